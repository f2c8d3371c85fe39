"""CAFace training with Lightning on precomputed (feature, style, label) triples, and fused inference over many sets.

``train_fusion`` fits ``ml.fusion.CAFace`` on a frozen FR model's features (paper Sec. 3.2). Each step draws identities,
``per_identity`` rows of each from 1..``max_sources`` of its sources, in groups of ``group``; each group's prefixes of
every even length in [min_len, max_len] are the sets (one masked call). ``Lt = mean(1 − cos(CAFace(set), f_GT))`` (Eq. 9),
``f_GT`` the clean-image ``centres`` (else the identity mean); ``Lp = mean(1 − cos(f_streamed, f_all_at_once))`` over
the groups (Eq. 10); ``L = Lt + λp·Lp + λu·Lu``, ``Lu = mean(1 − H(u)/log M)``, ``u`` a set's mass share per cluster.
AdamW, LR ×0.1 from each epoch of ``lr_steps``. Batches and drop path are functions of (seed, epoch, step), so a run
resumed from ``last.ckpt`` ends as an uninterrupted one. ``val_sets`` / ``validate_fusion``: fixed sets of held-out
identities scored after every epoch (``val/lt``, ``val/rank1`` against their targets, beside plain averaging's).
``fuse_sets``: eval-mode templates, long sets in chunks.

Differences from the reference (``mk-minchul/caface``, ``trainer.py``, datafeed ``dual_multi_v1``):
- ``Lu`` (``lambda_u``) is not in the paper or the reference; ``prefixes: one`` (one length per step) is an option.
- Identities are drawn afresh each step and the step count is set directly (the reference walks a shuffled list).
- Features are given (the reference computes them under image augmentation).
- params.yaml's recipe departs from the reference's (lr, ``lambda_p``, ``lambda_u``, steps): ``docs/methods/fusion.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
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
from torch.utils.data import DataLoader, Dataset

from ml.errors import ConfigError, DataError
from ml.fusion.caface import CAFace, FusionState
from ml.train.callbacks import EpochBatches, EpochHistory, fit, non_finite_loss
from ml.train.device import check_device_keys, rng_devices
from ml.train.checkpoint import check_resume, mix_seed, resume_path
from ml.train.schedules import adamw, lambda_schedule, multistep

__all__ = ["FusionConfig", "FusionModule", "FusionResult", "FusionVal", "fuse_sets", "identity_centres", "step_lr",
           "train_fusion", "val_scores", "val_sets", "validate_fusion"]

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_fusion"  # run description stored in every checkpoint, checked before resuming
LOSS_KEYS = ("train/loss", "train/lt", "train/lp", "train/lu", "train/lt_average")
PREFIXES = ("even", "one")


@dataclass(frozen=True)
class FusionConfig:
    """``fusion`` section of params.yaml: CAFace sizes and the training recipe (paper defaults)."""

    feature_dim: int = 512
    style_dim: int = 384
    num_clusters: int = 4
    epochs: int = 10
    steps_per_epoch: int = 100  # optimiser steps per epoch, whatever the number of identities
    lr: float = 1e-3
    weight_decay: float = 5e-4
    lr_steps: tuple[int, ...] = (6, 9)  # epochs (0-based) from which the LR is ×0.1 once more
    per_identity: int = 32  # features drawn per identity and step
    group: int = 16  # chunk size of the streamed pass for Lp; prefixes are taken inside each group
    min_len: int = 2
    max_len: int = 16
    batch_size: int = 512  # identities per step (reference: 512)
    max_sources: int = 3  # a step's draws of one identity come from 1..max_sources of its sources (reference: 1–3)
    prefixes: str = "even"  # "even": Lt over every even prefix 2, 4, …, max_len in one masked call (reference) | "one"
    lambda_p: float = 1.0
    lambda_u: float = 0.0  # weight of Lu, the clusters' usage regulariser (not in the paper; 0 = the reference)
    seed: int = 0
    accelerator: str = "auto"  # | "cpu" | "gpu"
    devices: int = 1  # one device: the model and its batches fit one GPU
    precision: str = "32-true"  # | "16-mixed" (GPU only) | "bf16-mixed" | "auto" (bf16-mixed where native)

    def __post_init__(self) -> None:
        ints = ("feature_dim", "style_dim", "num_clusters", "epochs", "steps_per_epoch", "per_identity", "group",
                "min_len", "max_len", "batch_size", "max_sources", "seed")
        for key in ints:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"fusion.{key} must be an integer, got {value!r}")
        for key in ("lr", "weight_decay", "lambda_p", "lambda_u"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"fusion.{key} must be a finite number, got {value!r}")
        for key in ("feature_dim", "style_dim", "num_clusters", "epochs", "steps_per_epoch", "group", "min_len",
                    "batch_size", "max_sources"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fusion.{key} = {getattr(self, key)} must be ≥ 1")
        if self.lr <= 0:
            raise ConfigError(f"fusion.lr = {self.lr} must be > 0")
        for key in ("weight_decay", "lambda_p", "lambda_u"):
            if getattr(self, key) < 0:
                raise ConfigError(f"fusion.{key} = {getattr(self, key)} must be ≥ 0")
        if self.per_identity < 2 * self.group or self.per_identity % self.group:
            raise ConfigError(
                f"fusion.per_identity = {self.per_identity} must be a multiple of fusion.group = {self.group} with at "
                "least 2 groups (the reference: 32 = 2 × 16)"
            )
        if not self.min_len <= self.max_len <= self.group:
            raise ConfigError(
                f"fusion.max_len = {self.max_len} must lie in [fusion.min_len = {self.min_len}, fusion.group = "
                f"{self.group}]: prefixes are taken inside one group"
            )
        if self.prefixes not in PREFIXES:
            raise ConfigError(f"fusion.prefixes = {self.prefixes!r}: use one of {', '.join(PREFIXES)}")
        if self.prefixes == "even" and not self.prefix_lengths:
            raise ConfigError(f"fusion.prefixes = 'even' needs an even length in [min_len, max_len] = "
                              f"[{self.min_len}, {self.max_len}]")
        steps = self.lr_steps
        if not isinstance(steps, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise ConfigError(f"fusion.lr_steps must be a list of epoch numbers, got {steps!r}")
        if any(s < 1 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"fusion.lr_steps = {list(steps)} must be increasing epochs ≥ 1")
        object.__setattr__(self, "lr_steps", tuple(steps))
        check_device_keys("fusion", self.accelerator, self.devices, self.precision)

    @property
    def prefix_lengths(self) -> tuple[int, ...]:
        """The even prefix lengths in ``[min_len, max_len]`` that ``prefixes: even`` trains on together."""
        return tuple(n for n in range(self.min_len, self.max_len + 1) if n % 2 == 0)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        return {"feature_dim": self.feature_dim, "style_dim": self.style_dim, "num_clusters": self.num_clusters}

    def to_dict(self) -> dict[str, Any]:
        """The config as plain values (``lr_steps`` a list), as stored in the checkpoint's run description."""
        out = dataclasses.asdict(self)
        out["lr_steps"] = list(self.lr_steps)
        return out


@dataclass(frozen=True)
class FusionVal:
    """Fixed validation sets of identities CAFace does not train on: S sets of n items each."""

    features: torch.Tensor  # (S, n, D) the sets' items
    styles: torch.Tensor  # (S, n, style_dim, 2)
    labels: torch.Tensor  # (S,) the identity 0..Kv-1 of each set
    centres: torch.Tensor  # (Kv, D) unit targets f_GT of the held-out identities: the val gallery
    rows: torch.Tensor | None = None  # (S, n) each set's items as rows of the features ``val_sets`` drew from


@dataclass
class FusionResult:
    model: CAFace  # in eval mode, on the CPU
    # per epoch: epoch, lr, train/loss, train/lt, train/lp, train/lt_average (Lt of the plain average, same sets),
    # and val/* (validate_fusion) when val sets were given
    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint: Path | None = None  # last.ckpt when a checkpoint_dir was given
    steps: int = 0  # optimiser steps taken in all (resumed ones included): epochs × steps_per_epoch


def step_lr(epoch: int, lr: float, steps: Sequence[int], gamma: float = 0.1) -> float:
    """Step schedule: ``lr · γ^{#{s ∈ steps : s ≤ epoch}}`` (epochs from 0; MultiStepLR milestones)."""
    return lr * multistep(epoch, steps, gamma)


def identity_centres(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``f_GT`` (K, D): per-identity mean of the L2-normalised features, L2-normalised."""
    units = F.normalize(features, dim=-1)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype).index_add_(0, labels, units)
    return F.normalize(sums, dim=-1)


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise DataError(f"{name} must be a numpy array or torch tensor, got {type(x).__name__}")


def _check_data(
    cfg: FusionConfig, features: Any, styles: Any, labels: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    features, styles, labels = _as_tensor(features, "features"), _as_tensor(styles, "styles"), _as_tensor(labels, "labels")
    if features.ndim != 2 or features.shape[1] != cfg.feature_dim or not features.is_floating_point():
        raise DataError(
            f"features must be float (N, fusion.feature_dim = {cfg.feature_dim}), got {features.dtype} "
            f"{tuple(features.shape)}"
        )
    n = features.shape[0]
    if tuple(styles.shape) != (n, cfg.style_dim, 2) or not styles.is_floating_point():
        raise DataError(
            f"styles must be float (N, fusion.style_dim, 2) = {(n, cfg.style_dim, 2)}, got {styles.dtype} "
            f"{tuple(styles.shape)}"
        )
    if labels.ndim != 1 or labels.shape[0] != n or labels.is_floating_point() or labels.dtype == torch.bool:
        raise DataError(f"labels must be integers of shape ({n},), got {labels.dtype} {tuple(labels.shape)}")
    for name, x in (("features", features), ("styles", styles)):
        bad = ~torch.isfinite(x.reshape(n, -1)).all(dim=1)
        if bad.any():
            raise DataError(f"{name} row {int(torch.nonzero(bad)[0])} is not finite ({int(bad.sum())} rows); drop them")
    if n == 0:
        raise DataError("features, styles and labels are empty; fusion training needs features of at least 2 identities")
    labels = labels.long()
    if labels.min() < 0:
        raise DataError(f"labels must be contiguous 0..K-1, found negative label {int(labels.min())}")
    counts = torch.bincount(labels)
    absent = torch.nonzero(counts == 0).flatten()
    if absent.numel():
        raise DataError(
            f"labels must be contiguous 0..K-1 (K={counts.numel()}), but {absent.numel()} are absent, e.g. "
            f"{absent[:5].tolist()}; re-index them (np.unique(labels, return_inverse=True))"
        )
    if counts.numel() < 2:
        raise DataError("fusion training needs at least 2 identities, got 1")
    return features.float(), styles.float(), labels, counts.numel()


def _check_sources(sources: Any, labels: torch.Tensor) -> np.ndarray:
    """(N,) int64 source ids (all zeros when None)."""
    n = labels.shape[0]
    if sources is None:
        return np.zeros(n, dtype=np.int64)
    src = _as_tensor(sources, "sources")
    if tuple(src.shape) != (n,) or src.is_floating_point() or src.dtype == torch.bool:
        raise DataError(f"sources must be integers of shape ({n},) (one source id per feature), got {src.dtype} "
                        f"{tuple(src.shape)}")
    return src.long().numpy()


def _check_centres(cfg: FusionConfig, centres: Any, num_classes: int) -> torch.Tensor:
    """(K, D) unit-norm targets."""
    c = _as_tensor(centres, "centres")
    if tuple(c.shape) != (num_classes, cfg.feature_dim) or not c.is_floating_point():
        raise DataError(f"centres must be float (K, D) = ({num_classes}, {cfg.feature_dim}) (one target per label), "
                        f"got {c.dtype} {tuple(c.shape)}")
    norms = c.float().norm(dim=1)
    bad = torch.nonzero(~torch.isfinite(norms) | (norms <= 1e-12)).flatten()
    if bad.numel():
        raise DataError(f"centres row {int(bad[0])} is zero or not finite ({bad.numel()} rows): every identity needs "
                        "a target; check its clean images")
    return F.normalize(c.float(), dim=-1)


def _digest(*tensors: torch.Tensor | np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _draw_rows(rng: np.random.Generator, sources: list[list[np.ndarray]], ids: np.ndarray, per_identity: int,
               max_sources: int) -> np.ndarray:
    """(B, per_identity) row indices: for each identity, 1..max_sources of its sources (uniform count, distinct
    sources), then ``per_identity`` of their rows (without replacement when they have that many)."""
    out = []
    for i in ids:
        own = sources[i]
        count = int(rng.integers(1, min(max_sources, len(own)) + 1))
        pool = np.concatenate([own[j] for j in rng.choice(len(own), count, replace=False)])
        out.append(rng.choice(pool, per_identity, replace=len(pool) < per_identity))
    return np.stack(out)


def val_sets(features: Any, styles: Any, labels: Any, centres: Any, *, sources: Any = None, set_size: int = 16,
             sets_per_identity: int = 4, max_sources: int = 3, seed: int = 0) -> FusionVal:
    """``sets_per_identity`` sets of ``set_size`` items for each held-out identity, drawn once as training draws
    them (1..``max_sources`` of the identity's sources, without replacement where it has enough items) from a
    generator seeded by ``seed`` alone, so every trial of a sweep is scored on the same sets. ``labels`` (N,) are
    0..Kv-1, ``centres`` (Kv, D) their targets."""
    features, styles, labels = _as_tensor(features, "val features"), _as_tensor(styles, "val styles"), \
        _as_tensor(labels, "val labels").long()
    num_classes = int(labels.max()) + 1 if labels.numel() else 0
    if num_classes < 2 or torch.bincount(labels).min() == 0:
        raise DataError(f"val sets need items of at least 2 identities labelled 0..Kv-1, got {num_classes}")
    c = _as_tensor(centres, "val centres").float()
    if tuple(c.shape) != (num_classes, features.shape[1]):
        raise DataError(f"val centres must be (Kv, D) = ({num_classes}, {features.shape[1]}), got {tuple(c.shape)}")
    source_of = _check_sources(sources, labels)
    rng = np.random.default_rng(mix_seed(seed, 2))
    per_source = []
    for k in range(num_classes):
        rows = np.flatnonzero(labels.numpy() == k)
        per_source.append([rows[source_of[rows] == u] for u in np.unique(source_of[rows])])
    ids = np.repeat(np.arange(num_classes), sets_per_identity)
    rows = torch.from_numpy(np.stack([_draw_rows(rng, per_source, [i], set_size, max_sources)[0] for i in ids]))
    return FusionVal(features[rows].float(), styles[rows].float(), torch.from_numpy(ids), F.normalize(c, dim=-1),
                     rows)


@torch.no_grad()
def val_scores(model: CAFace, val: FusionVal) -> dict[str, np.ndarray]:
    """Per val set (S,): ``lt`` = ``1 − cos(template, f_GT)`` and ``hit`` = whether its nearest val target is its
    own, for CAFace's template (``caface/*``) and plain averaging's (``average/*``). Eval mode; the model's mode is
    restored."""
    was_training = model.training
    model.eval()
    device = model.cn.centres.device
    try:
        fused = model(val.features.to(device), val.styles.to(device)).float().cpu()
    finally:
        model.train(was_training)
    out = {}
    for name, templates in (("caface", fused), ("average", F.normalize(F.normalize(val.features, dim=-1).sum(1), dim=-1))):
        cos = F.normalize(templates, dim=-1) @ val.centres.T  # (S, Kv)
        out[f"{name}/lt"] = (1.0 - cos[torch.arange(len(cos)), val.labels]).numpy()
        out[f"{name}/hit"] = (cos.argmax(dim=1) == val.labels).numpy()
    return out


def validate_fusion(model: CAFace, val: FusionVal) -> dict[str, float]:
    """Means over the val sets of :func:`val_scores`: ``val/lt`` (Eq. 9 on held-out identities), ``val/rank1``
    (chance ``1/Kv``) and plain averaging's ``val/lt_average``, ``val/rank1_average``."""
    scores = val_scores(model, val)
    return {f"val/{kind}{suffix}": float(scores[f"{name}/{key}"].mean())
            for name, suffix in (("caface", ""), ("average", "_average"))
            for kind, key in (("lt", "lt"), ("rank1", "hit"))}


def usage_loss(count: torch.Tensor) -> torch.Tensor:
    """``Lu = mean over sets of 1 − H(u)/log M`` with ``u = c / Σ_m c`` (B, M) a set's share of assignment mass per
    cluster: 0 when every cluster gets an equal share, 1 when one cluster takes every item (collapse)."""
    share = count / count.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    entropy = -(share * share.clamp_min(1e-12).log()).sum(dim=-1)
    return (1.0 - entropy / math.log(count.shape[-1])).mean() if count.shape[-1] > 1 else count.new_zeros(())


def _prefix_sets(x: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sets (S, n, …) → every prefix of each length in ``lengths``, padded to ``max(lengths)``: (S·|lengths|, w, …)
    and the mask (S·|lengths|, w) of real items (set-major: set 0's prefixes first)."""
    width = max(lengths)
    part = x[:, :width]
    sets = part.repeat_interleave(len(lengths), dim=0)
    lens = torch.as_tensor(lengths, device=x.device).repeat(x.shape[0])
    mask = torch.arange(width, device=x.device)[None, :] < lens[:, None]
    return sets, mask


def _batch_loss(
    model: CAFace, cfg: FusionConfig, feats: torch.Tensor, sty: torch.Tensor, target: torch.Tensor,
    lengths: Sequence[int],
) -> dict[str, torch.Tensor]:
    """``L``, ``Lt``, ``Lp`` and the plain average's ``Lt`` on the same sets (a yardstick, no gradient) for
    identities' draws ``feats`` (B, P, D), ``sty`` (B, P, style_dim, 2), ``target`` (B, D); ``Lt`` is the mean over
    every group's prefixes of each length in ``lengths``, fused in one masked call."""
    b, p, d = feats.shape
    g = p // cfg.group
    groups = feats.reshape(b, g, cfg.group, d)
    group_styles = sty.reshape(b, g, cfg.group, cfg.style_dim, 2)
    prefix, mask = _prefix_sets(groups.reshape(b * g, cfg.group, d), lengths)  # (B·G·|L|, w, D)
    prefix_styles, _ = _prefix_sets(group_styles.reshape(b * g, cfg.group, cfg.style_dim, 2), lengths)
    clusters = model.cluster(prefix, prefix_styles, mask if len(set(lengths)) > 1 else None)
    fused = model.fuse(FusionState(clusters.count, clusters.features, clusters.styles))
    target = target.repeat_interleave(g * len(lengths), dim=0)
    lt = (1.0 - F.cosine_similarity(fused, target, dim=-1)).mean()
    with torch.no_grad():
        average = (F.normalize(prefix, dim=-1) * mask[..., None]).sum(dim=1)
        lt_average = (1.0 - F.cosine_similarity(average, target, dim=-1)).mean()
    lp = fused.new_zeros(())
    if cfg.lambda_p > 0:
        at_once = model(feats, sty)  # (B, D)
        state = model.init_state(b)
        for k in range(g):
            state = model.update(state, groups[:, k], group_styles[:, k])
        lp = (1.0 - F.cosine_similarity(model.fuse(state), at_once, dim=-1)).mean()
    lu = usage_loss(clusters.count)
    loss = lt + cfg.lambda_p * lp + (cfg.lambda_u * lu if cfg.lambda_u > 0 else 0.0)
    return {"train/loss": loss, "train/lt": lt, "train/lp": lp, "train/lu": lu.detach(),
            "train/lt_average": lt_average}


class _StepBatches(Dataset):
    """Batch ``(epoch, step)`` (an ``EpochBatches`` key) as a pure function of (seed, epoch, step): the
    identities' draws (B, P, D) and (B, P, style_dim, 2), their centres (B, D) and the prefix lengths, on the CPU."""

    def __init__(self, cfg: FusionConfig, features: torch.Tensor, styles: torch.Tensor, targets: torch.Tensor,
                 sources: list[list[np.ndarray]]) -> None:
        self.cfg, self.features, self.styles, self.targets, self.sources = cfg, features, styles, targets, sources
        self.batch = min(cfg.batch_size, len(sources))

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        epoch, step = key
        rng = np.random.default_rng(mix_seed(self.cfg.seed, 0, epoch, step))
        ids = rng.choice(len(self.sources), self.batch, replace=False)
        rows = torch.from_numpy(_draw_rows(rng, self.sources, ids, self.cfg.per_identity, self.cfg.max_sources))
        lengths = self.cfg.prefix_lengths if self.cfg.prefixes == "even" else \
            (int(rng.integers(self.cfg.min_len, self.cfg.max_len + 1)),)
        return {"features": self.features[rows], "styles": self.styles[rows],
                "targets": self.targets[torch.from_numpy(ids)], "lengths": torch.tensor(lengths)}


class FusionModule(lightning.LightningModule):
    """CAFace under ``Lt + λp·Lp``; AdamW with the LR ×0.1 from each epoch of ``lr_steps``."""

    def __init__(self, model: CAFace, cfg: FusionConfig, val: FusionVal | None = None) -> None:
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.val = val
        self._epoch_lr = cfg.lr

    def on_train_epoch_start(self) -> None:
        self._epoch_lr = float(self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # drop-path masks as a function of the step, for exact resume
        torch.manual_seed(mix_seed(self.cfg.seed, 1, self.global_step))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        losses = _batch_loss(self.model, self.cfg, batch["features"], batch["styles"], batch["targets"],
                             batch["lengths"].tolist())
        loss = losses["train/loss"]
        if not bool(torch.isfinite(loss)):
            raise non_finite_loss(self, float(loss.detach()), batch_idx, what="fusion loss", entry="train_fusion",
                                  advice="Lower fusion.lr or check the features.")
        b = batch["targets"].shape[0]
        for key, value in losses.items():
            self.log(key, value.detach(), on_step=False, on_epoch=True, prog_bar=key == "train/loss", batch_size=b)
        return loss

    def epoch_summary(self) -> dict[str, float]:
        """The epoch's learning rate (Lightning steps an epoch schedule before the epoch's end) and, with val sets,
        :func:`validate_fusion`'s ``val/*``, for the history."""
        return {"lr": self._epoch_lr, **(validate_fusion(self.model, self.val) if self.val is not None else {})}

    def configure_optimizers(self) -> Any:
        optimizer = adamw(self.model.parameters(), self, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        return lambda_schedule(optimizer, partial(multistep, milestones=self.cfg.lr_steps, gamma=0.1), interval="epoch")


def train_fusion(
    cfg: FusionConfig,
    features: np.ndarray | torch.Tensor,
    styles: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    *,
    sources: np.ndarray | torch.Tensor | None = None,
    centres: np.ndarray | torch.Tensor | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    callbacks: Sequence[Callback] = (),
    val: FusionVal | None = None,
) -> FusionResult:
    """Fit a CAFace on ``features`` (N, D), ``styles`` (N, style_dim, 2), ``labels`` (N,) 0..K-1 for
    ``epochs × steps_per_epoch`` steps on ``fusion.train.accelerator``.

    ``sources`` (N,): which source image each row is a (degraded) copy of; a step draws an identity's rows from
    1..``max_sources`` of its sources (None: all rows of an identity are one source). ``centres`` (K, D): the
    targets ``f_GT`` (the reference: mean feature of the identity's clean images); None: the identity means of
    ``features`` (:func:`identity_centres`), which averaging already matches on average.

    ``checkpoint_dir``: where ``last.ckpt`` is written after every epoch (an existing one is an error unless
    ``resume``); with ``resume`` the run continues from it (a missing checkpoint starts afresh).
    ``callbacks``: extra Lightning callbacks (e.g. a progress bar). ``val``: sets of held-out identities
    (:func:`val_sets`) scored after every epoch (``val/*`` in the history rows).
    """
    features, styles, labels, num_classes = _check_data(cfg, features, styles, labels)
    source_of = _check_sources(sources, labels)
    targets = identity_centres(features, labels, num_classes) if centres is None else \
        _check_centres(cfg, centres, num_classes)  # (K, D), frozen
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_fusion")
    val_data = () if val is None else (val.features, val.styles, val.labels, val.centres)
    info = {"config": cfg.to_dict(), "data": _digest(features, styles, labels, source_of, targets, *val_data)}
    if ckpt_path is not None:
        check_resume(ckpt_path, CHECKPOINT_KEY, "fusion.train", info, data_keys=("data",))
    rows_of = np.argsort(labels.numpy(), kind="stable")
    by_identity = np.split(rows_of, np.cumsum(torch.bincount(labels, minlength=num_classes).numpy())[:-1])
    per_source = [
        [rows[source_of[rows] == u] for u in np.unique(source_of[rows])] for rows in by_identity
    ]
    dataset = _StepBatches(cfg, features, styles, targets, per_source)
    loader = DataLoader(dataset, batch_size=None, sampler=EpochBatches(cfg.steps_per_epoch))

    with torch.random.fork_rng(devices=rng_devices(cfg.accelerator)):  # the caller's RNG is left as it was
        torch.manual_seed(cfg.seed)  # seeded initialisation
        model = CAFace(**cfg.model_kwargs)
        info["model"] = model.config
        module = FusionModule(model, cfg, val)
        log.info("training CAFace on %d features of %d identities: %d steps/epoch × %d epochs of %d identities%s",
                 features.shape[0], num_classes, cfg.steps_per_epoch, cfg.epochs, dataset.batch,
                 f", resuming {ckpt_path}" if ckpt_path else "")
        fitted = fit(
            module, loader, section="fusion", epochs=cfg.epochs, steps_per_epoch=cfg.steps_per_epoch,
            history=EpochHistory(LOSS_KEYS), accelerator=cfg.accelerator, devices=cfg.devices,
            precision=cfg.precision, run_info=(CHECKPOINT_KEY, info), checkpoint_dir=checkpoint_dir,
            last_checkpoint=LAST_CHECKPOINT, ckpt_path=ckpt_path, callbacks=callbacks, progress=progress,
        )
    for row in fitted.history:
        log.info("fusion epoch %d: loss %.4f (Lt %.4f vs %.4f for the average, Lp %.4f), lr %.2e%s", row["epoch"],
                 row["train/loss"], row["train/lt"], row["train/lt_average"], row["train/lp"], row["lr"],
                 f"; val Lt {row['val/lt']:.4f} vs {row['val/lt_average']:.4f}, rank-1 {row['val/rank1']:.3f} vs "
                 f"{row['val/rank1_average']:.3f}" if "val/lt" in row else "")
    return FusionResult(model=module.model.cpu().eval(), history=fitted.history, checkpoint=fitted.checkpoint,
                        steps=int(fitted.trainer.global_step))


@torch.no_grad()
def fuse_sets(
    model: CAFace,
    features: np.ndarray | torch.Tensor,
    styles: np.ndarray | torch.Tensor,
    set_index: np.ndarray | torch.Tensor,
    chunk_size: int | None = None,
    *,
    sets_per_batch: int = 256,
) -> np.ndarray:
    """Templates (S, D) float32, unit norm, of the sets ``set_index`` (T,) ∈ 0..S-1 over items
    ``features`` (T, D), ``styles`` (T, style_dim, 2), in eval mode.

    Sets are sorted by length and fused ``sets_per_batch`` at a time with a padding mask; a set longer than
    ``chunk_size`` is streamed in chunks of ``chunk_size`` (``init_state``/``update``/``fuse``), so at most
    ``sets_per_batch × chunk_size`` items are in flight. ``chunk_size=None`` fuses each set in one call (equal to
    ``model(set)``). Every set 0..S-1 must have at least one item. The model's train/eval mode is restored.
    """
    if not isinstance(model, CAFace):
        raise ConfigError(f"fuse_sets needs a CAFace model, got {type(model).__name__}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ConfigError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if isinstance(sets_per_batch, bool) or not isinstance(sets_per_batch, int) or sets_per_batch < 1:
        raise ConfigError(f"sets_per_batch must be a positive integer, got {sets_per_batch!r}")
    features, styles = _as_tensor(features, "features"), _as_tensor(styles, "styles")
    index = _as_tensor(set_index, "set_index")
    t = features.shape[0] if features.ndim == 2 else -1
    if t < 1 or tuple(index.shape) != (t,) or index.is_floating_point() or index.dtype == torch.bool:
        raise DataError(
            f"fuse_sets needs features (T, D) with T ≥ 1 and integer set_index (T,), got features "
            f"{tuple(features.shape)} and set_index {index.dtype} {tuple(index.shape)}"
        )
    if tuple(styles.shape[:1]) != (t,):
        raise DataError(f"styles must have one row per feature ({t}), got {tuple(styles.shape)}")
    index = index.long()
    if index.min() < 0:
        raise DataError(f"set_index must be in 0..S-1, found {int(index.min())}")
    counts = torch.bincount(index)
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel():
        raise DataError(
            f"sets {empty[:5].tolist()} have no items ({empty.numel()} empty of {counts.numel()}); set_index must use "
            "every id 0..S-1 — re-index with np.unique(set_index, return_inverse=True)"
        )
    num_sets = counts.numel()
    order = torch.argsort(index, stable=True)  # items grouped by set
    starts = torch.cumsum(counts, 0) - counts
    by_length = torch.argsort(counts, stable=True)
    out = torch.empty(num_sets, model.feature_dim)
    was_training = model.training
    model.eval()
    device = model.cn.centres.device
    try:
        for lo in range(0, num_sets, sets_per_batch):
            sets = by_length[lo:lo + sets_per_batch]  # (b,)
            lengths, first = counts[sets], starts[sets]
            chunk = int(lengths.max()) if chunk_size is None else chunk_size
            state = model.init_state(len(sets), device=device)
            for offset in range(0, int(lengths.max()), chunk):
                take = (lengths - offset).clamp(0, chunk)  # (b,) items of each set in this chunk
                width = int(take.max())
                pos = torch.arange(width)
                mask = pos[None, :] < take[:, None]  # (b, width)
                items = order[(first[:, None] + offset + pos[None, :]).clamp(max=t - 1)]  # (b, width); padding is masked
                state = model.update(
                    state, features[items].to(device), styles[items].to(device), mask.to(device)
                )
            out[sets] = model.fuse(state).float().cpu()
    finally:
        model.train(was_training)
    return out.numpy()
