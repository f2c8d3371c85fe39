"""The journal → relay path of stage tracking: a stage process that never imports MLflow still gets its full,
nested MLflow run; a crash, a failure and an unreachable server are each reported and lose nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ops import tracking
from ops.run_store import EXPERIMENT, configure

from tests.conftest import curve_problems

REPO = Path(__file__).resolve().parents[2]

STAGE = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from ops.tracking import stage_run

    mode = sys.argv[1]
    plot = Path(sys.argv[2])
    plot.write_text("curve")
    with stage_run("toy", {"toy": {"epochs": 3, "lr": 0.1}}, Path.cwd()) as tracker:
        for epoch in range(3):
            tracker.log_metrics({"train/loss": 1.0 / (epoch + 1)}, step=epoch)
        tracker.log_artifact(plot, artifact_path="plots")
        tracker.set_tags({"toy.tag": 7})
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    print("mlflow imported:", "mlflow" in sys.modules)
""")


CURVES = textwrap.dedent("""
    from pathlib import Path
    from ops.tracking import stage_run

    with stage_run("toy", {}, Path.cwd()) as tracker:
        for epoch, step in enumerate((27, 54, 81)):  # Lightning logs an epoch's metrics at its last optimiser step
            tracker.log_metrics({"train/loss": 1.0 / (epoch + 1), "train/seconds": 10.0 + epoch, "epoch": epoch},
                                step=step)
            tracker.log_metrics({"train/lr": 0.1, "epoch": epoch}, step=step)  # Lightning's step log: `epoch` again
        # the stage's summary: the last epoch's loss (float32-rounded, as a tensor's .item() gives it), the whole
        # training's seconds (not the curve's last point), a number without a curve
        tracker.log_metrics({"train/loss": 0.3333333432674408, "train/seconds": 33.0, "train/images": 128.0})
        # an evaluation's summary: a set-size family, a count and a bound that qualify a column
        tracker.log_metrics({"sets/gain/caface/n=16/rank1": 0.75, "sets/gain/caface/n=4/rank1": 0.5,
                             "sets/caface/rank1": 0.6, "sets/caface/n_mated": 40.0, "sets/caface/rank1_ci_low": 0.52})
""")


def _run_stage(tmp_path: Path, relay: tracking.StageRelay, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "stage.py"
    script.write_text(STAGE)
    env = {**os.environ, **relay.env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(script), mode, str(tmp_path / "curve.txt")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def store(tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    configure(tmp_path)
    parent = mlflow.start_run(run_name="pipeline")
    yield MlflowClient(tracking_uri=uri), parent.info.run_id
    mlflow.end_run()


def test_relayed_run_is_complete_nested_and_stage_never_imports_mlflow(tmp_path, store):
    client, parent = store
    with tracking.StageRelay(tmp_path, parent) as relay:
        proc = _run_stage(tmp_path, relay, "ok")
    assert proc.returncode == 0, proc.stderr
    assert "mlflow imported: False" in proc.stdout
    assert relay.error is None and len(relay.run_ids) == 1
    assert not relay.path.exists()  # replayed in full: the journal is removed
    run = client.get_run(relay.run_ids[0])
    assert run.info.status == "FINISHED" and run.info.run_name == "toy"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["dvc.stage"] == "toy" and run.data.tags["toy.tag"] == "7"
    assert run.data.params == {"toy.epochs": "3", "toy.lr": "0.1"}
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 4)) for m in history] == [(0, 1.0), (1, 0.5), (2, 0.3333)]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curve.txt"]


@pytest.mark.parametrize("relayed", [False, True], ids=["direct", "relayed"])
def test_summary_values_end_curves_instead_of_restarting_them_at_step_zero(tmp_path, store, relayed):
    client, parent = store
    script = tmp_path / "curves.py"
    script.write_text(CURVES)
    env = {**os.environ, "PYTHONPATH": str(REPO), tracking.ENV_PARENT_RUN: parent}

    def run(extra: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)

    if relayed:
        with tracking.StageRelay(tmp_path, parent) as relay:
            proc = run(relay.env)
        (run_id,) = relay.run_ids
    else:
        proc = run({})
        (found,) = client.search_runs([client.get_run(parent).info.experiment_id],
                                      filter_string=f"tags.mlflow.parentRunId = '{parent}'")
        run_id = found.info.run_id
    assert proc.returncode == 0, proc.stderr
    history = {key: [(m.step, round(m.value, 4)) for m in client.get_metric_history(run_id, key)]
               for key in ("train/loss", "train/seconds", "train/images", "epoch")}
    assert history == {"train/loss": [(27, 1.0), (54, 0.5), (81, 0.3333)],  # the summary is the curve's last point
                       "train/seconds": [(27, 10.0), (54, 11.0), (81, 12.0), (82, 33.0)],  # another value: after it
                       "train/images": [(0, 128.0)],
                       "epoch": [(27, 0.0), (54, 1.0), (81, 2.0)]}  # one point per step
    metrics = client.get_run(run_id).data.metrics
    assert metrics["train/seconds"] == 33.0  # the run's table shows the summary
    assert curve_problems(client, run_id) == []
    # one column per compared number; the set sizes are a curve's steps; count and bound are in the details
    assert {k for k in metrics if k.startswith("sets/")} == {"sets/caface/rank1", "sets/gain/caface/rank1"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "sets/gain/caface/rank1")] == [(4, 0.5),
                                                                                                        (16, 0.75)]
    details = json.loads(Path(client.download_artifacts(run_id, tracking.DETAILS_ARTIFACT, str(tmp_path))).read_text())
    assert details == {"sets/caface/n_mated": 40.0, "sets/caface/rank1_ci_low": 0.52}


def test_failed_stage_ends_failed_with_what_it_logged(tmp_path, store):
    client, parent = store
    with tracking.StageRelay(tmp_path, parent) as relay:
        proc = _run_stage(tmp_path, relay, "raise")
    assert proc.returncode != 0 and "boom" in proc.stderr
    run = client.get_run(relay.run_ids[0])
    assert run.info.status == "FAILED"
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 3


def test_killed_stage_ends_killed(tmp_path, store):
    client, parent = store
    with tracking.StageRelay(tmp_path, parent) as relay:
        proc = _run_stage(tmp_path, relay, "kill")
    assert proc.returncode == -9
    assert relay.error is None
    run = client.get_run(relay.run_ids[0])
    assert run.info.status == "KILLED"
    assert run.data.tags["toy.tag"] == "7"  # everything written before the kill is there


def test_unreachable_mlflow_keeps_the_journal_for_replay(tmp_path, store, monkeypatch):
    client, _ = store
    uri = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    try:
        with tracking.StageRelay(tmp_path) as relay:
            proc = _run_stage(tmp_path, relay, "ok")
    finally:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        configure(tmp_path)
    assert proc.returncode == 0  # the stage's own work is not held hostage by the tracking server
    assert relay.error is not None and relay.path.is_file()
    entries = [json.loads(line)["op"] for line in relay.path.read_text().splitlines()]
    assert entries[0] == "start" and entries[-1] == "end"
    replayed = tracking.StageRelay.replay(relay.path, tmp_path)
    assert not relay.path.exists()
    run = client.get_run(replayed.run_ids[0])
    assert run.info.status == "FINISHED" and len(client.get_metric_history(run.info.run_id, "train/loss")) == 3


def test_unknown_journal_entry_is_an_error_naming_the_file(tmp_path, store):
    journal = tmp_path / "journal.jsonl"
    journal.write_text(json.dumps({"op": "delete_experiment", "args": []}) + "\n")
    with pytest.raises(ValueError, match=r"journal\.jsonl: unexpected journal entry 'delete_experiment'"):
        tracking.StageRelay.replay(journal, tmp_path)
    assert journal.is_file()


# ── DVC experiments run in DVC's temporary copy, and log into the repository that queued them ────────────────

EXP_STAGE = textwrap.dedent("""
    import sys
    from pathlib import Path

    import yaml
    from ops.tracking import stage_run

    value = yaml.safe_load(Path("params.yaml").read_text())["count"]["value"]
    with stage_run("count", {"count": {"value": value}}, Path.cwd()) as tracker:
        tracker.log_metrics({"count/value": float(value)})
        Path("out.txt").write_text(str(value))
        Path("metrics.json").write_text('{"count": {"value": %d, "seen": 1}}' % value)
""")
SEEN = 'import pathlib\npathlib.Path("seen.json").write_text(\'{"count": {"seen": 1}}\')\n'



def test_a_dvc_experiment_in_a_temporary_copy_logs_into_the_projects_store(tmp_path):
    import mlflow

    repo = tmp_path / "proj"
    repo.mkdir()
    (repo / "stage.py").write_text(EXP_STAGE)
    (repo / "seen.py").write_text(SEEN)
    (repo / "seen.json").write_text('{"count": {"seen": 1}}')  # committed, as a project's metrics files are
    (repo / "params.yaml").write_text("count:\n  value: 1\n")
    (repo / "dvc.yaml").write_text(  # `seen`: a stage that writes a key of `count`'s metrics too
        "stages:\n  count:\n    cmd: python stage.py\n    deps: [stage.py]\n    params: [count.value]\n"
        "    outs: [out.txt]\n    metrics: [{metrics.json: {cache: false}}]\n"
        "  seen:\n    cmd: python seen.py\n    deps: [seen.py]\n    metrics: [{seen.json: {cache: false}}]\n")
    (repo / ".gitignore").write_text("mlflow.db*\nmlruns/\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for name in ("MLFLOW_TRACKING_URI", tracking.ENV_JOURNAL, tracking.ENV_PARENT_RUN, "DVC_ROOT"):
        env.pop(name, None)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"],
                ["dvc", "exp", "run", "--temp", "-S", "count.value=2", "--name", "two"]):
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-2000:])
    assert not list((repo / ".dvc" / "tmp").rglob("mlflow.db")), "the copy opened a store of its own"
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment.artifact_location.removeprefix("file://").startswith(str(repo / "mlruns"))  # not DVC's copy
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"count", "dvc exp two"}
    run, parent = runs["count"], runs["dvc exp two"]
    assert run.data.tags["dvc.exp_name"] == "two" and run.data.metrics["count/value"] == 2.0
    assert run.data.tags["faceops.config"] == "custom" and run.data.tags["faceops.config_delta"] == "count.value=2"
    # nested under the experiment's parent run, and tagged with DVC's hashes as dvc.lock records them
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.tags["faceops.kind"] == "dvc-experiment" and parent.data.tags["dvc.exp_name"] == "two"
    # the parent shows the numbers only `count` writes, not the key another stage's metrics file has too
    assert parent.data.metrics == {"count/value": 2.0}
    assert run.data.tags["dvc.dep.stage.py"] == hashlib.md5((repo / "stage.py").read_bytes()).hexdigest()
    assert run.data.tags["dvc.out.out.txt"] == hashlib.md5(b"2").hexdigest()


def test_a_parent_run_shows_the_numbers_exactly_one_stage_writes(tmp_path):
    """``ops.lineage.unique_summary`` on a two-stage DVC project: a key both metrics files hold is left to the stage
    runs, a file not written yet adds nothing, and an unreadable one is one error naming it."""
    from ml.errors import DataError
    from ops import lineage

    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=tmp_path, check=True, capture_output=True,
                   env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  a:\n    cmd: 'true'\n    metrics: [{a.json: {cache: false}}]\n"
        "  b:\n    cmd: 'true'\n    metrics: [{b.json: {cache: false}}]\n")
    (tmp_path / "a.json").write_text('{"test": {"nme": 0.05}, "train": {"loss": 1.5}}')
    assert lineage.unique_summary(tmp_path) == {"test/nme": 0.05, "train/loss": 1.5}  # b.json not written yet
    (tmp_path / "b.json").write_text('{"sets": {"rank1": 0.4}, "train": {"loss": 0.7}}')
    assert lineage.unique_summary(tmp_path) == {"test/nme": 0.05, "sets/rank1": 0.4}
    assert lineage.unique_summary(tmp_path, only="b") == {"sets/rank1": 0.4}
    (tmp_path / "a.json").write_text('{"test": [')
    with pytest.raises(DataError, match="a.json cannot be read"):
        lineage.unique_summary(tmp_path)
