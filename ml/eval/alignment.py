"""Landmark-localisation metrics: NME, the cumulative error distribution (CED), its AUC and failure rate.

* ``nme`` - normalised mean error per face (Sagonas et al., "300 Faces In-the-Wild Challenge", IVC 2016;
  the KP-RPE supplementary §3.1 reports it for DFA on WiderFace).
* ``ced_curve`` / ``auc_at`` / ``failure_rate`` - the CED and its summary numbers as in 300-W/WFLW
  evaluations (Wu et al., "Look at Boundary", CVPR 2018): fraction of faces with NME ≤ t, the area under
  that curve up to ``max_error`` divided by ``max_error``, and the fraction above a threshold.
* ``score_auc`` / ``spearman`` - how well an aligner's face score separates face crops from non-face
  crops (ROC AUC, the Mann–Whitney statistic) and how it ranks faces by quality (Spearman's ρ).
* ``plot_ced`` - CED curves of several predictors in one PNG (the only function here that does I/O).

Differences from the reference
------------------------------
- With 5 points there are no outer eye corners, so the "inter-ocular" normaliser is the distance
  between the two eye centres (inter-pupil), a larger error per pixel than 68-point inter-ocular NME.
  RetinaFace/DFA's WiderFace NME (0.0518 for DFA) normalises by the face box instead, so the numbers
  are not comparable with the paper's.
- ``auc_at`` integrates the CED exactly (a step function) instead of with the trapezoid rule over a
  threshold grid.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from ml.errors import DataError

__all__ = ["auc_at", "ced_curve", "failure_rate", "inter_pupil", "nme", "plot_ced", "score_auc", "spearman"]


def _landmarks(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3 or x.shape[1:] != (5, 2):
        raise DataError(f"{name} must have shape (N, 5, 2) (pixel x, y in ArcFace order), got {x.shape}")
    bad = np.flatnonzero(~np.isfinite(x).all(axis=(1, 2)))
    if bad.size:
        raise DataError(f"{name} has non-finite values in {bad.size} faces (e.g. rows {bad[:5].tolist()}); drop them")
    return x


def _errors(nmes: np.ndarray) -> np.ndarray:
    e = np.asarray(nmes, dtype=np.float64)
    if e.ndim != 1 or e.size == 0:
        raise DataError(f"nmes must be a non-empty 1-D array of per-face errors, got shape {e.shape}")
    if not np.all(np.isfinite(e)) or np.any(e < 0):
        raise DataError("nmes must be finite and non-negative; compute them with nme()")
    return e


def inter_pupil(gt: np.ndarray) -> np.ndarray:
    """Distance between the two eye centres (landmarks 0 and 1) of each face: (N,)."""
    gt = _landmarks(gt, "gt")
    return np.linalg.norm(gt[:, 0] - gt[:, 1], axis=1)


def nme(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Per-face normalised mean error, (N,).

    ``NME_n = (1/5) Σ_k ‖pred_nk − gt_nk‖₂ / d_n`` with ``d_n = ‖gt_n,left eye − gt_n,right eye‖₂`` the
    inter-pupil distance (eye centres; 5 points have no outer eye corners). Both in the same pixel frame.
    """
    pred, gt = _landmarks(pred, "pred"), _landmarks(gt, "gt")
    if pred.shape != gt.shape:
        raise DataError(f"pred {pred.shape} and gt {gt.shape} must have the same shape")
    d = inter_pupil(gt)
    bad = np.flatnonzero(d <= 1e-9)
    if bad.size:
        raise DataError(
            f"gt has coincident eye centres in {bad.size} faces (e.g. rows {bad[:5].tolist()}): NME is undefined; "
            "drop them"
        )
    return np.linalg.norm(pred - gt, axis=2).mean(axis=1) / d


def ced_curve(nmes: np.ndarray, max_error: float = 0.2, steps: int = 201) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative error distribution: ``thresholds = linspace(0, max_error, steps)`` and
    ``fraction[i] = #{n : NME_n ≤ thresholds[i]} / N``."""
    e = _errors(nmes)
    if not max_error > 0 or steps < 2:
        raise DataError(f"ced_curve needs max_error > 0 and steps ≥ 2, got {max_error}, {steps}")
    thresholds = np.linspace(0.0, max_error, steps)
    fraction = np.searchsorted(np.sort(e), thresholds, side="right") / e.size
    return thresholds, fraction


def failure_rate(nmes: np.ndarray, threshold: float = 0.1) -> float:
    """Fraction of faces with ``NME > threshold``."""
    return float(np.mean(_errors(nmes) > threshold))


def auc_at(nmes: np.ndarray, max_error: float = 0.1) -> float:
    """Area under the CED on [0, max_error] divided by max_error, in [0, 1] (1 = every face exact).

    Exact for the step-function CED: ``(1/T) ∫₀ᵀ F(t) dt = mean_n max(0, T − NME_n) / T``.
    """
    e = _errors(nmes)
    if not max_error > 0:
        raise DataError(f"auc_at needs max_error > 0, got {max_error}")
    return float(np.mean(np.clip(max_error - e, 0.0, None)) / max_error)


def _scores(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise DataError(f"{name} must be a non-empty 1-D array of finite scores, got shape {x.shape}")
    return x


def score_auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """ROC AUC of a score with ``positive`` (e.g. face crops) above ``negative`` (non-face crops):
    ``P(s⁺ > s⁻) + ½ P(s⁺ = s⁻)`` over all pairs (``sklearn.metrics.roc_auc_score``)."""
    pos, neg = _scores(positive, "positive"), _scores(negative, "negative")
    labels = np.r_[np.ones(pos.size), np.zeros(neg.size)]
    return float(roc_auc_score(labels, np.concatenate([pos, neg])))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson's r of the tie-averaged ranks, ``scipy.stats.spearmanr``); NaN if either
    is constant."""
    a, b = _scores(a, "a"), _scores(b, "b")
    if a.shape != b.shape:
        raise DataError(f"spearman needs two arrays of the same length, got {a.shape} and {b.shape}")
    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def plot_ced(curves: Mapping[str, np.ndarray], path: str | os.PathLike, max_error: float = 0.2) -> Path:
    """Plot the CED of each ``name → per-face NMEs`` into a PNG at ``path`` (written atomically); return it.

    The legend gives each curve's mean NME and AUC@``max_error``.
    """
    if not curves:
        raise DataError("plot_ced needs at least one named curve")
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(5.0, 4.0), dpi=120)
    ax = fig.add_subplot()
    for name, errors in curves.items():
        e = _errors(errors)
        t, f = ced_curve(e, max_error)
        ax.step(t, f, where="post", label=f"{name} (NME {e.mean():.4f}, AUC {auc_at(e, max_error):.3f})")
    ax.set_xlim(0.0, max_error)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("NME (inter-pupil)")
    ax.set_ylabel("fraction of faces")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
