"""What sweeping each stage trains and reports: ``OBJECTIVES`` maps every sweepable stage to its ``SweepTarget``.

``train_fr`` trials train on the prepared set's ``train`` split and report ``val/accuracy`` after every epoch (the
closed-set identification accuracy of its ``val`` split against the margin head's class centres), where Optuna's
Lightning pruning callback may stop them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError, TrainingError
from tasks.common import Paths, section

log = logging.getLogger(__name__)

TrialTrainer = Callable[[Any, Any, Any], float]  # (stage config, optuna trial, tracker) → the trial's value


@dataclass(frozen=True)
class SweepTarget:
    """What sweeping one stage means: the params section its trials change, that section's config class
    (``module:Class``), the metrics a trial reports each epoch, a cheap check that its data exist, and a factory
    that loads the data once per process and returns the function training one trial."""

    section: str
    config: str
    metrics: tuple[str, ...]
    check_data: Callable[[Paths, Mapping[str, Any], str], None]
    trainer: Callable[[Paths, Mapping[str, Any], str], TrialTrainer]

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)


def _fr_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> None:
    """The prepared training set exists, with a ``val`` split when the metric is measured on it."""
    from ml.data.dataset import read_manifest

    manifest_path = paths.train_set / "manifest.parquet"
    if not manifest_path.is_file():
        raise DataError(f"{paths.train_set} holds no prepared dataset: run `dvc repro prepare` "
                        "(or `faceops run --stage prepare`) before sweeping train_fr")
    splits = set(read_manifest(manifest_path)["split"])
    if "train" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'train' to train on")
    if metric.startswith("val/") and "val" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'val' to measure {metric}; set data.val_fraction > 0 "
                        "and rerun prepare, or sweep on sweep.train_fr.metric train/loss")


def _fr_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """Load the prepared set's train and val splits once; → a function that trains one FR trial on them."""
    import numpy as np

    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.fr.train import train_fr
    from ops.tracking import lightning_logger
    from tasks.prepare import DataConfig

    data = from_mapping(DataConfig, section(params, "data"), "data")
    manifest = read_manifest(paths.train_set / "manifest.parquet")
    size = (data.image_size, data.image_size)
    rows = {s: manifest[manifest["split"] == s].reset_index(drop=True) for s in ("train", "val")}
    images = load_images(paths.train_set, rows["train"], expected_size=size)
    labels = rows["train"]["label"].to_numpy()
    keypoints = landmarks_array(rows["train"])  # used by KP-RPE backbones only
    val = None
    if len(rows["val"]):
        val = (load_images(paths.train_set, rows["val"], expected_size=size), rows["val"]["label"].to_numpy(),
               landmarks_array(rows["val"]))
    log.info("train_fr trials: %d training images of %d identities, %d val images", len(labels),
             int(np.max(labels)) + 1, 0 if val is None else len(val[1]))

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        if cfg.devices * cfg.num_nodes != 1:
            raise ConfigError(f"sweep trials train on one device (fr.devices = {cfg.devices}, fr.num_nodes = "
                              f"{cfg.num_nodes}); scale a sweep out with more workers on one study instead")
        pruning = _fr_pruning(trial, metric)
        train_fr(cfg, images, labels, loggers=[lightning_logger(tracker)], keypoints=keypoints, progress=False,
              callbacks=[pruning], val=val)
        values = pruning.values
        if not values:
            raise TrainingError(f"the trial reported no {metric}: training ran no epoch")
        return values[-1]

    return train_trial


def _fr_pruning(trial: Any, metric: str) -> Any:
    """Optuna's pruning callback on ``metric`` after every epoch; ``values`` keeps what it saw. ``val/accuracy`` is
    the FR trainer's own (``ml.fr.train.train_fr(..., val=...)``), measured before the callbacks run."""
    import optuna
    from optuna_integration import PyTorchLightningPruningCallback

    class EpochPruning(PyTorchLightningPruningCallback):
        """Optuna's Lightning pruning callback, reporting ``monitor`` after every training epoch (the FR trainer
        has no validation loop). Raises ``optuna.TrialPruned`` to stop."""

        def __init__(self) -> None:
            super().__init__(trial, monitor=metric)
            self.values: list[float] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                raise TrainingError(f"metric {self.monitor} was not reported this epoch (reported: "
                                    f"{sorted(trainer.callback_metrics)}); check sweep.train_fr.metric")
            self.values.append(float(value))
            try:
                self.on_validation_end(trainer, pl_module)
            except optuna.TrialPruned:
                # Lightning logs an epoch's metrics after its epoch-end hooks, which this stops: log the one the
                # trial was pruned on now
                for logger in trainer.loggers:
                    logger.log_metrics({self.monitor: float(value)}, step=trainer.global_step - 1)
                raise

    return EpochPruning()


OBJECTIVES: dict[str, SweepTarget] = {
    "train_fr": SweepTarget(
        section="fr", config="ml.fr.config:FRConfig", metrics=("val/accuracy", "train/accuracy", "train/loss"),
        check_data=_fr_check_data, trainer=_fr_trainer,
    ),
}
