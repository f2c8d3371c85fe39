"""Real servers on loopback for integration tests: Prefect, MLflow and moto's S3, each started as its own
process (moto: a thread) by the test and stopped by PID. Nothing binds to anything but 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
QUIET = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, seconds: float = 90) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode}): {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"server at {url} not healthy after {seconds}s")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[dict[str, str]]:
    """A Prefect server with its own ``PREFECT_HOME``; yields the client environment (``PREFECT_API_URL``, ...)."""
    env = {**os.environ, **QUIET, "PREFECT_HOME": str(home)}
    port = free_port()
    proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/health", proc)
        yield {"PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_HOME": str(home)}
    finally:
        stop(proc)


@contextlib.contextmanager
def mlflow_server(workdir: Path, artifacts: str | None = None, env: dict[str, str] | None = None
                  ) -> Iterator[dict[str, str]]:
    """An MLflow tracking server (SQLite store in ``workdir``, artifacts in ``workdir/artifacts`` or ``artifacts``,
    e.g. an ``s3://`` URI with ``MLFLOW_S3_ENDPOINT_URL`` in ``env``); yields ``{"MLFLOW_TRACKING_URI": ...}``."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
         "--artifacts-destination", artifacts or str(workdir / "artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        env={**os.environ, **QUIET, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        yield {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
    finally:
        stop(proc)


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """moto's S3 over HTTP on loopback (a thread in this process); yields the client environment: endpoint and
    dummy credentials (``AWS_ENDPOINT_URL``, ``MLFLOW_S3_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        yield {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    finally:
        server.stop()
