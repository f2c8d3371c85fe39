"""Clustering metrics of generalized face discovery.

* ``cluster_accuracy`` - generalized category discovery accuracy, All / Known / Novel, with one
  Hungarian matching over all classes (Vaze et al., "Generalized Category Discovery", CVPR 2022,
  ``split_cluster_acc_v2``), as FaceGCD reports it; ``cluster_correct`` gives each point's outcome
  under that matching.
* ``nearest_neighbor_consistency`` - share of the k cosine nearest neighbours with the same
  predicted label (FaceGCD, Appendix C.1).

Differences from the reference:

* ``cluster_accuracy`` matches the rectangular clusters x classes count matrix directly instead of
  padding it to a square of side max(id) + 1; the matching value is the same, and ids need not be
  small non-negative integers. An empty Known or Novel subset gives nan (the reference divides by 0).
* ``nearest_neighbor_consistency``: the paper does not name the neighbour metric; cosine similarity
  on L2-normalised embeddings is used, the point itself excluded.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment

from ml.errors import ConfigError, DataError
from ml.eval.metrics._common import _BATCH_ELEMENTS, _as_matrix, _as_vector, _l2_normalize


def cluster_accuracy(y_true: np.ndarray, y_pred: np.ndarray, known_mask: np.ndarray) -> dict[str, float]:
    """Clustering accuracy with one Hungarian matching over all classes (the GCD "v2" All / Known / Novel).

    With W[c, t] = #{i : y_pred_i = c, y_true_i = t} (clusters x classes), the cluster-to-class map m
    is the one-to-one matching maximising sum_c W[c, m(c)] (``scipy.optimize.linear_sum_assignment``
    on the rectangular W; clusters or classes left unmatched are wrong for all their points). Then

        acc(S) = #{i in S : m(y_pred_i) = y_true_i} / |S|

    for S = all points (``"all"``), points with ``known_mask`` True (``"known"``) and points with it
    False (``"novel"``). The matching is computed once on all points and shared by the three subsets,
    so known and novel accuracies add up, weighted by subset size, to ``"all"``. An empty subset
    gives nan. Ids of either kind may be any integers (or other sortable values) and the numbers of
    clusters and classes may differ. W is dense: memory is n_clusters * n_classes int64.

    Source: Vaze et al., "Generalized Category Discovery", CVPR 2022, ``split_cluster_acc_v2``;
    FaceGCD reports it for All / Known / Novel identities.

    Args:
        y_true: (N,) true class of each point.
        y_pred: (N,) predicted cluster of each point.
        known_mask: (N,) bool, True where the point's true class is a known (labelled) class.

    Returns:
        ``{"all": acc, "known": acc, "novel": acc}``, each in [0, 1] or nan.
    """
    y_true = _as_vector(y_true, "y_true")
    if y_true.shape[0] == 0:
        raise DataError("y_true is empty; cluster accuracy needs at least one point")
    y_pred = _as_vector(y_pred, "y_pred", y_true.shape[0])
    known = _as_vector(known_mask, "known_mask", y_true.shape[0])
    if known.dtype != bool:
        raise DataError(f"known_mask must be boolean (True = known class); got dtype {known.dtype}")

    correct = cluster_correct(y_true, y_pred)

    def acc(subset: np.ndarray) -> float:
        return float(correct[subset].mean()) if subset.any() else math.nan

    return {"all": float(correct.mean()), "known": acc(known), "novel": acc(~known)}


def cluster_correct(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """Each point's outcome under ``cluster_accuracy``'s matching: (N,) bool, True where the class matched to the
    point's cluster is its own, so ``cluster_correct(...).mean()`` is ``cluster_accuracy(...)["all"]``. What a
    bootstrap over points resamples (the matching held fixed)."""
    y_true = _as_vector(y_true, "y_true")
    y_pred = _as_vector(y_pred, "y_pred", y_true.shape[0])
    classes, t = np.unique(y_true, return_inverse=True)  # t: (N,) in 0..T-1
    clusters, c = np.unique(y_pred, return_inverse=True)  # c: (N,) in 0..C-1
    w = np.bincount(c * classes.size + t, minlength=clusters.size * classes.size)
    w = w.reshape(clusters.size, classes.size)  # (C, T) contingency
    rows, cols = linear_sum_assignment(w, maximize=True)
    mapped = np.full(clusters.size, -1, dtype=np.int64)  # class index of each cluster; -1 unmatched
    mapped[rows] = cols
    return mapped[c] == t


def nearest_neighbor_consistency(embeddings: np.ndarray, pred_labels: np.ndarray, k: int) -> float:
    """Nearest-neighbour consistency (NNC): the mean share of each point's k neighbours sharing its label.

        NNC = (1/N) sum_i (1/k) sum_{j in N_k(i)} 1[yhat_j = yhat_i]

    N_k(i) are the k rows with the highest cosine similarity to row i (L2-normalised embeddings),
    row i itself excluded (a duplicate of i at another row is a neighbour). Ties at the k-th
    similarity are broken arbitrarily (``np.argpartition``). Similarities are computed in row blocks of
    at most ``_BATCH_ELEMENTS`` entries, so 100k points never hold an N x N matrix.

    Source: FaceGCD (Appendix C.1, "Separability Metric").

    Args:
        embeddings: (N, D) features; rows must be non-zero.
        pred_labels: (N,) predicted label (cluster) of each point.
        k: neighbours per point, 1 <= k < N.

    Returns:
        NNC in [0, 1].
    """
    emb = _as_matrix(embeddings, "embeddings")
    n = emb.shape[0]
    labels = _as_vector(pred_labels, "pred_labels", n)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < n:
        raise ConfigError(f"k must be an integer in [1, {n - 1}] (neighbours besides the point itself); got {k!r}")
    k = int(k)
    unit = _l2_normalize(emb.astype(np.result_type(emb.dtype, np.float32), copy=False), "embeddings")
    _, ids = np.unique(labels, return_inverse=True)  # (N,) label index

    same = 0
    batch = max(1, _BATCH_ELEMENTS // n)
    for lo in range(0, n, batch):
        sim = unit[lo : lo + batch] @ unit.T  # (B, N) cosine similarities
        rows = np.arange(sim.shape[0])
        sim[rows, lo + rows] = -np.inf  # the point is not its own neighbour
        nbrs = np.argpartition(-sim, k - 1, axis=1)[:, :k]  # (B, k) k most similar rows
        same += int(np.count_nonzero(ids[nbrs] == ids[lo : lo + sim.shape[0], None]))
    return same / (n * k)
