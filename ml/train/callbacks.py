"""What the five Lightning trainers (FR, UIFace generator, DFA aligner, CAFace fusion, FaceGCD discovery) share:
``fit`` (one ``lightning.Trainer`` set up the same way for all, with the per-epoch ``last.ckpt`` and exact resume),
per-epoch history that survives a resume, the run description written into every checkpoint and a sampler of whole
batches keyed by (epoch, step). Device keys and numerics: ``ml.train.device``."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from torch.utils.data import DataLoader, Sampler

from ml.errors import TrainingError
from ml.train.device import attention_kernels, check_device, deterministic_algorithms, resolve_precision

log = logging.getLogger(__name__)


def last_good_checkpoint(trainer: lightning.Trainer | None) -> str | None:
    """The newest checkpoint file this fit wrote (or resumed from), for error messages that say where to resume."""
    if trainer is None:
        return None
    for cb in trainer.checkpoint_callbacks:
        for path in (getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", "")):
            if path and Path(path).is_file():
                return str(path)
    return str(trainer.ckpt_path) if trainer.ckpt_path else None


def non_finite_loss(module: lightning.LightningModule, value: float, batch_idx: int, *, what: str, entry: str,
                    advice: str) -> TrainingError:
    """The error a trainer raises when ``what`` (its loss) became ``value`` (NaN/inf) in a training step, before
    that step's update: the global step, epoch and batch, the last good checkpoint and how ``entry()`` resumes
    from it (or that none was saved), then ``advice``."""
    ckpt = last_good_checkpoint(module._trainer)
    where = (f"{ckpt} ({entry}(..., resume=True) continues from it)" if ckpt
             else f"none: no checkpoint was saved (pass checkpoint_dir to {entry}() to keep one per epoch)")
    return TrainingError(
        f"{what} became {value} at global step {module.global_step} (epoch {module.current_epoch}, step "
        f"{batch_idx}); training stopped before that step's update. Last good checkpoint: {where}. {advice}"
    )


class EpochHistory(Callback):
    """Epoch means of ``keys`` from ``trainer.callback_metrics`` (``epoch`` counts from 0, as Lightning does), plus
    what the module's ``epoch_summary()`` returns when it has one (e.g. validation numbers) and, with ``timed``,
    the epoch's ``seconds``; the rows travel in the checkpoint, so a resumed run's history starts at epoch 0."""

    def __init__(self, keys: Sequence[str], timed: bool = False) -> None:
        self.keys = tuple(keys)
        self.timed = timed
        self.rows: list[dict] = []
        self._started = time.perf_counter()

    def on_train_epoch_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        metrics = trainer.callback_metrics
        row: dict[str, Any] = {"epoch": trainer.current_epoch}
        for key in self.keys:
            if key in metrics:
                row[key] = float(metrics[key])
        summary = getattr(pl_module, "epoch_summary", None)
        if callable(summary):
            row.update(summary())
        if self.timed:
            row["seconds"] = time.perf_counter() - self._started
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


class OnEpochEnd(Callback):
    """Calls ``fn(row)`` with a copy of ``history``'s newest row after every epoch, e.g. to log metrics as training
    goes (pass it to ``fit`` as ``after_checkpoint`` to run it once the epoch's checkpoint is written)."""

    def __init__(self, history: EpochHistory, fn: Callable[[dict], None]) -> None:
        self.history, self.fn = history, fn

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        if self.history.rows:
            self.fn(dict(self.history.rows[-1]))


class EpochBatches(Sampler[tuple[int, int]]):
    """Yields the keys ``(epoch, step)`` of one epoch's ``steps`` batches, for a dataset whose ``__getitem__``
    builds a whole batch as a function of (seed, epoch, step) (use ``DataLoader(dataset, batch_size=None,
    sampler=EpochBatches(steps))``). Lightning sets the epoch, so a resumed run sees the batches an uninterrupted
    one would, however the batch is drawn (identities, set lengths, non-face crops)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.epoch = int(steps), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # A generator: the epoch is read when the first key is drawn. Lightning makes the first epoch's iterator
        # before it calls set_epoch, so reading it here already would replay epoch 0 after a resume.
        for i in range(self.steps):
            yield self.epoch, i


class _AfterCheckpoint(Checkpoint):
    """Runs ``inner``'s ``on_train_epoch_end`` after the epoch's checkpoint: Lightning calls the ordinary callbacks'
    epoch-end hooks, then the module's, then the checkpoint callbacks' in their order, so this one, being a
    ``Checkpoint`` placed after ``ModelCheckpoint``, comes after the file is written."""

    def __init__(self, inner: Callback) -> None:
        self.inner = inner

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.inner.on_train_epoch_end(trainer, pl_module)


@dataclass
class Fitted:
    """What ``fit`` returns: the trainer (ranks, paths), the per-epoch history and the ``last`` checkpoint."""

    trainer: lightning.Trainer
    history: list[dict]
    checkpoint: Path | None
    seconds: float
    precision: str = "32-true"  # what the trainer ran in ("auto" resolved)


class _ResumedEpoch(Callback):
    """Tells the training sampler which epoch a resumed run starts in, as the checkpoint is loaded. Lightning creates
    the first epoch's DataLoader iterator before it calls the sampler's ``set_epoch``, and with workers that iterator
    draws its first batches at once: a resumed run would replay epoch 0's order (a fresh run starts at epoch 0, so it
    alone was right). Lightning then sets the same epoch itself."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def on_load_checkpoint(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
        self.sampler.set_epoch(int(progress.get("processed", checkpoint.get("epoch", -1) + 1)))


class _LoaderEpoch(Callback):
    """Tells a loader that orders its data itself (``ml.data.shard_stream.StreamLoader``: it has no sampler for
    Lightning to give the epoch) which epoch starts, before Lightning creates that epoch's iterator, and after each
    step how many of the epoch's batches are trained (Lightning fetches one ahead: a checkpoint saved mid-epoch must
    resume after the last batch trained, not the last one fetched)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def on_train_epoch_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.loader.set_epoch(trainer.current_epoch)

    def on_train_batch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.loader.consumed = batch_idx + 1


def fit(
    module: lightning.LightningModule,
    loader: DataLoader,
    *,
    section: str,
    epochs: int,
    steps_per_epoch: int,
    history: EpochHistory,
    accelerator: str = "auto",
    devices: int = 1,
    precision: str = "32-true",
    num_nodes: int = 1,
    strategy: Any = "auto",
    max_steps: int = -1,
    grad_clip: float = 0.0,
    run_info: tuple[str, dict[str, Any]] | None = None,
    checkpoint_dir: Path | str | None = None,
    last_checkpoint: str = "last.ckpt",
    ckpt_path: Path | None = None,
    callbacks: Sequence[Callback] = (),
    after_checkpoint: Sequence[Callback] = (),
    loggers: Any = None,
    progress: bool = True,
) -> Fitted:
    """Fit ``module`` on ``loader`` for ``epochs`` with one ``lightning.Trainer`` set up as every faceops trainer
    is: the device settings of params ``<section>.*`` (refused up front where the machine cannot run them), gradient
    clipping at ``grad_clip`` (0 = off), ``history`` and the run description ``run_info = (key, info)`` first, then
    the per-epoch ``checkpoint_dir/last_checkpoint`` when a directory is given, the caller's ``callbacks``, and
    last the epoch-end hooks of ``after_checkpoint``, which run once that epoch's checkpoint is written. ``ckpt_path`` resumes: the weights, optimiser, schedule, epoch and global step come
    back, and data keyed by (seed, epoch, step) make the result equal an uninterrupted run's."""
    start = time.perf_counter()
    check_device(section, accelerator, precision)
    if precision == "auto":
        precision = resolve_precision(accelerator, precision)
        log.info("%s.precision auto: training in %s", section, precision)
    deterministic_algorithms()
    own: list[Callback] = [history]
    sampler = loader.sampler if hasattr(loader.sampler, "set_epoch") else getattr(loader.batch_sampler, "sampler", None)
    if hasattr(loader, "set_epoch"):
        sampler = loader
        own.append(_LoaderEpoch(loader))
    if ckpt_path is not None and hasattr(sampler, "set_epoch"):
        own.append(_ResumedEpoch(sampler))
    if run_info is not None:
        own.append(RunInfo(*run_info))
    after = [_AfterCheckpoint(c) for c in after_checkpoint] if checkpoint_dir is not None else list(after_checkpoint)
    all_callbacks, checkpointing = trainer_callbacks(own, checkpoint_dir, last_checkpoint, [*after, *callbacks])
    trainer = lightning.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        gradient_clip_val=grad_clip if grad_clip > 0 else None,
        logger=loggers if loggers else False,
        callbacks=all_callbacks,
        enable_checkpointing=checkpointing,
        enable_progress_bar=progress,
        enable_model_summary=False,
        log_every_n_steps=max(1, min(50, steps_per_epoch)),
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the samplers order (and split) the data themselves
    )
    with warnings.catch_warnings(), attention_kernels(accelerator, precision):
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # ml.data.shard_stream gives each worker its own part and knows its length: Lightning's caution does not apply
        warnings.filterwarnings("ignore", message=".*IterableDataset. has .__len__. defined.*")
        warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")  # lightning 2.6 vs torch 2.13, harmless
        warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")  # frozen parts (FaceGCD) by design
        if ckpt_path is not None:  # resuming into the directory is the point
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    last = Path(checkpoint_dir) / last_checkpoint if checkpoint_dir is not None else None
    return Fitted(trainer, history.rows, last if last is not None and last.is_file() else None,
                  time.perf_counter() - start, precision)
