"""ml/fusion/diagnostics.py: rank-1 hits, the Wilson interval and the paired bootstrap against hand values, and
CAFace's frame-weight diagnostics on a tiny untrained model (finite, in range)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ml.errors import DataError
from ml.fusion.diagnostics import (
    caface_diagnostics,
    caface_frame_weights,
    paired_difference,
    rank1_hits,
    wilson_interval,
)
from ml.fusion import CAFace

pytestmark = pytest.mark.usefixtures("one_thread")


def test_rank1_hits_by_hand_skip_non_mated_probes():
    gallery = np.array([[1.0, 0.0], [0.0, 1.0]])
    probes = np.array([[0.9, 0.1], [0.8, 0.2], [0.0, 1.0], [0.1, 0.9]])
    hits = rank1_hits(probes, np.array(["a", "b", "x", "b"]), gallery, np.array(["a", "b"]))
    assert hits.tolist() == [True, False, True]  # probe 2 (x) is not enrolled


def test_wilson_interval_against_the_closed_form():
    # 8 of 10: p̂ = 0.8, z = 1.959964: centre (p̂ + z²/2n)/(1 + z²/n),
    # half-width z/(1 + z²/n)·√(p̂(1−p̂)/n + z²/4n²)
    z = 1.959963984540054
    centre = (0.8 + z**2 / 20) / (1 + z**2 / 10)
    half = z / (1 + z**2 / 10) * math.sqrt(0.8 * 0.2 / 10 + z**2 / 400)
    low, high = wilson_interval(np.array([True] * 8 + [False] * 2))
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-9)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook value
    low, high = wilson_interval(np.zeros(5, dtype=bool))
    assert low == pytest.approx(0.0, abs=1e-12) and 0.0 < high < 0.5  # never a degenerate [0, 0]
    with pytest.raises(DataError, match="at least one trial"):
        wilson_interval(np.array([], dtype=bool))


def test_paired_difference_mean_and_bootstrap_interval():
    a = np.array([1, 1, 0, 1, 0], dtype=bool)
    b = np.array([0, 1, 0, 0, 0], dtype=bool)
    out = paired_difference(a, b, seed=3)
    assert out["mean"] == pytest.approx(0.4)
    assert 0.0 <= out["ci_low"] <= 0.4 <= out["ci_high"] <= 1.0  # every paired difference is ≥ 0
    assert paired_difference(a, b, seed=3) == out  # seeded
    assert paired_difference(a, a) == {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    assert paired_difference(b, a, seed=3)["mean"] == pytest.approx(-0.4)
    with pytest.raises(DataError, match="equal-length"):
        paired_difference(a, b[:4])


def _sets(lengths, d=16, style_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    feats = rng.normal(size=(n, d)).astype(np.float32) * rng.uniform(1, 4, size=(n, 1)).astype(np.float32)
    styles = rng.normal(size=(n, style_dim, 2)).astype(np.float32)
    groups = np.repeat(np.arange(len(lengths)), lengths)
    quality = rng.uniform(0.0, 0.8, size=n)
    return feats, styles, groups, quality


def test_caface_diagnostics_on_an_untrained_model_are_finite_and_in_range():
    torch.manual_seed(0)
    model = CAFace(feature_dim=16, style_dim=8, num_clusters=4).train()
    feats, styles, groups, quality = _sets([6, 5, 1, 8])
    weights, entropy, usage = caface_frame_weights(model, feats, styles, groups)
    assert model.training  # its mode is restored
    assert (weights >= 0).all() and np.bincount(groups, weights=weights) == pytest.approx(np.ones(4))
    assert ((entropy >= -1e-9) & (entropy <= 1 + 1e-9)).all()
    assert len(usage) == 4 and all(u.shape == (4,) and u.sum() == pytest.approx(1.0) for u in usage)
    out = caface_diagnostics(model, feats, styles, groups, quality)
    assert set(out) == {"weight_quality_spearman", "weight_cv", "usable_weight_ratio", "assignment_entropy",
                        "cluster_usage_entropy", "effective_clusters"}
    # ρ is undefined (NaN) exactly when every set's weights are equal, as an untrained CAFace's can be (averaging)
    equal = all(np.ptp(weights[groups == g]) <= 1e-9 for g in np.unique(groups))
    rho = out.pop("weight_quality_spearman")
    assert math.isnan(rho) if equal else -1.0 <= rho <= 1.0, (rho, weights)
    assert all(math.isfinite(v) for v in out.values()), out
    assert out["weight_cv"] >= 0.0 and out["usable_weight_ratio"] > 0.0
    assert 0.0 <= out["assignment_entropy"] <= 1.0 + 1e-9 and 0.0 <= out["cluster_usage_entropy"] <= 1.0 + 1e-9
    assert 1.0 - 1e-9 <= out["effective_clusters"] <= 4.0 + 1e-9
    with pytest.raises(DataError, match="one set id per frame"):
        caface_frame_weights(model, feats, styles, groups[:-1])


def test_the_gain_note_says_when_caface_does_not_beat_the_strongest_weighting_baseline():
    from tasks.evaluate.fusion import gain_note

    def metrics(caface_minus_landmarks: tuple[float, float, float]) -> dict[str, float]:
        m = {"sets/videos_single/caface_minus_average/rank1": 0.10,
             "sets/videos_single/caface_minus_average/rank1/ci_low": 0.06,
             "sets/videos_single/caface_minus_average/rank1/ci_high": 0.14,
             "sets/videos_single/norm_weighted/rank1": 0.25, "sets/videos_single/landmark_score/rank1": 0.33}
        for b, (mean, low, high) in (("norm_weighted", (0.09, 0.05, 0.13)), ("landmark_score", caface_minus_landmarks)):
            key = f"sets/videos_single/caface_minus_{b}/rank1"
            m.update({key: mean, f"{key}/ci_low": low, f"{key}/ci_high": high})
        return m

    tied = gain_note(metrics((0.023, -0.02, 0.067)))
    assert "CAFace +10.0 points (+6.0 to +14.0), above 0" in tied
    assert ("Against the strongest baseline that weights frames, KP-RPE landmark × face score: CAFace +2.3 points "
            "(-2.0 to +6.7); **CAFace does not beat it beyond noise**.") in tied
    assert "CAFace beats it." in gain_note(metrics((0.05, 0.01, 0.09)))
    assert "**CAFace is below it**" in gain_note(metrics((-0.05, -0.09, -0.01)))
