"""The faceops dataset directory (docs/data.md); its manifest's schema, checks and writers are ``ml.data.manifest``.

A dataset directory holds::

    shards/faces-NNNNNN.tar     the images as RGB uint8 PNGs in WebDataset tars (``ml.data.shards``), one member
                                ``images/<identity>/<n>.png`` per image (its manifest ``path``), n counting from 0
                                within each identity; a few files for any number of images. An ingested JPEG
                                face that needed no resize keeps its bytes: ``images/<identity>/<n>.jpg``
    shards/index.parquet        where each image's bytes lie in the shards
    manifest.parquet            one row per image, columns MANIFEST_COLUMNS
    dataset.json                name, source, image size, counts, generator, content digest
    records.parquet             faces ingested from a RecordIO only: the record each image came from

:class:`DatasetWriter` builds the directory under ``.<out>.<pid>.tmp`` and moves it onto ``<out>`` only when
closed without error, so readers never see a half-written dataset. The content digest is the sha256 over one
canonical JSON line per image, sorted by path: ``[path, sha256(image bytes), identity, label, split, source,
landmarks, quality, template, media, width, height]``. It changes when any pixel, label or annotation changes,
not when rows are reordered; ``records.parquet`` is outside it. The contract in full: ``docs/data.md``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ml.atomic import remove_dead_temporaries
from ml.data import shards as _shards
from ml.data.digest import digest_line, manifest_digest
from ml.data.formats import decode_image, encode_image, encoded_format
from ml.data.manifest import (
    MANIFEST_COLUMNS,
    NUM_LANDMARKS,
    SCHEMA,
    landmark_values,
    read_manifest,
    validate_manifest_columns,
    write_manifest,
    write_parquet_batches,
)
from ml.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "DATASET_INFO_KEYS",
    "MANIFEST_COLUMNS",
    "SOURCES",
    "DatasetWriter",
    "dataset_digest",
    "landmarks_array",
    "load_images",
    "read_dataset_info",
    "read_manifest",
    "shard_places",
    "validate_manifest_columns",
    "write_manifest",
]

SOURCES = ("procedural", "real", "synthetic")
DATASET_INFO_KEYS: tuple[str, ...] = (
    "name", "source", "image_size", "aligned", "identity_count", "image_count", "splits", "generator", "digest",
    "created_by",
)
MANIFEST_FILE = "manifest.parquet"
INFO_FILE = "dataset.json"
IMAGES_DIR = "images"  # the first part of every image's path (and shard member name)
SHARDS_DIR = "shards"
_READ_BLOCK = 2048  # images whose encoded bytes are in memory at once while reading
_HAS_LANDMARKS, _HAS_TEMPLATE, _HAS_MEDIA = 1, 2, 4  # DatasetWriter's per-image bits: which nullable cells are set
_JPEG = 8  # and whether the image's bytes are a JPEG (kept as given) rather than a PNG
_ROW_GROUP = 16_384  # manifest rows per Parquet row group as DatasetWriter writes them (memory holds one group)


def read_dataset_info(dataset_dir: str | os.PathLike) -> dict:
    """Read ``dataset.json`` of a dataset directory."""
    path = Path(dataset_dir) / INFO_FILE
    if not path.is_file():
        raise DataError(f"{path}: dataset.json not found; {dataset_dir} is not a complete faceops dataset, "
                        "rebuild it with the prepare stage")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: invalid JSON ({exc}); rebuild the dataset") from exc
    if not isinstance(info, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(info).__name__}; rebuild the dataset")
    missing = [k for k in DATASET_INFO_KEYS if k not in info]
    if missing:
        raise DataError(f"{path}: missing key(s) {', '.join(repr(k) for k in missing)}; rebuild the dataset")
    return info


# Images and landmarks ------------------------------------------------------------------------------


def _progress(items: Iterable | None, total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar over ``items`` (a bar to update by hand when None); ``items`` itself when not ``enabled``."""
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="img")


@functools.lru_cache(maxsize=8)
def _cached_reader(shards: str, stamp: tuple[int, int, int]) -> _shards.ShardReader:
    return _shards.ShardReader(shards)


def _reader(root: Path) -> _shards.ShardReader:
    """The dataset's shard set (cached while its index is unchanged: readers of a row at a time stay cheap)."""
    index = root / SHARDS_DIR / _shards.INDEX_FILE
    try:
        st = index.stat()
    except FileNotFoundError:
        if (root / IMAGES_DIR).is_dir():
            raise DataError(f"{root}: its images are loose files, the layout before shards; rebuild the dataset "
                            "(`dvc repro prepare`)") from None
        raise DataError(f"{index}: not found; {root} is not a complete faceops dataset, rebuild it with the prepare "
                        "stage") from None
    return _cached_reader(str(root / SHARDS_DIR), (st.st_ino, st.st_mtime_ns, st.st_size))


def _member_key(rel: str) -> str:
    return rel.rsplit(".", 1)[0]  # a shard key is the member name without its extension


def _locate(root: Path, reader: _shards.ShardReader, manifest: pd.DataFrame) -> np.ndarray:
    """Index rows of the manifest's paths in the dataset's shard set; a path missing there is named with its row."""
    rels = [str(r) for r in manifest["path"]]
    rows = reader.locate([_member_key(r) for r in rels])
    if (rows < 0).any():
        at = int(np.argmax(rows < 0))
        raise DataError(f"{root / rels[at]} (manifest row {manifest.index[at]}): image is missing from "
                        f"{root / SHARDS_DIR}; restore the dataset (dvc checkout) or rebuild it")
    return rows


def shard_places(dataset_dir: str | os.PathLike, manifest: pd.DataFrame
                 ) -> tuple[list[Path], np.ndarray, np.ndarray, np.ndarray]:
    """Where the manifest's images lie: (shard files, (N,) shard number of each row, (N,) byte offsets, (N,) sizes)."""
    root = Path(dataset_dir)
    reader = _reader(root)
    index = reader.index.iloc[_locate(root, reader, manifest)]
    names, shard_of = np.unique(index["shard"].to_numpy(), return_inverse=True)
    return ([root / SHARDS_DIR / str(n) for n in names], shard_of.astype(np.int32),
            index["offset"].to_numpy(np.int64), index["size"].to_numpy(np.int64))


def _encoded(root: Path, manifest: pd.DataFrame, desc: str, progress: bool) -> Iterable[tuple[Any, str, bytes]]:
    """``(manifest index, path, encoded bytes)`` of each row, in manifest order, read from the shards a block at a
    time."""
    reader = _reader(root)
    bar = _progress(None, len(manifest), progress, desc)
    for lo in range(0, len(manifest), _READ_BLOCK):
        part = manifest.iloc[lo:lo + _READ_BLOCK]
        yield from zip(part.index, (str(r) for r in part["path"]), reader.read_rows(_locate(root, reader, part)))
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()


def load_images(
    dataset_dir: str | os.PathLike,
    manifest: pd.DataFrame,
    *,
    expected_size: tuple[int, int] | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Decode the manifest's images into uint8 (N, H, W, 3), in manifest order.

    ``expected_size`` is (H, W); without it every image must match the first one. Each image must also
    match its row's ``width``/``height``.
    """
    root = Path(dataset_dir)
    for column in ("path", "width", "height"):
        if column not in manifest.columns:
            raise DataError(f"{root}: manifest passed to load_images has no '{column}' column")
    n = len(manifest)
    size = tuple(int(v) for v in expected_size) if expected_size is not None else None
    out: np.ndarray | None = None
    if size is not None:
        out = np.empty((n, size[0], size[1], 3), dtype=np.uint8)
    if n == 0:
        h, w = size if size is not None else (0, 0)
        return np.empty((0, h, w, 3), dtype=np.uint8)
    widths, heights = manifest["width"].to_numpy(), manifest["height"].to_numpy()
    for i, (idx, rel, data) in enumerate(_encoded(root, manifest, f"load {root.name}", progress)):
        where = f"{root / rel} (manifest row {idx})"
        img = decode_image(data, source=where)
        h, w = img.shape[:2]
        if (w, h) != (int(widths[i]), int(heights[i])):
            raise DataError(f"{where}: image is {h}x{w} (HxW) but the manifest says {int(heights[i])}x"
                            f"{int(widths[i])}; the shards were replaced, rebuild the dataset")
        if out is None:
            size = (h, w)
            out = np.empty((n, h, w, 3), dtype=np.uint8)
        if (h, w) != size:
            raise DataError(f"{where}: image is {h}x{w} (HxW), expected {size[0]}x{size[1]}; resize or re-align "
                            "the dataset to one size")
        out[i] = img
    return out


def landmarks_array(manifest: pd.DataFrame) -> np.ndarray:
    """float32 (N, 5, 2) pixel (x, y) landmarks; rows whose landmarks are null are all-NaN."""
    out = np.full((len(manifest), NUM_LANDMARKS, 2), np.nan, dtype=np.float32)
    for i, (idx, value) in enumerate(zip(manifest.index, manifest["landmarks"])):
        arr = landmark_values(value, f"manifest row {idx}")
        if arr is not None:
            out[i] = arr.reshape(NUM_LANDMARKS, 2)
    return out


# Digest --------------------------------------------------------------------------------------------


def dataset_digest(dataset_dir: str | os.PathLike, *, progress: bool = False) -> str:
    """Content digest of a dataset directory (see the module docstring); equals dataset.json's ``digest``
    while the directory is intact."""
    root = Path(dataset_dir)
    manifest = read_manifest(root / MANIFEST_FILE)
    hashes = {rel: hashlib.sha256(data).hexdigest()
              for _, rel, data in _encoded(root, manifest, f"hash {root.name}", progress)}
    return manifest_digest(manifest, hashes)


# Writer --------------------------------------------------------------------------------------------


def _check_identity(identity: Any) -> str:
    if not isinstance(identity, str) or not identity or identity in (".", "..") \
            or any(ch in identity for ch in ("/", "\\", "\x00")):
        raise DataError(f"identity {identity!r} cannot be a folder name; use a non-empty string without "
                        "'/', '\\' or NUL that is not '.' or '..'")
    return identity


_ROW = np.dtype([  # one image's manifest values as DatasetWriter spills them (the path and labels come at close)
    ("code", "<i4"), ("split", "<i4"), ("height", "<i4"), ("width", "<i4"), ("sha", "u1", (32,)),
    ("quality", "<f8"), ("template", "<i8"), ("media", "<i8"), ("known", "u1"),
    ("landmarks", "<f4", (2 * NUM_LANDMARKS,)), ("shard", "<i4"), ("offset", "<i8"), ("size", "<i8"),
])


class _RowFile:
    """Fixed-size rows (``_ROW``) appended to a file a buffer at a time and read back a block or a row at a time:
    the writer keeps no per-image memory while it writes (the file is in the page cache, not the process)."""

    def __init__(self, path: Path, buffer_rows: int = 4096) -> None:
        self.path, self.n = path, 0
        self._file = path.open("w+b")
        self._buffer = np.zeros(buffer_rows, dtype=_ROW)
        self._pending = 0

    def append(self, row: tuple) -> None:
        self._buffer[self._pending] = row
        self._pending += 1
        self.n += 1
        if self._pending == len(self._buffer):
            self.flush()

    def flush(self) -> None:
        self._file.write(self._buffer[: self._pending].tobytes())
        self._file.flush()
        self._pending = 0

    def __len__(self) -> int:
        return self.n

    def blocks(self, size: int) -> Iterable[np.ndarray]:
        """Rows in order, ``size`` at a time (the buffer is written first, so :meth:`row` reads every row after)."""
        self.flush()
        self._file.seek(0)
        for lo in range(0, self.n, size):
            yield np.fromfile(self._file, dtype=_ROW, count=min(size, self.n - lo))

    def row(self, r: int) -> np.void:
        return self.read(r, 1)[0]

    def read(self, lo: int, count: int) -> np.ndarray:
        """Rows ``lo`` .. ``lo + count - 1`` (after :meth:`blocks` has flushed the buffer)."""
        return np.frombuffer(os.pread(self._file.fileno(), count * _ROW.itemsize, lo * _ROW.itemsize), dtype=_ROW)

    def close(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


def _image_path(identity: str, number: int, ext: str = "png") -> str:
    return f"{IMAGES_DIR}/{identity}/{number}.{ext}"


def _ext(known: int) -> str:
    return "jpg" if known & _JPEG else "png"


def _is_replaceable(path: Path) -> bool:
    """An existing output may be replaced only if it is an empty directory or a faceops dataset."""
    if not path.exists():
        return True
    return path.is_dir() and (not any(path.iterdir()) or (path / INFO_FILE).is_file())


class DatasetWriter:
    """Write a dataset directory image by image; the result appears at ``out_dir`` only on a clean close.

    Use as a context manager: an exception inside the ``with`` block removes the temporary directory and
    leaves any existing ``out_dir`` untouched; leaving the block normally calls :meth:`close`.

    Each image's manifest values go to a file in the temporary directory as it is added (a fixed-size row); the
    writer's memory does not grow with the images: closing reads the rows back a row group at a time, and holds only
    each image's identity code and the digest's path order (4 and 8 bytes per image) while it closes.
    """

    def __init__(self, out_dir: str | os.PathLike, *, name: str, source: str, aligned: bool,
                 generator: dict | None = None):
        self.out_dir = Path(out_dir)
        if source not in SOURCES:
            raise DataError(f"dataset {name!r}: source {source!r} is not one of {', '.join(SOURCES)}")
        if generator is not None:
            if not isinstance(generator, dict):
                raise DataError(f"dataset {name!r}: generator must be a dict or None, got {type(generator).__name__}")
            try:
                json.dumps(generator, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise DataError(f"dataset {name!r}: generator params are not JSON-serialisable ({exc})") from exc
        if not _is_replaceable(self.out_dir):
            raise DataError(f"{self.out_dir}: exists and is not a faceops dataset (no {INFO_FILE}); remove it or "
                            "choose another output directory")
        self.name, self.source, self.aligned, self.generator = name, source, bool(aligned), generator
        # what a writer killed mid-write left (a whole dataset) lies outside anything DVC tracks or cleans
        remove_dead_temporaries(self.out_dir)
        self.tmp_dir = self.out_dir.with_name(f".{self.out_dir.name}.{os.getpid()}.tmp")
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)  # left over by a crashed run of a process with our pid
        self.tmp_dir.mkdir(parents=True)
        self._shards = _shards.ShardWriter(self.tmp_dir / SHARDS_DIR, prefix="faces", index=False)
        self._closed = False
        self._clear()

    def _clear(self) -> None:
        """Empty state; per image only the spilled row (``_RowFile``), per identity and split a code and a count."""
        self._identities: dict[str, int] = {}  # identity → code, in order of first appearance
        self._counts: list[int] = []           # images per identity code (the next image's file number)
        self._splits: dict[str, int] = {}      # split → code
        self._split_counts: list[int] = []     # images per split code
        self._sizes: set[tuple[int, int]] = set()  # (height, width) seen, up to two
        self._rows: _RowFile | None = None

    def add(self, image: np.ndarray, *, identity: str, split: str = "train", landmarks: Any = None,
            quality: float | None = None, template: int | None = None, media: int | None = None,
            encoded: bytes | None = None) -> str:
        """Append ``image`` (RGB uint8 (H, W, 3)) as a PNG to the shards and record its row; returns its path.

        ``encoded``: the JPEG or PNG file ``image`` was decoded from (RGB, at this size), stored as it is instead of
        encoding ``image`` again: an ingested JPEG face stays the JPEG it was (``.jpg`` path), at its size on disk
        and without the cost of a PNG encode. The caller vouches that the bytes decode to ``image``."""
        if self._closed:
            raise RuntimeError(f"DatasetWriter for {self.out_dir} is closed")
        identity = _check_identity(identity)
        code = self._identities.get(identity)
        number = 0 if code is None else self._counts[code]
        where = f"dataset {self.name!r}, identity {identity!r}, image {number}"
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            desc = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise DataError(f"{where}: expected an RGB uint8 array of shape (H, W, 3), got {desc}")
        if not isinstance(split, str) or not split:
            raise DataError(f"{where}: split must be a non-empty string, got {split!r}")
        lm = landmark_values(landmarks, where)
        if quality is not None:
            if isinstance(quality, bool) or not isinstance(quality, Real) or not 0.0 <= float(quality) <= 1.0:
                raise DataError(f"{where}: quality {quality!r} is not a number in [0, 1]; pass None if unknown")
        for key, value in (("template", template), ("media", media)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise DataError(f"{where}: {key} {value!r} is not an integer; pass None if not a set benchmark")
            if value is not None and not -(1 << 63) <= int(value) < (1 << 63):
                raise DataError(f"{where}: {key} {value!r} does not fit the manifest's int64 column")

        ext = "png" if encoded is None else encoded_format(encoded)
        if ext is None:
            raise DataError(f"{where}: encoded bytes are neither a JPEG nor a PNG; pass the image alone instead")
        data = encode_image(image, "png") if encoded is None else bytes(encoded)
        rel = _image_path(identity, number, ext)
        if self._rows is None:
            self._rows = _RowFile(self.tmp_dir / ".rows")
        place = self._shards.add(_member_key(rel), ext, data)
        if code is None:
            code = self._identities[identity] = len(self._counts)
            self._counts.append(0)
        self._counts[code] += 1
        split_code = self._splits.setdefault(split, len(self._splits))
        if split_code == len(self._split_counts):
            self._split_counts.append(0)
        self._split_counts[split_code] += 1
        if len(self._sizes) < 2:
            self._sizes.add(image.shape[:2])
        self._rows.append((
            code, split_code, image.shape[0], image.shape[1], np.frombuffer(hashlib.sha256(data).digest(), np.uint8),
            math.nan if quality is None else float(quality), 0 if template is None else int(template),
            0 if media is None else int(media),
            (_HAS_LANDMARKS if lm is not None else 0) | (_HAS_TEMPLATE if template is not None else 0)
            | (_HAS_MEDIA if media is not None else 0) | (_JPEG if ext == "jpg" else 0),
            0.0 if lm is None else lm, *place))
        return rel

    def close(self) -> dict:
        """Assign labels, write manifest.parquet and dataset.json, move the directory into place.

        Returns the dataset.json content.
        """
        if self._closed:
            raise RuntimeError(f"DatasetWriter for {self.out_dir} is already closed")
        try:
            if self._rows is None:
                raise DataError(f"dataset {self.name!r}: no images were added; nothing to write to {self.out_dir}")
            info = self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._clear()
        logger.info("wrote dataset %s: %d images, %d identities -> %s",
                    self.name, info["image_count"], info["identity_count"], self.out_dir)
        return info

    def _finish(self) -> dict:
        rows = self._rows
        n = len(rows)
        names = list(self._identities)  # by code
        label_of = np.empty(len(names), dtype=np.int64)  # code → label, 0..K-1 by sorted identity
        label_of[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
        codes = np.empty(n, dtype=np.int32)  # (N,) identity code of each row, for the digest's path order
        seen = [0] * len(names)  # next file number per identity code, in row order

        def paths(block: np.ndarray) -> Iterable[str]:
            for code, known in zip(block["code"].tolist(), block["known"].tolist()):
                seen[code] += 1  # before the yield: the consumer stops at the block's last path
                yield _image_path(names[code], seen[code] - 1, _ext(known))

        pool = pa.system_memory_pool()  # freed to malloc, reusable by numpy and Python (see write_parquet)

        def column(values: Any, **kw: Any) -> pa.Array:
            return pa.array(values, memory_pool=pool, **kw)

        def lookup(values: pa.Array, index: np.ndarray) -> pa.Array:  # strings values[index]
            return pc.take(values, column(index), memory_pool=pool)

        identities, splits = column(names, type=pa.string()), column(list(self._splits), type=pa.string())
        source = pa.scalar(self.source, type=pa.string())
        landmark_type = SCHEMA.field("landmarks").type

        def batches() -> Iterable[pa.RecordBatch]:  # manifest rows a row group at a time
            lo = 0
            for block in rows.blocks(_ROW_GROUP):
                k, known = len(block), block["known"]
                codes[lo:lo + k] = block["code"]
                lo += k
                has_lm = (known & _HAS_LANDMARKS) > 0
                offsets = np.zeros(k + 1, dtype=np.int32)
                np.cumsum(has_lm, out=offsets[1:])
                offsets *= 2 * NUM_LANDMARKS
                arrays = [
                    column(paths(block), type=pa.string(), size=k),
                    lookup(identities, block["code"]),
                    column(label_of[block["code"]]),
                    lookup(splits, block["split"]),
                    pa.repeat(source, k, memory_pool=pool),
                    pa.ListArray.from_arrays(column(offsets), column(block["landmarks"][has_lm].reshape(-1)),
                                             type=landmark_type, mask=column(~has_lm), pool=pool),
                    column(block["quality"], type=pa.float64(), from_pandas=True),
                    column(block["template"], mask=(known & _HAS_TEMPLATE) == 0),
                    column(block["media"], mask=(known & _HAS_MEDIA) == 0),
                    column(block["width"].astype(np.int64)),
                    column(block["height"].astype(np.int64)),
                ]
                yield pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)

        write_parquet_batches(batches(), SCHEMA, self.tmp_dir / MANIFEST_FILE)
        self._shards.close()
        self._write_shard_index()
        info = {
            "name": self.name,
            "source": self.source,
            "image_size": list(next(iter(self._sizes))) if len(self._sizes) == 1 else None,
            "aligned": self.aligned,
            "identity_count": len(names),
            "image_count": n,
            "splits": dict(sorted(zip(self._splits, self._split_counts))),
            "generator": self.generator,
            "digest": self._digest(names, label_of, codes),
            "created_by": "faceops",
        }
        rows.close()  # the spilled rows are not part of the dataset
        (self.tmp_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        self._move_into_place()
        return info

    def _write_shard_index(self) -> None:
        """``shards/index.parquet`` from the manifest's paths (read back a row group at a time) and the spilled
        places: the shards' keys are the paths without their extension."""
        import pyarrow.parquet as pq

        shard_names = pa.array([self._shards.shard_name(k) for k in range(len(self._shards.names))], pa.string())
        schema = pa.schema([(c, pa.type_for_alias(t)) for c, t in zip(_shards.INDEX_COLUMNS, _shards.INDEX_TYPES)])

        def batches() -> Iterable[pa.RecordBatch]:
            lo = 0
            for part in pq.ParquetFile(self.tmp_dir / MANIFEST_FILE).iter_batches(columns=["path"]):
                rows = self._rows.read(lo, len(part))
                lo += len(part)
                keys = pc.replace_substring_regex(part.column(0), r"\.(png|jpg)$", "")
                exts = pa.array(np.where(rows["known"] & _JPEG, "jpg", "png"), pa.string())
                yield pa.RecordBatch.from_arrays([
                    keys, exts, pc.take(shard_names, pa.array(rows["shard"])),
                    pa.array(rows["offset"]), pa.array(rows["size"])], schema=schema)

        write_parquet_batches(batches(), schema, self.tmp_dir / SHARDS_DIR / _shards.INDEX_FILE)

    def _digest(self, names: list[str], label_of: np.ndarray, codes: np.ndarray) -> str:
        """:func:`dataset_digest` of the directory being written, from the spilled rows (the values a reader of the
        manifest gets back: float32 landmarks, float64 quality, int64 template/media), streamed line by line.

        Rows sorted by path without building the paths: an identity's paths ``images/<identity>/...`` are
        contiguous in sorted order and ordered by ``<identity>/`` (an identity holds no ``/``); within one identity
        the file names ``<n>.png`` sort as strings (``1.png`` < ``10.png`` < ``2.png``; never by the extension,
        a ``.`` sorts before every digit)."""
        by_identity = np.argsort(codes, kind="stable")  # rows grouped by identity code, in file order
        starts = np.concatenate([[0], np.cumsum(self._counts)[:-1]]).tolist()
        splits = list(self._splits)
        name_order: dict[int, list[int]] = {}  # images of an identity → its file numbers in path order
        h = hashlib.sha256()
        for code in sorted(range(len(names)), key=lambda c: names[c] + "/"):
            count = self._counts[code]
            if count not in name_order:
                name_order[count] = sorted(range(count), key=lambda k: f"{k}.png")
            at = by_identity[starts[code]:starts[code] + count].tolist()  # file number k is row at[k]
            for number in name_order[count]:
                row = self._rows.row(at[number])
                bits, q = int(row["known"]), float(row["quality"])
                h.update(digest_line(_image_path(names[code], number, _ext(bits)), row["sha"].tobytes().hex(), (
                    names[code], int(label_of[code]), splits[row["split"]], self.source,
                    row["landmarks"].tolist() if bits & _HAS_LANDMARKS else None,
                    None if math.isnan(q) else q,
                    int(row["template"]) if bits & _HAS_TEMPLATE else None,
                    int(row["media"]) if bits & _HAS_MEDIA else None,
                    int(row["width"]), int(row["height"]))))
        return h.hexdigest()

    def _move_into_place(self) -> None:
        out = self.out_dir
        if not _is_replaceable(out):
            raise DataError(f"{out}: exists and is not a faceops dataset (no {INFO_FILE}); remove it or choose "
                            "another output directory")
        if not out.exists():
            os.replace(self.tmp_dir, out)
            return
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)  # a non-empty directory cannot be replaced in one rename
        try:
            os.replace(self.tmp_dir, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Discard everything written so far; ``out_dir`` is left as it was."""
        self._closed = True
        if self._rows is not None:
            self._rows.close()
        self._shards.abort()
        self._clear()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()
