"""Landmark-localisation metrics: NME, the cumulative error distribution (CED), its AUC and failure rate.

* ``nme`` - normalised mean error per face by the inter-pupil distance (Sagonas et al., "300 Faces In-the-Wild
  Challenge", IVC 2016; the KP-RPE supplementary §3.1 reports it for DFA on WiderFace).
* ``nme_box`` - the same error divided by the face box size ``√(W·H)``, the convention of RetinaFace and the DFA
  paper (and of Bulat & Tzimiropoulos, "How far are we from solving the 2D & 3D face alignment problem?",
  ICCV 2017, whose CED and AUC stop at 0.07). ``face_box_size`` estimates ``√(W·H)`` from the 5 landmarks
  when the face box itself is not stored (below).
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
  RetinaFace/DFA's WiderFace NME (0.0518 for DFA) normalises by the face box instead: ``nme_box`` is that
  convention, ``nme`` is not comparable with the paper's numbers (and neither is comparable as data: our
  faces are procedural and their box is estimated, below).
- The box convention needs the ground-truth face box. Our unaligned set stores only the 5 landmarks, so
  ``face_box_size`` estimates the box side from them: ``√(W·H) ≈ FACE_BOX_112 · σ`` with ``σ`` the scale of
  the least-squares similarity (Umeyama) that maps the ArcFace-112 template onto the 5 points (pixels per
  template unit) and ``FACE_BOX_112 = 2·√(36·45) = 80.5`` the face box of the procedural renderer's average
  face (half width 36, half height 45 canonical units, forehead to chin; ``ml.data.unaligned.renderer_face_size``
  gives each face's exact one). σ is rotation-invariant, unlike the landmarks' bounding box. Measured on
  600 unaligned 128-px faces (50 identities, default nuisance): renderer box / estimate = 1.006 ± 0.056 (mean
  ± std), against ± 0.087 for a multiple of the inter-pupil distance (renderer box = 2.33 ± 0.20 inter-pupil
  distances) and ± 0.10 for the 5 points' bounding box. The renderer's box has no ears or hair, like a
  WiderFace box; real annotated boxes vary with the annotator, so compare box-convention numbers across
  datasets with that in mind.
- Failure thresholds: ``failure@0.1`` (inter-pupil, the 300-W/WFLW convention); in the box convention
  ``failure_box@0.05`` (≈ 0.12 inter-pupil at the ratio above: the closest round threshold to the
  inter-pupil 0.1) and ``failure_box@0.07`` / ``auc_box@0.07`` (Bulat & Tzimiropoulos' range).
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

from ml.data.procedural import ARCFACE_TEMPLATE_112
from ml.errors import DataError

__all__ = ["FACE_BOX_112", "auc_at", "ced_curve", "face_box_size", "failure_rate", "inter_pupil", "nme", "nme_box",
           "plot_ced", "score_auc", "spearman", "template_scale"]

# √(W·H) of the procedural renderer's average face box (2·36 × 2·45 canonical units) in ArcFace-112 units,
# the units of the template; see the module docstring for how well it predicts each face's box.
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
    (:func:`template_scale`; the module docstring gives its agreement with the renderer's own box)."""
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
