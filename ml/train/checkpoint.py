"""The resume policy every trainer follows: which checkpoint to continue from (``resume_path``), what it must
have been trained as (``check_resume``), and the seeds derived from (seed, epoch, step) that make a resumed run
exact (``mix_seed``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ml.errors import ConfigError, DataError
from ml.train.device import DEVICE_KEYS

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


# config keys a resumed run may change: where it trains, and for how long (a longer run continues its schedule)
RESUME_FREE = (*DEVICE_KEYS, "strategy", "num_nodes", "num_workers", "num_threads", "epochs", "max_steps")


def check_resume(path: Path, key: str, section: str, info: dict[str, Any],
                 data_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Refuse to resume from ``path`` unless it is the ``section`` trainer's checkpoint (run description under
    ``key``) written as this run would write it: the same ``info["config"]`` but for ``RESUME_FREE`` and the same
    other ``info`` entries (architecture, data). A mismatch in ``data_keys`` is a DataError, any other a
    ConfigError naming the keys and both values. Refusing, not warning: a run resumed with another recipe is
    neither that recipe's run nor the first one's. → the checkpoint, for a trainer's own further checks."""
    ckpt, meta = read_checkpoint(path, key, section)
    saved, now = _flat(meta.get("config") or {}), _flat(info.get("config") or {})
    settings = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
                if k not in RESUME_FREE and saved.get(k) != now.get(k)}
    others = {k: v for k, v in info.items() if k != "config" and k not in data_keys}
    saved, now = _flat({k: meta.get(k) for k in others}), _flat(others)
    settings.update({k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v})
    if settings:
        shown = "; ".join(f"{section}.{k}: {old!r} → {new!r}" for k, (old, new) in settings.items())
        raise ConfigError(f"checkpoint {path} was written with other settings ({shown}); only where and how long a run "
                          f"trains ({', '.join(RESUME_FREE)}) may change on resume: restore them or use another "
                          "checkpoint_dir")
    data = {k: (meta.get(k), info[k]) for k in data_keys if meta.get(k) != info[k]}
    if data:
        shown = "; ".join(f"{k} {old!r}, these are {new!r}" for k, (old, new) in data.items())
        raise DataError(f"checkpoint {path} was trained on other data ({shown}); resume on the same data or use "
                        "another checkpoint_dir")
    return ckpt


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as ``{"model.block_out_channels": [8, 16], ...}``, so a refusal names the leaf that moved."""
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


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
