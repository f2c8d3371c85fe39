"""UIFace sampling: DDIM with two-stage context switching, adaptive t0 and attention injection (paper Eq. 4–5).

``sample(unet, cond_context, empty_context, shape, cfg)``: diffusers ``DDIMScheduler`` (linear β, "leading" spacing,
η = 0, no clipping); ε = ε(x_t, t, c_e) for t ≥ t0 of the sample, else ``(w+1)·ε(x_t, t, c) − w·ε(x_t, t, c_e)``.
A v-prediction or EDM-preconditioned UNet's output is turned into ε at every step (``epsilon_from``). Modes: ``baseline`` (t0 = T), ``two_stage_fixed`` (t0 = ``cfg.t0``), ``two_stage_adaptive`` (t0 = the first t with
``d_t = dist(h_{t+1}, h_t) < threshold``, h_t from ``attention.switch_map`` on the c_e pass; ``hard_switch_t``
forces stage 2 below it; never switched: t0 = 0). A step is one UNet call on ``[x with c_e for all B; x with c for
the n₂ in stage 2]`` (``unet_evals``: 1 per stage-1 step, 2 per stage-2 step); injection pairs the two halves.

Differences from the reference (``Tencent/TFace``, ``generation/uiface/diffusion/ddpm.py``, ``sample_ddim_2stage``):
- ᾱ_prev = ᾱ_{t−20} (diffusers); the reference indexes ᾱ_{t−21} (off by one), with ᾱ = exp(cumsum(log α)).
- Stage-1 steps take one UNet pass, not two; a sample switched adaptively before the hard switch goes straight to
  Eq. 4's stage 2 (CFG, both injections), where the reference gives plain ε(c) with self-attention injection only.
- d_t: ``"mean_abs"`` (default) is the reference's ``calculate_rmse``, a mean absolute difference (what 0.005/0.006
  are calibrated for); ``"rms"`` is the paper's ‖·‖₂ / √(HW). h_t comes from the c_e pass at the sample's size (the
  reference: from its second pass, at the 32×32 latent).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import DDIMScheduler
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError, TrainingError
from ml.generator.attention import AttentionControl, Injection, attention_control, switch_map

__all__ = ["DISTANCES", "MODES", "SampleResult", "SamplerConfig", "ddim_scheduler", "sample"]

log = logging.getLogger(__name__)

MODES = ("baseline", "two_stage_fixed", "two_stage_adaptive")
PREDICTION_TYPES = ("epsilon", "v_prediction", "edm")
EDM_SIGMA_DATA = 0.5  # σ_data of EDM's preconditioning: faces in [−1, 1] have a standard deviation of about 0.5


def edm_coefficients(abar: torch.Tensor, sigma_data: float = EDM_SIGMA_DATA) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out) of EDM's denoiser D = c_skip·x + c_out·F (Karras et al. 2022, Table 1) at the VP timestep
    with ᾱ_t = ``abar``, read as σ² = (1 − ᾱ)/ᾱ on x = x_t/√ᾱ: ``c_skip = σ_d²/(σ² + σ_d²)``, ``c_out =
    σ·σ_d/√(σ² + σ_d²)``. At low noise D is nearly x itself, so an untrained UNet already denoises there."""
    sigma2 = (1.0 - abar) / abar
    return sigma_data ** 2 / (sigma2 + sigma_data ** 2), sigma2.sqrt() * sigma_data / (sigma2 + sigma_data ** 2).sqrt()


def epsilon_from(out: torch.Tensor, x_t: torch.Tensor, abar: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """The ε a UNet output means at ᾱ_t = ``abar`` (broadcast against ``out``): ε itself; ``v_prediction``:
    ``ε = √ᾱ·v + √(1 − ᾱ)·x_t``; ``edm``: ``ε = (x_t − √ᾱ·x̂_0)/√(1 − ᾱ)`` with ``x̂_0 = c_skip·x_t/√ᾱ + c_out·F``.
    Each is affine in the output, so guidance mixes ε exactly as it would mix the outputs."""
    if prediction_type == "epsilon":
        return out
    if prediction_type == "v_prediction":
        return abar.sqrt() * out + (1.0 - abar).sqrt() * x_t
    c_skip, c_out = edm_coefficients(abar)
    x0 = c_skip * x_t / abar.sqrt() + c_out * out
    return (x_t - abar.sqrt() * x0) / (1.0 - abar).sqrt()


def mean_abs_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mean_{h,w} |a − b|`` per sample: (B, H, W) × 2 → (B,) (the reference's ``calculate_rmse``)."""
    return (a - b).abs().mean(dim=(1, 2))


def rms_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean_{h,w} (a − b)²)`` per sample: ‖a − b‖₂ / sqrt(H·W)."""
    return (a - b).pow(2).mean(dim=(1, 2)).sqrt()


DISTANCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean_abs": mean_abs_distance,
    "rms": rms_distance,
}


@dataclass(frozen=True)
class SamplerConfig:
    """UIFace sampling (paper defaults; the public config is ``threshold=0.006, hard_switch_t=500``)."""

    mode: str = "two_stage_adaptive"  # one of MODES
    attention_injection: bool = True
    steps: int = 50  # DDIM steps; spacing train_timesteps / steps = 20
    train_timesteps: int = 1000  # T of the trained model
    beta_start: float = 1e-4  # linear β schedule of the trained model
    beta_end: float = 0.02
    prediction_type: str = "epsilon"  # what the trained UNet predicts: epsilon | v_prediction | edm (→ ε per step)
    eta: float = 0.0  # DDIM η (0: deterministic given x_T)
    guidance_scale: float = 1.0  # w in ε = (w+1)ε(c) − wε(c_e)
    t0: int = 500  # two_stage_fixed: c_e only for t ≥ t0
    threshold: float = 0.005  # two_stage_adaptive: switch when d_t < threshold (paper 0.005, public 0.006)
    hard_switch_t: int | None = None  # two_stage_adaptive: all samples in stage 2 for t < this (public 500)
    distance: str = "mean_abs"  # d_t, one of DISTANCES
    injection_blend: float = 0.5  # weight of the c_e statistics in the cross-attention rescaling
    seed: int = 0  # x_T when no generator is given

    def __post_init__(self) -> None:
        for key in ("steps", "train_timesteps", "t0", "seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"sampler.{key} must be an integer, got {value!r}")
        for key in ("beta_start", "beta_end", "eta", "guidance_scale", "threshold", "injection_blend"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"sampler.{key} must be a finite number, got {value!r}")
        if self.mode not in MODES:
            raise ConfigError(f"sampler.mode = {self.mode!r} is not one of {list(MODES)}")
        if not isinstance(self.attention_injection, bool):
            raise ConfigError(f"sampler.attention_injection must be true/false, got {self.attention_injection!r}")
        if self.prediction_type not in PREDICTION_TYPES:
            raise ConfigError(f"sampler.prediction_type = {self.prediction_type!r} is not one of "
                              f"{list(PREDICTION_TYPES)}")
        if self.distance not in DISTANCES:
            raise ConfigError(f"sampler.distance = {self.distance!r} is not one of {list(DISTANCES)}")
        if self.train_timesteps < 1 or self.steps < 1:
            key = "steps" if self.steps < 1 else "train_timesteps"
            raise ConfigError(f"sampler.{key} = {getattr(self, key)} must be ≥ 1")
        if self.train_timesteps % self.steps:
            raise ConfigError(
                f"sampler.steps = {self.steps} must divide sampler.train_timesteps = {self.train_timesteps} "
                "(DDIM skips T/steps timesteps per step; the paper: 50 steps of 20)"
            )
        if not 0.0 < self.beta_start < self.beta_end < 1.0:
            raise ConfigError(
                f"sampler.beta_start = {self.beta_start} and sampler.beta_end = {self.beta_end} must satisfy "
                "0 < beta_start < beta_end < 1 (the trained model's linear schedule: 1e-4 → 0.02)"
            )
        if self.eta < 0:
            raise ConfigError(f"sampler.eta = {self.eta} must be ≥ 0")
        if self.guidance_scale < 0:
            raise ConfigError(f"sampler.guidance_scale = {self.guidance_scale} must be ≥ 0 (paper: w = 1)")
        if self.t0 < 0:
            raise ConfigError(f"sampler.t0 = {self.t0} must be ≥ 0")
        if self.threshold <= 0:
            raise ConfigError(f"sampler.threshold = {self.threshold} must be > 0 (paper 0.005, public code 0.006)")
        if self.hard_switch_t is not None and (
            isinstance(self.hard_switch_t, bool) or not isinstance(self.hard_switch_t, int) or self.hard_switch_t < 0
        ):
            raise ConfigError(f"sampler.hard_switch_t must be null or an integer ≥ 0, got {self.hard_switch_t!r}")
        if not 0.0 <= self.injection_blend <= 1.0:
            raise ConfigError(f"sampler.injection_blend = {self.injection_blend} must lie in [0, 1] (public: 0.5)")


@dataclass
class SampleResult:
    x0: torch.Tensor  # (B, C, H, W) float32, model space (latent or pixels, as the UNet was trained)
    t0: torch.Tensor  # (B,) long: c_e only for t ≥ t0 (T: never; 0: at every step)
    unet_evals: torch.Tensor  # (B,) long: UNet evaluations spent on each sample (1 per stage-1 step, 2 per stage-2)
    timesteps: torch.Tensor  # (steps,) long, descending
    d_history: torch.Tensor | None = None  # (steps, B) d_t in two_stage_adaptive, NaN at the first step


def ddim_scheduler(cfg: SamplerConfig) -> DDIMScheduler:
    """diffusers DDIM for the trained model's schedule, with ``cfg.steps`` set ("leading": 980, 960, …, 0)."""
    scheduler = DDIMScheduler(
        num_train_timesteps=cfg.train_timesteps,
        beta_start=cfg.beta_start,
        beta_end=cfg.beta_end,
        beta_schedule="linear",
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=0,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )
    scheduler.set_timesteps(cfg.steps)
    return scheduler


def _check_inputs(
    cond_context: torch.Tensor, empty_context: torch.Tensor, shape: tuple[int, ...]
) -> tuple[int, int, int, int]:
    """The batch contract of ``sample``; returns ``shape``."""
    if len(shape) != 4 or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ConfigError(f"shape must be (B, C, H, W) of positive integers, got {tuple(shape)!r}")
    b = shape[0]
    if not isinstance(cond_context, torch.Tensor) or cond_context.ndim != 3 or cond_context.shape[0] != b:
        got = tuple(cond_context.shape) if isinstance(cond_context, torch.Tensor) else type(cond_context).__name__
        raise ConfigError(f"cond_context must be (B, L, D) with B = shape[0] = {b}, got {got}")
    if (
        not isinstance(empty_context, torch.Tensor)
        or empty_context.ndim != 3
        or empty_context.shape[0] not in (1, b)
        or empty_context.shape[1:] != cond_context.shape[1:]
    ):
        got = tuple(empty_context.shape) if isinstance(empty_context, torch.Tensor) else type(empty_context).__name__
        raise ConfigError(
            f"empty_context must be (1 or B = {b}, L, D) with the (L, D) = {tuple(cond_context.shape[1:])} of "
            f"cond_context, got {got}"
        )
    for name, ctx in (("cond_context", cond_context), ("empty_context", empty_context)):
        if not ctx.is_floating_point():
            raise DataError(f"{name} must be a float tensor (the projected ID context), got dtype {ctx.dtype}")
        if not torch.isfinite(ctx).all():
            rows = torch.nonzero(~torch.isfinite(ctx.reshape(ctx.shape[0], -1)).all(dim=1)).flatten().tolist()
            raise DataError(f"{name} rows {rows[:10]} contain NaN/inf; drop or recompute those contexts")
    return shape


@torch.no_grad()
def sample(
    unet: torch.nn.Module,
    cond_context: torch.Tensor,
    empty_context: torch.Tensor,
    shape: tuple[int, int, int, int],
    cfg: SamplerConfig = SamplerConfig(),
    generator: torch.Generator | None = None,
    progress: bool = False,
) -> SampleResult:
    """Sample ``shape`` = (B, C, H, W) with ID contexts ``cond_context`` (B, L, D) and ``c_e`` (1 or B, L, D).

    ``unet`` is a diffusers ``UNet2DConditionModel`` (put it in eval mode; one built with ``class_embed_type
    "projection"`` also gets the flattened context as ``class_labels``); its attention processors are replaced
    for the duration of the call and restored after. Raises ``TrainingError`` naming the step and timestep when
    the sample becomes non-finite.
    """
    b, _, height, width = _check_inputs(cond_context, empty_context, tuple(shape))
    param = next(unet.parameters())
    device, dtype = param.device, param.dtype
    scheduler = ddim_scheduler(cfg)
    timesteps = scheduler.timesteps.long()
    adaptive = cfg.mode == "two_stage_adaptive"
    dist = DISTANCES[cfg.distance]
    time_context = getattr(unet.config, "class_embed_type", None) == "projection"

    if generator is None:
        generator = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(tuple(shape), generator=generator, device=generator.device, dtype=torch.float32).to(device)
    cond = cond_context.to(device=device, dtype=dtype)
    empty = empty_context.to(device=device, dtype=dtype).expand(b, -1, -1)

    if cfg.mode == "baseline":
        switched = torch.ones(b, dtype=torch.bool, device=device)
        t0 = torch.full((b,), cfg.train_timesteps, dtype=torch.long)
    elif cfg.mode == "two_stage_fixed":
        switched = torch.zeros(b, dtype=torch.bool, device=device)
        t0 = torch.full((b,), min(cfg.t0, cfg.train_timesteps), dtype=torch.long)
    else:
        switched = torch.zeros(b, dtype=torch.bool, device=device)
        t0 = torch.zeros(b, dtype=torch.long)
    evals = torch.zeros(b, dtype=torch.long)
    d_history = torch.full((len(timesteps), b), float("nan")) if adaptive else None
    previous_map: torch.Tensor | None = None
    w = cfg.guidance_scale

    control = AttentionControl(record_cross=adaptive)
    with attention_control(unet, control):
        for i, t in enumerate(tqdm(timesteps, desc="UIFace DDIM", disable=not progress)):
            t_int = int(t)
            if cfg.mode == "two_stage_fixed":
                switched = torch.full_like(switched, t_int < cfg.t0)
            elif adaptive and cfg.hard_switch_t is not None and t_int < cfg.hard_switch_t:
                forced = ~switched
                t0[forced.cpu()] = cfg.hard_switch_t
                switched = torch.ones_like(switched)
            rows = torch.nonzero(switched).flatten()  # samples in stage 2 at this step
            n2 = rows.numel()

            x_in = torch.cat([x, x[rows]]).to(dtype)
            context = torch.cat([empty, cond[rows]])
            control.clear()
            control.injection = (
                Injection(targets=torch.arange(b, b + n2, device=device), sources=rows, blend=cfg.injection_blend)
                if cfg.attention_injection and n2
                else None
            )
            labels = context.flatten(1) if time_context else None  # the context's time-embedding route
            out = unet(x_in, t.to(device), encoder_hidden_states=context, class_labels=labels,
                       return_dict=False)[0].float()
            out = epsilon_from(out, x_in.float(), scheduler.alphas_cumprod[t_int].double(), cfg.prediction_type
                               ).float()  # float64 ᾱ: at t = 0, 1 − ᾱ is 1e-4
            eps = out[:b].clone()  # ε(c_e) for every sample
            if n2:
                eps[rows] = (w + 1.0) * out[b:] - w * out[:b][rows]
            evals += 1
            evals[rows.cpu()] += 1

            if adaptive:
                h = switch_map(control.cross_records(), (height, width), rows=slice(0, b))
                if previous_map is not None:
                    d = dist(previous_map, h)
                    d_history[i] = d.cpu()
                    newly = ~switched & (d < cfg.threshold)
                    t0[newly.cpu()] = t_int
                    switched = switched | newly
                previous_map = h

            x = scheduler.step(eps, t, x, eta=cfg.eta, generator=generator if cfg.eta > 0 else None).prev_sample
            if not torch.isfinite(x).all():
                bad = torch.nonzero(~torch.isfinite(x.reshape(b, -1)).all(dim=1)).flatten().tolist()
                raise TrainingError(
                    f"UIFace sampling produced non-finite values at step {i + 1}/{len(timesteps)} (t = {t_int}) in "
                    f"samples {bad[:10]} (mode {cfg.mode}, injection {cfg.attention_injection}); check the UNet "
                    "weights and contexts for NaN/inf, or sample in float32"
                )
        control.injection = None
        control.clear()

    if adaptive:
        log.info(
            "UIFace adaptive t0: mean %.1f, min %d, max %d; %d of %d samples stayed on c_e to the end (t0 = 0)",
            t0.float().mean(), int(t0.min()), int(t0.max()), int((t0 == 0).sum()), b,
        )
    return SampleResult(x0=x, t0=t0, unet_evals=evals, timesteps=timesteps, d_history=d_history)

