"""Attention capture and injection for UIFace sampling, as diffusers attention processors (paper Sec. 3.3–3.4).

``UIFaceAttnProcessor`` runs the stock ``AttnProcessor`` operations in order (bit for bit equal when nothing is
injected) and records the pre-softmax logits (B·heads, Q, K); ``attention_control(unet)`` installs one per
``Attention`` module around a shared ``AttentionControl``. ``Injection`` pairs rows of one batch, empty-context pass
→ conditional pass: self-attention logits are copied (``S^c = S^{c_e}``); cross-attention logits, per query over
the keys, become ``(S_c − μ_c)/σ_c · (a·σ_e + (1−a)·σ_c) + a·μ_e + (1−a)·μ_c`` (a = ``blend``). ``switch_map``:
h_t (B, H, W), per layer softmax over queries, mean over keys and heads, max-normalised, resized; layer mean, min–max.

Differences from the reference (paper Eq. 6–7; public ``generation/uiface/models/diffusion/nn.py``):
- Eq. 7 rescales the c_e map with the conditional statistics; the code, followed here, standardises the conditional
  logits (over the keys, not "spatially"; before the softmax) with a 50/50 blend. Population std (the code's
  unbiased one gives the same ratio σ/σ_c), σ_c ≥ 1e-6.
- Source and target rows share one UNet call, so no (B·heads, Q, Q) self-attention maps wait between two passes.
- With one context token the cross-attention injection cannot act (softmax over one key); the public model has 32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention

from ml.errors import ConfigError, DataError

__all__ = [
    "AttentionControl",
    "AttentionRecord",
    "Injection",
    "UIFaceAttnProcessor",
    "attention_control",
    "install_attention_processors",
    "remove_attention_processors",
    "standardise_cross_logits",
    "switch_map",
]

STD_EPS = 1e-6  # floor of σ_c in the cross-attention standardisation (logit units)


@dataclass(frozen=True)
class AttentionRecord:
    """Logits of one attention layer in one forward, as they entered the softmax (after any injection)."""

    logits: torch.Tensor  # (B·heads, Q, K), batch-major rows: row b·heads + h
    heads: int
    cross: bool

    def per_head(self) -> torch.Tensor:
        """(B, heads, Q, K) view of the logits."""
        bh, q, k = self.logits.shape
        return self.logits.view(bh // self.heads, self.heads, q, k)


@dataclass(frozen=True)
class Injection:
    """Rows ``targets`` of the batch take attention from rows ``sources`` of the same batch (paired in order)."""

    targets: torch.Tensor  # (N,) long: rows of the conditional pass
    sources: torch.Tensor  # (N,) long: rows of the empty-context pass
    blend: float = 0.5  # weight a of the empty-context statistics in the cross-attention rescaling
    self_attention: bool = True  # replace self-attention logits
    cross_attention: bool = True  # standardise and rescale cross-attention logits

    def __post_init__(self) -> None:
        for key in ("targets", "sources"):
            rows = getattr(self, key)
            if not isinstance(rows, torch.Tensor) or rows.ndim != 1 or rows.dtype != torch.long:
                raise ConfigError(f"Injection.{key} must be a 1-D LongTensor of batch rows, got {rows!r}")
        if self.targets.shape != self.sources.shape:
            raise ConfigError(
                f"Injection.targets ({self.targets.numel()} rows) and Injection.sources ({self.sources.numel()} rows) "
                "must pair one source row with each target row"
            )
        if not (isinstance(self.blend, (int, float)) and math.isfinite(self.blend) and 0.0 <= self.blend <= 1.0):
            raise ConfigError(f"Injection.blend = {self.blend!r} must lie in [0, 1] (public code: 0.5)")


@dataclass
class AttentionControl:
    """State shared by the processors of one UNet: what the next forwards record and inject.

    ``records`` maps a processor name (``unet.attn_processors`` key) to the last ``AttentionRecord`` of that layer;
    call ``clear()`` between forwards whose records should not mix.
    """

    record_cross: bool = False
    record_self: bool = False
    injection: Injection | None = None
    records: dict[str, AttentionRecord] = field(default_factory=dict)

    def clear(self) -> None:
        self.records.clear()

    def cross_records(self) -> dict[str, AttentionRecord]:
        return {name: r for name, r in self.records.items() if r.cross}


def standardise_cross_logits(
    logits: torch.Tensor, source: torch.Tensor, blend: float, eps: float = STD_EPS
) -> torch.Tensor:
    """``(S − μ_c)/σ_c · (a·σ_e + (1−a)·σ_c) + (a·μ_e + (1−a)·μ_c)``, statistics over the last axis (keys).

    ``logits`` S_c and ``source`` S_e are (..., Q, K) of the conditional and the empty-context pass (public UIFace
    ``qkv_attention``; the paper's Eq. 6–7 with the blend of the code, see the module docstring).
    """
    mu_c = logits.mean(dim=-1, keepdim=True)
    sd_c = logits.std(dim=-1, correction=0, keepdim=True)
    mu_e = source.mean(dim=-1, keepdim=True)
    sd_e = source.std(dim=-1, correction=0, keepdim=True)
    mu = blend * mu_e + (1.0 - blend) * mu_c
    sd = blend * sd_e + (1.0 - blend) * sd_c
    return (logits - mu_c) / sd_c.clamp_min(eps) * sd + mu


class UIFaceAttnProcessor:
    """Stock ``AttnProcessor`` math plus recording and same-batch injection, driven by a shared ``AttentionControl``."""

    def __init__(self, name: str, control: AttentionControl) -> None:
        self.name = name
        self.control = control

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        cross = encoder_hidden_states is not None
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = attn.head_to_batch_dim(query)  # (B·heads, Q, d)
        key = attn.head_to_batch_dim(key)  # (B·heads, K, d)
        value = attn.head_to_batch_dim(value)

        # Attention.get_attention_scores, split so that the logits can be recorded and replaced.
        dtype = query.dtype
        if attn.upcast_attention:
            query, key = query.float(), key.float()
        if attention_mask is None:
            baddbmm_input = torch.empty(
                query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype, device=query.device
            )
            beta = 0
        else:
            baddbmm_input = attention_mask
            beta = 1
        scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=attn.scale)
        del baddbmm_input
        if attn.upcast_softmax:
            scores = scores.float()

        scores = self._inject(attn, scores, cross, attention_mask)  # (B·heads, Q, K)
        control = self.control
        if (control.record_cross and cross) or (control.record_self and not cross):
            control.records[self.name] = AttentionRecord(scores.detach(), attn.heads, cross)

        attention_probs = scores.softmax(dim=-1).to(dtype)
        del scores

        hidden_states = torch.bmm(attention_probs, value)
        hidden_states = attn.batch_to_head_dim(hidden_states)
        hidden_states = attn.to_out[0](hidden_states)  # linear projection
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor

    def _inject(
        self, attn: Attention, scores: torch.Tensor, cross: bool, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        inj = self.control.injection
        if inj is None or inj.targets.numel() == 0 or not (inj.cross_attention if cross else inj.self_attention):
            return scores
        if attention_mask is not None:
            raise ConfigError(
                f"attention layer {self.name}: attention injection with an attention mask is not supported (the "
                "masked logits would enter the statistics); sample without encoder_attention_mask"
            )
        per_head = scores.view(scores.shape[0] // attn.heads, attn.heads, *scores.shape[1:])  # (B, heads, Q, K)
        n = per_head.shape[0]
        rows = torch.cat([inj.targets, inj.sources])
        if int(rows.min()) < 0 or int(rows.max()) >= n:
            raise ConfigError(
                f"attention layer {self.name}: Injection rows {rows.tolist()} fall outside the batch of {n} samples"
            )
        targets, sources = inj.targets.to(scores.device), inj.sources.to(scores.device)
        source = per_head[sources]
        new = standardise_cross_logits(per_head[targets], source, inj.blend) if cross else source
        return per_head.index_copy(0, targets, new.to(per_head.dtype)).view_as(scores)


def install_attention_processors(unet: torch.nn.Module, control: AttentionControl) -> dict[str, object]:
    """Set a ``UIFaceAttnProcessor`` on every ``Attention`` module of ``unet``; return the original processors."""
    if not hasattr(unet, "attn_processors") or not hasattr(unet, "set_attn_processor"):
        raise ConfigError(
            f"{type(unet).__name__} has no diffusers attention-processor API (attn_processors / set_attn_processor); "
            "pass a diffusers UNet2DConditionModel"
        )
    originals = dict(unet.attn_processors)
    new: dict[str, object] = {}
    for name, processor in originals.items():
        module = unet.get_submodule(name.removesuffix(".processor"))
        new[name] = UIFaceAttnProcessor(name, control) if isinstance(module, Attention) else processor
    if not any(isinstance(p, UIFaceAttnProcessor) for p in new.values()):
        raise ConfigError(f"{type(unet).__name__} has no diffusers Attention module to install processors on")
    unet.set_attn_processor(new)
    return originals


def remove_attention_processors(unet: torch.nn.Module, originals: Mapping[str, object]) -> None:
    """Restore the processors returned by ``install_attention_processors``."""
    unet.set_attn_processor(dict(originals))  # set_attn_processor pops from the dict it is given


@contextmanager
def attention_control(unet: torch.nn.Module, control: AttentionControl | None = None) -> Iterator[AttentionControl]:
    """``with attention_control(unet) as control:`` UIFace processors on every Attention module, originals after."""
    control = AttentionControl() if control is None else control
    originals = install_attention_processors(unet, control)
    try:
        yield control
    finally:
        remove_attention_processors(unet, originals)


def _grid(queries: int, size: tuple[int, int], name: str) -> tuple[int, int]:
    """(h, w) of a layer's query grid with the aspect ratio of ``size``: h·w = Q, h/w = H/W."""
    height, width = size
    h = max(1, round(math.sqrt(queries * height / width)))
    w = queries // h
    if h * w != queries or h * width != w * height:
        raise DataError(
            f"attention layer {name} has {queries} queries, which do not tile a {height}×{width} map; "
            "give switch_map the sample's spatial size (H, W) of a UNet whose downsampling divides it"
        )
    return h, w


def switch_map(
    records: Mapping[str, AttentionRecord], size: tuple[int, int], rows: torch.Tensor | slice | None = None
) -> torch.Tensor:
    """``h_t`` (B, H, W) in [0, 1] from recorded cross-attention logits (module docstring; METHODS "UIFace").

    ``rows`` selects the batch rows (the empty-context pass) before any reduction; ``size`` is the common
    resolution (the sample's spatial size in the sampler; the reference uses the 32×32 latent).
    """
    maps = []
    for name, record in records.items():
        if not record.cross:
            continue
        logits = record.per_head().float()  # (B, heads, Q, K)
        if rows is not None:
            logits = logits[rows]
        m = logits.softmax(dim=2).mean(dim=(1, 3))  # (B, Q): softmax over queries, mean over heads and keys
        m = m / m.amax(dim=1, keepdim=True)  # per-sample max 1 (softmax > 0, so the max is positive)
        h, w = _grid(m.shape[1], size, name)
        m = F.interpolate(m.view(-1, 1, h, w), size=size, mode="bilinear", align_corners=False)
        maps.append(m.squeeze(1).clamp(0.0, 1.0))
    if not maps:
        raise ConfigError(
            "switch_map needs recorded cross-attention logits: set AttentionControl.record_cross and run the UNet "
            "with encoder_hidden_states inside attention_control(unet)"
        )
    mean = torch.stack(maps).mean(dim=0)  # (B, H, W)
    lo = mean.amin(dim=(1, 2), keepdim=True)
    hi = mean.amax(dim=(1, 2), keepdim=True)
    return (mean - lo) / (hi - lo).clamp_min(1e-12)  # a constant map gives zeros
