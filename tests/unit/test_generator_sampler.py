"""UIFace sampler: DDIM against diffusers and a hand-run loop, the modes' limiting cases (fixed t0 outside the
schedule, adaptive thresholds at the extremes), cost accounting, the injection invariance, determinism, NaN
detection, and every bad config."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0

from tests.conftest import tiny_unet
from ml.errors import ConfigError, DataError, TrainingError
from ml.generator.sampler import DISTANCES, SamplerConfig, ddim_scheduler, sample

pytestmark = pytest.mark.usefixtures("one_thread")

B, C, S, D = 3, 3, 8, 16
SHAPE = (B, C, S, S)
STEPS = 10  # spacing 100 (900, 800, …, 0): every property below holds for any divisor of T; 50 only where stated


@pytest.fixture(scope="module")
def unet() -> UNet2DConditionModel:
    return tiny_unet()


@pytest.fixture(scope="module")
def contexts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, 1, D, generator=g), torch.randn(1, 1, D, generator=g)


def cfg(**kw) -> SamplerConfig:
    return SamplerConfig(**{"steps": STEPS, "attention_injection": False, **kw})


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding of differently batched UNet calls (the samples reach |x| ~ 10²)."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-4)


@torch.no_grad()
def hand_ddim(unet, context: torch.Tensor, steps: int = STEPS, seed: int = 0) -> torch.Tensor:
    """DDIM (η = 0) written out from the linear schedule in float64, with one context for every step."""
    betas = np.linspace(1e-4, 0.02, 1000, dtype=np.float32).astype(np.float64)
    abar = np.cumprod(1.0 - betas)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    for t in range(1000 - 1000 // steps, -1, -1000 // steps):
        eps = unet(x, t, encoder_hidden_states=context.expand(B, -1, -1)).sample.double()
        a_t, a_prev = abar[t], abar[t - 1000 // steps] if t >= 1000 // steps else 1.0
        x0 = (x.double() - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
        x = (math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps).float()
    return x


# --------------------------------------------------------------------------------------------------- DDIM
def test_scheduler_is_the_papers_ddim() -> None:
    s = ddim_scheduler(SamplerConfig())
    assert s.timesteps.tolist() == list(range(980, -1, -20))
    abar = np.cumprod(1.0 - np.linspace(1e-4, 0.02, 1000))
    assert np.allclose(s.alphas_cumprod.numpy(), abar, rtol=1e-5)
    g = torch.Generator().manual_seed(0)
    x, eps = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    for t, prev in ((980, 960), (0, None)):
        a_t, a_prev = abar[t], (abar[prev] if prev is not None else 1.0)  # ᾱ = 1 after the last step
        x0 = (x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)
        expected = math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps
        assert torch.allclose(s.step(eps, t, x).prev_sample, expected, atol=1e-4)


def test_ddim_matches_a_hand_run_loop_and_diffusers_stepping(unet, contexts) -> None:
    """Empty-context-only sampling (two_stage_fixed, t0 = 0) against the written-out DDIM and against a plain
    diffusers loop over the UNet with the stock AttnProcessor."""
    _, ce = contexts
    got = sample(unet, contexts[0], ce, SHAPE, cfg(mode="two_stage_fixed", t0=0))
    scheduler = DDIMScheduler(beta_schedule="linear", beta_start=1e-4, beta_end=0.02, clip_sample=False)
    scheduler.set_timesteps(STEPS)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    before = unet.attn_processors
    unet.set_attn_processor(AttnProcessor())  # the math the sampler's processors reproduce bit for bit
    try:
        with torch.no_grad():
            for t in scheduler.timesteps:
                x = scheduler.step(unet(x, t, encoder_hidden_states=ce.expand(B, -1, -1)).sample, t, x).prev_sample
    finally:
        unet.set_attn_processor(before)
    assert torch.equal(got.x0, x)  # same batch, same operations
    assert torch.allclose(got.x0, hand_ddim(unet, ce), rtol=1e-4, atol=1e-3)
    assert got.unet_evals.tolist() == [STEPS] * B and got.t0.tolist() == [0] * B and got.d_history is None


def test_a_v_prediction_unet_samples_as_diffusers_v_prediction_ddim(unet, contexts) -> None:
    """The sampler turns v into ε (ε = √ᾱ·v + √(1 − ᾱ)·x_t) before its guidance and DDIM step: the same UNet read as
    a v-model must follow diffusers' own v-prediction DDIM, and differ from reading it as an ε-model."""
    _, ce = contexts
    got = sample(unet, contexts[0], ce, SHAPE, cfg(mode="two_stage_fixed", t0=0, prediction_type="v_prediction"))
    scheduler = DDIMScheduler(beta_schedule="linear", beta_start=1e-4, beta_end=0.02, clip_sample=False,
                              prediction_type="v_prediction")
    scheduler.set_timesteps(STEPS)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(unet(x, t, encoder_hidden_states=ce.expand(B, -1, -1)).sample, t, x).prev_sample
    assert close(got.x0, x)
    assert not close(got.x0, sample(unet, contexts[0], ce, SHAPE, cfg(mode="two_stage_fixed", t0=0)).x0)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "edm"])
def test_each_parametrisation_s_exact_output_gives_back_the_noise(kind) -> None:
    """x_t from known x_0 and ε; the output a perfect UNet of each kind gives (ε; v; EDM's F) turns back into ε."""
    from ml.generator.sampler import edm_coefficients, epsilon_from

    g = torch.Generator().manual_seed(0)
    x0, eps = torch.rand(4, 3, 4, 4, generator=g).double() * 2 - 1, torch.randn(4, 3, 4, 4, generator=g).double()
    abar = torch.tensor([0.9999, 0.8, 0.3, 4e-5], dtype=torch.float64).view(4, 1, 1, 1)
    x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * eps
    c_skip, c_out = edm_coefficients(abar)
    out = {"epsilon": eps, "v_prediction": abar.sqrt() * eps - (1 - abar).sqrt() * x0,
           "edm": (x0 - c_skip * x_t / abar.sqrt()) / c_out}[kind]
    torch.testing.assert_close(epsilon_from(out, x_t, abar, kind), eps)
    # EDM's coefficients by hand at ᾱ = 0.8: σ² = 0.25 = σ_d², so c_skip = 1/2 and c_out = 0.25/√0.5
    assert float(c_skip[1]) == pytest.approx(0.5) and float(c_out[1]) == pytest.approx(0.25 / math.sqrt(0.5))
    assert float(c_skip[0]) > 0.99 and float(c_skip[3]) < 1e-3  # the identity at low noise, ~0 at high noise


def test_baseline_without_guidance_is_plain_conditional_ddim(unet, contexts) -> None:
    c, ce = contexts
    got = sample(unet, c, ce, SHAPE, cfg(mode="baseline", guidance_scale=0.0))
    scheduler = ddim_scheduler(cfg())
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(unet(x, t, encoder_hidden_states=c).sample, t, x).prev_sample
    assert close(got.x0, x)
    assert got.unet_evals.tolist() == [2 * STEPS] * B and got.t0.tolist() == [1000] * B


# ---------------------------------------------------------------------------------------------------- modes
def test_fixed_t0_above_the_schedule_is_the_baseline(unet, contexts) -> None:
    base = sample(unet, *contexts, SHAPE, cfg(mode="baseline"))
    fixed = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=1001))
    assert torch.equal(fixed.x0, base.x0) and torch.equal(fixed.unet_evals, base.unet_evals)


def test_fixed_t0_splits_the_schedule(unet, contexts) -> None:
    """t0 = 500: c_e only at 900…500 (5 steps), CFG at 400…0 (5 steps); equals adaptive with a hard switch at
    500 and a threshold that never fires."""
    fixed = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=500))
    assert fixed.t0.tolist() == [500] * B and fixed.unet_evals.tolist() == [5 + 2 * 5] * B
    base, ce_only = (sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=t0)) for t0 in (1000, 0))
    assert not close(fixed.x0, base.x0) and not close(fixed.x0, ce_only.x0)
    hard = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", threshold=1e-12, hard_switch_t=500))
    assert close(hard.x0, fixed.x0) and hard.t0.tolist() == [500] * B
    assert torch.equal(hard.unet_evals, fixed.unet_evals)


def test_adaptive_with_a_huge_threshold_switches_at_the_first_possible_step(unet, contexts) -> None:
    """d_t needs two maps: the first decision is at the second step (800), effective from the third."""
    got = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", threshold=1e9))
    assert got.t0.tolist() == [800] * B
    fixed = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=800))
    assert close(got.x0, fixed.x0) and torch.equal(got.unet_evals, fixed.unet_evals)


def test_adaptive_with_a_tiny_threshold_never_switches(unet, contexts) -> None:
    got = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", threshold=1e-12))
    ce_only = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=0))
    assert torch.equal(got.x0, ce_only.x0)  # the same single-pass batches
    assert got.t0.tolist() == [0] * B and got.unet_evals.tolist() == [STEPS] * B


def test_adaptive_switches_per_sample_where_d_first_falls_below_the_threshold(unet, contexts) -> None:
    """t0 of each sample = the first timestep whose d_t < th, the cost follows t0, and the adaptive sampler never
    costs more than the baseline (20 steps of 50 here)."""
    n = 20
    probe = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", steps=n, threshold=1e-12))
    d = probe.d_history
    assert d.shape == (n, B) and torch.isnan(d[0]).all() and torch.isfinite(d[1:]).all() and (d[1:] >= 0).all()
    th = float(d[1:].median())
    got = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", steps=n, threshold=th))
    timesteps = got.timesteps.tolist()
    for b in range(B):
        below = [i for i in range(1, n) if got.d_history[i, b] < th]
        assert below and got.t0[b] == timesteps[below[0]]
        # the same path up to t0 (up to the rounding of batches that grow as other samples switch)
        assert torch.allclose(got.d_history[1 : below[0] + 1, b], d[1 : below[0] + 1, b], atol=1e-6)
        assert got.unet_evals[b] == n + sum(t < got.t0[b] for t in timesteps)
    assert len(set(got.t0.tolist())) > 1  # samples switch at different timesteps
    base = sample(unet, *contexts, SHAPE, cfg(mode="baseline", steps=n))
    assert (got.unet_evals <= base.unet_evals).all() and got.unet_evals.sum() < base.unet_evals.sum()


@pytest.mark.parametrize("name", sorted(DISTANCES))
def test_distances_are_resolution_free(name) -> None:
    a, b = torch.zeros(1, 4, 4), torch.full((1, 4, 4), 0.5)
    assert torch.allclose(DISTANCES[name](a, b), torch.tensor([0.5]))
    big = torch.zeros(1, 32, 32)
    assert torch.allclose(DISTANCES[name](big, big + 0.5), torch.tensor([0.5]))


# ------------------------------------------------------------------------------------------------ injection
@pytest.mark.parametrize("mode", ["baseline", "two_stage_adaptive"])
def test_injection_with_identical_contexts_changes_nothing(unet, contexts, mode) -> None:
    """c = c_e: the conditional pass injects its own attention and CFG gives ε(c_e), i.e. c_e-only sampling."""
    _, ce = contexts
    same = ce.expand(B, -1, -1)
    got = sample(unet, same, ce, SHAPE, cfg(mode=mode, attention_injection=True, threshold=1e9))
    assert close(got.x0, sample(unet, same, ce, SHAPE, cfg(mode="two_stage_fixed", t0=0)).x0)


def test_injection_acts_and_the_processors_are_restored(unet, contexts) -> None:
    plain = sample(unet, *contexts, SHAPE, cfg(mode="baseline"))
    injected = sample(unet, *contexts, SHAPE, cfg(mode="baseline", attention_injection=True))
    assert not close(injected.x0, plain.x0)
    assert torch.equal(injected.unet_evals, plain.unet_evals)
    assert all(isinstance(p, AttnProcessor2_0) for p in unet.attn_processors.values())
    # stage 1 has no conditional pass: injection only acts from t0 on
    a, b = (
        sample(unet, *contexts, SHAPE, cfg(mode="two_stage_fixed", t0=0, attention_injection=i)) for i in (False, True)
    )
    assert torch.equal(a.x0, b.x0)


# ------------------------------------------------------------------------------------------ seeds, contexts
def test_determinism_by_seed_and_generator(unet, contexts) -> None:
    config = cfg(mode="two_stage_adaptive", attention_injection=True, threshold=0.01, seed=3)
    a, b = sample(unet, *contexts, SHAPE, config), sample(unet, *contexts, SHAPE, config)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.t0, b.t0)
    other = sample(unet, *contexts, SHAPE, cfg(mode="two_stage_adaptive", attention_injection=True, threshold=0.01))
    assert not torch.equal(a.x0, other.x0)
    explicit = sample(unet, *contexts, SHAPE, config, generator=torch.Generator().manual_seed(3))
    assert torch.equal(explicit.x0, a.x0)
    noisy = [sample(unet, *contexts, SHAPE, cfg(mode="baseline", eta=1.0, seed=3)).x0 for _ in range(2)]
    assert torch.equal(*noisy) and not close(noisy[0], sample(unet, *contexts, SHAPE, cfg(mode="baseline", seed=3)).x0)


def test_a_per_sample_empty_context_equals_the_shared_one(unet, contexts) -> None:
    c, ce = contexts
    shared = sample(unet, c, ce, SHAPE, cfg(mode="two_stage_fixed", t0=500))
    per_sample = sample(unet, c, ce.expand(B, -1, -1).clone(), SHAPE, cfg(mode="two_stage_fixed", t0=500))
    assert torch.equal(shared.x0, per_sample.x0)


# ----------------------------------------------------------------------------------------------- failures
def test_non_finite_samples_name_the_step_and_timestep(unet, contexts) -> None:
    calls = []

    def poison(module, args, output):
        calls.append(1)
        return output * float("nan") if len(calls) == 3 else output

    handle = unet.conv_out.register_forward_hook(poison)
    try:
        with pytest.raises(TrainingError, match=r"step 3/10 \(t = 700\)"):
            sample(unet, *contexts, SHAPE, cfg(mode="baseline"))
    finally:
        handle.remove()
    assert all(isinstance(p, AttnProcessor2_0) for p in unet.attn_processors.values())


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"mode": "three_stage"}, "sampler.mode"),
        ({"steps": 30}, "sampler.steps"),
        ({"steps": 0}, "sampler.steps"),
        ({"steps": 50.0}, "sampler.steps"),
        ({"threshold": 0.0}, "sampler.threshold"),
        ({"threshold": -0.005}, "sampler.threshold"),
        ({"threshold": float("nan")}, "sampler.threshold"),
        ({"hard_switch_t": -1}, "sampler.hard_switch_t"),
        ({"injection_blend": 1.5}, "sampler.injection_blend"),
        ({"distance": "l2"}, "sampler.distance"),
        ({"guidance_scale": -1.0}, "sampler.guidance_scale"),
        ({"t0": -5}, "sampler.t0"),
        ({"beta_start": 0.03}, "sampler.beta_start"),
        ({"eta": -0.1}, "sampler.eta"),
        ({"attention_injection": "yes"}, "sampler.attention_injection"),
    ],
)
def test_bad_config_names_the_key(changes, key) -> None:
    with pytest.raises(ConfigError, match=key):
        SamplerConfig(**changes)


def test_bad_shapes_name_the_argument(unet, contexts) -> None:
    c, ce = contexts
    with pytest.raises(ConfigError, match="cond_context"):
        sample(unet, c[:2], ce, SHAPE, cfg())
    with pytest.raises(ConfigError, match="empty_context"):
        sample(unet, c, ce.expand(2, -1, -1), SHAPE, cfg())
    with pytest.raises(ConfigError, match="empty_context"):
        sample(unet, c, torch.randn(1, 2, D), SHAPE, cfg())
    with pytest.raises(ConfigError, match="shape"):
        sample(unet, c, ce, (B, C, S), cfg())
    with pytest.raises(DataError, match="cond_context"):
        sample(unet, torch.full_like(c, float("nan")), ce, SHAPE, cfg())
