"""What of a stage's summary becomes an MLflow column, a curve over set size, or a detail in the run's
``metrics/details.json``: the runs table keeps the numbers runs are compared on."""

from __future__ import annotations

from ops.tracking import split_summary


def test_counts_bounds_and_spreads_are_details_and_set_sizes_are_steps():
    columns, curves, details = split_summary({
        "real/identification/rank1": 0.8,
        "real/templates/tar@far=1e-4": 0.3,
        "real/templates/pairs": 900.0,
        "real/verification/procedural/std": 0.01,
        "sets/videos_single/caface/n_mated": 40.0,
        "sets/videos_single/caface/rank1_ci_high": 0.9,
        "sets/videos_single/caface_minus_average/rank1/ci_low": 0.02,
        "sets/gain/caface/n=64/rank1": 0.95,
        "sets/gain/caface/n=1/rank1": 0.4,
        "validate/leakage/train_heldout/shared_images": 0.0,
        "validate/train/success_percent": 100.0,
        "synthetic/t0_std": 0.2,
        "data/template_pairs": 900.0,
        "skipped": None,
    })
    assert columns == {"real/identification/rank1": 0.8, "real/templates/tar_at_far_1e-4": 0.3,
                       "validate/train/success_percent": 100.0, "synthetic/t0_std": 0.2, "data/template_pairs": 900.0}
    assert curves == {"sets/gain/caface/rank1": {1: 0.4, 64: 0.95}}
    assert set(details) == {"real/templates/pairs", "real/verification/procedural/std",
                            "sets/videos_single/caface/n_mated", "sets/videos_single/caface/rank1_ci_high",
                            "sets/videos_single/caface_minus_average/rank1/ci_low",
                            "validate/leakage/train_heldout/shared_images"}
