"""The content digest of a dataset directory (``ml.data.dataset``, ``docs/data.md``).

The sha256 over one canonical line per image, sorted by path: ``[path, sha256(encoded bytes), identity, label,
split, source, landmarks, quality, template, media, width, height]`` as compact ASCII JSON (floats as their shortest
repr, nulls as ``null``) and a newline. It changes when any pixel, label or annotation changes, not when rows are
reordered or the images are packed differently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

import numpy as np
import pandas as pd

from ml.data.manifest import MANIFEST_COLUMNS, is_null

__all__ = ["digest_line", "manifest_digest"]


def json_value(value: Any) -> Any:
    """A manifest cell as its canonical JSON value (numpy scalars and arrays as Python numbers and lists)."""
    if is_null(value):
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


def digest_line(rel: str, file_hash: str, values: Iterable[Any]) -> bytes:
    """One image's canonical line: ``[path, sha256, *the other manifest columns]`` as compact ASCII JSON + newline."""
    line = [rel, file_hash, *(json_value(v) for v in values)]
    return json.dumps(line, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode("ascii") + b"\n"


def manifest_digest(manifest: pd.DataFrame, file_hashes: dict[str, str]) -> str:
    """The digest of ``manifest``'s rows, ``file_hashes`` mapping each path to the hex sha256 of its encoded bytes."""
    columns = [c for c in MANIFEST_COLUMNS if c != "path"]
    records = []
    for rel, *values in zip(manifest["path"], *(manifest[c] for c in columns)):
        rel = str(rel)
        records.append((rel, digest_line(rel, file_hashes[rel], values)))
    h = hashlib.sha256()
    for _, line in sorted(records):
        h.update(line)
    return h.hexdigest()
