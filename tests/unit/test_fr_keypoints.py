"""KP-RPE in training and embedding: landmarks follow the augmentation, flips swap left and right,
and a keypoint backbone without keypoints is a clear error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ml.data.procedural import ProceduralFaces
from ml.errors import ConfigError, DataError
from ml.fr.backbones import build_backbone
from ml.fr.train import FLIP_LANDMARK_ORDER, FRConfig, augment_batch, embed, flip_keypoints, images_to_tensor, train_fr

COLOURS = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 1.0, 0], [0, 1.0, 1.0]])


def _dots(b: int = 16, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Black images with a 5×5 coloured square at each of 5 landmarks (left points on the image left)."""
    kp = torch.tensor([[22.0, 26.0], [42.0, 26.0], [32.0, 36.0], [24.0, 46.0], [40.0, 46.0]]).expand(b, 5, 2).clone()
    x = torch.zeros(b, 3, size, size)
    for j, (cx, cy) in enumerate(kp[0].round().long().tolist()):
        x[:, :, cy - 2 : cy + 3, cx - 2 : cx + 3] = COLOURS[j].view(1, 3, 1, 1)
    return x, kp


def test_augmented_landmarks_land_on_the_moved_features():
    torch.manual_seed(0)
    x, kp = _dots()
    out, moved = augment_batch(x, keypoints=kp)
    flipped_any = False
    for i in range(len(out)):
        # ArcFace order survives the flip: the left eye is still on the image left
        assert moved[i, 0, 0] < moved[i, 1, 0] and moved[i, 3, 0] < moved[i, 4, 0]
        px = moved[i].round().long()
        colours = torch.stack([out[i, :, y, xx] for xx, y in px.tolist()])
        same = torch.allclose(colours, COLOURS, atol=0.15)
        swapped = torch.allclose(colours, COLOURS[list(FLIP_LANDMARK_ORDER)], atol=0.15)
        assert same or swapped, (i, colours)
        flipped_any |= swapped
    assert flipped_any  # 16 samples at p=0.5: the flip branch was exercised


def test_flip_keypoints_mirror_and_swap():
    kp = torch.tensor([[[20.0, 30.0], [44.0, 30.0], [32.0, 40.0], [24.0, 50.0], [40.0, 50.0]]])
    f = flip_keypoints(kp, 64)
    assert torch.equal(f[0, 0], torch.tensor([63 - 44.0, 30.0]))  # new left eye = mirrored right eye
    assert torch.equal(flip_keypoints(f, 64), kp)


def _faces(n_ids: int = 4, per_id: int = 8):
    gen = ProceduralFaces(seed=1)
    samples = [gen.sample(i, j) for i in range(n_ids) for j in range(per_id)]
    images = np.stack([s.image for s in samples])
    kp = np.stack([s.landmarks for s in samples]).astype(np.float32)
    return images, np.repeat(np.arange(n_ids), per_id), kp


def test_kprpe_training_uses_keypoints_and_refuses_without():
    images, labels, kp = _faces()
    cfg = FRConfig(backbone="vit_tiny_kprpe", epochs=2, batch_size=16)
    with pytest.raises(DataError, match="needs 5 landmarks"):
        train_fr(cfg, images, labels, progress=False, backbone_overrides={"depth": 1})
    bad = kp.copy()
    bad[3] = np.nan
    with pytest.raises(DataError, match="rows \\[3\\]"):
        train_fr(cfg, images, labels, keypoints=bad, progress=False, backbone_overrides={"depth": 1})
    result = train_fr(cfg, images, labels, keypoints=kp, progress=False, backbone_overrides={"depth": 1})
    table = result.model.kprpe.linear.weight
    assert table.abs().sum() > 0  # the zero-initialised keypoint table received gradient steps
    feats = embed(result.model, images[:4], keypoints=kp[:4])
    assert feats.shape == (4, 128) and np.isfinite(feats).all()


def test_keypoint_map_learns_at_its_own_rate():
    """fr.keypoint_lr_scale puts the zero-initialised keypoint map in its own optimiser group at that multiple of
    the lr: after the same steps (same seed, same batches) it has moved further than at scale 1, and the rest of
    the backbone's first update is unchanged by it."""
    images, labels, kp = _faces()
    cfg = FRConfig(backbone="vit_tiny_kprpe", epochs=1, batch_size=16, augment=False, warmup_epochs=0.0)
    moved = {}
    for scale in (1.0, 10.0):
        result = train_fr(dataclasses.replace(cfg, keypoint_lr_scale=scale), images, labels, keypoints=kp,
                       progress=False, backbone_overrides={"depth": 1})
        moved[scale] = float(result.model.kprpe.linear.weight.detach().abs().sum())
    assert moved[10.0] > 3.0 * moved[1.0] > 0.0
    with pytest.raises(ConfigError, match="keypoint_lr_scale"):
        FRConfig(keypoint_lr_scale=0.0)


def test_embed_flip_passes_flipped_keypoints():
    images, _, kp = _faces(1, 3)
    model = build_backbone("vit_tiny_kprpe", depth=1).eval()
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)  # make the keypoint path matter
    x = images_to_tensor(images)
    k = torch.from_numpy(kp)
    with torch.no_grad():
        expected = model(x, k) + model(x.flip(3), flip_keypoints(k, 64))
        wrong = model(x, k) + model(x.flip(3), k)
    got = embed(model, images, keypoints=kp)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, wrong.numpy(), atol=1e-4)
    with pytest.raises(DataError, match="needs 5 landmarks"):
        embed(model, images)
