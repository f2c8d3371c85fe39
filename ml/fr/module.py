"""The FR LightningModule (``FRModule``): backbone + margin head, AdamW with warmup then cosine or step decay.

Heads (``build_head``): ArcFace/CosFace (``CombinedMarginLoss``) or AdaFace on the unnormalised embeddings;
``fr.sample_rate < 1`` swaps in PartialFC (class weights sharded over the DDP ranks, sampled negatives);
``fr.lvface`` wraps the margin head in LVFace's two-stage schedule. A head that shards classes is built in
``FRModule.configure_model``, after the process group exists, and kept out of DDP's gradient averaging; its
checkpoint holds all classes (gathered on save, sliced on load, AdamW moments included), so a run may resume on
another number of ranks.

LR factor per optimiser step: ``warmup_cosine`` or ``warmup_step_decay``. Augmentation and the model's own
randomness are reseeded from (seed, global step, rank) before every step, for exact resume.

``fr.compile`` runs the training forward through ``torch.compile`` (fewer, fused kernels: a small ViT on a GPU is
bound by kernel launches, not arithmetic) and the kprpe augmentation too; evaluation and the saved model stay eager.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ml.errors import DataError, TrainingError
from ml.fr.losses.adaface import AdaFaceLoss
from ml.fr.losses.lvface import LVFaceSchedule
from ml.fr.losses.margin import MARGINS, CombinedMarginLoss
from ml.fr.losses.partial_fc import PartialFC, shard_bounds
from ml.fr.backbones import input_contract
from ml.train.augment import augment_kprpe
from ml.train.callbacks import last_good_checkpoint, non_finite_loss
from ml.fr.config import FRConfig
from ml.fr.data import _mean_std, _mix_seed, augment_batch, needs_keypoints, normalize
from ml.train.schedules import adamw, lambda_schedule, warmup_cosine, warmup_step_decay

__all__ = ["FRModule", "build_head", "warmup_cosine", "warmup_step_decay"]


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
    ``val`` = (uint8 images (V, 3, H, W), labels (V,), float32 keypoints (V, 5, 2) or None): images of the
    training identities that are not trained on, measured after every epoch (``epoch_summary``).
    """

    VAL_BATCH = 256

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module | Callable[[], nn.Module],
        cfg: FRConfig,
        steps_per_epoch: int,
        val: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
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
        self._compiled_forward: Callable[..., torch.Tensor] | None = None  # fr.compile, made in on_fit_start
        self.val = val  # plain tensors on the CPU: neither in the checkpoint nor moved with the module

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

    def on_fit_start(self) -> None:
        # a compiled function of the backbone's bound forward, not a module: the state dict keeps its keys
        if self.cfg.compile and self._compiled_forward is None:
            self._compiled_forward = torch.compile(self.backbone.forward)

    def _train_forward(self, x: torch.Tensor, keypoints: torch.Tensor | None) -> torch.Tensor:
        if self._compiled_forward is None:
            return self(x, keypoints)
        return self._compiled_forward(x, keypoints) if needs_keypoints(self.backbone) else self._compiled_forward(x)

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
        u, keypoints = augment_kprpe(images.float() / 255.0, keypoints, self.cfg.augmentation, generator=gen,
                                     compiled=self.cfg.compile)
        return (u - self.mean) / self.std, keypoints

    def _loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, training accuracy) of unnormalised embeddings (B, D), computed in float32 outside autocast
        under mixed precision too: cos θ near 1 needs the bits (the margin is an angle), and the heads scatter the
        margin target into the cosine matrix, which must keep one dtype."""
        with torch.autocast(embeddings.device.type, enabled=False):
            return self._loss_fp32(embeddings.float(), labels)

    def _loss_fp32(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        loss, accuracy = self._loss(self._train_forward(x, keypoints), labels)
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="train/loss", entry="train_fr",
                                  advice="Lower fr.lr, set fr.grad_clip > 0 or use fr.precision '32-true'.")
        b = labels.shape[0]
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/accuracy", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False, batch_size=b)
        return loss

    def epoch_summary(self) -> dict[str, float]:
        """``val/accuracy`` when the module has ``val`` data (``EpochHistory`` adds it to the epoch's row, and it is
        logged at the step of the epoch's ``train/*``): the share of val images whose nearest class centre (cosine
        to the head's class weights) is their own identity, the closed-set accuracy on images not trained on.
        Without flip TTA; every rank computes it, a sharded head's classes gathered first."""
        if self.val is None:
            return {}
        images, labels, keypoints = self.val
        inner = self.head.head if isinstance(self.head, LVFaceSchedule) else self.head
        weight = inner.weight.detach().float()
        pfc = _partial_fc(self.head)
        if pfc is not None and pfc.world_size > 1:
            weight = _gather_classes(weight, pfc.num_classes, pfc.world_size)
        centres = F.normalize(weight, dim=1)  # (C, D)
        was_training = self.backbone.training
        self.backbone.eval()
        hits = 0
        try:
            with torch.no_grad():
                for i in range(0, len(labels), self.VAL_BATCH):
                    x = normalize(images[i : i + self.VAL_BATCH].to(self.device), self.mean, self.std)
                    kp = None if keypoints is None else keypoints[i : i + self.VAL_BATCH].to(self.device)
                    cos = F.normalize(self(x, kp).float(), dim=1) @ centres.T  # (b, C)
                    hits += int((cos.argmax(dim=1).cpu() == labels[i : i + self.VAL_BATCH]).sum())
        finally:
            self.backbone.train(was_training)
        accuracy = hits / len(labels)
        self.log("val/accuracy", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(labels),
                 sync_dist=True)  # the same on every rank: the mean changes nothing, and Lightning asks for it
        return {"val/accuracy": accuracy}

    # Checkpoints hold every class of a sharded head (gathered on save, sliced on load) and its AdamW moments.
    def _param_groups(self) -> tuple[list[nn.Parameter], ...]:
        """(decayed, not decayed[, keypoint map]) trainable parameters: no weight decay on norms, biases and other
        1-D ones; with ``keypoint_lr_scale`` ≠ 1 a KP-RPE backbone's keypoint map (``kprpe.*``, zero-initialised)
        is a third group, decayed, at that multiple of the learning rate."""
        decay, no_decay, keypoint = [], [], []
        split = self.cfg.keypoint_lr_scale != 1.0
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            if split and ".kprpe." in f".{name}":
                keypoint.append(p)
            else:
                (decay if p.ndim >= 2 else no_decay).append(p)
        return (decay, no_decay, keypoint) if keypoint else (decay, no_decay)

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
        decay, no_decay, *keypoint = self._param_groups()
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups += [{"params": kp, "weight_decay": self.cfg.weight_decay, "lr": self.cfg.lr * self.cfg.keypoint_lr_scale}
                   for kp in keypoint]
        optimizer = adamw(groups, self, lr=self.cfg.lr)
        total = self.cfg.epochs * self.steps_per_epoch
        if self.cfg.max_steps > 0:
            total = min(total, self.cfg.max_steps)
        warmup = min(round(self.cfg.warmup_epochs * self.steps_per_epoch), total)
        if self.cfg.schedule == "step":
            milestones = [max(warmup, round(f * total)) for f in self.cfg.lr_steps]
            factor = partial(warmup_step_decay, warmup_steps=warmup, milestones=milestones)
        else:
            factor = partial(warmup_cosine, warmup_steps=warmup, total_steps=total)
        return lambda_schedule(optimizer, factor)
