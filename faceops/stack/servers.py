"""What ``faceops stack`` runs: the command line and environment of each server (Prefect, MLflow, moto's S3, a
Prefect worker per work pool) and the set-up steps that follow their start: the S3 bucket, the work pools and
deployments (schedules paused), and the crash-detection automation.

The Prefect, MLflow and worker command lines are ``infra/docker-compose.yml``'s, made local by
``faceops/stack/compose.py``; moto stands in for MinIO. ``faceops/stack`` plans and records the servers; the
integration tests' servers (``tests/servers.py``) use the same command lines.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from faceops.processes import HOST, ServerFailed, StackError
from faceops.stack.compose import local_command, pools, quiet_env, worker_service

# moto accepts any credentials; these fixed dummies keep real ones from ever being sent to it
S3_DUMMY_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}
# settings a user may have exported for another server; the stack's servers must use their own stores
_FOREIGN_SERVER_ENV = ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_API_DATABASE_CONNECTION_URL",
                       "PREFECT_SERVER_DATABASE_CONNECTION_URL")


def prefect_command(port: int) -> list[str]:
    """compose's ``prefect-server``: ``prefect server start`` on 127.0.0.1:``port`` (its SQLite store lives in
    ``PREFECT_HOME``)."""
    return local_command("prefect-server", os.environ, port=str(port))


def mlflow_command(port: int, backend_store_uri: str, artifacts_destination: str,
                   default_artifact_root: str | None = None) -> list[str]:
    """compose's ``mlflow``: ``mlflow server`` on 127.0.0.1:``port``, proxying artifacts to
    ``artifacts_destination`` (a path or s3://); with ``default_artifact_root``, experiments it creates keep their
    artifacts there instead (a path that clients without the server can read too)."""
    root = ["--default-artifact-root", default_artifact_root] if default_artifact_root else []
    return [*local_command("mlflow", os.environ, port=str(port)), "--backend-store-uri", backend_store_uri, *root,
            "--artifacts-destination", artifacts_destination]


def prefect_server_env(port: int, home: Path) -> dict[str, str]:
    """The Prefect server's environment: its own ``PREFECT_HOME``, and the API URL its UI calls. Without
    ``PREFECT_UI_API_URL`` the UI calls :4200 whatever ``--port`` says, and on another port every page of it shows
    "Can't connect to Server API"; no Prefect Cloud banners on a lab's server."""
    return {"PREFECT_HOME": str(home), "PREFECT_UI_API_URL": f"http://{HOST}:{port}/api",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false"}


def worker_command(pool: str) -> list[str]:
    """compose's worker for work pool ``pool``: ``prefect worker start --pool POOL --type process``."""
    return local_command(worker_service(pool), os.environ)


def moto_command(port: int) -> list[str]:
    """moto's S3 (all its mock AWS services) over HTTP on 127.0.0.1:``port``; state is in memory."""
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]


def server_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment, quiet and offline, without settings that point at other servers, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_SERVER_ENV}
    return {**env, **quiet_env(), **extra}


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` at the S3 ``endpoint`` with the dummy credentials (kept if it exists). boto3 retries
    connection failures; after that the error names the endpoint."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=S3_DUMMY_CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=S3_DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=3, read_timeout=10),
    )
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise ServerFailed(f"cannot create bucket {bucket!r} at S3 endpoint {endpoint}: {exc}") from exc
    except BotoCoreError as exc:
        raise ServerFailed(f"S3 endpoint {endpoint} is unreachable (after retries): {exc}") from exc


def check_git_head(url: str) -> None:
    """Refuse a local ``FACEOPS_GIT_URL`` that is not a git repository with a commit (the workers clone it)."""
    path = Path(url)
    if not path.is_dir():
        return  # a remote URL: the worker's clone says what is wrong with it
    done = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=path, capture_output=True, text=True)
    if done.returncode != 0:
        raise StackError(f"--workers: the workers clone FACEOPS_GIT_URL={url}, which is not a git repository with a "
                         "commit; commit your work (the workers run the committed HEAD) or pass --git-url")


def setup_deployments(root: Path, api_url: str, env: Mapping[str, str], log: Path) -> None:
    """Create the work pools (type process; kept if they exist), ``prefect deploy --all`` from ``root``, then pause
    the deployments' schedules: on a laptop a flow run starts when someone asks (Quick run), not at 02:00."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        for pool in pools():
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process", base_job_template=template))
        with open(log, "ab") as out:
            done = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=root,
                                  env=server_env({**env, "PREFECT_API_URL": api_url}), stdout=out,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=600)
        if done.returncode != 0:
            raise ServerFailed(f"`prefect deploy --all` failed (exit {done.returncode}); see {log}")
        for deployment in client.read_deployments():
            if any(s.active for s in deployment.schedules or []):
                client.pause_deployment(deployment.id)


def install_crash_detection(api_url: str, log: Path) -> None:
    """Install the automation that marks a flow run Crashed when its process dies silently (flows/heartbeats.py)
    on the Prefect server at ``api_url``; its output goes to the server's log."""
    env = {**os.environ, "PREFECT_API_URL": api_url}
    with open(log, "ab") as out:
        done = subprocess.run([sys.executable, "-m", "flows.heartbeats"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=120)
    if done.returncode != 0:
        raise ServerFailed(f"the Prefect server started, but installing its crash detection "
                           f"(python -m flows.heartbeats) failed; see {log}")
