"""1:N identification: closed-set CMC, open-set TPIR at fixed FPIR, and CMC against distractors.

* ``identification_rank`` - closed-set CMC (rank-k rate), as in MegaFace and the IJB 1:N protocol.
* ``open_set_identification`` - TPIR at fixed FPIR, as in IJB-C / IJB-S 1:N and NIST FRVT (NISTIR 8271, 2019).
* ``identification_with_distractors`` - CMC against a gallery padded with distractor images, the TinyFace protocol
  (Cheng et al., "Low-Resolution Face Recognition", ACCV 2018).

Differences from the reference:

* ``identification_rank`` counts ties against the probe, so a constant embedding cannot score rank-1 = 1.
* ``open_set_identification`` accepts a search iff its score is strictly above the threshold, read from the
  non-mated top-1 order statistic with the ``tar_at_far`` tie rule (FRVT: score >= T on a continuous sweep).
* ``identification_with_distractors`` ranks each (unlabelled) distractor image as its own identity.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from ml.eval.metrics._common import (
    _BATCH_ELEMENTS, _allowed_false_accepts, _as_matrix, _as_vector, _l2_normalize,
)


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


def _identity_scores(
    probe: np.ndarray, gallery: np.ndarray, gallery_id: np.ndarray
) -> Iterator[tuple[int, np.ndarray]]:
    """``(lo, sim)`` per block of probes: ``sim`` (B, K) the cosine of probes ``lo..lo+B`` with each of the K
    gallery identities ``gallery_id`` (G,) indexes, an identity scoring the best of its entries. Blocks hold at most
    ``_BATCH_ELEMENTS`` similarities, so a 50k x 50k search holds one (671, 50k) block at a time."""
    dtype = np.result_type(probe.dtype, gallery.dtype, np.float32)
    p = _l2_normalize(probe.astype(dtype, copy=False), "probe")
    g = _l2_normalize(gallery.astype(dtype, copy=False), "gallery")
    # sort gallery by identity so each identity is one contiguous column run for reduceat
    order = np.argsort(gallery_id, kind="stable")
    g = g[order]
    starts = np.flatnonzero(np.r_[True, np.diff(gallery_id[order]) != 0])
    one_per_identity = starts.size == g.shape[0]
    batch = max(1, _BATCH_ELEMENTS // g.shape[0])
    for lo in range(0, p.shape[0], batch):
        sim = p[lo : lo + batch] @ g.T  # (B, G) cosine similarities
        if not one_per_identity:
            sim = np.maximum.reduceat(sim, starts, axis=1)  # (B, n_identities)
        yield lo, sim


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

    rank = np.empty(probe.shape[0], dtype=np.int64)
    for lo, sim in _identity_scores(probe, gallery, gallery_id):
        own = sim[np.arange(sim.shape[0]), true_id[lo : lo + sim.shape[0]]]  # (B,)
        rank[lo : lo + sim.shape[0]] = np.count_nonzero(sim >= own[:, None], axis=1)  # includes itself
    return {r: float(np.mean(rank <= r)) for r in ranks}


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
    top1 = np.empty(probe.shape[0], dtype=dtype)  # (P,) best identity score of each probe
    own = np.full(probe.shape[0], -np.inf, dtype=dtype)  # (P,) true-identity score; -inf non-mated
    rank = np.zeros(probe.shape[0], dtype=np.int64)  # (P,) true-identity rank; 0 non-mated
    for lo, sim in _identity_scores(probe, gallery, gallery_id):
        top1[lo : lo + sim.shape[0]] = sim.max(axis=1)
        rows = np.flatnonzero(mated[lo : lo + sim.shape[0]])  # mated rows of this block
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
    probe, probe_labels, gallery, gallery_labels = _probe_gallery(probe, probe_labels, gallery, gallery_labels)
    distractors = np.asarray(distractors)
    if distractors.ndim != 2 or distractors.shape[1] != gallery.shape[1]:
        raise ValueError(
            f"distractors must be an (M, {gallery.shape[1]}) array, matching the gallery feature "
            f"dimension; got shape {distractors.shape}"
        )
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
