"""The ``fr`` section of params.yaml as a frozen, validated dataclass (``FRConfig``) and the choices it accepts.

Every bad value raises a ConfigError naming the ``fr.<key>`` and what it must be, when the config is built, so a
training run never starts on settings it would reject later (e.g. AdaFace with PartialFC, an LVFace switch epoch
past the last epoch). Mixed precision: "16-mixed" passes here and is refused on the CPU by the trainer
(``ml.train.device.check_device``); "bf16-mixed" runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ml.errors import ConfigError
from ml.fr.losses.margin import MARGINS
from ml.fr.backbones import BACKBONES
from ml.fr.backbones.kprpe import KEYPOINT_MAPS
from ml.train.augment import AugmentConfig
from ml.train.device import PRECISIONS

__all__ = ["AUGMENT_RECIPES", "HEAD_MARGINS", "PRECISIONS", "SCHEDULES", "STRATEGIES", "FRConfig"]

HEAD_MARGINS = (*MARGINS, "adaface")
SCHEDULES = ("cosine", "step")
AUGMENT_RECIPES = ("basic", "kprpe")
STRATEGIES = ("auto", "ddp", "ddp_spawn")


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
    margin: str = "arcface"  # "arcface" | "cosface" | "adaface" (m=0.4, h=0.333 on unnormalised embeddings)
    scale: float = 32.0  # s; 64 for big runs, smaller converges faster on tiny data
    augment: bool = True  # batched in torch; which ops: augment_recipe
    num_workers: int = 0
    seed: int = 0
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed" | "auto" (bf16-mixed where native)
    accelerator: str = "auto"
    devices: int = 1
    max_steps: int = -1  # -1 = no limit (for smoke runs)
    augment_recipe: str = "basic"  # "basic": flip + small zoom/shift | "kprpe": ml/train/augment.py
    augmentation: AugmentConfig = field(default_factory=AugmentConfig)  # probabilities/magnitudes of "kprpe"
    sample_rate: float = 1.0  # < 1: PartialFC keeps the batch's classes + this share of all classes per step
    lvface: bool = False  # LVFace: sampled margin softmax, then prototype-stabilised centres without sampling
    lvface_switch_epoch: int = 0  # first epoch of LVFace's stable stage; 0 = epochs // 2
    lvface_prototype_momentum: float = 0.9
    lvface_prototype_weight: float = 0.5
    schedule: str = "cosine"  # after warmup: "cosine" to 0 | "step": ×0.1 at each of lr_steps
    lr_steps: tuple[float, ...] = (0.6, 0.9)  # fractions of the training steps
    grad_clip: float = 0.0  # max gradient norm; 0 = off
    keypoint_lr_scale: float = 1.0  # KP-RPE: the keypoint map (``kprpe.*``) learns at this multiple of lr (its own group)
    keypoint_map: str = "linear"  # KP-RPE: "linear" (the paper's) | "mlp" (per-query keypoint terms), ml/fr/backbones/kprpe.py
    num_nodes: int = 1
    strategy: str = "auto"  # | "ddp" | "ddp_spawn"; several devices or nodes always run DDP
    compile: bool = False  # torch.compile the training forward and (on an accelerator) the kprpe augmentation
    stream: bool = False  # decode the training faces from the dataset's shards in DataLoader workers every epoch
    # a copy of the training dataset directory (a folder or fsspec URL, e.g. s3://bucket/datasets/train) to stream the
    # faces from, a window of its shards at a time, in ml.data.shard_stream's order (not the in-memory path's batches)
    stream_from: str = ""

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ConfigError(f"fr.backbone {self.backbone!r} is not registered; valid: {', '.join(BACKBONES)}")
        if self.margin not in HEAD_MARGINS:
            raise ConfigError(f"fr.margin {self.margin!r} is not one of {sorted(HEAD_MARGINS)}")
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
        choices = {
            "augment_recipe": AUGMENT_RECIPES, "schedule": SCHEDULES, "strategy": STRATEGIES, "precision": PRECISIONS,
            "keypoint_map": KEYPOINT_MAPS,
        }
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"fr.{key} {getattr(self, key)!r} is not one of {list(valid)}")
        ranges = {
            "sample_rate": (0.0 < self.sample_rate <= 1.0, "in (0, 1]"),
            "lvface_switch_epoch": (self.lvface_switch_epoch >= 0, "≥ 0 (0 = half of fr.epochs)"),
            "lvface_prototype_momentum": (0.0 <= self.lvface_prototype_momentum < 1.0, "in [0, 1)"),
            "lvface_prototype_weight": (0.0 <= self.lvface_prototype_weight <= 1.0, "in [0, 1]"),
            "grad_clip": (self.grad_clip >= 0.0, "≥ 0 (0 = off)"),
            "keypoint_lr_scale": (self.keypoint_lr_scale > 0.0, "> 0 (1 = the backbone's lr)"),
            "num_nodes": (self.num_nodes >= 1, "≥ 1"),
        }
        for key, (ok, need) in ranges.items():
            if not ok:
                raise ConfigError(f"fr.{key} = {getattr(self, key)!r} is out of range; it must be {need}")
        steps = self.lr_steps
        if not (all(0.0 < f < 1.0 for f in steps) and all(a < b for a, b in zip(steps, steps[1:]))):
            raise ConfigError(
                f"fr.lr_steps = {steps!r}: need increasing fractions of training strictly between 0 and 1"
            )
        if self.margin == "adaface" and (self.sample_rate < 1.0 or self.lvface):
            raise ConfigError(
                "fr.margin 'adaface' works with the full softmax only: PartialFC (fr.sample_rate < 1) and fr.lvface "
                "take the unified margins; use fr.margin arcface or cosface with them, or sample_rate 1.0 and "
                "lvface false"
            )
        if self.keypoint_map != "linear" and not self.backbone.endswith("_kprpe"):
            raise ConfigError(
                f"fr.keypoint_map {self.keypoint_map!r} shapes a KP-RPE backbone's keypoint bias, but fr.backbone "
                f"{self.backbone!r} has none; pick a *_kprpe backbone or leave fr.keypoint_map linear"
            )
        if self.lvface and self.lvface_switch_epoch >= self.epochs:
            raise ConfigError(
                f"fr.lvface_switch_epoch = {self.lvface_switch_epoch} is not below fr.epochs = {self.epochs}: the "
                "stable stage would never start; lower it (0 = half of the epochs) or set fr.lvface false"
            )

    @property
    def switch_epoch(self) -> int:
        """LVFace's first stable-stage epoch (0-based)."""
        return self.lvface_switch_epoch or self.epochs // 2
