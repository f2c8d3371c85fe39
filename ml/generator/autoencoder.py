"""The latent space of UIFace at embedded size: a small diffusers autoencoder trained on the training faces.

UIFace denoises the latent of a pre-trained autoencoder; none can be downloaded here, so ``train_autoencoder(cfg,
images, id_embeddings, fr_model)`` fits one with Lightning on the generator's faces. ``architecture`` is a diffusers
``AutoencoderTiny`` ("tiny": TAESD's plain convolutions and ReLUs, a deterministic latent z = Enc(x)) or an
``AutoencoderKL`` ("kl": LDM's ResNet blocks, mid-block attention, a posterior), whose closing GroupNorm removes each
face's mean per channel group, so global colour must be rebuilt from patterns; the tiny decoder has no norm. Per batch::

    z ~ q(z | x) = N(μ(x), σ²(x)) (kl) or z = Enc(x) (tiny),   x̂ = Dec(z)
    L = |x̂ − x|₁ + ‖x̂ − x‖² + kl_weight · KL(q(z | x) ‖ N(0, I)) / dim(z) + fr_weight · (1 − cos(F(x̂), f))

x in [−1, 1], means over elements; F the frozen FR model, f the face's unit FR embedding, on the first ``fr_batch``
faces: the term keeps identity, which a pixel loss at this size blurs first; the KL term is kl's only. Then
``scaling_factor`` is set to 1/std of the latents (kl: the posterior means). Exact resume as in ``ml.generator.train``.

Differences from the reference: LDM's VQ-f4 (3×32×32 latents of 128-px faces) was trained with perceptual and
adversarial losses on large face sets; here a small autoencoder (8×8 latents of 32-px faces at the embedded
default) trains on the CPU with pixel and FR-embedding losses only (no perceptual network weights offline).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderTiny
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ml.errors import ConfigError, DataError
from ml.train.callbacks import EpochHistory, fit, non_finite_loss
from ml.train.device import check_device, check_device_keys
from ml.train.checkpoint import check_resume, mix_seed, resume_path
from ml.fr.train import EpochSampler
from ml.fr.data import check_keypoints, needs_keypoints
from ml.generator.train import images_to_unit_range
from ml.generator.uiface import decode_latents, encode_images
from ml.train.schedules import adamw

__all__ = ["AutoencoderConfig", "AutoencoderModule", "build_autoencoder", "reconstruct", "train_autoencoder"]

log = logging.getLogger(__name__)

ARCHITECTURES = ("kl", "tiny")
LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_autoencoder"
ENCODE_BATCH = 128


@dataclass(frozen=True)
class AutoencoderConfig:
    """``generator.autoencoder_train`` section of params.yaml."""

    architecture: str = "kl"  # kl (diffusers AutoencoderKL) | tiny (AutoencoderTiny: no normalisation)
    block_out_channels: tuple[int, ...] = (8, 16, 64)  # encoder levels (tiny: all equal); latent side: image / 2^(L−1)
    layers_per_block: int = 1  # ResNet blocks (kl) or TAESD blocks (tiny; the first level has one) per level
    latent_channels: int = 4
    norm_num_groups: int = 8
    kl_weight: float = 1e-4
    fr_weight: float = 0.2  # identity term; 0 = pixel losses only (no FR model needed)
    fr_batch: int = 8  # faces per batch the FR term is computed on (its backward costs as much as the decoder's)
    lr: float = 1e-3
    batch_size: int = 32
    epochs: int = 4
    seed: int = 0
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed" | "auto" (bf16-mixed where native)
    accelerator: str = "auto"
    devices: int = 1
    max_steps: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        checks = {
            "block_out_channels": (len(self.block_out_channels) >= 1 and min(self.block_out_channels) >= 1
                                   and (self.architecture != "tiny" or len(set(self.block_out_channels)) == 1),
                                   "one positive channel count per level, e.g. [8, 16, 64]; with architecture tiny "
                                   "one for all (TAESD's stride-2 convolutions keep the width), e.g. [48, 48, 48]"),
            "layers_per_block": (self.layers_per_block >= 1, "≥ 1"),
            "latent_channels": (self.latent_channels >= 1, "≥ 1"),
            "architecture": (self.architecture in ARCHITECTURES, f"one of {list(ARCHITECTURES)}"),
            "norm_num_groups": (self.norm_num_groups >= 1 and (self.architecture != "kl" or all(
                                c % self.norm_num_groups == 0 for c in self.block_out_channels)),
                                "≥ 1 and a divisor of every block_out_channels entry"),
            "kl_weight": (self.kl_weight >= 0, "≥ 0"),
            "fr_weight": (self.fr_weight >= 0, "≥ 0 (0 = no identity term)"),
            "fr_batch": (self.fr_batch >= 1, "≥ 1"),
            "lr": (self.lr > 0, "> 0"),
            "batch_size": (self.batch_size >= 1, "≥ 1"),
            "epochs": (self.epochs >= 1, "≥ 1"),
            "max_steps": (self.max_steps == -1 or self.max_steps >= 1, "-1 or ≥ 1"),
        }
        for key, (ok, need) in checks.items():
            if not ok:
                raise ConfigError(f"generator.autoencoder_train.{key} = {getattr(self, key)!r} is out of range; "
                                  f"it must be {need}")
        check_device_keys("generator.autoencoder_train", self.accelerator, self.devices, self.precision)

    @property
    def factor(self) -> int:
        """Downsampling of the encoder: 2^(levels − 1)."""
        return 2 ** (len(self.block_out_channels) - 1)


def build_autoencoder(cfg: AutoencoderConfig, image_size: int) -> AutoencoderKL | AutoencoderTiny:
    """A fresh diffusers ``AutoencoderKL`` or ``AutoencoderTiny`` (``cfg.architecture``) for RGB ``image_size``²
    faces."""
    if image_size % cfg.factor:
        raise ConfigError(f"{image_size}-px faces are not a multiple of the autoencoder's downsampling "
                          f"{cfg.factor} (generator.autoencoder_train.block_out_channels has "
                          f"{len(cfg.block_out_channels)} levels)")
    levels = len(cfg.block_out_channels)
    if cfg.architecture == "tiny":
        blocks = (1, *[cfg.layers_per_block] * (levels - 1))
        return AutoencoderTiny(
            encoder_block_out_channels=cfg.block_out_channels, decoder_block_out_channels=cfg.block_out_channels,
            num_encoder_blocks=blocks, num_decoder_blocks=blocks[::-1], latent_channels=cfg.latent_channels,
            scaling_factor=1.0,
        )
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=cfg.block_out_channels,
        layers_per_block=cfg.layers_per_block, latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.norm_num_groups, sample_size=image_size, scaling_factor=1.0,
    )


class AutoencoderModule(lightning.LightningModule):
    """The autoencoder and its loss; the FR model is held outside the module's children (frozen, not saved)."""

    def __init__(self, autoencoder: AutoencoderKL | AutoencoderTiny, cfg: AutoencoderConfig,
                 fr_model: nn.Module | None) -> None:
        super().__init__()
        self.autoencoder = autoencoder
        self.cfg = cfg
        self._fr = [fr_model] if fr_model is not None else []  # a list: not a submodule, not in the checkpoint

    def on_fit_start(self) -> None:
        for fr in self._fr:
            fr.to(self.device).eval().requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        images, ids, keypoints = batch  # uint8 (B, 3, H, W), float (B, D) unit embeddings, float (B, 5, 2) pixels
        x = images_to_unit_range(images)
        if self.cfg.architecture == "tiny":  # a deterministic latent: nothing to sample, no KL term
            y, kl = self.autoencoder.decode(self.autoencoder.encode(x).latents).sample, 0.0
        else:
            generator = torch.Generator(device=self.device).manual_seed(mix_seed(self.cfg.seed, self.global_step))
            posterior = self.autoencoder.encode(x).latent_dist
            y = self.autoencoder.decode(posterior.sample(generator=generator)).sample
            kl = posterior.kl().mean() / float(np.prod(posterior.mean.shape[1:]))
        pixel = (y - x).abs().mean() + F.mse_loss(y, x)
        loss = pixel + self.cfg.kl_weight * kl
        b = images.shape[0]
        if self._fr and self.cfg.fr_weight > 0:
            k = min(self.cfg.fr_batch, b)
            fr = self._fr[0]
            faces, kp = y[:k], keypoints[:k]
            size = int(fr.input_contract["size"])
            if faces.shape[-1] != size:  # faces smaller than the FR model's input: seen as the FR model sees them
                kp = kp * (size / faces.shape[-1])
                faces = F.interpolate(faces, size=(size, size), mode="bilinear", align_corners=False)
            feats = fr(faces, kp) if needs_keypoints(fr) else fr(faces)  # KP-RPE takes the landmarks
            cos = (F.normalize(feats.float(), dim=-1) * ids[:k]).sum(-1).mean()
            loss = loss + self.cfg.fr_weight * (1.0 - cos)
            self.log("train/fr_cosine", cos.detach(), on_step=False, on_epoch=True, batch_size=k)
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="train/loss", entry="train_generator",
                                  advice="Lower generator.autoencoder_train.lr or kl_weight.")
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/pixel", pixel.detach(), on_step=False, on_epoch=True, batch_size=b)
        return loss

    def configure_optimizers(self) -> Any:
        return adamw(self.autoencoder.parameters(), self, lr=self.cfg.lr, weight_decay=0.0)


@torch.no_grad()
def reconstruct(autoencoder: nn.Module, images: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 reconstructions (N, H, W, 3) of uint8 ``images``, their latents (N, C, h, w)) through a diffusers
    ``AutoencoderKL`` (the posterior means × ``scaling_factor``: the raw means while it is 1), ``AutoencoderTiny``
    (its latents × ``scaling_factor``) or ``VQModel``."""
    device = next(autoencoder.parameters()).device
    recon, means = [], []
    for i in range(0, len(images), ENCODE_BATCH):
        x = images_to_unit_range(torch.from_numpy(images[i : i + ENCODE_BATCH]).permute(0, 3, 1, 2)).to(device)
        latents = encode_images(autoencoder, x)
        y = decode_latents(autoencoder, latents).clamp(-1, 1)
        recon.append(((y + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy())
        means.append(latents.float().cpu())
    return np.concatenate(recon), torch.cat(means)


def train_autoencoder(
    cfg: AutoencoderConfig,
    images: np.ndarray,
    id_embeddings: np.ndarray | None = None,
    fr_model: nn.Module | None = None,
    landmarks: np.ndarray | None = None,
    *,
    checkpoint_dir: Path | str | None = None,
    resume: bool = False,
    callbacks: Sequence[Callback] | None = None,
    progress: bool = True,
) -> tuple[AutoencoderKL, list[dict], float]:
    """Fit an ``AutoencoderKL`` on uint8 RGB ``images`` (N, H, W, 3); with ``cfg.fr_weight`` > 0, ``fr_model`` and
    the faces' ``id_embeddings`` (N, D) give the identity term (a KP-RPE FR model also needs the faces' pixel
    ``landmarks`` (N, 5, 2), the ones their embeddings were computed with). Returns (the autoencoder in eval mode with its
    ``scaling_factor`` set to 1/std of the latent means, per-epoch history, seconds)."""
    start = time.perf_counter()
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise DataError(f"images must be a uint8 numpy array (N, H, W, 3) RGB, got {getattr(images, 'shape', '')}")
    n, size = images.shape[0], images.shape[1]
    if cfg.fr_weight > 0 and (fr_model is None or id_embeddings is None):
        raise ConfigError("generator.autoencoder_train.fr_weight > 0 needs the FR model and the faces' embeddings; "
                          "pass them, or set fr_weight: 0")
    ids = np.zeros((n, 1), np.float32) if id_embeddings is None else np.asarray(id_embeddings, np.float32)
    if len(ids) != n:
        raise DataError(f"{n} images but {len(ids)} id_embeddings; one embedding per image, in the same order")
    ids = ids / np.linalg.norm(ids, axis=1, keepdims=True).clip(1e-12)
    if cfg.fr_weight > 0 and needs_keypoints(fr_model):
        keypoints = check_keypoints(landmarks, n, type(fr_model).__name__)
    else:
        keypoints = np.zeros((n, 5, 2), np.float32)
    check_device("generator.autoencoder_train", cfg.accelerator, cfg.precision)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_generator")
    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    autoencoder = build_autoencoder(cfg, size)
    batch_size = min(cfg.batch_size, n)
    steps_per_epoch = math.ceil(n / batch_size)
    data = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()
    tensors = TensorDataset(data, torch.from_numpy(ids), torch.from_numpy(np.asarray(keypoints, np.float32)))
    loader = DataLoader(tensors, batch_size=batch_size, sampler=EpochSampler(n, cfg.seed))
    module = AutoencoderModule(autoencoder, cfg, fr_model if cfg.fr_weight > 0 else None)
    info = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
            "data": [n, size]}
    if ckpt_path is not None:
        check_resume(ckpt_path, CHECKPOINT_KEY, "generator.autoencoder_train", info, data_keys=("data",))
    log.info("training the latent autoencoder (%s → %d×%d×%d) on %d faces: %d steps/epoch × %d epochs", size,
             cfg.latent_channels, size // cfg.factor, size // cfg.factor, n, steps_per_epoch, cfg.epochs)
    fitted = fit(
        module, loader, section="generator.autoencoder_train", epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
        history=EpochHistory(("train/loss", "train/pixel", "train/fr_cosine")), accelerator=cfg.accelerator,
        devices=cfg.devices, precision=cfg.precision, max_steps=cfg.max_steps, run_info=(CHECKPOINT_KEY, info),
        checkpoint_dir=checkpoint_dir, last_checkpoint=LAST_CHECKPOINT, ckpt_path=ckpt_path,
        callbacks=callbacks or (), progress=progress,
    )
    autoencoder = module.autoencoder.eval().requires_grad_(False)
    _, means = reconstruct(autoencoder, images[: min(n, 1024)])
    std = float(means.std())
    autoencoder.register_to_config(scaling_factor=1.0 / max(std, 1e-6))
    return autoencoder, fitted.history, time.perf_counter() - start
