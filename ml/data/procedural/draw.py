"""Drawing a face: back to front on a (3, H, W) float32 canvas, background clutter, then neck, ears, hair, the
face with its beard and marks, eyes and brows, nose, mouth and the front hair. Each layer group maps its pixel box
to its own canonical frame, draws on a contiguous copy of that box, and writes it back."""

from __future__ import annotations

import math
import random

import numpy as np

from ml.data.procedural.config import (
    _CX, _Z_EAR, _Z_EYE, _Z_FACE, _Z_HAIR_BACK, _Z_HAIR_FRONT, _Z_MOUTH, _Z_NECK, _Z_NOSE_TIP,
)
from ml.data.procedural.geometry import _View, _colour, _ellipse_alpha, _ellipse_sd, _norm, _over, _ramp, _rgb
from ml.data.procedural.identity import _Face, _mouth_shape

_SCLERA = _rgb([236, 232, 226])
_PUPIL = _rgb([14, 10, 10])
_LASH = _rgb([28, 20, 20])
_MOUTH_INSIDE = _rgb([45, 18, 20])
_TEETH = _rgb([225, 220, 205])


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
