"""Surveillance-quality faces: IJB-S-like video probes and the degraded sets CAFace trains on.

In IJB-S most frames of a surveillance video are unusable (the person far from the camera: a few pixels across,
blurred, noisy, compressed) and a few, when the person passes near the camera, are usable. Set fusion can only show
its worth on such probes: when every frame is of similar quality, averaging is already the best template.

- :func:`surveillance_sequence` (and :func:`stream_surveillance_sequence`, one frame at a time): pose, expression,
  light, background and occluders follow :meth:`ProceduralFaces.sequence`'s smooth walk; a contiguous usable window
  of ``max(1, round(usable_fraction · length))`` frames gets mild degradations, every other frame heavy ones, each
  smooth in time (knots every 8 frames, cosine interpolation). ``quality`` is the renderer's ``quality_score``.
- :func:`fusion_faces`: CAFace's material for one identity after ``mk-minchul/caface``: clean renders (the targets
  ``f_GT``) and ``copies`` degraded renders of each of ``sources`` poses (usable with probability ``usable_fraction``).
- :func:`degrade_image`: the same degradation on any aligned face (CAFace's sets from real faces).

The ranges are :class:`SurveillanceConfig` (``params.yaml`` ``data.surveillance``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import numpy as np
from PIL import Image, ImageFilter

from ml.data.procedural import FaceSample, ProceduralFaces
from ml.errors import ConfigError

__all__ = [
    "FUSION_FIRST_IDENTITY",
    "NO_DEGRADATION",
    "PROBE_SEQ_INDEX",
    "SurveillanceConfig",
    "clean_capture",
    "degrade_image",
    "draw_copy_degradation",
    "draw_degradation",
    "fusion_faces",
    "stream_surveillance_sequence",
    "surveillance_sequence",
]

# CAFace's procedural training identities start here: far from every other prepared set, whatever their sizes.
FUSION_FIRST_IDENTITY = 1_000_000
# the sequence index of every IJB-S-like probe (``ProceduralFaces.iter_sequence_nuisance``): its poses and light
PROBE_SEQ_INDEX = 7
# a camera that adds nothing: full resolution, no blur, no noise, no compression
NO_DEGRADATION = {"lowres": 1.0, "blur": 0.0, "noise": 0.0, "jpeg_quality": 100}
_DEGRADATION_KEYS = ("lowres", "blur", "noise", "jpeg_quality")
_OCCLUDERS = ("glasses", "sunglasses", "mask", "bar")


def _range(value: Sequence[float], name: str, lo: float, hi: float) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise ConfigError(f"data.surveillance.{name} must be a [min, max] pair of numbers, got {value!r}")
    a, b = float(value[0]), float(value[1])
    if not lo <= a <= b <= hi:
        raise ConfigError(f"data.surveillance.{name} = [{a}, {b}] must satisfy {lo} ≤ min ≤ max ≤ {hi}")
    return a, b


@dataclass(frozen=True)
class SurveillanceConfig:
    """``params.yaml`` ``data.surveillance``: how usable and how degraded probe frames and CAFace's sets are."""

    usable_fraction: float = 0.1  # share of a probe's frames in its usable window (at least one frame)
    heavy_lowres: tuple[float, float] = (0.1, 0.3)  # capture resolution, fraction of the side
    heavy_blur: tuple[float, float] = (1.0, 3.5)  # Gaussian σ in 112-px units
    heavy_noise: tuple[float, float] = (4.0, 20.0)  # Gaussian std on 0..255
    heavy_jpeg: tuple[float, float] = (8.0, 40.0)  # JPEG quality
    usable_lowres: tuple[float, float] = (0.7, 1.0)
    usable_blur: tuple[float, float] = (0.0, 0.6)
    usable_noise: tuple[float, float] = (0.0, 3.0)
    usable_jpeg: tuple[float, float] = (70.0, 100.0)

    def __post_init__(self) -> None:
        if isinstance(self.usable_fraction, bool) or not isinstance(self.usable_fraction, (int, float)) \
                or not 0.0 < self.usable_fraction <= 1.0:
            raise ConfigError(f"data.surveillance.usable_fraction = {self.usable_fraction!r} must lie in (0, 1]")
        limits = {"lowres": (0.05, 1.0), "blur": (0.0, 10.0), "noise": (0.0, 60.0), "jpeg": (1.0, 100.0)}
        for f in fields(self):
            if f.name != "usable_fraction":
                lo, hi = limits[f.name.split("_", 1)[1]]
                object.__setattr__(self, f.name, _range(getattr(self, f.name), f.name, lo, hi))


def draw_degradation(rng: np.random.Generator, cfg: SurveillanceConfig, usable: bool) -> dict[str, float]:
    """One frame's ``lowres``, ``blur``, ``noise``, ``jpeg_quality`` (uniform in the usable or heavy ranges)."""
    kind = "usable" if usable else "heavy"
    return {key: float(rng.uniform(*getattr(cfg, f"{kind}_{key.split('_')[0]}"))) for key in _DEGRADATION_KEYS}


def draw_copy_degradation(rng: np.random.Generator, cfg: SurveillanceConfig) -> dict[str, float]:
    """A training copy's degradation: usable with probability ``cfg.usable_fraction``, heavy otherwise."""
    return draw_degradation(rng, cfg, bool(rng.random() < cfg.usable_fraction))


def _apply(nuisance: dict, degradation: dict[str, float], noise_seed: int) -> dict:
    n = dict(nuisance)
    n.update(lowres=degradation["lowres"], blur=degradation["blur"], noise=degradation["noise"],
             jpeg_quality=int(round(degradation["jpeg_quality"])), noise_seed=int(noise_seed))
    return n


def _knots(rng: np.random.Generator, cfg: SurveillanceConfig, usable: bool, length: int,
           stride: int) -> list[dict[str, float]]:
    return [draw_degradation(rng, cfg, usable) for _ in range((length - 1) // stride + 2)]


def surveillance_sequence(gen: ProceduralFaces, identity: int, length: int, seq_index: int = 0,
                          cfg: SurveillanceConfig = SurveillanceConfig()) -> list[FaceSample]:
    """A probe of ``length`` frames: mostly heavily degraded, a usable window of ``⌈usable_fraction·length⌉``
    frames (rounded, at least one) at a random place; deterministic in (generator seed, identity, seq_index)."""
    return list(stream_surveillance_sequence(gen, identity, length, seq_index, cfg))


def stream_surveillance_sequence(gen: ProceduralFaces, identity: int, length: int, seq_index: int = 0,
                                 cfg: SurveillanceConfig = SurveillanceConfig()) -> Iterator[FaceSample]:
    """The frames of :func:`surveillance_sequence`, rendered one at a time, holding only the knots of the pose
    walk and of the two degradation tracks (every 8 frames, cosine interpolation between them) and one noise seed
    per frame: a 20,000-frame probe at 64 px would be 246 MB of images as a list. Arguments are checked at the
    call."""
    nuisances = gen.iter_sequence_nuisance(identity, length, seq_index)
    rng = np.random.default_rng([gen.seed, 91, int(identity), int(seq_index)])
    usable = max(1, int(round(cfg.usable_fraction * length)))
    start = int(rng.integers(0, length - usable + 1))
    stride = 8
    heavy, mild = _knots(rng, cfg, False, length, stride), _knots(rng, cfg, True, length, stride)
    seeds = rng.integers(0, 2**31, size=length)

    def frames() -> Iterator[FaceSample]:
        for t, n in enumerate(nuisances):
            knots = mild if start <= t < start + usable else heavy
            j, frac = divmod(t, stride)
            w = 0.5 - 0.5 * math.cos(math.pi * frac / stride)
            degradation = {k: (1 - w) * knots[j][k] + w * knots[j + 1][k] for k in _DEGRADATION_KEYS}
            yield gen.render(identity, _apply(n, degradation, seeds[t]))

    return frames()


def clean_capture(gen: ProceduralFaces, identity: int, length: int, frames: Sequence[int],
                  seq_index: int = PROBE_SEQ_INDEX) -> list[FaceSample]:
    """Frames ``frames`` (indices in 0 … length − 1) of the probe :func:`surveillance_sequence` renders for
    (``identity``, ``length``, ``seq_index``), as a good camera would have filmed them: the same pose, expression,
    light, background and occluders, without the capture degradations (``NO_DEGRADATION``). The clean source of
    each frame: the set-fusion benchmark's reference for what removing degradation could give."""
    wanted = sorted({int(t) for t in frames})
    if wanted and not 0 <= wanted[0] <= wanted[-1] < length:
        raise ValueError(f"frame indices must lie in 0 … {length - 1}, got {wanted[0]} … {wanted[-1]}")
    picked, out = set(wanted), []
    for t, n in enumerate(gen.iter_sequence_nuisance(identity, length, seq_index)):
        if t in picked:
            out.append(gen.render(identity, _apply(n, NO_DEGRADATION, 0)))
    return out


def _clean(nuisance: dict) -> dict:
    n = dict(nuisance)
    n.update(NO_DEGRADATION, **{k: False for k in _OCCLUDERS})
    return n


def fusion_faces(gen: ProceduralFaces, identity: int, clean: int, sources: int, copies: int,
                 cfg: SurveillanceConfig = SurveillanceConfig()) -> tuple[list[FaceSample], list[list[FaceSample]]]:
    """(``clean`` undegraded renders without occluders, ``sources`` lists of ``copies`` degraded renders of one
    pose each) of ``identity``; a copy is usable with probability ``cfg.usable_fraction``, heavy otherwise."""
    rng = np.random.default_rng([gen.seed, 92, int(identity)])
    clean_faces = [gen.render(identity, _clean(gen.sample_nuisance(identity, 40_000 + j))) for j in range(clean)]
    sets = []
    for s in range(sources):
        base = gen.sample_nuisance(identity, 41_000 + s)  # pose, light, background and occluders of this source
        sets.append([
            gen.render(identity, _apply(base, draw_copy_degradation(rng, cfg), int(rng.integers(0, 2**31))))
            for _ in range(copies)
        ])
    return clean_faces, sets


def degrade_image(image: np.ndarray, degradation: dict[str, float], seed: int) -> np.ndarray:
    """An aligned face (H, W, 3) uint8 degraded in image space like a procedural frame: box-downscaled to
    ``lowres`` of its side and bilinearly back, Gaussian blur ``blur`` (112-px σ), noise ``noise`` std, JPEG at
    ``jpeg_quality``."""
    h, w = image.shape[:2]
    pil = Image.fromarray(image)
    sigma = degradation["blur"] * w / 112.0
    if sigma > 0.05:
        pil = pil.filter(ImageFilter.GaussianBlur(sigma))
    small = max(4, int(round(w * degradation["lowres"])))
    if small < w:
        pil = pil.resize((small, max(4, int(round(h * degradation["lowres"])))), Image.BOX).resize((w, h),
                                                                                                   Image.BILINEAR)
    out = np.asarray(pil, dtype=np.float32)
    if degradation["noise"] > 0:
        out = out + np.random.default_rng(seed).normal(0.0, degradation["noise"], out.shape)
    out = np.clip(out + 0.5, 0, 255).astype(np.uint8)
    quality = int(round(degradation["jpeg_quality"]))
    if quality < 100:
        buf = io.BytesIO()
        Image.fromarray(out).save(buf, format="JPEG", quality=quality)
        buf.seek(0)
        out = np.asarray(Image.open(buf).convert("RGB"))
    return out
