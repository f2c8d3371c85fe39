"""Stage ``train_discovery``: FaceGCD on the generalized-face-discovery split, and the GCD control beside it.

Reads ``data/prepared/gfd/split.parquet`` (and the dataset ``split.json`` names), trains on the split's ``train``
subset — labelled images of the known identities plus every unlabelled image — with both ViTs initialised from the
FR model ``models/fr/real`` (``discovery.backbone_init: fr``; ``random`` for a from-scratch ablation). Writes
``models/discovery/`` (``model.safetensors`` + ``config.json``), ``metrics/train_discovery.json`` and the loss curve
(``plots/train_discovery_history.csv``, ``plots/train_discovery_loss.png``). The model is logged to MLflow and
registered as a new ``faceops-discovery`` version with alias ``candidate``.

With ``discovery.anchor_weight`` > 0 (the recipe) the trainer's anchor term also reads the FR model's own training
set (``training_rows`` of the FR source, at most ``discovery.anchor_images`` of its images drawn with the seed).

With ``discovery.gcd_arm`` (default) the same training runs a second time with ``prefix_length: 0`` — GCD (Vaze et
al. 2022): the last block and the projection head fine-tuned, no prefixes — into ``models/discovery_gcd/``, the
control of the paper's claim FaceGCD > GCD; its losses are ``train/gcd/*`` (not registered). With the arm off the
directory holds only ``DISABLED`` and ``evaluate`` leaves the GCD rows out. Clustering and its metrics are the
``evaluate`` stage's (semi-supervised k-means over the features of these models and of the FR model).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ml.config import from_mapping
from ml.errors import DataError
from ml.discovery.train import DiscoveryConfig
from ops.tracking import registered_note
from tasks import registered_model
from tasks.common import (
    Paths, StageResult, load_params, numerics, plot_history, section, stage_main, write_history_csv, write_json,
)
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)

REGISTERED_MODEL = registered_model("train_discovery")
ANCHOR_SOURCE = "real"  # the training source whose rows the anchor replays (the run's own FR training set)
LOSS_KEYS = ("loss", "loss/unsup", "loss/sup", "loss/anchor")


def gcd_model_dir(paths: Paths) -> Path:
    """``models/discovery_gcd``: the GCD control (FaceGCD's training with ``prefix_length: 0``)."""
    return paths.root / "models" / "discovery_gcd"


def gfd_rows(paths: Paths) -> tuple[Path, pd.DataFrame]:
    """(dataset dir, the split joined with the dataset's manifest: one row per image, manifest columns + split)."""
    from ml.data.dataset import read_manifest
    from ml.discovery.split import check_gfd_split, read_gfd_split

    info_path = paths.gfd_split.parent / "split.json"
    if not info_path.is_file():
        raise DataError(f"{info_path} is missing: run the prepare stage (`dvc repro prepare`) first.")
    dataset = paths.prepared / json.loads(info_path.read_text())["dataset"]
    split = read_gfd_split(paths.gfd_split)
    check_gfd_split(split)
    manifest = read_manifest(dataset / "manifest.parquet")
    rows = split.merge(manifest.drop(columns=["identity"]), on="path", how="left", validate="one_to_one")
    missing = rows["label"].isna()
    if missing.any():
        raise DataError(f"{paths.gfd_split}: {int(missing.sum())} image(s) are not in {dataset / 'manifest.parquet'}, "
                        f"e.g. {rows.loc[missing, 'path'].iloc[0]!r}; rerun `dvc repro prepare`.")
    return dataset, rows


def training_data(paths: Paths, data: DataConfig, progress: bool = True
                  ) -> tuple[Path, pd.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """(dataset dir, the GFD split's ``train`` rows, their uint8 images, labels with −1 on every unlabelled image,
    the labelled mask): what the stage and the sweep's trials train on."""
    from ml.data.dataset import load_images

    dataset, rows = gfd_rows(paths)
    train = rows[rows["subset"] == "train"].reset_index(drop=True)
    images = load_images(dataset, train, expected_size=(data.image_size, data.image_size), progress=progress)
    labelled = train["labelled"].to_numpy(bool)
    labels = np.where(labelled, train["label"].to_numpy(np.int64), -1)  # unlabelled images carry no label at all
    return dataset, train, images, labels, labelled


def anchor_set(cfg: DiscoveryConfig, data: DataConfig, paths: Paths) -> tuple[np.ndarray, np.ndarray] | None:
    """The anchor's (uint8 images, labels): the FR model's training rows, at most ``cfg.anchor_images`` of them;
    None when the anchor is off."""
    if cfg.anchor_weight == 0:
        return None
    from tasks.train_fr import load_rows, training_rows

    parts, _, _ = training_rows(paths, ANCHOR_SOURCE)
    total = sum(len(rows) for _, rows in parts)
    rng = np.random.default_rng(cfg.seed)
    keep = np.sort(rng.choice(total, cfg.anchor_images, replace=False)) if 0 < cfg.anchor_images < total else None
    images, labels, start = [], [], 0
    for dataset, rows in parts:
        end = start + len(rows)
        if keep is not None:
            rows = rows.iloc[keep[(keep >= start) & (keep < end)] - start].reset_index(drop=True)
        start = end
        images.append(load_rows(dataset, rows, data, progress=True))
        labels.append(rows["label"].to_numpy(np.int64))
    log.info("discovery anchor: %d FR training images of %d identities", sum(map(len, labels)),
             len(np.unique(np.concatenate(labels))))
    return np.concatenate(images), np.concatenate(labels)


def run(cfg: DiscoveryConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import read_dataset_info
    from ml.discovery.facegcd import save_facegcd
    from ml.discovery.train import train_discovery

    dataset, train, images, labels, labelled = training_data(paths, data)
    init = None
    if cfg.backbone_init == "fr":
        init = paths.fr_model(cfg.fr_source)  # discovery.fr_source: the run's own, or one `faceops import` brought
        if not (init / "config.json").is_file():
            raise DataError(f"discovery.backbone_init is 'fr' but {init} (discovery.fr_source) holds no model: run "
                            f"`dvc repro train_fr@real`, import one with `faceops import`, or set "
                            f"discovery.backbone_init: random.")
    anchor = anchor_set(cfg, data, paths)
    res = train_discovery(cfg, images, labels, labelled, init_model_dir=init, progress=True,
                          anchor=anchor)
    gcd_dir = gcd_model_dir(paths)
    gcd = None
    if cfg.gcd_arm:  # the control: the same data, seed and recipe without prefixes
        gcd = train_discovery(dataclasses.replace(cfg, prefix_length=0), images, labels, labelled,
                              init_model_dir=init, progress=True, anchor=anchor)
    info = read_dataset_info(dataset)
    extra = {
        "registered_name": REGISTERED_MODEL,
        "training_data_digest": info["digest"],
        "training_images": int(len(train)),
        "labelled_images": int(labelled.sum()),
        "known_identities": int(train.loc[train["known"], "identity"].nunique()),
        "backbone_init": cfg.backbone_init,
        "anchor_images": 0 if anchor is None else int(len(anchor[1])),
        **numerics(cfg.accelerator, cfg.precision),
    }
    save_facegcd(res.model, paths.discovery_model, extra={**extra, "best_epoch": res.best_epoch})
    if gcd is not None:
        save_facegcd(gcd.model, gcd_dir, extra={**extra, "arm": "gcd", "best_epoch": gcd.best_epoch})
    else:  # a declared output all the same; no config.json, so evaluate skips the GCD rows
        shutil.rmtree(gcd_dir, ignore_errors=True)
        gcd_dir.mkdir(parents=True)
        (gcd_dir / "DISABLED").write_text("discovery.gcd_arm is false: no GCD control was trained\n")

    result = StageResult("train_discovery", outputs=[paths.discovery_model, gcd_dir])
    result.metrics = {}
    for prefix, arm in (("train", res), ("train/gcd", gcd)):
        if arm is None:
            continue
        last = arm.history[-1] if arm.history else {}
        result.metrics.update({f"{prefix}/{k}": float(last[k]) for k in (*LOSS_KEYS, "val/accuracy") if k in last})
        result.metrics[f"{prefix}/seconds"] = float(sum(h.get("seconds", 0.0) for h in arm.history))
        result.metrics[f"{prefix}/best_epoch"] = float(arm.best_epoch)
    write_json(paths.metrics / "train_discovery.json", result.metrics)
    write_history_csv(paths.plots / "train_discovery_history.csv", res.history,
                      ["epoch", *(k for k in LOSS_KEYS if k in res.history[0]),
                       *(["val/accuracy"] if cfg.val_per_identity else [])])
    parts = ("loss", "loss/unsup", "loss/sup", "loss/anchor")
    anchor = " + w·L_anchor" if res.history and "loss/anchor" in res.history[0] else ""
    plot_history(paths.plots / "train_discovery_loss.png", [{
        "title": f"FaceGCD: (1−λ)·L_unsup + λ·L_sup{anchor}", "ylabel": "loss",
        "curves": [(k, res.history, k) for k in parts]
        + [(f"gcd {k}", gcd.history if gcd is not None else [], k, {"color": "0.55"}) for k in parts]}])
    result.summary = (
        f"FaceGCD ({cfg.backbone}, init {cfg.backbone_init}) trained on {len(train)} images "
        f"({int(labelled.sum())} labelled) in {result.metrics['train/seconds']:.0f}s → {paths.discovery_model}"
    )
    if gcd is not None:
        result.summary += f"; GCD control in {result.metrics['train/gcd/seconds']:.0f}s → {gcd_dir}"
    if tracker is not None:
        tracker.log_dataset(dataset, context="discovery")
        for prefix, arm in (("train", res), ("train/gcd", gcd)):
            for h in arm.history if arm is not None else []:  # train/epoch_seconds: an epoch's (train/seconds: all)
                tracker.log_metrics({(f"{prefix}/epoch_seconds" if k == "seconds" else f"{prefix}/{k}"): v
                                     for k, v in h.items() if k != "epoch"}, step=int(h["epoch"]))
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "train_discovery_loss.png", artifact_path="plots")
        version = tracker.log_model_dir(
            paths.discovery_model, REGISTERED_MODEL,
            tags={"data_digest": info["digest"], "backbone": cfg.backbone, "backbone_init": cfg.backbone_init},
        )
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(DiscoveryConfig, section(params, "discovery"), "discovery")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("train_discovery", {"discovery": section(params, "discovery")}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "train_discovery")
