"""Real servers on loopback for integration tests: Prefect, MLflow and moto's S3, each started as its own
process (moto: a thread) by the test and stopped by PID. Nothing binds to anything but 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# free_port, wait_healthy and stop are the ones `faceops stack` uses (stop: SIGTERM to the process group,
# then SIGKILL after 20 s); re-exported here for the tests
from faceops.processes import free_port, spawn, stop, wait_healthy
from faceops.stack.compose import quiet_env
from faceops.stack.servers import mlflow_command, prefect_command, prefect_server_env

BIN = Path(sys.executable).parent
QUIET = quiet_env()


@contextlib.contextmanager
def prefect_server(home: Path) -> Iterator[dict[str, str]]:
    """A Prefect server with its own ``PREFECT_HOME``; yields the client environment (``PREFECT_API_URL``, ...)."""
    port = free_port()
    env = {**os.environ, **QUIET, **prefect_server_env(port, home)}
    proc = spawn(prefect_command(port), env=env)
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
    proc = spawn(mlflow_command(port, f"sqlite:///{workdir / 'mlflow.db'}", artifacts or str(workdir / "artifacts")),
                 env={**os.environ, **QUIET, **(env or {})})
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


class FaultProxy:
    """A plain HTTP proxy on loopback in front of ``upstream`` (moto) that answers the first requests with the
    faults in ``faults``, in order, then forwards every request unchanged: ``"slowdown"`` = 503 SlowDown,
    ``"500"`` = 500 InternalError, ``"drop"`` = the connection closed without an answer. ``served`` lists
    ``(method, path, fault or "forwarded")`` per request. Every answer closes its connection."""

    ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
              "500": (500, "InternalError", "We encountered an internal error. Please try again.")}

    def __init__(self, upstream: str, faults: list[str]) -> None:
        import threading
        from urllib.parse import urlsplit

        self.upstream = urlsplit(upstream)
        self.faults = list(faults)
        self.served: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def next_fault(self, method: str, path: str) -> str:
        with self.lock:
            fault = self.faults.pop(0) if self.faults else "forwarded"
            self.served.append((method, path, fault))
            return fault

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Run the proxy in a thread; yields its endpoint URL."""
        import http.client
        import http.server
        import threading

        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers botocore's Expect: 100-continue

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.next_fault(self.command, self.path)
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault in proxy.ERRORS:
                    status, code, message = proxy.ERRORS[fault]
                    payload = b"" if self.command == "HEAD" else (
                        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message>"
                        f"<RequestId>fault</RequestId></Error>").encode()
                    self._answer(status, [("Content-Type", "application/xml")], payload)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in ("expect", "connection", "transfer-encoding"):
                            upstream.putheader(name, value)
                    upstream.endheaders(body)
                    response = upstream.getresponse()
                    payload = response.read()
                    headers = [(k, v) for k, v in response.getheaders()
                               if k.lower() not in ("content-length", "transfer-encoding", "connection", "date",
                                                    "server")]
                    self._answer(response.status, headers, payload,
                                 length=response.getheader("Content-Length") if self.command == "HEAD" else None)
                finally:
                    upstream.close()

            def _answer(self, status: int, headers: list[tuple[str, str]], payload: bytes,
                        length: str | None = None) -> None:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", length if length is not None else str(len(payload)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()


def closed_port_url() -> str:
    """An http URL on loopback where nothing listens (connections are refused at once)."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def prefect_worker(pool: str, env: dict[str, str], workdir: Path) -> Iterator[Path]:
    """A worker of the ``process`` work pool ``pool`` (its own process, stopped by PID) started in ``workdir`` with
    the whole environment ``env`` (``PREFECT_API_URL``, ...), which its flow runs inherit; yields its log file."""
    log = workdir / f"worker-{pool}.log"
    proc = spawn([str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name",
                  f"{pool}-worker"], env=env, log=log, cwd=workdir)
    try:
        yield log
    finally:
        stop(proc)


@contextlib.contextmanager
def mlflow_model_server(model_uri: str, env: dict[str, str] | None = None, log: Path | None = None,
                        seconds: float = 90) -> Iterator[str]:
    """``mlflow models serve -m MODEL_URI --env-manager local`` on loopback (one worker); yields its base URL once
    ``/ping`` answers. The CLI runs the scoring server as its child: both go with the process group on stop."""
    port = free_port()
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # the CLI runs `uvicorn` from PATH: this venv's
    proc = spawn([str(BIN / "mlflow"), "models", "serve", "-m", model_uri, "--env-manager", "local", "-h", "127.0.0.1",
                  "-p", str(port), "-w", "1"], env={**os.environ, **QUIET, "PATH": path, **(env or {})}, log=log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/ping", proc, seconds)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@contextlib.contextmanager
def postgres_server(workdir: Path) -> Iterator[str]:
    """A PostgreSQL 16 server (pgserver's bundled binaries, data in ``workdir``) reachable only through a Unix socket
    in ``workdir``: nothing listens on the network. Yields an SQLAlchemy URL (psycopg2, trust authentication)."""
    pgserver = pytest.importorskip("pgserver", reason="PostgreSQL tests need pgserver (pip install -e '.[test]')")
    pytest.importorskip("psycopg2", reason="PostgreSQL tests need psycopg2-binary (pip install -e '.[test]')")
    server = pgserver.get_server(workdir, cleanup_mode="stop")
    try:
        socket_dir = server.get_uri().rsplit("host=", 1)[1]
        yield f"postgresql+psycopg2://postgres@/postgres?host={socket_dir}"
    finally:
        server.cleanup()
