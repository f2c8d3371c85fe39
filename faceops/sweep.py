"""``faceops sweep STAGE``: an Optuna hyperparameter sweep as the Prefect flow ``sweep`` (``flows/sweep.py``).

Registered in ``faceops/cli.py``; heavy libraries are imported inside the command so ``--help`` stays instant.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, Optional

import typer

from faceops.console import fail, quiet_env, repo_root


def sweep_command(
    stage: Annotated[str, typer.Argument(help="the stage whose params to search: `train_fr`, `train_aligner`, `train_discovery`, `train_fusion` or `train_generator`")] = "train_fr",
    trials: Annotated[Optional[int], typer.Option(
        help="trials this command runs (split over --workers; 0 = only report/apply); default `sweep.<stage>.trials`")] = None,
    storage: Annotated[Optional[str], typer.Option(
        help="Optuna storage: `journal:FILE`, `sqlite:///FILE` or `postgresql://user@host/db`; "
             "default `sweep.storage` (\"\" = `sqlite:///optuna.db` here)")] = None,
    study: Annotated[Optional[str], typer.Option(
        help="study name; commands with the same storage and name share one study. Default: STAGE-HASH, a hash "
             "of the space and the stage's other params, so rerunning continues it")] = None,
    apply: Annotated[bool, typer.Option(
        "--apply", help="write the best params into params.yaml and print the diff")] = False,
    workers: Annotated[int, typer.Option(help="worker processes, one study (on this machine; with --ray, over the "
                                                "Ray cluster)")] = 1,
    ray: Annotated[bool, typer.Option(
        "--ray", help="run the workers as Ray tasks: on a cluster they spread over its machines")] = False,
    ray_address: Annotated[Optional[str], typer.Option(
        help="the Ray cluster with --ray (ray://HOST:10001, auto); default RAY_ADDRESS, else a local Ray")] = None,
    cpus: Annotated[float, typer.Option(help="CPUs per Ray worker (its torch threads) with --ray")] = 1,
    gpus: Annotated[float, typer.Option(help="GPUs per Ray worker with --ray")] = 0,
) -> None:
    """Search a stage's hyperparameters with Optuna; every trial is a nested MLflow run.

    The space is data: `params.yaml` → `sweep.STAGE.space` maps params keys to ranges, e.g.
    `fr.lr: {type: float, low: 0.0001, high: 0.01, log: true}` or `fr.margin: {type: categorical, choices: [arcface,
    cosface]}`. A trial trains on the stage's train split with its values set in memory (params.yaml is not
    touched), reports `sweep.STAGE.metric` on a val split after every epoch (FR: `val/accuracy`; aligner:
    `val/nme_box` on val identities; discovery: `val/accuracy` of held-out labelled images) and is pruned when it
    falls behind (`sweep.pruner`). No trial reads a test split.
    Results: `reports/sweeps/STUDY.json` (best params and value), `plots/sweeps/STUDY_history.png` and
    `_importance.png`, and in MLflow one `sweep-STUDY` run with a child run per trial.

    Examples:

    * `faceops sweep train_fr --trials 20` — locally, study in `optuna.db` (SQLite)

    * `faceops sweep train_fr --trials 20 --workers 2` — two processes on this machine, one study

    * `faceops sweep train_aligner --trials 3` — the DFA aligner on its val identities

    * `faceops sweep train_fusion --trials 10` — CAFace's recipe, chosen by rank-1 of sets of its val identities

    * `faceops sweep train_generator --trials 4` — UIFace: identity gap + val accuracy of a small FR model trained
      on a small synthetic set (`generator.probe`)

    * `RAY_ADDRESS=ray://head:10001 faceops sweep train_fr --trials 16 --workers 8 --ray --gpus 1
      --storage postgresql://optuna@db:5432/optuna` with `MLFLOW_TRACKING_URI` at the MLflow server — eight
      workers on the Ray cluster's GPU machines, one study (a SQLite or journal file, or a local MLflow store, is
      refused when the cluster has several machines)

    * `faceops sweep train_fr --trials 10 --storage journal:sweeps/fr.log --study fr-lr` in each of two
      terminals — two independent commands, one study (20 trials); any number of them may join

    * `PGPASSWORD=… faceops sweep train_fr --trials 10 --storage postgresql://optuna@db:5432/optuna --study fr-lr`
      on each cluster worker, with `MLFLOW_TRACKING_URI` at the MLflow server (start one command first, or create
      the MLflow experiment before starting many at once)

    * `faceops sweep train_fr --study fr-lr --storage journal:sweeps/fr.log --trials 0 --apply` — no more
      trials: write the study's best params into params.yaml and print the diff; review with `git diff params.yaml`
    """
    from ml.errors import FaceopsError
    from ops import sweep as sw

    root = repo_root()
    quiet_env()
    if storage:  # through the environment, so the URL (and any password) is not recorded as a flow parameter
        os.environ[sw.ENV_STORAGE] = storage
    if ray and (cpus <= 0 or gpus < 0):
        fail(f"--cpus {cpus:g} --gpus {gpus:g}: a Ray worker needs more than 0 CPUs and at least 0 GPUs")
    try:
        sw.check_request(stage, trials=trials, storage=storage, root=root, workers=workers)
    except FaceopsError as exc:
        fail(str(exc))
    from flows.sweep import sweep_flow

    try:
        summary = sweep_flow(stage=stage, trials=trials, storage=None, study=study, apply=apply, root=str(root),
                             workers=workers, ray=ray, ray_address=ray_address, ray_cpus=cpus, ray_gpus=gpus)
    except FaceopsError as exc:
        fail(str(exc))
    _print_summary(summary)


def _print_summary(summary: dict[str, Any]) -> None:
    counts = summary["trials"]
    typer.echo(f"\nstudy {summary['study']} ({summary['storage']}): {counts['total']} trials — "
               f"{counts.get('complete', 0)} complete, {counts.get('pruned', 0)} pruned, {counts.get('fail', 0)} failed"
               + (f", {counts['running']} running" if counts.get("running") else ""))
    best = summary["best"]
    if best:
        typer.echo(f"best trial {best['number']}: {summary['metric']} = {best['value']:.4f}")
        for key, value in best["params"].items():
            typer.echo(f"  {key} = {value!r}")
    base = summary.get("baseline")
    if base and base.get("value") is not None:
        verdict = ("the default is the best trial" if base["number"] == (best or {}).get("number")
                   else f"best beats it by {base['gain']:+.4f}" if base["gain"] > 0 else "best ties it")
        typer.echo(f"baseline trial {base['number']} (params.yaml's values): {summary['metric']} = "
                   f"{base['value']:.4f}; {verdict}")
    for note in summary["notes"]:
        typer.echo(f"note: {note}")
    typer.echo(f"report       {summary['report']}")
    for name, path in summary["plots"].items():
        typer.echo(f"{name:<12} {path}")
    typer.echo(f"MLflow       run {summary['mlflow_parent_run_id']} in {summary['mlflow_tracking_uri']}")
    applied = summary.get("applied")
    if applied is not None:
        if applied["diff"]:
            typer.echo(f"\nparams.yaml ← best trial {applied['trial']}:\n")
            typer.echo(applied["diff"].rstrip("\n"))
            typer.echo("\nreview and commit: git diff params.yaml")
        else:
            typer.echo("\nparams.yaml already holds the best trial's params: nothing changed")
