"""The FR trainer's data side: input checks, normalisation, batched augmentation and the resumable sampler.

Data stay a uint8 ``(N, 3, H, W)`` tensor; ``normalize`` and ``augment_batch`` ("basic": random flip, small zoom
and translation as one affine resample) run on each batch tensor, so a step costs no per-image Python work.
``EpochSampler`` orders the data by (seed, epoch) only, and ``mix_seed`` (ml.train.checkpoint) derives every other seed (augmentation,
the model's own randomness, PartialFC's initial shards), which is what makes a resumed run exact.
``_check_images``, ``_check_labels`` and ``check_keypoints`` turn bad arrays into a DataError that says what to fix.

Pure torch/numpy, no Lightning: code that needs only these helpers can import this module on its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Sampler

from ml.errors import DataError
from ml.fr.backbones.vit import INPUT_CONTRACT
from ml.train.augment import FLIP_LANDMARK_ORDER
from ml.train.checkpoint import mix_seed

__all__ = [
    "EpochSampler",
    "LabelledFaces",
    "augment_batch",
    "check_keypoints",
    "images_to_tensor",
    "needs_keypoints",
    "normalize",
]


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


def augment_batch(
    x: torch.Tensor,
    max_zoom: float = 0.1,
    max_shift: float = 0.06,
    keypoints: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Random horizontal flip (p = 0.5), zoom-in by up to ``max_zoom`` of the side and translation by up
    to ``max_shift`` of the side, per sample, as one bilinear affine resample of the batch (B, C, H, W).

    With ``keypoints`` (B, 5, 2) pixel (x, y), returns ``(images, keypoints)`` with the landmarks moved by
    the same transform (and left/right swapped where flipped), so KP-RPE sees where the features went.
    With a ``generator`` the random numbers are drawn on its device and moved to the images' device.
    """
    b, size = x.shape[0], x.shape[-1]
    dev = x.device
    gdev = generator.device if generator is not None else dev
    u = torch.rand(b, 4, generator=generator, device=gdev).to(dev)  # (B, 4) in [0, 1)
    flip = torch.where(u[:, 0] < 0.5, -1.0, 1.0)
    zoom = 1.0 - max_zoom * u[:, 1]  # sampled window side / image side
    shift = (u[:, 2:4] * 2.0 - 1.0) * (2.0 * max_shift)  # grid coords span 2 per side
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


_mix_seed = mix_seed  # the name this module's callers import


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class EpochSampler(Sampler[int]):
    """Shuffles ``range(n)`` with a permutation that depends only on (seed, epoch), so a resumed run sees the
    batches an uninterrupted one would. Under DDP each rank takes every world-th index, ``n // world`` each;
    the rank and world size are read when iterating, i.e. after the process group exists."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = int(n), int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every epoch."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // _rank_world()[1]

    def __iter__(self):
        rank, world = _rank_world()
        gen = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        perm = torch.randperm(self.n, generator=gen)
        return iter(perm[rank::world][: self.n // world].tolist())


class LabelledFaces(Dataset):
    """Training items of a dataset of decoded faces (``faces[i]`` → (uint8 (H, W, 3) tensor, anything), e.g.
    ``ml.data.records.ShardDataset``, decoded in the DataLoader's workers): ``(uint8 (3, H, W), int64 label)`` and,
    with ``keypoints`` (N, 5, 2), the face's keypoints: the items a ``TensorDataset`` of the decoded arrays gives, so
    the two paths train the same model."""

    def __init__(self, faces: Dataset, labels: np.ndarray, keypoints: np.ndarray | None = None) -> None:
        self.faces, self.labels = faces, torch.from_numpy(np.asarray(labels, dtype=np.int64))
        self.keypoints = None if keypoints is None else torch.from_numpy(keypoints)
        if len(faces) != len(self.labels):  # type: ignore[arg-type]
            raise DataError(f"{len(faces)} faces for {len(self.labels)} labels")  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        image = self.faces[index][0].permute(2, 0, 1).contiguous()
        if self.keypoints is None:
            return image, self.labels[index]
        return image, self.labels[index], self.keypoints[index]


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


def check_keypoints(keypoints: np.ndarray | None, n: int, model_name: str) -> np.ndarray:
    """float32 (n, 5, 2) pixel landmarks for a KP-RPE model, or DataError: none given, wrong shape, non-finite rows."""
    if keypoints is None:
        raise DataError(
            f"{model_name!r} uses KP-RPE and needs 5 landmarks per image, but none were given: it needs keypoints "
            "(N, 5, 2) pixel x, y — from the manifest's landmarks or the aligner's predictions"
        )
    keypoints = np.asarray(keypoints, dtype=np.float32)
    if keypoints.shape != (n, 5, 2):
        raise DataError(f"keypoints must have shape ({n}, 5, 2), got {keypoints.shape}")
    missing = np.flatnonzero(~np.isfinite(keypoints).all(axis=(1, 2)))
    if missing.size:
        raise DataError(
            f"keypoints of image {int(missing[0])} are not finite ({missing.size} of {n} images, e.g. rows "
            f"{missing[:5].tolist()}); drop them or fill them with the aligner's predictions"
        )
    return keypoints
