"""Improved ResNet (IResNet) face backbone, the insightface ``arcface_torch`` layout, with CAFace styles.

Stem ``conv3x3(3→64) → BN → PReLU``, then four stages of ``IBasicBlock`` (64, 128, 256, 512 channels) each opening
with stride 2 (112 px → 7×7), and the head ``BN2d → Dropout → flatten → Linear → BN1d`` (unnormalised embedding).
``forward(x, return_styles=True)`` also returns the per-channel spatial mean and std of chosen stages' outputs
(default stages 2 and 3: ``(B, 384, 2)``). An untrained full-width model is meaningful in train mode only: in eval
mode its BatchNorms hold the initial statistics and the activations grow with depth.

Differences from the reference (insightface ``recognition/arcface_torch/backbones/iresnet.py``):

- The final BatchNorm1d's scale is a constant buffer of ones, not a frozen parameter (same key: checkpoints load).
- ``img_size`` sets the final map and the ``fc`` input (reference: 7×7); ``width`` scales every stage's channels.
- Dropout is not in-place and runs before ``flatten``; no fp16 flag, dilation, groups or ``zero_init_residual``.
- Styles are not in insightface; CAFace takes them from TFace's IR-101 (strided identity shortcut, other keys)
  with the unbiased std, here the population std.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ml.errors import ConfigError, DataError

# What data code must feed the model; ``IResNet.input_contract`` fills in size and the dims.
INPUT_CONTRACT: dict[str, Any] = {
    "size": 112,  # square side in pixels
    "colour": "RGB",
    "scale": "x/255",  # the mean/std below apply to x/255, i.e. the model sees (x/255 - 0.5)/0.5
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "layout": "NCHW float32",
    "embedding_dim": 512,
    "style_dim": 384,  # channels of the styles from forward(x, return_styles=True): 128 + 256
}

STAGE_PLANES = (64, 128, 256, 512)
BN_EPS = 1e-5


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """3×3 convolution, padding 1, no bias: a side ``n`` becomes ``⌈n/stride⌉``."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1×1 convolution, no bias (the downsampling shortcut)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def channel_style(x: torch.Tensor) -> torch.Tensor:
    """Per-channel spatial mean and population std of a map ``(B, C, H, W)`` → ``(B, C, 2)``.

    ``[..., 0] = mean_hw x``, ``[..., 1] = sqrt(mean_hw (x − mean)²)`` (``unbiased=False``).
    """
    flat = x.flatten(2)  # (B, C, H·W)
    var, mean = torch.var_mean(flat, dim=-1, correction=0)
    return torch.stack((mean, var.sqrt()), dim=-1)


class IBasicBlock(nn.Module):
    """Pre-activation-style residual block: ``BN → conv3x3 → BN → PReLU → conv3x3(stride) → BN`` + shortcut.

    The shortcut is the identity, or ``conv1x1(stride) → BN`` when the stride or the width changes.
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=BN_EPS)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=BN_EPS)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=BN_EPS)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(conv1x1(inplanes, planes, stride), nn.BatchNorm2d(planes, eps=BN_EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        identity = x if self.downsample is None else self.downsample(x)
        return out + identity


class UnitScaleBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose scale is fixed to 1 (a buffer named ``weight``); only the shift is learned.

    insightface freezes this scale with ``requires_grad = False``; a buffer keeps the same state-dict
    key while making the scale untrainable by construction.
    """

    def __init__(self, num_features: int, eps: float = BN_EPS) -> None:
        super().__init__(num_features, eps=eps, affine=True)
        del self.weight
        self.register_buffer("weight", torch.ones(num_features))


class IResNet(nn.Module):
    """IResNet face backbone returning an unnormalised ``embed_dim`` embedding per image."""

    def __init__(
        self,
        layers: Sequence[int] = (3, 4, 14, 3),
        img_size: int = 112,
        embed_dim: int = 512,
        dropout: float = 0.0,
        width: float = 1.0,
        style_layers: Sequence[int] = (2, 3),
    ) -> None:
        super().__init__()
        layers = list(layers)
        if len(layers) != 4 or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in layers):
            raise ConfigError(f"IResNet 'layers' must be 4 positive integers (blocks per stage), got {layers!r}")
        for name, value in (("img_size", img_size), ("embed_dim", embed_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"IResNet argument '{name}' must be a positive integer, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"IResNet dropout must be in [0, 1), got {dropout}")
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not width > 0:
            raise ConfigError(f"IResNet width must be a positive number (1.0 = insightface), got {width!r}")
        chosen = list(style_layers)
        bad = [s for s in chosen if isinstance(s, bool) or s not in (1, 2, 3, 4)]
        if not chosen or bad or len(set(chosen)) != len(chosen):
            raise ConfigError(
                f"IResNet style_layers must be distinct stage numbers from 1 to 4 (CAFace uses [2, 3]), got {chosen!r}"
            )
        self.layers = tuple(layers)
        self.img_size = img_size
        self.embed_dim = embed_dim
        self.width = float(width)
        self.planes = tuple(max(1, round(p * width)) for p in STAGE_PLANES)
        self.style_layers = tuple(sorted(chosen))
        self.style_dim = sum(self.planes[s - 1] for s in self.style_layers)
        side = img_size
        for _ in STAGE_PLANES:
            side = math.ceil(side / 2)  # each stage's stride-2 block: n → ⌈n/2⌉
        self.final_size = side  # 7 for 112 px, 4 for 64 px

        stem = self.planes[0]
        self.conv1 = conv3x3(3, stem)
        self.bn1 = nn.BatchNorm2d(stem, eps=BN_EPS)
        self.prelu = nn.PReLU(stem)
        inplanes = stem
        stages = []
        for planes, blocks in zip(self.planes, self.layers):
            stage = [IBasicBlock(inplanes, planes, stride=2)]
            stage += [IBasicBlock(planes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.bn2 = nn.BatchNorm2d(inplanes, eps=BN_EPS)
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(inplanes * side * side, embed_dim)
        self.features = UnitScaleBatchNorm1d(embed_dim, eps=BN_EPS)
        self._init_weights()

    def _init_weights(self) -> None:
        # insightface: convolutions N(0, 0.1²), BatchNorm2d scale 1 and shift 0, fc at PyTorch's default.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def input_contract(self) -> dict[str, Any]:
        return {**INPUT_CONTRACT, "size": self.img_size, "embedding_dim": self.embed_dim, "style_dim": self.style_dim}

    def forward(
        self, x: torch.Tensor, return_styles: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Images (B, 3, S, S) → embeddings (B, embed_dim), and with ``return_styles`` the styles
        (B, style_dim, 2) of the ``style_layers`` stage outputs in stage order (``[..., 0]`` mean,
        ``[..., 1]`` population std)."""
        if x.ndim != 4 or x.shape[1:] != (3, self.img_size, self.img_size):
            raise DataError(
                f"expected images of shape (B, 3, {self.img_size}, {self.img_size}), got {tuple(x.shape)}; "
                f"resize/align the images to the backbone's input contract"
            )
        x = self.prelu(self.bn1(self.conv1(x)))  # (B, 64w, S, S)
        styles = []
        for number, stage in enumerate((self.layer1, self.layer2, self.layer3, self.layer4), start=1):
            x = stage(x)
            if return_styles and number in self.style_layers:
                styles.append(channel_style(x))  # (B, planes, 2)
        x = self.dropout(self.bn2(x))  # (B, 512w, h, w)
        embeddings = self.features(self.fc(x.flatten(1)))  # (B, embed_dim)
        if not return_styles:
            return embeddings
        return embeddings, torch.cat(styles, dim=1)


def _variant(layers: tuple[int, int, int, int], overrides: dict[str, Any]) -> IResNet:
    if "layers" in overrides:
        raise ConfigError("a named IResNet variant fixes 'layers'; build IResNet(layers=...) directly instead")
    return IResNet(layers=layers, **overrides)


def iresnet18(**overrides: Any) -> IResNet:
    """insightface ``r18``: blocks [2, 2, 2, 2], 112 px, 512-d."""
    return _variant((2, 2, 2, 2), overrides)


def iresnet34(**overrides: Any) -> IResNet:
    """insightface ``r34``: blocks [3, 4, 6, 3], 112 px, 512-d."""
    return _variant((3, 4, 6, 3), overrides)


def iresnet50(**overrides: Any) -> IResNet:
    """insightface ``r50``: blocks [3, 4, 14, 3], 112 px, 512-d (43.6M parameters)."""
    return _variant((3, 4, 14, 3), overrides)


def iresnet100(**overrides: Any) -> IResNet:
    """insightface ``r100``: blocks [3, 13, 30, 3], 112 px, 512-d (65.2M parameters)."""
    return _variant((3, 13, 30, 3), overrides)
