"""What sweeping each stage trains and reports: ``OBJECTIVES`` maps every sweepable stage to its ``SweepTarget``.

Every trial reports its metric to Optuna after every epoch, where the study's pruner may stop it (``_pruning``),
and reads no test split:

- ``train_fr``: the prepared set's ``train`` split; ``val/accuracy``, the closed-set identification accuracy of its
  ``val`` split (images of the training identities not trained on) against the margin head's class centres;
- ``train_aligner``: the unaligned set's ``train`` split; ``val/nme_box`` (and the other ``val/*``) on its ``val``
  split, identities neither trained on nor tested on;
- ``train_discovery``: the GFD split's ``train`` subset; ``val/accuracy``, the nearest-class-mean accuracy of the
  labelled images held out by ``discovery.val_per_identity`` (the GCD control is not trained in a trial); a trial
  is worth its best epoch's value, the epoch the stage keeps;
- ``train_fusion``: CAFace on the frozen FR model's features of the fusion set but its last ``fusion.val_identities``
  identities; ``val/rank1`` (and ``val/lt``) of fixed sets of those identities against their targets;
- ``train_generator``: UIFace (its autoencoder first in latent space) on the training faces; ``val/objective`` =
  the identity gap of a small synthetic set + the accuracy on val identities (the GFD split's labelled images) of a
  small FR model trained on it (``tasks.synthesize.probe_generator``), measured once, after training (no pruning).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError, TrainingError
from tasks.common import Paths, section

log = logging.getLogger(__name__)

TrialTrainer = Callable[[Any, Any, Any], float]  # (stage config, optuna trial, tracker) → the trial's value


@dataclass(frozen=True)
class SweepTarget:
    """What sweeping one stage means: the params section its trials change, that section's config class
    (``module:Class``), the metrics a trial reports each epoch, a cheap check that its data exist (→ how many val
    items the metric is measured on, None for a training metric), and a factory that loads the data once per
    process and returns the function training one trial."""

    section: str
    config: str
    metrics: tuple[str, ...]
    check_data: Callable[[Paths, Mapping[str, Any], str], int | None]  # → the val items the metric is measured on
    trainer: Callable[[Paths, Mapping[str, Any], str], TrialTrainer]

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)


def _splits(dataset: Path, stage: str) -> tuple[Path, dict[str, int]]:
    """(the manifest of a prepared ``dataset``, rows per split); DataError when it was not prepared."""
    from ml.data.dataset import read_manifest

    manifest_path = dataset / "manifest.parquet"
    if not manifest_path.is_file():
        raise DataError(f"{dataset} holds no prepared dataset: run `dvc repro prepare` (or `faceops run --stage "
                        f"prepare`) before sweeping {stage}")
    return manifest_path, read_manifest(manifest_path)["split"].value_counts().to_dict()


def _labelled_identities(paths: Paths) -> tuple[int, int]:
    """(known identities, labelled training images) of the GFD split."""
    from ml.discovery.split import read_gfd_split

    gfd = read_gfd_split(paths.gfd_split)
    labelled = gfd[(gfd["subset"] == "train") & gfd["labelled"]]
    return labelled["identity"].nunique(), len(labelled)


def _fr_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> int | None:
    """The prepared training set exists, with a ``val`` split when the metric is measured on it."""
    manifest_path, splits = _splits(paths.train_set, "train_fr")
    if "train" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'train' to train on")
    if metric.startswith("val/") and "val" not in splits:
        raise DataError(f"{manifest_path}: no rows with split 'val' to measure {metric}; set data.val_fraction > 0 "
                        "and rerun prepare, or sweep on sweep.train_fr.metric train/loss")
    return splits.get("val") if metric.startswith("val/") else None


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
        _one_device(cfg, "fr")
        pruning = _pruning(trial, metric)
        train_fr(cfg, images, labels, loggers=[lightning_logger(tracker)], keypoints=keypoints, progress=False,
                 callbacks=[pruning], val=val)
        return _last_value(pruning, metric)

    return train_trial


def _pruning(trial: Any, metric: str, tracker: Any = None) -> Any:
    """Optuna's pruning callback on ``metric`` after every epoch; ``values`` keeps what it saw. The value is the
    trainer's logged metric or its epoch history row (``ml.train.callbacks.EpochHistory``: the ``val/*`` numbers);
    with ``tracker`` the row is logged to the trial's run."""
    import optuna
    from lightning.pytorch.callbacks import Callback

    from ml.train.callbacks import EpochHistory

    class EpochPruning(Callback):
        """Reports ``metric`` to the trial after every training epoch (the trainers have no validation loop) and
        raises ``optuna.TrialPruned`` when the pruner says so."""

        def __init__(self) -> None:
            self.values: list[float] = []

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            rows = [c.rows[-1] for c in trainer.callbacks if isinstance(c, EpochHistory) and c.rows]
            row = rows[0] if rows else {}
            value = trainer.callback_metrics.get(metric, row.get(metric))
            if value is None:
                raise TrainingError(f"metric {metric} was not reported this epoch (reported: "
                                    f"{sorted({*trainer.callback_metrics, *row})}); check sweep.<stage>.metric")
            value = float(value)
            self.values.append(value)
            if tracker is not None and row:
                tracker.log_metrics({k: float(v) for k, v in row.items() if k != "epoch"}, step=int(row["epoch"]))
            trial.report(value, step=trainer.current_epoch)
            if trial.should_prune():
                # Lightning logs an epoch's metrics after its epoch-end hooks, which this stops: log this one now
                for logger in trainer.loggers:
                    logger.log_metrics({metric: value}, step=trainer.global_step - 1)
                raise optuna.TrialPruned(f"trial {trial.number} pruned at epoch {trainer.current_epoch}: "
                                         f"{metric} = {value:.4g}")

    return EpochPruning()


def _last_value(pruning: Any, metric: str) -> float:
    if not pruning.values:
        raise TrainingError(f"the trial reported no {metric}: training ran no epoch")
    return pruning.values[-1]


def _one_device(cfg: Any, section_name: str) -> None:
    devices, nodes = getattr(cfg, "devices", 1), getattr(cfg, "num_nodes", 1)
    if devices * nodes != 1:
        raise ConfigError(f"sweep trials train on one device ({section_name}.devices = {devices}, num_nodes = "
                          f"{nodes}); scale a sweep out with more workers on one study instead")


def _aligner_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> int | None:
    """The unaligned set exists with a ``train`` and a ``val`` split."""
    manifest_path, splits = _splits(paths.unaligned_set, "train_aligner")
    for split, advice in (("train", "rerun prepare"), ("val", "set data.unaligned_val_identities > 0 and rerun "
                                                              "prepare")):
        if split not in splits:
            raise DataError(f"{manifest_path}: no rows with split {split!r}; {advice}")
    return splits["val"] if metric.startswith("val/") else None


def _aligner_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """Load the unaligned set's train and val splits once; → a function that trains one DFA trial on them."""
    from ml.aligner.train import train_aligner
    from tasks.train_aligner import unaligned_split

    images, landmarks = unaligned_split(paths, "train", progress=False)
    val = unaligned_split(paths, "val", progress=False)
    log.info("train_aligner trials: %d training faces, %d val faces", len(images), len(val[0]))

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        _one_device(cfg.train, "aligner.train")
        pruning = _pruning(trial, metric, tracker)
        train_aligner(cfg.train, images, landmarks, val=val, progress=False, callbacks=[pruning])
        return _last_value(pruning, metric)

    return train_trial


def _discovery_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> int | None:
    """The GFD split exists, and labelled images are held out when the metric is measured on them."""
    if not paths.gfd_split.is_file():
        raise DataError(f"{paths.gfd_split} is missing: run `dvc repro prepare` before sweeping train_discovery")
    fixed = (section(params, "sweep").get("train_discovery") or {}).get("fixed") or {}
    held = fixed.get("discovery.val_per_identity", section(params, "discovery").get("val_per_identity", 0))
    if metric.startswith("val/") and not held:
        raise DataError(f"{metric} is measured on held-out labelled images: set discovery.val_per_identity > 0 "
                        "(or in sweep.train_discovery.fixed)")
    return _labelled_identities(paths)[0] * int(held) if metric.startswith("val/") else None


def _discovery_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """Load the GFD split's training images (and the anchor's FR images) once; → a function that trains one FaceGCD
    trial on them."""
    from ml.discovery.train import DiscoveryConfig, train_discovery
    from tasks.prepare import DataConfig
    from tasks.train_discovery import anchor_set, training_data

    data = from_mapping(DataConfig, section(params, "data"), "data")
    base = from_mapping(DiscoveryConfig, section(params, "discovery"), "discovery")
    _, _, images, labels, labelled = training_data(paths, data, progress=False)
    anchor = anchor_set(base, data, paths) if base.anchor_weight > 0 else None
    log.info("train_discovery trials: %d images (%d labelled)", len(labels), int(labelled.sum()))

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        _one_device(cfg, "discovery")
        if cfg.anchor_weight > 0 and anchor is None:
            raise ConfigError("a trial sets discovery.anchor_weight > 0 but the base params have the anchor off: "
                              "set discovery.anchor_weight > 0 in params.yaml (or in sweep.train_discovery.fixed)")
        init = paths.fr_model(cfg.fr_source) if cfg.backbone_init == "fr" else None
        if init is not None and not (init / "config.json").is_file():
            raise DataError(f"discovery.backbone_init is 'fr' but {init} holds no model: run `dvc repro "
                            "train_fr@real` first")
        pruning = _pruning(trial, metric, tracker)
        result = train_discovery(cfg, images, labels, labelled, init_model_dir=init, progress=False,
                                 callbacks=[pruning], anchor=anchor if cfg.anchor_weight > 0 else None)
        # the trainer keeps its best val epoch (and with discovery.patience stops some epochs after it): the
        # trial is worth the metric at the epoch the stage would keep, whichever metric the sweep reads
        if 0 <= result.best_epoch < len(pruning.values):
            return pruning.values[result.best_epoch]
        return _last_value(pruning, metric)

    return train_trial


FUSION_FIXED = ("fr_source", "val_identities", "val_set_size", "val_sets_per_identity")  # what trials are measured on


def _fusion_base(params: Mapping[str, Any]) -> Any:
    """The ``fusion`` section as ``FusionStageConfig``, with the keys that fix what every trial is trained and
    measured on (``FUSION_FIXED``) taken from ``sweep.train_fusion.fixed`` where set there."""
    import dataclasses

    from tasks.train_fusion import FusionStageConfig

    fixed = (section(params, "sweep").get("train_fusion") or {}).get("fixed") or {}
    base = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
    return dataclasses.replace(base, **{k: fixed[f"fusion.{k}"] for k in FUSION_FIXED if f"fusion.{k}" in fixed})


def _fusion_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> int | None:
    """CAFace's material and FR model exist, and identities are held out when the metric is measured on them."""
    from tasks.prepare import DataConfig

    data = from_mapping(DataConfig, section(params, "data"), "data")
    _splits(paths.train_set if data.ingested else paths.fusion_set, "train_fusion")
    base = _fusion_base(params)
    if not (paths.fr_model(base.fr_source) / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {base.fr_source!r} but {paths.fr_model(base.fr_source)} holds no model: "
                        f"run `dvc repro train_fr@{base.fr_source}` before sweeping train_fusion")
    if not metric.startswith("val/"):
        return None
    if not base.val_identities:
        raise DataError(f"{metric} is measured on held-out identities: set fusion.val_identities > 0")
    return base.val_identities * base.val_sets_per_identity


def _fusion_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """Embed CAFace's material with the frozen FR model once and hold out its val identities; → a function that
    trains one CAFace trial on the rest."""
    import dataclasses

    from ml.fusion.train import train_fusion
    from tasks.prepare import DataConfig
    from tasks.train_fusion import load_material, split_val

    data = from_mapping(DataConfig, section(params, "data"), "data")
    base = _fusion_base(params)
    material, sized, _, _ = load_material(base, data, paths)
    material, val = split_val(material, base)
    log.info("train_fusion trials: %d set items of %d identities, %d val sets", len(material.labels),
             len(material.centres), 0 if val is None else len(val.labels))

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        _one_device(cfg.train, "fusion.train")
        moved = [k for k in FUSION_FIXED if getattr(cfg, k) != getattr(base, k)]
        if moved:
            raise ConfigError(f"a trial changes fusion.{moved[0]}, which fixes what every trial is trained and measured "
                              "on: keep it out of sweep.train_fusion.space")
        train_cfg = dataclasses.replace(cfg.train, feature_dim=sized.feature_dim, style_dim=sized.style_dim)
        pruning = _pruning(trial, metric, tracker)
        train_fusion(train_cfg, material.features, material.styles, material.labels, sources=material.sources,
                     centres=material.centres, progress=False, callbacks=[pruning], val=val)
        return _last_value(pruning, metric)

    return train_trial


def _generator_check_data(paths: Paths, params: Mapping[str, Any], metric: str) -> int | None:
    """The training faces, the FR models the generator is conditioned and probed with, and the val faces exist."""
    _splits(paths.train_set, "train_generator")
    for key in ("generator", "synthesize"):
        source = section(params, key).get("fr_source", "real")
        if not (paths.fr_model(source) / "config.json").is_file():
            raise DataError(f"{key}.fr_source is {source!r} but {paths.fr_model(source)} holds no model: run `dvc "
                            f"repro train_fr@{source}` before sweeping train_generator")
    if not paths.gfd_split.is_file():
        raise DataError(f"{paths.gfd_split} is missing: the generator's val faces are its labelled images; run `dvc "
                        "repro prepare` before sweeping train_generator")
    return _labelled_identities(paths)[1] // 2  # the probes: every other labelled image of an identity


def _generator_trainer(paths: Paths, params: Mapping[str, Any], metric: str) -> TrialTrainer:
    """→ a function that trains one generator into a temporary folder and scores it with ``probe_generator``."""
    import tempfile

    from ml.fr.config import FRConfig
    from tasks.prepare import DataConfig
    from tasks.synthesize import SynthesizeConfig, probe_generator, probe_setup
    from tasks.train_generator import fit

    data = from_mapping(DataConfig, section(params, "data"), "data")
    synthesize = from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize")
    fr = from_mapping(FRConfig, section(params, "fr"), "fr")
    setup = None  # probe_setup's, loaded by the first trial and kept for the others

    def train_trial(cfg: Any, trial: Any, tracker: Any) -> float:
        nonlocal setup
        _one_device(cfg.train, "generator.train")
        setup = setup or probe_setup(synthesize, data, paths)
        with tempfile.TemporaryDirectory(prefix="faceops-generator-trial-") as tmp:
            fit(cfg, paths, Path(tmp) / "generator", report=False)
            scores = probe_generator(Path(tmp) / "generator", cfg, synthesize, data, fr, paths, setup)
        if tracker is not None:
            tracker.log_metrics(scores)
        log.info("generator trial %d: %s", trial.number, ", ".join(f"{k} {v:.4g}" for k, v in scores.items()))
        return scores[metric]

    return train_trial


OBJECTIVES: dict[str, SweepTarget] = {
    "train_fr": SweepTarget(
        section="fr", config="ml.fr.config:FRConfig", metrics=("val/accuracy", "train/accuracy", "train/loss"),
        check_data=_fr_check_data, trainer=_fr_trainer,
    ),
    "train_aligner": SweepTarget(
        section="aligner", config="tasks.train_aligner:AlignerStageConfig",
        metrics=("val/nme_box", "val/nme", "val/failure@0.1", "val/auc@0.1", "train/loss", "train/nme"),
        check_data=_aligner_check_data, trainer=_aligner_trainer,
    ),
    "train_discovery": SweepTarget(
        section="discovery", config="ml.discovery.train:DiscoveryConfig", metrics=("val/accuracy", "loss"),
        check_data=_discovery_check_data, trainer=_discovery_trainer,
    ),
    "train_fusion": SweepTarget(
        section="fusion", config="tasks.train_fusion:FusionStageConfig",
        metrics=("val/rank1", "val/lt", "val/rank1_average", "val/lt_average", "train/loss", "train/lt"),
        check_data=_fusion_check_data, trainer=_fusion_trainer,
    ),
    "train_generator": SweepTarget(
        section="generator", config="tasks.train_generator:GeneratorStageConfig",
        metrics=("val/objective", "val/accuracy", "val/identity_gap"),
        check_data=_generator_check_data, trainer=_generator_trainer,
    ),
}
