"""``faceops stack``: the Prefect server, the MLflow server and, with ``--s3``, moto's S3 on a laptop, no Docker;
with ``--workers``, also the work pools, the deployments of prefect.yaml, a worker per pool and a local DVC remote.

Each server is a detached background process in its own session, so ``down`` stops it together with any
children it forked (one process group), and a closed terminal does not take it down. Everything binds to
127.0.0.1. What runs is recorded in ``.faceops/stack/stack.json`` (name, pid, port, url, cmd, start time),
replaced atomically, so ``status`` and ``down`` work from any later shell. Beside it live each server's log
(``<name>.log``) and Prefect's SQLite database (``prefect/``).

**One MLflow store.** The MLflow server serves the repository's own store, the one ``make run`` / ``faceops run``
log to without a server: ``mlflow.db`` with artifacts in ``mlruns/`` (``tasks.tracking.default_store``). Runs
logged either way are in the same store, whether or not the stack runs; experiments created through the server
keep their artifacts in ``mlruns/`` too (``--default-artifact-root``), so they stay readable without it. SQLite
takes one writer at a time: MLflow waits up to 20 s for a lock (its ``busy_timeout``), the pipeline retries its
MLflow calls, and ``up`` holds ``mlflow.db.lock`` (the lock ``tasks.tracking`` takes to create the store) while the
server creates or migrates it. With ``--s3`` MLflow's artifacts go to ``s3://<bucket>/<storage.prefix>/mlflow`` on
the moto server, which keeps them in memory (gone after ``down``): runs logged there would point at vanished
files, so that stack keeps its own store, ``.faceops/stack/mlflow-s3.db``.

**Workers** (``--workers``): work pools ``cpu`` and ``gpu`` (type process), ``prefect deploy --all`` with the
schedules paused (Quick run from the UI; nothing starts at 02:00 on a laptop), one ``prefect worker`` per pool, and
a DVC remote in ``.faceops/stack/dvc-remote`` that the workers see as their default (a DVC global config in
``.faceops/stack/dvc/``, ``DVC_GLOBAL_CONFIG_DIR``) unless the repository commits its own. The workers clone
``FACEOPS_GIT_URL`` (default: this repository, its committed ``HEAD``) and log to the stack's MLflow server.

The same helpers (free port, health wait, stop by PID) serve the integration tests' servers
(``tests/servers.py``). A team deployment (PostgreSQL, MinIO, GPU workers) is ``infra/``; see ``infra/README.md``.
POSIX only (sessions, process groups, ``flock``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer

from ml.errors import FaceopsError

HOST = "127.0.0.1"
STACK_DIR = Path(".faceops") / "stack"
STATE_FILE = "stack.json"
QUIET_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
# moto accepts any credentials; these fixed dummies keep real ones from ever being sent to it
S3_DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}
# settings a user may have exported for another server; the stack's servers must use their own stores
_FOREIGN_SERVER_ENV = ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_API_DATABASE_CONNECTION_URL",
                       "PREFECT_SERVER_DATABASE_CONNECTION_URL")
HEALTH_TIMEOUT = 120.0  # s; Prefect answers in ~9 s and MLflow in ~12 s on an idle laptop, far slower under load
STOP_TIMEOUT = 20.0  # s between SIGTERM and SIGKILL
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3 bucket names: 3–63 of a-z 0-9 . -


class StackError(FaceopsError, RuntimeError):
    """Bad input or state (busy port, bad bucket name, a stack already running); the message says what to do."""


class ServerFailed(StackError):
    """A server did not start, answer or stop; the message names its URL or endpoint and its log."""


# ── processes ─────────────────────────────────────────────────────────────────────────────────────────────────────


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_busy(port: int, host: str = HOST) -> bool:
    """True when something listens on or holds ``host:port``: a connect succeeds, or a bind fails.

    ``SO_REUSEADDR`` makes the bind ignore sockets in TIME_WAIT, so a port freed by ``down`` a moment ago
    counts as free, as it will be for the server.
    """
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def spawn(cmd: Sequence[str], *, env: Mapping[str, str], log: Path | None = None, cwd: Path | None = None
          ) -> subprocess.Popen:
    """Start ``cmd`` detached: its own session and process group, stdin closed, output appended to ``log``
    (discarded without one). Its PID is the server's, and the group holds whatever it forks."""
    out: Any = subprocess.DEVNULL
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
        out.write(f"\n── {_now()} {' '.join(cmd)}\n".encode())
        out.flush()
    try:
        return subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None:
            out.close()


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    # loopback health checks must not go through an HTTP(S)_PROXY the user exported
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when ``GET url`` answers 200 within ``timeout`` seconds."""
    try:
        with _no_proxy_opener().open(url, timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError, http.client.HTTPException):  # refused, reset, timeout, half-started server
        return False


def wait_healthy(url: str, proc: subprocess.Popen | None = None, seconds: float = 90) -> None:
    """Poll ``url`` until it answers 200. Fails at once if ``proc`` exits, else after ``seconds``, naming the URL."""
    deadline = time.monotonic() + seconds
    while True:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"the server for {url} exited with code {proc.returncode} before answering")
        if http_ok(url):
            return
        if time.monotonic() >= deadline:
            raise StackError(f"nothing healthy answered at {url} within {seconds:.0f} s")
        time.sleep(0.5)


def proc_start(pid: int) -> str | None:
    """The start time of ``pid`` (``psutil``: seconds since the epoch, to 10 ms), recorded so that a PID reused
    by another program is not taken for ours; None if it is gone."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, OSError):
        return None


def pid_alive(pid: int, started: str | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if ``started`` is given, is still the process started then."""
    with contextlib.suppress(ChildProcessError):  # our own child: reap it if it has exited
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        return started is None or f"{proc.create_time():.2f}" == started
    except psutil.AccessDenied:
        return False  # another user's process: whatever it is, it is not one we started
    except (psutil.Error, OSError):
        return False


def _group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) in process group ``pgid``."""
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
    return members


class _Target:
    """One process to stop: a ``Popen`` we hold, or a recorded PID (and its start time)."""

    def __init__(self, target: int | subprocess.Popen, started: str | None = None) -> None:
        self.proc = target if isinstance(target, subprocess.Popen) else None
        self.pid = target.pid if isinstance(target, subprocess.Popen) else int(target)
        self.started = started
        # a server spawned detached leads its own group; never signal the group we run in ourselves
        try:
            self.group = os.getpgid(self.pid) == self.pid and self.pid != os.getpgid(0)
        except OSError:
            self.group = False

    def leader_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid, self.started)

    def alive(self) -> bool:
        if self.leader_alive():
            return True
        if not self.group:
            return False
        return bool(_group_members(self.pid))

    def send(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group:
                os.killpg(self.pid, sig)
            elif self.leader_alive():
                os.kill(self.pid, sig)


def stop(*targets: int | subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """Stop processes (``Popen`` objects or PIDs): SIGTERM to each one's process group, wait up to ``timeout``
    seconds, then SIGKILL what is left. Processes already gone are skipped, so stopping twice is harmless."""
    _stop([_Target(t) for t in targets], timeout)


def _stop(targets: Sequence[_Target], timeout: float) -> None:
    live = [t for t in targets if t.alive()]
    for t in live:
        t.send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [t for t in live if t.alive()]
    for t in live:
        t.send(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [t for t in live if t.alive()]
    for t in targets:
        if t.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                t.proc.wait(timeout=1.0)


# ── the servers ───────────────────────────────────────────────────────────────────────────────────────────────────


def prefect_command(port: int) -> list[str]:
    """``prefect server start`` on 127.0.0.1:``port`` (its SQLite store lives in ``PREFECT_HOME``)."""
    return [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]


def mlflow_command(port: int, backend_store_uri: str, artifacts_destination: str,
                   default_artifact_root: str | None = None) -> list[str]:
    """``mlflow server`` on 127.0.0.1:``port``, proxying artifacts to ``artifacts_destination`` (a path or s3://);
    with ``default_artifact_root``, experiments it creates keep their artifacts there instead (a path that clients
    without the server can read too)."""
    root = ["--default-artifact-root", default_artifact_root] if default_artifact_root else []
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri, *root,
            "--artifacts-destination", artifacts_destination, "--host", HOST, "--port", str(port), "--workers", "1"]


def prefect_server_env(port: int, home: Path) -> dict[str, str]:
    """The Prefect server's environment: its own ``PREFECT_HOME``, and the API URL its UI calls. Without
    ``PREFECT_UI_API_URL`` the UI calls :4200 whatever ``--port`` says, and on another port every page of it shows
    "Can't connect to Server API"; no Prefect Cloud banners on a lab's server."""
    return {"PREFECT_HOME": str(home), "PREFECT_UI_API_URL": f"http://{HOST}:{port}/api",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}


def worker_command(pool: str) -> list[str]:
    """``prefect worker start`` for the ``process`` work pool ``pool``."""
    return [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
            "--name", f"faceops-{pool}"]


def moto_command(port: int) -> list[str]:
    """moto's S3 (all its mock AWS services) over HTTP on 127.0.0.1:``port``; state is in memory."""
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]


def server_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, quiet and offline, without settings that point at other servers, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_SERVER_ENV}
    return {**env, **QUIET_ENV, **extra}


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` at the S3 ``endpoint`` with the dummy credentials (kept if it exists). boto3 retries
    connection failures; after that the error names the endpoint."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=S3_DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=S3_DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=3, read_timeout=10),
    )
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ServerFailed(f"cannot create bucket {bucket!r} at S3 endpoint {endpoint}: {exc}") from exc
    except BotoCoreError as exc:
        raise ServerFailed(f"S3 endpoint {endpoint} is unreachable (after retries): {exc}") from exc


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
    from tasks.storage import StorageConfig, mlflow_artifacts

    params = load_params(root / "params.yaml") if (root / "params.yaml").is_file() else {}
    prefix = section(params, "storage").get("prefix", StorageConfig().prefix)
    return mlflow_artifacts(StorageConfig(bucket=bucket, prefix=prefix))[0]


POOLS = ("cpu", "gpu")  # the work pools of prefect.yaml


def plans(root: Path, *, s3: bool, prefect_port: int, mlflow_port: int, s3_port: int, bucket: str,
          workers: bool = False, git_url: str | None = None) -> list[Plan]:
    """What ``up`` starts, in order: S3 first (MLflow writes to it), then Prefect and MLflow, then (``workers``)
    one worker per work pool, which need both servers."""
    from tasks.tracking import default_artifact_root, default_store

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
        for pool in POOLS:
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


def _git_head(url: str) -> None:
    """Refuse a local ``FACEOPS_GIT_URL`` that is not a git repository with a commit (the workers clone it)."""
    path = Path(url)
    if not path.is_dir():
        return  # a remote URL: the worker's clone says what is wrong with it
    done = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=path, capture_output=True, text=True)
    if done.returncode != 0:
        raise StackError(f"--workers: the workers clone FACEOPS_GIT_URL={url}, which is not a git repository with a "
                         "commit; commit your work (the workers run the committed HEAD) or pass --git-url")


def setup_deployments(root: Path, api_url: str, env: Mapping[str, str], log: Path) -> None:
    """Create the work pools (type process; kept if they exist), ``prefect deploy --all`` from ``root``, then pause
    the deployments' schedules: on a laptop a flow run starts when someone asks (Quick run), not at 02:00."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        for pool in POOLS:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        with open(log, "ab") as out:
            done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=root,
                                  env=server_env({**env, "PREFECT_API_URL": api_url}), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=600)
        if done.returncode != 0:
            raise ServerFailed(f"`prefect deploy --all` failed (exit {done.returncode}); see {log}")
        for deployment in client.read_deployments():
            if any(s.active for s in deployment.schedules or []):
                client.pause_deployment(deployment.id)


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


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join(f"    {line}" for line in tail)


def up(root: Path, *, s3: bool = False, prefect_port: int = 4200, mlflow_port: int = 5000, s3_port: int = 5055,
       bucket: str = "faceops", timeout: float = HEALTH_TIMEOUT, workers: bool = False, git_url: str | None = None
       ) -> tuple[list[Service], bool]:
    """Start the stack and wait until every server answers its health check; returns (services, already_running).

    A stack already running with the same servers and ports is reported, not restarted; with other options it
    is an error (``down`` first). A record whose processes are all gone is cleaned. Busy ports are refused before
    anything starts. If a server fails, the ones started are stopped and the error quotes its log. With
    ``workers``, the pools, deployments, workers and the local DVC remote follow once the servers answer.
    """
    if s3:
        if not _BUCKET.match(bucket):
            raise StackError(f"--bucket {bucket!r} is not a valid S3 bucket name (3–63 lowercase letters, digits, "
                             "'.' or '-', starting and ending with a letter or digit)")
        if importlib.util.find_spec("moto") is None:
            raise StackError("--s3 needs moto's server, which is not installed: pip install 'moto[server]' "
                             "(or `pip install -e '.[test]'`)")
    todo = plans(root, s3=s3, prefect_port=prefect_port, mlflow_port=mlflow_port, s3_port=s3_port, bucket=bucket,
                 workers=workers, git_url=git_url)
    if workers:
        _git_head(next(p for p in todo if p.name.startswith("worker-")).env["FACEOPS_GIT_URL"])
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
def _store_lock(todo: Sequence[Plan]) -> Iterator[None]:
    """Hold ``<store>.lock`` (``tasks.tracking.store_creation_lock``, the lock ``faceops run`` takes to create an
    SQLite store) while the MLflow server creates or migrates its SQLite store, so a ``faceops run`` starting
    meanwhile waits for it."""
    from tasks.tracking import store_creation_lock

    store = next((p.info.get("store") for p in todo if p.name == "mlflow"), None)
    if not store:
        yield
        return
    with store_creation_lock(f"sqlite:///{store}"):
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
                          _now(), proc_start(proc.pid), p.info)
        started.append((p, proc, service))
        save_state(root, [s for _, _, s in started])  # recorded at once: `down` can stop a half-started stack
        return proc, service

    servers = [p for p in todo if p.port]
    workers = [p for p in todo if not p.port]
    try:
        with _store_lock(todo):
            for p in servers:
                spawn_plan(p)
            for p, proc, service in list(started):
                try:
                    wait_healthy(service.health, proc, timeout)
                except StackError as exc:
                    tail = _log_tail(Path(service.log))
                    raise ServerFailed(f"{p.name} did not start: {exc}; its log is {service.log}"
                                       + (f", ending:\n{tail}" if tail else "")) from None
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
                    tail = _log_tail(Path(service.log))
                    raise ServerFailed(f"{p.name} exited with code {proc.returncode}; its log is {service.log}"
                                       + (f", ending:\n{tail}" if tail else ""))
    except BaseException:
        _stop([_Target(proc) for _, proc, _ in started], STOP_TIMEOUT)
        save_state(root, [])
        raise
    return [s for _, _, s in started]


def install_crash_detection(api_url: str, log: Path) -> None:
    """Install the automation that marks a flow run Crashed when its process dies silently (flows/heartbeats.py)
    on the Prefect server at ``api_url``; its output goes to the server's log."""
    env = {**os.environ, "PREFECT_API_URL": api_url}
    with open(log, "ab") as out:
        done = subprocess.run([sys.executable, "-m", "flows.heartbeats"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=120)
    if done.returncode != 0:
        raise ServerFailed(f"the Prefect server started, but installing its crash detection "
                           f"(python -m flows.heartbeats) failed; see {log}")


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
                targets.append(_Target(s.pid, s.proc_start))
                notes.append(f"stopped {s.name} (pid {s.pid}" + (f", {s.url})" if s.url else ")"))
            else:
                reused = " (another program has that PID now; left alone)" if pid_alive(s.pid) else ""
                notes.append(f"{s.name}: pid {s.pid} was already gone{reused}; record cleaned")
        # workers first, while the servers they report to still answer; then MLflow, Prefect and S3
        workers = {s.pid for s in recorded if s.name.startswith("worker-")}
        _stop([t for t in targets if t.pid in workers], timeout)
        _stop([t for t in targets if t.pid not in workers], timeout)
        still = [t.pid for t in targets if t.alive()]
        if still:
            raise ServerFailed(f"pids {still} did not exit after SIGKILL; check them with `ps -o pid,stat,cmd -p "
                             f"{','.join(map(str, still))}`; the record {stack_dir(root) / STATE_FILE} is kept")
        save_state(root, [])
        return notes


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ── the command ───────────────────────────────────────────────────────────────────────────────────────────────────

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
        "State, logs and stores: `.faceops/stack/` in the repository root. A team deployment is `infra/` "
        "(see `infra/README.md`)."
    ),
)


def _root() -> Path:
    root = Path.cwd()
    if not (root / "dvc.yaml").is_file():
        _fail(f"no dvc.yaml in {root}: run `faceops stack` from the repository root.")
    return root


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _rel(root: Path, path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(root))
    return path


def _echo_env(services: Sequence[Service]) -> None:
    for key, value in client_env(services).items():
        comment = "   # moto's dummy credentials" if key in S3_DUMMY_CREDENTIALS else ""
        typer.echo(f"export {key}={value}{comment}")


def _echo_services(root: Path, services: Sequence[Service]) -> None:
    for s in services:
        extra = "  ".join(f"{k} {_rel(root, v)}" for k, v in s.info.items() if k != "note")
        typer.echo(f"  {s.label:<11} {s.url or '-':<24} pid {s.pid:<7} log {_rel(root, s.log)}"
                   + (f"  {extra}" if extra else ""))


@stack_app.command("up")
def up_cmd(
    s3: Annotated[bool, typer.Option("--s3", help="also start moto's S3 and keep MLflow's artifacts in `s3://BUCKET/mlflow`")] = False,
    prefect_port: Annotated[int, typer.Option(min=1, max=65535, help="Prefect server (API + UI) port")] = 4200,
    mlflow_port: Annotated[int, typer.Option(min=1, max=65535, help="MLflow tracking server (API + UI) port")] = 5000,
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

    * `faceops stack up --workers` — plus pools, deployments and workers: Quick run `pipeline-nightly` with
      `preset: smoke` in the Prefect UI runs the whole DAG on this machine

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
    if any(s.name.startswith("worker-") for s in services):
        prefect = next(s.url for s in services if s.name == "prefect")
        typer.echo(f"\nDeployments: {prefect}/deployments (schedules paused). Quick run `pipeline-nightly` "
                   "with preset `smoke` runs the whole DAG on these workers, from the committed HEAD of the "
                   "repository they clone; their DVC remote is .faceops/stack/dvc-remote.")
    typer.echo("\nTo use it from this shell (`faceops run` reads these), run `eval \"$(faceops stack env)\"` or:")
    _echo_env(services)
    typer.echo("\nStop it with `faceops stack down`.")


@stack_app.command("env")
def env_cmd() -> None:
    """Print `export` lines for the running stack: `eval "$(faceops stack env)"` points this shell at it.

    Exits 3 (and prints nothing) when no stack runs.
    """
    root = _root()
    try:
        found = status(root)
    except StackError as exc:
        _fail(str(exc))
    if not found or not all(h.alive for h in found):
        typer.secho("no local stack runs here: start it with `faceops stack up`", err=True)
        raise typer.Exit(3)
    _echo_env([h.service for h in found])


@stack_app.command("status")
def status_cmd() -> None:
    """Show each server of the local stack: PID alive and health check answered.

    Exit code: 0 all running and healthy, 1 something recorded is down or not answering, 3 stopped.
    """
    root = _root()
    try:
        found = status(root)
    except StackError as exc:
        _fail(str(exc))
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
