"""Stage ``train_fr@<source>``: train a face recogniser on one training source.

``dvc.yaml`` runs it as a ``foreach`` over the sources: ``real`` is the prepared training set (procedural
faces, or the user's real set); ``synthetic`` and ``mixed`` read the synthesize stage's output once it exists.
Writes ``models/fr/<source>/`` (``model.safetensors`` + ``config.json``), ``metrics/train_fr_<source>.json`` and
the loss curve (``plots/train_fr_<source>_history.csv`` for ``dvc plots``, ``plots/train_fr_<source>_loss.png``
for people). The model is logged to MLflow and registered as a new ``faceops-fr`` version with alias
``candidate``, tagged with its training source and data digest.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError
from ml.train.fr import FRConfig
from tasks.common import (
    Paths, StageResult, load_params, section, stage_main, write_json, pyplot, save_figure, write_history_csv,
)
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)

REGISTERED_MODEL = "faceops-fr"
SOURCES = ("real",)  # training sources with data today; the synthesize stage adds "synthetic" and "mixed"


def source_dataset(paths: Paths, source: str) -> Path:
    if source not in SOURCES:
        raise ConfigError(f"unknown training source {source!r}; available: {', '.join(SOURCES)}")
    return paths.train_set


def plot_history(history: list[dict], path: Path) -> None:
    plt = pyplot()

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].plot(epochs, [h["train/loss"] for h in history], marker="o")
    ax[0].set(xlabel="epoch", ylabel="loss", title="train/loss")
    ax[1].plot(epochs, [h["train/accuracy"] for h in history], marker="o", color="tab:green")
    ax[1].set(xlabel="epoch", ylabel="accuracy", title="train/accuracy (closed set, cosine arg-max)", ylim=(0, 1))
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def run(cfg: FRConfig, data: DataConfig, paths: Paths, *, source: str = "real", tracker: Any = None) -> StageResult:
    from ml.data.dataset import landmarks_array, load_images, read_dataset_info, read_manifest
    from ml.models.backbones import input_contract
    from ml.models.io import save_model
    from ml.train.fr import train

    dataset = source_dataset(paths, source)
    model_dir = paths.fr_model(source)
    manifest = read_manifest(dataset / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    images = load_images(dataset, rows, expected_size=(data.image_size, data.image_size), progress=True)
    labels = rows["label"].to_numpy()
    info = read_dataset_info(dataset)

    loggers = None
    if tracker is not None:
        from lightning.pytorch.loggers import MLFlowLogger

        from tasks.tracking import tracking_uri

        loggers = [MLFlowLogger(run_id=tracker.run_id, tracking_uri=tracking_uri(paths.root))]
    # KP-RPE backbones read the manifest's landmarks (ground truth for procedural data, the aligner's otherwise)
    keypoints = landmarks_array(rows) if input_contract(cfg.backbone).get("needs_keypoints") else None
    res = train(cfg, images, labels, loggers=loggers, keypoints=keypoints)

    extra = {
        "training_data_digest": info["digest"],
        "training_source": source,
        "training_data_source": info["source"],
        "training_identities": int(labels.max()) + 1,
        "training_images": int(len(labels)),
    }
    save_model(model_dir, res.model, backbone=res.backbone, kwargs=res.backbone_kwargs, extra=extra)
    last = res.history[-1] if res.history else {}
    result = StageResult(f"train_fr@{source}", outputs=[model_dir])
    result.metrics = {
        "train/loss": float(last.get("train/loss", float("nan"))),
        "train/accuracy": float(last.get("train/accuracy", float("nan"))),
        "train/seconds": float(res.seconds),
        "train/images_per_second": float(len(labels) * max(len(res.history), 1) / max(res.seconds, 1e-9)),
    }
    write_json(paths.metrics / f"train_fr_{source}.json", result.metrics)
    write_history_csv(paths.plots / f"train_fr_{source}_history.csv", res.history, ["epoch", "train/loss", "train/accuracy"])
    plot_history(res.history, paths.plots / f"train_fr_{source}_loss.png")
    result.summary = (
        f"{res.backbone} trained on {len(labels)} images of {extra['training_identities']} identities in "
        f"{res.seconds:.0f}s (train/accuracy {result.metrics['train/accuracy']:.3f}) → {model_dir}"
    )
    if tracker is not None:
        tracker.log_dataset(dataset, context="train")
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / f"train_fr_{source}_loss.png", artifact_path="plots")
        version = tracker.log_model_dir(
            model_dir, REGISTERED_MODEL,
            tags={"source": source, "data_source": info["source"], "data_digest": info["digest"],
                  "backbone": res.backbone},
        )
        result.summary += f"; registered {REGISTERED_MODEL} v{version} @candidate"
    return result


def main(source: str = "real") -> None:
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(FRConfig, section(params, "fr"), "fr")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    source_dataset(paths, source)  # unknown source: fail before opening a run
    with stage_run(f"train_fr@{source}", {"fr": section(params, "fr")}, paths.root) as tracker:
        result = run(cfg, data, paths, source=source, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    import sys

    stage_main(lambda: main(*sys.argv[1:2]))
