"""Stage ``train_generator``: UIFace's ID-conditioned diffusion model on the training faces.

Each training face (``data/prepared/train``, split ``train``) is embedded by the FR model
``models/fr/<generator.fr_source>``; the L2-normalised embedding is the face's identity context. The generator
(ml/generator/uiface.py, trained by ml/generator/train.py) learns ε-prediction on (face, context) pairs,
with the context dropped element-wise (0.25) and replaced by the learnable empty context ``c_e`` with
probability 0.2. ``generator.space: pixel`` denoises the faces at ``generator.train.model.image_size`` (faces are
resized to it); ``generator.autoencoder`` names a local diffusers ``VQModel``/``AutoencoderKL``/``AutoencoderTiny``
directory for latent-space runs (faces are resized to the size whose latent matches the UNet); ``generator.space:
latent`` without one (the default) trains a small diffusers autoencoder first on the same faces
(ml/generator/autoencoder.py: ``autoencoder_train.architecture``, pixel losses plus an FR-embedding cosine term),
saved with the UNet in ``models/generator/autoencoder`` and reported as ``autoencoder/psnr`` and
``autoencoder/fr_cosine`` (plots/autoencoder_reconstructions.png).

Contexts follow one convention for training and sampling: the FR embedding of a face as the generator renders it
(pixel space: resized to the UNet's size and back; latent space: the face itself, the autoencoder's output size),
which is how ``synthesize`` embeds generated faces.

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

from ml.atomic import atomic_path
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.generator.uiface import GeneratorModelConfig, autoencoder_factor
from ml.generator.autoencoder import AutoencoderConfig
from ml.generator.train import GeneratorConfig
from ops.tracking import registered_note
from tasks import registered_model
from tasks.common import (
    Paths, StageResult, load_params, numerics, plot_history, pyplot, save_figure, section, stage_main,
    write_history_csv, write_json,
)

log = logging.getLogger(__name__)

REGISTERED_MODEL = registered_model("train_generator")
AUTOENCODER_KINDS = ("vq", "kl", "tiny")
SPACES = ("pixel", "latent")
AUTOENCODER_DIR = "autoencoder"  # models/generator/autoencoder: the autoencoder trained in phase 1 (latent space)


@dataclass(frozen=True)
class GeneratorProbe:
    """What ``faceops sweep train_generator`` scores a trial's generator on (``tasks.synthesize.probe_generator``):
    ``synthetic_identities`` × ``images_per_identity`` faces sampled as ``synthesize`` samples them, and a small FR
    model trained on them for ``fr_epochs`` epochs (params ``fr`` otherwise)."""

    synthetic_identities: int = 16
    images_per_identity: int = 8
    fr_epochs: int = 4

    def __post_init__(self) -> None:
        for key, low in (("synthetic_identities", 2), ("images_per_identity", 2), ("fr_epochs", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"generator.probe.{key} = {value!r}: need an integer ≥ {low}")


@dataclass(frozen=True)
class GeneratorStageConfig:
    """``params.yaml`` section ``generator``; ``train`` holds ml/generator/train.py's GeneratorConfig keys (the
    context size ``train.model.id_dim`` is taken from the FR model, whatever is written there)."""

    fr_source: str = "real"            # the FR model whose embeddings are the identity contexts
    space: str = "pixel"               # pixel | latent (the UNet denoises an autoencoder's latent)
    autoencoder: str | None = None     # a local diffusers VQModel/AutoencoderKL/AutoencoderTiny directory; none with
                                       # space latent: one is trained here first (autoencoder_train)
    autoencoder_kind: str = "vq"       # vq | kl | tiny (of a given autoencoder; a trained one is autoencoder_train's)
    autoencoder_train: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    max_images: int = 0                # train on the first N training faces (0 = all)
    train: GeneratorConfig = field(default_factory=lambda: GeneratorConfig(
        model=GeneratorModelConfig(image_size=32, block_out_channels=(32, 64, 64)), epochs=8, batch_size=64))
    probe: GeneratorProbe = field(default_factory=GeneratorProbe)  # the sweep's objective (not used by the stage)

    def __post_init__(self) -> None:
        if self.autoencoder_kind not in AUTOENCODER_KINDS:
            raise ConfigError(f"generator.autoencoder_kind {self.autoencoder_kind!r} is not one of "
                              f"{list(AUTOENCODER_KINDS)}")
        if self.space not in SPACES:
            raise ConfigError(f"generator.space {self.space!r} is not one of {list(SPACES)}")
        if isinstance(self.max_images, bool) or not isinstance(self.max_images, int) or self.max_images < 0:
            raise ConfigError(f"generator.max_images = {self.max_images!r}: need an integer ≥ 0 (0 = all)")
        channels, unet = self.autoencoder_train.latent_channels, self.train.model.in_channels
        if self.space == "latent" and not self.autoencoder and unet != channels:  # before minutes of autoencoder
            raise ConfigError(f"generator.train.model.in_channels = {unet} but the autoencoder trained here makes "
                              f"{channels}-channel latents (generator.autoencoder_train.latent_channels); set both "
                              "to the same value")


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
    from ml.fr.train import embed, needs_keypoints

    size = int(model.input_contract["size"])
    kp = None
    if needs_keypoints(model):
        if landmarks is None:
            raise DataError(f"the FR model ({type(model).__name__}) needs 5 landmarks per face and none were given")
        kp = landmarks.astype(np.float32) * (size / images.shape[1])
    emb = embed(model, resize_faces(images, size), keypoints=kp, progress=True)
    return emb / np.linalg.norm(emb, axis=1, keepdims=True).clip(1e-12)


def load_autoencoder_for(cfg: GeneratorStageConfig, paths: Paths) -> Any:
    """The autoencoder ``generator.autoencoder`` names (frozen), or None when the stage trains one or runs in pixels."""
    from ml.generator.uiface import load_autoencoder

    if not cfg.autoencoder:
        return None
    path = Path(cfg.autoencoder)
    return load_autoencoder(path if path.is_absolute() else paths.root / path, kind=cfg.autoencoder_kind)


def generator_autoencoder(paths: Paths, extra: dict[str, Any], cfg: GeneratorStageConfig,
                          model_dir: Path | None = None) -> Any:
    """The autoencoder a saved generator (``model_dir``, default ``models/generator``) samples through: the one
    trained with it (``<model_dir>/autoencoder``), else the one its config names (``extra["autoencoder"]``, then
    ``generator.autoencoder``); None for a pixel-space generator."""
    from ml.generator.uiface import load_autoencoder

    if extra.get("space", "pixel") == "pixel":
        return None
    own = Path(model_dir or paths.generator_model) / AUTOENCODER_DIR
    if (own / "config.json").is_file():
        return load_autoencoder(own, kind=extra.get("autoencoder_kind") or "kl")
    recorded = extra.get("autoencoder") or cfg.autoencoder
    if not recorded:
        raise DataError(f"{paths.generator_model} is a {extra.get('space')} generator but names no autoencoder; "
                        "re-run `dvc repro train_generator`")
    path = Path(recorded)
    return load_autoencoder(path if path.is_absolute() else paths.root / path,
                            kind=extra.get("autoencoder_kind") or cfg.autoencoder_kind)


def reconstruction_report(autoencoder: Any, fr: Any, images: np.ndarray, contexts: np.ndarray,
                          landmarks: np.ndarray | None, path: Path) -> dict[str, float]:
    """PSNR (dB, faces in [0, 255]) and mean FR cosine between faces and their reconstructions from the posterior
    means; a picture of faces over their reconstructions goes to ``path``."""
    from ml.generator.autoencoder import reconstruct

    recon, _ = reconstruct(autoencoder, images)
    mse = ((recon.astype(np.float64) - images.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
    psnr = float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10))))
    cosine = float(np.mean(np.sum(identity_embeddings(fr, recon, landmarks) * contexts, axis=1)))
    plt = pyplot()
    k = min(10, len(images))
    fig, axes = plt.subplots(2, k, figsize=(1.2 * k, 2.8), squeeze=False)
    for i in range(k):
        for row, img in enumerate((images[i], recon[i])):
            axes[row, i].imshow(img)
            axes[row, i].axis("off")
    axes[0, 0].set_title("face", fontsize=8, loc="left")
    axes[1, 0].set_title("reconstruction", fontsize=8, loc="left")
    fig.suptitle(f"UIFace latent autoencoder: PSNR {psnr:.1f} dB, FR cosine {cosine:.2f}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return {"autoencoder/psnr": psnr, "autoencoder/fr_cosine": cosine}


@dataclass
class Fitted:
    """A trained generator (saved in ``fit``'s ``model_dir``) and what the stage reports about it."""

    result: Any  # ml.generator.train.GeneratorResult
    metrics: dict[str, float]  # autoencoder/* when one was trained or given
    extra: dict[str, Any]  # the saved config's extra
    rows: Any  # the training faces' manifest rows
    size: int  # the side of the faces the generator makes
    info: dict[str, Any]  # the training set's dataset info


def fit(cfg: GeneratorStageConfig, paths: Paths, model_dir: Path, *, report: bool = True) -> Fitted:
    """Train the generator (and, for ``space: latent`` without a given autoencoder, its autoencoder first) on the
    training faces with the FR model's contexts and save both into ``model_dir`` together. ``report``: progress
    bars, the autoencoder's history CSV and reconstruction figure (``autoencoder/psnr``, ``autoencoder/fr_cosine``)
    in ``plots/``, as the stage writes them; a sweep trial goes without."""
    from ml.data.dataset import landmarks_array, load_images, read_dataset_info, read_manifest
    from ml.generator.train import train_generator

    fr, fr_config, fr_dir = load_fr(paths, cfg.fr_source, "generator.fr_source")
    model_cfg = dataclasses.replace(cfg.train.model, id_dim=int(fr_config["input_contract"]["embedding_dim"]))
    train_cfg = dataclasses.replace(cfg.train, model=model_cfg)
    manifest = read_manifest(paths.train_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "train"].reset_index(drop=True)
    if cfg.max_images:
        rows = rows.iloc[: cfg.max_images].reset_index(drop=True)
    images = load_images(paths.train_set, rows, progress=report)
    landmarks = landmarks_array(rows)
    metrics: dict[str, float] = {}
    autoencoder = load_autoencoder_for(cfg, paths)
    trained_autoencoder = cfg.space == "latent" and autoencoder is None
    size = model_cfg.image_size  # the side of the faces the generator makes: its UNet's, × the autoencoder's factor
    if autoencoder is not None:
        size *= autoencoder_factor(autoencoder)
    elif trained_autoencoder:
        size *= cfg.autoencoder_train.factor
    faces = resize_faces(images, size)
    face_landmarks = None if landmarks is None else landmarks * (size / images.shape[1])
    # contexts as sampling makes them: the FR embedding of a face rendered the way the generator renders faces
    # (at its output size, then resized to the FR model's), so training and synthesis share one convention; the
    # autoencoder's identity term aims at the same embeddings (what a perfect reconstruction of these faces gives)
    contexts = identity_embeddings(fr, faces, face_landmarks)
    if trained_autoencoder:  # phase 1: the latent space, from the same faces at the generator's face size
        from ml.generator.autoencoder import train_autoencoder

        ae_cfg = cfg.autoencoder_train
        autoencoder, ae_history, ae_seconds = train_autoencoder(
            ae_cfg, faces, contexts, fr if ae_cfg.fr_weight > 0 else None, face_landmarks,
            progress=report)
        metrics["autoencoder/seconds"] = float(ae_seconds)
        if report:
            write_history_csv(paths.plots / "train_autoencoder_history.csv", ae_history,
                              ["epoch", "train/loss", "train/pixel", "train/fr_cosine"])
    if autoencoder is not None and report:
        report_rows = min(len(faces), 1024)
        metrics.update(reconstruction_report(
            autoencoder, fr, faces[:report_rows], contexts[:report_rows],
            None if face_landmarks is None else face_landmarks[:report_rows],
            paths.plots / "autoencoder_reconstructions.png"))
    res = train_generator(train_cfg, faces, contexts, autoencoder=autoencoder, progress=report)
    info = read_dataset_info(paths.train_set)
    extra = {"registered_name": REGISTERED_MODEL, "fr_model": str(fr_dir.relative_to(paths.root)),
             "fr_data_digest": fr_config.get("extra", {}).get("training_data_digest", ""),
             "training_data_digest": info["digest"], "training_images": int(len(rows)),
             "autoencoder": cfg.autoencoder or "", "autoencoder_kind": cfg.autoencoder_kind if cfg.autoencoder else "",
             "context_size": int(size), **numerics(train_cfg.accelerator, train_cfg.precision)}
    if trained_autoencoder:
        extra["autoencoder"] = str((model_dir / AUTOENCODER_DIR).relative_to(paths.root)
                                   if model_dir.is_relative_to(paths.root) else model_dir / AUTOENCODER_DIR)
        extra["autoencoder_kind"] = cfg.autoencoder_train.architecture
        extra["autoencoder_train"] = {k: (list(v) if isinstance(v, tuple) else v)
                                      for k, v in dataclasses.asdict(cfg.autoencoder_train).items()}
    with atomic_path(model_dir) as tmp:  # the UNet and its autoencoder appear together
        res.save(tmp, extra=extra)
        if trained_autoencoder:
            autoencoder.save_pretrained(str(tmp / AUTOENCODER_DIR))
    return Fitted(res, metrics, extra, rows, size, info)


# the training loss plotted per prediction type (GeneratorConfig.prediction_type)
LOSS_TITLES = {"epsilon": "ε-prediction", "v_prediction": "v-prediction", "edm": "EDM"}
LOSS_LABELS = {"epsilon": "w_t ‖ε − ε_θ(x_t, t, c)‖²", "v_prediction": "w_t ‖v − v_θ(x_t, t, c)‖²",
               "edm": "‖F_θ(x_t, σ, c) − F_target‖²"}


def run(cfg: GeneratorStageConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    fitted = fit(cfg, paths, paths.generator_model)
    res, metrics, extra, rows, size, info = (fitted.result, fitted.metrics, fitted.extra, fitted.rows, fitted.size,
                                             fitted.info)
    fr_dir = paths.root / extra["fr_model"]

    last = res.history[-1] if res.history else {}
    result = StageResult("train_generator", outputs=[paths.generator_model])
    result.metrics = {"train/loss": float(last.get("train/loss", float("nan"))), "train/seconds": float(res.seconds),
                      "train/images": float(len(rows)), **metrics}
    write_json(paths.metrics / "train_generator.json", result.metrics)
    write_history_csv(paths.plots / "train_generator_history.csv", res.history, ["epoch", "train/loss"])
    plot_history(paths.plots / "train_generator_loss.png", [{
        "title": f"UIFace generator: {LOSS_TITLES[cfg.train.prediction_type]} loss ({cfg.train.loss_weighting})",
        "ylabel": LOSS_LABELS[cfg.train.prediction_type],
        "curves": [("train/loss", res.history, "train/loss")]}])
    result.summary = (f"UIFace generator ({res.space} space, {size}px faces) trained on {len(rows)} faces with "
                      f"{fr_dir.name} contexts in {res.seconds:.0f}s → {paths.generator_model}")
    if tracker is not None:
        tracker.log_dataset(paths.train_set, context="train")
        for h in res.history:
            tracker.log_metrics({k: v for k, v in h.items() if k.startswith("train/")}, step=int(h["epoch"]))
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "train_generator_loss.png", artifact_path="plots")
        if "autoencoder/psnr" in metrics:  # the picture is drawn with the numbers
            tracker.log_artifact(paths.plots / "autoencoder_reconstructions.png", artifact_path="plots")
        version = tracker.register_model_dir(REGISTERED_MODEL, model_dir=paths.generator_model,
                                             tags={"fr_model": extra["fr_model"], "data_digest": info["digest"]})
        result.summary += f"; {registered_note(REGISTERED_MODEL, version)}"
    return result


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    with stage_run("train_generator", {"generator": section(params, "generator")}, paths.root) as tracker:
        result = run(cfg, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "train_generator")
