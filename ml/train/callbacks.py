"""What the Lightning trainers (FR, UIFace generator) share: per-epoch history that survives a resume, the run
description written into every checkpoint, the refusal of device settings the machine cannot run, and following
a share of the CPU cores that changes while training runs."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from ml.errors import ConfigError


def check_device(section: str, accelerator: str, precision: str) -> None:
    """Refuse settings the machine cannot run (params ``<section>.accelerator`` / ``.precision``), instead of
    Lightning silently or obscurely changing them."""
    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    if accelerator in ("gpu", "cuda") and not cuda:
        raise ConfigError(f"{section}.accelerator {accelerator!r} but no CUDA GPU is visible; use 'auto' or 'cpu'")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda and not mps)
    if on_cpu and precision == "16-mixed":
        raise ConfigError(
            f"{section}.precision '16-mixed' needs a GPU, but {section}.accelerator {accelerator!r} runs on the CPU "
            "here; use 'bf16-mixed' (bfloat16 autocast works on the CPU) or '32-true'"
        )


def last_good_checkpoint(trainer: lightning.Trainer | None) -> str | None:
    """The newest checkpoint file this fit wrote (or resumed from), for error messages that say where to resume."""
    if trainer is None:
        return None
    for cb in trainer.checkpoint_callbacks:
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
            if path and Path(path).is_file():
                return str(path)
    return str(trainer.ckpt_path) if trainer.ckpt_path else None


class FollowCoreShare(Callback):
    """Keep torch's intra-op threads at the number written in ``path`` (one integer), re-read at most every
    ``interval`` seconds between training steps. Whoever schedules several trainings on one machine writes each
    its share of the cores there (``flows.pipeline`` does), so a training left running alone takes all the cores
    instead of keeping the share it started with. A missing or unreadable file changes nothing."""

    def __init__(self, path: str | Path, interval: float = 2.0) -> None:
        self.path = Path(path)
        self.interval = interval
        self._checked = float("-inf")

    def poll(self) -> int:
        """Apply the current share if it is due and changed; → the threads torch uses now."""
        now = time.monotonic()
        if now - self._checked >= self.interval:
            self._checked = now
            try:
                threads = int(self.path.read_text().strip())
            except (OSError, ValueError):
                threads = 0
            if threads > 0 and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()

    def on_train_batch_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.poll()


class EpochHistory(Callback):
    """Epoch means of ``keys`` from ``trainer.callback_metrics`` (``epoch`` counts from 0, as Lightning does); the
    rows travel in the checkpoint, so a resumed run's history starts at epoch 0."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        self.rows: list[dict] = []

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        metrics = trainer.callback_metrics
        row: dict[str, Any] = {"epoch": trainer.current_epoch}
        for key in self.keys:
            if key in metrics:
                row[key] = float(metrics[key])
        self.rows.append(row)

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [dict(r) for r in self.rows]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rows = [dict(r) for r in state_dict.get("rows", [])]


class RunInfo(Callback):
    """Writes what the checkpoint was trained as (``info``) into it under ``key``; trainers check it on resume."""

    def __init__(self, key: str, info: dict[str, Any]) -> None:
        self.key = key
        self.info = info

    def on_save_checkpoint(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[self.key] = self.info


def trainer_callbacks(own: Sequence[Callback], checkpoint_dir: Path | str | None, last_checkpoint: str,
                      extra: Sequence[Callback] = ()) -> tuple[list[Callback], bool]:
    """A trainer's callbacks: its ``own`` ones, then the per-epoch checkpoint ``checkpoint_dir/last_checkpoint``
    (without a monitor top-1 is the latest epoch: one file, overwritten after every epoch) when a directory is
    given, then the caller's ``extra``; → (callbacks, whether any of them checkpoints)."""
    callbacks = list(own)
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(
            dirpath=checkpoint_dir, filename=Path(last_checkpoint).stem, save_top_k=1, every_n_epochs=1,
            save_on_train_epoch_end=True, enable_version_counter=False,
        ))
    callbacks += list(extra)
    return callbacks, any(isinstance(c, ModelCheckpoint) for c in callbacks)
