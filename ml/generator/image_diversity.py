"""Image-space diversity of a synthetic face dataset, beside the embedding metrics of ``ml.generator.diversity``.

* ``adjacent_pixel_correlation`` - smoothness at the pixel scale: faces are smooth, untrained generator noise
  is not.
* ``ssim_diversity`` - mean ``1 − SSIM`` within identity, needing no network weights.
* ``lpips_distance`` - LPIPS (Zhang, Isola, Efros, Shechtman & Wang, "The Unreasonable Effectiveness of Deep
  Features as a Perceptual Metric", CVPR 2018), VGG16 variant, only from a local weights file (``load_lpips``).

Differences from the reference:

* ``lpips_distance`` reads one state dict holding both the VGG16 features and the linear layers
  (``lpips`` ships them in two files); it skips the dropout before each linear layer (inference
  only) and returns per-pair distances averaged over space (``spatial=False``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ml.errors import ConfigError, DataError
from ml.generator.diversity import _as_labels

__all__ = ["LPIPS", "adjacent_pixel_correlation", "load_lpips", "lpips_distance", "ssim_diversity"]


def adjacent_pixel_correlation(images) -> float:
    """Mean over images of the Pearson correlation between horizontally adjacent pixel values (all channels).

    Natural faces are smooth at the pixel scale (≈ 0.95–0.99 at 64 px); colour noise is not (a generator that has
    not learnt faces gives ≈ 0.8 and below). ``images``: uint8 or float (N, H, W, C), W ≥ 2."""
    x = np.asarray(images, dtype=np.float64)
    if x.ndim != 4 or x.shape[2] < 2 or len(x) == 0:
        raise DataError(f"images must be (N, H, W, C) with N ≥ 1 and W ≥ 2, got shape {x.shape}")
    a = x[:, :, :-1].reshape(len(x), -1)
    b = x[:, :, 1:].reshape(len(x), -1)
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    den = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    flat = den <= 1e-12  # a constant image: perfectly smooth
    corr = np.where(flat, 1.0, (a * b).sum(axis=1) / np.where(flat, 1.0, den))
    return float(corr.mean())


def ssim_diversity(images, labels, max_per_class: int = 8) -> float:
    """Pixel-space diversity within identity that needs no network weights: mean over identities of the mean
    ``1 − SSIM`` over pairs of its first ``max_per_class`` faces (grey levels, torchmetrics' Gaussian-window SSIM).
    0 = every face of an identity identical; higher = more pose/lighting variation. A companion to the embedding
    proxy, since LPIPS needs VGG weights."""
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    x = np.asarray(images)
    lab = _as_labels(labels, len(x))
    if x.ndim != 4 or x.shape[-1] != 3:
        raise DataError(f"images must be (N, H, W, 3) RGB, got shape {x.shape}")
    grey = torch.from_numpy(x.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[:, None] / 255.0
    per_class = []
    for c in np.unique(lab):
        rows = np.flatnonzero(lab == c)[:max_per_class]
        if len(rows) < 2:
            continue
        i, j = np.triu_indices(len(rows), k=1)
        a, b = grey[rows[i]], grey[rows[j]]
        values = ssim(a, b, data_range=1.0, reduction="none", kernel_size=7 if x.shape[1] >= 7 else 3)
        per_class.append(float((1.0 - values).mean()))
    if not per_class:
        raise DataError("SSIM diversity needs an identity with ≥ 2 faces")
    return float(np.mean(per_class))


# torchvision ``vgg16().features`` (configuration "D", no batch norm): numbers are 3x3 convs
# (padding 1) each followed by ReLU, "M" a 2x2 max-pool. Module indices match torchvision's, so its
# ``features.<i>.weight`` keys load directly.
_VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512)
_LPIPS_TAPS = (3, 8, 15, 22, 29)  # relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
_LPIPS_CHANNELS = (64, 128, 256, 512, 512)
_MIN_SIDE = 16  # four 2x2 pools before relu5_3: 16 -> 1


class VGG16Features(nn.Module):
    """The convolutional part of VGG16 up to relu5_3; ``forward`` returns the five LPIPS taps."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for item in _VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(in_ch, item, kernel_size=3, padding=1), nn.ReLU()]
                in_ch = item
        self.features = nn.Sequential(*layers)  # indices 0..29
        assert len(self.features) == _LPIPS_TAPS[-1] + 1

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        taps = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in _LPIPS_TAPS:
                taps.append(x)  # (N, C_l, H / 2^l, W / 2^l)
        return taps


class LPIPS(nn.Module):
    """LPIPS-VGG (Zhang et al., CVPR 2018): a distance between images of the same size.

        d(x, y) = sum_l mean_{h,w} sum_c w_{l,c} (f^l_{hwc}(x) - f^l_{hwc}(y))^2

    f^l are the VGG16 activations at relu1_2 .. relu5_3, each normalised to unit L2 norm over
    channels at every position; w_l are the learned non-negative 1x1 linear weights. Inputs are
    RGB in [-1, 1], shifted and scaled by LPIPS's fixed ``ScalingLayer`` constants first.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = VGG16Features()
        self.lins = nn.ModuleList(nn.Conv2d(c, 1, kernel_size=1, bias=False) for c in _LPIPS_CHANNELS)
        # ImageNet mean / std mapped to [-1, 1] (lpips ``ScalingLayer``); constants, not weights.
        self.register_buffer("shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1), persistent=False)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) pairs in [-1, 1] -> (N,) distances."""
        feats_a = self.net((a - self.shift) / self.scale)
        feats_b = self.net((b - self.shift) / self.scale)
        total = torch.zeros(a.shape[0], dtype=a.dtype, device=a.device)
        for lin, fa, fb in zip(self.lins, feats_a, feats_b):
            fa = fa / (fa.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)  # unit norm over channels
            fb = fb / (fb.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
            total = total + lin((fa - fb).pow(2)).mean(dim=(1, 2, 3))  # (N, 1, h, w) -> (N,)
        return total


# Accepted key spellings -> our module's keys.
_KEY_RULES = (
    (re.compile(r"^(?:net\.)?features\.(\d+)\.(weight|bias)$"), "net.features.{0}.{1}"),  # torchvision / ours
    (re.compile(r"^net\.slice\d\.(\d+)\.(weight|bias)$"), "net.features.{0}.{1}"),  # lpips.LPIPS().state_dict()
    (re.compile(r"^lin(\d)\.model\.1\.weight$"), "lins.{0}.weight"),  # lpips weights/v0.1/vgg.pth
    (re.compile(r"^lins\.(\d)\.weight$"), "lins.{0}.weight"),  # ours
)
_IGNORED_KEYS = re.compile(r"^(classifier\.|scaling_layer\.|(net\.)?shift$|(net\.)?scale$)")

_LPIPS_HELP = (
    "LPIPS needs VGG16 + LPIPS weights available offline, and nothing here downloads them. Save one "
    "state dict holding torchvision's VGG16 'features.*' tensors (vgg16-397923af.pth) and the LPIPS v0.1 "
    "linear layers 'lin0..lin4' (lpips/weights/v0.1/vgg.pth), e.g. "
    "torch.save({**torch.load(vgg16_pth), **torch.load(lpips_vgg_pth)}, 'models/lpips_vgg16.pth'), "
    "and pass that path as weights_path; without it use embedding_diversity, the embedding-space proxy"
)


def load_lpips(weights_path: str | Path | None) -> LPIPS:
    """An eval-mode ``LPIPS`` with every weight read from the local state dict at ``weights_path``.

    Accepted keys: torchvision ``features.<i>.weight|bias`` (``classifier.*`` ignored) or lpips's
    ``net.slice<s>.<i>.*``; lpips ``lin<l>.model.1.weight``; or this module's own state dict. Every
    VGG16 conv and every linear layer must be present: a missing or unknown key raises ConfigError.
    """
    if weights_path is None:
        raise ConfigError(f"no LPIPS weights_path given. {_LPIPS_HELP}")
    path = Path(weights_path)
    if not path.is_file():
        raise ConfigError(f"LPIPS weights file {path} does not exist. {_LPIPS_HELP}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise ConfigError(f"cannot read LPIPS weights {path} as a torch state dict ({exc}). {_LPIPS_HELP}") from exc
    if not isinstance(state, Mapping):
        raise ConfigError(f"LPIPS weights {path} hold a {type(state).__name__}, not a state dict. {_LPIPS_HELP}")

    mapped, unknown = {}, []
    for key, value in state.items():
        for pattern, target in _KEY_RULES:
            m = pattern.match(key)
            if m:
                mapped[target.format(*m.groups())] = value
                break
        else:
            if not _IGNORED_KEYS.match(key):
                unknown.append(key)
    model = LPIPS()
    expected = set(model.state_dict())
    missing = sorted(expected - set(mapped))
    unknown += sorted(set(mapped) - expected)
    if missing or unknown:
        raise ConfigError(
            f"LPIPS weights {path} do not fit VGG16 + LPIPS: missing {missing[:6]}"
            f"{' ...' if len(missing) > 6 else ''} ({len(missing)} in all), unknown {unknown[:6]}. {_LPIPS_HELP}"
        )
    own = model.state_dict()
    for key, value in mapped.items():
        want = own[key].shape
        if tuple(value.shape) != tuple(want):
            raise ConfigError(f"LPIPS weights {path}: {key} has shape {tuple(value.shape)}, expected {tuple(want)}")
    model.load_state_dict(mapped, strict=True)
    return model.eval()


def _as_images(x, name: str) -> torch.Tensor:
    t = x.detach().cpu() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
    if t.ndim != 4 or t.shape[1] != 3:
        raise DataError(f"{name} must be (N, 3, H, W) RGB images; got shape {tuple(t.shape)}")
    if t.shape[2] < _MIN_SIDE or t.shape[3] < _MIN_SIDE:
        raise DataError(
            f"{name} images are {t.shape[2]}x{t.shape[3]}; LPIPS-VGG needs at least {_MIN_SIDE}x{_MIN_SIDE}"
        )
    if not t.is_floating_point():
        raise DataError(f"{name} must be float images in [-1, 1]; got dtype {t.dtype} (map uint8 with x / 127.5 - 1)")
    t = t.float()
    if not torch.isfinite(t).all():
        raise DataError(f"{name} has NaN or inf pixels")
    lo, hi = float(t.min()), float(t.max())
    if lo < -1.0 - 1e-5 or hi > 1.0 + 1e-5:
        raise DataError(f"{name} values span [{lo:.3g}, {hi:.3g}]; LPIPS expects [-1, 1] (from [0, 1] use 2x - 1)")
    return t


def lpips_distance(
    images_a, images_b, weights_path: str | Path | None = None, *, model: LPIPS | None = None, batch_size: int = 32
) -> np.ndarray:
    """Per-pair LPIPS-VGG distance between ``images_a[i]`` and ``images_b[i]`` (see ``LPIPS``).

    Only available with local weights: pass ``weights_path`` (a state dict, see ``load_lpips``) or an
    already loaded ``model``. With neither, ConfigError explains where to put the weights. Runs on
    the model's device (CPU when loaded from a path), ``batch_size`` pairs at a time, without grad.

    Args:
        images_a, images_b: (N, 3, H, W) float RGB in [-1, 1], same shape, H, W >= 16.
        weights_path: local VGG16 + LPIPS state dict.
        model: a loaded ``LPIPS``, to skip reloading across calls.

    Returns:
        (N,) float64 distances >= 0 with trained (non-negative) linear weights; 0 for identical images.
    """
    if model is None:
        model = load_lpips(weights_path)
    a = _as_images(images_a, "images_a")
    b = _as_images(images_b, "images_b")
    if a.shape != b.shape:
        raise DataError(f"images_a and images_b must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer; got {batch_size!r}")
    model.eval()
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for lo in range(0, a.shape[0], batch_size):
            out.append(model(a[lo : lo + batch_size].to(device), b[lo : lo + batch_size].to(device)).cpu())
    return torch.cat(out).double().numpy() if out else np.zeros(0)
