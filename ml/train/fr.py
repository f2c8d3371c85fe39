"""Face-recognition training: a backbone + margin softmax head fitted with Lightning on in-memory images.

``train(cfg, images, labels)`` is the whole stage: it seeds, builds the registered backbone for the
images' size, fits it with AdamW (linear warmup, then cosine decay per step) under an ArcFace or
CosFace head, and returns the backbone in eval mode with its per-epoch history. ``embed`` turns
uint8 images into (unnormalised) embeddings with flip test-time augmentation, ``f(x) + f(flip x)``.

Data stay a uint8 ``(N, 3, H, W)`` tensor; normalisation and augmentation (random horizontal flip,
small zoom and translation as one batched affine resample) run on each batch tensor, so a step
costs no per-image Python work.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError
from ml.losses.margin import MARGINS, CombinedMarginLoss
from ml.models.backbones import BACKBONES, build_backbone, input_contract
from ml.models.backbones.vit import INPUT_CONTRACT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FRConfig:
    """``fr`` section of params.yaml."""

    backbone: str = "vit_tiny"
    embedding_dim: int = 128
    epochs: int = 12
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    margin: str = "arcface"  # "arcface" | "cosface"
    scale: float = 32.0  # s; 64 for big runs, smaller converges faster on tiny data
    augment: bool = True  # random horizontal flip + small random zoom/translation, batched in torch
    num_workers: int = 0
    seed: int = 0
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: int = 1
    max_steps: int = -1  # -1 = no limit (for smoke runs)

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ConfigError(f"fr.backbone {self.backbone!r} is not registered; valid: {', '.join(BACKBONES)}")
        if self.margin not in MARGINS:
            raise ConfigError(f"fr.margin {self.margin!r} is not one of {sorted(MARGINS)}")
        checks = {
            "embedding_dim": self.embedding_dim >= 1,
            "epochs": self.epochs >= 1,
            "batch_size": self.batch_size >= 2,  # BatchNorm in the head needs 2 samples per batch
            "lr": self.lr > 0,
            "weight_decay": self.weight_decay >= 0,
            "warmup_epochs": self.warmup_epochs >= 0,
            "scale": self.scale > 0,
            "num_workers": self.num_workers >= 0,
            "devices": self.devices >= 1,
            "max_steps": self.max_steps == -1 or self.max_steps >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(
                f"fr.{bad[0]} = {getattr(self, bad[0])!r} is out of range; need embedding_dim, epochs, devices ≥ 1, "
                "batch_size ≥ 2, lr, scale > 0, weight_decay, warmup_epochs, num_workers ≥ 0, max_steps -1 or ≥ 1"
            )


def _mean_std(contract: dict[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    contract = contract or INPUT_CONTRACT
    mean = torch.tensor(contract["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(contract["std"], dtype=torch.float32).view(1, -1, 1, 1)
    return mean, std


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) → float32 ``(x/255 − mean)/std``."""
    return (x.float() / 255.0 - mean.to(x.device)) / std.to(x.device)


def images_to_tensor(images: np.ndarray, contract: dict[str, Any] | None = None) -> torch.Tensor:
    """uint8 RGB (N, H, W, 3) → float32 (N, 3, H, W) ``(x/255 − mean)/std`` (default 0.5, 0.5)."""
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
    return normalize(x, *_mean_std(contract)).contiguous()


# ArcFace order: left eye, right eye, nose, left mouth, right mouth → after a horizontal flip
FLIP_LANDMARK_ORDER = (1, 0, 2, 4, 3)


def flip_keypoints(keypoints: torch.Tensor, size: int) -> torch.Tensor:
    """Pixel landmarks (B, 5, 2) of a horizontally flipped image: x → S−1−x, left/right points swapped."""
    flipped = keypoints[:, list(FLIP_LANDMARK_ORDER)].clone()
    flipped[..., 0] = (size - 1) - flipped[..., 0]
    return flipped


def augment_batch(
    x: torch.Tensor, max_zoom: float = 0.1, max_shift: float = 0.06, keypoints: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Random horizontal flip (p = 0.5), zoom-in by up to ``max_zoom`` of the side and translation by up
    to ``max_shift`` of the side, per sample, as one bilinear affine resample of the batch (B, C, H, W).

    With ``keypoints`` (B, 5, 2) pixel (x, y), returns ``(images, keypoints)`` with the landmarks moved by
    the same transform (and left/right swapped where flipped), so KP-RPE sees where the features went.
    """
    b, size = x.shape[0], x.shape[-1]
    dev = x.device
    flip = torch.where(torch.rand(b, device=dev) < 0.5, -1.0, 1.0)
    zoom = 1.0 - max_zoom * torch.rand(b, device=dev)  # sampled window side / image side
    shift = (torch.rand(b, 2, device=dev) * 2.0 - 1.0) * (2.0 * max_shift)  # grid coords span 2 per side
    theta = torch.zeros(b, 2, 3, device=dev, dtype=x.dtype)
    theta[:, 0, 0] = zoom * flip
    theta[:, 1, 1] = zoom
    theta[:, :, 2] = shift
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if keypoints is None:
        return out
    # output grid g maps to input A·g + t; a landmark at input n sits at A⁻¹(n − t) in the output.
    # pixel ↔ normalised (align_corners=False): n = (2p + 1)/S − 1
    n = (2.0 * keypoints + 1.0) / size - 1.0
    scale = torch.stack([zoom * flip, zoom], dim=1).unsqueeze(1)  # (B, 1, 2)
    moved = (n - shift.unsqueeze(1)) / scale
    moved = ((moved + 1.0) * size - 1.0) / 2.0
    swap = (flip < 0).view(b, 1, 1)
    moved = torch.where(swap, moved[:, list(FLIP_LANDMARK_ORDER)], moved)
    return out, moved


def warmup_cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    """LR factor: linear from 1/warmup to 1 over ``warmup_steps``, then cosine from 1 to 0 at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class FRModule(lightning.LightningModule):
    """Backbone + margin head; AdamW with per-step warmup-cosine schedule."""

    def __init__(self, backbone: nn.Module, head: CombinedMarginLoss, cfg: FRConfig, steps_per_epoch: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.cfg = cfg
        self.steps_per_epoch = steps_per_epoch
        mean, std = _mean_std(input_contract(backbone))
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("std", std, persistent=False)

    def forward(self, x: torch.Tensor, keypoints: torch.Tensor | None = None) -> torch.Tensor:
        return self.backbone(x, keypoints) if needs_keypoints(self.backbone) else self.backbone(x)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        images, labels, *rest = batch  # uint8 (B, 3, H, W), int64 (B,), [float32 (B, 5, 2) pixel landmarks]
        keypoints = rest[0] if rest else None
        x = normalize(images, self.mean, self.std)
        if self.cfg.augment:
            if keypoints is None:
                x = augment_batch(x)
            else:
                x, keypoints = augment_batch(x, keypoints=keypoints)
        cosine = self.head.cosine(self(x, keypoints))  # (B, C)
        loss = F.cross_entropy(self.head.apply_margin(cosine, labels), labels)
        accuracy = (cosine.argmax(dim=1) == labels).float().mean()
        b = labels.shape[0]
        self.log("train/loss", loss.detach(), on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/accuracy", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=b)
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False, batch_size=b)
        return loss

    def configure_optimizers(self) -> Any:
        # No weight decay on norms, biases and other 1-D parameters.
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.cfg.lr,
        )
        total = self.cfg.epochs * self.steps_per_epoch
        if self.cfg.max_steps > 0:
            total = min(total, self.cfg.max_steps)
        warmup = min(round(self.cfg.warmup_epochs * self.steps_per_epoch), total)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, warmup, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@dataclass
class FRResult:
    model: nn.Module  # backbone in eval mode
    backbone: str
    backbone_kwargs: dict
    history: list[dict]  # per-epoch {"epoch", "train/loss", "train/accuracy"}
    seconds: float


class _History(Callback):
    """Collects the epoch means logged by FRModule (``epoch`` counts from 0, as Lightning does)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_epoch_end(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        metrics = trainer.callback_metrics
        row: dict[str, Any] = {"epoch": trainer.current_epoch}
        for key in ("train/loss", "train/accuracy"):
            if key in metrics:
                row[key] = float(metrics[key])
        self.rows.append(row)


def _check_images(images: np.ndarray, what: str = "images") -> None:
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"{what} must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    if images.shape[1] != images.shape[2]:
        raise DataError(f"{what} must be square, got {images.shape[1]}×{images.shape[2]}; align/resize them first")


def _check_labels(labels: np.ndarray, n: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != n or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
    if labels.min() < 0:
        raise DataError(f"labels must be contiguous 0..K-1, found negative label {labels.min()}")
    counts = np.bincount(labels)
    absent = np.flatnonzero(counts == 0)
    if absent.size:
        raise DataError(
            f"labels must be contiguous 0..K-1 (K={counts.size}), but {absent.size} are absent, e.g. "
            f"{absent[:5].tolist()}; re-index them (np.unique(labels, return_inverse=True))"
        )
    if counts.size < 2:
        raise DataError("training needs at least 2 identities, got 1")
    return labels.astype(np.int64)


def needs_keypoints(model: nn.Module) -> bool:
    """True for backbones (KP-RPE) that take 5 pixel landmarks per image beside the image."""
    return bool(getattr(model, "needs_keypoints", False))


def _check_keypoints(keypoints: np.ndarray | None, n: int, model_name: str) -> np.ndarray:
    if keypoints is None:
        raise DataError(
            f"backbone {model_name!r} uses KP-RPE and needs 5 landmarks per image, but none were given; "
            "pass keypoints (N, 5, 2) pixel x, y — from the manifest's landmarks or the aligner's predictions"
        )
    keypoints = np.asarray(keypoints, dtype=np.float32)
    if keypoints.shape != (n, 5, 2):
        raise DataError(f"keypoints must have shape ({n}, 5, 2), got {keypoints.shape}")
    missing = np.flatnonzero(~np.isfinite(keypoints).all(axis=(1, 2)))
    if missing.size:
        raise DataError(
            f"{missing.size} of {n} images have no landmarks (e.g. rows {missing[:5].tolist()}); "
            "drop them or fill them with the aligner's predictions before training a KP-RPE backbone"
        )
    return keypoints


def _backbone_kwargs(cfg: FRConfig, size: int, overrides: dict[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(overrides or {})
    for key in ("img_size", "embed_dim"):
        if key in kwargs:
            raise ConfigError(f"backbone_overrides may not set {key!r}; it follows the images / fr.embedding_dim")
    params = inspect.signature(BACKBONES[cfg.backbone]).parameters
    flexible = "img_size" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if flexible:
        kwargs["img_size"] = size
    kwargs["embed_dim"] = cfg.embedding_dim
    expected = input_contract(cfg.backbone, **kwargs)["size"]
    if expected != size:
        raise ConfigError(
            f"backbone {cfg.backbone!r} takes {expected}×{expected} images but the data are {size}×{size}; "
            "prepare the data at that size or pick another fr.backbone"
        )
    return kwargs


def train(
    cfg: FRConfig,
    images: np.ndarray,
    labels: np.ndarray,
    *,
    loggers: Any = None,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    backbone_overrides: dict[str, Any] | None = None,
    keypoints: np.ndarray | None = None,
) -> FRResult:
    """Fit ``cfg.backbone`` on uint8 RGB ``images`` (N, H, W, 3) with contiguous integer ``labels`` (N,).

    KP-RPE backbones also need ``keypoints`` (N, 5, 2): pixel landmarks in ArcFace order.

    ``backbone_overrides`` are extra constructor arguments (e.g. ``depth``); the image size and the
    embedding dimension always come from the data and ``cfg``.
    """
    start = time.perf_counter()
    _check_images(images)
    labels = _check_labels(labels, images.shape[0])
    n, size = images.shape[0], images.shape[1]
    if n < 2:
        raise DataError(f"training needs at least 2 images, got {n}")
    kwargs = _backbone_kwargs(cfg, size, backbone_overrides)

    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    backbone = build_backbone(cfg.backbone, **kwargs)
    tensors = [
        torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(),  # uint8 (N, 3, H, W)
        torch.from_numpy(labels),
    ]
    if needs_keypoints(backbone):
        tensors.append(torch.from_numpy(_check_keypoints(keypoints, n, cfg.backbone)))
    num_classes = int(labels.max()) + 1
    head = CombinedMarginLoss(cfg.embedding_dim, num_classes, s=cfg.scale, **MARGINS[cfg.margin])

    batch_size = min(cfg.batch_size, n)
    steps_per_epoch = n // batch_size  # drop_last: a batch of 1 would break BatchNorm
    data = TensorDataset(*tensors)
    loader = DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    module = FRModule(backbone, head, cfg, steps_per_epoch)
    history = _History()
    trainer = lightning.Trainer(
        max_epochs=cfg.epochs,
        max_steps=cfg.max_steps,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        precision=cfg.precision,
        logger=loggers if loggers else False,
        callbacks=[history, *callbacks],
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        log_every_n_steps=max(1, min(50, steps_per_epoch)),
        num_sanity_val_steps=0,
    )
    log.info(
        "training %s %s on %d images (%d identities, %d×%d): %d steps/epoch × %d epochs",
        cfg.backbone, kwargs, n, num_classes, size, size, steps_per_epoch, cfg.epochs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=loader)
    seconds = time.perf_counter() - start
    if history.rows:
        log.info("done in %.1f s; last epoch %s", seconds, history.rows[-1])
    return FRResult(backbone.eval(), cfg.backbone, kwargs, history.rows, seconds)


def embed(
    model: nn.Module,
    images: np.ndarray,
    *,
    batch_size: int = 256,
    flip: bool = True,
    progress: bool = False,
    keypoints: np.ndarray | None = None,
) -> np.ndarray:
    """float32 (N, D) embeddings of uint8 RGB ``images`` (N, H, W, 3): ``f(x) + f(flip x)`` when ``flip``
    (horizontal flip), else ``f(x)``. Not L2-normalised; callers normalise. KP-RPE models also need
    ``keypoints`` (N, 5, 2) pixel landmarks; the flipped pass gets the flipped, left/right-swapped ones."""
    _check_images(images)
    kp = _check_keypoints(keypoints, len(images), type(model).__name__) if needs_keypoints(model) else None
    contract = getattr(model, "input_contract", None)
    if contract is not None and images.shape[1] != contract["size"]:
        raise DataError(
            f"model expects {contract['size']}×{contract['size']} images, got {images.shape[1]}×{images.shape[2]}"
        )
    if batch_size < 1:
        raise ConfigError(f"embed batch_size must be ≥ 1, got {batch_size}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chunks: list[np.ndarray] = []
    try:
        with torch.no_grad(), tqdm(total=len(images), unit="img", disable=not progress, desc="embed") as bar:
            for i in range(0, len(images), batch_size):
                x = images_to_tensor(images[i : i + batch_size], contract).to(device)
                if kp is None:
                    feats = model(x)
                    if flip:
                        feats = feats + model(x.flip(3))
                else:
                    k = torch.from_numpy(kp[i : i + batch_size]).to(device)
                    feats = model(x, k)
                    if flip:
                        feats = feats + model(x.flip(3), flip_keypoints(k, x.shape[-1]))
                chunks.append(feats.float().cpu().numpy())
                bar.update(x.shape[0])
    finally:
        model.train(was_training)
    if not chunks:
        dim = contract["embedding_dim"] if contract else 0
        return np.zeros((0, dim), dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)
