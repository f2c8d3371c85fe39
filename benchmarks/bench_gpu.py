"""Every trainer on the accelerator, each through its own public function (``train_fr`` for the embedded ``vit_tiny``
and for the ``real-112`` recipe's ViT-T as ``fr112``, ``train_aligner``, ``train_fusion``, ``train_discovery``,
``train_autoencoder``, ``train_generator``), for a fixed number of optimiser steps on one device and precision.

The environment chooses: ``FACEOPS_BENCH_ACCELERATOR`` (``gpu`` when CUDA is visible, else ``cpu``),
``FACEOPS_BENCH_PRECISION`` (``bf16-mixed`` on a GPU, ``32-true`` on the CPU) and ``FACEOPS_BENCH_STEPS`` (60 on a
GPU, 6 on the CPU). Recipes are the embedded defaults of ``params.yaml`` with only the device keys and the run's
length changed (``fr112``: the ``real-112`` preset's ``fr.*`` keys; batch 16 on the CPU). Inputs are random
images, features and contexts of the right sizes built in memory (the aligner: procedural crops with exact
landmarks; FaceGCD from a random ViT, which costs the same per step). A callback starts the clock after
``max(1, steps // 6)`` warm-up steps and stops it after the timed ones, synchronising CUDA at both ends, so data
loading, augmentation and logging count and set-up does not; items are images, crops or (CAFace) features of the
timed batches. A trainer whose parameters are not on CUDA on a GPU run is an error. The first (warm-up) step runs
under ``FlopCounterMode``: its FLOPs per item (matrix products, convolutions, attention; forward and backward) give
each trainer's model FLOP utilisation against the chip's dense peak (``peak_tflops``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from ml.config import from_mapping
from ml.errors import ConfigError
from ml.fr.backbones import input_contract
from ml.train.device import ACCELERATORS
from ml.train.device import PRECISIONS

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
FR112_PRESET = "real-112"
FR112_CPU_BATCH = 16  # the preset's 512 at 112 px is ~80 s per step on two cores
FR_STEPS_PER_EPOCH = 16  # FR data hold this many batches (112 px: 8,192 images); longer runs take more epochs


# dense tensor-core peaks by vendor data sheet (TFLOP/s), by a substring of torch.cuda.get_device_name
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16-mixed": 989.4, "16-mixed": 989.4, "32-true": 66.9},  # SXM
    "H200": {"bf16-mixed": 989.4, "16-mixed": 989.4, "32-true": 66.9},
    "A100": {"bf16-mixed": 312.0, "16-mixed": 312.0, "32-true": 19.5},
}


def peak_tflops(device: str, precision: str) -> float | None:
    """The dense peak for ``precision`` on the device named ``device``; ``FACEOPS_BENCH_PEAK_TFLOPS`` overrides it.
    ``None`` when unknown (the CPU)."""
    raw = os.environ.get("FACEOPS_BENCH_PEAK_TFLOPS")
    if raw:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"FACEOPS_BENCH_PEAK_TFLOPS = {raw!r}: need a number of TFLOP/s") from None
    for key, peaks in PEAK_TFLOPS.items():
        if key in device:
            return peaks.get(precision)
    return None


@dataclasses.dataclass(frozen=True)
class _Run:
    """Where and how long every trainer runs, and the params it reads."""

    accelerator: str
    precision: str
    warmup: int
    steps: int
    params: dict[str, Any]
    preset: dict[str, Any]

    @property
    def total(self) -> int:
        return self.warmup + self.steps

    @property
    def on_gpu(self) -> bool:
        return self.accelerator in ("gpu", "cuda") or (self.accelerator == "auto" and torch.cuda.is_available())


class StepClock(lightning.Callback):
    """Wall time of ``steps`` optimiser steps after ``warmup`` of them (CUDA synchronised at both ends), the items
    of those steps' batches (``count(batch)``), the device of the module's parameters at the first batch, and the
    FLOPs per item of the first step (``flops_per_item``, counted by ``FlopCounterMode``)."""

    def __init__(self, warmup: int, steps: int, count: Callable[[Any], int]) -> None:
        if warmup < 1 or steps < 1:
            raise ConfigError(f"StepClock needs warmup ≥ 1 and steps ≥ 1, got {warmup} and {steps}")
        self.warmup, self.steps, self.count = warmup, steps, count
        self.done = self.items = 0
        self.device: str | None = None
        self.seconds: float | None = None
        self.flops_per_item: float | None = None
        self._t0 = 0.0
        self._counter: FlopCounterMode | None = None
        self._first_items = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.device is None:
            self.device = str(next(pl_module.parameters()).device)
        if self.done == 0:  # the first step's forward, backward and optimiser step run before on_train_batch_end
            self._first_items = self.count(batch)
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        if self.warmup <= self.done < self.warmup + self.steps:
            self.items += self.count(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.flops_per_item = self._counter.get_total_flops() / max(1, self._first_items)
            self._counter = None
        self.done += 1
        if self.done == self.warmup:
            self._t0 = _synced_clock()
        elif self.done == self.warmup + self.steps:
            self.seconds = _synced_clock() - self._t0


def _synced_clock() -> float:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the steps queued so far have run
    return time.perf_counter()


def _leading(batch: Any) -> int:
    """Items of a tuple batch whose first tensor is (B, ...)."""
    return int(batch[0].shape[0])


def _env_run(precision: str | None = None) -> _Run:
    cuda = torch.cuda.is_available()
    accelerator = os.environ.get("FACEOPS_BENCH_ACCELERATOR") or ("gpu" if cuda else "cpu")
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda)
    precision = precision or os.environ.get("FACEOPS_BENCH_PRECISION") or ("bf16-mixed" if gpu else "32-true")
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"FACEOPS_BENCH_ACCELERATOR={accelerator!r} is not one of {list(ACCELERATORS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"FACEOPS_BENCH_PRECISION={precision!r} is not one of {list(PRECISIONS)}")
    if accelerator in ("gpu", "cuda") and not cuda:
        raise ConfigError(f"FACEOPS_BENCH_ACCELERATOR={accelerator} but no CUDA GPU is visible; run on a GPU machine "
                          "or unset it (the CPU is then used)")
    if not gpu and precision == "16-mixed":
        raise ConfigError("FACEOPS_BENCH_PRECISION=16-mixed needs a GPU; use bf16-mixed or 32-true on the CPU")
    raw = os.environ.get("FACEOPS_BENCH_STEPS") or ("60" if gpu else "6")
    try:
        steps = int(raw)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ConfigError(f"FACEOPS_BENCH_STEPS = {raw!r}: need an integer ≥ 1 (timed optimiser steps per trainer)")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    preset = yaml.safe_load((ROOT / "presets.yaml").read_text()).get(FR112_PRESET)
    if not preset:
        raise ConfigError(f"presets.yaml has no {FR112_PRESET!r} preset; the fr112 benchmark reads its fr.* keys")
    return _Run(accelerator, precision, max(1, steps // 6), steps, params, preset)


def _device_keys(run: _Run) -> dict[str, Any]:
    return {"accelerator": run.accelerator, "devices": 1, "precision": run.precision}


def _random_images(n: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _fr_fit(run: _Run, fr: dict[str, Any], size: int, section: str, batch_cap: int | None = None) -> StepClock:
    from ml.fr.train import FRConfig, train_fr

    cfg = from_mapping(FRConfig, fr, section)
    batch = min(cfg.batch_size, batch_cap or cfg.batch_size)
    per_epoch = min(run.total, FR_STEPS_PER_EPOCH)
    workers = min(cfg.num_workers, os.cpu_count() or 1)
    cfg = dataclasses.replace(cfg, batch_size=batch, epochs=math.ceil(run.total / per_epoch), max_steps=run.total,
                              num_workers=workers, **_device_keys(run))
    n = batch * per_epoch
    labels = np.arange(n) % min(run.params["data"]["train_identities"], n // 2)
    clock = StepClock(run.warmup, run.steps, _leading)
    train_fr(cfg, _random_images(n, size, 0), labels, callbacks=[clock], progress=False)
    return clock


def _fr(run: _Run) -> StepClock:
    """The embedded FR recipe (params.yaml ``fr``: vit_tiny, 64 px, batch 128, basic augmentation)."""
    return _fr_fit(run, run.params["fr"], run.params["data"]["image_size"], "fr")


def fr112_section(run: _Run) -> tuple[dict[str, Any], int]:
    """(params.yaml's ``fr`` with the ``real-112`` preset's ``fr.*`` keys over it, the preset's image size)."""
    fr = dict(run.params["fr"])
    for key, value in run.preset.items():
        section, _, name = key.partition(".")
        if section == "fr":
            if "." in name:
                raise ConfigError(f"presets.yaml {FR112_PRESET}.{key}: nested fr keys are not read by this benchmark")
            fr[name] = value
    return fr, int(run.preset.get("data.image_size", run.params["data"]["image_size"]))


def _fr112(run: _Run) -> StepClock:
    """``fr`` with the ``real-112`` preset's ``fr.*`` keys (ViT-T patch 9 at 112 px, AdaFace, batch 512, kprpe)."""
    fr, size = fr112_section(run)
    return _fr_fit(run, fr, size, f"{FR112_PRESET}: fr", batch_cap=None if run.on_gpu else FR112_CPU_BATCH)


def _dfa(run: _Run) -> StepClock:
    """The DFA aligner at params.yaml ``aligner.train`` (96² input, batch 14 faces + 2 non-face crops), one epoch."""
    from ml.data.unaligned import unaligned_faces
    from ml.aligner.train import AlignerConfig, train_aligner

    cfg = dataclasses.replace(from_mapping(AlignerConfig, run.params["aligner"]["train"], "aligner.train"), epochs=1,
                              **_device_keys(run))
    n = (cfg.batch_size - cfg.nonfaces_per_batch) * run.total  # one epoch of ⌊n / faces per batch⌋ steps
    images, landmarks, _ = unaligned_faces(n, 1, size=run.params["data"]["unaligned_size"], seed=0)
    clock = StepClock(run.warmup, run.steps, _leading)
    train_aligner(cfg, images, landmarks, progress=False, callbacks=[clock])
    return clock


def _caface(run: _Run) -> StepClock:
    """CAFace at params.yaml ``fusion.train`` (32 identities × 32 features per step, every even prefix) on random
    features of the embedded FR model's sizes."""
    from ml.fusion.train import FusionConfig, train_fusion

    fr, data = run.params["fr"], run.params["data"]
    contract = input_contract(fr["backbone"], embed_dim=fr["embedding_dim"])
    cfg = dataclasses.replace(
        from_mapping(FusionConfig, run.params["fusion"]["train"], "fusion.train"), epochs=1,
        steps_per_epoch=run.total, feature_dim=int(contract["embedding_dim"]), style_dim=int(contract["style_dim"]),
        **_device_keys(run),
    )
    identities, sources, copies = data["fusion_identities"], data["fusion_sources"], data["fusion_copies"]
    n = identities * sources * copies
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(n, cfg.feature_dim)).astype(np.float32) * rng.uniform(5, 25, (n, 1)).astype(np.float32)
    styles = rng.normal(size=(n, cfg.style_dim, 2)).astype(np.float32)
    labels = np.repeat(np.arange(identities), sources * copies)
    src = np.repeat(np.arange(identities * sources), copies)
    clock = StepClock(run.warmup, run.steps, lambda b: int(b["features"].shape[0] * b["features"].shape[1]))
    train_fusion(cfg, feats, styles, labels, sources=src, progress=False, callbacks=[clock])
    return clock


def _facegcd(run: _Run) -> StepClock:
    """FaceGCD at params.yaml ``discovery`` (vit_tiny, 10 prefix tokens, batch 64 × 2 views, the anchor term on
    random faces of the FR set's identity count) from a random ViT; no validation split (its per-epoch evaluation
    is no step cost, and holding images out would shorten the epoch)."""
    from ml.discovery.train import DiscoveryConfig, train_discovery

    cfg = dataclasses.replace(from_mapping(DiscoveryConfig, run.params["discovery"], "discovery"), epochs=1,
                              backbone_init="random", val_per_identity=0, gcd_arm=False, **_device_keys(run))
    n = cfg.batch_size * run.total
    labels = np.arange(n) % run.params["data"]["discovery_identities"]
    labelled = (labels % 2 == 0) & (np.arange(n) % 4 < 2)  # half the identities known, half of their images labelled
    size = run.params["data"]["image_size"]
    anchor = (_random_images(n, size, 3), np.arange(n) % run.params["data"]["train_identities"])  # the FR set's faces
    clock = StepClock(run.warmup, run.steps, _leading)
    train_discovery(cfg, _random_images(n, size, 1), labels, labelled, progress=False, callbacks=[clock],
                    anchor=anchor)
    return clock


def _generator_faces(run: _Run) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """(autoencoder config, generator config, random faces at the generator's face size, unit identity contexts of
    the embedded FR model's size), one per image of ``total`` UNet batches."""
    from ml.generator.autoencoder import AutoencoderConfig
    from ml.generator.train import GeneratorConfig

    section = run.params["generator"]
    ae = from_mapping(AutoencoderConfig, section["autoencoder_train"], "generator.autoencoder_train")
    cfg = from_mapping(GeneratorConfig, section["train"], "generator.train")
    latent = section.get("space", "latent") == "latent"
    model = dataclasses.replace(cfg.model, id_dim=int(run.params["fr"]["embedding_dim"]))
    cfg = dataclasses.replace(cfg, model=model, epochs=1, max_steps=run.total, **_device_keys(run))
    n = cfg.batch_size * run.total
    ids = np.random.default_rng(2).normal(size=(n, model.id_dim)).astype(np.float32)
    size = model.image_size * (ae.factor if latent else 1)
    return ae if latent else None, cfg, _random_images(n, size, 2), ids / np.linalg.norm(ids, axis=1, keepdims=True)


def _uiface_ae(run: _Run) -> StepClock:
    """UIFace's latent autoencoder at params.yaml ``generator.autoencoder_train`` (a diffusers ``AutoencoderTiny``
    or ``AutoencoderKL`` on 32-px faces, batch 16, with the identity term through a randomly initialised FR model of
    the ``fr`` section)."""
    from ml.fr.backbones import build_backbone
    from ml.generator.autoencoder import train_autoencoder

    ae, _, faces, ids = _generator_faces(run)
    if ae is None:
        raise ConfigError("generator.space is pixel: there is no autoencoder to train")
    ae = dataclasses.replace(ae, epochs=1, max_steps=run.total, **_device_keys(run))
    faces, ids = faces[: ae.batch_size * run.total], ids[: ae.batch_size * run.total]
    fr = run.params["fr"]
    fr_model = build_backbone(fr["backbone"], img_size=run.params["data"]["image_size"],
                              embed_dim=fr["embedding_dim"]) if ae.fr_weight > 0 else None
    clock = StepClock(run.warmup, run.steps, _leading)
    train_autoencoder(ae, faces, ids, fr_model, callbacks=[clock], progress=False)
    return clock


def _uiface(run: _Run) -> StepClock:
    """The UIFace generator at params.yaml ``generator.train`` (the UNet on the latent of 32-px faces
    through an untrained autoencoder of ``generator.autoencoder_train``'s shape, batch 64, EMA; in pixel space when
    ``generator.space`` is pixel), its identity contexts of the embedded FR model's embedding size."""
    from ml.generator.autoencoder import build_autoencoder
    from ml.generator.train import train_generator

    ae, cfg, faces, ids = _generator_faces(run)
    autoencoder = None if ae is None else build_autoencoder(ae, faces.shape[1]).eval().requires_grad_(False)
    clock = StepClock(run.warmup, run.steps, _leading)
    train_generator(cfg, faces, ids, autoencoder=autoencoder, callbacks=[clock], progress=False)
    return clock


TRAINERS: dict[str, Callable[[_Run], StepClock]] = {
    "fr": _fr,
    "fr112": _fr112,
    "dfa": _dfa,
    "caface": _caface,
    "facegcd": _facegcd,
    "uiface_ae": _uiface_ae,
    "uiface": _uiface,
}


def _one_line(exc: BaseException) -> str:
    """The exception as one line that fits a results.md table cell."""
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:300]}".replace("|", "/")


def _measure(name: str, trainer: Callable[[_Run], StepClock], run: _Run) -> dict[str, Any]:
    gpu = torch.cuda.is_available() and run.on_gpu
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        clock = trainer(run)
        if clock.seconds is None:
            raise RuntimeError(f"the fit ran {clock.done} steps, fewer than warm-up {run.warmup} + {run.steps} timed")
        if run.on_gpu and not (clock.device or "").startswith("cuda"):
            raise RuntimeError(f"the model's parameters were on {clock.device}, not on the GPU, during training")
    except Exception as exc:  # one trainer failing must not hide the others' numbers
        log.warning("gpu_trainers: %s failed", name, exc_info=True)
        return {f"{name}_error": _one_line(exc)}
    out: dict[str, Any] = {
        f"{name}_items_per_s": clock.items / clock.seconds,
        f"{name}_seconds": time.perf_counter() - start,
        f"{name}_device": clock.device,
    }
    if clock.flops_per_item:
        out[f"{name}_gflop_per_item"] = clock.flops_per_item / 1e9
        peak = peak_tflops(torch.cuda.get_device_name(0) if gpu else "cpu", run.precision)
        if peak:
            out[f"{name}_mfu"] = clock.flops_per_item * out[f"{name}_items_per_s"] / (peak * 1e12)
    if gpu:
        out[f"{name}_peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def bench_gpu_trainers(precision: str | None = None) -> dict:
    """Fit each trainer (FR twice: embedded 64 px and ``real-112``; UIFace's autoencoder and UNet apart) for
    ``FACEOPS_BENCH_STEPS`` timed optimiser steps after a short warm-up on ``FACEOPS_BENCH_ACCELERATOR`` in
    ``FACEOPS_BENCH_PRECISION`` (module docstring). Target: report; every trainer runs on the GPU in
    16-mixed/bf16-mixed.

    Returns:
        ``{"device"`` (the GPU's name or "cpu"), ``"accelerator", "precision", "torch", "lightning", "steps",
        "warmup"}`` and per trainer ``<name>`` in fr, fr112, dfa, caface, facegcd, uiface_ae, uiface:
        ``<name>_items_per_s`` (images, crops or CAFace features per second of the timed steps), ``<name>_seconds``
        (the whole trainer call: set-up, warm-up and timed steps), ``<name>_device`` (where the parameters sat, e.g.
        "cuda:0"), ``<name>_gflop_per_item`` (the first step's FLOPs per item), ``<name>_mfu`` where the chip's peak
        is known, and on a GPU ``<name>_peak_gpu_mb`` (``torch.cuda.max_memory_allocated`` of that trainer alone), or
        only ``<name>_error`` (the exception, one line) when it failed.
    """
    run = _env_run(precision)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if run.on_gpu else "cpu",
        "accelerator": run.accelerator,
        "precision": run.precision,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "steps": run.steps,
        "warmup": run.warmup,
    }
    for name, trainer in TRAINERS.items():
        out.update(_measure(name, trainer, run))
    return out


def bench_gpu_trainers_fp16() -> dict:
    """``bench_gpu_trainers`` in ``16-mixed`` (float16 autocast with loss scaling; needs a GPU)."""
    return bench_gpu_trainers("16-mixed")


def bench_gpu_trainers_fp32() -> dict:
    """``bench_gpu_trainers`` in ``32-true``: the baseline of the mixed-precision rows, on the same device."""
    return bench_gpu_trainers("32-true")


def bench_caface_paths() -> dict:
    """CAFace training (``_caface``) with the cluster network's two ways of running sets padded at the end, on the
    same device and precision (``FACEOPS_BENCH_*``), twice each in turn: ``masked`` (one call over the padded batch,
    the path on a GPU) and ``by_length`` (one call per set length, the path on the CPU). Target: on each device its
    path is the faster.

    Returns:
        ``{"device", "precision", "masked_items_per_s", "by_length_items_per_s"`` (lists, one per repeat),
        ``"by_length_over_masked"`` (ratio of the means)}.
    """
    from ml.fusion.caface import ClusterNetwork

    run = _env_run()
    default = ClusterNetwork.by_length_devices
    device = "cuda" if run.on_gpu else "cpu"
    paths = {"masked": (), "by_length": (device,)}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if run.on_gpu else "cpu",
                           "precision": run.precision}
    try:
        for _ in range(2):
            for name, devices in paths.items():
                ClusterNetwork.by_length_devices = devices
                result = _measure("caface", _caface, run)
                if "caface_error" in result:
                    raise RuntimeError(result["caface_error"])
                out.setdefault(f"{name}_items_per_s", []).append(round(result["caface_items_per_s"], 1))
    finally:
        ClusterNetwork.by_length_devices = default
    out["by_length_over_masked"] = float(np.mean(out["by_length_items_per_s"]) / np.mean(out["masked_items_per_s"]))
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(bench_gpu_trainers(), indent=1))
