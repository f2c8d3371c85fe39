"""Crash-and-resume report: ``python -m tests.reliability.report_crash [--seed N] [--no-pipeline]``.

Runs every trainer's kill/resume sequence once (``tests/reliability/crash.py``: SIGKILL inside a checkpoint write,
then SIGKILL after a random step, then resume to the end) at kill points drawn from ``--seed`` (default: a fresh
random seed, recorded in the report so the run can be repeated), compares each with an uninterrupted run, and, unless
``--no-pipeline``, SIGKILLs ``dvc repro validate`` on the smoke preset mid-write and re-runs it. Everything runs in a
snapshot of the project (its tracked and untracked files), so edits to the working tree meanwhile cannot mix code
versions. Writes ``reports/reliability_crash.md`` (temporary file + rename) and prints its path.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.reliability.crash import REPO, SPECS, CrashRun, kill_and_resume, max_abs_diff, reference

REPORT = REPO / "reports" / "reliability_crash.md"


def trainer_row(run: CrashRun) -> dict[str, Any]:
    """One table row: where the kills landed, where training resumed, and the final metrics against a reference."""
    spec = SPECS[run.trainer]
    state, metrics = reference(run.trainer)
    died, held, finished = run.attempts
    loss_diff = abs(run.metrics["final_loss"] - metrics["final_loss"])
    weight_diff = max_abs_diff(state, run.state)
    epoch, within = divmod(run.kill_step - 1, spec.steps_per_epoch)
    ok = (died.returncode == held.returncode == -9 and finished.returncode == 0
          and held.resumed_from == run.die_in_save - 1 and finished.last_step == spec.total_steps
          and max(loss_diff, weight_diff) <= spec.tolerance and run.metrics["digest"] == metrics["digest"]
          and sorted(p.name for p in run.checkpoint_dir.iterdir()) == [spec.checkpoint])
    return {
        "trainer": run.trainer,
        "first kill": f"inside checkpoint write {run.die_in_save} (after epoch {run.die_in_save})",
        "second kill": f"step {run.kill_step}/{spec.total_steps} (epoch {epoch + 1}, step {within + 1} of "
                       f"{spec.steps_per_epoch})",
        "resumed from epoch": f"{held.resumed_from}, then {finished.resumed_from}",
        "final loss uninterrupted": f"{metrics['final_loss']:.8f}",
        "final loss resumed": f"{run.metrics['final_loss']:.8f}",
        "Δ final loss (abs)": f"{loss_diff:.1e}",
        "max Δ weight (abs)": f"{weight_diff:.1e}",
        "tolerance": "exact (0)" if spec.tolerance == 0 else f"{spec.tolerance:g}",
        "ok": "yes" if ok else "**NO**",
    }


def pipeline_rows(workdir: Path) -> list[tuple[str, str]]:
    """SIGKILL ``dvc repro validate`` while validate writes its reports, re-run, and describe what happened."""
    from tests.conftest import copy_project
    from tests.reliability import test_crash_resume as t
    from tasks.params import apply_delta, load_preset

    root = copy_project(workdir)
    apply_delta(root / "params.yaml", load_preset("smoke", root))
    t0 = time.perf_counter()
    log, temps = t._kill_while_writing(root, "validate", "reports/.validation.*.tmp")
    killed_after = time.perf_counter() - t0
    locked = sorted(t._locked_stages(root))
    prepared = ["data/prepared", "plots/samples.png"]
    before = t._mtimes(root, prepared)
    t1 = time.perf_counter()
    rerun = t._dvc(root, "repro", "validate")
    rerun_s = time.perf_counter() - t1
    out = rerun.stdout + rerun.stderr
    status = t._dvc(root, "status", "validate")
    prepare = "skipped" if "Stage 'prepare' didn't change, skipping" in out else "RE-RUN"
    validate = "ran" if "Running stage 'validate'" in out else "did not run"
    warnings = [line for line in out.splitlines() if "RWLock-file" in line and "had been killed" in line]
    return [
        ("killed", f"`dvc repro validate` process group, {killed_after:.0f} s after start, while validate was "
                   f"writing (temporaries on disk: {', '.join(f'`{p}`' for p in temps)})"),
        ("dvc.lock after the kill", ", ".join(locked) or "none"),
        ("re-run", f"exit {rerun.returncode} in {rerun_s:.0f} s; prepare {prepare}; validate {validate}"),
        ("prepare's outputs", f"{len(before)} files, mtimes {'unchanged' if t._mtimes(root, prepared) == before else 'CHANGED'}"),
        ("DVC's lock after SIGKILL", f"the killed process was still named in `.dvc/tmp/rwlock` for {len(warnings)} "
                                     "path(s); the re-run removed those entries itself (a WARNING line each), no "
                                     "manual step" if warnings else "nothing stale"),
        ("`dvc status validate`", status.stdout.strip().splitlines()[0] if status.stdout.strip() else status.stderr),
        ("temporaries left after the re-run", ", ".join(t._temporaries(root)) or "none"),
    ]


def code_digest() -> str:
    """sha256 over ``ml/`` and ``tasks/`` sources: a report is only meaningful when every process of it (workers and
    reference) ran the same code."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted([*REPO.glob("ml/**/*.py"), *REPO.glob("tasks/*.py")]):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def render(seed: str, rows: list[dict[str, Any]], pipeline: list[tuple[str, str]] | None, seconds: float) -> str:
    head = list(rows[0])
    lines = [
        "# Crash and resume",
        "",
        f"Generated by `python -m tests.reliability.report_crash --seed {seed}` on {platform.node()} "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {seconds:.0f} s). Kill points are drawn from the seed; the same seed "
        "gives the same points.",
        "",
        "## Trainers",
        "",
        "Each trainer runs at toy size (tiny model, separable data, CPU, one thread) in a separate process that is "
        "SIGKILLed twice: first inside a checkpoint write (Lightning's temporary file written, not yet renamed), "
        "then, resumed in a fresh process, right after a "
        "random optimiser step. A third process resumes from whatever the killed ones left on disk and finishes. "
        "The reference is the same training uninterrupted. `resumed from epoch`: epochs in the checkpoint each "
        "resumed process found. `ok`: both kills were SIGKILLs, every resume started from the last complete "
        "checkpoint, the weights' digest and every epoch's loss equal the reference within the tolerance, and the "
        "checkpoint directory holds the checkpoint only.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    lines += ["| " + " | ".join(str(r[k]) for k in head) + " |" for r in rows]
    if pipeline is not None:
        lines += ["", "## Pipeline (`dvc repro`, smoke preset)", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in pipeline]
    lines += ["", f"Python {sys.version.split()[0]}, {platform.machine()}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    from tasks.common import write_text

    parser = argparse.ArgumentParser(prog="python -m tests.reliability.report_crash", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", default=None, help="draws the kill points (default: fresh, recorded)")
    parser.add_argument("--no-pipeline", action="store_true", help="trainers only (skip the dvc repro kill)")
    parser.add_argument("--report", type=Path, default=None, help=argparse.SUPPRESS)  # set in the snapshot run
    args = parser.parse_args(argv)
    seed = args.seed or str(secrets.randbelow(10**6))
    if args.report is None:
        return in_snapshot(seed, args.no_pipeline)
    report = args.report
    code = code_digest()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="faceops-crash-report-") as tmp:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {name: pool.submit(kill_and_resume, name, Path(tmp) / name, seed) for name in SPECS}
            runs = [futures[name].result() for name in SPECS]
        rows = [trainer_row(run) for run in runs]
        pipeline = None if args.no_pipeline else pipeline_rows(Path(tmp) / "ws")
    if code_digest() != code:
        raise SystemExit("ml/ or tasks/ changed while the report ran, so its processes ran different code; "
                         f"{report} was not written. Run it again.")
    write_text(report, render(seed, rows, pipeline, time.perf_counter() - t0))
    print(report)
    return report


def in_snapshot(seed: str, no_pipeline: bool) -> Path:
    """Run the report in a snapshot of the project (``copy_project``), so that every worker and the reference run
    the same code even while the working tree is being edited; the report lands in this tree's ``reports/``."""
    from faceops.workspace import copy_project

    with tempfile.TemporaryDirectory(prefix="faceops-crash-snapshot-") as tmp:
        root = copy_project(REPO, Path(tmp))
        cmd = [sys.executable, "-m", "tests.reliability.report_crash", "--seed", seed, "--report", str(REPORT)]
        cmd += ["--no-pipeline"] * no_pipeline
        done = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    if done.returncode != 0:
        raise SystemExit(f"the crash report failed in its snapshot (exit {done.returncode}); see the output above")
    return REPORT


if __name__ == "__main__":
    main()
