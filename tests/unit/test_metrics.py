"""Unit tests for ml/eval/metrics/ against hand-computed values and brute-force references."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from ml.eval.metrics import (
    identification,
    identification_rank,
    pair_correct,
    pair_scores,
    roc_curve,
    tar_at_far,
    template_features,
    verification_accuracy,
)


def _pairs_at_distances(distances: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """2-D unit-vector pairs whose squared distance ||a - b||^2 = 2 - 2 cos(theta) is each value."""
    cos = 1.0 - np.asarray(distances) / 2.0
    theta = np.arccos(cos)
    emb1 = np.tile([1.0, 0.0], (len(distances), 1))
    emb2 = np.stack([np.cos(theta), np.sin(theta)], axis=1)
    return emb1, emb2


def _unit(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


# ------------------------------------------------------------------------------------------
# verification_accuracy
# ------------------------------------------------------------------------------------------


def test_verification_accuracy_hand_worked_two_folds():
    # pair  d      same   fold
    #  0    0.205  yes    0
    #  1    1.005  no     0
    #  2    2.005  yes    0
    #  3    0.105  yes    1
    #  4    1.505  no     1
    #  5    3.005  no     1
    # Fold 0 (test 0-2) trains on pairs 3-5: any t in (0.105, 1.505] gets 3/3, the first grid
    #   value is t = 0.11. On the test fold at 0.11: pair 0 (0.205 >= 0.11) -> "diff", wrong;
    #   pair 1 -> "diff", right; pair 2 -> "diff", wrong. Accuracy 1/3.
    # Fold 1 (test 3-5) trains on pairs 0-2: t in (0.205, 1.005] gets 2/3 (pairs 0, 1), as does
    #   t > 2.005 (pairs 0, 2); the first best is t = 0.21. On the test fold: pair 3 (0.105 <
    #   0.21) "same", right; pair 4 "diff", right; pair 5 "diff", right. Accuracy 3/3.
    # mean = 2/3, population std = 1/3, threshold = (0.11 + 0.21) / 2 = 0.16.
    emb1, emb2 = _pairs_at_distances([0.205, 1.005, 2.005, 0.105, 1.505, 3.005])
    issame = np.array([1, 0, 1, 1, 0, 0])
    out = verification_accuracy(emb1, emb2, issame, n_folds=2)
    assert out["accuracy"] == pytest.approx(2 / 3)
    assert out["std"] == pytest.approx(1 / 3)
    assert out["threshold"] == pytest.approx(0.16)


def test_pair_correct_is_each_pairs_outcome_at_its_folds_threshold():
    # The two-fold example above: fold 0 at t = 0.11 gets pairs 0 and 2 wrong, pair 1 right; fold 1 at t = 0.21
    # gets pairs 3-5 right.
    emb1, emb2 = _pairs_at_distances([0.205, 1.005, 2.005, 0.105, 1.505, 3.005])
    issame = np.array([1, 0, 1, 1, 0, 0])
    assert pair_correct(emb1, emb2, issame, n_folds=2).tolist() == [False, True, False, True, True, True]
    rng = np.random.default_rng(1)  # equal folds: the outcomes' mean is the accuracy
    a, b, same = rng.normal(size=(200, 8)), rng.normal(size=(200, 8)), rng.integers(0, 2, 200)
    b[same == 1] = a[same == 1] + 0.8 * rng.normal(size=(int(same.sum()), 8))
    assert pair_correct(a, b, same).mean() == pytest.approx(verification_accuracy(a, b, same)["accuracy"])
    with pytest.raises(ValueError, match="n_folds"):
        pair_correct(emb1, emb2, issame, n_folds=7)


def test_verification_accuracy_uneven_folds_first_fold_is_larger():
    # 5 pairs, 2 folds -> sizes 3 and 2 (KFold). Fold 0 = pairs 0-2, fold 1 = pairs 3-4.
    # pair  d      same
    #  0    0.305  yes
    #  1    0.105  no
    #  2    2.505  no
    #  3    0.505  yes
    #  4    1.505  no
    # Fold 0 trains on 3-4: t in (0.505, 1.505] gets 2/2, first t = 0.51. Test: pair 0 (0.305)
    #   "same" right; pair 1 (0.105) "same" wrong; pair 2 "diff" right -> 2/3.
    # Fold 1 trains on 0-2: t <= 0.105 -> pairs 1, 2 right (2/3); t in (0.105, 0.305] -> pair 2
    #   only (1/3); t in (0.305, 2.505] -> pairs 0, 2 (2/3). First best t = 0.0. Test: pairs 3
    #   and 4 both "diff" -> 1/2.
    # With 2-3 folds the other way round (sizes 2, 3) the numbers differ, so this pins the split.
    emb1, emb2 = _pairs_at_distances([0.305, 0.105, 2.505, 0.505, 1.505])
    out = verification_accuracy(emb1, emb2, np.array([1, 0, 0, 1, 0]), n_folds=2)
    assert out["accuracy"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert out["std"] == pytest.approx((2 / 3 - 1 / 2) / 2)
    assert out["threshold"] == pytest.approx(0.51 / 2)


def test_verification_accuracy_perfect_separation():
    # Same pairs all at d = 0.105, different pairs in [2, 3.9]: every fold's training set picks
    # the first separating grid value t = 0.11, which also separates its test fold.
    rng = np.random.default_rng(0)
    d = np.empty(60)
    d[0::2], d[1::2] = 0.105, rng.uniform(2.0, 3.9, 30)
    emb1, emb2 = _pairs_at_distances(d.tolist())
    issame = np.tile([True, False], 30)
    out = verification_accuracy(emb1, emb2, issame, n_folds=10)
    assert out == {"accuracy": 1.0, "std": 0.0, "threshold": pytest.approx(0.11)}


def test_verification_accuracy_inverted_scores_cannot_be_flipped():
    # Same pairs are far apart (3.995), different pairs identical (0.005): every t in
    # (0.005, 3.99] gets every pair wrong, so the best grid threshold is t = 0 ("all different"),
    # which is right exactly on the different pairs: accuracy 1/2 in each fold.
    d = [3.995, 0.005] * 10
    emb1, emb2 = _pairs_at_distances(d)
    issame = np.tile([1, 0], 10)
    out = verification_accuracy(emb1, emb2, issame, n_folds=5)
    assert out["accuracy"] == pytest.approx(0.5)
    assert out["std"] == pytest.approx(0.0)
    assert out["threshold"] == 0.0


def _reference_lfw(emb1, emb2, issame, n_folds):
    """Straight transcription of the per-threshold boolean loop, with sklearn's KFold."""
    KFold = pytest.importorskip("sklearn.model_selection").KFold

    a = emb1 / np.linalg.norm(emb1, axis=1, keepdims=True)
    b = emb2 / np.linalg.norm(emb2, axis=1, keepdims=True)
    dist = np.sum((a - b) ** 2, axis=1)
    thresholds = np.arange(0, 4, 0.01)
    accs, ths = [], []
    for train, test in KFold(n_splits=n_folds, shuffle=False).split(np.arange(len(dist))):
        acc_train = [np.mean(np.less(dist[train], t) == issame[train]) for t in thresholds]
        best = thresholds[int(np.argmax(acc_train))]
        accs.append(np.mean(np.less(dist[test], best) == issame[test]))
        ths.append(best)
    return np.mean(accs), np.std(accs), np.mean(ths)


def test_verification_accuracy_matches_reference_and_is_scale_invariant():
    rng = np.random.default_rng(1)
    n, dim = 203, 8  # 203 = 10 * 20 + 3: three folds of 21
    emb1 = rng.normal(size=(n, dim))
    issame = rng.random(n) < 0.5
    noise = np.where(issame[:, None], 0.8, 3.0)
    emb2 = emb1 + noise * rng.normal(size=(n, dim))
    out = verification_accuracy(emb1, emb2, issame, n_folds=10)
    acc, std, th = _reference_lfw(emb1, emb2, issame, 10)
    assert out["accuracy"] == pytest.approx(acc)
    assert out["std"] == pytest.approx(std)
    assert out["threshold"] == pytest.approx(th)
    assert 0.6 < out["accuracy"] < 1.0  # the case is neither trivial nor hopeless
    assert verification_accuracy(7 * emb1, 7 * emb2, issame, n_folds=10) == out


@pytest.mark.parametrize(
    "emb1, emb2, issame, match",
    [
        (np.ones((4, 3)), np.ones((4, 2)), np.ones(4), "same shape"),
        (np.ones(4), np.ones(4), np.ones(4), r"\(N, D\)"),
        (np.ones((4, 3)), np.ones((4, 3)), np.ones(5), "4 were expected"),
        (np.ones((4, 3)), np.ones((4, 3)), np.array([0, 1, 2, 1]), "found 2"),
        (np.zeros((4, 3)), np.ones((4, 3)), np.ones(4), "all-zero"),
    ],
)
def test_verification_accuracy_rejects_bad_input(emb1, emb2, issame, match):
    with pytest.raises(ValueError, match=match):
        verification_accuracy(emb1, emb2, issame, n_folds=2)


def test_verification_accuracy_rejects_more_folds_than_pairs():
    emb1, emb2 = _pairs_at_distances([0.1, 2.0, 0.2])
    with pytest.raises(ValueError, match="n_folds"):
        verification_accuracy(emb1, emb2, np.array([1, 0, 1]), n_folds=4)


# ------------------------------------------------------------------------------------------
# tar_at_far
# ------------------------------------------------------------------------------------------

# 10 impostors, the top two tied at 9; 6 genuine.
_IMP = [1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
_GEN = [10, 9, 9, 8, 8, 3]


def _scores_labels(gen, imp):
    scores = np.array(list(gen) + list(imp), dtype=np.float64)
    labels = np.array([1] * len(gen) + [0] * len(imp))
    return scores, labels


def test_tar_at_far_hand_computed_with_ties():
    # far 0.05: k = floor(0.5) = 0 -> threshold = max impostor 9 -> genuine > 9: {10} -> 1/6
    # far 0.1 : k = 1. The 2nd largest impostor is 9, tied with the largest: accepting one 9
    #           would mean accepting both (FAR 0.2), so the threshold stays 9 -> 1/6
    # far 0.2 : k = 2 -> 3rd largest = 8; impostors > 8 are the two 9s (2 <= 2) -> genuine > 8:
    #           {10, 9, 9} -> 3/6
    # far 0.3 : k = 3 -> 4th largest = 7 -> genuine > 7: {10, 9, 9, 8, 8} -> 5/6
    # far 1.0 : k = 10 = n_imp -> all impostors allowed -> 1.0
    scores, labels = _scores_labels(_GEN, _IMP)
    out = tar_at_far(scores, labels, fars=(0.05, 0.1, 0.2, 0.3, 1.0))
    assert out == {0.05: 1 / 6, 0.1: 1 / 6, 0.2: 3 / 6, 0.3: 5 / 6, 1.0: 1.0}


def test_tar_at_far_order_and_label_dtype_do_not_matter():
    scores, labels = _scores_labels(_GEN, _IMP)
    perm = np.random.default_rng(0).permutation(scores.size)
    out = tar_at_far(scores[perm].astype(np.float32), labels[perm].astype(bool), fars=[0.2])
    assert out == {0.2: 0.5}


def test_tar_at_far_below_one_impostor_uses_max_impostor():
    # 1000 impostors in 0..0.999, far = 1e-4 -> far * n_imp = 0.1 < 1 -> threshold = 0.999.
    imp = np.arange(1000) / 1000
    gen = np.array([0.9995, 0.999, 1.2, 0.5])  # 0.9995 and 1.2 pass
    scores, labels = _scores_labels(gen, imp)
    assert tar_at_far(scores, labels, fars=[1e-4]) == {1e-4: 0.5}
    assert tar_at_far(scores, labels, fars=[0.0]) == {0.0: 0.5}


def test_tar_at_far_reads_far_as_a_decimal():
    # 0.29 * 100 = 28.999999999999996 in floats; the 29 allowed false accepts are meant.
    # Impostors 0..99: k = 29 -> threshold = 30th largest = 70 -> genuine > 70.
    # With k = 28 the threshold would be 71 and the genuine score 71 would be lost.
    imp = np.arange(100)
    gen = np.array([71, 70])
    scores, labels = _scores_labels(gen, imp)
    assert tar_at_far(scores, labels, fars=[0.29]) == {0.29: 0.5}


def _brute_force_tar(gen, imp, far):
    """Best TAR over every impostor-valued threshold (and -inf) whose false accepts fit in far."""
    allowed = math.floor(Fraction(str(far)) * len(imp))
    best = 0.0
    for t in np.concatenate([[-np.inf], np.unique(imp)]):
        if np.sum(imp > t) <= allowed:
            best = max(best, float(np.mean(gen > t)))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tar_at_far_matches_brute_force_on_heavy_ties(seed):
    rng = np.random.default_rng(seed)
    imp = rng.integers(0, 12, size=997).astype(np.float64)  # ~83 copies of each value
    gen = rng.integers(6, 20, size=311).astype(np.float64)
    scores, labels = _scores_labels(gen, imp)
    fars = (1e-4, 1e-3, 0.005, 0.01, 0.05, 0.1, 0.17, 0.3, 0.5, 0.9, 1.0)
    out = tar_at_far(scores, labels, fars=fars)
    for far in fars:
        assert out[far] == pytest.approx(_brute_force_tar(gen, imp, far)), far


@pytest.mark.parametrize("seed", [0, 1])
def test_tar_at_far_is_the_exact_roc_read_at_the_last_point_within_k_false_accepts(seed):
    # the order statistic and the full curve agree, ties included (the curve is slower, not different)
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 30, size=1_500).astype(np.float64)
    labels = (rng.random(1_500) < 0.3).astype(int)
    fars = (0.0, 1e-3, 0.01, 0.05, 0.2, 0.5, 0.99, 1.0)
    out = tar_at_far(scores, labels, fars=fars)
    fpr, tpr, _ = roc_curve(scores, labels, max_points=10_000)
    n_imp = int((labels == 0).sum())
    false_accepts = np.rint(fpr * n_imp)
    for far in fars:
        k = math.floor(Fraction(str(far)) * n_imp)
        assert out[far] == tpr[np.searchsorted(false_accepts, k, side="right") - 1], far


def test_tar_at_far_matches_brute_force_on_continuous_scores():
    rng = np.random.default_rng(3)
    imp = rng.normal(0.0, 0.1, size=20_000)
    gen = rng.normal(0.4, 0.15, size=2_000)
    scores, labels = _scores_labels(gen, imp)
    fars = (1e-4, 1e-3, 1e-2)
    out = tar_at_far(scores, labels, fars=fars)
    for far in fars:
        k = math.floor(far * imp.size + 1e-9)
        threshold = np.sort(imp)[::-1][k]  # (k+1)-th largest
        assert out[far] == np.mean(gen > threshold)


def test_tar_at_far_requires_both_classes_and_valid_far():
    with pytest.raises(ValueError, match="impostor"):
        tar_at_far(np.array([0.1, 0.2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="genuine"):
        tar_at_far(np.array([0.1, 0.2]), np.array([0, 0]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tar_at_far(np.array([0.1, 0.2]), np.array([0, 1]), fars=[1.5])
    with pytest.raises(ValueError, match="non-finite"):
        tar_at_far(np.array([np.nan, 0.2]), np.array([0, 1]))


# ------------------------------------------------------------------------------------------
# roc_curve
# ------------------------------------------------------------------------------------------


def test_roc_curve_small_is_exact():
    # scores 3 (gen), 2 (imp), 2 (gen), 1 (imp); accept iff score >= threshold:
    # thr inf: (0, 0); thr 3: (0, 1/2); thr 2: (1/2, 1); thr 1: (1, 1)
    fpr, tpr, thr = roc_curve(np.array([3.0, 2.0, 2.0, 1.0]), np.array([1, 0, 1, 0]))
    np.testing.assert_allclose(fpr, [0, 0, 0.5, 1])
    np.testing.assert_allclose(tpr, [0, 0.5, 1, 1])
    np.testing.assert_array_equal(thr, [np.inf, 3, 2, 1])


def test_roc_curve_downsampled_is_monotone_on_curve_and_covers_low_far():
    sk_roc_curve = pytest.importorskip("sklearn.metrics").roc_curve

    rng = np.random.default_rng(4)
    n_imp, n_gen = 100_000, 5_000
    scores = np.concatenate([rng.normal(0.4, 0.15, n_gen), rng.normal(0.0, 0.1, n_imp)])
    labels = np.r_[np.ones(n_gen, int), np.zeros(n_imp, int)]
    fpr, tpr, thr = roc_curve(scores, labels, max_points=500)

    assert 100 < fpr.size <= 500
    assert (fpr[0], tpr[0]) == (0.0, 0.0) and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0) and np.all(np.diff(thr) <= 0)
    assert np.any((fpr >= 1e-4) & (fpr <= 2e-4))  # the low-FAR end of the plot has points
    assert np.sum((fpr > 0) & (fpr < 1e-3)) >= 20

    exact_fpr, exact_tpr, exact_thr = sk_roc_curve(labels, scores, drop_intermediate=False)
    at = np.searchsorted(-exact_thr, -thr)  # sklearn's thresholds are decreasing
    np.testing.assert_array_equal(exact_thr[at], thr)
    np.testing.assert_allclose(exact_fpr[at], fpr)
    np.testing.assert_allclose(exact_tpr[at], tpr)
    # at each FAR the highest TAR is kept, e.g. the top of the vertical run at FAR 0
    assert tpr[fpr == 0].max() == exact_tpr[exact_fpr == 0].max() > 0


def test_roc_curve_with_ties_ends_at_one_one():
    rng = np.random.default_rng(5)
    scores = rng.integers(0, 50, 5_000).astype(float)
    labels = rng.integers(0, 2, 5_000)
    fpr, tpr, thr = roc_curve(scores, labels, max_points=10)
    assert fpr.size <= 10 and (fpr[-1], tpr[-1]) == (1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert thr[-1] == scores.min()


# ------------------------------------------------------------------------------------------
# identification_rank
# ------------------------------------------------------------------------------------------


def test_identification_rank_hand_made_gallery():
    # Gallery identities at angles: "a" 0 deg, "b" 75 deg, "c" 45 deg, "d" 60 deg.
    # Probe A ("a") at 5 deg: angular gaps a 5, c 40, d 55, b 70 -> rank 1.
    # Probe B ("b") at 40 deg: gaps c 5, d 20, b 35, a 40 -> rank 3.
    # rank-1 = 1/2, rank-5 = 2/2 (rank 5 exceeds the 4 identities).
    gallery = np.array([_unit(0), _unit(75), _unit(45), _unit(60)])
    gallery_labels = np.array(["a", "b", "c", "d"])
    probe = np.array([_unit(5), _unit(40)])
    probe_labels = np.array(["a", "b"])
    assert identification_rank(probe, probe_labels, gallery, gallery_labels) == {1: 0.5, 5: 1.0}
    out = identification_rank(probe, probe_labels, gallery, gallery_labels, ranks=(1, 2, 3, 4))
    assert out == {1: 0.5, 2: 0.5, 3: 1.0, 4: 1.0}
    # scale of either side does not matter (cosine)
    assert identification_rank(3 * probe, probe_labels, 0.5 * gallery, gallery_labels, ranks=(2, 3)) == {
        2: 0.5,
        3: 1.0,
    }


def test_identification_rank_counts_identities_not_entries():
    # Probe (id 1) at 0 deg. Identity 2 has three entries at 10, 15, 20 deg, all closer than
    # identity 1 at 40 deg; identity 0 is at 90 deg. Entry-wise the probe would be rank 4;
    # identity-wise it is rank 2.
    gallery = np.array([_unit(10), _unit(40), _unit(15), _unit(90), _unit(20)])
    gallery_labels = np.array([2, 1, 2, 0, 2])
    probe = np.array([_unit(0)])
    out = identification_rank(probe, np.array([1]), gallery, gallery_labels, ranks=(1, 2, 3))
    assert out == {1: 0.0, 2: 1.0, 3: 1.0}
    # a second entry of identity 1 at 5 deg makes it rank 1
    gallery2 = np.vstack([gallery, [_unit(5)]])
    labels2 = np.r_[gallery_labels, 1]
    out2 = identification_rank(probe, np.array([1]), gallery2, labels2, ranks=(1,))
    assert out2 == {1: 1.0}


def test_identification_rank_ties_count_against_the_probe():
    gallery = np.ones((3, 4))
    probe = np.ones((2, 4))
    out = identification_rank(probe, np.array([0, 2]), gallery, np.array([0, 1, 2]), ranks=(1, 3))
    assert out == {1: 0.0, 3: 1.0}


def _reference_ranks(probe, probe_labels, gallery, gallery_labels):
    p = probe / np.linalg.norm(probe, axis=1, keepdims=True)
    g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    sim = p @ g.T
    ranks = []
    for i in range(len(p)):
        seen = []
        for j in np.argsort(-sim[i]):
            if gallery_labels[j] not in seen:
                seen.append(gallery_labels[j])
            if gallery_labels[j] == probe_labels[i]:
                ranks.append(len(seen))
                break
    return np.array(ranks)


def test_identification_rank_batched_matches_reference(monkeypatch):
    rng = np.random.default_rng(6)
    centers = rng.normal(size=(40, 16))
    gallery_labels = rng.integers(0, 40, 120)
    gallery_labels[:40] = np.arange(40)  # every identity present
    gallery = centers[gallery_labels] + 0.9 * rng.normal(size=(120, 16))
    probe_labels = rng.integers(0, 40, 77)
    probe = centers[probe_labels] + 0.9 * rng.normal(size=(77, 16))
    ref = _reference_ranks(probe, probe_labels, gallery, gallery_labels)
    expected = {r: float(np.mean(ref <= r)) for r in (1, 2, 5, 10)}
    assert 0.2 < expected[1] < 1.0

    full = identification_rank(probe, probe_labels, gallery, gallery_labels, ranks=(1, 2, 5, 10))
    monkeypatch.setattr(identification, "_BATCH_ELEMENTS", 7 * 120)  # 7 probes per block
    batched = identification_rank(probe, probe_labels, gallery, gallery_labels, ranks=(1, 2, 5, 10))
    assert full == pytest.approx(expected)
    assert batched == full


def test_identification_rank_missing_identity_raises():
    gallery = np.array([_unit(0), _unit(90)])
    with pytest.raises(ValueError, match=r"absent from the gallery.*\[99\]"):
        identification_rank(np.array([_unit(1), _unit(2)]), np.array([0, 99]), gallery, np.array([0, 1]))


def test_identification_rank_dimension_mismatch_raises():
    with pytest.raises(ValueError, match="dimension"):
        identification_rank(np.ones((2, 3)), np.array([0, 1]), np.ones((2, 4)), np.array([0, 1]))


# ------------------------------------------------------------------------------------------
# template_features and pair_scores
# ------------------------------------------------------------------------------------------


def test_template_features_media_mean_first():
    # Template 7: media 1 holds (3,0), (0,0.5), (2,0) -> unit (1,0), (0,1), (1,0) -> mean (2/3, 1/3)
    #             media 2 holds (0,4)                   -> unit (0,1)               -> mean (0, 1)
    #             mean of media means = (1/3, 2/3)      -> normalised (1, 2) / sqrt(5)
    #             (image-wise it would be (1/2, 1/2)    -> (1, 1) / sqrt(2))
    # Template 3: media 1 (same id, other template) holds (0,-2) -> (0, -1)
    features = np.array([[3, 0], [0, 0.5], [0, -2], [2, 0], [0, 4]])
    template_ids = np.array([7, 7, 3, 7, 7])
    media_ids = np.array([1, 1, 1, 1, 2])
    ids, feats = template_features(features, template_ids, media_ids)
    np.testing.assert_array_equal(ids, [3, 7])
    np.testing.assert_allclose(feats, [[0, -1], [1 / math.sqrt(5), 2 / math.sqrt(5)]])

    ids, feats = template_features(features, template_ids)  # each image its own media
    np.testing.assert_array_equal(ids, [3, 7])
    np.testing.assert_allclose(feats, [[0, -1], [1 / math.sqrt(2), 1 / math.sqrt(2)]])


def test_template_features_rejects_bad_input():
    with pytest.raises(ValueError, match="template_ids"):
        template_features(np.ones((3, 2)), np.array([0, 1]))
    with pytest.raises(ValueError, match="zero vector"):
        template_features(np.array([[1.0, 0.0], [-1.0, 0.0]]), np.array([5, 5]))


def test_pair_scores_rowwise_cosine():
    a = np.array([[1.0, 0.0], [2.0, 2.0], [0.0, 3.0]])
    b = np.array([[5.0, 0.0], [0.0, -1.0], [0.0, -0.1]])
    np.testing.assert_allclose(pair_scores(a, b), [1.0, -1 / math.sqrt(2), -1.0])
    with pytest.raises(ValueError, match="same shape"):
        pair_scores(a, b[:2])
