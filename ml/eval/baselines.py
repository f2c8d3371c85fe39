"""Reference embeddings that need no trained network, to show how hard a benchmark is.

- ``raw_pixels``: the image itself, flattened and normalised ``(x/255 − 0.5)/0.5``, as the embedding.
- ``LinearProbe``: a linear softmax classifier on raw pixels trained on the *training* identities; its
  logit vector ``W·x + b`` (K-dimensional) is the embedding of a held-out face. This is the strongest
  purely linear function of the pixels the training labels can buy; a trained FR model should beat it
  by a wide margin on held-out identities, or the data is too easy.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def raw_pixels(images: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) uint8 → (N, H·W·3) float32 in [−1, 1]."""
    return (images.reshape(len(images), -1).astype(np.float32) / 255.0 - 0.5) / 0.5


class LinearProbe:
    """Multinomial logistic regression on raw pixels (AdamW, full passes over mini-batches)."""

    def __init__(self, epochs: int = 30, lr: float = 1e-3, weight_decay: float = 1e-4, batch_size: int = 256, seed: int = 0):
        self.epochs, self.lr, self.weight_decay, self.batch_size, self.seed = epochs, lr, weight_decay, batch_size, seed
        self.linear: nn.Linear | None = None

    def fit(self, images: np.ndarray, labels: np.ndarray) -> "LinearProbe":
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.from_numpy(raw_pixels(images))
        y = torch.from_numpy(np.array(labels, dtype=np.int64))  # a copy: manifests hand out read-only arrays
        k = int(y.max()) + 1
        torch.manual_seed(self.seed)
        self.linear = nn.Linear(x.shape[1], k)
        opt = torch.optim.AdamW(self.linear.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        for _ in range(self.epochs):
            for idx in torch.randperm(len(x), generator=gen).split(self.batch_size):
                loss = nn.functional.cross_entropy(self.linear(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        return self

    def accuracy(self, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.embed(images).argmax(1) == np.asarray(labels)).mean())

    @torch.no_grad()
    def embed(self, images: np.ndarray) -> np.ndarray:
        if self.linear is None:
            raise RuntimeError("LinearProbe.embed called before fit")
        return self.linear(torch.from_numpy(raw_pixels(images))).numpy()
