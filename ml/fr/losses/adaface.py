"""AdaFace: a quality-adaptive margin from the feature norm [Kim, Jain, Liu, CVPR 2022].

With ``n_i = clip(‖z_i‖, 0.001, 100)`` (no gradient) as the quality proxy and running statistics ``μ, σ`` of ``n``,
``ĝ_i = clip(h·(n_i − μ)/(σ + ε), −1, 1)``, the target logit is ``z_y = s·(cos(clip(θ_y − m·ĝ_i, ε, π − ε)) − m −
m·ĝ_i)`` and the others ``s·cos θ_j`` (ε = 10⁻³); the loss is the cross-entropy. ĝ = −1 (poor image) gives ArcFace,
ĝ = 0 CosFace, ĝ = +1 (good image) ``cos(θ − m) − 2m``, which stresses hard samples. ``μ, σ`` are EMAs (α =
``t_alpha``) of the batch mean and unbiased std of ``n``, updated before the margins, from μ = 20, σ = 100.

Differences from the reference (``mk-minchul/AdaFace`` ``head.py``):

- Class weights are ``(C, D)`` rows drawn N(0, 0.01²) like ``CombinedMarginLoss`` (reference: a ``(D, C)`` kernel
  of unit-renormalised uniform columns); the forward takes unnormalised embeddings and computes their norms.
- Only the target angle is clipped, after clamping every cosine to [−1 + ε, 1 − ε]: the same computation.
- The statistics update in training mode only (reference: every call); σ stays for a one-sample batch (reference:
  NaN). Under DDP each rank keeps its own statistics, as in the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError


class AdaFaceLoss(nn.Module):
    """AdaFace margin head: owns the class weights ``W`` (C, D) and the norm statistics; returns the CE."""

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        m: float = 0.4,
        h: float = 0.333,
        s: float = 64.0,
        t_alpha: float = 0.01,
    ) -> None:
        super().__init__()
        if embedding_dim < 1 or num_classes < 1:
            raise ConfigError(f"AdaFace needs embedding_dim, num_classes ≥ 1, got {embedding_dim}, {num_classes}")
        if m < 0 or h <= 0 or s <= 0 or not 0.0 <= t_alpha <= 1.0:
            raise ConfigError(f"AdaFace needs m ≥ 0, h > 0, s > 0, 0 ≤ t_alpha ≤ 1; got m={m}, h={h}, s={s}, t_alpha={t_alpha}")
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.m, self.h, self.s, self.t_alpha = float(m), float(h), float(s), float(t_alpha)
        self.eps = 1e-3
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_dim))
        nn.init.normal_(self.weight, std=0.01)
        # Running statistics of the clipped feature norm; the reference's starting values.
        self.register_buffer("batch_mean", torch.tensor(20.0))
        self.register_buffer("batch_std", torch.tensor(100.0))

    def extra_repr(self) -> str:
        return (
            f"classes={self.num_classes}, dim={self.embedding_dim}, m={self.m}, h={self.h}, s={self.s}, "
            f"t_alpha={self.t_alpha}"
        )

    def cosine(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``cos θ`` (B, C) between L2-normalised embeddings and class weights, in [−1 + ε, 1 − ε]."""
        x = F.normalize(embeddings.float(), dim=1)
        w = F.normalize(self.weight.float(), dim=1)
        # the clamp keeps acos and its gradient finite
        return (x @ w.t()).clamp(-1.0 + self.eps, 1.0 - self.eps)

    def safe_norms(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Feature norms (B,) clipped to [0.001, 100], detached: the norm is a quality signal, not a target."""
        return embeddings.detach().float().norm(dim=1).clamp(0.001, 100.0)

    @torch.no_grad()
    def update_norm_stats(self, norms: torch.Tensor) -> None:
        """EMA update of ``batch_mean`` / ``batch_std`` from one batch of safe norms (B,)."""
        a = self.t_alpha
        self.batch_mean.mul_(1.0 - a).add_(a * norms.mean())
        if norms.numel() > 1:  # the unbiased std of one sample is NaN
            self.batch_std.mul_(1.0 - a).add_(a * norms.std())

    def margin_scaler(self, norms: torch.Tensor) -> torch.Tensor:
        """ĝ (B,) in [−1, 1] from the current statistics (no update)."""
        z = (norms - self.batch_mean) / (self.batch_std + self.eps)  # ~66% within ±1 for normal norms
        # 68% of ĝ within ±0.333 when h=0.333
        return (z * self.h).clamp(-1.0, 1.0)

    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scaled AdaFace logits (B, C) for unnormalised embeddings (B, D); updates the norm EMA in training."""
        norms = self.safe_norms(embeddings)
        if self.training:
            self.update_norm_stats(norms)
        g = self.margin_scaler(norms).unsqueeze(1)  # (B, 1)
        cosine = self.cosine(embeddings)
        idx = labels.long().view(-1, 1)
        theta = torch.acos(cosine.gather(1, idx))  # (B, 1), target angle
        theta = (theta - self.m * g).clamp(self.eps, math.pi - self.eps)  # g_angle = −m·ĝ
        target = torch.cos(theta) - (self.m + self.m * g)  # g_add = m + m·ĝ
        return self.s * cosine.scatter(1, idx, target)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the AdaFace logits; ``embeddings`` must be unnormalised (B, D)."""
        return F.cross_entropy(self.logits(embeddings, labels), labels.long())
