"""PartialFC [An et al., CVPR 2022]: class-sharded margin softmax with negative class sampling and a distributed softmax.

Rank r of W owns classes ``[⌊r·C/W⌋, ⌊(r+1)·C/W⌋)``. Each step (1) all-gathers unit embeddings and labels into the
global batch (N, D), differentiably (each rank gets back the rank-summed gradient of its rows); (2) keeps per shard
its classes labelled in the batch (P) plus random others, ``K = min(C_r, max(P, round(rate·C_r), 1))`` (all of them
in eval mode or at rate 1); (3) takes ``CombinedMarginLoss``'s logits (LVFace Eq. 18); (4) runs the cross-entropy
across shards without gathering (N, C): ``L = mean_i(log S_i + z̄_i − z_iy)``, ``z̄_i = all_reduce_MAX(max_j z_ij)``,
``S_i = all_reduce_SUM(Σ_j exp(z_ij − z̄_i))``, with an exact gradient. Without a process group it runs at world
size 1. The weights are rank-local: keep this module out of ``DistributedDataParallel``.

Differences from the reference (insightface ``arcface_torch/partial_fc_v2.py``):

- Exact gradients; the reference's ×W embedding-gradient factor for DDP's averaging is opt-in (``ddp_backbone``).
- Negatives come from a CPU generator seeded by (seed, rank, step), reproducibly; at least one class is kept.
- Ranks may hold unequal batches (padded gather); sampling happens only in training mode.
- Any (m1, m2, m3) margin is accepted, not only ArcFace or CosFace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError, DataError
from ml.fr.losses.margin import MARGINS, CombinedMarginLoss

# (class ids (M,), their unit weights (M, D)) -> unit weights (M, D) to use for those target logits
TargetWeightFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _process_group() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_bounds(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the classes that ``rank`` owns: contiguous shards, sizes differ by at most one."""
    return rank * num_classes // world_size, (rank + 1) * num_classes // world_size


def _all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    """In-place all-reduce (``op`` = "sum" or "max") over the default group; a no-op in a single process."""
    if _process_group()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def _gather_rows(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows (b_r, ...) concatenated in rank order; batches are padded to the largest."""
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


class _AllGatherRows(torch.autograd.Function):
    """Differentiable all-gather: forward concatenates every rank's rows; backward sums the gradient over
    ranks (each rank holds only its own part of it) and keeps this rank's rows, times ``grad_scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int, grad_scale: float) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.grad_scale = sizes, rank, grad_scale
        return _gather_rows(x.contiguous(), sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.sizes[: ctx.rank])
        own = grad[start : start + ctx.sizes[ctx.rank]]
        if ctx.grad_scale != 1.0:
            own = own * ctx.grad_scale
        return own, None, None, None


def gather_batch(
    embeddings: torch.Tensor, labels: torch.Tensor, grad_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch in rank order: embeddings (N, D), differentiable back to each rank's own rows, and labels (N,).

    With world size 1 the inputs are returned unchanged.
    """
    rank, world = _process_group()
    if world == 1:
        return embeddings, labels
    sizes_t = torch.tensor([embeddings.shape[0]], dtype=torch.long, device=embeddings.device)
    sizes = [int(n) for n in _gather_rows(sizes_t, [1] * world)]
    x = _AllGatherRows.apply(embeddings, sizes, rank, grad_scale)
    return x, _gather_rows(labels.long().contiguous(), sizes)


class _DistributedCrossEntropy(torch.autograd.Function):
    """Softmax CE over column shards of the logits; backward ``(p − onehot)/N`` on this rank's columns."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        z_max = _all_reduce(logits.max(dim=1).values, "max")  # (N,)
        exp = torch.exp(logits - z_max.unsqueeze(1))  # (N, K), in (0, 1]
        denom = _all_reduce(exp.sum(dim=1), "sum")  # (N,), ≥ 1
        has = target >= 0
        z_t = torch.zeros_like(z_max)
        z_t[has] = logits[has, target[has]]
        z_t = _all_reduce(z_t, "sum")  # exactly one rank contributes each row's target
        ctx.save_for_backward(exp / denom.unsqueeze(1), target)
        ctx.n = n
        return (denom.log() + z_max - z_t).mean()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        prob, target = ctx.saved_tensors
        grad = prob.clone()
        rows = (target >= 0).nonzero().squeeze(1)
        grad[rows, target[rows]] -= 1.0
        return grad * (grad_out / ctx.n), None


def distributed_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy over the global batch when each rank holds a column shard of the logits.

    ``logits`` (N, K_r) are this rank's columns for all N rows; ``target`` (N,) is the target column in
    them or −1 where another rank owns it. Every rank returns the same loss
    ``(1/N)·Σ_i (log Σ_j exp z_ij − z_iy)`` and gets the exact gradient of its own columns.
    """
    return _DistributedCrossEntropy.apply(logits, target.long())


def _resolve_margin(margin: str | Mapping[str, float]) -> dict[str, float]:
    """A ``MARGINS`` name or an ``{m1, m2, m3}`` mapping (missing keys take ``CombinedMarginLoss``'s defaults)."""
    if isinstance(margin, str):
        if margin not in MARGINS:
            raise ConfigError(f"PartialFC margin {margin!r} is unknown; use one of {sorted(MARGINS)} or a dict of m1, m2, m3")
        return dict(MARGINS[margin])
    unknown = set(margin) - {"m1", "m2", "m3"}
    if unknown:
        raise ConfigError(f"PartialFC margin keys {sorted(unknown)} are unknown; expected m1, m2, m3")
    return {k: float(v) for k, v in margin.items()}


def _margin_function(margin: dict[str, float], s: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``CombinedMarginLoss.apply_margin`` for these margins, without that head's class weights."""
    head = CombinedMarginLoss(1, 1, s=s, **margin)
    del head.weight  # only the margin function is used; the classes live in PartialFC.weight
    return head.apply_margin


class PartialFC(nn.Module):
    """This rank's shard of the class weights (C_r, D), negative class sampling and the distributed margin CE."""

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        sample_rate: float = 1.0,
        margin: str | Mapping[str, float] = "arcface",
        s: float = 64.0,
        seed: int = 0,
        ddp_backbone: bool = False,
    ) -> None:
        super().__init__()
        rank, world = _process_group()
        if embedding_dim < 1 or num_classes < world:
            raise ConfigError(
                f"PartialFC needs embedding_dim ≥ 1 and at least one class per rank; got embedding_dim={embedding_dim}, "
                f"num_classes={num_classes} over {world} ranks"
            )
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.rank, self.world_size = rank, world
        self.class_start, stop = shard_bounds(num_classes, rank, world)
        self.num_local = stop - self.class_start
        self.margin = _resolve_margin(margin)
        self.s = float(s)
        self._apply_margin = _margin_function(self.margin, self.s)
        self.sample_rate = sample_rate
        self.seed = int(seed)
        self.ddp_backbone = bool(ddp_backbone)
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim))
        nn.init.normal_(self.weight, std=0.01)
        self.register_buffer("step", torch.zeros((), dtype=torch.long))  # training steps taken, seeds the sampler
        self.last_index: torch.Tensor | None = None  # (K,) local class ids kept at the last call

    @property
    def sample_rate(self) -> float:
        """Fraction of this shard's classes kept per step (positives always kept); 1.0 disables sampling."""
        return self._sample_rate

    @sample_rate.setter
    def sample_rate(self, rate: float) -> None:
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"PartialFC sample_rate must be in (0, 1], got {rate}")
        self._sample_rate = float(rate)

    def extra_repr(self) -> str:
        return (
            f"classes={self.num_classes}, shard=[{self.class_start}, {self.class_start + self.num_local}) of rank "
            f"{self.rank}/{self.world_size}, dim={self.embedding_dim}, sample_rate={self.sample_rate}, s={self.s}, "
            f"margin={self.margin}"
        )

    def gather(self, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit embeddings (N, D) and labels (N,) of the global batch, in rank order."""
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim or labels.shape != embeddings.shape[:1]:
            raise ValueError(
                f"PartialFC expects embeddings (B, {self.embedding_dim}) and labels (B,); "
                f"got {tuple(embeddings.shape)} and {tuple(labels.shape)}"
            )
        world = _process_group()[1]
        if world != self.world_size:
            raise RuntimeError(
                f"PartialFC was built for world size {self.world_size} but runs in {world}; "
                "build it after init_process_group"
            )
        x = F.normalize(embeddings.float(), dim=1)
        x, y = gather_batch(x, labels.long(), grad_scale=float(self.world_size) if self.ddp_backbone else 1.0)
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= self.num_classes:
            raise DataError(f"PartialFC labels must be in [0, {self.num_classes}); the batch holds {lo}..{hi}")
        return x, y

    def local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Global labels (N,) → this shard's class ids, −1 where another rank owns the class."""
        local = labels.long() - self.class_start
        return torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))

    def _step_seed(self, step: int) -> int:
        # distinct for every (seed, rank < 2^20, step < 2^32)
        return ((self.seed * 2**20 + self.rank) * 2**32 + step) % 2**63

    def sample(self, local: torch.Tensor) -> torch.Tensor:
        """Sorted local class ids (K,) kept this step: all positives in ``local`` plus random negatives."""
        step = int(self.step)
        if self.training:
            self.step.add_(1)
        if not self.training or self.sample_rate >= 1.0:
            index = torch.arange(self.num_local, device=local.device)
        else:
            positives = torch.unique(local[local >= 0]).cpu()
            k = min(self.num_local, max(positives.numel(), round(self.sample_rate * self.num_local), 1))
            gen = torch.Generator().manual_seed(self._step_seed(step))
            score = torch.rand(self.num_local, generator=gen)  # in [0, 1)
            score[positives] = 2.0  # above every draw: positives are always among the top k
            index = torch.topk(score, k).indices.sort().values.to(local.device)
        self.last_index = index
        return index

    def shard_logits(
        self, x: torch.Tensor, labels: torch.Tensor, target_weight: TargetWeightFn | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Margin logits (N, K) of the kept classes for unit embeddings ``x`` (N, D) and global ``labels`` (N,),
        and each row's target column in them (N,), −1 where another rank owns the target.

        ``target_weight(class_ids, unit_w)`` may replace the unit weights used for the target cosines
        (the class ids are local to this shard).
        """
        local = self.local_labels(labels)
        index = self.sample(local)
        w = F.normalize(self.weight.float()[index], dim=1)  # (K, D)
        cos = (x @ w.t()).clamp(-1.0, 1.0)  # (N, K)
        has = local >= 0
        target = torch.where(has, torch.searchsorted(index, local.clamp_min(0)), torch.full_like(local, -1))
        if target_weight is not None:
            rows = has.nonzero().squeeze(1)
            cols = target[rows]
            w_t = target_weight(index[cols], w[cols])  # (M, D)
            cos = cos.index_put((rows, cols), (x[rows] * w_t).sum(dim=1).clamp(-1.0, 1.0))
        logits = self._apply_margin(cos, target.clamp_min(0))
        return torch.where(has.unsqueeze(1), logits, self.s * cos), target

    def forward(
        self, embeddings: torch.Tensor, labels: torch.Tensor, target_weight: TargetWeightFn | None = None
    ) -> torch.Tensor:
        """Mean margin cross-entropy over the global batch; every rank returns the same value."""
        x, y = self.gather(embeddings, labels)
        logits, target = self.shard_logits(x, y, target_weight)
        return distributed_cross_entropy(logits, target)
