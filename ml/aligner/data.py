"""What the DFA aligner trains on: checked uint8 crops with pixel landmarks, resized once to the input size, the
non-face crops of the face score (``render_nonface``), and batches keyed by ``(epoch, step)`` so that a resumed run
sees the same batches as an uninterrupted one."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ml.data.procedural import render_nonfaces
from ml.errors import DataError
from ml.aligner.dfa import resize_images, to_normalised

__all__ = ["HELDOUT_NONFACE_START", "AlignerBatches", "check_images", "check_landmarks", "nonface_crops",
           "prepare_crops"]

HELDOUT_NONFACE_START = 1 << 32  # non-face indices from here on are never used for training


def check_images(images: np.ndarray, what: str) -> None:
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"{what} must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    if min(images.shape[1:3]) < 8:
        raise DataError(f"{what} are {images.shape[1]}×{images.shape[2]} pixels; need face crops of at least 8×8")


def check_landmarks(landmarks: np.ndarray, images: np.ndarray, what: str) -> np.ndarray:
    """Pixel landmarks (N, 5, 2) inside the images; returns float32. Raises DataError naming the rows."""
    n, h, w = images.shape[:3]
    landmarks = np.asarray(landmarks, dtype=np.float32)
    if landmarks.shape != (n, 5, 2):
        raise DataError(f"{what} must have shape ({n}, 5, 2) (pixel x, y per image, ArcFace order), got "
                        f"{landmarks.shape}")
    bad = np.flatnonzero(~np.isfinite(landmarks).all(axis=(1, 2)))
    if bad.size:
        raise DataError(f"{what}: {bad.size} of {n} faces have NaN/inf landmarks (e.g. rows {bad[:5].tolist()}); "
                        "drop those faces before training")
    if n and max(h, w) >= 16 and np.abs(landmarks).max() <= 1.5:
        raise DataError(f"{what} all lie within 1.5 px of the origin of {h}×{w} images: they look normalised to "
                        "[0, 1]; pass pixel coordinates (x = u·W − 0.5)")
    x, y = landmarks[..., 0], landmarks[..., 1]
    outside = np.flatnonzero(((x < -0.5) | (x > w - 0.5) | (y < -0.5) | (y > h - 0.5)).any(axis=1))
    if outside.size:
        raise DataError(f"{what}: {outside.size} of {n} faces have landmarks outside the {h}×{w} image (e.g. "
                        f"rows {outside[:5].tolist()}); crop the faces with padding so all 5 points are inside, or "
                        "drop them")
    return landmarks


def prepare_crops(images: np.ndarray, landmarks: np.ndarray, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (N, size, size, 3)-resized tensor (N, 3, S, S) and normalised landmarks (N, 5, 2)."""
    h, w = images.shape[1:3]
    chunks = []
    for i in range(0, len(images), 256):
        x = torch.from_numpy(np.ascontiguousarray(images[i : i + 256])).permute(0, 3, 1, 2)
        chunks.append(resize_images(x, size).round().clamp(0, 255).to(torch.uint8))
    x = torch.cat(chunks) if chunks else torch.zeros((0, 3, size, size), dtype=torch.uint8)
    return x.contiguous(), torch.from_numpy(to_normalised(landmarks, w, h))


class AlignerBatches(Dataset):
    """Whole training batches keyed by ``(epoch, step)``: ``faces_per_batch`` faces in the (seed, epoch) order,
    then ``nonfaces_per_batch`` non-face crops in the (seed, 11, epoch) order → (uint8 crops (B, 3, S, S),
    normalised landmarks (B, 5, 2); the non-faces get a placeholder that is never a target)."""

    def __init__(self, faces: torch.Tensor, landmarks: torch.Tensor, negatives: torch.Tensor, faces_per_batch: int,
                 nonfaces_per_batch: int, seed: int) -> None:
        self.faces, self.landmarks, self.negatives = faces, landmarks, negatives
        self.per_batch, self.n_neg, self.seed = faces_per_batch, nonfaces_per_batch, seed
        self.placeholder = torch.full((nonfaces_per_batch, 5, 2), 0.5)
        self._orders: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def orders(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._orders is None or self._orders[0] != epoch:
            faces = np.random.default_rng([self.seed, epoch]).permutation(len(self.faces))
            negatives = np.random.default_rng([self.seed, 11, epoch]).permutation(len(self.negatives))
            self._orders = (epoch, torch.from_numpy(faces), torch.from_numpy(negatives))
        return self._orders[1], self._orders[2]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = key
        order, neg_order = self.orders(epoch)
        idx = order[i * self.per_batch : (i + 1) * self.per_batch]
        x, y = self.faces[idx], self.landmarks[idx]
        if self.n_neg:
            x = torch.cat([x, self.negatives[neg_order[i * self.n_neg : (i + 1) * self.n_neg]]])
            y = torch.cat([y, self.placeholder])
        return x, y


def nonface_crops(seed: int, start: int, count: int, size: int, progress: bool = False) -> np.ndarray:
    """``count`` non-face crops ``render_nonface(seed, start + j, size)``, uint8 (count, size, size, 3).

    Training draws indices from 0 up; held-out evaluation crops start at :data:`HELDOUT_NONFACE_START`.
    """
    chunks, step = [], 64
    for i in tqdm(range(0, count, step), desc="non-face crops", unit="chunk", disable=not progress, leave=False):
        chunks.append(render_nonfaces(seed, range(start + i, start + min(count, i + step)), size))
    return np.concatenate(chunks) if chunks else np.zeros((0, size, size, 3), np.uint8)
