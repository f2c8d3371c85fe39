"""Generalized face discovery training: FaceGCD fitted with GCD's semi-supervised contrastive loss.

``train_discovery(cfg, images, labels, labelled_mask)`` is the whole stage. It builds ``FaceGCD`` with both ViTs
initialised from the pipeline's FR model (``backbone_init: fr``) or at random, draws two augmented views of every
image in a batch, and minimises ``(1 − λ)·L_u(all) + λ·L_s(labelled)`` (``ml.losses.contrastive``) on the
projection head's output with AdamW over the trainable parameters only (hypernetwork, base prefixes, last block,
projection head), a per-step linear warmup and cosine decay to 0. A plain torch loop: one process, no DDP.

Views: ``ml.train.augment.augment_kprpe`` without landmarks, with contrastive-strength defaults
(``DISCOVERY_AUGMENTATION``: flip, zoom 0.85–1.2, shift, small rotation, colour jitter, blur, cutout), drawn
independently for the two views.

Exact resume: batch order depends only on (seed, epoch); the views and the model's own randomness (a random base
prefix, stochastic depth in the last block) are reseeded from (seed, global step) before every step, inside
``torch.random.fork_rng`` so the caller's RNG is untouched. ``checkpoint_dir/last.pt`` (weights, optimiser,
history, config, data digest) is written atomically after every epoch; ``resume=True`` continues from it and ends
with the same weights as an uninterrupted run of the same config on the same data.

Differences from the reference (FaceGCD App. A.2, GCD's ``contrastive_training.py``):

- AdamW (lr 1e-3, weight decay 0.05 on matrices only) with a per-step warmup + cosine, instead of SGD (lr 0.1,
  momentum 0.9, weight decay 2e-5), 5 warm-up epochs, cosine with decays at epochs 90 and 180, over 200 epochs.
- Temperature 0.07 for both terms by default (paper: 1.0 for both; GCD's code: 1.0 and 0.07).
- Both views of a batch go through the model together (the frozen BatchNorms see no batch statistics, so this
  equals two passes). No model selection on a validation split: the last epoch's model is returned.
- Backbone: the FR model trained in the pipeline (``backbone_init: fr``) instead of a DINO ViT-B/8 pretrained on
  MS1MV3; ``random`` trains from scratch (a smoke test more than a method).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError, TrainingError
from ml.losses.contrastive import gcd_loss_terms
from ml.models.backbones import BACKBONES, input_contract
from ml.models.backbones.vit import ViT
from ml.models.discovery.facegcd import FaceGCD
from ml.models.io import load_model
from ml.train.augment import AugmentConfig, augment_kprpe
from ml.train.checkpoint import save_checkpoint

__all__ = [
    "DISCOVERY_AUGMENTATION",
    "DiscoveryConfig",
    "DiscoveryResult",
    "build_facegcd",
    "train_discovery",
]

log = logging.getLogger(__name__)

BACKBONE_INITS = ("fr", "random")


def plain_vits() -> tuple[str, ...]:
    """Registry names that build a plain ``ViT`` (what FaceGCD wraps): the builders of ``ml.models.backbones.vit``."""
    return tuple(name for name, build in BACKBONES.items() if getattr(build, "__module__", None) == ViT.__module__)
LAST_CHECKPOINT = "last.pt"
CHECKPOINT_FORMAT = 1


def _discovery_augmentation() -> AugmentConfig:
    """Stronger than FR training's: two views of one face must differ enough for InfoNCE to teach something."""
    return AugmentConfig(
        flip_prob=0.5, scale_prob=0.8, scale_range=(0.85, 1.2), translate_prob=0.5, max_translate=0.08,
        rotate_prob=0.3, max_rotate_deg=10.0, padding_mode="border",
        brightness_prob=0.8, brightness_range=(0.6, 1.4), contrast_prob=0.8, contrast_range=(0.6, 1.4),
        saturation_prob=0.8, saturation_range=(0.6, 1.4), blur_prob=0.2, cutout_prob=0.2,
    )


DISCOVERY_AUGMENTATION = _discovery_augmentation()


@dataclass(frozen=True)
class DiscoveryConfig:
    """``discovery`` section of params.yaml."""

    backbone: str = "vit_tiny"  # a plain ViT from ml.models.backbones; must match the FR model with backbone_init fr
    backbone_init: str = "fr"  # "fr": both ViTs from the FR model dir | "random"
    prefix_length: int = 10  # P key/value prefix tokens per layer; 0 = no prefixes (plain GCD on the last block)
    bottleneck: int = 0  # r of the prefix generator; 0 = head_dim // 4 (paper 16 at head_dim 64)
    hyper_hidden: int = 0  # hypernetwork MLP width; 0 = 4·dim // 3 (paper 1024 at dim 768)
    learn_base_prefix: bool = True  # false: the authors' code, a fresh random base prefix every forward
    static_prefix: bool = False  # ablation: learned sample-independent prefixes, no hypernetwork
    proj_dim: int = 256  # projection head output (GCD: 65536)
    proj_hidden: int = 512  # projection MLP width (GCD: 2048)
    proj_bottleneck: int = 128  # L2-normalised bottleneck before the last layer (GCD: 256)
    epochs: int = 10
    batch_size: int = 64  # images per step; the loss sees 2 × batch_size views
    lr: float = 1e-3
    weight_decay: float = 0.05  # AdamW, on weight matrices only
    warmup_epochs: float = 1.0
    temperature: float = 0.07  # InfoNCE τ
    sup_temperature: float = 0.07  # SupCon τ
    sup_weight: float = 0.35  # λ in (1 − λ)·L_u + λ·L_s
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    augment: bool = True
    augmentation: AugmentConfig = field(default_factory=_discovery_augmentation)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backbone not in plain_vits():
            raise ConfigError(
                f"discovery.backbone {self.backbone!r} is not a plain ViT backbone; valid: {', '.join(plain_vits())}"
            )
        if self.backbone_init not in BACKBONE_INITS:
            raise ConfigError(f"discovery.backbone_init {self.backbone_init!r} is not one of {list(BACKBONE_INITS)}")
        for key in ("learn_base_prefix", "static_prefix", "augment"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"discovery.{key} must be true or false, got {getattr(self, key)!r}")
        ints = {
            "prefix_length": 0, "bottleneck": 0, "hyper_hidden": 0, "proj_dim": 1, "proj_hidden": 1,
            "proj_bottleneck": 1, "epochs": 1, "batch_size": 2, "seed": 0,
        }
        for key, low in ints.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"discovery.{key} = {value!r}: need an integer ≥ {low}")
        ranges = {
            "lr": (lambda v: v > 0, "> 0"),
            "weight_decay": (lambda v: v >= 0, "≥ 0"),
            "warmup_epochs": (lambda v: v >= 0, "≥ 0"),
            "temperature": (lambda v: v > 0, "> 0"),
            "sup_temperature": (lambda v: v > 0, "> 0"),
            "sup_weight": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
            "grad_clip": (lambda v: v >= 0, "≥ 0 (0 = off)"),
        }
        for key, (ok, need) in ranges.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ConfigError(f"discovery.{key} = {value!r} is out of range; it must be a number {need}")
        if self.static_prefix and not self.learn_base_prefix:
            raise ConfigError(
                "discovery.learn_base_prefix false (random base prefix) needs the hypernetwork; with "
                "discovery.static_prefix true there is no base prefix: set learn_base_prefix true"
            )
        if not isinstance(self.augmentation, AugmentConfig):
            raise ConfigError(
                f"discovery.augmentation must be an AugmentConfig, got {type(self.augmentation).__name__}"
            )

    def model_kwargs(self) -> dict[str, Any]:
        """FaceGCD constructor arguments besides the backbone."""
        keys = ("prefix_length", "bottleneck", "hyper_hidden", "learn_base_prefix", "static_prefix", "proj_dim",
                "proj_hidden", "proj_bottleneck")
        return {k: getattr(self, k) for k in keys}


@dataclass
class DiscoveryResult:
    """The trained model (eval mode) and one dict per epoch: epoch, loss, loss/unsup, loss/sup, lr, seconds."""

    model: FaceGCD
    history: list[dict[str, float]]


def _mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers, e.g. (seed, epoch) or (seed, step, stream)."""
    words = [int(v) % 2**63 for v in values]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] % 2**63)


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear from 1/warmup to 1 over ``warmup`` steps, then ``½(1 + cos(π·progress))`` down to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _check_data(images: Any, labels: Any, labelled_mask: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and convert to uint8 (N, 3, S, S), int64 (N,), bool (N,) tensors."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3 \
            or images.shape[1] != images.shape[2]:
        got = (images.dtype, images.shape) if isinstance(images, np.ndarray) else type(images).__name__
        raise DataError(f"train_discovery: images must be a uint8 array (N, S, S, 3) of square RGB faces, got {got}")
    n = len(images)
    if n < 2:
        raise DataError(f"train_discovery: need at least 2 images for a contrastive batch, got {n}")
    labels = np.asarray(labels)
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"train_discovery: labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
    mask = np.asarray(labelled_mask)
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise DataError(f"train_discovery: labelled_mask must be bool of shape ({n},), got {mask.dtype} {mask.shape}")
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(labels.astype(np.int64)), torch.from_numpy(mask.copy())


def _digest(images: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in (images, labels, mask):
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def build_facegcd(cfg: DiscoveryConfig, img_size: int, init_model_dir: str | os.PathLike | None = None) -> FaceGCD:
    """FaceGCD for ``cfg`` and ``img_size``-pixel images; new parameters drawn from ``cfg.seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.backbone_init == "fr":
            if init_model_dir is None:
                raise ConfigError(
                    "discovery.backbone_init is 'fr' but no init_model_dir was given; pass the FR stage's model "
                    "directory or set discovery.backbone_init: random"
                )
            vit, config = load_model(init_model_dir)
            if config.get("backbone") != cfg.backbone:
                raise ConfigError(
                    f"discovery.backbone {cfg.backbone!r} differs from the FR model's {config.get('backbone')!r} in "
                    f"{init_model_dir}; set discovery.backbone to {config.get('backbone')!r}"
                )
            if vit.input_contract["size"] != img_size:
                raise DataError(
                    f"the FR model in {init_model_dir} takes {vit.input_contract['size']}×"
                    f"{vit.input_contract['size']} images but the data are {img_size}×{img_size}; prepare the data "
                    "at the FR model's size"
                )
            return FaceGCD(vit, prefix_seed=cfg.seed, **cfg.model_kwargs())
        if input_contract(cfg.backbone, img_size=img_size)["size"] != img_size:
            raise DataError(f"backbone {cfg.backbone!r} cannot take {img_size}×{img_size} images")
        return FaceGCD(cfg.backbone, backbone_kwargs={"img_size": img_size}, prefix_seed=cfg.seed,
                       **cfg.model_kwargs())


def _optimizer(model: FaceGCD, cfg: DiscoveryConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on weight matrices, none on biases, norms, prefixes and
    the layer embedding."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim == 2 and not name.endswith("layer_embed") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr)


def _views(model: FaceGCD, x: torch.Tensor, cfg: DiscoveryConfig, gen: torch.Generator) -> torch.Tensor:
    """uint8 batch (B, 3, S, S) → normalised model input of two views stacked (2B, 3, S, S)."""
    x = x.float() / 255.0
    if cfg.augment:
        v1, _ = augment_kprpe(x, None, cfg.augmentation, generator=gen)
        v2, _ = augment_kprpe(x, None, cfg.augmentation, generator=gen)
    else:
        v1 = v2 = x
    return model.normalize(torch.cat([v1, v2]))


def train_discovery(
    cfg: DiscoveryConfig,
    images: np.ndarray,
    labels: np.ndarray,
    labelled_mask: np.ndarray,
    *,
    init_model_dir: str | os.PathLike | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
) -> DiscoveryResult:
    """Fit FaceGCD on uint8 RGB ``images`` (N, S, S, 3); ``labels`` (N,) are read where ``labelled_mask`` (N,) is true.

    ``init_model_dir``: the FR model for ``backbone_init: fr``. ``checkpoint_dir``: where ``last.pt`` is written after
    every epoch; with ``resume`` the run continues from it (a missing checkpoint starts afresh).
    """
    x_all, y_all, m_all = _check_data(images, labels, labelled_mask)
    n, size = len(x_all), x_all.shape[-1]
    model = build_facegcd(cfg, size, init_model_dir)
    optimizer = _optimizer(model, cfg)
    batch = min(cfg.batch_size, n)
    steps_per_epoch = n // batch  # drop the last partial batch
    total = cfg.epochs * steps_per_epoch
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    digest = _digest(x_all, y_all, m_all)
    config_dict = dataclasses.asdict(cfg)
    history: list[dict[str, float]] = []
    start_epoch = 0

    ckpt_path = Path(checkpoint_dir) / LAST_CHECKPOINT if checkpoint_dir is not None else None
    if resume and ckpt_path is None:
        raise ConfigError("train_discovery: resume=True needs a checkpoint_dir to resume from")
    if resume and ckpt_path is not None and ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if state.get("config") != config_dict:
            old = state.get("config") or {}
            diff = sorted(k for k in set(old) | set(config_dict) if old.get(k) != config_dict.get(k))
            raise ConfigError(
                f"{ckpt_path} was written with other discovery settings ({', '.join(diff)}); resume with the same "
                "config or start a new run without resume"
            )
        if state.get("data_digest") != digest:
            raise DataError(f"{ckpt_path} was trained on other images/labels; resume on the same data or start afresh")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        history = list(state["history"])
        start_epoch = int(state["epoch"])
        log.info("resuming discovery training from %s after epoch %d", ckpt_path, start_epoch)
    elif resume:
        log.info("no checkpoint at %s; starting discovery training afresh", ckpt_path)

    bar = tqdm(total=total, initial=start_epoch * steps_per_epoch, disable=not progress, desc="discovery",
               unit="step")
    for epoch in range(start_epoch, cfg.epochs):
        model.train()
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix_seed(cfg.seed, epoch)))
        sums = {"loss": 0.0, "unsup": 0.0, "sup": 0.0}
        lr = cfg.lr
        for i in range(steps_per_epoch):
            step = epoch * steps_per_epoch + i
            lr = cfg.lr * _lr_factor(step, warmup, total)
            for group in optimizer.param_groups:
                group["lr"] = lr
            idx = perm[i * batch:(i + 1) * batch]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_mix_seed(cfg.seed, step, 1))  # random base prefix, stochastic depth
                gen = torch.Generator().manual_seed(_mix_seed(cfg.seed, step, 2))
                _, z = model(_views(model, x_all[idx], cfg, gen))  # (2B, proj_dim)
                z1, z2 = z.chunk(2)
                terms = gcd_loss_terms(z1, z2, y_all[idx], m_all[idx], cfg.sup_weight, cfg.temperature,
                                       cfg.sup_temperature)
                loss = terms["loss"]
                if not torch.isfinite(loss):
                    where = f"; the last good checkpoint is {ckpt_path}" if ckpt_path and ckpt_path.is_file() else ""
                    raise TrainingError(
                        f"discovery loss became {loss.item()} at epoch {epoch + 1}, step {step}{where}; "
                        "lower discovery.lr or raise discovery.temperature"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
            optimizer.step()
            for k in sums:
                sums[k] += terms[k].item()
            bar.set_postfix(epoch=epoch + 1, loss=f"{sums['loss'] / (i + 1):.4f}", refresh=False)  # shown at update
            bar.update(1)
        record = {
            "epoch": epoch + 1,
            "loss": sums["loss"] / steps_per_epoch,
            "loss/unsup": sums["unsup"] / steps_per_epoch,
            "loss/sup": sums["sup"] / steps_per_epoch,
            "lr": lr,
            "seconds": time.perf_counter() - t0,
        }
        history.append(record)
        log.info("discovery epoch %d/%d: loss %.4f (unsup %.4f, sup %.4f) in %.1f s", epoch + 1, cfg.epochs,
                 record["loss"], record["loss/unsup"], record["loss/sup"], record["seconds"])
        if ckpt_path is not None:
            save_checkpoint(ckpt_path, {
                "format": CHECKPOINT_FORMAT, "config": config_dict, "data_digest": digest, "epoch": epoch + 1,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(), "history": history,
            })
    bar.close()
    model.eval()
    return DiscoveryResult(model=model, history=history)
