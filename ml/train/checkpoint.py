"""The resume rule every trainer follows (``resume_path``), reading a checkpoint's run description before resuming
(``read_checkpoint``), and the seeds derived from (seed, epoch, step) that make a resumed run exact (``mix_seed``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ml.errors import ConfigError

log = logging.getLogger(__name__)


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers, e.g. (seed, epoch) or (seed, step, rank, stream)."""
    words = [int(v) % 2**63 for v in values]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] % 2**63)


def read_checkpoint(path: Path, key: str, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(checkpoint, its run description under ``key``) of a Lightning checkpoint written by the ``what`` trainer;
    a ConfigError that says what to do when it is unreadable or another trainer's."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, truncated or not a torch file
        raise ConfigError(f"cannot read checkpoint {path}: {exc}; remove it or pass resume=False") from exc
    meta = ckpt.get(key) if isinstance(ckpt, dict) else None
    if meta is None or "state_dict" not in ckpt:
        raise ConfigError(
            f"{path} is not a faceops {what} checkpoint (no {key!r} entry); remove it or pass resume=False"
        )
    return ckpt, meta


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
