"""The dataset directory contract: writer, manifest I/O, image loading, digest."""

from __future__ import annotations

import json
import shutil
import tarfile

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ml.data.dataset import (
    MANIFEST_COLUMNS,
    DatasetWriter,
    dataset_digest,
    landmarks_array,
    load_images,
    read_dataset_info,
    read_manifest,
    validate_manifest_columns,
    write_manifest,
)
from ml.data.formats import decode_image, encode_image
from ml.data.shards import ShardReader
from ml.errors import DataError

LANDMARKS = np.array([[38.3, 51.7], [73.5, 51.5], [56.0, 71.7], [41.5, 92.4], [70.7, 92.2]], dtype=np.float32)


def _img(seed: int, h: int = 12, w: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _members(out) -> list[str]:
    with tarfile.open(out / "shards" / "faces-000000.tar") as tar:
        return tar.getnames()


def _keys(out) -> list[str]:
    return pd.read_parquet(out / "shards" / "index.parquet")["key"].tolist()


def _write(out, *, tweak_pixel: bool = False, generator=None):
    """Five images of three identities added out of sorted order."""
    with DatasetWriter(out, name="toy", source="procedural", aligned=True, generator=generator) as w:
        for i, ident in enumerate(["zoe", "adam", "mia", "adam", "zoe"]):
            img = _img(i)
            if tweak_pixel and i == 3:
                img[0, 0, 0] ^= 1
            w.add(img, identity=ident, split="test" if i == 4 else "train",
                  landmarks=LANDMARKS if i % 2 == 0 else None, quality=0.25 * i if i else None,
                  template=i if i >= 3 else None, media=7 if i == 3 else None)
    return out


def test_writer_layout_labels_and_dtypes(tmp_path):
    out = _write(tmp_path / "ds")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp dir left
    assert sorted(p.name for p in out.iterdir()) == ["dataset.json", "manifest.parquet", "shards"]
    m = read_manifest(out / "manifest.parquet")
    assert tuple(m.columns) == MANIFEST_COLUMNS
    assert m["path"].tolist() == ["images/zoe/0.png", "images/adam/0.png", "images/mia/0.png",
                                  "images/adam/1.png", "images/zoe/1.png"]
    # the images are packed into one tar, indexed by their manifest paths, in the order they were added
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["faces-000000.tar", "index.parquet"]
    assert _members(out) == ["pack-00000000.faces"]
    index = pd.read_parquet(out / "shards" / "index.parquet")
    assert index["key"].tolist() == [p[:-len(".png")] for p in m["path"]] and set(index["ext"]) == {"png"}
    # labels contiguous 0..K-1 by sorted identity
    assert m["label"].tolist() == [2, 0, 1, 0, 2]
    assert m["label"].dtype == np.int64 and m["width"].dtype == np.int64 and m["height"].dtype == np.int64
    assert m["quality"].dtype == np.float64 and np.isnan(m["quality"][0]) and m["quality"][4] == 1.0
    assert str(m["template"].dtype) == "Int64" and m["template"].isna().tolist() == [True, True, True, False, False]
    assert m["media"].tolist()[3] == 7
    assert m["source"].unique().tolist() == ["procedural"]
    assert m["split"].tolist() == ["train"] * 4 + ["test"]
    assert (m["width"] == 10).all() and (m["height"] == 12).all()
    assert m["landmarks"][1] is None
    assert m["landmarks"][0].dtype == np.float32 and np.array_equal(m["landmarks"][0], LANDMARKS.reshape(-1))
    # on-disk types are the contract's
    schema = pq.read_schema(out / "manifest.parquet")
    assert schema.field("landmarks").type == pa.list_(pa.float32())
    assert schema.field("template").type == pa.int64() and schema.field("label").type == pa.int64()


def test_writer_images_round_trip(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    images = load_images(out, m, expected_size=(12, 10))
    assert images.shape == (5, 12, 10, 3) and images.dtype == np.uint8
    for i in range(5):
        assert np.array_equal(images[i], _img(i))
    lm = landmarks_array(m)
    assert lm.shape == (5, 5, 2) and lm.dtype == np.float32
    assert np.array_equal(lm[0], LANDMARKS) and np.isnan(lm[1]).all()


def test_dataset_json(tmp_path):
    out = _write(tmp_path / "ds", generator={"seed": 3, "kind": "procedural"})
    info = read_dataset_info(out)
    assert info == json.loads((out / "dataset.json").read_text())
    assert info["name"] == "toy" and info["source"] == "procedural" and info["aligned"] is True
    assert info["image_size"] == [12, 10]
    assert info["identity_count"] == 3 and info["image_count"] == 5
    assert info["splits"] == {"test": 1, "train": 4}
    assert info["generator"] == {"seed": 3, "kind": "procedural"}
    assert info["created_by"] == "faceops"
    assert len(info["digest"]) == 64 and info["digest"] == dataset_digest(out)


def test_image_size_null_when_mixed(tmp_path):
    with DatasetWriter(tmp_path / "mixed", name="m", source="real", aligned=False) as w:
        w.add(_img(0, 8, 8), identity="a")
        w.add(_img(1, 9, 8), identity="b")
    assert read_dataset_info(tmp_path / "mixed")["image_size"] is None


def test_digest_stable_and_sensitive(tmp_path):
    a = read_dataset_info(_write(tmp_path / "a"))["digest"]
    b = read_dataset_info(_write(tmp_path / "b"))["digest"]
    c = read_dataset_info(_write(tmp_path / "c", tweak_pixel=True))["digest"]
    assert a == b
    assert c != a
    # an annotation change alone also changes it
    m = read_manifest(tmp_path / "b" / "manifest.parquet")
    m.loc[0, "split"] = "val"
    write_manifest(m, tmp_path / "b" / "manifest.parquet")
    assert dataset_digest(tmp_path / "b") != a


def test_writer_streams_the_manifest_in_row_groups_with_the_same_rows(tmp_path, monkeypatch):
    """Closing writes the manifest a row group at a time (memory holds one group): split into groups of 2, the rows,
    landmarks across group borders included, and the digest are the single-group file's."""
    import ml.data.dataset as dataset

    whole = read_manifest(_write(tmp_path / "whole") / "manifest.parquet")
    monkeypatch.setattr(dataset, "_ROW_GROUP", 2)
    out = _write(tmp_path / "groups")
    meta = pq.ParquetFile(out / "manifest.parquet").metadata
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == [2, 2, 1]
    pd.testing.assert_frame_equal(read_manifest(out / "manifest.parquet").drop(columns="landmarks"),
                                  whole.drop(columns="landmarks"))
    groups = read_manifest(out / "manifest.parquet")["landmarks"]
    assert [None if v is None else v.tolist() for v in groups] == [None if v is None else v.tolist() for v in
                                                                   whole["landmarks"]]
    assert read_dataset_info(out)["digest"] == read_dataset_info(tmp_path / "whole")["digest"] == dataset_digest(out)
    assert sorted(p.name for p in out.iterdir()) == ["dataset.json", "manifest.parquet", "shards"]  # rows not kept
    pd.testing.assert_frame_equal(pd.read_parquet(out / "shards" / "index.parquet"),
                                  pd.read_parquet(tmp_path / "whole" / "shards" / "index.parquet"))


def test_writer_digest_sorts_like_the_paths(tmp_path):
    """The writer digests its rows in path order without building the paths: identities that prefix one another
    ("a", "a.b", "a b", "ab") and file numbers past 9 ("10.png" < "2.png") must sort as the strings do."""
    identities = ["ab", "a", "a.b", "a b", "é", "A", "a-"]
    with DatasetWriter(tmp_path / "ds", name="order", source="real", aligned=False) as w:
        for i in range(12 * len(identities)):
            w.add(_img(i), identity=identities[(i * 3) % len(identities)], split=("train", "val")[i % 2],
                  landmarks=LANDMARKS + i if i % 3 else None, template=i if i % 4 else None)
    assert read_dataset_info(tmp_path / "ds")["digest"] == dataset_digest(tmp_path / "ds")


def test_exception_inside_with_leaves_nothing(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter(out, name="x", source="real", aligned=False) as w:
            w.add(_img(0), identity="a")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_exception_keeps_existing_dataset_and_close_replaces_it(tmp_path):
    out = _write(tmp_path / "ds")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(RuntimeError):
        with DatasetWriter(out, name="x", source="real", aligned=False) as w:
            w.add(_img(9), identity="other")
            raise RuntimeError("boom")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    # a clean close replaces the old dataset entirely
    with DatasetWriter(out, name="new", source="real", aligned=False) as w:
        w.add(_img(9), identity="other")
    assert read_dataset_info(out)["name"] == "new"
    assert _keys(out) == ["images/other/0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_writer_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "precious.txt").write_text("keep")
    with pytest.raises(DataError, match="not a faceops dataset"):
        DatasetWriter(tmp_path / "home", name="x", source="real", aligned=False)
    assert (tmp_path / "home" / "precious.txt").read_text() == "keep"


def test_writer_input_checks(tmp_path):
    with pytest.raises(DataError, match="source 'web'"):
        DatasetWriter(tmp_path / "ds", name="x", source="web", aligned=False)
    with DatasetWriter(tmp_path / "ds", name="x", source="real", aligned=False) as w:
        with pytest.raises(DataError, match="uint8"):
            w.add(_img(0).astype(np.float32), identity="a")
        with pytest.raises(DataError, match="identity 'a/b'"):
            w.add(_img(0), identity="a/b")
        with pytest.raises(DataError, match="landmarks has 4 values"):
            w.add(_img(0), identity="a", landmarks=[1, 2, 3, 4])
        with pytest.raises(DataError, match="quality 1.5"):
            w.add(_img(0), identity="a", quality=1.5)
        with pytest.raises(DataError, match="identity 'a', image 0: encoded bytes are neither a JPEG nor a PNG"):
            w.add(_img(0), identity="a", encoded=b"BM" + bytes(60))
        w.add(_img(0), identity="a")
        jpeg = encode_image(_img(1), "jpg")
        w.add(decode_image(jpeg, source="test"), identity="a", encoded=jpeg)  # kept as it is, under .jpg
    m = read_manifest(tmp_path / "ds" / "manifest.parquet")
    assert m["path"].tolist() == ["images/a/0.png", "images/a/1.jpg"]
    index = pd.read_parquet(tmp_path / "ds" / "shards" / "index.parquet")
    assert index["ext"].tolist() == ["png", "jpg"] and index["key"].tolist() == ["images/a/0", "images/a/1"]
    assert ShardReader(tmp_path / "ds" / "shards").read("images/a/1") == jpeg
    assert read_dataset_info(tmp_path / "ds")["digest"] == dataset_digest(tmp_path / "ds")


def test_empty_writer_raises_and_cleans_up(tmp_path):
    with pytest.raises(DataError, match="no images"):
        with DatasetWriter(tmp_path / "ds", name="x", source="real", aligned=False):
            pass
    assert list(tmp_path.iterdir()) == []


def test_read_manifest_missing_column(tmp_path):
    out = _write(tmp_path / "ds")
    path = out / "manifest.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["quality", "media"]), path)
    with pytest.raises(DataError, match=r"manifest\.parquet.*'quality', 'media'"):
        read_manifest(path)
    with pytest.raises(DataError, match="my-source.*'label'"):
        validate_manifest_columns(pd.DataFrame({c: [] for c in MANIFEST_COLUMNS if c != "label"}), "my-source")


def test_read_manifest_unreadable_and_missing(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_manifest(tmp_path / "none.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet.*cannot read"):
        read_manifest(tmp_path / "bad.parquet")


def test_read_dataset_info_errors(tmp_path):
    with pytest.raises(DataError, match="dataset.json not found"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text("{broken")
    with pytest.raises(DataError, match="invalid JSON"):
        read_dataset_info(tmp_path)
    (tmp_path / "dataset.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(DataError, match="'digest'"):
        read_dataset_info(tmp_path)


def test_load_images_wrong_size_names_file(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    with pytest.raises(DataError, match=r"images/zoe/0\.png \(manifest row 0\).*expected 16x16"):
        load_images(out, m, expected_size=(16, 16))


def _overwrite_member(out, path: str, data: bytes) -> None:
    """Replace the bytes of ``path``'s shard member in place (same length), as a corrupted disk would."""
    row = pd.read_parquet(out / "shards" / "index.parquet").set_index("key").loc[path[:-len(".png")]]
    assert len(data) == row["size"]
    with open(out / "shards" / row["shard"], "r+b") as f:
        f.seek(int(row["offset"]))
        f.write(data)


def test_load_images_corrupt_or_missing_face_names_it(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    index_file = out / "shards" / "index.parquet"
    index = pd.read_parquet(index_file)
    size = int(index.loc[index["key"] == "images/mia/0", "size"].iloc[0])
    _overwrite_member(out, "images/mia/0.png", b"\x89PNG" + b"\0" * (size - 4))
    with pytest.raises(DataError, match=r"images/mia/0\.png \(manifest row 2\).*cannot decode"):
        load_images(out, m)
    index[index["key"] != "images/mia/0"].to_parquet(index_file, index=False)
    with pytest.raises(DataError, match=r"images/mia/0\.png \(manifest row 2\).*missing from .*shards"):
        load_images(out, m)
    with pytest.raises(DataError, match=r"images/mia/0\.png.*missing"):
        dataset_digest(out)


def test_load_images_truncated_or_lost_shard_names_it(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    tar = out / "shards" / "faces-000000.tar"
    tar.write_bytes(tar.read_bytes()[:2000])
    with pytest.raises(DataError, match=r"faces-000000\.tar: 'images/.*' needs \d+ bytes.*truncated"):
        load_images(out, m)
    tar.unlink()
    with pytest.raises(DataError, match=r"faces-000000\.tar: the shard is missing; restore it"):
        load_images(out, m)


def test_load_images_refuses_the_loose_file_layout(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    shutil.rmtree(out / "shards")
    with pytest.raises(DataError, match=r"index\.parquet: not found; .*not a complete faceops dataset"):
        load_images(out, m)
    (out / "images" / "zoe").mkdir(parents=True)
    with pytest.raises(DataError, match=r"loose files, the layout before shards; rebuild"):
        load_images(out, m)


def test_load_images_replaced_shards_disagree_with_manifest(tmp_path):
    out = _write(tmp_path / "ds")
    m = read_manifest(out / "manifest.parquet")
    with DatasetWriter(tmp_path / "small", name="toy", source="procedural", aligned=True) as w:
        for i, ident in enumerate(["zoe", "adam", "mia", "adam", "zoe"]):
            w.add(_img(i, 6, 6), identity=ident)
    shutil.rmtree(out / "shards")
    shutil.copytree(tmp_path / "small" / "shards", out / "shards")
    with pytest.raises(DataError, match=r"zoe/0\.png \(manifest row 0\).*manifest says 12x10"):
        load_images(out, m)
