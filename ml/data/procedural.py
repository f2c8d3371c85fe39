"""Procedural faces: the embedded default dataset, with exact 5-point landmarks.

An *identity* is a fixed random vector of facial geometry and appearance (face outline and jaw, skin
tone, eyes, iris colour, brows, nose, mouth, ears, hair colour/line/style, beard, moles and freckles),
sampled from ``(seed, identity)``. A *sample* draws that identity under per-image nuisance sampled from
``(seed, identity, index)``: pose (in-plane rotation, yaw, pitch, scale, translation), expression,
illumination and colour cast, background clutter, occluders (glasses, sunglasses, mask, bar) and
degradations (blur, low resolution, noise, JPEG). :class:`ProceduralConfig` sets how often and how
strongly each nuisance occurs.

Frames and the exact landmarks
------------------------------
Shapes are defined in a *canonical frame* measured in ArcFace-112 units: an average frontal face put
there has its 5 landmarks on the ArcFace template. Each feature has a depth ``z`` (nose 22, mouth 9,
eyes and brows 8, face outline 0, hair behind −6, ears −18). Rendering a canonical point ``p`` at depth
``z`` takes two maps:

- depth warp (yaw ψ, pitch φ):  ``q = C + diag(cos ψ, cos φ) (p − C) + z (sin ψ, sin φ)``, so the nose
  shifts sideways more than the eyes and the outline compresses;
- similarity:                   ``out = s R(θ) (q − C) + C + t``, then ``pixel = out · size / 112``,

with ``C = (56, 72)``, ``t = 112·(tx, ty)`` and pixel centres at integer coordinates. Both maps are
affine for a fixed depth, so every feature is drawn by inverse-mapping its pixel box into its own
canonical frame and evaluating soft-edged implicit shapes there (1-px linear edges for antialiasing),
alpha-composited back to front.
The 5 landmarks are the canonical eye centres, nose tip and mouth corners pushed through the very same
two maps, so they are exact for every pose and expression.

In ``aligned`` mode the similarity is the least-squares fit (Umeyama) of the warped landmarks onto the
ArcFace template, as a 5-point aligner would produce, plus a small jitter; the identity's own geometry
still moves the landmarks off the template. In unaligned mode a large random similarity about the image
centre is composed on top of that fit.

Quality is a product of per-degradation factors in ``[0, 1]`` (blur, noise, JPEG, low resolution,
occlusion, pose, darkness), so more of any degradation never raises it; see :func:`quality_score`.

:func:`render_nonface` draws crops without a usable face from the same renderer (background clutter alone,
a face pushed out of the frame, a face under an opaque cover), negatives for a face/no-face score.

Determinism and speed
---------------------
Identities draw from ``numpy.random.default_rng([seed, 1, identity])``; per-image nuisance draws from
Python's ``random.Random`` seeded with strings such as ``"seed:2:identity:index"`` (hashed with SHA-512,
the same on every platform, and far cheaper per scalar draw than numpy). Every draw is made whether or
not its nuisance fires, so changing one probability does not reshuffle the others. A 112×112 face costs
a few hundred small numpy calls, so the renderer minimises calls rather than arithmetic: features are
evaluated only in their pixel box, mirrored pairs (eyes, brows, ears, nostrils) in one pass, on a
contiguous copy of the box; Gaussian blur is separable shifted adds (no BLAS, whose threads misbehave
in busy data loaders) and sensor noise is a seeded window of a fixed noise bank.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import random
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from PIL import Image

from ml.errors import ConfigError

__all__ = [
    "ARCFACE_TEMPLATE_112",
    "FaceSample",
    "NONFACE_KINDS",
    "NUISANCE_KEYS",
    "ProceduralConfig",
    "ProceduralFaces",
    "arcface_template",
    "nonface_kind",
    "quality_score",
    "render_nonface",
    "render_nonfaces",
]

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

_HAIR_COLOURS = np.array(
    [[22, 18, 16], [48, 32, 24], [84, 56, 36], [118, 78, 46], [128, 58, 32], [196, 160, 104], [150, 146, 142]],
    dtype=np.float32,
)
_HAIR_WEIGHTS = np.array([0.26, 0.22, 0.17, 0.11, 0.07, 0.1, 0.07])
_IRIS_COLOURS = np.array(
    [[52, 30, 18], [92, 56, 30], [112, 92, 48], [70, 108, 66], [70, 110, 160], [110, 120, 130]], dtype=np.float32
)
_IRIS_WEIGHTS = np.array([0.3, 0.25, 0.13, 0.1, 0.14, 0.08])
_SKIN_LIGHT = np.array([236, 200, 174], dtype=np.float32)
_SKIN_DARK = np.array([96, 62, 46], dtype=np.float32)
_LIP_RED = np.array([172, 72, 78], dtype=np.float32)
_SCLERA = np.array([236, 232, 226], dtype=np.float32).reshape(3, 1, 1)
_PUPIL = np.array([14, 10, 10], dtype=np.float32).reshape(3, 1, 1)
_LASH = np.array([28, 20, 20], dtype=np.float32).reshape(3, 1, 1)
_HAIR_STYLES = ("short", "fringe", "side_part", "long", "receding")
_HAIR_STYLE_WEIGHTS = np.array([0.3, 0.2, 0.2, 0.2, 0.1])
_N_MOLES = 3


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


# --------------------------------------------------------------------------------------------------
# Identities


def _face_half_width(p: dict[str, float], y: float) -> float:
    """Half width of the face outline (see :func:`_face_sd`) at canonical height ``y``, by bisection."""
    h, lam, mu = p["face_h"], p["face_square"], p["chin_shape"]
    t = min(1.0, max(0.0, (y - p["face_cy"]) / h))
    w = p["face_w"] * (1.0 - p["jaw_taper"] * ((1.0 - mu) * t + mu * t * t))
    yy = min(1.0, abs(y - p["face_cy"]) / h)
    lo, hi = 0.0, 1.0
    for _ in range(30):
        x = 0.5 * (lo + hi)
        if (1.0 - lam) * math.hypot(x, yy) + lam * max(x, yy) < 1.0:
            lo = x
        else:
            hi = x
    return lo * w


def _sample_identity(seed: int, identity: int) -> dict[str, float]:
    """The identity's parameters; every draw is unconditional so one stream position = one parameter."""
    rng = np.random.default_rng([seed, _STREAM_IDENTITY, identity])

    def u(lo: float, hi: float) -> float:
        return float(rng.uniform(lo, hi))

    p: dict[str, float] = {}
    p["face_w"] = u(32.5, 39.5)  # half width of the upper face
    p["face_h"] = u(41.5, 48.5)  # half height
    p["face_cy"] = u(62.5, 67.5)
    p["face_square"] = u(0.15, 0.55)  # 0 = oval, higher = squarer (blend of L2 and L∞ norms)
    p["jaw_taper"] = u(0.05, 0.35)  # how much the face narrows towards the chin
    p["chin_shape"] = u(0.0, 1.0)  # taper profile: 0 = linear (V-shaped jaw), 1 = quadratic (round)
    tone, warmth = float(rng.beta(1.4, 1.4)), u(-1.0, 1.0)
    skin = _SKIN_LIGHT + (_SKIN_DARK - _SKIN_LIGHT) * tone + warmth * np.array([9.0, 0.0, -9.0])
    p["skin_r"], p["skin_g"], p["skin_b"] = (float(c) for c in skin)
    p["eye_dx"] = u(15.5, 19.7)  # half the distance between the eye centres
    p["eye_y"] = u(49.5, 54.0)
    p["eye_w"] = u(5.0, 7.0)  # half width of the eye opening
    p["eye_aspect"] = u(0.36, 0.62)  # half height / half width
    p["eye_tilt"] = u(-9.0, 9.0)  # degrees, positive = outer corners up
    iris = _IRIS_COLOURS[rng.choice(len(_IRIS_COLOURS), p=_IRIS_WEIGHTS)] * rng.uniform(0.85, 1.15, 3)
    p["iris_r"], p["iris_g"], p["iris_b"] = (float(c) for c in np.clip(iris, 0, 255))
    p["iris_frac"] = u(0.42, 0.56)  # iris radius / eye half width
    p["brow_thick"] = u(1.2, 3.4)
    p["brow_angle"] = u(-12.0, 12.0)  # degrees, positive = outer ends up
    p["brow_gap"] = u(7.5, 12.5)  # brow height above the eye centre
    p["brow_len"] = u(1.05, 1.5)  # brow half length / eye half width
    p["brow_arch"] = u(0.0, 2.8)
    p["brow_dark"] = u(0.45, 0.9)  # brow colour = hair colour × this
    p["mouth_y"] = u(89.5, 95.0)
    p["nose_len"] = min(u(16.5, 23.5), p["mouth_y"] - 12.5 - p["eye_y"])  # tip below the eye line
    p["nose_w"] = u(5.5, 9.5)  # half span of the nostril wings
    p["nose_tip"] = u(2.3, 3.8)  # tip radius
    p["nose_shade"] = u(0.1, 0.22)
    p["mouth_w"] = min(u(11.5, 17.5), 0.6 * _face_half_width(p, p["mouth_y"]))  # half width at rest
    p["lip_upper"] = u(1.3, 3.2)
    p["lip_lower"] = u(1.8, 4.2)
    lip = skin + (_LIP_RED - skin) * rng.uniform(0.25, 0.6)
    p["lip_r"], p["lip_g"], p["lip_b"] = (float(c) for c in lip)
    hair = _HAIR_COLOURS[rng.choice(len(_HAIR_COLOURS), p=_HAIR_WEIGHTS)] * rng.uniform(0.85, 1.15, 3)
    p["hair_r"], p["hair_g"], p["hair_b"] = (float(c) for c in np.clip(hair, 0, 255))
    p["hair_style"] = float(rng.choice(len(_HAIR_STYLES), p=_HAIR_STYLE_WEIGHTS))
    p["hairline"] = u(19.0, 31.0)  # y of the hairline at the centre
    p["hair_top"] = u(2.0, 9.0)  # volume above the skull
    p["hair_side"] = u(0.0, 7.0)  # volume at the sides
    p["fringe_y"] = u(35.0, 42.0)  # lower edge of a fringe
    p["fringe_jag"] = u(0.0, 2.5)
    p["hair_part"] = u(-0.15, 0.15)  # slope of the hairline: a side parting
    p["ear_size"] = u(6.0, 9.0)
    p["ear_dy"] = u(2.0, 9.0)  # ear centre below the eye line
    has_beard, beard = u(0.0, 1.0), u(0.3, 0.85)
    p["beard"] = beard if has_beard < 0.15 else 0.0
    n_moles = int(min(_N_MOLES, rng.poisson(0.9)))
    for i in range(_N_MOLES):
        ang, rad, r = u(0.0, 2 * math.pi), math.sqrt(u(0.05, 0.8)), u(0.7, 1.5)
        p[f"mole{i}_x"] = _CX + rad * p["face_w"] * 0.85 * math.cos(ang)
        p[f"mole{i}_y"] = p["face_cy"] + rad * p["face_h"] * 0.8 * math.sin(ang)
        p[f"mole{i}_r"] = r if i < n_moles else 0.0
    has_freckles, freckles = u(0.0, 1.0), u(0.3, 1.0)
    p["freckles"] = freckles if has_freckles < 0.25 else 0.0
    p["freckle_seed"] = float(rng.integers(0, 2**31 - 1))
    return p


class _Face:
    """An identity's parameters unpacked for rendering: colours as (3, 1, 1), derived shapes, marks."""

    def __init__(self, p: dict[str, float]):
        self.p = p
        for key, value in p.items():
            setattr(self, key, value)

        def rgb(prefix: str, factor: float = 1.0) -> np.ndarray:
            c = [p[f"{prefix}_r"], p[f"{prefix}_g"], p[f"{prefix}_b"]]
            return (np.array(c, dtype=np.float32) * np.float32(factor)).reshape(3, 1, 1)

        self.skin, self.iris, self.lip, self.hair = rgb("skin"), rgb("iris"), rgb("lip"), rgb("hair")
        self.skin_neck, self.skin_ear, self.skin_shadow, self.skin_mark = (
            rgb("skin", 0.78), rgb("skin", 0.9), rgb("skin", 0.55), rgb("skin", 0.45)
        )
        self.nose_colour = rgb("skin", 1.0 - p["nose_shade"])
        self.tip_colour = self.nose_colour * np.array([1.0, 0.93, 0.93], dtype=np.float32).reshape(3, 1, 1)
        self.nostril = rgb("skin", 0.35)
        self.seam = rgb("lip", 0.45)
        self.hair_dark = rgb("hair", 0.8)
        self.brow = rgb("hair", p["brow_dark"])
        self.style = _HAIR_STYLES[int(p["hair_style"])]
        self.face_top = p["face_cy"] - p["face_h"]
        self.chin_y = p["face_cy"] + p["face_h"]
        # Hair cap (half width, half height, centre y, lower cut) and front hairline (y, jag, drop at temples).
        cap_w, cap_top, cap_bottom = p["face_w"] + 2.0 + p["hair_side"], self.face_top - p["hair_top"], p["eye_y"] + 4.0
        line, jag = p["hairline"], 0.0
        if self.style in ("side_part", "long"):
            cap_bottom = p["eye_y"] + 14.0
        elif self.style == "fringe":
            line, jag = p["fringe_y"], p["fringe_jag"]
        elif self.style == "receding":
            cap_w, cap_top, cap_bottom = p["face_w"] + 1.0, self.face_top - 1.0, p["eye_y"] - 2.0
            line = self.face_top - 3.0
        cap_cy = p["face_cy"] - 4.0
        self.cap = (cap_w, cap_cy - cap_top, cap_cy, cap_bottom)
        self.front = (line, jag, p["eye_y"] + 2.0 - line)
        self.marks, self.marks_origin = self._marks_texture(p)

    @staticmethod
    def _marks_texture(p: dict[str, float]) -> tuple[np.ndarray | None, tuple[float, float]]:
        """Moles and freckles as an opacity texture at 0.5 canonical units per texel (None if none)."""
        moles = [i for i in range(_N_MOLES) if p[f"mole{i}_r"] > 0]
        dots = [(p[f"mole{i}_x"], p[f"mole{i}_y"], p[f"mole{i}_r"], 0.9) for i in moles]
        if p["freckles"] > 0:
            rng = np.random.default_rng([int(p["freckle_seed"]), _STREAM_MARKS])
            n = int(10 + 40 * p["freckles"])
            side = rng.choice([-1.0, 1.0], n)
            xs = _CX + side * rng.uniform(4.0, 0.8 * p["face_w"], n)
            ys = p["eye_y"] + rng.normal(13.0, 4.0, n)
            rs = rng.uniform(0.45, 0.9, n)
            alphas = rng.uniform(0.25, 0.55, n) * min(1.0, 0.5 + p["freckles"])
            dots += list(zip(xs.tolist(), ys.tolist(), rs.tolist(), alphas.tolist()))
        if not dots:
            return None, (0.0, 0.0)
        arr = np.array(dots, dtype=np.float32)
        x0, y0 = float((arr[:, 0] - arr[:, 2]).min() - 1.0), float((arr[:, 1] - arr[:, 2]).min() - 1.0)
        x1, y1 = float((arr[:, 0] + arr[:, 2]).max() + 1.0), float((arr[:, 1] + arr[:, 2]).max() + 1.0)
        w, h = int(math.ceil((x1 - x0) * 2)) + 1, int(math.ceil((y1 - y0) * 2)) + 1
        ys, xs = np.mgrid[0:h, 0:w].astype(np.float32) * np.float32(0.5)
        tex = np.zeros((h, w), dtype=np.float32)
        for x, y, r, a in dots:
            d = np.hypot(xs - (x - x0), ys - (y - y0))
            np.maximum(tex, a * np.clip((r - d) * 2.0 + 0.5, 0.0, 1.0), out=tex)
        tex *= np.float32(0.75)  # marks darken the skin by at most 75 %
        return tex, (x0, y0)


# --------------------------------------------------------------------------------------------------
# Geometry. Images are drawn channel-first, (3, H, W) float32, so blends run over whole rows.


def _ramp(d: np.ndarray, ppu: float, opacity: float = 1.0) -> np.ndarray:
    """Signed distance (canonical units, > 0 inside) → coverage in [0, opacity] with a 1-px linear edge.

    In place: opacity · clip(d · ppu + 0.5, 0, 1), computed as clip(d·ppu·o + 0.5·o, 0, o).
    """
    d *= ppu * opacity
    d += 0.5 * opacity
    np.maximum(d, 0.0, out=d)
    return np.minimum(d, opacity, out=d)


def _norm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """sqrt(x² + y²), without np.hypot's overflow guards (several times faster on float32)."""
    r = x * x
    r += y * y
    return np.sqrt(r, out=r)


def _ellipse_sd(u: np.ndarray, v: np.ndarray, a: float, b: float) -> np.ndarray:
    """Approximate signed distance to an axis-aligned ellipse (exact on the axes), > 0 inside."""
    m = min(a, b)
    d = _norm(u * (m / a), v * (m / b))
    return np.subtract(m, d, out=d)


def _ellipse_alpha(u: np.ndarray, v: np.ndarray, a: float, b: float, ppu: float, opacity: float = 1.0) -> np.ndarray:
    """``_ramp(_ellipse_sd(u, v, a, b), ppu, opacity)`` with the scalings folded together (fewer calls)."""
    k = min(a, b) * ppu * opacity
    d = _norm(u * (k / a), v * (k / b))
    np.subtract(k + 0.5 * opacity, d, out=d)
    np.maximum(d, 0.0, out=d)
    return np.minimum(d, opacity, out=d)


def _over(patch: np.ndarray, alpha: np.ndarray, colour: np.ndarray) -> None:
    """Composite ``colour`` ((3, 1, 1) or (3, h, w)) over a contiguous (3, h, w) ``patch``, coverage (h, w).

    Layers are drawn on contiguous copies of their region and written back once: numpy's per-call
    cost on small strided views is about twice that on contiguous arrays, and calls dominate.
    """
    t = colour - patch
    t *= alpha
    patch += t


def _rgb(values) -> np.ndarray:
    """A colour as a (3, 1, 1) float32 array, ready to broadcast over a (3, h, w) region."""
    return np.asarray(values, dtype=np.float32).reshape(3, 1, 1)


_GRIDS: dict[int, np.ndarray] = {}


def _grid(size: int) -> np.ndarray:
    """Pixel centre coordinates 0..size−1 (float32), shared by x and y."""
    g = _GRIDS.get(size)
    if g is None:
        g = np.arange(size, dtype=np.float32)
        _GRIDS[size] = g
    return g


class _View:
    """The per-image map between output pixels and canonical coordinates at a given depth."""

    def __init__(self, size: int, n: dict):
        self.size = size
        self.k = 112.0 / size
        th = math.radians(n["rotation"])
        self.s = n["scale"]
        self.cr, self.sr = math.cos(th), math.sin(th)
        yaw, pitch = math.radians(n["yaw"]), math.radians(n["pitch"])
        self.cy, self.sy = math.cos(yaw), math.sin(yaw)
        self.cp, self.sp = math.cos(pitch), math.sin(pitch)
        self.tx, self.ty = n["tx"] * 112.0, n["ty"] * 112.0
        self.ppu = self.s / self.k * math.sqrt(self.cy * self.cp)  # output pixels per canonical unit
        self.grid = _grid(size)
        self._cache: dict[float, tuple[float, ...]] = {}

    def forward(self, z: float) -> tuple[float, ...]:
        """Affine maps at depth z: (a, b, c, d, e, f) with pixel = [[a, b], [c, d]] p + (e, f), then
        (ia, ib, ic, id, pe, pf) with p = [[ia, ib], [ic, id]] pixel + (pe, pf)."""
        m = self._cache.get(z)
        if m is None:
            g, cr, sr = self.s / self.k, self.cr, self.sr
            # A = (s/k) R(θ) diag(cos ψ, cos φ); offset = (s R (z·(sin ψ, sin φ) − D C) + C + T) / k
            a, b, c, d = g * cr * self.cy, -g * sr * self.cp, g * sr * self.cy, g * cr * self.cp
            wx, wy = z * self.sy - self.cy * _CX, z * self.sp - self.cp * _CY
            e = (self.s * (cr * wx - sr * wy) + _CX + self.tx) / self.k
            f = (self.s * (sr * wx + cr * wy) + _CY + self.ty) / self.k
            det = a * d - b * c
            ia, ib, ic, id_ = d / det, -b / det, -c / det, a / det
            m = (a, b, c, d, e, f, ia, ib, ic, id_, -(ia * e + ib * f), -(ic * e + id_ * f))
            self._cache[z] = m
        return m

    def points(self, pts: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
        """Canonical points (x, y, depth) → output pixels."""
        out = []
        for x, y, z in pts:
            a, b, c, d, e, f = self.forward(z)[:6]
            out.append((a * x + b * y + e, c * x + d * y + f))
        return out

    def local(
        self, z: float, box: tuple[float, float, float, float], origin: tuple[float, float]
    ) -> tuple[slice, slice, np.ndarray, np.ndarray] | None:
        """Pixels covering ``box`` (u0, v0, u1, v1 in local units) and their local coordinates.

        Local coordinates are canonical coordinates at depth ``z`` relative to ``origin``. Returns
        (rows, cols, u, v) with u, v of shape (h, w), or None when the box is off-image.
        """
        a, b, c, d, e, f, ia, ib, ic, id_, pe, pf = self.forward(z)
        ox, oy = origin
        u0, v0, u1, v1 = box
        # Bounding box of the mapped rectangle: mapped centre ± |A| · half extents.
        hu, hv, px, py = 0.5 * (u1 - u0), 0.5 * (v1 - v0), ox + 0.5 * (u0 + u1), oy + 0.5 * (v0 + v1)
        x, y = a * px + b * py + e, c * px + d * py + f
        rx, ry = abs(a) * hu + abs(b) * hv, abs(c) * hu + abs(d) * hv
        size = self.size
        c0, c1 = max(0, math.floor(x - rx) - 1), min(size, math.ceil(x + rx) + 2)
        r0, r1 = max(0, math.floor(y - ry) - 1), min(size, math.ceil(y + ry) + 2)
        if c0 >= c1 or r0 >= r1:
            return None
        xs, ys = self.grid[c0:c1], self.grid[r0:r1]  # local = A⁻¹ pixel + p0 − origin
        u = np.add.outer(ys * ib + (pe - ox), xs * ia)
        v = np.add.outer(ys * id_ + (pf - oy), xs * ic)
        return slice(r0, r1), slice(c0, c1), u, v


def _fit_similarity(
    src: list[tuple[float, float]], dst: list[tuple[float, float]]
) -> tuple[float, float, float, float]:
    """Least-squares similarity dst ≈ s R(θ) src + t (Umeyama); returns (s, θ radians, tx, ty).

    In 2-D the optimum is closed form: s·cosθ = Σ a·b / Σ|a|², s·sinθ = Σ a×b / Σ|a|² over centred points.
    """
    k = len(src)
    msx, msy = sum(p[0] for p in src) / k, sum(p[1] for p in src) / k
    mdx, mdy = sum(p[0] for p in dst) / k, sum(p[1] for p in dst) / k
    sxx = dot = cross = 0.0
    for (sx, sy), (dx, dy) in zip(src, dst):
        ax, ay, bx, by = sx - msx, sy - msy, dx - mdx, dy - mdy
        sxx += ax * ax + ay * ay
        dot += ax * bx + ay * by
        cross += ax * by - ay * bx
    pc, ps = dot / sxx, cross / sxx
    return math.hypot(pc, ps), math.atan2(ps, pc), mdx - (pc * msx - ps * msy), mdy - (ps * msx + pc * msy)
def _rng(*key: int) -> random.Random:
    """A stream for one key; string seeds are hashed with SHA-512, so streams match across platforms."""
    return random.Random(":".join(str(k) for k in key))


def _mouth_shape(face: _Face, n: dict) -> tuple[float, float]:
    """(half width, corner lift) of the mouth under the expression: a smile widens it and lifts the corners."""
    return face.mouth_w * (1.0 + 0.12 * n["smile"]), 3.5 * n["smile"]


def _canonical_landmarks(face: _Face, n: dict) -> list[tuple[float, float, float]]:
    """The 5 landmarks as canonical (x, y, depth): eye centres, nose tip, mouth corners."""
    mw, lift = _mouth_shape(face, n)
    my = face.mouth_y - lift
    return [
        (_CX - face.eye_dx, face.eye_y, _Z_EYE),
        (_CX + face.eye_dx, face.eye_y, _Z_EYE),
        (_CX, face.eye_y + face.nose_len, _Z_NOSE_TIP),
        (_CX - mw, my, _Z_MOUTH),
        (_CX + mw, my, _Z_MOUTH),
    ]


def _warp_points(pts: list[tuple[float, float, float]], n: dict) -> list[tuple[float, float]]:
    """The depth warp alone: canonical (x, y, z) → the 112 frame before the similarity."""
    yaw, pitch = math.radians(n["yaw"]), math.radians(n["pitch"])
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    return [(_CX + cy * (x - _CX) + z * sy, _CY + cp * (y - _CY) + z * sp) for x, y, z in pts]


# --------------------------------------------------------------------------------------------------
# The generator


class ProceduralFaces:
    """Deterministic procedural face generator; identity indices are global for a seed."""

    def __init__(self, config: ProceduralConfig = ProceduralConfig(), seed: int = 0):
        if not isinstance(config, ProceduralConfig):
            raise ConfigError(f"ProceduralFaces: config must be a ProceduralConfig, got {type(config).__name__}.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"ProceduralFaces: seed must be a non-negative integer, got {seed!r}.")
        self.config = config
        self.seed = int(seed)
        self._faces: OrderedDict[int, _Face] = OrderedDict()
        self._cache_size = 2048

    # ---- identities

    def identity(self, identity: int) -> dict[str, float]:
        """The identity's parameters (plain floats), deterministic in (seed, identity)."""
        return dict(self._face(identity).p)

    def _face(self, identity: int) -> _Face:
        identity = self._check_index(identity, "identity")
        face = self._faces.get(identity)
        if face is None:
            face = _Face(_sample_identity(self.seed, identity))
            self._faces[identity] = face
            if len(self._faces) > self._cache_size:
                self._faces.popitem(last=False)
        else:
            self._faces.move_to_end(identity)
        return face

    @staticmethod
    def _check_index(value: int, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"ProceduralFaces: {name} must be a non-negative integer, got {value!r}.")
        return int(value)

    # ---- nuisance

    def clean_nuisance(self) -> dict:
        """Nuisance for a frontal, undegraded face in the canonical (template-like) pose."""
        return dict(_CLEAN_NUISANCE)

    def _draw_dynamic(self, rng: random.Random) -> dict:
        """Values that may change from frame to frame; every draw unconditional (stable streams)."""
        c = self.config
        r = [rng.random() for _ in range(24)]
        g = [rng.gauss(0.0, 1.0) for _ in range(4)]
        blo, bhi = c.brightness_min, c.brightness_max
        clo, chi = c.contrast_min, c.contrast_max
        dyn = {
            "yaw": (2 * r[0] - 1) * c.yaw_deg,
            "pitch": (2 * r[1] - 1) * c.pitch_deg,
            "smile": r[3] if r[2] < c.smile_prob else 0.0,
            "mouth_open": r[5] if r[4] < c.mouth_open_prob else 0.0,
            "eye_closure": 0.6 + 0.4 * r[7] if r[6] < c.blink_prob else 0.25 * r[7],
            "light_angle": 360.0 * r[8],
            "light_strength": c.light_strength * r[9],
            "brightness": blo + (bhi - blo) * r[10],
            "contrast": clo + (chi - clo) * r[11],
            "blur": 0.4 + (c.blur_sigma_max - 0.4) * r[13] if r[12] < c.blur_prob else 0.0,
            "lowres": c.lowres_min + (0.7 - c.lowres_min) * r[15] if r[14] < c.lowres_prob else 1.0,
            "noise": 2.0 + (c.noise_std_max - 2.0) * r[17] if r[16] < c.noise_prob else 0.0,
            "jpeg_quality": c.jpeg_quality_min + (90 - c.jpeg_quality_min) * r[19] if r[18] < c.jpeg_prob else 100.0,
        }
        if c.aligned:
            dyn["place_rot"] = c.aligned_rotation_deg * g[0]
            dyn["place_scale"] = math.exp(c.aligned_scale_jitter * g[1])
            dyn["place_tx"], dyn["place_ty"] = c.aligned_shift * g[2], c.aligned_shift * g[3]
        else:
            lo, hi = c.scale_min, c.scale_max
            dyn["place_rot"] = (2 * r[20] - 1) * c.rotation_deg
            dyn["place_scale"] = lo + (hi - lo) * r[21]
            dyn["place_tx"], dyn["place_ty"] = (2 * r[22] - 1) * c.shift, (2 * r[23] - 1) * c.shift
        return dyn

    def _draw_static(self, rng: random.Random) -> dict:
        """Values fixed within a sequence: colour cast, background, occluders."""
        c = self.config
        r = [rng.random() for _ in range(12)]
        cast = [rng.gauss(0.0, 1.0) * c.color_cast for _ in range(3)]
        sunglasses = r[3] < c.sunglasses_prob
        return {
            "cast_r": cast[0], "cast_g": cast[1], "cast_b": cast[2],
            "background_seed": rng.getrandbits(31),
            "clutter": min(c.clutter_max, int(r[0] * (c.clutter_max + 1))),
            "stripes": r[1] < c.stripes_prob,
            "glasses": r[2] < c.glasses_prob and not sunglasses,
            "sunglasses": sunglasses,
            "mask": r[4] < c.mask_prob,
            "bar": r[5] < c.bar_prob,
            "bar_angle": 180.0 * r[6],
            "bar_offset": 0.3 * (2 * r[7] - 1),
            "bar_width": 0.08 + 0.14 * r[8],
        }

    def _finish(self, face: _Face, dyn: dict, static: dict, noise_seed: int) -> dict:
        """Complete the nuisance: place the face (fit to the template, then jitter or random similarity)."""
        n = dict(_CLEAN_NUISANCE)
        n.update(static)
        for key in ("yaw", "pitch", "smile", "mouth_open", "eye_closure", "light_angle", "light_strength",
                    "brightness", "contrast", "blur", "lowres", "noise"):
            n[key] = float(dyn[key])
        n["jpeg_quality"] = int(round(dyn["jpeg_quality"]))
        n["noise_seed"] = int(noise_seed)
        # Warped landmarks (depth warp only) fitted onto the template: what a 5-point aligner would do.
        s1, th1, t1x, t1y = _fit_similarity(_warp_points(_canonical_landmarks(face, n), n), _TEMPLATE)
        # Compose S2 ∘ S1 with S2 = place_scale · R(place_rot) about the image centre, plus a shift.
        s2, th2 = dyn["place_scale"], math.radians(dyn["place_rot"])
        c2, sn2 = math.cos(th2), math.sin(th2)
        ux, uy = t1x - 56.0, t1y - 56.0
        tx = s2 * (c2 * ux - sn2 * uy) + 56.0 + dyn["place_tx"] * 112.0
        ty = s2 * (sn2 * ux + c2 * uy) + 56.0 + dyn["place_ty"] * 112.0
        s, th = s1 * s2, th1 + th2
        # out = s R q + t  ⇔  out = s R (q − C) + C + T  with T = t − C + s R C.
        cs, sn = math.cos(th), math.sin(th)
        n["rotation"] = math.degrees(th)
        n["scale"] = s
        n["tx"] = (tx - _CX + s * (cs * _CX - sn * _CY)) / 112.0
        n["ty"] = (ty - _CY + s * (sn * _CX + cs * _CY)) / 112.0
        return n

    def _sample_nuisance(self, face: _Face, identity: int, index: int) -> dict:
        rng = _rng(self.seed, _STREAM_SAMPLE, identity, index)
        dyn = self._draw_dynamic(rng)
        static = self._draw_static(rng)
        return self._finish(face, dyn, static, rng.getrandbits(31))

    def _check_nuisance(self, nuisance: dict) -> dict:
        if not isinstance(nuisance, dict):
            raise TypeError(f"render: nuisance must be a dict, got {type(nuisance).__name__}.")
        unknown = sorted(set(nuisance) - set(_CLEAN_NUISANCE))
        missing = sorted(set(_CLEAN_NUISANCE) - set(nuisance))
        if unknown or missing:
            raise ValueError(
                f"render: nuisance has unknown keys {unknown} and lacks keys {missing}; "
                "start from clean_nuisance() and override, e.g. {**gen.clean_nuisance(), 'yaw': 20.0}."
            )
        n = {}
        for key, value in nuisance.items():
            if key in _BOOL_NUISANCE:
                n[key] = bool(value)
            elif key in _INT_NUISANCE:
                n[key] = int(value)
            else:
                n[key] = float(value)
        if n["scale"] <= 0 or not 1 <= n["jpeg_quality"] <= 100 or not 0 < n["lowres"] <= 1:
            raise ValueError(
                f"render: nuisance out of range: scale={n['scale']} (> 0), jpeg_quality={n['jpeg_quality']} "
                f"(1..100), lowres={n['lowres']} (0, 1]."
            )
        if abs(n["yaw"]) >= 80 or abs(n["pitch"]) >= 80:
            raise ValueError(f"render: |yaw|, |pitch| must be < 80 degrees, got {n['yaw']}, {n['pitch']}.")
        return n

    # ---- public sampling

    def sample(self, identity: int, index: int) -> FaceSample:
        """Image ``index`` of ``identity``; deterministic in (seed, identity, index)."""
        face = self._face(identity)
        index = self._check_index(index, "index")
        return self._render(face, self._sample_nuisance(face, int(identity), index))

    def sample_nuisance(self, identity: int, index: int) -> dict:
        """The nuisance :meth:`sample` renders image ``index`` of ``identity`` with (nothing is rendered)."""
        face = self._face(identity)
        return self._sample_nuisance(face, int(identity), self._check_index(index, "index"))

    def sequence(self, identity: int, length: int, seq_index: int = 0) -> list[FaceSample]:
        """A video-like sequence: pose, expression and degradations follow a smooth random walk.

        Knots every 8 frames follow a random walk (each halfway from the previous knot to a fresh draw
        from the per-image distributions) joined by cosine interpolation, so consecutive frames differ
        a little and distant ones more; background, colour cast and occluders stay fixed.
        """
        face = self._face(identity)
        return [self._render(face, n) for n in self.sequence_nuisance(identity, length, seq_index)]

    def sequence_nuisance(self, identity: int, length: int, seq_index: int = 0) -> list[dict]:
        """The per-frame nuisance of :meth:`sequence` (nothing is rendered)."""
        return list(self.iter_sequence_nuisance(identity, length, seq_index))

    def iter_sequence_nuisance(self, identity: int, length: int, seq_index: int = 0) -> Iterator[dict]:
        """:meth:`sequence_nuisance` one frame at a time, holding only the walk's knots (one per 8 frames) and one
        noise seed per frame: for probes of tens of thousands of frames. Arguments are checked at the call."""
        face = self._face(identity)
        seq_index = self._check_index(seq_index, "seq_index")
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"sequence: length must be a positive integer, got {length!r}.")
        rng = _rng(self.seed, _STREAM_SEQUENCE, int(identity), seq_index)
        static = self._draw_static(rng)
        stride = 8
        knots = [self._draw_dynamic(rng)]
        for _ in range((length - 1) // stride + 1):  # a random walk: each knot halfway to a fresh draw
            fresh = self._draw_dynamic(rng)
            knots.append({key: 0.5 * (knots[-1][key] + fresh[key]) for key in _SMOOTH_KEYS})
        noise_seeds = [rng.getrandbits(31) for _ in range(length)]

        def frames() -> Iterator[dict]:
            for t in range(length):
                j, frac = divmod(t, stride)
                w = 0.5 - 0.5 * math.cos(math.pi * frac / stride)
                dyn = {key: (1 - w) * knots[j][key] + w * knots[j + 1][key] for key in _SMOOTH_KEYS}
                yield self._finish(face, dyn, static, noise_seeds[t])

        return frames()

    def render(self, identity: int, nuisance: dict) -> FaceSample:
        """Render ``identity`` with explicit nuisance values (all keys of :meth:`clean_nuisance`)."""
        return self._render(self._face(identity), self._check_nuisance(nuisance))

    # ---- rendering

    def _render(self, face: _Face, n: dict) -> FaceSample:
        size = self.config.image_size
        view = _View(size, n)
        bg = random.Random(2 * n["background_seed"])
        img = np.empty((3, size, size), dtype=np.float32)
        _draw_background(img, view, n, bg)
        _draw_head(img, view, face, n, bg)
        _draw_occluders(img, view, face, n)
        out = _degrade(img, view, n)
        landmarks = np.array(view.points(_canonical_landmarks(face, n)), dtype=np.float32)
        return FaceSample(image=out, landmarks=landmarks, quality=quality_score(n), nuisance=n)


# --------------------------------------------------------------------------------------------------
# Non-face crops: negatives for a face/no-face score (the DFA aligner's score head)

NONFACE_KINDS: tuple[str, ...] = ("clutter", "off_frame", "covered")
_NONFACE_CUMULATIVE = (0.5, 0.8, 1.0)  # kind shares 50 / 30 / 20 %
_NONFACE_IDENTITY0 = 1 << 40  # partial faces use identities far above any dataset's range
_OFF_FRAME_MARGIN = 0.03  # every landmark at least this fraction of the side outside the crop


@functools.lru_cache(maxsize=8)
def _nonface_generator(config: ProceduralConfig, seed: int) -> ProceduralFaces:
    return ProceduralFaces(config, seed=seed)


def _nonface_args(seed: int, index: int, size: int, config: ProceduralConfig | None) -> ProceduralConfig:
    for name, value in (("seed", seed), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"render_nonface: {name} must be a non-negative integer, got {value!r}.")
    base = ProceduralConfig(aligned=False) if config is None else config
    if not isinstance(base, ProceduralConfig):
        raise ConfigError(f"render_nonface: config must be a ProceduralConfig, got {type(base).__name__}.")
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ConfigError(f"render_nonface: size must be an integer number of pixels, got {size!r}.")
    return dataclasses.replace(base, image_size=int(size))  # ProceduralConfig checks 32 ≤ size ≤ 1024


def nonface_kind(seed: int, index: int) -> str:
    """Which of :data:`NONFACE_KINDS` ``render_nonface(seed, index, …)`` draws (the first draw of its stream)."""
    u = _rng(int(seed), _STREAM_NONFACE, int(index)).random()
    return NONFACE_KINDS[next(i for i, c in enumerate(_NONFACE_CUMULATIVE) if u < c)]


def render_nonface(seed: int, index: int, size: int = 96, config: ProceduralConfig | None = None) -> np.ndarray:
    """A crop without a usable face, (size, size, 3) uint8 RGB; deterministic in (seed, index, size, config).

    Three kinds (:func:`nonface_kind`), drawn from the stream ``(seed, 5, index)``:

    - ``clutter`` (50 %): the face renderer's background alone (gradient, stripes, 1 … 2·clutter_max + 2
      random boxes, bars, ellipses and rings);
    - ``off_frame`` (30 %): a face whose placement is pushed in a random direction until all 5 landmarks
      lie at least 3 % of the side outside the crop (hair, an ear or a cheek may remain at the border);
    - ``covered`` (20 %): a face in an ordinary pose with one opaque box or ellipse over its eyes, nose and
      mouth (the landmarks' bounding box grown by 1.3–1.6×, plus 5 % of the side).

    Pose, lighting, colour cast, clutter and degradations (blur, noise, JPEG, low resolution) are drawn as
    for a face sample of ``config`` (default ``ProceduralConfig(aligned=False)``, its ``image_size`` replaced
    by ``size``), so they cannot tell faces from non-faces. Partial faces use identities ``2⁴⁰ + index``,
    disjoint from any dataset's. Cost: about one face render (≈2 ms of CPU at 128 px, measured).
    """
    cfg = _nonface_args(seed, index, size, config)
    gen = _nonface_generator(cfg, int(seed))
    rng = _rng(int(seed), _STREAM_NONFACE, int(index))
    u = rng.random()  # the kind; the same first draw as nonface_kind
    kind = next(i for i, c in enumerate(_NONFACE_CUMULATIVE) if u < c)
    identity = _NONFACE_IDENTITY0 + int(index)
    face = gen._face(identity)
    n = gen._sample_nuisance(face, identity, 0)  # pose, light, background, occluders, degradations
    size = cfg.image_size
    if kind == 1:  # off_frame: push the placement until no landmark is inside the crop
        ang, dist = rng.uniform(0.0, 2.0 * math.pi), rng.uniform(0.6, 0.85)
        base_tx, base_ty = n["tx"], n["ty"]
        lo, hi = -0.5 - _OFF_FRAME_MARGIN * size, size - 0.5 + _OFF_FRAME_MARGIN * size
        while True:
            n["tx"], n["ty"] = base_tx + dist * math.cos(ang), base_ty + dist * math.sin(ang)
            pts = _View(size, n).points(_canonical_landmarks(face, n))
            if all(x < lo or x > hi or y < lo or y > hi for x, y in pts):
                break
            dist += 0.05
    view = _View(size, n)
    img = np.empty((3, size, size), dtype=np.float32)
    bg = random.Random(2 * n["background_seed"])
    if kind == 0:  # clutter only
        n["clutter"] = rng.randint(1, 2 * cfg.clutter_max + 2)
        _draw_background(img, view, n, bg)
    else:
        _draw_background(img, view, n, bg)
        _draw_head(img, view, face, n, bg)
        _draw_occluders(img, view, face, n)
        if kind == 2:
            _draw_cover(img, view, view.points(_canonical_landmarks(face, n)), rng)
    return _degrade(img, view, n)


def render_nonfaces(seed: int, indices, size: int = 96, config: ProceduralConfig | None = None) -> np.ndarray:
    """:func:`render_nonface` for each of ``indices`` (an iterable of non-negative ints), stacked:
    uint8 (N, size, size, 3)."""
    indices = [int(i) for i in indices]
    cfg = _nonface_args(seed, 0, size, config)
    out = np.empty((len(indices), cfg.image_size, cfg.image_size, 3), dtype=np.uint8)
    for row, index in enumerate(indices):
        out[row] = render_nonface(seed, index, size, config)
    return out


# --------------------------------------------------------------------------------------------------
# Drawing: back to front on a (3, H, W) float32 canvas. Each layer group maps its pixel box to its own
# canonical frame, draws on a contiguous copy of that box, and writes it back.

_MOUTH_INSIDE = _rgb([45, 18, 20])
_TEETH = _rgb([225, 220, 205])
_LENS_DARK = _rgb([18, 20, 26])
_LENS_CLEAR = _rgb([200, 220, 235])
_MASK_COLOURS = ([232, 236, 240], [120, 170, 215], [35, 35, 40], [200, 190, 170])
_FRAME_COLOURS = ([20, 20, 22], [90, 60, 35], [160, 160, 165], [120, 20, 25])


def _colour(rng: random.Random, lo: float, hi: float) -> np.ndarray:
    return _rgb([rng.uniform(lo, hi), rng.uniform(lo, hi), rng.uniform(lo, hi)])


def _draw_background(img: np.ndarray, view: _View, n: dict, rng: random.Random) -> None:
    """Two-colour linear gradient, optional stripes, then ``clutter`` random boxes, bars, ellipses, rings."""
    size, grid = view.size, view.grid
    c0, c1 = _colour(rng, 20, 235), _colour(rng, 20, 235)
    ang = rng.uniform(0, 2 * math.pi)
    t = np.add.outer(grid * (math.sin(ang) / size), grid * (math.cos(ang) / size))
    np.multiply(c1 - c0, t, out=img)
    img += c0
    if n["stripes"]:
        colour = _colour(rng, 10, 245)
        ang, freq, phase = rng.uniform(0, math.pi), rng.uniform(0.15, 0.6) * 112.0 / size, rng.uniform(0, 6.3)
        alpha = np.sin(np.add.outer(grid * (freq * math.sin(ang)) + phase, grid * (freq * math.cos(ang))))
        amp = 0.5 * rng.uniform(0.4, 0.9)
        alpha *= amp
        alpha += amp  # in [0, 2·amp]
        _over(img, alpha, colour)
    for _ in range(n["clutter"]):
        kind = rng.randrange(4)
        cx, cy = rng.uniform(-0.1, 1.1) * size, rng.uniform(-0.1, 1.1) * size
        a, b = rng.uniform(0.05, 0.3) * size, rng.uniform(0.05, 0.3) * size
        colour = _colour(rng, 0, 255)
        opacity = rng.uniform(0.5, 1.0)
        angle = math.radians(rng.uniform(0, 180))
        r = max(a, b)
        ra, rb = (a, b) if kind == 0 else (r, r)  # an axis-aligned box is its own pixel box
        r0, r1 = max(0, int(cy - rb) - 1), min(size, int(cy + rb) + 2)
        c0_, c1_ = max(0, int(cx - ra) - 1), min(size, int(cx + ra) + 2)
        if r0 >= r1 or c0_ >= c1_:
            continue
        patch = img[:, r0:r1, c0_:c1_].copy()
        if kind == 0:  # axis-aligned box, hard-edged
            patch += opacity * (colour - patch)
        else:
            ca, sa = math.cos(angle), math.sin(angle)
            dx, dy = grid[c0_:c1_] - cx, grid[r0:r1] - cy
            v = np.add.outer(dy * ca, dx * -sa)
            if kind == 1:  # rotated bar across the patch
                d = np.subtract(0.25 * b, np.abs(v, out=v), out=v)
            else:
                u = np.add.outer(dy * sa, dx * ca)
                d = _ellipse_sd(u, v, a, b)
                if kind == 3:  # ring
                    d = 0.18 * r - np.abs(d, out=d)
            _over(patch, _ramp(d, 1.0, opacity), colour)
        img[:, r0:r1, c0_:c1_] = patch


def _face_sd(f: _Face, u: np.ndarray, v: np.ndarray, grow: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Signed distance to the face outline (local origin (C_x, face_cy)) and the normalised radius.

    The half width narrows below the centre as w·(1 − taper·τ(v/h)), τ(t) = (1−μ)t + μt²; the radius
    blends the L2 and L∞ norms of (|u|/w(v), |v|/h) by the squareness λ: r = (1−λ)·L2 + λ·L∞.
    """
    w, h = f.face_w + grow, f.face_h + grow
    t = v * (1.0 / h)
    np.clip(t, 0.0, 1.0, out=t)
    tau = t * f.chin_shape
    tau += 1.0 - f.chin_shape
    tau *= t
    tau *= -f.jaw_taper * w
    tau += w  # half width at this height
    x = np.abs(u)
    x /= tau
    y = np.abs(v)
    y *= 1.0 / h
    r = _norm(x, y)
    r *= 1.0 - f.face_square
    np.maximum(x, y, out=x)
    x *= f.face_square
    r += x
    d = 1.0 - r
    d *= 0.8 * min(w, h)
    return d, r


def _draw_head(img: np.ndarray, view: _View, f: _Face, n: dict, rng: random.Random) -> None:
    ppu = view.ppu
    fcy = f.face_cy
    shirt = _colour(rng, 20, 235)

    if f.style == "long":  # long hair, behind everything
        hw = f.face_w + 6.0 + f.hair_side
        loc = view.local(_Z_HAIR_BACK, (-hw, -62.0, hw, 62.0), (_CX, fcy + 20.0))
        if loc is not None:
            rows, cols, u, v = loc
            patch = img[:, rows, cols].copy()
            _over(patch, _ellipse_alpha(u, v, hw, 62.0, ppu), f.hair_dark)
            img[:, rows, cols] = patch

    loc = view.local(_Z_NECK, (-80.0, -30.0, 80.0, 62.0), (_CX, f.chin_y + 30.0))
    if loc is not None:  # shoulders and neck
        rows, cols, u, v = loc
        patch = img[:, rows, cols].copy()
        _over(patch, _ellipse_alpha(u, v - 30.0, 75.0, 32.0, ppu), shirt)
        v += 10.0
        d = np.minimum(0.5 * f.face_w - np.abs(u, out=u), 30.0 - np.abs(v, out=v))
        _over(patch, _ramp(d, ppu), f.skin_neck)
        img[:, rows, cols] = patch

    ear_y = f.eye_y + f.ear_dy
    ex = f.face_w - 1.0 + 0.45 * f.ear_size
    loc = view.local(_Z_EAR, (-ex - f.ear_size, -f.ear_size - 1, ex + f.ear_size, f.ear_size + 1), (_CX, ear_y))
    if loc is not None:  # ears, mirrored: |u| folds the left ear onto the right one
        rows, cols, u, v = loc
        au = np.abs(u, out=u)
        au -= ex
        patch = img[:, rows, cols].copy()
        _over(patch, _ellipse_alpha(au, v, 0.5 * f.ear_size, f.ear_size, ppu), f.skin_ear)
        img[:, rows, cols] = patch

    cap_w, cap_h, cap_cy, cap_bottom = f.cap
    loc = view.local(_Z_HAIR_BACK, (-cap_w, -cap_h, cap_w, cap_bottom - cap_cy), (_CX, cap_cy))
    if loc is not None:  # hair over the skull, cut off at ear level at the sides
        rows, cols, u, v = loc
        d = _ellipse_sd(u, v, cap_w, cap_h)
        np.minimum(d, (cap_bottom - cap_cy) - v, out=d)
        patch = img[:, rows, cols].copy()
        _over(patch, _ramp(d, ppu), f.hair_dark)
        img[:, rows, cols] = patch

    loc = view.local(_Z_FACE, (-f.face_w, -f.face_h, f.face_w, f.face_h), (_CX, fcy))
    if loc is not None:  # the face, darker towards the outline; beard and marks in the same frame
        rows, cols, u, v = loc
        d, rad = _face_sd(f, u, v)
        np.minimum(rad, 1.0, out=rad)
        rad *= rad
        rad *= -0.22
        rad += 1.0
        face_a = _ramp(d, ppu)
        patch = img[:, rows, cols].copy()
        _over(patch, face_a, f.skin * rad)
        if f.beard > 0:  # below a line over the upper lip that rises to the sideburns, soft-edged
            tu = u * (1.0 / f.face_w)
            tu *= tu
            tu *= 14.0
            ramp = v + tu
            ramp -= f.mouth_y - 6.5 - fcy
            ramp *= 0.2 * f.beard * 0.75
            np.clip(ramp, 0.0, f.beard * 0.75, out=ramp)
            ramp *= face_a
            _over(patch, ramp, f.hair)
        if f.marks is not None:
            th, tw = f.marks.shape
            ox, oy = f.marks_origin
            iu = (u + (_CX - ox)) * 2.0
            iv = (v + (fcy - oy)) * 2.0
            np.clip(iu, 0, tw - 1, out=iu)
            np.clip(iv, 0, th - 1, out=iv)
            _over(patch, f.marks[iv.astype(np.intp), iu.astype(np.intp)], f.skin_mark)
        img[:, rows, cols] = patch

    _draw_eyes_and_brows(img, view, f, n)
    _draw_nose(img, view, f, n)
    _draw_mouth(img, view, f, n)
    _draw_front_hair(img, view, f)


def _draw_eyes_and_brows(img: np.ndarray, view: _View, f: _Face, n: dict) -> None:
    """Both eyes and brows in one mirrored frame centred between the eyes."""
    ppu = view.ppu
    a, h = f.eye_w, f.eye_w * f.eye_aspect
    half = f.brow_len * f.eye_w
    span = f.eye_dx + max(a, half) + 3.0
    top = -f.brow_gap - half - 2.0
    loc = view.local(_Z_EYE, (-span, top, span, a + 1.5), (_CX, f.eye_y))
    if loc is None:
        return
    rows, cols, u, v = loc
    patch = img[:, rows, cols].copy()
    au = np.abs(u, out=u)  # mirrored: the right eye and brow
    au -= f.eye_dx
    # Brow: rotated about its centre (outer end up for angle > 0), arched, thicker at the inner end.
    ca, sa = math.cos(math.radians(f.brow_angle)), math.sin(math.radians(f.brow_angle))
    vb = v + f.brow_gap
    bu = au * ca
    bu -= vb * sa
    bv = au * sa
    bv += vb * ca
    t = bu * (1.0 / half)
    np.clip(t, -1.0, 1.0, out=t)
    curve = t * t
    curve -= 1.0
    curve *= f.brow_arch  # the middle is higher (smaller v) than the ends
    bv -= curve
    thick = t * (-0.225 * f.brow_thick)
    thick += 0.5 * f.brow_thick
    thick -= np.abs(bv, out=bv)
    np.abs(bu, out=bu)
    np.subtract(half, bu, out=bu)
    np.minimum(thick, bu, out=thick)
    _over(patch, _ramp(thick, ppu), f.brow)
    # Eye: canthal tilt rotates the outer corner (larger |u|) up for tilt > 0.
    ca, sa = math.cos(math.radians(f.eye_tilt)), math.sin(math.radians(f.eye_tilt))
    eu = au * ca
    eu -= v * sa
    ev = au * sa
    ev += v * ca
    # Opening: the almond minus what the upper lid covers (lid line from −h open to +h closed).
    lid_y = -h + 2.0 * h * n["eye_closure"]
    opening = _ellipse_sd(eu, ev, a, h)
    np.minimum(opening, ev - lid_y, out=opening)
    open_a = _ramp(opening, ppu)
    _over(patch, open_a, _SCLERA)
    r = _norm(eu, ev)
    ri = f.iris_frac * a
    iris_a = _ramp(ri - r, ppu)
    np.minimum(iris_a, open_a, out=iris_a)
    _over(patch, iris_a, f.iris)
    np.subtract(0.45 * ri, r, out=r)
    pupil_a = _ramp(r, ppu)
    np.minimum(pupil_a, open_a, out=pupil_a)
    _over(patch, pupil_a, _PUPIL)
    # Lash line along the upper edge of the opening (or along the lid when it is lowered).
    t = eu * (1.0 / a)
    t *= t
    np.subtract(1.0, t, out=t)
    np.maximum(t, 0.0, out=t)
    upper = np.sqrt(t, out=t)
    upper *= -h
    np.maximum(upper, lid_y, out=upper)
    upper -= ev
    upper -= 0.2
    d = 0.55 - np.abs(upper, out=upper)
    np.abs(eu, out=eu)
    np.subtract(a + 0.3, eu, out=eu)
    np.minimum(d, eu, out=d)
    _over(patch, _ramp(d, ppu), _LASH)
    img[:, rows, cols] = patch


def _draw_nose(img: np.ndarray, view: _View, f: _Face, n: dict) -> None:
    """Ridge shadow, wings, tip and nostrils in the tip's frame; the tip's centre is the nose landmark."""
    ppu = view.ppu
    tip_y = f.eye_y + f.nose_len
    r = f.nose_tip
    span = f.nose_w + 2.0
    loc = view.local(_Z_NOSE_TIP, (-span, f.eye_y + 4.0 - tip_y, span, r + 2.5), (_CX, tip_y))
    if loc is None:
        return
    rows, cols, u, v = loc
    patch = img[:, rows, cols].copy()
    side = -1.0 if n["yaw"] >= 0 else 1.0  # the shadow falls on the side turned away
    d = np.abs(u - side * 0.45 * f.nose_w)
    np.subtract(1.2, d, out=d)
    np.minimum(d, -1.0 - v, out=d)
    _over(patch, _ramp(d, ppu, 0.35 + 0.3 * abs(n["yaw"]) / 45.0), f.nose_colour)
    au = np.abs(u)  # mirrored
    _over(patch, _ellipse_alpha(au - 0.72 * f.nose_w, v, 0.4 * f.nose_w, 0.85 * r, ppu, 0.6), f.nose_colour)
    _over(patch, _ellipse_alpha(u, v, 1.1 * r, 0.9 * r, ppu), f.tip_colour)
    au -= 0.42 * f.nose_w
    v -= 0.8 * r
    _over(patch, _ellipse_alpha(au, v, 0.24 * f.nose_w, 0.85, ppu), f.nostril)
    img[:, rows, cols] = patch


def _draw_mouth(img: np.ndarray, view: _View, f: _Face, n: dict) -> None:
    """Lips between curves of t = u/w: centre line −lift·t², gap and lip thickness ∝ sqrt(1 − t²)."""
    ppu = view.ppu
    mw, lift = _mouth_shape(f, n)
    gap = 7.0 * n["mouth_open"]
    extent = max(f.lip_upper, f.lip_lower) + gap + lift + 1.5
    loc = view.local(_Z_MOUTH, (-mw - 1.5, -extent, mw + 1.5, extent), (_CX, f.mouth_y))
    if loc is None:
        return
    rows, cols, u, v = loc
    patch = img[:, rows, cols].copy()
    t2 = u * (1.0 / mw)
    t2 *= t2
    sq = 1.0 - t2
    np.maximum(sq, 0.0, out=sq)
    np.sqrt(sq, out=sq)
    centre = t2 * -lift  # the corners rise with a smile
    side = np.abs(u, out=u)
    np.subtract(mw, side, out=side)
    bow = t2 * -36.0
    np.exp(bow, out=bow)
    bow *= -0.35
    bow += 1.0  # Cupid's bow: the upper lip is thinner at the centre
    bow *= sq
    bow *= f.lip_upper
    if gap > 0.05:
        half_gap = sq * (0.5 * gap)
        upper_edge = centre - half_gap
        lower_edge = centre + half_gap
    else:
        upper_edge = lower_edge = centre
    d = v - upper_edge
    d += bow
    low = sq * f.lip_lower
    low += lower_edge
    low -= v
    np.minimum(d, low, out=d)
    np.minimum(d, side, out=d)
    _over(patch, _ramp(d, ppu), f.lip)
    if gap > 0.05:
        d = np.minimum(v - upper_edge, lower_edge - v)
        np.minimum(d, side, out=d)
        _over(patch, _ramp(d, ppu), _MOUTH_INSIDE)
        d = np.minimum(v - upper_edge, upper_edge + half_gap * 0.6 - v)
        np.minimum(d, side - 0.25 * mw, out=d)
        _over(patch, _ramp(d, ppu), _TEETH)
    # The seam between the lips reaches exactly the corners (the mouth landmarks).
    v -= centre
    d = 0.65 - np.abs(v, out=v)
    side += 0.5
    np.minimum(d, side, out=d)
    _over(patch, _ramp(d, ppu), f.seam)
    img[:, rows, cols] = patch


def _draw_front_hair(img: np.ndarray, view: _View, f: _Face) -> None:
    """Hair over the forehead: inside the cap, above a hairline that drops to the ears at the temples."""
    cap_w, cap_h, cap_cy, _ = f.cap
    line, jag, drop = f.front
    loc = view.local(_Z_HAIR_FRONT, (-cap_w, -cap_h, cap_w, line + drop + jag - cap_cy + 1.0), (_CX, cap_cy))
    if loc is None:
        return
    rows, cols, u, v = loc
    t6 = u * (1.0 / f.face_w)
    hl = t6 * (f.hair_part * f.face_w)  # a side parting tilts the line
    hl += line - cap_cy
    t6 *= t6
    t6 *= t6 * t6
    t6 *= drop
    hl += t6
    if jag > 0:  # fringe: a jagged lower edge
        s = np.sin(u * 0.9)
        np.abs(s, out=s)
        s *= jag
        hl += s
    hl -= v
    d = _ellipse_sd(u, v, cap_w, cap_h)
    np.minimum(d, hl, out=d)
    patch = img[:, rows, cols].copy()
    _over(patch, _ramp(d, view.ppu), f.hair)
    img[:, rows, cols] = patch


def _draw_occluders(img: np.ndarray, view: _View, f: _Face, n: dict) -> None:
    if not (n["mask"] or n["glasses"] or n["sunglasses"] or n["bar"]):
        return
    ppu = view.ppu
    occ = random.Random(2 * n["background_seed"] + 1)
    mask_colour = _rgb(_MASK_COLOURS[occ.randrange(len(_MASK_COLOURS))])
    frame_colour = _rgb(_FRAME_COLOURS[occ.randrange(len(_FRAME_COLOURS))])
    bar_colour = _colour(occ, 0, 255)
    if n["mask"]:
        top = f.eye_y + 0.45 * f.nose_len
        loc = view.local(_Z_MASK, (-f.face_w - 2, top - f.face_cy, f.face_w + 2, f.face_h + 2), (_CX, f.face_cy))
        if loc is not None:
            rows, cols, u, v = loc
            d = _face_sd(f, u, v, grow=1.5)[0]
            tu = u * (1.0 / f.face_w)
            tu *= tu
            tu *= 4.0
            tu += top - f.face_cy
            np.minimum(d, v - tu, out=d)
            pleat = (np.sin(v * 1.1) > 0.6).astype(np.float32)
            pleat *= -0.08
            pleat += 1.0
            patch = img[:, rows, cols].copy()
            _over(patch, _ramp(d, ppu), mask_colour * pleat)
            img[:, rows, cols] = patch
    if n["glasses"] or n["sunglasses"]:
        rx, ry = 1.45 * f.eye_w + 1.5, 1.1 * f.eye_w + 1.0
        span = f.face_w + 1.0
        loc = view.local(_Z_GLASSES, (-span, -ry - 1.5, span, ry + 1.5), (_CX, f.eye_y))
        if loc is not None:
            rows, cols, u, v = loc
            patch = img[:, rows, cols].copy()
            au = np.abs(u, out=u)  # mirrored
            d_lens = _ellipse_sd(au - f.eye_dx, v, rx, ry)
            a = _ramp(d_lens.copy(), ppu, 0.92 if n["sunglasses"] else 0.12)
            _over(patch, a, _LENS_DARK if n["sunglasses"] else _LENS_CLEAR)
            ring = 0.7 - np.abs(d_lens, out=d_lens)
            bridge = np.minimum(0.6 - np.abs(v + 1.0), (f.eye_dx - rx + 0.5) - au)
            arm = np.minimum(0.6 - np.abs(v + 0.3 * ry), au - (f.eye_dx + rx - 0.5))
            np.minimum(arm, span - au, out=arm)
            np.maximum(ring, bridge, out=ring)
            np.maximum(ring, arm, out=ring)
            _over(patch, _ramp(ring, ppu), frame_colour)
            img[:, rows, cols] = patch
    if n["bar"]:
        size, grid = view.size, view.grid
        a, b, c, d, e, f_ = view.forward(_Z_FACE)[:6]
        cx, cy = a * _CX + b * f.face_cy + e, c * _CX + d * f.face_cy + f_
        ang = math.radians(n["bar_angle"])
        nx, ny = -math.sin(ang), math.cos(ang)
        off = nx * cx + ny * cy + n["bar_offset"] * size
        dist = np.add.outer(grid * ny - off, grid * nx)
        d = 0.5 * n["bar_width"] * size - np.abs(dist, out=dist)
        _over(img, _ramp(d, 1.0), bar_colour)


def _draw_cover(img: np.ndarray, view: _View, pts: list[tuple[float, float]], rng: random.Random) -> None:
    """An opaque box or ellipse (1-px edge) over the landmarks' bounding box grown by 1.3–1.6× plus 5 % of
    the side; an ellipse passes through the grown box's corners (semi-axes ×√2). Random colour, with a
    second colour as a linear gradient across it half of the time."""
    size, grid = view.size, view.grid
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    cx, cy = 0.5 * (min(xs) + max(xs)), 0.5 * (min(ys) + max(ys))
    hx = 0.5 * (max(xs) - min(xs)) * rng.uniform(1.3, 1.6) + 0.05 * size
    hy = 0.5 * (max(ys) - min(ys)) * rng.uniform(1.3, 1.6) + 0.05 * size
    ellipse = rng.random() < 0.5
    c0, c1, gradient = _colour(rng, 0, 255), _colour(rng, 0, 255), rng.random() < 0.5
    u = np.add.outer(np.zeros(size, np.float32), grid - cx)  # (rows, cols) x offset
    v = np.add.outer(grid - cy, np.zeros(size, np.float32))
    if ellipse:
        d = _ellipse_sd(u, v, math.sqrt(2.0) * hx, math.sqrt(2.0) * hy)
    else:
        d = np.minimum(hx - np.abs(u), hy - np.abs(v))
    colour = c0 if not gradient else c0 + (c1 - c0) * np.clip(0.5 + 0.5 * u / hx, 0.0, 1.0)[None]
    _over(img, _ramp(d, 1.0), colour)


# --------------------------------------------------------------------------------------------------
# Degradations. No BLAS here: a 112² matmul is threaded by OpenBLAS, and under load (data-loader
# workers, a busy CI machine) its spinning threads made one image take tens of milliseconds.

_NOISE_BANKS: dict[int, np.ndarray] = {}


def _noise_bank(size: int) -> np.ndarray:
    """(2·size, 2·size, 3) standard normal float32, fixed; images take seeded windows of it.

    Drawing fresh float32 normals costs more than rendering a face; a window at one of size² offsets,
    with a seeded sign, is as good for a training set.
    """
    bank = _NOISE_BANKS.get(size)
    if bank is None:
        bank = np.random.default_rng(20240917).standard_normal((2 * size, 2 * size, 3), dtype=np.float32)
        _NOISE_BANKS[size] = bank
    return bank


def _blur_axis(x: np.ndarray, w: list[float], axis: int) -> np.ndarray:
    """Symmetric convolution of a (3, H, W) array along ``axis`` (1 or 2) with taps w[0], w[±1], ...;
    edges replicated."""
    r, n = len(w) - 1, x.shape[axis]
    shape = list(x.shape)
    shape[axis] = n + 2 * r
    xp = np.empty(shape, dtype=np.float32)
    sl = [slice(None)] * 3

    def at(start: int, stop: int) -> tuple:
        sl[axis] = slice(start, stop)
        return tuple(sl)

    xp[at(r, r + n)] = x
    xp[at(0, r)] = x[at(0, 1)]
    xp[at(r + n, n + 2 * r)] = x[at(n - 1, n)]
    out = xp[at(r, r + n)] * w[0]
    for k in range(1, r + 1):
        t = xp[at(r - k, r - k + n)] + xp[at(r + k, r + k + n)]
        t *= w[k]
        out += t
    return out


def _gaussian_taps(sigma: float) -> list[float]:
    r = max(1, math.ceil(2.0 * sigma))
    w = np.exp(-0.5 * (np.arange(r + 1) / sigma) ** 2)
    return (w / (w[0] + 2.0 * w[1:].sum())).tolist()  # truncated at 2σ, renormalised


def _gaussian_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of a (3, H, W) image, σ in pixels, edges replicated."""
    w = _gaussian_taps(sigma)
    return _blur_axis(_blur_axis(img, w, 1), w, 2)


def _degrade(img: np.ndarray, view: _View, n: dict) -> np.ndarray:
    """Illumination, colour and blur on the float canvas; then low resolution (PIL), noise, JPEG (PIL).

    Returns (H, W, 3) uint8.
    """
    size, grid = view.size, view.grid
    if n["light_strength"] > 0:
        ang, ls = math.radians(n["light_angle"]), n["light_strength"]
        g = 2.0 * ls / size
        light = np.add.outer(grid * (g * math.sin(ang)) + (1.0 - ls * (math.cos(ang) + math.sin(ang))),
                             grid * (g * math.cos(ang)))  # 1 ± strength across the image
        np.maximum(light, 0.15, out=light)
        img *= light
    cast = 1.0 + np.array([n["cast_r"], n["cast_g"], n["cast_b"]])
    img *= _rgb(n["contrast"] * n["brightness"] * cast)
    img += _rgb(128.0 * (1.0 - n["contrast"]) * n["brightness"] * cast + 0.5)  # + 0.5: round on the cast
    sigma = n["blur"] * size / 112.0
    if sigma > 0.05:
        img = _gaussian_blur(img, sigma)
    np.clip(img, 0.0, 255.0, out=img)
    out = img.transpose(1, 2, 0).astype(np.uint8, order="C")
    small = max(4, int(round(size * n["lowres"])))
    if small < size:  # area-average down to the capture size, bilinear back up
        pil = Image.fromarray(out).resize((small, small), Image.BOX)
        out = np.array(pil.resize((size, size), Image.BILINEAR))
    if n["noise"] > 0:
        seed = n["noise_seed"]
        oy, ox = seed % size, (seed // size) % size
        sign = 1.0 if (seed // (size * size)) % 2 else -1.0
        noisy = _noise_bank(size)[oy : oy + size, ox : ox + size] * (sign * n["noise"])
        noisy += out
        noisy += 0.5
        np.clip(noisy, 0.0, 255.0, out=noisy)
        out = noisy.astype(np.uint8, order="C")
    if n["jpeg_quality"] < 100:
        buf = io.BytesIO()
        Image.fromarray(out).save(buf, format="JPEG", quality=int(n["jpeg_quality"]))
        # The raw decoder skips the file-format layer of Image.open (a third of the decode time).
        out = np.array(Image.frombytes("RGB", (size, size), buf.getvalue(), "jpeg", "RGB", ""))
    return out
