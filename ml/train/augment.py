"""Batched, landmark-aware face augmentation: the KP-RPE training recipe as torch ops on a batch.

KP-RPE trains with "Flip, Brightness, Contrast, Scaling, Translation, RandAug (magnitude 14/31), Blur,
Cutout, Rotation (20°)" (supplementary, Table 6). ``augment_kprpe`` applies to float images in [0, 1]
``(B, C, H, W)``, per sample and each with its own probability (``AugmentConfig``):

1. Geometry, as one bilinear resample: horizontal flip, then scale ``s``, rotation ``r`` and translation
   ``d`` about the image centre. In normalised coordinates (``align_corners=False``: ``n = (2p + 1)/S − 1``
   for pixel ``p`` of a side of ``S``) an input point ``n`` lands at ``o = s·R(r)·F·n + d`` in the output
   (``F = diag(−1, 1)`` where flipped). The output is sampled at ``n = F·R(−r)·(o − d)/s`` and the
   landmarks are pushed through the forward map exactly, then left/right swapped where flipped so that
   they stay in ArcFace order.
2. Photometric jitter: brightness ``x·b``, contrast ``(x − ḡ)·c + ḡ`` (``ḡ`` the image's mean grey),
   saturation ``g + (x − g)·σ`` (``g`` each pixel's grey, Rec. 601 weights), each clamped to [0, 1].
3. Gaussian blur with a random σ (given for 112-px images, scaled to the image side).
4. Cutout: one rectangle of random area and aspect ratio, filled with zero or the image's mean colour.

Only step 1 moves landmarks. Every random number comes from the ``generator`` argument: one
``(B, 21)`` uniform draw per call, made whatever the probabilities, so a batch's augmentation is a
function of the generator's state alone (exact resume reseeds it per step).

Differences from the reference (the paper lists the operations without magnitudes; the authors'
training code was not consulted):

- RandAug (magnitude 14/31) is not implemented; brightness/contrast/saturation/blur/cutout cover the
  photometric part of it.
- Rotation ±20° is the paper's; every other magnitude and all probabilities are our defaults.
- Scale, translation and rotation are one resample instead of chained ones, so the image is
  interpolated once and the landmark transform is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ml.errors import ConfigError

# ArcFace order: left eye, right eye, nose, left mouth, right mouth → after a horizontal flip
FLIP_LANDMARK_ORDER = (1, 0, 2, 4, 3)

# Rec. 601 luma weights for the grey of an RGB pixel
_GREY = (0.299, 0.587, 0.114)

PADDING_MODES = ("zeros", "border", "reflection")
CUTOUT_FILLS = ("zero", "mean")


@dataclass(frozen=True)
class AugmentConfig:
    """Probabilities and magnitudes of the KP-RPE recipe (``fr.augmentation`` in params.yaml)."""

    flip_prob: float = 0.5
    scale_prob: float = 0.5
    scale_range: tuple[float, float] = (0.9, 1.1)  # content magnification; > 1 zooms in
    translate_prob: float = 0.5
    max_translate: float = 0.08  # fraction of the image side, per axis
    rotate_prob: float = 0.5
    max_rotate_deg: float = 20.0  # paper: Rotation (20°)
    padding_mode: str = "zeros"  # what the resample shows outside the input: "zeros" | "border" | "reflection"
    brightness_prob: float = 0.3
    brightness_range: tuple[float, float] = (0.7, 1.3)
    contrast_prob: float = 0.3
    contrast_range: tuple[float, float] = (0.7, 1.3)
    saturation_prob: float = 0.3
    saturation_range: tuple[float, float] = (0.7, 1.3)
    blur_prob: float = 0.2
    blur_sigma: tuple[float, float] = (0.4, 1.8)  # Gaussian σ in pixels of a 112-px image
    cutout_prob: float = 0.2
    cutout_area: tuple[float, float] = (0.02, 0.2)  # fraction of the image area
    cutout_ratio: tuple[float, float] = (0.3, 3.3)  # height / width, drawn log-uniformly
    cutout_fill: str = "zero"  # "zero" | "mean" (the image's per-channel mean)

    def __post_init__(self) -> None:
        for name in ("flip_prob", "scale_prob", "translate_prob", "rotate_prob", "brightness_prob",
                     "contrast_prob", "saturation_prob", "blur_prob", "cutout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"fr.augmentation.{name} = {value!r}: a probability must lie in [0, 1]")
        ranges = {
            "scale_range": 0.0,
            "brightness_range": 0.0,
            "contrast_range": 0.0,
            "saturation_range": 0.0,
            "blur_sigma": 0.0,
            "cutout_area": 0.0,
            "cutout_ratio": 0.0,
        }
        for name, floor in ranges.items():
            lo, hi = getattr(self, name)
            if not floor < lo <= hi:
                raise ConfigError(f"fr.augmentation.{name} = {(lo, hi)!r}: need {floor} < low ≤ high")
        if self.cutout_area[1] > 1.0:
            raise ConfigError(f"fr.augmentation.cutout_area = {self.cutout_area!r}: the area fraction must be ≤ 1")
        if not 0.0 <= self.max_translate <= 1.0:
            raise ConfigError(
                f"fr.augmentation.max_translate = {self.max_translate!r}: need 0 ≤ value ≤ 1 (of the side)"
            )
        if not 0.0 <= self.max_rotate_deg <= 180.0:
            raise ConfigError(f"fr.augmentation.max_rotate_deg = {self.max_rotate_deg!r}: need 0 ≤ value ≤ 180")
        if self.padding_mode not in PADDING_MODES:
            raise ConfigError(f"fr.augmentation.padding_mode {self.padding_mode!r} is not one of {list(PADDING_MODES)}")
        if self.cutout_fill not in CUTOUT_FILLS:
            raise ConfigError(f"fr.augmentation.cutout_fill {self.cutout_fill!r} is not one of {list(CUTOUT_FILLS)}")


def flip_keypoints(keypoints: torch.Tensor, size: int) -> torch.Tensor:
    """Pixel landmarks (B, 5, 2) of a horizontally flipped image: x → S−1−x, left/right points swapped."""
    flipped = keypoints[:, list(FLIP_LANDMARK_ORDER)].clone()
    flipped[..., 0] = (size - 1) - flipped[..., 0]
    return flipped


def pixel_to_normalised(p: torch.Tensor, size: int) -> torch.Tensor:
    """Pixel coordinates → grid_sample coordinates in [−1, 1] (``align_corners=False``)."""
    return (2.0 * p + 1.0) / size - 1.0


def normalised_to_pixel(n: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of ``pixel_to_normalised``."""
    return ((n + 1.0) * size - 1.0) / 2.0


def _between(u: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    return lo + (hi - lo) * u


def affine(
    x: torch.Tensor,
    keypoints: torch.Tensor | None,
    flip: torch.Tensor,
    scale: torch.Tensor,
    angle: torch.Tensor,
    shift: torch.Tensor,
    padding_mode: str = "zeros",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Flip then scale/rotate/translate about the centre, as one bilinear resample of square images.

    ``flip`` (B,) bool, ``scale`` (B,) magnification, ``angle`` (B,) radians, ``shift`` (B, 2) in normalised
    units (a side spans 2). Pixel landmarks (B, K, 2) follow exactly; flipped rows get left/right swapped.
    """
    b, size = x.shape[0], x.shape[-1]
    if x.shape[-2] != size:
        raise ValueError(f"affine augmentation needs square images, got {tuple(x.shape[-2:])}")
    f = torch.where(flip, -1.0, 1.0).to(x.dtype)
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    s = scale.to(x.dtype)
    d = shift.to(x.dtype)
    # forward map M = s·R·F = s·[[f·cos, −sin], [f·sin, cos]]; sampling uses M⁻¹ = F·R(−r)/s
    inv = torch.stack([torch.stack([f * cos, f * sin], -1), torch.stack([-sin, cos], -1)], 1) / s.view(b, 1, 1)
    theta = torch.cat([inv, -(inv @ d.unsqueeze(-1))], dim=2)  # (B, 2, 3): n = M⁻¹·o − M⁻¹·d
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)
    if keypoints is None:
        return out, None
    fwd = torch.stack([torch.stack([f * cos, -sin], -1), torch.stack([f * sin, cos], -1)], 1) * s.view(b, 1, 1)
    n = pixel_to_normalised(keypoints.to(x.dtype), size)  # (B, K, 2)
    moved = normalised_to_pixel(n @ fwd.transpose(1, 2) + d.unsqueeze(1), size)
    moved = torch.where(flip.view(b, 1, 1), moved[:, list(FLIP_LANDMARK_ORDER)], moved)
    return out, moved.to(keypoints.dtype)


def _grey(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) → (B, 1, H, W) luma."""
    w = torch.tensor(_GREY, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x * w).sum(dim=1, keepdim=True)


def photometric(
    x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor, saturation: torch.Tensor
) -> torch.Tensor:
    """Brightness, contrast, saturation factors (B,) on RGB images in [0, 1]; 1 leaves that step out."""
    view = (-1, 1, 1, 1)
    x = (x * brightness.to(x.dtype).view(view)).clamp(0.0, 1.0)
    mean = _grey(x).mean(dim=(2, 3), keepdim=True)  # (B, 1, 1, 1)
    x = ((x - mean) * contrast.to(x.dtype).view(view) + mean).clamp(0.0, 1.0)
    grey = _grey(x)
    return ((x - grey) * saturation.to(x.dtype).view(view) + grey).clamp(0.0, 1.0)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with one σ (B,) > 0 in pixels per image, reflect-padded; (B, C, H, W)."""
    b, c, h, w = x.shape
    radius = min(max(1, math.ceil(3.0 * float(sigma.max()))), h - 1, w - 1)  # 99.7 % of the mass
    taps = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-(taps**2) / (2.0 * sigma.to(x.dtype).view(b, 1) ** 2))  # (B, k)
    kernel = (kernel / kernel.sum(dim=1, keepdim=True)).repeat_interleave(c, dim=0)  # (B·C, k)
    y = x.reshape(1, b * c, h, w)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="reflect"), kernel.view(b * c, 1, 1, -1), groups=b * c)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="reflect"), kernel.view(b * c, 1, -1, 1), groups=b * c)
    return y.view(b, c, h, w)


def cutout(x: torch.Tensor, boxes: torch.Tensor, fill: str = "zero") -> torch.Tensor:
    """Fill one rectangle per image, ``boxes`` (B, 4) = (x0, y0, x1, y1) in pixels, with zero or the image mean.

    A pixel is covered when its centre lies in ``[x0, x1) × [y0, y1)``.
    """
    h, w = x.shape[-2:]
    ys = torch.arange(h, dtype=x.dtype, device=x.device).view(1, 1, h, 1) + 0.5
    xs = torch.arange(w, dtype=x.dtype, device=x.device).view(1, 1, 1, w) + 0.5
    bx = boxes.to(x.dtype).view(-1, 4, 1, 1)
    inside = (xs >= bx[:, 0:1]) & (xs < bx[:, 2:3]) & (ys >= bx[:, 1:2]) & (ys < bx[:, 3:4])  # (B, 1, H, W)
    value = x.mean(dim=(2, 3), keepdim=True) if fill == "mean" else torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(inside, value, x)


def _rows(mask: torch.Tensor) -> torch.Tensor | None:
    idx = mask.nonzero().squeeze(1)
    return idx if idx.numel() else None


def augment_kprpe(
    x: torch.Tensor,
    keypoints: torch.Tensor | None = None,
    cfg: AugmentConfig = AugmentConfig(),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KP-RPE recipe on RGB images in [0, 1] (B, 3, S, S) and optional pixel landmarks (B, 5, 2).

    Returns ``(images, landmarks)`` (``None`` landmarks when none were given). Samples an op leaves out
    are returned unchanged by that op. Random numbers are drawn on ``generator``'s device (the CPU when
    ``None``, from the global generator) and moved to the images' device.
    """
    b, size = x.shape[0], x.shape[-1]
    dev = x.device
    gen_device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(b, 21, generator=generator, device=gen_device).to(dev, torch.float32)  # (B, 21) in [0, 1)
    out = x
    kp = keypoints

    # 1. geometry: identity parameters where an op is not drawn
    flip = u[:, 0] < cfg.flip_prob
    scale = torch.where(u[:, 1] < cfg.scale_prob, _between(u[:, 2], cfg.scale_range), 1.0)
    angle = torch.where(u[:, 3] < cfg.rotate_prob, (2.0 * u[:, 4] - 1.0) * math.radians(cfg.max_rotate_deg), 0.0)
    shift = torch.where(
        (u[:, 5] < cfg.translate_prob).unsqueeze(1), (2.0 * u[:, 6:8] - 1.0) * (2.0 * cfg.max_translate), 0.0
    )
    moved = flip | (u[:, 1] < cfg.scale_prob) | (u[:, 3] < cfg.rotate_prob) | (u[:, 5] < cfg.translate_prob)
    rows = _rows(moved)
    if rows is not None:
        part, part_kp = affine(
            out[rows], None if kp is None else kp[rows], flip[rows], scale[rows], angle[rows], shift[rows],
            cfg.padding_mode,
        )
        out = out.index_copy(0, rows, part)
        if kp is not None:
            kp = kp.index_copy(0, rows, part_kp)

    # 2. photometric
    on_b, on_c, on_s = u[:, 8] < cfg.brightness_prob, u[:, 10] < cfg.contrast_prob, u[:, 12] < cfg.saturation_prob
    rows = _rows(on_b | on_c | on_s)
    if rows is not None:
        bright = torch.where(on_b, _between(u[:, 9], cfg.brightness_range), 1.0)
        contrast = torch.where(on_c, _between(u[:, 11], cfg.contrast_range), 1.0)
        sat = torch.where(on_s, _between(u[:, 13], cfg.saturation_range), 1.0)
        out = out.index_copy(0, rows, photometric(out[rows], bright[rows], contrast[rows], sat[rows]))

    # 3. blur, σ scaled from 112 px to this size
    rows = _rows(u[:, 14] < cfg.blur_prob)
    if rows is not None:
        sigma = _between(u[:, 15], cfg.blur_sigma) * (size / 112.0)
        out = out.index_copy(0, rows, gaussian_blur(out[rows], sigma[rows]))

    # 4. cutout: area a·S², height/width ratio r → h = S·√(a·r), w = S·√(a/r), centre anywhere in the image
    rows = _rows(u[:, 16] < cfg.cutout_prob)
    if rows is not None:
        area = _between(u[:, 17], cfg.cutout_area)
        lo, hi = math.log(cfg.cutout_ratio[0]), math.log(cfg.cutout_ratio[1])
        ratio = torch.exp(lo + (hi - lo) * u[:, 18])
        h = (size * torch.sqrt(area * ratio)).clamp(max=size)
        w = (size * torch.sqrt(area / ratio)).clamp(max=size)
        cy = u[:, 19] * size
        cx = u[:, 20] * size
        boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=1)
        out = out.index_copy(0, rows, cutout(out[rows], boxes[rows], cfg.cutout_fill))
    return out, kp
