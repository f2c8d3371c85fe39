"""KP-RPE augmentation recipe: landmarks follow the geometry, flips swap left and right, the photometric ops
leave landmarks alone, and everything is a function of the generator's seed."""

from __future__ import annotations

import math

import pytest
import torch

from ml.config import from_mapping
from ml.errors import ConfigError
from ml.train.augment import (
    FLIP_LANDMARK_ORDER,
    AugmentConfig,
    affine,
    augment_kprpe,
    cutout,
    flip_keypoints,
    gaussian_blur,
    photometric,
)
from ml.train.fr import FRConfig

COLOURS = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 1.0, 0], [0, 1.0, 1.0]])
SIZE = 64
OFF = dict(flip_prob=0.0, scale_prob=0.0, translate_prob=0.0, rotate_prob=0.0, brightness_prob=0.0,
           contrast_prob=0.0, saturation_prob=0.0, blur_prob=0.0, cutout_prob=0.0)


def _dots(b: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Mid-grey images in [0, 1] with a 5×5 coloured square at each of 5 landmarks (left points on the left)."""
    kp = torch.tensor([[24.0, 26.0], [40.0, 26.0], [32.0, 34.0], [26.0, 42.0], [38.0, 42.0]]).expand(b, 5, 2).clone()
    x = torch.full((b, 3, SIZE, SIZE), 0.5)
    for j, (cx, cy) in enumerate(kp[0].round().long().tolist()):
        x[:, :, cy - 2 : cy + 3, cx - 2 : cx + 3] = COLOURS[j].view(1, 3, 1, 1)
    return x, kp


def _colours_at(img: torch.Tensor, kp: torch.Tensor) -> torch.Tensor:
    return torch.stack([img[:, y, x] for x, y in kp.round().long().tolist()])


def test_landmarks_follow_scale_rotation_translation_and_flip():
    cfg = AugmentConfig(**{**OFF, "flip_prob": 0.5, "scale_prob": 1.0, "rotate_prob": 1.0, "translate_prob": 1.0,
                           "scale_range": (0.85, 1.2), "max_rotate_deg": 30.0, "max_translate": 0.1})
    x, kp = _dots()
    out, moved = augment_kprpe(x, kp, cfg, generator=torch.Generator().manual_seed(3))
    assert not torch.allclose(moved, kp)
    flipped = 0
    for i in range(len(out)):
        assert moved[i, 0, 0] < moved[i, 1, 0] and moved[i, 3, 0] < moved[i, 4, 0]  # ArcFace order survives
        colours = _colours_at(out[i], moved[i])
        same = torch.allclose(colours, COLOURS, atol=0.1)
        swapped = torch.allclose(colours, COLOURS[list(FLIP_LANDMARK_ORDER)], atol=0.1)
        assert same or swapped, (i, colours)
        flipped += swapped
    assert 0 < flipped < len(out)


def test_quarter_turn_is_exact():
    x, kp = _dots(1)
    half_pi = torch.tensor([math.pi / 2])
    out, moved = affine(x, kp, torch.tensor([False]), torch.ones(1), half_pi, torch.zeros(1, 2))
    # about the centre (31.5, 31.5) with y down: (x, y) → (63 − y, x)
    expected = torch.stack([SIZE - 1 - kp[..., 1], kp[..., 0]], dim=-1)
    torch.testing.assert_close(moved, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(_colours_at(out[0], moved[0]), COLOURS, atol=1e-4, rtol=0)
    torch.testing.assert_close(out, torch.rot90(x, k=-1, dims=(2, 3)), atol=1e-4, rtol=0)  # pixel centres map exactly


def test_flip_mirrors_the_image_and_swaps_landmarks():
    x, kp = _dots(4)
    out, moved = augment_kprpe(x, kp, AugmentConfig(**{**OFF, "flip_prob": 1.0}), torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x.flip(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(moved, flip_keypoints(kp, SIZE), atol=1e-4, rtol=0)
    torch.testing.assert_close(_colours_at(out[0], moved[0]), COLOURS[list(FLIP_LANDMARK_ORDER)])


@pytest.mark.parametrize("op", ["brightness", "contrast", "saturation", "blur", "cutout"])
def test_photometric_blur_cutout_change_pixels_not_landmarks(op):
    cfg = AugmentConfig(**{**OFF, f"{op}_prob": 1.0, "cutout_area": (0.1, 0.2)})
    x, kp = _dots(8)
    x = (x + 0.2 * torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) - 0.1).clamp(0, 1)  # texture
    out, moved = augment_kprpe(x, kp, cfg, torch.Generator().manual_seed(0))
    assert torch.equal(moved, kp)
    assert not torch.allclose(out, x, atol=1e-3)
    assert out.min() >= 0.0 - 1e-6 and out.max() <= 1.0 + 1e-6


def test_everything_off_is_identity_and_no_keypoints_is_fine():
    x, kp = _dots(4)
    out, moved = augment_kprpe(x, kp, AugmentConfig(**OFF), torch.Generator().manual_seed(0))
    assert torch.equal(out, x) and torch.equal(moved, kp)
    out, none = augment_kprpe(x, None, AugmentConfig(), torch.Generator().manual_seed(0))
    assert none is None and out.shape == x.shape


def test_deterministic_under_a_seeded_generator():
    x, kp = _dots(16)
    a = augment_kprpe(x, kp, AugmentConfig(), torch.Generator().manual_seed(7))
    b = augment_kprpe(x, kp, AugmentConfig(), torch.Generator().manual_seed(7))
    c = augment_kprpe(x, kp, AugmentConfig(), torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_op_formulas():
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(2)
    torch.testing.assert_close(photometric(x, torch.full((2,), 0.5), ones, ones), x * 0.5)
    grey = photometric(x, ones, ones, torch.zeros(2))
    torch.testing.assert_close(grey[:, 0], grey[:, 1])  # saturation 0: every channel is the grey
    flat = photometric(x, ones, torch.zeros(2), ones)
    assert flat.std(dim=(2, 3)).max() < 1e-6  # contrast 0: one colour, the mean grey
    blurred = gaussian_blur(x, torch.tensor([0.8, 1.5]))
    assert blurred.std() < x.std()
    torch.testing.assert_close(blurred.mean(), x.mean(), atol=0.02, rtol=0)
    boxed = cutout(x, torch.tensor([[2.0, 2.0, 5.0, 6.0], [0.0, 0.0, 8.0, 1.0]]))
    assert (boxed[0, :, 2:6, 2:5] == 0).all() and torch.equal(boxed[0, :, 6:], x[0, :, 6:])
    assert (boxed[1, :, 0, :] == 0).all() and torch.equal(boxed[1, :, 1:], x[1, :, 1:])
    mean_fill = cutout(x, torch.tensor([[0.0, 0.0, 8.0, 8.0]] * 2), fill="mean")
    torch.testing.assert_close(mean_fill[:, :, 0, 0], x.mean(dim=(2, 3)))


def test_config_is_validated_and_nested_in_fr_params():
    with pytest.raises(ConfigError, match="blur_prob"):
        AugmentConfig(blur_prob=1.5)
    with pytest.raises(ConfigError, match="scale_range"):
        AugmentConfig(scale_range=(1.2, 0.8))
    with pytest.raises(ConfigError, match="cutout_fill"):
        AugmentConfig(cutout_fill="noise")
    section = {"augment_recipe": "kprpe", "augmentation": {"max_rotate_deg": 10, "blur_sigma": [1, 2]}}
    cfg = from_mapping(FRConfig, section, "fr")
    assert cfg.augmentation.max_rotate_deg == 10.0 and cfg.augmentation.blur_sigma == (1.0, 2.0)
    with pytest.raises(ConfigError, match=r"fr\.augmentation\.rotate"):
        from_mapping(FRConfig, {"augmentation": {"rotate": 10}}, "fr")
    assert AugmentConfig().max_rotate_deg == 20.0  # KP-RPE supplementary, Table 6
