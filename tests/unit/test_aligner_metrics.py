"""Landmark metrics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from ml.errors import DataError
from ml.data.procedural import ARCFACE_TEMPLATE_112
from ml.aligner.metrics import (
    FACE_BOX_112, auc_at, ced_curve, face_box_size, failure_rate, inter_pupil, nme, nme_box, plot_ced, score_auc,
    spearman, template_scale,
)


def _face(scale: float = 1.0) -> np.ndarray:
    """Eyes 10 px apart (times scale): inter-pupil distance 10·scale."""
    return scale * np.array([[0.0, 0.0], [10.0, 0.0], [5.0, 5.0], [2.0, 10.0], [8.0, 10.0]])


def test_nme_hand_computed():
    gt = np.stack([_face(), _face(2.0)])
    pred = gt.copy()
    pred[0, 0] += [3.0, 4.0]  # one point off by 5 px: mean error 1 px over 5 points, / 10 → 0.1
    pred[1] += [0.0, 2.0]  # every point off by 2 px, iod 20 → 0.1
    np.testing.assert_allclose(inter_pupil(gt), [10.0, 20.0])
    np.testing.assert_allclose(nme(pred, gt), [0.1, 0.1])
    np.testing.assert_allclose(nme(gt, gt), [0.0, 0.0])


def test_nme_is_invariant_to_a_common_similarity():
    rng = np.random.default_rng(0)
    gt = rng.uniform(0, 100, (4, 5, 2))
    pred = gt + rng.normal(0, 2, gt.shape)
    th, s = 0.7, 3.0
    r = s * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
    np.testing.assert_allclose(nme(pred @ r.T + 5, gt @ r.T + 5), nme(pred, gt), rtol=1e-12)


def _rotate(points: np.ndarray, degrees: float) -> np.ndarray:
    th = np.radians(degrees)
    return points @ np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]).T


def test_face_box_constant_is_the_renderers_average_face():
    assert FACE_BOX_112 == pytest.approx(2 * np.sqrt(36.0 * 45.0))  # half width 36, half height 45 canonical units
    assert FACE_BOX_112 == pytest.approx(80.4984, abs=1e-4)


def test_template_scale_and_face_box_hand_computed():
    t = ARCFACE_TEMPLATE_112.astype(np.float64)
    # the template itself (σ = 1), ×2 rotated 30° and shifted, ×0.5 rotated −90° and shifted
    gt = np.stack([t, _rotate(2.0 * t, 30.0) + [7.0, -3.0], _rotate(0.5 * t, -90.0) + 100.0])
    np.testing.assert_allclose(template_scale(gt), [1.0, 2.0, 0.5], rtol=1e-12)
    np.testing.assert_allclose(face_box_size(gt), [FACE_BOX_112, 2 * FACE_BOX_112, 0.5 * FACE_BOX_112], rtol=1e-12)
    # not a similarity: doubling only the x spread, b = (2a_x, a_y), so Σ a·b = 2Σa_x² + Σa_y² and
    # Σ a×b = Σ (a_x·a_y − a_y·2a_x) = −Σ a_x·a_y (the template's points are not symmetric in x and y)
    a = t - t.mean(0)
    stretched = t.mean(0) + a * [2.0, 1.0]
    dot, cross = 2.0 * (a[:, 0] ** 2).sum() + (a[:, 1] ** 2).sum(), -(a[:, 0] * a[:, 1]).sum()
    want = np.hypot(dot, cross) / (a**2).sum()
    assert template_scale(stretched[None])[0] == pytest.approx(want, rel=1e-12)


def test_nme_box_hand_computed():
    gt = np.stack([_face(), _face(2.0)])
    pred = gt.copy()
    pred[0, 0] += [3.0, 4.0]  # mean error 1 px, box 20 → 0.05
    pred[1] += [0.0, 2.0]  # mean error 2 px, box 50 → 0.04
    np.testing.assert_allclose(nme_box(pred, gt, np.array([20.0, 50.0])), [0.05, 0.04])
    np.testing.assert_allclose(nme_box(gt, gt, np.array([20.0, 50.0])), [0.0, 0.0])
    # without boxes: the estimate from gt; the template at scale 2 has a box of 2·80.498 px
    t = ARCFACE_TEMPLATE_112.astype(np.float64)[None] * 2.0
    off = t + [0.0, 3.0]  # every point 3 px off
    np.testing.assert_allclose(nme_box(off, t), [3.0 / (2.0 * FACE_BOX_112)], rtol=1e-12)
    # the box convention and the inter-pupil one differ by the ratio of the normalisers only
    np.testing.assert_allclose(nme_box(off, t) * face_box_size(t), nme(off, t) * inter_pupil(t), rtol=1e-12)
    with pytest.raises(DataError, match="one √\\(W·H\\) per face"):
        nme_box(pred, gt, np.array([20.0]))
    with pytest.raises(DataError, match="finite and positive.*rows \\[1\\]"):
        nme_box(pred, gt, np.array([20.0, 0.0]))


def test_ced_failure_auc_hand_computed():
    e = np.array([0.0, 0.05, 0.1, 0.3])
    t, f = ced_curve(e, max_error=0.2, steps=5)  # thresholds 0, .05, .1, .15, .2
    np.testing.assert_allclose(t, [0.0, 0.05, 0.1, 0.15, 0.2])
    np.testing.assert_allclose(f, [0.25, 0.5, 0.75, 0.75, 0.75])  # NME ≤ t counts
    assert failure_rate(e, 0.1) == 0.25  # only 0.3 is strictly above 0.1
    assert failure_rate(e, 0.05) == 0.5
    # ∫₀^0.1 F = per face max(0, 0.1 − e): 0.1 + 0.05 + 0 + 0 = 0.15, / 4 faces / 0.1 → 0.375
    assert auc_at(e, 0.1) == pytest.approx(0.375)
    assert auc_at(np.zeros(3), 0.1) == pytest.approx(1.0)
    assert auc_at(np.full(3, 0.5), 0.1) == 0.0


def test_auc_agrees_with_a_fine_riemann_sum_of_the_ced():
    e = np.random.default_rng(1).gamma(2.0, 0.03, 500)
    t, f = ced_curve(e, max_error=0.15, steps=150001)
    assert auc_at(e, 0.15) == pytest.approx(np.trapezoid(f, t) / 0.15, abs=1e-4)


def test_score_auc_hand_computed():
    # pairs (s⁺, s⁻) of [3, 2, 1] × [2, 0]: 3>2, 3>0, 2=2 (½), 2>0, 1<2, 1>0 → 4.5 / 6
    assert score_auc(np.array([3.0, 2.0, 1.0]), np.array([2.0, 0.0])) == pytest.approx(0.75)
    assert score_auc(np.array([5.0, 4.0]), np.array([1.0, 2.0, 3.0])) == 1.0
    assert score_auc(np.array([1.0, 2.0]), np.array([3.0])) == 0.0
    assert score_auc(np.full(3, 0.5), np.full(4, 0.5)) == 0.5  # every pair tied


def test_spearman_hand_computed():
    # no ties: ρ = 1 − 6 Σd² / (n(n² − 1)) = 1 − 6·2 / 60
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)
    # a tie: ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]: Pearson = 4.5 / √(4.5 · 5) = √0.9
    assert spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0, 40.0])) == pytest.approx(0.9 ** 0.5)
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([9.0, 4.0, 1.0])) == pytest.approx(-1.0)
    assert np.isnan(spearman(np.ones(4), np.arange(4.0)))  # a constant ranks nothing
    with pytest.raises(DataError, match="same length"):
        spearman(np.arange(3.0), np.arange(4.0))
    with pytest.raises(DataError, match="finite"):
        score_auc(np.array([np.nan]), np.array([0.0]))


def test_bad_inputs_raise():
    gt = np.stack([_face()])
    with pytest.raises(DataError, match=r"\(N, 5, 2\)"):
        nme(gt[:, :4], gt[:, :4])
    with pytest.raises(DataError, match="same shape"):
        nme(np.concatenate([gt, gt]), gt)
    nan = gt.copy()
    nan[0, 1, 0] = np.nan
    with pytest.raises(DataError, match="non-finite.*rows \\[0\\]"):
        nme(nan, gt)
    same = gt.copy()
    same[0, 1] = same[0, 0]
    with pytest.raises(DataError, match="coincident eye centres"):
        nme(gt, same)
    with pytest.raises(DataError, match="non-negative"):
        failure_rate(np.array([-0.1]))
    with pytest.raises(DataError, match="non-empty"):
        auc_at(np.array([]))


def test_plot_ced_writes_png_atomically(tmp_path):
    rng = np.random.default_rng(2)
    path = plot_ced({"dfa": rng.gamma(2, 0.02, 100), "mean shape": rng.gamma(2, 0.1, 100)}, tmp_path / "ced.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ced.png"]  # no temporary left behind
    with pytest.raises(DataError, match="at least one"):
        plot_ced({}, tmp_path / "empty.png")
    both = plot_ced({"dfa": rng.gamma(2, 0.02, 100)}, tmp_path / "both.png",
                    box_curves={"dfa": rng.gamma(2, 0.01, 100), "top anchor": rng.gamma(2, 0.012, 100)})
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(DataError, match="box_curves"):
        plot_ced({"dfa": np.ones(3)}, tmp_path / "none.png", box_curves={})
