"""Fusion of per-image features into one unit template per group: the input checks, the fusers of ``FUSERS``
(average / IJB media pooling, norm-weighted, KP-RPE landmark × face score, CAFace, the quality oracle) and
``fuse_templates``. The package docstring gives each method's formula."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ml.errors import ConfigError, DataError
from ml.eval.metrics.templates import template_features
from ml.fusion.baselines import ARCFACE_TEMPLATE_112, landmark_weights
from ml.fusion.caface import CAFace
from ml.fusion.train import fuse_sets

log = logging.getLogger(__name__)

MAX_ITEMS = 1 << 16  # CAFace items per fuse_sets call: 65,536 × 512 floats = 128 MiB of features
# CN self-attention pairs per call, Σ_sets width²: 2^24 × 8 heads × 4 B = 512 MiB of attention logits
# (256 sets of 256 items, the paper's N' = 256).
MAX_ATTENTION = 1 << 24
MAX_SETS = 256  # sets per CAFace call (fuse_sets' default)


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise DataError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")


def _check_features(features: Any, name: str = "features") -> np.ndarray:
    """Finite float32 (N, D) with N, D ≥ 1 and no all-zero row; the first bad row is named."""
    x = _to_numpy(features, name)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0 or not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{name} must be a non-empty float array (N, D), got {x.dtype} {x.shape}")
    x = np.ascontiguousarray(x, dtype=np.float32)  # torch.from_numpy needs non-negative strides
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if bad.size:
        raise DataError(
            f"{name} row {int(bad[0])} is not finite (NaN or inf; {bad.size} such rows); drop or re-extract those "
            "images before fusion"
        )
    zero = np.flatnonzero(~x.any(axis=1))
    if zero.size:
        raise DataError(
            f"{name} row {int(zero[0])} is all zeros ({zero.size} such rows): a zero feature has no direction; drop "
            "or re-extract those images"
        )
    return x


@dataclass(frozen=True)
class _Groups:
    """Dense group ids of N images: ``index`` (N,) in 0..G-1, every id used."""

    index: np.ndarray  # (N,) int64
    counts: np.ndarray  # (G,) images per group, all ≥ 1

    @property
    def num(self) -> int:
        return int(self.counts.size)


def _check_groups(groups: Any, n: int, name: str = "groups") -> _Groups:
    g = _to_numpy(groups, name)
    if g.shape != (n,) or not np.issubdtype(g.dtype, np.integer):
        raise DataError(f"{name} must be integer ids of shape ({n},) (one per image), got {g.dtype} {g.shape}")
    g = np.ascontiguousarray(g, dtype=np.int64)
    if g.min() < 0:
        raise DataError(f"{name} must be ids 0..G-1, found {int(g.min())} at row {int(np.argmin(g))}")
    counts = np.bincount(g)
    empty = np.flatnonzero(counts == 0)
    if empty.size:
        raise DataError(
            f"{name} ids {empty[:5].tolist()} have no image ({empty.size} empty of {counts.size}): ids must be 0..G-1 "
            "with every id used; re-index with np.unique(ids, return_inverse=True)"
        )
    return _Groups(g, counts)


def _check_rows(x: Any, n: int, shape: tuple[int, ...], name: str, hint: str) -> np.ndarray:
    """Finite float32 array of shape (n, *shape); the first non-finite row is named."""
    arr = _to_numpy(x, name)
    if arr.shape != (n, *shape) or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise DataError(f"{name} must be a float array of shape {(n, *shape)} ({hint}), got {arr.dtype} {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(arr.reshape(n, -1)).all(axis=1))
    if bad.size:
        raise DataError(f"{name} row {int(bad[0])} is not finite ({bad.size} such rows); {hint}")
    return arr


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class _Inputs:
    """Everything a fuser may use beside the features; each fuser checks what it needs."""

    styles: Any = None
    landmarks: Any = None
    face_scores: Any = None
    model: Any = None
    image_size: float | None = None
    chunk_size: int | None = None
    media: Any = None
    h: float = 0.2
    max_items: int = MAX_ITEMS
    quality: Any = None


def _segment_sum(values: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Per-group sums (G, ...) of ``values`` (N, ...), in float64."""
    out = torch.zeros((groups.num, *values.shape[1:]), dtype=torch.float64)
    return out.index_add_(0, torch.from_numpy(groups.index), values.double())


def _fuse_average(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    if inputs.media is not None:
        media = _to_numpy(inputs.media, "media")
        if media.shape != (features.shape[0],):
            raise DataError(f"media must have one id per image, shape ({features.shape[0]},), got {media.shape}")
        try:
            ids, pooled = template_features(features, groups.index, media)
        except ValueError as exc:  # a template whose media means cancel out
            raise DataError(f"average fusion with media pooling: {exc}") from exc
        assert np.array_equal(ids, np.arange(groups.num)), "dense group ids pool to rows 0..G-1"
        return pooled
    units = F.normalize(torch.from_numpy(features), dim=1)
    return _segment_sum(units, groups).numpy()


def _fuse_norm_weighted(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    return _segment_sum(torch.from_numpy(features), groups).numpy()


def _landmark_score_weights(
    landmarks: Any, face_scores: Any, n: int, image_size: float | None, h: float
) -> torch.Tensor:
    """Checked KP-RPE weights ``w_i = d_i·s_i`` (N,) float32 (supp. Eq. 17 × face score) of N images."""
    if landmarks is None:
        raise DataError("landmark_score fusion needs landmarks (N, 5, 2) pixel x, y per image (ArcFace order)")
    hint = "pixel (x, y) of the 5 ArcFace landmarks; re-run the detector on those images or drop them"
    points = torch.from_numpy(_check_rows(landmarks, n, (5, 2), "landmarks", hint))
    if face_scores is None:
        scores = torch.ones(n)
    else:
        scores = torch.from_numpy(_check_rows(face_scores, n, (), "face_scores", "the detector's faceness score"))
        if bool((scores < 0).any()):
            row = int(torch.nonzero(scores < 0)[0])
            raise DataError(f"face_scores row {row} is negative ({float(scores[row])}); detector scores must be ≥ 0")
    size = 112.0 if image_size is None else float(image_size)
    if not size > 0:
        raise ConfigError(f"image_size must be positive (the side of the images the landmarks are in), got {size}")
    template = torch.tensor(ARCFACE_TEMPLATE_112, dtype=torch.float32) * (size / 112.0)  # (5, 2) in this frame
    return landmark_weights(points[None], scores[None], template, h, image_size=size)[0]  # (N,)


def _weighted_fusion(features: np.ndarray, groups: _Groups, weights: torch.Tensor, floor: float, what: str
                     ) -> np.ndarray:
    """``Σ_i w_i·f̄_i`` per group (G, D); a group whose weights sum to ≤ ``floor`` gets ``Σ_i f̄_i`` (logged)."""
    units = F.normalize(torch.from_numpy(features), dim=1)
    fused = _segment_sum(weights[:, None] * units, groups)  # (G, D)
    degenerate = _segment_sum(weights, groups) <= floor  # (G,)
    if bool(degenerate.any()):
        log.warning("%d group(s) have %s; using the plain average for them", int(degenerate.sum()), what)
        fused = torch.where(degenerate[:, None], _segment_sum(units, groups), fused)
    return fused.numpy()


def _fuse_landmark_score(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    n = features.shape[0]
    weights = _landmark_score_weights(inputs.landmarks, inputs.face_scores, n, inputs.image_size, inputs.h)
    return _weighted_fusion(features, groups, weights, 0.0, "all landmark-score weights 0")


def _caface_batches(counts: np.ndarray, width: Callable[[int], int], max_items: int) -> list[np.ndarray]:
    """Groups sorted by length, cut into batches of at most ``MAX_SETS`` groups whose padded call of ``b`` sets
    of width ``w`` (the widest group's items per call) has ``b·w ≤ max_items`` and ``b·w² ≤ MAX_ATTENTION``;
    a group over either limit on its own goes alone (stream it with ``chunk_size`` to bound it)."""
    order = np.argsort(counts, kind="stable")
    batches: list[np.ndarray] = []
    lo = 0
    while lo < order.size:
        hi = lo + 1
        while hi < order.size and hi - lo < MAX_SETS:
            b, w = hi - lo + 1, width(int(counts[order[hi]]))
            if b * w > max_items or b * w * w > MAX_ATTENTION:
                break
            hi += 1
        batches.append(order[lo:hi])
        lo = hi
    return batches


def _check_caface(model: Any) -> CAFace:
    if not isinstance(model, CAFace):
        raise ConfigError(
            f"caface fusion needs a trained CAFace model (ml.fusion.load_caface), got {type(model).__name__}"
        )
    return model


def _caface_styles(model: CAFace, features: np.ndarray, styles: Any) -> np.ndarray:
    """Checked styles (N, style_dim, 2) float32 of ``features`` (N, D) for ``model``."""
    if features.shape[1] != model.feature_dim:
        raise DataError(
            f"features have {features.shape[1]} channels but the CAFace model was trained on {model.feature_dim}; "
            "use the backbone the fusion model was trained on"
        )
    if styles is None:
        raise DataError("caface fusion needs styles (N, style_dim, 2); get them with features_and_styles")
    return _check_rows(
        styles, features.shape[0], (model.style_dim, 2), "styles",
        f"per-image (mean, std) of the backbone's {model.style_dim} style channels, from features_and_styles",
    )


def _fuse_caface(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    model = _check_caface(inputs.model)
    styles = _caface_styles(model, features, inputs.styles)
    d = features.shape[1]
    chunk = inputs.chunk_size
    if chunk is not None:
        chunk = _positive_int(chunk, "chunk_size")
    max_items = _positive_int(inputs.max_items, "max_items")
    order = np.argsort(groups.index, kind="stable")  # rows of each group, in their given order
    starts = np.cumsum(groups.counts) - groups.counts
    out = np.empty((groups.num, d), dtype=np.float32)
    for batch in _caface_batches(groups.counts, lambda c: c if chunk is None else min(c, chunk), max_items):
        rows = np.concatenate([order[starts[g] : starts[g] + groups.counts[g]] for g in batch])
        local = np.repeat(np.arange(batch.size), groups.counts[batch])
        out[batch] = fuse_sets(model, features[rows], styles[rows], local, chunk, sets_per_batch=int(batch.size))
    return out


def _quality_weights(quality: Any, n: int, when: str = "") -> torch.Tensor:
    """Checked ``quality_oracle`` weights (n,) float32: the renderer's true quality of each image, ≥ 0."""
    if quality is None:
        raise DataError(f"quality_oracle fusion needs quality (N,){when}: the renderer's true quality of each image; "
                        "pass quality=... or leave quality_oracle out")
    weights = torch.from_numpy(_check_rows(quality, n, (), "quality", "the renderer's true quality of each image"))
    if bool((weights < 0).any()):
        row = int(torch.nonzero(weights < 0)[0])
        raise DataError(f"quality row {row} is negative ({float(weights[row])}); qualities lie in [0, 1]")
    return weights


def _fuse_quality_oracle(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    weights = _quality_weights(inputs.quality, features.shape[0])
    return _weighted_fusion(features, groups, weights, 1e-12, "quality 0 in every image")


# Fusion registry: name → fuser(features (N, D), groups, inputs) → unnormalised or unit templates (G, D).
FUSERS: dict[str, Callable[[np.ndarray, _Groups, _Inputs], np.ndarray]] = {
    "average": _fuse_average,
    "norm_weighted": _fuse_norm_weighted,
    "landmark_score": _fuse_landmark_score,
    "caface": _fuse_caface,
    "quality_oracle": _fuse_quality_oracle,
}
FUSION_METHODS: tuple[str, ...] = tuple(FUSERS)
STREAM_METHODS: tuple[str, ...] = FUSION_METHODS  # FusionStream fuses every method


def fuse_templates(
    method: str,
    features: np.ndarray | torch.Tensor,
    groups: np.ndarray | torch.Tensor,
    *,
    styles: np.ndarray | torch.Tensor | None = None,
    landmarks: np.ndarray | torch.Tensor | None = None,
    face_scores: np.ndarray | torch.Tensor | None = None,
    model: CAFace | None = None,
    image_size: float | None = None,
    chunk_size: int | None = None,
    media: np.ndarray | None = None,
    h: float = 0.2,
    max_items: int = MAX_ITEMS,
    quality: np.ndarray | None = None,
) -> np.ndarray:
    """Unit-norm templates (G, D) float32 of the images ``features`` (N, D) grouped by ``groups`` (N,) ∈ 0..G-1.

    ``method`` is a key of ``FUSERS`` (see the module docstring for each formula). What each needs:
    ``quality_oracle``: ``quality`` (N,) ≥ 0, the renderer's true quality (a headroom reference, not a method);
    ``landmark_score``: ``landmarks`` (N, 5, 2) pixels in images of side ``image_size`` (default 112) and
    optionally ``face_scores`` (N,) ≥ 0 (default 1); ``caface``: ``model`` (a CAFace), ``styles``
    (N, style_dim, 2) and optionally ``chunk_size`` (stream each group in chunks; None = one call per group)
    and ``max_items`` (items per CAFace call); ``average``: optionally ``media`` (N,) for IJB
    media-then-template pooling. Inputs a method does not use are ignored, except ``media`` (only ``average``
    defines media pooling). Row ``g`` is group ``g``.
    """
    if method not in FUSERS:
        raise ConfigError(f"unknown fusion method {method!r}; choose one of {', '.join(FUSERS)}")
    if media is not None and method != "average":
        raise ConfigError(f"media pooling is defined for 'average' only, not {method!r}; pass media=None")
    feats = _check_features(features)
    grp = _check_groups(groups, feats.shape[0])
    inputs = _Inputs(styles, landmarks, face_scores, model, image_size, chunk_size, media, h, max_items, quality)
    fused = torch.from_numpy(np.asarray(FUSERS[method](feats, grp, inputs), dtype=np.float64))
    norms = fused.norm(dim=1)
    zero = torch.nonzero(norms <= 1e-12).flatten()
    if zero.numel():
        raise DataError(
            f"group {int(zero[0])} fuses to the zero vector with {method!r} ({zero.numel()} such groups): its features "
            "cancel out; check its images"
        )
    return (fused / norms[:, None]).float().numpy()
