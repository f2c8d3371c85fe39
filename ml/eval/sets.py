"""Set and video benchmarks over precomputed per-image features: fusion into templates, IJB 1:1 template
verification, video (probe-set) identification, CAFace's gain versus probe size and its robustness to frame order.

The pipeline is: ``features_and_styles`` (images → unnormalised features (N, D) and CAFace styles
(N, style_dim, 2), once) → ``fuse_templates`` (images grouped by template / probe id → unit templates (G, D))
→ ``template_verification`` (pairs of templates, TAR@FAR) or ``video_identification`` (probe templates
against gallery templates, rank-N and TPIR@FPIR). Every fusion works on the stored features, so the
backbone runs once whatever the number of fusion methods, probe sizes or shuffles compared.

Fusion methods (``FUSERS``), for a group ``g`` with images ``i ∈ g``, ``f̄_i = f_i/‖f_i‖``:

- ``average``: ``normalize(Σ_i f̄_i)``; with ``media`` the IJB media-then-template pooling
  ``normalize(Σ_m mean_{i∈m} f̄_i)`` (``ml.eval.metrics.template_features``): a video counts as one still.
- ``norm_weighted``: ``normalize(Σ_i f_i)`` (KP-RPE supp. Eq. 16: weights ∝ ‖f_i‖).
- ``landmark_score``: ``normalize(Σ_i d_i·s_i·f̄_i)``, ``d_i = (h − min(‖L_i − L̂‖₂/S, h))/h`` (KP-RPE supp.
  Eq. 17–18, ``ml.models.fusion.baselines.landmark_weights``) with the ArcFace template ``L̂`` scaled to the
  image side ``S``; a group whose weights are all 0 falls back to ``average`` (logged), as in the baselines.
  Landmarks outside the image are not special-cased: they are simply far from the template. Every template
  point lies at least 19.6 px of 112 (0.175·S) inside the border, so an outside landmark alone costs at least
  0.175 of the h = 0.2 budget (weight ≤ 0.12), and an image with landmarks well outside gets weight 0.
- ``quality_oracle``: ``normalize(Σ_i q_i·f̄_i)`` with ``q_i`` the renderer's true quality of image ``i`` (the
  headroom reference: what weighting frames by quality can gain; a group of all-zero quality falls back to
  ``average``).
- ``caface``: the learned CAFace (``ml.train.fusion.fuse_sets``, eval mode). ``chunk_size=None`` fuses each
  group in one call (exactly ``model(set)``); a ``chunk_size`` streams groups in chunks through the CAFace
  memory (paper Eq. 8), which is how probes of thousands of frames stay in bounded memory (the paper uses
  N' = 256 on IJB-S): the CN's self-attention costs ``width²`` per set and call. Groups are batched by
  length so that one call holds at most ``max_items`` items and ``MAX_ATTENTION`` attention pairs (a single
  group over that without ``chunk_size`` is fused alone, in one call, at its full cost).

``FusionStream`` fuses one set whose frames arrive a chunk at a time (probes of tens of thousands of frames) in
memory bounded by the chunk: running sums for the baselines and the quality oracle (given each chunk's true
quality), the CAFace memory for ``caface``; its template equals ``fuse_templates`` over the same frames (CAFace:
over the same chunks).

Groups are integer ids ``0..G-1`` per image (``np.unique(ids, return_inverse=True)`` makes them); row ``g`` of
a result is group ``g``. Variable-length groups cost one segment sum (baselines) or length-sorted padded
batches (CAFace), never a Python loop over images.

Bad input fails loudly (``DataError`` / ``ConfigError``), never as a NaN template: a non-finite or all-zero
feature (named by its row), a group id with no image, styles or landmarks of the wrong shape, non-finite
landmarks or face scores, and a group whose fused vector is exactly zero (its features cancel). A group of one
image works for every method.

Differences from the reference:

- IJB pooling (``media``) is InsightFace's ``image2template_feature`` without faceness weighting or flip
  features inside (pass features already combined, e.g. with ``features_and_styles(flip=True)``).
- ``features_and_styles(flip=True)``: features ``f(x) + f(flip x)`` (the METHODS.md convention) and styles
  the mean of both passes (the CAFace card does not say how the reference treats styles under flip; the mean
  keeps them on the scale the fusion model was trained on).
- ``gain_vs_probe_size`` (paper Fig. 1c): the paper plots the gain over averaging against the natural mean
  probe size of four datasets; here each probe of one dataset is sub-sampled (seeded, without replacement) to
  N frames for a sweep of N, so probe size is the only thing that changes. Probes shorter than N keep all
  their frames (``"frames"`` reports the mean actually used).
- ``order_robustness`` (paper Table 4, last row: 5 random orders, N' = 256): the same protocol; the std is
  the sample std (ddof 1; the paper does not say which), and the minimum cosine between a probe's template
  under two orders is reported as well.
- TAR@FAR and TPIR@FPIR use the exact order-statistic thresholds of ``ml.eval.metrics`` (no ROC
  interpolation); a FAR below ``1/n_impostor`` is reported at observed FAR 0 (threshold = the highest
  impostor score), with a logged warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError
from ml.eval.metrics import (
    identification_rank,
    open_set_identification,
    pair_scores,
    tar_at_far,
    template_features,
)
from ml.models.backbones import input_contract
from ml.models.fusion.baselines import ARCFACE_TEMPLATE_112, landmark_weights
from ml.models.fusion.caface import CAFace
from ml.train.augment import flip_keypoints
from ml.train.fusion import fuse_sets

__all__ = [
    "FUSERS",
    "FUSION_METHODS",
    "FusionStream",
    "features_and_styles",
    "fuse_templates",
    "gain_vs_probe_size",
    "index_pairs",
    "order_robustness",
    "shuffled_templates",
    "template_verification",
    "video_identification",
]

log = logging.getLogger(__name__)

DEFAULT_FARS = (1e-5, 1e-4, 1e-3, 1e-2)
MAX_ITEMS = 1 << 16  # CAFace items per fuse_sets call: 65,536 × 512 floats = 128 MiB of features
# CN self-attention pairs per call, Σ_sets width²: 2^24 × 8 heads × 4 B = 512 MiB of attention logits
# (256 sets of 256 items, the paper's N' = 256).
MAX_ATTENTION = 1 << 24
MAX_SETS = 256  # sets per CAFace call (fuse_sets' default)


def _scalar(value: Any) -> Any:
    """A numpy scalar as its Python value, anything else (e.g. the str of an object array) as it is."""
    return value.item() if isinstance(value, np.generic) else value


def _fmt_rate(rate: float) -> str:
    """0.01 → "1e-2", 1e-05 → "1e-5" (the metric-key format of ``tasks/evaluate.py``); a rate that one digit
    cannot hold exactly keeps its repr (0.25 → "0.25"), so two rates never share a key."""
    short = f"{rate:.0e}"
    return short.replace("e-0", "e-") if float(short) == rate else repr(float(rate))


# ---------------------------------------------------------------------------------------------------------
# per-image features and styles
# ---------------------------------------------------------------------------------------------------------


def _forward(model: nn.Module, x: torch.Tensor, k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x, return_styles=True) if k is None else model(x, k, return_styles=True)
    return out[0], out[1]


@torch.no_grad()
def features_and_styles(
    model: nn.Module,
    images: np.ndarray,
    *,
    keypoints: np.ndarray | None = None,
    batch_size: int = 256,
    flip: bool = False,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Unnormalised features (N, D) and CAFace styles (N, style_dim, 2), float32, of uint8 RGB ``images``
    (N, S, S, 3), in eval mode.

    ``model`` is a backbone whose ``input_contract`` declares ``style_dim`` and whose forward takes
    ``return_styles=True`` (ViT, KP-RPE ViT, IResNet). KP-RPE models also need ``keypoints`` (N, 5, 2) pixel
    landmarks (ignored for the others). With ``flip``: features ``f(x) + f(flip x)`` and styles
    ``(Γ(x) + Γ(flip x))/2`` (the flipped pass gets mirrored, left/right-swapped landmarks). A non-finite
    output raises ``DataError`` naming the first such image. The model's train/eval mode is restored.
    """
    # ml.train.fr imports Lightning (seconds); only this function needs it.
    from ml.train.fr import check_keypoints, images_to_tensor, needs_keypoints

    contract = input_contract(model)
    name = type(model).__name__
    if "style_dim" not in contract:
        raise ConfigError(
            f"{name} declares no 'style_dim' in its input_contract, so it cannot return CAFace styles; use a "
            "ViT, KP-RPE ViT or IResNet backbone (forward(x, return_styles=True))"
        )
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"images must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    size = int(contract["size"])
    if images.shape[1:3] != (size, size):
        raise DataError(
            f"{name} expects {size}×{size} images (its input contract), got {images.shape[1]}×{images.shape[2]}; "
            "align/resize them first"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = images.shape[0]
    kp = check_keypoints(keypoints, n, name) if needs_keypoints(model) else None
    style_dim = int(contract["style_dim"])
    if n == 0:
        return np.zeros((0, int(contract["embedding_dim"])), np.float32), np.zeros((0, style_dim, 2), np.float32)

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    feats: list[np.ndarray] = []
    styles: list[np.ndarray] = []
    try:
        for lo in tqdm(range(0, n, batch_size), desc="features+styles", disable=not progress, leave=False):
            x = images_to_tensor(images[lo : lo + batch_size], contract).to(device)  # (b, 3, S, S)
            k = None if kp is None else torch.from_numpy(kp[lo : lo + batch_size]).to(device)  # (b, 5, 2)
            f, s = _forward(model, x, k)  # (b, D), (b, style_dim, 2)
            if flip:
                f2, s2 = _forward(model, x.flip(3), None if k is None else flip_keypoints(k, size))
                f, s = f + f2, (s + s2) / 2
            feats.append(f.float().cpu().numpy())
            styles.append(s.float().cpu().numpy())
    finally:
        model.train(was_training)
    features, style_arr = np.concatenate(feats), np.concatenate(styles)
    if style_arr.shape[1:] != (style_dim, 2):
        raise ConfigError(f"{name} returned styles {style_arr.shape[1:]} but its contract says ({style_dim}, 2)")
    for what, arr in (("features", features), ("styles", style_arr)):
        bad = np.flatnonzero(~np.isfinite(arr.reshape(n, -1)).all(axis=1))
        if bad.size:
            raise DataError(
                f"{name} produced non-finite {what} for image {int(bad[0])} ({bad.size} images); check the weights "
                "(an untrained full-width IResNet overflows in eval mode) and the input images"
            )
    return features, style_arr


# ---------------------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# fusion
# ---------------------------------------------------------------------------------------------------------


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


def _fuse_landmark_score(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    n = features.shape[0]
    weights = _landmark_score_weights(inputs.landmarks, inputs.face_scores, n, inputs.image_size, inputs.h)
    units = F.normalize(torch.from_numpy(features), dim=1)
    fused = _segment_sum(weights[:, None] * units, groups)  # (G, D)
    degenerate = _segment_sum(weights, groups) <= 0  # (G,)
    if bool(degenerate.any()):
        log.warning("%d group(s) have all landmark-score weights 0; using the plain average for them",
                    int(degenerate.sum()))
        fused = torch.where(degenerate[:, None], _segment_sum(units, groups), fused)
    return fused.numpy()


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


def _fuse_caface(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    model = inputs.model
    if not isinstance(model, CAFace):
        raise ConfigError(
            f"caface fusion needs a trained CAFace model (ml.models.fusion.load_caface), got {type(model).__name__}"
        )
    n, d = features.shape
    if d != model.feature_dim:
        raise DataError(
            f"features have {d} channels but the CAFace model was trained on {model.feature_dim}; use the backbone "
            "the fusion model was trained on"
        )
    if inputs.styles is None:
        raise DataError("caface fusion needs styles (N, style_dim, 2); get them with features_and_styles")
    styles = _check_rows(
        inputs.styles, n, (model.style_dim, 2), "styles",
        f"per-image (mean, std) of the backbone's {model.style_dim} style channels, from features_and_styles",
    )
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


def _fuse_quality_oracle(features: np.ndarray, groups: _Groups, inputs: _Inputs) -> np.ndarray:
    n = features.shape[0]
    if inputs.quality is None:
        raise DataError("quality_oracle fusion needs quality (N,): the renderer's true quality of each image")
    weights = torch.from_numpy(_check_rows(inputs.quality, n, (), "quality", "the manifest's quality column"))
    if bool((weights < 0).any()):
        row = int(torch.nonzero(weights < 0)[0])
        raise DataError(f"quality row {row} is negative ({float(weights[row])}); qualities lie in [0, 1]")
    units = F.normalize(torch.from_numpy(features), dim=1)
    fused = _segment_sum(weights[:, None] * units, groups)
    degenerate = _segment_sum(weights, groups) <= 1e-12
    if bool(degenerate.any()):
        log.warning("%d group(s) have quality 0 in every image; using the plain average for them", int(degenerate.sum()))
        fused = torch.where(degenerate[:, None], _segment_sum(units, groups), fused)
    return fused.numpy()


# Fusion registry: name → fuser(features (N, D), groups, inputs) → unnormalised or unit templates (G, D).
FUSERS: dict[str, Callable[[np.ndarray, _Groups, _Inputs], np.ndarray]] = {
    "average": _fuse_average,
    "norm_weighted": _fuse_norm_weighted,
    "landmark_score": _fuse_landmark_score,
    "caface": _fuse_caface,
    "quality_oracle": _fuse_quality_oracle,
}
FUSION_METHODS: tuple[str, ...] = tuple(FUSERS)
STREAM_METHODS: tuple[str, ...] = ("average", "norm_weighted", "landmark_score", "caface", "quality_oracle")


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


class FusionStream:
    """One set's template fused from frames that arrive a chunk at a time, in memory that does not grow with the
    set (IJB-S probes of tens of thousands of frames): between calls it keeps fewer than ``chunk_size`` frames.

    The state per ``method`` (D = feature size; the formulas are ``fuse_templates``'s, see the module docstring):

    - ``average``: ``Σ_i f̄_i`` (D,) in float64; ``norm_weighted``: ``Σ_i f_i`` (D,);
    - ``landmark_score``: ``Σ_i w_i·f̄_i`` (D,), ``Σ_i w_i`` and ``Σ_i f̄_i`` (the fallback when every weight is
      0), ``w_i = d_i·s_i`` (KP-RPE supp. Eq. 17–18) from ``landmarks`` and ``face_scores``;
    - ``quality_oracle``: the same sums with ``w_i = q_i``, the renderer's true quality of each frame, passed as
      ``quality`` with its chunk (a headroom reference, not a method: only a renderer knows ``q_i``);
    - ``caface``: the CAFace memory ``(c̄, F̄', S̄')`` of ``init_state``/``update`` (O(M·(D + d)), paper Eq. 8) plus
      a buffer of fewer than ``chunk_size`` frames, so the chunks absorbed are frames [0, C), [C, 2C), … however
      ``update`` is sliced.

    ``template()`` equals ``fuse_templates(method, <every frame so far>, chunk_size=chunk_size)`` up to float
    rounding (the same float64 sums; CAFace over the same chunks) and leaves the state as it is, so the templates
    of a probe's prefixes are read on the way. Bad input raises as in ``fuse_templates``.
    """

    def __init__(
        self,
        method: str,
        *,
        model: CAFace | None = None,
        image_size: float | None = None,
        chunk_size: int = 64,
        h: float = 0.2,
    ) -> None:
        if method not in STREAM_METHODS:
            raise ConfigError(f"unknown fusion method {method!r}; FusionStream fuses {', '.join(STREAM_METHODS)}")
        if method == "caface" and not isinstance(model, CAFace):
            raise ConfigError(
                f"caface fusion needs a trained CAFace model (ml.models.fusion.load_caface), got {type(model).__name__}"
            )
        self.method = method
        self.model = model if method == "caface" else None
        self.image_size = image_size
        self.chunk_size = _positive_int(chunk_size, "chunk_size")
        self.h = h
        self.frames = 0
        self._total: np.ndarray | None = None  # (D,) float64: Σ f̄, Σ f or Σ w·f̄
        self._units: np.ndarray | None = None  # (D,) float64: Σ f̄ (landmark_score's and quality_oracle's fallback)
        self._weight = 0.0  # Σ w (landmark_score, quality_oracle)
        self._state: Any = None  # CAFace FusionState of the chunks absorbed
        self._buffer: list[tuple[np.ndarray, np.ndarray]] = []  # CAFace frames not yet absorbed, < chunk_size
        self._buffered = 0

    def update(
        self,
        features: np.ndarray | torch.Tensor,
        *,
        styles: np.ndarray | torch.Tensor | None = None,
        landmarks: np.ndarray | torch.Tensor | None = None,
        face_scores: np.ndarray | torch.Tensor | None = None,
        quality: np.ndarray | torch.Tensor | None = None,
    ) -> FusionStream:
        """Absorb the next frames: ``features`` (n, D) and what the method needs (``styles`` (n, style_dim, 2) for
        ``caface``; ``landmarks`` (n, 5, 2) pixels and optional ``face_scores`` (n,) for ``landmark_score``;
        ``quality`` (n,) ≥ 0, the renderer's true quality, for ``quality_oracle``)."""
        feats = _check_features(features)
        n, d = feats.shape
        dim = self.model.feature_dim if self.model is not None else (None if self._total is None else self._total.size)
        if dim is not None and d != dim:
            raise DataError(f"features have {d} channels but this stream fuses {dim}-d features; use one backbone")
        if self.method == "caface":
            self._update_caface(feats, styles)
        else:
            units = F.normalize(torch.from_numpy(feats), dim=1)  # (n, D) float32, as fuse_templates
            if self.method == "average":
                part = units.double().sum(dim=0)
            elif self.method == "norm_weighted":
                part = torch.from_numpy(feats).double().sum(dim=0)
            else:
                if self.method == "landmark_score":
                    weights = _landmark_score_weights(landmarks, face_scores, n, self.image_size, self.h)  # (n,)
                else:
                    weights = self._quality_weights(quality, n)
                part = (weights[:, None] * units).double().sum(dim=0)
                self._weight += float(weights.double().sum())
                unit_sum = units.double().sum(dim=0).numpy()
                self._units = unit_sum if self._units is None else self._units + unit_sum
            self._total = part.numpy() if self._total is None else self._total + part.numpy()
        self.frames += n
        return self

    @staticmethod
    def _quality_weights(quality: Any, n: int) -> torch.Tensor:
        """Checked ``quality_oracle`` weights (n,) float32: the frames' true quality, as ``fuse_templates``."""
        if quality is None:
            raise DataError("quality_oracle fusion needs quality (n,) with every update: the renderer's true quality "
                            "of each frame; pass quality=... or leave quality_oracle out")
        weights = torch.from_numpy(_check_rows(quality, n, (), "quality", "the renderer's true quality of each frame"))
        if bool((weights < 0).any()):
            row = int(torch.nonzero(weights < 0)[0])
            raise DataError(f"quality row {row} is negative ({float(weights[row])}); qualities lie in [0, 1]")
        return weights

    def _update_caface(self, feats: np.ndarray, styles: Any) -> None:
        model = self.model
        assert model is not None  # checked in __init__
        if feats.shape[1] != model.feature_dim:
            raise DataError(
                f"features have {feats.shape[1]} channels but the CAFace model was trained on {model.feature_dim}; "
                "use the backbone the fusion model was trained on"
            )
        if styles is None:
            raise DataError("caface fusion needs styles (N, style_dim, 2); get them with features_and_styles")
        sty = _check_rows(
            styles, feats.shape[0], (model.style_dim, 2), "styles",
            f"per-image (mean, std) of the backbone's {model.style_dim} style channels, from features_and_styles",
        )
        self._buffer.append((feats, sty))
        self._buffered += feats.shape[0]
        if self._buffered < self.chunk_size:
            return
        all_feats = np.concatenate([f for f, _ in self._buffer])
        all_styles = np.concatenate([s for _, s in self._buffer])
        full = (all_feats.shape[0] // self.chunk_size) * self.chunk_size
        for lo in range(0, full, self.chunk_size):
            self._state = self._absorb(self._state, all_feats[lo : lo + self.chunk_size],
                                       all_styles[lo : lo + self.chunk_size])
        rest = all_feats.shape[0] - full
        self._buffer = [(all_feats[full:].copy(), all_styles[full:].copy())] if rest else []
        self._buffered = rest

    @torch.no_grad()
    def _absorb(self, state: Any, feats: np.ndarray, styles: np.ndarray) -> Any:
        """The CAFace memory after one chunk (eval mode, the model's mode restored)."""
        model = self.model
        assert model is not None
        device = model.cn.centres.device
        was_training = model.training
        model.eval()
        try:
            if state is None:
                state = model.init_state(1, device=device)
            return model.update(state, torch.from_numpy(feats)[None].to(device), torch.from_numpy(styles)[None].to(device))
        finally:
            model.train(was_training)

    @torch.no_grad()
    def template(self) -> np.ndarray:
        """The unit-norm template (D,) float32 of every frame so far; the state is unchanged."""
        if self.frames == 0:
            raise DataError(f"the {self.method} stream has no frames yet; call update() with at least one frame first")
        if self.method == "caface":
            model = self.model
            assert model is not None
            state = self._state
            if self._buffer:  # the last, partial chunk, absorbed into a copy of the memory
                state = self._absorb(state, np.concatenate([f for f, _ in self._buffer]),
                                     np.concatenate([s for _, s in self._buffer]))
            was_training = model.training
            model.eval()
            try:
                fused = model.fuse(state)[0].double().cpu()
            finally:
                model.train(was_training)
        else:
            assert self._total is not None
            fused = torch.from_numpy(self._total)
            floor = {"landmark_score": 0.0, "quality_oracle": 1e-12}.get(self.method)  # as fuse_templates
            if floor is not None and self._weight <= floor:
                log.warning("the %s stream has all weights 0 after %d frames; using the plain average", self.method,
                            self.frames)
                assert self._units is not None
                fused = torch.from_numpy(self._units)
        norm = float(fused.norm())
        if norm <= 1e-12:
            raise DataError(
                f"the {self.method} stream fuses to the zero vector after {self.frames} frames: its features cancel out"
            )
        return (fused / norm).float().numpy()

    def state_nbytes(self) -> int:
        """Bytes the stream holds now (sums, CAFace memory, buffered frames): bounded by the chunk, not the set."""
        total = sum(a.nbytes for a in (self._total, self._units) if a is not None)
        if self._state is not None:
            total += sum(t.numel() * t.element_size() for t in self._state)
        return total + sum(f.nbytes + s.nbytes for f, s in self._buffer)


# ---------------------------------------------------------------------------------------------------------
# verification and identification
# ---------------------------------------------------------------------------------------------------------


def index_pairs(pairs: np.ndarray, template_ids: np.ndarray) -> np.ndarray:
    """Template-id pairs (P, 2) (e.g. from ``ml.data.ijb.read_template_pairs``) → row indices (P, 2) int64 into
    templates whose ids are ``template_ids`` (G,) (e.g. the ``np.unique`` ids used to build the groups)."""
    pairs = np.asarray(pairs)
    ids = np.asarray(template_ids)
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise DataError(f"pairs must have shape (P, 2) (template id 1, template id 2), got {pairs.shape}")
    if ids.ndim != 1 or np.unique(ids).size != ids.size:
        raise DataError(f"template_ids must be a 1-D array of distinct ids, got shape {ids.shape} with duplicates")
    if ids.size == 0:
        raise DataError("template_ids is empty: there are no templates to index")
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    pos = np.clip(np.searchsorted(sorted_ids, pairs), 0, ids.size - 1)  # (P, 2)
    found = sorted_ids[pos] == pairs
    if not found.all():
        row, col = (int(i) for i in np.argwhere(~found)[0])
        raise DataError(
            f"pair {row} names template {pairs[row, col].item()!r}, which has no template features ({int((~found).sum())} "
            "such ids); drop those pairs or add the templates' images"
        )
    return order[pos].astype(np.int64)


def template_verification(
    templates: np.ndarray,
    pairs: np.ndarray,
    labels: np.ndarray,
    fars: Sequence[float] = DEFAULT_FARS,
) -> dict[str, float]:
    """IJB 1:1 template verification: TAR at each FAR over the cosine scores of template ``pairs`` (P, 2)
    (row indices into ``templates`` (G, D)) with ``labels`` (P,) 1 = same identity, 0 = different.

    Returns ``"tar@far=1e-4"``-style keys (``ml.eval.metrics.tar_at_far``: threshold = the (k+1)-th highest
    impostor score, k = ⌊FAR·n_impostor⌋) plus ``"n_genuine"`` and ``"n_impostor"``.
    """
    templates = _check_features(templates, "templates")
    pairs = _to_numpy(pairs, "pairs")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.shape[0] == 0 or not np.issubdtype(pairs.dtype, np.integer):
        raise DataError(f"pairs must be integer template indices of shape (P, 2), P ≥ 1, got {pairs.dtype} {pairs.shape}")
    out = np.flatnonzero(((pairs < 0) | (pairs >= templates.shape[0])).any(axis=1))
    if out.size:
        raise DataError(
            f"pair {int(out[0])} = {pairs[out[0]].tolist()} indexes outside the {templates.shape[0]} templates; map "
            "template ids to rows with index_pairs"
        )
    labels = _to_numpy(labels, "labels")
    if labels.shape != (pairs.shape[0],):
        raise DataError(f"labels must have one entry per pair, shape ({pairs.shape[0]},), got {labels.shape}")
    bad = np.flatnonzero(~np.isin(labels, (0, 1)))
    if bad.size:
        raise DataError(f"labels must be 0 or 1, found {labels[bad[0]].item()!r} at pair {int(bad[0])}")
    labels = labels.astype(np.int64)
    n_gen, n_imp = int(labels.sum()), int((labels == 0).sum())
    if n_gen == 0 or n_imp == 0:
        raise DataError(f"verification needs genuine and impostor pairs, got {n_gen} genuine and {n_imp} impostor")
    scores = pair_scores(templates[pairs[:, 0]], templates[pairs[:, 1]])
    result: dict[str, float] = {}
    for far, tar in tar_at_far(scores, labels, fars).items():
        if 0 < far * n_imp < 1:
            log.warning("FAR %s needs at least %d impostor pairs, have %d: reported at observed FAR 0",
                        _fmt_rate(far), int(np.ceil(1 / far)), n_imp)
        result[f"tar@far={_fmt_rate(far)}"] = tar
    result["n_genuine"] = float(n_gen)
    result["n_impostor"] = float(n_imp)
    return result


def video_identification(
    probe_templates: np.ndarray,
    probe_ids: np.ndarray,
    gallery_templates: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    ranks: Sequence[int] = (1, 5),
    fpirs: Sequence[float] = (0.01,),
    mated: np.ndarray | None = None,
) -> dict[str, float]:
    """Probe-set (video) identification against gallery templates: closed-set rank-N over the mated probes
    (``"rank1"``, ``"rank5"``) and open-set TPIR at each FPIR at rank 1 (``"tpir@fpir=1e-2"``) when there are
    non-mated probes, plus ``"n_mated"`` and ``"n_nonmated"``.

    A probe is mated iff its id is among ``gallery_ids``, or as given by ``mated`` (P,) bool: a probe marked
    non-mated counts as an impostor search even if its id is enrolled, and one marked mated must have its id
    in the gallery. Without non-mated probes the TPIR keys are absent (``n_nonmated`` = 0).
    """
    probe_templates = _check_features(probe_templates, "probe_templates")
    gallery_templates = _check_features(gallery_templates, "gallery_templates")
    probe_ids, gallery_ids = np.asarray(probe_ids), np.asarray(gallery_ids)
    p, g = probe_templates.shape[0], gallery_templates.shape[0]
    if probe_ids.shape != (p,) or gallery_ids.shape != (g,):
        raise DataError(
            f"probe_ids must have shape ({p},) and gallery_ids ({g},) (one identity per template), got "
            f"{probe_ids.shape} and {gallery_ids.shape}"
        )
    if probe_templates.shape[1] != gallery_templates.shape[1]:
        raise DataError(
            f"probe and gallery templates differ in dimension: {probe_templates.shape[1]} vs {gallery_templates.shape[1]}"
        )
    identities, gallery_label = np.unique(gallery_ids, return_inverse=True)
    enrolled = np.isin(probe_ids, identities)
    if mated is None:
        mated = enrolled
    else:
        mated = np.asarray(mated)
        if mated.shape != (p,) or mated.dtype != bool:
            raise DataError(f"mated must be a bool array of shape ({p},), got {mated.dtype} {mated.shape}")
        wrong = np.flatnonzero(mated & ~enrolled)
        if wrong.size:
            raise DataError(
                f"probe {int(wrong[0])} is marked mated but its id {_scalar(probe_ids[wrong[0]])!r} is not in the gallery "
                f"({wrong.size} such probes)"
            )
    n_mated = int(mated.sum())
    if n_mated == 0:
        raise DataError("no probe is mated (its identity in the gallery); check that probe and gallery ids match")
    probe_label = np.full(p, -1, dtype=np.int64)  # -1: non-mated, never a gallery label
    probe_label[mated] = np.searchsorted(identities, probe_ids[mated])
    result: dict[str, float] = {}
    closed = identification_rank(probe_templates[mated], probe_label[mated], gallery_templates, gallery_label, ranks)
    for r, rate in closed.items():
        result[f"rank{r}"] = rate
    if n_mated < p:
        open_set = open_set_identification(probe_templates, probe_label, gallery_templates, gallery_label, fpirs, (1,))
        for f in fpirs:
            result[f"tpir@fpir={_fmt_rate(float(f))}"] = open_set[f"tpir@fpir={float(f)!r}/rank1"]
    result["n_mated"] = float(n_mated)
    result["n_nonmated"] = float(p - n_mated)
    return result


# ---------------------------------------------------------------------------------------------------------
# Fig. 1c and Table 4 of CAFace
# ---------------------------------------------------------------------------------------------------------


def _subsample(groups: _Groups, size: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted rows keeping min(size, |g|) random images of every group g, without replacement."""
    keys = rng.random(groups.index.size)
    order = np.lexsort((keys, groups.index))  # by group, random inside each
    starts = np.cumsum(groups.counts) - groups.counts
    position = np.arange(order.size) - np.repeat(starts, groups.counts)  # rank inside the group
    return np.sort(order[position < size])


def gain_vs_probe_size(
    features: np.ndarray,
    styles: np.ndarray | None,
    probe_groups: np.ndarray,
    probe_ids: np.ndarray,
    gallery: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    sizes: Sequence[int] = (1, 4, 16, 64, 256),
    methods: Sequence[str] = ("average", "caface"),
    model: CAFace | None = None,
    seed: int = 0,
    landmarks: np.ndarray | None = None,
    face_scores: np.ndarray | None = None,
    image_size: float | None = None,
    chunk_size: int | None = None,
    quality: np.ndarray | None = None,
) -> dict[str, dict[int, float]]:
    """Closed-set rank-1 of probe templates fused from N random frames of each probe, for each N in ``sizes``
    and each fusion method (CAFace Fig. 1c: the gain over averaging grows with the probe size).

    ``features`` (N_img, D) / ``styles`` / ``landmarks`` / ``face_scores`` are per probe image, ``probe_groups``
    (N_img,) ∈ 0..P-1 the probe of each image, ``probe_ids`` (P,) its identity; ``gallery`` (G, D) are gallery
    templates with ``gallery_ids`` (G,). For each size one seeded sub-sample is drawn and shared by all methods.
    Returns ``{method: {size: rank1}}`` and ``{"frames": {size: mean frames used per probe}}`` (probes shorter
    than N keep all their frames).
    """
    feats = _check_features(features)
    grp = _check_groups(probe_groups, feats.shape[0], "probe_groups")
    probe_ids = np.asarray(probe_ids)
    if probe_ids.shape != (grp.num,):
        raise DataError(f"probe_ids must give one identity per probe, shape ({grp.num},), got {probe_ids.shape}")
    absent = np.flatnonzero(~np.isin(probe_ids, np.asarray(gallery_ids)))
    if absent.size:
        raise DataError(
            f"probe {int(absent[0])} (id {_scalar(probe_ids[absent[0]])!r}) is not in the gallery ({absent.size} such "
            "probes); rank-1 is closed-set: drop the non-mated probes"
        )
    sizes = [_positive_int(s, "each probe size") for s in sizes]
    if not sizes:
        raise ConfigError("sizes must list at least one probe size")
    for m in methods:
        if m not in FUSERS:
            raise ConfigError(f"unknown fusion method {m!r}; choose from {', '.join(FUSERS)}")
    rng = np.random.default_rng(seed)
    arrays = {"styles": styles, "landmarks": landmarks, "face_scores": face_scores, "quality": quality}
    arrays = {k: _to_numpy(v, k) for k, v in arrays.items() if v is not None}
    for k, v in arrays.items():
        if v.shape[:1] != (feats.shape[0],):
            raise DataError(f"{k} must have one row per feature ({feats.shape[0]}), got shape {v.shape}")
    result: dict[str, dict[int, float]] = {m: {} for m in methods}
    result["frames"] = {}
    for size in sizes:
        rows = _subsample(grp, size, rng)
        subset = {k: v[rows] for k, v in arrays.items()}
        for m in methods:
            templates = fuse_templates(m, feats[rows], grp.index[rows], model=model, image_size=image_size,
                                       chunk_size=chunk_size, **subset)
            result[m][size] = identification_rank(templates, probe_ids, gallery, gallery_ids, ranks=(1,))[1]
        result["frames"][size] = float(rows.size / grp.num)
    return result


def shuffled_templates(
    model: CAFace,
    features: np.ndarray,
    styles: np.ndarray,
    groups: np.ndarray,
    *,
    shuffles: int = 5,
    chunk_size: int | None = 256,
    seed: int = 0,
    max_items: int = MAX_ITEMS,
) -> np.ndarray:
    """CAFace templates (shuffles, G, D) of the same groups, each time with the images of every group in a new
    random order and streamed in chunks of ``chunk_size``: what changes is only which frames share a chunk."""
    shuffles = _positive_int(shuffles, "shuffles")
    feats = _check_features(features)
    grp = _check_groups(groups, feats.shape[0])
    styles = _to_numpy(styles, "styles")
    if styles.shape[:1] != (feats.shape[0],):
        raise DataError(f"styles must have one row per feature ({feats.shape[0]}), got shape {styles.shape}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(shuffles):
        perm = rng.permutation(feats.shape[0])
        out.append(fuse_templates("caface", feats[perm], grp.index[perm], styles=styles[perm], model=model,
                                  chunk_size=chunk_size, max_items=max_items))
    return np.stack(out)


def order_robustness(
    model: CAFace,
    features: np.ndarray,
    styles: np.ndarray,
    groups: np.ndarray,
    probe_ids: np.ndarray,
    gallery: np.ndarray,
    gallery_ids: np.ndarray,
    *,
    shuffles: int = 5,
    chunk_size: int | None = 256,
    ranks: Sequence[int] = (1, 5),
    fpirs: Sequence[float] = (0.01,),
    mated: np.ndarray | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """CAFace Table 4, last row: ``video_identification`` of the probes fused after ``shuffles`` random frame
    orders (``shuffled_templates``), as ``"<metric>/mean"`` and ``"<metric>/std"`` (sample std, 0 for one
    shuffle), plus ``"template_cosine/min"`` (the lowest cosine between a probe's template under shuffle 0 and
    under any other; 1 = order had no effect) and ``"shuffles"``."""
    templates = shuffled_templates(model, features, styles, groups, shuffles=shuffles, chunk_size=chunk_size,
                                   seed=seed)
    runs = [video_identification(t, probe_ids, gallery, gallery_ids, ranks=ranks, fpirs=fpirs, mated=mated)
            for t in templates]
    result: dict[str, float] = {}
    for key in runs[0]:
        if key.startswith("n_"):
            result[key] = runs[0][key]
            continue
        values = np.array([r[key] for r in runs], dtype=np.float64)
        result[f"{key}/mean"] = float(values.mean())
        result[f"{key}/std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
    cosines = np.einsum("sgd,gd->sg", templates.astype(np.float64), templates[0].astype(np.float64))
    result["template_cosine/min"] = float(cosines.min())
    result["shuffles"] = float(len(runs))
    return result
