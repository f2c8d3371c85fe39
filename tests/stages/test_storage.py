"""`faceops data` against moto's S3 HTTP server on loopback: DVC push / pull / get / ls through the remote the
``storage`` section configures, a corrupt object, an unreachable endpoint, an older version by git revision, the
MLflow artifact store on the same bucket, and no credential in any output. Throttling, server errors and dropped
connections under the same commands: tests/reliability/test_faults.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ml.errors import ConfigError
from ops.remote import StorageConfig, dvc_remote_commands, mlflow_artifacts, remote_settings, storage_config

from tests.servers import closed_port_url, moto_s3

BUCKET = "faceops-test"
SECRET = f"faceops-secret-{uuid.uuid4().hex}"  # moto accepts any credentials; this value must never be printed
FACEOPS = [sys.executable, "-m", "faceops.cli"]
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}


@pytest.fixture(scope="module")
def s3():
    """moto on loopback with the test bucket; yields the client environment (secret key: SECRET)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    with moto_s3() as env, pytest.MonkeyPatch.context() as mp:
        env = {**env, "AWS_SECRET_ACCESS_KEY": SECRET}
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield env


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def contents(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def dvc(root: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, check=True, capture_output=True)


def project(root: Path, *, scm: bool = False, **storage) -> Path:
    """A DVC working copy for `faceops data`: params.yaml with a storage section, one procedural dataset under
    ``data/prepared/tiny`` and a model file, both tracked (``dvc add``)."""
    from ml.data.dataset import DatasetWriter

    root.mkdir(parents=True)
    (root / "params.yaml").write_text(json.dumps({"storage": {"bucket": BUCKET, **storage}}))
    if scm:
        git(root, "init", "-q")
    dvc(root, "init", "-q", *([] if scm else ["--no-scm"]))
    rng = np.random.default_rng(0)
    with DatasetWriter(root / "data/prepared/tiny", name="tiny", source="procedural", aligned=True) as w:
        for i in range(6):
            w.add(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), identity=f"id{i % 2}")
    tree(root / "models/fr", {"config.json": b"{}", "model.safetensors": rng.bytes(3000)})
    dvc(root, "add", "-q", "data/prepared", "models/fr")
    return root


def faceops(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(FACEOPS + args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                               **env})


def remote_keys(prefix: str) -> list[str]:
    import boto3

    listing = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")
    return [o["Key"] for o in listing.get("Contents", [])]


def forget_local(root: Path) -> None:
    """The workspace's tracked data and DVC's cache gone: only the remote holds the bytes."""
    for path in ("data/prepared", "models/fr", ".dvc/cache"):
        shutil.rmtree(root / path)


# ── the section ───────────────────────────────────────────────────────────────────────────────────────────────


def test_config_refuses_credentials_and_bad_values():
    for key in ("aws_secret_access_key", "access_key", "secret", "session_token", "password"):
        with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY") as err:
            storage_config({"storage": {"bucket": "b", key: "hunter2"}})
        assert "hunter2" not in str(err.value) and f"storage.{key}" in str(err.value)
    with pytest.raises(ConfigError, match="user name or password") as err:
        storage_config({"storage": {"endpoint_url": "http://minio:hunter2@127.0.0.1:9000"}})
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="storage.max_attempts"):
        storage_config({"storage": {"max_attempts": 0}})
    with pytest.raises(ConfigError, match="Did you mean 'storage.max_attempts'"):
        storage_config({"storage": {"max_attempt": 3}})
    with pytest.raises(ConfigError, match="storage.bucket"):
        storage_config({}).url("dvc")
    assert storage_config({"storage": {"bucket": "b", "retry_mode": "adaptive"}}).retry_mode == "adaptive"


def test_remote_settings_carry_the_section_and_no_credential(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    cfg = StorageConfig(bucket="b", prefix="team/x", region="eu-west-1", max_concurrency=3, max_attempts=7,
                        retry_mode="adaptive", connect_timeout=2.5, read_timeout=30)
    assert remote_settings(cfg) == {"url": "s3://b/team/x/dvc", "jobs": "3", "verify": "true", "connect_timeout": "3",
                                    "read_timeout": "30", "region": "eu-west-1"}
    assert cfg.sdk_env() == {"AWS_MAX_ATTEMPTS": "7", "AWS_RETRY_MODE": "adaptive"}
    assert dvc_remote_commands(cfg)[0] == ["remote", "add", "--local", "--default", "--force", "faceops",
                                           "s3://b/team/x/dvc"]
    assert mlflow_artifacts(cfg) == ("s3://b/team/x/mlflow", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert remote_settings(cfg)["endpointurl"] == "http://127.0.0.1:9000"
    assert mlflow_artifacts(cfg)[1] == {"MLFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:9000"}


# ── the commands ───────────────────────────────────────────────────────────────────────────────────────────────


def test_push_ls_pull_round_trip_is_byte_identical_and_content_addressed(s3, tmp_path):
    from ml.data.dataset import dataset_digest

    root = project(tmp_path / "ws", prefix="cli")
    digest, before = dataset_digest(root / "data/prepared/tiny"), contents(root / "data/prepared")
    out = faceops(["data", "ls"], root)
    assert out.returncode == 0, out.stderr
    assert "data/prepared" in out.stdout and "not pushed" in out.stdout and f"s3://{BUCKET}/cli/dvc" in out.stdout

    out = faceops(["data", "push"], root)
    assert out.returncode == 0, out.stderr
    keys = remote_keys("cli/dvc")
    assert keys and all(k.startswith("cli/dvc/files/md5/") for k in keys)
    assert "up to date" in faceops(["data", "push"], root).stdout  # nothing goes up twice
    listing = faceops(["data", "ls"], root).stdout
    assert "not pushed" not in listing and listing.count(" pushed") == 2

    forget_local(root)
    out = faceops(["data", "pull", "data/prepared/tiny"], root)  # one dataset of a tracked directory
    assert out.returncode == 0, out.stderr
    assert dataset_digest(root / "data/prepared/tiny") == digest and not (root / "models/fr").exists()
    assert faceops(["data", "pull"], root).returncode == 0
    assert contents(root / "data/prepared") == before and (root / "models/fr/config.json").is_file()

    out = faceops(["data", "pull", "data/prepared", "--rev", "HEAD"], root)
    assert out.returncode == 2 and "--to" in out.stderr


def test_pull_of_an_older_version_by_git_revision(s3, tmp_path):
    root = project(tmp_path / "ws", scm=True, prefix="rev")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "v1", "--no-verify")
    old = contents(root / "models/fr")
    assert faceops(["data", "push"], root).returncode == 0
    (root / "models/fr/model.safetensors").write_bytes(b"retrained")
    dvc(root, "add", "-q", "models/fr")
    git(root, "commit", "-qam", "v2", "--no-verify")
    assert faceops(["data", "push"], root).returncode == 0
    shutil.rmtree(root / ".dvc/cache")
    out = faceops(["data", "pull", "models/fr", "--rev", "HEAD~1", "--to", "old"], root)
    assert out.returncode == 0, out.stderr
    assert contents(root / "old") == old and (root / "models/fr/model.safetensors").read_bytes() == b"retrained"


def test_corrupt_object_on_the_remote_is_refused(s3, tmp_path):
    import boto3

    root = project(tmp_path / "ws", prefix="corrupt")
    assert faceops(["data", "push", "models/fr"], root).returncode == 0
    weights = (root / "models/fr/model.safetensors").read_bytes()
    client = boto3.client("s3")
    for key in remote_keys("corrupt/dvc"):
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        if body == weights:
            client.put_object(Bucket=BUCKET, Key=key, Body=b"x" + body[1:])  # same size, wrong bytes
    forget_local(root)
    out = faceops(["data", "pull", "models/fr"], root)
    assert out.returncode == 1 and len([l for l in out.stderr.splitlines() if l.startswith("error:")]) == 1
    assert not (root / "models/fr/model.safetensors").exists()


def test_unreachable_endpoint_fails_quickly_with_a_clear_error(s3, tmp_path):
    root = project(tmp_path / "ws", prefix="down", endpoint_url=closed_port_url(), max_attempts=2, connect_timeout=1)
    start = time.monotonic()
    out = faceops(["data", "push"], root)
    assert out.returncode == 1 and time.monotonic() - start < 60
    assert "storage.endpoint_url" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_no_credential_in_any_output_or_config(s3, tmp_path):
    root = project(tmp_path / "ws", prefix="secret", max_attempts=2, connect_timeout=1.0)
    runs = [faceops(["data", "push", "-v"], root), faceops(["data", "ls"], root), faceops(["data", "remote"], root),
            faceops(["data", "push", "-v"], root, AWS_ENDPOINT_URL=closed_port_url())]
    assert [r.returncode for r in runs] == [0, 0, 0, 1]
    assert "storage.endpoint_url" in runs[-1].stderr
    assert "DEBUG" in runs[0].stdout + runs[0].stderr  # DVC's debug log, requests included, really was shown
    for r in runs:
        assert SECRET not in r.stdout + r.stderr
    for path in (root / ".dvc").rglob("*"):
        if path.is_file() and "cache" not in path.parts:
            assert SECRET.encode() not in path.read_bytes(), path


def test_credential_in_params_is_refused_by_the_command(s3, tmp_path):
    root = project(tmp_path / "ws", aws_secret_access_key=SECRET)
    out = faceops(["data", "ls"], root)
    assert out.returncode == 2 and "looks like a credential" in out.stderr and "AWS_SECRET_ACCESS_KEY" in out.stderr
    assert SECRET not in out.stdout + out.stderr


def test_remote_command_writes_only_the_local_config(s3, tmp_path):
    root = project(tmp_path / "ws", prefix="dvcrepo")
    out = faceops(["data", "remote"], root)
    assert out.returncode == 0, out.stderr
    assert f"--artifacts-destination s3://{BUCKET}/dvcrepo/mlflow" in out.stdout
    assert f"MLFLOW_S3_ENDPOINT_URL={s3['AWS_ENDPOINT_URL']}" in out.stdout
    local = (root / ".dvc/config.local").read_text()
    assert f"s3://{BUCKET}/dvcrepo/dvc" in local and s3["AWS_ENDPOINT_URL"] in local and "verify = true" in local
    assert "remote" not in (root / ".dvc/config").read_text()  # nothing machine-specific in the committed config


@pytest.mark.slow
def test_mlflow_server_stores_artifacts_in_the_printed_destination(s3, tmp_path):
    """The flags `faceops data remote` prints, given to a real MLflow server: an artifact lands under PREFIX/mlflow."""
    from mlflow import MlflowClient

    from tests.servers import mlflow_server

    destination, env = mlflow_artifacts(StorageConfig(bucket=BUCKET, prefix="mlf"))
    assert destination == f"s3://{BUCKET}/mlf/mlflow" and env == {"MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"]}
    (tmp_path / "note.txt").write_text("artifact\n")
    with mlflow_server(tmp_path, artifacts=destination, env=env) as tracking:
        client = MlflowClient(tracking["MLFLOW_TRACKING_URI"])
        run = client.create_run(client.create_experiment("storage"))
        client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    assert any(k.endswith("/note.txt") for k in remote_keys("mlf/mlflow"))
