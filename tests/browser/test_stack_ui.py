"""The stack's MLflow UI as a newcomer opens it after `make run`: `faceops stack up` in a repository whose `mlflow.db`
already holds runs logged without a server (as `make run` logs them), then the experiment page in headless Chromium
lists those runs, and a run's artifact opens from its page."""

from __future__ import annotations

import pytest

from tests.conftest import copy_project
from tests.stages.test_stack import stack_over_logged_runs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack_after_make_run(tmp_path_factory):
    from mlflow import MlflowClient

    root = copy_project(tmp_path_factory.mktemp("stack-ui"))
    with stack_over_logged_runs(root) as (url, _, stage_id, _):
        yield url, MlflowClient(url).get_experiment_by_name("faceops").experiment_id, stage_id


def test_the_stacks_mlflow_ui_lists_the_runs_make_run_logged(page, stack_after_make_run):
    url, experiment_id, stage_id = stack_after_make_run
    page.goto(f"{url}/#/experiments/{experiment_id}/runs")  # the experiment `faceops run` logs to: its runs list
    try:
        page.get_by_text("pipeline", exact=True).first.wait_for()
    except Exception:
        pytest.fail("the runs list shows no `pipeline` run:\n" + page.inner_text("body")[:3000])
    page.goto(f"{url}/#/experiments/{experiment_id}/runs/{stage_id}")
    page.get_by_text("train_fr@real").first.wait_for()
    page.get_by_text("train/accuracy", exact=True).first.wait_for()
    page.get_by_role("tab", name="Artifacts").click()
    page.get_by_text("notes").first.click()
    page.get_by_text("hello.txt").first.click()
    page.get_by_text("from make run").first.wait_for()
