"""The fusion stages at toy size: ``train_fusion`` on the procedural fusion set (clean targets, degraded sources) and on
degraded copies of the real training faces, and the set evaluation's oracle, intervals, CAFace diagnostics and
report lines (tasks/train_fusion.py, tasks/evaluate/fusion.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from ml.data.dataset import read_dataset_info, read_manifest
from ml.data.surveillance import SurveillanceConfig
from ml.errors import ConfigError
from ml.fr.backbones.vit import vit_tiny
from ml.models.io import load_model, save_model
from ml.fusion.train import FusionConfig
from tasks.evaluate import fusion as sets_eval
from tasks.common import Paths
from tasks.evaluate import EvaluateConfig
from tasks.prepare import DataConfig, _prepare_part
from tasks.train_fusion import (
    FusionStageConfig, degraded_features, procedural_material, real_material, run,
)

pytestmark = pytest.mark.usefixtures("one_thread")

VIT = dict(depth=4, dim=32, heads=2, embed_dim=16, drop_path=0.0)  # 64 px; taps blocks 2 and 3: style_dim 64
DATA = DataConfig(train_identities=4, images_per_identity=3, val_fraction=0.0, heldout_identities=4,
                  heldout_images_per_identity=3, gallery_images_per_identity=1, verification_pairs=20,
                  template_identities=2, templates_per_identity=2, frames_per_template=2, discovery_identities=4,
                  discovery_images_per_identity=4, video_identities=3, video_distractors=1, video_frames=(6, 12),
                  fusion_identities=4, fusion_clean_images=2, fusion_sources=2, fusion_copies=3)
STAGE = FusionStageConfig(val_identities=2, train=FusionConfig(epochs=1, steps_per_epoch=2, lr_steps=(), batch_size=4, per_identity=8,
                                             group=4, max_len=4, accelerator="cpu"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Prepared train / fusion / templates / videos parts and a random tiny FR ViT as ``models/fr/real``."""
    paths = Paths(tmp_path_factory.mktemp("ws"))
    paths.prepared.mkdir(parents=True)
    for part in ("train", "fusion", "templates", "videos"):
        _prepare_part(part, DATA, paths.prepared, progress=False)
    torch.manual_seed(0)
    save_model(paths.fr_model("real"), vit_tiny(**VIT).eval(), backbone="vit_tiny", kwargs=VIT)
    return paths


@pytest.fixture(scope="module")
def trained(workspace):
    return run(STAGE, DATA, workspace)


def test_procedural_material_clean_targets_and_degraded_sources(workspace):
    model, _ = load_model(workspace.fr_model("real"))
    m = procedural_material(model, workspace, DATA)
    k, per = 4, 2 * 3  # identities; sources × copies
    assert m.kind == "procedural-fusion" and m.dataset == workspace.fusion_set
    assert m.features.shape == (k * per, 16) and m.styles.shape == (k * per, 64, 2)
    assert np.bincount(m.labels).tolist() == [per] * k
    assert np.unique(m.sources).size == k * 2 and np.bincount(m.sources).tolist() == [3] * (k * 2)
    for source in np.unique(m.sources):  # a source belongs to one identity
        assert np.unique(m.labels[m.sources == source]).size == 1
    assert m.centres.shape == (k, 16) and np.allclose(np.linalg.norm(m.centres, axis=1), 1.0, atol=1e-5)


def test_degraded_copies_do_not_depend_on_the_batch_size(workspace):
    model, _ = load_model(workspace.fr_model("real"))
    rows = read_manifest(workspace.train_set / "manifest.parquet")
    from ml.data.dataset import load_images

    images = load_images(workspace.train_set, rows.iloc[:3])
    small = degraded_features(model, images, None, 4, SurveillanceConfig(), seed=1, batch_size=3)
    large = degraded_features(model, images, None, 4, SurveillanceConfig(), seed=1, batch_size=256)
    assert small[0].shape == (12, 16)
    np.testing.assert_allclose(small[0], large[0], atol=1e-5)
    other = degraded_features(model, images, None, 4, SurveillanceConfig(), seed=2)
    assert not np.allclose(other[0], large[0], atol=1e-3)  # the seed draws other degradations


def test_train_fusion_on_the_procedural_fusion_set(workspace, trained):
    metrics = json.loads((workspace.metrics / "train_fusion.json").read_text())
    # 4 identities: the last 2 (fusion.val_identities) are held out for val/*
    assert metrics["train/features"] == 2 * 2 * 3 and metrics["train/identities"] == 2 and metrics["train/steps"] == 2
    assert {"train/loss", "train/lt", "train/lp", "train/lt_average", "val/lt", "val/lt_average", "val/rank1",
            "val/rank1_average"} <= set(metrics)
    assert 0.0 <= metrics["val/rank1"] <= 1.0 and metrics["val/lt"] > 0.0
    extra = json.loads((workspace.fusion_model / "config.json").read_text())["extra"]
    assert extra["training_data"] == "procedural-fusion" and extra["val_identities"] == 2
    assert extra["training_data_digest"] == read_dataset_info(workspace.fusion_set)["digest"]
    assert extra["training_features"] == 12 and extra["training_sources"] == 4
    assert (workspace.plots / "train_fusion_loss.png").is_file()


def test_train_fusion_on_degraded_real_faces_when_ingested(workspace, tmp_path):
    """Ingested faces: no fusion set; every training image is a source with ``fusion_copies`` degraded copies."""
    paths = Paths(tmp_path)
    (tmp_path / "data").mkdir()
    (paths.prepared).mkdir()
    (paths.prepared / "train").symlink_to(workspace.train_set)
    (tmp_path / "models").mkdir()
    (paths.fr_models).mkdir()
    paths.fr_model("real").symlink_to(workspace.fr_model("real"))
    data = dataclasses.replace(DATA, ingest_folder=str(tmp_path / "faces"), fusion_copies=2)
    model, _ = load_model(paths.fr_model("real"))
    m = real_material(model, paths, data, seed=0)
    n = len(read_manifest(paths.train_set / "manifest.parquet").query("split == 'train'"))
    assert m.kind == "real-degraded" and m.features.shape == (2 * n, 16)
    assert m.sources.tolist() == np.repeat(np.arange(n), 2).tolist() and m.centres.shape == (4, 16)
    run(STAGE, data, paths)
    extra = json.loads((paths.fusion_model / "config.json").read_text())["extra"]
    assert extra["training_data"] == "real-degraded"
    assert extra["training_data_digest"] == read_dataset_info(workspace.train_set)["digest"]
    assert json.loads((paths.metrics / "train_fusion.json").read_text())["train/features"] == 2 * n // 2  # 2 of 4 ids
    with pytest.raises(ConfigError, match=r"fusion.val_identities = 3 leaves 1 of the 4 identities"):
        run(dataclasses.replace(STAGE, val_identities=3), data, paths)


def test_zero_quality_probes_by_hand():
    quality = np.array([0.01, 0.04, 0.0, 0.9, 0.049, 0.06])
    groups = np.array([0, 0, 1, 1, 2, 3])
    assert sets_eval.zero_quality_probes(quality, groups) == 2  # probes 0 and 2; 1 and 3 have a usable frame


def test_evaluate_sets_adds_the_oracle_intervals_and_caface_diagnostics(workspace, trained):
    model, _ = load_model(workspace.fr_model("real"))
    metrics = sets_eval.evaluate_sets(EvaluateConfig(batch_size=16), DATA, workspace, model, chunk_size=4,
                                      references={"same": model})
    # a pretrained recogniser's reference row: its own features averaged; the run's own model as the "reference"
    # must reproduce the average row to the bit, templates, single and booking galleries alike
    ref = sets_eval.reference_method("same")
    for key in [k for k in metrics if "/average/" in k and not k.startswith("sets/gain/")]:
        assert metrics[key.replace("/average/", f"/{ref}/")] == metrics[key], key
    assert not any(k.startswith(f"sets/gain/{ref}/") for k in metrics)
    assert all(math.isfinite(v) for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    for method in sets_eval.LABELS:
        low, high = (metrics[f"sets/videos_single/{method}/rank1_ci_{b}"] for b in ("low", "high"))
        assert 0.0 <= low <= metrics[f"sets/videos_single/{method}/rank1"] <= high <= 1.0, method
        assert f"sets/gain/{method}/n=1/rank1" in metrics and f"sets/templates/{method}/tar@far=1e-2" in metrics
    for method in ("caface", "quality_oracle"):
        key = f"sets/videos_single/{method}_minus_average/rank1"
        assert -1.0 <= metrics[f"{key}/ci_low"] <= metrics[key] <= metrics[f"{key}/ci_high"] <= 1.0
        assert metrics[key] == pytest.approx(metrics[f"sets/videos_single/{method}/rank1"]
                                             - metrics["sets/videos_single/average/rank1"])
    for baseline in sets_eval.WEIGHTING_BASELINES:  # CAFace against each baseline that also weights frames
        key = f"sets/videos_single/caface_minus_{baseline}/rank1"
        assert metrics[f"{key}/ci_low"] <= metrics[key] <= metrics[f"{key}/ci_high"]
        assert metrics[key] == pytest.approx(metrics["sets/videos_single/caface/rank1"]
                                             - metrics[f"sets/videos_single/{baseline}/rank1"])
    assert {f"sets/caface/{k}" for k in ("weight_quality_spearman", "weight_cv", "usable_weight_ratio",
                                         "assignment_entropy", "cluster_usage_entropy", "effective_clusters",
                                         "num_clusters")} <= set(metrics)
    assert metrics["sets/videos/zero_quality_probes"] == 0  # every surveillance probe has a usable window
    assert json.loads((workspace.metrics / "sets.json").read_text()) == pytest.approx(metrics)
    clean = f"sets/videos_single/{sets_eval.CLEAN}"  # the probes' frames rendered again without degradation
    assert 0.0 <= metrics[f"{clean}/rank1_ci_low"] <= metrics[f"{clean}/rank1"] <= metrics[f"{clean}/rank1_ci_high"]
    assert metrics[f"{clean}_minus_average/rank1"] == pytest.approx(metrics[f"{clean}/rank1"]
                                                                   - metrics["sets/videos_single/average/rank1"])
    assert f"sets/videos_booking/{sets_eval.CLEAN}/tpir@fpir=1e-2" in metrics
    assert f"sets/gain/{sets_eval.CLEAN}/n=1/rank1" not in metrics  # not a fusion of the probes' frames
    report = "\n".join(sets_eval.render_section(metrics))
    assert f"| {sets_eval.LABELS['quality_oracle']} |" in report and f"| {sets_eval.CLEAN_LABEL} |" in report
    assert "the same frames without capture degradation" in report
    assert "Gain over averaging" in report and "the true-quality oracle" in report
    assert "Does CAFace weight frames by quality?" in report and "Spearman ρ" in report
    gallery = metrics["sets/videos_single/chance/rank1"]  # random scores: one hit in G identities
    assert 0.0 < gallery < 1.0 and metrics["sets/videos_booking/chance/rank5"] == pytest.approx(min(1.0, 5 * gallery))
    assert metrics["sets/videos_single/chance/tpir@fpir=1e-2"] == pytest.approx(0.01 * gallery)
    assert metrics["sets/templates/chance/tar@far=1e-3"] == 1e-3 and metrics["sets/gain/chance/n=1/rank1"] == gallery
    assert f"| {sets_eval.CHANCE} | " in report
    label = "| `same` features, averaged (pretrained reference) | "
    assert report.count(label) == 2  # the templates and the videos table, not the probe-size curve
    recipe = json.loads((workspace.fusion_model / "config.json").read_text())["extra"]["recipe"]
    steps = recipe["epochs"] * recipe["steps_per_epoch"]
    assert metrics["sets/caface/lambda_u"] == recipe["lambda_u"] and metrics["sets/caface/train_steps"] == steps
    assert f"(one training run: seed {recipe['seed']}, {steps} steps)" in report
    val = json.loads((workspace.metrics / "train_fusion.json").read_text())  # the recipe's val numbers, reported
    assert metrics["sets/caface/val/rank1"] == val["val/rank1"] and metrics["sets/caface/val/identities"] == 2
    assert "On its val split (2 identities" in report and "(chance 50.0 %)" in report


def test_fusion_recipes_compares_variants_seed_by_seed_on_val(workspace):
    from experiments.fusion_recipes import compare_recipes, render

    variants = [{"lambda_u": 0.0}, {"lambda_u": 0.3}]
    for path in workspace.video_set.rglob("*"):  # recipes are chosen on val: a test probe read is an error
        if path.is_file():
            path.rename(path.with_name(path.name + ".hidden"))
    try:
        rows, baselines = compare_recipes(workspace, DATA, STAGE, variants, seeds=[0, 1])
    finally:
        for path in workspace.video_set.rglob("*.hidden"):
            path.rename(path.with_name(path.name.removesuffix(".hidden")))
    assert [(r["variant"], r["seed"]) for r in rows] == [(v, s) for v in variants for s in (0, 1)]
    for r in rows:
        assert r["steps"] == 2 and 0.0 <= r["rank1"] <= 1.0 and r["hits"].size == 2 * 4  # 2 val ids × 4 sets
        assert r["minus_average"] == pytest.approx(r["rank1"] - baselines["average"])
        assert r["ci_low"] <= r["minus_average"] <= r["ci_high"]
    report = render(rows, baselines, int(rows[0]["hits"].size))
    assert report.count('| `{"lambda_u": 0.3}` |') == 3  # two runs and the summary line
    assert "+0.0, +0.0" in report.split('`{"lambda_u": 0.0}` | ')[-1]  # the first variant against itself


def test_fusion_recipes_refuses_an_unknown_key_before_training(workspace):
    from experiments.fusion_recipes import compare_recipes

    with pytest.raises(ConfigError, match=r"unknown FusionConfig key\(s\) \['lambda_q'\]"):
        compare_recipes(workspace, DATA, STAGE, [{"lambda_q": 1.0}], seeds=[0])


def test_clean_capture_is_the_probe_as_a_good_camera_films_it(workspace):
    """``clean_capture`` renders a probe's frames without degradation; with every frame usable and the usable
    ranges at no degradation, the probe itself is that clean capture, frame for frame."""
    from ml.data.procedural import ProceduralFaces
    from ml.data.surveillance import PROBE_SEQ_INDEX, clean_capture, surveillance_sequence

    gen = ProceduralFaces(DATA.procedural_config(), seed=DATA.seed)
    none = SurveillanceConfig(usable_fraction=1.0, usable_lowres=(1.0, 1.0), usable_blur=(0.0, 0.0),
                              usable_noise=(0.0, 0.0), usable_jpeg=(100.0, 100.0))
    frames = [1, 4, 9]
    probe = surveillance_sequence(gen, 7, 11, PROBE_SEQ_INDEX, none)
    got = clean_capture(gen, 7, 11, frames)
    for t, sample in zip(frames, got):
        np.testing.assert_array_equal(sample.image, probe[t].image)
        np.testing.assert_allclose(sample.landmarks, probe[t].landmarks)
    degraded = surveillance_sequence(gen, 7, 11, PROBE_SEQ_INDEX, DATA.surveillance_config())
    assert all(c.quality > d.quality for c, d in zip(got, (degraded[t] for t in frames)))
    with pytest.raises(ValueError, match="0 … 10"):
        clean_capture(gen, 7, 11, [0, 11])


def test_no_clean_capture_reference_for_videos_the_params_did_not_make(workspace, caplog):
    """Frames rendered again from other data params are other frames: the reference is left out, saying why."""
    model, _ = load_model(workspace.fr_model("real"))
    rows = read_manifest(workspace.video_set / "manifest.parquet")
    other = dataclasses.replace(DATA, seed=DATA.seed + 1)
    assert sets_eval.clean_capture_templates(model, workspace, other, rows, 16) is None
    assert "does not render again" in caplog.text and "dvc repro prepare" in caplog.text
    templates = sets_eval.clean_capture_templates(model, workspace, DATA, rows, 16)
    probes = rows[rows["split"] == "probe"]["template"].nunique()
    assert templates.shape[0] == probes  # one template per probe, in template id order
    np.testing.assert_allclose(np.linalg.norm(templates, axis=1), 1.0, atol=1e-5)
