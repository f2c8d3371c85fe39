"""The ``sweep`` flow: an Optuna study over one stage's params, its trials nested under one MLflow run.

Steps, one Prefect task each: open (check the request, create or join the study and its MLflow parent run) →
trials (this process's share; with ``workers > 1`` the others run at the same time as ``python -m ops.sweep``
processes on the same study) → report (history and importance plots, best params) → apply (optional: the best
params into ``params.yaml``, as a reviewable diff). The work itself is in ``ops.sweep``.

With ``ray`` set, every share runs as a ``python -m ops.sweep`` worker placed by Ray (``ops.launch.fan_out``):
on a Ray cluster the trials spread over its machines, with ``ray_cpus``/``ray_gpus`` each; the storage and the
MLflow store must then be servers every machine reaches (a SQLite or journal file, or a local MLflow store, is
refused on a cluster of several machines). Their URLs reach the workers as Ray task arguments, so a password in
either is refused (``PGPASSWORD`` or ``~/.pgpass`` on each machine instead).

Several flow runs with the same storage and study name (two terminals, or many cluster workers) cooperate on one
study. A storage URL with a password is best passed in ``$FACEOPS_SWEEP_STORAGE`` (the CLI does that with
``--storage``), so that it is not recorded as a flow parameter.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from ops import sweep as sw
from tasks.common import redact, stage_cores


@task(task_run_name="open-study-{stage}", cache_policy=NO_CACHE)
def open_study(stage: str, trials: int | None, storage: str | None, study: str | None, root: str) -> sw.SweepPlan:
    """Check everything, then create or join the study and the MLflow parent run."""
    tags = {"prefect.flow_run_id": str(flow_run.id)} if flow_run.id else {}
    return sw.prepare_sweep(stage, trials=trials, storage=storage, study=study, root=root, tags=tags)


@task(task_run_name="trials-{plan.study}", cache_policy=NO_CACHE)
def run_trials(plan: sw.SweepPlan, workers: int = 1, ray: RayWorkers | None = None) -> int:
    """This process's trials; with ``workers > 1`` also start the other workers and wait for them; with ``ray``,
    every share in a worker Ray places."""
    logger = get_run_logger()
    shares = split_trials(plan.trials, workers)
    if ray is not None:
        return _trials_on_ray(plan, shares, ray, logger)
    threads = max(1, stage_cores() // len(shares))
    extra = start_workers(plan, shares[1:], threads)
    if extra:
        logger.info("%d worker processes on study %s: %s trials each, %d torch threads each", len(shares), plan.study,
                    "/".join(map(str, shares)), threads)
    try:
        sw.run_trials(plan, shares[0], threads=threads if extra else None)
    except BaseException:
        for proc in extra:  # ours: stop them rather than leave them training alone
            proc.terminate()
        for proc in extra:
            proc.wait()
        raise
    failed = [(i, proc.wait()) for i, proc in enumerate(extra, start=1)]
    failed = [(i, rc) for i, rc in failed if rc != 0]
    if failed:
        raise sw.SweepError(f"sweep worker(s) {', '.join(f'{i} (exit {rc})' for i, rc in failed)} of study "
                            f"{plan.study} failed; their log is above. Completed trials are kept in the study.")
    return plan.trials


@dataclass(frozen=True)
class RayWorkers:
    """Where ``sweep --ray`` runs its workers: the Ray cluster (``address``; None = ``RAY_ADDRESS`` or a local
    instance) and each worker's CPUs and GPUs."""

    address: str | None = None
    cpus: float = 1
    gpus: float = 0


def _trials_on_ray(plan: sw.SweepPlan, shares: list[int], ray: RayWorkers, logger: Any) -> int:
    from ops.launch import LaunchError, fan_out
    from ops.run_store import tracking_uri

    if plan.trials == 0:
        return 0
    uri = tracking_uri(plan.root)
    for what, url in (("the storage", plan.storage.text), ("MLFLOW_TRACKING_URI", uri)):
        if redact(url) != url:
            raise sw.SweepError(f"--ray: {what} {redact(url)} holds a password, which would travel to the workers "
                                "as a Ray task argument; take it out of the URL and set PGPASSWORD (or ~/.pgpass, "
                                "MLFLOW_TRACKING_PASSWORD) on each machine")
    local = [f"the {plan.storage.kind} storage {plan.storage.masked}"] if plan.storage.kind == "journal" or \
        plan.storage.target.startswith("sqlite:") else []
    if not uri.startswith(("http://", "https://")):
        local.append(f"the MLflow store {uri}")
    threads = max(1, int(ray.cpus))
    env = {sw.ENV_STORAGE: plan.storage.text, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    commands = [sw.worker_command(plan, n, plan.seed + i) for i, n in enumerate(shares)]
    logger.info("%d Ray workers on study %s: %s trials each, %g CPUs and %g GPUs each", len(shares), plan.study,
                "/".join(map(str, shares)), ray.cpus, ray.gpus)
    try:
        results = fan_out(f"sweep-{plan.study}", commands, root=plan.root, address=ray.address, cpus=ray.cpus,
                          gpus=ray.gpus, env=env, machine_local=local)
    except LaunchError as exc:
        raise sw.SweepError(f"sweep workers of study {plan.study}: {exc}\nCompleted trials are kept in the "
                            "study.") from exc
    for r in results:
        logger.info("worker %d on %s: %d trial(s) in %.0f s (log %s)", r.rank, r.address, shares[r.rank], r.seconds,
                    r.log)
    return plan.trials


def split_trials(trials: int, workers: int) -> list[int]:
    """``trials`` over at most ``workers`` processes, as evenly as possible, none with zero."""
    workers = max(1, min(workers, trials))
    return [trials // workers + (1 if i < trials % workers else 0) for i in range(workers)]


def start_workers(plan: sw.SweepPlan, shares: list[int], threads: int) -> list[subprocess.Popen]:
    """One ``python -m ops.sweep`` process per share, each with its own sampler seed and its share of the cores."""
    env = {**os.environ, sw.ENV_STORAGE: plan.storage.text, "OMP_NUM_THREADS": str(threads),
           "MKL_NUM_THREADS": str(threads)}
    return [subprocess.Popen(sw.worker_command(plan, n, plan.seed + i), cwd=plan.root, env=env)
            for i, n in enumerate(shares, start=1)]


@task(task_run_name="report-{plan.study}", cache_policy=NO_CACHE)
def report(plan: sw.SweepPlan) -> dict[str, Any]:
    """Plots, best params and counts, written and logged to the parent run."""
    return sw.report(plan)


@task(task_run_name="apply-{plan.study}", cache_policy=NO_CACHE)
def apply_best(plan: sw.SweepPlan) -> dict[str, Any]:
    """The best params into params.yaml; → the changes and the diff."""
    return sw.apply_best(plan)


@flow(name="sweep", flow_run_name="sweep-{stage}")
def sweep_flow(stage: str = "train_fr", trials: int | None = None, storage: str | None = None,
               study: str | None = None, apply: bool = False, root: str = ".", workers: int = 1, ray: bool = False,
               ray_address: str | None = None, ray_cpus: float = 1, ray_gpus: float = 0) -> dict[str, Any]:
    """Run ``trials`` trials of an Optuna study over ``stage``'s params (``params.yaml``: ``sweep.<stage>``), in
    ``workers`` processes; summarise the study; with ``apply`` write its best params into ``params.yaml``.

    Args:
        stage: the stage whose params are searched: train_fr, train_aligner, train_discovery, train_fusion or train_generator
            (the search space is params.yaml's sweep.<stage>).
        trials: trials this run adds to the study; empty: sweep.<stage>.trials in params.yaml.
        storage: the Optuna storage shared by the workers (postgresql://user@host/db, sqlite:///optuna.db,
            journal:<file>); empty: sweep.storage.
        study: the study name; trials of earlier runs under the same name are kept; empty: one named after the
            stage.
        apply: write the best trial's params into params.yaml when the study ends.
        root: the repository root (on a worker: the clone its pull steps made).
        workers: trial processes run at once (on this worker; with ray, over the Ray cluster).
        ray: run every worker as a Ray task placed on the cluster at ray_address (empty: RAY_ADDRESS, else a Ray
            instance on this machine); the storage and MLflow must be servers on a cluster of several machines.
        ray_address: the Ray cluster (ray://HOST:10001, or auto on a cluster machine).
        ray_cpus: CPUs per Ray worker (also its torch threads).
        ray_gpus: GPUs per Ray worker.
    """
    logger = get_run_logger()
    root = str(Path(root).resolve())
    plan = open_study(stage, trials, storage, study, root)
    logger.info("study %s in %s: %d trial(s) from this run, MLflow parent run %s", plan.study, plan.storage.masked,
                plan.trials, plan.parent_run_id)
    run_trials(plan, workers, RayWorkers(ray_address or None, ray_cpus, ray_gpus) if ray else None)
    summary = report(plan)
    best = summary["best"]
    logger.info("study %s: %s; best %s", plan.study, summary["trials"],
                f"trial {best['number']} {summary['metric']} = {best['value']:.4f}" if best else "none yet")
    if apply:
        summary["applied"] = apply_best(plan)
    return summary
