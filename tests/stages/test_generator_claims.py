"""experiments/uiface_summary.py (aggregation, verdict, report) on fabricated per-seed numbers, and the sampler rows
and the time estimate of experiments/uiface_claims.py (no training)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from experiments.uiface_claims import estimate_seconds, sampler_configs
from experiments.uiface_runs import Units, aggregate, by_data_seed, over_generators
from experiments.uiface_summary import (
    CLAIM_MODE, MODES, QUICK, Scale, compare, effective_threshold, render, scale_of, summarize, with_holm,
    with_sample_std,
)

SEEDS = ["0", "1", "2"]


def _mode(acc: float, div: float) -> dict[str, float]:
    return {"accuracy": acc, "identity_consistency": 1.0 - div, "diversity": div, "inter_class_mean_cos": 0.1,
            "inter_class_max_cos": 0.4, "precision": 0.5, "recall": 0.3, "t0_mean": 500.0, "t0_std": 10.0,
            "never_switched": 0.0, "unet_evals_per_face": 15.0, "synthesis_seconds": 20.0, "fr_train_seconds": 12.0}


def fabricate(claim_acc: list[float], claim_div: list[float]) -> dict[str, dict]:
    """Baseline accuracy 0.60/0.62/0.64 and diversity 0.20/0.21/0.22; the other two-stage rows equal the baseline."""
    per_seed = {}
    for i, seed in enumerate(SEEDS):
        base = _mode(0.60 + 0.02 * i, 0.20 + 0.01 * i)
        modes = {m: dict(base) for m in MODES}
        modes[CLAIM_MODE] = _mode(claim_acc[i], claim_div[i])
        per_seed[seed] = {"identities_found": 38 + i, "recall_k": 10, "modes": modes,
                          "real": {"real_32px": 0.70, "real_64px": 0.75},
                          "real_stats": {"identity_consistency": 0.6, "diversity": 0.4, "inter_class_mean_cos": 0.0}}
    return per_seed


SETUP = {"teacher_seconds": 80.0, "teacher_accuracy": 0.8, "teacher_accuracy_32px": 0.7, "generator_seconds": 300.0,
         "generator_loss": 0.05, "generator_steps": 456, "recall_k": 10}


def report(per_seed: dict) -> tuple[dict, str]:
    summary = summarize(per_seed)
    results = {"seeds": [int(s) for s in SEEDS], "setup": SETUP, "per_seed": per_seed, "summary": summary,
               "measured_at": "2026-01-01 00:00 UTC"}
    return summary, render(results, Scale())


def test_mean_std_and_gap_are_computed_over_seeds():
    acc, div = [0.70, 0.72, 0.74], [0.40, 0.42, 0.44]
    summary, text = report(fabricate(acc, div))
    r = summary["modes"][CLAIM_MODE]
    # mean 0.72; deviations ±0.02, 0: sample variance (0.0004 + 0 + 0.0004) / 2, so the sample std is 0.02
    assert r["accuracy"]["mean"] == pytest.approx(0.72) and r["accuracy"]["std"] == pytest.approx(0.02)
    assert r["accuracy"]["values"] == pytest.approx(acc)
    assert r["diversity"]["mean"] == pytest.approx(0.42)
    # gaps (0.70 − a)/a: 0, −0.02/0.72 = −0.027778, −0.04/0.74 = −0.054054; mean −0.027277, sample std 0.027031
    assert r["gap_real_32px"]["mean"] == pytest.approx(-0.027277, abs=1e-6)
    assert r["gap_real_32px"]["std"] == pytest.approx(0.027031, abs=1e-6)
    assert summary["identities_found"]["mean"] == pytest.approx(39.0)
    assert "72.00 ± 2.00 %" in text and "0.420 ± 0.020" in text  # accuracy and diversity of the claim row
    assert "-2.7 ± 2.7 %" in text and "Mean ± sample std (ddof 1) over seeds." in text
    for mode in MODES:
        assert f"`{mode}`" in text


def test_a_summary_stored_with_population_stds_renders_with_sample_stds():
    summary = summarize(fabricate([0.70, 0.72, 0.74], [0.40, 0.42, 0.44]))
    old = json.loads(json.dumps(summary))
    old["modes"][CLAIM_MODE]["accuracy"]["std"] = 0.01633  # what the population std (ddof 0) stored
    old["versus_baseline"][CLAIM_MODE]["accuracy"]["paired_std"] = 0.0
    fixed = with_sample_std(old)
    assert fixed["modes"][CLAIM_MODE]["accuracy"]["std"] == pytest.approx(0.02)
    # paired differences 0.70 − 0.60, 0.72 − 0.62, 0.74 − 0.64: all 0.10, so their std is 0
    assert fixed["versus_baseline"][CLAIM_MODE]["accuracy"]["paired_std"] == pytest.approx(0.0, abs=1e-12)
    assert old["modes"][CLAIM_MODE]["accuracy"]["std"] == 0.01633  # the stored results are not changed in place


def test_verdict_holds_when_adaptive_injection_wins_beyond_one_std():
    summary, text = report(fabricate([0.70, 0.72, 0.74], [0.40, 0.42, 0.44]))
    assert summary["claim_holds"]
    assert summary["claim_accuracy"] == summary["claim_diversity"] == "higher"
    assert "**Yes, in direction at this scale**" in text
    assert "Why it may not hold" not in text


def test_verdict_flips_when_the_numbers_flip():
    summary, text = report(fabricate([0.50, 0.52, 0.54], [0.10, 0.11, 0.12]))
    assert not summary["claim_holds"]
    assert summary["claim_accuracy"] == summary["claim_diversity"] == "lower"
    assert "**No, not at this scale**" in text
    assert "Why it may not hold" in text


def test_a_win_within_one_std_is_not_enough():
    # accuracy higher by 0.5 pp on average but the baseline's sample std is 2.00 pp; diversity clearly higher
    summary, text = report(fabricate([0.605, 0.625, 0.645], [0.40, 0.42, 0.44]))
    assert summary["claim_diversity"] == "higher"
    assert summary["claim_accuracy"] == "within one std"
    assert not summary["claim_holds"]
    assert "not distinguishable from" in text


def test_compare_pairs_seeds():
    c = compare([1.0, 2.0, 3.0], [0.0, 2.5, 2.0])
    assert c["diff"] == pytest.approx(0.5)
    # sample stds: [1, 2, 3] → 1.0; [0, 2.5, 2] (mean 1.5, deviations −1.5, 1, 0.5) → √(3.5 / 2) = 1.3229
    assert c["margin"] == pytest.approx(1.3229, abs=1e-4)
    assert c["verdict"] == "within one std"
    assert c["paired_positive"] == 2
    assert c["paired_mean"] == pytest.approx(0.5)


def test_estimate_is_positive_and_quick_is_cheaper():
    rates = {"render_s_per_face": 0.005, "gen_train_s_per_image": 0.02, "unet_s_per_eval": 0.01,
             "ae_train_s_per_image": 0.005}
    full, quick = estimate_seconds(Scale(), rates, 3), estimate_seconds(QUICK, rates, 3)
    assert full["total"] == pytest.approx(sum(v for k, v in full.items() if k != "total"))
    pixel = estimate_seconds(dataclasses.replace(Scale(), latent=False), rates, 3)
    autoencoder = Scale().ae_epochs * Scale().train_identities * Scale().images_per_identity * 0.005
    gens = len(Scale().generator_seeds)
    assert full["generator"] - pixel["generator"] == pytest.approx(gens * autoencoder)  # one per generator seed
    one = estimate_seconds(dataclasses.replace(Scale(), generator_seeds=(0,)), rates, 3)
    assert full["sampling"] == pytest.approx(gens * one["sampling"])
    assert 0 < quick["total"] < full["total"]


def test_threshold_is_rescaled_to_the_ddim_step():
    assert effective_threshold(Scale(steps=50)) == pytest.approx(0.005)  # the paper's step, Δt = 20
    assert effective_threshold(Scale(steps=10)) == pytest.approx(0.025)  # Δt = 100
    assert effective_threshold(Scale(steps=10, threshold_per_paper_step=False)) == pytest.approx(0.005)


def test_sampler_configs_are_the_table2_rows_and_make_runs_sampler():
    cfgs = sampler_configs(Scale(), {"noise_schedule": {"num_train_timesteps": 1000, "beta_start": 1e-4,
                                                        "beta_end": 0.02}})
    assert list(cfgs) == list(MODES)
    assert [(c.mode, c.attention_injection) for c in cfgs.values()] == [
        ("baseline", False), ("two_stage_fixed", False), ("two_stage_fixed", True), ("two_stage_adaptive", False),
        ("two_stage_adaptive", True)]
    assert [c.threshold for c in cfgs.values()] == pytest.approx([0.01] * 5)  # 0.005 × Δt 40 / 20
    from tasks.common import Paths, load_params, section

    sampler = section(load_params(Paths().params), "synthesize")["sampler"]  # make run's is one of the rows
    assert (sampler["mode"], sampler["attention_injection"], sampler["t0"]) == ("two_stage_fixed", True, 500)
    assert cfgs["two_stage_fixed+injection"].t0 == 500
    assert cfgs["two_stage_fixed"].t0 == 500 and all(c.steps == 25 for c in cfgs.values())


def test_report_says_when_adaptive_faces_never_switched():
    per_seed = fabricate([0.50, 0.52, 0.54], [0.10, 0.11, 0.12])
    for r in per_seed.values():
        r["modes"][CLAIM_MODE]["never_switched"] = 1.0
    _, text = report(per_seed)
    assert "100 % of the adaptive faces never reached d_t < th" in text


def test_a_report_rendered_again_from_its_json_is_the_same_report():
    import json

    per_seed = fabricate([0.70, 0.72, 0.74], [0.30, 0.31, 0.32])
    summary, text = report(per_seed)
    results = {"seeds": [int(s) for s in SEEDS], "setup": SETUP, "per_seed": per_seed, "summary": summary,
               "measured_at": "2026-01-01 00:00 UTC"}
    stored = json.loads(json.dumps(results, sort_keys=True))  # as tasks.common.write_json stores it
    assert render(stored, Scale()) == text
    assert "on 2026-01-01 00:00 UTC" in text and "Chosen on:" in text and "Scored on:" in text
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `two_stage")]
    assert rows[-4:] == ["| `two_stage_fixed`", "| `two_stage_fixed+injection`", "| `two_stage_adaptive`",
                         "| `two_stage_adaptive+injection`"]


def test_a_verdict_that_does_not_survive_holm_over_the_table_makes_no_claim():
    """Two comparisons judged over 5 test sets: diversity at t = 10 (p 0.0006 ≤ .05/2) stays "higher"; accuracy at
    t = 2.2 (p 0.09) passes the uncorrected 2-SE rule, but not Holm, so the claim does not hold."""
    def judged(mean: float, se: float) -> dict:
        sets = {"mean": mean, "se": se, "units": 5, "std": se * 5 ** 0.5, "higher": 5, "beyond_noise": True}
        return {"diff": mean, "verdict": "higher", "test_sets": sets}

    summary = {"versus_baseline": {CLAIM_MODE: {"diversity": judged(0.1, 0.01), "accuracy": judged(0.022, 0.01)}},
               "claim_holds": True, "claim_diversity": "higher", "claim_accuracy": "higher"}
    fixed = with_holm(summary)
    claim = fixed["versus_baseline"][CLAIM_MODE]
    assert claim["diversity"]["verdict"] == "higher" and claim["diversity"]["holm"]
    assert claim["accuracy"]["verdict"] == "within noise after Holm" and claim["accuracy"]["holm_family"] == 2
    assert (fixed["claim_accuracy"], fixed["claim_holds"]) == ("within noise after Holm", False)


def test_with_pair_outcomes_each_seed_is_a_test_set_and_the_verdict_needs_them_to_agree():
    """Seeds that each scored their own held-out identities: the claimed mode's accuracy is "higher" only when every
    test set agrees beyond 2 SE and the pair interval excludes 0; a large mean carried by one set is within noise."""
    rng = np.random.default_rng(0)

    def with_outcomes(per_seed: dict, claim_rates: list[float]) -> dict:
        for (seed, r), rate in zip(per_seed.items(), claim_rates):
            base = rng.random(20000) < r["modes"]["baseline"]["accuracy"]  # pairs enough for Holm over 12 on 3 sets
            claim = base | (rng.random(20000) < rate)  # the claimed mode right wherever the baseline is, and more
            r["_correct"] = {**{m: base for m in MODES}, CLAIM_MODE: claim,
                             "real_32px": base, "real_64px": claim | base}
            r["modes"][CLAIM_MODE]["accuracy"] = float(claim.mean())
        return per_seed

    agree = summarize(with_outcomes(fabricate([0.7] * 3, [0.30, 0.31, 0.32]), [0.10, 0.12, 0.11]))
    acc = agree["versus_baseline"][CLAIM_MODE]["accuracy"]
    t = acc["test_sets"]
    assert (t["units"], t["higher"], acc["verdict"]) == (3, 3, "higher") and t["ci_low"] > 0
    div = agree["versus_baseline"][CLAIM_MODE]["diversity"]  # +0.10 on each seed: beyond noise over 3 sets
    assert div["verdict"] == "higher" and div["test_sets"]["std"] == pytest.approx(0)
    assert agree["claim_holds"]
    assert agree["real_vs_claim"]["real_32px"]["mean"] < 0 and agree["real_vs_claim"]["real_32px"]["beyond_noise"]
    # one seed's diversity falls: the mean is still +0.05, but the sets disagree → within noise, no claim
    split = summarize(with_outcomes(fabricate([0.7] * 3, [0.35, 0.36, 0.17]), [0.10, 0.12, 0.11]))
    assert split["versus_baseline"][CLAIM_MODE]["diversity"]["verdict"] == "within noise"
    assert not split["claim_holds"]
    summary, text = report(with_outcomes(fabricate([0.7] * 3, [0.30, 0.31, 0.32]), [0.10, 0.12, 0.11]))
    assert "each seed draws its own held-out identities" in text and "beyond noise over the independent" in text
    assert "- Native 64-px real faces − `two_stage_adaptive+injection`" in text


@pytest.mark.slow
def test_ablation_flow_writes_the_report_and_the_numbers_at_toy_scale(tmp_path):
    """The Prefect flow runs the whole ablation (quick scale, one seed) and leaves both files, whose numbers agree."""
    import json

    from flows.experiments import uiface_ablation

    out = uiface_ablation(seeds=[0, 2], generator_seeds=[0, 1], quick=True, out_dir=str(tmp_path))
    metrics = json.loads((tmp_path / "metrics" / "uiface_claims.json").read_text())
    report_md = (tmp_path / "reports" / "uiface_claims.md").read_text()
    assert out["claim_holds"] == metrics["summary"]["claim_holds"] and metrics["seeds"] == [0, 2] and metrics["quick"]
    acc = metrics["summary"]["versus_baseline"][CLAIM_MODE]["accuracy"]
    assert acc["test_sets"]["units"] == 2 and acc["verdict"] in ("higher", "lower", "within noise", "within noise "
                                                                 "after Holm")
    assert acc["test_sets"]["resampled"] == "identities"
    assert not any("_correct" in r for r in metrics["per_seed"].values())
    assert set(metrics["per_seed"]["0"]["modes"]) == set(MODES)
    assert sorted(metrics["per_run"]) == ["0:0", "0:2", "1:0", "1:2"]  # every generator on every data seed
    assert metrics["stability"]["generator_seeds"] == [0, 1] and metrics["setup"]["generator_seeds"] == [0, 1]
    for m in MODES:  # a data seed's number is the mean over its generators
        assert metrics["per_seed"]["2"]["modes"][m]["ssim_diversity"] == pytest.approx(np.mean(
            [metrics["per_run"][f"{g}:2"]["modes"][m]["ssim_diversity"] for g in (0, 1)]))
    assert "## Does the claim hold?" in report_md and "## Over generator seeds (stability)" in report_md
    # resumed with every part finished, nothing is trained again and the same numbers come back
    units = (tmp_path / "metrics" / "uiface_claims_units.jsonl").read_text().splitlines()
    assert len(units) == 1 + 2 + 4 + 2  # teacher, generators, (generator, data seed) modes, real arms
    again = uiface_ablation(seeds=[0, 2], generator_seeds=[0, 1], quick=True, resume=True, out_dir=str(tmp_path))
    assert again["seconds"] < out["seconds"]
    assert json.loads((tmp_path / "metrics" / "uiface_claims.json").read_text())["summary"] == metrics["summary"]


def _run(g: int, s: int, acc: float, ssim: float, rng: np.random.Generator) -> dict:
    modes = {m: {**_mode(acc, 0.3), "ssim_diversity": ssim} for m in MODES}
    modes[CLAIM_MODE] = {**_mode(acc + 0.05, 0.3), "ssim_diversity": ssim + 0.1}
    return {"generator_seed": g, "data_seed": s, "identities_found": 40 + g, "recall_k": 10, "modes": modes,
            "_correct": {m: rng.random(400) < modes[m]["accuracy"] for m in MODES}}


def _reals(rng: np.random.Generator) -> dict:
    return {"real": {"real_32px": 0.8, "real_64px": 0.8},
            "real_stats": {"identity_consistency": 0.6, "ssim_diversity": 0.5, "diversity": 0.4,
                           "inter_class_mean_cos": 0.0},
            "_correct": {r: rng.random(400) < 0.8 for r in ("real_32px", "real_64px")},
            "_identities": np.repeat(np.arange(40), 10)}


def test_a_data_seeds_numbers_are_the_mean_over_its_generators_and_the_spread_is_over_generators():
    """Two generators on three data seeds: per data seed each metric and each pair's outcome is the mean over the
    generators (a pair right under one of two counts 0.5); the stability rows are per-generator means over the
    data seeds, with a sample std over the generators and how many generators put the mode above the baseline."""
    rng = np.random.default_rng(0)
    per_run = {f"{g}:{s}": _run(g, s, 0.6 + 0.02 * g + 0.01 * s, 0.2 + 0.1 * g, rng) for g in (0, 1) for s in (2, 3, 4)}
    per_seed = by_data_seed(per_run, {str(s): _reals(rng) for s in (2, 3)})  # seed 4 has no real arms: left out
    assert sorted(per_seed) == ["2", "3"] and per_seed["2"]["generator_seeds"] == [0, 1]
    # accuracy 0.6 + 0.02 g + 0.01 s: at s = 2 the generators give 0.62 and 0.64, mean 0.63
    assert per_seed["2"]["modes"]["baseline"]["accuracy"] == pytest.approx(0.63)
    assert per_seed["2"]["identities_found"] == 40  # the fewer of 40, 41: the real arms' budget
    both = [per_run[f"{g}:2"]["_correct"]["baseline"] for g in (0, 1)]
    assert per_seed["2"]["_correct"]["baseline"] == pytest.approx((both[0].astype(float) + both[1]) / 2)
    stab = over_generators(per_run)
    # generator 0: mean accuracy over s = 2, 3, 4 is 0.63; generator 1: 0.65; sample std of (0.63, 0.65) = 0.01414
    assert stab["modes"]["baseline"]["accuracy"]["values"] == pytest.approx([0.63, 0.65])
    assert stab["modes"]["baseline"]["accuracy"]["std"] == pytest.approx(0.0141421, abs=1e-6)
    d = stab["versus_baseline"][CLAIM_MODE]["ssim_diversity"]
    assert d["values"] == pytest.approx([0.1, 0.1]) and (d["higher"], d["units"]) == (2, 2)


def test_the_diversity_claim_is_judged_in_pixels_not_on_the_consistency_it_mirrors():
    """1 − identity consistency rises with the claimed mode (its consistency falls) while its image diversity does
    not move: the claim's diversity verdict follows the pixels."""
    rng = np.random.default_rng(1)
    per_run = {f"0:{s}": _run(0, s, 0.6, 0.3, rng) for s in (2, 3, 4)}
    for r in per_run.values():
        r["modes"][CLAIM_MODE].update(ssim_diversity=0.3, diversity=0.6, identity_consistency=0.4)
    summary = summarize(by_data_seed(per_run, {str(s): _reals(rng) for s in (2, 3, 4)}))
    v = summary["versus_baseline"][CLAIM_MODE]
    assert v["diversity"]["verdict"] == "higher"  # the embedding proxy: consistency's fall, again
    assert v["ssim_diversity"]["verdict"] == "within noise" and summary["claim_diversity"] == "within noise"
    assert not summary["claim_holds"]
    assert v["accuracy"]["test_sets"]["resampled"] == "identities"


def test_units_round_trip_their_pair_outcomes_and_resume_only_the_same_scale(tmp_path):
    path = tmp_path / "units.jsonl"
    units = Units(path, QUICK, resume=False)
    outcome = np.random.default_rng(2).random(123) < 0.5
    units.add("real 2", {"real": {"real_32px": 0.5}, "_correct": {"real_32px": outcome},
                         "_identities": np.arange(123) % 7})
    back = Units(path, QUICK, resume=True).done["real 2"]
    assert back["real"] == {"real_32px": 0.5} and (back["_correct"]["real_32px"] == outcome).all()
    assert (back["_identities"] == np.arange(123) % 7).all()
    assert Units(path, dataclasses.replace(QUICK, generator_seeds=(5,)), resume=True).done  # seeds: same scale
    assert not Units(path, dataclasses.replace(QUICK, fr_epochs=2), resume=True).done  # another scale: not read
    Units(path, QUICK, resume=False)
    assert path.read_text() == ""  # a fresh run starts the file anew


def test_aggregate_needs_every_part_and_names_what_it_holds():
    rng = np.random.default_rng(3)
    done = {"teacher": {"teacher_seconds": 1.0, "teacher_accuracy": 0.8, "teacher_accuracy_32px": 0.7}}
    for g in (0, 1):
        done[f"generator {g}"] = {"generator_seconds": 10.0 + g, "generator_loss": 0.1, "generator_steps": 5}
        for s in (2, 3):
            done[f"modes {g} {s}"] = _run(g, s, 0.6, 0.3, rng)
    for s in (2, 3):
        done[f"real {s}"] = _reals(rng)
    results = aggregate(done, [2, 3], [0, 1])
    assert results["setup"]["generator_seconds"] == pytest.approx(10.5)
    assert results["setup"]["generator_seeds"] == [0, 1]
    assert "_correct" not in results["per_run"]["0:2"] and "_identities" not in results["per_seed"]["2"]
    text = render(json.loads(json.dumps(results)), QUICK)
    assert "Trained once per generator seed (0, 1)" in text and "`two_stage_fixed+injection`" in text
    del done["real 3"]
    with pytest.raises(KeyError, match="real 3"):
        aggregate(done, [2, 3], [0, 1])


def test_stored_results_of_the_kl_generator_keep_their_scale():
    """A results file written before the generator fields existed renders as what it ran: the KL latent, ε, one
    generator; a field it has wins."""
    scale = scale_of({"gen_size": 32, "ae_channels": [16, 32, 64], "gen_epochs": 50})
    assert (scale.ae_architecture, scale.gen_prediction_type, scale.generator_seeds) == ("kl", "epsilon", (0,))
    assert scale.ae_channels == (16, 32, 64) and scale.unet_side == 8
    assert scale_of({**dataclasses.asdict(Scale())}) == Scale()


def test_report_says_when_the_adaptive_switch_comes_too_early_to_differ_from_the_baseline():
    per_seed = fabricate([0.50, 0.52, 0.54], [0.10, 0.11, 0.12])
    _, text = report(per_seed)
    assert "switched early" not in text  # t0 500: half the steps on c_e
    for r in per_seed.values():
        r["modes"][CLAIM_MODE]["t0_mean"] = 887.0
    _, text = report(per_seed)
    assert "The adaptive rule switched early, at t0 ≈ 887 on average" in text


def test_one_generator_reports_no_spread_and_says_how_to_get_one():
    from experiments.uiface_summary import stability_lines

    rng = np.random.default_rng(4)
    one = "\n".join(stability_lines(over_generators({f"0:{s}": _run(0, s, 0.6, 0.3, rng) for s in (2, 3)})))
    assert "its spread over training runs is not measured" in one and "--generator-seeds 0 1 2 --resume" in one
    assert "± 0.00" not in one
    two = "\n".join(stability_lines(over_generators({f"{g}:2": _run(g, 2, 0.6, 0.3, rng) for g in (0, 1)})))
    assert "| `two_stage_adaptive+injection` |" in two and "(2 of 2)" in two
