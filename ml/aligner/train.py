"""Training the DFA aligner: smooth-L1 on the pooled landmarks (plus a per-anchor term), and a face score.

``train_aligner(cfg, images, landmarks_px)`` resizes uint8 crops to ``cfg.input_size``² once and fits a
``ml.aligner.dfa.DFA`` with AdamW (no decay on norms and biases), per-step warmup + cosine, and the loss
``L + λ_a·L_anchor + λ_p·L_pool`` of ``ml.aligner.losses``: landmarks on the faces, the score losses on faces plus
``round(nonface_fraction · batch_size)`` non-face crops per batch (``render_nonface``, rendered once per run at the
faces' size). Augmentation: ``augment_kprpe`` (flip with landmark swap, scale/shift/rotation, photometric, blur).
Lightning runs it on ``aligner.accelerator`` / ``devices`` / ``precision``; batches and augmentation are functions of
(seed, epoch, step), so a resumed run ends with the uninterrupted run's weights. Recipe: ``docs/methods/aligner.md``.

Differences from the reference: the paper trains 750 epochs at batch 320 on WiderFace crops at 160 px; the embedded
default trains a few epochs on procedural faces at 96 px (``input_size: 160`` restores the size). Smooth L1 (Fast
R-CNN, the paper's reference [56]) for the paper's "smooth L2", ``β`` in crop units (the reference's
``multibox_loss.py`` uses β = 1 on its own coordinates and also trains the pooled box). The reference keeps
RetinaFace's per-anchor losses (landmarks, boxes, anchor cross-entropy with 3:1 hard negatives) beside the pooled
terms, as we do with ``anchor_loss_weight`` (0 = the paper's pooled loss alone) and the score weights; the non-face
crops that train the score (``nonface_fraction: 0`` = none) are ours.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from ml.errors import ConfigError, DataError
from ml.aligner.dfa import DFA, DFAConfig, normalise, to_normalised, to_pixels
from ml.aligner.data import AlignerBatches, check_images, check_landmarks, nonface_crops, prepare_crops
from ml.aligner.evaluate import evaluate_aligner
from ml.aligner.losses import landmark_loss, score_losses
from ml.train.augment import AugmentConfig, augment_kprpe
from ml.train.callbacks import EpochBatches, EpochHistory, OnEpochEnd, fit, non_finite_loss
from ml.train.device import check_device, check_device_keys
from ml.train.checkpoint import check_resume, mix_seed, resume_path
from ml.train.schedules import adamw, lambda_schedule, warmup_cosine

__all__ = ["AlignerConfig", "AlignerModule", "AlignerResult", "LAST_CHECKPOINT", "evaluate_aligner", "train_aligner"]

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_aligner"  # run description in every checkpoint, checked before resuming
_ARCH_KEYS = ("input_size", "width", "fpn_channels", "context", "mixer_dim", "mixer_depth",
              "mixer_token_hidden", "mixer_channel_hidden")


@dataclass(frozen=True)
class AlignerConfig:
    """``aligner`` section of params.yaml."""

    input_size: int = 96  # embedded default for CPU speed; the paper uses 160
    width: float = 0.25  # MobileNetV1 width multiplier
    fpn_channels: int = 64
    context: bool = True  # SSH context modules
    mixer_dim: int = 16
    mixer_depth: int = 3
    mixer_token_hidden: int = 16
    mixer_channel_hidden: int = 32
    epochs: int = 9  # 9 × 114 steps at batch 16 on the embedded 1,600 faces (docs/methods/aligner.md)
    batch_size: int = 16
    lr: float = 2e-2
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    loss_beta: float = 0.01  # smooth-L1 transition in crop units (≈1 px at 96)
    anchor_loss_weight: float = 5.0  # λ of the per-anchor landmark term; 0 = pooled output only (paper)
    anchor_radius: float = 0.0  # that term covers anchors centred in the landmark box grown by this; < 0: all
    grad_clip: float = 5.0  # max gradient norm; 0 = off
    nonface_fraction: float = 0.1  # share of each batch that is non-face crops (score negatives); 0 = score untrained
    score_loss_weight: float = 0.1  # weight of the per-anchor face/background cross-entropy (RetinaFace's)
    pooled_score_loss_weight: float = 0.1  # weight of the BCE on the pooled face score (faces 1, non-faces 0)
    negative_ratio: float = 3.0  # hard negative anchors kept per positive anchor (RetinaFace's 3:1 mining)
    seed: int = 0
    augment: bool = True
    flip_prob: float = 0.5
    scale_jitter: float = 0.1  # content magnification uniform in [1 − j, 1 + j], applied with prob. 0.5
    shift_jitter: float = 0.05  # |shift| ≤ this fraction of the side per axis, prob. 0.5
    rotate_deg: float = 10.0  # |rotation| ≤ this, prob. 0.5
    photometric_prob: float = 0.3  # each of brightness, contrast, saturation (0.7–1.3)
    blur_prob: float = 0.1
    num_threads: int = 0  # torch intra-op threads during training; 0 = leave torch's setting
    accelerator: str = "auto"  # | "cpu" | "gpu" | "cuda" | "mps"
    devices: int = 1  # one device: the model and its data are small
    precision: str = "32-true"  # | "bf16-mixed" | "16-mixed" (GPU only) | "auto" (bf16-mixed where native)

    def __post_init__(self) -> None:
        checks = {
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 2,  # BatchNorm needs 2 samples per batch
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "warmup_epochs": self.warmup_epochs >= 0,
            "loss_beta": self.loss_beta > 0,
            "anchor_loss_weight": self.anchor_loss_weight >= 0,
            "grad_clip": self.grad_clip >= 0,
            "nonface_fraction": 0.0 <= self.nonface_fraction <= 0.5,
            "score_loss_weight": self.score_loss_weight >= 0,
            "pooled_score_loss_weight": self.pooled_score_loss_weight >= 0,
            "negative_ratio": self.negative_ratio > 0,
            "seed": self.seed >= 0,
            "flip_prob": 0.0 <= self.flip_prob <= 1.0,
            "scale_jitter": 0.0 <= self.scale_jitter < 1.0,
            "shift_jitter": 0.0 <= self.shift_jitter <= 0.5,
            "rotate_deg": 0.0 <= self.rotate_deg <= 180.0,
            "photometric_prob": 0.0 <= self.photometric_prob <= 1.0,
            "blur_prob": 0.0 <= self.blur_prob <= 1.0,
            "num_threads": self.num_threads >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"aligner.{key} = {getattr(self, key)!r} is out of range")
        check_device_keys("aligner", self.accelerator, self.devices, self.precision)
        self.model_config()  # architecture keys are checked by DFAConfig, named aligner.<key>

    @property
    def nonfaces_per_batch(self) -> int:
        """Non-face crops in each training batch: ``round(nonface_fraction · batch_size)``."""
        return int(round(self.nonface_fraction * self.batch_size))

    def model_config(self) -> DFAConfig:
        """The DFA architecture these settings build."""
        return DFAConfig(**{k: getattr(self, k) for k in _ARCH_KEYS})

    def augment_config(self) -> AugmentConfig:
        """The ``augment_kprpe`` recipe for these settings (no cutout: it would hide landmarks)."""
        return AugmentConfig(
            flip_prob=self.flip_prob, scale_prob=0.5 if self.scale_jitter > 0 else 0.0,
            scale_range=(1.0 - self.scale_jitter, 1.0 + self.scale_jitter),
            translate_prob=0.5 if self.shift_jitter > 0 else 0.0, max_translate=self.shift_jitter,
            rotate_prob=0.5 if self.rotate_deg > 0 else 0.0, max_rotate_deg=self.rotate_deg, padding_mode="border",
            brightness_prob=self.photometric_prob, contrast_prob=self.photometric_prob,
            saturation_prob=self.photometric_prob, blur_prob=self.blur_prob, cutout_prob=0.0,
        )


@dataclass
class AlignerResult:
    model: DFA  # eval mode
    history: list[dict]  # per epoch: epoch, train/loss, train/nme, and val/* when val data were given
    seconds: float
    checkpoint: Path | None = None  # last.ckpt when a checkpoint_dir was given


class AlignerModule(lightning.LightningModule):
    """The DFA, its losses on batches of ``faces_per_batch`` faces followed by non-face crops, AdamW and the
    per-step warmup + cosine schedule; ``val = (images, landmarks_px)`` adds ``val/*`` to each epoch's row."""

    def __init__(self, model: DFA, cfg: AlignerConfig, steps_per_epoch: int, faces_per_batch: int,
                 val: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        super().__init__()
        self.model, self.cfg, self.val = model, cfg, val
        self.steps_per_epoch, self.faces_per_batch = steps_per_epoch, faces_per_batch
        self.augmentation = cfg.augment_config()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The model's own randomness as a function of the step, for exact resume.
        torch.manual_seed(mix_seed(self.cfg.seed, self.global_step, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, y = batch  # uint8 (B, 3, S, S), normalised landmarks (B, 5, 2): faces first, then non-faces
        cfg, b, size = self.cfg, self.faces_per_batch, self.cfg.input_size
        x = images.float() / 255.0
        if cfg.augment:  # draws from a CPU generator seeded by (seed, global step); float32 under any precision
            gen = torch.Generator().manual_seed(mix_seed(cfg.seed, self.global_step, 0))
            x, kp = augment_kprpe(x, to_pixels(y, size, size), self.augmentation, gen)
            y = to_normalised(kp, size, size)
        x = normalise(x * 255.0).contiguous(memory_format=torch.channels_last)
        out = {k: v.float() for k, v in self.model(x).items()}
        face_out = {k: v[:b] for k, v in out.items()}
        # the losses in float32 outside autocast: CUDA autocast refuses binary_cross_entropy whatever its inputs
        with torch.autocast(self.device.type, enabled=False):
            loss = landmark_loss(face_out, y[:b], self.model.priors, beta=cfg.loss_beta,
                                 anchor_weight=cfg.anchor_loss_weight, anchor_radius=cfg.anchor_radius)
            if len(x) > b:  # non-face crops: the score losses, logged unweighted
                face = torch.arange(len(x), device=x.device) < b
                anchor_ce, pooled_bce = score_losses(out, y, face, self.model.priors, cfg.anchor_radius,
                                                     cfg.negative_ratio)
                loss = loss + cfg.score_loss_weight * anchor_ce + cfg.pooled_score_loss_weight * pooled_bce
                self.log("train/score_loss", (anchor_ce + pooled_bce).detach(), on_step=False, on_epoch=True,
                         batch_size=b)
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="aligner loss", entry="train_aligner",
                                  advice="Lower aligner.lr, set aligner.grad_clip > 0 or check the data.")
        with torch.no_grad():  # inter-pupil NME of the batch's faces in crop units
            yf = y[:b]
            err = (face_out["landmarks"] - yf).norm(dim=-1).mean(dim=1)
            err = err / (yf[:, 0] - yf[:, 1]).norm(dim=-1).clamp_min(1e-6)
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/nme", err.mean(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        return loss

    def epoch_summary(self) -> dict[str, float]:
        """``val/*`` of the validation crops (``EpochHistory`` adds them to the epoch's row)."""
        if self.val is None:
            return {}
        summary = evaluate_aligner(self.model, self.val[0], self.val[1])
        return {f"val/{k}": v for k, v in summary.items() if not k.startswith("nmes")}

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        rest = [p for p in self.model.parameters() if p.ndim <= 1]  # norms and biases: no decay
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        optimizer = adamw(groups, self, lr=self.cfg.lr)
        total = self.steps_per_epoch * self.cfg.epochs
        warmup = min(total, round(self.cfg.warmup_epochs * self.steps_per_epoch))
        return lambda_schedule(optimizer, partial(warmup_cosine, warmup_steps=warmup, total_steps=total))


def train_aligner(
    cfg: AlignerConfig,
    images: np.ndarray,
    landmarks_px: np.ndarray,
    *,
    val: tuple[np.ndarray, np.ndarray] | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    on_epoch_end: Callable[[dict], None] | None = None,
    callbacks: Sequence[Callback] = (),
) -> AlignerResult:
    """Fit a DFA on uint8 RGB face crops ``images`` (N, H, W, 3) with pixel landmarks (N, 5, 2).

    Crops of any size are resized to ``cfg.input_size``² (non-square ones are stretched, as ``predict``
    does). Landmarks must be finite and inside their image (DataError otherwise). ``val = (images,
    landmarks_px)`` adds ``val/nme``, ``val/failure@0.1``, ``val/auc@0.1`` and ``val/face_score_mean`` to each
    epoch's history row; with non-face crops in the batches (``cfg.nonface_fraction > 0``) the row also has
    ``train/score_loss`` (unweighted ``L_anchor + L_pool``).

    With ``checkpoint_dir`` a ``last.ckpt`` (weights, optimiser, schedule, history) is written after every
    epoch; an existing one is an error unless ``resume``, which continues from it after checking the
    architecture and the number of images. ``on_epoch_end(row)`` runs after the checkpoint (e.g. to log
    metrics); ``callbacks`` are extra Lightning callbacks. A NaN/inf loss raises ``TrainingError`` naming the
    step. The model comes back in eval mode on the CPU.
    """
    start = time.perf_counter()
    if not isinstance(cfg, AlignerConfig):
        raise ConfigError(f"train_aligner needs an AlignerConfig, got {type(cfg).__name__}")
    check_images(images, "training images")
    landmarks_px = check_landmarks(landmarks_px, images, "training landmarks")
    n, size = images.shape[0], cfg.input_size
    if n < 2:
        raise DataError(f"training needs at least 2 images, got {n}")
    if val is not None:
        if not isinstance(val, tuple) or len(val) != 2:
            raise DataError("val must be a tuple (images, landmarks_px)")
        check_images(val[0], "validation images")
        val = (val[0], check_landmarks(val[1], val[0], "validation landmarks"))
    check_device("aligner", cfg.accelerator, cfg.precision)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_aligner")
    info = {"config": dataclasses.asdict(cfg), "num_images": n}
    if ckpt_path is not None:
        check_resume(ckpt_path, CHECKPOINT_KEY, "aligner.train", info, data_keys=("num_images",))
    n_neg = cfg.nonfaces_per_batch  # non-face crops per batch, after the faces
    batch_size = min(cfg.batch_size - n_neg, n)  # faces per batch
    steps_per_epoch = n // batch_size  # drop_last: a batch of 1 would break BatchNorm
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        # channels_last: faster depthwise/pointwise convolutions and BatchNorm per step on the CPU; the returned
        # model is plain
        model = DFA(cfg.model_config()).to(memory_format=torch.channels_last)
        log.info("training DFA (%d anchors at %d², %d params) on %d faces + %d non-face crops per batch: %d "
                 "steps/epoch × %d epochs%s", model.num_anchors, size, sum(p.numel() for p in model.parameters()), n,
                 n_neg, steps_per_epoch, cfg.epochs, f", resuming {ckpt_path}" if ckpt_path else "")
        x_all, y_all = prepare_crops(images, landmarks_px, size)  # uint8 (N, 3, S, S), float (N, 5, 2) in [0, 1]
        # One epoch's worth of non-face crops at the faces' size, resized like them, rendered once per run
        neg_images = nonface_crops(cfg.seed, 0, steps_per_epoch * n_neg, images.shape[1], progress)
        negatives, _ = prepare_crops(neg_images, np.zeros((len(neg_images), 5, 2), np.float32), size)
        loader = DataLoader(AlignerBatches(x_all, y_all, negatives, batch_size, n_neg, cfg.seed), batch_size=None,
                            sampler=EpochBatches(steps_per_epoch))
        module = AlignerModule(model, cfg, steps_per_epoch, batch_size, val)
        history = EpochHistory(("train/loss", "train/nme", "train/score_loss"))

        def report(row: dict) -> None:
            rounded = {k: round(v, 5) for k, v in row.items() if k != "epoch"}
            log.info("epoch %d: %s (%.0f s)", row["epoch"], rounded, time.perf_counter() - start)

        after = [OnEpochEnd(history, fn) for fn in (report, on_epoch_end) if fn is not None]
        fitted = fit(
            module, loader, section="aligner", epochs=cfg.epochs, steps_per_epoch=steps_per_epoch, history=history,
            accelerator=cfg.accelerator, devices=cfg.devices, precision=cfg.precision, grad_clip=cfg.grad_clip,
            run_info=(CHECKPOINT_KEY, info), checkpoint_dir=checkpoint_dir, last_checkpoint=LAST_CHECKPOINT,
            ckpt_path=ckpt_path, callbacks=callbacks, after_checkpoint=after, progress=progress,
        )
    finally:
        torch.set_num_threads(threads)
    model = module.model.cpu().to(memory_format=torch.contiguous_format).eval()
    return AlignerResult(model, fitted.history, time.perf_counter() - start, fitted.checkpoint)
