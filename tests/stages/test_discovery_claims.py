"""experiments/discovery_claims.py: its claim statistics against hand-computed values, and the ``discovery-claims``
flow end to end at toy size (every arm per run, the paired claims, the report and the MLflow run)."""

from __future__ import annotations

import json

import pytest

from experiments.discovery_claims import beyond_noise, summarise
from ml.errors import ConfigError


def _runs(arm: str, all_: list[float], novel: list[float]) -> list[dict]:
    keys = ("test/known", "transductive/all", "transductive/known", "transductive/novel")
    return [{"arm": arm, "data_seed": s // 2, "seed": s % 2, "test/all": a, "test/novel": n, **dict.fromkeys(keys, 0.5)}
            for s, (a, n) in enumerate(zip(all_, novel))]


def test_claims_are_paired_per_run_with_sign_counts_and_a_noise_rule():
    runs = (_runs("fr_ssk", [0.50, 0.52, 0.54, 0.56], [0.40, 0.40, 0.40, 0.40])
            + _runs("gcd", [0.51, 0.53, 0.55, 0.57], [0.40, 0.43, 0.38, 0.41])
            + _runs("facegcd", [0.55, 0.55, 0.60, 0.56], [0.45, 0.44, 0.46, 0.45]))
    s = summarise(runs)
    assert s["arms"]["gcd"]["test/all"]["mean"] == pytest.approx(0.54)
    assert s["arms"]["gcd"]["test/all"]["std"] == pytest.approx(0.025819888974716)  # ddof 1 of .51 .53 .55 .57
    # gcd − fr_ssk on all: +0.01 every run (std 0): 4/4 higher, beyond noise
    d = s["claims"]["gcd-fr_ssk"]["test/all"]
    assert (d["mean"], d["std"], d["higher"], d["seeds"], d["beyond_noise"]) == (pytest.approx(0.01), pytest.approx(0),
                                                                                 4, 4, True)
    # gcd − fr_ssk on novel: 0, +.03, −.02, +.01 → mean +0.005, std 0.0208: within noise, 2/4 higher
    d = s["claims"]["gcd-fr_ssk"]["test/novel"]
    assert d["mean"] == pytest.approx(0.005) and d["higher"] == 2 and not d["beyond_noise"]
    # facegcd − gcd on all: +.04, +.02, +.05, −.01
    d = s["claims"]["facegcd-gcd"]["test/all"]
    assert d["mean"] == pytest.approx(0.025) and (d["higher"], d["seeds"]) == (3, 4)
    assert "facegcd-static_prefix" not in s["claims"]  # an arm that did not run makes no claim
    d = s["claims"]["facegcd-gcd"]["transductive/novel"]  # the third claim column: 0.5 in every run, no difference
    assert (d["mean"], d["higher"], d["beyond_noise"]) == (pytest.approx(0), 0, False)
    assert beyond_noise({"mean": 0.021, "std": 0.02, "seeds": 4}) and not beyond_noise({"mean": 0.019, "std": 0.02,
                                                                                         "seeds": 4})
    assert not beyond_noise({"mean": 0.5, "std": 0.0, "seeds": 1})  # one run says nothing about noise


def test_the_oracle_arm_alone_trains_with_every_training_label(monkeypatch):
    """The headroom row: the oracle gets the label of every training image (novel identities too), FaceGCD only the
    GFD split's; both see the same images, and the oracle's difference to the FR features is reported as headroom."""
    import numpy as np

    import experiments.discovery_claims as dc

    calls, anchors = [], []

    class Trained:
        history, best_epoch = [{"loss/unsup": 1.0, "loss/sup": 1.0}], 0

        class model:  # noqa: N801 - stands in for a FaceGCD model
            @staticmethod
            def embed(images, flip):
                return np.random.default_rng(len(calls)).normal(size=(len(images), 8)).astype(np.float32)

    def fake_train(cfg, images, labels, labelled, **kwargs):
        calls.append((images, labels, labelled))
        anchors.append(kwargs["anchor"])
        return Trained

    monkeypatch.setattr(dc, "train_discovery", fake_train)
    results = dc.run_claims([0], dc.QUICK, [0], ("facegcd", "oracle"))
    data = dc.make_data(dc.QUICK, 0)
    train = ~data["test"]
    (x_f, y_f, l_f), (x_o, y_o, l_o) = calls  # in the order of the arms
    np.testing.assert_array_equal(x_f, x_o)
    np.testing.assert_array_equal(l_f, data["labelled"][train])
    np.testing.assert_array_equal(y_f, np.where(data["labelled"], data["dy"], -1)[train])
    assert l_o.all() and (~l_f).any()
    for fr_x, fr_y in anchors:  # every arm's anchor: the FR model's own training set
        np.testing.assert_array_equal(fr_x, data["x"])
        np.testing.assert_array_equal(fr_y, data["y"])
    np.testing.assert_array_equal(y_o, data["dy"][train])
    assert "oracle-fr_ssk" in results["summary"]["claims"]
    report = dc.render(results, [0], [0], dc.QUICK, 1.0)
    assert "| oracle − FR features (headroom) |" in report
    # each row's image outcomes average to its accuracy; chance is scored on the same images without outcomes
    scored = [r for r in results["runs"] if r["arm"] != "chance"]
    assert {r["arm"] for r in scored} == {"fr_ssk", "facegcd", "oracle", "kmeans", "agglomerative"}
    for r in scored:
        for key in dc.CLAIM_KEYS:
            assert r["_correct"][key].mean() == pytest.approx(r[key])
    chance = next(r for r in results["runs"] if r["arm"] == "chance")
    assert "_correct" not in chance and 0 < chance["test/all"] < 1
    assert "| chance (random partitions with the true cluster sizes) |" in report


def test_the_strong_backbone_trains_lvface_on_its_identities_and_scores_the_blocks_after_them(monkeypatch):
    """``--backbone strong``: the FR model every arm starts from is LVFace's staged schedule (PartialFC 0.5) on
    ``STRONG``'s identities, and the discovery sets move to the blocks after them; the default stays plain ArcFace."""
    import dataclasses

    import experiments.discovery_claims as dc

    seen = []

    class Stop(Exception):
        pass

    def fake_fr(cfg, x, y, **kwargs):
        seen.append((cfg, len(set(y.tolist())), len(x)))
        raise Stop

    monkeypatch.setattr(dc, "train_fr", fake_fr)
    strong = dataclasses.replace(dc.QUICK, **{**dc.STRONG, "fr_identities": 20, "fr_images_per_identity": 3})
    for scale in (dc.QUICK, strong):
        with pytest.raises(Stop):
            dc.run_claims([0], scale, [2], ("facegcd",))
    (plain, n_plain, _), (lvface, n_strong, images) = seen
    assert (plain.lvface, plain.sample_rate) == (False, 1.0) and n_plain == dc.QUICK.fr_identities
    assert (lvface.lvface, lvface.sample_rate) == (True, 0.5) and (n_strong, images) == (20, 60)
    assert dc.scored_identities(strong, 2) == {"discovery": (2, range(20 + 2 * 12, 20 + 3 * 12))}
    assert dc.Scale(**dc.STRONG).fr_identities == 2000 and dc.Scale(**dc.STRONG).fr_lvface
    assert dc.choose_scale(False, 0, "strong") == (dc.Scale(**dc.STRONG), "discovery_claims_strong")
    with pytest.raises(ConfigError, match="default or strong"):
        dc.choose_scale(False, 0, "huge")


def test_with_image_outcomes_the_verdict_takes_the_test_set_as_its_unit():
    """Two data seeds × two training seeds: per test set the training seeds are averaged, so four runs that are
    all higher make two units, and a claim holds only if the test sets agree and the image interval excludes 0."""
    import numpy as np

    def rows(arm, outcomes):
        return [{"arm": arm, "data_seed": ds, "seed": s, **dict.fromkeys(dc_keys, 0.5),
                 "_correct": dict.fromkeys(("test/all", "test/novel", "transductive/novel"), np.array(o, bool))}
                for (ds, s), o in outcomes.items()]

    dc_keys = ("test/all", "test/known", "test/novel", "transductive/all", "transductive/known", "transductive/novel")
    ref = {(2, 0): [1, 0, 0, 0], (2, 1): [1, 0, 0, 0], (3, 0): [0, 0, 0, 0], (3, 1): [0, 0, 0, 0]}
    gcd = {(2, 0): [1, 1, 0, 0], (2, 1): [1, 1, 1, 0], (3, 0): [1, 0, 0, 0], (3, 1): [1, 1, 0, 0]}
    s = summarise(rows("fr_ssk", ref) + rows("gcd", gcd))
    t = s["claims"]["gcd-fr_ssk"]["test/all"]["test_sets"]
    # data seed 2: (+1/4 + +2/4) / 2 = 0.375; data seed 3: (1/4 + 2/4) / 2 = 0.375
    assert (t["units"], t["higher"]) == (2, 2) and t["mean"] == pytest.approx(0.375) and t["std"] == 0
    assert t["ci_low"] > 0 and t["beyond_noise"]
    # one test set against the other: +0.375 and −0.375 over four runs all of one seed's sign are not beyond noise
    flipped = {**gcd, (3, 0): [0, 0, 0, 0], (3, 1): [0, 0, 0, 0]}
    ref_up = {**ref, (3, 0): [1, 0, 0, 0], (3, 1): [1, 1, 0, 0]}
    t = summarise(rows("fr_ssk", ref_up) + rows("gcd", flipped))["claims"]["gcd-fr_ssk"]["test/all"]["test_sets"]
    assert t["mean"] == pytest.approx(0) and t["higher"] == 1 and not t["beyond_noise"]


def test_curves_average_over_runs_and_lead_with_the_fr_features_score():
    from experiments.discovery_claims import mean_curves

    def run(seed, fr, curve):
        return {"arm": "facegcd", "seed": seed, "val/accuracy/fr": fr,
                "curve": [{"loss/unsup": 4.0, "loss/sup": ls, "val/accuracy": va} for ls, va in curve]}

    runs = [run(0, 0.60, [(4.0, 0.62), (3.0, 0.64)]), run(1, 0.70, [(3.0, 0.66), (2.0, 0.70)]),
            {"arm": "fr_ssk", "seed": 0}]
    c = mean_curves(runs)
    assert list(c) == ["facegcd"]
    assert c["facegcd"]["val/accuracy"] == pytest.approx([0.65, 0.64, 0.67])  # epoch 0 = the FR features
    assert c["facegcd"]["loss/sup"] == pytest.approx([3.5, 2.5])


def test_initial_score_is_the_trainers_selection_score_on_the_starting_features():
    import numpy as np

    from experiments.discovery_claims import initial_score
    from ml.discovery.train import DiscoveryConfig, nearest_mean_accuracy, validation_split

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(6), 5)
    labelled = labels < 3
    feats = rng.normal(size=(30, 4)) + labels[:, None]
    cfg = DiscoveryConfig(val_per_identity=2, seed=3)
    held = validation_split(np.where(labelled, labels, -1), labelled, 2, 3)
    keep = labelled & ~held
    assert held.sum() == 6 and initial_score(feats, np.where(labelled, labels, -1), labelled, cfg) == pytest.approx(
        nearest_mean_accuracy(feats[keep], labels[keep], feats[held], labels[held]))
    assert initial_score(feats, labels, labelled, DiscoveryConfig(val_per_identity=0)) is None


@pytest.mark.slow
def test_discovery_claims_flow_writes_runs_claims_report_and_an_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    from flows.experiments import discovery_claims

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = discovery_claims(seeds=[0], data_seeds=[2, 3], arms=["facegcd", "gcd"], quick=True, out_dir=str(tmp_path))
    results = json.loads((tmp_path / "metrics" / "discovery_claims.json").read_text())
    assert results["recipe"]["temperature"] == 1.0 and results["recipe"]["val_per_identity"] == 2  # params.yaml's
    assert sorted((r["arm"], r["data_seed"]) for r in results["runs"]) == sorted(
        (a, d) for a in ("fr_ssk", "facegcd", "gcd", "kmeans", "agglomerative", "chance") for d in (2, 3))
    assert not any("_correct" in r for r in results["runs"])
    trained = [r for r in results["runs"] if r["arm"] in ("facegcd", "gcd")]
    assert all(r["epochs"] == 2 and 0 <= r["best_epoch"] < 2 and r["loss/unsup/first"] > 0 for r in trained)
    claim = results["summary"]["claims"]["facegcd-gcd"]["test/novel"]
    by = {(r["arm"], r["data_seed"]): r["test/novel"] for r in results["runs"]}
    assert claim["mean"] == pytest.approx(sum(by[("facegcd", d)] - by[("gcd", d)] for d in (2, 3)) / 2)
    assert claim["test_sets"]["units"] == 2 and claim["test_sets"]["mean"] == pytest.approx(claim["mean"])
    assert set(results["summary"]["claims"]) == {"facegcd-gcd", "gcd-fr_ssk", "facegcd-fr_ssk", "facegcd-kmeans",
                                                 "facegcd-agglomerative"}
    # Holm over the 5 claims × 3 columns: each verdict carries whether its p survived, which needs p ≤ .05 / 15
    corrected = [d["test_sets"] for c in results["summary"]["claims"].values() for d in c.values()]
    assert len(corrected) == 15 and all(isinstance(t["holm"], bool) for t in corrected)
    assert any(t["holm"] for t in corrected) == (min(t["p"] for t in corrected) <= 0.05 / 15)
    report = (tmp_path / "reports" / "discovery_claims.md").read_text()
    assert "GCD (no prefixes) + SSK" in report and "| data seed | seed |" in report and "holds beyond noise" in report
    assert "test sets);" in report and "Holm's procedure over the table's 15 comparisons" in report
    assert "| k-means (FR features, K = all identities, no labels) |" in report
    assert "| FaceGCD: score |" in report and (tmp_path / "reports" / "discovery_claims_curves.png").stat().st_size
    assert all(len(r["curve"]) == 2 and 0 <= r["val/accuracy/fr"] <= 1 for r in trained)
    run = mlflow.get_run(out["mlflow_run"])
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(out["mlflow_run"])}
    assert {"discovery_claims.md", "discovery_claims_curves.png", "metrics"} <= artifacts
    assert run.data.metrics["facegcd-gcd/test/novel/paired_mean"] == pytest.approx(claim["mean"])
    details = mlflow.artifacts.load_dict(f"runs:/{out['mlflow_run']}/metrics/details.json")
    assert details["facegcd-gcd/test/novel/test_sets_ci_low"] == pytest.approx(claim["test_sets"]["ci_low"])
    assert "facegcd-gcd/test/novel/test_sets_ci_low" not in run.data.metrics  # a bound: in the details only
    assert run.data.metrics["gcd/test/all/mean"] == pytest.approx(results["summary"]["arms"]["gcd"]["test/all"]["mean"])


def test_a_verdict_beyond_noise_alone_says_it_did_not_survive_holm():
    import experiments.discovery_claims as dc

    def cell(beyond: bool, holm: bool) -> dict:
        return {"test_sets": {"mean": 0.04, "beyond_noise": beyond, "holm": holm}}

    assert dc._verdict(cell(True, True), cell(True, True), cell(True, True)) == "yes"
    text = dc._verdict(cell(False, False), cell(False, False), cell(True, False))
    assert text == "no: within noise (transd. novel: beyond noise alone, not after Holm)"
