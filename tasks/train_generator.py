"""Stage ``train_generator``: UIFace's ID-conditioned diffusion model on the training faces.

Each training face (``data/prepared/train``, split ``train``) is embedded by the FR model
``models/fr/<generator.fr_source>``; the L2-normalised embedding is the face's identity context. The generator
(ml/models/generator/uiface.py, trained by ml/train/generator.py) learns ε-prediction on (face, context) pairs,
with the context dropped element-wise (0.25) and replaced by the learnable empty context ``c_e`` with
probability 0.2. The embedded default runs in pixel space at ``generator.train.model.image_size`` (faces are
resized to it); ``generator.autoencoder`` names a local diffusers ``VQModel``/``AutoencoderKL`` directory for
latent-space runs (faces are resized to the size whose latent matches the UNet).

Writes ``models/generator/`` (the EMA weights + config with the noise schedule), ``metrics/train_generator.json``
and the loss curve; registers ``faceops-generator`` with alias ``candidate``.
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
from ml.models.generator.uiface import GeneratorModelConfig
from ml.train.generator import GeneratorConfig
from tasks.common import (
    Paths, StageResult, core_share_callbacks, load_params, pyplot, save_figure, section, stage_main,
    write_history_csv, write_json,
)
from tasks.tracking import registered_note

log = logging.getLogger(__name__)

REGISTERED_MODEL = "faceops-generator"
AUTOENCODER_KINDS = ("vq", "kl")


@dataclass(frozen=True)
class GeneratorStageConfig:
    """``params.yaml`` section ``generator``; ``train`` holds ml/train/generator.py's GeneratorConfig keys (the
    context size ``train.model.id_dim`` is taken from the FR model, whatever is written there)."""

    fr_source: str = "real"            # the FR model whose embeddings are the identity contexts
    autoencoder: str | None = None     # local diffusers VQModel/AutoencoderKL directory; none = pixel space
    autoencoder_kind: str = "vq"       # vq | kl
    max_images: int = 0                # train on the first N training faces (0 = all)
    train: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        model=GeneratorModelConfig(image_size=32, block_out_channels=(32, 64, 64)), epochs=8, batch_size=64))

    def __post_init__(self) -> None:
        if self.autoencoder_kind not in AUTOENCODER_KINDS:
            raise ConfigError(f"generator.autoencoder_kind {self.autoencoder_kind!r} is not one of "
                              f"{list(AUTOENCODER_KINDS)}")
        if isinstance(self.max_images, bool) or not isinstance(self.max_images, int) or self.max_images < 0:
            raise ConfigError(f"generator.max_images = {self.max_images!r}: need an integer ≥ 0 (0 = all)")


def resize_faces(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 (N, H, W, 3) → uint8 (N, size, size, 3), antialiased bilinear; unchanged when already that size."""
    import torch
    import torch.nn.functional as F

    if images.shape[1] == size and images.shape[2] == size:
        return images
    out = np.empty((len(images), size, size, 3), dtype=np.uint8)
    for start in range(0, len(images), 512):
        x = torch.from_numpy(images[start:start + 512]).permute(0, 3, 1, 2).float()
        y = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out[start:start + 512] = y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return out


def load_fr(paths: Paths, source: str, key: str) -> tuple[Any, dict[str, Any], Path]:
    """(model, config, directory) of ``models/fr/<source>``; a missing model names ``key`` and the stage to run."""
    from ml.models.io import load_model

    fr_dir = paths.fr_model(source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"{key} is {source!r} but {fr_dir} holds no FR model to embed faces into identity contexts: "
                        f"run `dvc repro train_fr@{source}` first.")
    model, config = load_model(fr_dir)
    return model, config, fr_dir


def identity_embeddings(model: Any, images: np.ndarray, landmarks: np.ndarray | None) -> np.ndarray:
    """L2-normalised FR embeddings (flip TTA) of uint8 faces at the FR model's input size; KP-RPE models get
    ``landmarks`` (N, 5, 2) in the images' pixels, rescaled with the images."""
    from ml.train.fr import embed, needs_keypoints

    size = int(model.input_contract["size"])
    kp = None
    if needs_keypoints(model):
        if landmarks is None:
            raise DataError(f"the FR model ({type(model).__name__}) needs 5 landmarks per face and none were given")
        kp = landmarks.astype(np.float32) * (size / images.shape[1])
    emb = embed(model, resize_faces(images, size), keypoints=kp, progress=True)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(1e-12)


def load_autoencoder_for(cfg: GeneratorStageConfig, paths: Paths) -> Any:
    from ml.models.generator.uiface import load_autoencoder

    if not cfg.autoencoder:
        return None
    path = Path(cfg.autoencoder)
    return load_autoencoder(path if path.is_absolute() else paths.root / path, kind=cfg.autoencoder_kind)


def plot_history(history: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([h["epoch"] for h in history], [h["train/loss"] for h in history], "-o")
    ax.set(xlabel="epoch", ylabel="‖ε − ε_θ(x_t, t, c)‖²", title="UIFace generator: ε-prediction loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)


def run(cfg: GeneratorStageConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import landmarks_array, load_images, read_dataset_info, read_manifest
    from ml.train.generator import train_generator

    fr, fr_config, fr_dir = load_fr(paths, cfg.fr_source, "generator.fr_source")
    model_cfg = dataclasses.replace(cfg.train.model, id_dim=int(fr_config["input_contract"]["embedding_dim"]))
    train_cfg = dataclasses.replace(cfg.train, model=model_cfg)
    manifest = read_manifest(paths.train_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    if cfg.max_images:
        rows = rows.iloc[: cfg.max_images].reset_index(drop=True)
    images = load_images(paths.train_set, rows, progress=True)
    contexts = identity_embeddings(fr, images, landmarks_array(rows))
    autoencoder = load_autoencoder_for(cfg, paths)
    size = model_cfg.image_size
    if autoencoder is not None:
        size *= 2 ** (len(autoencoder.config.block_out_channels) - 1)
    res = train_generator(train_cfg, resize_faces(images, size), contexts, autoencoder=autoencoder, progress=True,
                          callbacks=core_share_callbacks())
    info = read_dataset_info(paths.train_set)
    extra = {"registered_name": REGISTERED_MODEL, "fr_model": str(fr_dir.relative_to(paths.root)),
             "fr_data_digest": fr_config.get("extra", {}).get("training_data_digest", ""),
             "training_data_digest": info["digest"], "training_images": int(len(rows)),
             "autoencoder": cfg.autoencoder or "", "autoencoder_kind": cfg.autoencoder_kind if cfg.autoencoder else ""}
    res.save(paths.generator_model, extra=extra)

    last = res.history[-1] if res.history else {}
    result = StageResult("train_generator", outputs=[paths.generator_model])
    result.metrics = {"train/loss": float(last.get("train/loss", float("nan"))), "train/seconds": float(res.seconds),
                      "train/images": float(len(rows))}
    write_json(paths.metrics / "train_generator.json", result.metrics)
    write_history_csv(paths.plots / "train_generator_history.csv", res.history, ["epoch", "train/loss"])
    plot_history(res.history, paths.plots / "train_generator_loss.png")
    result.summary = (f"UIFace generator ({res.space} space, {size}px faces) trained on {len(rows)} faces with "
                      f"{fr_dir.name} contexts in {res.seconds:.0f}s → {paths.generator_model}")
    if tracker is not None:
        tracker.log_dataset(paths.train_set, context="train")
        for h in res.history:
            tracker.log_metrics({k: v for k, v in h.items() if k.startswith("train/")}, step=int(h["epoch"]))
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "train_generator_loss.png", artifact_path="plots")
        version = tracker.register_model_dir(REGISTERED_MODEL, model_dir=paths.generator_model,
                                             tags={"fr_model": extra["fr_model"], "data_digest": info["digest"]})
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    with stage_run("train_generator", {"generator": section(params, "generator")}, paths.root) as tracker:
        result = run(cfg, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main)
