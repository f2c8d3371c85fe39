"""Occluders drawn over a face: a mask, clear glasses or sunglasses, a bar across the image, and the opaque
cover that hides a face's landmarks in a ``covered`` non-face crop."""

from __future__ import annotations

import math
import random

import numpy as np

from ml.data.procedural.config import _CX, _Z_FACE, _Z_GLASSES, _Z_MASK
from ml.data.procedural.draw import _face_sd
from ml.data.procedural.geometry import _View, _colour, _ellipse_sd, _over, _ramp, _rgb
from ml.data.procedural.identity import _Face

_LENS_DARK = _rgb([18, 20, 26])
_LENS_CLEAR = _rgb([200, 220, 235])
_MASK_COLOURS = ([232, 236, 240], [120, 170, 215], [35, 35, 40], [200, 190, 170])
_FRAME_COLOURS = ([20, 20, 22], [90, 60, 35], [160, 160, 165], [120, 20, 25])


def _draw_occluders(img: np.ndarray, view: _View, f: _Face, n: dict) -> None:
    """The mask, clear glasses or sunglasses and the bar that the nuisance ``n`` asks for, in that order."""
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
