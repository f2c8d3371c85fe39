"""Semi-supervised k-means (ml/discovery/ssk.py): recovery, fixed labelled points, determinism, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ml.discovery.ssk import semi_supervised_kmeans
from ml.errors import ConfigError, DataError
from ml.eval.metrics import cluster_accuracy


pytestmark = pytest.mark.usefixtures("one_thread")


def _blobs(n_classes: int = 6, per_class: int = 40, dim: int = 16, spread: float = 10.0, noise: float = 0.5,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs: centres ~ N(0, spread^2) per dimension, points ~ N(centre, noise^2). → (x (N, D), y (N,))."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, spread, (n_classes, dim))
    y = np.repeat(np.arange(n_classes), per_class)
    x = centres[y] + rng.normal(0.0, noise, (y.size, dim))
    return x.astype(np.float32), y


def _half_of_known(y: np.ndarray, n_known: int) -> np.ndarray:
    """Every other point of classes < n_known is labelled."""
    return (y < n_known) & (np.arange(y.size) % 2 == 0)


def test_recovers_separated_blobs_with_known_clusters_first():
    x, y = _blobs()
    # known classes 10, 20, 30 (ids not 0..2) sorted → clusters 0, 1, 2; novel classes 40, 50, 60
    y_ids = (y + 1) * 10
    mask = _half_of_known(y, 3)
    result = semi_supervised_kmeans(x, y_ids, mask, 6, n_init=3, seed=0)

    assert result.labels.dtype == np.int64 and result.labels.shape == (x.shape[0],)
    assert result.centroids.shape == (6, 16) and result.centroids.dtype == np.float32
    np.testing.assert_array_equal(result.known_classes, [10, 20, 30])
    assert cluster_accuracy(y, result.labels, y < 3) == {"all": 1.0, "known": 1.0, "novel": 1.0}
    # unlabelled points of known class j land in cluster j itself, not just in some matched cluster
    np.testing.assert_array_equal(result.labels[y < 3], y[y < 3])
    # inertia is sum ||x - c_label||^2 over all points
    diff = x.astype(np.float64) - result.centroids[result.labels]
    assert result.inertia == pytest.approx(float((diff**2).sum()), rel=1e-4)


def test_labelled_point_inside_another_blob_keeps_its_class_cluster():
    x, y = _blobs()
    mask = _half_of_known(y, 3)
    moved = int(np.flatnonzero(mask & (y == 0))[0])
    x[moved] = x[y == 4].mean(axis=0)  # a labelled class-0 point placed in the middle of novel blob 4
    result = semi_supervised_kmeans(x, y, mask, 6, n_init=2, seed=1)

    assert result.labels[moved] == 0
    np.testing.assert_array_equal(result.labels[mask], y[mask])
    others = np.arange(y.size) != moved
    assert cluster_accuracy(y[others], result.labels[others], y[others] < 3)["all"] == 1.0


def test_deterministic_given_seed():
    x, y = _blobs(n_classes=12, noise=4.0, seed=3)  # overlapping blobs: k-means++ draws matter
    mask = _half_of_known(y, 4)
    a = semi_supervised_kmeans(x, y, mask, 12, n_init=2, seed=7)
    b = semi_supervised_kmeans(x, y, mask, 12, n_init=2, seed=7)
    np.testing.assert_array_equal(a.labels, b.labels)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert a.inertia == b.inertia and a.n_iter == b.n_iter


def test_restarts_keep_the_lowest_inertia():
    # restarts 0..n-1 are the same draws whatever n_init is. For this data and seed, restart 1 or 2 beats
    # restart 0 and restart 3 is worse than the best of 0..2 (inertias ~157k, 130k, 123k, >123k): keeping
    # the first restart fails the first assert, keeping the last one the second.
    x, y = _blobs(n_classes=20, per_class=15, noise=5.0, seed=4)
    mask = _half_of_known(y, 5)
    one, three, four = (semi_supervised_kmeans(x, y, mask, 20, n_init=n, seed=1) for n in (1, 3, 4))
    assert three.inertia < one.inertia
    assert four.inertia == three.inertia


def test_chunked_assignment_equals_unchunked():
    x, y = _blobs(n_classes=8, per_class=30, seed=5)
    mask = _half_of_known(y, 4)
    small = semi_supervised_kmeans(x, y, mask, 8, n_init=2, seed=0, batch_size=16)  # 180 unlabelled: 12 blocks
    whole = semi_supervised_kmeans(x, y, mask, 8, n_init=2, seed=0, batch_size=10**6)
    np.testing.assert_array_equal(small.labels, whole.labels)
    np.testing.assert_allclose(small.centroids, whole.centroids, rtol=1e-5, atol=1e-5)
    assert small.inertia == pytest.approx(whole.inertia, rel=1e-5)


def test_accepts_torch_tensors():
    x, y = _blobs()
    mask = _half_of_known(y, 3)
    from_numpy = semi_supervised_kmeans(x, y, mask, 6, n_init=1, seed=0)
    from_torch = semi_supervised_kmeans(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(mask), 6,
                                        n_init=1, seed=0)
    np.testing.assert_array_equal(from_numpy.labels, from_torch.labels)


def test_empty_novel_cluster_keeps_its_centroid():
    # 3 identical unlabelled points: k-means++ seeds one novel centroid on them, then (all d = 0) a
    # duplicate; ties go to the lower index, so the second novel cluster is empty from the start.
    x = np.array([[0.0, 0.0], [0.2, 0.0], [5.0, 5.0], [5.0, 5.0], [5.0, 5.0]], dtype=np.float32)
    y = np.array([0, 0, -1, -1, -1])
    mask = np.array([True, True, False, False, False])
    result = semi_supervised_kmeans(x, y, mask, 3, n_init=1, seed=0)
    assert np.isfinite(result.centroids).all()
    np.testing.assert_array_equal(result.labels, [0, 0, 1, 1, 1])
    np.testing.assert_allclose(result.centroids, [[0.1, 0.0], [5.0, 5.0], [5.0, 5.0]], atol=1e-6)


def test_max_iter_caps_iterations():
    x, y = _blobs(n_classes=12, noise=4.0, seed=3)
    result = semi_supervised_kmeans(x, y, _half_of_known(y, 4), 12, n_init=1, max_iter=1)
    assert result.n_iter == 1


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k": 2}, ConfigError, r"k=2 is smaller than the 3 known classes"),
        ({"mask": "none"}, DataError, r"plain k-means"),
        ({"x": "3d"}, DataError, r"2-D \(N, D\)"),
        ({"x": "nan"}, DataError, r"NaN/inf \(first at row 5\)"),
        ({"x": "inf"}, DataError, r"NaN/inf \(first at row 5\)"),
        ({"y": "short"}, DataError, r"labels must be a 1-D array with one entry per feature row \(240\)"),
        ({"mask": "short"}, DataError, r"labelled_mask must be a 1-D array"),
        ({"y": "negative"}, DataError, r"negative class id.*index 0: -3"),
        ({"mask": "int"}, DataError, r"labelled_mask must be boolean"),
        ({"k": 500}, DataError, r"unlabelled point\(s\) to seed"),
        ({"n_init": 0}, ConfigError, r"n_init must be an integer >= 1"),
    ],
)
def test_bad_input_raises_clear_error(change, error, match):
    x, y = _blobs()
    mask = _half_of_known(y, 3)
    k, n_init = change.get("k", 6), change.get("n_init", 1)
    if change.get("x") == "3d":
        x = x[None]
    elif change.get("x") in ("nan", "inf"):
        x[5, 3] = np.nan if change["x"] == "nan" else np.inf
    if change.get("y") == "short":
        y = y[:-1]
    elif change.get("y") == "negative":
        y = y.copy()
        y[0] = -3
    if change.get("mask") == "none":
        mask = np.zeros_like(mask)
    elif change.get("mask") == "short":
        mask = mask[:-1]
    elif change.get("mask") == "int":
        mask = mask.astype(np.int64)
    with pytest.raises(error, match=match):
        semi_supervised_kmeans(x, y, mask, k, n_init=n_init)


def test_seeding_pool_smaller_than_the_data_still_recovers_the_blobs():
    x, y = _blobs(n_classes=8, per_class=60)
    mask = _half_of_known(y, 4)
    full = semi_supervised_kmeans(x, y, mask, 8, n_init=3, seed=0, init_pool=0)
    pooled = semi_supervised_kmeans(x, y, mask, 8, n_init=3, seed=0, init_pool=40)
    big = semi_supervised_kmeans(x, y, mask, 8, n_init=3, seed=0, init_pool=10_000)
    assert cluster_accuracy(y, pooled.labels, y < 4)["all"] == 1.0
    # a pool at least as large as the unlabelled set is no pool at all
    np.testing.assert_array_equal(big.labels, full.labels)
    with pytest.raises(ConfigError, match="init_pool"):
        semi_supervised_kmeans(x, y, mask, 8, init_pool=-1)
