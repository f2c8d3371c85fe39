"""What every ``faceops`` command shares: one red ``error:`` line and an exit status, a quiet environment for the
libraries the command loads, and the repository root it must run from. Imports nothing but typer, so any command
module can use it without importing the others."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NoReturn

import typer
from typer.core import TyperOption


def _flags_take_no_value() -> None:
    """typer's rich help prints ``<bool>`` in the type column of every flag (``--force / --no-force``, ``--help``),
    as if it took a value; a flag takes none (plain click help shows nothing there), so the column stays empty."""
    shown = TyperOption.display_type_rich
    if getattr(shown, "faceops", False):
        return

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.faceops = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` to stderr and exit with ``code`` (2: bad input, 1: the work itself failed)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def quiet_env() -> None:
    """No analytics or telemetry from the libraries a command loads, no Hugging Face downloads; set only where unset."""
    for key, value in {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
        "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        # without PREFECT_API_URL a flow starts a temporary local Prefect server: give it time on a busy machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    }.items():
        os.environ.setdefault(key, value)


def repo_root(command: str = "faceops") -> Path:
    """The current directory, which must hold ``dvc.yaml``; else ``fail`` telling to run ``command`` from the root."""
    root = Path.cwd()
    if not (root / "dvc.yaml").is_file():
        fail(f"no dvc.yaml in {root}: run {command} from the repository root.")
    return root


class _RefusalWithoutTraceback(logging.Filter):
    """Keeps an expected refusal (a ``FaceopsError``) that Prefect logs for a failed task or flow run to its message:
    the command prints the reason once, and the traceback of a refusal says nothing more."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ml.errors import FaceopsError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FaceopsError):
            record.exc_info, record.exc_text = None, None
        return True


def refusals_without_traceback() -> None:
    """Install ``_RefusalWithoutTraceback`` on Prefect's run loggers (once): expected refusals print one line."""
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RefusalWithoutTraceback) for f in logger.filters):
            logger.addFilter(_RefusalWithoutTraceback())
