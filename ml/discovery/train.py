"""FaceGCD trained with GCD's semi-supervised contrastive loss; ``train_discovery`` is the whole stage.

Both ViTs start from the pipeline's FR model (``backbone_init: fr``) or at random. Each batch gives two augmented views
per image (``DISCOVERY_AUGMENTATION``) and the loss ``(1 − λ)·L_u(all) + λ·L_s(labelled)`` on the projection head
(``ml.discovery.contrastive``), plus ``anchor_weight · L_anchor``; AdamW over the trainable parameters with a per-step
warmup and cosine decay to 0, as a one-device Lightning fit. Exact resume: batches depend on (seed, epoch), the views
and the model's own randomness on (seed, step); ``last.ckpt`` is written after every epoch.

Differences from the reference (App. A.2, GCD's ``contrastive_training.py``; docs/methods/discovery.md):
- AdamW (lr 1e-3, weight decay 0.05 on matrices) instead of SGD (lr 0.1, momentum 0.9, 2e-5, 5 warm-up epochs, cosine
  with decays at 90 and 180 of 200 epochs); τ 0.07 for both terms by default (paper 1.0 for both, GCD's 1.0 / 0.07).
- Both views go through the model as one batch (the frozen BatchNorms make it equal two passes). SSK clusters the
  embedding before the head, as the authors' code (the paper's text: the head); ``loss_on: embedding`` is a diagnostic.
- Backbone: the FR model, not a DINO ViT-B/8; ``random`` is a smoke test. The anchor (not in the paper): ArcFace
  (s 32, m 0.5) on the embedding over the FR training and the known identities, centres from the starting class means.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ml.errors import ConfigError, DataError
from ml.discovery.contrastive import gcd_loss_terms
from ml.fr.losses.margin import CombinedMarginLoss
from ml.fr.backbones import BACKBONES, input_contract
from ml.fr.backbones.vit import ViT
from ml.discovery.facegcd import FaceGCD
from ml.models.io import load_model
from ml.train.augment import AugmentConfig, augment_kprpe
from ml.train.callbacks import EpochHistory, fit, non_finite_loss
from ml.train.device import check_device_keys, rng_devices
from ml.train.checkpoint import check_resume, mix_seed, resume_path
from ml.fr.data import EpochSampler
from ml.train.schedules import adamw, lambda_schedule, warmup_cosine

__all__ = [
    "DISCOVERY_AUGMENTATION",
    "Anchor",
    "BalancedBatchSampler",
    "DiscoveryConfig",
    "DiscoveryModule",
    "DiscoveryResult",
    "build_facegcd",
    "train_discovery",
]

log = logging.getLogger(__name__)

BACKBONE_INITS = ("fr", "random")
LOSS_ON = ("head", "embedding")
ANCHOR_SCALE, ANCHOR_MARGIN = 32.0, 0.5  # the anchor's ArcFace s and additive angular margin m


def plain_vits() -> tuple[str, ...]:
    """Registry names that build a plain ``ViT`` (what FaceGCD wraps): the builders of ``ml.fr.backbones.vit``."""
    return tuple(name for name, build in BACKBONES.items() if getattr(build, "__module__", None) == ViT.__module__)
LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_discovery"  # run description stored in every checkpoint, checked before resuming


def _discovery_augmentation() -> AugmentConfig:
    """Stronger than FR training's: two views of one face must differ enough for InfoNCE to teach something."""
    return AugmentConfig(
        flip_prob=0.5, scale_prob=0.8, scale_range=(0.85, 1.2), translate_prob=0.5, max_translate=0.08,
        rotate_prob=0.3, max_rotate_deg=10.0, padding_mode="border",
        brightness_prob=0.8, brightness_range=(0.6, 1.4), contrast_prob=0.8, contrast_range=(0.6, 1.4),
        saturation_prob=0.8, saturation_range=(0.6, 1.4), blur_prob=0.2, cutout_prob=0.2,
    )


DISCOVERY_AUGMENTATION = _discovery_augmentation()


@dataclass(frozen=True)
class DiscoveryConfig:
    """``discovery`` section of params.yaml."""

    backbone: str = "vit_tiny"  # a plain ViT from ml.fr.backbones; must match the FR model with backbone_init fr
    backbone_init: str = "fr"  # "fr": both ViTs from the FR model dir | "random"
    fr_source: str = "real"  # which models/fr/<source> the stage passes as that directory (a ViT of `backbone`)
    prefix_length: int = 10  # P key/value prefix tokens per layer; 0 = no prefixes (plain GCD on the last block)
    bottleneck: int = 0  # r of the prefix generator; 0 = head_dim // 4 (paper 16 at head_dim 64)
    hyper_hidden: int = 0  # hypernetwork MLP width; 0 = 4·dim // 3 (paper 1024 at dim 768)
    learn_base_prefix: bool = True  # false: the authors' code, a fresh random base prefix every forward
    static_prefix: bool = False  # ablation: learned sample-independent prefixes, no hypernetwork
    proj_dim: int = 256  # projection head output (GCD: 65536)
    proj_hidden: int = 512  # projection MLP width (GCD: 2048)
    proj_bottleneck: int = 128  # L2-normalised bottleneck before the last layer (GCD: 256)
    epochs: int = 10
    batch_size: int = 64  # images per step; the loss sees 2 × batch_size views
    lr: float = 1e-3
    block_lr_scale: float = 1.0  # the pre-trained last ViT block learns at lr × this; the new parts (ℋ, prefixes, head) at lr
    weight_decay: float = 0.05  # AdamW, on weight matrices only
    warmup_epochs: float = 1.0
    temperature: float = 0.07  # InfoNCE τ
    sup_temperature: float = 0.07  # SupCon τ
    sup_weight: float = 0.35  # λ in (1 − λ)·L_u + λ·L_s
    labelled_identities_per_batch: int = 0  # P: every batch holds P labelled identities × K images; 0 = uniform batches
    images_per_identity: int = 4  # K of the balanced batches (with replacement where an identity has fewer)
    val_per_identity: int = 0  # labelled images per known identity held out for model selection; 0 = last epoch
    patience: int = 0  # with a val split: stop after this many epochs without a better val/accuracy; 0 = every epoch
    # where the loss acts: "head" (the paper: the projection head's output) | "embedding" (a diagnostic: the
    # L2-normalised embedding the protocol clusters, the FR embedding layer trainable at lr × block_lr_scale, no head)
    loss_on: str = "head"
    # ArcFace on the embedding over the FR model's training identities + the known ones, weighted beside GCD's loss
    # (a deviation, see the module docstring); 0 = off, the paper. Needs train_discovery(anchor=...)
    anchor_weight: float = 0.0
    anchor_batch: int = 64  # FR training images per step in the anchor term
    anchor_images: int = 20000  # the stage keeps at most this many FR training images for the anchor (0 = all)
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    gcd_arm: bool = True  # stage train_discovery also trains the GCD control (prefix_length 0, else the same)
    augment: bool = True
    augmentation: AugmentConfig = field(default_factory=_discovery_augmentation)
    accelerator: str = "auto"  # | "cpu" | "gpu"
    devices: int = 1
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed" | "auto" (bf16-mixed where native)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backbone not in plain_vits():
            raise ConfigError(
                f"discovery.backbone {self.backbone!r} is not a plain ViT backbone; valid: {', '.join(plain_vits())}"
            )
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"discovery.loss_on {self.loss_on!r} is not one of {list(LOSS_ON)}")
        if self.backbone_init not in BACKBONE_INITS:
            raise ConfigError(f"discovery.backbone_init {self.backbone_init!r} is not one of {list(BACKBONE_INITS)}")
        for key in ("learn_base_prefix", "static_prefix", "augment", "gcd_arm"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"discovery.{key} must be true or false, got {getattr(self, key)!r}")
        ints = {
            "prefix_length": 0, "bottleneck": 0, "hyper_hidden": 0, "proj_dim": 1, "proj_hidden": 1,
            "proj_bottleneck": 1, "epochs": 1, "batch_size": 2, "seed": 0, "labelled_identities_per_batch": 0,
            "images_per_identity": 1, "val_per_identity": 0, "patience": 0, "anchor_batch": 1, "anchor_images": 0,
        }
        for key, low in ints.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"discovery.{key} = {value!r}: need an integer ≥ {low}")
        ranges = {
            "lr": (lambda v: v > 0, "> 0"),
            "block_lr_scale": (lambda v: v >= 0, "≥ 0 (0 = the last block frozen)"),
            "weight_decay": (lambda v: v >= 0, "≥ 0"),
            "warmup_epochs": (lambda v: v >= 0, "≥ 0"),
            "temperature": (lambda v: v > 0, "> 0"),
            "sup_temperature": (lambda v: v > 0, "> 0"),
            "sup_weight": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
            "grad_clip": (lambda v: v >= 0, "≥ 0 (0 = off)"),
            "anchor_weight": (lambda v: v >= 0, "≥ 0 (0 = off)"),
        }
        for key, (ok, need) in ranges.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ConfigError(f"discovery.{key} = {value!r} is out of range; it must be a number {need}")
        if self.static_prefix and not self.learn_base_prefix:
            raise ConfigError(
                "discovery.learn_base_prefix false (random base prefix) needs the hypernetwork; with "
                "discovery.static_prefix true there is no base prefix: set learn_base_prefix true"
            )
        if self.labelled_identities_per_batch * self.images_per_identity > self.batch_size:
            raise ConfigError(
                f"discovery.labelled_identities_per_batch × images_per_identity = {self.labelled_identities_per_batch} "
                f"× {self.images_per_identity} exceeds discovery.batch_size {self.batch_size}; lower one of them"
            )
        check_device_keys("discovery", self.accelerator, self.devices, self.precision)
        if not isinstance(self.augmentation, AugmentConfig):
            raise ConfigError(
                f"discovery.augmentation must be an AugmentConfig, got {type(self.augmentation).__name__}"
            )

    def model_kwargs(self) -> dict[str, Any]:
        """FaceGCD constructor arguments besides the backbone."""
        keys = ("prefix_length", "bottleneck", "hyper_hidden", "learn_base_prefix", "static_prefix", "proj_dim",
                "proj_hidden", "proj_bottleneck")
        return {k: getattr(self, k) for k in keys}


@dataclass
class DiscoveryResult:
    """The trained model (eval mode, on the CPU) and one dict per epoch: epoch (from 0), loss, loss/unsup, loss/sup,
    loss/anchor (with the anchor), lr (of the epoch's last step), seconds, and ``val/accuracy`` with a validation
    split. ``best_epoch``: the epoch whose weights ``model`` holds (the last one without a validation split)."""

    model: FaceGCD
    history: list[dict[str, float]]
    checkpoint: Path | None = None  # last.ckpt when a checkpoint_dir was given
    best_epoch: int = -1


def _check_data(images: Any, labels: Any, labelled_mask: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and convert to uint8 (N, 3, S, S), int64 (N,), bool (N,) tensors."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3 \
            or images.shape[1] != images.shape[2]:
        got = (images.dtype, images.shape) if isinstance(images, np.ndarray) else type(images).__name__
        raise DataError(f"train_discovery: images must be a uint8 array (N, S, S, 3) of square RGB faces, got {got}")
    n = len(images)
    if n < 2:
        raise DataError(f"train_discovery: need at least 2 images for a contrastive batch, got {n}")
    labels = np.asarray(labels)
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"train_discovery: labels must be integers of shape ({n},), got {labels.dtype} {labels.shape}")
    mask = np.asarray(labelled_mask)
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise DataError(f"train_discovery: labelled_mask must be bool of shape ({n},), got {mask.dtype} {mask.shape}")
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(labels.astype(np.int64)), torch.from_numpy(mask.copy())


class BalancedBatchSampler(Sampler[list[int]]):
    """Batches for SupCon: each of ``len(labels) // batch_size`` batches holds ``identities`` labelled identities
    (P, drawn without replacement) × ``per_identity`` of their labelled images (K, without replacement unless the
    identity has fewer), and ``batch_size − P·K`` other images taken in turn from a shuffled order of the
    unlabelled ones (all images when none is unlabelled). With uniform batches of 64 out of 1,400 images, 25 %
    labelled over 40–50 identities, an anchor has ~0.3 same-identity partners; here it has K − 1.

    The batches depend only on (seed, epoch), so a resumed run sees an uninterrupted one's. Lightning sets the
    epoch on a batch sampler's ``.sampler`` (an ``EpochSampler``), whose epoch this reads.
    """

    def __init__(self, labels: np.ndarray, labelled: np.ndarray, batch_size: int, identities: int,
                 per_identity: int, seed: int) -> None:
        labels, labelled = np.asarray(labels), np.asarray(labelled, bool)
        self.sampler = EpochSampler(len(labels), seed)
        self.batch_size, self.per_identity, self.seed = int(batch_size), int(per_identity), int(seed)
        self.groups = [np.flatnonzero(labelled & (labels == c)) for c in np.unique(labels[labelled])]
        self.identities = min(int(identities), len(self.groups))
        if self.identities * self.per_identity > self.batch_size:
            raise ConfigError(f"balanced batches: {self.identities} identities × {self.per_identity} images exceed "
                              f"the batch of {self.batch_size}")
        rest = np.flatnonzero(~labelled)
        self.rest = rest if len(rest) else np.arange(len(labels))
        self.steps = len(labels) // self.batch_size

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        rng = np.random.default_rng(mix_seed(self.seed, self.sampler.epoch, 3))
        fill = self.batch_size - self.identities * self.per_identity
        order, pos = rng.permutation(self.rest), 0
        for _ in range(self.steps):
            batch: list[int] = []
            for g in rng.choice(len(self.groups), self.identities, replace=False):
                group = self.groups[g]
                batch += rng.choice(group, self.per_identity, replace=len(group) < self.per_identity).tolist()
            for _ in range(fill):  # the unlabelled order, reshuffled each time it runs out
                if pos == len(order):
                    order, pos = rng.permutation(self.rest), 0
                batch.append(int(order[pos]))
                pos += 1
            yield batch


def validation_split(labels: np.ndarray, labelled: np.ndarray, per_identity: int, seed: int) -> np.ndarray:
    """Bool mask (N,) of ``per_identity`` labelled images of every labelled identity, drawn from ``seed``; an
    identity keeps at least one labelled training image (fewer held out where it has ≤ per_identity)."""
    rng = np.random.default_rng(mix_seed(seed, 4))
    val = np.zeros(len(labels), bool)
    for c in np.unique(labels[labelled]):
        idx = np.flatnonzero(labelled & (labels == c))
        take = min(per_identity, len(idx) - 1)
        val[rng.choice(idx, take, replace=False)] = True
    return val


def nearest_mean_accuracy(train_feats: np.ndarray, train_labels: np.ndarray, val_feats: np.ndarray,
                          val_labels: np.ndarray) -> float:
    """Share of ``val_feats`` whose nearest class mean (cosine) among the labelled ``train_feats`` is their own
    class: the known-identity part of semi-supervised k-means, whose labelled centroids are these means."""
    classes = np.unique(train_labels)
    means = np.stack([train_feats[train_labels == c].mean(0) for c in classes])
    means /= np.linalg.norm(means, axis=1, keepdims=True).clip(1e-12)
    return float((classes[(val_feats @ means.T).argmax(1)] == val_labels).mean())


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def build_facegcd(cfg: DiscoveryConfig, img_size: int, init_model_dir: str | os.PathLike | None = None) -> FaceGCD:
    """FaceGCD for ``cfg`` and ``img_size``-pixel images; new parameters drawn from ``cfg.seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.backbone_init == "fr":
            if init_model_dir is None:
                raise ConfigError(
                    "discovery.backbone_init is 'fr' but no init_model_dir was given; pass the FR stage's model "
                    "directory or set discovery.backbone_init: random"
                )
            vit, config = load_model(init_model_dir)
            if config.get("backbone") != cfg.backbone:
                raise ConfigError(
                    f"discovery.backbone {cfg.backbone!r} differs from the FR model's {config.get('backbone')!r} in "
                    f"{init_model_dir}; set discovery.backbone to {config.get('backbone')!r}"
                )
            if vit.input_contract["size"] != img_size:
                raise DataError(
                    f"the FR model in {init_model_dir} takes {vit.input_contract['size']}×"
                    f"{vit.input_contract['size']} images but the data are {img_size}×{img_size}; prepare the data "
                    "at the FR model's size"
                )
            model = FaceGCD(vit, prefix_seed=cfg.seed, **cfg.model_kwargs())
        else:
            if input_contract(cfg.backbone, img_size=img_size)["size"] != img_size:
                raise DataError(f"backbone {cfg.backbone!r} cannot take {img_size}×{img_size} images")
            model = FaceGCD(cfg.backbone, backbone_kwargs={"img_size": img_size}, prefix_seed=cfg.seed,
                            **cfg.model_kwargs())
    if cfg.loss_on == "embedding":  # the loss reads the embedding: its layer trains, the unused head does not
        model.vit.feature.requires_grad_(True)
        model.head.requires_grad_(False)
    return model


def _optimizer(model: FaceGCD, cfg: DiscoveryConfig, module: Any = None,
               centres: Sequence[torch.nn.Parameter] = ()) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on weight matrices, none on biases, norms, prefixes and
    the layer embedding. The pre-trained parts (the last ViT block ``vit.blocks.<last>.``, and the embedding layer
    ``vit.feature.`` with ``loss_on: embedding``) learn at ``lr × block_lr_scale`` (frozen at 0), the new parts at
    ``lr``; the schedule scales every group alike. ``centres``: the anchor's class centres, at ``lr`` without decay."""
    pretrained = (f"vit.blocks.{len(model.vit.blocks) - 1}.", "vit.feature.")
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        block = name.startswith(pretrained)
        if block and cfg.block_lr_scale == 0:
            p.requires_grad_(False)  # no gradient wasted on it
            continue
        groups.setdefault((block, p.ndim == 2 and not name.endswith("layer_embed")), []).append(p)
    if centres:
        groups.setdefault((False, False), []).extend(centres)
    return adamw(
        [{"params": ps, "lr": cfg.lr * (cfg.block_lr_scale if block else 1.0),
          "weight_decay": cfg.weight_decay if decay else 0.0} for (block, decay), ps in sorted(groups.items())],
        module, lr=cfg.lr,
    )


class Anchor(torch.nn.Module):
    """The anchor term: ArcFace (``ANCHOR_SCALE``, ``ANCHOR_MARGIN``) on the embedding over the FR training classes
    (``images`` uint8 (M, 3, S, S), ``labels`` (M,)) and the labelled discovery identities, whose ids ``known`` maps
    to the classes after the FR ones (−1 elsewhere). The centres start at the class means of ``model``'s
    L2-normalised embedding; the images stay plain tensors (not in the checkpoint, which keeps the centres)."""

    def __init__(self, model: FaceGCD, images: torch.Tensor, labels: torch.Tensor, train_x: torch.Tensor,
                 train_y: torch.Tensor, labelled: torch.Tensor) -> None:
        super().__init__()
        fr_ids, fr_classes = torch.unique(labels, return_inverse=True)
        ids = torch.unique(train_y[labelled])
        self.images, self.labels = images, fr_classes
        self.known = torch.full((int(train_y.max().clamp(min=0)) + 1,), -1, dtype=torch.long)
        self.known[ids] = torch.arange(len(ids)) + len(fr_ids)
        nhwc = lambda t: t.permute(0, 2, 3, 1).numpy()  # noqa: E731
        feats = torch.from_numpy(np.concatenate([model.embed(nhwc(images)), model.embed(nhwc(train_x[labelled]))]))
        classes = torch.cat([fr_classes, self.known[train_y[labelled]]])
        self.head = CombinedMarginLoss(feats.shape[1], len(fr_ids) + len(ids), s=ANCHOR_SCALE, m2=ANCHOR_MARGIN)
        with torch.no_grad():  # class means of unit vectors (the sums' directions, at the experiments' scale)
            counts = torch.bincount(classes, minlength=len(self.head.weight)).clamp(min=1)
            self.head.weight.zero_().index_add_(0, classes, feats).div_(counts[:, None])

    def forward(self, model: FaceGCD, x: torch.Tensor, labels: torch.Tensor, labelled: torch.Tensor, count: int,
                generator: torch.Generator) -> torch.Tensor:
        """The term on ``count`` FR training images drawn with ``generator`` and the batch's labelled images."""
        pick = torch.randint(len(self.images), (count,), generator=generator)
        xs = torch.cat([self.images[pick].to(x.device), x[labelled]])
        ys = torch.cat([self.labels[pick], self.known[labels[labelled].cpu()]]).to(x.device)
        emb = model.forward_features(model.normalize(xs.float() / 255.0))
        with torch.autocast(emb.device.type, enabled=False):
            return self.head(emb.float(), ys)


def _views(model: FaceGCD, x: torch.Tensor, cfg: DiscoveryConfig, gen: torch.Generator) -> torch.Tensor:
    """uint8 batch (B, 3, S, S) → normalised model input of two views stacked (2B, 3, S, S)."""
    x = x.float() / 255.0
    if cfg.augment:
        v1, _ = augment_kprpe(x, None, cfg.augmentation, generator=gen)
        v2, _ = augment_kprpe(x, None, cfg.augmentation, generator=gen)
    else:
        v1 = v2 = x
    return model.normalize(torch.cat([v1, v2]))


class DiscoveryModule(lightning.LightningModule):
    """FaceGCD under GCD's loss: two views per image, ``(1 − λ)·L_u + λ·L_s``, AdamW with warmup + cosine per step."""

    def __init__(self, model: FaceGCD, cfg: DiscoveryConfig, steps_per_epoch: int,
                 val: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                 anchor: Anchor | None = None) -> None:
        super().__init__()
        self.model = model
        self.anchor = anchor
        self.cfg = cfg
        self.steps_per_epoch = steps_per_epoch
        self.val = val  # (labelled train images, their labels, val images, val labels); uint8 (N, S, S, 3)
        self.best: dict[str, Any] = {"epoch": -1, "score": float("-inf"), "state": None}
        self._view_generator: torch.Generator | None = None  # made on first use

    def epoch_summary(self) -> dict[str, float]:
        """With a validation split: ``val/accuracy`` (``nearest_mean_accuracy`` of the held-out labelled images
        against the labelled training images' class means, features with flip TTA as in evaluation), and the
        trainable weights of the best epoch so far are kept (ties: the earlier epoch). With ``patience`` > 0 the
        fit stops once that many epochs have passed without a better one: the kept weights are those a full run
        would keep unless a later epoch would have beaten them (the lr schedule still spans ``epochs``)."""
        if self.val is None:
            return {}
        train_x, train_y, val_x, val_y = self.val
        feats = self.model.embed(np.concatenate([train_x, val_x]), flip=True)  # restores train mode
        accuracy = nearest_mean_accuracy(feats[: len(train_x)], train_y, feats[len(train_x):], val_y)
        if accuracy > self.best["score"]:
            trainable = set(self.model.trainable_parameter_names())
            state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if k in trainable}
            self.best = {"epoch": self.current_epoch, "score": accuracy, "state": state}
        if self.cfg.patience and self.current_epoch - self.best["epoch"] >= self.cfg.patience:
            log.info("discovery: no better val/accuracy for %d epochs, stopping after epoch %d of %d",
                     self.cfg.patience, self.current_epoch + 1, self.cfg.epochs)
            self.trainer.should_stop = True
        return {"val/accuracy": accuracy}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["discovery_best"] = self.best  # a resumed run selects among all epochs, not only its own

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.best = checkpoint.get("discovery_best", self.best)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # the model's own randomness (random base prefix, stochastic depth) as a function of the step
        torch.manual_seed(mix_seed(self.cfg.seed, self.global_step, 1))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, labels, labelled = batch  # uint8 (B, 3, S, S), int64 (B,), bool (B,)
        if self._view_generator is None:
            self._view_generator = torch.Generator()
        gen = self._view_generator.manual_seed(mix_seed(self.cfg.seed, self.global_step, 2))
        if self.cfg.loss_on == "embedding":
            z = F.normalize(self.model.forward_features(_views(self.model, x, self.cfg, gen)), dim=-1)  # (2B, emb)
        else:
            _, z = self.model(_views(self.model, x, self.cfg, gen))  # (2B, proj_dim)
        z1, z2 = z.chunk(2)
        with torch.autocast(z.device.type, enabled=False):  # logits / τ = 0.07 need float32 under mixed precision
            terms = gcd_loss_terms(z1.float(), z2.float(), labels, labelled, self.cfg.sup_weight,
                                   self.cfg.temperature, self.cfg.sup_temperature)
        loss = terms["loss"]
        if self.anchor is not None:
            terms["anchor"] = self.anchor(self.model, x, labels, labelled, self.cfg.anchor_batch,
                                          gen.manual_seed(mix_seed(self.cfg.seed, self.global_step, 5)))
            loss = loss + self.cfg.anchor_weight * terms["anchor"]
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="discovery loss",
                                  entry="train_discovery",
                                  advice="Lower discovery.lr or raise discovery.temperature.")
        b = x.shape[0]
        for key, name in (("loss", "loss"), ("unsup", "loss/unsup"), ("sup", "loss/sup"), ("anchor", "loss/anchor")):
            if key in terms:
                self.log(name, terms[key].detach(), on_step=False, on_epoch=True, prog_bar=key == "loss",
                         batch_size=b)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False, batch_size=b)
        return loss

    def configure_optimizers(self) -> Any:
        total = self.cfg.epochs * self.steps_per_epoch
        warmup = round(self.cfg.warmup_epochs * self.steps_per_epoch)
        centres = [self.anchor.head.weight] if self.anchor is not None else []
        return lambda_schedule(_optimizer(self.model, self.cfg, self, centres),
                               partial(warmup_cosine, warmup_steps=warmup, total_steps=total))


def train_discovery(
    cfg: DiscoveryConfig,
    images: np.ndarray,
    labels: np.ndarray,
    labelled_mask: np.ndarray,
    *,
    init_model_dir: str | os.PathLike | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    anchor: tuple[np.ndarray, np.ndarray] | None = None,
) -> DiscoveryResult:
    """Fit FaceGCD on uint8 RGB ``images`` (N, S, S, 3); ``labels`` (N,) are read where ``labelled_mask`` (N,) is true.

    ``init_model_dir``: the FR model for ``backbone_init: fr``. ``checkpoint_dir``: where ``last.ckpt`` is written
    after every epoch (an existing one is an error unless ``resume``); with ``resume`` the run continues from it
    (a missing checkpoint starts afresh). ``callbacks``: extra Lightning callbacks (e.g. a progress bar).
    ``anchor``: the FR model's training images (uint8 (M, S, S, 3)) and identity labels (M,), which the anchor term
    reads when ``cfg.anchor_weight`` > 0 (required then, ignored otherwise).
    """
    x_all, y_all, m_all = _check_data(images, labels, labelled_mask)
    n, size = len(x_all), x_all.shape[-1]
    anchor_data: tuple[torch.Tensor, ...] = ()
    if cfg.anchor_weight > 0:
        if anchor is None:
            raise ConfigError("discovery.anchor_weight > 0 needs the FR model's training images and labels "
                              "(train_discovery(anchor=(images, labels))); or set discovery.anchor_weight: 0")
        ax, ay, _ = _check_data(anchor[0], anchor[1], np.ones(len(anchor[1]), bool))
        if ax.shape[-1] != size:
            raise DataError(f"train_discovery: the anchor images are {ax.shape[-1]}×{ax.shape[-1]} but the "
                            f"discovery images {size}×{size}; prepare both at data.image_size")
        if not bool(m_all.any()):
            raise DataError("train_discovery: discovery.anchor_weight > 0 but no image is labelled")
        anchor_data = (ax, ay)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_discovery")
    info = {"config": dataclasses.asdict(cfg), "data_digest": _digest(x_all, y_all, m_all, *anchor_data)}
    if ckpt_path is not None:
        check_resume(ckpt_path, CHECKPOINT_KEY, "discovery", info, data_keys=("data_digest",))
    model = build_facegcd(cfg, size, init_model_dir)
    val = None
    if cfg.val_per_identity > 0:  # held-out labelled images: out of training altogether
        held = torch.from_numpy(validation_split(y_all.numpy(), m_all.numpy(), cfg.val_per_identity, cfg.seed))
        if not bool(held.any()):
            raise DataError("discovery.val_per_identity > 0 but no labelled identity has 2 labelled images, one "
                            "to train on and one to hold out; set discovery.val_per_identity: 0")
        keep = m_all & ~held
        val = (images[keep.numpy()], y_all[keep].numpy(), images[held.numpy()], y_all[held].numpy())
        x_all, y_all, m_all = x_all[~held], y_all[~held], m_all[~held]
        n = len(x_all)
    batch = min(cfg.batch_size, n)
    steps_per_epoch = n // batch  # drop the last partial batch
    dataset = TensorDataset(x_all, y_all, m_all)
    if cfg.labelled_identities_per_batch > 0:
        batches = BalancedBatchSampler(y_all.numpy(), m_all.numpy(), batch, cfg.labelled_identities_per_batch,
                                       cfg.images_per_identity, cfg.seed)
        loader = DataLoader(dataset, batch_sampler=batches)
    else:
        loader = DataLoader(dataset, batch_size=batch, sampler=EpochSampler(n, cfg.seed), drop_last=True)
    head = Anchor(model, *anchor_data, x_all, y_all, m_all) if anchor_data else None
    module = DiscoveryModule(model, cfg, steps_per_epoch, val, head)
    log.info("training FaceGCD (%s, %d trainable parameters) on %d images (%d labelled): %d steps/epoch × %d epochs%s",
             cfg.backbone, sum(p.numel() for p in model.parameters() if p.requires_grad), n, int(m_all.sum()),
             steps_per_epoch, cfg.epochs, f", resuming {ckpt_path}" if ckpt_path else "")
    with torch.random.fork_rng(devices=rng_devices(cfg.accelerator)):  # per-step reseeding leaves the caller's RNG
        fitted = fit(
            module, loader, section="discovery", epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
            history=EpochHistory(("loss", "loss/unsup", "loss/sup", "loss/anchor", "lr"), timed=True),
            accelerator=cfg.accelerator, devices=cfg.devices, precision=cfg.precision, grad_clip=cfg.grad_clip,
            run_info=(CHECKPOINT_KEY, info), checkpoint_dir=checkpoint_dir, last_checkpoint=LAST_CHECKPOINT,
            ckpt_path=ckpt_path, callbacks=callbacks, progress=progress,
        )
    for row in fitted.history:
        log.info("discovery epoch %d/%d: loss %.4f (unsup %.4f, sup %.4f) in %.1f s", row["epoch"] + 1, cfg.epochs,
                 row["loss"], row["loss/unsup"], row["loss/sup"], row["seconds"])
    best_epoch = len(fitted.history) - 1
    if module.best["state"] is not None:
        module.model.load_state_dict(module.best["state"], strict=False)
        best_epoch = int(module.best["epoch"])
        log.info("discovery: keeping epoch %d (val/accuracy %.3f)", best_epoch + 1, module.best["score"])
    return DiscoveryResult(model=module.model.cpu().eval(), history=fitted.history, checkpoint=fitted.checkpoint,
                           best_epoch=best_epoch)
