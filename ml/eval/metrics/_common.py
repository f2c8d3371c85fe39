"""Input checks shared by the metrics (finite feature matrices, vectors, binary labels, unit rows), the FAR/FPIR
count rule, and the memory budget of one probe-by-gallery similarity block."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

# Elements of one probe-by-gallery similarity block: 2**25 float64 = 256 MiB at most, i.e. 671
# probes at a time against a 50k gallery.
_BATCH_ELEMENTS = 1 << 25


def _as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as a finite floating (N, D) array with N, D >= 1, else ValueError naming it."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (N, D) array of features; got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise ValueError(f"{name} has non-finite values (first at row {bad}); check the model output")
    return x


def _reject_zero_rows(norms: np.ndarray, name: str) -> None:
    """ValueError naming ``name`` when a row norm of ``norms`` (N,) is 0 (that row has no direction)."""
    zero = np.flatnonzero(norms == 0)
    if zero.size:
        raise ValueError(
            f"{name} has {zero.size} all-zero row(s) (first at row {int(zero[0])}); "
            "a zero feature has no direction, so its cosine similarity is undefined"
        )


def _l2_normalize(x: np.ndarray, name: str) -> np.ndarray:
    """Rows of ``x`` scaled to unit L2 norm; a zero row raises (it has no direction)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # (N, 1)
    _reject_zero_rows(norms[:, 0], name)
    return x / norms


def _as_vector(x: np.ndarray, name: str, length: int | None = None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array; got shape {x.shape}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} has {x.shape[0]} entries but {length} were expected")
    return x


def _as_binary(labels: np.ndarray, name: str, length: int) -> np.ndarray:
    """``labels`` (bool, or integers 0/1) as a bool vector of ``length`` entries."""
    labels = _as_vector(labels, name, length)
    if labels.dtype == bool:
        return labels
    is_one = labels == 1
    if not (is_one | (labels == 0)).all():
        bad = np.flatnonzero(~(is_one | (labels == 0)))[0]
        raise ValueError(
            f"{name} must hold only 1 (genuine / same) and 0 (impostor / different); "
            f"found {labels[bad].item()!r} at index {int(bad)}"
        )
    return is_one


def _allowed_false_accepts(far: float, n_impostor: int) -> int:
    """floor(far * n_impostor), with ``far`` read as the decimal it prints as.

    ``0.29 * 100`` is 28.999999999999996 in binary floating point; reading 0.29 as 29/100 gives
    the 29 that the user meant.
    """
    return math.floor(Fraction(repr(float(far))) * n_impostor)
