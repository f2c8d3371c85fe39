"""Training faces streamed from shards (``ml.data.shard_stream``): every rank an equal, disjoint part of an order fixed by
(seed, epoch); workers read their own windows, each once; the loader hands out the workers' batches in turn and
resumes mid-epoch to the uninterrupted order; the same faces from an S3 store (moto on loopback); clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ml.data.formats import encode_image
from ml.data.shards import write_shards
from ml.data.shard_stream import ShardStream, StreamLoader, handed_out
from ml.errors import DataError

SIZE = 8


def _faces(n: int = 60, identities: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8), np.arange(n) % identities


@pytest.fixture()
def dataset(tmp_path):
    """60 random faces as PNGs (~250 bytes each) in small shards and packs: several windows per shard."""
    images, labels = _faces()
    keys = [f"id{label}/{i}" for i, label in enumerate(labels)]
    write_shards([(k, "png", encode_image(im, "png")) for k, im in zip(keys, images)], tmp_path / "shards",
                 max_bytes=6_000, pack_bytes=1_000)
    return tmp_path / "shards", keys, labels, images


def _stream(dataset, **kw) -> ShardStream:
    root, keys, labels, _ = dataset
    return ShardStream(root, keys, labels, image_size=SIZE, batch_size=kw.pop("batch_size", 4),
                       window_bytes=kw.pop("window_bytes", 1_500), **kw)


def _loader(stream: ShardStream, workers: int = 0, epoch: int = 0) -> StreamLoader:
    loader = StreamLoader(stream, **({"num_workers": workers, "multiprocessing_context": "forkserver"}
                                     if workers else {}))
    loader.set_epoch(epoch)
    return loader


def _ids(batch) -> list[int]:
    """A batch as the list of its faces' labels × 10⁶ + the sum of their pixels (an identity for a face)."""
    return (batch[1] * 10**6 + batch[0].sum(dim=(1, 2, 3))).tolist()


def _batches(loader) -> list[list[int]]:
    return [_ids(b) for b in loader]


def _face_ids(images: np.ndarray, labels: np.ndarray) -> list[int]:
    return (labels * 10**6 + images.astype(np.int64).sum(axis=(1, 2, 3))).tolist()


def test_ranks_get_equal_disjoint_parts_of_an_order_fixed_by_seed_and_epoch(dataset):
    stream = _stream(dataset)
    assert stream.batches_per_rank(2) == 7 and len(stream.windows) > len(stream.shard_names) > 2
    order = stream.order(0)
    assert sorted(order.tolist()) == list(range(60))
    assert np.array_equal(order, stream.order(0)) and not np.array_equal(order, stream.order(1))
    # a window's faces stay together: the stream never comes back to a window it left
    windows = stream.window_of[order]
    assert len(np.flatnonzero(np.diff(windows))) == len(stream.windows) - 1
    ranks = [np.concatenate(stream.worker_batches(0, r, 2, 0, 1)) for r in range(2)]
    assert [len(r) for r in ranks] == [28, 28] and not set(ranks[0]) & set(ranks[1])
    by_worker = [np.concatenate(stream.worker_batches(0, 1, 2, w, 3)) for w in range(3)]
    assert np.array_equal(np.concatenate(by_worker), ranks[1])  # workers: contiguous parts of the rank's batches


def test_items_are_the_faces_and_labels_and_each_window_is_read_once(dataset, monkeypatch):
    root, keys, labels, images = dataset
    stream = _stream(dataset)
    reads: list[tuple[str, int, int]] = []
    fs = stream._filesystem()
    real = fs.cat_file
    monkeypatch.setattr(fs, "cat_file", lambda path, start, end: reads.append((path, start, end))
                        or real(path, start, end))
    got = _batches(_loader(stream))
    assert len(got) == 15 and all(len(b) == 4 for b in got)
    assert sorted(x for b in got for x in b) == sorted(_face_ids(images, labels))
    assert len(reads) == len(stream.windows) == len(set(reads))


def test_two_workers_hand_out_their_batches_in_turn_and_resume_mid_epoch(dataset):
    stream = _stream(dataset, seed=3)
    with_workers = _batches(_loader(stream, 2))
    alone = _batches(_loader(stream))
    assert sorted(map(sorted, with_workers)) == sorted(map(sorted, alone))  # the same batches
    first, second = alone[:8], alone[8:]  # worker 0 serves batches 0-7, worker 1 batches 8-14
    assert with_workers == [b for pair in zip(first, second) for b in pair] + first[7:]
    loader = _loader(stream, 2)
    it = iter(loader)
    seen = [_ids(next(it)) for _ in range(5)]
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches": 5} and seen == with_workers[:5]
    resumed = _loader(_stream(dataset, seed=3), 2)
    resumed.load_state_dict(state)
    assert _batches(resumed) == with_workers[5:]
    resumed.load_state_dict({"epoch": 0, "batches": 15})  # saved at the epoch's end: the next epoch, from its start
    assert resumed.state_dict() == {"epoch": 1, "batches": 0}
    next_epoch = _batches(resumed)
    assert next_epoch == _batches(_loader(_stream(dataset, seed=3), 2, epoch=1)) != with_workers


def test_handed_out_passes_over_exhausted_workers():
    assert handed_out([3, 1], 3) == [2, 1]
    assert handed_out([3, 1], 4) == [3, 1]
    assert handed_out([2, 2, 1], 5) == [2, 2, 1]
    with pytest.raises(DataError, match="only 4"):
        handed_out([3, 1], 5)


def test_the_same_stream_from_an_s3_store(dataset, monkeypatch):
    import boto3

    from tests.servers import moto_s3

    root, keys, labels, _ = dataset
    local = _batches(_loader(_stream(dataset, seed=1)))
    with moto_s3() as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        s3.create_bucket(Bucket="faces")
        for file in root.iterdir():
            s3.upload_file(str(file), "faces", f"toy/shards/{file.name}")
        assert len(list(root.iterdir())) > 3
        options = {"endpoint_url": env["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
        remote = ShardStream("s3://faces/toy/shards", keys, labels, image_size=SIZE, batch_size=4, seed=1,
                             window_bytes=1_500, storage_options=options)
        assert _batches(_loader(remote, 2)) == _batches(_loader(_stream(dataset, seed=1), 2))
        assert _batches(_loader(remote)) == local


def test_bad_shards_keys_and_sizes_are_refused_naming_them(dataset):
    root, keys, labels, _ = dataset
    with pytest.raises(DataError, match="'nobody/0' is not in its index"):
        ShardStream(root, ["nobody/0"], labels[:1], image_size=SIZE)
    with pytest.raises(DataError, match="2 faces for 1 labels"):
        ShardStream(root, keys[:2], labels[:1], image_size=SIZE)
    with pytest.raises(DataError, match=r"face is 8x8, not 16x16"):
        list(StreamLoader(ShardStream(root, keys, labels, image_size=16, batch_size=4)))
    with pytest.raises(DataError, match="cannot be persistent"):
        StreamLoader(_stream(dataset), num_workers=1, persistent_workers=True)
    stream = _stream(dataset)
    shard = root / stream.shard_names[-1]
    shard.write_bytes(shard.read_bytes()[:700])
    with pytest.raises(DataError, match=f"{shard.name}: needs bytes .* the shard is truncated"):
        list(StreamLoader(stream))
    shard.unlink()
    with pytest.raises(DataError, match=f"{shard.name}: the shard is missing"):
        list(StreamLoader(stream))


def test_train_fr_streams_only_a_copy_of_its_own_dataset(tmp_path):
    """``fr.stream_from``: the copy's ``dataset.json`` must carry the local dataset's digest; one dataset only."""
    import shutil

    from ml.data.dataset import DatasetWriter, read_manifest
    from ml.errors import ConfigError
    from tasks.train_fr import streamed_faces

    images, labels = _faces(12, 3)
    for name, flip in (("train", False), ("other", True)):
        with DatasetWriter(tmp_path / name, name=name, source="procedural", aligned=True) as w:
            for image, label in zip(images, labels):
                w.add(image[::-1] if flip else image, identity=f"id{label}")
    shutil.copytree(tmp_path / "train", tmp_path / "store" / "train")
    rows = read_manifest(tmp_path / "train" / "manifest.parquet")
    parts = [(tmp_path / "train", rows)]
    data = SimpleNamespace(image_size=SIZE)  # the only data.* key it reads (DataConfig refuses 8-px faces)
    stream = streamed_faces(str(tmp_path / "store" / "train"), parts, data, "real")
    got = _batches(_loader(stream.training(4, 0, None)))
    assert sorted(x for b in got for x in b) == sorted(_face_ids(images[rows.index], rows["label"].to_numpy()))
    with pytest.raises(DataError, match=r"holds dataset digest .* copy the dataset there again"):
        streamed_faces(str(tmp_path / "other"), parts, data, "real")
    with pytest.raises(DataError, match=r"nowhere/dataset.json not found; copy the dataset directory"):
        streamed_faces(str(tmp_path / "nowhere"), parts, data, "real")
    with pytest.raises(ConfigError, match="streams one dataset, but train_fr@mixed trains on 2"):
        streamed_faces(str(tmp_path / "store" / "train"), parts * 2, data, "mixed")


def test_a_store_that_fails_is_retried_then_refused_and_a_corrupt_face_is_named(dataset, monkeypatch):
    root, keys, labels, _ = dataset
    stream = _stream(dataset, backoff_s=0.0)
    fs = stream._filesystem()
    real, calls = fs.cat_file, []

    def flaky(path, start, end):
        calls.append(path)
        if len(calls) <= 2:
            raise ConnectionResetError("connection reset by peer")
        return real(path, start, end)

    monkeypatch.setattr(fs, "cat_file", flaky)
    assert len(_batches(_loader(stream))) == 15 and calls[0] == calls[1] == calls[2]

    def down(path, start, end):
        raise TimeoutError("the store did not answer")

    monkeypatch.setattr(fs, "cat_file", down)
    with pytest.raises(DataError, match=r"unreadable after 4 tries \(TimeoutError"):
        list(StreamLoader(stream))
    monkeypatch.setattr(fs, "cat_file", real)
    first = stream.windows[0][0]  # a face's bytes overwritten inside its pack: named by shard and byte offset
    shard = root / stream.shard_names[stream.shard[first]]
    data = bytearray(shard.read_bytes())
    data[stream.offset[first]:stream.offset[first] + stream.size[first]] = bytes(int(stream.size[first]))
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{shard.name} at byte {stream.offset[first]}: cannot decode"):
        list(StreamLoader(stream))
