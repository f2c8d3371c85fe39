"""Identities: the fixed random vector of facial geometry and appearance drawn from ``(seed, identity)``
(:func:`_sample_identity`), its unpacked rendering form (:class:`_Face`: colours, hair cap, moles and freckles
texture) and the canonical 5 landmarks it carries under an expression."""

from __future__ import annotations

import math

import numpy as np

from ml.data.procedural.config import _CX, _STREAM_IDENTITY, _STREAM_MARKS, _Z_EYE, _Z_MOUTH, _Z_NOSE_TIP

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
_HAIR_STYLES = ("short", "fringe", "side_part", "long", "receding")
_HAIR_STYLE_WEIGHTS = np.array([0.3, 0.2, 0.2, 0.2, 0.1])
_N_MOLES = 3


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
        self.skin_neck, self.skin_ear, self.skin_mark = rgb("skin", 0.78), rgb("skin", 0.9), rgb("skin", 0.45)
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
