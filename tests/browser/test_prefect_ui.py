"""A deployment's Quick run as a person starts it: the Prefect UI's deployment page in headless Chromium, "Run" →
"Quick run", and the flow run that click creates completes on a process worker of the deployment's pool, with the
parameter descriptions the flow's docstring gives shown in the run form. (The whole DAG at smoke size through the
stack's workers is ``tests/stages/test_stack_workers.py``, which creates its run through the same API call the UI makes.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.servers import QUIET, prefect_server, prefect_worker

pytestmark = pytest.mark.slow

TOY_FLOW = '''
from pathlib import Path
from prefect import flow


@flow(name="toy-quick")
def toy(marker: str = "quick-run.txt", greeting: str = "hello") -> str:
    """A flow a person starts from the UI.

    Args:
        marker: the file the run writes, relative to the worker's folder.
        greeting: what it writes there.
    """
    Path(marker).write_text(greeting)
    return greeting
'''

DEPLOY = """
import sys
from prefect import flow
print(flow.from_source(source=sys.argv[1], entrypoint="toy_flow.py:toy").deploy(
    name="laptop", work_pool_name="quick", print_next_steps=False))
"""


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server, pool ``quick`` (process), the toy flow deployed there; yields (UI base URL, deployment id,
    worker folder, server environment)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    work = tmp_path_factory.mktemp("prefect_ui")
    src = work / "src"
    src.mkdir()
    (src / "toy_flow.py").write_text(TOY_FLOW)
    with prefect_server(work / "prefect") as server:
        with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                client.create_work_pool(WorkPoolCreate(name="quick", type="process",
                                                       base_job_template=ProcessWorker.get_default_base_job_template()))
        # in a process of its own: while Playwright's sync API is open its loop is this thread's running loop, and
        # Prefect's dual sync/async calls (flow.from_source) would hand back coroutines here
        deploy = subprocess.run([sys.executable, "-c", DEPLOY, str(src)], env={**os.environ, **QUIET, **server},
                                capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stderr[-3000:]
        deployment_id = deploy.stdout.split()[-1]
        yield server["PREFECT_API_URL"].removesuffix("/api"), deployment_id, work, server


def _shows(page, text: str, failure: str) -> None:
    """Wait up to a minute (the UI's first load) for ``text`` on ``page``; else fail with what the page shows."""
    try:
        page.get_by_text(text).first.wait_for(timeout=60_000)
    except Exception:
        pytest.fail(f"{failure}:\n" + page.inner_text("body")[:3000])


def test_quick_run_from_the_deployment_page_completes_on_a_local_worker(page, deployed):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    ui, deployment_id, work, server = deployed
    page.goto(f"{ui}/deployments/deployment/{deployment_id}")
    _shows(page, "laptop", "the deployment page did not show the deployment")
    page.get_by_role("button", name="Run", exact=True).click()
    page.get_by_text("Quick run").first.click()
    with temporary_settings({PREFECT_API_URL: server["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        deadline = time.monotonic() + 180  # the UI's request: slow when every core is busy (the whole suite beside)
        while not (runs := client.read_flow_runs()):
            assert time.monotonic() < deadline, "the Quick run click created no flow run"
            time.sleep(1)
        (run,) = runs
        assert str(run.deployment_id) == deployment_id and run.parameters == {}  # the defaults: a Quick run
        env = {**os.environ, **QUIET, **server, "PREFECT_WORKER_QUERY_SECONDS": "1"}
        with prefect_worker("quick", env, work) as log:
            deadline = time.monotonic() + 240
            while not (run := client.read_flow_run(run.id)).state.is_final():
                assert time.monotonic() < deadline, f"{run.state.name} after 240 s:\n{log.read_text()[-3000:]}"
                time.sleep(1)
        assert run.state.is_completed(), (run.state.name, run.state.message, log.read_text()[-3000:])
    assert any(p.read_text() == "hello" for p in work.rglob("quick-run.txt"))


def test_the_custom_run_form_shows_each_parameters_description(page, deployed):
    ui, deployment_id, _, _ = deployed
    page.goto(f"{ui}/deployments/deployment/{deployment_id}/run")
    _shows(page, "the file the run writes, relative to the worker's folder.",
           "the run form shows no parameter description")
    page.get_by_text("what it writes there.").first.wait_for()
