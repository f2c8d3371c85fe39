"""Step costs of the UIFace generator's UNet (the default run's critical path) and of CAFace (beside it), on one
CPU thread: what the fused optimiser, the foreach EMA and CAFace's per-length cluster network buy, each against the
code path it replaced, measured in one process so that only the ratio is read.

- ``unet``: one training step of the embedded latent UNet (params.yaml ``generator.train``: its latents,
  batch 64) — forward, backward, optimiser step and EMA update — with ``torch.optim.AdamW``'s default per-tensor
  loop and a per-tensor EMA (before) against ``ml.train.schedules.adamw`` (fused) and the module's foreach EMA.
- ``unet`` in channels_last (what the trainer runs) against the same fused step in the default NCHW layout:
  ``unet_channels_last_ratio`` < 1 is what the layout saves; ``unet_channels_last_bf16_ratio`` is bfloat16 autocast
  against float32, both in channels_last.
- ``caface``: one CAFace training step of the embedded recipe (32 identities × 2 groups × every even prefix
  2..16, vit_tiny feature sizes) with every prefix padded to 16 in one masked cluster-network call (before)
  against one call per prefix length (``ClusterNetwork`` does this for any batch padded at the end).
- bfloat16 autocast (what ``bf16-mixed`` runs, and ``auto`` on a CPU where it pays) against float32 for the UNet
  step above, for one FR step (``vit_tiny`` at 64 px, batch 128, ``fr.embedding_dim``, a linear softmax head in
  float32 as the trainer's margin heads are) and for the CAFace step: ``*_bf16_ratio`` < 1 is what autocast saves;
  ``cpu_has_bf16`` says whether this CPU has bfloat16 instructions, ``cpu_has_amx`` whether it has AMX tiles, and
  ``probe_bf16_ratio`` is what ``faceops doctor`` recommends by (``ml.train.device.bf16_step_ratio``).
- the attention kernel under bfloat16 autocast: every ``bf16`` step runs what the trainers run on the CPU
  (``ml.train.device.attention_kernels``: the math kernel); ``*_flash_ratio`` is the same step with PyTorch's fused
  CPU flash kernel over it (> 1: what the math kernel saves).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ml.train.device import attention_kernels, bf16_step_ratio, cpu_has_amx, cpu_has_bf16


def _numerics(name: str) -> contextlib.ExitStack:
    """The autocast and attention kernel of a variant's forward (the backward follows the kernels it chose): names
    ending in ``bf16`` run as a ``bf16-mixed`` CPU trainer does, ``flash`` ones in bfloat16 with the fused flash
    kernel PyTorch picks by itself, the rest in float32."""
    stack = contextlib.ExitStack()
    bf16 = name.endswith(("bf16", "flash"))
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16))
    if name.endswith("bf16"):
        stack.enter_context(attention_kernels("cpu", "bf16-mixed"))
    return stack


def _best_ms(step: Callable[[], Any], warmup: int, rounds: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - start) / steps)
    return 1000.0 * best


def _unet_steps(steps: int, rounds: int) -> dict:
    from benchmarks.bench_synth import _generator_params
    from ml.config import from_mapping
    from ml.generator.uiface import IDConditionedUNet
    from ml.generator.train import GeneratorConfig, GeneratorModule

    spec = dict(_generator_params()["train"])
    spec["model"] = {**spec["model"], "id_dim": 128}  # the embedded FR model's embedding size
    cfg = from_mapping(GeneratorConfig, spec, "generator.train")
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(cfg.batch_size, cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size, generator=g)
    ids = torch.randn(cfg.batch_size, 128, generator=g)
    out = {}
    for name in ("loop", "fused", "bf16", "channels_last", "channels_last_bf16", "channels_last_flash"):
        torch.manual_seed(0)
        module = GeneratorModule(IDConditionedUNet(cfg.model), cfg, steps_per_epoch=57, pixel=False,
                                 channels_last=name.startswith("channels_last"))
        if name != "loop":
            configured = module.configure_optimizers()
            optimizer = configured["optimizer"] if isinstance(configured, dict) else configured

            def ema() -> None:
                module.on_train_batch_end(None, None, 0)
        else:
            optimizer = torch.optim.AdamW(module.model.parameters(), lr=cfg.lr, foreach=False)

            def ema() -> None:
                state = module.ema.state_dict()
                for key, value in module.model.state_dict().items():
                    state[key].mul_(0.99).add_(value, alpha=0.01)

        def step(name: str = name) -> None:
            with _numerics(name):
                loss = module.diffusion_loss(x0, ids, g)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                ema()

        out[name] = _best_ms(step, 3, rounds, steps)
    return {"unet_loop_ms": out["loop"], "unet_fused_ms": out["fused"], "unet_ratio": out["fused"] / out["loop"],
            "unet_bf16_ms": out["bf16"], "unet_bf16_ratio": out["bf16"] / out["fused"], "unet_batch": cfg.batch_size,
            "unet_channels_last_ms": out["channels_last"], "unet_channels_last_ratio": out["channels_last"] / out["fused"],
            "unet_channels_last_bf16_ratio": out["channels_last_bf16"] / out["channels_last"],
            "unet_flash_ratio": out["channels_last_flash"] / out["channels_last_bf16"]}


def _fr_steps(steps: int, rounds: int) -> dict:
    from ml.fr.backbones import build_backbone
    from ml.train.schedules import adamw

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 3, 64, 64, generator=g)
    y = torch.randint(0, 200, (128,), generator=g)
    out = {}
    for name in ("fp32", "bf16", "flash"):
        torch.manual_seed(0)
        backbone = build_backbone("vit_tiny", img_size=64, embed_dim=128)
        head = torch.nn.Linear(128, 200)
        optimizer = adamw([*backbone.parameters(), *head.parameters()], lr=1e-3, weight_decay=0.05)

        def step(name: str = name) -> None:
            with _numerics(name):
                emb = backbone(x)
            loss = torch.nn.functional.cross_entropy(head(emb.float()), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        out[name] = _best_ms(step, 2, rounds, steps)
    return {"fr_fp32_ms": out["fp32"], "fr_bf16_ms": out["bf16"], "fr_bf16_ratio": out["bf16"] / out["fp32"],
            "fr_flash_ratio": out["flash"] / out["bf16"]}


def _caface_steps(steps: int, rounds: int) -> dict:
    from ml.fusion import CAFace
    from ml.fusion.caface import ClusterNetwork
    from ml.fusion.train import FusionConfig, _batch_loss

    from tasks.common import load_params, section

    spec = dict(section(load_params(Path(__file__).resolve().parents[1] / "params.yaml"), "fusion")["train"])
    spec["lr_steps"] = tuple(spec.get("lr_steps", ()))
    cfg = FusionConfig(**{**spec, "feature_dim": 128, "style_dim": 256})  # the embedded FR model's sizes
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(cfg.batch_size, cfg.per_identity, 128, generator=g) * 10
    styles = torch.randn(cfg.batch_size, cfg.per_identity, 256, 2, generator=g)
    target = torch.nn.functional.normalize(torch.randn(cfg.batch_size, 128, generator=g), dim=-1)
    out = {}
    by_length = ClusterNetwork.forward
    for name in ("padded", "by_length", "bf16", "flash"):
        torch.manual_seed(0)
        model = CAFace(feature_dim=128, style_dim=256).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

        def step(name: str = name) -> None:
            with _numerics(name):
                loss = _batch_loss(model, cfg, feats, styles, target, cfg.prefix_lengths)["train/loss"]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        ClusterNetwork.forward = ClusterNetwork._forward if name == "padded" else by_length
        try:
            out[name] = _best_ms(step, 2, rounds, steps)
        finally:
            ClusterNetwork.forward = by_length
    return {"caface_padded_ms": out["padded"], "caface_by_length_ms": out["by_length"],
            "caface_ratio": out["by_length"] / out["padded"], "caface_bf16_ms": out["bf16"],
            "caface_bf16_ratio": out["bf16"] / out["by_length"], "caface_flash_ratio": out["flash"] / out["bf16"]}


def bench_train_step_costs(steps: int = 10, rounds: int = 3, threads: int = 1) -> dict:
    """ms per training step (best of ``rounds`` means over ``steps`` steps) of the UNet and of CAFace, before and
    after, and of the UNet, an FR step and CAFace in bfloat16 autocast against float32, on ``threads`` torch threads
    (the stages run one thread each when they share the cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return {**_unet_steps(steps, rounds), **_fr_steps(steps, rounds), **_caface_steps(steps, rounds),
                "threads": threads, "cpu_has_bf16": cpu_has_bf16(),
                "cpu_has_amx": cpu_has_amx(),
                "probe_bf16_ratio": bf16_step_ratio()}
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    r = bench_train_step_costs()
    print(f"UNet {r['unet_loop_ms']:.0f} → {r['unet_fused_ms']:.0f} ms/step ({r['unet_ratio']:.3f}×); "
          f"CAFace {r['caface_padded_ms']:.0f} → {r['caface_by_length_ms']:.0f} ms/step ({r['caface_ratio']:.3f}×); "
          f"bf16/fp32: UNet {r['unet_bf16_ratio']:.3f}×, FR {r['fr_bf16_ratio']:.3f}×, "
          f"CAFace {r['caface_bf16_ratio']:.3f}×; flash/math kernel: UNet {r['unet_flash_ratio']:.3f}×, "
          f"FR {r['fr_flash_ratio']:.3f}×, CAFace {r['caface_flash_ratio']:.3f}×")
