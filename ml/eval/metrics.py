"""Face-recognition evaluation metrics: arrays in, numbers out.

* ``verification_accuracy`` - the LFW-style 10-fold pair accuracy of InsightFace
  ``recognition/arcface_torch/eval/verification.py`` (``calculate_roc``), itself from FaceNet's
  ``lfw.py`` (Schroff et al., "FaceNet", CVPR 2015; Huang et al., LFW tech. report 07-49, 2007).
* ``tar_at_far`` / ``roc_curve`` - true accept rate at a fixed false accept rate, the IJB-B/C 1:1
  verification protocol (Whitelam et al., "IARPA Janus Benchmark-B", CVPRW 2017; Maze et al.,
  "IARPA Janus Benchmark-C", ICB 2018).
* ``identification_rank`` - closed-set CMC (rank-k identification rate), as in MegaFace and the
  IJB 1:N protocol.
* ``open_set_identification`` - open-set 1:N search, TPIR at fixed FPIR, as in the IJB-C / IJB-S
  1:N protocols and NIST FRVT identification (Grother et al., NISTIR 8271, 2019).
* ``identification_with_distractors`` - closed-set CMC against a gallery padded with distractor
  images, the TinyFace protocol (Cheng et al., "Low-Resolution Face Recognition", ACCV 2018).
* ``template_features`` - IJB template pooling of InsightFace ``recognition/_evaluation_/ijb``
  (``image2template_feature``): media-level mean, then template-level mean, optionally weighted.
* ``pair_scores`` - rowwise cosine similarity.
* ``cluster_accuracy`` - generalized category discovery accuracy, All / Known / Novel, with one
  Hungarian matching over all classes (Vaze et al., "Generalized Category Discovery", CVPR 2022,
  ``split_cluster_acc_v2``), as FaceGCD reports it.
* ``nearest_neighbor_consistency`` - share of the k cosine nearest neighbours with the same
  predicted label (FaceGCD, Appendix C.1).

Differences from the reference:

* ``verification_accuracy`` counts correct predictions with sorted distances and ``searchsorted``
  instead of one boolean pass per threshold; the counts, the first-best tie rule and the folds are
  the same. It also returns the mean of the per-fold best thresholds, which ``calculate_roc``
  computes but does not return, and it omits the optional PCA step.
* ``tar_at_far`` reads the operating point from the impostor order statistic (``np.partition``)
  instead of interpolating an ``sklearn.metrics.roc_curve``: the result is exact and the
  threshold is always an observed impostor score (see its docstring for the tie convention).
* ``template_features`` weights images only by the ``weights`` it is given (``ml.eval.ijb`` passes
  the faceness scores) and does not add flipped-image features; pass features already combined
  that way if wanted. It averages the media vectors of a template where the reference sums them
  (the same direction). A media id is scoped to its template, so the same media id in two
  templates is pooled separately.
* ``identification_rank`` counts ties against the probe (a gallery identity scoring exactly the
  probe's true-identity score ranks ahead of it), so a constant embedding cannot score rank-1 = 1.
* ``open_set_identification`` accepts a search iff its score is strictly above the threshold and
  reads the threshold from the non-mated top-1 order statistic with the ``tar_at_far`` tie rule;
  FRVT states FPIR(T) and FNIR(T) with score >= T on a continuous threshold sweep. Mated ranks use
  the ``identification_rank`` tie rule.
* ``identification_with_distractors`` ranks each distractor image as its own identity, as TinyFace's
  distractors are unlabelled; a distractor is never merged with a gallery identity.
* ``cluster_accuracy`` matches the rectangular clusters x classes count matrix directly instead of
  padding it to a square of side max(id) + 1; the matching value is the same, and ids need not be
  small non-negative integers. An empty Known or Novel subset gives nan (the reference divides by 0).
* ``nearest_neighbor_consistency``: the paper does not name the neighbour metric; cosine similarity
  on L2-normalised embeddings is used, the point itself excluded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from scipy.optimize import linear_sum_assignment
from sklearn.metrics import roc_curve as sk_roc_curve

from ml.errors import ConfigError, DataError

__all__ = [
    "cluster_accuracy",
    "identification_rank",
    "identification_with_distractors",
    "nearest_neighbor_consistency",
    "open_set_identification",
    "pair_scores",
    "roc_curve",
    "tar_at_far",
    "template_features",
    "verification_accuracy",
]

# Elements of one probe-by-gallery similarity block: 2**25 float64 = 256 MiB at most, i.e. 671
# probes at a time against a 50k gallery.
_BATCH_ELEMENTS = 1 << 25
# Images per summing step of template pooling: 65,536 x 512 float64 = 256 MiB of temporaries at most.
_POOL_ROWS = 1 << 16


# --------------------------------------------------------------------------------------------
# input checks
# --------------------------------------------------------------------------------------------


def _as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    """``x`` as a finite floating (N, D) array with N, D >= 1, else ValueError naming it."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (N, D) array of features; got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x).all(axis=1))[0])
        raise ValueError(f"{name} has non-finite values (first at row {bad}); check the model output")
    return x


def _reject_zero_rows(norms: np.ndarray, name: str) -> None:
    """ValueError naming ``name`` when a row norm of ``norms`` (N,) is 0 (that row has no direction)."""
    zero = np.flatnonzero(norms == 0)
    if zero.size:
        raise ValueError(
            f"{name} has {zero.size} all-zero row(s) (first at row {int(zero[0])}); "
            "a zero feature has no direction, so its cosine similarity is undefined"
        )


def _l2_normalize(x: np.ndarray, name: str) -> np.ndarray:
    """Rows of ``x`` scaled to unit L2 norm; a zero row raises (it has no direction)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)  # (N, 1)
    _reject_zero_rows(norms[:, 0], name)
    return x / norms


def _as_vector(x: np.ndarray, name: str, length: int | None = None) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array; got shape {x.shape}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} has {x.shape[0]} entries but {length} were expected")
    return x


def _as_binary(labels: np.ndarray, name: str, length: int) -> np.ndarray:
    """``labels`` (bool, or integers 0/1) as a bool vector of ``length`` entries."""
    labels = _as_vector(labels, name, length)
    if labels.dtype == bool:
        return labels
    is_one = labels == 1
    if not (is_one | (labels == 0)).all():
        bad = np.flatnonzero(~(is_one | (labels == 0)))[0]
        raise ValueError(
            f"{name} must hold only 1 (genuine / same) and 0 (impostor / different); "
            f"found {labels[bad].item()!r} at index {int(bad)}"
        )
    return is_one


# --------------------------------------------------------------------------------------------
# verification: LFW-style k-fold accuracy
# --------------------------------------------------------------------------------------------


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
        emb1, emb2: (N, D) embeddings of the two sides of N pairs.
        issame: (N,) 1 / True where the pair shows one identity.
        n_folds: number of folds, 2 <= n_folds <= N.

    Returns:
        ``accuracy``: mean test-fold accuracy (a fraction); ``std``: its population standard
        deviation over folds (``np.std``, ddof=0); ``threshold``: mean of the per-fold best
        thresholds, in squared-distance units.
    """
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
    dist = np.sum(np.square(a - b), axis=1)  # (N,) in [0, 4]
    thresholds = np.arange(0, 4, 0.01)  # 400 candidates, the reference grid

    accuracies, best_thresholds = [], []
    for start, stop in _kfold_bounds(n, int(n_folds)):
        test = np.zeros(n, dtype=bool)
        test[start:stop] = True
        train_correct = _correct_counts(dist[~test], same[~test], thresholds)
        best = thresholds[int(np.argmax(train_correct))]
        test_correct = _correct_counts(dist[test], same[test], np.array([best]))[0]
        accuracies.append(test_correct / (stop - start))
        best_thresholds.append(best)
    return {
        "accuracy": float(np.mean(accuracies)),
        "std": float(np.std(accuracies)),
        "threshold": float(np.mean(best_thresholds)),
    }


# --------------------------------------------------------------------------------------------
# verification: TAR @ FAR and ROC
# --------------------------------------------------------------------------------------------


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


def _allowed_false_accepts(far: float, n_impostor: int) -> int:
    """floor(far * n_impostor), with ``far`` read as the decimal it prints as.

    ``0.29 * 100`` is 28.999999999999996 in binary floating point; reading 0.29 as 29/100 gives
    the 29 that the user meant.
    """
    return math.floor(Fraction(repr(float(far))) * n_impostor)


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
    # sorts every score: 5.7 s for IJB-C's 15.6M pairs against 0.16 s for this partition of the impostors.
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


# --------------------------------------------------------------------------------------------
# identification
# --------------------------------------------------------------------------------------------


def _probe_gallery(
    probe: np.ndarray, probe_labels: np.ndarray, gallery: np.ndarray, gallery_labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validated (P, D) probe, (P,) labels, (G, D) gallery, (G,) labels of one dimension D."""
    probe = _as_matrix(probe, "probe")
    gallery = _as_matrix(gallery, "gallery")
    if probe.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"probe and gallery features differ in dimension: {probe.shape[1]} vs {gallery.shape[1]}"
        )
    probe_labels = _as_vector(probe_labels, "probe_labels", probe.shape[0])
    gallery_labels = _as_vector(gallery_labels, "gallery_labels", gallery.shape[0])
    return probe, probe_labels, gallery, gallery_labels


def _closed_set_ids(
    probe_labels: np.ndarray, gallery_labels: np.ndarray, hint: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted gallery identities, gallery index into them, probe index into them); every probe identity
    must be in the gallery, else ValueError ending with ``hint``."""
    identities, gallery_id = np.unique(gallery_labels, return_inverse=True)
    present = np.isin(probe_labels, identities)
    if not present.all():
        missing = np.unique(probe_labels[~present])
        raise ValueError(
            f"{int((~present).sum())} probe(s) have identities absent from the gallery "
            f"(e.g. {missing[:5].tolist()}); {hint}"
        )
    return identities, gallery_id, np.searchsorted(identities, probe_labels)


def identification_rank(
    probe: np.ndarray,
    probe_labels: np.ndarray,
    gallery: np.ndarray,
    gallery_labels: np.ndarray,
    ranks: Sequence[int] = (1, 5),
) -> dict[int, float]:
    """Closed-set CMC: the fraction of probes whose identity is among the top-r gallery identities.

    Probe and gallery features are L2-normalised and compared by cosine similarity. A gallery
    identity with several entries scores the best of them, so ranks count identities, not
    entries: a probe's rank is 1 + the number of other gallery identities scoring at least as high
    as its own identity (ties count against the probe). Every probe identity must be in the gallery
    (closed set). Similarities are computed in probe blocks of at most ``_BATCH_ELEMENTS`` entries,
    so a 50k x 50k search holds one (671, 50k) block at a time.

    Source: cumulative match characteristic, e.g. Grother & Phillips, FRVT / IJB 1:N protocol.

    Args:
        probe: (P, D) probe features; probe_labels: (P,) identities.
        gallery: (G, D) gallery features; gallery_labels: (G,) identities.
        ranks: positive ranks r to report.

    Returns:
        ``{r: rate}``, each rate a fraction of probes in [0, 1].
    """
    probe, probe_labels, gallery, gallery_labels = _probe_gallery(probe, probe_labels, gallery, gallery_labels)
    ranks = [int(r) for r in ranks]
    if not ranks or min(ranks) < 1:
        raise ValueError(f"ranks must be a non-empty list of integers >= 1; got {ranks!r}")

    identities, gallery_id, true_id = _closed_set_ids(
        probe_labels, gallery_labels, "closed-set identification needs every probe identity in the gallery - "
        "drop those probes or use an open-set metric")

    dtype = np.result_type(probe.dtype, gallery.dtype, np.float32)
    p = _l2_normalize(probe.astype(dtype, copy=False), "probe")
    g = _l2_normalize(gallery.astype(dtype, copy=False), "gallery")
    # sort gallery by identity so each identity is one contiguous column run for reduceat
    order = np.argsort(gallery_id, kind="stable")
    g = g[order]
    starts = np.flatnonzero(np.r_[True, np.diff(gallery_id[order]) != 0])
    one_per_identity = starts.size == g.shape[0]

    rank = np.empty(p.shape[0], dtype=np.int64)
    batch = max(1, _BATCH_ELEMENTS // g.shape[0])
    for lo in range(0, p.shape[0], batch):
        sim = p[lo : lo + batch] @ g.T  # (B, G) cosine similarities
        if not one_per_identity:
            sim = np.maximum.reduceat(sim, starts, axis=1)  # (B, n_identities)
        own = sim[np.arange(sim.shape[0]), true_id[lo : lo + batch]]  # (B,)
        rank[lo : lo + batch] = np.count_nonzero(sim >= own[:, None], axis=1)  # includes itself
    return {r: float(np.mean(rank <= r)) for r in ranks}


# --------------------------------------------------------------------------------------------
# templates and pairs
# --------------------------------------------------------------------------------------------


def template_features(
    features: np.ndarray,
    template_ids: np.ndarray,
    media_ids: np.ndarray | None = None,
    *,
    weights: np.ndarray | None = None,
    normalize_items: bool = True,
    normalize: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """IJB template pooling: media means of (weighted) image features, then their mean, then L2-normalised.

    For template t with media m_1..m_M, each holding images i:
        f_t = normalise( (1/M) * sum_m (1/|m|) * sum_{i in m} w_i * u_i ),
    with u_i = x_i / ||x_i|| (``normalize_items``, the default) or x_i (norms kept), and w_i the
    image's weight (1 without ``weights``). A video contributes as much as a single still, however
    many frames it has. With ``media_ids=None`` each image is its own media, so f_t is the
    normalised (weighted) mean of the u_i. Media ids are scoped to their template. Images are summed
    in float64, whole media groups of at most ``_POOL_ROWS`` images at a time (IJB-C holds 469,375).

    Source: InsightFace ``recognition/_evaluation_/ijb`` ``image2template_feature``; the IJB-B/C
    protocol (Whitelam et al. 2017; Maze et al. 2018). ``ml.eval.ijb`` pools with the detector's
    faceness scores as ``weights`` and ``normalize_items=False``, the reference's default mode.

    Args:
        features: (N, D) image features.
        template_ids: (N,) template of each image.
        media_ids: (N,) media (still or video) of each image, or None.
        weights: (N,) weight of each image, finite and >= 0, or None (all 1).
        normalize_items: scale each image feature to unit norm before pooling.
        normalize: scale each template feature to unit norm; False returns the pooled means as they
            are (no zero check), for a caller that normalises them itself.

    Returns:
        (sorted unique template ids (T,), template features (T, D) float64, unit norm when
        ``normalize``).
    """
    features = _as_matrix(features, "features")
    n, dim = features.shape
    template_ids = _as_vector(template_ids, "template_ids", n)
    if weights is not None:
        weights = _as_vector(weights, "weights", n).astype(np.float64)
        bad = np.flatnonzero(~(np.isfinite(weights) & (weights >= 0)))
        if bad.size:
            raise ValueError(
                f"weights must be finite and >= 0; image {int(bad[0])} has weight {weights[bad[0]]} "
                f"({bad.size} such images)"
            )
    norms = None
    if normalize_items:
        norms = np.concatenate([  # (N,) float64, as _l2_normalize computes them
            np.linalg.norm(features[lo : lo + _POOL_ROWS].astype(np.float64, copy=False), axis=1)
            for lo in range(0, n, _POOL_ROWS)
        ])
        _reject_zero_rows(norms, "features")

    templates, t_idx = np.unique(template_ids, return_inverse=True)  # t_idx: (N,)
    if media_ids is None:
        m_idx = np.arange(n)
        n_media = n
    else:
        media_ids = _as_vector(media_ids, "media_ids", n)
        media, m_idx = np.unique(media_ids, return_inverse=True)
        n_media = media.size
    key = t_idx.astype(np.int64) * n_media + m_idx  # (template, media) pairs, template-major
    order = np.argsort(key, kind="stable")
    key = key[order]
    media_starts = np.flatnonzero(np.r_[True, np.diff(key) != 0])
    edges = np.r_[media_starts, n]  # (M + 1,) media group boundaries in sorted order
    media_sizes = np.diff(edges)

    sums = np.empty((media_starts.size, dim))  # (M, D) sum_{i in m} w_i u_i
    first = 0  # a step sums whole media groups: up to _POOL_ROWS images, or one larger group
    while first < media_starts.size:
        stop = max(first + 1, int(np.searchsorted(edges, edges[first] + _POOL_ROWS, side="right")) - 1)
        rows = order[edges[first] : edges[stop]]
        x = features[rows].astype(np.float64, copy=False)  # (B, D), a copy of these rows only
        if norms is not None:
            x /= norms[rows, None]
        if weights is not None:
            x *= weights[rows, None]
        sums[first:stop] = np.add.reduceat(x, media_starts[first:stop] - edges[first], axis=0)
        first = stop
    media_mean = sums / media_sizes[:, None]  # (M, D)

    media_template = key[media_starts] // n_media  # (M,) sorted
    template_starts = np.flatnonzero(np.r_[True, np.diff(media_template) != 0])
    template_sizes = np.diff(np.r_[template_starts, media_mean.shape[0]])
    pooled = np.add.reduceat(media_mean, template_starts, axis=0) / template_sizes[:, None]  # (T, D)
    if not normalize:
        return templates, pooled

    norms = np.linalg.norm(pooled, axis=1)
    cancelled = np.flatnonzero(norms <= 1e-12)
    if cancelled.size:
        raise ValueError(
            f"template {templates[cancelled[0]]!r} pools to a zero vector (its media features "
            "cancel out); check its images"
        )
    return templates, pooled / norms[:, None]


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


# --------------------------------------------------------------------------------------------
# identification: open set and distractors
# --------------------------------------------------------------------------------------------


def open_set_identification(
    probe: np.ndarray,
    probe_labels: np.ndarray,
    gallery: np.ndarray,
    gallery_labels: np.ndarray,
    fpirs: Sequence[float] = (0.01,),
    ranks: Sequence[int] = (1,),
) -> dict[str, float]:
    """Open-set 1:N identification: true positive identification rate at fixed FPIRs.

    Features are L2-normalised and compared by cosine similarity; a gallery identity scores the
    best of its entries. A probe is *mated* if its label is a gallery identity and *non-mated*
    otherwise. A search returns a candidate iff its score is strictly greater than a threshold t.

    * FPIR(t) = #{non-mated probes with top-1 score s_max > t} / n_nonmated.
    * For each target FPIR f, k = floor(f * n_nonmated) false alarms are allowed and t is the
      (k+1)-th largest non-mated top-1 score, exactly as ``tar_at_far`` picks its threshold: ties
      are never split (all non-mated probes tied at t are rejected, so FPIR(t) may be below f);
      k = 0 gives the largest non-mated top-1 score; k = n_nonmated (f = 1) gives t = -inf.
    * TPIR(f, r) = #{mated probes whose true identity has rank <= r and score s_true > t}
      / n_mated. The rank is 1 + the number of other gallery identities scoring >= s_true (ties
      count against the probe, as in ``identification_rank``), so at f = 1 (t = -inf) TPIR is
      the closed-set rank-r CMC of the mated probes.

    FNIR = 1 - TPIR. Similarities are computed in probe blocks of at most ``_BATCH_ELEMENTS``
    entries, as in ``identification_rank``.

    Source: NIST FRVT 1:N (Grother, Ngan & Hanaoka, NISTIR 8271, 2019) for FPIR / FNIR; the
    IJB-C 1:N open-set protocol (Maze et al., ICB 2018) and IJB-S (Kalka et al., BTAS 2018),
    which report TPIR at low FPIRs such as 0.01 and 0.1.

    Args:
        probe: (P, D) probe features; probe_labels: (P,) identities.
        gallery: (G, D) gallery features; gallery_labels: (G,) identities.
        fpirs: target false positive identification rates, each in [0, 1].
        ranks: positive ranks r for the TPIR.

    Returns:
        With ``f`` written as ``repr(float(fpir))`` (0.01 -> ``"0.01"``, 1e-4 -> ``"0.0001"``):

        * ``"tpir@fpir={f}/rank{r}"``: TPIR, a fraction of mated probes, for every fpir and rank;
        * ``"threshold@fpir={f}"``: the cosine threshold t (a non-mated top-1 score, or -inf);
        * ``"n_mated"``, ``"n_nonmated"``: probe counts (ints).

    Raises:
        ValueError: no mated or no non-mated probe, an fpir outside [0, 1], a rank < 1, or
            malformed features.
    """
    fpirs = [float(f) for f in np.atleast_1d(np.asarray(fpirs, dtype=np.float64))]
    if not fpirs:
        raise ValueError("fpirs must hold at least one rate in [0, 1]")
    for fpir in fpirs:
        if not 0.0 <= fpir <= 1.0:
            raise ValueError(f"each fpir must be in [0, 1]; got {fpir!r}")
    ranks = [int(r) for r in ranks]
    if not ranks or min(ranks) < 1:
        raise ValueError(f"ranks must be a non-empty list of integers >= 1; got {ranks!r}")
    probe, probe_labels, gallery, gallery_labels = _probe_gallery(probe, probe_labels, gallery, gallery_labels)

    identities, gallery_id = np.unique(gallery_labels, return_inverse=True)
    mated = np.isin(probe_labels, identities)  # (P,)
    n_mated = int(mated.sum())
    n_nonmated = probe.shape[0] - n_mated
    if n_mated == 0 or n_nonmated == 0:
        raise ValueError(
            f"open-set identification needs both mated probes (identity in the gallery) and "
            f"non-mated probes (identity not in the gallery); got {n_mated} mated and "
            f"{n_nonmated} non-mated of {probe.shape[0]} - check that probe_labels and "
            "gallery_labels use the same identity ids, or use identification_rank for a closed set"
        )
    true_id = np.full(probe.shape[0], -1, dtype=np.int64)  # index into identities; -1 non-mated
    true_id[mated] = np.searchsorted(identities, probe_labels[mated])

    dtype = np.result_type(probe.dtype, gallery.dtype, np.float32)
    p = _l2_normalize(probe.astype(dtype, copy=False), "probe")
    g = _l2_normalize(gallery.astype(dtype, copy=False), "gallery")
    order = np.argsort(gallery_id, kind="stable")  # identities as contiguous column runs
    g = g[order]
    starts = np.flatnonzero(np.r_[True, np.diff(gallery_id[order]) != 0])
    one_per_identity = starts.size == g.shape[0]

    top1 = np.empty(p.shape[0], dtype=dtype)  # (P,) best identity score of each probe
    own = np.full(p.shape[0], -np.inf, dtype=dtype)  # (P,) true-identity score; -inf non-mated
    rank = np.zeros(p.shape[0], dtype=np.int64)  # (P,) true-identity rank; 0 non-mated
    batch = max(1, _BATCH_ELEMENTS // g.shape[0])
    for lo in range(0, p.shape[0], batch):
        sim = p[lo : lo + batch] @ g.T  # (B, G) cosine similarities
        if not one_per_identity:
            sim = np.maximum.reduceat(sim, starts, axis=1)  # (B, n_identities)
        top1[lo : lo + batch] = sim.max(axis=1)
        rows = np.flatnonzero(mated[lo : lo + batch])  # mated rows of this block
        if rows.size:
            s_true = sim[rows, true_id[lo + rows]]  # (b,)
            own[lo + rows] = s_true
            rank[lo + rows] = np.count_nonzero(sim[rows] >= s_true[:, None], axis=1)

    nonmated_top1 = np.sort(top1[~mated])  # ascending
    own, rank = own[mated], rank[mated]
    result: dict[str, float] = {}
    for fpir in fpirs:
        k = _allowed_false_accepts(fpir, n_nonmated)
        threshold = -math.inf if k >= n_nonmated else float(nonmated_top1[n_nonmated - k - 1])
        accepted = own > threshold  # (n_mated,)
        key = repr(fpir)
        for r in ranks:
            hits = np.count_nonzero(accepted & (rank <= r))
            result[f"tpir@fpir={key}/rank{r}"] = float(hits / n_mated)
        result[f"threshold@fpir={key}"] = threshold
    result["n_mated"] = n_mated
    result["n_nonmated"] = n_nonmated
    return result


def identification_with_distractors(
    probe: np.ndarray,
    probe_labels: np.ndarray,
    gallery: np.ndarray,
    gallery_labels: np.ndarray,
    distractors: np.ndarray,
    ranks: Sequence[int] = (1, 5, 20),
) -> dict[int, float]:
    """Closed-set CMC against a gallery extended by distractor images (the TinyFace protocol).

    Every probe identity must be in the gallery. Each of the M distractor images joins the
    gallery as an identity of its own, one that matches no probe, so a probe's rank is
        1 + #{other gallery identities scoring >= s_true} + #{distractors scoring >= s_true}
    with s_true the best cosine similarity over the probe's own gallery entries (ties count
    against the probe). This is ``identification_rank`` on the extended gallery: the gallery and
    probe labels are mapped to identity indices 0..K-1 and distractor i gets index K + i, so no
    distractor can collide with a real identity whatever the label type. The extended gallery is
    one (G + M, D) copy; the search is batched as in ``identification_rank``.

    Source: TinyFace (Cheng, Zhu & Gong, "Low-Resolution Face Recognition", ACCV 2018): 153,428
    distractor faces added to the gallery, CMC at ranks 1, 5 and 20.

    Args:
        probe: (P, D) probe features; probe_labels: (P,) identities.
        gallery: (G, D) gallery features; gallery_labels: (G,) identities.
        distractors: (M, D) distractor features; M = 0 gives ``identification_rank``.
        ranks: positive ranks r to report.

    Returns:
        ``{r: rate}``, each rate a fraction of probes in [0, 1].
    """
    probe = _as_matrix(probe, "probe")
    gallery = _as_matrix(gallery, "gallery")
    distractors = np.asarray(distractors)
    if distractors.ndim != 2 or distractors.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"distractors must be an (M, {gallery.shape[1]}) array, matching the gallery feature "
            f"dimension; got shape {distractors.shape}"
        )
    probe_labels = _as_vector(probe_labels, "probe_labels", probe.shape[0])
    gallery_labels = _as_vector(gallery_labels, "gallery_labels", gallery.shape[0])
    if distractors.shape[0] == 0:
        return identification_rank(probe, probe_labels, gallery, gallery_labels, ranks)
    distractors = _as_matrix(distractors, "distractors")
    zero = np.flatnonzero(~distractors.any(axis=1))
    if zero.size:  # checked here so the message names the distractors, not row G + i of a gallery
        raise ValueError(
            f"distractors has {zero.size} all-zero row(s) (first at row {int(zero[0])}); "
            "a zero feature has no direction, so its cosine similarity is undefined"
        )

    identities, gallery_id, probe_id = _closed_set_ids(
        probe_labels, gallery_labels, "distractor identification is closed-set on the labelled gallery - "
        "drop those probes or use open_set_identification")
    distractor_id = identities.size + np.arange(distractors.shape[0])  # (M,) in K..K+M-1
    extended = np.concatenate([gallery, distractors])  # (G + M, D), promoted dtype
    extended_labels = np.concatenate([gallery_id.astype(np.int64), distractor_id])
    return identification_rank(probe, probe_id, extended, extended_labels, ranks)


# --------------------------------------------------------------------------------------------
# clustering: generalized category discovery
# --------------------------------------------------------------------------------------------


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

    classes, t = np.unique(y_true, return_inverse=True)  # t: (N,) in 0..T-1
    clusters, c = np.unique(y_pred, return_inverse=True)  # c: (N,) in 0..C-1
    w = np.bincount(c * classes.size + t, minlength=clusters.size * classes.size)
    w = w.reshape(clusters.size, classes.size)  # (C, T) contingency
    rows, cols = linear_sum_assignment(w, maximize=True)
    mapped = np.full(clusters.size, -1, dtype=np.int64)  # class index of each cluster; -1 unmatched
    mapped[rows] = cols
    correct = mapped[c] == t  # (N,)

    def acc(subset: np.ndarray) -> float:
        return float(correct[subset].mean()) if subset.any() else math.nan

    return {"all": float(correct.mean()), "known": acc(known), "novel": acc(~known)}


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
