"""One study, many processes: create or join a study and its MLflow parent run (``prepare_sweep``); after the
trials, summarise it (``report``) and write its best params into ``params.yaml`` (``apply_best``). See ``ops/sweep``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import secrets
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError
from ops.sweep.config import (ENV_STORAGE, ParamRange, StageSweep, StorageSpec, SweepConfig, SweepError, check_driver,
                              check_space, open_storage, resolve_storage)
from ops.sweep.targets import OBJECTIVES
from ops.tracking import git_commit, mlflow_metric_name
from ops.run_store import configure, tracking_uri
from tasks.common import Paths, load_params, redact, section, write_json

log = logging.getLogger(__name__)
_WARNED_SMALL: set[tuple[Path, str]] = set()  # (root, stage) whose val split check_request warned about
SMALL_VAL = 100  # fewer val items than this: the study's ranking is coarse, and check_request says so

PARENT_ATTR = "mlflow_parent_run_id"  # study user attr: the MLflow run every trial nests under
BASELINE_ATTR = "faceops.baseline"  # trial user attr: the trial that runs params.yaml's own values
PARENT_WAIT_S = 120.0  # how long a joining process waits for the creator to record the parent run


# ── tracking ──────────────────────────────────────────────────────────────────────────────────────────────────


def ensure_tracking(root: Path) -> str:
    """Check the MLflow store answers and set the experiment (created once, before any worker starts trials);
    → experiment id. SweepError, with nothing written, when the tracking endpoint is unreachable."""
    uri = tracking_uri(root)
    if uri.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(uri)  # without user:password@, which urllib does not take in a URL
        probe = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl().rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(probe, timeout=5):
                pass
        except urllib.error.HTTPError:
            pass  # it answered; MLflow itself reports auth or path problems below
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SweepError(f"MLflow tracking server {redact(uri)} is unreachable ({reason}); start it or point "
                             "MLFLOW_TRACKING_URI at a running one (unset: mlflow.db in the repository). Nothing "
                             "was run or written.") from None
    elif uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).parent.is_dir():
        raise SweepError(f"MLflow store {uri}: its directory does not exist")
    last: Exception | None = None
    for attempt in range(3):  # two processes creating a fresh SQLite store or the experiment at once: retry
        try:
            return configure(root)
        except Exception as exc:
            last = exc
            if not uri.startswith("sqlite"):
                break
            time.sleep(1.0 + attempt)
    raise SweepError(f"MLflow at {redact(uri)} refused the experiment: {redact(str(last).splitlines()[0])}") from None


def _client(root: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri(root))


# ── one study, many processes ─────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class SweepPlan:
    """Everything a process needs to run trials of one study: where, what, and the MLflow parent run."""

    stage: str
    study: str
    storage: StorageSpec
    root: Path
    trials: int
    seed: int
    created: bool  # this process created the study (and its parent run)
    experiment_id: str
    parent_run_id: str


def default_study_name(stage: str, entry: StageSweep, settings: SweepConfig, params: Mapping[str, Any]) -> str:
    """``<stage>-<8 hex>`` from the space, fixed values, metric and the stage's other params: rerunning the same
    command continues the study, changing the space starts a new one (``--apply`` keeps it)."""
    target = OBJECTIVES[stage]
    base = {k: v for k, v in dict(section(params, target.section)).items()
            if f"{target.section}.{k}" not in entry.space}
    blob = json.dumps({"entry": dataclasses.asdict(entry), "base": base, "sampler": settings.sampler,
                       "pruner": settings.pruner}, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


def check_request(stage: str, *, trials: int | None = None, storage: str | None = None, root: Path | str = ".",
                  workers: int = 1) -> tuple[SweepConfig, StageSweep, StorageSpec]:
    """Everything that can be checked without opening a study: params, space against the stage's config, the
    storage's form, the stage's data and the tracking endpoint. Raises a FaceopsError naming what to fix."""
    root = Path(root).resolve()
    params = load_params(root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    entry = settings.stage(stage)
    ranges = settings.ranges(stage)
    if not ranges:
        raise ConfigError(f"params key 'sweep.{stage}.space' is empty: add the params keys to search, e.g. "
                          f"{OBJECTIVES[stage].section}.lr: {{type: float, low: 0.0001, high: 0.01, log: true}}")
    if trials is not None and trials < 0:
        raise ConfigError(f"--trials {trials}: must be ≥ 0 (0 = only report on, or --apply, an existing study)")
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be ≥ 1")
    check_space(stage, entry, ranges, params)
    spec = _storage_spec(storage, settings, root)
    check_driver(spec)
    measured_on = OBJECTIVES[stage].check_data(Paths(root), params, entry.metric)
    if measured_on is not None and measured_on < SMALL_VAL and (root, stage) not in _WARNED_SMALL:
        _WARNED_SMALL.add((root, stage))  # once: the CLI checks before its flow checks again in this process
        log.warning("sweep %s: %s is measured on %d val items, so a trial's value moves in steps of about 1/%d and "
                    "trials may tie or be ranked by noise; sweep on data of the default's size, not a toy preset's",
                    stage, entry.metric, measured_on, measured_on)
    if tracking_uri(root).startswith(("http://", "https://")):
        ensure_tracking(root)
    return settings, entry, spec


def _storage_spec(storage: str | None, settings: SweepConfig, root: Path) -> StorageSpec:
    if storage:
        return resolve_storage(storage, root, "--storage")
    if os.environ.get(ENV_STORAGE):
        return resolve_storage(os.environ[ENV_STORAGE], root, f"${ENV_STORAGE}")
    return resolve_storage(settings.storage, root, "sweep.storage")


def prepare_sweep(stage: str, *, trials: int | None = None, storage: str | None = None, study: str | None = None,
                  root: Path | str = ".", seed: int | None = None, tags: Mapping[str, str] | None = None) -> SweepPlan:
    """Check the request, reach MLflow, create or join the study and its MLflow parent run; → the plan.

    The first process to create study ``study`` (storage creation is atomic) opens the parent run and records
    it in the study; processes joining wait for it. Nothing is created when a check fails. ``seed``: the
    sampler's seed in this process (default: ``sweep.seed`` for the creator, random for a joiner, so that
    workers do not repeat each other's suggestions)."""
    import optuna

    root = Path(root).resolve()
    settings, entry, spec = check_request(stage, trials=trials, storage=storage, root=root)
    params = load_params(root / "params.yaml")
    name = study or default_study_name(stage, entry, settings, params)
    experiment_id = ensure_tracking(root)
    backend = open_storage(spec)
    if trials == 0 and name not in optuna.get_all_study_names(backend):
        raise ConfigError(f"--trials 0 reports on an existing study, but {spec.masked} has no study {name!r}; "
                          "name it with --study, or run some trials")
    try:
        handle = optuna.create_study(storage=backend, study_name=name, direction=entry.direction)
        created = True
    except optuna.exceptions.DuplicatedStudyError:
        handle = optuna.load_study(study_name=name, storage=backend)
        created = False
    if created:
        _describe_study(handle, stage, entry, settings)
        if settings.baseline:
            _enqueue_baseline(handle, settings.ranges(stage), params)
        parent = _create_parent_run(root, experiment_id, handle, stage, entry, settings, spec, tags or {})
    else:
        _check_joined_study(handle, name, stage, entry, spec)
        parent = _join_parent_run(root, handle, name, spec, reopen=trials != 0)
    if seed is None:
        seed = settings.seed if created else secrets.randbits(31)
    log.info("%s study %r in %s (MLflow parent run %s), sampler seed %d", "created" if created else "joined",
             name, spec.masked, parent, seed)
    return SweepPlan(stage, name, spec, root, entry.trials if trials is None else trials, seed, created,
                     experiment_id, parent)


def _describe_study(study: Any, stage: str, entry: StageSweep, settings: SweepConfig) -> None:
    import optuna

    with warnings.catch_warnings():  # "experimental" since Optuna 3.2
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names([entry.metric])  # optuna-dashboard's axes say val/accuracy, not "Objective 0"
    study.set_user_attr("faceops.stage", stage)
    study.set_user_attr("faceops.metric", entry.metric)
    study.set_user_attr("faceops.space", json.loads(json.dumps(entry.space, default=str)))
    study.set_user_attr("faceops.fixed", json.loads(json.dumps(entry.fixed, default=str)))


def _enqueue_baseline(study: Any, ranges: Mapping[str, ParamRange], params: Mapping[str, Any]) -> None:
    """Queue a first trial with the swept keys at their ``params.yaml`` values, tagged ``faceops.baseline``: scored
    by the same trial procedure as the others, it is the value a sweep has to beat (the stage's own metrics may
    differ, e.g. where ``fixed`` drops part of the stage). Skipped, with a warning, when a current value is not
    one of a categorical range's choices (Optuna cannot record it)."""
    from tasks.params import lookup

    values = {key: lookup(params, key.split(".")) for key in ranges}
    outside = [k for k, r in ranges.items() if r.type == "categorical" and values[k] not in (r.choices or [])]
    if outside:
        log.warning("no baseline trial: params.yaml's %s is not among the swept choices", ", ".join(outside))
        return
    study.enqueue_trial(values, user_attrs={BASELINE_ATTR: True})


def _check_joined_study(study: Any, name: str, stage: str, entry: StageSweep, spec: StorageSpec) -> None:
    attrs = study.user_attrs
    other = attrs.get("faceops.stage", stage)
    if other != stage:
        raise ConfigError(f"study {name!r} in {spec.masked} sweeps stage {other!r}, not {stage!r}; pick another --study")
    if attrs.get("faceops.metric", entry.metric) != entry.metric:
        raise ConfigError(f"study {name!r} optimises {attrs['faceops.metric']!r} but sweep.{stage}.metric is "
                          f"{entry.metric!r}; pick another --study or set the metric back")
    direction = study.direction.name.lower()
    if direction != entry.direction:
        raise ConfigError(f"study {name!r} is to {direction} but sweep.{stage}.direction is {entry.direction!r}; "
                          "pick another --study")
    if attrs.get("faceops.space") not in (None, json.loads(json.dumps(entry.space, default=str))):
        log.warning("study %r was started with another search space (%s); its new trials use params.yaml's",
                    name, attrs["faceops.space"])


def _create_parent_run(root: Path, experiment_id: str, study: Any, stage: str, entry: StageSweep,
                       settings: SweepConfig, spec: StorageSpec, tags: Mapping[str, str]) -> str:
    client = _client(root)
    commit = git_commit(root)
    run = client.create_run(experiment_id, run_name=f"sweep-{study.study_name}", tags={
        "faceops.kind": "sweep", "faceops.stage": stage, "optuna.study": study.study_name,
        "optuna.storage": spec.masked, "git.commit": commit, **tags,
    })
    run_id = run.info.run_id
    sweep_params = {"sweep.metric": entry.metric, "sweep.direction": entry.direction, "sweep.sampler": settings.sampler,
                    "sweep.pruner": settings.pruner, "sweep.seed": settings.seed,
                    "sweep.startup_trials": settings.startup_trials, "sweep.warmup_epochs": settings.warmup_epochs,
                    "sweep.space": json.dumps(entry.space, default=str), "sweep.fixed": json.dumps(entry.fixed, default=str)}
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in sweep_params.items()])
    study.set_user_attr(PARENT_ATTR, run_id)
    return run_id


def _join_parent_run(root: Path, study: Any, name: str, spec: StorageSpec, *, reopen: bool = True) -> str:
    """The parent run recorded by the study's creator (waiting for it a little); with ``reopen``, set RUNNING
    again if a finished sweep is being continued (``report`` closes it)."""
    deadline = time.monotonic() + PARENT_WAIT_S
    run_id = study.user_attrs.get(PARENT_ATTR)
    while run_id is None and time.monotonic() < deadline:
        time.sleep(0.5)
        run_id = study.user_attrs.get(PARENT_ATTR)
    if run_id is None:
        raise SweepError(f"study {name!r} in {spec.masked} records no MLflow parent run after {PARENT_WAIT_S:.0f} s; "
                         "the process that created it may have failed: start a new study (--study)")
    client = _client(root)
    try:
        run = client.get_run(run_id)
    except Exception:
        raise SweepError(f"study {name!r} nests its trials under MLflow run {run_id}, which is not in "
                         f"{redact(tracking_uri(root))}: point MLFLOW_TRACKING_URI at the store the study "
                         "started with, or start a new study (--study)") from None
    if reopen and run.info.status != "RUNNING":
        client.update_run(run_id, status="RUNNING")
    return run_id


# ── after the trials ──────────────────────────────────────────────────────────────────────────────────────────


def _stem(study: str) -> str:
    return re.sub(r"[^\w.-]", "_", study)


def report_paths(root: Path, study: str) -> dict[str, Path]:
    """Where a study's summary goes: ``reports/sweeps/<study>.json``, ``plots/sweeps/<study>_{history,importance}.png``."""
    paths, stem = Paths(root), _stem(study)
    return {"summary": paths.root / "reports" / "sweeps" / f"{stem}.json",
            "history": paths.plots / "sweeps" / f"{stem}_history.png",
            "importance": paths.plots / "sweeps" / f"{stem}_importance.png"}


def report(plan: SweepPlan) -> dict[str, Any]:
    """Summarise the study as it stands: counts per state, the best trial, optimisation history and parameter
    importance plots; written under ``reports/sweeps`` and ``plots/sweeps`` and logged to the parent run, which
    is closed when no trial of the study is still running."""
    import optuna

    params = load_params(plan.root / "params.yaml")
    settings = from_mapping(SweepConfig, section(params, "sweep"), "sweep")
    metric = settings.stage(plan.stage).metric
    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))
    trials = study.get_trials(deepcopy=False)
    counts = {s.name.lower(): sum(t.state == s for t in trials) for s in optuna.trial.TrialState}
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": b.params, "mlflow_run_id": b.user_attrs.get("mlflow_run_id")}
    baseline = _baseline(trials, study.direction.name.lower(), best)
    out = report_paths(plan.root, plan.study)
    notes: list[str] = []
    plots: dict[str, str] = {}
    importances: dict[str, float] = {}
    if complete:
        plots["history"] = str(_plot(optuna.visualization.matplotlib.plot_optimization_history, out["history"],
                                     study, target_name=metric))
    else:
        notes.append("no completed trial yet: optimisation history not plotted")
    if len(complete) >= 2:
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=settings.seed)
        try:
            importances = dict(optuna.importance.get_param_importances(study, evaluator=evaluator))
            plots["importance"] = str(_plot(optuna.visualization.matplotlib.plot_param_importances, out["importance"],
                                            study, evaluator=evaluator, target_name=metric))
        except (ValueError, RuntimeError) as exc:  # e.g. every completed trial has the same params
            notes.append(f"parameter importance not computed: {exc}")
    else:
        notes.append(f"parameter importance needs at least 2 completed trials; this study has {len(complete)}: "
                     "not plotted")
    idle = not counts.get("running") and not counts.get("waiting")
    if not idle:
        notes.append(f"{counts.get('running', 0)} trial(s) still running in other processes: the last process to "
                     "finish logs the plots and this summary to the parent run")
    summary = {
        "stage": plan.stage, "study": plan.study, "storage": plan.storage.masked, "metric": metric,
        "direction": study.direction.name.lower(), "trials": {**counts, "total": len(trials)}, "best": best,
        "baseline": baseline,
        "importance": importances, "plots": plots, "notes": notes, "mlflow_parent_run_id": plan.parent_run_id,
        "mlflow_tracking_uri": redact(tracking_uri(plan.root)),
    }
    write_json(out["summary"], summary)
    summary["report"] = str(out["summary"])
    client = _client(plan.root)
    if idle:  # the last process to finish logs the files (two copying one artifact at once could garble it)
        for path in plots.values():
            client.log_artifact(plan.parent_run_id, path, "plots")
        client.log_artifact(plan.parent_run_id, str(out["summary"]), "reports")
    metrics = {f"sweep/trials_{k}": float(v) for k, v in counts.items() if k in ("complete", "pruned", "fail")}
    if baseline is not None and baseline["value"] is not None:
        metrics["sweep/baseline_value"] = float(baseline["value"])
    if best is not None:
        metrics["sweep/best_value"] = float(best["value"])
        client.set_tag(plan.parent_run_id, "sweep.best_trial", str(best["number"]))
        for key, value in best["params"].items():
            client.set_tag(plan.parent_run_id, f"sweep.best.{key}", str(value))
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(plan.parent_run_id, metrics=[Metric(mlflow_metric_name(k), v, now, 0) for k, v in metrics.items()])
    if idle:
        client.set_terminated(plan.parent_run_id, "FINISHED")
    for note in notes:
        log.info("%s: %s", plan.study, note)
    return summary


def _baseline(trials: list[Any], direction: str, best: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The baseline trial (params.yaml's values) and by how much the best trial beats it: ``gain`` > 0 is better
    whichever the direction; None when the study has no baseline trial."""
    import optuna

    trial = next((t for t in trials if t.user_attrs.get(BASELINE_ATTR)), None)
    if trial is None:
        return None
    done = trial.state == optuna.trial.TrialState.COMPLETE
    out: dict[str, Any] = {"number": trial.number, "state": trial.state.name.lower(),
                           "value": trial.value if done else None, "params": trial.params, "gain": None}
    if done and best is not None:
        sign = 1.0 if direction == "maximize" else -1.0
        out["gain"] = sign * (float(best["value"]) - float(trial.value))
    return out


def _plot(fn: Callable[..., Any], path: Path, study: Any, **kwargs: Any) -> Path:
    import warnings

    from tasks.common import pyplot, save_figure

    pyplot()  # the file-only backend, before Optuna touches matplotlib
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        ax = fn(study, **kwargs)
    fig = ax.figure
    fig.set_size_inches(7.5, 4.2)
    fig.tight_layout()
    return save_figure(fig, path)


def apply_best(plan: SweepPlan) -> dict[str, Any]:
    """Write the study's best params into ``params.yaml`` (comments kept, via ``tasks.params.apply_delta``);
    → ``{"changes": {key: [old, new]}, "diff": unified diff of params.yaml}``. Keys already at their best value
    are left alone; ``fixed`` values are never written. SweepError when no trial completed."""
    import optuna

    from tasks.params import apply_delta, lookup

    study = optuna.load_study(study_name=plan.study, storage=open_storage(plan.storage))
    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        raise SweepError(f"study {plan.study!r} has no completed trial: nothing to apply; run more trials "
                         f"(faceops sweep {plan.stage} --study {plan.study})")
    best = study.best_trial
    params_path = plan.root / "params.yaml"
    current = load_params(params_path)
    changed = {k: v for k, v in best.params.items() if lookup(current, k.split(".")) != v}
    if not changed:
        return {"trial": best.number, "value": best.value, "changes": {}, "diff": ""}
    before = params_path.read_text()
    changes = apply_delta(params_path, changed)
    after = params_path.read_text()
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        "a/params.yaml", "b/params.yaml"))
    _client(plan.root).log_text(plan.parent_run_id, diff, "reports/params.diff")
    log.info("params.yaml: wrote the best params of trial %d (%s = %s)", best.number, plan.study, best.value)
    return {"trial": best.number, "value": best.value, "changes": {k: [o, n] for k, (o, n) in changes.items()},
            "diff": diff}
