"""Unit tests for open-set identification and distractor CMC in ml/eval/metrics/identification.py.

Hand-worked cases use 2-D unit vectors at given angles (cosine = cos of the angular gap) or
vectors whose normalised entries are dyadic (0, +-1/2, +-1/4), so that tied scores are exactly
equal in floating point.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from ml.eval.metrics import (
    identification,
    identification_rank,
    identification_with_distractors,
    open_set_identification,
)


def _unit(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def _cos(deg: float) -> float:
    return math.cos(math.radians(deg))


# ------------------------------------------------------------------------------------------
# open_set_identification
# ------------------------------------------------------------------------------------------

# Gallery identities at angles: "a" 0 deg, "b" 60 deg, "c" 120 deg.
_GALLERY = np.array([_unit(0), _unit(60), _unit(120)])
_GALLERY_LABELS = np.array(["a", "b", "c"])
# Mated probes (identity, angle -> gap to own identity, rank):
#   M1 a   5 deg -> 5,  rank 1
#   M2 b  80 deg -> 20, rank 1 (c 40, a 80)
#   M3 c 150 deg -> 30, rank 1 (b 90)
#   M4 a  40 deg -> 40, rank 2 (b is 20 away)
# Non-mated probes (top-1 gap): -10 deg (a, 10), 145 deg (c, 25), 165 deg (c, 45), 190 deg (c, 70).
_PROBE = np.array(
    [_unit(5), _unit(80), _unit(150), _unit(40), _unit(-10), _unit(145), _unit(165), _unit(190)]
)
_PROBE_LABELS = np.array(["a", "b", "c", "a", "x", "y", "x", "w"])


def test_open_set_hand_computed_threshold_excludes_mated_probe():
    # 4 non-mated top-1 scores: cos 10 > cos 25 > cos 45 > cos 70.
    # fpir 0   : k = 0 -> t = cos 10 -> only M1 (gap 5) passes               -> r1 1/4, r2 1/4
    # fpir 0.25: k = 1 -> t = cos 25 -> M1, M2 pass; M3 is rank 1 but its true
    #            score cos 30 is below t, so it is lost                       -> r1 2/4, r2 2/4
    # fpir 0.3 : k = floor(1.2) = 1 -> same as 0.25
    # fpir 0.5 : k = 2 -> t = cos 45 -> M1, M2, M3 at rank 1; M4 (gap 40) passes
    #            the threshold but is rank 2                                   -> r1 3/4, r2 4/4
    # fpir 1   : k = 4 = n_nonmated -> t = -inf -> the CMC of the mated probes -> r1 3/4, r2 4/4
    fpirs = (0.0, 0.25, 0.3, 0.5, 1.0)
    out = open_set_identification(_PROBE, _PROBE_LABELS, _GALLERY, _GALLERY_LABELS, fpirs, (1, 2))
    expected_tpir = {0.0: (1, 1), 0.25: (2, 2), 0.3: (2, 2), 0.5: (3, 4), 1.0: (3, 4)}
    for fpir, (r1, r2) in expected_tpir.items():
        assert out[f"tpir@fpir={fpir}/rank1"] == r1 / 4, fpir
        assert out[f"tpir@fpir={fpir}/rank2"] == r2 / 4, fpir
    assert out["threshold@fpir=0.0"] == pytest.approx(_cos(10))
    assert out["threshold@fpir=0.25"] == pytest.approx(_cos(25))
    assert out["threshold@fpir=0.3"] == pytest.approx(_cos(25))
    assert out["threshold@fpir=0.5"] == pytest.approx(_cos(45))
    assert out["threshold@fpir=1.0"] == -math.inf
    assert out["n_mated"] == 4 and out["n_nonmated"] == 4


def test_open_set_key_names_and_defaults():
    out = open_set_identification(_PROBE, _PROBE_LABELS, _GALLERY, _GALLERY_LABELS)
    assert set(out) == {"tpir@fpir=0.01/rank1", "threshold@fpir=0.01", "n_mated", "n_nonmated"}
    out = open_set_identification(
        _PROBE, _PROBE_LABELS, _GALLERY, _GALLERY_LABELS, fpirs=[1e-4, 0.1], ranks=[1, 5]
    )
    assert set(out) == {
        "tpir@fpir=0.0001/rank1",
        "tpir@fpir=0.0001/rank5",
        "tpir@fpir=0.1/rank1",
        "tpir@fpir=0.1/rank5",
        "threshold@fpir=0.0001",
        "threshold@fpir=0.1",
        "n_mated",
        "n_nonmated",
    }


def test_open_set_rank_requirement_is_identities_not_entries():
    # Probe "a" at 0 deg; "a" has one entry at 30 deg; "b" has entries at 10 and 20 deg; "c" at
    # 25 deg. Identity-wise "a" is rank 3 (b 10, c 25, a 30), entry-wise it would be rank 4.
    # Non-mated probe at 180 deg has top-1 cos 150 < 0 (a), so at fpir 0 the threshold is below
    # the mated score cos 30: only the rank limits the TPIR.
    gallery = np.array([_unit(30), _unit(10), _unit(20), _unit(25)])
    gallery_labels = np.array(["a", "b", "b", "c"])
    probe = np.array([_unit(0), _unit(180)])
    out = open_set_identification(
        probe, np.array(["a", "z"]), gallery, gallery_labels, fpirs=[0.0], ranks=(1, 2, 3)
    )
    assert out["threshold@fpir=0.0"] == pytest.approx(_cos(150))
    assert [out[f"tpir@fpir=0.0/rank{r}"] for r in (1, 2, 3)] == [0.0, 0.0, 1.0]


def test_open_set_ties_at_the_threshold_are_never_split():
    # 4-D features whose normalised entries are 0, +-1/2 or 1, so every cosine below is exact.
    # Gallery: a = e1, b = e2, c = e3.
    gallery = np.eye(4)[:3]
    gallery_labels = np.array([0, 1, 2])
    probe = np.array(
        [
            # mated                  scores (a, b, c)      own   rank
            [1, 0, 0, 0],  # a       ( 1,   0,   0)        1     1
            [1, 1, -1, 1],  # b      ( .5,  .5, -.5)       .5    2 (tied with a: counts against)
            [-1, -1, 1, 1],  # c     (-.5, -.5,  .5)       .5    1
            [1, -1, -1, -1],  # a    ( .5, -.5, -.5)       .5    1
            # non-mated                                    top-1
            [1, 1, 1, 1],  #         ( .5,  .5,  .5)       .5
            [1, -1, -1, 1],  #       ( .5, -.5, -.5)       .5
            [0, 0, 0, 1],  #         ( 0,   0,   0)        0
            [-1, -1, -1, 1],  #      (-.5, -.5, -.5)      -.5
        ],
        dtype=np.float64,
    )
    probe_labels = np.array([0, 1, 2, 0, 7, 8, 9, 7])
    # fpir 0.25: k = 1, but the two largest non-mated scores tie at .5: accepting one means
    #            accepting both (FPIR .5), so t stays .5 and the three mated probes scoring
    #            exactly .5 are rejected (score must be > t)                 -> r1 1/4, r2 1/4
    # fpir 0.5 : k = 2 -> t = 0 (3rd largest); M1, M3, M4 at rank 1, M2 at 2 -> r1 3/4, r2 4/4
    out = open_set_identification(
        probe, probe_labels, gallery, gallery_labels, fpirs=(0.0, 0.25, 0.5), ranks=(1, 2)
    )
    assert out == {
        "tpir@fpir=0.0/rank1": 0.25,
        "tpir@fpir=0.0/rank2": 0.25,
        "threshold@fpir=0.0": 0.5,
        "tpir@fpir=0.25/rank1": 0.25,
        "tpir@fpir=0.25/rank2": 0.25,
        "threshold@fpir=0.25": 0.5,
        "tpir@fpir=0.5/rank1": 0.75,
        "tpir@fpir=0.5/rank2": 1.0,
        "threshold@fpir=0.5": 0.0,
        "n_mated": 4,
        "n_nonmated": 4,
    }
    # float32 features give the same exact scores
    p32, g32 = probe.astype(np.float32), gallery.astype(np.float32)
    out32 = open_set_identification(p32, probe_labels, g32, gallery_labels, (0.0, 0.25, 0.5), (1, 2))
    assert out32 == out


def _brute_force_open_set(sim_int, probe_labels, gallery_labels, fpir, ranks):
    """Open-set TPIR from an integer score matrix by enumerating every candidate threshold."""
    identities = sorted(set(gallery_labels.tolist()))
    best = {}  # (probe, identity) -> best integer score over that identity's entries
    for i in range(sim_int.shape[0]):
        for ident in identities:
            best[i, ident] = max(sim_int[i, j] for j in np.flatnonzero(gallery_labels == ident))
    nonmated_top1, mated = [], []
    for i, label in enumerate(probe_labels.tolist()):
        scores = [best[i, ident] for ident in identities]
        if label in identities:
            own = best[i, label]
            rank = sum(1 for ident in identities if best[i, ident] >= own)
            mated.append((own, rank))
        else:
            nonmated_top1.append(max(scores))
    nonmated_top1 = np.array(nonmated_top1)
    allowed = math.floor(Fraction(str(fpir)) * len(nonmated_top1))
    # the smallest threshold, among -inf and the observed non-mated scores, that alarms on at
    # most `allowed` non-mated probes; TPIR only grows as the threshold falls
    candidates = np.concatenate([[-np.inf], np.unique(nonmated_top1)])
    feasible = [t for t in candidates if np.sum(nonmated_top1 > t) <= allowed]
    t = min(feasible)
    tpir = {r: sum(1 for own, rank in mated if rank <= r and own > t) / len(mated) for r in ranks}
    return t, tpir


@pytest.mark.parametrize("seed", [0, 1])
def test_open_set_matches_brute_force_on_tied_scores(seed, monkeypatch):
    # +-1 features in 16 dims: normalised entries are +-1/4, so cosine = (16 - 2 * hamming) / 16
    # exactly, an integer over 16 with only 17 possible values -> heavy ties everywhere.
    rng = np.random.default_rng(seed)
    dim, n_ids = 16, 25
    gallery_labels = np.r_[np.arange(n_ids), rng.integers(0, n_ids, 35)]  # 60 entries, all ids
    gallery = rng.choice([-1.0, 1.0], size=(gallery_labels.size, dim))
    probe_labels = rng.integers(0, n_ids + 12, 150)  # ids >= 25 are non-mated (about a third)
    probe = rng.choice([-1.0, 1.0], size=(probe_labels.size, dim))
    # pull mated probes toward their identity's first entry so ranks and scores vary
    mated = probe_labels < n_ids
    flip = rng.random((probe_labels.size, dim)) < 0.3
    probe[mated] = np.where(flip[mated], -1.0, 1.0) * gallery[probe_labels[mated]]
    sim_int = (probe @ gallery.T).astype(np.int64)  # (P, G), = 16 * cosine

    fpirs = (0.0, 0.01, 0.05, 0.1, 0.2, 0.37, 0.5, 0.9, 1.0)
    ranks = (1, 2, 3, 5)
    out = open_set_identification(probe, probe_labels, gallery, gallery_labels, fpirs, ranks)
    for fpir in fpirs:
        t, tpir = _brute_force_open_set(sim_int, probe_labels, gallery_labels, fpir, ranks)
        assert out[f"threshold@fpir={fpir}"] == t / dim, fpir
        for r in ranks:
            assert out[f"tpir@fpir={fpir}/rank{r}"] == tpir[r], (fpir, r)
    assert 0.0 < out["tpir@fpir=0.1/rank1"] < out["tpir@fpir=1.0/rank5"] <= 1.0  # not trivial
    assert out["n_mated"] == int(mated.sum())

    monkeypatch.setattr(identification, "_BATCH_ELEMENTS", 7 * n_ids)  # 7 probes per block
    batched = open_set_identification(probe, probe_labels, gallery, gallery_labels, fpirs, ranks)
    assert batched == out


def test_open_set_at_fpir_one_is_the_closed_set_cmc_of_mated_probes():
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(20, 8))
    gallery_labels = np.arange(20)
    gallery = centers + 0.5 * rng.normal(size=(20, 8))
    probe_labels = rng.integers(0, 26, 90)
    mated = probe_labels < 20
    probe = rng.normal(size=(90, 8))
    probe[mated] = centers[probe_labels[mated]] + 0.9 * rng.normal(size=(int(mated.sum()), 8))
    ranks = (1, 3, 10)
    out = open_set_identification(probe, probe_labels, gallery, gallery_labels, [1.0], ranks)
    cmc = identification_rank(probe[mated], probe_labels[mated], gallery, gallery_labels, ranks)
    assert {r: out[f"tpir@fpir=1.0/rank{r}"] for r in ranks} == cmc
    # a stricter operating point can only lose mated probes
    strict = open_set_identification(probe, probe_labels, gallery, gallery_labels, [0.1], ranks)
    assert all(strict[f"tpir@fpir=0.1/rank{r}"] <= cmc[r] for r in ranks)


def test_open_set_requires_mated_and_nonmated_probes():
    with pytest.raises(ValueError, match="0 non-mated"):
        open_set_identification(_PROBE[:4], _PROBE_LABELS[:4], _GALLERY, _GALLERY_LABELS)
    with pytest.raises(ValueError, match="got 0 mated"):
        open_set_identification(_PROBE[4:], _PROBE_LABELS[4:], _GALLERY, _GALLERY_LABELS)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fpirs": [1.5]}, r"\[0, 1\]"),
        ({"fpirs": [-0.1]}, r"\[0, 1\]"),
        ({"fpirs": []}, "at least one"),
        ({"ranks": [0]}, ">= 1"),
        ({"ranks": []}, ">= 1"),
    ],
)
def test_open_set_rejects_bad_operating_points(kwargs, match):
    with pytest.raises(ValueError, match=match):
        open_set_identification(_PROBE, _PROBE_LABELS, _GALLERY, _GALLERY_LABELS, **kwargs)


def test_open_set_rejects_bad_features():
    with pytest.raises(ValueError, match="dimension"):
        open_set_identification(np.ones((2, 3)), [0, 1], np.ones((2, 4)), np.array([0, 2]))
    with pytest.raises(ValueError, match="2 were expected"):
        open_set_identification(_PROBE, _PROBE_LABELS, _GALLERY[:2], _GALLERY_LABELS)
    with pytest.raises(ValueError, match="all-zero"):
        open_set_identification(np.zeros((2, 2)), np.array([0, 9]), _GALLERY, np.array([0, 1, 2]))


# ------------------------------------------------------------------------------------------
# identification_with_distractors
# ------------------------------------------------------------------------------------------


def test_distractors_push_a_probe_from_rank_one_to_rank_three():
    # Gallery "a" at 0 deg, "b" at 90 deg. Probe A ("a") at 20 deg, probe B ("b") at 80 deg: both
    # rank 1. Two identical distractors at 10 deg are each 10 deg from A, closer than "a"
    # (20 deg): each is its own identity, so A drops to rank 3 (not 2). A distractor at 170 deg
    # is far from both. B is still rank 1 (b 10 deg, distractors 70 and 90 deg away).
    gallery = np.array([_unit(0), _unit(90)])
    gallery_labels = np.array(["a", "b"])
    probe = np.array([_unit(20), _unit(80)])
    probe_labels = np.array(["a", "b"])
    distractors = np.array([_unit(10), _unit(10), _unit(170)])
    ranks = (1, 2, 3)
    args = (probe, probe_labels, gallery, gallery_labels)
    assert identification_rank(*args, ranks) == {1: 1.0, 2: 1.0, 3: 1.0}
    assert identification_with_distractors(*args, distractors, ranks) == {1: 0.5, 2: 0.5, 3: 1.0}
    # default ranks (1, 5, 20)
    assert identification_with_distractors(*args, distractors) == {1: 0.5, 5: 1.0, 20: 1.0}
    # M = 0 distractors is the closed-set CMC
    empty = np.empty((0, 2))
    assert identification_with_distractors(*args, empty, ranks) == {1: 1.0, 2: 1.0, 3: 1.0}


def _reference_ranks(probe, probe_labels, gallery, gallery_labels, distractors):
    """Rank of each probe by walking the sorted similarities; distractor j is identity ("d", j)."""
    p = probe / np.linalg.norm(probe, axis=1, keepdims=True)
    feats = np.vstack([gallery, distractors])
    g = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    labels = [("g", x) for x in gallery_labels.tolist()]
    labels += [("d", j) for j in range(len(distractors))]
    sim = p @ g.T
    ranks = []
    for i in range(len(p)):
        own = max(sim[i, j] for j in range(len(labels)) if labels[j] == ("g", probe_labels[i]))
        others = {labels[j] for j in range(len(labels)) if sim[i, j] >= own}
        ranks.append(len(others))  # identities scoring >= own, own included
    return np.array(ranks)


def test_distractors_match_reference_batched_with_colliding_looking_labels(monkeypatch):
    # Gallery labels 0..29 and distractor indices 0..M-1 overlap as numbers; the function must
    # not confuse gallery identity 3 with distractor 3 (nor with the internal index 30 + 3).
    rng = np.random.default_rng(8)
    centers = rng.normal(size=(30, 12))
    gallery_labels = rng.integers(0, 30, 70)
    gallery_labels[:30] = np.arange(30)
    gallery = centers[gallery_labels] + 0.8 * rng.normal(size=(70, 12))
    probe_labels = rng.integers(0, 30, 60)
    probe = centers[probe_labels] + 0.8 * rng.normal(size=(60, 12))
    distractors = rng.normal(size=(200, 12))
    ranks = (1, 5, 20)
    ref = _reference_ranks(probe, probe_labels, gallery, gallery_labels, distractors)
    expected = {r: float(np.mean(ref <= r)) for r in ranks}
    closed = identification_rank(probe, probe_labels, gallery, gallery_labels, ranks)
    assert expected[1] < closed[1]  # the distractors do cost something

    args = (probe, probe_labels, gallery, gallery_labels, distractors, ranks)
    full = identification_with_distractors(*args)
    assert full == pytest.approx(expected)
    monkeypatch.setattr(identification, "_BATCH_ELEMENTS", 9 * 270)  # 9 probes per block
    batched = identification_with_distractors(*args)
    assert batched == full
    # string labels give the same answer
    as_str = identification_with_distractors(
        probe, probe_labels.astype(str), gallery, gallery_labels.astype(str), distractors, ranks
    )
    assert as_str == full


def test_distractors_reject_bad_input():
    gallery = np.array([_unit(0), _unit(90)])
    labels = np.array([0, 1])
    probe = np.array([_unit(1), _unit(2)])
    with pytest.raises(ValueError, match=r"distractors must be an \(M, 2\)"):
        identification_with_distractors(probe, labels, gallery, labels, np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"distractors must be an \(M, 2\)"):
        identification_with_distractors(probe, labels, gallery, labels, np.ones(2))
    with pytest.raises(ValueError, match=r"distractors has 1 all-zero"):
        identification_with_distractors(probe, labels, gallery, labels, np.eye(2) * [1, 0])
    with pytest.raises(ValueError, match=r"absent from the gallery.*\[99\]"):
        identification_with_distractors(probe, np.array([0, 99]), gallery, labels, np.ones((3, 2)))
    with pytest.raises(ValueError, match="non-finite"):
        identification_with_distractors(probe, labels, gallery, labels, np.array([[np.nan, 1.0]]))
