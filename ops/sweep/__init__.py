"""Optuna hyperparameter sweeps over one stage's params: ``faceops sweep train_fr`` (flow ``sweep``).

The search space is data: ``params.yaml``'s ``sweep:`` section (``SweepConfig``) holds the study settings
(storage, sampler, pruner, seed) and one entry per sweepable stage (``StageSweep``: metric, direction, trials,
``fixed`` overrides and ``space``, a mapping of dotted params keys such as ``fr.lr`` to ranges, ``ParamRange``).
Every range is checked against the stage's config class before a trial starts: a key that is not a params
key, a wrong type, ``low ≥ high``, a log scale reaching 0, no choices, or a bound the stage itself rejects
raises a ConfigError naming ``sweep.<stage>.space.<key>.<field>``.

A trial applies its values as an in-memory delta on the stage's section (``params.yaml`` is never written
during a sweep), trains, reports the stage's metric after every epoch to Optuna, which may prune it (Optuna's
Lightning pruning callback), and returns the last value. ``OBJECTIVES`` maps each sweepable stage to what that
means (``SweepTarget``); ``train_fr`` reports ``val/accuracy``, the closed-set identification accuracy of the
prepared set's ``val`` split against the margin head's class centres.

One study, many processes: every command or worker with the same storage and study name joins the same study
(the storage hands out trial numbers, so none is lost or run twice). The process that creates the study also
creates the MLflow parent run and records its id in the study; the others wait for that id, so all trials,
whatever process ran them, are nested runs under one parent, each with its params, per-epoch curves, its state
(``optuna.trial_state``: COMPLETE, PRUNED, FAIL) and its number. Storage: ``""`` is ``sqlite:///optuna.db`` in
the repository, ``journal:<file>`` an Optuna JournalStorage file (several processes on one machine or a shared
file system), or an SQLAlchemy URL (``postgresql://user@host/db``; the password comes from ``PGPASSWORD`` or
``~/.pgpass``, never from params.yaml; printed and logged URLs have it masked).

A worker killed mid-trial (SIGKILL, a lost node) cannot mark its trial finished. On an SQL storage every running
trial beats a heartbeat every ``sweep.heartbeat_s`` seconds; a trial silent for three intervals is marked FAIL
by the next worker that starts a trial, and run again once with the same params (Optuna's
``RetryFailedTrialCallback``: the copy records the failed trial's number). A JournalStorage has no heartbeat in
Optuna: there such a trial stays RUNNING, so use an SQL storage for workers that may be killed.

After the trials, ``report`` writes the optimisation history and parameter importance plots
(``plots/sweeps/``), the best params and value (``reports/sweeps/<study>.json``) and logs them to the parent
run; ``apply_best`` writes the best params into ``params.yaml`` (comments kept) and returns a unified diff.

Here: ``run_sweep``, the whole sweep in one process, and ``python -m ops.sweep``, one more worker on a study. The
parts: ``ops.sweep.config`` (the section, the space checks, the storage), ``ops.sweep.targets`` (``OBJECTIVES``),
``ops.sweep.study`` (create or join a study and its parent run; ``report``, ``apply_best``) and ``ops.sweep.trials``
(``run_trials``).
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
from tasks.common import stage_main

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
