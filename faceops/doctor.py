"""``faceops doctor``: what this machine is, what the device params resolve to on it, and what a measurement of it
recommends. Nothing here changes a run: a recommendation is applied by setting params, so the choice is recorded
in ``params.yaml`` and ``dvc.lock`` instead of being re-made, perhaps differently, by every run."""

from __future__ import annotations

import platform
from typing import Annotated

import typer

# the trainers' precision keys: what `auto` resolves to on this machine, and what doctor recommends setting
PRECISION_KEYS = ("fr.precision", "generator.train.precision", "generator.autoencoder_train.precision",
                  "discovery.precision", "fusion.train.precision", "aligner.train.precision")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def doctor_cmd(
    measure: Annotated[bool, typer.Option(help="time a bfloat16 against a float32 training step on this CPU "
                                                "(about a second) and recommend a precision")] = True,
) -> None:
    """Show this machine's facts, what `precision: auto` and each stage's thread count resolve to here, and (with
    `--measure`) whether bfloat16 autocast would pay on this CPU.

    `precision: auto` is decided from the instruction set alone (bfloat16 with AMX tiles, else float32), never by a
    timing, so two runs of the same params give the same bits. Where the measurement disagrees, set the precision
    keys yourself, e.g. `faceops run --set fr.precision=bf16-mixed`: the choice then lives in `params.yaml`, and
    DVC reruns the stages it changes.
    """
    import torch

    from faceops.console import repo_root
    from ml.config import from_mapping
    from ml.train.device import (
        BF16_FASTER, available_cores, bf16_step_ratio, cpu_has_amx, cpu_has_bf16, resolve_precision,
    )
    from tasks.common import load_params
    from tasks.pipeline import PipelineConfig, stage_threads

    def row(label: str, value: object) -> None:
        typer.echo(f"  {label:<30} {value}")

    cores = available_cores()
    typer.echo("machine")
    row("CPU", f"{_cpu_name()} ({platform.machine()})")
    row("cores this process may use", cores)
    row("bfloat16 instructions", "yes" if cpu_has_bf16() else "no")
    row("AMX tiles", "yes" if cpu_has_amx() else "no")
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    row("CUDA GPUs", ", ".join(gpus) or "none")
    row("torch", torch.__version__)

    typer.echo("\nwhat the params resolve to here")
    params = load_params(repo_root("faceops doctor") / "params.yaml")
    schedule = from_mapping(PipelineConfig, params.get("pipeline") or {}, "pipeline")
    beside = stage_threads("", schedule, cores)  # "": any stage not in pipeline.exclusive
    row("stage threads", f"{beside} beside other stages (pipeline.jobs = {schedule.jobs}), {cores} alone: "
                         f"{', '.join(schedule.exclusive)}")
    row("precision auto (CPU)", resolve_precision("cpu", "auto"))
    if gpus:
        row("precision auto (GPU)", resolve_precision("gpu", "auto"))

    if not measure:
        return
    typer.echo("\nmeasured now (a recommendation: nothing is applied)")
    ratio = bf16_step_ratio()
    row("bfloat16 step / float32 step", f"{ratio:.2f}× (CPU time, best of 5)")
    auto = resolve_precision("cpu", "auto")
    pays = cpu_has_bf16() and ratio <= BF16_FASTER
    if pays and auto != "bf16-mixed":
        keys = " ".join(f"--set {k}=bf16-mixed" for k in PRECISION_KEYS)
        typer.echo(f"\n  bfloat16 autocast is faster on this CPU; to train in it (other numerics, so DVC reruns "
                   f"the stages):\n    faceops run {keys}")
    elif not pays and auto == "bf16-mixed":
        typer.echo("\n  bfloat16 autocast is not faster here although the CPU has AMX: set the precision keys to "
                   "32-true, e.g. `faceops run --set fr.precision=32-true`")
    else:
        typer.echo(f"\n  precision auto ({auto}) is the faster choice on this CPU: nothing to change.")
