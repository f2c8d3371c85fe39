"""Learning-rate factors shared by every trainer (``torch.optim.lr_scheduler.LambdaLR`` multiplies the base LR by
them): linear warmup then cosine decay, linear warmup then ×γ steps, and plain steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["lambda_schedule", "multistep", "warmup_cosine", "warmup_step_decay"]


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
