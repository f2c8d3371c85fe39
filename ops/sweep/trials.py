"""The trials of one study in this process (``run_trials``): each trains as a nested MLflow run, reports every epoch
to Optuna, which may prune it, and ends tagged with its state. See ``ops/sweep``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from ml.config import from_mapping, to_flat_dict
from ml.errors import FaceopsError, TrainingError
from ops.sweep.config import ParamRange, StageSweep, SweepConfig, build_config, open_storage
from ops.sweep.study import BASELINE_ATTR, SweepPlan, ensure_tracking
from ops.sweep.targets import OBJECTIVES, SweepTarget, TrialTrainer
from ops.tracking import StageTracker, git_commit
from tasks.common import Paths, load_params, redact, section


def make_sampler(settings: SweepConfig, seed: int) -> Any:
    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # constant liar (Optuna 5's default): running trials of other workers count as bad, so they are not repeated
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=settings.startup_trials)


def make_pruner(settings: SweepConfig) -> Any:
    import optuna

    if settings.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=settings.startup_trials, n_warmup_steps=settings.warmup_epochs)


def suggest(trial: Any, key: str, r: ParamRange) -> Any:
    """The trial's value for params key ``key`` from its range."""
    if r.type == "categorical":
        return trial.suggest_categorical(key, list(r.choices or []))
    if r.type == "int":
        return trial.suggest_int(key, int(r.low), int(r.high), step=int(r.step or 1), log=r.log)
    return trial.suggest_float(key, float(r.low), float(r.high), step=r.step, log=r.log)


def run_trials(plan: SweepPlan, trials: int | None = None, *, pruner: Any = None, threads: int | None = None) -> int:
    """Run ``trials`` (default: the plan's) trials of the plan's study in this process; → how many ran.

    A trial whose config the stage rejects or whose training fails (NaN loss) is recorded FAIL and the study
    goes on; any other error stops the sweep. ``pruner`` replaces ``sweep.pruner`` (tests force pruning)."""
    import optuna

    n = plan.trials if trials is None else trials
    if n == 0:
        return 0
    params = load_params(plan.root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    entry = settings.stage(plan.stage)
    if threads:
        import torch

        torch.set_num_threads(threads)
    ensure_tracking(plan.root)  # this process's MLflow client points at the store
    target = OBJECTIVES[plan.stage]
    train_trial = target.trainer(Paths(plan.root), params, entry.metric)
    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage, settings.heartbeat_s),
                              sampler=make_sampler(settings, plan.seed), pruner=pruner or make_pruner(settings))
    objective = _objective(plan, target, settings.ranges(plan.stage), entry, params, train_trial)
    study.optimize(objective, n_trials=n, catch=(FaceopsError,), gc_after_trial=True)
    return n


def _objective(plan: SweepPlan, target: SweepTarget, ranges: Mapping[str, ParamRange], entry: StageSweep,
               params: Mapping[str, Any], train_trial: TrialTrainer) -> Callable[[Any], float]:
    import mlflow
    import optuna

    base = section(params, target.section)
    commit = git_commit(plan.root)

    def objective(trial: Any) -> float:
        values = {key: suggest(trial, key, r) for key, r in ranges.items()}
        baseline = {BASELINE_ATTR: "true"} if trial.user_attrs.get(BASELINE_ATTR) else {}
        run = mlflow.start_run(experiment_id=plan.experiment_id, run_name=f"trial-{trial.number}",
                               parent_run_id=plan.parent_run_id, tags={
                                   "faceops.kind": "sweep-trial", "faceops.stage": plan.stage,
                                   "optuna.study": plan.study, "optuna.trial_number": str(trial.number),
                                   "optuna.worker": f"{socket.gethostname()}:{os.getpid()}", "git.commit": commit,
                                   **baseline,
                               })
        try:
            trial.set_user_attr("mlflow_run_id", run.info.run_id)
            mlflow.log_params({k: str(v) for k, v in values.items()})
            cfg = build_config(target, base, {**entry.fixed, **values})
            rest = to_flat_dict(cfg, f"{target.section}.")
            mlflow.log_params({k: str(v)[:500] for k, v in rest.items() if k not in values})
            value = float(train_trial(cfg, trial, StageTracker(run.info.run_id, plan.root)))
        except optuna.TrialPruned:
            _end_trial_run("PRUNED", "FINISHED")
            raise
        except KeyboardInterrupt:
            _end_trial_run("FAIL", "KILLED", "interrupted")
            raise
        except BaseException as exc:
            _end_trial_run("FAIL", "FAILED", str(exc))
            raise
        if value != value:  # NaN: Optuna would record the trial FAIL; say why
            _end_trial_run("FAIL", "FAILED", f"{entry.metric} is NaN")
            raise TrainingError(f"trial {trial.number}: {entry.metric} is NaN")
        mlflow.log_metric("sweep/value", value)
        _end_trial_run("COMPLETE", "FINISHED")
        return value

    return objective


def _end_trial_run(state: str, status: str, reason: str = "") -> None:
    import mlflow

    tags = {"optuna.trial_state": state}
    if reason:
        tags["optuna.fail_reason"] = redact(reason)[:500]
    mlflow.set_tags(tags)
    mlflow.end_run(status)
