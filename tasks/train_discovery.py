"""Stage ``train_discovery``: FaceGCD on the generalized-face-discovery split.

Reads ``data/prepared/gfd/split.parquet`` (and the dataset ``split.json`` names), trains on the split's ``train``
subset — labelled images of the known identities plus every unlabelled image — with both ViTs initialised from the
FR model ``models/fr/real`` (``discovery.backbone_init: fr``; ``random`` for a from-scratch ablation). Writes
``models/discovery/`` (``model.safetensors`` + ``config.json``), ``metrics/train_discovery.json`` and the loss curve
(``plots/train_discovery_history.csv``, ``plots/train_discovery_loss.png``). The model is logged to MLflow and
registered as a new ``faceops-discovery`` version with alias ``candidate``. Clustering and its metrics are the
``evaluate`` stage's (semi-supervised k-means over the features of this model and of the FR model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ml.config import from_mapping
from ml.errors import DataError
from ml.train.discovery import DiscoveryConfig
from tasks.common import (
    Paths, StageResult, core_share_callbacks, load_params, section, stage_main, write_json, pyplot, save_figure,
    write_history_csv,
)
from tasks.prepare import DataConfig
from tasks.tracking import registered_note

log = logging.getLogger(__name__)

REGISTERED_MODEL = "faceops-discovery"
FR_SOURCE = "real"  # the FR model whose weights initialise FaceGCD's ViTs


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


def plot_history(history: list[dict], path: Path) -> None:
    plt = pyplot()

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for key, style in (("loss", "-o"), ("loss/unsup", "--"), ("loss/sup", ":")):
        ax.plot(epochs, [h[key] for h in history], style, label=key)
    ax.set(xlabel="epoch", ylabel="loss", title="FaceGCD: (1−λ)·L_unsup + λ·L_sup")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def run(cfg: DiscoveryConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import load_images, read_dataset_info
    from ml.models.discovery.facegcd import save_facegcd
    from ml.train.discovery import train_discovery

    dataset, rows = gfd_rows(paths)
    train = rows[rows["subset"] == "train"].reset_index(drop=True)
    images = load_images(dataset, train, expected_size=(data.image_size, data.image_size), progress=True)
    labelled = train["labelled"].to_numpy(bool)
    labels = np.where(labelled, train["label"].to_numpy(np.int64), -1)  # unlabelled images carry no label at all
    init = None
    if cfg.backbone_init == "fr":
        init = paths.fr_model(FR_SOURCE)
        if not (init / "config.json").is_file():
            raise DataError(f"discovery.backbone_init is 'fr' but {init} holds no model: run `dvc repro train_fr@real` "
                            "first, or set discovery.backbone_init: random.")
    res = train_discovery(cfg, images, labels, labelled, init_model_dir=init, progress=True,
                          callbacks=core_share_callbacks())
    info = read_dataset_info(dataset)
    extra = {
        "registered_name": REGISTERED_MODEL,
        "training_data_digest": info["digest"],
        "training_images": int(len(train)),
        "labelled_images": int(labelled.sum()),
        "known_identities": int(train.loc[train["known"], "identity"].nunique()),
        "backbone_init": cfg.backbone_init,
    }
    save_facegcd(res.model, paths.discovery_model, extra=extra)

    last = res.history[-1] if res.history else {}
    result = StageResult("train_discovery", outputs=[paths.discovery_model])
    result.metrics = {f"train/{k}": float(last[k]) for k in ("loss", "loss/unsup", "loss/sup") if k in last}
    result.metrics["train/seconds"] = float(sum(h.get("seconds", 0.0) for h in res.history))
    write_json(paths.metrics / "train_discovery.json", result.metrics)
    write_history_csv(paths.plots / "train_discovery_history.csv", res.history, ["epoch", "loss", "loss/unsup", "loss/sup"])
    plot_history(res.history, paths.plots / "train_discovery_loss.png")
    result.summary = (
        f"FaceGCD ({cfg.backbone}, init {cfg.backbone_init}) trained on {len(train)} images "
        f"({int(labelled.sum())} labelled) in {result.metrics['train/seconds']:.0f}s → {paths.discovery_model}"
    )
    if tracker is not None:
        tracker.log_dataset(dataset, context="discovery")
        for h in res.history:  # an epoch's seconds: train/epoch_seconds (train/seconds is the whole training's)
            tracker.log_metrics({("train/epoch_seconds" if k == "seconds" else f"train/{k}"): v
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
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(DiscoveryConfig, section(params, "discovery"), "discovery")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("train_discovery", {"discovery": section(params, "discovery")}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main)
