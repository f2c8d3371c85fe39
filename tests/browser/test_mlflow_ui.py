"""The MLflow UI as a researcher reads it: a stage's run page, its "Model metrics" tab and the curve behind a
chart, on a real MLflow server on loopback with a run logged through ``ops.tracking.stage_run``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.servers import mlflow_server

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = (27, 54, 81, 108)  # the optimiser step at each epoch's end, as the FR trainer logs its epochs
ACCURACY = (0.52, 0.61, 0.68, 0.74)

# an evaluation's summary: two set sizes of one family, a count and a bound (details, not columns)
SUMMARY = {"sets/gain/caface/n=4/rank1": 0.5, "sets/gain/caface/n=16/rank1": 0.75, "sets/caface/n_mated": 40.0,
           "sets/caface/rank1_ci_low": 0.52}
# a stage as the trainers log it: per-epoch points, then the stage's summary (no step) equal to the last point
STAGE = textwrap.dedent(f"""
    from pathlib import Path
    from ops.tracking import stage_run

    with stage_run("train_fr", {{"fr": {{"epochs": {len(STEPS)}}}}}, Path.cwd()) as tracker:
        for epoch, (step, acc) in enumerate(zip({STEPS!r}, {ACCURACY!r})):
            tracker.log_metrics({{"val/accuracy": acc, "train/loss": 2.0 / (epoch + 1), "epoch": epoch}}, step=step)
        tracker.log_metrics({{"val/accuracy": {ACCURACY[-1]!r}, "train/loss": 0.5}})
""")


# an evaluation as `evaluate` logs its summary
EVALUATE = textwrap.dedent(f"""
    from pathlib import Path
    from ops.tracking import stage_run

    with stage_run("evaluate", {{}}, Path.cwd()) as tracker:
        tracker.log_metrics({{"sets/caface/rank1": 0.6, **{SUMMARY!r}}})
""")


def _server_with(tmp_path_factory, script: str):
    """A server with the one finished run ``script`` logs; yields (server URL, experiment id, run id)."""
    from mlflow import MlflowClient

    work = tmp_path_factory.mktemp("mlflow_ui")
    (work / "stage.py").write_text(script)
    with mlflow_server(work) as env:
        proc = subprocess.run([sys.executable, "stage.py"], cwd=work, capture_output=True, text=True, timeout=180,
                              env={**os.environ, **env, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        experiment = client.get_experiment_by_name("faceops")
        (run,) = client.search_runs([experiment.experiment_id])
        yield env["MLFLOW_TRACKING_URI"], experiment.experiment_id, run.info.run_id


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A server with one finished ``train_fr`` run; yields (server URL, experiment id, run id)."""
    yield from _server_with(tmp_path_factory, STAGE)


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A server with one finished ``evaluate`` run (``SUMMARY`` and a column); yields as ``logged_run``."""
    yield from _server_with(tmp_path_factory, EVALUATE)


def _is_history_of(response, key: str) -> bool:
    """The UI's own call for a metric's history (``get-history`` or ``get-history-bulk-interval``)."""
    url = urlsplit(response.url)
    return "/ajax-api/2.0/mlflow/metrics/get-history" in url.path and parse_qs(url.query).get("metric_key") == [key]


def test_run_page_shows_the_metric_curve_with_every_logged_step(page, logged_run):
    base, experiment_id, run_id = logged_run
    page.goto(f"{base}/#/experiments/{experiment_id}/runs/{run_id}")
    # the overview's metrics table: the run's value is the curve's final value
    page.get_by_text("val/accuracy", exact=True).first.wait_for()
    row = page.get_by_role("row").filter(has_text="val/accuracy").first
    assert str(ACCURACY[-1]) in row.inner_text()

    with page.expect_response(lambda r: _is_history_of(r, "val/accuracy"), timeout=60_000) as answer:
        page.get_by_role("tab", name="Model metrics").click()
    response = answer.value
    assert response.ok, response.status
    points = [(m["step"], m["value"]) for m in json.loads(response.text())["metrics"] if m["key"] == "val/accuracy"]
    steps = [int(step) for step, _ in points]
    assert steps == list(STEPS), points  # no summary point at step 0 before or after the curve
    assert all(b > a for a, b in zip(steps, steps[1:]))
    assert [round(v, 6) for _, v in points] == list(ACCURACY)
    assert points[-1][1] == pytest.approx(ACCURACY[-1])

    # the chart itself: an "accuracy" chart in the "val" section, its legend naming the run and the metric
    legend = page.get_by_text("train_fr (val/accuracy)", exact=True).first
    legend.wait_for(state="attached")
    legend.scroll_into_view_if_needed()
    assert legend.is_visible()
    assert page.get_by_text("accuracy", exact=True).first.is_visible()


def test_after_one_click_on_model_training_the_experiment_opens_on_its_runs(page, logged_run):
    """MLflow 3's UI starts in its GenAI mode, where an experiment opens on a traces overview that is empty for
    faceops; `docs/operations/running.md` tells a user to click *Model training* in the sidebar once (the browser
    keeps it). After that the experiment opens on its runs, the stage run in the table."""
    base, experiment_id, _ = logged_run
    page.goto(f"{base}/#/experiments/{experiment_id}")
    page.wait_for_url("**workflowType=genai**")  # what a first visit gets: the defect the docs step answers
    page.goto(f"{base}/")
    page.get_by_text("Model training", exact=True).first.click()
    page.goto(f"{base}/#/experiments/{experiment_id}")
    page.get_by_text("train_fr", exact=True).first.wait_for()
    assert "/runs" in page.url and "workflowType=machine_learning" in page.url, page.url


def test_the_address_faceops_prints_opens_the_runs_table(page, logged_run):
    """`faceops stack up` prints the experiment's address as ``ops.run_store.runs_page`` gives it: a browser that never
    chose a mode opens it on the runs table, the stage run in it, not on the GenAI traces overview."""
    from ops.run_store import runs_page

    base, experiment_id, _ = logged_run
    page.goto(f"{base}{runs_page(experiment_id)}")
    page.get_by_text("train_fr", exact=True).first.wait_for()
    assert "workflowType=genai" not in page.url, page.url
    assert page.get_by_role("button", name="Columns").count() == 1  # the runs table's own control


def test_the_columns_picker_lists_compared_numbers_not_their_counts_and_bounds(page, evaluated_run):
    """The runs table's Columns picker has one entry per metric key: the set-size family is one entry (a curve over
    set size), and the count and the bound are not there (they are in the run's metrics/details.json)."""
    base, experiment_id, run_id = evaluated_run
    page.goto(f"{base}/")
    page.get_by_text("Model training", exact=True).first.click()
    page.goto(f"{base}/#/experiments/{experiment_id}")
    page.get_by_text("evaluate", exact=True).first.wait_for()
    page.get_by_role("button", name="Columns").click()
    page.get_by_text("Metrics (2)", exact=True).wait_for()  # sets/caface/rank1, sets/gain/caface/rank1
    for key in ("sets/caface/rank1", "sets/gain/caface/rank1"):
        assert page.get_by_text(key, exact=True).count() == 1, key
    assert page.get_by_text("sets/caface/n_mated", exact=True).count() == 0

    page.goto(f"{base}/#/experiments/{experiment_id}/runs/{run_id}/artifacts")
    page.get_by_text("metrics", exact=True).first.click()  # the run's artifact tree: metrics/details.json
    page.get_by_text("details.json", exact=True).first.click()
    page.get_by_text("sets/caface/n_mated").first.wait_for()


# a pipeline run and its folded stage runs; the stages' keys are named as in a default run
STAGE_KEYS = {"align": {"align/residual_nme": 0.03}, "train_aligner": {"test/nme": 0.05, "val/nme": 0.06},
              "evaluate": {"real/verification/accuracy": 0.8, "sets/videos_single/caface/rank1": 0.35}}


# a pipeline as flows.pipeline logs it; in its own process, as `_server_with`'s: the fluent API's tracking URI and
# active experiment are process-wide (mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI), so later tests keep them
PIPELINE = textwrap.dedent("""
    import sys
    import mlflow
    from ops.tracking import log_summary

    stage_keys, parent_holds_summary = {stage_keys!r}, sys.argv[1] == "1"
    mlflow.set_experiment("faceops")
    with mlflow.start_run(run_name="pipeline default"):
        mlflow.log_metrics({{"pipeline/wall_seconds": 1200.0, "pipeline/stages_ran": 3.0}})
        if parent_holds_summary:
            log_summary({{k: v for keys in stage_keys.values() for k, v in keys.items()}})
        for stage, keys in stage_keys.items():
            with mlflow.start_run(run_name=stage, nested=True):
                log_summary(keys)
""")


def _pipeline_store(tmp_path_factory, parent_holds_summary: bool):
    """A server with one pipeline run and a nested run per stage of ``STAGE_KEYS``; the pipeline run holds its own
    timings and, when ``parent_holds_summary``, the stages' numbers as ``flows.pipeline`` logs them."""
    from mlflow import MlflowClient

    work = tmp_path_factory.mktemp("mlflow_chart")
    (work / "pipeline.py").write_text(PIPELINE.format(stage_keys=STAGE_KEYS))
    with mlflow_server(work) as env:
        proc = subprocess.run([sys.executable, "pipeline.py", str(int(parent_holds_summary))], cwd=work,
                              capture_output=True, text=True, timeout=180,
                              env={**os.environ, **env, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        experiment = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_experiment_by_name("faceops")
        yield env["MLFLOW_TRACKING_URI"], experiment.experiment_id


def _chart_sections(page, base: str, experiment_id: str) -> dict[str, int]:
    """The chart view's sections as the page shows them: name → the chart count beside it."""
    from ops.run_store import runs_page

    page.goto(f"{base}{runs_page(experiment_id)}&compareRunsMode=CHART")
    page.get_by_text("pipeline", exact=True).first.wait_for()
    page.wait_for_timeout(1500)  # the sections settle once the folded runs' keys have loaded
    text = page.inner_text("body")
    return {name: int(count) for name, count in re.findall(r"\n([\w/.@=-]+)\n\((\d+)\)\n", text)}


@pytest.mark.parametrize("parent_holds_summary", [False, True], ids=["stage-runs-only", "as-faceops-logs"])
def test_the_chart_view_opens_without_an_empty_section(page, tmp_path_factory, parent_holds_summary):
    """With the stage runs folded under their pipeline run (as the table opens), MLflow shows an empty section for
    the first metric prefix only folded runs hold; the pipeline run holding its stages' numbers fills it, and every
    section of a faceops prefix has a chart of the pipeline run."""
    for base, experiment_id in _pipeline_store(tmp_path_factory, parent_holds_summary):
        sections = _chart_sections(page, base, experiment_id)
    ours = {name: n for name, n in sections.items() if name not in ("Model metrics", "System metrics")}
    assert ours.get("pipeline") == 2, sections
    if parent_holds_summary:
        assert min(ours.values()) >= 1, sections
        assert {"align", "test", "real/verification"} <= set(ours), sections
    else:  # the defect the pipeline's summary answers, as MLflow shows it
        assert 0 in ours.values(), sections
