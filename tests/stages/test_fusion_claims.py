"""experiments/fusion_claims.py: the identity folds against hand-made material, and both ways end to end at toy size
(every fold trains without its test identities and never scores the val block; every data seed renders its own
identities and trains without the block it scores), and the report of both parts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.fusion_claims import fold_blocks, main, render, run_data_seeds, run_folds, split_fold
from ml.errors import ConfigError
from ml.fr.backbones.vit import vit_tiny
from ml.fusion.train import FusionConfig
from ml.models.io import save_model
from tasks.common import Paths
from tasks.prepare import DataConfig, _prepare_part
from tasks.train_fusion import FusionMaterial, FusionStageConfig

pytestmark = pytest.mark.usefixtures("one_thread")

VIT = dict(depth=4, dim=32, heads=2, embed_dim=16, drop_path=0.0)
DATA = DataConfig(train_identities=4, images_per_identity=3, val_fraction=0.0, fusion_identities=8,
                  fusion_clean_images=2, fusion_sources=2, fusion_copies=3)
STAGE = FusionStageConfig(val_identities=2, train=FusionConfig(epochs=1, steps_per_epoch=2, lr_steps=(), batch_size=4,
                                                              per_identity=8, group=4, max_len=4, accelerator="cpu"))


def test_folds_are_contiguous_blocks_that_stop_before_the_val_block():
    assert fold_blocks(450, 50, 5) == [range(0, 50), range(50, 100), range(100, 150), range(150, 200), range(200, 250)]
    assert fold_blocks(8, 2, 3)[-1] == range(4, 6)  # identities 6-7 are the val block
    with pytest.raises(ConfigError, match="give --folds between 2 and 3"):
        fold_blocks(8, 2, 4)
    with pytest.raises(ConfigError, match="at least 2 identities"):
        fold_blocks(8, 1, 2)


def test_a_fold_splits_the_material_by_identity_with_contiguous_labels():
    labels = np.repeat(np.arange(5), 2)  # identities 0..4, two items each
    material = FusionMaterial(features=np.arange(10, dtype=np.float32)[:, None], styles=np.zeros((10, 1, 2)),
                              labels=labels, sources=np.arange(10), centres=np.arange(5, dtype=np.float32)[:, None] * 10,
                              dataset=Path("."), kind="procedural-fusion")
    train, test = split_fold(material, range(1, 3))
    assert train.labels.tolist() == [0, 0, 1, 1, 2, 2] and train.features[:, 0].tolist() == [0, 1, 6, 7, 8, 9]
    assert train.centres[:, 0].tolist() == [0, 30, 40]  # identities 0, 3, 4
    assert test.labels.tolist() == [0, 0, 1, 1] and test.centres[:, 0].tolist() == [10, 20]
    assert test.sources.tolist() == [2, 3, 4, 5]


def test_the_baselines_weigh_a_sets_items_as_evaluate_does():
    """One set of identity 0: a strong item on its target (norm 10, landmarks on the template, quality 1) and two
    unit items on identity 1's (landmarks 30 px off, quality 0). Averaging the unit features picks identity 1; each
    weighting baseline picks identity 0."""
    from experiments.fusion_claims import _baseline_hits
    from ml.fusion.baselines import ARCFACE_TEMPLATE_112
    from ml.fusion.train import FusionVal

    feats = torch.tensor([[[10.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])  # (S=1, n=3, D=2)
    val = FusionVal(feats, torch.zeros(1, 3, 1, 2), torch.tensor([0]), torch.eye(2))
    template = np.asarray(ARCFACE_TEMPLATE_112, np.float32)
    landmarks = np.stack([template, template + 30, template + 30])[None]  # (1, 3, 5, 2)
    hits = _baseline_hits(val, landmarks, np.ones((1, 3), np.float32), np.array([[1.0, 0.0, 0.0]], np.float32), 112.0)
    assert {k: bool(v[0]) for k, v in hits.items()} == {"norm_weighted": True, "landmark_score": True,
                                                        "quality_oracle": True}
    units = torch.nn.functional.normalize(feats[0], dim=-1).sum(0)
    assert int((units @ val.centres.T).argmax()) == 1  # while the plain average misses


def test_fusion_claims_end_to_end_train_without_the_fold_and_judge_over_folds(tmp_path, monkeypatch):
    import ml.fusion.train as fusion_train

    paths = Paths(tmp_path)
    paths.prepared.mkdir(parents=True)
    _prepare_part("fusion", DATA, paths.prepared, progress=False)
    torch.manual_seed(0)
    save_model(paths.fr_model("real"), vit_tiny(**VIT).eval(), backbone="vit_tiny", kwargs=VIT)
    trained_on = []
    real_train = fusion_train.train_fusion

    def spy(cfg, features, styles, labels, **kwargs):
        trained_on.append(len(kwargs["centres"]))
        return real_train(cfg, features, styles, labels, **kwargs)

    monkeypatch.setattr(fusion_train, "train_fusion", spy)
    results = run_folds(paths, DATA, STAGE, folds=3)
    assert trained_on == [6, 6, 6]  # 8 identities less the fold's 2: the val block is trained on, never scored
    rows = results["folds"]
    assert [r["identities"] for r in rows] == [[0, 1], [2, 3], [4, 5]] and all(r["sets"] == 2 * 4 for r in rows)
    d = results["summary"]["caface_minus_average"]
    assert d["units"] == 3 and d["mean"] == pytest.approx(np.mean([r["caface"] - r["average"] for r in rows]))
    assert d["ci_low"] <= d["mean"] <= d["ci_high"] and results["summary"]["chance"] == 0.5
    text = render({**results, "seconds": 1.0, "measured_at": "2026-01-01 00:00 UTC"})  # a file of the folds alone
    assert "the last 2 identities (the val block" in text and text.count("\n| ") == 4  # header + 3 folds
    assert "No verdict: the folds train on overlapping identities" in text and "beyond noise" not in text
    assert dataclasses.asdict(STAGE.train)["lr"] == results["recipe"]["lr"]


def test_fusion_claims_on_fresh_data_seeds_renders_new_identities_and_scores_only_their_held_out_block(
        tmp_path, monkeypatch):
    import ml.fusion.train as fusion_train

    paths = Paths(tmp_path)
    torch.manual_seed(0)
    save_model(paths.fr_model("real"), vit_tiny(**VIT).eval(), backbone="vit_tiny", kwargs=VIT)
    trained, scored = [], []
    real_train, real_scores = fusion_train.train_fusion, fusion_train.val_scores

    def spy_train(cfg, features, styles, labels, **kwargs):
        trained.append((len(kwargs["centres"]), kwargs.get("val")))
        return real_train(cfg, features, styles, labels, **kwargs)

    def spy_scores(model, val):
        scored.append(val.centres.clone())
        return real_scores(model, val)

    monkeypatch.setattr(fusion_train, "train_fusion", spy_train)
    monkeypatch.setattr(fusion_train, "val_scores", spy_scores)
    results = run_data_seeds(paths, DATA, STAGE, [2, 3])
    assert trained == [(6, None), (6, None)]  # 8 identities less the 2 scored; training never sees them
    assert len(scored) == 2 and not torch.allclose(scored[0], scored[1])  # each data seed: other identities
    rows = results["data_seeds"]
    assert [r["data_seed"] for r in rows] == [2, 3] and all(r["sets"] == 2 * 4 and r["identities"] == 8 for r in rows)
    for baseline in ("average", "norm_weighted", "landmark_score"):  # every baseline, its own paired difference
        d = results["summary"][f"caface_minus_{baseline}"]
        assert d["units"] == 2 and d["mean"] == pytest.approx(np.mean([r["caface"] - r[baseline] for r in rows]))
        assert d["resampled"] == "identities" and isinstance(d["holm"], bool)
    assert all(0.0 <= r["quality_oracle"] <= 1.0 for r in rows)  # the reference row, never a claim
    assert "caface_minus_quality_oracle" not in results["summary"]
    text = render({"data_seeds": {**results, "seconds": 1.0, "measured_at": "2026-01-01 00:00 UTC"}})
    assert "CAFace − norm-weighted over the 2 data seeds" in text and "Holm's correction for the 3" in text
    assert not list(paths.root.glob("data"))  # rendered in a temporary folder, nothing left in the project


def test_the_report_holds_both_parts_and_a_second_part_keeps_the_first(tmp_path, monkeypatch):
    import experiments.fusion_claims as fc

    diff = {"mean": 0.1, "std": 0.02, "se": 0.01, "units": 2, "higher": 2, "ci_low": 0.05, "ci_high": 0.15,
            "beyond_noise": True}
    part = {"summary": {"caface_minus_average": diff, "chance": 0.02}, "val_identities": 50,
            "data_seeds": [{"data_seed": d, "identities": 450, "sets": 200, "caface": 0.7, "average": 0.6, "lt": 0.3,
                            "lt_average": 0.35, "seconds": 9.0} for d in (2, 3)]}
    folds = {"summary": {"caface_minus_average": {**diff, "beyond_noise": False}, "chance": 0.02},
             "val_identities": 50, "identities": 450, "seconds": 60.0, "measured_at": "2026-01-01 00:00 UTC",
             "folds": [{"fold": f, "identities": [50 * f, 50 * f + 49], "sets": 200, "caface": 0.7, "average": 0.6,
                        "lt": 0.3, "lt_average": 0.35, "seconds": 9.0} for f in (0, 1)]}
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "fusion_claims.json").write_text(json.dumps(folds))  # the old layout
    (tmp_path / "params.yaml").write_text("fusion: {}\ndata: {}\n")
    monkeypatch.setattr(fc, "run_data_seeds", lambda *a, **k: part)
    main(["--root", str(tmp_path), "--data-seeds", "2", "3"])
    stored = json.loads((tmp_path / "metrics" / "fusion_claims.json").read_text())
    assert stored["folds"]["folds"] == folds["folds"] and stored["data_seeds"]["data_seeds"] == part["data_seeds"]
    text = (tmp_path / "reports" / "fusion_claims.md").read_text()
    assert text.index("## Fresh identities per data seed") < text.index("## Folds of the default run's identities")
    assert "over the 2 data seeds: +10.0 ± 2.0 pp" in text and "**beyond noise**" in text
    assert "over the 2 folds" in text and "**not beyond noise**" not in text and "No verdict" in text
    assert "Chosen on:" in text and "Scored on:" in text
