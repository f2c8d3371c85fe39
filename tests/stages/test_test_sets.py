"""experiments/test_sets.py: the rule that calls a difference beyond noise over independent test sets and Holm's
correction, against hand-computed values; every claims experiment's test sets rendered beside the default run's and
found disjoint; and that the reports' pure parts load without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.test_sets import DATA_SEEDS, LOOKED_AT, across_test_sets, holm, over_test_sets, shared_faces

ROOT = Path(__file__).resolve().parents[2]


def _default_run_faces():
    """What `make run` renders, as {part: (procedural seed, identities)}, and its data config: params.yaml's data
    section through prepare's own identity layout."""
    from ml.config import from_mapping
    from tasks.common import load_params, section
    from tasks.prepare import DataConfig, procedural_identities

    data = from_mapping(DataConfig, section(load_params(ROOT / "params.yaml"), "data"), "data")
    return {part: (data.seed, ids) for part, ids in procedural_identities(data).items()}, data


def test_every_claims_test_set_shares_no_face_with_the_default_run():
    """Each claims experiment's scored identities for every default data seed, rendered beside every set the default
    run renders: no identity's parameters and no image in common (the seeds looked at are not among them)."""
    from experiments import claims, discovery_claims, fusion_claims, uiface_claims

    rendered, data = _default_run_faces()
    assert not set(DATA_SEEDS) & set(LOOKED_AT) and len(DATA_SEEDS) >= 5
    for d in DATA_SEEDS:
        scored = {f"{name} ({source.__name__.split('.')[-1]})": ids for source, sets in (
            (claims, {**claims.scored_identities("misaligned", claims.Scale(), d),
                      **claims.scored_identities("noisy", claims.Scale(), d),
                      **claims.scored_identities("many", claims.Scale(), d)}),
            (uiface_claims, uiface_claims.scored_identities(uiface_claims.Scale(), d)),
            (discovery_claims, discovery_claims.scored_identities(discovery_claims.Scale(), d)),
            (discovery_claims, {"discovery strong": discovery_claims.scored_identities(
                discovery_claims.Scale(**discovery_claims.STRONG), d)["discovery"]}),
            (fusion_claims, fusion_claims.scored_identities(data, d))) for name, ids in sets.items()}
        assert shared_faces(scored, rendered) == [], d


def test_a_test_set_drawn_from_the_default_runs_faces_is_caught_naming_both():
    """The discovery claims' earlier layout (data seed 2 = identities 310–389 of procedural seed 0) shares 80
    identities with the default run's discovery set and 0 with its training set."""
    rendered, _ = _default_run_faces()
    found = shared_faces({"discovery claims, data seed 2": (0, range(310, 390))}, rendered)
    assert found == ["discovery claims, data seed 2 (seed 0, identities 310–389) shares 80 identities and 80 images "
                     "with discovery"]
    one = shared_faces({"one": (0, range(5, 6))}, {"train": (0, range(200))})  # one face is enough
    assert one and "shares 1 identities and 1 images with train" in one[0]


def test_the_bootstrap_over_identities_draws_whole_identities():
    """Identity A: four items, each +1; identity B: one item, 0. Drawing identities gives AA (mean 1), AB (4/5) or
    BB (0) with probabilities 1/4, 1/2, 1/4, so the 95 % interval is [0, 1]; drawing the five items as if independent
    almost never gives 0 (0.2⁵) and narrows the interval."""
    arm, ref = [np.array([1, 1, 1, 1, 0], dtype=float)], [np.zeros(5)]
    by_identity = across_test_sets(arm, ref, [0], identities=[np.array([7, 7, 7, 7, 3])])
    assert (by_identity["ci_low"], by_identity["ci_high"], by_identity["resampled"]) == (0.0, 1.0, "identities")
    by_item = across_test_sets(arm, ref, [0])
    assert by_item["resampled"] == "items" and by_item["ci_low"] >= 0.4 and by_item["mean"] == by_identity["mean"]


def test_holm_rejects_in_step_down_order_and_never_a_missing_p():
    # m = 4: 0.005 ≤ .05/4 and 0.01 ≤ .05/3 rejected; 0.03 > .05/2 stops, so 0.04 is kept though ≤ .05
    assert holm([0.01, 0.04, 0.03, 0.005]) == [True, False, False, True]
    assert holm([None, 0.001]) == [False, True]  # m counts the missing p: 0.001 ≤ .05/2
    assert holm([0.03, 0.04]) == [False, False] and holm([0.03]) == [True]


def test_over_test_sets_needs_two_units_the_mean_beyond_two_se_and_one_sign():
    # +1, +2, +3: mean 2, sample std 1, SE 1/√3 = 0.577; 2 > 1.155 and all positive
    d = over_test_sets([1.0, 2.0, 3.0])
    assert d["mean"] == pytest.approx(2.0) and d["std"] == pytest.approx(1.0)
    assert d["se"] == pytest.approx(1 / np.sqrt(3)) and (d["units"], d["higher"], d["beyond_noise"]) == (3, 3, True)
    # t = 2 / 0.577 = 3.464 on 2 degrees of freedom: sf = (1 − t / √(t² + 2)) / 2 = 0.0371, two-sided p 0.0742
    assert d["p"] == pytest.approx(1 - np.sqrt(12) / np.sqrt(14), abs=1e-9)
    d = over_test_sets([-0.1, 2.0, 3.0])  # mean 1.63, SE 0.91: beyond 2 SE fails first, and one unit disagrees
    assert not d["beyond_noise"] and d["higher"] == 2
    d = over_test_sets([-1.0, 3.0, 3.1, 2.9, 3.0, 3.0])  # mean beyond 2 SE (2.33 > 1.33) but one unit disagrees
    assert d["mean"] > 2 * d["se"] and not d["beyond_noise"]
    d = over_test_sets([5.0])  # one test set: no SE, no verdict beyond noise
    assert d["se"] is None and d["std"] == 0.0 and not d["beyond_noise"] and d["p"] is None


def test_differences_take_the_data_seed_as_the_unit_with_an_interval_over_pairs():
    b = lambda *v: np.array(v, dtype=bool)  # noqa: E731
    # data seed 0 has two training seeds: per-pair differences [1,0,0,0] and [1,0,1,0] average to [1,0,.5,0], mean
    # 0.375; data seed 1: [0,1,0,0], mean 0.25. Over the two test sets: mean 0.3125, sample std 0.125/√2, SE 0.0625.
    arm = [b(1, 1, 0, 0), b(1, 0, 1, 0), b(1, 1, 1, 1)]
    ref = [b(0, 1, 0, 0), b(0, 0, 0, 0), b(1, 0, 1, 1)]
    d = across_test_sets(arm, ref, [0, 0, 1])
    assert d["mean"] == pytest.approx(0.3125) and d["std"] == pytest.approx(0.125 / np.sqrt(2))
    assert d["se"] == pytest.approx(0.0625) and (d["units"], d["higher"]) == (2, 2)
    assert d["ci_low"] <= d["mean"] <= d["ci_high"] and d["ci_low"] >= 0.0
    # every pair right against every pair wrong on three test sets: no spread, the interval is the point
    d = across_test_sets([np.ones(50, bool)] * 3, [np.zeros(50, bool)] * 3, [2, 3, 4])
    assert (d["mean"], d["ci_low"], d["ci_high"], d["beyond_noise"]) == (1.0, 1.0, 1.0, True)
    # a large gain on two test sets and a loss on the third: not beyond noise, whatever the mean
    rng = np.random.default_rng(0)
    ref = [rng.random(2000) < 0.5 for _ in range(3)]
    arm = [ref[0] | (rng.random(2000) < 0.4), ref[1] | (rng.random(2000) < 0.4), ref[2] & (rng.random(2000) < 0.9)]
    d = across_test_sets(arm, ref, [0, 1, 2])
    assert d["mean"] > 0.1 and d["higher"] == 2 and not d["beyond_noise"]
    d = across_test_sets(arm[:1], ref[:1], [0])  # one test set: no SE, no verdict beyond noise
    assert d["se"] is None and d["units"] == 1 and not d["beyond_noise"] and d["ci_low"] > 0.1


def test_the_report_modules_pure_parts_load_without_torch():
    code = ("import sys; import experiments.test_sets, experiments.uiface_summary; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0
