"""Calibrated gates of a synthetic face set: thresholds read off real faces under the same FR model.

A fixed cosine means nothing across FR models, so each gate's default threshold is a percentile of a reference:
real faces of identities the FR model never trained on, embedded by the same model in the same run.
``reference_privacy`` (per identity: the highest centre cosine to a training identity), ``nearest_same_identity``
(per face: the cosine to the nearest other face of its identity) and ``reference_consistency`` (per identity: mean
intra-class cosine) are the references of the privacy, memorisation and consistency gates; ``calibrate`` turns a
param or a reference percentile into a ``Threshold`` that says which it was (≥ 1 on a cosine, ≤ −1 for
consistency: report only). What each gate does with its threshold: ``docs/methods/generator.md``.

A copy that comes back through a latent generator's decoder loses detail: its FR cosine to the face it copies falls
to about the autoencoder's own reconstruction cosine, within the spread of two faces of one identity, so the cosine
gate cannot tell it from a lookalike. ``nearest_image`` compares pixels instead, against the training faces passed
through the same decoder (what a copy of them looks like when the generator emits it): ``pixel_copy_reference``
(per training face: the distance to the nearest *other* one) calibrates it, a face nearer a training face than
distinct training faces are to one another being a copy.

Differences from the reference: UIFace (and DCFace) filter identities with a fixed cosine to the training set chosen
by hand; neither measures memorisation face by face nor calibrates on never-trained identities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ml.errors import DataError
from ml.generator.diversity import nearest_real, per_class_consistency

__all__ = ["Threshold", "calibrate", "nearest_image", "nearest_same_identity", "pixel_copy_reference",
           "reference_consistency", "reference_privacy"]


@dataclass(frozen=True)
class Threshold:
    """A gate's threshold and where it came from: ``percentile`` of the reference (None when set by hand)."""

    value: float
    percentile: float | None
    reference_median: float
    reference_size: int

    @property
    def source(self) -> str:
        if self.percentile is None:
            return "set by hand"
        return f"p{self.percentile:g} of {self.reference_size} real reference values"


def calibrate(explicit: float | None, reference: np.ndarray, percentile: float, name: str) -> Threshold:
    """``explicit`` when given, else the ``percentile`` (0–100) of the finite values of ``reference``."""
    values = np.asarray(reference, dtype=np.float64).reshape(-1)
    values = values[np.isfinite(values)]
    if values.size == 0:
        raise DataError(f"{name}: the real reference holds no value to calibrate on (it needs never-trained "
                        "identities with ≥ 2 faces each); set the threshold by hand")
    median = float(np.median(values))
    if explicit is not None:
        return Threshold(float(explicit), None, median, int(values.size))
    return Threshold(float(np.percentile(values, percentile)), float(percentile), median, int(values.size))


def reference_privacy(emb: np.ndarray, labels: np.ndarray, train_emb: np.ndarray,
                      train_labels: np.ndarray) -> np.ndarray:
    """(C,) each never-trained identity's highest centre cosine to a training identity's centre."""
    return nearest_real(emb, labels, train_emb, train_labels)["identity_max_cos"]


def nearest_same_identity(emb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N,) cosine of each row to the nearest *other* row of its label; NaN for a label with one row."""
    x = np.asarray(emb, dtype=np.float64)
    x = x / np.linalg.norm(x, axis=1, keepdims=True).clip(1e-12)
    labels = np.asarray(labels)
    out = np.full(len(x), np.nan)
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        if rows.size < 2:
            continue
        sim = x[rows] @ x[rows].T
        np.fill_diagonal(sim, -np.inf)
        out[rows] = sim.max(axis=1)
    return out


def reference_consistency(emb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(C,) mean pairwise cosine within each never-trained identity that has ≥ 2 faces."""
    labels = np.asarray(labels)
    classes, counts = np.unique(labels, return_counts=True)
    keep = np.isin(labels, classes[counts >= 2])
    if not keep.any():
        return np.empty(0)
    return np.fromiter(per_class_consistency(np.asarray(emb)[keep], labels[keep]).values(), dtype=np.float64)


def nearest_image(faces: np.ndarray, reference: np.ndarray, *, exclude_self: bool = False,
                  chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(distance (N,), index (N,)) of each of ``faces`` (N, H, W, 3) to its nearest image of ``reference``
    (M, H, W, 3), both uint8 at one size: the root-mean-square pixel difference in [0, 1] units (0: the same image,
    ≈ 0.3 between unrelated faces). ``exclude_self``: ``faces`` is ``reference`` and each row's own image is skipped."""
    a = np.asarray(faces)
    b = np.asarray(reference)
    if a.shape[1:] != b.shape[1:]:
        raise DataError(f"nearest_image compares images of one size, got {a.shape[1:]} and {b.shape[1:]}")
    if len(b) < (2 if exclude_self else 1):
        raise DataError("nearest_image needs a reference image to compare with (two when a face is its own row)")
    x = a.reshape(len(a), -1).astype(np.float64) / 255.0
    y = b.reshape(len(b), -1).astype(np.float64) / 255.0
    y2 = (y * y).sum(axis=1)
    dist, index = np.empty(len(x)), np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), chunk):
        part = x[start:start + chunk]
        sq = (part * part).sum(axis=1)[:, None] + y2[None] - 2.0 * part @ y.T  # (n, M) squared distances
        if exclude_self:
            sq[np.arange(len(part)), np.arange(start, start + len(part))] = np.inf
        index[start:start + len(part)] = sq.argmin(axis=1)
        dist[start:start + len(part)] = np.sqrt(sq[np.arange(len(part)), index[start:start + len(part)]].clip(0.0)
                                                / x.shape[1])
    return dist, index


def pixel_copy_reference(reference: np.ndarray) -> np.ndarray:
    """(M,) each reference image's ``nearest_image`` distance to the nearest *other* one: how near distinct training
    faces come to one another, the scale a copy has to undercut."""
    return nearest_image(reference, reference, exclude_self=True)[0]
