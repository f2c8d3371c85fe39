"""Ingested RecordIO faces read in place: a RecordIO-backed Dataset decoded in DataLoader workers gives the pixels
and labels of the prepared PNG copies; a RecordIO that changed after ingest is refused naming the file/record."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pyarrow.parquet as pq
import pytest

from ml.data.dataset import load_images, read_manifest
from ml.data.formats import encode_image, ingest_image_folder, write_recordio
from ml.data.records import (
    RECORDS_FILE,
    ShardDataset,
    RecordIODataset,
    RecordsWriter,
    decode_all,
    has_records,
    recordio_dataset,
)
from ml.errors import ConfigError, DataError
from tasks.common import Paths
from tasks.prepare import DataConfig
from tasks.prepare import run as prepare

from tests.stages.test_ingest import TINY, _faces

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ingested(tmp_path_factory):
    """40 faces of 8 people at 80 px as JPEG records (resized to 64 px by ingest), prepared."""
    root = tmp_path_factory.mktemp("ws")
    images, labels = _faces(8, 5, size=80)
    rec = root / "in" / "train.rec"
    write_recordio(rec, [encode_image(im, "jpg", quality=90) for im in images], labels)
    cfg = dataclasses.replace(TINY, ingest_recordio=str(rec))
    prepare(cfg, Paths(root), workers=1)
    return cfg, Paths(root), rec


def test_recordio_read_in_place_with_workers_equals_the_png_folder(ingested):
    cfg, paths, _ = ingested
    for d in (paths.train_set, paths.heldout_set, paths.discovery_set):
        assert has_records(d)
        rows = read_manifest(d / "manifest.parquet")
        shard_images, shard_labels = decode_all(ShardDataset(d, rows), num_workers=2, batch_size=7)
        rec_images, rec_labels = decode_all(recordio_dataset(d, rows, image_size=64), num_workers=2, batch_size=7)
        assert rec_images.shape == (len(rows), 64, 64, 3) and rec_images.dtype == np.uint8
        np.testing.assert_array_equal(rec_images, shard_images)  # PNG is lossless: the very pixels ingest wrote
        np.testing.assert_array_equal(rec_labels, shard_labels)
        np.testing.assert_array_equal(rec_labels, rows["label"].to_numpy())
        np.testing.assert_array_equal(shard_images, load_images(d, rows))


def test_dataset_pickles_after_use_and_reopens_per_process(ingested):
    _, paths, _ = ingested
    rows = read_manifest(paths.train_set / "manifest.parquet")
    ds = recordio_dataset(paths.train_set, rows, image_size=64)
    first, label = ds[3]
    assert ds._reader is not None  # opened lazily by the first read
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._reader is None  # nothing open travels to a worker
    again, label_again = clone[3]
    assert label_again == label and bool((again == first).all()) and tuple(first.shape) == (64, 64, 3)


def test_train_fr_reads_in_place_by_default_for_recordio_ingest(ingested, monkeypatch):
    import tasks.train_fr as train_fr

    cfg, paths, _ = ingested
    rows = read_manifest(paths.train_set / "manifest.parquet")
    monkeypatch.setattr(train_fr, "READER_MIN_IMAGES", 1)  # use the workers even for these few faces
    read = {reader: train_fr.load_rows(paths.train_set, rows, dataclasses.replace(cfg, train_reader=reader))
            for reader in ("auto", "recordio", "png")}
    np.testing.assert_array_equal(read["auto"], read["png"])
    np.testing.assert_array_equal(read["recordio"], read["png"])
    with pytest.raises(ConfigError, match="data.train_reader"):
        dataclasses.replace(cfg, train_reader="lmdb")


def test_a_recordio_changed_after_ingest_is_refused_naming_the_record(ingested, tmp_path):
    import shutil

    _, paths, rec = ingested
    rows = read_manifest(paths.train_set / "manifest.parquet")
    ds = recordio_dataset(paths.train_set, rows, image_size=64)
    key = int(ds.keys[0])
    copy = tmp_path / "train.rec"
    shutil.copy(rec, copy)
    shutil.copy(rec.with_suffix(".idx"), copy.with_suffix(".idx"))
    offset = int(dict(line.split("\t") for line in copy.with_suffix(".idx").read_text().splitlines())[str(key)])
    raw = bytearray(copy.read_bytes())
    raw[offset + 8 + 24 + 20: offset + 8 + 24 + 220] = b"\x00" * 200  # the JPEG after its header: garbage, same size
    copy.write_bytes(bytes(raw))
    broken = RecordIODataset(copy, ds.keys, ds.labels, image_size=64)
    with pytest.raises(DataError, match=rf"train.rec: record {key}: cannot decode.*RecordIO changed since"):
        decode_all(broken, num_workers=0)
    # the file the dataset was ingested from changed size, or is gone
    original = rec.read_bytes()
    try:
        rec.write_bytes(original + b"\x00")
        with pytest.raises(DataError, match="bytes, but .* when it was ingested"):
            recordio_dataset(paths.train_set, rows, image_size=64)
        rec.unlink()
        with pytest.raises(DataError, match="is gone"):
            recordio_dataset(paths.train_set, rows, image_size=64)
    finally:
        rec.write_bytes(original)


def test_folder_ingest_has_no_records_and_train_reader_recordio_says_so(tmp_path):
    import tasks.train_fr as train_fr
    from PIL import Image

    images, labels = _faces(8, 4)
    for i, (im, label) in enumerate(zip(images, labels)):
        (tmp_path / "faces" / f"p{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(tmp_path / "faces" / f"p{label}" / f"{i}.png")
    cfg = dataclasses.replace(TINY, ingest_folder=str(tmp_path / "faces"), train_reader="recordio")
    paths = Paths(tmp_path / "ws")
    prepare(cfg, paths, workers=1)
    assert not has_records(paths.train_set)
    rows = read_manifest(paths.train_set / "manifest.parquet")
    with pytest.raises(DataError, match="not ingested from a RecordIO"):
        train_fr.load_rows(paths.train_set, rows, cfg)


def test_real_faces_read_in_place_equal_their_png_copies(glint24, tmp_path):
    items, seen = [], {}
    for path, identity in ingest_image_folder(glint24):  # 8 faces of each of the 24 people
        seen[identity] = seen.get(identity, 0) + 1
        if seen[identity] <= 8:
            items.append((path, identity))
    names = sorted({identity for _, identity in items})
    rec = tmp_path / "glint.rec"
    write_recordio(rec, [path.read_bytes() for path, _ in items], [names.index(i) for _, i in items])
    paths = Paths(tmp_path / "ws")
    prepare(DataConfig(**{**dataclasses.asdict(TINY), "ingest_recordio": str(rec), "verification_pairs": 100}),
            paths, workers=1)
    rows = read_manifest(paths.train_set / "manifest.parquet")
    got, got_labels = decode_all(recordio_dataset(paths.train_set, rows, image_size=64), num_workers=2)
    np.testing.assert_array_equal(got, load_images(paths.train_set, rows))  # 112 px JPEGs → 64 px, as ingest did
    np.testing.assert_array_equal(got_labels, rows["label"].to_numpy())


def test_records_writer_streams_row_groups_and_leaves_nothing_when_aborted(tmp_path):
    rec = tmp_path / "r.rec"
    write_recordio(rec, [encode_image(np.zeros((8, 8, 3), np.uint8), "jpg")] * 3, [0, 1, 2])
    writer = RecordsWriter(tmp_path, rec, rows_per_group=4)
    for i in range(10):
        writer.add(f"images/a/{i}.png", i + 1)
    assert not (tmp_path / RECORDS_FILE).exists()  # only the hidden temporary until close
    writer.close()
    meta = pq.ParquetFile(tmp_path / RECORDS_FILE).metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [4, 4, 2]
    table = pq.read_table(tmp_path / RECORDS_FILE)
    assert table.column("record").to_pylist() == list(range(1, 11))
    assert table.column("path").to_pylist()[-1] == "images/a/9.png"
    writer.abort()  # after close: a no-op
    assert (tmp_path / RECORDS_FILE).is_file()

    other = tmp_path / "other"
    other.mkdir()
    aborted = RecordsWriter(other, rec, rows_per_group=4)
    for i in range(6):
        aborted.add(f"images/a/{i}.png", i)
    aborted.abort()
    assert list(other.iterdir()) == []
    with pytest.raises(DataError, match=r"gone\.rec: RecordIO file not found"):
        RecordsWriter(other, tmp_path / "gone.rec")
    assert list(other.iterdir()) == []
