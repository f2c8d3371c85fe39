"""cluster_accuracy / nearest_neighbor_consistency (ml/eval/metrics/clustering.py) against hand-computed values,
and the clustering baselines (ml/discovery/baselines.py) that they score."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ml.discovery.baselines import agglomerative_baseline, best_of, dbscan_baseline, kmeans_baseline
from ml.errors import ConfigError, DataError
from ml.eval.metrics import cluster_accuracy, cluster_correct, clustering, nearest_neighbor_consistency


# ------------------------------------------------------------------------------------------
# cluster_accuracy
# ------------------------------------------------------------------------------------------


def test_one_matching_over_all_classes_hand_worked():
    # Class 0 is known (points 0-2), class 1 novel (points 3-5). Cluster 4 holds two class-0 and three
    # class-1 points, cluster 8 one class-0 point:
    #            class 0  class 1
    #   c4         2        3
    #   c8         1        0
    # Matchings: {c4->1, c8->0} = 3 + 1 = 4, {c4->0, c8->1} = 2 + 0 = 2, so c4->1, c8->0.
    # all = 4/6; known: only point 2 (c8->0) is right = 1/3; novel: points 3-5 all right = 1.
    # (Matching the known points alone would pick c4->0 and give 2/3: the v2 matching is global.)
    y_true = np.array([0, 0, 0, 1, 1, 1])
    y_pred = np.array([4, 4, 8, 4, 4, 4])
    known = np.array([True, True, True, False, False, False])
    acc = cluster_accuracy(y_true, y_pred, known)
    assert acc == {"all": pytest.approx(4 / 6), "known": pytest.approx(1 / 3), "novel": pytest.approx(1.0)}


def test_per_point_outcomes_follow_the_same_global_matching():
    # The hand-worked example above: c4->1, c8->0, so points 0 and 1 (class 0 in c4) are wrong, the rest right.
    y_true = np.array([0, 0, 0, 1, 1, 1])
    y_pred = np.array([4, 4, 8, 4, 4, 4])
    assert cluster_correct(y_true, y_pred).tolist() == [False, False, True, True, True, True]
    # More clusters than classes: the unmatched cluster (9) is wrong for its point.
    assert cluster_correct(np.array([0, 0, 1, 1]), np.array([5, 5, 6, 9])).tolist() == [True, True, True, False]


def test_arbitrary_ids_and_relabelling_invariance():
    y_true = np.array([0, 0, 1, 1, 2, 2])
    y_pred = np.array([1, 1, 2, 2, 0, 0])  # a perfect clustering under another naming
    known = np.array([True, True, True, True, False, False])
    assert cluster_accuracy(y_true, y_pred, known) == {"all": 1.0, "known": 1.0, "novel": 1.0}
    # string classes and negative / sparse cluster ids
    names = np.array(["ann", "ann", "bob", "bob", "cy", "cy"])
    assert cluster_accuracy(names, np.array([-7, -7, 100, 100, 3, 3]), known)["all"] == 1.0


def test_more_clusters_than_classes():
    # 2 classes, 3 clusters: c0 = {0, 0}, c1 = {0, 1}, c2 = {1}. Best: c0->0 (2) + c1->1 or c2->1 (1) = 3.
    # The third cluster is unmatched, so its point is wrong: all = 3/5.
    y_true = np.array([0, 0, 0, 1, 1])
    y_pred = np.array([0, 0, 1, 1, 2])
    known = np.array([True, True, True, False, False])
    acc = cluster_accuracy(y_true, y_pred, known)
    assert acc["all"] == pytest.approx(3 / 5)
    assert acc["known"] == pytest.approx(2 / 3)  # point 2 (class 0 in c1) is wrong either way
    assert acc["novel"] == pytest.approx(1 / 2)  # one of points 3, 4 is in the matched cluster


def test_fewer_clusters_than_classes():
    # 3 classes, 1 cluster holding everything: it matches the largest class (1, three points).
    y_true = np.array([0, 1, 1, 1, 2, 2])
    y_pred = np.zeros(6, dtype=int)
    known = np.array([True, True, True, True, False, False])
    acc = cluster_accuracy(y_true, y_pred, known)
    assert acc["all"] == pytest.approx(3 / 6)
    assert acc["known"] == pytest.approx(3 / 4)
    assert acc["novel"] == 0.0


def test_empty_subset_is_nan():
    acc = cluster_accuracy(np.array([0, 1]), np.array([5, 6]), np.array([True, True]))
    assert acc["all"] == 1.0 and acc["known"] == 1.0 and math.isnan(acc["novel"])


def test_matches_brute_force_over_permutations():
    from itertools import permutations

    rng = np.random.default_rng(0)
    y_true = rng.integers(0, 4, 40)
    y_pred = rng.integers(0, 4, 40)
    known = y_true < 2
    best = max(sum(int(p[c] == t) for c, t in zip(y_pred, y_true)) for p in permutations(range(4)))
    assert cluster_accuracy(y_true, y_pred, known)["all"] == pytest.approx(best / 40)


@pytest.mark.parametrize(
    ("y_pred", "known", "match"),
    [
        (np.zeros(5, dtype=int), np.ones(6, dtype=bool), r"y_pred has 5 entries but 6"),
        (np.zeros(6, dtype=int), np.ones(5, dtype=bool), r"known_mask has 5 entries but 6"),
        (np.zeros(6, dtype=int), np.ones(6, dtype=int), r"known_mask must be boolean"),
    ],
)
def test_cluster_accuracy_rejects_bad_input(y_pred, known, match):
    with pytest.raises(ValueError, match=match):
        cluster_accuracy(np.arange(6), y_pred, known)


# ------------------------------------------------------------------------------------------
# nearest_neighbor_consistency
# ------------------------------------------------------------------------------------------


def _at_degrees(*degrees: float) -> np.ndarray:
    rad = np.radians(degrees)
    return np.stack([np.cos(rad), np.sin(rad)], axis=1)


def test_nnc_hand_worked():
    # points at 0, 10, 90, 100 degrees. Nearest neighbours (cosine): 0<->10, 90<->100.
    emb = _at_degrees(0, 10, 90, 100)
    assert nearest_neighbor_consistency(emb, np.array([0, 0, 1, 1]), k=1) == 1.0
    # labels [0, 1, 1, 1]: 0 and 10 disagree (0 each), 90 and 100 agree (1 each) → 2/4
    assert nearest_neighbor_consistency(emb, np.array([0, 1, 1, 1]), k=1) == 0.5
    # k=2: 0° → {10°, 90°} (cos 0 > cos 100), 10° → {0°, 90°}, 90° → {100°, 10°}, 100° → {90°, 10°};
    # with labels [0, 0, 1, 1] each point has one same-label neighbour of two → 1/2
    assert nearest_neighbor_consistency(emb, np.array([0, 0, 1, 1]), k=2) == 0.5


def test_nnc_is_cosine_not_euclidean_and_excludes_self():
    # point 1 is point 0 scaled by 100: cosine neighbours, far apart in Euclidean distance
    emb = np.array([[1.0, 0.0], [100.0, 1.0], [0.0, 1.0], [0.1, 1.0]])
    assert nearest_neighbor_consistency(emb, np.array([0, 0, 1, 1]), k=1) == 1.0
    # duplicates at different rows are each other's neighbour and self is never counted: rows 0 and 1
    # (labels 0, 1) see each other (0 each), rows 2 and 3 agree (1 each) → 1/2; counting self gives 1
    dup = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.1, 1.0]])
    assert nearest_neighbor_consistency(dup, np.array([0, 1, 1, 1]), k=1) == 0.5


def test_nnc_batched_equals_one_block(monkeypatch):
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(50, 8))
    labels = rng.integers(0, 3, 50)
    whole = nearest_neighbor_consistency(emb, labels, k=5)
    monkeypatch.setattr(clustering, "_BATCH_ELEMENTS", 50 * 3)  # 3 rows per block
    assert nearest_neighbor_consistency(emb, labels, k=5) == whole
    # brute force
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    nbrs = np.argsort(-sim, axis=1)[:, :5]
    assert whole == pytest.approx(np.mean(labels[nbrs] == labels[:, None]))


@pytest.mark.parametrize(("k", "error"), [(0, ConfigError), (4, ConfigError), (1.5, ConfigError)])
def test_nnc_rejects_bad_k(k, error):
    with pytest.raises(error, match=r"k must be an integer in \[1, 3\]"):
        nearest_neighbor_consistency(np.eye(4), np.arange(4), k=k)


def test_nnc_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"pred_labels has 3 entries but 4"):
        nearest_neighbor_consistency(np.eye(4), np.arange(3), k=1)
    with pytest.raises(ValueError, match=r"embeddings must be a non-empty \(N, D\)"):
        nearest_neighbor_consistency(np.ones(4), np.arange(4), k=1)


# ------------------------------------------------------------------------------------------
# baselines
# ------------------------------------------------------------------------------------------


def _directions(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """4 classes around 4 orthogonal directions in 8-D, 10 points each, at varied norms."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(4), 10)
    x = np.eye(8)[y] + rng.normal(0.0, 0.05, (40, 8))
    return x * rng.uniform(0.5, 5.0, (40, 1)), y  # norms must not matter: features are L2-normalised


def test_kmeans_and_agglomerative_recover_directions():
    x, y = _directions()
    known = y < 2
    assert cluster_accuracy(y, kmeans_baseline(x, 4, seed=0), known)["all"] == 1.0
    preds = agglomerative_baseline(x, 4)
    assert list(preds) == ["ward", "average", "complete", "single"]
    key, pred, acc = best_of(preds, y, known)
    assert key == "ward" and acc["all"] == 1.0 and pred is preds["ward"]


def test_best_of_picks_highest_all_accuracy():
    y = np.array([0, 0, 1, 1])
    known = np.array([True, True, False, False])
    preds = {"bad": np.array([0, 1, 0, 1]), "good": np.array([3, 3, 4, 4]), "also": np.array([5, 5, 6, 6])}
    key, _, acc = best_of(preds, y, known)
    assert key == "good" and acc["all"] == 1.0  # first of the tied best


def test_dbscan_noise_points_become_singletons():
    x, y = _directions()
    x = np.vstack([x, -np.ones((1, 8))])  # an isolated point, noise for min_samples = 3
    y = np.append(y, 9)
    preds = dbscan_baseline(x, eps_grid=[0.3], min_samples_grid=[3])
    pred = preds[(0.3, 3)]
    assert pred.min() >= 0  # no -1 left
    assert np.unique(pred).size == 5  # 4 direction clusters + the singleton
    assert cluster_accuracy(y, pred, y < 2)["all"] == 1.0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: kmeans_baseline(x, 0), ConfigError, r"k must be an integer in \[1, 40\]"),
        (lambda x: agglomerative_baseline(x, 4, linkages=["median"]), ConfigError, r"unknown linkage 'median'"),
        (lambda x: dbscan_baseline(x, [0.0], [3]), ConfigError, r"each eps must be > 0"),
        (lambda x: kmeans_baseline(x[:, :, None], 2), DataError, r"2-D \(N, D\)"),
        (lambda x: best_of({}, np.zeros(1), np.ones(1, bool)), ConfigError, r"preds is empty"),
    ],
)
def test_baselines_reject_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(_directions()[0])
