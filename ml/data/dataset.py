"""The faceops dataset directory (DESIGN.md §3).

A dataset directory holds::

    images/<identity>/<n>.png   RGB uint8 PNGs, n counts from 0 within each identity
    manifest.parquet            one row per image, columns MANIFEST_COLUMNS
    dataset.json                name, source, image size, counts, generator, content digest
    records.parquet             only for faces ingested from a RecordIO: the record each image came from
                                (``ml.data.records``; not part of the digest)

Manifest columns and their parquet types: ``path`` (string, relative to the dataset directory),
``identity`` (string), ``label`` (int64, 0..K-1 by sorted identity), ``split`` (string), ``source``
(string, one of SOURCES), ``landmarks`` (list<float32> of 10 pixel coordinates x0,y0,...,x4,y4 in
ArcFace order: left eye, right eye, nose, left mouth corner, right mouth corner; null if unknown),
``quality`` (float64 in [0, 1] or null), ``template`` and ``media`` (nullable int64, for set/video
benchmarks), ``width`` and ``height`` (int64).

:class:`DatasetWriter` builds the directory under ``.<out>.<pid>.tmp`` and moves it onto ``<out>`` only
when closed without error, so readers never see a half-written dataset.

The content digest is the sha256 over one canonical JSON line per image, sorted by path:
``[path, sha256(file bytes), identity, label, split, source, landmarks, quality, template, media,
width, height]`` (floats as their shortest repr, nulls as null). It changes when any pixel, label or
annotation changes and not when rows are reordered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections import Counter
from collections.abc import Iterable
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ml.atomic import atomic_write, remove_dead_temporaries
from ml.data.formats import decode_image, encode_image
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
    "validate_manifest_columns",
    "write_manifest",
]

MANIFEST_COLUMNS: tuple[str, ...] = (
    "path", "identity", "label", "split", "source", "landmarks", "quality", "template", "media", "width", "height",
)
SOURCES = ("procedural", "real", "synthetic")
DATASET_INFO_KEYS: tuple[str, ...] = (
    "name", "source", "image_size", "aligned", "identity_count", "image_count", "splits", "generator", "digest",
    "created_by",
)
MANIFEST_FILE = "manifest.parquet"
INFO_FILE = "dataset.json"
IMAGES_DIR = "images"
NUM_LANDMARKS = 5

_STRING_COLUMNS = ("path", "identity", "split", "source")
_INT_COLUMNS = ("label", "width", "height")
_NULLABLE_INT_COLUMNS = ("template", "media")
_SCHEMA = pa.schema([
    ("path", pa.string()),
    ("identity", pa.string()),
    ("label", pa.int64()),
    ("split", pa.string()),
    ("source", pa.string()),
    ("landmarks", pa.list_(pa.float32())),
    ("quality", pa.float64()),
    ("template", pa.int64()),
    ("media", pa.int64()),
    ("width", pa.int64()),
    ("height", pa.int64()),
])


# --------------------------------------------------------------------------------------------------
# Manifest I/O
# --------------------------------------------------------------------------------------------------


def validate_manifest_columns(df: pd.DataFrame, source_name: str) -> None:
    """Raise DataError naming ``source_name`` and every missing manifest column."""
    missing = [c for c in MANIFEST_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{source_name}: manifest is missing column(s) {', '.join(repr(c) for c in missing)}; "
                        f"a faceops manifest has {', '.join(MANIFEST_COLUMNS)}. Rebuild it with the prepare stage")


def _is_null(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and math.isnan(value)


def _landmark_values(value: Any, where: str) -> np.ndarray | None:
    """Normalise one landmarks cell to float32 (10,) or None."""
    if _is_null(value):
        return None
    arr = np.asarray(value, dtype=np.float32).reshape(-1)
    if arr.size != 2 * NUM_LANDMARKS:
        raise DataError(f"{where}: landmarks has {arr.size} values, expected {2 * NUM_LANDMARKS} "
                        "(x0, y0, ..., x4, y4) or null")
    if not np.isfinite(arr).all():
        raise DataError(f"{where}: landmarks contains NaN/inf; store null when landmarks are unknown")
    return arr


def _arrow_column(df: pd.DataFrame, column: str, type_: pa.DataType, path: Path) -> pa.Array:
    series = df[column]
    if column == "landmarks":
        values = [_landmark_values(v, f"{path}: row {idx}") for idx, v in zip(df.index, series)]
        return pa.array(values, type=type_)
    if column in _STRING_COLUMNS + _INT_COLUMNS:
        nulls = series.isna()
        if nulls.any():
            raise DataError(f"{path}: column '{column}' is null in row {nulls.idxmax()}; it must be set on every row")
    try:
        return pa.array(series, type=type_, from_pandas=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise DataError(f"{path}: column '{column}' cannot be stored as {type_} ({exc}); fix its values") from exc


def write_manifest(df: pd.DataFrame, path: str | os.PathLike) -> None:
    """Write ``df`` as a manifest parquet with the contract's types, atomically.

    Columns beyond MANIFEST_COLUMNS are kept after them with inferred types.
    """
    path = Path(path)
    validate_manifest_columns(df, str(path))
    arrays = [_arrow_column(df, field.name, field.type, path) for field in _SCHEMA]
    names = list(MANIFEST_COLUMNS)
    for extra in (c for c in df.columns if c not in MANIFEST_COLUMNS):
        try:
            arrays.append(pa.array(df[extra], from_pandas=True))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"{path}: extra column '{extra}' cannot be stored in parquet ({exc})") from exc
        names.append(str(extra))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(pa.Table.from_arrays(arrays, names=names), path)


def write_parquet(table: pa.Table, path: Path) -> None:
    """``table`` to ``path`` atomically (``ml.atomic.atomic_write``)."""
    atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def read_manifest(path: str | os.PathLike) -> pd.DataFrame:
    """Read a manifest parquet: ints as int64, ``template``/``media`` as nullable Int64, ``quality`` float64
    (NaN where null), ``landmarks`` as float32 arrays or None.

    The file is checked against the contract first (DataError naming the file, column and first offending row):
    the column types (no ``label`` stored as text or as fractional numbers), no null where a value is required,
    landmarks of 10 finite values or null (NaN landmarks would slip through the gate's range checks)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: manifest not found; run the prepare stage to build the dataset")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path}: cannot read manifest parquet ({exc}); the file is corrupt, rebuild the dataset") from exc
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: manifest is missing column(s) {', '.join(repr(c) for c in missing)}; "
                        f"a faceops manifest has {', '.join(MANIFEST_COLUMNS)}. Rebuild it with the prepare stage")
    _check_table(table, path)
    df = table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    for column in _INT_COLUMNS:
        if df[column].isna().any():
            raise DataError(f"{path}: column '{column}' is null in row {df[column].isna().idxmax()}; "
                            "rebuild the manifest")
        try:
            df[column] = df[column].astype("int64")
        except (TypeError, ValueError) as exc:
            raise DataError(f"{path}: column '{column}' is not integer ({exc}); rebuild the manifest") from exc
    try:
        for column in _NULLABLE_INT_COLUMNS:
            df[column] = df[column].astype("Int64")
        df["quality"] = df["quality"].astype("float64")
    except (TypeError, ValueError) as exc:
        raise DataError(f"{path}: a template/media/quality value has the wrong type ({exc}); "
                        "rebuild the manifest") from exc
    for extra_int in (c for c in df.columns if c not in MANIFEST_COLUMNS and isinstance(df[c].dtype, pd.Int64Dtype)):
        if not df[extra_int].isna().any():
            df[extra_int] = df[extra_int].astype("int64")
    return df


def _type_ok(column: str, type_: pa.DataType) -> bool:
    if pa.types.is_null(type_):  # every value null
        return column in ("landmarks", "quality") + _NULLABLE_INT_COLUMNS
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if column in _STRING_COLUMNS:
        return pa.types.is_string(type_) or pa.types.is_large_string(type_)
    if column in _INT_COLUMNS + _NULLABLE_INT_COLUMNS:
        return pa.types.is_integer(type_)
    if column == "quality":
        return pa.types.is_floating(type_) or pa.types.is_integer(type_)
    if column == "landmarks":
        return (pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)) and (
            pa.types.is_floating(type_.value_type) or pa.types.is_integer(type_.value_type))
    return True


def _check_table(table: pa.Table, path: Path) -> None:
    """The contract's column types, no nulls where a value is required, landmarks of 10 finite values or null;
    DataError naming the file, the column and the first offending row."""
    import pyarrow.compute as pc

    def row_name(row: int) -> str:
        rel = table.column("path")[row].as_py() if pa.types.is_string(table.schema.field("path").type) else None
        return f"row {row} ({rel})" if rel else f"row {row}"

    for column in MANIFEST_COLUMNS:
        type_ = table.schema.field(column).type
        if not _type_ok(column, type_):
            raise DataError(f"{path}: column '{column}' has type {type_}, expected {_SCHEMA.field(column).type}; "
                            "fix its values or rebuild the manifest with the prepare stage")
    for column in _STRING_COLUMNS + _INT_COLUMNS:
        values = table.column(column)
        if values.null_count:
            row = pc.index(pc.is_null(values), True).as_py()
            raise DataError(f"{path}: column '{column}' is null in {row_name(row)}; it must be set on every row, "
                            "rebuild the manifest")
    landmarks = table.column("landmarks").combine_chunks()
    if pa.types.is_null(landmarks.type):
        return
    lengths = pc.list_value_length(landmarks)
    wrong = pc.fill_null(pc.not_equal(lengths, 2 * NUM_LANDMARKS), False)
    if pc.any(wrong).as_py():
        row = pc.index(wrong, True).as_py()
        raise DataError(f"{path}: {row_name(row)}: landmarks has {lengths[row].as_py()} values, expected "
                        f"{2 * NUM_LANDMARKS} (x0, y0, ..., x4, y4) or null; rebuild the manifest")
    values = pc.list_flatten(landmarks).cast(pa.float64())
    finite = pc.fill_null(pc.is_finite(values), False)
    if len(finite) and not pc.all(finite).as_py():
        row = pc.list_parent_indices(landmarks)[pc.index(finite, False).as_py()].as_py()
        raise DataError(f"{path}: {row_name(row)}: landmarks contains NaN/inf or a null coordinate; store null for "
                        "the whole row when landmarks are unknown, or rebuild the manifest")


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


# --------------------------------------------------------------------------------------------------
# Images and landmarks
# --------------------------------------------------------------------------------------------------


def _progress(items: Iterable, total: int, enabled: bool, desc: str) -> Iterable:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="img")


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
    rows = zip(manifest.index, manifest["path"], manifest["width"], manifest["height"])
    for i, (idx, rel, width, height) in enumerate(_progress(rows, n, progress, f"load {root.name}")):
        file = root / str(rel)
        where = f"{file} (manifest row {idx})"
        try:
            data = file.read_bytes()
        except FileNotFoundError:
            raise DataError(f"{where}: image file is missing; restore it or rebuild the dataset") from None
        except OSError as exc:
            raise DataError(f"{where}: cannot read image ({exc})") from exc
        img = decode_image(data, source=where)
        h, w = img.shape[:2]
        if (w, h) != (int(width), int(height)):
            raise DataError(f"{where}: image is {h}x{w} (HxW) but the manifest says {int(height)}x{int(width)}; "
                            "the file was replaced, rebuild the dataset")
        if out is None:
            size = (h, w)
            out = np.empty((n, h, w, 3), dtype=np.uint8)
        if (h, w) != size:
            raise DataError(f"{where}: image is {h}x{w} (HxW), expected {size[0]}x{size[1]}; resize or re-align "
                            "the dataset to one size")
        out[i] = img
    if out is None:  # empty manifest
        h, w = size if size is not None else (0, 0)
        out = np.empty((0, h, w, 3), dtype=np.uint8)
    return out


def landmarks_array(manifest: pd.DataFrame) -> np.ndarray:
    """float32 (N, 5, 2) pixel (x, y) landmarks; rows whose landmarks are null are all-NaN."""
    out = np.full((len(manifest), NUM_LANDMARKS, 2), np.nan, dtype=np.float32)
    for i, (idx, value) in enumerate(zip(manifest.index, manifest["landmarks"])):
        arr = _landmark_values(value, f"manifest row {idx}")
        if arr is not None:
            out[i] = arr.reshape(NUM_LANDMARKS, 2)
    return out


# --------------------------------------------------------------------------------------------------
# Digest
# --------------------------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    if _is_null(value):
        return None
    if isinstance(value, np.ndarray):
        return [float(v) for v in value.reshape(-1)]
    if isinstance(value, (list, tuple)):
        return [float(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        return float(value)
    return str(value)


def _digest(manifest: pd.DataFrame, file_hashes: dict[str, str]) -> str:
    columns = [c for c in MANIFEST_COLUMNS if c != "path"]
    records = []
    for rel, *values in zip(manifest["path"], *(manifest[c] for c in columns)):
        rel = str(rel)
        line = [rel, file_hashes[rel], *(_json_value(v) for v in values)]
        records.append((rel, json.dumps(line, separators=(",", ":"), allow_nan=False, ensure_ascii=True)))
    h = hashlib.sha256()
    for _, line in sorted(records):
        h.update(line.encode("ascii"))
        h.update(b"\n")
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dataset_digest(dataset_dir: str | os.PathLike, *, progress: bool = False) -> str:
    """Content digest of a dataset directory (see the module docstring); equals dataset.json's ``digest``
    while the directory is intact."""
    root = Path(dataset_dir)
    manifest = read_manifest(root / MANIFEST_FILE)
    hashes: dict[str, str] = {}
    rows = zip(manifest.index, manifest["path"])
    for idx, rel in _progress(rows, len(manifest), progress, f"hash {root.name}"):
        file = root / str(rel)
        try:
            hashes[str(rel)] = _file_sha256(file)
        except FileNotFoundError:
            raise DataError(f"{file} (manifest row {idx}): image file is missing; restore it or rebuild the "
                            "dataset") from None
    return _digest(manifest, hashes)


# --------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------


def _check_identity(identity: Any) -> str:
    if not isinstance(identity, str) or not identity or identity in (".", "..") \
            or any(ch in identity for ch in ("/", "\\", "\x00")):
        raise DataError(f"identity {identity!r} cannot be a folder name; use a non-empty string without "
                        "'/', '\\' or NUL that is not '.' or '..'")
    return identity


def _is_replaceable(path: Path) -> bool:
    """An existing output may be replaced only if it is an empty directory or a faceops dataset."""
    if not path.exists():
        return True
    return path.is_dir() and (not any(path.iterdir()) or (path / INFO_FILE).is_file())


class DatasetWriter:
    """Write a dataset directory image by image; the result appears at ``out_dir`` only on a clean close.

    Use as a context manager: an exception inside the ``with`` block removes the temporary directory and
    leaves any existing ``out_dir`` untouched; leaving the block normally calls :meth:`close`.
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
        (self.tmp_dir / IMAGES_DIR).mkdir(parents=True)
        self._rows: list[dict[str, Any]] = []
        self._counts: Counter[str] = Counter()
        self._hashes: dict[str, str] = {}
        self._closed = False

    def add(self, image: np.ndarray, *, identity: str, split: str = "train", landmarks: Any = None,
            quality: float | None = None, template: int | None = None, media: int | None = None) -> str:
        """Save ``image`` (RGB uint8 (H, W, 3)) as PNG and record its row; returns its relative path."""
        if self._closed:
            raise RuntimeError(f"DatasetWriter for {self.out_dir} is closed")
        identity = _check_identity(identity)
        where = f"dataset {self.name!r}, identity {identity!r}, image {self._counts[identity]}"
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            desc = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
            raise DataError(f"{where}: expected an RGB uint8 array of shape (H, W, 3), got {desc}")
        if not isinstance(split, str) or not split:
            raise DataError(f"{where}: split must be a non-empty string, got {split!r}")
        lm = _landmark_values(landmarks, where)
        if quality is not None:
            if isinstance(quality, bool) or not isinstance(quality, Real) or not 0.0 <= float(quality) <= 1.0:
                raise DataError(f"{where}: quality {quality!r} is not a number in [0, 1]; pass None if unknown")
            quality = float(quality)
        for key, value in (("template", template), ("media", media)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise DataError(f"{where}: {key} {value!r} is not an integer; pass None if not a set benchmark")

        rel = f"{IMAGES_DIR}/{identity}/{self._counts[identity]}.png"
        data = encode_image(image, "png")
        file = self.tmp_dir / rel
        file.parent.mkdir(exist_ok=True)
        file.write_bytes(data)
        self._hashes[rel] = hashlib.sha256(data).hexdigest()
        self._counts[identity] += 1
        self._rows.append({
            "path": rel, "identity": identity, "split": split, "landmarks": lm, "quality": quality,
            "template": None if template is None else int(template), "media": None if media is None else int(media),
            "width": int(image.shape[1]), "height": int(image.shape[0]),
        })
        return rel

    def close(self) -> dict:
        """Assign labels, write manifest.parquet and dataset.json, move the directory into place.

        Returns the dataset.json content.
        """
        if self._closed:
            raise RuntimeError(f"DatasetWriter for {self.out_dir} is already closed")
        try:
            if not self._rows:
                raise DataError(f"dataset {self.name!r}: no images were added; nothing to write to {self.out_dir}")
            info = self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        logger.info("wrote dataset %s: %d images, %d identities -> %s",
                    self.name, info["image_count"], info["identity_count"], self.out_dir)
        return info

    def _finish(self) -> dict:
        labels = {identity: i for i, identity in enumerate(sorted(self._counts))}
        df = pd.DataFrame({
            "path": [r["path"] for r in self._rows],
            "identity": [r["identity"] for r in self._rows],
            "label": np.array([labels[r["identity"]] for r in self._rows], dtype=np.int64),
            "split": [r["split"] for r in self._rows],
            "source": [self.source] * len(self._rows),
            "landmarks": pd.Series([r["landmarks"] for r in self._rows], dtype=object),
            "quality": pd.Series([r["quality"] for r in self._rows], dtype="float64"),
            "template": pd.array([r["template"] for r in self._rows], dtype="Int64"),
            "media": pd.array([r["media"] for r in self._rows], dtype="Int64"),
            "width": np.array([r["width"] for r in self._rows], dtype=np.int64),
            "height": np.array([r["height"] for r in self._rows], dtype=np.int64),
        })
        write_manifest(df, self.tmp_dir / MANIFEST_FILE)
        manifest = read_manifest(self.tmp_dir / MANIFEST_FILE)  # digest what a reader will see
        sizes = {(r["height"], r["width"]) for r in self._rows}
        info = {
            "name": self.name,
            "source": self.source,
            "image_size": list(next(iter(sizes))) if len(sizes) == 1 else None,
            "aligned": self.aligned,
            "identity_count": len(labels),
            "image_count": len(self._rows),
            "splits": dict(sorted(Counter(r["split"] for r in self._rows).items())),
            "generator": self.generator,
            "digest": _digest(manifest, self._hashes),
            "created_by": "faceops",
        }
        (self.tmp_dir / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        self._move_into_place()
        return info

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
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()
