"""Additive/multiplicative angular margin softmax (ArcFace, CosFace, combined) holding the class weights.

With unit embedding ``x`` and unit class weights ``W_j`` (rows of ``(C, D)``), ``cos θ_j = x·W_j`` and the logits are
``z_j = s·cos θ_j`` for j ≠ y, ``z_y = s·(cos(m1·θ_y + m2) − m3)`` while ``m1·θ_y + m2 ≤ π`` and otherwise
``z_y = s·(cos θ_y − m2·sin m2 − m3)`` (insightface's fallback: the target logit keeps decreasing in θ, with a
downward step at the switch); the loss is the cross-entropy of ``z``. ArcFace = (1, 0.5, 0) [Deng et al., CVPR
2019], CosFace = (1, 0, 0.4) [Wang et al., CVPR 2018]; the unified form is LVFace's (Eq. 17) and insightface's.

Differences from the reference (insightface ``arcface_torch/losses.py``):

- Every (m1, m2, m3) is computed from the formula (insightface raises unless pure ArcFace or pure CosFace); for
  m1 ≠ 1 the switch is at m1·θ + m2 = π with the same fallback.
- The class weights live here, not in a PartialFC module: no negative sampling, no inter-class filtering.
- ArcFace's target is differentiated through ``cos θ·cos m2 − sin θ·sin m2`` (insightface's current code), not the
  older in-place ``arccos``/``cos`` under ``no_grad``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ml.errors import ConfigError

ARCFACE = dict(m1=1.0, m2=0.5, m3=0.0)
COSFACE = dict(m1=1.0, m2=0.0, m3=0.4)
MARGINS = {"arcface": ARCFACE, "cosface": COSFACE}


class CombinedMarginLoss(nn.Module):
    """Margin softmax head: owns the class weights ``W`` (C, D) and returns the cross-entropy."""

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        s: float = 64.0,
        m1: float = 1.0,
        m2: float = 0.5,
        m3: float = 0.0,
    ) -> None:
        super().__init__()
        if embedding_dim < 1 or num_classes < 1:
            raise ConfigError(f"margin head needs embedding_dim, num_classes ≥ 1, got {embedding_dim}, {num_classes}")
        if s <= 0 or m1 <= 0 or m2 < 0 or m3 < 0 or m2 >= math.pi:
            raise ConfigError(f"margin head needs s > 0, m1 > 0, 0 ≤ m2 < π, m3 ≥ 0; got s={s}, m={m1, m2, m3}")
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.s, self.m1, self.m2, self.m3 = float(s), float(m1), float(m2), float(m3)
        self.weight = nn.Parameter(torch.empty(num_classes, embedding_dim))
        nn.init.normal_(self.weight, std=0.01)
        # Target-logit switch: m1·θ + m2 ≤ π  ⇔  cos θ ≥ cos((π − m2)/m1) (θ ∈ [0, π]).
        self._threshold = math.cos(min((math.pi - self.m2) / self.m1, math.pi))
        self._fallback = math.sin(math.pi - self.m2) * self.m2

    def extra_repr(self) -> str:
        return f"classes={self.num_classes}, dim={self.embedding_dim}, s={self.s}, m=({self.m1}, {self.m2}, {self.m3})"

    def cosine(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``cos θ`` (B, C) between L2-normalised embeddings (B, D) and class weights, in [−1, 1]."""
        x = F.normalize(embeddings.float(), dim=1)
        w = F.normalize(self.weight.float(), dim=1)
        return (x @ w.t()).clamp(-1.0, 1.0)

    def target_logit(self, cos_t: torch.Tensor) -> torch.Tensor:
        """Margin-adjusted target cosine ``cos(m1·θ + m2) − m3`` with the θ + m > π fallback (unscaled)."""
        if self.m1 == 1.0 and self.m2 == 0.0:
            margin = cos_t
        elif self.m1 == 1.0:
            # cos(θ + m2) = cos θ·cos m2 − sin θ·sin m2; the clamp keeps the sqrt gradient finite at |cos θ| = 1
            sin_t = torch.sqrt((1.0 - cos_t * cos_t).clamp_min(1e-12))
            margin = cos_t * math.cos(self.m2) - sin_t * math.sin(self.m2)
        else:
            theta = torch.acos(cos_t.clamp(-1.0 + 1e-7, 1.0 - 1e-7))
            margin = torch.cos(self.m1 * theta + self.m2)
        if self.m2 > 0.0 or self.m1 > 1.0:
            margin = torch.where(cos_t > self._threshold, margin, cos_t - self._fallback)
        return margin - self.m3

    def apply_margin(self, cosine: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scaled logits (B, C) from ``cosine`` (B, C): margin on each row's target column only."""
        idx = labels.long().view(-1, 1)
        target = self.target_logit(cosine.gather(1, idx))
        return self.s * cosine.scatter(1, idx, target)

    def logits(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Scaled margin logits (B, C) for embeddings (B, D) and integer labels (B,)."""
        return self.apply_margin(self.cosine(embeddings), labels)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the margin logits."""
        return F.cross_entropy(self.logits(embeddings, labels), labels.long())
