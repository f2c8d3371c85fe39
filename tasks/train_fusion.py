"""Stage ``train_fusion``: CAFace set fusion on features of the frozen FR model.

Features and styles (per-channel mean/std of two intermediate layers: IResNet layer2/3, or two ViT blocks'
token statistics) are precomputed by the FR model ``models/fr/<fusion.fr_source>`` over the training images and
``fusion.augmented_copies`` augmented copies of each (the KP-RPE recipe: geometry, photometric, blur, cutout), so
the sets mix clean and degraded faces. Identity centres (mean normalised feature) are precomputed and frozen;
CAFace learns ``Lt + λp·Lp`` for ``epochs × steps_per_epoch`` steps with Lightning on ``fusion.train.accelerator``
(ml/train/fusion.py), following the stage's share of the CPU cores. Writes ``models/fusion/``,
``metrics/train_fusion.json`` and the loss curve; the model is registered as ``faceops-fusion`` with alias
``candidate``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.train.fusion import FusionConfig
from tasks.common import (
    Paths, StageResult, core_share_callbacks, load_params, section, stage_main, write_json, pyplot, save_figure,
    write_history_csv,
)
from tasks.prepare import DataConfig
from tasks.tracking import registered_note

log = logging.getLogger(__name__)

REGISTERED_MODEL = "faceops-fusion"


@dataclass(frozen=True)
class FusionStageConfig:
    """``params.yaml`` section ``fusion``; ``train`` holds ml/train/fusion.py's FusionConfig keys (its feature and
    style sizes are taken from the FR model, whatever is written there)."""

    fr_source: str = "real"
    augmented_copies: int = 1   # augmented copies per training image, besides the image itself
    train: FusionConfig = field(
        default_factory=lambda: FusionConfig(epochs=6, steps_per_epoch=100, lr_steps=(4, 5), batch_size=32)
    )

    def __post_init__(self) -> None:
        if isinstance(self.augmented_copies, bool) or not isinstance(self.augmented_copies, int) \
                or not 0 <= self.augmented_copies <= 8:
            raise ConfigError(f"fusion.augmented_copies = {self.augmented_copies!r}: need an integer in [0, 8]")


def augmented_features(model: Any, images: np.ndarray, keypoints: np.ndarray | None, copies: int, seed: int,
                       batch_size: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features (N·(1+copies), D), styles (…, style_dim, 2), index of the source image per row)."""
    import torch

    from ml.eval.sets import features_and_styles
    from ml.train.augment import AugmentConfig, augment_kprpe

    feats, styles = features_and_styles(model, images, keypoints=keypoints, batch_size=batch_size, progress=True)
    out_f, out_s, source = [feats], [styles], [np.arange(len(images))]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(copies):
        imgs, kps = np.empty_like(images), None if keypoints is None else np.empty_like(keypoints, dtype=np.float32)
        for start in range(0, len(images), batch_size):  # augment batch by batch: memory O(batch), not O(N)
            part = slice(start, start + batch_size)
            x = torch.from_numpy(images[part]).permute(0, 3, 1, 2).float() / 255.0
            kp = None if keypoints is None else torch.from_numpy(keypoints[part].astype(np.float32))
            aug, kp_aug = augment_kprpe(x, kp, AugmentConfig(), generator=gen)
            imgs[part] = (aug.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            if kps is not None:
                kps[part] = kp_aug.numpy()
        f, s = features_and_styles(model, imgs, keypoints=kps, batch_size=batch_size, progress=True)
        out_f.append(f)
        out_s.append(s)
        source.append(np.arange(len(images)))
    return np.concatenate(out_f), np.concatenate(out_s), np.concatenate(source)


def plot_history(history: list[dict], path: Path) -> None:
    plt = pyplot()

    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(5.2, 3.3))
    for key, style in (("train/loss", "-o"), ("train/lt", "--"), ("train/lp", ":"), ("train/lt_average", "-.")):
        if history and key in history[0]:
            ax.plot(epochs, [h[key] for h in history], style, label=key)
    ax.set(xlabel="epoch", ylabel="loss", title="CAFace: Lt + λp·Lp (Lt of plain averaging for reference)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def run(cfg: FusionStageConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import landmarks_array, load_images, read_dataset_info, read_manifest
    from ml.models.fusion.caface import save_caface
    from ml.models.io import load_model
    from ml.train.fr import needs_keypoints
    from ml.train.fusion import train_fusion

    fr_dir = paths.fr_model(cfg.fr_source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {cfg.fr_source!r} but {fr_dir} holds no model: run "
                        f"`dvc repro train_fr@{cfg.fr_source}` first.")
    model, fr_config = load_model(fr_dir)
    contract = fr_config["input_contract"]
    if "style_dim" not in contract:
        raise ConfigError(f"the FR model in {fr_dir} declares no style taps (input_contract.style_dim); CAFace needs "
                          "a ViT or IResNet backbone.")
    train_cfg = dataclasses.replace(cfg.train, feature_dim=int(contract["embedding_dim"]),
                                    style_dim=int(contract["style_dim"]))
    manifest = read_manifest(paths.train_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    images = load_images(paths.train_set, rows, expected_size=(data.image_size, data.image_size), progress=True)
    keypoints = landmarks_array(rows) if needs_keypoints(model) else None
    feats, styles, source = augmented_features(model, images, keypoints, cfg.augmented_copies, train_cfg.seed)
    labels = rows["label"].to_numpy(np.int64)[source]
    res = train_fusion(train_cfg, feats, styles, labels, progress=True, callbacks=core_share_callbacks())
    info = read_dataset_info(paths.train_set)
    extra = {"registered_name": REGISTERED_MODEL, "fr_model": str(fr_dir.relative_to(paths.root)),
             "fr_data_digest": fr_config.get("extra", {}).get("training_data_digest", ""),
             "training_data_digest": info["digest"], "training_features": int(len(feats))}
    save_caface(res.model, paths.fusion_model, extra=extra)

    last = res.history[-1] if res.history else {}
    result = StageResult("train_fusion", outputs=[paths.fusion_model])
    result.metrics = {k: float(v) for k, v in last.items() if k.startswith("train/")}
    result.metrics["train/features"] = float(len(feats))
    write_json(paths.metrics / "train_fusion.json", result.metrics)
    write_history_csv(paths.plots / "train_fusion_history.csv", res.history)
    plot_history(res.history, paths.plots / "train_fusion_loss.png")
    result.summary = (f"CAFace trained on {len(feats)} features ({cfg.augmented_copies} augmented copies) of "
                      f"{fr_dir.name} → {paths.fusion_model}")
    if tracker is not None:
        tracker.log_dataset(paths.train_set, context="train")
        for h in res.history:
            tracker.log_metrics({k: v for k, v in h.items() if k.startswith("train/")}, step=int(h["epoch"]))
        tracker.log_artifact(paths.plots / "train_fusion_loss.png", artifact_path="plots")
        version = tracker.register_model_dir(REGISTERED_MODEL, model_dir=paths.fusion_model,
                                             tags={"fr_model": extra["fr_model"], "data_digest": info["digest"]})
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("train_fusion", {"fusion": section(params, "fusion")}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main)
