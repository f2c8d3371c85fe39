"""`faceops stack`: real Prefect and MLflow servers started in the background on free loopback ports, reported by
`status`, refused on a busy port, stopped by PID with `down`; with `--s3`, an MLflow artifact lands in moto's bucket.

Every command runs as a user would run it (a `faceops` subprocess) in a throw-away directory holding a `dvc.yaml`,
so the repository's own `.faceops/` is never touched. Whatever a test started is killed at teardown.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from faceops.processes import free_port
from faceops.stack import plans

pytestmark = pytest.mark.slow
BUCKET = "stack-test"
FACEOPS = [sys.executable, "-m", "faceops.cli", "stack"]
# a shell pointed at other servers must not change what the stack starts or where the tests look
ENV = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
ENV["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


def _stack(args: list[str], root: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(FACEOPS + args, cwd=root, env=ENV, capture_output=True, text=True, timeout=timeout)


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "dvc.yaml").write_text("stages: {}\n")
    return root


def _ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _record(root: Path) -> dict[str, dict]:
    path = root / ".faceops" / "stack" / "stack.json"
    return {s["name"]: s for s in json.loads(path.read_text())["services"]}


def _running(pid: int) -> bool:
    """Alive and not a zombie, judged without the module under test."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _get(url: str, data: bytes | None = None) -> tuple[int, str]:
    """(status, body) of a request that bypasses any proxy; (0, "") when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def _kill_left_over(pids: list[int]) -> None:
    """Teardown safety net: the servers a test started lead their own process groups."""
    for pid in pids:
        if _running(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`faceops stack up --s3` on three free ports; yields (root, ports, args of up, stdout of up); stopped at the end.

    One stack with S3 serves every test: the servers' start-up dominates the time, and the S3 stack holds the
    default one (Prefect + MLflow) plus moto."""
    pytest.importorskip("moto")
    root = _project(tmp_path_factory.mktemp("stack"))
    prefect_port, mlflow_port, s3_port = _ports(3)
    ports = {"prefect": prefect_port, "mlflow": mlflow_port, "s3": s3_port}
    args = ["--s3", "--bucket", BUCKET, "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port),
            "--s3-port", str(s3_port)]
    out = _stack(["up", *args], root)
    pids = [s["pid"] for s in _record(root).values()] if (root / ".faceops/stack/stack.json").is_file() else []
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        yield root, ports, args, out.stdout
    finally:
        _stack(["down"], root)
        _kill_left_over(pids)


def test_up_prints_both_ui_urls_and_the_exports(stack):
    _, ports, _, stdout = stack
    assert f"http://127.0.0.1:{ports['prefect']}" in stdout and f"http://127.0.0.1:{ports['mlflow']}" in stdout
    assert f"export PREFECT_API_URL=http://127.0.0.1:{ports['prefect']}/api" in stdout
    assert f"export MLFLOW_TRACKING_URI=http://127.0.0.1:{ports['mlflow']}" in stdout
    assert f"export AWS_ENDPOINT_URL=http://127.0.0.1:{ports['s3']}" in stdout


def test_record_names_each_live_server(stack):
    root, ports, _, _ = stack
    record = _record(root)
    assert set(record) == {"s3", "prefect", "mlflow"}
    for name, service in record.items():
        assert _running(service["pid"]), name
        assert service["port"] == ports[name]
        assert service["url"] == f"http://127.0.0.1:{ports[name]}"
        cmd = service["cmd"]
        host, port = ("-H", "-p") if name == "s3" else ("--host", "--port")
        assert cmd[cmd.index(host) + 1] == "127.0.0.1" and cmd[cmd.index(port) + 1] == str(ports[name])
        assert dt.datetime.fromisoformat(service["started"]).tzinfo is not None
        assert Path(service["log"]).is_file() and Path(service["log"]).parent == root / ".faceops" / "stack"
    mlflow_cmd = record["mlflow"]["cmd"]
    assert mlflow_cmd[mlflow_cmd.index("--backend-store-uri") + 1].endswith("/.faceops/stack/mlflow-s3.db")
    # the layout of `faceops data`: s3://<bucket>/<storage.prefix>/mlflow
    assert mlflow_cmd[mlflow_cmd.index("--artifacts-destination") + 1] == f"s3://{BUCKET}/faceops/mlflow"


def test_default_stack_serves_the_repositorys_own_store(tmp_path):
    """Without --s3: Prefect and MLflow only; MLflow serves mlflow.db and mlruns/ in the repository root, the store
    `make run` logs to, and creates experiments there too; no S3 settings."""
    todo = plans(tmp_path, s3=False, prefect_port=4200, mlflow_port=5000, s3_port=5055, bucket="faceops")
    assert [p.name for p in todo] == ["prefect", "mlflow"]
    mlflow = todo[1]
    cmd = mlflow.cmd
    assert cmd[cmd.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert cmd[cmd.index("--default-artifact-root") + 1] == str(tmp_path.resolve() / "mlruns")
    assert cmd[cmd.index("--artifacts-destination") + 1] == str(tmp_path.resolve() / "mlruns")
    assert not any(k.startswith(("AWS_", "MLFLOW_S3")) for k in mlflow.env)
    assert all(p.cmd[p.cmd.index("--host") + 1] == "127.0.0.1" for p in todo)
    s3 = plans(tmp_path, s3=True, prefect_port=4200, mlflow_port=5000, s3_port=5055, bucket="faceops")[2]
    # moto's objects are in memory: runs whose artifacts vanish at `down` stay out of the repository's store
    assert s3.cmd[s3.cmd.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path / '.faceops/stack/mlflow-s3.db'}"


def test_prefect_and_mlflow_answer(stack):
    _, ports, _, _ = stack
    prefect, mlflow = f"http://127.0.0.1:{ports['prefect']}", f"http://127.0.0.1:{ports['mlflow']}"
    assert _get(f"{prefect}/api/health") == (200, "true")
    assert _get(f"{mlflow}/health")[0] == 200
    for ui in (prefect, mlflow):  # the UIs a user opens
        status, body = _get(ui)
        assert status == 200 and "<html" in body.lower(), ui


def test_the_stacks_prefect_server_marks_silent_flow_runs_crashed(stack):
    """`stack up` installs the heartbeat automation (flows/heartbeats.py): a flow run whose process died with its
    worker does not stay Running for ever."""
    import urllib.request

    from flows.heartbeats import AUTOMATION_NAME

    _, ports, _, _ = stack
    request = urllib.request.Request(f"http://127.0.0.1:{ports['prefect']}/api/automations/filter", data=b"{}",
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30) as response:
        automations = json.loads(response.read())
    (crash,) = [a for a in automations if a["name"] == AUTOMATION_NAME]
    assert crash["enabled"] and crash["actions"][0]["state"] == "CRASHED"


def test_mlflow_artifacts_land_in_the_moto_bucket(stack):
    import boto3

    _, ports, _, _ = stack
    # a client with the tracking URI only: the server proxies the artifact to S3 with its own credentials
    client_env = {k: v for k, v in ENV.items() if not k.startswith(("AWS_", "MLFLOW_S3"))}
    client_env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{ports['mlflow']}"
    logged = subprocess.run(
        [sys.executable, "-c", "import mlflow\nmlflow.set_experiment('stack-s3')\n"
         "with mlflow.start_run() as run:\n    mlflow.log_text('hello from the stack', 'notes/hello.txt')\n"
         "print(run.info.run_id)"],
        env=client_env, capture_output=True, text=True, timeout=180,
    )
    assert logged.returncode == 0, logged.stderr[-3000:]
    run_id = logged.stdout.strip().splitlines()[-1]
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{ports['s3']}", region_name="us-east-1",
                      aws_access_key_id="testing", aws_secret_access_key="testing")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="faceops/mlflow/").get("Contents", [])]
    key = next(k for k in keys if k.endswith("notes/hello.txt"))
    assert run_id in key
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"hello from the stack"


def test_status_reports_each_healthy_with_its_pid(stack):
    root, _, _, _ = stack
    record = _record(root)
    out = _stack(["status"], root)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for name, service in record.items():
        line = next(line for line in lines if line.split()[:1] == [name])
        assert "healthy" in line and str(service["pid"]) in line


def test_second_up_reports_it_is_already_running(stack):
    root, _, args, _ = stack
    before = {name: s["pid"] for name, s in _record(root).items()}
    out = _stack(["up", *args], root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "already running" in out.stdout
    assert {name: s["pid"] for name, s in _record(root).items()} == before


def test_up_with_other_options_while_running_is_refused(stack):
    root, ports, _, _ = stack
    before = {name: s["pid"] for name, s in _record(root).items()}
    other = next(p for p in _ports(4) if p not in ports.values())
    out = _stack(["up", "--prefect-port", str(other), "--mlflow-port", str(ports["mlflow"])], root)  # no --s3
    assert out.returncode == 2
    assert "already running" in out.stderr and "faceops stack down" in out.stderr
    assert {name: s["pid"] for name, s in _record(root).items()} == before


def test_down_stops_the_servers_and_status_then_says_stopped(stack):  # runs last of the `stack` tests
    root, ports, _, _ = stack
    pids = {name: s["pid"] for name, s in _record(root).items()}
    out = _stack(["down"], root)
    assert out.returncode == 0, out.stdout + out.stderr
    for name, pid in pids.items():
        assert f"stopped {name}" in out.stdout
        assert not _running(pid), f"{name} pid {pid} still runs"
        assert _get(f"http://127.0.0.1:{ports[name]}/")[0] == 0
    assert not (root / ".faceops" / "stack" / "stack.json").exists()
    status = _stack(["status"], root)
    assert status.returncode == 3 and "stopped" in status.stdout
    again = _stack(["down"], root)
    assert again.returncode == 0 and "not running" in again.stdout


@pytest.mark.parametrize("option", ["--prefect-port", "--mlflow-port"])
def test_busy_port_is_refused_naming_it(tmp_path, option):
    root = _project(tmp_path / "ws")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        free = next(p for p in _ports(2) if p != busy)
        ports = {"--prefect-port": free, "--mlflow-port": free, option: busy}
        out = _stack(["up", *[str(x) for kv in ports.items() for x in kv]], root)
    assert out.returncode == 2
    assert f"port {busy}" in out.stderr and option in out.stderr
    assert not (root / ".faceops" / "stack" / "stack.json").exists()  # nothing was started


def test_down_cleans_a_stale_record_and_spares_a_reused_pid(tmp_path):
    root = _project(tmp_path / "ws")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stranger = subprocess.Popen(["sleep", "60"])  # alive, but not the process the record names
    try:
        services = [
            {"name": "prefect", "label": "Prefect UI", "pid": gone.pid, "port": 1, "url": "http://127.0.0.1:1",
             "health": "http://127.0.0.1:1/api/health", "cmd": ["prefect"], "log": "prefect.log",
             "started": "2026-01-01T00:00:00+00:00", "proc_start": None, "info": {}},
            {"name": "mlflow", "label": "MLflow UI", "pid": stranger.pid, "port": 2, "url": "http://127.0.0.1:2",
             "health": "http://127.0.0.1:2/health", "cmd": ["mlflow"], "log": "mlflow.log",
             "started": "2026-01-01T00:00:00+00:00", "proc_start": "1", "info": {}},
        ]
        state = root / ".faceops" / "stack" / "stack.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"services": services}))
        status = _stack(["status"], root)
        assert status.returncode == 3 and "stopped" in status.stdout
        out = _stack(["down"], root)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"pid {gone.pid} was already gone" in out.stdout
        assert f"pid {stranger.pid} was already gone (another program has that PID now" in out.stdout
        assert stranger.poll() is None, "down killed a process the stack did not start"
        assert not state.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_stack_outside_a_project_says_where_to_run_it(tmp_path):
    out = _stack(["status"], tmp_path)
    assert out.returncode == 2 and "no dvc.yaml" in out.stderr and "repository root" in out.stderr


def test_services_lists_each_compose_service_with_what_runs_for_it_here(tmp_path):
    """`faceops stack services`: every service of infra/docker-compose.yml, the local command of those whose command
    runs here (loopback, one MLflow web worker) and the flags left out with their reasons."""
    import yaml

    out = _stack(["services"], _project(tmp_path))
    assert out.returncode == 0, out.stderr
    compose = Path(__file__).resolve().parents[2] / "infra" / "docker-compose.yml"
    names = yaml.safe_load(compose.read_text())["services"]
    listed = [line.split()[0] for line in out.stdout.splitlines() if line and not line.startswith((" ", "left"))]
    assert listed == list(names), out.stdout
    assert "$ python -m mlflow server --host 127.0.0.1 --port 5000 --workers 1" in out.stdout
    assert "$ python -m prefect worker start --pool gpu --type process --name gpu-worker" in out.stdout
    assert "--limit: " in out.stdout and "--with-healthcheck: " in out.stdout


# ── one MLflow store: what `make run` logged is in the stack's UI, and `faceops promote` sees it ──

LOG_LIKE_MAKE_RUN = """
from pathlib import Path
import mlflow
from mlflow import MlflowClient
from ops import run_store, tracking

root = Path.cwd()
run_store.configure(root)  # what `faceops run` does: no MLFLOW_TRACKING_URI, the repository's mlflow.db
with mlflow.start_run(run_name="pipeline") as parent:
    mlflow.log_metric("pipeline/wall_seconds", 470.0)
    with mlflow.start_run(run_name="train_fr@real", nested=True) as stage:
        mlflow.log_metric("train/accuracy", 0.77, step=27)
        mlflow.log_text("from make run", "notes/hello.txt")
client = MlflowClient()
client.create_registered_model("faceops-fr")
for alias in ("previous", "champion"):
    version = client.create_model_version("faceops-fr", f"runs:/{stage.info.run_id}/notes", run_id=stage.info.run_id)
    client.set_registered_model_alias("faceops-fr", alias, version.version)
print(parent.info.run_id, stage.info.run_id)
"""


@contextlib.contextmanager
def stack_over_logged_runs(root):
    """In project ``root``: runs, an artifact and registered versions logged into its mlflow.db as `make run` logs
    them (the repository's store, no server), then `faceops stack up` (no --s3) there; stopped on exit.
    → (MLflow URL, the pipeline run's id, the stage run's id, what `up` printed)."""
    logged = subprocess.run([sys.executable, "-c", LOG_LIKE_MAKE_RUN], cwd=root, env=ENV, capture_output=True,
                            text=True, timeout=300)
    assert logged.returncode == 0, logged.stderr[-3000:]
    parent_id, stage_id = logged.stdout.split()[-2:]
    prefect_port, mlflow_port = _ports(2)
    out = _stack(["up", "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)], root)
    record = root / ".faceops/stack/stack.json"
    pids = [s["pid"] for s in _record(root).values()] if record.is_file() else []
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        yield f"http://127.0.0.1:{mlflow_port}", parent_id, stage_id, out.stdout
    finally:
        _stack(["down"], root)
        _kill_left_over(pids)


@pytest.fixture(scope="module")
def project_with_runs(tmp_path_factory):
    """``stack_over_logged_runs`` in a copy of the project → (root, URL, pipeline run id, stage run id, output)."""
    from tests.conftest import copy_project

    root = copy_project(tmp_path_factory.mktemp("one-store"))
    with stack_over_logged_runs(root) as (url, parent_id, stage_id, stdout):
        yield root, url, parent_id, stage_id, stdout


def test_the_stacks_mlflow_shows_the_runs_make_run_logged(project_with_runs):
    from mlflow import MlflowClient

    root, url, parent_id, stage_id, stdout = project_with_runs
    assert f"store {root / 'mlflow.db'}" in stdout or "store mlflow.db" in stdout
    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name("faceops")
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    assert {parent_id, stage_id} <= set(runs)
    # the address of its runs table in the model-training view (tests/browser/test_mlflow_ui.py opens it)
    assert f"MLflow runs {url}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning" in stdout
    assert runs[stage_id].data.tags["mlflow.parentRunId"] == parent_id
    assert [m.value for m in client.get_metric_history(stage_id, "train/accuracy")] == [0.77]
    # the artifact as the UI fetches it: through the server, from the file store `make run` wrote
    assert _get(f"{url}/get-artifact?path=notes/hello.txt&run_uuid={stage_id}") == (200, "from make run")
    assert {m.name for m in client.search_registered_models()} == {"faceops-fr"}


def test_runs_logged_through_the_stack_land_in_the_repositorys_store(project_with_runs):
    """A new experiment made through the server keeps its artifacts in mlruns/, so the run stays whole and
    readable without the server."""
    from mlflow import MlflowClient

    root, url, _, _, _ = project_with_runs
    client_env = {**ENV, "MLFLOW_TRACKING_URI": url}
    logged = subprocess.run(
        [sys.executable, "-c", "import mlflow\nmlflow.set_experiment('through-the-stack')\n"
         "with mlflow.start_run() as run:\n    mlflow.log_text('via the server', 'notes/via.txt')\n"
         "print(run.info.run_id)"], env=client_env, capture_output=True, text=True, timeout=180)
    assert logged.returncode == 0, logged.stderr[-3000:]
    run_id = logged.stdout.split()[-1]
    direct = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")  # no server: what `make run` sees
    run = direct.get_run(run_id)
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(root / "mlruns")
    assert (Path(run.info.artifact_uri.removeprefix("file://")) / "notes/via.txt").read_text() == "via the server"


def test_promote_with_the_stacks_env_acts_on_the_same_registry(project_with_runs):
    root, url, _, _, _ = project_with_runs
    exported = subprocess.run(FACEOPS[:-1] + ["stack", "env"], cwd=root, env=ENV, capture_output=True, text=True)
    assert exported.returncode == 0, exported.stderr
    env = dict(ENV)
    for line in exported.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.split("   #")[0]
    assert env["MLFLOW_TRACKING_URI"] == url
    out = subprocess.run(FACEOPS[:-1] + ["promote", "fr", "--rollback", "--dry-run"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    said = out.stdout + out.stderr
    # v2 is @champion and v1 @previous in the store `make run` wrote: the plan names them, not an empty registry
    assert out.returncode == 0, said[-3000:]
    assert "not in the MLflow registry" not in said and "v1" in said and "v2" in said, said[-3000:]

