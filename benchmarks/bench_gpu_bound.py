"""What bounds the ``real-112`` FR training step on one accelerator, and its model FLOP utilisation (MFU).

The ``real-112`` preset's FR model (ViT-T patch 9 at 112 px, 512-d embeddings, AdaFace over ``CLASSES`` identities,
as in CASIA-WebFace) is stepped by hand on one batch of random uint8 faces already on the device: augment, forward
under autocast, the float32 loss with the trainer's finiteness check, backward, the trainer's AdamW. Nothing but
the step is timed, in variants that each change one thing:

- ``fit``, ``fit_eager``, ``fit_ddp``: ``train_fr`` itself (``bench_gpu._fr112``; DataLoader, Lightning's loop
  and logging included) with the preset's keys (``fr.compile: true``), with ``fr.compile: false``, and with
  ``strategy: ddp`` on one device (the process group and DDP's gradient hooks);
- ``step``: the trainer's step by hand (``FRModule._augment``: the KP-RPE recipe on the device, dense path);
- ``step_sparse``: the augmentation's CPU path on the device (rows found by reading masks back, one wait each);
- ``nocheck``: without the loss's finiteness check (the one wait for the device per step);
- ``noaug``: normalisation only;
- ``compiled``: ``torch.compile`` of the backbone, augmentation as in ``step``; ``compiled_noaug`` without it;
  ``compiled_aug`` with the augmentation compiled too; ``compiled_b2x``, ``compiled_b4x``: ``compiled`` at twice and
  four times the preset's batch;
- ``graphed``, ``graphed_noaug``: the backbone compiled with ``mode="reduce-overhead"`` (its forward and backward
  replayed as CUDA graphs); ``graphed_aug_b4x``: with the augmentation compiled, at four times the batch.

Three rows, each one run: ``fr112_bound`` (``BOUND``), ``fr112_graphs`` (``GRAPHS``), ``fr112_fit_compile``
(``FIT_COMPILE``); ``FACEOPS_BENCH_VARIANTS`` (comma-separated) runs the variants it names instead.

FLOPs per image are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one ``noaug`` step (matrix
products, convolutions and attention of forward and backward; elementwise work is not counted, as usual for MFU).
MFU = FLOP/image × images/s ÷ ``peak_tflops``, the chip's dense tensor peak for the precision
(``bench_gpu.PEAK_TFLOPS``, or ``FACEOPS_BENCH_PEAK_TFLOPS``). ``<variant>_busy``: CUDA kernel time ÷ wall time over
profiled steps (below 1 the device waits for the host).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_gpu import FR112_CPU_BATCH, _env_run, _fr112, _one_line, _Run, fr112_section, peak_tflops
from ml.config import from_mapping
from ml.errors import ConfigError

CLASSES = 10_575  # CASIA-WebFace's identities: the head's size on the data the preset is for
WARMUP, STEPS, PROFILED = 5, 20, 5
def step_flops(step: Callable[[], Any]) -> float:
    """FLOPs of one call of ``step`` (forward and backward) as ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return float(counter.get_total_flops())


@dataclasses.dataclass
class _Stepper:
    """One hand-written training step of the ``real-112`` FR module on a fixed device batch."""

    module: Any
    optimizer: torch.optim.Optimizer
    images: torch.Tensor  # uint8 (B, 3, S, S) on the device
    labels: torch.Tensor
    precision: str
    augment: bool = True
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    check: bool = True  # the trainer's finiteness check of the loss (one wait for the device per step)
    graphed: bool = False  # ``forward`` replays CUDA graphs (torch.compile's "reduce-overhead")

    def __call__(self) -> None:
        from ml.fr.data import normalize

        m = self.module
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.precision)
        if self.graphed:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are no longer read
        with torch.autocast(self.images.device.type, dtype=dtype, enabled=dtype is not None):
            if self.augment:
                x, _ = m._augment(self.images, None)
            else:
                x = normalize(self.images, m.mean, m.std)
            forward = m.backbone if self.forward is None else self.forward
            loss, _ = m._loss(forward(x), self.labels)
        if self.check and not bool(torch.isfinite(loss)):
            raise RuntimeError("non-finite loss in the benchmark step")
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _stepper(run: _Run, batch: int) -> _Stepper:
    from ml.fr.backbones import build_backbone
    from ml.fr.config import FRConfig
    from ml.fr.module import FRModule, build_head
    from ml.fr.train import _backbone_kwargs
    from ml.train.schedules import adamw

    fr, size = fr112_section(run)
    # eager: the variants compile what they name themselves (the preset's fr.compile is for train_fr)
    cfg = dataclasses.replace(from_mapping(FRConfig, fr, "real-112: fr"), compile=False)
    device = torch.device("cuda" if run.on_gpu else "cpu")
    backbone = build_backbone(cfg.backbone, **_backbone_kwargs(cfg, size, None))
    module = FRModule(backbone, build_head(cfg, CLASSES), cfg, steps_per_epoch=1_000).to(device).train()
    gen = torch.Generator(device="cpu").manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, size, size), generator=gen, dtype=torch.uint8).to(device)
    labels = torch.randint(0, CLASSES, (batch,), generator=gen).to(device)
    return _Stepper(module, adamw(module.parameters(), lr=cfg.lr), images, labels, run.precision)


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _time(step: Callable[[], Any], warmup: int, steps: int) -> float:
    """Seconds per step after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return (time.perf_counter() - start) / steps


def _busy(step: Callable[[], Any], steps: int) -> float:
    """CUDA kernel time ÷ wall time over ``steps`` profiled steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync()
    wall_us = (time.perf_counter() - start) * 1e6
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    if not kernel_us:  # kernels not listed as events: each host op's own device time counts them once
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CPU)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)  # where the host goes
    return kernel_us / wall_us


# each row's variants: one device run gives each row's ratios
BOUND = ("fit_eager", "fit_ddp", "step", "step_sparse", "agreement", "nocheck", "noaug", "compiled", "compiled_noaug",
         "compiled_b2x", "compiled_b4x")
GRAPHS = ("step", "nocheck", "noaug", "compiled", "compiled_aug", "graphed", "graphed_noaug", "graphed_aug_b4x")
FIT_COMPILE = ("fit_eager", "fit")
GPU_ONLY = {"step_sparse", "agreement", "compiled_aug", "compiled_b2x", "compiled_b4x", "graphed", "graphed_noaug",
            "graphed_aug_b4x"}


def bench_fr112_bound(variants: tuple[str, ...] = BOUND) -> dict:
    """The ``real-112`` FR step's ``variants`` (module docstring; ``FACEOPS_BENCH_VARIANTS`` overrides them) on
    ``FACEOPS_BENCH_ACCELERATOR`` in ``FACEOPS_BENCH_PRECISION``; the GPU-only ones are left out on the CPU. Target:
    report what bounds the step; MFU ≥ 35 % and busy ≥ 0.9 on a GPU.

    Returns:
        ``{"device", "precision", "batch", "classes", "gflop_per_image", "peak_tflops"}`` and per variant
        ``<variant>_images_per_s``, ``<variant>_mfu`` (where the peak is known), ``step_busy`` and
        ``compiled_busy`` on a GPU, ``dense_vs_sparse_max_diff`` (the two augmentation paths on the device, blur
        off, same draw), or ``<variant>_error`` (one line) for a variant that failed.
    """
    run = _env_run()
    device = torch.cuda.get_device_name(0) if run.on_gpu else "cpu"
    batch = int(run.preset.get("fr.batch_size", 512)) if run.on_gpu else FR112_CPU_BATCH
    steps = STEPS if run.on_gpu else 2
    out: dict[str, Any] = {"device": device, "precision": run.precision, "batch": batch, "classes": CLASSES,
                           "torch": torch.__version__}
    peak = peak_tflops(device, run.precision)
    out["peak_tflops"] = peak

    def record(name: str, images_per_s: float) -> None:
        out[f"{name}_images_per_s"] = images_per_s
        if peak and out.get("gflop_per_image"):
            out[f"{name}_mfu"] = out["gflop_per_image"] * 1e9 * images_per_s / (peak * 1e12)

    def attempt(name: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # one variant failing must not hide the others' numbers
            out[f"{name}_error"] = _one_line(exc)
        finally:
            mine = {k: v for k, v in out.items() if k.startswith(name) or k == "gflop_per_image"}
            print(f"fr112_bound {name} ({time.perf_counter() - start:.0f} s): {mine}", flush=True)
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    base = _stepper(run, batch)

    def flops() -> None:
        plain = dataclasses.replace(base, augment=False)
        out["gflop_per_image"] = step_flops(plain) / batch / 1e9

    def fit(name: str, **fr: Any) -> Callable[[], None]:
        def go() -> None:
            r = dataclasses.replace(run, preset={**run.preset, **{f"fr.{k}": v for k, v in fr.items()}})
            clock = _fr112(r)
            if clock.seconds is None:
                raise RuntimeError(f"the fit ran {clock.done} steps, fewer than its warm-up and timed steps")
            record(name, clock.items / clock.seconds)
        return go

    def variant(name: str, stepper: _Stepper, busy: bool = False) -> Callable[[], None]:
        def go() -> None:
            record(name, stepper.images.shape[0] / _time(stepper, WARMUP, steps))
            if busy and run.on_gpu:
                out[f"{name}_busy"] = _busy(stepper, PROFILED)
        return go

    def sparse() -> None:
        from ml.train import augment

        saved = augment.SPARSE_DEVICES
        augment.SPARSE_DEVICES = ("cpu", "cuda")
        try:
            variant("step_sparse", base)()
        finally:
            augment.SPARSE_DEVICES = saved

    def agreement() -> None:
        from ml.train import augment

        cfg = dataclasses.replace(base.module.cfg.augmentation, blur_prob=0.0)
        x = base.images.float() / 255.0
        u = torch.rand(x.shape[0], augment.DRAW_SIZE, generator=torch.Generator().manual_seed(1)).to(x.device)
        dense, _ = augment.augment_with(x, None, cfg, u)
        saved = augment.SPARSE_DEVICES
        augment.SPARSE_DEVICES = ("cpu", "cuda")
        try:
            sparse_out, _ = augment.augment_with(x, None, cfg, u)
        finally:
            augment.SPARSE_DEVICES = saved
        out["dense_vs_sparse_max_diff"] = float((dense - sparse_out).abs().max())

    forwards: dict[tuple[int, str], Any] = {}  # (batch factor, compile mode) → compiled backbone and its stepper

    def compiled(name: str, factor: int, mode: str = "default", aug: bool = False, **change: Any
                 ) -> Callable[[], None]:
        def go() -> None:
            from ml.train import augment

            if (factor, mode) not in forwards:
                stepper = _stepper(run, batch * factor) if factor > 1 else base
                forwards[factor, mode] = dataclasses.replace(
                    stepper, forward=torch.compile(stepper.module.backbone, mode=mode),
                    graphed=mode == "reduce-overhead")
            stepper = dataclasses.replace(forwards[factor, mode], **change)
            eager = augment.augment_with
            if aug:  # the augmentation compiled too (its dense path has no data-dependent branch)
                augment.augment_with = torch.compile(eager)
            try:
                variant(name, stepper, busy=factor == 1 and not change)()
            finally:
                augment.augment_with = eager
        return go

    steps_by_name: dict[str, Callable[[], None]] = {
        "flops": flops,
        "fit": fit("fit"),
        "fit_eager": fit("fit_eager", compile=False),
        "fit_ddp": fit("fit_ddp", strategy="ddp"),
        "step": variant("step", base, busy=True),
        "step_sparse": sparse,
        "agreement": agreement,
        "nocheck": variant("nocheck", dataclasses.replace(base, check=False)),
        "noaug": variant("noaug", dataclasses.replace(base, augment=False), busy=True),
        "compiled": compiled("compiled", 1),
        "compiled_noaug": compiled("compiled_noaug", 1, augment=False),
        "compiled_aug": compiled("compiled_aug", 1, aug=True),
        "compiled_b2x": compiled("compiled_b2x", 2),
        "compiled_b4x": compiled("compiled_b4x", 4),
        "graphed": compiled("graphed", 1, "reduce-overhead"),
        "graphed_noaug": compiled("graphed_noaug", 1, "reduce-overhead", augment=False),
        "graphed_aug_b4x": compiled("graphed_aug_b4x", 4, "reduce-overhead", aug=True),
    }
    chosen = [v for v in os.environ.get("FACEOPS_BENCH_VARIANTS", "").split(",") if v] or list(variants)
    unknown = sorted(set(chosen) - set(steps_by_name))
    if unknown:
        raise ConfigError(f"FACEOPS_BENCH_VARIANTS names {unknown}; choose from {sorted(steps_by_name)}")
    for name in ["flops", *chosen]:
        if run.on_gpu or name not in GPU_ONLY:
            attempt(name, steps_by_name[name])
    if run.on_gpu:
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def bench_fr112_graphs() -> dict:
    """``bench_fr112_bound`` over ``GRAPHS``: compiled and CUDA-graph steps beside the eager step, in one run."""
    return bench_fr112_bound(GRAPHS)


def bench_fr112_fit_compile() -> dict:
    """``bench_fr112_bound`` over ``FIT_COMPILE``: ``train_fr`` with the preset's ``fr.compile: true`` and without."""
    return bench_fr112_bound(FIT_COMPILE)


if __name__ == "__main__":
    import json

    print(json.dumps(bench_fr112_bound(), indent=1))
