"""UIFace sampling cost: two-stage adaptive sampling with attention injection vs plain CFG, and throughput."""

from __future__ import annotations

import time

import torch


def _generator_params() -> dict:
    from pathlib import Path

    from tasks.common import load_params, section

    return dict(section(load_params(Path(__file__).resolve().parents[1] / "params.yaml"), "generator"))


def _model():
    from ml.generator.uiface import GeneratorModelConfig, IDConditionedUNet

    # the embedded default's UNet (params.yaml generator.train.model: on the latent), random weights
    spec = dict(_generator_params().get("train", {}).get("model", {}))
    spec["block_out_channels"] = tuple(spec.get("block_out_channels", (16, 32, 32)))
    torch.manual_seed(0)
    return IDConditionedUNet(GeneratorModelConfig(**{**spec, "id_dim": 128})).eval()


def _autoencoder(latent_side: int):
    """The embedded default's autoencoder (params.yaml generator.autoencoder_train), random weights; None in pixel
    space."""
    from ml.generator.autoencoder import AutoencoderConfig, build_autoencoder

    params = _generator_params()
    if params.get("space", "pixel") != "latent":
        return None
    spec = dict(params.get("autoencoder_train", {}))
    cfg = AutoencoderConfig(architecture=str(spec.get("architecture", "kl")),
                            block_out_channels=tuple(spec.get("block_out_channels", (16, 32, 64))),
                            latent_channels=int(spec.get("latent_channels", 4)))
    torch.manual_seed(0)
    return build_autoencoder(cfg, latent_side * cfg.factor).eval()


def bench_sampler_cost(batch: int = 32, steps: int = 25, rounds: int = 2) -> dict:
    """Seconds per face of ``two_stage_adaptive + attention_injection`` relative to plain CFG sampling
    (``baseline``: two UNet passes at every step), the same contexts and noise, in one run; best of ``rounds``.

    With random weights the cross-attention maps settle at an arbitrary step, so the adaptive boundary here says
    nothing about a trained model's; the public config's hard switch at t = 500 bounds stage 1 from below and is
    measured too. ``evals`` = UNet evaluations per face (stage 1: one per step, stage 2: two).
    """
    from ml.generator.sampler import SamplerConfig, sample

    model = _model()
    m = model.config
    with torch.no_grad():
        cond = model.encode_context(torch.randn(batch, m.id_dim))
        empty = model.empty_context.detach()
    shape = model.sample_shape(batch)
    modes = {
        "baseline": SamplerConfig(mode="baseline", attention_injection=False, steps=steps),
        "adaptive_injection": SamplerConfig(mode="two_stage_adaptive", attention_injection=True, steps=steps),
        "adaptive_injection_hard500": SamplerConfig(mode="two_stage_adaptive", attention_injection=True, steps=steps,
                                                    threshold=0.006, hard_switch_t=500),
        "fixed_injection": SamplerConfig(mode="two_stage_fixed", t0=500, attention_injection=True, steps=steps),
    }
    best: dict[str, float] = {}
    evals: dict[str, float] = {}
    for _ in range(rounds):
        for name, cfg in modes.items():
            start = time.perf_counter()
            res = sample(model.unet, cond, empty, shape, cfg, generator=torch.Generator().manual_seed(0))
            seconds = (time.perf_counter() - start) / batch
            best[name] = min(best.get(name, float("inf")), seconds)
            evals[name] = float(res.unet_evals.float().mean())
    out = {f"{k}_ms_per_face": round(1000 * v, 2) for k, v in best.items()}
    out.update({f"{k}_evals": round(v, 1) for k, v in evals.items()})
    out["ratio_adaptive_injection"] = round(best["adaptive_injection"] / best["baseline"], 3)
    out["ratio_adaptive_injection_hard500"] = round(best["adaptive_injection_hard500"] / best["baseline"], 3)
    out["ratio_fixed_injection"] = round(best["fixed_injection"] / best["baseline"], 3)
    return out


def bench_synthesis_throughput(batch: int = 64, steps: int = 25) -> dict:
    """Faces per second of the embedded default's sampler (two_stage_fixed at t0 = 500 + injection, 25 DDIM steps)
    at the embedded UNet size, decoded through the default's autoencoder (latent space), one batch of ``batch``
    identities."""
    from ml.generator.uiface import decode_latents
    from ml.generator.sampler import SamplerConfig, sample

    model = _model()
    m = model.config
    autoencoder = _autoencoder(m.image_size)
    with torch.no_grad():
        cond = model.encode_context(torch.randn(batch, m.id_dim))
        cfg = SamplerConfig(mode="two_stage_fixed", t0=500, attention_injection=True, steps=steps)
        start = time.perf_counter()
        res = sample(model.unet, cond, model.empty_context.detach(), model.sample_shape(batch), cfg)
        x0 = model.from_unet(res.x0)  # the UNet's patches back to the latent (or face)
        faces = x0 if autoencoder is None else decode_latents(autoencoder, x0)
        seconds = time.perf_counter() - start
    return {"faces_per_s": round(batch / seconds, 1), "unet_side": m.unet_shape[1], "face_size": int(faces.shape[-1]),
            "space": "latent" if autoencoder is not None else "pixel", "steps": steps,
            "threads": torch.get_num_threads()}
