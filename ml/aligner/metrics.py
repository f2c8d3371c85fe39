"""Landmark-localisation metrics: NME, the cumulative error distribution (CED), its AUC and failure rate.

``nme``: mean point error over the inter-pupil distance (300-W, Sagonas et al. 2016); ``nme_box``: over the face box
``√(W·H)``, the convention of RetinaFace and the DFA paper (and of Bulat & Tzimiropoulos, ICCV 2017, whose CED stops at
0.07); ``ced_curve`` / ``auc_at`` / ``failure_rate`` as in 300-W/WFLW evaluations; ``score_auc`` (ROC AUC, faces vs
non-face crops) and ``spearman`` (score vs quality) for the face score; ``plot_ced``, the only function with I/O.
``face_box_size`` estimates ``√(W·H) ≈ FACE_BOX_112 · σ`` from the 5 points, ``σ`` the scale of the least-squares
similarity from the ArcFace-112 template onto them (rotation-invariant) and ``FACE_BOX_112 = 2·√(36·45)`` the
procedural renderer's average face box (forehead to chin, no ears or hair, like a WiderFace box).

Differences from the reference: 5 points have no outer eye corners, so ``nme`` divides by the eye-centre distance
(larger than 68-point inter-ocular NME) and is not comparable with the paper's numbers; ``nme_box`` is, in convention
only (our faces are procedural and their box estimated, not annotated). Box thresholds ``failure_box@0.05`` (the round
value nearest the inter-pupil 0.1) and ``failure_box@0.07`` / ``auc_box@0.07``; ``auc_at`` integrates the step CED
exactly instead of with the trapezoid rule.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from ml.data.procedural import ARCFACE_TEMPLATE_112
from ml.errors import DataError

__all__ = ["FACE_BOX_112", "auc_at", "ced_curve", "face_box_size", "failure_rate", "inter_pupil", "nme", "nme_box",
           "plot_ced", "score_auc", "spearman", "template_scale"]

# √(W·H) of the procedural renderer's average face box (2·36 × 2·45 canonical units) in ArcFace-112 units,
# the units of the template; docs/methods/aligner.md says how well it predicts each face's box.
FACE_BOX_112 = 2.0 * float(np.sqrt(36.0 * 45.0))


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


def template_scale(gt: np.ndarray) -> np.ndarray:
    """Scale σ (N,) of the least-squares similarity ``gt ≈ σ R(θ) T + t`` from the ArcFace-112 template ``T``
    onto each face's 5 points (pixels per template unit; Umeyama, closed form in 2-D):

        σ = √((Σ_k a_k·b_k)² + (Σ_k a_k×b_k)²) / Σ_k ‖a_k‖²,   a = T − mean(T), b = gt − mean(gt).
    """
    gt = _landmarks(gt, "gt")
    a = ARCFACE_TEMPLATE_112.astype(np.float64)
    a = a - a.mean(axis=0)  # (5, 2)
    b = gt - gt.mean(axis=1, keepdims=True)  # (N, 5, 2)
    dot = np.einsum("kc,nkc->n", a, b)
    cross = (a[None, :, 0] * b[..., 1] - a[None, :, 1] * b[..., 0]).sum(axis=1)
    return np.hypot(dot, cross) / float((a**2).sum())


def face_box_size(gt: np.ndarray) -> np.ndarray:
    """Estimated face box side ``√(W·H)`` (N,) in pixels from the 5 landmarks: ``FACE_BOX_112 · σ``
    (:func:`template_scale`; docs/methods/aligner.md gives its agreement with the renderer's own box)."""
    return FACE_BOX_112 * template_scale(gt)


def _mean_error(pred: np.ndarray, gt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean point-to-point error per face (N,), gt as float64) after the shape checks."""
    pred, gt = _landmarks(pred, "pred"), _landmarks(gt, "gt")
    if pred.shape != gt.shape:
        raise DataError(f"pred {pred.shape} and gt {gt.shape} must have the same shape")
    return np.linalg.norm(pred - gt, axis=2).mean(axis=1), gt


def nme_box(pred: np.ndarray, gt: np.ndarray, box_sizes: np.ndarray | None = None) -> np.ndarray:
    """Per-face mean error normalised by the face box, (N,).

    ``NME_box,n = (1/5) Σ_k ‖pred_nk − gt_nk‖₂ / √(W_n·H_n)`` (RetinaFace, DFA; Bulat & Tzimiropoulos 2017)
    with ``box_sizes`` the ground-truth ``√(W·H)`` per face in the landmarks' pixel frame, or when omitted
    the estimate :func:`face_box_size` of ``gt``.
    """
    err, gt = _mean_error(pred, gt)
    if box_sizes is None:
        box_sizes = face_box_size(gt)
    box = np.asarray(box_sizes, dtype=np.float64)
    if box.shape != err.shape:
        raise DataError(f"box_sizes must have one √(W·H) per face, shape {err.shape}, got {box.shape}")
    bad = np.flatnonzero(~np.isfinite(box) | (box <= 1e-9))
    if bad.size:
        raise DataError(f"box_sizes must be finite and positive; {bad.size} faces are not (e.g. rows "
                        f"{bad[:5].tolist()}): drop them or pass their boxes")
    return err / box


def nme(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Per-face normalised mean error, (N,).

    ``NME_n = (1/5) Σ_k ‖pred_nk − gt_nk‖₂ / d_n`` with ``d_n = ‖gt_n,left eye − gt_n,right eye‖₂`` the
    inter-pupil distance (eye centres; 5 points have no outer eye corners). Both in the same pixel frame.
    """
    err, gt = _mean_error(pred, gt)
    d = inter_pupil(gt)
    bad = np.flatnonzero(d <= 1e-9)
    if bad.size:
        raise DataError(
            f"gt has coincident eye centres in {bad.size} faces (e.g. rows {bad[:5].tolist()}): NME is undefined; "
            "drop them"
        )
    return err / d


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


def plot_ced(
    curves: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    max_error: float = 0.2,
    *,
    box_curves: Mapping[str, np.ndarray] | None = None,
    box_max_error: float = 0.1,
) -> Path:
    """Plot the CED of each ``name → per-face NMEs`` (inter-pupil) into a PNG at ``path`` (written atomically);
    return it. With ``box_curves`` (per-face :func:`nme_box`) a second panel shows those up to ``box_max_error``.

    Each legend gives the curve's mean NME and AUC@``max_error`` (``box_max_error``).
    """
    if not curves:
        raise DataError("plot_ced needs at least one named curve")
    if box_curves is not None and not box_curves:
        raise DataError("plot_ced box_curves, when given, needs at least one named curve")
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [(curves, max_error, "NME (inter-pupil)")]
    if box_curves is not None:
        panels.append((box_curves, box_max_error, "NME (face box √(W·H))"))
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(n for named, _, _ in panels for n in named))}
    fig = Figure(figsize=(5.0 * len(panels), 4.0), dpi=120)
    for i, (named, limit, label) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for name, errors in named.items():  # one colour per predictor in both panels
            e = _errors(errors)
            t, f = ced_curve(e, limit)
            ax.step(t, f, where="post", color=colours[name],
                    label=f"{name} (NME {e.mean():.4f}, AUC {auc_at(e, limit):.3f})")
        ax.set_xlim(0.0, limit)
        ax.set_ylim(0.0, 1.0)
        ax.set_xlabel(label)
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
