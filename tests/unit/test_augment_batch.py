"""The KP-RPE recipe works on each image alone and never writes into the caller's batch (it augments a copy in
place, op by op)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ml.train.augment import DRAW_SIZE, AugmentConfig, augment_with

pytestmark = pytest.mark.usefixtures("one_thread")

EVERYTHING = AugmentConfig(flip_prob=0.5, blur_prob=0.5, cutout_prob=0.5, brightness_prob=0.5, contrast_prob=0.5,
                           saturation_prob=0.5, randaug_prob=0.7, randaug_ops=3, cutout_fill="mean")


@pytest.mark.parametrize("cfg", [AugmentConfig(), EVERYTHING], ids=["default", "every-op"])
def test_each_image_is_augmented_alone_and_the_input_is_left_alone(cfg):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(9, 3, 48, 48, generator=g)
    keypoints = torch.rand(9, 5, 2, generator=g) * 40 + 4
    u = torch.rand(9, DRAW_SIZE, generator=g)
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
