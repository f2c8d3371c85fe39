"""``faceops stack up | env | status | down``: the command over ``faceops/stack``, which plans, starts,
records and stops the local stack; exit codes and messages are this module's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from faceops.console import fail as _fail, repo_root
from faceops.processes import STOP_TIMEOUT, ServerFailed, StackError
from faceops.stack import HEALTH_TIMEOUT, STATE_FILE, Health, Service, client_env, down, stack_dir, status, up
from faceops.stack.servers import S3_DUMMY_CREDENTIALS

stack_app = typer.Typer(
    name="stack",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    help=(
        "The local stack: a Prefect server and an MLflow server (and, with `--s3`, moto's S3) as background "
        "processes on 127.0.0.1, so both UIs run on a laptop without Docker. MLflow serves the repository's own "
        "store (`mlflow.db`, `mlruns/`): what `make run` logged is there.\n\n"
        "* `faceops stack up` — start them, wait until they answer, print the UI URLs and the variables to export\n\n"
        "* `faceops stack up --workers` — also work pools, deployments (schedules paused), a worker per pool and "
        "a local DVC remote: a deployment's Quick run runs on this machine\n\n"
        "* `eval \"$(faceops stack env)\"` — point this shell (and so `faceops run`) at them\n\n"
        "* `faceops stack status` — is each one running and answering\n\n"
        "* `faceops stack down` — stop them\n\n"
        "* `faceops stack services` — what runs here for each service of `infra/docker-compose.yml`\n\n"
        "The servers and workers are the compose file's services, with its command lines and ports, run as local "
        "processes (SQLite for PostgreSQL, moto or folders for MinIO). State, logs and stores: `.faceops/stack/` in "
        "the repository root. A team deployment is the compose file itself (see `infra/README.md`)."
    ),
)


def _root() -> Path:
    return repo_root("`faceops stack`")


def _status() -> list[Health]:
    """``status`` of the stack in the current directory; a corrupt record exits 2 naming it."""
    try:
        return status(_root())
    except StackError as exc:
        _fail(str(exc))


def _rel(root: Path, path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(root))
    return path


def _echo_env(services: Sequence[Service]) -> None:
    for key, value in client_env(services).items():
        comment = "   # moto's dummy credentials" if key in S3_DUMMY_CREDENTIALS else ""
        typer.echo(f"export {key}={value}{comment}")


def _runs_link(mlflow_url: str) -> str | None:
    """The faceops experiment's runs table on the MLflow server at ``mlflow_url`` (``ops.run_store.runs_page``), or
    None while no run has made the experiment."""
    import json
    import urllib.request

    from ops.run_store import EXPERIMENT, runs_page

    query = f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={EXPERIMENT}"
    try:
        with urllib.request.urlopen(query, timeout=10) as answer:
            return mlflow_url + runs_page(json.load(answer)["experiment"]["experiment_id"])
    except (OSError, ValueError, KeyError):  # 404 (no such experiment yet) is an HTTPError, an OSError
        return None


def _echo_services(root: Path, services: Sequence[Service]) -> None:
    for s in services:
        extra = "  ".join(f"{k} {_rel(root, v)}" for k, v in s.info.items() if k != "note")
        typer.echo(f"  {s.label:<11} {s.url or '-':<24} pid {s.pid:<7} log {_rel(root, s.log)}"
                   + (f"  {extra}" if extra else ""))


@stack_app.command("up")
def up_cmd(
    s3: Annotated[bool, typer.Option("--s3", help="also start moto's S3 and keep MLflow's artifacts in `s3://BUCKET/mlflow`")] = False,
    prefect_port: Annotated[Optional[int], typer.Option(
        min=1, max=65535, show_default=False,
        help="Prefect server (API + UI) port  [default: the compose file's, 4200 unless PREFECT_PORT says]")] = None,
    mlflow_port: Annotated[Optional[int], typer.Option(
        min=1, max=65535, show_default=False,
        help="MLflow tracking server (API + UI) port  [default: the compose file's, 5000 unless MLFLOW_PORT says]")] = None,
    s3_port: Annotated[int, typer.Option(min=1, max=65535, help="moto S3 port (with `--s3`)")] = 5055,
    bucket: Annotated[str, typer.Option(help="bucket created on moto for MLflow's artifacts (with `--s3`)")] = "faceops",
    timeout: Annotated[float, typer.Option(min=1, help="seconds to wait for each server's health check")] = HEALTH_TIMEOUT,
    workers: Annotated[bool, typer.Option("--workers", help="also create the work pools `cpu` and `gpu`, deploy "
                                          "prefect.yaml (schedules paused), start a worker per pool and give them "
                                          "a local DVC remote: a deployment's Quick run then runs on this machine")] = False,
    git_url: Annotated[str, typer.Option(help="the repository the workers clone (with `--workers`); default "
                                         "FACEOPS_GIT_URL, else this repository (its committed HEAD)")] = "",
) -> None:
    """Start the Prefect and MLflow servers in the background on 127.0.0.1 and wait until both answer.

    MLflow serves the repository's own store (`mlflow.db`, artifacts in `mlruns/`): the runs and models of
    `make run` / `faceops run` are in its UI, and what is logged through it stays there after `down`.

    Examples:

    * `faceops stack up` — Prefect on :4200, MLflow on :5000 serving `mlflow.db`

    * `faceops stack up --workers` — plus pools, deployments and workers: Quick run of `pipeline-smoke` in the
      Prefect UI runs the whole DAG at toy size on this machine in minutes

    * `faceops stack up --s3` — plus moto's S3 on :5055; MLflow's artifacts go to `s3://faceops/faceops/mlflow`
      (in memory, so this stack keeps its own MLflow store, `.faceops/stack/mlflow-s3.db`)

    * `faceops stack up --prefect-port 4300 --mlflow-port 5100` — other ports (a busy port is refused)

    Running it again while the stack runs reports it instead of starting a second one.
    """
    root = _root()
    try:
        services, already = up(root, s3=s3, prefect_port=prefect_port, mlflow_port=mlflow_port, s3_port=s3_port,
                               bucket=bucket, timeout=timeout, workers=workers, git_url=git_url or None)
    except StackError as exc:
        _fail(str(exc), code=1 if isinstance(exc, ServerFailed) else 2)
    typer.echo(("the local stack is already running" if already else "started the local stack")
               + f" (record: {_rel(root, str(stack_dir(root) / STATE_FILE))})")
    _echo_services(root, services)
    for s in services:
        if "note" in s.info:
            typer.echo(f"  note: {s.label}: {s.info['note']}")
    runs = _runs_link(next(s.url for s in services if s.name == "mlflow"))
    if runs:  # MLflow's UI opens an experiment on its GenAI overview unless the address names the view
        typer.echo(f"  MLflow runs {runs}")
    if any(s.name.startswith("worker-") for s in services):
        prefect = next(s.url for s in services if s.name == "prefect")
        typer.echo(f"\nDeployments: {prefect}/deployments (schedules paused). Quick run of `pipeline-smoke` runs the "
                   "whole DAG at toy size on these workers in minutes (`pipeline-nightly`: the full one), from the "
                   "committed HEAD of the repository they clone; their DVC remote is .faceops/stack/dvc-remote.")
    typer.echo("\nTo use it from this shell (`faceops run` reads these), run `eval \"$(faceops stack env)\"` or:")
    _echo_env(services)
    typer.echo("\nStop it with `faceops stack down`.")


@stack_app.command("services")
def services_cmd() -> None:
    """List the services of `infra/docker-compose.yml` and what `faceops stack up` runs for each: the compose
    command made local (loopback, this interpreter, dropped container-only flags) or what stands in for it.
    """
    import os
    import shlex

    from faceops.stack.compose import DROPPED_FLAGS, LOCAL, compose, local_command

    try:
        names = list(compose()["services"])
    except StackError as exc:
        _fail(str(exc))
    for name in names:
        runs, note = LOCAL.get(name, (False, "no local counterpart yet: give it one in faceops/stack/compose.py"))
        typer.echo(f"{name:<15} {note}")
        if runs:
            typer.echo(f"{'':<15} $ {shlex.join(['python', *local_command(name, os.environ)[1:]])}")
    typer.echo("\nleft out of the compose commands:")
    for flag, (_, why) in DROPPED_FLAGS.items():
        typer.echo(f"  {flag}: {why}")


@stack_app.command("env")
def env_cmd() -> None:
    """Print `export` lines for the running stack: `eval "$(faceops stack env)"` points this shell at it.

    Exits 3 (and prints nothing) when no stack runs.
    """
    found = _status()
    if not found or not all(h.alive for h in found):
        typer.secho("no local stack runs here: start it with `faceops stack up`", err=True)
        raise typer.Exit(3)
    _echo_env([h.service for h in found])


@stack_app.command("status")
def status_cmd() -> None:
    """Show each server of the local stack: PID alive and health check answered.

    Exit code: 0 all running and healthy, 1 something recorded is down or not answering, 3 stopped.
    """
    found = _status()
    if not found:
        typer.echo("the local stack is stopped (start it with `faceops stack up`)")
        raise typer.Exit(3)
    for h in found:
        s = h.service
        typer.echo(f"  {s.name:<10} {h.state:<20} pid {s.pid:<7} {s.url or '-':<24} since {s.started}")
    if all(h.healthy for h in found):
        typer.echo("the local stack is running")
        return
    if not any(h.alive for h in found):
        typer.echo("the local stack is stopped; `faceops stack down` cleans the record")
        raise typer.Exit(3)
    typer.echo("the local stack is degraded: see the logs under .faceops/stack/, then `faceops stack down` and `up`")
    raise typer.Exit(1)


@stack_app.command("down")
def down_cmd(
    timeout: Annotated[float, typer.Option(min=0, help="seconds between SIGTERM and SIGKILL")] = STOP_TIMEOUT,
) -> None:
    """Stop the local stack's servers by their recorded PIDs and remove the record (safe to run twice).

    Stores and logs stay in `.faceops/stack/` for the next `up` (moto's S3 objects are in memory and are lost).
    """
    root = _root()
    try:
        notes = down(root, timeout)
    except StackError as exc:
        _fail(str(exc), code=1)
    if not notes:
        typer.echo("the local stack is not running (nothing recorded); nothing to stop")
    for note in notes:
        typer.echo(note)
