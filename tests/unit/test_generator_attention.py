"""UIFace attention processors: stock-exact attention, recording, same-batch injection (Eq. 6–7 as the public code
reads them), the adaptive-switch map h_t, and every bad input."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import UNet2DConditionModel
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from tests.conftest import tiny_unet
from ml.errors import ConfigError, DataError
from ml.generator.attention import (
    AttentionControl,
    AttentionRecord,
    Injection,
    UIFaceAttnProcessor,
    attention_control,
    standardise_cross_logits,
    switch_map,
)

pytestmark = pytest.mark.usefixtures("one_thread")

B, C, S, D = 3, 3, 8, 16  # batch, channels, spatial size, context width


@pytest.fixture(scope="module")
def unet() -> UNet2DConditionModel:
    return tiny_unet()


def _inputs(tokens: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, S, S, generator=g)
    return x, torch.randn(B, tokens, D, generator=g), torch.randn(1, tokens, D, generator=g)


@torch.no_grad()
def _stock(unet, x, t, ctx) -> torch.Tensor:
    before = unet.attn_processors
    unet.set_attn_processor(AttnProcessor())
    try:
        return unet(x, t, encoder_hidden_states=ctx).sample
    finally:
        unet.set_attn_processor(before)


# ---------------------------------------------------------------------------------------- stock equivalence
@pytest.mark.parametrize("tokens", [1, 3])
def test_processors_reproduce_the_stock_processor_bit_for_bit(unet, tokens) -> None:
    x, c, _ = _inputs(tokens)
    stock = _stock(unet, x, 500, c)
    with torch.no_grad(), attention_control(unet) as control:
        plain = unet(x, 500, encoder_hidden_states=c).sample
        control.record_cross = control.record_self = True
        recorded = unet(x, 500, encoder_hidden_states=c).sample
    assert torch.equal(plain, stock) and torch.equal(recorded, stock)
    with torch.no_grad():
        sdpa = unet(x, 500, encoder_hidden_states=c).sample  # the default AttnProcessor2_0 (SDPA): same math
    assert torch.allclose(sdpa, stock, atol=1e-5)


def test_context_manager_installs_everywhere_and_restores_the_originals(unet) -> None:
    before = unet.attn_processors
    assert all(isinstance(p, AttnProcessor2_0) for p in before.values())
    with pytest.raises(RuntimeError, match="inside"), attention_control(unet) as control:
        procs = unet.attn_processors
        assert set(procs) == set(before) and len(procs) == 8
        assert all(isinstance(p, UIFaceAttnProcessor) and p.control is control for p in procs.values())
        assert [p.name for p in procs.values()] == list(procs)
        raise RuntimeError("an error inside the block")
    after = unet.attn_processors
    assert all(after[k] is before[k] for k in before)


def test_records_hold_the_logits_of_every_layer(unet) -> None:
    x, c, _ = _inputs(tokens=3)
    with torch.no_grad(), attention_control(unet, AttentionControl(record_cross=True)) as control:
        unet(x, 500, encoder_hidden_states=c)
        assert set(control.records) == {k for k in unet.attn_processors if k.endswith("attn2.processor")}
        control.record_self = True
        control.clear()
        unet(x, 500, encoder_hidden_states=c)
    assert len(control.records) == 8
    for name, record in control.records.items():
        q = 64 if "mid_block" not in name else 16  # 8×8 or 4×4 queries
        assert record.cross == name.endswith("attn2.processor") and record.heads == 2
        assert record.logits.shape == (B * 2, q, 3 if record.cross else q)
        assert record.per_head().shape == (B, 2, q, 3 if record.cross else q)


# ----------------------------------------------------------------------------------------------- injection
@pytest.mark.parametrize("blend", [0.0, 0.5, 1.0])
def test_injection_between_identical_passes_changes_nothing(unet, blend) -> None:
    """Conditional context = empty context: the injected logits are the pass's own, up to rounding."""
    x, _, ce = _inputs(tokens=3)
    ctx = ce.expand(B, -1, -1)
    stock = _stock(unet, x, 300, ctx)
    pairs = Injection(targets=torch.arange(B, 2 * B), sources=torch.arange(B), blend=blend)
    with torch.no_grad(), attention_control(unet, AttentionControl(injection=pairs)):
        out = unet(torch.cat([x, x]), 300, encoder_hidden_states=torch.cat([ctx, ctx])).sample
    assert torch.allclose(out[:B], stock, atol=1e-5) and torch.allclose(out[B:], stock, atol=1e-5)


def test_injected_self_attention_logits_are_the_captured_ones(unet) -> None:
    x, c, ce = _inputs(tokens=3)
    batch, ctx = torch.cat([x, x]), torch.cat([ce.expand(B, -1, -1), c])
    pairs = Injection(targets=torch.tensor([3, 4, 5]), sources=torch.tensor([0, 1, 2]))
    with torch.no_grad(), attention_control(unet, AttentionControl(record_self=True)) as control:
        unet(x, 300, encoder_hidden_states=ce.expand(B, -1, -1))  # a separate empty-context pass: the capture
        captured = dict(control.records)
        control.clear()
        control.injection = pairs
        injected = unet(batch, 300, encoder_hidden_states=ctx).sample
    for name, record in control.records.items():
        logits = record.per_head()  # (2B, heads, Q, Q)
        assert torch.equal(logits[B:], logits[:B]), name
        assert torch.allclose(logits[B:], captured[name].per_head(), rtol=1e-5, atol=1e-4), name
    plain = _stock(unet, x, 300, c)
    assert not torch.allclose(injected[B:], plain, atol=1e-3)  # the injection does change the conditional pass


def _small_attention() -> Attention:
    torch.manual_seed(1)
    return Attention(query_dim=8, cross_attention_dim=6, heads=2, dim_head=4).eval()


def _hand_logits(attn: Attention, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """(heads, Q, K) = q·kᵀ/sqrt(d) for one sample, from the projections."""
    q = attn.to_q(h).view(h.shape[0], 2, 4).transpose(0, 1)
    k = attn.to_k(e).view(e.shape[0], 2, 4).transpose(0, 1)
    return q @ k.transpose(1, 2) / math.sqrt(4)


def test_cross_logits_get_the_blended_mean_and_std_per_query() -> None:
    attn = _small_attention()
    g = torch.Generator().manual_seed(2)
    hidden, context = torch.randn(2, 5, 8, generator=g), torch.randn(2, 3, 6, generator=g)  # Q = 5, K = 3
    control = AttentionControl(record_cross=True, injection=Injection(torch.tensor([1]), torch.tensor([0]), blend=0.25))
    attn.set_processor(UIFaceAttnProcessor("layer", control))
    with torch.no_grad():
        out = attn(hidden, encoder_hidden_states=context)
        raw_e, raw_c = _hand_logits(attn, hidden[0], context[0]), _hand_logits(attn, hidden[1], context[1])
        attn.set_processor(AttnProcessor())
        stock = attn(hidden, encoder_hidden_states=context)
    got = control.records["layer"].per_head()  # (2, heads, Q, K)
    assert torch.allclose(got[0], raw_e, atol=1e-6)  # the source row is untouched
    mean, std = got[1].mean(-1), got[1].std(-1, correction=0)
    assert torch.allclose(mean, 0.25 * raw_e.mean(-1) + 0.75 * raw_c.mean(-1), atol=1e-6)
    assert torch.allclose(std, 0.25 * raw_e.std(-1, correction=0) + 0.75 * raw_c.std(-1, correction=0), atol=1e-6)
    z = (raw_c - raw_c.mean(-1, keepdim=True)) / raw_c.std(-1, correction=0, keepdim=True)
    assert torch.allclose((got[1] - mean[..., None]) / std[..., None], z, atol=1e-5)  # the pattern is c's
    assert torch.equal(out[0], stock[0]) and not torch.allclose(out[1], stock[1], atol=1e-4)


def test_standardisation_endpoints_and_a_single_token() -> None:
    g = torch.Generator().manual_seed(3)
    s_c, s_e = torch.randn(2, 7, 4, generator=g) * 3 + 1, torch.randn(2, 7, 4, generator=g)
    assert torch.allclose(standardise_cross_logits(s_c, s_e, 0.0), s_c, atol=1e-5)
    one = standardise_cross_logits(s_c, s_e, 1.0)
    assert torch.allclose(one.mean(-1), s_e.mean(-1), atol=1e-5)
    assert torch.allclose(one.std(-1, correction=0), s_e.std(-1, correction=0), atol=1e-5)
    single = standardise_cross_logits(s_c[..., :1], s_e[..., :1], 0.5)  # L = 1: σ = 0, the blended mean
    assert torch.isfinite(single).all() and torch.allclose(single, 0.5 * (s_c[..., :1] + s_e[..., :1]))


def test_cross_injection_cannot_act_on_a_single_context_token(unet) -> None:
    """Softmax over one key is 1: with L = 1 only the self-attention replacement changes the conditional pass."""
    x, c, ce = _inputs(tokens=1)
    batch, ctx = torch.cat([x, x]), torch.cat([ce.expand(B, -1, -1), c])
    cross_only = Injection(torch.arange(B, 2 * B), torch.arange(B), self_attention=False)
    with torch.no_grad():
        plain = unet(batch, 700, encoder_hidden_states=ctx).sample
        with attention_control(unet, AttentionControl(injection=cross_only)):
            injected = unet(batch, 700, encoder_hidden_states=ctx).sample
    assert torch.allclose(injected, plain, atol=1e-5)


# --------------------------------------------------------------------------------------------- switch map h_t
def test_switch_map_hand_computed() -> None:
    """One layer, one head, one key, 2×2 queries with logits log(1..4): softmax over queries ∝ 1..4,
    ÷ max → ¼..1, min–max → 0, ⅓, ⅔, 1; a constant shift of the logits (softmax invariance) changes nothing."""
    logits = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0])).view(1, 4, 1)
    h = switch_map({"a": AttentionRecord(logits, heads=1, cross=True)}, (2, 2))
    assert torch.allclose(h, torch.tensor([[[0.0, 1 / 3], [2 / 3, 1.0]]]), atol=1e-6)
    shifted = switch_map({"a": AttentionRecord(logits + 5.0, heads=1, cross=True)}, (2, 2))
    assert torch.allclose(shifted, h, atol=1e-6)


def test_switch_map_averages_heads_keys_and_layers_at_a_common_size() -> None:
    g = torch.Generator().manual_seed(4)
    fine = torch.randn(2 * 3, 16, 2, generator=g)  # 2 samples × 3 heads, 4×4 queries, 2 keys
    coarse = torch.randn(2 * 3, 4, 2, generator=g)  # 2×2 queries
    records = {
        "fine": AttentionRecord(fine, 3, True),
        "self": AttentionRecord(torch.randn(6, 16, 16, generator=g), 3, False),  # ignored
        "coarse": AttentionRecord(coarse, 3, True),
    }
    h = switch_map(records, (4, 4))
    assert h.shape == (2, 4, 4)
    flat = h.flatten(1)
    assert torch.allclose(flat.amax(1), torch.ones(2)) and torch.allclose(flat.amin(1), torch.zeros(2))
    # hand: per layer softmax over queries, mean over keys and heads, ÷ per-sample max, resize, mean, min–max
    maps = []
    for logits, side in ((fine, 4), (coarse, 2)):
        m = logits.view(2, 3, side * side, 2).softmax(dim=2).mean(dim=(1, 3))
        m = (m / m.amax(1, keepdim=True)).view(2, 1, side, side)
        maps.append(torch.nn.functional.interpolate(m, size=(4, 4), mode="bilinear", align_corners=False)[:, 0])
    mean = (maps[0] + maps[1]) / 2
    lo, hi = mean.flatten(1).amin(1)[:, None, None], mean.flatten(1).amax(1)[:, None, None]
    assert torch.allclose(h, (mean - lo) / (hi - lo), atol=1e-6)
    assert torch.allclose(switch_map(records, (4, 4), rows=slice(1, 2)), h[1:], atol=1e-6)


def test_switch_map_of_a_unet_pass(unet) -> None:
    x, _, ce = _inputs()
    with torch.no_grad(), attention_control(unet, AttentionControl(record_cross=True)) as control:
        unet(x, 800, encoder_hidden_states=ce.expand(B, -1, -1))
    h = switch_map(control.cross_records(), (S, S))
    assert h.shape == (B, S, S) and torch.isfinite(h).all() and h.min() >= 0 and h.max() <= 1


# ----------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise(unet) -> None:
    with pytest.raises(ConfigError, match="pair one source row"):
        Injection(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ConfigError, match="blend"):
        Injection(torch.tensor([1]), torch.tensor([0]), blend=1.5)
    with pytest.raises(ConfigError, match="targets"):
        Injection([1], torch.tensor([0]))
    with pytest.raises(ConfigError, match="no diffusers attention-processor API"):
        with attention_control(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(ConfigError, match="record_cross"):
        switch_map({}, (S, S))
    with pytest.raises(DataError, match="do not tile"):
        switch_map({"odd": AttentionRecord(torch.randn(1, 7, 1), 1, True)}, (4, 4))
    x, c, _ = _inputs()
    outside = Injection(torch.tensor([B + 5]), torch.tensor([0]))
    with pytest.raises(ConfigError, match="outside the batch"), torch.no_grad():
        with attention_control(unet, AttentionControl(injection=outside)):
            unet(x, 10, encoder_hidden_states=c)
    assert all(isinstance(p, AttnProcessor2_0) for p in unet.attn_processors.values())
