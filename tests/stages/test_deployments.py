"""Prefect deployments: prefect.yaml, GPU routing and the per-area flows, against a real Prefect server on loopback.

The end-to-end test deploys the `train` and `stage-gpu` deployments of prefect.yaml with `prefect deploy` from a
copy of the project (a git repository with a DVC remote in a folder), starts one worker for each of the `process`
work pools `cpu` and `gpu`, and triggers `train` for `train_fr@real` at the smoke preset: the `cpu` worker clones
the repository and runs prepare and validate; `train_fr@real` is a GPU stage, so it runs as a `stage` flow run on
the `gpu` worker, in a clone of its own, exchanging data with the other only through the DVC remote.
"""

from __future__ import annotations

import ast
import base64
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from flows import routing
from flows.pipeline import benchmark_markdown
from flows.routing import apply_params
from flows.stages import mlflow_run_link
from ml.errors import ConfigError

from tests.conftest import copy_project
from tests.servers import QUIET, prefect_server, prefect_worker

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PREFECT_YAML = yaml.safe_load((REPO / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in PREFECT_YAML["deployments"]}


# ── prefect.yaml ──


def _flow_function(path: Path, name: str) -> ast.FunctionDef | None:
    """The function ``name`` in ``path`` if a ``@flow(...)`` decorates it (read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(target, ast.Name) and target.id == "flow":
                    return node
    return None


@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_deployment_names_a_pool_and_a_flow_that_takes_its_parameters(name):
    deployment = DEPLOYMENTS[name]
    assert deployment["work_pool"]["name"] in ("cpu", "gpu"), name
    file, _, function = deployment["entrypoint"].partition(":")
    if not (REPO / file).is_file():
        pytest.skip(f"{file} is not in this tree yet (written with another part of the project)")
    node = _flow_function(REPO / file, function)
    assert node is not None, f"{name}: {deployment['entrypoint']} is not a @flow function"
    args = node.args.args + node.args.kwonlyargs
    accepted = {a.arg for a in args}
    given = set(deployment.get("parameters") or {})
    assert given <= accepted, f"{name}: parameters {given - accepted} are not arguments of {function}"
    if deployment.get("schedules"):  # a scheduled run has nobody to fill in a required argument
        defaults = len(node.args.defaults)
        required = {a.arg for a in node.args.args[: len(node.args.args) - defaults]}
        required |= {a.arg for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is None}
        assert required <= given, f"{name}: scheduled without a value for {required - given}"


def test_schedules_pull_steps_and_gpu_routing_fit_together():
    from prefect.client.schemas.schedules import CronSchedule

    for deployment in DEPLOYMENTS.values():
        for schedule in deployment.get("schedules") or []:
            CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])  # raises on a bad cron or zone
    nightly, weekly = DEPLOYMENTS["pipeline-nightly"]["schedules"][0], DEPLOYMENTS["sweep-weekly"]["schedules"][0]
    assert nightly["cron"].split()[2:] == ["*", "*", "*"] and weekly["cron"].split()[4] != "*"  # daily, weekly
    assert int(DEPLOYMENTS["promote"]["schedules"][0]["cron"].split()[1]) > int(nightly["cron"].split()[1])
    steps = [next(iter(step)) for step in PREFECT_YAML["pull"]]
    assert steps == ["prefect.deployments.steps.git_clone", "prefect.deployments.steps.set_working_directory"]
    # every deployment on pool cpu sends GPU stages to a deployment of the `stage` flow on pool gpu
    for name, deployment in DEPLOYMENTS.items():
        if deployment["work_pool"]["name"] == "cpu":
            target = deployment["work_pool"]["job_variables"]["env"][routing.ENV_GPU_DEPLOYMENT]
            flow_name, _, gpu_name = target.partition("/")
            assert flow_name == routing.run_stage_remote.name == routing.STAGE_FLOW, name
            assert DEPLOYMENTS[gpu_name]["work_pool"]["name"] == "gpu", name
            assert DEPLOYMENTS[gpu_name]["entrypoint"] == "flows/routing.py:run_stage_remote", name


# ── routing, links, params deltas, the benchmark artifact ──


def test_gpu_stages_are_the_trainings_and_synthesis():
    for stage in ("train_aligner", "train_generator", "train_fr@real", "train_fr@synthetic", "synthesize",
                  "train_fusion", "train_discovery"):
        assert routing.is_gpu_stage(stage), stage
    for stage in ("prepare", "validate", "align", "evaluate"):
        assert not routing.is_gpu_stage(stage), stage


def test_gpu_stages_are_dispatched_only_when_a_gpu_deployment_is_configured(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv(routing.ENV_GPU_DEPLOYMENT, raising=False)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        assert routing.gpu_deployment() is None and routing.dispatch_target("train_fr@real") is None
        monkeypatch.setenv(routing.ENV_GPU_DEPLOYMENT, "stage/stage-gpu")
        assert routing.dispatch_target("train_fr@real") == "stage/stage-gpu"
        assert routing.dispatch_target("prepare") is None  # CPU stages stay in-process
        monkeypatch.setenv(routing.ENV_GPU_DEPLOYMENT, "stage-gpu")
        with pytest.raises(ConfigError, match="FACEOPS_GPU_DEPLOYMENT='stage-gpu': expected FLOW/DEPLOYMENT"):
            routing.dispatch_target("train_fr@real")
    monkeypatch.setenv(routing.ENV_GPU_DEPLOYMENT, "stage/stage-gpu")
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        with pytest.raises(ConfigError, match="PREFECT_API_URL"):
            routing.gpu_deployment()


def test_area_flows_run_their_stages_and_refuse_stages_of_another_area():
    from flows.areas import area_stages

    dag = ["prepare", "validate", "train_aligner", "align", "train_fr@real", "train_discovery", "train_fusion",
           "train_generator", "synthesize", "train_fr@synthetic", "evaluate"]
    assert area_stages("synthesize", dag) == ["train_generator", "synthesize"]
    assert area_stages("train", dag) == ["train_aligner", "train_fr@real", "train_discovery", "train_fusion",
                                         "train_generator", "train_fr@synthetic"]
    assert area_stages("train", dag, ["train_fr@synthetic", "train_fr@real"]) == ["train_fr@real", "train_fr@synthetic"]
    with pytest.raises(ConfigError, match="stage.s. evaluate not in the 'train' flow; its stages: train_aligner"):
        area_stages("train", dag, ["evaluate"])


def test_mlflow_links_name_the_run_and_never_a_password():
    assert mlflow_run_link("http://alice:s3cret@127.0.0.1:5000/", "0a1b") == "http://127.0.0.1:5000/#/runs/0a1b"
    note = mlflow_run_link("sqlite:////data/faceops/mlflow.db", "0a1b")
    assert "mlflow ui --backend-store-uri sqlite:////data/faceops/mlflow.db" in note and "#/runs/0a1b" in note


def test_benchmark_artifact_keeps_the_models_and_verification_tables():
    report = "\n".join([
        "# faceops benchmark", "", "Generated by the `evaluate` stage on 2026-11-21 18:17 UTC.", "",
        "## Models", "", "| model | backbone |", "|---|---|", "| `real` | `vit_tiny` |", "",
        "## Verification (10-fold accuracy)", "", "| embedding | `procedural.bin` |", "|---|---|",
        "| FR model `real` | 87.47 ± 2.17 % |", "",
        "## Notes", "", "No table here.", "",
        "## Templates", "", "| model | TAR@far=1e-4 |", "|---|---|", "| `real` | 13.33 % |", "",
    ])
    markdown = benchmark_markdown(report)
    assert markdown.startswith("# faceops benchmark") and "2026-11-21 18:17 UTC" in markdown
    assert "| `real` | `vit_tiny` |" in markdown and "87.47 ± 2.17 %" in markdown
    assert "13.33 %" not in markdown and "_2 more section(s) in `reports/benchmark.md`._" in markdown


def test_params_delta_from_head_rebuilds_the_working_copy_params_in_a_clone(tmp_path):
    from tasks.params import apply_delta

    ws = copy_project(tmp_path / "ws")
    faces = tmp_path / "my faces"  # a path with a space; it must exist: apply_delta checks input paths
    faces.mkdir()
    apply_delta(ws / "params.yaml", {"fr.lr": 0.0003, "fr.epochs": 3, "fr.augment_recipe": "kprpe",
                                     "evaluate.fars": [0.01, 0.1], "data.ingest_folder": str(faces),
                                     "data.procedural.blur_prob": 0.5})
    wanted = yaml.safe_load((ws / "params.yaml").read_text())
    delta = routing.params_delta_from_head(ws)
    assert set(delta) == {"fr.lr", "fr.epochs", "fr.augment_recipe", "evaluate.fars", "data.ingest_folder",
                          "data.procedural.blur_prob"}
    assert all(isinstance(v, str) for v in delta.values())  # the stage flow's params_delta: dict[str, str]
    subprocess.run(["git", "checkout", "--", "params.yaml"], cwd=ws, check=True)  # what a fresh clone has
    apply_params(ws, None, delta, logging.getLogger(__name__))
    assert yaml.safe_load((ws / "params.yaml").read_text()) == wanted


# the flows of these deployments are owned elsewhere and have no `Args:` section in their docstrings yet
@pytest.mark.parametrize("name", list(DEPLOYMENTS))
def test_every_parameter_of_the_run_form_has_a_description(name):
    """Prefect shows a flow's docstring `Args:` beside each field of a deployment's run form."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.importtools import import_object

    flow = import_object(DEPLOYMENTS[name]["entrypoint"])
    properties = parameter_schema(flow.fn).model_dump()["properties"]
    undescribed = [key for key, field in properties.items() if not (field.get("description") or "").strip()]
    assert not undescribed, f"{name}: no description for {undescribed}"


def _no_dvc_remote_anywhere(tmp_path: Path, monkeypatch) -> Path:
    for key in ("DVC_GLOBAL_CONFIG_DIR", "DVC_SYSTEM_CONFIG_DIR"):  # no default remote from this machine's config
        monkeypatch.setenv(key, str(tmp_path / key))
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=repo, check=True)
    return repo


def test_a_missing_dvc_remote_names_the_setting_that_needs_it(tmp_path, monkeypatch):
    """A run on pool cpu needs the remote because of FACEOPS_PUBLISH_OUTPUTS=1 (which the pool sets), so the hint
    must not send the user to unset FACEOPS_GPU_DEPLOYMENT, which would not help."""
    repo = _no_dvc_remote_anywhere(tmp_path, monkeypatch)
    monkeypatch.setenv(routing.ENV_GPU_DEPLOYMENT, "stage/stage-gpu")
    monkeypatch.setenv(routing.ENV_PUBLISH, "1")
    with pytest.raises(ConfigError) as publishing:
        routing.require_remote(repo)
    message = str(publishing.value)
    assert "FACEOPS_PUBLISH_OUTPUTS=1" in message and "work pool `cpu`" in message
    assert "unset FACEOPS_GPU_DEPLOYMENT" not in message
    assert "dvc remote add -d" in message and "faceops stack up --workers" in message
    monkeypatch.delenv(routing.ENV_PUBLISH)
    with pytest.raises(ConfigError, match="FACEOPS_GPU_DEPLOYMENT is set.*unset FACEOPS_GPU_DEPLOYMENT"):
        routing.require_remote(repo)


def test_deploying_without_faceops_git_url_says_so(monkeypatch, capsys):
    """The build step of prefect.yaml runs at `prefect deploy` time."""
    assert {"flows.routing.check_git_url": {}} in PREFECT_YAML["build"]
    monkeypatch.delenv(routing.ENV_GIT_URL, raising=False)
    assert routing.check_git_url() == {"git_url": ""}
    said = capsys.readouterr().err
    assert "FACEOPS_GIT_URL is not set" in said and "each worker must have FACEOPS_GIT_URL" in said
    monkeypatch.setenv(routing.ENV_GIT_URL, "https://git.example.org/faceops.git")
    assert routing.check_git_url() == {"git_url": "https://git.example.org/faceops.git"}
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("register", "preset", "moved"), [(None, "smoke", False), (None, None, True),
                                                            (True, "smoke", True)])
def test_a_smoke_run_registers_its_models_without_candidate_unless_asked(tmp_path, monkeypatch, register, preset,
                                                                         moved):
    """The real registration path (StageTracker, a SQLite store) under the flows' switch: a toy model becomes a
    version tagged `faceops.alias_withheld`, and `@candidate` stays on the version it was on."""
    import mlflow
    from mlflow import MlflowClient

    from flows.areas import TOY_PRESETS
    from ops import run_store, tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    run_store.configure(tmp_path)
    with mlflow.start_run() as run:
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        tracker = tracking.StageTracker(run.info.run_id, tmp_path)
        first = tracker.register_model_dir("faceops-fusion", model_dir=tmp_path / "model")  # a real candidate
        move = register if register is not None else preset not in TOY_PRESETS
        with routing.moving_aliases(move):
            second = tracker.register_model_dir("faceops-fusion", model_dir=tmp_path / "model")
    assert tracking.ENV_MOVE_ALIASES not in os.environ  # restored
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("faceops-fusion", "candidate").version) == (second if moved else first)
    tags = client.get_model_version("faceops-fusion", second).tags
    assert ("faceops.alias_withheld" in tags) is not moved


# ── against a real Prefect server, with a worker per work pool ──


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Prefect server, work pools `cpu` and `gpu` (type process) with one worker each, and `train` and
    `stage-gpu` deployed from prefect.yaml in ``origin``: a git repository whose default DVC remote is a folder."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    tmp = tmp_path_factory.mktemp("deployments")
    (tmp / "origin").mkdir()
    origin = copy_project(tmp / "origin")
    remote = tmp / "dvc-remote"
    env = {**os.environ, **QUIET, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop(routing.ENV_GPU_DEPLOYMENT, None)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-d", "shared", str(remote)], cwd=origin, env=env,
                   check=True, capture_output=True)
    subprocess.run(["git", "commit", "-qam", "DVC remote shared by the work pools", "--no-verify"], cwd=origin,
                   check=True, env={**env, "GIT_AUTHOR_NAME": "faceops", "GIT_AUTHOR_EMAIL": "faceops@localhost",
                                    "GIT_COMMITTER_NAME": "faceops", "GIT_COMMITTER_EMAIL": "faceops@localhost"})
    with prefect_server(tmp / "prefect") as server_env:
        env.update(server_env)

        def api():
            return temporary_settings(updates={PREFECT_API_URL: server_env["PREFECT_API_URL"]})

        with api(), get_client(sync_client=True) as client:
            template = ProcessWorker.get_default_base_job_template()
            for pool in ("cpu", "gpu"):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        out = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "train", "--name",
                              "stage-gpu"], cwd=origin, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        workers = {**env, "FACEOPS_GIT_URL": str(origin), "PREFECT_WORKER_QUERY_SECONDS": "1",
                   "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
        with prefect_worker("cpu", workers, tmp) as cpu_log, prefect_worker("gpu", workers, tmp) as gpu_log:

            def logs() -> str:
                return "\n".join(f"── {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                                 for log in (cpu_log, gpu_log))

            yield SimpleNamespace(origin=origin, remote=remote, tracking=workers["MLFLOW_TRACKING_URI"], api=api,
                                  logs=logs)


def _flow_runs_by_name(client) -> dict[str, list]:
    flows = {f.id: f.name for f in client.read_flows()}
    runs: dict[str, list] = {}
    for run in client.read_flow_runs():
        runs.setdefault(flows[run.flow_id], []).append(run)
    return runs


@pytest.mark.slow
def test_area_flow_runs_on_the_cpu_worker_and_its_gpu_stage_on_the_gpu_worker(cluster):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    with cluster.api():
        run = run_deployment("train/train", parameters={"stages": ["train_fr@real"], "preset": "smoke", "jobs": 1},
                             timeout=480, poll_interval=2)
    assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{cluster.logs()}"

    with cluster.api(), get_client(sync_client=True) as client:
        runs = _flow_runs_by_name(client)
        (pipeline_run,) = runs["faceops-pipeline"]  # the area's stages ran as a subflow of the area's run
        (stage_run,) = runs[routing.STAGE_FLOW]
        tasks = {t.name for t in client.read_task_runs() if t.flow_run_id == pipeline_run.id}
        artifacts = {(a.key, a.flow_run_id): a for a in client.read_artifacts()}
    assert pipeline_run.state.is_completed() and {"prepare", "validate", "train_fr@real"} <= tasks
    assert {"dvc push", "dvc pull"} <= tasks  # the GPU stage's inputs to the DVC remote, its outputs back
    # the GPU stage ran on the gpu pool, from the same commit, with the run's params delta (the smoke preset)
    assert stage_run.name == "train_fr@real" and stage_run.state.is_completed() and stage_run.work_pool_name == "gpu"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cluster.origin, capture_output=True, text=True).stdout
    assert stage_run.parameters["commit"] == head.strip() and stage_run.parameters["params_delta"]["fr.epochs"] == "1"
    assert set(stage_run.parameters["lock"]) == {"prepare", "validate"}
    # it pushed its outputs to the DVC remote and handed back its lock entry and its uncached outputs
    result = artifacts[(routing.RESULT_KEY, stage_run.id)].data
    result = json.loads(result[result.index("```json\n") + 8: result.rindex("\n```")])
    (model,) = [o for o in result["lock"]["outs"] if o["path"] == "models/fr/real"]
    assert (cluster.remote / "files" / "md5" / model["md5"][:2] / model["md5"][2:]).is_file()
    assert "train/loss" in result["files"]["plots/train_fr_real_history.csv"]
    assert json.loads(result["files"]["metrics/train_fr_real.json"])
    png = base64.b64decode(result["binary_files"]["plots/train_fr_real_loss.png"])  # a figure: bytes, not text
    assert png.startswith(b"\x89PNG")
    # the pipeline run published its benchmark artifact (no report yet: evaluate did not run)
    assert "No benchmark yet" in artifacts[("benchmark", pipeline_run.id)].data
    # its clone is gone, but every output of its stages is in the remote under the dvc.lock it published
    lock = artifacts[(routing.LOCK_KEY, pipeline_run.id)].data
    lock = yaml.safe_load(lock[lock.index("```yaml\n") + 8: lock.rindex("```")])["stages"]
    assert set(lock) == {"prepare", "validate", "train_fr@real"}
    cached = [o for entry in lock.values() for o in entry["outs"] if o["path"].startswith(("data/", "models/"))]
    assert cached and all((cluster.remote / "files" / "md5" / o["md5"][:2] / o["md5"][2:]).is_file() for o in cached)
    # the stage's MLflow run nests under the pipeline's run although it ran on another worker
    client = MlflowClient(tracking_uri=cluster.tracking)
    experiment = client.get_experiment_by_name("faceops").experiment_id
    mlflow_runs = {r.info.run_name: r for r in client.search_runs([experiment])}
    trained = mlflow_runs["train_fr@real"]
    (parent,) = [r for r in mlflow_runs.values() if r.data.tags.get("faceops.kind") == "pipeline"]
    assert trained.data.tags["mlflow.parentRunId"] == parent.info.run_id and parent.info.run_name.startswith("pipeline")
    assert trained.info.status == "FINISHED" and any(k.startswith("dvc.dep.") for k in trained.data.tags)


@pytest.mark.slow
def test_unknown_params_key_fails_the_flow_run_at_once_naming_it(cluster, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.areas import train

    ws = copy_project(tmp_path)
    before = (ws / "params.yaml").read_bytes()
    with cluster.api():
        state = train(stages=["train_fr@real"], params_delta={"fr.epochs": "2", "fr.epoch": "3"}, root=str(ws),
                      return_state=True)
    assert state.is_failed()
    assert "unknown params key 'fr.epoch'. Did you mean 'fr.epochs'?" in state.message
    with cluster.api(), get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).state.is_failed()
    assert (ws / "params.yaml").read_bytes() == before and not (ws / "data").exists()  # nothing was written or run


@pytest.mark.slow
def test_a_stage_flow_run_never_dispatches_again(cluster, monkeypatch):
    from prefect import flow

    monkeypatch.setenv(routing.ENV_GPU_DEPLOYMENT, "stage/stage-gpu")

    @flow(name=routing.STAGE_FLOW)
    def worker_side() -> str | None:
        return routing.dispatch_target("train_fr@real")

    @flow(name="faceops-pipeline")
    def pipeline_side() -> str | None:
        return routing.dispatch_target("train_fr@real")

    with cluster.api():
        assert worker_side() is None and pipeline_side() == "stage/stage-gpu"
