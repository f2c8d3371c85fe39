"""Detached background servers on 127.0.0.1: start one in its own session, wait until it answers, stop it by PID.

Each server is started in its own session and process group, so stopping it (SIGTERM to the group, SIGKILL after
a grace period) also stops any children it forked, and a closed terminal does not take it down. A recorded PID is
paired with its start time, so a PID reused by another program is never taken for ours. ``faceops stack``
(``faceops/stack``) and the integration tests' servers (``tests/servers.py``) share these helpers.
POSIX only (sessions, process groups).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from ml.errors import FaceopsError

HOST = "127.0.0.1"
STOP_TIMEOUT = 20.0  # s between SIGTERM and SIGKILL


class StackError(FaceopsError, RuntimeError):
    """Bad input or state (busy port, bad bucket name, a stack already running); the message says what to do."""


class ServerFailed(StackError):
    """A server did not start, answer or stop; the message names its URL or endpoint and its log."""


def utc_now() -> str:
    """Now, ISO-8601 UTC to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_busy(port: int, host: str = HOST) -> bool:
    """True when something listens on or holds ``host:port``: a connect succeeds, or a bind fails.

    ``SO_REUSEADDR`` makes the bind ignore sockets in TIME_WAIT, so a port freed by ``down`` a moment ago
    counts as free, as it will be for the server.
    """
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((host, port)) == 0:
            return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def spawn(cmd: Sequence[str], *, env: Mapping[str, str], log: Path | None = None, cwd: Path | None = None
          ) -> subprocess.Popen:
    """Start ``cmd`` detached: its own session and process group, stdin closed, output appended to ``log``
    (discarded without one). Its PID is the server's, and the group holds whatever it forks."""
    out: Any = subprocess.DEVNULL
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "ab")  # noqa: SIM115 - handed to the child, closed below
        out.write(f"\n── {utc_now()} {' '.join(cmd)}\n".encode())
        out.flush()
    try:
        return subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None:
            out.close()


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when ``GET url`` answers 200 within ``timeout`` seconds."""
    # loopback health checks must not go through an HTTP(S)_PROXY the user exported
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError, http.client.HTTPException):  # refused, reset, timeout, half-started server
        return False


def wait_healthy(url: str, proc: subprocess.Popen | None = None, seconds: float = 90) -> None:
    """Poll ``url`` until it answers 200. Fails at once if ``proc`` exits, else after ``seconds``, naming the URL."""
    deadline = time.monotonic() + seconds
    while True:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"the server for {url} exited with code {proc.returncode} before answering")
        if http_ok(url):
            return
        if time.monotonic() >= deadline:
            raise StackError(f"nothing healthy answered at {url} within {seconds:.0f} s")
        time.sleep(0.5)


def proc_start(pid: int) -> str | None:
    """The start time of ``pid`` (``psutil``: seconds since the epoch, to 10 ms), recorded so that a PID reused
    by another program is not taken for ours; None if it is gone."""
    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.Error, OSError):
        return None


def pid_alive(pid: int, started: str | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if ``started`` is given, is still the process started then."""
    with contextlib.suppress(ChildProcessError):  # our own child: reap it if it has exited
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        proc = psutil.Process(pid)
        if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        return started is None or f"{proc.create_time():.2f}" == started
    except psutil.AccessDenied:
        return False  # another user's process: whatever it is, it is not one we started
    except (psutil.Error, OSError):
        return False


def _group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) in process group ``pgid``."""
    members = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and os.getpgid(proc.pid) == pgid:
                members.append(proc.pid)
    return members


class Target:
    """One process to stop: a ``Popen`` we hold, or a recorded PID (and its start time)."""

    def __init__(self, target: int | subprocess.Popen, started: str | None = None) -> None:
        self.proc = target if isinstance(target, subprocess.Popen) else None
        self.pid = target.pid if isinstance(target, subprocess.Popen) else int(target)
        self.started = started
        # a server spawned detached leads its own group; never signal the group we run in ourselves
        try:
            self.group = os.getpgid(self.pid) == self.pid and self.pid != os.getpgid(0)
        except OSError:
            self.group = False

    def leader_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return pid_alive(self.pid, self.started)

    def alive(self) -> bool:
        if self.leader_alive():
            return True
        if not self.group:
            return False
        return bool(_group_members(self.pid))

    def send(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group:
                os.killpg(self.pid, sig)
            elif self.leader_alive():
                os.kill(self.pid, sig)


def stop(*targets: int | subprocess.Popen, timeout: float = STOP_TIMEOUT) -> None:
    """Stop processes (``Popen`` objects or PIDs): SIGTERM to each one's process group, wait up to ``timeout``
    seconds, then SIGKILL what is left. Processes already gone are skipped, so stopping twice is harmless."""
    stop_targets([Target(t) for t in targets], timeout)


def stop_targets(targets: Sequence[Target], timeout: float) -> None:
    """``stop`` for ``Target`` objects (recorded PIDs keep their start time)."""
    live = [t for t in targets if t.alive()]
    for t in live:
        t.send(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [t for t in live if t.alive()]
    for t in live:
        t.send(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [t for t in live if t.alive()]
    for t in targets:
        if t.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                t.proc.wait(timeout=1.0)
