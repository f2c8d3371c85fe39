"""IJB-style template meta files, read and written, so that real IJB-B/C protocol files plug in.

Whitespace-separated text, one record per line, as in the IJB-B/C ``meta/`` folders InsightFace reads:
``*_face_tid_mid.txt`` (``img tid mid``: image, template id, media id) → :func:`read_tid_mid`;
``*_template_pair_label.txt`` (``tid1 tid2 label``, 1 = same subject) → :func:`read_template_pairs`;
``*_name_5pts_score.txt`` (``img x1 y1 … x5 y5 score``: 5 ArcFace-order pixel landmarks and the faceness score)
→ :func:`read_landmark_scores`. ``tasks/prepare`` writes the first two for the procedural template set. Ids are
int64 integers, coordinates and scores finite decimals; a file without records is an error, and every error is a
``DataError`` naming the file, the 1-based line and the fault. Writers check the same rules (what they write reads
back identically, floats in the shortest form that reads back to the same float32) and write atomically.

Differences from the reference (InsightFace ``ijb_11.py`` / ``ijb_1n.py``):
- The reference loads these files with ``pandas.read_csv`` / ``np.loadtxt`` unchecked; here a malformed line is an
  error naming it, instead of NaN ids or shifted columns.
- Image names are kept as written (the reference keeps the file name only); names with whitespace cannot be
  represented in the format, and the writers refuse them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from ml.atomic import atomic_path
from ml.errors import DataError

__all__ = [
    "read_landmark_scores",
    "read_template_pairs",
    "read_tid_mid",
    "write_landmark_scores",
    "write_template_pairs",
    "write_tid_mid",
]

TID_MID_COLUMNS = ("path", "template", "media")
NUM_LANDMARKS = 5
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INT64 = np.iinfo(np.int64)


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------


def _records(path: str | os.PathLike, columns: int, layout: str) -> tuple[Path, list[int], list[list[str]]]:
    """(path, 1-based line numbers, fields) of the non-blank lines of ``path``, each with ``columns`` fields."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist; expected an IJB-style meta file with lines '{layout}'")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} as UTF-8 text: {exc}") from exc
    numbers: list[int] = []
    rows: list[list[str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != columns:
            raise DataError(
                f"{path}, line {number}: expected {columns} whitespace-separated fields '{layout}', got "
                f"{len(fields)}: {line.strip()[:120]!r}"
            )
        numbers.append(number)
        rows.append(fields)
    if not rows:
        raise DataError(f"{path} holds no records; expected lines '{layout}'")
    return path, numbers, rows


def _int_column(tokens: list[str], numbers: list[int], path: Path, what: str) -> np.ndarray:
    """int64 array of ``tokens``; the first non-integer or out-of-range one is named by its line."""
    for token, number in zip(tokens, numbers):
        if not _INT.fullmatch(token) or not _INT64.min <= int(token) <= _INT64.max:
            raise DataError(f"{path}, line {number}: {what} {token!r} is not an integer (int64); ids are whole numbers")
    return np.array([int(t) for t in tokens], dtype=np.int64)


def _float_block(rows: list[list[str]], cols: slice, numbers: list[int], path: Path, what: str) -> np.ndarray:
    """float32 array (N, k) of the fields ``cols`` of every row; the first non-numeric or non-finite field
    (NaN, inf, or beyond float32) is named by its line."""
    block = [r[cols] for r in rows]
    for fields, number in zip(block, numbers):
        for token in fields:
            if not _FLOAT.fullmatch(token):
                raise DataError(
                    f"{path}, line {number}: {what} {token!r} is not a finite decimal number (NaN/inf are refused)"
                )
    values = np.array(block, dtype=np.float64)
    with np.errstate(over="ignore"):
        out = values.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(out).all(axis=1))
    if bad.size:
        raise DataError(f"{path}, line {numbers[bad[0]]}: {what} out of the float32 range: {block[bad[0]]}")
    return out


def read_tid_mid(path: str | os.PathLike) -> pd.DataFrame:
    """``img tid mid`` lines → ``DataFrame`` with columns ``path`` (str), ``template`` and ``media`` (int64),
    in file order."""
    path, numbers, rows = _records(path, 3, "img tid mid")
    templates = _int_column([r[1] for r in rows], numbers, path, "template id")
    media = _int_column([r[2] for r in rows], numbers, path, "media id")
    return pd.DataFrame({"path": [r[0] for r in rows], "template": templates, "media": media})


def read_template_pairs(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``tid1 tid2 label`` lines → (template-id pairs (P, 2) int64, labels (P,) int8 in {0, 1})."""
    path, numbers, rows = _records(path, 3, "tid1 tid2 label")
    first = _int_column([r[0] for r in rows], numbers, path, "template id")
    second = _int_column([r[1] for r in rows], numbers, path, "template id")
    for r, number in zip(rows, numbers):
        if r[2] not in ("0", "1"):
            raise DataError(f"{path}, line {number}: label {r[2]!r} must be 1 (same subject) or 0 (different)")
    labels = np.array([r[2] == "1" for r in rows], dtype=np.int8)
    return np.stack([first, second], axis=1), labels


def read_landmark_scores(path: str | os.PathLike) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``img x1 y1 … x5 y5 score`` lines → (image paths, landmarks (N, 5, 2) float32 pixel x, y, faceness
    scores (N,) float32)."""
    path, numbers, rows = _records(path, 2 + 2 * NUM_LANDMARKS, "img x1 y1 x2 y2 x3 y3 x4 y4 x5 y5 score")
    points = _float_block(rows, slice(1, 1 + 2 * NUM_LANDMARKS), numbers, path, "landmark coordinate")
    scores = _float_block(rows, slice(1 + 2 * NUM_LANDMARKS, None), numbers, path, "face score")
    return [r[0] for r in rows], points.reshape(-1, NUM_LANDMARKS, 2), scores[:, 0]


# ---------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------


def _write_lines(path: str | os.PathLike, lines: list[str]) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text("".join(lines), encoding="utf-8", newline="\n")
    return path


def _check_paths(paths: Sequence[str], target: Path) -> list[str]:
    out = [str(p) for p in paths]
    for i, p in enumerate(out):
        if not p or any(c.isspace() for c in p):
            raise DataError(
                f"cannot write {target}: image path {i} ({p!r}) is empty or contains whitespace, which the "
                "whitespace-separated IJB format cannot hold; rename the file"
            )
    return out


def _check_ids(values: object, n: int, target: Path, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"cannot write {target}: {what} must be {n} integers, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int64)


def _check_floats(values: object, shape: tuple[int, ...], target: Path, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.shape != shape or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise DataError(f"cannot write {target}: {what} must be numbers of shape {shape}, got {arr.dtype} {arr.shape}")
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(arr.reshape(shape[0], -1)).all(axis=1))
    if bad.size:
        raise DataError(f"cannot write {target}: {what} of row {int(bad[0])} is NaN, inf or beyond float32")
    return arr


def write_tid_mid(path: str | os.PathLike, table: pd.DataFrame) -> Path:
    """Write ``table`` (columns ``path``, ``template``, ``media``, as ``read_tid_mid`` returns) as
    ``img tid mid`` lines, atomically; returns ``path``."""
    target = Path(path)
    if not isinstance(table, pd.DataFrame) or not set(TID_MID_COLUMNS) <= set(table.columns):
        raise DataError(f"cannot write {target}: need a DataFrame with columns {list(TID_MID_COLUMNS)}")
    n = len(table)
    if n == 0:
        raise DataError(f"cannot write {target}: the table has no rows")
    paths = _check_paths(table["path"].tolist(), target)
    templates = _check_ids(table["template"].to_numpy(), n, target, "template")
    media = _check_ids(table["media"].to_numpy(), n, target, "media")
    return _write_lines(target, [f"{p} {t} {m}\n" for p, t, m in zip(paths, templates.tolist(), media.tolist())])


def write_template_pairs(path: str | os.PathLike, pairs: np.ndarray, labels: np.ndarray) -> Path:
    """Write template-id ``pairs`` (P, 2) and ``labels`` (P,) in {0, 1} as ``tid1 tid2 label`` lines, atomically."""
    target = Path(path)
    pairs = np.asarray(pairs)
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.shape[0] == 0 or not np.issubdtype(pairs.dtype, np.integer):
        raise DataError(
            f"cannot write {target}: pairs must be integer template ids (P, 2), P ≥ 1, got {pairs.dtype} {pairs.shape}"
        )
    labels = np.asarray(labels)
    if labels.shape != (pairs.shape[0],):
        raise DataError(f"cannot write {target}: labels must have shape ({pairs.shape[0]},), got {labels.shape}")
    bad = np.flatnonzero(~np.isin(labels, (0, 1)))
    if bad.size:
        raise DataError(f"cannot write {target}: label {labels[bad[0]].item()!r} of pair {int(bad[0])} must be 0 or 1")
    lab = labels.astype(np.int64).tolist()
    return _write_lines(target, [f"{a} {b} {c}\n" for (a, b), c in zip(pairs.astype(np.int64).tolist(), lab)])


def write_landmark_scores(
    path: str | os.PathLike, paths: Sequence[str], landmarks: np.ndarray, scores: np.ndarray
) -> Path:
    """Write ``img x1 y1 … x5 y5 score`` lines from image ``paths`` (N), ``landmarks`` (N, 5, 2) pixel x, y and
    faceness ``scores`` (N,), atomically; floats in their shortest float32 form."""
    target = Path(path)
    names = _check_paths(list(paths), target)
    n = len(names)
    if n == 0:
        raise DataError(f"cannot write {target}: no images given")
    points = _check_floats(landmarks, (n, NUM_LANDMARKS, 2), target, "landmarks").reshape(n, -1)
    score = _check_floats(scores, (n,), target, "scores")
    lines = [
        " ".join([name, *(str(v) for v in row), str(s)]) + "\n"  # str(np.float32): shortest round-trip form
        for name, row, s in zip(names, points, score)
    ]
    return _write_lines(target, lines)
