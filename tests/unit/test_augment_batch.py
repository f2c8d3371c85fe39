"""The KP-RPE recipe works on each image alone and never writes into the caller's batch (it augments a copy in
place, op by op)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ml.train import augment
from ml.train.augment import DRAW_SIZE, AugmentConfig, augment_with

pytestmark = pytest.mark.usefixtures("one_thread")

EVERYTHING = AugmentConfig(flip_prob=0.5, blur_prob=0.5, cutout_prob=0.5, brightness_prob=0.5, contrast_prob=0.5,
                           saturation_prob=0.5, randaug_prob=0.7, randaug_ops=3, cutout_fill="mean")


def _draw(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n images (48 px) in [0, 1], their pixel landmarks and one uniform draw per image."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 48, 48, generator=g), torch.rand(n, 5, 2, generator=g) * 40 + 4,
            torch.rand(n, DRAW_SIZE, generator=g))


@pytest.mark.parametrize("cfg", [AugmentConfig(), EVERYTHING], ids=["default", "every-op"])
def test_each_image_is_augmented_alone_and_the_input_is_left_alone(cfg):
    x, keypoints, u = _draw(9, seed=3)
    before, kp_before = x.clone(), keypoints.clone()
    out, kp = augment_with(x, keypoints, cfg, u)
    assert torch.equal(x, before) and torch.equal(keypoints, kp_before)
    assert not torch.equal(out, x)
    # a row's result does not depend on which other rows share its batch (blur aside: its kernel reaches 3σ of
    # the batch's largest σ, so a batch of one truncates it sooner)
    cfg = dataclasses.replace(cfg, blur_prob=0.0)
    out, kp = augment_with(x, keypoints, cfg, u)
    for i in range(9):
        alone, kp_alone = augment_with(x[i:i + 1], keypoints[i:i + 1], cfg, u[i:i + 1])
        torch.testing.assert_close(out[i:i + 1], alone, atol=1e-6, rtol=0)
        torch.testing.assert_close(kp[i:i + 1], kp_alone)
    # ops drawn for some rows only: those rows change, the others and the caller's batch do not
    some = torch.full((9, DRAW_SIZE), 0.99)  # above every probability: nothing drawn
    some[:3, 0] = 0.0  # flip rows 0–2
    some[3:5, 8] = 0.0  # brighten rows 3–4
    part, _ = augment_with(x, None, cfg, some)
    assert torch.equal(x, before)
    assert torch.equal(part[5:], x[5:]) and not torch.equal(part[:5], x[:5])
    torch.testing.assert_close(part[:3], x[:3].flip(3))
    # every row drawn: the batch is replaced as a whole, still without touching the input
    out_all, _ = augment_with(x, None, cfg, torch.zeros(9, DRAW_SIZE))
    assert torch.equal(x, before) and not torch.equal(out_all, x)


@pytest.mark.parametrize("cfg", [AugmentConfig(), EVERYTHING], ids=["default", "every-op"])
def test_the_dense_path_gives_the_sparse_paths_values_without_reading_masks_back(cfg, monkeypatch):
    """On an accelerator every op runs on the whole batch and keeps the drawn rows (no mask is read back to find
    them); run on the CPU here, it must give the sparse path's values, blur aside (its kernel then reaches 3σ of
    the range's top rather than of the batch's largest σ: within the 0.3 % of mass beyond 3σ)."""
    x, keypoints, u = _draw(16, seed=5)
    before, kp_before = x.clone(), keypoints.clone()
    sparse, kp_sparse = augment_with(x, keypoints, cfg, u)
    monkeypatch.setattr(augment, "SPARSE_DEVICES", ())
    calls = []
    real_nonzero = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: calls.append(1) or real_nonzero(self, *a, **k))
    dense, kp_dense = augment_with(x, keypoints, cfg, u)
    assert not calls, "the dense path looked up rows"
    assert torch.equal(x, before) and torch.equal(keypoints, kp_before)
    blurred = u[:, 14] < cfg.blur_prob
    torch.testing.assert_close(dense[~blurred], sparse[~blurred], atol=1e-6, rtol=0)
    torch.testing.assert_close(dense[blurred], sparse[blurred], atol=5e-3, rtol=0)
    torch.testing.assert_close(kp_dense, kp_sparse, atol=1e-5, rtol=0)
    assert not torch.equal(dense, x)
