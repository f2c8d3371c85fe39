"""CAFace training on precomputed (feature, style, label) triples, and fused inference over many sets.

``train_fusion(cfg, features, styles, labels)`` fits ``ml.models.fusion.CAFace`` on features of a
frozen FR backbone (paper Sec. 3.2 and 4.1):

- Targets: ``f_GT`` = per-identity mean of the L2-normalised features, computed once and frozen.
- An epoch shuffles the identities and visits them in full batches of ``batch_size`` (the remainder,
  fewer than ``batch_size``, waits for the next epoch's shuffle). For each identity ``per_identity`` (32)
  of its features are drawn (without replacement when it has that many, with replacement otherwise) and
  split into ``per_identity / group`` groups of ``group`` (2 of 16).
- One prefix length ``L ∈ [min_len, max_len]`` is drawn per batch; every group's first ``L`` items are a
  training set: ``Lt = mean(1 − cos(CAFace(set), f_GT))`` (Eq. 9).
- ``Lp = mean(1 − cos(f_streamed, f_all_at_once))`` (Eq. 10) on the identity's ``per_identity`` items: fed
  group by group through ``init_state/update/fuse`` against one call over all of them, gradients
  through both. ``L = Lt + λp·Lp`` (Eq. 11).
- AdamW (lr 1e-3, wd 5e-4), the LR multiplied by 0.1 at each epoch of ``lr_steps`` (6, 9), 10 epochs.

Checkpoints: with ``checkpoint_dir`` the complete state (weights, optimiser, epoch, history, config,
a digest of the data) is written after every epoch to ``last.pt`` (temporary file + ``os.replace``).
``resume=True`` continues from it. All randomness of an epoch (sampling, drop-path) is seeded from
(seed, epoch), so a run stopped after any epoch and resumed ends with the same weights as an
uninterrupted one. ``epochs`` may grow between the two (the step schedule is in absolute epochs); every
other key must match.

``fuse_sets`` fuses many sets of different lengths in eval mode, batching sets with a padding mask and
feeding long sets in chunks, so memory is bounded by ``sets_per_batch × chunk_size`` items.

Differences from the reference (``mk-minchul/caface``, ``caface/trainer.py``, ``datafeed_scheme
dual_multi_v1``):

- Prefixes: the reference averages ``Lt`` over every even prefix length 2, 4, …, 16 of both groups in each
  step; here one length per batch is drawn uniformly from ``[min_len, max_len]`` (odd ones included),
  so a step costs one CAFace call instead of eight.
- The reference precomputes features under image augmentation; here the features are given.
- The step schedule is per epoch and set directly on the optimiser (no scheduler object to checkpoint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError, TrainingError
from ml.models.fusion.caface import CAFace
from ml.train.checkpoint import save_checkpoint

__all__ = ["FusionConfig", "FusionResult", "fuse_sets", "identity_centres", "step_lr", "train_fusion"]

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.pt"
CHECKPOINT_KEY = "faceops_fusion"


@dataclass(frozen=True)
class FusionConfig:
    """``fusion`` section of params.yaml: CAFace sizes and the training recipe (paper defaults)."""

    feature_dim: int = 512
    style_dim: int = 384
    num_clusters: int = 4
    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 5e-4
    lr_steps: tuple[int, ...] = (6, 9)  # epochs (0-based) from which the LR is ×0.1 once more
    per_identity: int = 32  # features drawn per identity and step
    group: int = 16  # chunk size of the streamed pass for Lp; prefixes are taken inside each group
    min_len: int = 2
    max_len: int = 16
    batch_size: int = 512  # identities per step (reference: 512)
    lambda_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        ints = ("feature_dim", "style_dim", "num_clusters", "epochs", "per_identity", "group", "min_len",
                "max_len", "batch_size", "seed")
        for key in ints:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"fusion.{key} must be an integer, got {value!r}")
        for key in ("lr", "weight_decay", "lambda_p"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"fusion.{key} must be a finite number, got {value!r}")
        for key in ("feature_dim", "style_dim", "num_clusters", "epochs", "group", "min_len", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fusion.{key} = {getattr(self, key)} must be ≥ 1")
        if self.lr <= 0:
            raise ConfigError(f"fusion.lr = {self.lr} must be > 0")
        if self.weight_decay < 0 or self.lambda_p < 0:
            key = "weight_decay" if self.weight_decay < 0 else "lambda_p"
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
        steps = self.lr_steps
        if not isinstance(steps, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
            raise ConfigError(f"fusion.lr_steps must be a list of epoch numbers, got {steps!r}")
        if any(s < 1 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"fusion.lr_steps = {list(steps)} must be increasing epochs ≥ 1")
        object.__setattr__(self, "lr_steps", tuple(steps))

    @property
    def model_kwargs(self) -> dict[str, Any]:
        return {"feature_dim": self.feature_dim, "style_dim": self.style_dim, "num_clusters": self.num_clusters}


@dataclass
class FusionResult:
    model: CAFace  # in eval mode
    # per epoch: epoch, lr, train/loss, train/lt, train/lp, train/lt_average (Lt of the plain average, same sets)
    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint: Path | None = None  # last.pt when a checkpoint_dir was given


def step_lr(epoch: int, lr: float, steps: tuple[int, ...], gamma: float = 0.1) -> float:
    """Step schedule: ``lr · γ^{#{s ∈ steps : s ≤ epoch}}`` (epochs from 0; MultiStepLR milestones)."""
    return lr * gamma ** sum(epoch >= s for s in steps)


def identity_centres(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``f_GT`` (K, D): per-identity mean of the L2-normalised features, L2-normalised."""
    units = F.normalize(features, dim=-1)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype).index_add_(0, labels, units)
    return F.normalize(sums, dim=-1)


def _mix(*values: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(values).encode(), digest_size=8).digest(), "little") & (2**63 - 1)


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


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def _sample(
    rng: np.random.Generator, members: list[np.ndarray], ids: np.ndarray, per_identity: int
) -> np.ndarray:
    """(B, per_identity) row indices: each identity's features without replacement when it has enough."""
    rows = [
        rng.choice(members[i], per_identity, replace=len(members[i]) < per_identity) for i in ids
    ]
    return np.stack(rows)


def _batch_loss(
    model: CAFace, cfg: FusionConfig, feats: torch.Tensor, sty: torch.Tensor, target: torch.Tensor, length: int
) -> dict[str, torch.Tensor]:
    """``L``, ``Lt``, ``Lp`` and the plain average's ``Lt`` on the same sets (a yardstick, no gradient) for
    identities' draws ``feats`` (B, P, D), ``sty`` (B, P, style_dim, 2), ``target`` (B, D)."""
    b, p, d = feats.shape
    g = p // cfg.group
    groups = feats.reshape(b, g, cfg.group, d)
    group_styles = sty.reshape(b, g, cfg.group, cfg.style_dim, 2)
    prefix = groups[:, :, :length].reshape(b * g, length, d)  # every group's first L items: B·G sets
    prefix_styles = group_styles[:, :, :length].reshape(b * g, length, cfg.style_dim, 2)
    fused = model(prefix, prefix_styles)  # (B·G, D)
    target = target.repeat_interleave(g, dim=0)  # (B·G, D)
    lt = (1.0 - F.cosine_similarity(fused, target, dim=-1)).mean()
    with torch.no_grad():
        lt_average = (1.0 - F.cosine_similarity(F.normalize(prefix, dim=-1).sum(dim=1), target, dim=-1)).mean()
    lp = fused.new_zeros(())
    if cfg.lambda_p > 0:
        at_once = model(feats, sty)  # (B, D)
        state = model.init_state(b)
        for k in range(g):
            state = model.update(state, groups[:, k], group_styles[:, k])
        lp = (1.0 - F.cosine_similarity(model.fuse(state), at_once, dim=-1)).mean()
    return {"train/loss": lt + cfg.lambda_p * lp, "train/lt": lt, "train/lp": lp, "train/lt_average": lt_average}


def _load_checkpoint(path: Path, cfg: FusionConfig, digest: str) -> dict[str, Any]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable, truncated or not a torch file
        raise ConfigError(f"cannot read checkpoint {path}: {exc}; remove it or pass resume=False") from exc
    if not isinstance(ckpt, dict) or CHECKPOINT_KEY not in ckpt:
        raise ConfigError(f"{path} is not a faceops fusion checkpoint; remove it or pass resume=False")
    saved = ckpt[CHECKPOINT_KEY]["config"]
    now = dataclasses.asdict(cfg)
    now["lr_steps"] = list(cfg.lr_steps)
    saved = {**saved, "lr_steps": list(saved.get("lr_steps", []))}
    differ = sorted(k for k in now if k != "epochs" and saved.get(k) != now[k])
    if differ:
        raise ConfigError(
            f"checkpoint {path} was trained with a different fusion config ({', '.join(f'{k}: {saved.get(k)!r} → {now[k]!r}' for k in differ)}); "
            "only fusion.epochs may change on resume — restore the keys or use another checkpoint_dir"
        )
    if ckpt[CHECKPOINT_KEY]["data"] != digest:
        raise DataError(
            f"checkpoint {path} was trained on other features/styles/labels; resume on the same data or use another "
            "checkpoint_dir"
        )
    return ckpt


def train_fusion(
    cfg: FusionConfig,
    features: np.ndarray | torch.Tensor,
    styles: np.ndarray | torch.Tensor,
    labels: np.ndarray | torch.Tensor,
    *,
    checkpoint_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
) -> FusionResult:
    """Fit a CAFace on ``features`` (N, D), ``styles`` (N, style_dim, 2), ``labels`` (N,) 0..K-1; CPU training."""
    features, styles, labels, num_classes = _check_data(cfg, features, styles, labels)
    targets = identity_centres(features, labels, num_classes)  # (K, D), frozen
    members = [np.flatnonzero(labels.numpy() == k) for k in range(num_classes)]
    digest = _digest(features, styles, labels)

    with torch.random.fork_rng(devices=[]):  # seeded initialisation, the caller's RNG left as it was
        torch.manual_seed(cfg.seed)
        model = CAFace(**cfg.model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    history: list[dict[str, float]] = []
    start = 0

    ckpt_path = None if checkpoint_dir is None else Path(checkpoint_dir) / LAST_CHECKPOINT
    if resume and ckpt_path is None:
        raise ConfigError("train_fusion(resume=True) needs a checkpoint_dir holding last.pt")
    if ckpt_path is not None and ckpt_path.is_file():
        if not resume:
            raise ConfigError(
                f"{ckpt_path} exists from an earlier run; pass resume=True to continue it, or remove it / choose "
                "another checkpoint_dir to start over"
            )
        ckpt = _load_checkpoint(ckpt_path, cfg, digest)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        history = [dict(r) for r in ckpt["history"]]
        start = int(ckpt["epoch"])
        log.info("resuming fusion training from %s after epoch %d", ckpt_path, start)
    elif resume:
        log.warning("resume=True but %s does not exist; training from scratch", ckpt_path)

    batch = min(cfg.batch_size, num_classes)
    steps = num_classes // batch  # full batches only: every step has the same shape
    for epoch in range(start, cfg.epochs):
        lr = step_lr(epoch, cfg.lr, cfg.lr_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        rng = np.random.default_rng(_mix(cfg.seed, epoch))
        order = rng.permutation(num_classes)
        model.train()
        sums = {"train/loss": 0.0, "train/lt": 0.0, "train/lp": 0.0, "train/lt_average": 0.0}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_mix(cfg.seed, epoch, 1))  # drop-path masks
            bar = tqdm(range(steps), desc=f"fusion epoch {epoch + 1}/{cfg.epochs}", disable=not progress, leave=False)
            for step in bar:
                ids = order[step * batch:(step + 1) * batch]
                rows = torch.from_numpy(_sample(rng, members, ids, cfg.per_identity))  # (B, P)
                length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
                losses = _batch_loss(model, cfg, features[rows], styles[rows], targets[torch.from_numpy(ids)], length)
                loss = losses["train/loss"]
                if not torch.isfinite(loss):
                    last = ckpt_path if ckpt_path is not None and ckpt_path.is_file() else None
                    raise TrainingError(
                        f"fusion loss became {loss.item()} at epoch {epoch}, step {step}; last good checkpoint: "
                        f"{last or 'none'}. Lower fusion.lr or check the features"
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                for key, value in losses.items():
                    sums[key] += float(value.detach())
                bar.set_postfix(loss=f"{float(loss.detach()):.4f}", refresh=False)
        row = {"epoch": epoch, "lr": lr, **{k: v / steps for k, v in sums.items()}}
        history.append(row)
        log.info("fusion epoch %d: loss %.4f (Lt %.4f vs %.4f for the average, Lp %.4f)", epoch, row["train/loss"],
                 row["train/lt"], row["train/lt_average"], row["train/lp"])
        if ckpt_path is not None:
            config = dataclasses.asdict(cfg)
            config["lr_steps"] = list(cfg.lr_steps)
            save_checkpoint(ckpt_path, {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch + 1,
                "history": history,
                CHECKPOINT_KEY: {"config": config, "data": digest, "model_kwargs": model.config},
            })
    model.eval()
    return FusionResult(model=model, history=history, checkpoint=ckpt_path)


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
