"""The local recipe for deployments, driven as a user drives it: `faceops stack up --workers` in a repository (a
throw-away copy: a git repository with one commit), then a flow run of `pipeline-nightly` with `preset: smoke`
created through the API exactly as the Prefect UI's Quick/Custom run creates it, which must complete on the stack's
own workers — the `cpu` worker runs the DAG in a fresh clone and sends the GPU stages to the `gpu` worker, the two
exchanging data through the stack's local DVC remote — and log to the stack's MLflow, that is, the repository's
`mlflow.db`. The smoke models are registered without `@candidate`. Whatever the test started is stopped at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faceops.processes import free_port, pid_alive

from tests.conftest import copy_project

pytestmark = pytest.mark.slow
FACEOPS = [sys.executable, "-m", "faceops.cli"]
RUN_TIMEOUT = 780  # s; the smoke DAG up to synthesize, its GPU stages dispatched, takes ~3 min on 2 busy cores


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "FACEOPS_GIT_URL", "FACEOPS_GPU_DEPLOYMENT")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env["PREFECT_WORKER_QUERY_SECONDS"] = "2"  # the workers pick a run up within 2 s instead of 10
    return env


@pytest.fixture(scope="module")
def stack_with_workers(tmp_path_factory):
    root = copy_project(tmp_path_factory.mktemp("recipe"))
    ports = sorted({free_port() for _ in range(4)})[:2]
    env = _env()
    up = subprocess.run([*FACEOPS, "stack", "up", "--workers", "--prefect-port", str(ports[0]), "--mlflow-port",
                         str(ports[1])], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    record = root / ".faceops" / "stack" / "stack.json"
    pids = [s["pid"] for s in json.loads(record.read_text())["services"]] if record.is_file() else []
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:] + _logs(root)
        yield root, ports, env, up.stdout
    finally:
        subprocess.run([*FACEOPS, "stack", "down"], cwd=root, env=env, capture_output=True, timeout=120)
        for pid in pids:
            if pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _logs(root: Path) -> str:
    return "\n".join(f"── {log.name}\n{log.read_text(errors='replace')[-3000:]}"
                     for log in sorted((root / ".faceops" / "stack").glob("*.log")))


@pytest.mark.timeout(RUN_TIMEOUT + 300)  # the stack's start-up (~45 s) comes on top of the run
def test_quick_run_of_the_nightly_pipeline_at_smoke_size_completes_on_the_stacks_workers(stack_with_workers):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root, (prefect_port, mlflow_port), env, stdout = stack_with_workers
    assert "worker cpu" in stdout and "worker gpu" in stdout and "pipeline-nightly" in stdout
    status = subprocess.run([*FACEOPS, "stack", "status"], cwd=root, env=env, capture_output=True, text=True)
    assert status.returncode == 0 and "worker-cpu" in status.stdout and "worker-gpu" in status.stdout, status.stdout
    api = f"http://127.0.0.1:{prefect_port}/api"
    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("pipeline/pipeline-nightly")
        assert deployment.work_pool_name == "cpu" and deployment.paused  # no run at 02:00 on a laptop
        # what the run form shows beside each field
        properties = deployment.parameter_openapi_schema["properties"]
        assert "presets.yaml" in properties["preset"]["description"]
        assert "@candidate" in properties["register_candidates"]["description"]
        # the UI's run button: a flow run of the deployment with its parameters, the preset filled in
        # up to `synthesize`: the stages on both pools and the DVC remote between them, without the DAG's tail
        # (discovery, fusion, the FR arms, evaluate), which tests/stages/test_pipeline.py runs
        run = client.create_flow_run_from_deployment(deployment.id, parameters={**deployment.parameters,
                                                                                "preset": "smoke",
                                                                                "stages": ["synthesize"]})
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (run := client.read_flow_run(run.id)).state.is_final():
            assert time.monotonic() < deadline, f"still {run.state.name} after {RUN_TIMEOUT} s\n{_logs(root)}"
            time.sleep(5)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{_logs(root)}"
        flows = {f.id: f.name for f in client.read_flows()}
        runs = client.read_flow_runs()
    stage_runs = [r for r in runs if flows[r.flow_id] == "stage"]
    assert stage_runs and all(r.state.is_completed() and r.work_pool_name == "gpu" for r in stage_runs)
    assert {r.name for r in stage_runs} >= {"train_fr@real", "train_generator", "synthesize"}
    (dag,) = [r for r in runs if flows[r.flow_id] == "faceops-pipeline"]
    assert dag.state.is_completed()
    # the two pools exchanged data through the stack's DVC remote
    assert any((root / ".faceops" / "stack" / "dvc-remote" / "files" / "md5").rglob("*"))
    # the runs are in the repository's own store, served by the stack's MLflow
    assert (root / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_port}")
    experiment = client.get_experiment_by_name("faceops")
    names = {r.info.run_name for r in client.search_runs([experiment.experiment_id])}
    assert {"pipeline preset:smoke", "prepare", "train_fr@real", "synthesize"} <= names  # the DAG named by its config
    assert "evaluate" not in names  # only what `synthesize` needs ran
    # toy models are registered, but @candidate is not moved to them unless asked
    model = client.get_registered_model("faceops-fr")
    assert not model.aliases, model.aliases
    versions = client.search_model_versions("name = 'faceops-fr'")
    assert versions and all(v.tags.get("faceops.alias_withheld", "").startswith("candidate") for v in versions)


def test_prefect_deploy_says_when_faceops_git_url_is_missing(stack_with_workers):
    root, (prefect_port, _), env, _ = stack_with_workers
    deploy = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--name", "promote"], cwd=root,
                            env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api"},
                            capture_output=True, text=True, timeout=300)
    said = deploy.stdout + deploy.stderr
    assert "FACEOPS_GIT_URL is not set" in said and "each worker must have FACEOPS_GIT_URL" in said, said[-3000:]
