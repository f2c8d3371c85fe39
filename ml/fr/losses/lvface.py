"""LVFace staged margin loss: a sampled margin softmax early, prototype-stabilised class centres later.

[You et al., "LVFace: Large Vision Model for Face Recognition", 2025], paper Eq. 17–19. Early stage (Eq. 18): the
unified margin softmax ``s·(cos(m1θ_y + m2) − m3)`` over PartialFC's sampled classes. Stable stage (Eq. 19): all
classes, no sampling, the target centre stabilised by the expectation of the class feature (EPL, VPL). Each class
keeps a running prototype of its unit features, updated without gradient after each stable-stage step for the
classes in the (global) batch, ``p_c ← m·p_c + (1 − m)·mean_{i: y_i = c} x̂_i`` (the first observation sets it),
and the target logit uses ``w̃_c = normalise((1 − λ)·ŵ_c + λ·p_c)``; non-target logits keep ``w_j``.
m = ``prototype_momentum``, λ = ``prototype_weight``.

Differences from the reference (the paper; no code was released: switch epoch, sample rate, momentum are params):

- Eq. 19's ``s·‖α(w, x)‖_i`` is read as the EPL/VPL mixing above; λ and the first-observation init are ours.
- Unseen classes use ``w_c``; prototypes update after the loss, so a sample never pulls its own centre in-step.
- Prototypes are sharded like a ``PartialFC`` head's weights and updated from the gathered global batch (with a
  ``CombinedMarginLoss`` head under DDP too), so every rank keeps the same prototypes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError
from ml.fr.losses.margin import CombinedMarginLoss
from ml.fr.losses.partial_fc import PartialFC, distributed_cross_entropy, gather_batch


class LVFaceSchedule(nn.Module):
    """Wraps a margin head; call ``on_epoch_start(epoch)`` every epoch to move from the early to the stable stage."""

    def __init__(
        self,
        head: PartialFC | CombinedMarginLoss,
        switch_epoch: int,
        sample_rate: float,
        prototype_momentum: float = 0.9,
        prototype_weight: float = 0.5,
    ) -> None:
        super().__init__()
        if not isinstance(head, (PartialFC, CombinedMarginLoss)):
            raise ConfigError(f"LVFaceSchedule wraps a PartialFC or CombinedMarginLoss head, got {type(head).__name__}")
        if switch_epoch < 0:
            raise ConfigError(f"LVFaceSchedule switch_epoch must be ≥ 0, got {switch_epoch}")
        if not 0.0 < sample_rate <= 1.0:
            raise ConfigError(f"LVFaceSchedule sample_rate must be in (0, 1], got {sample_rate}")
        if sample_rate < 1.0 and not isinstance(head, PartialFC):
            raise ConfigError(
                f"LVFaceSchedule sample_rate={sample_rate} needs a PartialFC head; CombinedMarginLoss cannot sample "
                "negatives (use sample_rate=1.0 or wrap a PartialFC)"
            )
        if not 0.0 <= prototype_momentum < 1.0 or not 0.0 <= prototype_weight <= 1.0:
            raise ConfigError(
                "LVFaceSchedule needs 0 ≤ prototype_momentum < 1 and 0 ≤ prototype_weight ≤ 1; "
                f"got {prototype_momentum}, {prototype_weight}"
            )
        self.head = head
        self.switch_epoch = int(switch_epoch)
        self.sample_rate = float(sample_rate)
        self.prototype_momentum = float(prototype_momentum)
        self.prototype_weight = float(prototype_weight)
        num = head.num_local if isinstance(head, PartialFC) else head.num_classes
        self.class_start = head.class_start if isinstance(head, PartialFC) else 0
        # (C_r, D) running expectation of each class's unit features; rows valid where prototype_seen
        self.register_buffer("prototypes", torch.zeros(num, head.embedding_dim))
        self.register_buffer("prototype_seen", torch.zeros(num, dtype=torch.bool))
        self.epoch = 0
        self.on_epoch_start(0)

    def extra_repr(self) -> str:
        return (
            f"switch_epoch={self.switch_epoch}, sample_rate={self.sample_rate}, "
            f"prototype_momentum={self.prototype_momentum}, prototype_weight={self.prototype_weight}, "
            f"stage={'stable' if self.stable else 'early'}"
        )

    @property
    def stable(self) -> bool:
        """True from ``switch_epoch`` on: sampling off, prototypes updated and mixed into the target centres."""
        return self.epoch >= self.switch_epoch

    def on_epoch_start(self, epoch: int) -> None:
        """Set the stage for ``epoch`` (0-based) and the head's sampling rate."""
        self.epoch = int(epoch)
        if isinstance(self.head, PartialFC):
            self.head.sample_rate = 1.0 if self.stable else self.sample_rate

    def target_weights(self, class_ids: torch.Tensor, unit_w: torch.Tensor) -> torch.Tensor:
        """Mixed centres ``normalise((1 − λ)·ŵ_c + λ·p_c)`` (M, D) for local ``class_ids`` (M,) with unit weights (M, D);
        classes without a prototype keep ŵ_c."""
        lam = self.prototype_weight
        proto = self.prototypes[class_ids].to(unit_w.dtype)
        mixed = F.normalize((1.0 - lam) * unit_w + lam * proto, dim=1)
        return torch.where(self.prototype_seen[class_ids].unsqueeze(1), mixed, unit_w)

    @torch.no_grad()
    def update_prototypes(self, unit_x: torch.Tensor, labels: torch.Tensor) -> None:
        """EMA of the per-class mean of unit features ``unit_x`` (N, D) for the classes of global ``labels`` (N,)
        that this module holds; other classes are untouched."""
        local = labels.long() - self.class_start
        keep = (local >= 0) & (local < self.prototypes.shape[0])
        local, x = local[keep], unit_x[keep].to(self.prototypes.dtype)
        if local.numel() == 0:
            return
        classes, inverse = torch.unique(local, return_inverse=True)
        sums = torch.zeros(classes.numel(), x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, inverse, x)
        counts = torch.bincount(inverse, minlength=classes.numel()).to(x.dtype).unsqueeze(1)
        mean = sums / counts  # (U, D) batch mean per present class
        m = self.prototype_momentum
        seen = self.prototype_seen[classes].unsqueeze(1)
        old = self.prototypes[classes]
        self.prototypes[classes] = torch.where(seen, m * old + (1.0 - m) * mean, mean)
        self.prototype_seen[classes] = True

    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Stage-dependent scaled margin logits: (B, C) for a ``CombinedMarginLoss`` head, this rank's (N, K)
        kept-class columns of the global batch for a ``PartialFC`` head. Nothing is updated but PartialFC's step."""
        if isinstance(self.head, PartialFC):
            x, y = self.head.gather(embeddings, labels)
            return self.head.shard_logits(x, y, self.target_weights if self.stable else None)[0]
        return self._full_logits(embeddings, labels)

    def _full_logits(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = self.head
        cosine = head.cosine(embeddings)  # (B, C)
        if self.stable:
            idx = labels.long()
            x = F.normalize(embeddings.float(), dim=1)
            w_t = self.target_weights(idx, F.normalize(head.weight.float()[idx], dim=1))  # (B, D)
            cos_t = (x * w_t).sum(dim=1, keepdim=True).clamp(-1.0, 1.0)
            cosine = cosine.scatter(1, idx.view(-1, 1), cos_t)
        return head.apply_margin(cosine, labels)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Eq. 18 before ``switch_epoch``, Eq. 19 from it on; in the stable stage the prototypes are then updated
        (training mode only)."""
        if not self.stable:
            return self.head(embeddings, labels)
        if isinstance(self.head, PartialFC):
            x, y = self.head.gather(embeddings, labels)
            logits, target = self.head.shard_logits(x, y, self.target_weights)
            loss = distributed_cross_entropy(logits, target)
        else:
            loss = F.cross_entropy(self._full_logits(embeddings, labels), labels.long())
            if self.training:
                x, y = gather_batch(F.normalize(embeddings.detach().float(), dim=1), labels.long())
        if self.training:
            self.update_prototypes(x.detach(), y)
        return loss
