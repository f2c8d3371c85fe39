"""Contrastive losses of generalized category discovery (GCD, Vaze et al., CVPR 2022; used by FaceGCD).

Every function takes the embeddings of two augmented views of the same ``B`` images, ``z1`` and ``z2`` (B, d),
L2-normalises them and works on the ``2B`` views ``z = [z1; z2]``, with ``s_ij = z_i·z_j/τ``. Each view ``i`` is
an anchor; its denominator runs over every other view, ``A(i) = {a ≠ i}``.

Differences from the reference (GCD's ``info_nce_logits`` + ``SupConLoss``; FaceGCD App. A.1):

- Means over anchors instead of the paper's sums over the batch (GCD's code takes means too).
- SupCon without Khosla et al.'s ``τ/τ_base`` factor (1 at their defaults τ = τ_base = 0.07).
- The paper writes ``(1 − τ)`` in front of the unsupervised term; it means ``(1 − λ)`` (GCD's code).
- GCD's code uses τ = 1.0 for InfoNCE and 0.07 for SupCon, the FaceGCD paper 1.0 for both; our default is
  0.07 for both (``temperature`` and ``sup_temperature`` set them apart).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ml.errors import DataError


def _views(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits ``s = z·zᵀ/τ`` of the 2B normalised views with the diagonal at −∞: (2B, 2B)."""
    if z1.ndim != 2 or z1.shape != z2.shape:
        raise DataError(f"contrastive loss: z1 and z2 must both be (B, d), got {tuple(z1.shape)} and {tuple(z2.shape)}")
    if z1.shape[0] < 1:
        raise DataError("contrastive loss: the batch is empty")
    if not temperature > 0:
        raise DataError(f"contrastive loss: temperature must be > 0, got {temperature}")
    z = F.normalize(torch.cat([z1, z2]), dim=1)  # (2B, d)
    logits = z @ z.T / temperature  # (2B, 2B)
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    return logits.masked_fill(eye, float("-inf"))


def unsup_contrastive_loss(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.07) -> torch.Tensor:
    """SimCLR InfoNCE (NT-Xent): the other view of the same image is the only positive.

    ``L_u = mean_i −log( exp(s_{i,i⁺}) / Σ_{a≠i} exp(s_ia) )`` over the 2B views, ``i⁺`` = the other view of i.
    Needs B ≥ 1; with B = 1 the positive is the only candidate and the loss is 0.
    """
    logits = _views(z1, z2, temperature)
    b = z1.shape[0]
    target = (torch.arange(2 * b, device=logits.device) + b) % (2 * b)  # view i of image k ↔ the other view of k
    return F.cross_entropy(logits, target)


def supcon_loss(
    z1: torch.Tensor, z2: torch.Tensor, labels: torch.Tensor, temperature: float = 0.07
) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al., NeurIPS 2020, L^sup_out): all views with the anchor's label
    are positives, its own other view included.

    ``L_s = mean_i −1/|P(i)| Σ_{p∈P(i)} log( exp(s_ip) / Σ_{a≠i} exp(s_ia) )``, ``P(i) = {p ≠ i : y_p = y_i}``
    (never empty: the other view of i is in it). ``labels`` (B,) integers.
    """
    logits = _views(z1, z2, temperature)
    if labels.shape != (z1.shape[0],):
        raise DataError(f"supcon_loss: labels must be ({z1.shape[0]},), got {tuple(labels.shape)}")
    y = torch.cat([labels, labels]).to(logits.device)  # (2B,)
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)  # (2B, 2B), −∞ on the diagonal
    positive = (y[:, None] == y[None, :]).fill_diagonal_(False)
    per_anchor = torch.where(positive, log_prob, 0.0).sum(1) / positive.sum(1)
    return -per_anchor.mean()


def gcd_loss_terms(
    z1: torch.Tensor,
    z2: torch.Tensor,
    labels: torch.Tensor,
    labelled_mask: torch.Tensor,
    lam: float = 0.35,
    temperature: float = 0.07,
    sup_temperature: float | None = None,
) -> dict[str, torch.Tensor]:
    """GCD's semi-supervised contrastive objective and its parts: ``{"loss", "unsup", "sup"}``.

    ``loss = (1 − λ)·L_u(all B images) + λ·L_s(labelled images only)``; ``L_s = 0`` when the batch has no
    labelled image. ``labels`` (B,) are read only where ``labelled_mask`` (B,) bool is true. ``sup_temperature``
    defaults to ``temperature``.
    """
    if labelled_mask.shape != (z1.shape[0],) or labelled_mask.dtype != torch.bool:
        raise DataError(f"gcd_loss: labelled_mask must be bool ({z1.shape[0]},), got {labelled_mask.dtype} "
                        f"{tuple(labelled_mask.shape)}")
    if labels.shape != (z1.shape[0],):
        raise DataError(f"gcd_loss: labels must be ({z1.shape[0]},), got {tuple(labels.shape)}")
    if not 0.0 <= lam <= 1.0:
        raise DataError(f"gcd_loss: lam must lie in [0, 1], got {lam}")
    unsup = unsup_contrastive_loss(z1, z2, temperature)
    mask = labelled_mask.to(z1.device)
    if bool(mask.any()):
        sup = supcon_loss(z1[mask], z2[mask], labels.to(z1.device)[mask],
                          temperature if sup_temperature is None else sup_temperature)
    else:
        sup = torch.zeros((), dtype=unsup.dtype, device=unsup.device)
    return {"loss": (1.0 - lam) * unsup + lam * sup, "unsup": unsup, "sup": sup}


def gcd_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    labels: torch.Tensor,
    labelled_mask: torch.Tensor,
    lam: float = 0.35,
    temperature: float = 0.07,
    sup_temperature: float | None = None,
) -> torch.Tensor:
    """``(1 − λ)·L_u + λ·L_s`` as in ``gcd_loss_terms`` (a scalar)."""
    return gcd_loss_terms(z1, z2, labels, labelled_mask, lam, temperature, sup_temperature)["loss"]


__all__ = ["gcd_loss", "gcd_loss_terms", "supcon_loss", "unsup_contrastive_loss"]
