"""WebDataset shard sets: byte-exact round trips (faces packed into members, or a member per face), reproducible
tars, a deterministic and resumable stream split across ranks, RecordIO payloads kept as they are, and clear errors on
truncated shards and bad keys."""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np
import pytest
from PIL import Image

from ml.data.formats.recordio import RecordIOReader, write_recordio
from ml.data.shards import INDEX_FILE, ShardReader, export_folder, shard_recordio, write_shards
from ml.errors import DataError


def _items(n: int = 40, seed: int = 0) -> list[tuple[str, str, bytes]]:
    rng = np.random.default_rng(seed)
    return [(f"id{i % 7}/{i}", "png" if i % 3 else "jpg", rng.bytes(int(rng.integers(100, 3000)))) for i in range(n)]


def test_round_trip_across_several_shards_in_any_key_order_a_member_per_face(tmp_path):
    items = _items()
    index = write_shards(items, tmp_path / "s", max_bytes=16_000, pack_bytes=0)
    assert index["shard"].nunique() > 3 and (tmp_path / "s" / INDEX_FILE).is_file()
    reader = ShardReader(tmp_path / "s")
    order = np.random.default_rng(1).permutation(len(items))
    keys = [items[i][0] for i in order]
    assert reader.read_many(keys) == [items[i][2] for i in order]
    assert reader.read("id3/10") == items[10][2]
    # plain tar: any tool lists the members as WebDataset names them, and the index's offsets are tar's own
    for shard, part in index.groupby("shard"):
        with tarfile.open(tmp_path / "s" / shard) as tar:
            members = tar.getmembers()
        assert [m.name for m in members] == [f"{k}.{e}" for k, e in zip(part["key"], part["ext"])]
        assert [m.offset_data for m in members] == part["offset"].tolist()
    long_key = "a" * 150 + "/1"  # a GNU long-name header before the member: the offset still points at its bytes
    long_index = write_shards([(long_key, "png", b"long"), ("b/2", "png", b"short")], tmp_path / "long", pack_bytes=0)
    assert ShardReader(tmp_path / "long").read_many([long_key, "b/2"]) == [b"long", b"short"]
    assert long_index["offset"].iloc[1] > long_index["offset"].iloc[0] + 512


def test_packed_faces_read_alike_and_lie_inside_their_pack_members(tmp_path):
    items = _items(60) + [("big/0", "jpg", bytes(range(256)) * 40)]  # 10 kB: larger than a pack
    index = write_shards(items, tmp_path / "p", max_bytes=20_000, pack_bytes=5_000)
    loose = write_shards(items, tmp_path / "l", max_bytes=20_000, pack_bytes=0)
    reader = ShardReader(tmp_path / "p")
    order = np.random.default_rng(2).permutation(len(items))
    assert reader.read_many([items[i][0] for i in order]) == [items[i][2] for i in order]
    assert sorted(k for k, _ in reader.stream(seed=1, epoch=0)) == sorted(k for k, _, _ in items)
    assert index[["key", "ext", "size"]].equals(loose[["key", "ext", "size"]])
    packs = 0
    for shard, part in index.groupby("shard"):
        with tarfile.open(tmp_path / "p" / shard) as tar:
            members = tar.getmembers()
        assert all(m.name.startswith("pack-") and m.name.endswith(".faces") and m.size <= 10_240 for m in members)
        starts = np.array([m.offset_data for m in members])
        ends = starts + [m.size for m in members]
        inside = np.searchsorted(starts, part["offset"].to_numpy(), side="right") - 1  # the member each face is in
        assert (inside >= 0).all() and (part["offset"] + part["size"] <= ends[inside]).all()
        packs += len(members)
    assert packs <= len(items) / 2
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).glob("*.tar")) for d in ("p", "l")}
    assert size["l"] - size["p"] >= 512 * (len(items) - packs)  # a header (and padding) per pack, not per face
    again = write_shards(items, tmp_path / "p2", max_bytes=20_000, pack_bytes=5_000)
    assert again.equals(index) and all(
        (tmp_path / "p" / n).read_bytes() == (tmp_path / "p2" / n).read_bytes() for n in index["shard"].unique())
    with pytest.raises(DataError, match="pack_bytes -1"):
        write_shards(items, tmp_path / "bad", pack_bytes=-1)


def test_the_same_items_give_the_same_shard_bytes(tmp_path):
    write_shards(_items(), tmp_path / "a", max_bytes=16_000)
    write_shards(_items(), tmp_path / "b", max_bytes=16_000)
    digest = {d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / d).iterdir()}
              for d in ("a", "b")}
    assert digest["a"] == digest["b"]


def test_stream_covers_every_face_once_across_ranks_and_resumes_mid_epoch(tmp_path):
    items = _items(60)
    write_shards(items, tmp_path / "s", max_bytes=12_000)
    reader = ShardReader(tmp_path / "s")
    by_key = {k: d for k, _, d in items}
    ranks = [list(reader.stream(seed=3, epoch=0, rank=r, world=2)) for r in range(2)]
    keys = [k for part in ranks for k, _ in part]
    assert sorted(keys) == sorted(by_key) and all(by_key[k] == d for part in ranks for k, d in part)
    whole = [k for k, _ in reader.stream(seed=3, epoch=0)]
    assert whole == [k for k, _ in reader.stream(seed=3, epoch=0)]  # deterministic per (seed, epoch)
    assert whole != [k for k, _ in reader.stream(seed=3, epoch=1)]  # reshuffled per epoch
    assert [k for k, _ in reader.stream(seed=3, epoch=0, start=17)] == whole[17:]  # resumed after 17 faces
    with pytest.raises(DataError, match="rank 2"):
        next(reader.stream(seed=0, epoch=0, rank=2, world=2))


def test_a_truncated_shard_is_named_when_read_or_streamed(tmp_path):
    index = write_shards(_items(), tmp_path / "s", max_bytes=16_000)
    last = tmp_path / "s" / index["shard"].iloc[-1]
    last.write_bytes(last.read_bytes()[:1000])
    reader = ShardReader(tmp_path / "s")
    with pytest.raises(DataError, match=f"{last.name}.*truncated"):
        reader.read_many(index["key"].tolist())
    with pytest.raises(DataError, match=f"{last.name}.*truncated"):
        list(reader.stream(seed=0, epoch=0))


def test_a_stream_skips_a_bad_shard_up_to_its_threshold_and_names_it(tmp_path, caplog):
    items = _items(60)
    index = write_shards(items, tmp_path / "s", max_bytes=12_000)
    shards = sorted(index["shard"].unique())
    assert len(shards) >= 4
    bad, gone = tmp_path / "s" / shards[1], tmp_path / "s" / shards[2]
    bad.write_bytes(bad.read_bytes()[:1000])  # keeps its first face or none: every face past 1000 bytes is lost
    gone.unlink()
    per_shard = index.groupby("shard").size()
    readable = index[(index["shard"] != shards[2]) & ((index["shard"] != shards[1])
                                                      | (index["offset"] + index["size"] <= 1000))]
    lost = len(index) - len(readable)
    reader = ShardReader(tmp_path / "s")
    by_key = {k: d for k, _, d in items}
    with caplog.at_level("WARNING", logger="ml.data.shards"):
        got = list(reader.stream(seed=0, epoch=0, max_skipped_fraction=(lost + 1) / len(index)))
    assert sorted(k for k, _ in got) == sorted(readable["key"]) and all(by_key[k] == d for k, d in got)
    assert reader.skipped[shards[2]] == per_shard[shards[2]] and sum(reader.skipped.values()) == lost
    assert shards[2] in caplog.text and "missing" in caplog.text and "truncated at 1000 bytes" in caplog.text
    with pytest.raises(DataError, match="above max_skipped_fraction 0.1"):  # fewer allowed than lost: refused
        list(reader.stream(seed=0, epoch=0, max_skipped_fraction=0.1))
    with pytest.raises(DataError, match="restore them"):  # the default skips nothing
        list(reader.stream(seed=0, epoch=0))


def test_a_failing_store_is_retried_then_refused_with_one_error(tmp_path, monkeypatch):
    items = _items(20)
    write_shards(items, tmp_path / "s", max_bytes=12_000)
    reader = ShardReader(tmp_path / "s")
    real_open, calls = reader.fs.open, []

    def flaky(path, mode="rb", **kwargs):
        calls.append(path)
        if len(calls) <= 2:
            raise ConnectionResetError("connection reset by peer")
        return real_open(path, mode, **kwargs)

    monkeypatch.setattr(reader.fs, "open", flaky)  # fsspec caches the instance: patch it for this test only
    got = list(reader.stream(seed=0, epoch=0, backoff_s=0.0))
    assert sorted(k for k, _ in got) == sorted(k for k, _, _ in items) and calls[0] == calls[1] == calls[2]

    def down(path, mode="rb", **kwargs):
        raise TimeoutError("the store did not answer")

    monkeypatch.setattr(reader.fs, "open", down)
    with pytest.raises(DataError, match=r"unreadable after 3 tries \(TimeoutError"):
        list(reader.stream(seed=0, epoch=0, retries=2, backoff_s=0.0))
    with pytest.raises(DataError, match="max_skipped_fraction"):
        next(reader.stream(seed=0, epoch=0, max_skipped_fraction=1.0))


def test_bad_keys_and_a_missing_index_are_refused(tmp_path):
    with pytest.raises(DataError, match="no dot"):
        write_shards([("alice/3.5", "png", b"x")], tmp_path / "s")
    with pytest.raises(DataError, match="twice"):
        write_shards([("a/1", "png", b"x"), ("a/1", "png", b"y")], tmp_path / "t")
    assert not any((tmp_path / "t").iterdir())  # the shard written before the refusal is gone
    with pytest.raises(DataError, match="not a shard set"):
        ShardReader(tmp_path / "nothing")
    write_shards(_items(3), tmp_path / "u")
    with pytest.raises(DataError, match="'nope/1' is not in"):
        ShardReader(tmp_path / "u").read("nope/1")


def _faces(n: int, size: int = 16) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def test_recordio_payloads_are_sharded_as_they_are_over_two_workers(tmp_path):
    labels = np.arange(30) % 5
    write_recordio(tmp_path / "train.rec", _faces(30), labels)
    done = shard_recordio(tmp_path / "train.rec", tmp_path / "s", workers=2, max_bytes=4_000, size=16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s", "train.idx", "train.rec"]  # no temporary left
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if not p.name.endswith(".tar")) == [INDEX_FILE]
    index = ShardReader(tmp_path / "s").index
    assert (done.faces, done.identities, done.shards) == (30, 5, index["shard"].nunique())
    assert {name[:8] for name in index["shard"]} == {"faces-00", "faces-01"} and (index["ext"] == "jpg").all()
    reader, shards = RecordIOReader(tmp_path / "train.rec"), ShardReader(tmp_path / "s")
    for key, label, data in zip(index["key"], index["label"], shards.read_many(index["key"].tolist())):
        record = int(key.split("/")[1])
        header, payload = reader.read_record(record)
        assert data == payload and label == int(header.label) == int(key.split("/")[0])  # the JPEG, byte for byte
    assert sorted(index["label"]) == sorted(labels.tolist())


def test_recordio_faces_of_another_size_and_a_used_folder_are_refused_leaving_nothing(tmp_path):
    write_recordio(tmp_path / "train.rec", _faces(6), np.arange(6) % 2)
    with pytest.raises(DataError, match=r"\(16, 16\) \(width, height\), not 112x112"):
        shard_recordio(tmp_path / "train.rec", tmp_path / "s", workers=2, size=112)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.idx", "train.rec"]
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(DataError, match="not empty"):
        shard_recordio(tmp_path / "train.rec", tmp_path / "used")


def test_export_writes_each_face_as_a_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    import ml.data.shards

    monkeypatch.setattr(ml.data.shards, "_INDEX_BLOCK_ROWS", 3)  # the writer appends its index 3 rows at a time
    write_recordio(tmp_path / "train.rec", _faces(8), np.arange(8) % 2)
    shard_recordio(tmp_path / "train.rec", tmp_path / "s", workers=1)
    index = ShardReader(tmp_path / "s").index
    assert pq.ParquetFile(tmp_path / "s" / INDEX_FILE).metadata.num_rows == 8  # no row lost between blocks
    assert [int(k.split("/")[1]) for k in index["key"]] == sorted(RecordIOReader(tmp_path / "train.rec").image_keys)
    assert export_folder(tmp_path / "s", tmp_path / "look", limit=5) == 5
    files = sorted((tmp_path / "look").rglob("*.jpg"))
    assert len(files) == 5
    first = tmp_path / "look" / f"{index['key'].iloc[0]}.jpg"
    assert Image.open(io.BytesIO(first.read_bytes())).size == (16, 16)


def test_faceops_data_shard_and_export_from_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from faceops.cli import app

    write_recordio(tmp_path / "train.rec", _faces(12), np.arange(12) % 3)
    runner = CliRunner()
    result = runner.invoke(app, ["data", "shard", str(tmp_path / "train.rec"), str(tmp_path / "s"), "--workers", "2",
                                 "--size", "16"])
    assert result.exit_code == 0, result.output
    assert "12 faces of 3 identities in 2 shards" in result.output
    result = runner.invoke(app, ["data", "export", str(tmp_path / "s"), str(tmp_path / "look"), "--limit", "4"])
    assert result.exit_code == 0 and "4 faces" in result.output
    result = runner.invoke(app, ["data", "shard", str(tmp_path / "train.rec"), str(tmp_path / "s")])
    assert result.exit_code == 2 and "not empty" in result.output


def test_faceops_data_export_of_a_dataset_directory_writes_its_manifest_paths(tmp_path):
    from typer.testing import CliRunner

    from faceops.cli import app
    from ml.data.dataset import DatasetWriter, load_images, read_manifest

    rng = np.random.default_rng(0)
    with DatasetWriter(tmp_path / "ds", name="toy", source="real", aligned=True) as w:
        for i in range(6):
            w.add(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), identity=("ann", "bob")[i % 2])
    result = CliRunner().invoke(app, ["data", "export", str(tmp_path / "ds"), str(tmp_path / "look")])
    assert result.exit_code == 0 and "6 faces" in result.output, result.output
    manifest = read_manifest(tmp_path / "ds" / "manifest.parquet")
    written = [np.asarray(Image.open(tmp_path / "look" / p)) for p in manifest["path"]]
    np.testing.assert_array_equal(np.stack(written), load_images(tmp_path / "ds", manifest))


def test_read_and_stream_a_shard_set_from_s3(tmp_path, monkeypatch):
    """The same reader over an S3 URL (moto on loopback): random access by byte range and the epoch stream."""
    import boto3

    from tests.servers import moto_s3

    items = _items(30)
    index = write_shards(items, tmp_path / "s", max_bytes=12_000)
    with moto_s3() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        s3.create_bucket(Bucket="faces")
        for file in (tmp_path / "s").iterdir():
            s3.upload_file(str(file), "faces", f"casia/{file.name}")
        reader = ShardReader("s3://faces/casia")
        assert reader.read_many([items[7][0], items[2][0]]) == [items[7][2], items[2][2]]
        local = ShardReader(tmp_path / "s")
        assert list(reader.stream(seed=1, epoch=2, rank=1, world=2)) == list(local.stream(seed=1, epoch=2, rank=1,
                                                                                         world=2))
        assert len(reader) == len(index)
