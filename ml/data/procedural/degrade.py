"""Degradations of a drawn face: illumination gradient, gain, contrast and colour cast, Gaussian blur, low
resolution, sensor noise and JPEG. No BLAS here: a 112² matmul is threaded by OpenBLAS, and under load (data-loader
workers, a busy CI machine) its spinning threads stall single images."""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from ml.data.procedural.geometry import _View, _rgb

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
