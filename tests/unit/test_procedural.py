"""The procedural face generator: determinism, exact landmarks, quality, sequences, sizes, identities."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ml.data.procedural import (
    NUISANCE_KEYS,
    FaceSample,
    ProceduralConfig,
    ProceduralFaces,
    arcface_template,
    quality_score,
)
from ml.errors import ConfigError


@pytest.fixture(scope="module")
def gen112() -> ProceduralFaces:
    return ProceduralFaces(ProceduralConfig(image_size=112), seed=0)


def _rgb(p: dict, prefix: str, factor: float = 1.0) -> np.ndarray:
    return np.array([p[f"{prefix}_r"], p[f"{prefix}_g"], p[f"{prefix}_b"]]) * factor


def _pixel(img: np.ndarray, xy: np.ndarray) -> np.ndarray:
    x, y = np.rint(xy).astype(int)
    return img[y, x].astype(float)


def _dist_to_segment(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    t = np.clip(np.dot(c - a, b - a) / np.dot(b - a, b - a), 0.0, 1.0)
    return float(np.linalg.norm(c - (a + t * (b - a))))


# Nuisances with occluders, noise, blur, JPEG and lighting off, so colours can be checked exactly.
POSES = [
    {},
    {"rotation": 20.0},
    {"rotation": -12.0, "scale": 0.8, "tx": 0.06, "ty": -0.05},
    {"yaw": 28.0},
    {"yaw": -25.0, "pitch": 10.0, "rotation": 8.0},
    {"pitch": -12.0, "scale": 1.15, "smile": 1.0, "mouth_open": 0.6},
    {"clutter": 5, "stripes": True, "background_seed": 17, "smile": 0.5},
]


def _clean_with(gen: ProceduralFaces, **overrides) -> dict:
    return {**gen.clean_nuisance(), **overrides}


# ---- determinism


def test_sample_is_deterministic_and_global_in_identity_index():
    a = ProceduralFaces(ProceduralConfig(image_size=64), seed=3)
    b = ProceduralFaces(ProceduralConfig(image_size=64), seed=3)
    for i in range(20):  # a has seen other identities first; indices are global
        a.sample(i, 0)
    s1, s2 = a.sample(7, 3), b.sample(7, 3)
    assert s1.image.tobytes() == s2.image.tobytes()
    assert np.array_equal(s1.landmarks, s2.landmarks)
    assert s1.quality == s2.quality
    assert s1.nuisance == s2.nuisance
    assert a.identity(7) == b.identity(7)


def test_different_index_and_seed_give_different_output():
    a = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    b = ProceduralFaces(ProceduralConfig(image_size=64), seed=1)
    assert a.sample(2, 0).image.tobytes() != a.sample(2, 1).image.tobytes()
    assert a.sample(2, 0).nuisance != a.sample(2, 1).nuisance
    pa, pb = a.identity(2), b.identity(2)
    assert pa.keys() == pb.keys()
    assert pa != pb
    assert a.render(2, a.clean_nuisance()).image.tobytes() != b.render(2, b.clean_nuisance()).image.tobytes()


def test_render_reproduces_sample_from_its_nuisance():
    gen = ProceduralFaces(ProceduralConfig(image_size=64, aligned=False), seed=5)
    s = gen.sample(4, 9)
    again = gen.render(4, s.nuisance)
    assert again.image.tobytes() == s.image.tobytes()
    assert np.array_equal(again.landmarks, s.landmarks)


# ---- identities


def test_identity_parameters_are_plain_floats_and_distinct():
    gen = ProceduralFaces(seed=0)
    params = [gen.identity(i) for i in range(30)]
    assert all(isinstance(v, float) for p in params for v in p.values())
    vecs = np.array([[p[k] for k in sorted(p)] for p in params])
    dists = np.linalg.norm(vecs[:, None] - vecs[None], axis=-1)
    assert dists[~np.eye(30, dtype=bool)].min() > 1.0
    # Geometry, not only colour, varies between identities.
    for key in ("eye_dx", "eye_aspect", "nose_len", "mouth_w", "face_w", "jaw_taper", "brow_angle", "hairline"):
        assert np.std([p[key] for p in params]) > 0.0, key


def test_identities_differ_more_than_one_identity_under_the_same_nuisance(gen112):
    clean = gen112.clean_nuisance()
    same = gen112.render(1, clean).image.astype(float)
    assert np.array_equal(same, gen112.render(1, clean).image)
    diffs = [np.abs(gen112.render(i, clean).image.astype(float) - same).mean() for i in (2, 3, 4, 5)]
    assert min(diffs) > 3.0


# ---- landmarks


@pytest.mark.parametrize("pose", POSES, ids=[",".join(p) or "clean" for p in POSES])
def test_landmarks_land_on_the_drawn_features(gen112, pose):
    for identity in range(6):
        p = gen112.identity(identity)
        s = gen112.render(identity, _clean_with(gen112, **pose))
        img, lm = s.image, s.landmarks
        assert ((lm >= 2) & (lm <= 109)).all()
        skin, iris, pupil = _rgb(p, "skin"), _rgb(p, "iris"), np.array([14.0, 10.0, 10.0])
        sclera = np.array([236.0, 232.0, 226.0])
        for eye in lm[:2]:  # iris or pupil colour, not skin or white
            c = _pixel(img, eye)
            d_eye = _dist_to_segment(c, iris, pupil)
            assert d_eye < np.linalg.norm(c - skin) and d_eye < np.linalg.norm(c - sclera), (identity, pose)
        tip = skin * (1.0 - p["nose_shade"]) * np.array([1.0, 0.93, 0.93])
        assert np.abs(_pixel(img, lm[2]) - tip).max() <= 3.0, (identity, pose)  # the nose tip's own colour
        seam = _rgb(p, "lip", 0.45)
        contrast = np.linalg.norm(skin - seam)
        centre = lm[3:].mean(0)
        for corner in lm[3:]:  # lip-seam colour within one pixel of each mouth corner, none 3 px beyond it
            x, y = np.rint(corner).astype(int)
            patch = img[y - 1 : y + 2, x - 1 : x + 2].reshape(-1, 3).astype(float)
            nearest = np.linalg.norm(patch - seam, axis=1).min()
            assert nearest < 0.5 * contrast, (identity, pose)
            beyond = _pixel(img, corner + 3.0 * (corner - centre) / np.linalg.norm(corner - centre))
            assert np.linalg.norm(beyond - 0.92 * skin) < np.linalg.norm(beyond - seam), (identity, pose)


def test_landmarks_follow_depth_under_yaw(gen112):
    """Yaw shifts the nose (deepest) sideways more than the eyes, in the direction of the yaw."""
    base = gen112.render(0, gen112.clean_nuisance()).landmarks
    turned = gen112.render(0, _clean_with(gen112, yaw=25.0)).landmarks
    eye_mid_shift = turned[:2, 0].mean() - base[:2, 0].mean()
    nose_shift = turned[2, 0] - base[2, 0]
    assert nose_shift > eye_mid_shift > 0
    assert turned[1, 0] - turned[0, 0] < base[1, 0] - base[0, 0]  # foreshortened eye distance


def test_aligned_landmarks_near_template_unaligned_far():
    template = arcface_template(112)
    errors = {}
    for aligned in (True, False):
        gen = ProceduralFaces(ProceduralConfig(image_size=112, aligned=aligned), seed=0)
        lms = np.stack([gen.sample(i, i).landmarks for i in range(40)])
        errors[aligned] = np.linalg.norm(lms - template, axis=-1).mean(axis=1)
        if aligned:
            assert ((lms >= 0) & (lms <= 111)).all()
    assert errors[True].mean() < 6.0
    assert errors[True].max() > 0.3  # the identity's own geometry and the jitter move them
    assert errors[False].mean() > 2.5 * errors[True].mean()


def test_aligned_mode_is_a_least_squares_similarity_fit_to_the_template():
    """Without jitter, aligned landmarks are the 5-point similarity fit: centroids coincide and the
    residual is orthogonal to the fitted map's tangent directions (scale/rotation)."""
    cfg = ProceduralConfig(image_size=112, aligned_rotation_deg=0.0, aligned_scale_jitter=0.0, aligned_shift=0.0)
    gen = ProceduralFaces(cfg, seed=0)
    template = arcface_template(112).astype(float)
    tc = template - template.mean(0)
    for i in range(10):
        lm = gen.sample(i, i).landmarks.astype(float)
        np.testing.assert_allclose(lm.mean(0), template.mean(0), atol=1e-3)
        lc = lm - lm.mean(0)
        residual = tc - lc  # optimal: no scale or rotation of lc reduces it
        assert abs((residual * lc).sum()) < 1e-2 * (lc * lc).sum()
        assert abs((residual * np.stack([-lc[:, 1], lc[:, 0]], 1)).sum()) < 1e-2 * (lc * lc).sum()


def test_clean_landmarks_scale_with_image_size():
    small = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    large = ProceduralFaces(ProceduralConfig(image_size=112), seed=0)
    lm64 = small.render(3, small.clean_nuisance()).landmarks
    lm112 = large.render(3, large.clean_nuisance()).landmarks
    np.testing.assert_allclose(lm64, lm112 * 64 / 112, atol=1e-3)


# ---- quality


def _sharpness(img: np.ndarray) -> float:
    g = img.astype(float).mean(-1)
    return float(np.abs(np.diff(g, axis=0)).mean() + np.abs(np.diff(g, axis=1)).mean())


def test_quality_drops_with_each_degradation(gen112):
    clean = gen112.render(2, gen112.clean_nuisance())
    assert clean.quality == pytest.approx(1.0)
    degraded = {
        "blur": {"blur": 1.5},
        "noise": {"noise": 12.0, "noise_seed": 5},
        "lowres": {"lowres": 0.3},
        "jpeg": {"jpeg_quality": 15},
        "mask": {"mask": True},
        "sunglasses": {"sunglasses": True},
        "bar": {"bar": True, "bar_width": 0.15},
        "pose": {"yaw": 35.0, "pitch": 15.0},
        "dark": {"brightness": 0.45},
    }
    for name, delta in degraded.items():
        s = gen112.render(2, _clean_with(gen112, **delta))
        assert 0.0 <= s.quality < clean.quality, name
        assert s.image.tobytes() != clean.image.tobytes(), name
    # The pixel degradations act on the image, not only on the score.
    blurred = gen112.render(2, _clean_with(gen112, blur=1.5)).image
    noisy = gen112.render(2, _clean_with(gen112, noise=12.0, noise_seed=5)).image
    assert _sharpness(blurred) < 0.8 * _sharpness(clean.image)
    assert _sharpness(noisy) > 1.5 * _sharpness(clean.image)


def test_quality_is_monotone_in_strength():
    base = ProceduralFaces().clean_nuisance()
    for key, values in {
        "blur": [0.0, 0.5, 1.0, 2.0],
        "noise": [0.0, 4.0, 8.0, 16.0],
        "lowres": [1.0, 0.7, 0.5, 0.25],
        "jpeg_quality": [100, 80, 40, 10],
        "yaw": [0.0, 15.0, 30.0, 45.0],
        "brightness": [1.0, 0.6, 0.4, 0.2],
    }.items():
        qs = [quality_score({**base, key: v}) for v in values]
        assert all(a > b for a, b in zip(qs, qs[1:])), (key, qs)
    both = quality_score({**base, "blur": 1.0, "noise": 8.0})
    assert both < min(quality_score({**base, "blur": 1.0}), quality_score({**base, "noise": 8.0}))


def test_sampled_quality_in_range_and_spread():
    gen = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    q = np.array([gen.sample(i % 10, i).quality for i in range(120)])
    assert ((q >= 0) & (q <= 1)).all()
    assert q.std() > 0.1


# ---- sequences


def _pose(s: FaceSample) -> np.ndarray:
    n = s.nuisance
    return np.array([n["rotation"], n["yaw"], n["pitch"], 100 * np.log(n["scale"]), 100 * n["tx"], 100 * n["ty"]])


def test_sequences_vary_smoothly():
    gen = ProceduralFaces(ProceduralConfig(image_size=64, aligned=False), seed=0)
    near, far, lm_near, lm_far = [], [], [], []
    for k in range(4):
        seq = gen.sequence(k, 24, seq_index=k)
        assert len(seq) == 24
        poses = np.stack([_pose(s) for s in seq])
        lms = np.stack([s.landmarks for s in seq])
        step = np.abs(np.diff(poses, axis=0))
        assert step[:, 1].max() < 10.0  # yaw changes by a few degrees per frame at most
        near.append(step.mean(0))
        far.append(np.abs(poses[12:] - poses[:-12]).mean(0))
        lm_near.append(np.linalg.norm(np.diff(lms, axis=0), axis=-1).mean())
        lm_far.append(np.linalg.norm(lms[12:] - lms[:-12], axis=-1).mean())
        assert len({s.nuisance["background_seed"] for s in seq}) == 1
        assert len({s.image.tobytes() for s in seq}) == 24
    assert (np.mean(near, 0) < np.mean(far, 0)).all()
    assert np.mean(lm_near) < 0.5 * np.mean(lm_far)


def test_sequence_is_deterministic():
    gen = ProceduralFaces(seed=2)
    a = gen.sequence(5, 10, seq_index=1)
    b = ProceduralFaces(seed=2).sequence(5, 10, seq_index=1)
    assert all(x.image.tobytes() == y.image.tobytes() for x, y in zip(a, b))
    c = gen.sequence(5, 10, seq_index=2)
    assert a[0].image.tobytes() != c[0].image.tobytes()


# ---- sizes, types, API


@pytest.mark.parametrize("size", [64, 112])
@pytest.mark.parametrize("aligned", [True, False])
def test_shapes_and_dtypes(size, aligned):
    gen = ProceduralFaces(ProceduralConfig(image_size=size, aligned=aligned), seed=0)
    degraded = {**gen.clean_nuisance(), "jpeg_quality": 30, "lowres": 0.5, "blur": 1.0, "noise": 6.0, "bar": True}
    samples = [gen.sample(0, 0), gen.sample(11, 4), *gen.sequence(1, 3), gen.render(2, gen.clean_nuisance())]
    for s in [*samples, gen.render(2, degraded), gen.render(3, {**gen.clean_nuisance(), "jpeg_quality": 50})]:
        assert s.image.shape == (size, size, 3) and s.image.dtype == np.uint8
        assert s.image.flags["C_CONTIGUOUS"] and s.image.flags["WRITEABLE"]
        assert s.landmarks.shape == (5, 2) and s.landmarks.dtype == np.float32
        assert isinstance(s.quality, float) and 0.0 <= s.quality <= 1.0
        assert set(s.nuisance) == set(NUISANCE_KEYS)
        assert all(isinstance(v, (bool, int, float)) for v in s.nuisance.values())


def test_config_loads_from_params_mapping():
    from ml.config import from_mapping

    cfg = from_mapping(ProceduralConfig, {"blur_prob": 0.1, "scale_min": 0.5, "clutter_max": 3}, "data.procedural")
    assert (cfg.blur_prob, cfg.scale_min, cfg.clutter_max) == (0.1, 0.5, 3)
    with pytest.raises(ConfigError, match="blur_prb"):
        from_mapping(ProceduralConfig, {"blur_prb": 0.1}, "data.procedural")
    with pytest.raises(ConfigError, match="scale_min"):
        from_mapping(ProceduralConfig, {"scale_min": 1.5}, "data.procedural")


def test_config_is_frozen_and_validated():
    cfg = ProceduralConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.blur_prob = 0.5  # type: ignore[misc]
    with pytest.raises(ConfigError, match="blur_prob"):
        ProceduralConfig(blur_prob=1.5)
    with pytest.raises(ConfigError, match="image_size"):
        ProceduralConfig(image_size=8)
    with pytest.raises(ConfigError, match="seed"):
        ProceduralFaces(seed=-1)


def test_difficulty_knobs_take_effect():
    easy = ProceduralFaces(
        ProceduralConfig(
            blur_prob=0.0, noise_prob=0.0, jpeg_prob=0.0, lowres_prob=0.0, glasses_prob=0.0, sunglasses_prob=0.0,
            mask_prob=0.0, bar_prob=0.0, yaw_deg=0.0, pitch_deg=0.0,
        ),
        seed=0,
    )
    hard = ProceduralFaces(ProceduralConfig(blur_prob=1.0, noise_prob=1.0, mask_prob=1.0), seed=0)
    q_easy = np.mean([easy.sample(i, i).quality for i in range(20)])
    q_hard = np.mean([hard.sample(i, i).quality for i in range(20)])
    assert q_hard < 0.5 * q_easy
    assert all(hard.sample(i, i).nuisance["mask"] for i in range(5))


def test_render_rejects_bad_nuisance():
    gen = ProceduralFaces()
    with pytest.raises(ValueError, match="unknown keys"):
        gen.render(0, {**gen.clean_nuisance(), "yawn": 1.0})
    with pytest.raises(ValueError, match="lacks keys"):
        gen.render(0, {"yaw": 1.0})
    with pytest.raises(ValueError, match="jpeg_quality"):
        gen.render(0, {**gen.clean_nuisance(), "jpeg_quality": 0})
    with pytest.raises(ValueError, match="identity"):
        gen.sample(-1, 0)
