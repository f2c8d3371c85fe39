"""Optuna hyperparameter sweeps over one stage's params: ``faceops sweep train_fr`` (``train_aligner``,
``train_discovery``, ``train_fusion``, ``train_generator``; flow ``sweep``).

The search space is data (params ``sweep``, ``ops.sweep.config``): each range is checked against the stage's config
class before a trial starts. A trial applies its values as an in-memory delta (``params.yaml`` is never written
during a sweep), trains, reports the stage's validation metric every epoch to Optuna, which may prune it, and
returns the value of the model the stage would keep: the last epoch's, or the best epoch's where the stage keeps
its best (``ops.sweep.targets.OBJECTIVES``). Every process with the same storage and study name joins
one study; the creator opens the MLflow parent run under which every trial nests (``ops.sweep.study``). On an SQL
storage running trials beat a heartbeat, and a killed worker's trial is failed and retried once (Optuna's
``RetryHeartbeatStaleTrialCallback``); a JournalStorage has no heartbeat. ``report`` writes the history and importance
plots and the best trial; ``apply_best`` writes the best params into ``params.yaml``.

Here: ``run_sweep``, the whole sweep in one process, and ``python -m ops.sweep``, one more worker on a study. See
``docs/operations/sweeps.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

# the sweep's API in one place (the flow, the CLI and the tests import these from here)
from ops.sweep.config import ENV_STORAGE, StorageSpec, SweepConfig, SweepError, open_storage
from ops.sweep.study import SweepPlan, apply_best, check_request, ensure_tracking, prepare_sweep, report
from ops.sweep.targets import OBJECTIVES
from ops.sweep.trials import run_trials

__all__ = ["ENV_STORAGE", "OBJECTIVES", "StorageSpec", "SweepConfig", "SweepError", "SweepPlan", "apply_best",
           "check_request", "ensure_tracking", "main", "open_storage", "prepare_sweep", "report", "run_sweep",
           "run_trials", "worker_command"]


def run_sweep(stage: str = "train_fr", *, trials: int | None = None, storage: str | None = None,
              study: str | None = None, root: Path | str = ".", apply: bool = False, pruner: Any = None) -> dict[str, Any]:
    """The whole sweep in this process, without Prefect (the ``sweep`` flow runs the same steps as tasks)."""
    plan = prepare_sweep(stage, trials=trials, storage=storage, study=study, root=root)
    run_trials(plan, pruner=pruner)
    summary = report(plan)
    if apply:
        summary["applied"] = apply_best(plan)
    return summary


def worker_command(plan: SweepPlan, trials: int, seed: int) -> list[str]:
    """The command of one extra worker process on the plan's study (the storage travels in ``$FACEOPS_SWEEP_STORAGE``,
    not in the command line, where other users of the machine could read a password)."""
    return [sys.executable, "-m", "ops.sweep", plan.stage, "--study", plan.study, "--trials", str(trials),
            "--seed", str(seed)]


def main(argv: list[str] | None = None) -> None:
    """``python -m ops.sweep STAGE --study NAME --trials N [--seed S]``: join a study and run N trials."""
    parser = argparse.ArgumentParser(prog="python -m ops.sweep",
                                     description="One sweep worker: join study NAME and run N trials of STAGE.")
    parser.add_argument("stage")
    parser.add_argument("--study", required=True)
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    plan = prepare_sweep(args.stage, trials=args.trials, study=args.study, root=Path.cwd(), seed=args.seed)
    run_trials(plan)
