"""The DFA aligner's losses: the smooth-L1 landmark loss on the pooled output plus the per-anchor term over the
face, and the face-score losses (RetinaFace's anchor cross-entropy with hard negatives, a BCE on the pooled score).

    L = mean_{b,k,c} ℓ_β(L̂_bkc − L_bkc) + λ · Σ_{b,a∈N_b} mean_{k,c} ℓ_β(l̂_bakc − L_bkc) / Σ_b |N_b|,
    ℓ_β(d) = d²/(2β) if |d| < β else |d| − β/2      (smooth L1, coordinates in crop units [0, 1])

with ``L̂`` the mixer-pooled landmarks, ``l̂_a`` anchor ``a``'s decoded landmarks and ``N_b`` the anchors centred
inside face ``b``'s landmark bounding box grown by ``anchor_radius`` of its size (:func:`near_anchors`).
``ml.aligner.train`` lists where these depart from the paper; ``docs/methods/aligner.md`` gives the recipe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FAR_PAD", "hard_negatives", "landmark_loss", "near_anchors", "score_losses"]

FAR_PAD = 0.5  # face crops: anchors centred outside the landmark box grown by this (per side) are background


def near_anchors(priors: torch.Tensor, target: torch.Tensor, radius: float) -> torch.Tensor:
    """(B, A) bool: anchors whose centre lies in the landmarks' bounding box grown by ``radius`` of its size
    on each side (the face region); ``radius < 0`` selects every anchor."""
    if radius < 0:
        return torch.ones(target.shape[0], priors.shape[0], dtype=torch.bool, device=target.device)
    lo, hi = target.min(dim=1).values, target.max(dim=1).values  # (B, 2)
    pad = radius * (hi - lo)
    c = priors[None, :, :2]  # (1, A, 2)
    return ((c >= (lo - pad)[:, None]) & (c <= (hi + pad)[:, None])).all(dim=-1)


def hard_negatives(hardness: torch.Tensor, candidates: torch.Tensor, quota: torch.Tensor) -> torch.Tensor:
    """(B, A) bool: per row, the ``quota[b]`` candidate anchors with the highest ``hardness`` (ties by index).

    ``candidates`` (B, A) bool, ``quota`` (B,) integers (more than a row's candidates selects them all).
    """
    masked = hardness.detach().masked_fill(~candidates, float("-inf"))
    order = masked.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return candidates & (rank < quota.to(rank.dtype).unsqueeze(1))


def score_losses(
    out: dict[str, torch.Tensor],
    target: torch.Tensor,
    face: torch.Tensor,
    priors: torch.Tensor,
    anchor_radius: float,
    negative_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-anchor cross-entropy with hard negatives, BCE of the pooled score) for one batch.

    ``out`` is ``DFA.forward``'s output, ``target`` (B, 5, 2) normalised landmarks (ignored where ``face``
    (B,) bool is false). Positives ``P``: anchors of face crops centred in the landmark box grown by
    ``anchor_radius`` (:func:`near_anchors`). Negative candidates: every anchor of a non-face crop, and the
    anchors of a face crop centred outside its box grown by ``max(anchor_radius, 0) + FAR_PAD`` (the ring
    between is ignored). Of those, :func:`hard_negatives` keeps per crop the ``⌈r·|P_b|⌉`` with the largest
    loss (``r = negative_ratio``; a non-face crop uses the batch's mean |P_b| over face crops), so

        L_anchor = (Σ_{a∈P} −log p_a + Σ_{a∈H} −log(1 − p_a)) / max(1, |P| + |H|),  p_a = softmax(s_a)₁,
        L_pool = mean_b BCE(clamp(ŝ_b, 1e-6, 1 − 1e-6), [b is a face]),  ŝ_b = Σ_a sg(w_ba) p_ba,

    ``ŝ`` being the model's pooled score with the pooling weights ``w`` (``out["weights"]``) under a stop-gradient
    ``sg``: the BCE trains the anchors' scores (those the pooling attends to most) and the features under them,
    while the weights stay the landmark loss's alone, so the score cannot be bought by re-weighting anchors
    away from the ones that place the landmarks best. Both terms are 0 with a zero gradient when there is
    nothing to score (no anchors selected / an empty batch).
    """
    logits = out["anchor_scores"]
    face = face.to(torch.bool)
    near = near_anchors(priors, target, anchor_radius)
    positives = near & face.unsqueeze(1)
    inside = near_anchors(priors, target, max(anchor_radius, 0.0) + FAR_PAD)
    candidates = torch.where(face.unsqueeze(1), ~inside & ~positives, torch.ones_like(inside))
    logp = logits.float().log_softmax(dim=-1)  # (B, A, 2)
    ce_face, ce_background = -logp[..., 1], -logp[..., 0]
    n_pos = positives.sum(dim=1).float()  # (B,)
    mean_pos = n_pos[face].mean() if bool(face.any()) else n_pos.new_zeros(())
    quota = torch.ceil(negative_ratio * torch.where(face, n_pos, mean_pos)).long()
    hard = hard_negatives(ce_background, candidates, quota)
    count = (positives.sum() + hard.sum()).clamp_min(1).to(logp.dtype)
    zero = logp.new_zeros(())
    anchor = (torch.where(positives, ce_face, zero).sum() + torch.where(hard, ce_background, zero).sum()) / count
    pooled = (out["weights"].detach().float() * logp[..., 1].exp()).sum(dim=1)  # (B,), = out["score"] in value
    if pooled.numel() == 0:
        return anchor, pooled.sum()
    bce = F.binary_cross_entropy(pooled.clamp(1e-6, 1.0 - 1e-6), face.float())
    return anchor, bce


def landmark_loss(
    out: dict[str, torch.Tensor], target: torch.Tensor, priors: torch.Tensor, *, beta: float, anchor_weight: float,
    anchor_radius: float,
) -> torch.Tensor:
    """The landmark loss ``L`` (module docstring) of face crops: ``β = beta``, ``λ = anchor_weight``."""
    loss = F.smooth_l1_loss(out["landmarks"], target, beta=beta)
    if anchor_weight > 0:
        per_anchor = out["anchor_landmarks"]  # (B, A, 5, 2)
        err = F.smooth_l1_loss(per_anchor, target.unsqueeze(1).expand_as(per_anchor), beta=beta,
                               reduction="none").mean(dim=(2, 3))  # (B, A)
        near = near_anchors(priors, target, anchor_radius).to(err.dtype)
        loss = loss + anchor_weight * (err * near).sum() / near.sum().clamp_min(1.0)
    return loss
