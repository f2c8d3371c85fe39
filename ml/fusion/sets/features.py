"""Per-image features and CAFace styles of a backbone, computed once for every fusion method, probe size or
shuffle compared (``features_and_styles``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ml.errors import ConfigError, DataError
from ml.fr.backbones import input_contract
from ml.train.augment import flip_keypoints


def _forward(model: nn.Module, x: torch.Tensor, k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x, return_styles=True) if k is None else model(x, k, return_styles=True)
    return out[0], out[1]


@torch.no_grad()
def features_and_styles(
    model: nn.Module,
    images: np.ndarray,
    *,
    keypoints: np.ndarray | None = None,
    batch_size: int = 256,
    flip: bool = False,
    progress: bool = False,
    resize: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Unnormalised features (N, D) and CAFace styles (N, style_dim, 2), float32, of uint8 RGB ``images``
    (N, S, S, 3), in eval mode.

    ``model`` is a backbone whose ``input_contract`` declares ``style_dim`` and whose forward takes
    ``return_styles=True`` (ViT, KP-RPE ViT, IResNet). KP-RPE models also need ``keypoints`` (N, 5, 2) pixel
    landmarks (ignored for the others). With ``flip``: features ``f(x) + f(flip x)`` and styles
    ``(Γ(x) + Γ(flip x))/2`` (the flipped pass gets mirrored, left/right-swapped landmarks). A non-finite
    output raises ``DataError`` naming the first such image. The model's train/eval mode is restored. Images of
    another side than the model's are an error unless ``resize``: then each batch is resized (antialiased bilinear,
    as ``tasks.train_generator.resize_faces``) and its landmarks scaled, e.g. 64-px faces for a 112-px pretrained
    recogniser.
    """
    # ml.fr.train imports Lightning (seconds); only this function needs it.
    from ml.fr.train import check_keypoints, images_to_tensor, needs_keypoints

    contract = input_contract(model)
    name = type(model).__name__
    if "style_dim" not in contract:
        raise ConfigError(
            f"{name} declares no 'style_dim' in its input_contract, so it cannot return CAFace styles; use a "
            "ViT, KP-RPE ViT or IResNet backbone (forward(x, return_styles=True))"
        )
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        desc = f"{type(images).__name__} {getattr(images, 'dtype', '')} {getattr(images, 'shape', '')}"
        raise DataError(f"images must be a uint8 numpy array (N, H, W, 3) RGB, got {desc}")
    size = int(contract["size"])
    if images.shape[1] != images.shape[2]:
        raise DataError(f"images must be square, got {images.shape[1]}×{images.shape[2]}")
    if images.shape[1:3] != (size, size) and not resize:
        raise DataError(
            f"{name} expects {size}×{size} images (its input contract), got {images.shape[1]}×{images.shape[2]}; "
            "align/resize them first"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = images.shape[0]
    kp = check_keypoints(keypoints, n, name) if needs_keypoints(model) else None
    style_dim = int(contract["style_dim"])
    if n == 0:
        return np.zeros((0, int(contract["embedding_dim"])), np.float32), np.zeros((0, style_dim, 2), np.float32)

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    feats: list[np.ndarray] = []
    styles: list[np.ndarray] = []
    try:
        for lo in tqdm(range(0, n, batch_size), desc="features+styles", disable=not progress, leave=False):
            x = images_to_tensor(images[lo : lo + batch_size], contract).to(device)  # (b, 3, H, H)
            k = None if kp is None else torch.from_numpy(kp[lo : lo + batch_size]).to(device)  # (b, 5, 2)
            if x.shape[-1] != size:  # (b, 3, S, S) at the model's side
                k = None if k is None else k * (size / x.shape[-1])
                x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True,
                                                    align_corners=False)
            f, s = _forward(model, x, k)  # (b, D), (b, style_dim, 2)
            if flip:
                f2, s2 = _forward(model, x.flip(3), None if k is None else flip_keypoints(k, size))
                f, s = f + f2, (s + s2) / 2
            feats.append(f.float().cpu().numpy())
            styles.append(s.float().cpu().numpy())
    finally:
        model.train(was_training)
    features, style_arr = np.concatenate(feats), np.concatenate(styles)
    if style_arr.shape[1:] != (style_dim, 2):
        raise ConfigError(f"{name} returned styles {style_arr.shape[1:]} but its contract says ({style_dim}, 2)")
    for what, arr in (("features", features), ("styles", style_arr)):
        bad = np.flatnonzero(~np.isfinite(arr.reshape(n, -1)).all(axis=1))
        if bad.size:
            raise DataError(
                f"{name} produced non-finite {what} for image {int(bad[0])} ({bad.size} images); check the weights "
                "(an untrained full-width IResNet overflows in eval mode) and the input images"
            )
    return features, style_arr
