"""What a learned set fusion does, not only what it scores: CAFace's per-frame weights and cluster use, and the
statistics that say whether a rank-1 gain over averaging is more than noise.

- :func:`caface_frame_weights` — for each set, in eval mode and one call per set, CAFace's effective weight of
  every frame ``w_i = Σ_m P̄_m · A_{m,i} / max(1, c_m)`` (``P̄_m`` the channel mean of the AGN's cluster weights,
  ``A`` the assignment, ``c_m = Σ_i A_{m,i}``: the template is ``≈ Σ_i w_i f̄_i``), the normalised entropy of each
  frame's assignment over the ``M`` clusters, and each set's cluster usage ``c_m / Σ c``.
- :func:`caface_diagnostics` — summaries: the mean within-set Spearman ρ between a frame's weight and its true
  quality (``weight_quality_spearman``: > 0 when CAFace weights good frames up, the paper's mechanism), the
  mean frame assignment entropy and the mean cluster-usage entropy (both / log M: 0 = every frame in one
  cluster, 1 = spread evenly), ``effective_clusters = exp(usage entropy)``, the mean within-set coefficient of
  variation of the weights (0 = every frame weighted equally, i.e. averaging) and the ratio of the mean weight of
  a set's usable frames (quality ≥ ``usable``) to that of its other frames.
- :func:`rank1_hits` and :func:`paired_difference` — per-probe closed-set rank-1 hits and the paired difference
  of two fusions over the same probes with a percentile-bootstrap 95 % interval; :func:`wilson_interval` the
  Wilson interval of one rate (``scipy.stats.binomtest``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from scipy.stats import binomtest, spearmanr

from ml.errors import DataError
from ml.fusion.caface import CAFace, FusionState

__all__ = ["USABLE_QUALITY", "caface_diagnostics", "caface_frame_weights", "paired_difference", "rank1_hits", "wilson_interval"]


USABLE_QUALITY = 0.3  # a frame of at least this true quality counts as usable in ``usable_weight_ratio``


@torch.no_grad()
def caface_frame_weights(model: CAFace, features: np.ndarray, styles: np.ndarray,
                         groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(effective weight per frame (N,), normalised assignment entropy per frame (N,), cluster usage (M,) per set)
    for the sets ``groups`` (N,) ∈ 0..G-1, each fused in one call in eval mode (the model's mode is restored)."""
    groups = np.asarray(groups)
    if groups.shape != (features.shape[0],):
        raise DataError(f"groups must give one set id per frame ({features.shape[0]},), got {groups.shape}")
    was_training = model.training
    model.eval()
    device = model.cn.centres.device
    weights = np.zeros(features.shape[0], dtype=np.float64)
    entropy = np.zeros(features.shape[0], dtype=np.float64)
    usage: list[np.ndarray] = []
    log_m = math.log(model.num_clusters)
    try:
        for g in np.unique(groups):
            rows = np.flatnonzero(groups == g)
            f = torch.from_numpy(np.ascontiguousarray(features[rows])).float()[None].to(device)
            s = torch.from_numpy(np.ascontiguousarray(styles[rows])).float()[None].to(device)
            out = model.cluster(f, s)
            _, p = model.aggregate(FusionState(out.count, out.features, out.styles))  # P (1, M, D)
            a = out.assignment[0].double().cpu()  # (M, n)
            share = p[0].double().mean(dim=1).cpu()  # (M,)
            w = (share[:, None] * a / out.count[0].double().cpu().clamp_min(1.0)[:, None]).sum(dim=0)
            weights[rows] = (w / w.sum()).numpy()
            entropy[rows] = (-(a * a.clamp_min(1e-12).log()).sum(dim=0) / log_m).numpy()
            usage.append((a.sum(dim=1) / a.sum()).numpy())
    finally:
        model.train(was_training)
    return weights, entropy, usage


def caface_diagnostics(model: CAFace, features: np.ndarray, styles: np.ndarray, groups: np.ndarray,
                       quality: np.ndarray, usable: float = USABLE_QUALITY) -> dict[str, float]:
    """Summaries of :func:`caface_frame_weights` against each frame's true ``quality`` (N,) (see the module
    docstring); sets whose qualities or weights are all equal are left out of the Spearman mean."""
    weights, entropy, usage = caface_frame_weights(model, features, styles, groups)
    groups, quality = np.asarray(groups), np.asarray(quality, dtype=np.float64)
    rhos, cvs, ratios = [], [], []
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        w, q = weights[rows], quality[rows]
        cvs.append(float(w.std() / w.mean()) if w.mean() > 0 else 0.0)
        # ρ is undefined for equal weights (averaging); float noise of ~1e-17 between equal weights is no ranking
        if np.ptp(q) > 0 and np.ptp(w) > 1e-9 * np.abs(w).max():
            rhos.append(float(spearmanr(w, q).statistic))
        good = q >= usable
        if good.any() and not good.all():
            ratios.append(float(w[good].mean() / max(w[~good].mean(), 1e-12)))
    log_m = math.log(model.num_clusters)
    usage_entropy = np.array([-(u * np.log(np.clip(u, 1e-12, None))).sum() / log_m for u in usage])
    nan = float("nan")
    return {
        "weight_quality_spearman": float(np.mean(rhos)) if rhos else nan,
        "weight_cv": float(np.mean(cvs)),
        "usable_weight_ratio": float(np.mean(ratios)) if ratios else nan,
        "assignment_entropy": float(entropy.mean()),
        "cluster_usage_entropy": float(usage_entropy.mean()),
        "effective_clusters": float(np.exp(usage_entropy * log_m).mean()),
    }


def rank1_hits(probes: np.ndarray, probe_ids: np.ndarray, gallery: np.ndarray, gallery_ids: np.ndarray) -> np.ndarray:
    """(P_mated,) bool: for each probe whose id is enrolled (in order), whether its most similar gallery template
    (unit templates, cosine) has its identity."""
    probe_ids, gallery_ids = np.asarray(probe_ids), np.asarray(gallery_ids)
    mated = np.isin(probe_ids, gallery_ids)
    scores = probes[mated] @ gallery.T
    return gallery_ids[np.argmax(scores, axis=1)] == probe_ids[mated]


def wilson_interval(hits: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of the rate ``hits.mean()``."""
    hits = np.asarray(hits, dtype=bool)
    if hits.size == 0:
        raise DataError("wilson_interval needs at least one trial")
    ci = binomtest(int(hits.sum()), int(hits.size)).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def paired_difference(a: np.ndarray, b: np.ndarray, *, resamples: int = 2000, seed: int = 0,
                      confidence: float = 0.95) -> dict[str, float]:
    """Mean of ``a − b`` over paired trials (e.g. two fusions' rank-1 hits on the same probes) with a percentile
    bootstrap interval over the trials: ``{"mean", "ci_low", "ci_high"}``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise DataError(f"paired_difference needs two equal-length 1-D arrays, got {a.shape} and {b.shape}")
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(resamples, diff.size))].mean(axis=1)
    tail = 100 * (1 - confidence) / 2
    return {"mean": float(diff.mean()), "ci_low": float(np.percentile(means, tail)),
            "ci_high": float(np.percentile(means, 100 - tail))}
