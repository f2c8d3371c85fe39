"""The optimiser and the learning-rate factors shared by every trainer (``torch.optim.lr_scheduler.LambdaLR``
multiplies the base LR by them): linear warmup then cosine decay, linear warmup then ×γ steps, and plain steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["adamw", "lambda_schedule", "multistep", "warmup_cosine", "warmup_step_decay"]

FUSED_DEVICES = ("cpu", "cuda")


def adamw(params: Any, module: Any = None, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` with its fused kernel where every parameter allows it (floating point,
    on the CPU or a CUDA device): one kernel over all tensors instead of a dozen small ops per tensor. The same update
    up to float rounding, the same state dict (checkpoints resume either way); on the CPU the default is the per-tensor
    loop, which costs 4–7 % of a latent-UNet training step (``benchmarks/bench_steps.py``). Not fused when the
    LightningModule ``module``'s Trainer clips gradients under mixed precision: a fused AdamW unscales the gradients
    inside its step, so Lightning could not clip them first (it refuses)."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = bool(tensors) and all(p.is_floating_point() and p.device.type in FUSED_DEVICES for p in tensors)
    trainer = getattr(module, "_trainer", None)
    if trainer is not None and (trainer.gradient_clip_val or 0) > 0:
        from lightning.pytorch.plugins.precision import MixedPrecision

        fused = fused and not isinstance(trainer.precision_plugin, MixedPrecision)
    return torch.optim.AdamW(params, **({"fused": True} if fused else {}), **kwargs)


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear from 1/warmup to 1 over ``warmup_steps``, then ``½(1 + cos(π·progress))`` from 1 to 0 at
    ``total_steps`` (and 0 after)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def multistep(step: int, milestones: Sequence[int], gamma: float = 0.1) -> float:
    """``γ^{#{m ∈ milestones : m ≤ step}}`` (torch's MultiStepLR as a factor)."""
    return gamma ** sum(step >= m for m in milestones)


def warmup_step_decay(step: int, warmup_steps: int, milestones: Sequence[int], gamma: float = 0.1) -> float:
    """Linear from 1/warmup to 1 over ``warmup_steps``, then ×γ from each milestone step on."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return multistep(step, milestones, gamma)


def lambda_schedule(optimizer: torch.optim.Optimizer, factor: Callable[[int], float],
                    interval: str = "step") -> dict[str, Any]:
    """What a ``LightningModule.configure_optimizers`` returns for ``optimizer`` under the LR factor ``factor``
    of the step (or of the epoch with ``interval="epoch"``); the scheduler is checkpointed with the run."""
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": interval}}
