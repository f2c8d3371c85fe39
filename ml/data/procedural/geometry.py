"""Geometry and canvas primitives. Images are drawn channel-first, (3, H, W) float32, so blends run over whole
rows: soft-edged coverage (:func:`_ramp`, :func:`_ellipse_alpha`), compositing (:func:`_over`), colours, the
per-image map between pixels and canonical coordinates at a depth (:class:`_View`), the depth warp alone and the
least-squares similarity fit that places a face on the template."""

from __future__ import annotations

import math
import random

import numpy as np

from ml.data.procedural.config import _CX, _CY


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
    cost is higher on small strided views than on contiguous arrays, and calls dominate.
    """
    t = colour - patch
    t *= alpha
    patch += t


def _rgb(values) -> np.ndarray:
    """A colour as a (3, 1, 1) float32 array, ready to broadcast over a (3, h, w) region."""
    return np.asarray(values, dtype=np.float32).reshape(3, 1, 1)


def _colour(rng: random.Random, lo: float, hi: float) -> np.ndarray:
    """A random colour, each channel uniform in [lo, hi], as :func:`_rgb`."""
    return _rgb([rng.uniform(lo, hi), rng.uniform(lo, hi), rng.uniform(lo, hi)])


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


def _warp_points(pts: list[tuple[float, float, float]], n: dict) -> list[tuple[float, float]]:
    """The depth warp alone: canonical (x, y, z) → the 112 frame before the similarity."""
    yaw, pitch = math.radians(n["yaw"]), math.radians(n["pitch"])
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    return [(_CX + cy * (x - _CX) + z * sy, _CY + cp * (y - _CY) + z * sp) for x, y, z in pts]
