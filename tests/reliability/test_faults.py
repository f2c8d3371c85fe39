"""Fault injection against real servers on loopback: S3 faults under the `faceops data` commands, an MLflow server
that goes away in the middle of a training stage's tracking, and a Prefect process worker killed mid-task.

Already proven elsewhere and not repeated here: tests/stages/test_storage.py (a corrupt object never replaces a local
file; an unreachable endpoint fails fast), tests/stages/test_tracking_relay.py (a journal written while MLflow is
unreachable from the start is kept and replays). What is added: S3 faults under `faceops data` (retried by the AWS
SDK under DVC; beyond storage.max_attempts, exit 1, one message, the workspace as it was), the server lost *during*
a stage, and the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import QUIET, FaultProxy, mlflow_server, prefect_server, prefect_worker
from tests.stages.test_storage import (BUCKET, SECRET, contents, faceops, forget_local, project,  # noqa: F401  (s3: a fixture)
                                s3)

from .report_faults import prepared_workspace, record

REPO = Path(__file__).resolve().parents[2]
AREA = "Fault injection"


# ── S3 ───────────────────────────────────────────────────────────────────────────────────────────────────────────


def test_throttling_server_errors_and_dropped_connections_are_retried(s3, tmp_path):
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"], ["slowdown", "500", "drop", "slowdown"])
    with proxy.serve() as url:
        root = project(tmp_path / "ws", prefix="faults", endpoint_url=url, max_attempts=5)
        before = contents(root / "data/prepared")
        push = faceops(["data", "push", "-v"], root)
        push_faults = [f for _, _, f in proxy.served if f != "forwarded"]
        forget_local(root)
        proxy.faults = ["drop", "500", "slowdown"]
        pull = faceops(["data", "pull"], root)
    assert push.returncode == 0, push.stderr[-3000:]
    assert push_faults == ["slowdown", "500", "drop", "slowdown"]  # every fault really reached the client
    assert pull.returncode == 0, pull.stderr[-3000:]
    assert sum(f != "forwarded" for _, _, f in proxy.served) == 7
    assert contents(root / "data/prepared") == before
    record(AREA, "S3 SlowDown/503, 500 and dropped connections under `faceops data push` and `pull`",
           "4 faults on push, 3 on pull: the AWS SDK under DVC retried each (storage.max_attempts); both commands "
           "exit 0 and the pulled data are byte-identical", True, faults_injected=7)


def test_more_failures_than_attempts_stop_with_one_message_and_the_workspace_as_it_was(s3, tmp_path):
    root = project(tmp_path / "ws", prefix="giveup")
    assert faceops(["data", "push"], root).returncode == 0
    before = contents(root / "data/prepared")
    shutil.rmtree(root / ".dvc/cache")
    (root / "models/fr/model.safetensors").write_bytes(b"a local edit")
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"], ["500", "drop"] * 200)
    with proxy.serve() as url:
        params = json.loads((root / "params.yaml").read_text())
        params["storage"].update(endpoint_url=url, max_attempts=2)
        (root / "params.yaml").write_text(json.dumps(params))
        start = time.monotonic()
        out = faceops(["data", "pull", "models/fr"], root)
        seconds = time.monotonic() - start
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1, out.stdout + out.stderr
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert url in errors[0] and f"s3://{BUCKET}/giveup/dvc" in errors[0] and "storage.max_attempts" in errors[0]
    assert SECRET not in out.stdout + out.stderr and seconds < 120
    assert (root / "models/fr/model.safetensors").read_bytes() == b"a local edit"  # nothing half-written over it
    assert contents(root / "data/prepared") == before
    record(AREA, "S3 pull failing throughout (500s and drops beyond storage.max_attempts=2)",
           "exit 1 with one line naming the remote, the endpoint and storage.max_attempts; the locally edited file and "
           "the other outputs untouched", True, seconds=round(seconds, 1))


# ── MLflow gone mid-run ──────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.slow
def test_mlflow_server_lost_mid_stage_keeps_the_result_and_the_journal_replays(tmp_path_factory, tmp_path, monkeypatch):
    """train_fr@real under the flow's relay (`faceops run`'s path) against an MLflow server behind a proxy; once the
    relay has opened the stage's run, the proxy drops every connection and the server is stopped. The stage finishes
    and its model and metrics are on disk; the relay reports the error and keeps the journal; a new server on the same
    store accepts the replay: one FINISHED run with every metric and the registered model."""
    from mlflow import MlflowClient

    from ops import tracking

    root = prepared_workspace(tmp_path_factory, tmp_path / "ws", {"fr.epochs": 3})
    store = tmp_path / "mlflow"
    store.mkdir()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # the client's default backoff takes minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with contextlib.ExitStack() as server:
        first = server.enter_context(mlflow_server(store))
        proxy = FaultProxy(first["MLFLOW_TRACKING_URI"], [])
        with proxy.serve() as url:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
            with tracking.StageRelay(root) as relay:
                env = {**os.environ, **relay.env, "PYTHONPATH": str(REPO)}
                proc = subprocess.Popen([sys.executable, "-m", "tasks.train_fr", "real"], cwd=root, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                deadline = time.monotonic() + 240
                while not relay.run_ids and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                lost_at = time.monotonic()
                proxy.faults = ["drop"] * 100_000  # from now on every request finds no server ...
                server.close()  # ... and the server process really stops
                output = proc.communicate(timeout=300)[0]
            relay_s = time.monotonic() - lost_at
    assert relay.run_ids, "the relay never opened the stage's run; output:\n" + output[-3000:]
    assert proc.returncode == 0, output[-3000:]  # the stage is not held hostage by the tracking server
    model = root / "models/fr/real"
    assert (model / "model.safetensors").stat().st_size > 0 and (model / "config.json").is_file()
    metrics = json.loads((root / "metrics/train_fr_real.json").read_text())
    assert relay.error is not None and relay.path.is_file()  # reported, and the journal kept
    journal = [json.loads(l)["op"] for l in relay.path.read_text().splitlines()]
    assert journal[0] == "start" and journal[-1] == "end" and "log_model_dir" in journal

    with mlflow_server(store) as back:  # the server returns, on the same store
        monkeypatch.setenv("MLFLOW_TRACKING_URI", back["MLFLOW_TRACKING_URI"])
        start = time.monotonic()
        replayed = tracking.StageRelay.replay(relay.path, root)
        replay_s = time.monotonic() - start
        client = MlflowClient(back["MLFLOW_TRACKING_URI"])
        run = client.get_run(replayed.run_ids[0])
        partial = client.get_run(relay.run_ids[0])
        history = client.get_metric_history(run.info.run_id, "train/loss")
        versions = client.search_model_versions("name = 'faceops-fr'")
    assert not relay.path.exists()
    assert run.info.status == "FINISHED" and run.data.tags["dvc.stage"] == "train_fr@real"
    assert run.data.params["fr.epochs"] == "3" and len(history) >= 3
    logged = {k: v for k, v in run.data.metrics.items() if k.startswith("train/")}
    assert logged and all(isinstance(v, float) for v in logged.values())
    assert [v.run_id for v in versions] == [run.info.run_id]  # the model is registered once, from the replay
    assert partial.info.status != "FINISHED"  # the half-relayed run does not pass for a complete one
    record(AREA, "MLflow server lost in the middle of train_fr@real (relayed tracking)",
           f"stage exit 0, model + metrics/train_fr_real.json on disk (train/accuracy "
           f"{metrics.get('train/accuracy', '?')}); relay error reported, journal of {len(journal)} entries kept; "
           f"after the server returned the replay made one FINISHED run with {len(history)} loss points and "
           f"faceops-fr v{versions[0].version}; the half-relayed run stays {partial.info.status}", True,
           relay_gave_up_s=relay_s, replay_s=replay_s)


# ── Prefect worker killed ────────────────────────────────────────────────────────────────────────────────────────

TOY_FLOW = '''
import os, time
from pathlib import Path
from prefect import flow, task


@task
def work(marker: str) -> str:
    """Say it started, then wait for the test's go-ahead (or for ever)."""
    Path(marker).write_text(str(os.getpid()))
    go = Path(marker + ".go")
    while not go.exists():
        time.sleep(0.2)
    Path(marker + ".done").write_text("done")
    return "done"


@flow(name="toy-work")
def toy(marker: str) -> str:
    return work(marker)
'''


def _wait_for(path: Path, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {seconds:.0f} s; worker log:\n"
                                 + log.read_text(errors="replace")[-3000:])
        time.sleep(0.2)


def _worker_pid(pool: str) -> int:
    """The PID of the `prefect worker start --pool POOL` process (from /proc: ps may cut long command lines)."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in args and b"--pool" in args and pool.encode() in args:
            return int(proc.name)
    raise AssertionError(f"no `prefect worker start --pool {pool}` process found")


@pytest.mark.slow
def test_killed_worker_never_leaves_a_flow_run_silently_completed(tmp_path):
    """Two flow runs of one deployment on one process worker, both mid-task; the worker is SIGKILLed with its whole
    process group. Run A's own process outlives it (Prefect gives each flow run its own session) and is told to go
    on: it may finish or be torn down with its worker, and its final state says which (Completed only with the
    task's output on disk). Run B's process is killed too, as when the machine is lost: with flows/heartbeats.py's
    automation installed it is marked Crashed, never Completed."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    from flows.heartbeats import HEARTBEAT_ENV, ensure_crash_detection

    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_flow.py").write_text(TOY_FLOW)
    within = 45.0  # > the 30 s heartbeat below, Prefect's smallest
    with prefect_server(tmp_path / "prefect") as server:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name="kill", type="process",
                                                       base_job_template=ProcessWorker.get_default_base_job_template()))
            ensure_crash_detection(within)
            flow.from_source(source=str(src), entrypoint="toy_flow.py:toy").deploy(
                name="toy", work_pool_name="kill", print_next_steps=False)
            markers = {k: tmp_path / f"run-{k}" for k in "ab"}
            runs = {k: run_deployment("toy-work/toy", parameters={"marker": str(m)}, timeout=0)
                    for k, m in markers.items()}
            env = {**os.environ, **QUIET, **server, "PREFECT_WORKER_QUERY_SECONDS": "1", HEARTBEAT_ENV: "30"}
            with prefect_worker("kill", env, tmp_path) as log:
                for k, m in markers.items():
                    _wait_for(m, 240, f"run {k}'s task start", log)
                worker = _worker_pid("kill")
                os.killpg(os.getpgid(worker), signal.SIGKILL)
                task_pids = {k: int(m.read_text()) for k, m in markers.items()}
                os.killpg(os.getpgid(task_pids["b"]), signal.SIGKILL)  # run B: the machine is lost
                killed = time.monotonic()
                Path(str(markers["a"]) + ".go").write_text("go")  # run A: its process carries on
                states, seen = {}, {}
                with get_client(sync_client=True) as client:
                    deadline = killed + within + 120
                    while len(states) < 2 and time.monotonic() < deadline:
                        for k, r in runs.items():
                            state = client.read_flow_run(r.id).state
                            seen[k] = state.name
                            if k not in states and state.is_final():
                                states[k] = (state, time.monotonic() - killed)
                        time.sleep(1.0)
    for pid in task_pids.values():  # nothing of ours left running
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert set(states) == {"a", "b"}, f"states after {within + 120:.0f} s: {seen}"
    a, a_s = states["a"]
    b, b_s = states["b"]
    a_done = Path(str(markers["a"]) + ".done").is_file()
    # run A may finish or be torn down with its lost worker; either way its state says so, and Completed only if done
    assert a.is_crashed() or a.is_failed() or (a.is_completed() and a_done), (a.name, a.message, a_done)
    assert b.is_crashed() and "heartbeat" in (b.message or ""), (b.name, b.message)
    assert not Path(str(markers["b"]) + ".done").exists()
    record(AREA, "Prefect process worker SIGKILLed (with its process group) while two flow runs are mid-task",
           f"run A (its process outlived the worker and was told to go on): {a.name} after {a_s:.0f} s "
           f"('{a.message}'; task output {'on disk' if a_done else 'absent'}); "
           f"run B (its process killed too, machine lost): {b.name} by the heartbeat automation, "
           f"message '{b.message}'", True, crashed_after_s=b_s, heartbeat_s=30, within_s=within)
