"""KP-RPE augmentation recipe: landmarks follow the geometry, flips swap left and right, the photometric ops
leave landmarks alone, RandAugment's ops match their formulas, and everything is a function of the generator's
seed through one fixed-size draw."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ml.config import from_mapping
from ml.errors import ConfigError
from ml.train.augment import (
    DRAW_SIZE,
    FLIP_LANDMARK_ORDER,
    GEOMETRIC_OPS,
    RANDAUG_MAX_OPS,
    RANDAUG_OPS,
    AugmentConfig,
    affine,
    augment_kprpe,
    augment_with,
    flip_keypoints,
    posterize_bits,
    randaug_choices,
    solarize_threshold,
)
from ml.train.image_ops import (
    autocontrast,
    cutout,
    enhance,
    equalize,
    gaussian_blur,
    photometric,
    posterize,
    smooth,
    solarize,
)
from ml.fr.train import FRConfig

REPO = Path(__file__).resolve().parents[2]

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


# ---------------------------------------------------------------- RandAugment
SLOTS = DRAW_SIZE - 2 * RANDAUG_MAX_OPS  # first (op, sign) column; the column before it switches RandAug on
MAGNITUDE_FREE = ("AutoContrast", "Equalize")


def _randaug_cfg(**overrides) -> AugmentConfig:
    """Only RandAug on (every sample), the fixed recipe off."""
    return AugmentConfig(**{**OFF, "randaug_prob": 1.0, **overrides})


def _forced(b: int, ops: list[str], signs: list[int], base: dict[int, float] | None = None) -> torch.Tensor:
    """A draw (b, DRAW_SIZE) choosing ``ops`` with ``signs`` in RandAug's slots; ``base`` sets other columns."""
    u = torch.full((b, DRAW_SIZE), 0.5)
    u[:, SLOTS - 1] = 0.0  # RandAug drawn
    for k, (name, sign) in enumerate(zip(ops, signs)):
        u[:, SLOTS + 2 * k] = (RANDAUG_OPS.index(name) + 0.5) / len(RANDAUG_OPS)
        u[:, SLOTS + 2 * k + 1] = 0.25 if sign < 0 else 0.75
    for column, value in (base or {}).items():
        u[:, column] = value
    return u


def _texture(b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8-level images in [0, 1] with the dot landmarks."""
    _, kp = _dots(b)
    levels = torch.randint(0, 256, (b, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(5))
    return levels.float() / 255.0, kp


def _blobs(kp: torch.Tensor, sigma: float = 1.2) -> torch.Tensor:
    """Image i (of K = 5): black with one Gaussian blob centred (sub-pixel) at landmark i of sample i."""
    k = kp.shape[1]
    ys = torch.arange(SIZE, dtype=torch.float64).view(1, SIZE, 1)
    xs = torch.arange(SIZE, dtype=torch.float64).view(1, 1, SIZE)
    centres = kp[torch.arange(k), torch.arange(k)].double()  # (K, 2)
    d2 = (xs - centres[:, 0].view(k, 1, 1)) ** 2 + (ys - centres[:, 1].view(k, 1, 1)) ** 2
    return torch.exp(-d2 / (2 * sigma**2)).unsqueeze(1).expand(k, 3, SIZE, SIZE).clone()


def _centroids(x: torch.Tensor) -> torch.Tensor:
    """Intensity centroid (K, 2) in pixel (x, y) of each image's first channel."""
    w = x[:, 0].double()
    ys, xs = torch.meshgrid(torch.arange(SIZE, dtype=torch.float64), torch.arange(SIZE, dtype=torch.float64),
                            indexing="ij")
    mass = w.sum(dim=(1, 2))
    return torch.stack([(w * xs).sum(dim=(1, 2)) / mass, (w * ys).sum(dim=(1, 2)) / mass], dim=1)


@pytest.mark.parametrize("name", [n for n in RANDAUG_OPS if n not in MAGNITUDE_FREE])
@pytest.mark.parametrize("sign", [-1, 1])
def test_randaug_magnitude_zero_leaves_images_and_landmarks_alone(name, sign):
    x, kp = _texture()
    for slots in (1, RANDAUG_MAX_OPS):  # the op in one slot, and in every slot
        u = _forced(len(x), [name] * slots, [sign] * slots)
        out, moved = augment_with(x, kp, _randaug_cfg(randaug_ops=slots, randaug_magnitude=0), u)
        assert torch.equal(out, x) and torch.equal(moved, kp), name


@pytest.mark.parametrize("name", MAGNITUDE_FREE)
def test_autocontrast_and_equalize_take_no_magnitude(name):
    x, kp = _texture()
    x = 0.3 + 0.2 * x  # low contrast: both ops stretch it
    outs = [augment_with(x, kp, _randaug_cfg(randaug_ops=1, randaug_magnitude=m), _forced(len(x), [name], [1]))
            for m in (0, 14, 30)]
    assert not torch.allclose(outs[0][0], x, atol=0.05)
    for out, moved in outs:
        assert torch.equal(out, outs[0][0]) and torch.equal(moved, kp)


def _expected_geometry(name: str, sign: int, magnitude: int, kp: torch.Tensor) -> torch.Tensor:
    """Where a geometric op sends pixel landmarks, from its formula about the centre (S − 1)/2."""
    level, c = magnitude / 30, (SIZE - 1) / 2
    x, y = kp[..., 0] - c, kp[..., 1] - c
    if name == "Rotate":
        a = sign * math.radians(30 * level)
        x, y = math.cos(a) * x - math.sin(a) * y, math.sin(a) * x + math.cos(a) * y
    elif name == "ShearX":
        x = x + sign * 0.3 * level * y
    elif name == "ShearY":
        y = y + sign * 0.3 * level * x
    elif name == "TranslateX":
        x = x + sign * (150 / 331) * level * SIZE
    elif name == "TranslateY":
        y = y + sign * (150 / 331) * level * SIZE
    return torch.stack([x + c, y + c], dim=-1)


@pytest.mark.parametrize("name", GEOMETRIC_OPS)
@pytest.mark.parametrize("sign", [-1, 1])
def test_randaug_geometric_ops_move_landmarks_exactly_as_the_content(name, sign):
    _, kp = _dots(5)
    x = _blobs(kp)
    out, moved = augment_with(x, kp, _randaug_cfg(randaug_ops=1, randaug_magnitude=20), _forced(5, [name], [sign]))
    torch.testing.assert_close(moved, _expected_geometry(name, sign, 20, kp), atol=1e-4, rtol=0)
    assert (moved - kp).norm(dim=-1).max() > 1.0  # the op moved something by far more than the tolerance
    torch.testing.assert_close(_centroids(out), moved[torch.arange(5), torch.arange(5)].double(), atol=0.25, rtol=0)


def test_randaug_geometry_composes_with_flip_scale_rotation_translation():
    cfg = AugmentConfig(**{**OFF, "flip_prob": 1.0, "scale_prob": 1.0, "rotate_prob": 1.0, "translate_prob": 1.0,
                           "max_translate": 0.05, "randaug_prob": 1.0, "randaug_ops": 4, "randaug_magnitude": 10})
    _, kp = _dots(5)
    x = _blobs(kp)
    # scale 1.06, rotation +12°, shift (+0.02, −0.02) of the side; then Rotate+, ShearX−, TranslateY+, ShearY+
    base = {0: 0.0, 1: 0.0, 2: 0.8, 3: 0.0, 4: 0.8, 5: 0.0, 6: 0.7, 7: 0.3}
    u = _forced(5, ["Rotate", "ShearX", "TranslateY", "ShearY"], [1, -1, 1, 1], base)
    out, moved = augment_with(x, kp, cfg, u)
    # sample i's blob is its landmark i, which the flip relabels as landmark FLIP_LANDMARK_ORDER.index(i)
    slot = torch.tensor([FLIP_LANDMARK_ORDER.index(i) for i in range(5)])
    where = moved[torch.arange(5), slot].double()
    assert where.min() > 5 and where.max() < SIZE - 6  # blobs whole inside the image
    assert (where - kp[torch.arange(5), torch.arange(5)]).norm(dim=-1).min() > 3.0
    torch.testing.assert_close(_centroids(out), where, atol=0.25, rtol=0)
    # the same forward map by hand: flip, scale, rotate, shift, then the four RandAug ops in slot order
    c = (SIZE - 1) / 2
    p = torch.stack([(SIZE - 1) - kp[..., 0], kp[..., 1]], dim=-1)
    p = (p - c) * 1.06
    a = math.radians(20 * (2 * 0.8 - 1))
    p = torch.stack([math.cos(a) * p[..., 0] - math.sin(a) * p[..., 1],
                     math.sin(a) * p[..., 0] + math.cos(a) * p[..., 1]], dim=-1)
    p = p + torch.tensor([2 * 0.7 - 1, 2 * 0.3 - 1]) * 0.05 * 2 * SIZE / 2 + c
    for name, sign in (("Rotate", 1), ("ShearX", -1), ("TranslateY", 1), ("ShearY", 1)):
        p = _expected_geometry(name, sign, 10, p)
    torch.testing.assert_close(moved, p[:, list(FLIP_LANDMARK_ORDER)], atol=1e-3, rtol=0)


def test_draw_has_one_fixed_size_whatever_the_config():
    x, kp = _texture(6)
    configs = [AugmentConfig(**OFF), AugmentConfig(), _randaug_cfg(randaug_ops=0),
               AugmentConfig(**{k: 1.0 for k in OFF}, randaug_prob=1.0, randaug_ops=RANDAUG_MAX_OPS)]
    reference = torch.Generator().manual_seed(11)
    torch.rand(len(x), DRAW_SIZE, generator=reference)
    for cfg in configs:
        gen = torch.Generator().manual_seed(11)
        augment_kprpe(x, kp, cfg, generator=gen)
        assert torch.equal(gen.get_state(), reference.get_state()), cfg
    cfg = configs[-1]
    gen = torch.Generator().manual_seed(4)
    state = gen.get_state()
    a = augment_kprpe(x, kp, cfg, generator=gen)
    gen.set_state(state)
    b = augment_kprpe(x, kp, cfg, generator=gen)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], augment_kprpe(x, kp, cfg, generator=gen)[0])  # the state moved on


def test_randaug_choices_are_uniform_over_the_ops_and_off_where_not_drawn():
    u = torch.rand(7000, DRAW_SIZE, generator=torch.Generator().manual_seed(0))
    ops, signs = randaug_choices(u, AugmentConfig(randaug_prob=0.5, randaug_ops=2))
    assert ops.shape == signs.shape == (7000, 2)
    on = u[:, SLOTS - 1] < 0.5
    assert (ops[~on] == RANDAUG_OPS.index("Identity")).all()
    counts = torch.bincount(ops[on].flatten(), minlength=len(RANDAUG_OPS)).float()
    expected = 2 * on.sum() / len(RANDAUG_OPS)  # ≈ 500 per op; binomial sd ≈ 22
    assert ((counts - expected).abs() < 100).all(), counts
    assert set(signs.unique().tolist()) == {-1.0, 1.0}


def test_solarize_posterize_autocontrast_by_hand():
    x = torch.tensor([0.1, 0.5, 0.6, 1.0]).view(1, 1, 2, 2)
    torch.testing.assert_close(solarize(x, 0.55).flatten(), torch.tensor([0.1, 0.5, 0.4, 0.0]))
    assert torch.equal(solarize(x, solarize_threshold(0)), x)
    assert solarize_threshold(14) == pytest.approx(1 - 14 / 30)
    assert [posterize_bits(m) for m in (0, 3, 4, 14, 30)] == [8, 8, 7, 6, 4]
    levels = torch.tensor([0.0, 37.0, 128.0, 255.0, 201.0, 3.0]).view(1, 1, 2, 3)
    x = levels / 255
    assert torch.equal(posterize(x, 6), torch.tensor([0.0, 36, 128, 252, 200, 0]).view(1, 1, 2, 3) / 255)
    assert torch.equal(posterize(x, 4), torch.tensor([0.0, 32, 128, 240, 192, 0]).view(1, 1, 2, 3) / 255)
    assert torch.equal(posterize(x, 8), x)
    rgb = torch.tensor([[0.2, 0.4, 0.6], [0.5, 0.5, 0.5], [0.0, 0.25, 1.0]]).view(1, 3, 1, 3)
    expected = torch.tensor([[0.0, 0.5, 1.0], [0.5, 0.5, 0.5], [0.0, 0.25, 1.0]]).view(1, 3, 1, 3)
    torch.testing.assert_close(autocontrast(rgb), expected)  # per channel; flat and full-range channels kept


def test_equalize_by_hand_and_against_pil():
    levels = torch.cat([torch.full((256,), 50), torch.full((512,), 60), torch.full((256,), 70)])
    x = (levels.float() / 255).view(1, 1, 32, 32)
    # step = ⌊(1024 − 256)/255⌋ = 3: level 50 → ⌊1/3⌋ = 0, 60 → ⌊(1 + 256)/3⌋ = 85,
    # 70 → min(255, ⌊(1 + 768)/3⌋) = 255
    torch.testing.assert_close(equalize(x).flatten().unique() * 255, torch.tensor([0.0, 85.0, 255.0]))
    few = torch.tensor([0.0, 0.5, 1.0, 0.5]).view(1, 1, 2, 2)
    assert torch.equal(equalize(few), few)  # step 0: too few pixels, unchanged
    image = pytest.importorskip("PIL.Image")
    ops = pytest.importorskip("PIL.ImageOps")
    g = torch.Generator().manual_seed(2)
    rgb = torch.randint(0, 120, (24, 20, 3), generator=g) + torch.randint(0, 60, (24, 1, 1), generator=g)
    rgb = rgb.to(torch.uint8)  # rows of varying brightness, 120 levels wide
    ours = equalize(rgb.permute(2, 0, 1).unsqueeze(0).float() / 255)
    theirs = torch.from_numpy(np.array(ops.equalize(image.fromarray(rgb.numpy()))))
    assert torch.equal((ours[0].permute(1, 2, 0) * 255).round().to(torch.uint8), theirs)


def test_enhance_ops():
    x, _ = _texture(2)
    ones = torch.ones(2)
    assert torch.equal(enhance(x, smooth(x), ones), x)  # factor 1: exactly the image
    torch.testing.assert_close(enhance(x, smooth(x), torch.zeros(2)), smooth(x))  # factor 0: the degenerate
    smoothed = smooth(x)
    assert torch.equal(smoothed[..., 0, :], x[..., 0, :]) and torch.equal(smoothed[..., :, -1], x[..., :, -1])
    torch.testing.assert_close(smoothed[0, 0, 1, 1], (x[0, 0, :3, :3].sum() + 4 * x[0, 0, 1, 1]) / 13)
    sharper = enhance(x, smoothed, torch.full((2,), 1.9))
    assert _detail(sharper) > _detail(x) and sharper.min() >= 0 and sharper.max() <= 1


def _detail(y: torch.Tensor) -> torch.Tensor:
    """Mean |image − smoothed image| inside the border: high-frequency content."""
    return (y[..., 1:-1, 1:-1] - smooth(y)[..., 1:-1, 1:-1]).abs().mean()


@pytest.mark.parametrize("padding_mode", ["zeros", "reflection"])
def test_strongest_randaug_stays_in_range_and_finite(padding_mode):
    cfg = AugmentConfig(**{k: 1.0 for k in OFF}, padding_mode=padding_mode, randaug_prob=1.0,
                        randaug_ops=RANDAUG_MAX_OPS, randaug_magnitude=30)
    x, kp = _texture(32)
    x[:4] = 0.0  # flat black and white images: AutoContrast/Equalize/Contrast must not divide by zero
    x[4:8] = 1.0
    for seed in range(3):
        out, moved = augment_kprpe(x, kp, cfg, generator=torch.Generator().manual_seed(seed))
        assert torch.isfinite(out).all() and torch.isfinite(moved).all()
        assert out.min() >= 0.0 and out.max() <= 1.0


def test_randaug_config_is_validated_and_read_from_params():
    for key, bad in (("randaug_magnitude", 31), ("randaug_magnitude", -1), ("randaug_magnitude", 14.5),
                     ("randaug_magnitude", True), ("randaug_ops", RANDAUG_MAX_OPS + 1), ("randaug_ops", -1),
                     ("randaug_prob", 1.5)):
        with pytest.raises(ConfigError, match=rf"fr\.augmentation\.{key}"):
            AugmentConfig(**{key: bad})
    with pytest.raises(ConfigError, match=r"fr\.augmentation\.randaug_magnitude"):
        from_mapping(FRConfig, {"augmentation": {"randaug_magnitude": 14.5}}, "fr")
    assert AugmentConfig().randaug_prob == 0.0 and AugmentConfig().randaug_magnitude == 14  # paper: 14/31
    block = yaml.safe_load((REPO / "params.yaml").read_text())["fr"]["augmentation"]
    cfg = from_mapping(FRConfig, {"augmentation": block}, "fr").augmentation
    assert (cfg.randaug_prob, cfg.randaug_ops, cfg.randaug_magnitude) == (0.5, 2, 14)
