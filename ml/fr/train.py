"""Face-recognition training: a backbone + margin softmax head fitted with Lightning on in-memory or streamed images.

``train_fr(cfg, images, labels)`` is the whole stage: it seeds, builds the registered backbone for the images' size,
fits it with AdamW (linear warmup, then cosine or step decay per step) under a margin head and returns the backbone
in eval mode with its per-epoch history. ``embed`` turns uint8 images into unnormalised embeddings with flip TTA,
``f(x) + f(flip x)``. Heads and LR schedules live in ``ml.fr.module``, ``FRConfig`` in ``ml.fr.config``, input
checks, batched augmentation and ``EpochSampler`` in ``ml.fr.data``; their public names are re-exported here.

Exact resume: data order depends on (seed, epoch) only, augmentation and the model's own randomness are reseeded
from (seed, global step, rank), and every piece of state (weights, optimiser, schedule, PartialFC's step, AdaFace's
statistics, LVFace's prototypes, history) is checkpointed, so a run resumed from ``last.ckpt`` ends with the weights
of an uninterrupted one (a changed ``fr.epochs`` changes the schedule). Under DDP the backbone's BatchNorms use the
global batch's statistics (``ml.train.batchnorm``), so N ranks train the model one process trains on their images.
Precision: "16-mixed" is refused on the CPU, "bf16-mixed" runs everywhere, "auto" resolves per machine
(``ml.train.device.resolve_precision``) and the model's ``config.json`` records what it trained in.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from tqdm.auto import tqdm

from ml.data.records import worker_kwargs
from ml.data.shard_stream import ShardStream, StreamLoader
from ml.errors import ConfigError, DataError
from ml.fr.backbones import BACKBONES, build_backbone, input_contract
from ml.train.augment import FLIP_LANDMARK_ORDER, flip_keypoints
from ml.train.batchnorm import global_batchnorm
from ml.train.callbacks import EpochHistory, fit
from ml.train.device import check_device
from ml.train.checkpoint import check_resume, resume_path

# Not all of these are used here: the choice constants and ``normalize`` stay importable from ml.fr.train too.
from ml.fr.config import AUGMENT_RECIPES, HEAD_MARGINS, PRECISIONS, SCHEDULES, STRATEGIES, FRConfig
from ml.fr.data import (
    EpochSampler,
    LabelledFaces,
    _check_images,
    _check_labels,
    augment_batch,
    check_keypoints,
    images_to_tensor,
    needs_keypoints,
    normalize,
)
from ml.fr.module import FRModule, build_head, warmup_cosine, warmup_step_decay

__all__ = [
    "FLIP_LANDMARK_ORDER",
    "EpochSampler",
    "FRConfig",
    "FRModule",
    "FRResult",
    "augment_batch",
    "build_head",
    "embed",
    "flip_keypoints",
    "images_to_tensor",
    "needs_keypoints",
    "train_fr",
    "warmup_cosine",
    "warmup_step_decay",
]

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"
CHECKPOINT_KEY = "faceops_fr"  # run description stored in every checkpoint, checked before resuming


@dataclass
class FRResult:
    model: nn.Module  # backbone in eval mode
    backbone: str
    backbone_kwargs: dict
    history: list[dict]  # per epoch {"epoch", "train/loss", "train/accuracy"[, "val/accuracy"]}, resumed ones too
    seconds: float
    checkpoint: Path | None = None  # last.ckpt when train_fr() was given a checkpoint_dir
    global_rank: int = 0  # this process's rank under DDP: only rank 0 should save the model or log results
    precision: str = "32-true"  # what it trained in (fr.precision "auto" resolved)


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
    if cfg.keypoint_map != "linear":  # the linear map is the backbone's default: its saved kwargs stay as they were
        kwargs["keypoint_map"] = cfg.keypoint_map
    expected = input_contract(cfg.backbone, **kwargs)["size"]
    if expected != size:
        raise ConfigError(
            f"backbone {cfg.backbone!r} takes {expected}×{expected} images but the data are {size}×{size}; "
            "prepare the data at that size or pick another fr.backbone"
        )
    return kwargs


def _strategy(cfg: FRConfig) -> Any:
    """"auto" for one process; otherwise DDP. ``static_graph`` lets parameters that never get a gradient
    (the ViT's mask token when ``mask_ratio`` is 0) pass without DDP's per-step search for unused ones."""
    if cfg.strategy == "auto" and cfg.devices * cfg.num_nodes == 1:
        return "auto"
    return DDPStrategy(start_method="spawn" if cfg.strategy == "ddp_spawn" else "popen", static_graph=True)


def _head_kind(cfg: FRConfig) -> str:
    """The head's structure, which decides the checkpoint's head tensors."""
    kind = "adaface" if cfg.margin == "adaface" else ("partial_fc" if cfg.sample_rate < 1.0 else "margin")
    return f"lvface({kind})" if cfg.lvface else kind


def _check_checkpoint(path: Path, info: dict[str, Any], backbone: nn.Module) -> None:
    """Before fitting: the resume policy every trainer follows (``check_resume``), then every backbone tensor of
    the checkpoint must fit this backbone's shape."""
    ckpt = check_resume(path, CHECKPOINT_KEY, "fr", info, data_keys=("num_classes",))
    state = ckpt["state_dict"]
    wrong = []
    for key, value in backbone.state_dict().items():
        saved = state.get(f"backbone.{key}")
        if saved is None or tuple(saved.shape) != tuple(value.shape):
            wrong.append(f"backbone.{key}: {None if saved is None else tuple(saved.shape)} vs {tuple(value.shape)}")
    if wrong:
        raise ConfigError(f"checkpoint {path} does not fit this backbone ({len(wrong)} tensors, e.g. {wrong[:3]})")


def _val_tensors(val: tuple[np.ndarray, ...], size: int, num_classes: int, backbone: nn.Module, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``train``'s ``val`` checked (DataError naming what is wrong) → (uint8 (V, 3, H, W), int64 (V,), keypoints)."""
    if not isinstance(val, tuple) or len(val) not in (2, 3):
        raise DataError("val must be a tuple (images, labels) or, for KP-RPE backbones, (images, labels, keypoints)")
    images, labels = val[0], np.asarray(val[1])
    _check_images(images, "validation images")
    if images.shape[1] != size or len(images) == 0:
        raise DataError(f"validation images must be {size}×{size} like the training images and not empty, got "
                        f"{images.shape}")
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer) \
            or labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(f"validation labels must be {len(images)} integers in [0, {num_classes}) (the training "
                        f"identities), got {labels.dtype} {labels.shape}")
    keypoints = None
    if needs_keypoints(backbone):
        keypoints = torch.from_numpy(check_keypoints(val[2] if len(val) == 3 else None, len(images), name))
    return (torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(),
            torch.from_numpy(labels.astype(np.int64)), keypoints)


def _streamed_size(faces: Dataset) -> int:
    """The side of the square faces of a streamed dataset, from its first face (the gate checked every size)."""
    image = faces[0][0]
    if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.shape[0] != image.shape[1]:
        raise DataError(f"streamed faces must be square uint8 (H, W, 3) tensors, got {image.dtype} "
                        f"{tuple(image.shape)}")
    return int(image.shape[0])


def train_fr(
    cfg: FRConfig,
    images: np.ndarray | Dataset,
    labels: np.ndarray,
    *,
    loggers: Any = None,
    callbacks: Sequence[Callback] = (),
    progress: bool = True,
    backbone_overrides: dict[str, Any] | None = None,
    keypoints: np.ndarray | None = None,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    val: tuple[np.ndarray, ...] | None = None,
) -> FRResult:
    """Fit ``cfg.backbone`` on uint8 RGB ``images`` (N, H, W, 3) with contiguous integer ``labels`` (N,).

    ``images`` may instead be a dataset of N faces decoded on access (``faces[i][0]``: uint8 (H, W, 3) tensor, e.g.
    ``ml.data.records.ShardDataset``; ``fr.stream``): the DataLoader's ``fr.num_workers`` workers decode each
    epoch's faces, nothing is held decoded, and the batches (hence the model) are those of the decoded array. Or an
    ``ml.data.shard_stream.ShardStream`` (``fr.stream_from``): the faces are streamed a window at a time from shards that
    may lie in an object store, in the stream's own order (its docstring), by non-persistent workers.

    KP-RPE backbones also need ``keypoints`` (N, 5, 2): pixel landmarks in ArcFace order.

    ``backbone_overrides`` are extra constructor arguments (e.g. ``depth``); the image size and the
    embedding dimension always come from the data and ``cfg``.

    ``val = (images, labels)`` (KP-RPE: ``(images, labels, keypoints)``) are further images of the training
    identities, same size, not trained on: each epoch's history row (and the loggers) then get ``val/accuracy``,
    the share of them whose nearest class centre of the head is their own identity.

    With ``checkpoint_dir`` a ``last.ckpt`` is written there after every epoch (an existing one is an
    error unless ``resume``). ``resume=True`` continues from it, after checking that it holds the same
    backbone, class count and head; the result equals an uninterrupted run of the same config. Without a
    ``last.ckpt`` a resumed run starts from scratch (logged). A NaN/inf loss stops training with a
    ``TrainingError`` naming the global step and the last good checkpoint.
    """
    start = time.perf_counter()
    streamed = not isinstance(images, np.ndarray)
    if isinstance(images, ShardStream):
        n, size = len(images.labels), images.image_size
    elif streamed:
        n = len(images)  # type: ignore[arg-type]
        size = _streamed_size(images) if n else 0
    else:
        _check_images(images)
        n, size = images.shape[0], images.shape[1]
    labels = _check_labels(labels, n)
    if n < 2:
        raise DataError(f"training needs at least 2 images, got {n}")
    check_device("fr", cfg.accelerator, cfg.precision)
    kwargs = _backbone_kwargs(cfg, size, backbone_overrides)
    ckpt_path = resume_path(checkpoint_dir, resume, LAST_CHECKPOINT, "train_fr")
    world = cfg.devices * cfg.num_nodes
    per_rank = n // world
    if per_rank < 2:
        raise DataError(f"{n} images over {world} processes leave fewer than 2 per process; use fewer devices")

    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    backbone = build_backbone(cfg.backbone, **kwargs)
    if world > 1:  # BatchNorm over the global batch: DDP trains the model of one process with every rank's images
        global_batchnorm(backbone)
    keypoints = check_keypoints(keypoints, n, cfg.backbone) if needs_keypoints(backbone) else None
    if isinstance(images, ShardStream):
        dataset: Dataset = images
    elif streamed:
        dataset = LabelledFaces(images, labels, keypoints)  # type: ignore[arg-type]
    else:
        dataset = TensorDataset(
            torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).contiguous(),  # uint8 (N, 3, H, W)
            torch.from_numpy(labels), *([] if keypoints is None else [torch.from_numpy(keypoints)]))
    num_classes = int(labels.max()) + 1
    info = {
        "backbone": cfg.backbone,
        "backbone_kwargs": dict(kwargs),
        "num_classes": num_classes,
        "head": _head_kind(cfg),
        "config": dataclasses.asdict(cfg),
    }
    if ckpt_path is not None:
        _check_checkpoint(ckpt_path, info, backbone)
    val_tensors = _val_tensors(val, size, num_classes, backbone, cfg.backbone) if val is not None else None
    # A class-sharded head is built once the process group exists; the others now, as before.
    head_factory = partial(build_head, cfg, num_classes)
    head = head_factory if cfg.sample_rate < 1.0 else head_factory()

    batch_size = min(cfg.batch_size, per_rank)
    steps_per_epoch = per_rank // batch_size  # drop_last: a batch of 1 would break BatchNorm
    if isinstance(dataset, ShardStream):
        if not np.array_equal(dataset.labels, labels):
            raise DataError("the ShardStream's labels are not the labels passed to train_fr")
        loader: DataLoader = StreamLoader(dataset.training(batch_size, cfg.seed, keypoints),
                                          **worker_kwargs(cfg.num_workers))
    else:
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=EpochSampler(n, cfg.seed),
            drop_last=True,
            **worker_kwargs(cfg.num_workers, persistent=True),
        )
    module = FRModule(backbone, head, cfg, steps_per_epoch, val=val_tensors)
    log.info(
        "training %s %s on %d images (%d identities, %d×%d), %s head: %d steps/epoch × %d epochs%s",
        cfg.backbone, kwargs, n, num_classes, size, size, info["head"], steps_per_epoch, cfg.epochs,
        f", resuming {ckpt_path}" if ckpt_path else "",
    )
    fitted = fit(
        module, loader, section="fr", epochs=cfg.epochs, steps_per_epoch=steps_per_epoch,
        history=EpochHistory(("train/loss", "train/accuracy")), accelerator=cfg.accelerator, devices=cfg.devices,
        precision=cfg.precision, num_nodes=cfg.num_nodes, strategy=_strategy(cfg), max_steps=cfg.max_steps,
        grad_clip=cfg.grad_clip, run_info=(CHECKPOINT_KEY, info), checkpoint_dir=checkpoint_dir,
        last_checkpoint=LAST_CHECKPOINT, ckpt_path=ckpt_path, callbacks=callbacks, loggers=loggers, progress=progress,
    )
    seconds = time.perf_counter() - start
    if fitted.history:
        log.info("done in %.1f s; last epoch %s", seconds, fitted.history[-1])
    return FRResult(backbone.eval(), cfg.backbone, kwargs, fitted.history, seconds, fitted.checkpoint,
                    global_rank=fitted.trainer.global_rank, precision=fitted.precision)


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
    kp = check_keypoints(keypoints, len(images), type(model).__name__) if needs_keypoints(model) else None
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
