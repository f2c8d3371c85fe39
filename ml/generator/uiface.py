"""UIFace's ID-conditioned denoiser ε_θ(x_t, t, c): a diffusers UNet whose cross-attention reads an identity context.

Context (paper Sec. 3.1): ``c = reshape(W·f/‖f‖₂ + b)`` (B, tokens, context_dim) from the FR embedding f
(B, id_dim); in training, element dropout (p = 0.25) and, per sample with probability 0.2, the learnable empty
context ``c_e`` (``nn.Parameter``, (1, tokens, context_dim)), so one network gives ε(x_t, t, c) and ε(x_t, t, c_e)
for the two-stage sampler and CFG. Space: pixels in [−1, 1], or a diffusers ``VQModel`` / ``AutoencoderKL`` /
``AutoencoderTiny`` latent (``load_autoencoder``, ``encode_images``, ``decode_latents``); ``save_generator`` writes
the EMA weights and ``extra``.

Differences from the reference (appendix A.1; code from IDiff-Face / LDM):
- Small UNets on 32-px faces, not VQ-f4's 3×32×32 latent of 128-px faces with four levels: a trained latent
  (8×8) or the pixels themselves, which ``patch_size`` p hands the UNet as p×p patches in its channels (pixel
  unshuffle: lossless, so no decoder bounds the faces); a given VQ/KL autoencoder plugs in.
- Element dropout rescales kept entries by 1/(1 − p) and draws from an optional generator (exact resume).
- The context is one Linear into ``context_tokens`` tokens; the paper gives no token layout.
- ``time_context``: the flattened context also enters the time embedding (diffusers ``class_embed_type =
  "projection"``), reaching every ResNet block; the reference conditions by cross-attention only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderTiny, UNet2DConditionModel, VQModel
from torch import nn

from ml.errors import ConfigError, DataError
from ml.models.io import CONFIG, load_weights_into, read_model_config, write_model_dir

__all__ = [
    "ARCHITECTURE",
    "AUTOENCODERS",
    "GeneratorModelConfig",
    "IDConditionedUNet",
    "autoencoder_factor",
    "autoencoder_kind",
    "check_latent_shape",
    "decode_latents",
    "encode_images",
    "latent_shape",
    "load_autoencoder",
    "load_generator",
    "save_generator",
]

log = logging.getLogger(__name__)

ARCHITECTURE = "uiface"
FORMAT = 1
AUTOENCODERS = {"vq": VQModel, "kl": AutoencoderKL, "tiny": AutoencoderTiny}  # kind → diffusers class


@dataclass(frozen=True)
class GeneratorModelConfig:
    """``generator.model`` section: the denoiser's shape and its context. ``image_size``/``in_channels`` are
    what the UNet sees: pixels (3 × image_size²) or, with an autoencoder, its latent."""

    image_size: int = 32  # side of what the denoiser makes: pixels, or the latent side with an autoencoder
    in_channels: int = 3
    patch_size: int = 1  # the UNet sees p×p patches as channels (pixel unshuffle): (C·p², S/p, S/p), lossless
    block_out_channels: tuple[int, ...] = (32, 64, 64)  # one UNet level each; len − 1 downsamplings
    layers_per_block: int = 1
    attention_heads: int = 8  # per attention layer (diffusers passes this as ``attention_head_dim``)
    cross_attention_from: int = 1  # first level with cross-attention (0 = full resolution); the mid block always has it
    norm_num_groups: int = 8  # GroupNorm groups; must divide every entry of block_out_channels
    id_dim: int = 512
    context_dim: int = 256
    context_tokens: int = 1
    time_context: bool = False  # also add Linear(flattened context) to the time embedding (class_embed "projection")
    element_dropout: float = 0.25
    empty_context_prob: float = 0.2

    def __post_init__(self) -> None:
        # a params.yaml list arrives as a list; keep the frozen dataclass hashable and JSON-stable
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        positive = ("image_size", "in_channels", "patch_size", "layers_per_block", "attention_heads", "norm_num_groups", "id_dim",
                    "context_dim", "context_tokens")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"generator.model.{key} = {getattr(self, key)!r} must be ≥ 1")
        levels = len(self.block_out_channels)
        if levels < 1 or any(c < 1 for c in self.block_out_channels):
            raise ConfigError(
                f"generator.model.block_out_channels = {list(self.block_out_channels)}: need one positive channel "
                "count per UNet level, e.g. [32, 64, 64]"
            )
        for p in ("element_dropout", "empty_context_prob"):
            if not 0.0 <= getattr(self, p) < 1.0:
                raise ConfigError(f"generator.model.{p} = {getattr(self, p)!r} must be in [0, 1)")
        if not 0 <= self.cross_attention_from <= levels:
            raise ConfigError(
                f"generator.model.cross_attention_from = {self.cross_attention_from} must be in [0, {levels}] "
                f"(the UNet has {levels} levels; {levels} = cross-attention in the middle block only)"
            )
        bad_groups = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad_groups:
            raise ConfigError(
                f"generator.model.norm_num_groups = {self.norm_num_groups} does not divide block_out_channels "
                f"{list(bad_groups)}; pick a common divisor"
            )
        attn_channels = [*self.block_out_channels[self.cross_attention_from :], self.block_out_channels[-1]]
        bad_heads = sorted({c for c in attn_channels if c % self.attention_heads})
        if bad_heads:
            raise ConfigError(
                f"generator.model.attention_heads = {self.attention_heads} does not divide the channels {bad_heads} "
                "of the cross-attention levels; pick a divisor"
            )
        factor = self.downsample_factor * self.patch_size
        if self.image_size % factor:
            raise ConfigError(
                f"generator.model.image_size = {self.image_size} is not a multiple of {factor}, which a "
                f"{levels}-level UNet (it halves the size {levels - 1} times) on {self.patch_size}×{self.patch_size} "
                f"patches needs; use e.g. {max(factor, self.image_size - self.image_size % factor)}"
            )

    @property
    def downsample_factor(self) -> int:
        """Total downsampling of the UNet: 2^(levels − 1); image_size must be a multiple of it."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def unet_shape(self) -> tuple[int, int]:
        """(channels, side) of the tensors the UNet and the sampler work on: (C·p², image_size / p)."""
        return self.in_channels * self.patch_size ** 2, self.image_size // self.patch_size

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["block_out_channels"] = list(self.block_out_channels)
        return d


def _build_unet(cfg: GeneratorModelConfig) -> UNet2DConditionModel:
    levels = len(cfg.block_out_channels)
    cross = [i >= cfg.cross_attention_from for i in range(levels)]
    down = tuple("CrossAttnDownBlock2D" if c else "DownBlock2D" for c in cross)
    up = tuple("CrossAttnUpBlock2D" if c else "UpBlock2D" for c in reversed(cross))
    channels, side = cfg.unet_shape
    return UNet2DConditionModel(
        sample_size=side,
        in_channels=channels,
        out_channels=channels,  # ε has the input's shape
        down_block_types=down,
        up_block_types=up,
        mid_block_type="UNetMidBlock2DCrossAttn",
        block_out_channels=cfg.block_out_channels,
        layers_per_block=cfg.layers_per_block,
        cross_attention_dim=cfg.context_dim,
        attention_head_dim=cfg.attention_heads,  # diffusers' naming issue: this is the number of heads
        norm_num_groups=cfg.norm_num_groups,
        # the flattened context, projected, is added to the time embedding and so reaches every ResNet block
        class_embed_type="projection" if cfg.time_context else None,
        projection_class_embeddings_input_dim=cfg.context_tokens * cfg.context_dim if cfg.time_context else None,
    )


class IDConditionedUNet(nn.Module):
    """ε_θ(x_t, t, c): a diffusers UNet conditioned by cross-attention on an identity context or on ``c_e``."""

    def __init__(self, config: GeneratorModelConfig | None = None) -> None:
        super().__init__()
        cfg = config if config is not None else GeneratorModelConfig()
        if not isinstance(cfg, GeneratorModelConfig):
            raise ConfigError(f"IDConditionedUNet needs a GeneratorModelConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.unet = _build_unet(cfg)
        self.context_proj = nn.Linear(cfg.id_dim, cfg.context_tokens * cfg.context_dim)
        # c_e on the scale of a projected unit embedding (default Linear init: std ≈ 1/√(3·id_dim) per entry)
        self.empty_context = nn.Parameter(torch.randn(1, cfg.context_tokens, cfg.context_dim) * 0.02)

    def _check_ids(self, id_embeddings: torch.Tensor) -> None:
        if id_embeddings.ndim != 2 or id_embeddings.shape[1] != self.config.id_dim:
            raise DataError(
                f"id_embeddings must have shape (B, {self.config.id_dim}), got {tuple(id_embeddings.shape)}"
            )

    def encode_context(self, id_embeddings: torch.Tensor) -> torch.Tensor:
        """(B, id_dim) FR embeddings → (B, tokens, context_dim): L2-normalise, Linear, reshape. No dropout."""
        self._check_ids(id_embeddings)
        f = F.normalize(id_embeddings.to(self.context_proj.weight.dtype), dim=-1)
        return self.context_proj(f).view(-1, self.config.context_tokens, self.config.context_dim)

    def training_context(
        self, id_embeddings: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Training-time context: ``encode_context`` → element dropout (p = element_dropout, kept entries scaled by
        1/(1 − p)) → each sample replaced by ``c_e`` with probability ``empty_context_prob``. Random numbers come
        from ``generator`` (on its device) when given."""
        c = self.encode_context(id_embeddings)  # (B, T, D)
        b = c.shape[0]
        gdev = generator.device if generator is not None else c.device
        p = self.config.element_dropout
        if p > 0.0:
            keep = torch.rand(c.shape, generator=generator, device=gdev).to(c.device) >= p
            c = c * keep.to(c.dtype) / (1.0 - p)
        u = torch.rand(b, generator=generator, device=gdev).to(c.device)
        replace = (u < self.config.empty_context_prob).view(b, 1, 1)  # (B, 1, 1)
        return torch.where(replace, self.empty(b).to(c.dtype), c)

    def empty(self, batch_size: int) -> torch.Tensor:
        """``c_e`` expanded to (batch_size, tokens, context_dim) (a view; gradients reach the parameter)."""
        return self.empty_context.expand(batch_size, -1, -1)

    def to_unet(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) images or latents → (B, C·p², S/p, S/p), the UNet's own layout (identity for p = 1)."""
        p = self.config.patch_size
        return x if p == 1 else F.pixel_unshuffle(x, p)

    def from_unet(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of ``to_unet``: a sample in the UNet's layout → (B, C, S, S)."""
        p = self.config.patch_size
        return x if p == 1 else F.pixel_shuffle(x, p)

    def sample_shape(self, batch: int) -> tuple[int, int, int, int]:
        """The shape a sampler draws x_T in for ``batch`` samples: the UNet's layout."""
        channels, side = self.config.unet_shape
        return batch, channels, side, side

    def forward(self, x_t: torch.Tensor, timesteps: torch.Tensor | int, context: torch.Tensor) -> torch.Tensor:
        """ε prediction for noisy inputs ``x_t`` in the UNet's layout (``to_unet``: (B, C·p², S/p, S/p)) at
        ``timesteps`` (B,) or a scalar; the context (B, tokens, context_dim) is read by cross-attention and, with
        ``time_context``, flattened into the time embedding too. DDPM acts element-wise, so diffusing patches is
        diffusing pixels."""
        labels = context.flatten(1) if self.config.time_context else None
        return self.unet(x_t, timesteps, encoder_hidden_states=context, class_labels=labels).sample


# ---------------------------------------------------------------------------------------------- autoencoders
def autoencoder_kind(autoencoder: nn.Module) -> str:
    """"vq", "kl" or "tiny" for a diffusers VQModel / AutoencoderKL / AutoencoderTiny; ConfigError otherwise."""
    for kind, cls in AUTOENCODERS.items():
        if isinstance(autoencoder, cls):
            return kind
    raise ConfigError(
        "the autoencoder must be a diffusers VQModel, AutoencoderKL or AutoencoderTiny, "
        f"got {type(autoencoder).__name__}"
    )


def autoencoder_factor(autoencoder: nn.Module) -> int:
    """The encoder's downsampling: 2 per level but one (KL/VQ: the last block does not downsample; tiny: the first
    level's convolution has stride 1, every later one stride 2)."""
    cfg = autoencoder.config
    levels = cfg.encoder_block_out_channels if autoencoder_kind(autoencoder) == "tiny" else cfg.block_out_channels
    return 2 ** (len(levels) - 1)


def load_autoencoder(path: str | os.PathLike, kind: str = "vq") -> VQModel | AutoencoderKL | AutoencoderTiny:
    """A frozen diffusers ``VQModel`` (kind "vq"), ``AutoencoderKL`` ("kl") or ``AutoencoderTiny`` ("tiny") from a
    local ``save_pretrained`` directory, in eval mode. Never downloads: a missing directory or files raise
    ConfigError."""
    if kind not in AUTOENCODERS:
        raise ConfigError(f"autoencoder kind {kind!r} is not one of {sorted(AUTOENCODERS)}")
    cls = AUTOENCODERS[kind]
    path = Path(path)
    what = (
        f"a diffusers {cls.__name__} saved with save_pretrained (config.json + diffusion_pytorch_model.safetensors)"
    )
    if not path.is_dir():
        raise ConfigError(f"autoencoder directory {path} does not exist; put {what} there, or train in pixel space")
    if not (path / "config.json").is_file():
        raise ConfigError(f"autoencoder directory {path} has no config.json; it must hold {what}")
    try:
        model = cls.from_pretrained(str(path), local_files_only=True, low_cpu_mem_usage=False)  # no accelerate here
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot load {cls.__name__} from {path}: {exc}; it must hold {what}") from exc
    model.requires_grad_(False)
    log.info("loaded %s autoencoder from %s", cls.__name__, path)
    return model.eval()


def latent_shape(autoencoder: nn.Module, image_size: int) -> tuple[int, int]:
    """(channels, side) of the latent the autoencoder makes from ``image_size``² images."""
    kind = autoencoder_kind(autoencoder)
    cfg = autoencoder.config
    channels = cfg.latent_channels
    if kind == "vq" and getattr(cfg, "vq_embed_dim", None):
        channels = cfg.vq_embed_dim  # quant_conv maps latent_channels → vq_embed_dim
    factor = autoencoder_factor(autoencoder)
    if image_size % factor:
        raise ConfigError(
            f"{image_size}×{image_size} images are not a multiple of the autoencoder's downsampling factor {factor}"
        )
    return int(channels), image_size // factor


def check_latent_shape(autoencoder: nn.Module, image_size: int, model_cfg: GeneratorModelConfig) -> tuple[int, int]:
    """The latent (channels, side) of ``image_size``² images; ConfigError naming both shapes when the UNet was
    configured for another (``in_channels``, ``image_size``)."""
    channels, side = latent_shape(autoencoder, image_size)
    if (channels, side) != (model_cfg.in_channels, model_cfg.image_size):
        raise ConfigError(
            f"the {type(autoencoder).__name__} turns {image_size}×{image_size} images into latents of "
            f"{channels}×{side}×{side}, but the UNet takes {model_cfg.in_channels}×{model_cfg.image_size}×"
            f"{model_cfg.image_size} (generator.model.in_channels / image_size); set those to {channels} and {side}"
        )
    return channels, side


@torch.no_grad()
def encode_images(autoencoder: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [−1, 1] → latents: the quantised VQ latent, or the KL posterior mean or the tiny
    encoder's (deterministic) latent, minus ``shift_factor`` if set, × ``scaling_factor``."""
    kind = autoencoder_kind(autoencoder)
    if kind == "vq":
        h = autoencoder.encode(images).latents
        quant, _, _ = autoencoder.quantize(h)
        return quant
    mean = autoencoder.encode(images).latents if kind == "tiny" else autoencoder.encode(images).latent_dist.mean
    shift = getattr(autoencoder.config, "shift_factor", None) or 0.0
    return (mean - shift) * autoencoder.config.scaling_factor


@torch.no_grad()
def decode_latents(autoencoder: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Latents from ``encode_images`` (or a sampler) → images (B, 3, H, W), nominally in [−1, 1]."""
    if autoencoder_kind(autoencoder) == "vq":
        return autoencoder.decode(latents).sample  # re-quantises: a sampled latent snaps to the codebook
    shift = getattr(autoencoder.config, "shift_factor", None) or 0.0
    return autoencoder.decode(latents / autoencoder.config.scaling_factor + shift).sample


# ---------------------------------------------------------------------------------------------- save / load
def save_generator(
    model_dir: str | os.PathLike,
    model: IDConditionedUNet,
    config: GeneratorModelConfig | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (pass the EMA weights) and its config to ``model_dir`` atomically; return it."""
    if not isinstance(model, IDConditionedUNet):
        raise ConfigError(f"save_generator needs an IDConditionedUNet, got {type(model).__name__}")
    config = config if config is not None else model.config
    if config != model.config:
        raise ConfigError(f"save_generator: config {config} is not the model's own {model.config}")
    payload = {
        "format": FORMAT,
        "model": ARCHITECTURE,
        "architecture": ARCHITECTURE,
        "kwargs": config.to_dict(),
        "extra": dict(extra or {}),
    }
    return write_model_dir(model_dir, model, payload, what="UIFace generator")


def load_generator(model_dir: str | os.PathLike) -> tuple[IDConditionedUNet, GeneratorModelConfig]:
    """Rebuild the generator saved by ``save_generator``; returned in eval mode with its config.
    ``read_model_config(model_dir, what=...)["extra"]`` holds what the trainer stored (schedule, space)."""
    raw = read_model_config(model_dir, what="UIFace generator")
    config_path = Path(model_dir) / CONFIG
    if raw.get("model") != ARCHITECTURE or not isinstance(raw.get("kwargs"), dict):
        raise DataError(
            f"{config_path} is not a UIFace generator config (needs \"model\": \"{ARCHITECTURE}\" and kwargs); "
            "re-save it with save_generator"
        )
    try:
        config = GeneratorModelConfig(**raw["kwargs"])
    except (ConfigError, TypeError) as exc:
        raise DataError(f"{config_path}: cannot build the generator from its kwargs {raw['kwargs']}: {exc}") from exc
    model = IDConditionedUNet(config)
    return load_weights_into(model, model_dir, what=f"IDConditionedUNet({raw['kwargs']})"), config
