"""``infra/docker-compose.yml`` as the one definition of the stack's services; ``faceops stack`` runs them locally.

The compose file says which services a deployment runs, their command lines, published ports, work pools and quiet
settings. ``faceops stack`` reads those from it and swaps only what a machine without Docker must: SQLite files for
PostgreSQL, moto (``--s3``) or local folders for MinIO, 127.0.0.1 for 0.0.0.0, the interpreter's ``-m`` for a
container's entry point (``LOCAL_FLAGS``, ``DROPPED_FLAGS``). Each compose service has its local counterpart or a
stated reason for none in ``LOCAL``; ``tests/stages/test_infra.py`` fails when a service is added without one.
Interpolation follows compose: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``; ``$${``
escapes.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from faceops.processes import HOST, StackError

COMPOSE_FILE = Path("infra") / "docker-compose.yml"
# this checkout's compose file: the code and the service definitions come from one commit
_SOURCE = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")

# compose service → (whether the local stack runs its command, what stands for it locally)
LOCAL: dict[str, tuple[bool, str]] = {
    "postgres": (False, "SQLite files: the repository's mlflow.db, Prefect's under .faceops/stack/prefect"),
    "minio": (False, "with --s3, moto's S3 (in memory); else folders: mlruns/, .faceops/stack/dvc-remote"),
    "minio-init": (False, "with --s3, the bucket is created on moto once it answers"),
    "mlflow": (True, "on the repository's store (mlflow.db, mlruns/); with --s3, its own store"),
    "prefect-server": (True, "on SQLite in .faceops/stack/prefect"),
    "cpu-worker": (True, "with --workers"),
    "gpu-worker": (True, "with --workers; its flow runs use this machine's devices"),
    "ray-head": (False, "none: without a cluster, `faceops launch` starts a local Ray instance"),
    "ray-gpu-node": (False, "none, as ray-head"),
}
LOCAL_FLAGS = {"--host": HOST, "--workers": "1"}  # loopback only; one MLflow web worker on a laptop
DROPPED_FLAGS = {  # container-only options: how many values each takes, and why the local stack drops it
    "--with-healthcheck": (0, "serves a worker's health on port 8080, which two local workers would share"),
    "--limit": (1, "sized for a team machine's GPUs; locally, params pipeline.jobs bounds stages across pools"),
}


def interpolate(text: str, env: Mapping[str, str], *, lenient: bool = False) -> str:
    """Compose's ``${VAR...}`` interpolation of ``text`` with ``env`` and the defaults written in it; ``$$`` stays
    (the container's shell expands it). A required or default-less unset variable raises KeyError naming it, or
    becomes "" when ``lenient`` (the local stack replaces every secret)."""

    def value(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in env and (env[name] or ":" not in op):
            return env[name]
        if op.endswith("-"):
            return arg
        if lenient:
            return ""
        raise KeyError(f"${{{name}}} is unset and has no default")

    return VARIABLE.sub(value, text)


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise StackError(f"{path}: cannot read the stack's service definitions ({exc}); restore it from git") from exc
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise StackError(f"{path}: no `services:` mapping; restore it from git")
    return data


def compose(root: Path | None = None) -> dict[str, Any]:
    """The parsed compose file of ``root`` (default: this checkout), not yet interpolated."""
    return _load((root or _SOURCE) / COMPOSE_FILE)


def service(name: str, root: Path | None = None) -> dict[str, Any]:
    found = compose(root)["services"].get(name)
    if found is None:
        raise StackError(f"{(root or _SOURCE) / COMPOSE_FILE} has no service {name!r}; restore it from git")
    return found


def quiet_env(root: Path | None = None) -> dict[str, str]:
    """The settings that keep every server quiet and offline (the file's ``x-quiet-env``)."""
    return {k: str(v) for k, v in (compose(root).get("x-quiet-env") or {}).items()}


def published_port(name: str, env: Mapping[str, str], root: Path | None = None) -> int:
    """The host port service ``name`` publishes first, interpolated with ``env`` (e.g. ``MLFLOW_PORT``)."""
    spec = interpolate(str(service(name, root)["ports"][0]), env, lenient=True)
    try:
        return int(spec.rsplit(":", 2)[-2])
    except (ValueError, IndexError):
        raise StackError(f"service {name!r} publishes {spec!r}, which names no host port: check PREFECT_PORT / "
                         "MLFLOW_PORT in the environment, or pass the port option") from None


def local_command(name: str, env: Mapping[str, str], root: Path | None = None, **flags: str) -> list[str]:
    """Service ``name``'s command line as a local process: this interpreter's ``-m`` for the entry point,
    ``LOCAL_FLAGS`` and ``flags`` (``port="5000"`` sets ``--port``) over the file's values, ``DROPPED_FLAGS`` gone."""
    words = [interpolate(str(w), env, lenient=True) for w in service(name, root)["command"]]
    values = {**LOCAL_FLAGS, **{f"--{k.replace('_', '-')}": v for k, v in flags.items()}}
    out = [sys.executable, "-m", words[0]]
    rest = iter(words[1:])
    for word in rest:
        if word in DROPPED_FLAGS:
            for _ in range(DROPPED_FLAGS[word][0]):
                next(rest, None)
            continue
        out.append(word)
        if word in values:
            out.append(values[word])
            next(rest, None)
    return out


def _worker_pools(root: Path | None) -> dict[str, str]:
    """pool → the compose service of the Prefect worker that polls it, in file order."""
    found = {}
    for name, spec in compose(root)["services"].items():
        words = [str(w) for w in spec.get("command") or []]
        if words[:3] == ["prefect", "worker", "start"] and "--pool" in words:
            found[words[words.index("--pool") + 1]] = name
    return found


def pools(root: Path | None = None) -> tuple[str, ...]:
    """The work pools the file's Prefect workers poll, in file order."""
    return tuple(_worker_pools(root))


def worker_service(pool: str, root: Path | None = None) -> str:
    found = _worker_pools(root).get(pool)
    if found is None:
        raise StackError(f"{(root or _SOURCE) / COMPOSE_FILE} has no Prefect worker for pool {pool!r}")
    return found
