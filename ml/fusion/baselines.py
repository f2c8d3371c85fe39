"""Training-free set fusion baselines: average, norm-weighted average, KP-RPE landmark-score fusion.

Sets of features (B, N, D) [+ ``mask`` (B, N), True = real item] → L2-normalised templates (B, D); the papers'
``1/N`` is dropped (only the direction is compared). With ``f̄_i = f_i/‖f_i‖``:

- ``average_fusion``: ``normalize(Σ_i f̄_i)``.
- ``norm_weighted_fusion``: ``normalize(Σ_i ‖f_i‖·f̄_i) = normalize(Σ_i f_i)`` (KP-RPE supp. Eq. 16; CAFace Sec. 2).
- ``landmark_score_fusion`` (KP-RPE supp. Eq. 17–18): ``normalize(Σ_i d_i·s_i·f̄_i)``, ``s_i`` the face score and
  ``d_i = (h − min(‖L_i − L̂‖₂, h))/h`` (h = 0.2), the 5 landmarks ``L_i`` and ArcFace template ``L̂`` in [0, 1]²,
  ``‖·‖₂`` over the flattened 10-vector: 1 on the template, 0 once 0.2 away in total.

Differences from the reference (KP-RPE supplementary, Sec. 4):
- A set whose weights are all 0 falls back to ``average_fusion`` (logged) instead of Eq. 18's zero vector.
- Landmarks are given in pixels with ``image_size`` (112 by default); the [0, 1] normalisation is done here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ml.errors import DataError

log = logging.getLogger(__name__)

# ArcFace 112×112 alignment template, pixels: left eye, right eye, nose, left mouth, right mouth.
ARCFACE_TEMPLATE_112: tuple[tuple[float, float], ...] = (
    (38.2946, 51.6963), (73.5318, 51.5014), (56.0252, 71.7366), (41.5493, 92.3655), (70.7299, 92.2041),
)


def _check_features(features: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate sets (B, N, D) and mask (B, N); return float features and a bool mask."""
    if not isinstance(features, torch.Tensor) or not features.is_floating_point() or features.ndim != 3:
        desc = f"{type(features).__name__} {getattr(features, 'dtype', '')} {tuple(getattr(features, 'shape', ()))}"
        raise DataError(f"features must be a float tensor (B, N, D) of sets, got {desc}")
    b, n, _ = features.shape
    if b == 0 or n == 0:
        raise DataError(f"features {tuple(features.shape)} hold no items; every set needs at least one image")
    if mask is None:
        mask = torch.ones(b, n, dtype=torch.bool, device=features.device)
    elif not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != (b, n):
        raise DataError(f"mask must be a bool tensor (B, N) = {(b, n)}, got {getattr(mask, 'dtype', mask)!r}")
    empty = torch.nonzero(~mask.any(dim=1)).flatten()
    if empty.numel():
        raise DataError(f"sets {empty[:5].tolist()} have no items (mask all False); drop empty sets first")
    bad = mask & ~torch.isfinite(features).all(dim=-1)
    if bad.any():
        s, t = (int(i) for i in torch.nonzero(bad)[0])
        raise DataError(f"non-finite feature at set {s}, item {t}; drop or re-extract that image before fusion")
    return features.masked_fill(~mask[..., None], 0.0), mask


def average_fusion(features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of the L2-normalised features, ``normalize(Σ_i f_i/‖f_i‖)`` → (B, D)."""
    features, _ = _check_features(features, mask)
    return F.normalize(F.normalize(features, dim=-1).sum(dim=1), dim=-1)


def norm_weighted_fusion(features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Norm-weighted mean ``normalize(Σ_i ‖f_i‖·f̄_i) = normalize(Σ_i f_i)`` (KP-RPE supp. Eq. 16) → (B, D)."""
    features, _ = _check_features(features, mask)
    return F.normalize(features.sum(dim=1), dim=-1)


def landmark_weights(
    landmarks: torch.Tensor,
    face_scores: torch.Tensor,
    template: torch.Tensor | Sequence[Sequence[float]] = ARCFACE_TEMPLATE_112,
    h: float = 0.2,
    image_size: float | tuple[float, float] = 112.0,
) -> torch.Tensor:
    """KP-RPE supp. Eq. 17 times the face score: ``w_i = d_i·s_i``, ``d_i = (h − min(‖L_i − L̂‖₂, h))/h`` → (B, N).

    ``landmarks`` (B, N, 5, 2) and ``template`` (5, 2) in pixels (x, y) of an image of ``image_size``
    (side, or (width, height)); both are divided by it, and the norm is over the 10 flattened coordinates.
    """
    if not isinstance(landmarks, torch.Tensor) or landmarks.ndim != 4 or landmarks.shape[-2:] != (5, 2):
        raise DataError(
            f"landmarks must be (B, N, 5, 2) pixel coordinates (ArcFace order), got {tuple(getattr(landmarks, 'shape', ()))}"
        )
    if not isinstance(face_scores, torch.Tensor) or tuple(face_scores.shape) != tuple(landmarks.shape[:2]):
        raise DataError(
            f"face_scores must be (B, N) = {tuple(landmarks.shape[:2])}, got {tuple(getattr(face_scores, 'shape', ()))}"
        )
    if not h > 0:
        raise DataError(f"h must be positive (KP-RPE uses 0.2), got {h}")
    template = torch.as_tensor(template, dtype=landmarks.dtype, device=landmarks.device)
    if tuple(template.shape) != (5, 2):
        raise DataError(f"template must be 5 (x, y) points, got shape {tuple(template.shape)}")
    size = torch.as_tensor(image_size, dtype=landmarks.dtype, device=landmarks.device).reshape(-1)  # (1,) or (2,)
    if not bool((size > 0).all()):
        raise DataError(f"image_size must be positive, got {image_size}")
    distance = ((landmarks - template) / size).flatten(-2).norm(dim=-1)  # (B, N), ‖L_i − L̂‖₂ in [0,1] units
    d = (h - distance.clamp(max=h)) / h  # (B, N) in [0, 1]
    return d * face_scores


def landmark_score_fusion(
    features: torch.Tensor,
    landmarks: torch.Tensor,
    face_scores: torch.Tensor,
    template: torch.Tensor | Sequence[Sequence[float]] = ARCFACE_TEMPLATE_112,
    h: float = 0.2,
    *,
    image_size: float | tuple[float, float] = 112.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """KP-RPE landmark-score fusion (supp. Eq. 18): ``normalize(Σ_i d_i·s_i·f̄_i)`` → (B, D).

    Sets whose weights are all 0 fall back to ``average_fusion``. Weights of padded items are ignored.
    """
    features, mask = _check_features(features, mask)
    weights = landmark_weights(landmarks.to(features.dtype), face_scores.to(features.dtype), template, h, image_size)
    weights = weights.masked_fill(~mask, 0.0)  # (B, N)
    bad = mask & ~torch.isfinite(weights)
    if bad.any():
        s, t = (int(i) for i in torch.nonzero(bad)[0])
        raise DataError(f"non-finite landmarks or face score at set {s}, item {t}; re-run the detector on that image")
    units = F.normalize(features, dim=-1)  # (B, N, D)
    fused = (weights.unsqueeze(-1) * units).sum(dim=1)  # (B, D)
    degenerate = weights.sum(dim=1) <= 0  # (B,)
    if degenerate.any():
        log.warning("%d set(s) have all landmark-score weights 0; using the plain average for them", int(degenerate.sum()))
        fused = torch.where(degenerate.unsqueeze(-1), units.sum(dim=1), fused)
    return F.normalize(fused, dim=-1)


__all__ = [
    "ARCFACE_TEMPLATE_112",
    "average_fusion",
    "landmark_score_fusion",
    "landmark_weights",
    "norm_weighted_fusion",
]
