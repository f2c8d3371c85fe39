"""`faceops run` restores a stage from DVC's run-cache, as `dvc repro` does.

A one-stage DVC repository whose cmd writes random bytes (so a second run never reproduces the first's outputs), a
metrics file, an MLflow run through ``ops.tracking.stage_run``, and one line per execution into ``runs.log``
(outside DVC's outputs: the count of times the cmd really ran). Changing its param and changing it back must
bring the first run's outputs back without running the cmd, record the same ``dvc.lock`` entry, and say so in the
task's result, the flow log and MLflow; ``force`` must run the cmd anyway; half-written outputs DVC has no copy of
are replaced by the restored ones.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.servers import prefect_server

pytestmark = pytest.mark.slow
STAGE = "count"
COUNT_PY = '''\
import json, os
from pathlib import Path

import yaml

from ops.tracking import stage_run

params = yaml.safe_load(Path("params.yaml").read_text())["count"]
with open("runs.log", "a") as fh:
    fh.write(f"{params['value']}\\n")
Path("out").mkdir(exist_ok=True)
Path("out/result.bin").write_bytes(os.urandom(256) + str(params["value"]).encode())
with stage_run("count", {"count": params}, Path.cwd()) as tracker:
    metrics = {"count/value": float(params["value"]), "count/noise": float(os.urandom(1)[0])}
    Path("metrics").mkdir(exist_ok=True)
    Path("metrics/count.json").write_text(json.dumps(metrics))
    tracker.log_metrics(metrics)
'''
DVC_YAML = """\
stages:
  count:
    cmd: python count.py
    deps: [count.py]
    params: [count]
    outs: [out]
    metrics:
      - metrics/count.json:
          cache: false
"""


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def set_value(root: Path, value: int) -> None:
    (root / "params.yaml").write_text(f"count:\n  value: {value}\n")


def run(root: Path, force: bool = False) -> tuple[dict, list[str]]:
    """One `faceops run` of the tiny repository in this process: (the stage's result, the flow's log lines)."""
    from flows.pipeline import run_pipeline

    lines = _Lines()
    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    for logger in loggers:
        logger.addHandler(lines)
    try:
        (result,) = run_pipeline(root=str(root), force=force)
    finally:
        for logger in loggers:
            logger.removeHandler(lines)
    return result, lines.lines


def snapshot(root: Path) -> dict:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"][STAGE]
    return {"out": (root / "out/result.bin").read_bytes(), "metrics": (root / "metrics/count.json").read_text(),
            "lock": lock}


def executions(root: Path) -> list[str]:
    return (root / "runs.log").read_text().split()


def mlflow_runs() -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("faceops")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """value 1 (runs), value 2 (runs), value 1 again: the third run is the one under test."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    tmp = tmp_path_factory.mktemp("runcache")
    root = tmp / "repo"
    root.mkdir()
    (root / "count.py").write_text(COUNT_PY)
    (root / "dvc.yaml").write_text(DVC_YAML)
    set_value(root, 1)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    with pytest.MonkeyPatch.context() as mp, prefect_server(tmp / "prefect") as prefect_env:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp / 'mlflow.db'}")
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        mp.chdir(root)  # as `faceops run` runs: DVC names stages relative to the working directory
        with temporary_settings({PREFECT_API_URL: prefect_env["PREFECT_API_URL"]}):
            results, logs, states = [], [], []
            for value in (1, 2, 1):
                set_value(root, value)
                result, lines = run(root)
                results.append(result)
                logs.append(lines)
                states.append(snapshot(root))
            yield {"root": root, "results": results, "logs": logs, "states": states}
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=5)


def test_param_changed_and_changed_back_is_restored_without_running_the_cmd(history):
    from flows.stages import stage_status

    root, (first, second, third), (s1, s2, s3) = history["root"], history["results"], history["states"]
    assert first["ran"] and not first["restored"] and second["ran"] and not second["restored"]
    assert s2["out"] != s1["out"]  # the cmd writes fresh random bytes on every execution
    assert third["restored"] and not third["ran"]
    assert executions(root) == ["1", "2"]  # the cmd ran twice, not a third time
    assert s3["out"] == s1["out"] and s3["metrics"] == s1["metrics"]
    assert s3["lock"] == s1["lock"]
    assert stage_status(root, STAGE)[0] == []  # DVC finds the restored stage up to date
    restored_lines = [line for line in history["logs"][2] if "restored from DVC's run-cache" in line]
    assert len(restored_lines) == 2 and restored_lines[0].startswith(f"{STAGE}: restored"), history["logs"][2]
    assert "1 restored from DVC's run-cache (count)" in restored_lines[1]
    assert not any(line.startswith(f"{STAGE}: restored") for line in history["logs"][0] + history["logs"][1])
    assert "1 stage(s) ran, 0 restored from DVC's run-cache, 0 up to date" in history["logs"][1]


def test_restored_stage_has_its_own_mlflow_run_tagged_restored_with_the_restored_metrics(history):
    runs = mlflow_runs()
    pipelines = [r for r in runs if r.data.tags.get("faceops.kind") == "pipeline"]  # named by their params
    assert all(r.info.run_name.startswith("pipeline") for r in pipelines)
    stages = [r for r in runs if r.info.run_name == STAGE]
    assert len(pipelines) == 3 and len(stages) == 3
    ran = [r for r in stages if r.data.tags.get("dvc.restored") != "true"]
    (restored,) = [r for r in stages if r.data.tags.get("dvc.restored") == "true"]
    assert restored.info.status == "FINISHED"
    tags = restored.data.tags
    assert tags["mlflow.parentRunId"] == pipelines[2].info.run_id and tags["dvc.stage"] == STAGE
    assert tags["prefect.flow_run_id"] == pipelines[2].data.tags["prefect.flow_run_id"]
    assert tags["dvc.restored_from"] == ran[0].info.run_id  # the value-1 run that produced these outputs
    assert restored.data.params == {"count.value": "1"} == ran[0].data.params
    assert restored.data.metrics == json.loads(history["states"][0]["metrics"]) == ran[0].data.metrics
    lock = history["states"][2]["lock"]
    assert tags["dvc.out.out"] == next(o["md5"] for o in lock["outs"] if o["path"] == "out")
    assert tags["dvc.dep.count.py"] == lock["deps"][0]["md5"]
    assert pipelines[2].data.metrics["pipeline/stages_restored"] == 1.0
    assert pipelines[2].data.metrics["pipeline/stages_ran"] == 0.0
    assert pipelines[0].data.metrics["pipeline/stages_restored"] == 0.0


def test_force_runs_the_cmd_even_when_the_run_cache_holds_the_run(history):
    root = history["root"]
    result, _ = run(root, force=True)
    assert result["ran"] and not result["restored"]
    assert executions(root) == ["1", "2", "1"]
    assert snapshot(root)["out"] != history["states"][0]["out"]  # a fresh execution, not the cached bytes


def test_outputs_left_half_written_are_replaced_by_the_restored_ones(history):
    """A failed run's leftovers (files DVC's cache has no copy of) do not stop a restore: as `dvc repro` does, the
    stage's outputs are removed and the cached ones checked out."""
    root = history["root"]
    set_value(root, 2)
    (root / "out/result.bin").write_bytes(b"half-written")
    (root / "out/partial.tmp").write_bytes(b"left behind")
    (root / "metrics/count.json").write_text("{")
    result, _ = run(root)
    assert result["restored"] and not result["ran"]
    assert executions(root) == ["1", "2", "1"]
    assert snapshot(root) == history["states"][1]
    assert sorted(p.name for p in (root / "out").iterdir()) == ["result.bin"]
