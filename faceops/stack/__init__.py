"""``faceops stack``: the Prefect server, the MLflow server and, with ``--s3``, moto's S3 on a laptop, no Docker;
with ``--workers``, also the work pools, the deployments of prefect.yaml, a worker per pool and a local DVC remote.
These are ``infra/docker-compose.yml``'s services run as local processes, with its command lines and ports
(``faceops/stack/compose.py`` says what stands in for each other service, e.g. SQLite for PostgreSQL, and why).

This module plans the servers (``plans``), starts them (``up``), reports them (``status``) and stops them
(``down``); the command is ``faceops/stack/cli.py``, the command lines and set-up steps ``faceops/stack/servers.py``,
the process helpers ``faceops/processes.py``. Each server is a detached process in its own session (``down`` stops
its process group; a closed terminal does not), bound to 127.0.0.1 and recorded in ``.faceops/stack/stack.json``
beside its log. The MLflow server serves the repository's own store (``mlflow.db``, ``mlruns/``), so runs logged
with or without the stack are in one store; ``up`` holds ``mlflow.db.lock`` while the server creates or migrates it.
With ``--s3`` the artifacts live in moto's memory, so that stack keeps its own store (``mlflow-s3.db``). The workers
clone ``FACEOPS_GIT_URL`` (default: this repository's committed ``HEAD``) and see ``.faceops/stack/dvc-remote`` as
their default DVC remote. POSIX only (sessions, process groups, ``flock``). See ``docs/operations/stack.md``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from faceops.processes import (
    HOST, STOP_TIMEOUT, ServerFailed, StackError, Target, http_ok, pid_alive, port_busy, proc_start, spawn,
    stop_targets, utc_now, wait_healthy,
)
from faceops.stack.compose import pools, published_port
from faceops.stack.servers import (
    S3_DUMMY_CREDENTIALS, check_git_head, create_bucket, install_crash_detection, mlflow_command, moto_command,
    prefect_command, prefect_server_env, server_env, setup_deployments, worker_command,
)

STACK_DIR = Path(".faceops") / "stack"
STATE_FILE = "stack.json"
HEALTH_TIMEOUT = 120.0  # s; Prefect answers in ~9 s and MLflow in ~12 s on an idle laptop, far slower under load
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3 bucket names: 3–63 of a-z 0-9 . -


# ── the plan ──────────────────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Plan:
    """One server to start: its command, environment additions and the URLs it will answer on."""

    name: str
    label: str  # what `up` and `status` print, e.g. "Prefect UI"
    port: int
    option: str  # the `up` option that sets the port, for the busy-port message
    cmd: list[str]
    env: dict[str, str]
    health_path: str
    info: dict[str, str] = field(default_factory=dict)  # shown beside it, e.g. the artifact store

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Service:
    """A started server as recorded in ``stack.json``."""

    name: str
    label: str
    pid: int
    port: int
    url: str
    health: str
    cmd: list[str]
    log: str
    started: str  # ISO-8601 UTC
    proc_start: str | None = None  # start time of pid (psutil): tells a reused PID from ours
    info: dict[str, str] = field(default_factory=dict)


def stack_dir(root: Path) -> Path:
    return root / STACK_DIR


def mlflow_artifacts_on(root: Path, bucket: str) -> str:
    """MLflow's artifact destination in ``bucket``: the layout ``faceops data`` uses, ``s3://<bucket>/<prefix>/mlflow``
    with ``storage.prefix`` from the project's params.yaml, so the stack's bucket and a team bucket look the same."""
    from tasks.common import load_params, section
    from ops.remote import StorageConfig, mlflow_artifacts

    params = load_params(root / "params.yaml") if (root / "params.yaml").is_file() else {}
    prefix = section(params, "storage").get("prefix", StorageConfig().prefix)
    return mlflow_artifacts(StorageConfig(bucket=bucket, prefix=prefix))[0]


def plans(root: Path, *, s3: bool, prefect_port: int, mlflow_port: int, s3_port: int, bucket: str,
          workers: bool = False, git_url: str | None = None) -> list[Plan]:
    """What ``up`` starts, in order: S3 first (MLflow writes to it), then Prefect and MLflow, then (``workers``)
    one worker per work pool, which need both servers."""
    from ops.run_store import default_artifact_root, default_store

    home = stack_dir(root)
    out = []
    # no background job runner (eight huey processes for GenAI evaluation jobs faceops does not use) on a laptop
    mlflow_env: dict[str, str] = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    if s3:
        endpoint = f"http://{HOST}:{s3_port}"
        out.append(Plan("s3", "S3 (moto)", s3_port, "--s3-port", moto_command(s3_port), {}, "/",
                        {"bucket": f"s3://{bucket}", "note": "objects live in memory until `faceops stack down`, so "
                         "MLflow uses its own store here, .faceops/stack/mlflow-s3.db, not the repository's mlflow.db"}))
        artifacts = mlflow_artifacts_on(root, bucket)
        mlflow_env.update({"MLFLOW_S3_ENDPOINT_URL": endpoint, **S3_DUMMY_CREDENTIALS})
        store, cmd = home / "mlflow-s3.db", mlflow_command(mlflow_port, f"sqlite:///{home / 'mlflow-s3.db'}", artifacts)
    else:  # the repository's own store: what `make run` logs to
        artifacts = str(default_artifact_root(root))
        store = Path(default_store(root).removeprefix("sqlite:///"))
        cmd = mlflow_command(mlflow_port, default_store(root), artifacts, default_artifact_root=artifacts)
    out.append(Plan("prefect", "Prefect UI", prefect_port, "--prefect-port", prefect_command(prefect_port),
                    prefect_server_env(prefect_port, home / "prefect"), "/api/health"))
    info = {"store": str(store), "artifacts": artifacts}
    if not s3 and (home / "mlflow.db").is_file():  # an earlier stack's own store: say where its runs are
        info["note"] = (f"runs logged through an earlier stack stay in {home / 'mlflow.db'}: browse them with "
                        f"`mlflow ui --backend-store-uri sqlite:///{home / 'mlflow.db'} --port 5001`")
    out.append(Plan("mlflow", "MLflow UI", mlflow_port, "--mlflow-port", cmd, mlflow_env, "/health", info))
    if workers:
        env = worker_env(root, prefect_port, mlflow_port, git_url)
        for pool in pools():
            out.append(Plan(f"worker-{pool}", f"worker {pool}", 0, "", worker_command(pool), env, "",
                            {"pool": pool, "clones": env["FACEOPS_GIT_URL"]}))
    return out


def worker_env(root: Path, prefect_port: int, mlflow_port: int, git_url: str | None) -> dict[str, str]:
    """A worker's environment additions: the stack's servers, the repository to clone, the local DVC remote."""
    return {"PREFECT_API_URL": f"http://{HOST}:{prefect_port}/api", "MLFLOW_TRACKING_URI": f"http://{HOST}:{mlflow_port}",
            "FACEOPS_GIT_URL": git_url or os.environ.get("FACEOPS_GIT_URL") or str(root),
            "DVC_GLOBAL_CONFIG_DIR": str(stack_dir(root) / "dvc")}


def write_dvc_remote(root: Path) -> Path:
    """The workers' DVC global config: a default remote ``stack`` in ``.faceops/stack/dvc-remote`` (a repository
    that commits its own default remote keeps it: repository settings win over global ones); → the remote."""
    home = stack_dir(root)
    remote = home / "dvc-remote"
    remote.mkdir(parents=True, exist_ok=True)
    (home / "dvc").mkdir(parents=True, exist_ok=True)
    (home / "dvc" / "config").write_text(f"[core]\n    remote = stack\n['remote \"stack\"']\n    url = {remote.resolve()}\n")
    return remote


def client_env(services: Sequence[Service]) -> dict[str, str]:
    """What a shell exports so ``faceops run``, prefect, mlflow, dvc and boto3 use the stack."""
    env: dict[str, str] = {}
    for s in services:
        if s.name == "prefect":
            env["PREFECT_API_URL"] = f"{s.url}/api"
        elif s.name == "mlflow":
            env["MLFLOW_TRACKING_URI"] = s.url
        elif s.name == "s3":
            env.update({"AWS_ENDPOINT_URL": s.url, "MLFLOW_S3_ENDPOINT_URL": s.url, **S3_DUMMY_CREDENTIALS})
    return env


# ── state ─────────────────────────────────────────────────────────────────────────────────────────────────────────


def load_state(root: Path) -> list[Service]:
    """The recorded services (empty when nothing is recorded). A corrupt file is an error naming it."""
    path = stack_dir(root) / STATE_FILE
    if not path.is_file():
        return []
    try:
        return [Service(**s) for s in json.loads(path.read_text())["services"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise StackError(
            f"{path} is not a faceops stack record ({exc}); stop the servers it named by hand if any run, then delete it"
        ) from exc


def save_state(root: Path, services: Sequence[Service]) -> None:
    """Replace ``stack.json`` in one rename, so a reader never sees half a record; no services → no file."""
    from tasks.common import write_json

    path = stack_dir(root) / STATE_FILE
    if not services:
        path.unlink(missing_ok=True)
        return
    write_json(path, {"root": str(root), "services": [asdict(s) for s in services],
                      "env": client_env(services)})


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One ``up``/``down`` at a time per project (an flock on ``.faceops/stack/.lock``)."""
    import fcntl

    lock = stack_dir(root) / ".lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(f"another `faceops stack up` or `down` is running on this project (lock {lock})") from None
        yield


# ── up / down / status ────────────────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Health:
    """A recorded service as ``status`` finds it."""

    service: Service
    alive: bool
    healthy: bool

    @property
    def state(self) -> str:
        if not self.alive:
            return "stopped (pid gone)"
        if not self.service.health:
            return "running"
        return "healthy" if self.healthy else f"running, not answering at {self.service.health}"


def status(root: Path) -> list[Health]:
    """Each recorded service: is its PID still the process we started, and does its health URL answer 200."""
    out = []
    for s in load_state(root):
        alive = pid_alive(s.pid, s.proc_start)
        out.append(Health(s, alive, alive and (not s.health or http_ok(s.health))))
    return out


def _busy_ports(todo: Sequence[Plan]) -> None:
    seen: dict[int, str] = {}
    todo = [p for p in todo if p.port]  # workers listen on no port
    for p in todo:
        if p.port in seen:
            raise StackError(f"{p.option} {p.port} is also the {seen[p.port]} port; give each server its own port")
        seen[p.port] = p.option
    for p in todo:
        if port_busy(p.port):
            raise StackError(
                f"port {p.port} on {HOST} ({p.name}) is already in use by another process; stop it "
                f"(e.g. `lsof -i :{p.port}`) or choose another port with {p.option}"
            )


def _log_ending(path: str) -> str:
    """``", ending:"`` and the last lines of the log at ``path``, indented (empty when it cannot be read)."""
    try:
        tail = Path(path).read_text(errors="replace").splitlines()[-15:]
    except OSError:
        return ""
    return ", ending:\n" + "\n".join(f"    {line}" for line in tail) if tail else ""


def up(root: Path, *, s3: bool = False, prefect_port: int | None = None, mlflow_port: int | None = None,
       s3_port: int = 5055, bucket: str = "faceops", timeout: float = HEALTH_TIMEOUT, workers: bool = False,
       git_url: str | None = None) -> tuple[list[Service], bool]:
    """Start the stack and wait until every server answers its health check; returns (services, already_running).

    A stack already running with the same servers and ports is reported, not restarted; with other options it
    is an error (``down`` first). A record whose processes are all gone is cleaned. Busy ports are refused before
    anything starts; ports default to those the compose file publishes (``PREFECT_PORT``, ``MLFLOW_PORT``). If a
    server fails, the ones started are stopped and the error quotes its log. With ``workers``, the pools,
    deployments, workers and the local DVC remote follow once the servers answer.
    """
    if s3:
        if not _BUCKET.match(bucket):
            raise StackError(f"--bucket {bucket!r} is not a valid S3 bucket name (3–63 lowercase letters, digits, "
                             "'.' or '-', starting and ending with a letter or digit)")
        if importlib.util.find_spec("moto") is None:
            raise StackError("--s3 needs moto's server, which is not installed: pip install 'moto[server]' "
                             "(or `pip install -e '.[test]'`)")
    prefect_port = prefect_port or published_port("prefect-server", os.environ)
    mlflow_port = mlflow_port or published_port("mlflow", os.environ)
    todo = plans(root, s3=s3, prefect_port=prefect_port, mlflow_port=mlflow_port, s3_port=s3_port, bucket=bucket,
                 workers=workers, git_url=git_url)
    if workers:
        check_git_head(next(p for p in todo if p.name.startswith("worker-")).env["FACEOPS_GIT_URL"])
    with _locked(root):
        running = _running_or_clean(root, todo)
        if running is not None:
            return running, True
        _busy_ports(todo)
        return _start(root, todo, bucket, timeout), False


def _running_or_clean(root: Path, todo: Sequence[Plan]) -> list[Service] | None:
    """The recorded services if they all run as requested; None (record removed) if none runs; else an error."""
    recorded = load_state(root)
    if not recorded:
        return None
    alive = [s for s in recorded if pid_alive(s.pid, s.proc_start)]
    if not alive:
        save_state(root, [])
        return None
    wanted = {(p.name, p.port) for p in todo}
    have = {(s.name, s.port) for s in recorded}
    if len(alive) == len(recorded) and wanted == have:
        return recorded
    described = ", ".join(f"{s.name} pid {s.pid} on port {s.port}" + ("" if s in alive else " (gone)")
                          for s in recorded)
    raise StackError(f"a stack is already running here with other servers or ports ({described}); "
                     "run `faceops stack down` first, then `faceops stack up` with the options you want")


@contextlib.contextmanager
def _store_lock(root: Path, todo: Sequence[Plan]) -> Iterator[None]:
    """Hold ``<store>.lock`` (``ops.run_store.store_creation_lock``, the lock ``faceops run`` takes to create an
    SQLite store) while the MLflow server creates or migrates its SQLite store, so a ``faceops run`` starting
    meanwhile waits for it. The repository's own store, if copied from another folder, is first made to point at
    this folder's ``mlruns/`` (``ops.run_store.adopt_store``)."""
    from ops.run_store import adopt_store, default_store, store_creation_lock

    store = next((p.info.get("store") for p in todo if p.name == "mlflow"), None)
    if not store:
        yield
        return
    with store_creation_lock(f"sqlite:///{store}"):
        if f"sqlite:///{store}" == default_store(root):
            adopt_store(root)
        yield


def _start(root: Path, todo: Sequence[Plan], bucket: str, timeout: float) -> list[Service]:
    home = stack_dir(root)
    home.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Plan, subprocess.Popen, Service]] = []

    def spawn_plan(p: Plan) -> tuple[subprocess.Popen, Service]:
        log = home / f"{p.name}.log"
        proc = spawn(p.cmd, env=server_env(p.env), log=log, cwd=root)
        health = p.url + p.health_path if p.health_path else ""
        service = Service(p.name, p.label, proc.pid, p.port, p.url if p.port else "", health, p.cmd, str(log),
                          utc_now(), proc_start(proc.pid), p.info)
        started.append((p, proc, service))
        save_state(root, [s for _, _, s in started])  # recorded at once: `down` can stop a half-started stack
        return proc, service

    servers = [p for p in todo if p.port]
    workers = [p for p in todo if not p.port]
    try:
        with _store_lock(root, todo):
            for p in servers:
                spawn_plan(p)
            for p, proc, service in list(started):
                try:
                    wait_healthy(service.health, proc, timeout)
                except StackError as exc:
                    raise ServerFailed(f"{p.name} did not start: {exc}; its log is {service.log}"
                                       + _log_ending(service.log)) from None
                if p.name == "s3":
                    create_bucket(p.url, bucket)
                if p.name == "prefect":
                    install_crash_detection(f"{p.url}/api", home / f"{p.name}.log")
        if workers:
            write_dvc_remote(root)
            setup_deployments(root, workers[0].env["PREFECT_API_URL"], workers[0].env, home / "deploy.log")
            procs = [(p, *spawn_plan(p)) for p in workers]
            time.sleep(3.0)  # a worker with a bad setting exits at once: say so now, not at the first flow run
            for p, proc, service in procs:
                if proc.poll() is not None:
                    raise ServerFailed(f"{p.name} exited with code {proc.returncode}; its log is {service.log}"
                                       + _log_ending(service.log))
    except BaseException:
        stop_targets([Target(proc) for _, proc, _ in started], STOP_TIMEOUT)
        save_state(root, [])
        raise
    return [s for _, _, s in started]


def down(root: Path, timeout: float = STOP_TIMEOUT) -> list[str]:
    """Stop every recorded service (terminate → wait → kill, whole process group) and remove the record.

    Idempotent: with nothing recorded it does nothing; a PID that is gone, or now belongs to another program
    (its start time differs from the recorded one), is reported and left alone.
    """
    with _locked(root):
        recorded = load_state(root)
        notes = []
        targets = []
        for s in reversed(recorded):  # MLflow and Prefect before the S3 they write to
            if pid_alive(s.pid, s.proc_start):
                targets.append(Target(s.pid, s.proc_start))
                notes.append(f"stopped {s.name} (pid {s.pid}" + (f", {s.url})" if s.url else ")"))
            else:
                reused = " (another program has that PID now; left alone)" if pid_alive(s.pid) else ""
                notes.append(f"{s.name}: pid {s.pid} was already gone{reused}; record cleaned")
        # workers first, while the servers they report to still answer; then MLflow, Prefect and S3
        workers = {s.pid for s in recorded if s.name.startswith("worker-")}
        stop_targets([t for t in targets if t.pid in workers], timeout)
        stop_targets([t for t in targets if t.pid not in workers], timeout)
        still = [t.pid for t in targets if t.alive()]
        if still:
            raise ServerFailed(f"pids {still} did not exit after SIGKILL; check them with `ps -o pid,stat,cmd -p "
                             f"{','.join(map(str, still))}`; the record {stack_dir(root) / STATE_FILE} is kept")
        save_state(root, [])
        return notes
