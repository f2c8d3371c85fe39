"""Where a training runs and in what numerics: the device keys every trainer shares (``accelerator``, ``devices``,
``precision``), what ``precision: auto`` means, which attention kernels a CPU training runs, and the process-wide
settings that make a run repeatable.

Everything here is decided from params and stable facts of the machine (instruction sets, device names, the cores
this process may use), never from a clock: two runs of the same params on the same machine train in the same
precision with the same thread count, so they give the same bits. ``bf16_step_ratio`` measures whether bfloat16
autocast pays on this CPU; ``faceops doctor`` shows it as a recommendation that a user applies by setting params.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ml.errors import ConfigError

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")  # auto: resolve_precision
DEVICE_KEYS = ("accelerator", "devices", "precision")  # where a run trains, not what: may change on resume
BF16_FASTER = 0.9  # doctor recommends bf16-mixed on a CPU where a step takes at most this share of float32's


def trains_on_cpu(accelerator: str) -> bool:
    """Whether Lightning's ``accelerator`` setting puts the training on the CPU of this machine."""
    return accelerator == "cpu" or (
        accelerator == "auto" and not torch.cuda.is_available() and not torch.backends.mps.is_available()
    )


def check_device(section: str, accelerator: str, precision: str) -> None:
    """Refuse settings the machine cannot run (params ``<section>.accelerator`` / ``.precision``), instead of
    Lightning silently or obscurely changing them."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{section}.accelerator {accelerator!r} but no CUDA GPU is visible; use 'auto' or 'cpu'")
    if trains_on_cpu(accelerator) and precision == "16-mixed":
        raise ConfigError(
            f"{section}.precision '16-mixed' needs a GPU, but {section}.accelerator {accelerator!r} runs on the CPU "
            "here; use 'bf16-mixed' (bfloat16 autocast works on the CPU) or '32-true'"
        )


def check_device_keys(section: str, accelerator: Any, devices: Any, precision: Any, max_devices: int | None = 1) -> None:
    """Config-time check of a trainer's ``accelerator`` / ``devices`` / ``precision`` keys (values, not the machine:
    ``check_device`` does that when training starts). ``max_devices`` None allows any number (DDP)."""
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"{section}.accelerator {accelerator!r} is not one of {list(ACCELERATORS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"{section}.precision {precision!r} is not one of {list(PRECISIONS)}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"{section}.devices = {devices!r}: need an integer ≥ 1")
    if max_devices is not None and devices > max_devices:
        raise ConfigError(
            f"{section}.devices = {devices}: this trainer runs on one device (its model and data fit one GPU); "
            "only fr.devices spreads training over several with DDP"
        )


def _cpu_supports(check: str) -> bool:
    """``torch.cpu._is_<feature>_supported()``; False on a torch build without that check."""
    return bool(getattr(torch.cpu, check, lambda: False)())


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles: the matrix units that make bfloat16 autocast pay on a CPU."""
    return _cpu_supports("_is_amx_tile_supported")


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16 or AMX); without AMX they need not make a step
    faster (``bf16_step_ratio`` measures it)."""
    return _cpu_supports("_is_avx512_bf16_supported") or cpu_has_amx()


def resolve_precision(accelerator: str, precision: str) -> str:
    """``precision`` as Lightning takes it. "auto" becomes "bf16-mixed" on a CUDA GPU that supports bfloat16 and on
    a CPU with AMX tiles, else "32-true"; any other value is returned as it is. On a CPU with AVX512-BF16 but no AMX
    a bfloat16 step is slower than a float32 one (``train_step_costs`` in ``benchmarks/results.md``), so "auto" keeps
    float32 there; ``faceops doctor`` measures this CPU and says when setting "bf16-mixed" by hand would pay."""
    if precision != "auto":
        return precision
    if trains_on_cpu(accelerator):
        return "bf16-mixed" if cpu_has_amx() else "32-true"
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32-true"
    return "32-true"  # mps


def attention_kernels(accelerator: str, precision: str) -> contextlib.AbstractContextManager:
    """The ``F.scaled_dot_product_attention`` kernels a training runs (a context for the whole fit; the backward
    follows the kernel its forward chose). On the CPU under bfloat16 autocast: the math kernel, i.e. two batched
    matmuls and a float softmax that oneDNN runs on the matrix units, because the fused CPU flash kernel's backward
    is slower there than the rest of the step put together at these sequence lengths (``train_step_costs``
    ``*_flash_ratio`` in ``benchmarks/results.md``). Everywhere else PyTorch's own choice (on a GPU the fused
    kernels win). Both kernels are deterministic, so the choice is a fact of the params and the machine, as
    ``resolve_precision`` is."""
    if precision == "bf16-mixed" and trains_on_cpu(accelerator):
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def bf16_step_ratio(repeats: int = 5) -> float:
    """CPU time of a small training step (an MLP and two 3×3 convolutions, forward and backward) in bfloat16
    autocast over the same step in float32, best of ``repeats`` interleaved runs each (about 0.3 s). A measurement
    for ``faceops doctor`` and the benchmarks, never a decision on the training path: under load it moves (a wall
    clock read 0.70–1.62 on one CPU), and a decision that moves with it would change a run's numerics."""
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # the layers' init draws: leave the caller's seeded state as it was
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        conv = nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.SiLU(), nn.Conv2d(64, 32, 3, padding=1))
    x, y = torch.randn(512, 256, generator=gen), torch.randn(16, 32, 16, 16, generator=gen)

    def step(bf16: bool) -> float:
        start = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = mlp(x).float().square().mean() + conv(y).float().square().mean()
        loss.backward()
        return time.process_time() - start

    step(False), step(True)  # warm-up: allocator, kernel selection
    times = [(step(False), step(True)) for _ in range(max(1, repeats))]  # interleaved: load hits both alike
    return min(b for _, b in times) / min(f for f, _ in times)


def rng_devices(accelerator: str) -> list[int]:
    """The CUDA devices whose random state a training on ``accelerator`` may reseed (for ``torch.random.fork_rng``,
    so that the caller's state is left as it was)."""
    if accelerator == "cpu" or not torch.cuda.is_available():
        return []
    return list(range(torch.cuda.device_count()))


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: what ``taskset``, a container or a batch
    scheduler grants), a fact of the machine that does not move with its load."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity masks on this OS
        return max(1, os.cpu_count() or 1)


def set_threads(threads: int) -> None:
    """Fix this process's torch intra-op threads (and the OpenMP/MKL pools of the processes it starts) at
    ``threads`` for the rest of its run. The order of a float reduction on the CPU follows the thread count, so a
    count that changed while training ran would change the result's bits."""
    threads = max(1, int(threads))
    torch.set_num_threads(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def deterministic_algorithms() -> None:
    """Ask torch for deterministic kernels where it has them (``torch.use_deterministic_algorithms``, warning
    where an op has none), cuDNN without autotuning, and cuBLAS with a fixed workspace. Uninitialised memory is
    not filled: only a bug could read it, and filling it costs every allocation."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
