"""DFA, the Differentiable Face Aligner of KP-RPE (supplementary §3): one face's 5 landmarks and score without NMS.

A RetinaFace-style detector on a crop resized to ``input_size``²: MobileNetV1 (width 0.25) → FPN → SSH at strides
8, 16, 32; 1×1 heads give per anchor ``[box 4 | score 2 | landmarks 10]``, landmarks decoded as ``l = c_a + δ·v₀·wh_a``
(RetinaFace ``PriorBox``, 1050 anchors at 160 px, 378 at 96). Instead of NMS (supp. Eq. 13–15) the tokens ``O`` (A, 16)
pass ``mixer_depth`` MLP-Mixer blocks → one logit per anchor, ``w = softmax`` over anchors, landmarks
``L = Σ_a w_a l_a`` (5, 2), score ``Σ_a w_a·softmax(s_a)₁``; :meth:`DFA.top_anchor` is the RetinaFace read-out (the
best-scoring anchor). Landmarks are normalised to the crop, ``u = (x + ½)/W`` with pixel centres at integers, unclamped.

Differences from the reference (CVLface ``aligners/differentiable_face_aligner``): RGB input ``(x/255 − 0.5)/0.5``
(the reference flips the same tensor to BGR); a 16-channel token (2 score logits, as RetinaFace's heads; the paper
writes 4 + 1 + 10); a zero-initialised read-out (training starts from the uniform average of all anchors); the score
is trained on non-face crops (``ml.aligner.train``; the reference's loss trains the pooled class on its labelled
crops); ``min_sizes`` are given at 160 px and scaled with ``input_size`` (the reference runs at 160 only); the
mixer widths are ours, sized to the paper's parameter count (its token-mixing MLPs depend on the anchor count, hence on
``input_size``); MixerBlock lives here while DFA is its only user (STYLE §8).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError, DataError
from ml.models.io import CONFIG, load_weights_into, read_model_config, write_model_dir

__all__ = [
    "ALIGNERS",
    "DFA",
    "DFAConfig",
    "INPUT_CONTRACT",
    "READOUTS",
    "build_aligner",
    "decode_boxes",
    "decode_landmarks",
    "encode_landmarks",
    "load_aligner",
    "normalise",
    "prior_boxes",
    "resize_images",
    "save_aligner",
    "to_normalised",
    "to_pixels",
]

ANCHOR_REFERENCE = 160  # min sizes are given for a 160×160 crop
READOUTS = ("pooled", "top_anchor")  # predict(readout=...): the mixer-pooled face, or the best-scoring anchor
FORMAT = 1
MODEL_NAME = "dfa"

INPUT_CONTRACT: dict[str, Any] = {
    "size": 160,  # square side in pixels; inputs of other sizes are resized by predict()
    "colour": "RGB",
    "scale": "x/255",  # the model sees (x/255 - 0.5)/0.5
    "mean": (0.5, 0.5, 0.5),
    "std": (0.5, 0.5, 0.5),
    "layout": "NCHW float32",
    "output": "landmarks (B, 5, 2) normalised u=(x+0.5)/W, v=(y+0.5)/H; ArcFace order",
}


# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class DFAConfig:
    """Architecture of a DFA aligner (everything needed to rebuild it; saved in ``config.json``)."""

    input_size: int = 160
    width: float = 0.25  # MobileNetV1 width multiplier: channels 32·w … 1024·w
    fpn_channels: int = 64
    context: bool = True  # SSH context module on each FPN level
    min_sizes: tuple[tuple[int, ...], ...] = ((64, 80), (96, 112), (128, 144))  # at the 160-px reference
    steps: tuple[int, ...] = (8, 16, 32)
    variances: tuple[float, float] = (0.1, 0.2)
    mixer_dim: int = 16  # token embedding width
    mixer_depth: int = 3
    mixer_token_hidden: int = 16  # hidden width of the token-mixing MLP (mixes the A anchors)
    mixer_channel_hidden: int = 32

    def __post_init__(self) -> None:
        # JSON gives lists; store tuples so configs compare equal after a round trip
        object.__setattr__(self, "min_sizes", tuple(tuple(int(m) for m in level) for level in self.min_sizes))
        object.__setattr__(self, "steps", tuple(int(s) for s in self.steps))
        object.__setattr__(self, "variances", tuple(float(v) for v in self.variances))
        checks = {
            "input_size": isinstance(self.input_size, int) and self.input_size >= 32 and self.input_size % 32 == 0,
            "width": 0.0 < self.width <= 4.0,
            "fpn_channels": self.fpn_channels >= 8 and self.fpn_channels % 4 == 0,
            "mixer_dim": self.mixer_dim >= 1,
            "mixer_depth": self.mixer_depth >= 0,
            "mixer_token_hidden": self.mixer_token_hidden >= 1,
            "mixer_channel_hidden": self.mixer_channel_hidden >= 1,
            "steps": self.steps == (8, 16, 32),
            "min_sizes": len(self.min_sizes) == 3 and all(len(m) >= 1 and min(m) > 0 for m in self.min_sizes)
            and len({len(m) for m in self.min_sizes}) == 1,
            "variances": len(self.variances) == 2 and min(self.variances) > 0,
        }
        hints = {
            "input_size": "a multiple of 32, at least 32 (e.g. 96, 128, 160)",
            "fpn_channels": "a multiple of 4, at least 8 (SSH splits it 2:1:1)",
            "steps": "(8, 16, 32): the backbone's three output strides",
            "min_sizes": "three levels with the same number (≥ 1) of positive sizes each",
        }
        for key, ok in checks.items():
            if not ok:
                hint = hints.get(key, "out of range")
                raise ConfigError(f"aligner.{key} = {getattr(self, key)!r}: {hint}")

    @property
    def anchors_per_cell(self) -> int:
        return len(self.min_sizes[0])


# --------------------------------------------------------------------------------------------------
# Anchors and box/landmark coding


def prior_boxes(input_size: int, min_sizes=DFAConfig.min_sizes, steps=DFAConfig.steps) -> torch.Tensor:
    """Anchors (A, 4) normalised ``(cx, cy, w, h)``; row order = cell row, cell column, min size, per level.

    ``min_sizes`` are at the 160-px reference, so ``w = h = m/160`` of the crop whatever ``input_size``.
    """
    out = []
    for sizes, step in zip(min_sizes, steps):
        cells = math.ceil(input_size / step)
        centres = (torch.arange(cells, dtype=torch.float64) + 0.5) * step / input_size  # (cells,)
        cy, cx = torch.meshgrid(centres, centres, indexing="ij")
        wh = torch.tensor([m / ANCHOR_REFERENCE for m in sizes], dtype=torch.float64)  # (k,)
        k = len(sizes)
        level = torch.stack(
            [
                cx.reshape(-1, 1).expand(-1, k),
                cy.reshape(-1, 1).expand(-1, k),
                wh.view(1, k).expand(cells * cells, -1),
                wh.view(1, k).expand(cells * cells, -1),
            ],
            dim=-1,
        )  # (cells², k, 4)
        out.append(level.reshape(-1, 4))
    return torch.cat(out).float()


def decode_landmarks(pre: torch.Tensor, priors: torch.Tensor, variances=DFAConfig.variances) -> torch.Tensor:
    """Per-anchor offsets (B, A, 10) → landmarks (B, A, 5, 2): ``l = c_a + δ·v₀·wh_a``."""
    b, a = pre.shape[:2]
    d = pre.view(b, a, 5, 2)
    return priors[:, None, :2] + d * variances[0] * priors[:, None, 2:]


def encode_landmarks(landmarks: torch.Tensor, priors: torch.Tensor, variances=DFAConfig.variances) -> torch.Tensor:
    """Inverse of :func:`decode_landmarks`: landmarks (B, 5, 2) → offsets (B, A, 10) for every anchor."""
    d = (landmarks[:, None] - priors[None, :, None, :2]) / (variances[0] * priors[None, :, None, 2:])
    return d.flatten(2)


def decode_boxes(loc: torch.Tensor, priors: torch.Tensor, variances=DFAConfig.variances) -> torch.Tensor:
    """Per-anchor box offsets (B, A, 4) → boxes (B, A, 4) normalised ``(x0, y0, x1, y1)``."""
    centre = priors[:, :2] + loc[..., :2] * variances[0] * priors[:, 2:]
    size = priors[:, 2:] * torch.exp(loc[..., 2:] * variances[1])
    return torch.cat([centre - size / 2, centre + size / 2], dim=-1)


def to_pixels(landmarks: torch.Tensor | np.ndarray, width: int, height: int) -> torch.Tensor | np.ndarray:
    """Normalised (…, 2) → pixel x, y (pixel centres at integers): ``x = u·W − ½``, ``y = v·H − ½``."""
    scale = np.array([width, height], dtype=np.float32)
    if isinstance(landmarks, torch.Tensor):
        return landmarks * torch.as_tensor(scale, dtype=landmarks.dtype, device=landmarks.device) - 0.5
    return np.asarray(landmarks, dtype=np.float32) * scale - 0.5


def to_normalised(landmarks: torch.Tensor | np.ndarray, width: int, height: int) -> torch.Tensor | np.ndarray:
    """Pixel x, y (…, 2) → normalised: ``u = (x + ½)/W``, ``v = (y + ½)/H``."""
    scale = np.array([width, height], dtype=np.float32)
    if isinstance(landmarks, torch.Tensor):
        return (landmarks + 0.5) / torch.as_tensor(scale, dtype=landmarks.dtype, device=landmarks.device)
    return (np.asarray(landmarks, dtype=np.float32) + 0.5) / scale


# --------------------------------------------------------------------------------------------------
# Building blocks


def _conv_bn(cin: int, cout: int, stride: int, leaky: float, kernel: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.LeakyReLU(leaky, inplace=True) if leaky >= 0 else nn.Identity(),
    )


def _conv_dw(cin: int, cout: int, stride: int, leaky: float = 0.1) -> nn.Sequential:
    """Depthwise 3×3 (stride) → BN → LeakyReLU → pointwise 1×1 → BN → LeakyReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
        nn.BatchNorm2d(cin),
        nn.LeakyReLU(leaky, inplace=True),
        nn.Conv2d(cin, cout, 1, 1, 0, bias=False),
        nn.BatchNorm2d(cout),
        nn.LeakyReLU(leaky, inplace=True),
    )


class MobileNetV1(nn.Module):
    """RetinaFace's MobileNetV1: three stages ending at strides 8, 16, 32 with 256w, 512w, 1024w channels."""

    def __init__(self, width: float = 0.25) -> None:
        super().__init__()

        def c(base: int) -> int:
            return max(4, int(round(base * width)))

        self.stage1 = nn.Sequential(
            _conv_bn(3, c(32), 2, 0.1),
            _conv_dw(c(32), c(64), 1),
            _conv_dw(c(64), c(128), 2),
            _conv_dw(c(128), c(128), 1),
            _conv_dw(c(128), c(256), 2),
            _conv_dw(c(256), c(256), 1),
        )
        self.stage2 = nn.Sequential(_conv_dw(c(256), c(512), 2), *[_conv_dw(c(512), c(512), 1) for _ in range(5)])
        self.stage3 = nn.Sequential(_conv_dw(c(512), c(1024), 2), _conv_dw(c(1024), c(1024), 1))
        self.out_channels = (c(256), c(512), c(1024))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c3 = self.stage1(x)  # (B, 256w, S/8, S/8)
        c4 = self.stage2(c3)  # (B, 512w, S/16, S/16)
        c5 = self.stage3(c4)  # (B, 1024w, S/32, S/32)
        return [c3, c4, c5]


class FPN(nn.Module):
    """Top-down feature pyramid: 1×1 laterals, nearest upsampling, 3×3 merges (RetinaFace)."""

    def __init__(self, in_channels: tuple[int, ...], out: int) -> None:
        super().__init__()
        leaky = 0.1 if out <= 64 else 0.0
        self.lateral = nn.ModuleList([_conv_bn(c, out, 1, leaky, kernel=1) for c in in_channels])
        self.merge = nn.ModuleList([_conv_bn(out, out, 1, leaky) for _ in in_channels[:-1]])

    def forward(self, feats: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = [lat(f) for lat, f in zip(self.lateral, feats)]
        for i in range(len(outs) - 2, -1, -1):  # coarse → fine
            up = F.interpolate(outs[i + 1], size=outs[i].shape[-2:], mode="nearest")
            outs[i] = self.merge[i](outs[i] + up)
        return outs


class SSH(nn.Module):
    """SSH context module: 3×3, 5×5 and 7×7 receptive fields (stacked 3×3) concatenated 2:1:1, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        leaky = 0.1 if channels <= 64 else 0.0
        half, quarter = channels // 2, channels // 4
        self.conv3 = _conv_bn(channels, half, 1, -1)
        self.conv5_1 = _conv_bn(channels, quarter, 1, leaky)
        self.conv5_2 = _conv_bn(quarter, quarter, 1, -1)
        self.conv7_2 = _conv_bn(quarter, quarter, 1, leaky)
        self.conv7_3 = _conv_bn(quarter, quarter, 1, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c5 = self.conv5_1(x)
        return F.relu(torch.cat([self.conv3(x), self.conv5_2(c5), self.conv7_3(self.conv7_2(c5))], dim=1))


class MixerBlock(nn.Module):
    """MLP-Mixer block (Tolstikhin et al. 2021) on (B, T, D): token mixing across T, then channel mixing.

    ``x ← x + W₂ᵀ·GELU(W₁ᵀ·LN(x)ᵀ)`` over tokens, then ``x ← x + MLP(LN(x))`` over channels.
    """

    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)  # mix the T anchors per channel
        return x + self.channel_mlp(self.norm2(x))


class MixerPool(nn.Module):
    """Anchor tokens (B, A, C) → softmax weights (B, A) over anchors; starts uniform (zero read-out)."""

    def __init__(self, tokens: int, in_dim: int, cfg: DFAConfig) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, cfg.mixer_dim)
        self.blocks = nn.Sequential(
            *[MixerBlock(tokens, cfg.mixer_dim, cfg.mixer_token_hidden, cfg.mixer_channel_hidden)
              for _ in range(cfg.mixer_depth)]
        )
        self.norm = nn.LayerNorm(cfg.mixer_dim)
        self.readout = nn.Linear(cfg.mixer_dim, 1)
        nn.init.zeros_(self.readout.weight)
        nn.init.zeros_(self.readout.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(tokens))  # (B, A, D)
        return self.readout(self.norm(x)).squeeze(-1).softmax(dim=-1)  # (B, A), rows sum to 1


# --------------------------------------------------------------------------------------------------
# The model


class DFA(nn.Module):
    """Single-face landmark detector: images (B, 3, S, S), normalised per ``input_contract`` → one face each."""

    def __init__(self, cfg: DFAConfig = DFAConfig()) -> None:
        super().__init__()
        if not isinstance(cfg, DFAConfig):
            raise ConfigError(f"DFA needs a DFAConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        k = cfg.anchors_per_cell
        self.body = MobileNetV1(cfg.width)
        self.fpn = FPN(self.body.out_channels, cfg.fpn_channels)
        ch = cfg.fpn_channels
        self.context = nn.ModuleList([SSH(ch) if cfg.context else nn.Identity() for _ in cfg.steps])
        self.box_head = nn.ModuleList([nn.Conv2d(ch, k * 4, 1) for _ in cfg.steps])
        self.score_head = nn.ModuleList([nn.Conv2d(ch, k * 2, 1) for _ in cfg.steps])
        self.landmark_head = nn.ModuleList([nn.Conv2d(ch, k * 10, 1) for _ in cfg.steps])
        self.register_buffer("priors", prior_boxes(cfg.input_size, cfg.min_sizes, cfg.steps), persistent=False)
        self.num_anchors = int(self.priors.shape[0])
        self.pool = MixerPool(self.num_anchors, 4 + 2 + 10, cfg)

    @property
    def input_contract(self) -> dict[str, Any]:
        return {**INPUT_CONTRACT, "size": self.cfg.input_size, "num_anchors": self.num_anchors}

    @staticmethod
    def _flatten(x: torch.Tensor, per_anchor: int) -> torch.Tensor:
        """(B, k·c, H, W) → (B, H·W·k, c), the prior order (row, column, min size)."""
        b = x.shape[0]
        return x.permute(0, 2, 3, 1).reshape(b, -1, per_anchor)

    def forward_anchors(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw per-anchor outputs: box offsets (B, A, 4), score logits (B, A, 2), landmark offsets (B, A, 10)."""
        s = self.cfg.input_size
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[-2:] != (s, s):
            raise DataError(
                f"DFA takes normalised images (B, 3, {s}, {s}), got {tuple(images.shape)}; "
                "use predict() for uint8 images of any size (it resizes them)"
            )
        feats = [ctx(f) for ctx, f in zip(self.context, self.fpn(self.body(images)))]
        box = torch.cat([self._flatten(h(f), 4) for h, f in zip(self.box_head, feats)], dim=1)
        score = torch.cat([self._flatten(h(f), 2) for h, f in zip(self.score_head, feats)], dim=1)
        ldmk = torch.cat([self._flatten(h(f), 10) for h, f in zip(self.landmark_head, feats)], dim=1)
        assert box.shape[1] == self.num_anchors, (box.shape, self.num_anchors)  # heads and priors agree
        return box, score, ldmk

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """``landmarks`` (B, 5, 2) normalised, ``score`` (B,), ``weights`` (B, A) summing to 1, the
        per-anchor decoded ``anchor_landmarks`` (B, A, 5, 2) and score logits ``anchor_scores`` (B, A, 2)
        (background, face)."""
        box, score, ldmk = self.forward_anchors(images)
        weights = self.pool(torch.cat([box, score, ldmk], dim=-1))  # (B, A)
        per_anchor = decode_landmarks(ldmk, self.priors, self.cfg.variances)  # (B, A, 5, 2)
        landmarks = torch.einsum("ba,bakc->bkc", weights, per_anchor)  # (B, 5, 2)
        face = (weights * score.softmax(dim=-1)[..., 1]).sum(dim=1)  # (B,) in [0, 1]
        return {"landmarks": landmarks, "score": face, "weights": weights, "anchor_landmarks": per_anchor,
                "anchor_scores": score}

    @staticmethod
    def top_anchor(out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The single-detection read-out of a :meth:`forward` output: per image, the decoded landmarks (B, 5, 2)
        and face probability (B,) of the anchor with the highest face probability ``softmax(s_a)₁`` (ties: the
        first anchor in prior order)."""
        prob = out["anchor_scores"].float().softmax(dim=-1)[..., 1]  # (B, A)
        best = prob.argmax(dim=1)  # (B,)
        rows = torch.arange(prob.shape[0], device=prob.device)
        return out["anchor_landmarks"][rows, best], prob[rows, best]

    @torch.no_grad()
    def predict(
        self, images: np.ndarray, batch_size: int = 64, *, readout: str = "pooled"
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 RGB ``images`` (N, H, W, 3) of any size → (landmarks (N, 5, 2) float32 pixel x, y in those
        images, scores (N,) float32). Each batch is resized to ``input_size``² (bilinear, antialiased) and
        the normalised predictions are mapped back with ``x = u·W − ½``. ``readout="pooled"`` gives the
        mixer-pooled landmarks and score, ``"top_anchor"`` those of the best-scoring anchor (:meth:`top_anchor`)."""
        if readout not in READOUTS:
            raise ConfigError(f"DFA.predict readout = {readout!r}: use one of {', '.join(READOUTS)}")
        batches = self._batches(images, batch_size, "predict")
        h, w = images.shape[1:3]
        landmarks, scores = [], []
        for x in batches:
            out = self(x)
            lm, score = (out["landmarks"], out["score"]) if readout == "pooled" else self.top_anchor(out)
            landmarks.append(to_pixels(lm.float(), w, h).cpu().numpy())
            scores.append(score.float().cpu().numpy())
        if not landmarks:
            return np.zeros((0, 5, 2), np.float32), np.zeros((0,), np.float32)
        return np.concatenate(landmarks).astype(np.float32), np.concatenate(scores).astype(np.float32)

    @torch.no_grad()
    def features(self, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        """uint8 RGB ``images`` (N, H, W, 3) → (N, 1024w) float32: the backbone's deepest feature map (stride 32),
        average-pooled, of the images resized and normalised as :meth:`predict` does. A face representation
        learned for landmarks and faceness, never for identity: the synthetic set's independent judge compares
        feature distributions in it (``ml.generator.diversity.frechet_distance``)."""
        pooled = [self.body(x)[-1].float().mean(dim=(2, 3)).cpu().numpy()
                  for x in self._batches(images, batch_size, "features")]
        return np.concatenate(pooled) if pooled else np.zeros((0, self.body.out_channels[-1]), np.float32)

    def _batches(self, images: np.ndarray, batch_size: int, caller: str) -> Iterator[torch.Tensor]:
        """Normalised (b, 3, S, S) batches of uint8 (N, H, W, 3) ``images`` on the model's device, in eval mode
        (the previous mode is restored after the last batch). The input is checked now, before the first batch."""
        if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
            raise DataError(f"DFA.{caller} images must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"DFA.{caller} batch_size must be a positive integer, got {batch_size!r}")
        h, w = images.shape[1:3]
        if min(h, w) < 8:
            raise DataError(f"DFA.{caller} images are {h}×{w} pixels; need at least 8×8 face crops")
        return self._eval_batches(images, batch_size)

    def _eval_batches(self, images: np.ndarray, batch_size: int) -> Iterator[torch.Tensor]:
        n = images.shape[0]
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            for i in range(0, n, batch_size):
                x = torch.from_numpy(np.ascontiguousarray(images[i : i + batch_size])).to(device)
                yield normalise(resize_images(x.permute(0, 3, 1, 2), self.cfg.input_size))  # (b, 3, S, S)
        finally:
            self.train(was_training)


def resize_images(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 3, H, W) uint8 or float → float32 (B, 3, size, size) on the same 0..255 scale.

    Bilinear with ``align_corners=False`` (the crop's extent maps onto itself, so normalised landmark
    coordinates are unchanged) and antialiasing when shrinking.
    """
    x = x.float()
    if x.shape[-2:] == (size, size):
        return x
    shrink = x.shape[-2] > size or x.shape[-1] > size
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)


def normalise(x: torch.Tensor) -> torch.Tensor:
    """0..255 float (B, 3, S, S) → ``(x/255 − 0.5)/0.5`` per the input contract."""
    mean, std = INPUT_CONTRACT["mean"][0], INPUT_CONTRACT["std"][0]
    return (x / 255.0 - mean) / std


# --------------------------------------------------------------------------------------------------
# Named variants


ALIGNERS: dict[str, DFAConfig] = {
    "dfa_mnet025": DFAConfig(),  # the paper's DFA MobileNet (width 0.25, 160×160)
    "dfa_mnet050": DFAConfig(width=0.5),
}


def build_aligner(name: str = "dfa_mnet025", **overrides: Any) -> DFA:
    """Build registered aligner ``name`` with ``DFAConfig`` field overrides (e.g. ``input_size=128``)."""
    if name not in ALIGNERS:
        raise ConfigError(f"unknown aligner {name!r}; valid names: {', '.join(ALIGNERS)}")
    valid = {f.name for f in fields(DFAConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"aligner overrides {unknown} are not DFAConfig fields; valid: {sorted(valid)}")
    return DFA(DFAConfig(**{**asdict(ALIGNERS[name]), **overrides}))


# --------------------------------------------------------------------------------------------------
# Save / load: the layout of ml.models.io (model.safetensors + config.json, written atomically). The
# aligner is not a backbone (it returns landmarks, not embeddings), so it is not in BACKBONES and
# io.load_model cannot rebuild it; config.json names the model "dfa" and holds its DFAConfig instead.


def save_aligner(model_dir: str | os.PathLike, model: DFA, *, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` to ``model_dir`` (``model.safetensors`` + ``config.json``) atomically; return it."""
    if not isinstance(model, DFA):
        raise ConfigError(f"save_aligner needs a DFA model, got {type(model).__name__}")
    config = {
        "format": FORMAT,
        "model": MODEL_NAME,
        "config": asdict(model.cfg),
        "input_contract": model.input_contract,
        "extra": dict(extra or {}),
    }
    return write_model_dir(model_dir, model, config, what="DFA aligner")


def load_aligner(model_dir: str | os.PathLike) -> tuple[DFA, dict[str, Any]]:
    """Rebuild the aligner saved in ``model_dir``; return it in eval mode with its config dict."""
    config = read_model_config(model_dir, what="DFA aligner")
    config_path = Path(model_dir) / CONFIG
    if config.get("model") != MODEL_NAME or not isinstance(config.get("config"), dict):
        raise DataError(
            f"{config_path} does not describe a DFA aligner (model 'dfa' + config); re-save with save_aligner"
        )
    try:
        model = DFA(DFAConfig(**config["config"]))
    except (TypeError, ConfigError) as exc:
        raise DataError(f"{config_path}: cannot build DFA from its config: {exc}") from exc
    return load_weights_into(model, model_dir, what="the DFA"), config
