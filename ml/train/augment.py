"""Batched, landmark-aware face augmentation: KP-RPE's training recipe (supplementary Table 6) as torch ops on a batch.

``augment_kprpe`` takes float images in [0, 1] ``(B, C, H, W)`` and pixel landmarks; per sample, each op with its own
probability (``AugmentConfig``): (1) flip, scale, rotation, translation and RandAug's geometric ops composed into one
affine map ``o = A·n + t`` (normalised coordinates) and applied as one bilinear resample, the landmarks pushed
through it exactly and left/right swapped where flipped; (2) RandAugment's photometric ops: N per image from the 14
of ``RANDAUG_OPS`` at one magnitude M in 0..30, strength M/30 of torchvision's ranges; (3) brightness, contrast and
saturation jitter; (4) Gaussian blur; (5) cutout. All randomness is one ``(B, DRAW_SIZE)`` uniform draw from
``generator`` per call, whatever the probabilities, so a batch's augmentation depends on the generator state alone.

Differences from the reference (the paper lists the ops without magnitudes; the authors' code was not consulted):

- Rotation ±20° and M = 14 of 31 levels are the paper's; other magnitudes and all probabilities are ours. RandAug
  is off in ``AugmentConfig()`` (other users keep their recipe); ``fr.augmentation`` turns it on for FR.
- One resample instead of chained ones: exact landmarks, and RandAug's geometric ops act before its photometric ones.
- Ops act on float images, not PIL: Posterize/Equalize on 256 levels, Solarize strictly above its threshold, rotation
  and shear about the centre, one fixed magnitude.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ml.errors import ConfigError
from ml.train.image_ops import (
    autocontrast,
    constant,
    cutout,
    enhance,
    equalize,
    gaussian_blur,
    grey,
    mean_grey,
    photometric,
    posterize,
    smooth,
    solarize,
)

# ArcFace order: left eye, right eye, nose, left mouth, right mouth → after a horizontal flip
FLIP_LANDMARK_ORDER = (1, 0, 2, 4, 3)

# Rec. 601 luma weights for the grey of an RGB pixel

PADDING_MODES = ("zeros", "border", "reflection")
CUTOUT_FILLS = ("zero", "mean")

# RandAugment's 14 ops, in the paper's order (Cubuk et al. 2020); a slot's op is RANDAUG_OPS[floor(14·u)]
RANDAUG_OPS = (
    "Identity", "AutoContrast", "Equalize", "Rotate", "Solarize", "Color", "Posterize", "Contrast",
    "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateX", "TranslateY",
)
GEOMETRIC_OPS = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
RANDAUG_LEVELS = 30  # magnitude M ∈ {0, …, 30}: the 31 levels of the paper's "14/31"
RANDAUG_MAX_OPS = 4  # slots always drawn, so the draw's size does not depend on N
# strength at M = 30 (torchvision's RandAugment ranges)
_MAX_ROTATE_DEG = 30.0
_MAX_SHEAR = 0.3  # x' = x + k·y about the centre
_MAX_TRANSLATE = 150.0 / 331.0  # fraction of the side
_MAX_ENHANCE = 0.9  # Brightness/Color/Contrast/Sharpness factor 1 ± 0.9
_MIN_POSTERIZE_BITS = 4

# columns of the per-call uniform draw (B, DRAW_SIZE): 0–20 the fixed recipe, 21 RandAug on/off, then
# (op, sign) for each of RANDAUG_MAX_OPS slots
_RANDAUG_ON = 21
_RANDAUG_SLOTS = 22
DRAW_SIZE = _RANDAUG_SLOTS + 2 * RANDAUG_MAX_OPS


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
    # RandAugment per image; 0 here keeps the aligner/discovery/fusion recipes as they were, while
    # fr.augmentation in params.yaml sets 0.5 for FR training
    randaug_prob: float = 0.0
    randaug_ops: int = 2  # N ops per image, 0..RANDAUG_MAX_OPS
    randaug_magnitude: int = 14  # M on 0..30 (31 levels); paper: 14/31

    def __post_init__(self) -> None:
        for name in ("flip_prob", "scale_prob", "translate_prob", "rotate_prob", "brightness_prob",
                     "contrast_prob", "saturation_prob", "blur_prob", "cutout_prob", "randaug_prob"):
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
        for name, high in (("randaug_ops", RANDAUG_MAX_OPS), ("randaug_magnitude", RANDAUG_LEVELS)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ConfigError(f"fr.augmentation.{name} = {value!r}: need an integer in 0..{high}")


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
    return affine_map(x, keypoints, base_linear(flip, scale, angle), shift, flip, padding_mode)


def base_linear(flip: torch.Tensor, scale: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Forward linear part (B, 2, 2) ``s·R(r)·F = s·[[f·cos, −sin], [f·sin, cos]]``; f = −1 where flipped."""
    f = torch.where(flip, -1.0, 1.0).to(scale.dtype)
    cos, sin = torch.cos(angle).to(scale.dtype), torch.sin(angle).to(scale.dtype)
    rows = [torch.stack([f * cos, -sin], -1), torch.stack([f * sin, cos], -1)]
    return torch.stack(rows, 1) * scale.view(-1, 1, 1)


def affine_map(
    x: torch.Tensor,
    keypoints: torch.Tensor | None,
    linear: torch.Tensor,
    shift: torch.Tensor,
    flip: torch.Tensor,
    padding_mode: str = "zeros",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One bilinear resample of square images by the forward map ``o = A·n + t`` in normalised coordinates.

    ``linear`` (B, 2, 2) is ``A`` (invertible), ``shift`` (B, 2) is ``t`` (a side spans 2); the image is
    sampled at ``n = A⁻¹·(o − t)``. Pixel landmarks (B, K, 2) go through the forward map exactly; rows where
    ``flip`` (B,) bool is set (``A`` mirrors them) get their left/right points swapped.
    """
    b, size = x.shape[0], x.shape[-1]
    if x.shape[-2] != size:
        raise ValueError(f"affine augmentation needs square images, got {tuple(x.shape[-2:])}")
    a = linear.to(x.dtype)
    d = shift.to(x.dtype)
    det = (a[:, 0, 0] * a[:, 1, 1] - a[:, 0, 1] * a[:, 1, 0]).view(b, 1, 1)
    adj = torch.stack([torch.stack([a[:, 1, 1], -a[:, 0, 1]], -1), torch.stack([-a[:, 1, 0], a[:, 0, 0]], -1)], 1)
    inv = adj / det  # A⁻¹ = adj(A) / det(A)
    theta = torch.cat([inv, -(inv @ d.unsqueeze(-1))], dim=2)  # (B, 2, 3): n = A⁻¹·o − A⁻¹·t
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)
    if keypoints is None:
        return out, None
    n = pixel_to_normalised(keypoints.to(x.dtype), size)  # (B, K, 2)
    moved = normalised_to_pixel(n @ a.transpose(1, 2) + d.unsqueeze(1), size)
    moved = torch.where(flip.view(b, 1, 1), moved[:, list(FLIP_LANDMARK_ORDER)], moved)
    return out, moved.to(keypoints.dtype)


def posterize_bits(magnitude: int) -> int:
    """Bits Posterize keeps at level M: ``8 − round(4·M/30)`` (8 at M = 0, 6 at M = 14, 4 at M = 30)."""
    return 8 - round((8 - _MIN_POSTERIZE_BITS) * magnitude / RANDAUG_LEVELS)


def solarize_threshold(magnitude: int) -> float:
    """Solarize's threshold at level M: ``1 − M/30``."""
    return 1.0 - magnitude / RANDAUG_LEVELS


# photometric RandAug ops: (images, enhance factor (B,), magnitude) → images
_PHOTOMETRIC_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "AutoContrast": lambda x, f, m: autocontrast(x),
    "Equalize": lambda x, f, m: equalize(x),
    "Solarize": lambda x, f, m: solarize(x, solarize_threshold(m)),
    "Posterize": lambda x, f, m: posterize(x, posterize_bits(m)),
    "Color": lambda x, f, m: enhance(x, grey(x), f),  # saturation: blend with each pixel's grey
    "Contrast": lambda x, f, m: enhance(x, mean_grey(x), f),  # blend with the image's mean grey
    "Brightness": lambda x, f, m: enhance(x, torch.zeros((), dtype=x.dtype, device=x.device), f),  # with black
    "Sharpness": lambda x, f, m: enhance(x, smooth(x), f),  # with the smoothed image
}


def randaug_choices(u: torch.Tensor, cfg: AugmentConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's RandAug ops (B, N) as indices into ``RANDAUG_OPS`` and their signs ±1 (B, N), from the draw.

    Samples that do not draw RandAug get Identity in every slot.
    """
    on = u[:, _RANDAUG_ON] < cfg.randaug_prob
    cols = u[:, _RANDAUG_SLOTS : _RANDAUG_SLOTS + 2 * cfg.randaug_ops]
    ops = (cols[:, 0::2] * len(RANDAUG_OPS)).long().clamp(max=len(RANDAUG_OPS) - 1)
    ops = torch.where(on.unsqueeze(1), ops, RANDAUG_OPS.index("Identity"))
    signs = torch.where(cols[:, 1::2] < 0.5, -1.0, 1.0)
    return ops, signs


def randaug_geometry(ops: torch.Tensor, signs: torch.Tensor, magnitude: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward map ``(L (B, 2, 2), l (B, 2))`` of each sample's geometric RandAug ops, composed in slot order.

    In normalised coordinates about the centre, with ``λ = M/30`` and ``±`` the slot's sign: Rotate
    ``R(±30°·λ)``; ShearX ``[[1, ±0.3λ], [0, 1]]``; ShearY ``[[1, 0], [±0.3λ, 1]]``; TranslateX/Y a shift of
    ``±(150/331)·λ`` of the side (``2×`` that in normalised units). Other ops are the identity.
    """
    level = magnitude / RANDAUG_LEVELS
    b = ops.shape[0]
    linear = torch.eye(2, device=ops.device).expand(b, 2, 2).clone()
    shift = torch.zeros(b, 2, device=ops.device)
    code = {name: RANDAUG_OPS.index(name) for name in GEOMETRIC_OPS}
    for k in range(ops.shape[1]):
        op, sign = ops[:, k], signs[:, k]
        angle = torch.where(op == code["Rotate"], sign * math.radians(_MAX_ROTATE_DEG * level), 0.0)
        cos, sin = torch.cos(angle), torch.sin(angle)
        shear_x = torch.where(op == code["ShearX"], sign * (_MAX_SHEAR * level), 0.0)
        shear_y = torch.where(op == code["ShearY"], sign * (_MAX_SHEAR * level), 0.0)
        move_x = torch.where(op == code["TranslateX"], sign * (2.0 * _MAX_TRANSLATE * level), 0.0)
        move_y = torch.where(op == code["TranslateY"], sign * (2.0 * _MAX_TRANSLATE * level), 0.0)
        # one op per slot, so at most one of rotation/shear is not the identity and the sum is exact
        step = torch.stack([torch.stack([cos, shear_x - sin], -1), torch.stack([sin + shear_y, cos], -1)], 1)
        linear = step @ linear
        shift = (step @ shift.unsqueeze(-1)).squeeze(-1) + torch.stack([move_x, move_y], -1)
    return linear, shift


def randaug_photometric(
    x: torch.Tensor, ops: torch.Tensor, signs: torch.Tensor, magnitude: int, *, inplace: bool = False
) -> torch.Tensor:
    """The photometric RandAug ops of each sample (slot by slot) on images in [0, 1]; other ops leave it alone.

    AutoContrast, Equalize, Posterize (``posterize_bits(M)``) and Solarize (``solarize_threshold(M)``) as their
    functions here; with ``f = 1 ± 0.9·M/30``, each through ``enhance`` (clamped): Brightness ``x·f``,
    Color ``g + f·(x − g)`` (``g`` each pixel's grey), Contrast ``ḡ + f·(x − ḡ)`` (``ḡ`` the image's mean
    grey), Sharpness ``s + f·(x − s)`` (``s = smooth(x)``). ``inplace`` writes into ``x`` instead of a copy.
    """
    level = magnitude / RANDAUG_LEVELS
    dense = _dense(x)
    if not dense and not torch.isin(ops, _codes(_PHOTOMETRIC_OPS, ops.device)).any():
        return x
    if not inplace:
        x = x.clone()  # one copy, then in place: an out-of-place index_copy per op would copy the batch each time
    for k in range(ops.shape[1]):
        for name, apply in _PHOTOMETRIC_OPS.items():
            rows = _Rows.of(ops[:, k] == RANDAUG_OPS.index(name), dense)
            if rows is None:
                continue
            factor = 1.0 + rows.pick(signs[:, k]) * (_MAX_ENHANCE * level)
            x = rows.merge(apply(rows.pick(x), factor, magnitude), x)
    return x


def _codes(names: Sequence[str], device: torch.device) -> torch.Tensor:
    return constant(tuple(RANDAUG_OPS.index(n) for n in names), device, torch.int64)


# devices where an op runs on the rows that draw it alone; elsewhere (accelerators) on every row, keeping the drawn
# rows' results, since finding the rows means reading a mask back and waiting for the device's queue to drain
SPARSE_DEVICES: tuple[str, ...] = ("cpu",)


def _dense(x: torch.Tensor) -> bool:
    return x.device.type not in SPARSE_DEVICES


class _Rows:
    """The rows of a batch that an op applies to (a bool mask (B,)). Sparse: their indices, read back from the mask;
    ``pick`` gathers them, ``merge`` writes results into them in place. Dense: ``pick`` returns every row, ``merge``
    keeps the result where the mask is set. Every op works on each image alone: both give a row the same values."""

    def __init__(self, mask: torch.Tensor, index: torch.Tensor | None) -> None:
        self.mask, self.index = mask, index

    @classmethod
    def of(cls, mask: torch.Tensor, dense: bool) -> _Rows | None:
        """The rows where ``mask`` is set; ``None`` when sparse and there are none."""
        if dense:
            return cls(mask, None)
        index = mask.nonzero().squeeze(1)
        return cls(mask, index) if index.numel() else None

    @property
    def every(self) -> bool:  # sparse, and every row drawn
        return self.index is not None and self.index.numel() == self.mask.shape[0]

    def pick(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.index is None or self.every else t[self.index]

    def merge(self, part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """``whole`` with the rows' values from ``part`` (sparse: in place, returning ``whole``)."""
        if part is whole:  # an op that left every row alone
            return whole
        if self.index is None:
            return torch.where(self.mask.view((-1,) + (1,) * (whole.ndim - 1)), part, whole)
        return whole.index_copy_(0, self.index, part)


class _Batch:
    """The batch being augmented, written in place row by row once it is our own copy.

    ``take(rows)`` gives the rows an op reads, ``put(rows, part)`` writes its result back. The caller's
    tensor is copied once, on the first write (instead of one ``index_copy`` of the whole batch per op), and a
    selection of every row is the batch itself, not a gathered copy; the values are those of gathering and
    ``index_copy``-ing, since every op works on each image alone.
    """

    def __init__(self, x: torch.Tensor):
        self.x, self._owned = x, False

    def take(self, rows: _Rows) -> torch.Tensor:
        return rows.pick(self.x)

    def own(self) -> None:
        """Make ``x`` ours to write into (a copy of the caller's tensor, made once)."""
        if not self._owned:
            self.x, self._owned = self.x.clone(), True

    def put(self, rows: _Rows, part: torch.Tensor) -> None:
        if rows.every:
            self.x, self._owned = part, True  # a fresh result of an out-of-place op: ours
        elif rows.index is None:
            self.x, self._owned = rows.merge(part, self.x), True
        else:
            self.own()
            self.x[rows.index] = part


def augment_kprpe(
    x: torch.Tensor,
    keypoints: torch.Tensor | None = None,
    cfg: AugmentConfig = AugmentConfig(),
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The KP-RPE recipe on RGB images in [0, 1] (B, 3, S, S) and optional pixel landmarks (B, 5, 2).

    Returns ``(images, landmarks)`` (``None`` landmarks when none were given). Samples an op leaves out
    are returned unchanged by that op. Random numbers are one ``(B, DRAW_SIZE)`` uniform draw on
    ``generator``'s device (the CPU when ``None``, from the global generator), moved to the images' device
    (from pinned memory to a CUDA device, so that the copy does not wait for the device's queue). ``compiled``
    runs ``augment_with`` through ``torch.compile`` where its dense path applies (on accelerators), the same values
    in fewer kernels.
    """
    gen_device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(x.shape[0], DRAW_SIZE, generator=generator, device=gen_device)  # (B, 30) in [0, 1)
    if u.device.type == "cpu" and x.device.type == "cuda":
        u = u.pin_memory().to(x.device, non_blocking=True)
    # pixel maths in the images' own dtype: under a mixed-precision trainer autocast would turn the blur's and the
    # resample's outputs to 16 bits, which cannot be written back into the float32 batch
    with torch.autocast(x.device.type, enabled=False):
        fn = _compiled_augment_with() if compiled and _dense(x) else augment_with
        return fn(x, keypoints, cfg, u)


@functools.cache
def _compiled_augment_with() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    return torch.compile(augment_with)


def augment_with(
    x: torch.Tensor, keypoints: torch.Tensor | None, cfg: AugmentConfig, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``augment_kprpe`` as a pure function of its uniform draw ``u`` (B, DRAW_SIZE) in [0, 1).

    Columns: 0 flip; 1–2 scale on/value; 3–4 rotation; 5–7 translation on/(x, y); 8–13 brightness,
    contrast, saturation on/value; 14–15 blur; 16–20 cutout on/area/ratio/centre; 21 RandAug on; then
    (op, sign) per RandAug slot: op ``RANDAUG_OPS[⌊14·u⌋]``, sign − below 0.5.
    """
    if u.shape != (x.shape[0], DRAW_SIZE):
        raise ValueError(f"augment_with needs uniforms of shape {(x.shape[0], DRAW_SIZE)}, got {tuple(u.shape)}")
    size = x.shape[-1]
    u = u.to(x.device, torch.float32)
    dense = _dense(x)
    batch = _Batch(x)  # the caller's x is never written
    kp = keypoints
    ops, signs = randaug_choices(u, cfg)  # (B, N) each; Identity where RandAug is not drawn
    magnitude = cfg.randaug_magnitude

    # 1. geometry: identity parameters where an op is not drawn; RandAug's geometric ops composed after
    flip = u[:, 0] < cfg.flip_prob
    scale = torch.where(u[:, 1] < cfg.scale_prob, _between(u[:, 2], cfg.scale_range), 1.0)
    angle = torch.where(u[:, 3] < cfg.rotate_prob, (2.0 * u[:, 4] - 1.0) * math.radians(cfg.max_rotate_deg), 0.0)
    shift = torch.where(
        (u[:, 5] < cfg.translate_prob).unsqueeze(1), (2.0 * u[:, 6:8] - 1.0) * (2.0 * cfg.max_translate), 0.0
    )
    randaug_moved = torch.isin(ops, _codes(GEOMETRIC_OPS, ops.device)).any(dim=1) & (magnitude > 0)
    moved = flip | (u[:, 1] < cfg.scale_prob) | (u[:, 3] < cfg.rotate_prob) | (u[:, 5] < cfg.translate_prob)
    rows = _Rows.of(moved | randaug_moved, dense)
    if rows is not None:
        pick = rows.pick
        step, step_shift = randaug_geometry(pick(ops), pick(signs), magnitude)  # (R, 2, 2), (R, 2)
        linear = step @ base_linear(pick(flip), pick(scale), pick(angle))
        offset = (step @ pick(shift).unsqueeze(-1)).squeeze(-1) + step_shift
        part, part_kp = affine_map(
            batch.take(rows), None if kp is None else pick(kp), linear, offset, pick(flip), cfg.padding_mode
        )
        batch.put(rows, part)
        if kp is not None:
            kp = rows.merge(part_kp, kp.clone())

    # 2. RandAug's photometric ops, slot by slot
    if cfg.randaug_prob > 0 and cfg.randaug_ops > 0:
        batch.own()
        batch.x = randaug_photometric(batch.x, ops, signs, magnitude, inplace=True)

    # 3. photometric jitter
    on_b, on_c, on_s = u[:, 8] < cfg.brightness_prob, u[:, 10] < cfg.contrast_prob, u[:, 12] < cfg.saturation_prob
    rows = _Rows.of(on_b | on_c | on_s, dense)
    if rows is not None:
        bright = torch.where(on_b, _between(u[:, 9], cfg.brightness_range), 1.0)
        contrast = torch.where(on_c, _between(u[:, 11], cfg.contrast_range), 1.0)
        sat = torch.where(on_s, _between(u[:, 13], cfg.saturation_range), 1.0)
        batch.put(rows, photometric(batch.take(rows), rows.pick(bright), rows.pick(contrast), rows.pick(sat)))

    # 4. blur, σ scaled from 112 px to this size; clamped because the rounded kernel sum can overshoot 1 by an ulp
    rows = _Rows.of(u[:, 14] < cfg.blur_prob, dense)
    if rows is not None:
        scale_px = size / 112.0
        sigma = _between(u[:, 15], cfg.blur_sigma) * scale_px
        top = cfg.blur_sigma[1] * scale_px if dense else None  # the range's top: no read-back of σ
        batch.put(rows, gaussian_blur(batch.take(rows), rows.pick(sigma), top).clamp_(0.0, 1.0))

    # 5. cutout: area a·S², height/width ratio r → h = S·√(a·r), w = S·√(a/r), centre anywhere in the image
    rows = _Rows.of(u[:, 16] < cfg.cutout_prob, dense)
    if rows is not None:
        area = _between(u[:, 17], cfg.cutout_area)
        lo, hi = math.log(cfg.cutout_ratio[0]), math.log(cfg.cutout_ratio[1])
        ratio = torch.exp(lo + (hi - lo) * u[:, 18])
        h = (size * torch.sqrt(area * ratio)).clamp(max=size)
        w = (size * torch.sqrt(area / ratio)).clamp(max=size)
        cy = u[:, 19] * size
        cx = u[:, 20] * size
        boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=1)
        batch.put(rows, cutout(batch.take(rows), rows.pick(boxes), cfg.cutout_fill))
    return batch.x, kp
