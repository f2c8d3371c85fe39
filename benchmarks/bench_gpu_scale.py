"""The ``real-112`` preset at scale on one accelerator: UIFace's models and synthesis, and FR training fed from shards.

``uiface112``: the generator section with the ``real-112`` preset's ``generator.*`` keys over it (112-px faces, an
``AutoencoderKL`` to a 4 × 28 × 28 latent, the UNet on that latent), each from random weights on random faces:

- ``ae``, ``unet``: one trainer each, ``bench_gpu._uiface_ae`` and ``bench_gpu._uiface`` (Lightning's fit with the
  trainer's callbacks), images/s of the timed steps, GFLOP per image of the first step, MFU;
- ``synth``: ``ml.generator.sampler.sample`` of ``SYNTH_BATCH`` faces with params ``synthesize.sampler`` (DDIM, the
  two-stage identity schedule with attention injection), then ``decode_latents``, under autocast in the run's
  precision: faces/s after one warm-up call, GFLOP per face counted by ``FlopCounterMode`` over one call, MFU.

``fr112_stream``: ``train_fr`` at the ``real-112`` preset, its faces held decoded in memory (the default) against
``fr.stream`` (each face's PNG read from a dataset's shards and decoded in the ``fr.num_workers`` DataLoader workers
every step): images/s of the timed steps of each, in one run. The faces are a bank of procedural 112-px faces
repeated under new keys (PNG bytes of real-looking faces; every one decoded every time it is read).

Peaks for MFU: ``bench_gpu.peak_tflops``. On the CPU both run with tiny batches (a smoke test of the code path).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_gpu import (
    FR112_CPU_BATCH,
    FR112_PRESET,
    FR_STEPS_PER_EPOCH,
    StepClock,
    _env_run,
    _leading,
    _measure,
    _one_line,
    _Run,
    _uiface,
    _uiface_ae,
    fr112_section,
    peak_tflops,
)
from ml.config import from_mapping

SYNTH_BATCH = 256  # faces per sampler call on an accelerator (the CPU: 2)
BANK = 400  # distinct procedural faces behind the streamed set


def _with_preset(run: _Run, *sections: str) -> _Run:
    """``run`` whose params have the ``real-112`` preset's keys of ``sections`` set (dotted keys into nested maps)."""
    params = copy.deepcopy(run.params)
    for key, value in run.preset.items():
        head, _, rest = key.partition(".")
        if head not in sections:
            continue
        section = head
        node = params[section]
        *parents, leaf = rest.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return dataclasses.replace(run, params=params)


def _device_name(run: _Run) -> str:
    return torch.cuda.get_device_name(0) if run.on_gpu else "cpu"


def _synthesis(run: _Run) -> dict[str, Any]:
    """faces/s, GFLOP per face and MFU of sampling and decoding ``SYNTH_BATCH`` faces."""
    from torch.utils.flop_counter import FlopCounterMode

    from ml.generator.autoencoder import AutoencoderConfig, build_autoencoder
    from ml.generator.sampler import SamplerConfig, sample
    from ml.generator.train import GeneratorConfig
    from ml.generator.uiface import IDConditionedUNet, decode_latents

    gen = run.params["generator"]
    ae_cfg = from_mapping(AutoencoderConfig, gen["autoencoder_train"], "generator.autoencoder_train")
    cfg = from_mapping(GeneratorConfig, gen["train"], "generator.train")
    model_cfg = dataclasses.replace(cfg.model, id_dim=int(run.params["fr"]["embedding_dim"]))
    sampler = from_mapping(SamplerConfig, run.params["synthesize"]["sampler"], "synthesize.sampler")
    device = "cuda" if run.on_gpu else "cpu"
    face = model_cfg.image_size * ae_cfg.factor
    autoencoder = build_autoencoder(ae_cfg, face).eval().requires_grad_(False).to(device)
    model = IDConditionedUNet(model_cfg).eval().requires_grad_(False).to(device)
    batch = SYNTH_BATCH if run.on_gpu else 2
    draw = torch.randn(batch, model_cfg.id_dim, generator=torch.Generator().manual_seed(0))
    ids = torch.nn.functional.normalize(draw, dim=1).to(device)
    shape = (batch, model_cfg.in_channels, model_cfg.image_size, model_cfg.image_size)
    dtype = torch.bfloat16 if run.precision.startswith("bf16") else torch.float16
    mixed = run.precision != "32-true"

    def once() -> torch.Tensor:
        with torch.autocast(device, dtype=dtype, enabled=mixed):
            context = model.encode_context(ids)
            result = sample(model.unet, context, model.empty_context.detach(), shape, sampler)
            return decode_latents(autoencoder, result.x0)

    faces = once()  # warm-up: kernels chosen, memory pooled
    if tuple(faces.shape[-2:]) != (face, face):
        raise RuntimeError(f"decoded faces are {tuple(faces.shape)}, not {face}² px")
    start = time.perf_counter()
    once()
    if run.on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counter = FlopCounterMode(display=False)
    with counter:
        once()
    out = {"synth_faces_per_s": batch / seconds, "synth_batch": batch, "synth_steps": sampler.steps,
           "synth_mode": sampler.mode, "synth_gflop_per_face": counter.get_total_flops() / batch / 1e9}
    peak = peak_tflops(_device_name(run), run.precision)
    if peak:
        out["synth_mfu"] = out["synth_gflop_per_face"] * 1e9 * out["synth_faces_per_s"] / (peak * 1e12)
    return out


def bench_uiface112() -> dict:
    """UIFace at the ``real-112`` preset on ``FACEOPS_BENCH_ACCELERATOR`` (module docstring). Target: report
    faces/s and MFU of training and synthesis.

    Returns:
        ``{"device", "precision", "image_size", "latent"}``, ``ae_*`` and ``unet_*`` as ``gpu_trainers`` reports a
        trainer (``_items_per_s``, ``_gflop_per_item``, ``_mfu``, ``_peak_gpu_mb``, or ``_error``), and
        ``synth_faces_per_s``, ``synth_gflop_per_face``, ``synth_mfu``, ``synth_batch``, ``synth_steps``,
        ``synth_mode`` (or ``synth_error``).
    """
    run = _with_preset(_env_run(), "generator", "fr", "data")  # the autoencoder's identity term: the preset's FR
    model = run.params["generator"]["train"]["model"]
    out: dict[str, Any] = {"device": _device_name(run), "precision": run.precision,
                           "latent": f"{model['in_channels']}×{model['image_size']}×{model['image_size']}"}
    if not run.on_gpu:  # a smoke test of the path: the preset's models are minutes per step on two cores
        run = dataclasses.replace(run, warmup=1, steps=1)
    out.update(_measure("ae", _uiface_ae, run))
    out.update(_measure("unet", _uiface, run))
    try:
        out.update(_synthesis(run))
    except Exception as exc:  # the training rows still count
        out["synth_error"] = _one_line(exc)
    return out


def _bank_dataset(root: Path, n: int, size: int, classes: int) -> tuple[Any, np.ndarray]:
    """A dataset directory of ``n`` faces (``BANK`` procedural faces repeated) → (``ShardDataset``, labels)."""
    from ml.data.dataset import DatasetWriter, read_manifest
    from ml.data.procedural import ProceduralConfig, ProceduralFaces
    from ml.data.records import ShardDataset

    gen = ProceduralFaces(ProceduralConfig(image_size=size), seed=0)
    bank = [gen.sample(i // 4, i % 4).image for i in range(min(BANK, n))]
    labels = np.arange(n) % classes
    with DatasetWriter(root, name="stream-bench", source="procedural", aligned=True) as writer:
        for i in range(n):
            writer.add(bank[i % len(bank)], identity=f"{labels[i]:06d}")
    rows = read_manifest(root / "manifest.parquet")
    return ShardDataset(root, rows), rows["label"].to_numpy()


def bench_fr112_stream() -> dict:
    """``train_fr`` at the ``real-112`` preset from memory vs streamed from shards (``fr.stream``), one run.
    Target: streamed ≥ 0.9× in memory (the workers keep up with the step).

    Returns:
        ``{"device", "precision", "images", "workers", "memory_images_per_s", "stream_images_per_s",
        "stream_over_memory"}`` (or ``<path>_error``).
    """
    from ml.data.records import decode_all
    from ml.fr.train import FRConfig, train_fr

    run = _env_run()
    fr, size = fr112_section(run)
    cfg = from_mapping(FRConfig, fr, f"{FR112_PRESET}: fr")
    batch = cfg.batch_size if run.on_gpu else FR112_CPU_BATCH
    per_epoch = min(run.total, FR_STEPS_PER_EPOCH)
    workers = min(cfg.num_workers, os.cpu_count() or 1) or 1
    cfg = dataclasses.replace(cfg, batch_size=batch, epochs=-(-run.total // per_epoch), max_steps=run.total,
                              num_workers=workers, accelerator=run.accelerator, devices=1, precision=run.precision)
    n = batch * per_epoch
    out: dict[str, Any] = {"device": _device_name(run), "precision": run.precision, "images": n, "workers": workers}
    with tempfile.TemporaryDirectory() as tmp:
        faces, labels = _bank_dataset(Path(tmp) / "faces", n, size, max(2, n // 20))
        images, _ = decode_all(faces, num_workers=workers)
        for name, data in (("memory", images), ("stream", faces)):
            clock = StepClock(run.warmup, run.steps, _leading)
            try:
                train_fr(dataclasses.replace(cfg, stream=name == "stream"), data, labels, callbacks=[clock],
                         progress=False)
                out[f"{name}_images_per_s"] = clock.items / clock.seconds
            except Exception as exc:
                out[f"{name}_error"] = _one_line(exc)
    if "memory_images_per_s" in out and "stream_images_per_s" in out:
        out["stream_over_memory"] = out["stream_images_per_s"] / out["memory_images_per_s"]
    return out
