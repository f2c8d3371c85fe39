"""The GFD evaluation protocol (ml/discovery/protocol.py): subsets, names of discovered identities, bad splits."""

from __future__ import annotations

import numpy as np
import pytest

from ml.discovery.protocol import gfd_baselines, gfd_chance, gfd_ssk, known_or_new_names
from ml.errors import DataError


def _split(n_ids: int = 6, per_id: int = 10, seed: int = 0):
    """Well-separated unit-norm identity clusters; ids < n_ids/2 known, half their train images labelled,
    the last image of every identity a test image."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_ids, 32))
    labels = np.repeat(np.arange(n_ids), per_id)
    x = centres[labels] + 0.05 * rng.standard_normal((len(labels), 32))
    index = np.tile(np.arange(per_id), n_ids)
    known = labels < n_ids // 2
    test = index == per_id - 1
    labelled = known & ~test & (index % 2 == 0)
    return x.astype(np.float32), labels, labelled, known, test


def test_ssk_on_separable_identities_scores_perfectly_on_both_subsets():
    x, labels, labelled, known, test = _split()
    out = gfd_ssk(x, labels, labelled, known, test, n_init=2)
    for subset in ("test", "transductive"):
        assert out.metrics[f"{subset}/all"] == 1.0 and out.metrics[f"{subset}/novel"] == 1.0
    assert out.metrics["nnc"] == pytest.approx(0.0)  # one test image per identity: no neighbour shares its cluster
    names = known_or_new_names(out, [f"id{i}" for i in range(6)])
    # known identities are named, novel ones get a new-cluster id shared by all images of that identity
    assert names[0] == "id0" and names[10] == "id1"
    novel_names = {names[i] for i in np.flatnonzero(labels == 5)}
    assert len(novel_names) == 1 and next(iter(novel_names)).startswith("new-")


def test_baselines_choose_their_setting_without_reading_unlabelled_labels(monkeypatch):
    import ml.discovery.protocol as protocol

    seen = []  # the labels every choice of setting was made on

    def recording_best_of(preds, y_true, known_mask):
        seen.append(np.asarray(y_true).copy())
        return protocol.best_of.__wrapped__(preds, y_true, known_mask)

    recording_best_of.__wrapped__ = protocol.best_of
    monkeypatch.setattr(protocol, "best_of", recording_best_of)
    x, labels, labelled, known, test = _split()
    out = gfd_baselines(x, labels, labelled, known, test, eps_grid=[0.3, 0.8], min_samples_grid=[2])
    assert set(out) == {"kmeans", "agglomerative", "dbscan"}
    assert out["agglomerative"].setting in {"ward", "average", "complete", "single"}
    assert out["dbscan"].setting in {"(0.3, 2)", "(0.8, 2)"}
    assert all(o.known_classes is None for o in out.values())
    # the labels of the scored images (test and unlabelled train) permuted among themselves: every choice reads
    # the same labels and makes the same clusters; only the scores move
    scrambled = labels.copy()
    hidden = np.flatnonzero(~labelled)
    scrambled[hidden] = np.random.default_rng(2).permutation(labels[hidden])
    first = list(seen)
    again = gfd_baselines(x, scrambled, labelled, known, test, eps_grid=[0.3, 0.8], min_samples_grid=[2])
    assert len(seen) == 2 * len(first) == 6
    for a, b in zip(first, seen[len(first):]):
        np.testing.assert_array_equal(a, b)
    for name, outcome in out.items():
        assert again[name].setting == outcome.setting, name
        np.testing.assert_array_equal(again[name].pred, outcome.pred)
    assert again["kmeans"].metrics["test/all"] < out["kmeans"].metrics["test/all"]


def test_chance_is_the_expected_accuracy_of_a_random_partition():
    # 2 identities × 2 images: of the 6 equally likely arrangements 2 are right (accuracy 1) and 4 half right
    labels = np.array([0, 0, 1, 1])
    none, test = np.zeros(4, bool), np.ones(4, bool)
    out = gfd_chance(labels, none, none, test, draws=4000, seed=0)
    assert out.metrics["test/all"] == pytest.approx(2 / 3, abs=0.02)
    assert out.metrics["test/all"] > 1 / 2  # far above 1/K
    x, labels, labelled, known, test = _split()
    assert gfd_chance(labels, labelled, known, test).metrics["test/all"] < gfd_ssk(
        x, labels, labelled, known, test, n_init=1).metrics["test/all"]


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda lab, kn, te: lab.__setitem__(np.flatnonzero(te & kn)[0], True), "test image is labelled"),
    (lambda lab, kn, te: lab.__setitem__(np.flatnonzero(~kn & ~te)[0], True), "unknown identity"),
    (lambda lab, kn, te: te.__setitem__(slice(None), False), "no test image"),
])
def test_a_leaky_or_empty_split_is_refused(mutate, match):
    x, labels, labelled, known, test = _split()
    mutate(labelled, known, test)
    with pytest.raises(DataError, match=match):
        gfd_ssk(x, labels, labelled, known, test, n_init=1)


def test_the_report_says_when_facegcd_does_not_beat_a_baseline():
    from tasks.evaluate.discovery import verdict

    def metrics(facegcd: float, kmeans: float) -> dict[str, float]:
        return {"discovery/facegcd/transductive/all": facegcd, "discovery/gcd/transductive/all": 0.50,
                "discovery/fr_ssk/transductive/all": 0.52, "discovery/kmeans/transductive/all": kmeans,
                "discovery/chance/transductive/all": 0.90}  # chance is a reference row, never "the best method"

    behind = " ".join(verdict(metrics(0.535, 0.595)))
    assert "**FaceGCD does not beat k-means (FR features)** here (-6.0 points)" in behind
    assert "over the GCD control (what the prefixes add) +3.5 points" in behind
    assert "over FR features + SSK (what the contrastive training adds) +1.5 points" in behind
    ahead = " ".join(verdict(metrics(0.62, 0.595)))
    assert "FaceGCD beats every other method here, the best being k-means (FR features) by 2.5 points" in ahead
    assert verdict({"discovery/kmeans/transductive/all": 0.6}) == []  # no FaceGCD row: no verdict


def test_a_pretrained_recogniser_gets_its_reference_row_beside_the_runs_fr_features():
    from tasks.evaluate.discovery import reference_method, render_section, verdict

    rows = {"fr_ssk": 0.52, reference_method("sface"): 0.97, "kmeans": 0.5, "facegcd": 0.55, "chance": 0.3}
    metrics = {f"discovery/{m}/{s}/{k}": v for m, v in rows.items() for s in ("transductive", "test")
               for k in ("all", "known", "novel")}
    table = [line for line in render_section(metrics) if line.startswith("| ")][1:]
    assert [line.split(" | ")[0] for line in table] == [
        "| FaceGCD + SSK", "| FR features + SSK", "| `sface` features + SSK (pretrained reference)",
        "| k-means (FR features)", "| chance (random partition, true cluster sizes)"]
    assert table[2].startswith("| `sface` features + SSK (pretrained reference) | 97.0 | 97.0 | 97.0 |")
    # a reference, not a competitor: the verdict weighs FaceGCD against the run's own methods only
    assert "beats every other method here, the best being FR features + SSK" in " ".join(verdict(metrics))
