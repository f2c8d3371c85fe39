"""Stage ``train_fusion``: CAFace set fusion on features of the frozen FR model, trained on surveillance-degraded sets.

CAFace learns to weight a few usable frames up among many unusable ones only from sets like the IJB-S-style probes,
so it trains on the reference recipe (``mk-minchul/caface``): an identity's target ``f_GT`` is the mean unit flip
feature ``f(x) + f(flip x)`` of *clean* images, its set items heavily degraded copies of 1–3 *source* images.

- procedural (default): ``data/prepared/fusion`` (``ml.data.surveillance.fusion_faces``), identities no other set
  uses; items the ``degraded`` rows (``template`` = source), targets the ``clean`` rows.
- real faces ingested: ``data/prepared/train`` split ``train``; every image is a clean image and a source of
  ``data.fusion_copies`` copies degraded in image space (``degrade_image``, seeded by ``fusion.train.seed``).

The last ``fusion.val_identities`` identities (by name) are held out: after every epoch CAFace fuses fixed sets of
theirs (``ml.fusion.train.val_sets``) and is scored against their targets (``val/lt``, ``val/rank1``, beside plain
averaging's), which is what the recipe and ``faceops sweep train_fusion`` are chosen on; the video and template test
sets are read by ``evaluate`` alone.

Features and styles come from ``models/fr/<fusion.fr_source>`` (set items without flip, as probes are embedded);
training is ``ml.fusion.train``. Writes ``models/fusion/`` (``training_data``: ``procedural-fusion`` or
``real-degraded``), ``metrics/train_fusion.json`` and the loss curve; registers ``faceops-fusion`` as ``candidate``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ml.config import from_mapping
from ml.data.surveillance import SurveillanceConfig
from ml.errors import ConfigError, DataError
from ml.fusion.train import FusionConfig
from ops.tracking import registered_note
from tasks import registered_model
from tasks.common import (
    Paths, StageResult, load_params, numerics, plot_history, section, stage_main, write_history_csv, write_json,
)
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)

REGISTERED_MODEL = registered_model("train_fusion")
FEATURE_BATCH = 256  # images per FR forward pass


@dataclass(frozen=True)
class FusionStageConfig:
    """``params.yaml`` section ``fusion``; ``train`` holds ml/fusion/train.py's FusionConfig keys (its feature and
    style sizes are taken from the FR model, whatever is written there). ``val_*``: the held-out identities and the
    fixed sets of theirs scored every epoch."""

    fr_source: str = "real"
    val_identities: int = 50
    val_set_size: int = 16
    val_sets_per_identity: int = 4
    train: FusionConfig = field(
        default_factory=lambda: FusionConfig(epochs=5, steps_per_epoch=100, lr_steps=(4,), batch_size=32, lr=1e-4,
                                             lambda_p=0.0, lambda_u=0.3)
    )

    def __post_init__(self) -> None:
        for key in ("val_identities", "val_set_size", "val_sets_per_identity"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "val_identities" else 1):
                raise ConfigError(f"fusion.{key} must be an integer ≥ {0 if key == 'val_identities' else 1}, got "
                                  f"{value!r}")


@dataclass(frozen=True)
class FusionMaterial:
    """What CAFace trains on: degraded set items of K identities and their clean targets."""

    features: np.ndarray  # (N, D) FR features of the set items
    styles: np.ndarray  # (N, style_dim, 2)
    labels: np.ndarray  # (N,) identity 0..K-1
    sources: np.ndarray  # (N,) the source image each item is a copy of
    centres: np.ndarray  # (K, D) unit targets f_GT
    dataset: Path  # the prepared dataset it was built from
    kind: str  # "procedural-fusion" | "real-degraded"


def clean_centres(model: Any, images: np.ndarray, keypoints: np.ndarray | None, labels: np.ndarray,
                  num_classes: int, batch_size: int = FEATURE_BATCH) -> np.ndarray:
    """``f_GT`` (K, D): per-identity mean of the unit features ``f(x) + f(flip x)`` of clean ``images``, unit norm."""
    import torch

    from ml.fusion.sets import features_and_styles
    from ml.fusion.train import identity_centres

    feats, _ = features_and_styles(model, images, keypoints=keypoints, batch_size=batch_size, resize=True,
                                   flip=True, progress=True)
    return identity_centres(torch.from_numpy(feats), torch.from_numpy(labels.astype(np.int64)), num_classes).numpy()


def degraded_copies(images: np.ndarray, copies: int, surveillance: SurveillanceConfig,
                    rng: np.random.Generator) -> np.ndarray:
    """(n·copies, H, W, 3) uint8: ``copies`` surveillance-degraded copies of each image, image by image (row
    ``i·copies + c`` is copy ``c`` of image ``i``); a copy is usable with probability ``usable_fraction``."""
    from ml.data.surveillance import degrade_image, draw_copy_degradation

    out = np.empty((len(images) * copies, *images.shape[1:]), dtype=np.uint8)
    for i, image in enumerate(images):
        for c in range(copies):
            degradation = draw_copy_degradation(rng, surveillance)
            out[i * copies + c] = degrade_image(image, degradation, int(rng.integers(0, 2**31)))
    return out


def degraded_features(model: Any, images: np.ndarray, keypoints: np.ndarray | None, copies: int,
                      surveillance: SurveillanceConfig, seed: int,
                      batch_size: int = FEATURE_BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Features (N·copies, D) and styles (N·copies, style_dim, 2) of ``copies`` degraded copies of each image
    (:func:`degraded_copies`, row ``i·copies + c``), degraded and embedded a few images at a time (memory
    O(batch), not O(N·copies)); the same rows whatever ``batch_size``."""
    from tqdm.auto import tqdm

    from ml.fusion.sets import features_and_styles

    rng = np.random.default_rng([seed, 93])
    per = max(1, batch_size // copies)  # source images per chunk: about batch_size copies
    feats, styles = [], []
    for lo in tqdm(range(0, len(images), per), desc="degraded copies", unit="chunk", leave=False):
        part = degraded_copies(images[lo:lo + per], copies, surveillance, rng)
        kps = None if keypoints is None else np.repeat(keypoints[lo:lo + per], copies, axis=0)
        f, s = features_and_styles(model, part, keypoints=kps, batch_size=batch_size, resize=True)
        feats.append(f)
        styles.append(s)
    return np.concatenate(feats), np.concatenate(styles)


def procedural_material(model: Any, paths: Paths, data: DataConfig) -> FusionMaterial:
    """Set items and targets from ``data/prepared/fusion`` (split ``degraded``: items, ``template`` = source;
    split ``clean``: the targets, with flip)."""
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.fusion.sets import features_and_styles
    from ml.fr.train import needs_keypoints

    path = paths.fusion_set / "manifest.parquet"
    manifest = read_manifest(path)
    degraded = manifest[manifest["split"] == "degraded"].reset_index(drop=True)
    clean = manifest[manifest["split"] == "clean"].reset_index(drop=True)
    if degraded.empty:
        raise DataError(f"{path}: no 'degraded' rows, so CAFace has no sets to train on; rebuild it with "
                        "`dvc repro prepare`")
    if degraded["template"].isna().any():
        raise DataError(f"{path}: degraded row {int(degraded['template'].isna().idxmax())} has no template (its source "
                        "image); rebuild it with `dvc repro prepare`")
    names, labels = np.unique(degraded["identity"].to_numpy(str), return_inverse=True)
    missing = sorted(set(names) - set(clean["identity"]))
    if missing:
        raise DataError(f"{path}: identity {missing[0]!r} has degraded rows but no clean one, so no target "
                        f"({len(missing)} such identities); rebuild it with `dvc repro prepare`")
    clean = clean[clean["identity"].isin(names)].reset_index(drop=True)
    size = (data.image_size, data.image_size)
    keypoints = needs_keypoints(model)
    images = load_images(paths.fusion_set, clean, expected_size=size, progress=True)
    centres = clean_centres(model, images, landmarks_array(clean) if keypoints else None,
                            np.searchsorted(names, clean["identity"].to_numpy(str)), len(names))
    images = load_images(paths.fusion_set, degraded, expected_size=size, progress=True)
    feats, styles = features_and_styles(model, images, keypoints=landmarks_array(degraded) if keypoints else None,
                                        batch_size=FEATURE_BATCH, progress=True, resize=True)
    return FusionMaterial(feats, styles, labels.astype(np.int64), degraded["template"].to_numpy(np.int64), centres,
                          paths.fusion_set, "procedural-fusion")


def real_material(model: Any, paths: Paths, data: DataConfig, seed: int) -> FusionMaterial:
    """Set items and targets from the real training faces (``data/prepared/train``, split ``train``): each image is
    a source (``data.fusion_copies`` degraded copies) and a clean image for its identity's target."""
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.fr.train import needs_keypoints

    manifest = read_manifest(paths.train_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    if rows.empty:
        raise DataError(f"{paths.train_set / 'manifest.parquet'}: no 'train' rows to build CAFace's sets from; "
                        "check data.ingest_* and rerun `dvc repro prepare`")
    _, labels = np.unique(rows["label"].to_numpy(np.int64), return_inverse=True)
    images = load_images(paths.train_set, rows, expected_size=(data.image_size, data.image_size), progress=True)
    keypoints = landmarks_array(rows) if needs_keypoints(model) else None
    centres = clean_centres(model, images, keypoints, labels, int(labels.max()) + 1)
    feats, styles = degraded_features(model, images, keypoints, data.fusion_copies, data.surveillance_config(), seed)
    items = np.repeat(np.arange(len(rows)), data.fusion_copies)  # row i·copies + c is a copy of image i
    return FusionMaterial(feats, styles, labels[items].astype(np.int64), items.astype(np.int64), centres,
                          paths.train_set, "real-degraded")


def split_val(material: FusionMaterial, cfg: FusionStageConfig) -> tuple[FusionMaterial, Any]:
    """(the material of the identities CAFace trains on, ``FusionVal`` sets of the last ``cfg.val_identities``
    identities — None when 0); the labels of both stay contiguous."""
    from ml.fusion.train import val_sets

    k = len(material.centres)
    if not cfg.val_identities:
        return material, None
    first = k - cfg.val_identities
    if first < 2:
        raise ConfigError(f"fusion.val_identities = {cfg.val_identities} leaves {max(first, 0)} of the {k} identities "
                          f"in {material.dataset} to train on; CAFace needs at least 2: lower fusion.val_identities "
                          "(0 trains on all of them without val/*)")
    held = material.labels >= first
    val = val_sets(material.features[held], material.styles[held], material.labels[held] - first,
                   material.centres[first:], sources=material.sources[held], set_size=cfg.val_set_size,
                   sets_per_identity=cfg.val_sets_per_identity)
    keep = ~held
    train = dataclasses.replace(material, features=material.features[keep], styles=material.styles[keep],
                                labels=material.labels[keep], sources=material.sources[keep],
                                centres=material.centres[:first])
    return train, val


def load_material(cfg: FusionStageConfig, data: DataConfig, paths: Paths) -> tuple[FusionMaterial, Any, Path, dict]:
    """(CAFace's material, ``cfg.train`` sized to the FR model, the FR model's folder, its config): the frozen FR
    model's features of the fusion set (the real training faces' degraded copies when ingesting)."""
    from ml.models.io import load_model

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
    if data.ingested:
        material = real_material(model, paths, data, train_cfg.seed)
    elif (paths.fusion_set / "manifest.parquet").is_file():
        material = procedural_material(model, paths, data)
    else:
        raise DataError(f"{paths.fusion_set} holds no dataset: CAFace trains on it when no real faces are ingested; "
                        "run `dvc repro prepare`.")
    return material, train_cfg, fr_dir, fr_config


def run(cfg: FusionStageConfig, data: DataConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import read_dataset_info
    from ml.fusion.caface import save_caface
    from ml.fusion.train import train_fusion

    material, train_cfg, fr_dir, fr_config = load_material(cfg, data, paths)
    material, val = split_val(material, cfg)
    res = train_fusion(train_cfg, material.features, material.styles, material.labels, sources=material.sources,
                       centres=material.centres, progress=True, val=val)
    info = read_dataset_info(material.dataset)
    identities = len(material.centres)
    extra = {"registered_name": REGISTERED_MODEL, "fr_model": str(fr_dir.relative_to(paths.root)),
             "fr_data_digest": fr_config.get("extra", {}).get("training_data_digest", ""),
             "training_data": material.kind, "training_data_digest": info["digest"],
             "training_features": int(len(material.features)), "training_identities": identities,
             "training_sources": int(np.unique(material.sources).size), "recipe": train_cfg.to_dict(),
             "val_identities": cfg.val_identities,
             "val": {k: float(v) for k, v in (res.history[-1] if res.history else {}).items() if k.startswith("val/")},
             **numerics(train_cfg.accelerator, train_cfg.precision)}
    save_caface(res.model, paths.fusion_model, extra=extra)

    last = res.history[-1] if res.history else {}
    result = StageResult("train_fusion", outputs=[paths.fusion_model])
    result.metrics = {k: float(v) for k, v in last.items() if k.startswith(("train/", "val/"))}
    result.metrics.update({"train/features": float(len(material.features)), "train/identities": float(identities),
                           "train/steps": float(res.steps)})
    write_json(paths.metrics / "train_fusion.json", result.metrics)
    write_history_csv(paths.plots / "train_fusion_history.csv", res.history)
    panels = [{"title": "CAFace: Lt + λp·Lp (Lt of plain averaging for reference)", "ylabel": "loss",
               "curves": [(k, res.history, k) for k in ("train/loss", "train/lt", "train/lp", "train/lt_average")]}]
    if val is not None:
        panels += [{"title": f"val: {cfg.val_identities} held-out identities", "ylabel": "Lt",
                    "curves": [(k, res.history, k) for k in ("val/lt", "val/lt_average")]},
                   {"title": f"val rank-1 (chance {1 / cfg.val_identities:.3f})", "ylabel": "rank-1",
                    "curves": [(k, res.history, k) for k in ("val/rank1", "val/rank1_average")]}]
    plot_history(paths.plots / "train_fusion_loss.png", panels)
    result.summary = (f"CAFace trained {res.steps} steps on {len(material.features)} degraded faces of {identities} "
                      f"identities ({material.kind}: {material.dataset.relative_to(paths.root)}) with features of "
                      f"{fr_dir.name} → {paths.fusion_model}")
    if tracker is not None:
        tracker.log_dataset(material.dataset, context="train")
        for h in res.history:
            tracker.log_metrics({k: v for k, v in h.items() if k.startswith(("train/", "val/"))},
                                step=int(h["epoch"]))
        tracker.log_metrics(result.metrics)  # the curves' last points are not repeated (StageTracker)
        tracker.log_artifact(paths.plots / "train_fusion_loss.png", artifact_path="plots")
        version = tracker.register_model_dir(REGISTERED_MODEL, model_dir=paths.fusion_model,
                                             tags={"fr_model": extra["fr_model"], "data_digest": info["digest"],
                                                   "training_data": material.kind})
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    data_keys = {k: v for k, v in section(params, "data").items() if k.startswith("fusion_") or k == "surveillance"}
    with stage_run("train_fusion", {"fusion": section(params, "fusion"), "data": data_keys}, paths.root) as tracker:
        result = run(cfg, data, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "train_fusion")
