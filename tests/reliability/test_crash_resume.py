"""Crash and resume: a real SIGKILL of a separate process, then a fresh process carries on.

Trainers (FR, UIFace generator, CAFace fusion, FaceGCD discovery; ``tests/reliability/crash.py``): a worker dies by
SIGKILL inside a checkpoint write, the next resumes from what was left on disk and is SIGKILLed after a random step,
the third resumes and finishes. Its weights and per-epoch losses must equal an uninterrupted run's exactly (all four
trainers promise exact resume), it must have resumed from the last complete checkpoint, and the checkpoint
directory must hold the checkpoint only (no temporary file of the killed writer).

Pipeline: ``dvc repro validate`` on the smoke preset is SIGKILLed (the whole process group) while ``validate`` is
writing its reports, after ``prepare`` finished. The re-run must skip ``prepare`` (its outputs untouched), run
``validate`` to the end, leave ``dvc status`` clean, and leave no temporary or half-written directory behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_project
from tests.reliability.crash import SPECS, CrashRun, kill_and_resume, max_abs_diff, reference

BIN = Path(sys.executable).parent
SEED = 20240611  # the kill points; the report (report_crash.py) draws its own
TEMP_NAME = re.compile(r"(\.tmp\b|\.tmp-|\.old-|\.old$|\.\d+\.old$)")  # what the atomic writers name their temporaries


# ------------------------------------------------------------------------------------------------- trainers
@pytest.fixture(scope="module")
def crashes(tmp_path_factory) -> dict[str, CrashRun]:
    """Every trainer killed twice and resumed; two sequences at a time (each worker uses one thread)."""
    root = tmp_path_factory.mktemp("crash")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(kill_and_resume, name, root / name, SEED) for name in SPECS}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("trainer", sorted(SPECS))
def test_sigkilled_training_resumes_to_the_uninterrupted_result(crashes, trainer):
    spec, run = SPECS[trainer], crashes[trainer]
    died_in_save, held, finished = run.attempts
    # the first worker died inside checkpoint write N: the second found only the N − 1 complete ones
    assert died_in_save.resumed_from == 0
    assert held.resumed_from == run.die_in_save - 1, (held, run.die_in_save)
    # the second was killed right after the drawn step; the last checkpoint it completed is the epoch before
    assert held.last_step == run.kill_step
    assert finished.resumed_from == (run.kill_step - 1) // spec.steps_per_epoch
    assert finished.last_step == spec.total_steps  # it did the remaining steps, no more
    assert run.metrics["resumed_from_epoch"] == finished.resumed_from

    state, metrics = reference(trainer)
    assert run.metrics["epochs"] == spec.epochs == len(metrics["losses"])
    assert run.metrics["losses"] == metrics["losses"]  # exact: every epoch's mean loss, resumed epochs included
    assert max_abs_diff(state, run.state) <= spec.tolerance
    assert run.metrics["digest"] == metrics["digest"]


@pytest.mark.parametrize("trainer", sorted(SPECS))
def test_checkpoint_directory_holds_only_the_checkpoint(crashes, trainer):
    """The killed writer's temporary file is gone once a later run has written the checkpoint."""
    run = crashes[trainer]
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == [SPECS[trainer].checkpoint]


# ------------------------------------------------------------------------------------------------- pipeline
def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}


def _dvc(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=_env(root), capture_output=True,
                          text=True, timeout=timeout)


def _locked_stages(root: Path) -> set[str]:
    lock = root / "dvc.lock"
    return set(yaml.safe_load(lock.read_text())["stages"]) if lock.is_file() else set()


def _mtimes(root: Path, rels: list[str]) -> dict[str, int]:
    """path → mtime (ns) of every file under the given outputs."""
    out: dict[str, int] = {}
    for rel in rels:
        base = root / rel
        for path in [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()):
            out[str(path.relative_to(root))] = path.stat().st_mtime_ns
    return out


def _temporaries(root: Path) -> list[str]:
    """Temporary or half-written entries (atomic writers' names) anywhere under the output directories."""
    found = []
    for top in ("data", "models", "metrics", "plots", "reports"):
        for path in (root / top).rglob("*") if (root / top).is_dir() else ():
            if TEMP_NAME.search(path.name):
                found.append(str(path.relative_to(root)))
    return sorted(found)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill_while_writing(root: Path, stage: str, pattern: str) -> tuple[str, list[str]]:
    """Start ``dvc repro <stage>`` in its own process group and SIGKILL the group as soon as ``stage`` has a
    temporary output matching ``pattern`` on disk (it is then mid-write). → (the log until the kill, the temps)."""
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", stage], cwd=root, env=_env(root),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    os.set_blocking(proc.stdout.fileno(), False)
    log, seen = b"", []
    try:
        while proc.poll() is None:
            log += proc.stdout.read() or b""
            if f"Running stage '{stage}'".encode() in log:
                seen = sorted(str(p.relative_to(root)) for p in root.glob(pattern))
                if seen:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
        proc.wait(timeout=60)
        log += proc.stdout.read() or b""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.decode(errors="replace")
    assert proc.returncode == -signal.SIGKILL, (
        f"dvc repro {stage} ended by itself (exit {proc.returncode}) before {pattern} appeared:\n{text[-3000:]}")
    while not _group_gone(proc.pid):  # the stage process dies with the group; wait for the kernel to reap it
        time.sleep(0.05)
    return text, seen


@pytest.mark.slow
def test_sigkilled_dvc_repro_resumes_without_redoing_finished_stages(tmp_path):
    from tasks.params import apply_delta, load_preset

    root = copy_project(tmp_path / "ws")
    apply_delta(root / "params.yaml", load_preset("smoke", root))
    log, temps = _kill_while_writing(root, "validate", "reports/.validation.*.tmp")
    assert "Running stage 'prepare'" in log and temps, log[-3000:]
    assert _locked_stages(root) == {"prepare"}  # validate never finished
    prepared = [out if isinstance(out, str) else next(iter(out))  # `- path` or `- path: {cache: false}`
                for out in yaml.safe_load((root / "dvc.yaml").read_text())["stages"]["prepare"]["outs"]]
    before = _mtimes(root, prepared)
    # the whole prepared data set (shard tars, their indexes and manifests), not an empty directory
    assert sum("/shards/faces-" in p for p in before) >= 5 and len(before) > 20, sorted(before)

    rerun = _dvc(root, "repro", "validate")
    out = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, out[-3000:]
    assert "Stage 'prepare' didn't change, skipping" in out and "Running stage 'prepare'" not in out, out[-3000:]
    assert "Running stage 'validate'" in out
    assert _mtimes(root, prepared) == before  # prepare's outputs were neither rewritten nor touched
    assert _locked_stages(root) == {"prepare", "validate"}
    assert (root / "reports/validation/train.json").is_file()

    status = _dvc(root, "status", "validate")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr
    assert _temporaries(root) == [], "temporary files left in the outputs after the re-run"
