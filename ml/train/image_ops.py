"""Pixel operations on batches of float images in [0, 1], ``(B, C, H, W)``: the photometric half of the
augmentation recipe (``ml.train.augment``) and of RandAugment's ops, each a torch op over the whole batch with
per-image factors. Where an op has a PIL counterpart (``equalize``, ``posterize``, ``enhance``, ``smooth``), its
docstring gives PIL's formula, which it follows on the uint8 levels ``round(255·x)``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

__all__ = ["autocontrast", "constant", "cutout", "enhance", "equalize", "gaussian_blur", "grey", "mean_grey",
           "photometric", "posterize", "smooth", "solarize"]

_GREY = (0.299, 0.587, 0.114)  # ITU-R 601 luma weights (PIL's "L")


@functools.lru_cache(maxsize=64)
def constant(values: tuple[float | int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small constant tensor, copied to ``device`` once: every host-to-device copy waits for the device's queue."""
    return torch.tensor(values, dtype=dtype, device=device)


def grey(x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) → (B, 1, H, W) luma."""
    w = constant(_GREY, x.device, x.dtype).view(1, 3, 1, 1)
    return (x * w).sum(dim=1, keepdim=True)


def photometric(
    x: torch.Tensor, brightness: torch.Tensor, contrast: torch.Tensor, saturation: torch.Tensor
) -> torch.Tensor:
    """Brightness, contrast, saturation factors (B,) on RGB images in [0, 1]; 1 leaves that step out."""
    view = (-1, 1, 1, 1)
    x = (x * brightness.to(x.dtype).view(view)).clamp(0.0, 1.0)
    mean = grey(x).mean(dim=(2, 3), keepdim=True)  # (B, 1, 1, 1)
    x = ((x - mean) * contrast.to(x.dtype).view(view) + mean).clamp(0.0, 1.0)
    luma = grey(x)
    return ((x - luma) * saturation.to(x.dtype).view(view) + luma).clamp(0.0, 1.0)


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, max_sigma: float | None = None) -> torch.Tensor:
    """Separable Gaussian blur with one σ (B,) > 0 in pixels per image, reflect-padded; (B, C, H, W).

    The kernel reaches 3 σ of the largest σ, ``max_sigma`` when given (a bound known without reading ``sigma``
    back from the device), else ``sigma.max()``."""
    b, c, h, w = x.shape
    top = float(sigma.max()) if max_sigma is None else max_sigma
    radius = min(max(1, math.ceil(3.0 * top)), h - 1, w - 1)  # 99.7 % of the mass
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


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """Stretch each channel to [0, 1]: ``(x − lo)/(hi − lo)``, lo and hi its min and max; flat channels kept."""
    lo = x.amin(dim=(2, 3), keepdim=True)
    span = x.amax(dim=(2, 3), keepdim=True) - lo
    stretched = (x - lo) / torch.where(span > 0, span, 1.0)
    return torch.where(span > 0, stretched, x).clamp(0.0, 1.0)


def _levels(x: torch.Tensor) -> torch.Tensor:
    """uint8 levels ``round(255·x)`` in 0..255 as int64 (exact for images that came from uint8)."""
    return (x * 255.0).round().clamp(0, 255).long()


def equalize(x: torch.Tensor) -> torch.Tensor:
    """PIL's histogram equalisation of each channel on the uint8 levels ``v = round(255·x)``.

    With ``h`` the channel's 256-bin histogram and ``step = ⌊(Σh − h[top])/255⌋`` (``h[top]`` the count of
    the highest level present): ``v → min(255, ⌊(⌊step/2⌋ + Σ_{j<v} h[j]) / step⌋)/255``. A channel whose
    ``step`` is 0 (one level, or too few pixels) is returned unchanged.
    """
    b, c, h, w = x.shape
    v = _levels(x).view(b * c, h * w)
    hist = torch.zeros(b * c, 256, dtype=torch.long, device=x.device).scatter_add_(1, v, torch.ones_like(v))
    step = (h * w - hist.gather(1, v.amax(dim=1, keepdim=True))) // 255  # (B·C, 1)
    before = hist.cumsum(dim=1) - hist  # pixels below each level
    lut = ((before + step // 2) // step.clamp(min=1)).clamp(max=255)  # (B·C, 256)
    out = lut.gather(1, v).to(x.dtype) / 255.0
    return torch.where(step > 0, out, x.reshape(b * c, h * w)).view(b, c, h, w)


def posterize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Keep the top ``bits`` of each uint8 level: ``⌊round(255·x)/2^(8−bits)⌋·2^(8−bits)/255``; 8 keeps x."""
    if bits >= 8:
        return x
    q = float(2 ** (8 - bits))
    return torch.floor((x * 255.0).round().clamp(0.0, 255.0) / q) * q / 255.0  # exact up to the last division


def solarize(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Invert the pixels above a threshold: ``1 − x`` where ``x > τ``, else ``x`` (τ = 1 changes nothing)."""
    return torch.where(x > threshold, 1.0 - x, x)


def enhance(x: torch.Tensor, degenerate: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance blend ``x + (f − 1)·(x − degenerate)`` for factors f (B,), clamped; f = 1 gives x."""
    f = factor.to(x.dtype).view(-1, 1, 1, 1)
    return (x + (f - 1.0) * (x - degenerate)).clamp(0.0, 1.0)


def smooth(x: torch.Tensor) -> torch.Tensor:
    """PIL's SMOOTH filter ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]]/13`` per channel; the one-pixel border keeps x."""
    rows = x[..., :-2, :] + x[..., 1:-1, :] + x[..., 2:, :]  # (B, C, H−2, W): vertical 3-sums
    box = rows[..., :-2] + rows[..., 1:-1] + rows[..., 2:]  # (B, C, H−2, W−2): 3×3 sums (faster than conv2d)
    out = x.clone()
    out[..., 1:-1, 1:-1] = (box + 4.0 * x[..., 1:-1, 1:-1]) / 13.0
    return out


def mean_grey(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, 1, 1, 1): each image's mean luma."""
    return grey(x).mean(dim=(2, 3), keepdim=True)
