"""BatchNorm over the global batch of a DDP run, on any device and backend (gloo included).

Under DDP each rank normalises with the statistics of its own share of the batch, so N ranks of B/N images do not
train the model that one process with B images trains. :func:`global_batchnorm` turns a module's ``BatchNorm1d`` and
``BatchNorm2d`` layers into :class:`GlobalBatchNorm1d` / ``2d`` in place: in training, with a process group of more
than one rank, the per-channel sums ``Σx``, ``Σx²`` and the count are all-reduced (differentiably, so the backward pass
sees every rank's samples too) and

    μ = Σx / n,   σ² = Σx² / n − μ²,   y = (x − μ) / √(σ² + ε) · γ + β,

with the running statistics updated as ``BatchNorm`` does (momentum, unbiased σ² · n / (n − 1)). Otherwise (eval,
one process) the layer is the ``BatchNorm`` it was: same parameters, buffers and state-dict keys.

Differences from ``torch.nn.SyncBatchNorm``: that layer needs CUDA (DDP refuses it on CPU modules) and computes the
statistics with Welford's update; this one runs wherever the process group does, with the two-sum formula in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GlobalBatchNorm1d", "GlobalBatchNorm2d", "global_batchnorm"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GlobalStats:
    """The training-mode forward of a global BatchNorm (mixed into ``nn.BatchNorm1d`` / ``2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats and _distributed()):
            return super().forward(x)  # type: ignore[misc]
        from torch.distributed.nn.functional import all_reduce

        self._check_input_dim(x)
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        count = xf.new_tensor([x.numel() // c])
        total = all_reduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]))
        n = total[-1]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0.0)
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            momentum = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
            self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), momentum)
            unbiased = var.detach() * (n / (n - 1).clamp_min(1.0))
            self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = (1, c, *([1] * (x.dim() - 2)))
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


class GlobalBatchNorm1d(_GlobalStats, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose training statistics are the global batch's (module docstring)."""


class GlobalBatchNorm2d(_GlobalStats, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics are the global batch's (module docstring)."""


_GLOBAL = {nn.BatchNorm1d: GlobalBatchNorm1d, nn.BatchNorm2d: GlobalBatchNorm2d}


def global_batchnorm(module: nn.Module) -> nn.Module:
    """Turn every plain ``BatchNorm1d``/``2d`` of ``module`` (exactly those types: subclasses with their own forward
    are left alone) into its global counterpart in place, parameters and buffers kept → ``module``."""
    for layer in module.modules():
        cls = _GLOBAL.get(type(layer))
        if cls is not None:
            layer.__class__ = cls
    return module
