"""S3 storage against moto's S3 HTTP server on loopback: round trips, multipart, skipping identical files,
checksum mismatches, retries through a fault-injecting proxy, an unreachable endpoint, the `faceops data` commands,
DVC through the remote they configure, and no credential in any output."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ml.errors import ConfigError
from tasks.storage import INDEX_NAME, S3Store, StorageConfig, StorageError, file_sha256, storage_config

from .servers import FaultProxy, closed_port_url, moto_s3

BUCKET = "faceops-test"
SECRET = f"faceops-secret-{uuid.uuid4().hex}"  # moto accepts any credentials; this value must never be printed
FACEOPS = [sys.executable, "-m", "faceops.cli"]
MB = 1024 * 1024


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


@pytest.fixture
def store(s3, request):
    """A store factory: each test under its own prefix; keyword arguments override StorageConfig fields."""
    def make(**overrides) -> S3Store:
        return S3Store(StorageConfig(bucket=BUCKET, prefix=f"t/{request.node.name}", **overrides))
    return make


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def contents(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


SAMPLE = {"a.txt": b"alpha\n", "empty": b"", "deep/er/b.bin": bytes(range(256)) * 40, "deep/c.json": b'{"k": 1}'}


def test_directory_round_trip_is_byte_identical(store, tmp_path):
    s = store()
    src = tree(tmp_path / "src", SAMPLE)
    pushed = s.push_dir(src, "dir", progress=False)
    assert (pushed.files, pushed.transferred) == (4, 4)
    pulled = s.pull_dir("dir", tmp_path / "dst", progress=False)
    assert (pulled.transferred, pulled.skipped) == (4, 0)
    assert contents(tmp_path / "dst") == SAMPLE  # nothing more (no index, no temporary files), nothing less
    again = s.push_dir(src, "dir", progress=False)
    assert (again.transferred, again.skipped) == (0, 4)  # the published index already lists these contents
    index = json.loads(s.get_bytes(f"dir/{INDEX_NAME}"))
    assert {e["path"]: (e["sha256"], e["size"]) for e in index["files"]} == {
        rel: (file_sha256(src / rel), len(data)) for rel, data in SAMPLE.items()}


def test_large_file_goes_up_in_parts_and_comes_back_identical(store, tmp_path):
    s = store(multipart_threshold_mb=5, multipart_chunk_mb=5)
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).integers(0, 256, 11 * MB, dtype=np.uint8).tobytes())
    sha = s.upload_file(big, "big.bin")
    head = s.client.head_object(Bucket=BUCKET, Key=s.key("big.bin"))
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 1 MiB: a multipart ETag carries the part count
    assert head["Metadata"]["sha256"] == sha == file_sha256(big)
    out = s.download_file("big.bin", tmp_path / "back.bin")
    assert out.read_bytes() == big.read_bytes()


def test_pull_skips_files_already_identical(store, tmp_path):
    s = store()
    src = tree(tmp_path / "src", SAMPLE)
    s.push_dir(src, "dir", progress=False)
    dst = tmp_path / "dst"
    s.pull_dir("dir", dst, progress=False)
    (dst / "a.txt").write_bytes(b"changed locally\n")
    (dst / "deep/c.json").unlink()
    untouched = {rel: (dst / rel).stat().st_mtime_ns for rel in ("empty", "deep/er/b.bin")}
    time.sleep(0.01)
    pulled = s.pull_dir("dir", dst, progress=False)
    assert (pulled.files, pulled.transferred, pulled.skipped) == (4, 2, 2)
    assert contents(dst) == SAMPLE
    assert {rel: (dst / rel).stat().st_mtime_ns for rel in untouched} == untouched


def test_corrupt_object_is_detected_and_nothing_half_written(store, tmp_path):
    s = store()
    src = tree(tmp_path / "src", SAMPLE)
    s.push_dir(src, "dir", progress=False)
    key = s.key("dir/deep/er/b.bin")
    good = s.client.head_object(Bucket=BUCKET, Key=key)
    # behind the store's back: other bytes under the same key, even with the original sha256 metadata
    s.client.put_object(Bucket=BUCKET, Key=key, Body=b"corrupt" * 100, Metadata=good["Metadata"])
    dst = tree(tmp_path / "dst", {"deep/er/b.bin": b"an older local version"})
    with pytest.raises(StorageError) as err:
        s.pull_dir("dir", dst, progress=False)
    message = str(err.value)
    expected, got = file_sha256(src / "deep/er/b.bin"), hashlib.sha256(b"corrupt" * 100).hexdigest()
    assert "checksum mismatch" in message and key in message and expected in message and got in message
    assert (dst / "deep/er/b.bin").read_bytes() == b"an older local version"  # not replaced by the corrupt bytes
    assert not [p for p in dst.rglob("*") if ".part-" in p.name]  # no temporary file left behind
    with pytest.raises(StorageError, match="checksum mismatch"):  # one file, verified by its metadata alone
        s.download_file("dir/deep/er/b.bin", tmp_path / "single.bin")
    assert not list(tmp_path.glob("*single.bin*"))


def test_throttling_server_errors_and_dropped_connections_are_retried(s3, store, tmp_path):
    src = tree(tmp_path / "src", SAMPLE)
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"], ["slowdown", "500", "drop"])
    with proxy.serve() as url:
        s = store(endpoint_url=url, max_attempts=4)
        pushed = s.push_dir(src, "dir", progress=False)
        assert [fault for _, _, fault in proxy.served[:4]] == ["slowdown", "500", "drop", "forwarded"]
        proxy.faults = ["drop", "slowdown"]
        pulled = s.pull_dir("dir", tmp_path / "dst", progress=False)
    assert pushed.transferred == pulled.transferred == 4
    assert contents(tmp_path / "dst") == SAMPLE
    assert sum(fault != "forwarded" for _, _, fault in proxy.served) == 5


def test_more_failures_than_attempts_raise_naming_endpoint_and_key(s3, store, tmp_path):
    (tmp_path / "x.txt").write_text("x")
    proxy = FaultProxy(s3["AWS_ENDPOINT_URL"], ["slowdown", "500", "slowdown", "slowdown"])
    with proxy.serve() as url:
        s = store(endpoint_url=url, max_attempts=3)
        with pytest.raises(StorageError) as err:
            s.upload_file(tmp_path / "x.txt", "x.txt")
    assert len(proxy.served) == 3  # exactly max_attempts requests, then the error
    message = str(err.value)
    assert url in message and f"s3://{BUCKET}/{s.key('x.txt')}" in message and "3 attempt(s)" in message
    assert "storage.max_attempts" in message


def test_unreachable_endpoint_fails_quickly_with_a_clear_error(store, tmp_path):
    url = closed_port_url()
    s = store(endpoint_url=url, max_attempts=2, connect_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        s.pull_dir("dir", tmp_path / "dst", progress=False)
    assert time.monotonic() - start < 15
    message = str(err.value)
    assert url in message and "2 attempt(s)" in message and "storage.endpoint_url" in message
    assert not (tmp_path / "dst").exists()


def test_config_refuses_credentials_and_bad_values():
    for key in ("aws_secret_access_key", "access_key", "secret", "session_token", "password"):
        with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY") as err:
            storage_config({"storage": {"bucket": "b", key: "hunter2"}})
        assert "hunter2" not in str(err.value) and f"storage.{key}" in str(err.value)
    with pytest.raises(ConfigError, match="user name or password") as err:
        storage_config({"storage": {"endpoint_url": "http://minio:hunter2@127.0.0.1:9000"}})
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="storage.multipart_chunk_mb"):
        storage_config({"storage": {"multipart_chunk_mb": 4}})
    with pytest.raises(ConfigError, match="Did you mean 'storage.max_attempts'"):
        storage_config({"storage": {"max_attempt": 3}})
    with pytest.raises(ConfigError, match="storage.bucket"):
        S3Store(storage_config({}))
    assert storage_config({"storage": {"bucket": "b", "retry_mode": "adaptive"}}).retry_mode == "adaptive"


def test_publications_are_filed_under_the_git_commit(tmp_path):
    from tasks.storage import run_id

    assert re.fullmatch(r"\d{8}T\d{6}Z", run_id(tmp_path))  # outside git: the UTC time
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}
    (tmp_path / "f").write_text("1")
    for args in (["init", "-q"], ["add", "f"], ["commit", "-qm", "c", "--no-verify"]):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert run_id(tmp_path) == head[:12]
    (tmp_path / "f").write_text("2")
    assert re.fullmatch(rf"{head[:12]}-dirty-\d{{8}}T\d{{6}}Z", run_id(tmp_path))


# ── the commands ───────────────────────────────────────────────────────────────────────────────────────────────


def project(root: Path, **storage) -> Path:
    """A minimal working copy for `faceops data`: params.yaml with a storage section, one procedural dataset."""
    from ml.data.dataset import DatasetWriter

    root.mkdir(parents=True)
    (root / "params.yaml").write_text(json.dumps({"storage": {"bucket": BUCKET, **storage}}))
    rng = np.random.default_rng(0)
    with DatasetWriter(root / "data/prepared/tiny", name="tiny", source="procedural", aligned=True) as w:
        for i in range(6):
            w.add(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), identity=f"id{i % 2}")
    tree(root / "data/prepared/gfd", {"split.json": b"{}"})
    return root


def faceops(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(FACEOPS + args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                               **env})


def test_data_commands_push_ls_pull_publish(s3, tmp_path):
    from ml.data.dataset import dataset_digest

    root = project(tmp_path / "ws", prefix="cli")
    digest = json.loads((root / "data/prepared/tiny/dataset.json").read_text())["digest"]
    out = faceops(["data", "push", "tiny", "gfd"], root)
    assert out.returncode == 0, out.stderr
    assert f"s3://{BUCKET}/cli/datasets/tiny/{digest}/" in out.stdout
    assert "all identical already" in faceops(["data", "push", "tiny"], root).stdout
    tree(root / "models/fr/real", {"config.json": b"{}", "model.safetensors": b"weights"})
    tree(root / "reports", {"benchmark.md": b"# numbers\n"})
    tree(root / "metrics", {"evaluate.json": b"{}"})
    out = faceops(["data", "publish", "models", "reports/benchmark.md", "metrics", "--id", "run1"], root)
    assert out.returncode == 0, out.stderr
    assert f"s3://{BUCKET}/cli/models/fr/real/run1/" in out.stdout and f"s3://{BUCKET}/cli/reports/run1/" in out.stdout

    listing = faceops(["data", "ls"], root).stdout
    assert "tiny" in listing and f"{digest[:12]}" in listing and "LATEST" in listing
    assert "fr/real" in listing and "run1" in listing

    out = faceops(["data", "pull", "tiny", "--digest", digest[:8], "--to", "pulled"], root)
    assert out.returncode == 0, out.stderr
    assert dataset_digest(root / "pulled") == digest
    out = faceops(["data", "pull", "reports/run1", "--to", "report"], root)
    assert out.returncode == 0, out.stderr
    assert (root / "report/reports/benchmark.md").read_text() == "# numbers\n"
    assert (root / "report/metrics/evaluate.json").is_file()

    out = faceops(["data", "pull", "tiny", "--digest", "ffff"], root)
    assert out.returncode == 1 and "matches no published versions" in out.stderr and digest[:12] in out.stderr
    out = faceops(["data", "push", "nosuch"], root)
    assert out.returncode == 2 and "no dataset 'nosuch'" in out.stderr and "tiny" in out.stderr


def test_no_credential_in_any_output_or_config(s3, tmp_path, caplog):
    root = project(tmp_path / "ws", prefix="secret", max_attempts=2, connect_timeout=1.0)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, check=True)
    runs = [faceops(["data", "-v", "push"], root), faceops(["data", "ls"], root), faceops(["data", "remote"], root),
            faceops(["data", "-v", "push"], root, AWS_ENDPOINT_URL=closed_port_url())]
    assert [r.returncode for r in runs] == [0, 0, 0, 1]
    assert "Could not connect" in runs[-1].stderr and "storage.endpoint_url" in runs[-1].stderr
    for r in runs:
        assert SECRET not in r.stdout + r.stderr
    for path in (root / ".dvc").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    # in process, every logger at DEBUG (botocore's request dumps included), a push and a failing pull
    with caplog.at_level(logging.DEBUG):
        s = S3Store(StorageConfig(bucket=BUCKET, prefix="secret-inproc"))
        s.push_dir(root / "data/prepared/gfd", "gfd", progress=False)
        with pytest.raises(StorageError) as err:
            S3Store(StorageConfig(bucket=BUCKET, endpoint_url=closed_port_url(), max_attempts=1)).pull_dir(
                "gfd", tmp_path / "x", progress=False)
    assert "Sending http request" in caplog.text  # botocore's debug log really was captured
    assert SECRET not in caplog.text and SECRET not in str(err.value)


def test_credential_in_params_is_refused_by_the_command(s3, tmp_path):
    root = project(tmp_path / "ws", aws_secret_access_key=SECRET)
    out = faceops(["data", "ls"], root)
    assert out.returncode == 2 and "looks like a credential" in out.stderr and "AWS_SECRET_ACCESS_KEY" in out.stderr
    assert SECRET not in out.stdout + out.stderr


def test_dvc_push_and_pull_through_the_remote_faceops_configures(s3, tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "params.yaml").write_text(f"storage:\n  bucket: {BUCKET}\n  prefix: dvcrepo\n")
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run(dvc + ["init", "--no-scm", "-q"], cwd=root, check=True)
    out = faceops(["data", "remote"], root)
    assert out.returncode == 0, out.stderr
    assert f"--artifacts-destination s3://{BUCKET}/dvcrepo/mlflow" in out.stdout
    assert f"MLFLOW_S3_ENDPOINT_URL={s3['AWS_ENDPOINT_URL']}" in out.stdout
    local = (root / ".dvc/config.local").read_text()
    assert f"s3://{BUCKET}/dvcrepo/dvc" in local and s3["AWS_ENDPOINT_URL"] in local
    assert "remote" not in (root / ".dvc/config").read_text()  # nothing machine-specific in the committed config

    payload = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    (root / "blob.bin").write_bytes(payload)
    for args in (["add", "-q", "blob.bin"], ["push", "-q"]):
        subprocess.run(dvc + args, cwd=root, check=True, capture_output=True)
    import boto3

    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="dvcrepo/dvc/")["Contents"]]
    assert keys and all(k.startswith("dvcrepo/dvc/files/md5/") for k in keys)
    (root / "blob.bin").unlink()
    shutil.rmtree(root / ".dvc/cache")
    subprocess.run(dvc + ["pull", "-q"], cwd=root, check=True, capture_output=True)
    assert (root / "blob.bin").read_bytes() == payload


@pytest.mark.slow
def test_mlflow_server_stores_artifacts_in_the_printed_destination(s3, tmp_path):
    """The flags `faceops data remote` prints, given to a real MLflow server: an artifact lands under PREFIX/mlflow."""
    import boto3
    from mlflow import MlflowClient

    from tasks.storage import mlflow_artifacts

    from .servers import mlflow_server

    destination, env = mlflow_artifacts(StorageConfig(bucket=BUCKET, prefix="mlf"))
    assert destination == f"s3://{BUCKET}/mlf/mlflow" and env == {"MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"]}
    (tmp_path / "note.txt").write_text("artifact\n")
    with mlflow_server(tmp_path, artifacts=destination, env=env) as tracking:
        client = MlflowClient(tracking["MLFLOW_TRACKING_URI"])
        run = client.create_run(client.create_experiment("storage"))
        client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="mlf/mlflow/")["Contents"]]
    assert any(k.endswith("/note.txt") for k in keys), keys
