"""Face-recognition training: a backbone + margin softmax head fitted with Lightning on in-memory images.

``train(cfg, images, labels)`` is the whole stage: it seeds, builds the registered backbone for the
images' size, fits it with AdamW (linear warmup, then cosine or step decay per step) under a margin
head, and returns the backbone in eval mode with its per-epoch history. ``embed`` turns uint8 images
into (unnormalised) embeddings with flip test-time augmentation, ``f(x) + f(flip x)``.

Heads (``build_head``): ArcFace/CosFace (``CombinedMarginLoss``) or AdaFace on the unnormalised
embeddings; ``fr.sample_rate < 1`` swaps in PartialFC (class weights sharded over the DDP ranks,
sampled negatives); ``fr.lvface`` wraps the margin head in LVFace's two-stage schedule. A head that
shards classes is built in ``FRModule.configure_model``, after the process group exists, and kept
out of DDP's gradient averaging; its checkpoint holds all classes, so a run may resume on another
number of ranks.

Data stay a uint8 ``(N, 3, H, W)`` tensor; normalisation and augmentation run on each batch tensor
("basic": random flip, small zoom and translation as one affine resample; "kprpe": the recipe of
``ml.train.augment``), so a step costs no per-image Python work.

Exact resume: data order depends only on (seed, epoch) (``EpochSampler``), augmentation and the
model's own randomness (token masking, stochastic depth) are reseeded from (seed, global step, rank)
before every step, and every piece of state (weights, optimiser, schedule, PartialFC's step counter,
AdaFace's norm statistics, LVFace's prototypes, the history) is in the checkpoint. A run that is
stopped after any epoch and resumed from its ``last.ckpt`` ends with the same weights as one
uninterrupted run of the same config. Changing ``fr.epochs`` between the two changes the LR schedule
and so the result.

Mixed precision: ``fr.precision`` "16-mixed" needs a GPU and is refused with a ConfigError on the CPU
(no silent fallback to 32 bits); "bf16-mixed" is allowed everywhere, as Lightning and torch autocast
support bfloat16 on the CPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError, TrainingError
from ml.losses.adaface import AdaFaceLoss
from ml.losses.lvface import LVFaceSchedule
from ml.losses.margin import MARGINS, CombinedMarginLoss
from ml.losses.partial_fc import PartialFC, shard_bounds
from ml.models.backbones import BACKBONES, build_backbone, input_contract
from ml.models.backbones.vit import INPUT_CONTRACT
from ml.train.augment import FLIP_LANDMARK_ORDER, AugmentConfig, augment_kprpe, flip_keypoints
from ml.train.callbacks import EpochHistory, RunInfo, check_device, last_good_checkpoint, trainer_callbacks
from ml.train.checkpoint import resume_path

__all__ = [
    "FLIP_LANDMARK_ORDER",
    "EpochSampler",
    "FRConfig",
    "FRModule",
    "FRResult",
    "augment_batch",
    "build_head",
    "embed",
    "flip_keypoints",
    "images_to_tensor",
    "needs_keypoints",
    "train",
    "warmup_cosine",
    "warmup_step_decay",
]

log = logging.getLogger(__name__)

HEAD_MARGINS = (*MARGINS, "adaface")
SCHEDULES = ("cosine", "step")
AUGMENT_RECIPES = ("basic", "kprpe")
STRATEGIES = ("auto", "ddp", "ddp_spawn")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_fr"  # run description stored in every checkpoint, checked before resuming


@dataclass(frozen=True)
class FRConfig:
    """``fr`` section of params.yaml."""

    backbone: str = "vit_tiny"
    embedding_dim: int = 128
    epochs: int = 12
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    margin: str = "arcface"  # "arcface" | "cosface" | "adaface" (m=0.4, h=0.333 on unnormalised embeddings)
    scale: float = 32.0  # s; 64 for big runs, smaller converges faster on tiny data
    augment: bool = True  # batched in torch; which ops: augment_recipe
    num_workers: int = 0
    seed: int = 0
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed"
    accelerator: str = "auto"
    devices: int = 1
    max_steps: int = -1  # -1 = no limit (for smoke runs)
    augment_recipe: str = "basic"  # "basic": flip + small zoom/shift | "kprpe": ml/train/augment.py
    augmentation: AugmentConfig = field(default_factory=AugmentConfig)  # probabilities/magnitudes of "kprpe"
    sample_rate: float = 1.0  # < 1: PartialFC keeps the batch's classes + this share of all classes per step
    lvface: bool = False  # LVFace: sampled margin softmax, then prototype-stabilised centres without sampling
    lvface_switch_epoch: int = 0  # first epoch of LVFace's stable stage; 0 = epochs // 2
    lvface_prototype_momentum: float = 0.9
    lvface_prototype_weight: float = 0.5
    schedule: str = "cosine"  # after warmup: "cosine" to 0 | "step": ×0.1 at each of lr_steps
    lr_steps: tuple[float, ...] = (0.6, 0.9)  # fractions of the training steps
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    num_nodes: int = 1
    strategy: str = "auto"  # | "ddp" | "ddp_spawn"; several devices or nodes always run DDP

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ConfigError(f"fr.backbone {self.backbone!r} is not registered; valid: {', '.join(BACKBONES)}")
        if self.margin not in HEAD_MARGINS:
            raise ConfigError(f"fr.margin {self.margin!r} is not one of {sorted(HEAD_MARGINS)}")
        checks = {
            "embedding_dim": self.embedding_dim >= 1,
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 2,  # BatchNorm in the head needs 2 samples per batch
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "warmup_epochs": self.warmup_epochs >= 0,
            "scale": self.scale > 0,
            "num_workers": self.num_workers >= 0,
            "devices": self.devices >= 1,
            "max_steps": self.max_steps == -1 or self.max_steps >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(
                f"fr.{bad[0]} = {getattr(self, bad[0])!r} is out of range; need embedding_dim, epochs, devices ≥ 1, "
                "batch_size ≥ 2, lr, scale > 0, weight_decay, warmup_epochs, num_workers ≥ 0, max_steps -1 or ≥ 1"
            )
        choices = {
            "augment_recipe": AUGMENT_RECIPES, "schedule": SCHEDULES, "strategy": STRATEGIES, "precision": PRECISIONS,
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"fr.{key} {getattr(self, key)!r} is not one of {list(valid)}")
        ranges = {
            "sample_rate": (0.0 < self.sample_rate <= 1.0, "in (0, 1]"),
            "lvface_switch_epoch": (self.lvface_switch_epoch >= 0, "≥ 0 (0 = half of fr.epochs)"),
            "lvface_prototype_momentum": (0.0 <= self.lvface_prototype_momentum < 1.0, "in [0, 1)"),
            "lvface_prototype_weight": (0.0 <= self.lvface_prototype_weight <= 1.0, "in [0, 1]"),
            "grad_clip": (self.grad_clip >= 0.0, "≥ 0 (0 = off)"),
            "num_nodes": (self.num_nodes >= 1, "≥ 1"),
        }
        for key, (ok, need) in ranges.items():
            if not ok:
                raise ConfigError(f"fr.{key} = {getattr(self, key)!r} is out of range; it must be {need}")
        steps = self.lr_steps
        if not (all(0.0 < f < 1.0 for f in steps) and all(a < b for a, b in zip(steps, steps[1:]))):
            raise ConfigError(
                f"fr.lr_steps = {steps!r}: need increasing fractions of training strictly between 0 and 1"
            )
        if self.margin == "adaface" and (self.sample_rate < 1.0 or self.lvface):
            raise ConfigError(
                "fr.margin 'adaface' works with the full softmax only: PartialFC (fr.sample_rate < 1) and fr.lvface "
                "take the unified margins; use fr.margin arcface or cosface with them, or sample_rate 1.0 and "
                "lvface false"
            )
        if self.lvface and self.lvface_switch_epoch >= self.epochs:
            raise ConfigError(
                f"fr.lvface_switch_epoch = {self.lvface_switch_epoch} is not below fr.epochs = {self.epochs}: the "
                "stable stage would never start; lower it (0 = half of the epochs) or set fr.lvface false"
            )

    @property
    def switch_epoch(self) -> int:
        """LVFace's first stable-stage epoch (0-based)."""
        return self.lvface_switch_epoch or self.epochs // 2


def _mean_std(contract: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    contract = contract or INPUT_CONTRACT
    mean = torch.tensor(contract["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(contract["std"], dtype=torch.float32).view(1, -1, 1, 1)
    return mean, std


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) → float32 ``(x/255 − mean)/std``."""
    return (x.float() / 255.0 - mean.to(x.device)) / std.to(x.device)


def images_to_tensor(images: np.ndarray, contract: dict[str, Any] | None = None) -> torch.Tensor:
    """uint8 RGB (N, H, W, 3) → float32 (N, 3, H, W) ``(x/255 − mean)/std`` (default 0.5, 0.5)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
    return normalize(x, *_mean_std(contract)).contiguous()


def augment_batch(
    x: torch.Tensor,
    max_zoom: float = 0.1,
    max_shift: float = 0.06,
    keypoints: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Random horizontal flip (p = 0.5), zoom-in by up to ``max_zoom`` of the side and translation by up
    to ``max_shift`` of the side, per sample, as one bilinear affine resample of the batch (B, C, H, W).

    With ``keypoints`` (B, 5, 2) pixel (x, y), returns ``(images, keypoints)`` with the landmarks moved by
    the same transform (and left/right swapped where flipped), so KP-RPE sees where the features went.
    With a ``generator`` the random numbers are drawn on its device and moved to the images' device.
    """
    b, size = x.shape[0], x.shape[-1]
    dev = x.device
    gdev = generator.device if generator is not None else dev
    u = torch.rand(b, 4, generator=generator, device=gdev).to(dev)  # (B, 4) in [0, 1)
    flip = torch.where(u[:, 0] < 0.5, -1.0, 1.0)
    zoom = 1.0 - max_zoom * u[:, 1]  # sampled window side / image side
    shift = (u[:, 2:4] * 2.0 - 1.0) * (2.0 * max_shift)  # grid coords span 2 per side
    theta = torch.zeros(b, 2, 3, device=dev, dtype=x.dtype)
    theta[:, 0, 0] = zoom * flip
    theta[:, 1, 1] = zoom
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if keypoints is None:
        return out
    # output grid g maps to input A·g + t; a landmark at input n sits at A⁻¹(n − t) in the output.
    # pixel ↔ normalised (align_corners=False): n = (2p + 1)/S − 1
    n = (2.0 * keypoints + 1.0) / size - 1.0
    scale = torch.stack([zoom * flip, zoom], dim=1).unsqueeze(1)  # (B, 1, 2)
    moved = (n - shift.unsqueeze(1)) / scale
    moved = ((moved + 1.0) * size - 1.0) / 2.0
    swap = (flip < 0).view(b, 1, 1)
    moved = torch.where(swap, moved[:, list(FLIP_LANDMARK_ORDER)], moved)
    return out, moved


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR factor: linear from 1/warmup to 1 over ``warmup_steps``, then cosine from 1 to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def warmup_step_decay(step: int, warmup_steps: int, milestones: Sequence[int]) -> float:
    """LR factor: linear from 1/warmup to 1 over ``warmup_steps``, then ×0.1 from each milestone step on."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 0.1 ** sum(step >= m for m in milestones)


def _mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers, e.g. (seed, epoch) or (seed, step, rank, stream)."""
    words = [int(v) % 2**63 for v in values]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] % 2**63)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class EpochSampler(Sampler[int]):
    """Shuffles ``range(n)`` with a permutation that depends only on (seed, epoch), so a resumed run sees the
    batches an uninterrupted one would. Under DDP each rank takes every world-th index, ``n // world`` each;
    the rank and world size are read when iterating, i.e. after the process group exists."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // _rank_world()[1]

    def __iter__(self):
        rank, world = _rank_world()
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        perm = torch.randperm(self.n, generator=gen)
        return iter(perm[rank::world][: self.n // world].tolist())


def build_head(cfg: FRConfig, num_classes: int) -> nn.Module:
    """The loss head for ``cfg``: ``CombinedMarginLoss`` (arcface/cosface), ``AdaFaceLoss``, or ``PartialFC``
    when ``sample_rate < 1``, wrapped in ``LVFaceSchedule`` when ``lvface``. Every head maps (embeddings,
    labels) to the mean loss. Build a PartialFC head after the process group exists: it takes this rank's
    class shard, initialised N(0, 0.01²) from (seed, rank) so that shards differ."""
    if cfg.margin == "adaface":
        return AdaFaceLoss(cfg.embedding_dim, num_classes, s=cfg.scale)
    if cfg.sample_rate < 1.0:
        head: nn.Module = PartialFC(
            cfg.embedding_dim, num_classes, sample_rate=cfg.sample_rate, margin=cfg.margin, s=cfg.scale,
            seed=cfg.seed, ddp_backbone=True,  # backbone gradient of the global-mean loss after DDP's averaging
        )
        gen = torch.Generator().manual_seed(_mix_seed(cfg.seed, head.rank, 2))
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * 0.01)
    else:
        head = CombinedMarginLoss(cfg.embedding_dim, num_classes, s=cfg.scale, **MARGINS[cfg.margin])
    if cfg.lvface:
        head = LVFaceSchedule(
            head, switch_epoch=cfg.switch_epoch, sample_rate=cfg.sample_rate,
            prototype_momentum=cfg.lvface_prototype_momentum, prototype_weight=cfg.lvface_prototype_weight,
        )
    return head


def _partial_fc(head: nn.Module) -> PartialFC | None:
    inner = head.head if isinstance(head, LVFaceSchedule) else head
    return inner if isinstance(inner, PartialFC) else None


def _sharded_keys(head: nn.Module) -> list[str]:
    """State-dict keys (under ``head.``) whose first dimension is this rank's class shard."""
    if isinstance(head, LVFaceSchedule) and isinstance(head.head, PartialFC):
        return ["head.head.weight", "head.prototypes", "head.prototype_seen"]
    return ["head.weight"] if isinstance(head, PartialFC) else []


def _gather_classes(t: torch.Tensor, num_classes: int, world: int) -> torch.Tensor:
    """Every rank's class shard (C_r, ...) → the full (C, ...) tensor, on every rank."""
    sizes = [hi - lo for lo, hi in (shard_bounds(num_classes, r, world) for r in range(world))]
    src = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool collectives
    padded = src.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = src
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    full = torch.cat([p[:n] for p, n in zip(parts, sizes)])
    return full.to(torch.bool) if t.dtype == torch.bool else full


def _kept_class_accuracy(head: PartialFC, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Share of the global batch whose target class has the largest cosine among the classes PartialFC kept at
    its last call (all classes when not sampling); an upper bound of the full-softmax accuracy."""
    x, y = head.gather(embeddings.detach(), labels)
    index = head.last_index
    w = F.normalize(head.weight.detach().float()[index], dim=1)
    cos = x @ w.t()  # (N, K)
    local = head.local_labels(y)
    has = local >= 0
    col = torch.searchsorted(index, local.clamp_min(0)).clamp(max=index.numel() - 1)
    target = torch.where(has, cos.gather(1, col.view(-1, 1)).squeeze(1), torch.zeros_like(cos[:, 0]))
    best = cos.max(dim=1).values
    if head.world_size > 1:
        dist.all_reduce(best, op=dist.ReduceOp.MAX)
        dist.all_reduce(target, op=dist.ReduceOp.SUM)  # one rank owns each row's target
    return (target >= best).float().mean()


class FRModule(lightning.LightningModule):
    """Backbone + margin head; AdamW with per-step warmup, then cosine or step decay.

    ``head`` is the loss module (see ``build_head``) or a zero-argument callable returning it; a callable is
    called in ``configure_model``, once the process group exists, as a class-sharded PartialFC head needs.
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module | Callable[[], nn.Module],
        cfg: FRConfig,
        steps_per_epoch: int,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self._head_factory: Callable[[], nn.Module] | None = None
        if isinstance(head, nn.Module):
            self.head = head
        elif callable(head):
            self._head_factory = head
        else:
            raise TypeError(f"FRModule head must be an nn.Module or a callable building one, got {type(head).__name__}")
        self.cfg = cfg
        self.steps_per_epoch = steps_per_epoch
        mean, std = _mean_std(input_contract(backbone))
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("std", std, persistent=False)
        self._augment_generator: torch.Generator | None = None  # made on first use (picklable for ddp_spawn)

    def configure_model(self) -> None:
        if "head" not in self._modules:
            assert self._head_factory is not None
            self.head = self._head_factory()
        if _partial_fc(self.head) is not None:
            # Class shards differ between ranks: DDP must neither average their gradients nor broadcast buffers.
            names = [f"head.{n}" for n, _ in self.head.named_parameters()]
            names += [f"head.{n}" for n, _ in self.head.named_buffers()]
            self._ddp_params_and_buffers_to_ignore = names

    def forward(self, x: torch.Tensor, keypoints: torch.Tensor | None = None) -> torch.Tensor:
        return self.backbone(x, keypoints) if needs_keypoints(self.backbone) else self.backbone(x)

    def on_train_epoch_start(self) -> None:
        if isinstance(self.head, LVFaceSchedule):
            self.head.on_epoch_start(self.current_epoch)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The model's own randomness (token masking, stochastic depth) as a function of the step, for exact resume.
        torch.manual_seed(_mix_seed(self.cfg.seed, self.global_step, self.global_rank, 1))

    def _step_generator(self) -> torch.Generator:
        if self._augment_generator is None:
            self._augment_generator = torch.Generator()
        return self._augment_generator.manual_seed(_mix_seed(self.cfg.seed, self.global_step, self.global_rank, 0))

    def _augment(
        self, images: torch.Tensor, keypoints: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uint8 (B, 3, H, W) → normalised float images, augmented per ``cfg``; landmarks moved alike."""
        if not self.cfg.augment:
            return normalize(images, self.mean, self.std), keypoints
        gen = self._step_generator()
        if self.cfg.augment_recipe == "basic":
            x = normalize(images, self.mean, self.std)
            if keypoints is None:
                return augment_batch(x, generator=gen), None
            return augment_batch(x, keypoints=keypoints, generator=gen)
        u, keypoints = augment_kprpe(images.float() / 255.0, keypoints, self.cfg.augmentation, generator=gen)
        return (u - self.mean) / self.std, keypoints

    def _loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, training accuracy) of unnormalised embeddings (B, D)."""
        head = self.head
        if isinstance(head, CombinedMarginLoss):
            cosine = head.cosine(embeddings)  # (B, C)
            loss = F.cross_entropy(head.apply_margin(cosine, labels), labels)
            return loss, (cosine.argmax(dim=1) == labels).float().mean()
        loss = head(embeddings, labels)
        with torch.no_grad():
            pfc = _partial_fc(head)
            if pfc is not None:
                accuracy = _kept_class_accuracy(pfc, embeddings, labels)
            else:
                inner = head.head if isinstance(head, LVFaceSchedule) else head
                accuracy = (inner.cosine(embeddings).argmax(dim=1) == labels).float().mean()
        return loss, accuracy

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        images, labels, *rest = batch  # uint8 (B, 3, H, W), int64 (B,), [float32 (B, 5, 2) pixel landmarks]
        x, keypoints = self._augment(images, rest[0] if rest else None)
        loss, accuracy = self._loss(self(x, keypoints), labels)
        if not bool(torch.isfinite(loss)):
            self._stop_non_finite(float(loss.detach()), batch_idx)
        b = labels.shape[0]
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/accuracy", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False, batch_size=b)
        return loss

    def _stop_non_finite(self, value: float, batch_idx: int) -> None:
        ckpt = last_good_checkpoint(self._trainer)
        where = (
            f"the last good checkpoint is {ckpt} (train(..., resume=True) continues from it)"
            if ckpt
            else "no checkpoint was saved (pass checkpoint_dir to train() to keep one per epoch)"
        )
        raise TrainingError(
            f"train/loss became {value} at global step {self.global_step} (epoch {self.current_epoch}, batch "
            f"{batch_idx}); training stopped before that step's update. {where}. Lower fr.lr, set fr.grad_clip > 0 "
            "or use fr.precision '32-true'."
        )

    # Checkpoints hold every class of a sharded head (gathered on save, sliced on load) and its AdamW moments.
    def _param_groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(decayed, not decayed) trainable parameters: no weight decay on norms, biases and other 1-D ones."""
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        return decay, no_decay

    def _optimizer_index(self, key: str) -> int | None:
        """Position of the parameter behind state-dict ``key`` in the optimiser's state dict, if it is one."""
        param = dict(self.named_parameters()).get(key)
        if param is None:
            return None
        ids = [id(p) for group in self._param_groups() for p in group]
        return ids.index(id(param)) if id(param) in ids else None

    def _reshard(self, checkpoint: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every class-sharded tensor of the checkpoint: head weights, buffers, AdamW moments."""
        state = checkpoint["state_dict"]
        optimizer_states = checkpoint.get("optimizer_states") or [{}]
        moments = optimizer_states[0].get("state", {})
        for key in _sharded_keys(self.head):
            if key not in state:
                continue  # another kind of head: the pre-fit check or the strict load names it
            state[key] = fn(state[key])
            idx = self._optimizer_index(key)
            if idx is not None and idx in moments:
                # a new dict: the one in the checkpoint may be the live optimiser state
                moments[idx] = {
                    name: fn(v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                    for name, v in moments[idx].items()
                }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        pfc = _partial_fc(self.head)
        if pfc is not None and pfc.world_size > 1:
            self._reshard(checkpoint, lambda t: _gather_classes(t, pfc.num_classes, pfc.world_size))
        state = checkpoint["state_dict"]
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            ckpt = last_good_checkpoint(self._trainer)
            raise TrainingError(
                f"weights became non-finite at global step {self.global_step} (e.g. {bad[:3]}); this checkpoint is "
                f"not written. Last good checkpoint: {ckpt or 'none'}. Lower fr.lr or set fr.grad_clip > 0."
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        pfc = _partial_fc(self.head)
        if pfc is None:
            return
        lo, hi = pfc.class_start, pfc.class_start + pfc.num_local

        def shard(t: torch.Tensor) -> torch.Tensor:
            if t.shape[0] != pfc.num_classes:
                raise DataError(
                    f"the checkpoint's PartialFC tensors hold {t.shape[0]} classes but this run trains "
                    f"{pfc.num_classes}"
                )
            return t[lo:hi]

        self._reshard(checkpoint, shard)

    def configure_optimizers(self) -> Any:
        decay, no_decay = self._param_groups()
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.cfg.lr,
        )
        total = self.cfg.epochs * self.steps_per_epoch
        if self.cfg.max_steps > 0:
            total = min(total, self.cfg.max_steps)
        warmup = min(round(self.cfg.warmup_epochs * self.steps_per_epoch), total)
        if self.cfg.schedule == "step":
            milestones = [max(warmup, round(f * total)) for f in self.cfg.lr_steps]
            factor = partial(warmup_step_decay, warmup_steps=warmup, milestones=milestones)
        else:
            factor = partial(warmup_cosine, warmup_steps=warmup, total_steps=total)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@dataclass
class FRResult:
    model: nn.Module  # backbone in eval mode
    backbone: str
    backbone_kwargs: dict
    history: list[dict]  # per-epoch {"epoch", "train/loss", "train/accuracy"}, resumed epochs included
    seconds: float
    checkpoint: Path | None = None  # last.ckpt when train() was given a checkpoint_dir
    global_rank: int = 0  # this process's rank under DDP: only rank 0 should save the model or log results


def _check_images(images: np.ndarray, what: str = "images") -> None:
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"{what} must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    if images.shape[1] != images.shape[2]:
        raise DataError(f"{what} must be square, got {images.shape[1]}×{images.shape[2]}; align/resize them first")


def _check_labels(labels: np.ndarray, n: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != n or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
    if labels.min() < 0:
        raise DataError(f"labels must be contiguous 0..K-1, found negative label {labels.min()}")
    counts = np.bincount(labels)
    absent = np.flatnonzero(counts == 0)
    if absent.size:
        raise DataError(
            f"labels must be contiguous 0..K-1 (K={counts.size}), but {absent.size} are absent, e.g. "
            f"{absent[:5].tolist()}; re-index them (np.unique(labels, return_inverse=True))"
        )
    if counts.size < 2:
        raise DataError("training needs at least 2 identities, got 1")
    return labels.astype(np.int64)


def needs_keypoints(model: nn.Module) -> bool:
    """True for backbones (KP-RPE) that take 5 pixel landmarks per image beside the image."""
    return bool(getattr(model, "needs_keypoints", False))


def check_keypoints(keypoints: np.ndarray | None, n: int, model_name: str) -> np.ndarray:
    """float32 (n, 5, 2) pixel landmarks for a KP-RPE model, or DataError: none given, wrong shape, non-finite rows."""
    if keypoints is None:
        raise DataError(
            f"{model_name!r} uses KP-RPE and needs 5 landmarks per image, but none were given: it needs keypoints "
            "(N, 5, 2) pixel x, y — from the manifest's landmarks or the aligner's predictions"
        )
    keypoints = np.asarray(keypoints, dtype=np.float32)
    if keypoints.shape != (n, 5, 2):
        raise DataError(f"keypoints must have shape ({n}, 5, 2), got {keypoints.shape}")
    missing = np.flatnonzero(~np.isfinite(keypoints).all(axis=(1, 2)))
    if missing.size:
        raise DataError(
            f"keypoints of image {int(missing[0])} are not finite ({missing.size} of {n} images, e.g. rows "
            f"{missing[:5].tolist()}); drop them or fill them with the aligner's predictions"
        )
    return keypoints


def _backbone_kwargs(cfg: FRConfig, size: int, overrides: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(overrides or {})
    for key in ("img_size", "embed_dim"):
        if key in kwargs:
            raise ConfigError(f"backbone_overrides may not set {key!r}; it follows the images / fr.embedding_dim")
    params = inspect.signature(BACKBONES[cfg.backbone]).parameters
    flexible = "img_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if flexible:
        kwargs["img_size"] = size
    kwargs["embed_dim"] = cfg.embedding_dim
    expected = input_contract(cfg.backbone, **kwargs)["size"]
    if expected != size:
        raise ConfigError(
            f"backbone {cfg.backbone!r} takes {expected}×{expected} images but the data are {size}×{size}; "
            "prepare the data at that size or pick another fr.backbone"
        )
    return kwargs


def _strategy(cfg: FRConfig) -> Any:
    """"auto" for one process; otherwise DDP. ``static_graph`` lets parameters that never get a gradient
    (the ViT's mask token when ``mask_ratio`` is 0) pass without DDP's per-step search for unused ones."""
    if cfg.strategy == "auto" and cfg.devices * cfg.num_nodes == 1:
        return "auto"
    return DDPStrategy(start_method="spawn" if cfg.strategy == "ddp_spawn" else "popen", static_graph=True)


def _head_kind(cfg: FRConfig) -> str:
    """The head's structure, which decides the checkpoint's head tensors."""
    kind = "adaface" if cfg.margin == "adaface" else ("partial_fc" if cfg.sample_rate < 1.0 else "margin")
    return f"lvface({kind})" if cfg.lvface else kind


def _check_checkpoint(path: Path, info: dict[str, Any], backbone: nn.Module) -> None:
    """Before fitting: the checkpoint must hold this run's backbone (name, kwargs, tensor shapes), class count and
    kind of head. Other config differences (e.g. more epochs) are logged, as they change the run."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, truncated or not a torch file
        raise ConfigError(f"cannot read checkpoint {path}: {exc}; remove it or pass resume=False") from exc
    meta = ckpt.get(CHECKPOINT_KEY) if isinstance(ckpt, dict) else None
    if meta is None or "state_dict" not in ckpt:
        raise ConfigError(
            f"{path} is not a faceops FR checkpoint (no {CHECKPOINT_KEY!r} entry); remove it or pass resume=False"
        )
    if (meta["backbone"], meta["backbone_kwargs"]) != (info["backbone"], info["backbone_kwargs"]):
        raise ConfigError(
            f"checkpoint {path} holds backbone {meta['backbone']!r} {meta['backbone_kwargs']}, but this run builds "
            f"{info['backbone']!r} {info['backbone_kwargs']}; resume with the same fr.backbone, fr.embedding_dim and "
            "backbone_overrides, or use another checkpoint_dir"
        )
    if meta["num_classes"] != info["num_classes"]:
        raise DataError(
            f"checkpoint {path} was trained on {meta['num_classes']} identities, but these labels have "
            f"{info['num_classes']}; resume on the same training set or use another checkpoint_dir"
        )
    if meta["head"] != info["head"]:
        raise ConfigError(
            f"checkpoint {path} has a {meta['head']!r} head, but this config builds {info['head']!r} (fr.margin, "
            "fr.sample_rate < 1, fr.lvface); resume with the same head settings or use another checkpoint_dir"
        )
    state = ckpt["state_dict"]
    wrong = []
    for key, value in backbone.state_dict().items():
        saved = state.get(f"backbone.{key}")
        if saved is None or tuple(saved.shape) != tuple(value.shape):
            wrong.append(f"backbone.{key}: {None if saved is None else tuple(saved.shape)} vs {tuple(value.shape)}")
    if wrong:
        raise ConfigError(f"checkpoint {path} does not fit this backbone ({len(wrong)} tensors, e.g. {wrong[:3]})")
    changed = {k: (v, info["config"].get(k)) for k, v in meta.get("config", {}).items() if info["config"].get(k) != v}
    if changed:
        log.warning("resuming %s with changed settings (checkpoint → now): %s", path, changed)


def train(
    cfg: FRConfig,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    loggers: Any = None,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    backbone_overrides: dict[str, Any] | None = None,
    keypoints: np.ndarray | None = None,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
) -> FRResult:
    """Fit ``cfg.backbone`` on uint8 RGB ``images`` (N, H, W, 3) with contiguous integer ``labels`` (N,).

    KP-RPE backbones also need ``keypoints`` (N, 5, 2): pixel landmarks in ArcFace order.

    ``backbone_overrides`` are extra constructor arguments (e.g. ``depth``); the image size and the
    embedding dimension always come from the data and ``cfg``.

    With ``checkpoint_dir`` a ``last.ckpt`` is written there after every epoch (an existing one is an
    error unless ``resume``). ``resume=True`` continues from it, after checking that it holds the same
    backbone, class count and head; the result equals an uninterrupted run of the same config. Without a
    ``last.ckpt`` a resumed run starts from scratch (logged). A NaN/inf loss stops training with a
    ``TrainingError`` naming the global step and the last good checkpoint.
    """
    start = time.perf_counter()
    _check_images(images)
    labels = _check_labels(labels, images.shape[0])
    n, size = images.shape[0], images.shape[1]
    if n < 2:
        raise DataError(f"training needs at least 2 images, got {n}")
    check_device("fr", cfg.accelerator, cfg.precision)
    kwargs = _backbone_kwargs(cfg, size, backbone_overrides)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train")
    world = cfg.devices * cfg.num_nodes
    per_rank = n // world
    if per_rank < 2:
        raise DataError(f"{n} images over {world} processes leave fewer than 2 per process; use fewer devices")

    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    backbone = build_backbone(cfg.backbone, **kwargs)
    tensors = [
        torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(),  # uint8 (N, 3, H, W)
        torch.from_numpy(labels),
    ]
    if needs_keypoints(backbone):
        tensors.append(torch.from_numpy(check_keypoints(keypoints, n, cfg.backbone)))
    num_classes = int(labels.max()) + 1
    info = {
        "backbone": cfg.backbone,
        "backbone_kwargs": dict(kwargs),
        "num_classes": num_classes,
        "head": _head_kind(cfg),
        "config": dataclasses.asdict(cfg),
    }
    if ckpt_path is not None:
        _check_checkpoint(ckpt_path, info, backbone)
    # A class-sharded head is built once the process group exists; the others now, as before.
    head_factory = partial(build_head, cfg, num_classes)
    head = head_factory if cfg.sample_rate < 1.0 else head_factory()

    batch_size = min(cfg.batch_size, per_rank)
    steps_per_epoch = per_rank // batch_size  # drop_last: a batch of 1 would break BatchNorm
    loader = DataLoader(
        TensorDataset(*tensors),
        batch_size=batch_size,
        sampler=EpochSampler(n, cfg.seed),
        drop_last=True,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
    )
    module = FRModule(backbone, head, cfg, steps_per_epoch)
    history = EpochHistory(("train/loss", "train/accuracy"))
    all_callbacks, checkpointing = trainer_callbacks([history, RunInfo(CHECKPOINT_KEY, info)], checkpoint_dir,
                                                     LAST_CHECKPOINT, callbacks)
    trainer = lightning.Trainer(
        max_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=_strategy(cfg),
        precision=cfg.precision,
        gradient_clip_val=cfg.grad_clip if cfg.grad_clip > 0 else None,
        logger=loggers if loggers else False,
        callbacks=all_callbacks,
        enable_checkpointing=checkpointing,
        enable_progress_bar=progress,
        enable_model_summary=False,
        log_every_n_steps=max(1, min(50, steps_per_epoch)),
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # EpochSampler splits the data between ranks itself
    )
    log.info(
        "training %s %s on %d images (%d identities, %d×%d), %s head: %d steps/epoch × %d epochs%s",
        cfg.backbone, kwargs, n, num_classes, size, size, info["head"], steps_per_epoch, cfg.epochs,
        f", resuming {ckpt_path}" if ckpt_path else "",
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        if ckpt_path is not None:  # resuming into the directory is the point
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - start
    if history.rows:
        log.info("done in %.1f s; last epoch %s", seconds, history.rows[-1])
    last = Path(checkpoint_dir) / LAST_CHECKPOINT if checkpoint_dir is not None else None
    return FRResult(backbone.eval(), cfg.backbone, kwargs, history.rows, seconds,
                    last if last is not None and last.is_file() else None, global_rank=trainer.global_rank)


def embed(
    model: nn.Module,
    images: np.ndarray,
    *,
    batch_size: int = 256,
    flip: bool = True,
    progress: bool = False,
    keypoints: np.ndarray | None = None,
) -> np.ndarray:
    """float32 (N, D) embeddings of uint8 RGB ``images`` (N, H, W, 3): ``f(x) + f(flip x)`` when ``flip``
    (horizontal flip), else ``f(x)``. Not L2-normalised; callers normalise. KP-RPE models also need
    ``keypoints`` (N, 5, 2) pixel landmarks; the flipped pass gets the flipped, left/right-swapped ones."""
    _check_images(images)
    kp = check_keypoints(keypoints, len(images), type(model).__name__) if needs_keypoints(model) else None
    contract = getattr(model, "input_contract", None)
    if contract is not None and images.shape[1] != contract["size"]:
        raise DataError(
            f"model expects {contract['size']}×{contract['size']} images, got {images.shape[1]}×{images.shape[2]}"
        )
    if batch_size < 1:
        raise ConfigError(f"embed batch_size must be ≥ 1, got {batch_size}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chunks: list[np.ndarray] = []
    try:
        with torch.no_grad(), tqdm(total=len(images), unit="img", disable=not progress, desc="embed") as bar:
            for i in range(0, len(images), batch_size):
                x = images_to_tensor(images[i : i + batch_size], contract).to(device)
                if kp is None:
                    feats = model(x)
                    if flip:
                        feats = feats + model(x.flip(3))
                else:
                    k = torch.from_numpy(kp[i : i + batch_size]).to(device)
                    feats = model(x, k)
                    if flip:
                        feats = feats + model(x.flip(3), flip_keypoints(k, x.shape[-1]))
                chunks.append(feats.float().cpu().numpy())
                bar.update(x.shape[0])
    finally:
        model.train(was_training)
    if not chunks:
        dim = contract["embedding_dim"] if contract else 0
        return np.zeros((0, dim), dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)
