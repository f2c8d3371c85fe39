"""Pair verification: the LFW-style k-fold accuracy, TAR at fixed FAR, the ROC, and rowwise cosine scores.

* ``verification_accuracy`` - the 10-fold pair accuracy of InsightFace's ``eval/verification.py``
  (``calculate_roc``, from FaceNet's ``lfw.py``; Huang et al., LFW tech. report 07-49, 2007).
* ``tar_at_far`` / ``roc_curve`` - true accept rate at a fixed false accept rate, the IJB-B/C 1:1 protocol
  (Whitelam et al., CVPRW 2017; Maze et al., ICB 2018). ``pair_correct``: each pair right or wrong;
  ``pair_scores``: rowwise cosine similarity.

Differences from the reference:

* ``verification_accuracy`` counts correct predictions with sorted distances and ``searchsorted`` (same counts,
  first-best tie rule and folds), also returns the mean of the per-fold best thresholds, and omits the PCA step.
* ``tar_at_far`` reads the operating point from the impostor order statistic (``np.partition``) instead of
  interpolating ``sklearn.metrics.roc_curve``: exact, and the threshold is an observed impostor score.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.metrics import roc_curve as sk_roc_curve

from ml.eval.metrics._common import _allowed_false_accepts, _as_binary, _as_matrix, _as_vector, _l2_normalize


def _kfold_bounds(n: int, n_folds: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) test folds; the first ``n % n_folds`` are one larger (sklearn KFold)."""
    sizes = np.full(n_folds, n // n_folds, dtype=np.int64)
    sizes[: n % n_folds] += 1
    stops = np.cumsum(sizes)
    return [(int(stop - size), int(stop)) for size, stop in zip(sizes, stops)]


def _correct_counts(dist: np.ndarray, same: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Correct predictions per threshold when predicting "same" iff ``dist < threshold``."""
    d_same = np.sort(dist[same])
    d_diff = np.sort(dist[~same])
    true_accepts = np.searchsorted(d_same, thresholds, side="left")  # same pairs with d < t
    true_rejects = d_diff.size - np.searchsorted(d_diff, thresholds, side="left")  # diff with d >= t
    return true_accepts + true_rejects


def _pair_distances(emb1: np.ndarray, emb2: np.ndarray, issame: np.ndarray,
                    n_folds: int) -> tuple[np.ndarray, np.ndarray]:
    """(squared distances of the L2-normalised pairs, same mask), the inputs checked."""
    emb1 = _as_matrix(emb1, "emb1")
    emb2 = _as_matrix(emb2, "emb2")
    if emb1.shape != emb2.shape:
        raise ValueError(f"emb1 and emb2 must have the same shape; got {emb1.shape} and {emb2.shape}")
    n = emb1.shape[0]
    same = _as_binary(issame, "issame", n)
    is_int = isinstance(n_folds, (int, np.integer)) and not isinstance(n_folds, bool)
    if not is_int or not 2 <= n_folds <= n:
        raise ValueError(
            f"n_folds must be an integer in [2, {n}] (the number of pairs); got {n_folds!r}"
        )
    a = _l2_normalize(emb1.astype(np.float64, copy=False), "emb1")
    b = _l2_normalize(emb2.astype(np.float64, copy=False), "emb2")
    return np.sum(np.square(a - b), axis=1), same  # (N,) in [0, 4]


def _fold_decisions(dist: np.ndarray, same: np.ndarray, n_folds: int) -> tuple[np.ndarray, list[float]]:
    """(N,) bool, each pair right or wrong at its fold's threshold (chosen on the other folds), and the thresholds."""
    n = dist.shape[0]
    thresholds = np.arange(0, 4, 0.01)  # 400 candidates, the reference grid
    correct = np.zeros(n, dtype=bool)
    best_thresholds = []
    for start, stop in _kfold_bounds(n, int(n_folds)):
        test = np.zeros(n, dtype=bool)
        test[start:stop] = True
        train_correct = _correct_counts(dist[~test], same[~test], thresholds)
        best = float(thresholds[int(np.argmax(train_correct))])
        correct[start:stop] = (dist[start:stop] < best) == same[start:stop]
        best_thresholds.append(best)
    return correct, best_thresholds


def verification_accuracy(
    emb1: np.ndarray, emb2: np.ndarray, issame: np.ndarray, n_folds: int = 10
) -> dict[str, float]:
    """K-fold pair-verification accuracy, the LFW protocol as InsightFace computes it.

    Each embedding is L2-normalised and a pair's distance is d = ||a - b||^2 in [0, 4]. A pair is
    predicted "same" iff d < t, for t in ``np.arange(0, 4, 0.01)``. The pairs are split, in order,
    into ``n_folds`` contiguous folds (``sklearn.model_selection.KFold(shuffle=False)``: the first
    ``n % n_folds`` folds hold one extra pair). For each fold, t is the threshold with the highest
    accuracy on the other folds (the smallest such t on ties, as ``np.argmax`` picks), and the
    fold's accuracy is measured at t on the fold itself.

    Source: InsightFace ``eval/verification.py`` ``calculate_roc`` / ``evaluate``.

    Args:
        emb1: (N, D) embeddings of the first side of N pairs.
        emb2: (N, D) embeddings of the second side, row for row.
        issame: (N,) 1 / True where the pair shows one identity.
        n_folds: number of folds, 2 <= n_folds <= N.

    Returns:
        ``accuracy``: mean test-fold accuracy (a fraction); ``std``: its population standard
        deviation over folds (``np.std``, ddof=0); ``threshold``: mean of the per-fold best
        thresholds, in squared-distance units.
    """
    dist, same = _pair_distances(emb1, emb2, issame, n_folds)
    correct, best_thresholds = _fold_decisions(dist, same, n_folds)
    accuracies = [correct[start:stop].mean() for start, stop in _kfold_bounds(dist.shape[0], int(n_folds))]
    return {
        "accuracy": float(np.mean(accuracies)),
        "std": float(np.std(accuracies)),
        "threshold": float(np.mean(best_thresholds)),
    }


def pair_correct(emb1: np.ndarray, emb2: np.ndarray, issame: np.ndarray, n_folds: int = 10) -> np.ndarray:
    """(N,) bool: whether ``verification_accuracy`` classifies each pair right, at its fold's threshold.

    Two models scored on the same pairs give paired per-pair outcomes, so a bootstrap over pairs gives an interval
    for their accuracy difference. With equal folds (N divisible by ``n_folds``) the mean is the accuracy."""
    dist, same = _pair_distances(emb1, emb2, issame, n_folds)
    return _fold_decisions(dist, same, n_folds)[0]


def _split_scores(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(genuine, impostor) scores, each non-empty and finite."""
    scores = _as_vector(scores, "scores")
    if not np.issubdtype(scores.dtype, np.floating):
        scores = scores.astype(np.float64)
    genuine_mask = _as_binary(labels, "labels", scores.shape[0])
    if not np.isfinite(scores).all():
        bad = int(np.flatnonzero(~np.isfinite(scores))[0])
        raise ValueError(f"scores has a non-finite value {scores[bad]!r} at index {bad}")
    genuine = scores[genuine_mask]
    impostor = scores[~genuine_mask]
    if genuine.size == 0 or impostor.size == 0:
        raise ValueError(
            f"need both genuine (label 1) and impostor (label 0) pairs; got {genuine.size} genuine "
            f"and {impostor.size} impostor"
        )
    return genuine, impostor


def tar_at_far(
    scores: np.ndarray, labels: np.ndarray, fars: Sequence[float] = (1e-4, 1e-3, 1e-2)
) -> dict[float, float]:
    """True accept rate at each false accept rate, exactly, from similarity scores.

    A pair is accepted iff its score is strictly greater than the threshold. With n_imp impostor
    scores sorted in decreasing order s_1 >= s_2 >= ... and k = floor(far * n_imp) the number of
    impostors that may be accepted, the threshold is s_{k+1}: the smallest impostor score that
    accepts at most k impostors. Ties are never split: if s_k == s_{k+1}, every impostor tied at
    the threshold is rejected, so the realised FAR may be below ``far``. Consequences:

    * far * n_imp < 1 (k = 0): the threshold is the maximum impostor score (observed FAR 0);
    * k >= n_imp (far = 1): every impostor may be accepted, the threshold is -inf and TAR = 1.

    TAR is the fraction of genuine scores strictly greater than the threshold. Only impostor order
    statistics are needed, so the cost is one ``np.partition`` of the impostors plus one pass over
    the genuine scores per FAR; no ROC is built. ``far * n_imp`` is computed on the decimal value
    of ``far`` (0.29 * 100 gives 29, not 28).

    Source: the IJB-B / IJB-C 1:1 verification protocol (Whitelam et al. 2017; Maze et al. 2018).

    Args:
        scores: (N,) similarities, higher = more alike.
        labels: (N,) 1 / True for genuine pairs, 0 / False for impostor pairs.
        fars: target false accept rates, each in [0, 1].

    Returns:
        ``{far: tar}`` with ``far`` as a Python float.
    """
    fars = [float(f) for f in np.atleast_1d(np.asarray(fars, dtype=np.float64))]
    for far in fars:
        if not 0.0 <= far <= 1.0:
            raise ValueError(f"each far must be in [0, 1]; got {far!r}")
    genuine, impostor = _split_scores(scores, labels)
    n_imp = impostor.size

    allowed = {far: _allowed_false_accepts(far, n_imp) for far in fars}
    # sklearn's exact curve (``roc_curve``) gives the same TAR, at its last point with at most k false accepts, but
    # sorts every score; partitioning only the impostors at the needed order statistics scales to IJB-C's 15.6M pairs.
    # ascending order: the (k+1)-th largest impostor sits at index n_imp - k - 1
    kth = sorted({n_imp - k - 1 for k in allowed.values() if k < n_imp})
    part = np.partition(impostor, kth) if kth else impostor

    result: dict[float, float] = {}
    for far, k in allowed.items():
        if k >= n_imp:
            result[far] = 1.0
            continue
        threshold = part[n_imp - k - 1]
        result[far] = float(np.count_nonzero(genuine > threshold) / genuine.size)
    return result


def _full_roc(
    scores: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Exact ROC at every distinct score, accepting iff score >= threshold; starts at (0, 0, +inf)
    (``sklearn.metrics.roc_curve`` without dropping collinear points).

    Returns (fpr, tpr, thresholds, n_impostor).
    """
    genuine, impostor = _split_scores(scores, labels)
    truth = np.r_[np.ones(genuine.size, dtype=np.int8), np.zeros(impostor.size, dtype=np.int8)]
    fpr, tpr, thresholds = sk_roc_curve(truth, np.concatenate([genuine, impostor]).astype(np.float64),
                                        drop_intermediate=False)
    return fpr, tpr, thresholds.astype(np.float64), impostor.size


def roc_curve(
    scores: np.ndarray, labels: np.ndarray, max_points: int = 2000
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC curve for plotting: (fpr, tpr, thresholds), at most ``max_points`` points.

    A pair is accepted iff score >= threshold (the ``sklearn.metrics.roc_curve`` convention). The
    exact curve has one point per distinct score plus (0, 0) at threshold +inf and ends at (1, 1).
    If it has more than ``max_points`` points it is subsampled on a log-spaced FAR grid from
    1 / n_impostor to 1 (plus FAR 0): for each grid value the exact point with the largest FAR not
    above it (and so the highest TAR there) is kept. Every returned point lies on the exact curve;
    fpr and tpr are non-decreasing and thresholds non-increasing.

    Args:
        scores: (N,) similarities, higher = more alike.
        labels: (N,) 1 / True genuine, 0 / False impostor.
        max_points: at most this many points are returned (>= 3).
    """
    if isinstance(max_points, bool) or not isinstance(max_points, (int, np.integer)) or max_points < 3:
        raise ValueError(f"max_points must be an integer >= 3; got {max_points!r}")
    fpr, tpr, thresholds, n_imp = _full_roc(scores, labels)
    if fpr.size <= max_points:
        return fpr, tpr, thresholds
    # log10(1/n_imp) .. 0: e.g. 1e-7 .. 1 for 10M impostors, ~285 points per decade at 2000
    grid = np.concatenate([[0.0], np.logspace(-np.log10(n_imp), 0.0, max_points - 2)])
    keep = np.searchsorted(fpr, grid, side="right") - 1  # last point with fpr <= grid value
    keep = np.unique(np.concatenate([[0], keep, [fpr.size - 1]]))
    assert keep.size <= max_points, keep.size
    return fpr[keep], tpr[keep], thresholds[keep]


def pair_scores(feat_a: np.ndarray, feat_b: np.ndarray) -> np.ndarray:
    """Cosine similarity of row i of ``feat_a`` with row i of ``feat_b``: (N,) in [-1, 1]."""
    feat_a = _as_matrix(feat_a, "feat_a")
    feat_b = _as_matrix(feat_b, "feat_b")
    if feat_a.shape != feat_b.shape:
        raise ValueError(
            f"feat_a and feat_b must have the same shape; got {feat_a.shape} and {feat_b.shape}"
        )
    a = _l2_normalize(feat_a, "feat_a")
    b = _l2_normalize(feat_b, "feat_b")
    return np.einsum("nd,nd->n", a, b)
