"""The DFA aligner measured on held-out crops: NME in the inter-pupil and face-box conventions, failure rates and
CED areas, the best-scoring-anchor read-out, and its face score against non-face crops and the faces' quality."""

from __future__ import annotations

from typing import Any

import numpy as np

from ml.errors import DataError
from ml.aligner.metrics import auc_at, failure_rate, nme, nme_box, score_auc, spearman
from ml.aligner.dfa import DFA
from ml.aligner.data import check_images, check_landmarks

__all__ = ["evaluate_aligner"]


def evaluate_aligner(
    model: DFA,
    images: np.ndarray,
    landmarks_px: np.ndarray,
    batch_size: int = 128,
    *,
    nonfaces: np.ndarray | None = None,
    qualities: np.ndarray | None = None,
    top_anchor: bool = False,
) -> dict[str, Any]:
    """NME and face-score summary of ``model`` on uint8 crops (N, H, W, 3) with pixel ground truth (N, 5, 2).

    Returns ``{"nme": mean, "failure@0.1": rate, "auc@0.1": area}`` in the inter-pupil convention, the same in
    the face-box convention (``ml.aligner.metrics.nme_box``, box estimated from the ground truth): ``"nme_box"``,
    ``"failure_box@0.05"``, ``"failure_box@0.07"``, ``"auc_box@0.07"``; ``"face_score_mean"`` (mean pooled
    score) and the per-face arrays ``"nmes"``, ``"nmes_box"``. With ``top_anchor`` also the single-detection
    read-out of the same model (``DFA.top_anchor``): ``"nme_top_anchor"``, ``"nme_box_top_anchor"``,
    ``"failure_box@0.05_top_anchor"`` and ``"nmes_box_top_anchor"``. With uint8 non-face crops ``nonfaces``
    (M, H', W', 3) also ``"face_auc"`` (ROC AUC of the pooled score, faces positive), ``"face_accuracy@0.5"``
    (share of the N + M crops on the right side of 0.5) and ``"nonface_score_mean"``; with per-face
    ``qualities`` (N,) ``"score_quality_spearman"`` (Spearman's ρ between score and quality; NaN if either is
    constant).
    """
    check_images(images, "evaluation images")
    gt = check_landmarks(landmarks_px, images, "evaluation landmarks")
    pred, scores = model.predict(images, batch_size=batch_size)
    errors, box_errors = nme(pred, gt), nme_box(pred, gt)
    out: dict[str, Any] = {"nme": float(errors.mean()), "failure@0.1": failure_rate(errors, 0.1),
                           "auc@0.1": auc_at(errors, 0.1), "nme_box": float(box_errors.mean()),
                           "failure_box@0.05": failure_rate(box_errors, 0.05),
                           "failure_box@0.07": failure_rate(box_errors, 0.07), "auc_box@0.07": auc_at(box_errors, 0.07),
                           "face_score_mean": float(scores.mean())}
    if top_anchor:
        top, _ = model.predict(images, batch_size=batch_size, readout="top_anchor")
        top_box = nme_box(top, gt)
        out.update({"nme_top_anchor": float(nme(top, gt).mean()), "nme_box_top_anchor": float(top_box.mean()),
                    "failure_box@0.05_top_anchor": failure_rate(top_box, 0.05), "nmes_box_top_anchor": top_box})
    if nonfaces is not None:
        check_images(nonfaces, "non-face images")
        _, neg = model.predict(nonfaces, batch_size=batch_size)
        out.update({
            "face_auc": score_auc(scores, neg),
            "face_accuracy@0.5": float(((scores >= 0.5).sum() + (neg < 0.5).sum()) / (len(scores) + len(neg))),
            "nonface_score_mean": float(neg.mean()),
        })
    if qualities is not None:
        qualities = np.asarray(qualities, dtype=np.float64)
        if qualities.shape != scores.shape:
            raise DataError(f"qualities must have one value per evaluation image, shape {scores.shape}, got "
                            f"{qualities.shape}")
        out["score_quality_spearman"] = spearman(scores, qualities)
    out["nmes"], out["nmes_box"] = errors, box_errors
    return out
