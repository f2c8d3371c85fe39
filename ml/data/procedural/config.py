"""The procedural generator's vocabulary: the ArcFace template and canonical frame, feature depths, random
streams, :class:`ProceduralConfig` (how often and how strongly each nuisance occurs), :class:`FaceSample`, the
nuisance keys with their clean values, and :func:`quality_score`."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ml.errors import ConfigError

ARCFACE_TEMPLATE_112 = np.array(
    [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]],
    dtype=np.float32,
)
_TEMPLATE = [tuple(map(float, p)) for p in ARCFACE_TEMPLATE_112]
_CX, _CY = 56.0, 72.0  # centre of rotation and of the depth warp, canonical units

# Depth of each feature in canonical units (how far yaw/pitch shift it), nose tip most.
_Z_EAR, _Z_NECK, _Z_HAIR_BACK, _Z_FACE = -18.0, -10.0, -6.0, 0.0
_Z_MASK, _Z_HAIR_FRONT, _Z_EYE = 2.0, 3.0, 8.0
_Z_MOUTH, _Z_GLASSES, _Z_NOSE_TIP = 9.0, 12.0, 22.0

# Independent random streams: (seed, stream, ...) seeds numpy's SeedSequence.
_STREAM_IDENTITY, _STREAM_SAMPLE, _STREAM_SEQUENCE, _STREAM_MARKS, _STREAM_NONFACE = 1, 2, 3, 4, 5


def _rng(*key: int) -> random.Random:
    """A stream for one key; string seeds are hashed with SHA-512, so streams match across platforms."""
    return random.Random(":".join(str(k) for k in key))


def arcface_template(size: int) -> np.ndarray:
    """The ArcFace 5-point template for a ``size``×``size`` crop: (5, 2) float32 pixel x, y."""
    return ARCFACE_TEMPLATE_112 * np.float32(size / 112.0)


@dataclass(frozen=True)
class ProceduralConfig:
    """Nuisance and difficulty knobs (``params.yaml`` ``data.procedural``).

    ``*_prob`` is how often a nuisance occurs; the other fields set its strength. Lengths marked
    "112-px" are in pixels of a 112×112 crop and scale with ``image_size``.
    """

    image_size: int = 64
    aligned: bool = True
    # pose
    yaw_deg: float = 32.0  # |yaw| uniform up to this
    pitch_deg: float = 14.0
    aligned_rotation_deg: float = 3.0  # aligned mode: std of the jitter around the fitted alignment
    aligned_scale_jitter: float = 0.04  # std of log-scale jitter
    aligned_shift: float = 0.02  # std of translation jitter, fraction of image size
    rotation_deg: float = 30.0  # unaligned mode: |in-plane rotation| uniform up to this
    scale_min: float = 0.55  # unaligned mode: face scale uniform in [scale_min, scale_max]
    scale_max: float = 1.05
    shift: float = 0.14  # unaligned mode: |translation| uniform up to this fraction of image size
    # expression
    smile_prob: float = 0.5
    mouth_open_prob: float = 0.3
    blink_prob: float = 0.1
    # illumination: multiplicative linear gradient, global gain/contrast, per-channel cast
    light_strength: float = 0.55  # gradient amplitude, uniform in [0, this]
    brightness_min: float = 0.6  # global gain uniform in [brightness_min, brightness_max]
    brightness_max: float = 1.2
    contrast_min: float = 0.6  # contrast about mid-grey uniform in [contrast_min, contrast_max]
    contrast_max: float = 1.15
    color_cast: float = 0.08  # std of per-channel gain
    # background
    clutter_max: int = 6  # random shapes behind the face, uniform count in [0, this]
    stripes_prob: float = 0.35
    # occlusion
    glasses_prob: float = 0.15
    sunglasses_prob: float = 0.05
    mask_prob: float = 0.06
    bar_prob: float = 0.08
    # degradations
    blur_prob: float = 0.3
    blur_sigma_max: float = 1.8  # 112-px Gaussian sigma, uniform in [0.4, this]
    noise_prob: float = 0.4
    noise_std_max: float = 14.0  # on the 0..255 scale, uniform in [2, this]
    jpeg_prob: float = 0.4
    jpeg_quality_min: int = 12  # JPEG quality uniform in [this, 90]
    lowres_prob: float = 0.2
    lowres_min: float = 0.25  # captured at a fraction of the size uniform in [this, 0.7], then upsampled

    def __post_init__(self) -> None:
        probs = [f.name for f in fields(self) if f.name.endswith("_prob")]
        for name in probs:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"ProceduralConfig.{name} = {value!r}: a probability must lie in [0, 1].")
        checks = {
            "image_size": 32 <= self.image_size <= 1024,
            "yaw_deg": 0.0 <= self.yaw_deg <= 60.0,
            "pitch_deg": 0.0 <= self.pitch_deg <= 45.0,
            "rotation_deg": 0.0 <= self.rotation_deg <= 180.0,
            "aligned_rotation_deg": self.aligned_rotation_deg >= 0.0,
            "aligned_scale_jitter": self.aligned_scale_jitter >= 0.0,
            "aligned_shift": self.aligned_shift >= 0.0,
            "scale_min": 0.2 <= self.scale_min <= self.scale_max,
            "scale_max": self.scale_max <= 2.0,
            "shift": 0.0 <= self.shift <= 0.5,
            "light_strength": 0.0 <= self.light_strength <= 1.0,
            "brightness_min": 0.1 <= self.brightness_min <= self.brightness_max,
            "contrast_min": 0.1 <= self.contrast_min <= self.contrast_max,
            "color_cast": 0.0 <= self.color_cast <= 0.5,
            "clutter_max": 0 <= self.clutter_max <= 50,
            "blur_sigma_max": self.blur_sigma_max >= 0.4,
            "noise_std_max": self.noise_std_max >= 2.0,
            "jpeg_quality_min": 1 <= self.jpeg_quality_min <= 90,
            "lowres_min": 0.05 <= self.lowres_min <= 0.7,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"ProceduralConfig.{key} = {getattr(self, key)!r} is out of range.")


@dataclass(frozen=True)
class FaceSample:
    """One rendered face."""

    image: np.ndarray  # (H, W, 3) uint8 RGB
    landmarks: np.ndarray  # (5, 2) float32 pixel x, y: left eye, right eye, nose, left/right mouth corner
    quality: float  # [0, 1], 1 = frontal and undegraded
    nuisance: dict = field(default_factory=dict)  # the nuisance values it was rendered with


# The nuisance dict: every key, with its clean (frontal, undegraded, canonical-pose) value.
_CLEAN_NUISANCE: dict[str, Any] = {
    "rotation": 0.0,  # degrees, in-plane, about C
    "scale": 1.0,
    "tx": 0.0,  # translation, fraction of image size
    "ty": 0.0,
    "yaw": 0.0,  # degrees; positive moves the nose towards image right
    "pitch": 0.0,  # degrees; positive moves the nose down
    "smile": 0.0,  # [0, 1]
    "mouth_open": 0.0,  # [0, 1]
    "eye_closure": 0.0,  # [0, 1], 1 = closed
    "light_angle": 0.0,  # degrees, direction of the brighter side
    "light_strength": 0.0,  # gradient amplitude
    "brightness": 1.0,
    "contrast": 1.0,
    "cast_r": 0.0,  # per-channel relative gain
    "cast_g": 0.0,
    "cast_b": 0.0,
    "background_seed": 0,  # background colours, clutter and occluder colours
    "clutter": 0,  # number of random shapes
    "stripes": False,
    "glasses": False,
    "sunglasses": False,
    "mask": False,
    "bar": False,
    "bar_angle": 0.0,  # degrees
    "bar_offset": 0.0,  # signed distance of the bar from the face centre, fraction of image size
    "bar_width": 0.0,  # fraction of image size
    "blur": 0.0,  # Gaussian sigma, 112-px
    "lowres": 1.0,  # capture resolution, fraction of the size
    "noise": 0.0,  # Gaussian std, 0..255 scale
    "noise_seed": 0,
    "jpeg_quality": 100,  # 100 = not compressed
}
NUISANCE_KEYS: tuple[str, ...] = tuple(_CLEAN_NUISANCE)
_INT_NUISANCE = ("background_seed", "clutter", "noise_seed", "jpeg_quality")
_BOOL_NUISANCE = ("stripes", "glasses", "sunglasses", "mask", "bar")
# Values a sequence interpolates between its knots (everything else is fixed per sequence).
_SMOOTH_KEYS = (
    "yaw", "pitch", "smile", "mouth_open", "eye_closure", "light_angle", "light_strength", "brightness",
    "contrast", "blur", "lowres", "noise", "jpeg_quality", "place_rot", "place_scale", "place_tx", "place_ty",
)


def quality_score(nuisance: dict) -> float:
    """Quality in [0, 1]: a product of factors, each non-increasing in one degradation.

    blur σ (112-px): e^(−0.45σ); noise std: e^(−std/30); JPEG quality Q: 1 − 0.5·max(0, 90 − Q)/78;
    low resolution r: r^0.7; occluders: mask 0.6, sunglasses 0.65, glasses 0.95, bar 0.75 − width;
    pose: e^(−(yaw/50°)²)·e^(−(pitch/40°)²); small faces: min(1, scale/0.8)^0.5; darkness and flat
    contrast: min(1, brightness·contrast/0.7)^1.5; light gradient: 1 − 0.2·strength; closed eyes:
    1 − 0.1·closure.
    """
    n = nuisance
    q = math.exp(-0.45 * max(0.0, n["blur"]))
    q *= math.exp(-max(0.0, n["noise"]) / 30.0)
    q *= 1.0 - 0.5 * min(1.0, max(0.0, 90.0 - n["jpeg_quality"]) / 78.0)
    q *= min(1.0, max(0.0, n["lowres"])) ** 0.7
    if n["mask"]:
        q *= 0.6
    if n["sunglasses"]:
        q *= 0.65
    elif n["glasses"]:
        q *= 0.95
    if n["bar"]:
        q *= max(0.2, 0.75 - n["bar_width"])
    q *= math.exp(-((n["yaw"] / 50.0) ** 2)) * math.exp(-((n["pitch"] / 40.0) ** 2))
    q *= min(1.0, n["scale"] / 0.8) ** 0.5
    q *= min(1.0, max(0.0, n["brightness"] * n["contrast"]) / 0.7) ** 1.5
    q *= 1.0 - 0.2 * min(1.0, max(0.0, n["light_strength"]))
    q *= 1.0 - 0.1 * min(1.0, max(0.0, n["eye_closure"]))
    return float(min(1.0, max(0.0, q)))
