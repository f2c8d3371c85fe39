"""The manifest of a faceops dataset directory (``manifest.parquet``, docs/data.md): its Arrow schema, the checks a
file must pass before anything reads it, and the atomic writers (``ml.data.dataset`` re-exports the public names).

Columns and their parquet types: ``path`` (string, relative to the dataset directory), ``identity`` (string),
``label`` (int64, 0..K-1 by sorted identity), ``split`` (string), ``source`` (string), ``landmarks``
(list<float32> of 10 pixel coordinates x0,y0,...,x4,y4 in ArcFace order, or null), ``quality`` (float64 in [0, 1]
or null), ``template`` and ``media`` (nullable int64), ``width`` and ``height`` (int64).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ml.atomic import atomic_path
from ml.errors import DataError

MANIFEST_COLUMNS: tuple[str, ...] = (
    "path", "identity", "label", "split", "source", "landmarks", "quality", "template", "media", "width", "height",
)
NUM_LANDMARKS = 5
_STRING_COLUMNS = ("path", "identity", "split", "source")
_INT_COLUMNS = ("label", "width", "height")
_NULLABLE_INT_COLUMNS = ("template", "media")
SCHEMA = pa.schema([
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


def validate_manifest_columns(df: pd.DataFrame, source_name: str) -> None:
    """Raise DataError naming ``source_name`` and every missing manifest column."""
    missing = [c for c in MANIFEST_COLUMNS if c not in df.columns]
    if missing:
        raise DataError(f"{source_name}: manifest is missing column(s) {', '.join(repr(c) for c in missing)}; "
                        f"a faceops manifest has {', '.join(MANIFEST_COLUMNS)}. Rebuild it with the prepare stage")


def is_null(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    return isinstance(value, float) and math.isnan(value)


def landmark_values(value: Any, where: str) -> np.ndarray | None:
    """Normalise one landmarks cell to float32 (10,) or None."""
    if is_null(value):
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
        values = [landmark_values(v, f"{path}: row {idx}") for idx, v in zip(df.index, series)]
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
    arrays = [_arrow_column(df, field.name, field.type, path) for field in SCHEMA]
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
    """``table`` to ``path`` atomically (``ml.atomic.atomic_path``).

    Arrow's default allocator (mimalloc) keeps the pages the Parquet writer freed resident, some hundreds of bytes
    per row, which later numpy arrays cannot reuse: they are handed back after the write (cheap;
    ``benchmarks/bench_ingest.py``)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    pa.default_memory_pool().release_unused()


def write_parquet_batches(batches: Iterable[pa.RecordBatch], schema: pa.Schema, path: Path) -> None:
    """Record batches of ``schema`` to ``path`` atomically, one Parquet row group each, as they are made: memory holds
    one batch, not the whole table (a dataset writer closing over millions of rows). The writer allocates from the
    system allocator, which hands freed pages back to malloc."""

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, schema, memory_pool=pa.system_memory_pool()) as writer:
            for batch in batches:
                writer.write_batch(batch)

    with atomic_path(path) as tmp:
        write(tmp)


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
            raise DataError(f"{path}: column '{column}' has type {type_}, expected {SCHEMA.field(column).type}; "
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
