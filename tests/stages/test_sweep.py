"""Optuna sweeps: the space is checked before any trial, each trial is a nested MLflow run with its params and
curves, pruning stops trials, ``--apply`` edits params.yaml reviewably, and several processes share one study
without losing or repeating a trial. Real stores throughout: MLflow on SQLite, Optuna on SQLite and a journal file,
a Prefect server on loopback for the CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ml.config import from_mapping
from ml.errors import ConfigError
from tasks.common import Paths, load_params, section
from ops.sweep import OBJECTIVES, SweepConfig, SweepError, apply_best, prepare_sweep, run_sweep

from tests.conftest import REPO
from tests.servers import free_port, prefect_server

pytestmark = pytest.mark.usefixtures("one_thread")

FACEOPS = [sys.executable, "-m", "faceops.cli"]
SPACE = {
    "fr.lr": {"type": "float", "low": 0.0005, "high": 0.005, "log": True},
    "fr.margin": {"type": "categorical", "choices": ["arcface", "cosface"]},
}
TINY = {  # a prepared set of 4 identities × 6 faces at 32 px (2 val faces each) and a 2-epoch FR model
    "data.image_size": 32, "data.train_identities": 4, "data.images_per_identity": 6, "data.val_fraction": 0.34,
    "data.heldout_identities": 2, "data.heldout_images_per_identity": 2, "data.gallery_images_per_identity": 1,
    "data.verification_pairs": 20, "data.template_identities": 2, "data.templates_per_identity": 2,
    "data.frames_per_template": 1, "data.discovery_identities": 4, "data.discovery_images_per_identity": 4,
    "data.video_identities": 2, "data.video_distractors": 1, "data.video_frames": [2, 3], "data.booking_stills": 1,
    "data.unaligned_identities": 4, "data.unaligned_images_per_identity": 2, "data.unaligned_test_identities": 1,
    "data.unaligned_val_identities": 1, "data.unaligned_size": 64, "data.fusion_identities": 6,
    "data.fusion_clean_images": 2, "data.fusion_sources": 2, "data.fusion_copies": 4, "fusion.val_identities": 2,
    "fr.epochs": 2, "fr.batch_size": 8, "fr.embedding_dim": 16, "fr.warmup_epochs": 0.5, "fr.accelerator": "cpu",
    "sweep.sampler": "random", "sweep.pruner": "none", "sweep.train_fr.trials": 3, "sweep.train_fr.space": SPACE,
    "sweep.baseline": False,  # the baseline trial has its own test
}


def _faceops(args: list[str], cwd: Path, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(FACEOPS + args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, **kw)


def _workspace(root: Path, delta: dict) -> Path:
    """``params.yaml`` (the repository's, with ``delta`` applied the way ``--set`` does) and ``dvc.yaml``."""
    from tasks.params import apply_delta

    root.mkdir(parents=True, exist_ok=True)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, root / name)
    apply_delta(root / "params.yaml", delta)
    return root


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny prepared workspace whose MLflow store is ``mlflow.db`` in it."""
    from tasks.prepare import DataConfig, run

    root = _workspace(tmp_path_factory.mktemp("sweep") / "ws", TINY)
    run(from_mapping(DataConfig, section(load_params(root / "params.yaml"), "data"), "data"), Paths(root), workers=1)
    before = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    yield root
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def _client(root: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{root / 'mlflow.db'}")


def _runs(root: Path, study: str) -> tuple[object, list]:
    """(the study's parent run, its child runs) in the workspace's MLflow store."""
    client = _client(root)
    exp = client.get_experiment_by_name("faceops")
    parents = client.search_runs([exp.experiment_id], f"tags.`optuna.study` = '{study}' and tags.`faceops.kind` = 'sweep'")
    assert len(parents) == 1, [p.info.run_name for p in parents]
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    return parents[0], children


def _study(root: Path, name: str, storage: str | None = None):
    import optuna

    return optuna.load_study(study_name=name, storage=storage or f"sqlite:///{root / 'optuna.db'}")


# ── the space is data, checked before anything runs ───────────────────────────────────────────────────────────


def test_repository_sweep_section_is_valid_and_every_objective_has_an_entry():
    cfg = from_mapping(SweepConfig, section(load_params(REPO / "params.yaml"), "sweep"), "sweep")
    assert {"fr.lr", "fr.margin"} <= set(cfg.ranges("train_fr"))
    assert cfg.ranges("train_fr")["fr.lr"].log
    for stage in OBJECTIVES:  # adding an objective needs its sweep.<stage> entry
        assert cfg.stage(stage).space, stage


@pytest.mark.parametrize("space, key, words", [
    ({"fr.lr": {"type": "float", "low": 0.01, "high": 0.001}}, "sweep.train_fr.space.fr.lr.low", ["below"]),
    ({"fr.lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}}, "sweep.train_fr.space.fr.lr.low", ["log"]),
    ({"fr.lr": {"type": "float", "low": "small", "high": 0.1}}, "sweep.train_fr.space.fr.lr.low", ["expected a number"]),
    ({"fr.lr": {"type": "float", "lo": 0.1, "high": 1.0}}, "sweep.train_fr.space.fr.lr.lo", ["low"]),
    ({"fr.lr": {"type": "uniform", "low": 0.1, "high": 1.0}}, "sweep.train_fr.space.fr.lr.type", ["categorical"]),
    ({"fr.margin": {"type": "categorical", "choices": []}}, "sweep.train_fr.space.fr.margin.choices", ["at least one"]),
    ({"fr.margin": {"type": "categorical", "choices": ["arcface", 3]}}, "sweep.train_fr.space.fr.margin.choices[1]",
     ["expected a string"]),
    ({"fr.epochs": {"type": "float", "low": 1, "high": 3}}, "sweep.train_fr.space.fr.epochs.type", ["int"]),
    ({"fr.epochs": {"type": "int", "low": 1.5, "high": 3}}, "sweep.train_fr.space.fr.epochs.low", ["whole"]),
    ({"fr.lrate": {"type": "float", "low": 0.1, "high": 1.0}}, "sweep.train_fr.space.fr.lrate", ["fr.lr"]),
    ({"data.seed": {"type": "int", "low": 0, "high": 3}}, "sweep.train_fr.space.data.seed", ["fr.*"]),
    ({"fr.lr_steps": {"type": "categorical", "choices": [[0.5, 0.8]]}}, "sweep.train_fr.space.fr.lr_steps", ["scalars"]),
])
def test_invalid_space_names_the_key(space, key, words):
    with pytest.raises(ConfigError) as err:
        from_mapping(SweepConfig, {"train_fr": {"space": space}}, "sweep")
    assert f"'{key}" in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_unknown_stage_and_a_password_in_params_are_refused():
    with pytest.raises(ConfigError, match="sweep.validate"):
        from_mapping(SweepConfig, {"validate": {"space": {}}}, "sweep")
    with pytest.raises(ConfigError) as err:
        from_mapping(SweepConfig, {"storage": "postgresql://optuna:hunter2@db:5432/optuna"}, "sweep")
    assert "sweep.storage" in str(err.value) and "optuna:***@db" in str(err.value) and "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="has no sweep objective; sweepable stages: train_fr"):
        SweepConfig().stage("evaluate")


def test_messages_mask_url_passwords_and_aws_credentials_everywhere(monkeypatch):
    from ops import remote
    from tasks.common import redact

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMIK7MDENG")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "abc")  # under 4 characters: too likely to be ordinary text
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    text = ("tracking http://alice:s3cret@mlflow:5000/ storage postgresql+psycopg://optuna:hunter2@db:5432/optuna "
            "empty user https://:tok@host/x, no password postgresql://bob@db/x sqlite:////tmp/a.db "
            "S3 said key=wJalrXUtnFEMIK7MDENG abc")
    expected = ("tracking http://alice:***@mlflow:5000/ storage postgresql+psycopg://optuna:***@db:5432/optuna "
                "empty user https://:***@host/x, no password postgresql://bob@db/x sqlite:////tmp/a.db "
                "S3 said key=*** abc")
    for mask in (redact, remote.redact):  # the remote module masks its messages with the same function
        assert mask(text) == expected


def test_bounds_the_stage_rejects_fail_before_anything_is_written(tmp_path):
    root = _workspace(tmp_path / "ws", {"fr.epochs": 2, "sweep.train_fr.space": {
        **SPACE, "fr.batch_size": {"type": "int", "low": 1, "high": 8}}})
    with pytest.raises(ConfigError) as err:
        prepare_sweep("train_fr", root=root)
    assert "'sweep.train_fr.space.fr.batch_size.low'" in str(err.value) and "batch_size" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["dvc.yaml", "params.yaml"]


def test_cli_help_teaches_and_bad_range_fails_cleanly(tmp_path):
    out = _faceops(["sweep", "--help"], tmp_path)
    assert out.returncode == 0
    for word in ("journal:", "postgresql://", "--workers", "--apply", "two", "sqlite", "--ray", "RAY_ADDRESS"):
        assert word in out.stdout, word
    root = _workspace(tmp_path / "ws", {})
    out = _faceops(["sweep", "train_fr", "--ray", "--cpus", "0"], root)
    assert out.returncode == 2 and "--cpus 0 --gpus 0: a Ray worker needs more than 0 CPUs" in out.stderr, out.stderr
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["sweep"]["train_fr"]["space"]["fr.lr"] = {"type": "float", "low": 0.1, "high": 0.1}
    (root / "params.yaml").write_text(yaml.safe_dump(params))  # by hand: apply_delta would refuse it
    before = (root / "params.yaml").read_text()
    out = _faceops(["sweep", "train_fr", "--trials", "2"], root)
    assert out.returncode == 2, out.stderr
    assert "error: params key 'sweep.train_fr.space.fr.lr.low'" in out.stderr and "Traceback" not in out.stderr
    assert (root / "params.yaml").read_text() == before
    assert sorted(p.name for p in root.iterdir()) == ["dvc.yaml", "params.yaml"]


def test_unreachable_tracking_server_or_storage_driver_stops_before_anything_is_written(workspace, tmp_path, monkeypatch):
    journal = tmp_path / "j.log"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(SweepError, match="is unreachable"):
        prepare_sweep("train_fr", root=workspace, storage=f"journal:{journal}", study="never")
    assert not journal.exists() and not (workspace / "reports" / "sweeps" / "never.json").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workspace / 'mlflow.db'}")
    with pytest.raises(SweepError) as err:  # no PostgreSQL driver is installed here: the message says so, masked
        prepare_sweep("train_fr", root=workspace, storage="postgresql://optuna:hunter2@127.0.0.1:9/optuna")
    assert "postgresql://optuna:***@127.0.0.1:9/optuna" in str(err.value) and "hunter2" not in str(err.value)
    assert "psycopg" in str(err.value) and "pip install" in str(err.value)


# ── trials ────────────────────────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def swept(workspace):
    """Three trials in this process, default storage (optuna.db in the workspace)."""
    return run_sweep("train_fr", root=workspace, study="local")


def test_each_trial_is_a_nested_mlflow_run_with_params_and_curves(workspace, swept):
    study = _study(workspace, "local")
    trials = study.get_trials()
    assert swept["trials"]["complete"] == 3 and len(trials) == 3
    parent, children = _runs(workspace, "local")
    assert parent.info.status == "FINISHED" and parent.data.params["sweep.metric"] == "val/accuracy"
    by_number = {int(r.data.tags["optuna.trial_number"]): r for r in children}
    assert sorted(by_number) == [0, 1, 2]
    client = _client(workspace)
    for trial in trials:
        run = by_number[trial.number]
        assert run.info.run_id == trial.user_attrs["mlflow_run_id"]
        assert run.data.tags["optuna.trial_state"] == "COMPLETE" and run.info.status == "FINISHED"
        assert float(run.data.params["fr.lr"]) == pytest.approx(trial.params["fr.lr"])
        assert run.data.params["fr.margin"] == trial.params["fr.margin"]
        assert run.data.params["fr.epochs"] == "2"  # the rest of the effective fr config
        curve = client.get_metric_history(run.info.run_id, "val/accuracy")
        assert len(curve) == 2 and curve[-1].value == pytest.approx(trial.value)  # one point per epoch
        assert sorted(trial.intermediate_values) == [0, 1]
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
    best = max(trials, key=lambda t: t.value)
    assert swept["best"]["number"] == best.number and swept["best"]["params"] == best.params


def test_report_has_plots_and_best_params(workspace, swept):
    import json

    summary = json.loads((workspace / "reports/sweeps/local.json").read_text())
    assert summary["best"]["value"] == swept["best"]["value"] and set(summary["best"]["params"]) == set(SPACE)
    assert set(summary["importance"]) == set(SPACE)
    for name in ("history", "importance"):
        assert (workspace / f"plots/sweeps/local_{name}.png").stat().st_size > 1000
    parent, _ = _runs(workspace, "local")
    logged = {a.path for a in _client(workspace).list_artifacts(parent.info.run_id, "plots")}
    assert logged == {"plots/local_history.png", "plots/local_importance.png"}
    assert parent.data.metrics["sweep/best_value"] == pytest.approx(swept["best"]["value"])


def test_apply_writes_exactly_the_swept_keys_and_keeps_comments(workspace, swept):
    params = workspace / "params.yaml"
    before_text = params.read_text()
    before = yaml.safe_load(before_text)
    plan = prepare_sweep("train_fr", root=workspace, study="local", trials=0)
    applied = apply_best(plan)
    after_text = params.read_text()
    after = yaml.safe_load(after_text)
    best = swept["best"]["params"]
    differing = {k for k, v in best.items() if before["fr"][k.split(".")[1]] != v}
    assert "fr.lr" in differing and set(applied["changes"]) == differing
    assert {k: v for k, v in after.items() if k != "fr"} == {k: v for k, v in before.items() if k != "fr"}
    assert after["fr"] == {**before["fr"], **{k.split(".")[1]: v for k, v in best.items()}}
    comments = [line.split("#", 1)[1] for line in before_text.splitlines() if "#" in line]
    assert all(c in after_text for c in comments)
    changed = [l for l in applied["diff"].splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert applied["diff"].startswith("--- a/params.yaml\n+++ b/params.yaml")
    assert len(changed) == 2 * len(differing) and all(l[1:].lstrip().split(":")[0] in ("lr", "margin") for l in changed)
    assert len(_study(workspace, "local").get_trials()) == 3  # --trials 0 ran nothing


def test_pruned_trials_stop_early_and_are_recorded(workspace):
    import optuna

    summary = run_sweep("train_fr", root=workspace, study="pruned", trials=2,
                        pruner=optuna.pruners.ThresholdPruner(lower=1.5))  # accuracy < 1.5: prune at epoch 0
    trials = _study(workspace, "pruned").get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    assert all(list(t.intermediate_values) == [0] for t in trials)  # the second of the 2 epochs never ran
    _, children = _runs(workspace, "pruned")
    client = _client(workspace)
    assert len(children) == 2
    for run in children:
        assert run.data.tags["optuna.trial_state"] == "PRUNED"
        assert len(client.get_metric_history(run.info.run_id, "val/accuracy")) == 1
    assert summary["best"] is None and summary["trials"]["pruned"] == 2
    assert any("at least 2 completed trials" in n for n in summary["notes"])
    assert not (workspace / "plots/sweeps/pruned_importance.png").exists()
    with pytest.raises(SweepError, match="no completed trial"):
        apply_best(prepare_sweep("train_fr", root=workspace, study="pruned", trials=0))


def test_a_new_studys_first_trial_is_the_params_own_values_and_the_summary_compares_with_it(workspace, caplog,
                                                                                            capsys):
    from faceops.sweep import _print_summary
    from tasks.params import apply_delta

    params = workspace / "params.yaml"
    before = params.read_text()
    try:
        apply_delta(params, {"sweep.baseline": True})
        summary = run_sweep("train_fr", root=workspace, study="baseline", trials=1)
        (trial,) = _study(workspace, "baseline").get_trials()
        current = yaml.safe_load(params.read_text())["fr"]
        assert trial.params == {"fr.lr": current["lr"], "fr.margin": current["margin"]}
        assert trial.user_attrs["faceops.baseline"] is True
        _, (run,) = _runs(workspace, "baseline")
        assert run.data.tags["faceops.baseline"] == "true"
        base = summary["baseline"]
        assert base["number"] == 0 and base["value"] == pytest.approx(trial.value) and base["gain"] == 0.0
        _print_summary(summary)
        out = capsys.readouterr().out
        assert "baseline trial 0 (params.yaml's values)" in out and "the default is the best trial" in out
        text = params.read_text()
        assert apply_best(prepare_sweep("train_fr", root=workspace, study="baseline", trials=0))["changes"] == {}
        assert params.read_text() == text  # the default is the best: nothing to write
        apply_delta(params, {"fr.margin": "adaface"})  # not among SPACE's choices: Optuna could not record it
        with caplog.at_level("WARNING", logger="ops.sweep.study"):
            prepare_sweep("train_fr", root=workspace, study="outside")
        assert any("no baseline trial" in r.getMessage() and "fr.margin" in r.getMessage() for r in caplog.records)
        assert _study(workspace, "outside").get_trials() == []
    finally:
        params.write_text(before)


# ── many processes, one study ─────────────────────────────────────────────────────────────────────────────────


def test_two_commands_share_one_study_without_losing_or_repeating_trials(workspace, tmp_path):
    """Two `faceops sweep` commands started at once on one journal file; the first runs its trials in two worker
    processes (--workers 2), the second applies the best params at its end."""
    from ops.sweep import ensure_tracking

    ensure_tracking(workspace)  # the MLflow experiment exists before workers start, as on a cluster
    k, journal = 2, tmp_path / "j.log"
    args = ["sweep", "train_fr", "--trials", str(k), "--storage", f"journal:{journal}", "--study", "s"]
    before = yaml.safe_load((workspace / "params.yaml").read_text())
    with prefect_server(tmp_path / "prefect") as env:
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        procs = [subprocess.Popen(FACEOPS + args + extra, cwd=workspace, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for extra in (["--workers", "2"], ["--apply"])]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        for proc, out in zip(procs, outs):
            assert proc.returncode == 0, out[-3000:]
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs()
    assert len(flow_runs) == 2 and all(r.state.is_completed() for r in flow_runs)
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    trials = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(str(journal)))).get_trials()
    assert sorted(t.number for t in trials) == list(range(2 * k))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.user_attrs["mlflow_run_id"] for t in trials}) == 2 * k
    assert len({t.params["fr.lr"] for t in trials}) == 2 * k  # the workers drew different values
    parent, children = _runs(workspace, "s")
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == list(range(2 * k))
    assert len({r.data.tags["optuna.worker"] for r in children}) == 3  # 2 processes of the first command + 1
    assert "--- a/params.yaml" in outs[1] and "review and commit" in outs[1]
    after = yaml.safe_load((workspace / "params.yaml").read_text())
    assert {k: v for k, v in after["fr"].items() if k not in ("lr", "margin")} == \
        {k: v for k, v in before["fr"].items() if k not in ("lr", "margin")}
    assert after["fr"]["lr"] != before["fr"]["lr"]


def test_a_killed_workers_trial_is_failed_by_its_silent_heartbeat_and_run_again(tmp_path):
    """A trial whose process died stays RUNNING for ever without a heartbeat. With one (SQL storage), the next
    worker marks it FAIL once it has been silent for three intervals and runs it again with the same params."""
    import time

    import optuna

    from ops.sweep import StorageSpec, open_storage

    spec = StorageSpec("rdb", f"sqlite:///{tmp_path / 'optuna.db'}")
    storage = open_storage(spec, heartbeat_s=1)
    study = optuna.create_study(study_name="s", storage=storage)
    dead = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    storage.record_heartbeat(dead._trial_id)  # the worker beat once, then was killed (it never tells)
    time.sleep(5.0)  # > the 3 s grace period by more than SQLite's 1-second CURRENT_TIMESTAMP resolution
    worker = optuna.load_study(study_name="s", storage=open_storage(spec, heartbeat_s=1))
    worker.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=2)
    trials = worker.get_trials(deepcopy=False)
    assert trials[0].state == optuna.trial.TrialState.FAIL
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retried) == 1 and retried[0].state == optuna.trial.TrialState.COMPLETE
    assert retried[0].params["x"] == dead.params["x"]
    # without a heartbeat the same trial is never reclaimed
    plain = optuna.create_study(study_name="p", storage=open_storage(spec))
    stuck = plain.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)})
    plain.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=1)
    assert plain.get_trials()[stuck.number].state == optuna.trial.TrialState.RUNNING



def test_a_server_storage_whose_tables_another_worker_is_creating_is_retried(monkeypatch):
    """Two workers opening one fresh PostgreSQL study race on its tables (PostgreSQL refuses the loser's CREATE
    TABLE with "duplicate key value"); the loser opens the storage on its next try. An unreachable server is not
    retried: it fails at once, naming the storage without its password."""
    import optuna

    from ops.sweep import StorageSpec, SweepError, open_storage

    calls = []

    def storage(url, **kwargs):
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError('duplicate key value violates unique constraint "pg_type_typname_nsp_index"')
        return "opened"

    monkeypatch.setattr(optuna.storages, "RDBStorage", storage)
    monkeypatch.setattr("ops.sweep.config.time.sleep", lambda s: None)
    spec = StorageSpec("rdb", "postgresql+psycopg2://user:secret@db:5432/optuna")
    assert open_storage(spec) == "opened" and len(calls) == 2

    def unreachable(url, **kwargs):
        calls.append(url)
        raise RuntimeError("could not connect to server: Connection refused")

    calls.clear()
    monkeypatch.setattr(optuna.storages, "RDBStorage", unreachable)
    with pytest.raises(SweepError, match="Connection refused") as err:
        open_storage(spec)
    assert len(calls) == 1 and "secret" not in str(err.value)

# ── trial workers placed by Ray ───────────────────────────────────────────────────────────────────────────────
@pytest.fixture
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _ray_plan(workspace: Path, tmp_path: Path, study: str, trials: int = 2):
    from ops.sweep import ensure_tracking

    ensure_tracking(workspace)  # the MLflow experiment exists before workers start, as on a cluster
    return prepare_sweep("train_fr", trials=trials, storage=f"journal:{tmp_path / 'j.log'}", study=study,
                         root=workspace)


def test_sweep_ray_places_every_worker_through_ray_from_the_command_line(workspace, tmp_path):
    """`faceops sweep --ray --workers 2` through the flow on a real Prefect server; Ray (a local instance the
    command starts) runs both workers, each its own process, on one study."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    from ops.sweep import ensure_tracking

    ensure_tracking(workspace)  # the MLflow experiment exists before workers start, as on a cluster
    journal = tmp_path / "j.log"
    args = ["sweep", "train_fr", "--trials", "2", "--workers", "2", "--ray", "--storage", f"journal:{journal}",
            "--study", "r"]
    with prefect_server(tmp_path / "prefect") as env:
        out = _faceops(args, workspace, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trials = optuna.load_study(study_name="r", storage=JournalStorage(JournalFileBackend(str(journal)))).get_trials()
    assert sorted(t.number for t in trials) == [0, 1]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    parent, children = _runs(workspace, "r")
    assert len(children) == 2 and len({r.data.tags["optuna.worker"] for r in children}) == 2  # two processes
    for k in (0, 1):
        log = (workspace / "logs" / "launch" / f"sweep-r-node{k}.log").read_text()
        assert "ops.sweep train_fr --study r --trials 1" in log.splitlines()[0]


def test_a_failing_ray_worker_is_named_and_stops_the_sweep(workspace, tmp_path, ray_local, monkeypatch):
    import logging

    from flows.sweep import RayWorkers, _trials_on_ray
    from ops import sweep as sw

    real = sw.worker_command
    monkeypatch.setattr(sw, "worker_command", lambda plan, n, seed: (
        real(plan, n, seed) if seed == plan.seed else [sys.executable, "-c", "import sys; sys.exit(3)"]))
    plan = _ray_plan(workspace, tmp_path, "f")
    with pytest.raises(SweepError, match=r"(?s)study f: node 1 \(.*\) exited with status 3.*kept in the study"):
        _trials_on_ray(plan, [1, 1], RayWorkers(cpus=1), logging.getLogger("test"))


def test_file_storage_on_a_cluster_or_a_password_in_a_url_is_refused(workspace, tmp_path, ray_local, monkeypatch):
    import logging

    import dataclasses

    from flows.sweep import RayWorkers, _trials_on_ray
    from ops import launch
    from ops.sweep import StorageSpec

    monkeypatch.setattr(launch, "live_machines", lambda: ["10.0.0.1", "10.0.0.2"])
    plan = _ray_plan(workspace, tmp_path, "m")
    with pytest.raises(SweepError, match=r"2 machines.*journal storage.*and the MLflow store sqlite:"):
        _trials_on_ray(plan, [1, 1], RayWorkers(cpus=1), logging.getLogger("test"))
    assert not (workspace / "logs" / "launch" / "sweep-m-node0.log").exists()  # refused before anything ran
    secret = dataclasses.replace(plan, storage=StorageSpec("rdb", "postgresql://optuna:s3cret@db:5432/optuna"))
    with pytest.raises(SweepError, match=r"the storage postgresql://optuna:\*\*\*@db.*PGPASSWORD") as caught:
        _trials_on_ray(secret, [1, 1], RayWorkers(cpus=1), logging.getLogger("test"))
    assert "s3cret" not in str(caught.value)


# ── every trainer's target, on its val split only ─────────────────────────────────────────────────────────────

TARGETS = {  # stage → (a small space, fixed keys for 2-epoch trials on the tiny workspace, the metric's direction)
    "train_aligner": ({"aligner.train.lr": {"type": "float", "low": 0.005, "high": 0.05, "log": True}},
                      {"aligner.train.epochs": 2, "aligner.train.input_size": 64, "aligner.train.batch_size": 4}),
    "train_discovery": ({"discovery.lr": {"type": "float", "low": 0.0005, "high": 0.005, "log": True}},
                        {"discovery.epochs": 2, "discovery.batch_size": 8, "discovery.backbone_init": "random",
                         "discovery.anchor_weight": 0.0, "discovery.labelled_identities_per_batch": 0,
                         "discovery.val_per_identity": 1, "discovery.gcd_arm": False}),
    "train_fusion": ({"fusion.train.lr": {"type": "float", "low": 0.0001, "high": 0.001, "log": True}},
                     {"fusion.train.epochs": 2, "fusion.train.steps_per_epoch": 2, "fusion.train.batch_size": 4,
                      "fusion.train.per_identity": 8, "fusion.train.group": 4, "fusion.train.max_len": 4,
                      "fusion.train.accelerator": "cpu"}),
    "train_generator": ({"generator.train.lr": {"type": "float", "low": 0.0005, "high": 0.002, "log": True}},
                        {"generator.space": "pixel", "generator.max_images": 16, "generator.train.epochs": 1,
                         "generator.train.batch_size": 8, "generator.train.model.image_size": 16,
                         "generator.train.model.in_channels": 3, "generator.train.model.block_out_channels": [8, 16],
                         # a one-epoch toy: ε on whole pixels, whose empty-context faces differ enough to give the
                         # probe two identities (v on 2×2 patches gives near-identical ones after one epoch)
                         "generator.train.model.patch_size": 1, "generator.train.prediction_type": "epsilon",
                         "generator.train.loss_weighting": "uniform",
                         "generator.train.accelerator": "cpu", "generator.probe.synthetic_identities": 2,
                         "generator.probe.images_per_identity": 2, "generator.probe.fr_epochs": 1}),
}


def _poison_test_splits(root: Path) -> None:
    """Every image a report scores (the aligner's test identities, the GFD test subset, the held-out FR set, the
    video probes and templates) made unreadable: a trial that opens one fails. Test faces that share shards with
    val faces have their bytes overwritten in place, so the val faces still read."""
    from ml.data.dataset import load_images, read_manifest, shard_places
    from ml.errors import DataError
    from ml.discovery.split import read_gfd_split

    paths = Paths(root)
    manifest = read_manifest(paths.unaligned_set / "manifest.parquet")
    gfd = read_gfd_split(paths.gfd_split)
    poisoned = 0
    for dataset, rows in ((paths.unaligned_set, manifest[manifest["split"] == "test"]),
                          (paths.prepared / "discovery", gfd[gfd["subset"] == "test"])):
        shards, shard_of, offsets, sizes = shard_places(dataset, rows)
        for number, offset, size in zip(shard_of, offsets, sizes):
            with open(shards[number], "r+b") as f:
                f.seek(int(offset))
                f.write(b"\xff" * int(size))
            poisoned += 1
        with pytest.raises(DataError, match="decode"):  # the poison has teeth
            faces = read_manifest(dataset / "manifest.parquet")
            load_images(dataset, faces[faces["path"].isin(rows["path"])].iloc[:1])
    for part in ("heldout", "videos", "templates"):
        for path in (p for p in (paths.prepared / part).rglob("*") if p.is_file()):
            path.write_bytes(b"a test split: not for sweeps")
            poisoned += 1
    assert poisoned > 3


@pytest.mark.parametrize("stage", sorted(TARGETS))
def test_every_trainer_sweeps_on_its_val_split_and_never_reads_a_test_split(tmp_path, stage):
    from tasks.prepare import DataConfig, run

    space, fixed = TARGETS[stage]
    root = _workspace(tmp_path / "ws", {**TINY, f"sweep.{stage}.trials": 2, f"sweep.{stage}.space": space,
                                        f"sweep.{stage}.fixed": fixed, "synthesize.candidates": 4,
                                        "synthesize.identities": 2, "synthesize.sampler.steps": 2})
    params = load_params(root / "params.yaml")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    run(data, Paths(root), workers=1)
    if stage in ("train_fusion", "train_generator"):  # on the features of a trained FR model
        from ml.fr.config import FRConfig
        from tasks import train_fr

        train_fr.run(from_mapping(FRConfig, section(params, "fr"), "fr"), data, Paths(root))
    _poison_test_splits(root)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
    try:
        summary = run_sweep(stage, root=root, study=stage)
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    assert summary["trials"]["complete"] == 2, summary
    metric = section(load_params(root / "params.yaml"), "sweep")[stage]["metric"]
    assert metric.startswith("val/")
    parent, children = _runs(root, stage)
    assert parent.data.params["sweep.metric"] == metric and len(children) == 2
    values = {t.user_attrs["mlflow_run_id"]: t.value for t in _study(root, stage).trials}
    for child in children:
        curve = _client(root).get_metric_history(child.info.run_id, metric)
        # one point per epoch, visible in the nested run; the generator's objective is measured once, after training
        assert len(curve) == (1 if stage == "train_generator" else 2)
        # a trial is worth the model its stage keeps: FaceGCD keeps its best val epoch, the others their last
        kept = max if stage == "train_discovery" else (lambda points: points[-1])
        assert values[child.info.run_id] == pytest.approx(kept([m.value for m in sorted(curve, key=lambda m: m.step)]))
        if stage == "train_generator":  # gap + the small synthetic-trained FR model's accuracy on val identities
            m = child.data.metrics
            assert m["val/objective"] == pytest.approx(m["val/identity_gap"] + m["val/accuracy"])
            assert 0.0 <= m["val/accuracy"] <= 1.0 and 0.0 < m["val/chance"] < 1.0


def test_discovery_val_split_may_be_held_out_by_the_sweeps_fixed_keys(workspace):
    from ml.errors import DataError
    from ops.sweep.targets import OBJECTIVES

    paths = Paths(workspace)
    check = OBJECTIVES["train_discovery"].check_data
    params = {"discovery": {"val_per_identity": 0}}
    with pytest.raises(DataError, match=r"set discovery.val_per_identity > 0 \(or in sweep.train_discovery.fixed\)"):
        check(paths, params, "val/accuracy")
    # TINY: 4 discovery identities, half of them known → 2 known identities × 2 held-out images each
    assert check(paths, {**params, "sweep": {"train_discovery": {"fixed": {"discovery.val_per_identity": 2}}}},
                 "val/accuracy") == 4
    assert check(paths, params, "train/loss") is None  # a training metric needs no held-out images


def test_a_sweep_on_a_tiny_val_split_warns_that_trials_may_tie(workspace, caplog, monkeypatch):
    from ops.sweep import check_request, study

    monkeypatch.setattr(study, "_WARNED_SMALL", set())  # earlier sweeps in this process have warned already
    with caplog.at_level("WARNING", logger="ops.sweep.study"):
        check_request("train_fr", root=workspace)
        check_request("train_fr", root=workspace)  # the flow's own check after the command's: no second warning
    (warning,) = [r.getMessage() for r in caplog.records if "val items" in r.getMessage()]
    assert "val/accuracy is measured on 8 val items" in warning and "trials may tie" in warning
