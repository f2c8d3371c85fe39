"""UIFace generator training: ε-prediction DDPM on (face image, FR embedding) pairs, fitted with Lightning.

``train_generator(cfg, images, id_embeddings)`` minimises (paper Eq. 1, 3), ᾱ_t from diffusers' ``DDPMScheduler``::

    x_t = √ᾱ_t · x_0 + √(1 − ᾱ_t) · ε,   t ~ U{0, …, T−1},  ε ~ N(0, I);    L = mean ‖ε − ε_θ(x_t, t, c'')‖²

(ε-prediction, the paper's; ``prediction_type`` ``v_prediction`` regresses v = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0 instead, and
``edm`` regresses the F of EDM's preconditioned denoiser x̂_0 = c_skip·x_t/√ᾱ_t + c_out·F (Karras et al. 2022; c_skip
→ 1 at low noise, so the UNet need not learn the identity there); ``loss_weighting: min_snr`` weights each timestep by
min(SNR_t, γ)/SNR_t (Hang et al. 2023)). x_0 is in the UNet's layout (``IDConditionedUNet.to_unet``: p×p patches).
c'' is ``IDConditionedUNet.training_context``; x_0 the image in [−1, 1] or its latent under a frozen ``VQModel`` /
``AutoencoderKL``, encoded once. EMA after every step with ``d = min(ema_decay, (1 + n)/(10 + n))`` (LDM's warm-up);
the EMA network is returned, saved and sampled. Exact resume: batch order from (seed, epoch), a step's random draws
from (seed, global step), state in ``last.ckpt`` after every epoch.

Differences from the reference (appendix A.1 / IDiff-Face):
- Reference: Adam 1e-4, batch 64 × 8 GPUs, 250k iterations, cosine LR, VQ-f4 latent; here AdamW (weight decay 0 =
  Adam), a constant LR by default (``lr_schedule: cosine`` for the reference's), one device.
- Latents are computed once (frozen autoencoder; VQ quantiser or KL mean), the KL posterior is not sampled.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
from diffusers import DDPMScheduler
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ml.data.records import worker_kwargs
from ml.errors import ConfigError, DataError
from ml.generator.sampler import PREDICTION_TYPES, edm_coefficients
from ml.generator.uiface import (
    GeneratorModelConfig,
    IDConditionedUNet,
    autoencoder_factor,
    autoencoder_kind,
    check_latent_shape,
    encode_images,
    save_generator,
)
from ml.train.callbacks import EpochHistory, fit, non_finite_loss
from ml.train.device import check_device, check_device_keys
from ml.train.checkpoint import check_resume, mix_seed, resume_path
from ml.train.schedules import adamw, lambda_schedule, warmup_cosine
from ml.fr.train import EpochSampler

__all__ = [
    "GeneratorConfig",
    "GeneratorModule",
    "GeneratorResult",
    "ema_decay_at",
    "images_to_unit_range",
    "make_noise_scheduler",
    "train_generator",
]

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_generator"  # run description stored in every checkpoint, checked before resuming
LR_SCHEDULES = ("constant", "cosine")
LOSS_WEIGHTINGS = ("uniform", "min_snr")
TIMESTEP_SAMPLINGS = ("uniform", "log_normal")
BETA_SCHEDULES = ("linear", "scaled_linear")
ENCODE_BATCH = 64  # images per autoencoder call when precomputing latents


@dataclass(frozen=True)
class GeneratorConfig:
    """``generator`` section of params.yaml."""

    model: GeneratorModelConfig = field(default_factory=GeneratorModelConfig)
    num_train_timesteps: int = 1000  # T
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_schedule: str = "linear"  # | "scaled_linear" (Stable Diffusion's)
    lr: float = 2e-4
    weight_decay: float = 0.0  # AdamW; 0 = Adam, as the reference
    lr_schedule: str = "constant"  # | "cosine": annealed to 0 over the run (the reference's)
    batch_size: int = 32
    epochs: int = 20
    ema_decay: float = 0.999
    prediction_type: str = "epsilon"  # | "v_prediction" (v = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0) | "edm" (F of D = c_skip·x + c_out·F)
    loss_weighting: str = "uniform"  # | "min_snr": each timestep's ε loss × min(SNR_t, γ)/SNR_t (Hang et al. 2023)
    min_snr_gamma: float = 5.0  # γ of min_snr
    timestep_sampling: str = "uniform"  # t ~ U{0..T-1} | "log_normal": σ_t near EDM's ln σ ~ N(p_mean, p_std²)
    p_mean: float = -1.2  # log_normal: EDM's P_mean …
    p_std: float = 1.2  # … and P_std (Karras et al. 2022, Table 1)
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    seed: int = 0
    num_workers: int = 0
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed" | "auto" (bf16-mixed where native)
    accelerator: str = "auto"  # | "cpu" | "gpu"
    devices: int = 1  # one device: the embedded UNet fits one GPU
    max_steps: int = -1  # -1 = no limit (for smoke runs)

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):  # built by hand from a mapping; params.yaml goes through from_mapping
            object.__setattr__(self, "model", GeneratorModelConfig(**self.model))
        checks = {
            "num_train_timesteps": (self.num_train_timesteps >= 2, "≥ 2"),
            "beta_start": (0.0 < self.beta_start < self.beta_end, "in (0, beta_end)"),
            "beta_end": (self.beta_start < self.beta_end < 1.0, "in (beta_start, 1)"),
            "lr": (self.lr > 0, "> 0"),
            "weight_decay": (self.weight_decay >= 0, "≥ 0"),
            "batch_size": (self.batch_size >= 1, "≥ 1"),
            "epochs": (self.epochs >= 1, "≥ 1"),
            "ema_decay": (0.0 <= self.ema_decay < 1.0, "in [0, 1)"),
            "min_snr_gamma": (self.min_snr_gamma > 0, "> 0"),
            "p_std": (self.p_std > 0, "> 0"),
            "grad_clip": (self.grad_clip >= 0, "≥ 0 (0 = off)"),
            "num_workers": (self.num_workers >= 0, "≥ 0"),
            "max_steps": (self.max_steps == -1 or self.max_steps >= 1, "-1 or ≥ 1"),
        }
        for key, (ok, need) in checks.items():
            if not ok:
                raise ConfigError(f"generator.{key} = {getattr(self, key)!r} is out of range; it must be {need}")
        if self.prediction_type == "edm" and self.loss_weighting != "uniform":
            raise ConfigError(f"generator.loss_weighting = {self.loss_weighting!r} with prediction_type 'edm': EDM's "
                              "preconditioning already weights the timesteps (unit weight on F); set it to 'uniform'")
        check_device_keys("generator", self.accelerator, self.devices, self.precision)
        choices = {"lr_schedule": LR_SCHEDULES, "beta_schedule": BETA_SCHEDULES, "loss_weighting": LOSS_WEIGHTINGS,
                   "prediction_type": PREDICTION_TYPES, "timestep_sampling": TIMESTEP_SAMPLINGS}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"generator.{key} {getattr(self, key)!r} is not one of {list(valid)}")

    def noise_schedule(self) -> dict[str, Any]:
        """``DDPMScheduler`` keyword arguments of the forward process (saved with the model for samplers)."""
        return {
            "num_train_timesteps": self.num_train_timesteps,
            "beta_start": self.beta_start,
            "beta_end": self.beta_end,
            "beta_schedule": self.beta_schedule,
            "prediction_type": self.prediction_type,
        }


def make_noise_scheduler(schedule: dict[str, Any]) -> DDPMScheduler:
    """The diffusers ``DDPMScheduler`` of ``GeneratorConfig.noise_schedule()`` (or a saved model's extra); an
    ``edm`` model's forward process is the same VP one (diffusers knows no such prediction type: it is kept as ε,
    which only ``step`` would read)."""
    kwargs = dict(schedule)
    if kwargs.get("prediction_type") == "edm":
        kwargs["prediction_type"] = "epsilon"
    return DDPMScheduler(**kwargs)


def ema_decay_at(updates: int, ema_decay: float) -> float:
    """EMA decay of update number ``updates`` (0-based): ``min(ema_decay, (1 + n)/(10 + n))``.

    diffusers' ``EMAModel`` (``use_ema_warmup=False``) agrees from update 1 on but cannot give update 0 its 1/10:
    its first decay is 0 (a plain copy), or 2/11 with ``update_after_step=-1``. It is no ``nn.Module`` either, so
    Lightning would neither move nor checkpoint it; hence this schedule and the ``self.ema`` copy of the UNet."""
    return min(ema_decay, (1.0 + updates) / (10.0 + updates))


def images_to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) → float32 in [−1, 1]: ``x/127.5 − 1``."""
    return images.float() / 127.5 - 1.0


class GeneratorModule(lightning.LightningModule):
    """The denoiser, its EMA copy and the DDPM forward process; ``pixel`` batches are uint8 images, otherwise
    precomputed latents."""

    def __init__(self, model: IDConditionedUNet, cfg: GeneratorConfig, steps_per_epoch: int, pixel: bool,
                 channels_last: bool = True) -> None:
        super().__init__()
        # channels_last: the UNet's convolutions run faster per step on the CPU (oneDNN) and on tensor cores
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = model.to(memory_format=self.memory_format)
        self.ema = copy.deepcopy(model).requires_grad_(False)
        self.cfg = cfg
        self.steps_per_epoch = steps_per_epoch
        self.pixel = pixel
        self.noise_scheduler = make_noise_scheduler(cfg.noise_schedule())
        self._generator: torch.Generator | None = None  # made on first use, on the training device

    def forward(self, x_t: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.model(x_t, timesteps, context)

    def _step_generator(self) -> torch.Generator:
        if self._generator is None or self._generator.device != self.device:
            self._generator = torch.Generator(device=self.device)
        return self._generator.manual_seed(mix_seed(self.cfg.seed, self.global_step))

    def loss_weights(self, t: torch.Tensor) -> torch.Tensor:
        """(B,) per-sample weights of the ε loss: 1, or min-SNR-γ's ``min(SNR_t, γ) / SNR_t`` with
        ``SNR_t = ᾱ_t / (1 − ᾱ_t)``: the nearly clean timesteps, whose ε targets are noise the model cannot see,
        stop dominating the gradient."""
        if self.cfg.loss_weighting == "uniform":
            return torch.ones(t.shape, device=t.device)
        abar = self.noise_scheduler.alphas_cumprod.to(t.device)[t].float()
        snr = abar / (1.0 - abar)
        # a v target's loss is the ε loss × (SNR + 1): the same weight on x_0's error is min(SNR, γ)/(SNR + 1)
        return snr.clamp(max=self.cfg.min_snr_gamma) / (snr + 1.0 if self.cfg.prediction_type == "v_prediction"
                                                         else snr)

    def draw_timesteps(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) training timesteps: uniform over 0..T-1, or (``log_normal``) the timestep whose noise level
        σ_t = √((1 − ᾱ_t)/ᾱ_t) is nearest above a draw of ln σ ~ N(p_mean, p_std²), EDM's training distribution.
        A linear β schedule spends most uniform draws at σ > 1, where a face's layout forms; EDM's puts half below
        σ = 0.3, where its detail does."""
        if self.cfg.timestep_sampling == "uniform":
            return torch.randint(0, self.cfg.num_train_timesteps, (n,), generator=generator, device=generator.device)
        abar = self.noise_scheduler.alphas_cumprod.double()
        sigmas = ((1.0 - abar) / abar).sqrt()  # increasing in t
        draws = torch.randn(n, generator=generator, device=generator.device).double().cpu()
        t = torch.searchsorted(sigmas, (self.cfg.p_mean + self.cfg.p_std * draws).exp())
        return t.clamp(max=self.cfg.num_train_timesteps - 1).to(generator.device)

    def diffusion_loss(self, x0: torch.Tensor, ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Mean w_t·‖ε − ε_θ(x_t, t, c'')‖² of one batch (x0 in the UNet's layout; w_t from ``loss_weights``);
        every random draw from ``generator``."""
        b = x0.shape[0]
        noise = torch.randn(x0.shape, generator=generator, device=generator.device).to(x0.device)
        t = self.draw_timesteps(b, generator).to(x0.device)
        context = self.model.training_context(ids, generator=generator)  # (B, tokens, context_dim)
        x_t = self.noise_scheduler.add_noise(x0, noise, t).contiguous(memory_format=self.memory_format)
        out = self.model(x_t, t, context)
        kind = self.cfg.prediction_type
        if kind == "epsilon":
            target = noise
        elif kind == "v_prediction":
            target = self.noise_scheduler.get_velocity(x0, noise, t)
        else:  # F's target (x_0 − c_skip·x_t/√ᾱ)/c_out: EDM's loss weight 1/c_out² on D, unit weight on F
            abar = self.noise_scheduler.alphas_cumprod.to(x0.device)[t].double().view(-1, 1, 1, 1)
            c_skip, c_out = edm_coefficients(abar)
            target = ((x0.double() - c_skip * x_t.double() / abar.sqrt()) / c_out).float()
        per_sample = (out.float() - target.float()).pow(2).flatten(1).mean(dim=1)
        return (per_sample * self.loss_weights(t)).mean()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        data, ids = batch  # uint8 (B, 3, H, W) images or float (B, C, h, w) latents; float (B, id_dim)
        x0 = self.model.to_unet(images_to_unit_range(data) if self.pixel else data.float())
        loss = self.diffusion_loss(x0, ids, self._step_generator())
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="train/loss", entry="train_generator",
                                  advice="Lower generator.lr, set generator.grad_clip > 0 or use generator.precision "
                                         "'32-true'.")
        b = data.shape[0]
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False, batch_size=b)
        return loss

    @torch.no_grad()
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step already counts this update: it is update number global_step − 1 (0-based)
        d = ema_decay_at(self.global_step - 1, self.cfg.ema_decay)
        ema_state = self.ema.state_dict()
        floats, others = [], []
        for name, value in self.model.state_dict().items():
            target = ema_state[name]
            (floats if target.is_floating_point() else others).append((target, value.detach()))
        # θ_ema + (1 − d)(θ − θ_ema) = d·θ_ema + (1 − d)·θ, as one foreach kernel over every tensor
        torch._foreach_lerp_([t for t, _ in floats], [v.to(t.dtype) for t, v in floats], 1.0 - d)
        for target, value in others:
            target.copy_(value)

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            # no weight decay on norms, biases and the empty context (a token, not a weight matrix)
            (decay if p.ndim >= 2 and name != "empty_context" else no_decay).append(p)
        optimizer = adamw(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            self, lr=self.cfg.lr,
        )
        if self.cfg.lr_schedule == "constant":
            return optimizer
        total = self.cfg.epochs * self.steps_per_epoch
        if self.cfg.max_steps > 0:
            total = min(total, self.cfg.max_steps)
        return lambda_schedule(optimizer, partial(warmup_cosine, warmup_steps=0, total_steps=total))


@dataclass
class GeneratorResult:
    model: IDConditionedUNet  # EMA weights, eval mode: use this for sampling and saving
    raw_model: IDConditionedUNet  # the optimised (non-EMA) weights
    history: list[dict]  # per-epoch {"epoch", "train/loss"}, resumed epochs included
    seconds: float
    config: GeneratorConfig
    space: str  # "pixel" | "vq" | "kl"
    image_size: int  # side of the training images (pixels)
    checkpoint: Path | None = None  # last.ckpt when train_generator() was given a checkpoint_dir

    def extra(self) -> dict[str, Any]:
        """What a sampler needs besides the weights: noise schedule, space, image size."""
        return {
            "noise_schedule": self.config.noise_schedule(),
            "space": self.space,
            "image_size": self.image_size,
            "epochs_trained": len(self.history),
            "ema_decay": self.config.ema_decay,
        }

    def save(self, model_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """``save_generator`` of the EMA model with ``self.extra()`` (plus ``extra``) in its config.json."""
        return save_generator(model_dir, self.model, self.model.config, {**self.extra(), **(extra or {})})


def _check_inputs(images: np.ndarray, id_embeddings: np.ndarray, id_dim: int) -> np.ndarray:
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"images must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    n, h, w = images.shape[:3]
    if h != w:
        raise DataError(f"images must be square, got {h}×{w}; align/resize them first")
    if n < 1:
        raise DataError("train_generator needs at least 1 image, got 0")
    ids = np.asarray(id_embeddings)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.floating):
        raise DataError(f"id_embeddings must be a float array (N, {id_dim}), got {ids.dtype} {ids.shape}")
    if ids.shape[0] != n:
        raise DataError(
            f"{n} images but {ids.shape[0]} id_embeddings; there must be one FR embedding per image, in the same order"
        )
    if ids.shape[1] != id_dim:
        raise DataError(
            f"id_embeddings have {ids.shape[1]} dimensions but generator.model.id_dim is {id_dim}; embed the images "
            "with the FR model the generator is configured for, or change id_dim"
        )
    norms = np.linalg.norm(ids.astype(np.float64), axis=1)
    bad = np.flatnonzero(~np.isfinite(norms) | (norms == 0))
    if bad.size:
        raise DataError(
            f"id_embeddings row {int(bad[0])} is not finite or zero ({bad.size} of {n} rows, e.g. "
            f"{bad[:5].tolist()}); it cannot be L2-normalised — drop those images or re-embed them"
        )
    return ids.astype(np.float32)


def _training_data(
    cfg: GeneratorConfig, images: np.ndarray, autoencoder: nn.Module | None
) -> tuple[torch.Tensor, str]:
    """(uint8 images (N, 3, H, W) or float latents (N, C, h, w), space) after checking the sizes."""
    size = images.shape[1]
    m = cfg.model
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()  # uint8 (N, 3, H, W)
    if autoencoder is None:
        if m.in_channels != 3:
            raise ConfigError(
                f"generator.model.in_channels = {m.in_channels} but training runs in pixel space (RGB, 3 channels); "
                "set it to 3 or pass the autoencoder whose latent has that many channels"
            )
        if size != m.image_size:
            smaller = " — smaller than the UNet needs" if size < m.image_size else ""
            raise DataError(
                f"images are {size}×{size}{smaller}; the pixel-space UNet expects {m.image_size}×{m.image_size} "
                "(generator.model.image_size); resize the data or change image_size"
            )
        return x, "pixel"
    kind = autoencoder_kind(autoencoder)
    factor = autoencoder_factor(autoencoder)
    expected = m.image_size * factor
    if size != expected:
        smaller = " — smaller than the UNet needs" if size < expected else ""
        raise DataError(
            f"images are {size}×{size}{smaller}; the {type(autoencoder).__name__} (downsampling ×{factor}) must "
            f"turn them into the UNet's {m.image_size}×{m.image_size} latent, so it expects {expected}×{expected} "
            f"images; resize the data or change generator.model.image_size"
        )
    check_latent_shape(autoencoder, size, m)
    device = next(autoencoder.parameters()).device
    dtype = next(autoencoder.parameters()).dtype
    chunks = []
    for i in range(0, x.shape[0], ENCODE_BATCH):
        batch = images_to_unit_range(x[i : i + ENCODE_BATCH]).to(device=device, dtype=dtype)
        chunks.append(encode_images(autoencoder, batch).float().cpu())
    latents = torch.cat(chunks)
    assert tuple(latents.shape[1:]) == (m.in_channels, m.image_size, m.image_size), latents.shape
    log.info("encoded %d images into %s latents %s", x.shape[0], kind, tuple(latents.shape[1:]))
    return latents, kind


def train_generator(
    cfg: GeneratorConfig,
    images: np.ndarray,
    id_embeddings: np.ndarray,
    *,
    autoencoder: nn.Module | None = None,
    checkpoint_dir: Path | str | None = None,
    resume: bool = False,
    loggers: Any = None,
    callbacks: Sequence[Callback] | None = None,
    progress: bool = True,
) -> GeneratorResult:
    """Fit UIFace's ID-conditioned UNet on uint8 RGB ``images`` (N, H, W, 3) and their FR ``id_embeddings``
    (N, id_dim), in pixel space or in the latent space of a frozen ``autoencoder`` (diffusers VQModel /
    AutoencoderKL, used on its own device to encode the images once).

    With ``checkpoint_dir`` a ``last.ckpt`` is written there after every epoch (an existing one is an error
    unless ``resume``); ``resume=True`` continues from it and ends with the weights of an uninterrupted run.
    A NaN/inf loss stops training with a ``TrainingError`` naming the global step and the last good checkpoint.
    """
    start = time.perf_counter()
    ids = _check_inputs(images, id_embeddings, cfg.model.id_dim)
    check_device("generator", cfg.accelerator, cfg.precision)
    data, space = _training_data(cfg, images, autoencoder)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_generator")
    n, size = images.shape[0], images.shape[1]
    info = {
        "model": cfg.model.to_dict(),
        "space": space,
        "data": [n, size],
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"},
    }
    if ckpt_path is not None:
        check_resume(ckpt_path, CHECKPOINT_KEY, "generator.train", info, data_keys=("data",))

    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    model = IDConditionedUNet(cfg.model)
    batch_size = min(cfg.batch_size, n)
    steps_per_epoch = math.ceil(n / batch_size)
    loader = DataLoader(
        TensorDataset(data, torch.from_numpy(ids)),
        batch_size=batch_size,
        sampler=EpochSampler(n, cfg.seed),
        drop_last=False,
        **worker_kwargs(cfg.num_workers, persistent=True),
    )
    module = GeneratorModule(model, cfg, steps_per_epoch, pixel=space == "pixel")
    log.info(
        "training UIFace generator (%s space, UNet %d×%d×%d) on %d images: %d steps/epoch × %d epochs%s",
        space, cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size, n, steps_per_epoch, cfg.epochs,
        f", resuming {ckpt_path}" if ckpt_path else "",
    )
    fitted = fit(
        module, loader, section="generator", epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
        history=EpochHistory(("train/loss",)), accelerator=cfg.accelerator, devices=cfg.devices,
        precision=cfg.precision, max_steps=cfg.max_steps, grad_clip=cfg.grad_clip, run_info=(CHECKPOINT_KEY, info),
        checkpoint_dir=checkpoint_dir, last_checkpoint=LAST_CHECKPOINT, ckpt_path=ckpt_path,
        callbacks=callbacks or (), loggers=loggers, progress=progress,
    )
    seconds = time.perf_counter() - start
    if fitted.history:
        log.info("done in %.1f s; last epoch %s", seconds, fitted.history[-1])
    plain = torch.contiguous_format  # the module trains in channels_last; the returned models are plain
    return GeneratorResult(
        model=module.ema.to(memory_format=plain).eval(),
        raw_model=module.model.to(memory_format=plain).eval(),
        history=fitted.history,
        seconds=seconds,
        config=cfg,
        space=space,
        image_size=size,
        checkpoint=fitted.checkpoint,
    )
