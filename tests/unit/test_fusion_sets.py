"""Set and video benchmarks: per-image features + styles, fusion of variable-length groups (hand values and the
batched baselines), TAR@FAR and rank / TPIR on hand-built templates, probe-size sweep, frame-order robustness,
and every bad input."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ml.errors import ConfigError, DataError
from ml.eval.metrics import template_features
from ml.fusion.sets import (
    FUSERS,
    FusionStream,
    features_and_styles,
    fuse_templates,
    gain_vs_probe_size,
    index_pairs,
    order_robustness,
    shuffled_templates,
    template_verification,
    video_identification,
)
from ml.fr.backbones.iresnet import iresnet18
from ml.fr.backbones.kprpe import vit_tiny_kprpe
from ml.fr.backbones.vit import vit_tiny
from ml.fusion import ARCFACE_TEMPLATE_112, CAFace, average_fusion, landmark_score_fusion, norm_weighted_fusion
from ml.fusion.train import fuse_sets

from tests.conftest import spread_caface

VIT = dict(depth=4, dim=32, heads=2, embed_dim=16, drop_path=0.0)  # taps blocks 2 and 3: style_dim 32 · 2 = 64
SMALL = dict(feature_dim=32, style_dim=8)


pytestmark = pytest.mark.usefixtures("one_thread")


def _caface(seed: int = 0, **kw) -> CAFace:
    """A small CAFace with non-trivial weights, in eval mode."""
    torch.manual_seed(seed)
    return spread_caface(CAFace(**{**SMALL, **kw}))


def _random_sets(lengths: list[int], d: int = 32, style_dim: int = 8, seed: int = 0):
    """Features (N, D) with spread norms, styles (N, style_dim, 2) and group ids for groups of ``lengths``."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    feats = rng.normal(size=(n, d)).astype(np.float32)
    feats *= (1.0 + 3.0 * rng.random((n, 1))).astype(np.float32) / np.linalg.norm(feats, axis=1, keepdims=True)
    styles = rng.normal(size=(n, style_dim, 2)).astype(np.float32)
    groups = np.repeat(np.arange(len(lengths)), lengths)
    perm = rng.permutation(n)  # groups interleaved, as images of a real protocol are
    return feats[perm], styles[perm], groups[perm]


def _padded(values: np.ndarray, groups: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, Nmax, ...) padded sets in the items' given order and their (G, Nmax) mask."""
    count = np.bincount(groups)
    out = torch.zeros((count.size, count.max(), *values.shape[1:]), dtype=torch.float32)
    mask = torch.zeros(count.size, count.max(), dtype=torch.bool)
    for g in range(count.size):
        rows = np.flatnonzero(groups == g)
        out[g, : rows.size] = torch.from_numpy(values[rows].astype(np.float32))
        mask[g, : rows.size] = True
    return out, mask


# ---- fusion: hand values


def test_average_and_norm_weighted_by_hand_with_a_group_of_one():
    feats = np.array([[3.0, 0.0], [0.0, -2.0], [0.0, 4.0]], dtype=np.float32)
    groups = np.array([0, 1, 0])
    r = 1 / math.sqrt(2)
    np.testing.assert_allclose(fuse_templates("average", feats, groups), [[r, r], [0.0, -1.0]], atol=1e-7)
    np.testing.assert_allclose(fuse_templates("norm_weighted", feats, groups), [[0.6, 0.8], [0.0, -1.0]], atol=1e-7)
    out = fuse_templates("average", torch.from_numpy(feats), torch.from_numpy(groups))  # tensors work too
    assert out.dtype == np.float32 and out.shape == (2, 2)


def test_media_pooling_counts_a_video_as_one_still():
    feats = np.array([[1.0, 0.0], [2.0, 0.0], [5.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    groups = np.zeros(4, dtype=np.int64)
    r = 1 / math.sqrt(2)
    np.testing.assert_allclose(fuse_templates("average", feats, groups, media=np.array([7, 7, 7, 8])), [[r, r]], atol=1e-7)
    np.testing.assert_allclose(fuse_templates("average", feats, groups), [[3 / math.sqrt(10), 1 / math.sqrt(10)]], atol=1e-7)
    f, s, g = _random_sets([3, 1, 5], d=6)
    media = np.random.default_rng(1).integers(0, 3, size=g.size)
    ids, expected = template_features(f, g, media)
    np.testing.assert_allclose(fuse_templates("average", f, g, media=media), expected, atol=1e-6)


def test_landmark_score_by_hand_in_a_64px_frame():
    size = 64.0
    template = np.asarray(ARCFACE_TEMPLATE_112, dtype=np.float32) * (size / 112)
    on = template.copy()
    off = template.copy()
    off[2, 0] += 0.1 * size  # nose 6.4 px right: ‖ΔL‖/S = 0.1 → d = (0.2 − 0.1)/0.2 = 0.5
    outside = np.full((5, 2), -50.0, dtype=np.float32)  # far outside the image: d = 0
    feats = np.array([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0], [1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    landmarks = np.stack([on, off, outside, outside, outside])
    scores = np.array([0.5, 1.0, 1.0, 1.0, 1.0], dtype=np.float32)
    groups = np.array([0, 0, 0, 1, 1])
    r = 1 / math.sqrt(2)
    out = fuse_templates("landmark_score", feats, groups, landmarks=landmarks, face_scores=scores, image_size=size)
    # group 0: weights 0.5·1, 1·0.5, 0 → normalize(0.5·[1,0] + 0.5·[0,1]); group 1: all 0 → plain average
    np.testing.assert_allclose(out, [[r, r], [r, r]], atol=1e-6)
    # without face scores every score is 1: weights 1, 0.5, 0
    out = fuse_templates("landmark_score", feats, groups, landmarks=landmarks, image_size=size)
    np.testing.assert_allclose(out[0], [2 / math.sqrt(5), 1 / math.sqrt(5)], atol=1e-6)


def test_landmarks_outside_the_image_weigh_nothing_and_all_zero_groups_fall_back(caplog):
    feats = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    landmarks = np.stack([np.asarray(ARCFACE_TEMPLATE_112, np.float32), np.full((5, 2), 500.0, np.float32)])
    out = fuse_templates("landmark_score", feats, np.array([0, 0]), landmarks=landmarks)
    np.testing.assert_allclose(out, [[1.0, 0.0]], atol=1e-7)  # the outside image gets weight 0
    with caplog.at_level(logging.WARNING, logger="ml.fusion.sets"):
        out = fuse_templates("landmark_score", feats, np.array([0, 0]), landmarks=landmarks[[1, 1]])
    r = 1 / math.sqrt(2)
    np.testing.assert_allclose(out, [[r, r]], atol=1e-7)
    assert "plain average" in caplog.text


def test_quality_oracle_by_hand():
    feats = np.array([[3.0, 4.0], [0.0, 2.0], [0.0, -5.0]], dtype=np.float32)
    quality = np.array([0.5, 0.25, 0.9], dtype=np.float32)
    out = fuse_templates("quality_oracle", feats, np.array([0, 0, 1]), quality=quality)
    # group 0: 0.5·(0.6, 0.8) + 0.25·(0, 1) = (0.3, 0.65), ‖·‖ = √0.5125; group 1 (one image): its unit feature
    norm = math.sqrt(0.3**2 + 0.65**2)
    np.testing.assert_allclose(out, [[0.3 / norm, 0.65 / norm], [0.0, -1.0]], atol=1e-6)
    # the raw norms do not count, only the quality: scaling a feature changes nothing
    np.testing.assert_allclose(fuse_templates("quality_oracle", feats * [[10.0], [1.0], [3.0]], np.array([0, 0, 1]),
                                              quality=quality), out, atol=1e-6)
    with pytest.raises(DataError, match="needs quality"):
        fuse_templates("quality_oracle", feats, np.array([0, 0, 1]))
    with pytest.raises(DataError, match="quality row 1 is negative"):
        fuse_templates("quality_oracle", feats, np.array([0, 0, 1]), quality=np.array([0.5, -0.1, 0.2]))


def test_zero_quality_groups_fall_back_to_the_average_and_no_template_is_nan(caplog):
    """A probe without a usable frame (every quality < 0.05, or exactly 0) still gets a defined template with
    every method: the oracle's tiny weights still give a direction, and all-zero weights fall back to the average."""
    f, s, g = _random_sets([5, 4, 3], d=32)
    quality = np.where(g == 0, 0.0, np.where(g == 1, 0.01 + 0.03 * (np.arange(g.size) % 2), 0.9)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="ml.fusion.sets"):
        out = fuse_templates("quality_oracle", f, g, quality=quality)
    assert "1 group(s) have quality 0" in caplog.text and "plain average" in caplog.text
    average = fuse_templates("average", f, g)
    np.testing.assert_allclose(out[0], average[0], atol=1e-6)  # all zero: the plain average
    assert not np.allclose(out[1], average[1], atol=1e-4)  # small but unequal weights still weigh
    landmarks = np.tile(np.asarray(ARCFACE_TEMPLATE_112, np.float32), (g.size, 1, 1))
    for method in FUSERS:
        templates = fuse_templates(method, f, g, styles=s, landmarks=landmarks, face_scores=quality, model=_caface(),
                                   quality=quality, chunk_size=2)
        assert np.isfinite(templates).all(), method
        np.testing.assert_allclose(np.linalg.norm(templates, axis=1), 1.0, atol=1e-5)


def test_fusion_stream_streams_the_oracle_only_with_quality():
    f, _, _ = _random_sets([9], d=16)
    quality = np.array([0.0, 0.02, 0.9, 0.5, 0.0, 0.01, 0.7, 0.03, 0.2], dtype=np.float32)
    stream = FusionStream("quality_oracle").update(f[:4], quality=quality[:4]).update(f[4:], quality=quality[4:])
    np.testing.assert_allclose(stream.template(), fuse_templates("quality_oracle", f, np.zeros(9, np.int64),
                                                                 quality=quality)[0], atol=1e-6)
    with pytest.raises(DataError, match="quality_oracle fusion needs quality"):
        FusionStream("quality_oracle").update(f)
    with pytest.raises(DataError, match="quality row 1 is negative"):
        stream.update(f[:2], quality=np.array([0.5, -0.1]))
    assert stream.frames == 9  # a refused update leaves the state as it was
    zero = FusionStream("quality_oracle").update(f, quality=np.zeros(9))  # no usable frame: the plain average
    np.testing.assert_allclose(zero.template(), fuse_templates("average", f, np.zeros(9, np.int64))[0], atol=1e-6)


def test_segment_fusion_equals_the_batched_baselines():
    f, _, g = _random_sets([1, 4, 2, 9, 3], d=16)
    rng = np.random.default_rng(3)
    landmarks = (np.asarray(ARCFACE_TEMPLATE_112, np.float32) + rng.normal(0, 8, size=(g.size, 5, 2))).astype(np.float32)
    scores = rng.random(g.size).astype(np.float32)
    pf, mask = _padded(f, g)
    pl, _ = _padded(landmarks, g)
    ps, _ = _padded(scores, g)
    np.testing.assert_allclose(fuse_templates("average", f, g), average_fusion(pf, mask).numpy(), atol=1e-6)
    np.testing.assert_allclose(fuse_templates("norm_weighted", f, g), norm_weighted_fusion(pf, mask).numpy(), atol=1e-6)
    np.testing.assert_allclose(
        fuse_templates("landmark_score", f, g, landmarks=landmarks, face_scores=scores),
        landmark_score_fusion(pf, pl, ps, mask=mask).numpy(), atol=1e-6,
    )


def test_caface_equals_the_model_and_streams_in_bounded_batches():
    model = _caface()
    lengths = [1, 3, 7, 2, 12]
    f, s, g = _random_sets(lengths)
    whole = fuse_templates("caface", f, g, styles=s, model=model)
    for k in range(len(lengths)):
        rows = np.flatnonzero(g == k)
        with torch.no_grad():
            one = model(torch.from_numpy(f[rows])[None], torch.from_numpy(s[rows])[None])[0]
        np.testing.assert_allclose(whole[k], one.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-6)
    # streamed in chunks: the same as fuse_sets with that chunk size, however the groups are batched
    chunked = fuse_templates("caface", f, g, styles=s, model=model, chunk_size=4)
    np.testing.assert_allclose(chunked, fuse_sets(model, f, s, g, chunk_size=4), atol=1e-6)
    tiny_batches = fuse_templates("caface", f, g, styles=s, model=model, chunk_size=4, max_items=5)
    np.testing.assert_allclose(tiny_batches, chunked, atol=1e-6)
    np.testing.assert_allclose(fuse_templates("caface", f, g, styles=s, model=model, max_items=3), whole, atol=1e-6)
    assert not np.allclose(chunked[4], whole[4], atol=1e-4)  # chunking a 12-frame set changes its template


def test_registry_lists_every_method():
    assert set(FUSERS) == {"average", "norm_weighted", "landmark_score", "caface", "quality_oracle"}


# ---- fusion: bad input


def test_bad_fusion_inputs_raise_naming_the_row():
    f, s, g = _random_sets([2, 3], d=32)
    model = _caface()
    bad = f.copy()
    bad[3, 1] = np.nan
    with pytest.raises(DataError, match="features row 3 is not finite"):
        fuse_templates("average", bad, g)
    bad[3] = f[3]
    bad[1] = 0.0
    with pytest.raises(DataError, match="features row 1 is all zeros"):
        fuse_templates("norm_weighted", bad, g)
    bad[1, 0] = np.inf
    with pytest.raises(DataError, match="features row 1 is not finite"):
        fuse_templates("caface", bad, g, styles=s, model=model)
    with pytest.raises(DataError, match=r"ids \[1\] have no image"):
        fuse_templates("average", f, np.where(g == 1, 2, g))
    with pytest.raises(DataError, match="must be ids 0..G-1, found -1"):
        fuse_templates("average", f, g - 1)
    with pytest.raises(DataError, match="integer ids of shape"):
        fuse_templates("average", f, g.astype(np.float32))
    with pytest.raises(DataError, match="integer ids of shape"):
        fuse_templates("average", f, g[:-1])
    with pytest.raises(DataError, match="non-empty float array"):
        fuse_templates("average", np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    with pytest.raises(ConfigError, match="unknown fusion method 'median'"):
        fuse_templates("median", f, g)
    with pytest.raises(ConfigError, match="media pooling is defined for 'average' only"):
        fuse_templates("norm_weighted", f, g, media=np.zeros(5))


def test_bad_caface_inputs():
    f, s, g = _random_sets([2, 3])
    model = _caface()
    with pytest.raises(ConfigError, match="needs a trained CAFace"):
        fuse_templates("caface", f, g, styles=s)
    with pytest.raises(DataError, match="needs styles"):
        fuse_templates("caface", f, g, model=model)
    with pytest.raises(DataError, match=r"styles must be a float array of shape \(5, 8, 2\)"):
        fuse_templates("caface", f, g, styles=s[:, :4], model=model)
    with pytest.raises(DataError, match=r"styles must be a float array of shape \(5, 8, 2\)"):
        fuse_templates("caface", f, g, styles=s[:4], model=model)
    nan_styles = s.copy()
    nan_styles[2, 0, 1] = np.nan
    with pytest.raises(DataError, match="styles row 2 is not finite"):
        fuse_templates("caface", f, g, styles=nan_styles, model=model)
    with pytest.raises(DataError, match="trained on 32"):
        fuse_templates("caface", f[:, :16], g, styles=s, model=model)
    with pytest.raises(ConfigError, match="chunk_size must be a positive integer"):
        fuse_templates("caface", f, g, styles=s, model=model, chunk_size=0)


def test_bad_landmark_inputs():
    f, _, g = _random_sets([2, 3], d=4)
    lm = np.tile(np.asarray(ARCFACE_TEMPLATE_112, np.float32), (5, 1, 1))
    with pytest.raises(DataError, match="needs landmarks"):
        fuse_templates("landmark_score", f, g)
    with pytest.raises(DataError, match=r"landmarks must be a float array of shape \(5, 5, 2\)"):
        fuse_templates("landmark_score", f, g, landmarks=lm[:, :4])
    bad = lm.copy()
    bad[4, 2, 0] = np.nan
    with pytest.raises(DataError, match="landmarks row 4 is not finite"):
        fuse_templates("landmark_score", f, g, landmarks=bad)
    with pytest.raises(DataError, match="face_scores row 1 is negative"):
        fuse_templates("landmark_score", f, g, landmarks=lm, face_scores=np.array([1, -0.5, 1, 1, 1.0]))
    with pytest.raises(DataError, match="face_scores row 0 is not finite"):
        fuse_templates("landmark_score", f, g, landmarks=lm, face_scores=np.array([np.nan, 1, 1, 1, 1.0]))


def test_cancelling_features_raise_instead_of_a_zero_or_nan_template():
    feats = np.array([[1.0, 2.0], [-1.0, -2.0], [0.0, 1.0]], dtype=np.float32)
    for method in ("average", "norm_weighted"):
        with pytest.raises(DataError, match="group 0 fuses to the zero vector"):
            fuse_templates(method, feats, np.array([0, 0, 1]))
    with pytest.raises(DataError, match="zero vector"):
        fuse_templates("average", feats, np.array([0, 0, 1]), media=np.array([1, 2, 3]))


# ---- verification and identification


def _unit_at(score: float) -> list[float]:
    """A 2-D unit vector whose cosine with [1, 0] is ``score``."""
    return [score, math.sqrt(1.0 - score * score)]


def test_template_verification_by_hand():
    genuine, impostor = [0.9, 0.5, 0.2], [0.6, 0.3, 0.1, 0.0]
    templates = np.array([[1.0, 0.0]] + [_unit_at(s) for s in genuine + impostor], dtype=np.float64)
    pairs = np.array([[0, i] for i in range(1, 8)])
    labels = np.array([1, 1, 1, 0, 0, 0, 0])
    out = template_verification(templates, pairs, labels, fars=(0.25, 0.1, 1e-2, 1.0))
    # FAR 0.25 of 4 impostors: 1 may pass → threshold = 2nd highest impostor 0.3 → 0.9, 0.5 accepted
    assert out["tar@far=0.25"] == pytest.approx(2 / 3)
    # FAR 0.1, 0.01 → 0 impostors → threshold 0.6 → only 0.9
    assert out["tar@far=1e-1"] == pytest.approx(1 / 3) and out["tar@far=1e-2"] == pytest.approx(1 / 3)
    assert out["tar@far=1e+00"] == 1.0
    assert out["n_genuine"] == 3 and out["n_impostor"] == 4


def test_index_pairs_maps_template_ids_to_rows():
    ids = np.array([10, 3, 7])
    np.testing.assert_array_equal(index_pairs(np.array([[3, 10], [7, 7]]), ids), [[1, 0], [2, 2]])
    with pytest.raises(DataError, match="pair 1 names template 5"):
        index_pairs(np.array([[3, 10], [5, 7]]), ids)
    with pytest.raises(DataError, match="distinct"):
        index_pairs(np.array([[3, 10]]), np.array([3, 3, 10]))


def test_bad_verification_inputs():
    t = np.eye(3)
    with pytest.raises(DataError, match="pair 1 .* indexes outside the 3 templates"):
        template_verification(t, np.array([[0, 1], [0, 3]]), np.array([1, 0]))
    with pytest.raises(DataError, match="labels must be 0 or 1, found 2 at pair 1"):
        template_verification(t, np.array([[0, 1], [0, 2]]), np.array([1, 2]))
    with pytest.raises(DataError, match="1 genuine and 0 impostor"):
        template_verification(t, np.array([[0, 1]]), np.array([1]))
    with pytest.raises(DataError, match="integer template indices"):
        template_verification(t, np.array([[0.0, 1.0]]), np.array([1]))
    nan = t.copy()
    nan[2, 2] = np.nan
    with pytest.raises(DataError, match="templates row 2 is not finite"):
        template_verification(nan, np.array([[0, 1], [0, 2]]), np.array([1, 0]))


def _id_setup():
    gallery = np.eye(3)  # identities a, b, c on the axes
    gallery_ids = np.array(["a", "b", "c"])
    probes = np.array([
        [1.0, 0.1, 0.0],  # a: own 0.995, rank 1
        [0.0, 0.6, 0.8],  # b: own 0.6 < c's 0.8 → rank 2
        [0.96, 0.28, 0.0],  # z, not enrolled: top-1 score 0.96
        [0.3, 0.0, 0.954],  # c: own 0.954, rank 1
    ])
    probes = probes / np.linalg.norm(probes, axis=1, keepdims=True)
    return probes, np.array(["a", "b", "z", "c"]), gallery, gallery_ids


def test_video_identification_by_hand():
    probes, probe_ids, gallery, gallery_ids = _id_setup()
    out = video_identification(probes, probe_ids, gallery, gallery_ids, ranks=(1, 2), fpirs=(0.01, 1.0))
    assert out["rank1"] == pytest.approx(2 / 3) and out["rank2"] == 1.0
    # FPIR 0.01 of 1 non-mated: threshold = its top-1 (0.96): only probe a (0.995, rank 1) is a hit
    assert out["tpir@fpir=1e-2"] == pytest.approx(1 / 3)
    assert out["tpir@fpir=1e+00"] == pytest.approx(2 / 3)  # threshold −inf: the rank-1 rate
    assert out["n_mated"] == 3 and out["n_nonmated"] == 1


def test_video_identification_with_a_mated_mask_and_closed_set():
    probes, probe_ids, gallery, gallery_ids = _id_setup()
    mated = np.array([True, True, False, False])  # c's probe searched as an impostor
    out = video_identification(probes, probe_ids, gallery, gallery_ids, fpirs=(0.5,), mated=mated)
    assert out["rank1"] == 0.5 and out["n_nonmated"] == 2
    # non-mated top-1 scores 0.96, 0.954; FPIR 0.5 → 1 may pass → threshold 0.954 → probe a accepted
    assert out["tpir@fpir=5e-1"] == 0.5
    closed = video_identification(probes[[0, 1, 3]], probe_ids[[0, 1, 3]], gallery, gallery_ids)
    assert closed == {"rank1": pytest.approx(2 / 3), "rank5": 1.0, "n_mated": 3.0, "n_nonmated": 0.0}
    with pytest.raises(DataError, match="probe 2 is marked mated but its id 'z' is not in the gallery"):
        video_identification(probes, probe_ids, gallery, gallery_ids, mated=np.ones(4, bool))
    with pytest.raises(DataError, match="no probe is mated"):
        video_identification(probes, np.array(["x", "y", "z", "w"]), gallery, gallery_ids)
    with pytest.raises(DataError, match="probe_ids must have shape"):
        video_identification(probes, probe_ids[:3], gallery, gallery_ids)


# ---- probe-size sweep and frame order


def _probe_protocol(seed: int = 0, k: int = 8, d: int = 32, noise: float = 1.6):
    """k identities; gallery = identity directions; probes = 2 per identity of 5..40 noisy frames."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    lengths = rng.integers(5, 41, size=2 * k)
    probe_ids = np.repeat(np.arange(k), 2)
    groups = np.repeat(np.arange(2 * k), lengths)
    feats = centres[probe_ids[groups]] + noise * rng.normal(size=(groups.size, d)) / math.sqrt(d) * 3
    styles = rng.normal(size=(groups.size, 8, 2))
    return feats.astype(np.float32), styles.astype(np.float32), groups, probe_ids, centres, np.arange(k), lengths


def test_gain_vs_probe_size():
    feats, styles, groups, probe_ids, gallery, gallery_ids, lengths = _probe_protocol()
    model = _caface()
    out = gain_vs_probe_size(feats, styles, groups, probe_ids, gallery, gallery_ids, sizes=(1, 4, 64),
                             methods=("average", "norm_weighted", "caface"), model=model, seed=0, chunk_size=16)
    assert set(out) == {"average", "norm_weighted", "caface", "frames"}
    assert out["frames"] == {1: 1.0, 4: 4.0, 64: pytest.approx(lengths.mean())}  # 64 > every probe: all frames
    for m in ("average", "norm_weighted", "caface"):
        assert set(out[m]) == {1, 4, 64} and all(0.0 <= v <= 1.0 for v in out[m].values())
    assert out["average"][64] > out["average"][1]  # more frames, better templates
    full = fuse_templates("average", feats, groups)
    from ml.eval.metrics import identification_rank
    assert out["average"][64] == identification_rank(full, probe_ids, gallery, gallery_ids, ranks=(1,))[1]
    again = gain_vs_probe_size(feats, styles, groups, probe_ids, gallery, gallery_ids, sizes=(1, 4, 64),
                               methods=("average", "norm_weighted", "caface"), model=model, seed=0, chunk_size=16)
    assert again == out  # seeded
    flat = gain_vs_probe_size(feats, styles, groups, probe_ids, gallery, gallery_ids, sizes=(1, 4, 64),
                              methods=("average", "quality_oracle"), quality=np.ones(len(feats)), seed=0)
    assert flat["quality_oracle"] == flat["average"] == out["average"]  # equal qualities: the oracle is the average
    with pytest.raises(DataError, match="probe 0 .* is not in the gallery"):
        gain_vs_probe_size(feats, styles, groups, probe_ids + 100, gallery, gallery_ids, sizes=(1,))
    with pytest.raises(ConfigError, match="positive integer"):
        gain_vs_probe_size(feats, styles, groups, probe_ids, gallery, gallery_ids, sizes=(0,))
    with pytest.raises(DataError, match="one identity per probe"):
        gain_vs_probe_size(feats, styles, groups, probe_ids[:-1], gallery, gallery_ids)


def test_order_robustness():
    feats, styles, groups, probe_ids, gallery, gallery_ids, _ = _probe_protocol(seed=1)
    model = _caface()
    # one call per probe: CAFace (no positional encoding) is invariant to the frame order up to float rounding
    one_shot = shuffled_templates(model, feats, styles, groups, shuffles=3, chunk_size=None, seed=0)
    assert one_shot.shape == (3, 16, 32)
    np.testing.assert_allclose(one_shot[1], one_shot[0], atol=1e-5)
    # chunks of 4: which frames share a chunk changes with the order, and so the template (a little)
    out = order_robustness(model, feats, styles, groups, probe_ids, gallery, gallery_ids, shuffles=3, chunk_size=4)
    assert {"rank1/mean", "rank1/std", "rank5/mean", "rank5/std", "n_mated", "n_nonmated", "shuffles",
            "template_cosine/min"} == set(out)
    assert out["shuffles"] == 3 and out["n_mated"] == 16
    assert 0.9 < out["template_cosine/min"] < 1.0 - 1e-7
    assert 0.0 <= out["rank1/mean"] <= 1.0 and out["rank1/std"] >= 0.0
    # with non-mated probes the open-set TPIR is averaged too
    mixed = order_robustness(model, feats, styles, groups, np.where(probe_ids == 0, 99, probe_ids), gallery,
                             gallery_ids, shuffles=2, chunk_size=4, fpirs=(0.5,))
    assert "tpir@fpir=5e-1/mean" in mixed and mixed["n_nonmated"] == 2


# ---- per-image features and styles


def _images(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)


def _tensor(images: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5


def test_features_and_styles_vit_batches_and_flip():
    torch.manual_seed(0)
    model = vit_tiny(**VIT).train()  # left in train mode: features_and_styles runs in eval and restores it
    images = _images(5, 64)
    feats, styles = features_and_styles(model, images, batch_size=2)
    assert model.training
    assert feats.shape == (5, 16) and styles.shape == (5, 64, 2) and feats.dtype == styles.dtype == np.float32
    model.eval()
    with torch.no_grad():
        f, s = model(_tensor(images), return_styles=True)
        f2, s2 = model(_tensor(images).flip(3), return_styles=True)
    np.testing.assert_allclose(feats, f.numpy(), atol=1e-5)
    np.testing.assert_allclose(styles, s.numpy(), atol=1e-5)
    ff, fs = features_and_styles(model, images, flip=True)
    np.testing.assert_allclose(ff, (f + f2).numpy(), atol=1e-5)  # features summed
    np.testing.assert_allclose(fs, ((s + s2) / 2).numpy(), atol=1e-5)  # styles averaged
    empty_f, empty_s = features_and_styles(model, images[:0])
    assert empty_f.shape == (0, 16) and empty_s.shape == (0, 64, 2)


def test_features_and_styles_resizes_to_the_models_side_only_when_asked():
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = vit_tiny_kprpe(**VIT).eval()  # 64-px input
    small = _images(3, 32)
    kp = np.random.default_rng(1).random((3, 5, 2)).astype(np.float32) * 31
    with pytest.raises(DataError, match="expects 64×64 images"):
        features_and_styles(model, small, keypoints=kp)
    feats, styles = features_and_styles(model, small, keypoints=kp, resize=True, batch_size=2)
    x = F.interpolate(_tensor(small), size=(64, 64), mode="bilinear", antialias=True, align_corners=False)
    with torch.no_grad():  # the landmarks scale with the faces: ×2 from 32 to 64 px
        f, s = model(x, torch.from_numpy(kp * 2.0), return_styles=True)
    np.testing.assert_allclose(feats, f.numpy(), atol=1e-5)
    np.testing.assert_allclose(styles, s.numpy(), atol=1e-5)


def test_features_and_styles_kprpe_and_iresnet():
    torch.manual_seed(0)
    model = vit_tiny_kprpe(**VIT).eval()
    images = _images(3, 64)
    kp = np.random.default_rng(1).random((3, 5, 2)).astype(np.float32) * 63
    feats, styles = features_and_styles(model, images, keypoints=kp, flip=True)
    assert feats.shape == (3, 16) and styles.shape == (3, 64, 2)
    with pytest.raises(DataError, match="needs keypoints"):
        features_and_styles(model, images)
    bad = kp.copy()
    bad[1, 0, 0] = np.nan
    with pytest.raises(DataError, match="keypoints of image 1 are not finite"):
        features_and_styles(model, images, keypoints=bad)
    with pytest.raises(DataError, match=r"keypoints must have shape \(3, 5, 2\)"):
        features_and_styles(model, images, keypoints=kp[:2])
    res = iresnet18(img_size=32, embed_dim=16, width=0.125).eval()
    feats, styles = features_and_styles(res, _images(2, 32))
    assert feats.shape == (2, 16) and styles.shape == (2, res.style_dim, 2)


def test_features_and_styles_bad_inputs():
    torch.manual_seed(0)
    model = vit_tiny(**VIT).eval()
    with pytest.raises(DataError, match="expects 64×64 images"):
        features_and_styles(model, _images(2, 32))
    with pytest.raises(DataError, match="uint8 numpy array"):
        features_and_styles(model, _images(2, 64).astype(np.float32))
    with pytest.raises(ConfigError, match="batch_size"):
        features_and_styles(model, _images(2, 64), batch_size=0)

    class NoStyles(torch.nn.Module):
        input_contract = {"size": 64, "mean": (0.5,) * 3, "std": (0.5,) * 3, "embedding_dim": 4}

    with pytest.raises(ConfigError, match="declares no 'style_dim'"):
        features_and_styles(NoStyles(), _images(1, 64))
    with torch.no_grad():
        model.feature[2].weight[0, 0] = float("nan")
    with pytest.raises(DataError, match="non-finite features for image 0"):
        features_and_styles(model, _images(2, 64))


def test_procedural_video_probes_end_to_end():
    """Video-like procedural sequences → features + styles → every fusion method → identification."""
    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    gen = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    identities = [0, 1, 2]
    stills = [gen.sample(i, 0) for i in identities]
    frames = [gen.sequence(i, 4, seq_index=0) for i in identities]
    probe_samples = [s for seq in frames for s in seq]
    groups = np.repeat(np.arange(3), 4)
    torch.manual_seed(0)
    backbone = vit_tiny(**VIT).eval()
    g_feats, _ = features_and_styles(backbone, np.stack([s.image for s in stills]))
    p_feats, p_styles = features_and_styles(backbone, np.stack([s.image for s in probe_samples]), flip=True)
    landmarks = np.stack([s.landmarks for s in probe_samples])
    scores = np.array([s.quality for s in probe_samples], dtype=np.float32)
    model = _caface(feature_dim=16, style_dim=64)
    order = np.random.default_rng(0).permutation(len(groups))  # frames of the three videos interleaved
    gallery_ids = np.array([2, 0, 1])  # gallery enrolled in another order than the probes
    for method in FUSERS:
        templates = fuse_templates(method, p_feats, groups, styles=p_styles, landmarks=landmarks,
                                   face_scores=scores, image_size=64, model=model, chunk_size=2, quality=scores)
        assert templates.shape == (3, 16) and np.isfinite(templates).all()
        assert np.allclose(np.linalg.norm(templates, axis=1), 1.0, atol=1e-5)
        if method != "caface":  # CAFace reads a set in order (chunked memory); the others are set functions
            shuffled = fuse_templates(method, p_feats[order], groups[order], styles=p_styles[order],
                                      landmarks=landmarks[order], face_scores=scores[order], image_size=64,
                                      model=model, chunk_size=2, quality=scores[order])
            np.testing.assert_allclose(shuffled, templates, atol=1e-5)
        out = video_identification(templates, np.array(identities), g_feats[gallery_ids], gallery_ids, ranks=(1, 2))
        # rank-N by hand: each probe's gallery identities sorted by cosine similarity
        gallery = g_feats[gallery_ids] / np.linalg.norm(g_feats[gallery_ids], axis=1, keepdims=True)
        ranked = gallery_ids[np.argsort(-(templates @ gallery.T), axis=1)]
        for n in (1, 2):
            hits = [identity in row[:n] for identity, row in zip(identities, ranked)]
            assert out[f"rank{n}"] == pytest.approx(np.mean(hits)), (method, n)
    average = fuse_templates("average", p_feats, groups)
    by_hand = np.stack([(p_feats[groups == g] / np.linalg.norm(p_feats[groups == g], axis=1, keepdims=True)).sum(0)
                        for g in range(3)])
    np.testing.assert_allclose(average, by_hand / np.linalg.norm(by_hand, axis=1, keepdims=True), atol=1e-5)


def test_caface_batches_bound_items_and_attention():
    from ml.fusion.sets.fusers import MAX_ATTENTION, MAX_SETS, _caface_batches

    counts = np.array([300] * 10 + [5] * 400 + [70_000])
    batches = _caface_batches(counts, lambda c: c, max_items=1 << 16)
    assert sorted(np.concatenate(batches).tolist()) == list(range(counts.size))  # every group exactly once
    for b in batches:
        w = int(counts[b].max())
        assert b.size <= MAX_SETS
        assert b.size == 1 or (b.size * w <= 1 << 16 and b.size * w * w <= MAX_ATTENTION)
    assert [b.size for b in batches if counts[b].max() == 70_000] == [1]  # over both limits: alone
    chunked = _caface_batches(counts, lambda c: min(c, 256), max_items=1 << 16)
    assert max(b.size for b in chunked) == MAX_SETS
