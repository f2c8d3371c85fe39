"""ml/generator/contexts.py: DCFace-style greedy inter-class filtering of identity contexts."""

from __future__ import annotations

import logging
import math
import pickle

import numpy as np
import pytest

from ml.errors import ConfigError, DataError
from ml.generator.contexts import IdentityShortfall, select_identity_contexts

pytestmark = pytest.mark.usefixtures("one_thread")


def _deg(*angles: float) -> np.ndarray:
    return np.array([[math.cos(math.radians(a)), math.sin(math.radians(a))] for a in angles])


# candidate:  0    1     2     3     4      5
# angle:      0°   10°   90°   45°   100°   180°
HAND = _deg(0, 10, 90, 45, 100, 180) * np.array([[1.0], [2.0], [0.5], [1.0], [3.0], [1.0]])  # lengths do not matter
BOUND = 0.9  # cos 25.8°: candidates closer than ~25.8° clash


def _greedy_reference(emb: np.ndarray, n: int, bound: float, order) -> list[int]:
    """The definition, one candidate at a time."""
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    kept: list[int] = []
    kept_unit = np.empty((n, unit.shape[1]))
    for i in order:
        if (kept_unit[: len(kept)] @ unit[i] < bound).all():
            kept_unit[len(kept)] = unit[i]
            kept.append(int(i))
            if len(kept) == n:
                break
    return kept


def test_greedy_hand_worked_default_order():
    # 0 kept; 1 (10° from 0, cos .985) rejected; 2 (90°) kept; 3 (45° from both, cos .707) kept;
    # 4 (10° from 2) rejected; 5 (180°) kept.
    assert select_identity_contexts(HAND, 4, BOUND).tolist() == [0, 2, 3, 5]


def test_greedy_respects_the_visit_order():
    # reversed: 5 kept; 4 (80° from 5) kept; 3 (55° from 4) kept; 2 (10° from 4) rejected;
    # 1 (35° from 3, cos .819 < .9) kept -> 4 reached before candidate 0 is visited.
    assert select_identity_contexts(HAND, 4, BOUND, order=[5, 4, 3, 2, 1, 0]).tolist() == [5, 4, 3, 1]
    # a subset visits only those candidates
    assert select_identity_contexts(HAND, 2, BOUND, order=np.array([1, 0, 2])).tolist() == [1, 2]


def test_stops_once_enough_are_kept():
    assert select_identity_contexts(HAND, 2, BOUND).tolist() == [0, 2]


def test_bound_is_strict():
    # 0° and 60°: cos exactly 0.5 is not < 0.5, so 60° is rejected; 90° (cos 0) is kept
    emb = np.array([[1.0, 0.0], [0.5, math.sqrt(3) / 2], [0.0, 1.0]])
    assert select_identity_contexts(emb, 2, 0.5).tolist() == [0, 2]


def test_bound_is_exact_against_contexts_kept_in_earlier_blocks():
    # Candidates 300 and 301 meet the kept ones through the blocked float32 screen; their cosines to
    # candidate 0 (0.6 exactly, and 0.6 - ~1e-7) sit inside its tolerance, so float64 decides:
    # 300 (not < 0.6) is rejected, 301 kept. Candidates 2..299 duplicate candidate 1.
    near = np.array([0.6 - 1e-7, 0.8 + 0.75e-7])
    emb = np.concatenate([[[1.0, 0.0]], np.tile([[-1.0, 0.0]], (299, 1)), [[0.6, 0.8]], [near]])
    kept = select_identity_contexts(emb, 3, 0.6)
    assert kept.tolist() == [0, 1, 301] == _greedy_reference(emb, 3, 0.6, range(302))


def test_kept_set_is_pairwise_below_bound_and_equals_the_definition():
    # 1500 clustered candidates in 8-d: many clash, and the blocks of 256 are crossed several times
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(60, 8))
    emb = centres[rng.integers(0, 60, 1500)] + 0.3 * rng.normal(size=(1500, 8))
    order = rng.permutation(1500)
    kept = select_identity_contexts(emb, 120, 0.6, order=order, allow_fewer=True)
    assert kept.tolist() == _greedy_reference(emb, 120, 0.6, order)
    unit = emb[kept] / np.linalg.norm(emb[kept], axis=1, keepdims=True)
    cos = unit @ unit.T
    assert cos[np.triu_indices(len(kept), k=1)].max() < 0.6
    assert kept.dtype == np.int64 and len(set(kept.tolist())) == len(kept)


def test_many_512d_candidates_are_pairwise_below_bound_and_greedy_maximal():
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(3000, 512)).astype(np.float32)  # random 512-d: cosines ~ N(0, 1/512)
    kept = select_identity_contexts(emb, 2000, 0.15)
    assert kept.size == 2000 and np.all(np.diff(kept) > 0)  # default order: kept in index order
    unit = emb.astype(np.float64)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    cos = unit[: kept[-1] + 1] @ unit[kept].T  # (visited, kept)
    assert cos[kept][np.triu_indices(kept.size, k=1)].max() < 0.15
    # every visited candidate that was dropped clashes with a context kept before it
    dropped = np.setdiff1d(np.arange(kept[-1] + 1), kept)
    assert dropped.size > 0
    earlier = kept[None, :] < dropped[:, None]
    assert np.all(np.where(earlier, cos[dropped], -np.inf).max(axis=1) >= 0.15)


def test_shortfall_error_fields_and_message():
    with pytest.raises(IdentityShortfall) as err:
        select_identity_contexts(HAND, 5, BOUND)
    e = err.value
    assert isinstance(e, DataError)
    assert (e.found, e.asked, e.n_candidates, e.max_cosine) == (4, 5, 6, BOUND)
    assert e.indices.tolist() == [0, 2, 3, 5]
    msg = str(e)
    assert "found 4 identity contexts of the 5 asked among 6 candidates" in msg
    assert "generate more candidates" in msg and "raise max_cosine" in msg and "allow_fewer=True" in msg
    back = pickle.loads(pickle.dumps(e))
    assert (back.found, back.asked, str(back)) == (4, 5, msg)


def test_allow_fewer_returns_what_was_found_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="ml.generator.contexts"):
        kept = select_identity_contexts(HAND, 5, BOUND, allow_fewer=True)
    assert kept.tolist() == [0, 2, 3, 5]
    assert "found 4 identity contexts of the 5 asked" in caplog.text


@pytest.mark.parametrize(
    "emb, kwargs, error, match",
    [
        (np.where(np.arange(12).reshape(6, 2) == 5, np.nan, HAND), {}, DataError, r"first at row 2"),
        (np.where(np.arange(12).reshape(6, 2) >= 10, 0.0, HAND), {}, DataError, r"all-zero row\(s\) \(first at row 5"),
        (HAND[0], {}, DataError, r"\(N, D\)"),
        (HAND, {"n_identities": 0}, ConfigError, "n_identities must be a positive integer"),
        (HAND, {"max_cosine": 1.5}, ConfigError, r"max_cosine must be in \(-1, 1\]"),
        (HAND, {"max_cosine": -1.0}, ConfigError, r"max_cosine must be in \(-1, 1\]"),
        (HAND, {"order": [0, 6]}, ConfigError, "index 6 outside the 6 candidates"),
        (HAND, {"order": [0, 2, 0]}, ConfigError, "visits candidate 0 more than once"),
        (HAND, {"order": [[0, 1]]}, ConfigError, "1-D sequence"),
    ],
)
def test_input_errors(emb, kwargs, error, match):
    args = {"n_identities": 2, "max_cosine": BOUND, **kwargs}
    with pytest.raises(error, match=match):
        select_identity_contexts(emb, args.pop("n_identities"), args.pop("max_cosine"), **args)
