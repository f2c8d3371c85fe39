"""Checkpoint files shared by the plain-torch trainers (aligner, fusion, discovery) and the FR trainer's resume rule."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ml.errors import ConfigError
from ml.atomic import remove_dead_temporaries

log = logging.getLogger(__name__)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` to a temporary sibling, then ``os.replace``: a crash never leaves a truncated checkpoint.
    The temporary's name carries this process's id, so the next save removes one a killed writer left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def resume_path(checkpoint_dir: Path | str | None, resume: bool, filename: str, who: str) -> Path | None:
    """The checkpoint to continue from, or None to start afresh.

    ``resume`` without a ``checkpoint_dir`` is an error; an existing checkpoint without ``resume`` is an error too
    (it would be overwritten silently); ``resume`` with no checkpoint yet starts afresh with a warning.
    """
    if checkpoint_dir is None:
        if resume:
            raise ConfigError(f"{who}(resume=True) needs a checkpoint_dir holding {filename}")
        return None
    last = Path(checkpoint_dir) / filename
    if last.is_file():
        if not resume:
            raise ConfigError(
                f"{last} exists from an earlier run; pass resume=True to continue it, or remove it / choose another "
                "checkpoint_dir to start over"
            )
        return last
    if resume:
        log.warning("resume=True but %s holds no %s; training from scratch", checkpoint_dir, filename)
    return None
