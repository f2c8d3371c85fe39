"""The `faceops` command: help that teaches, and bad input that fails with one clear message and no output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import copy_project

FACEOPS = [sys.executable, "-m", "faceops.cli"]


def _run(args, cwd, **env):
    return subprocess.run(FACEOPS + args, cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env})


@pytest.fixture
def workspace(tmp_path):
    return copy_project(tmp_path / "ws")


def test_help_explains_commands(workspace):
    out = _run(["--help"], workspace)
    assert out.returncode == 0
    for word in ("run", "stage", "ls", "params.yaml", "--preset smoke"):
        assert word in out.stdout
    run_help = _run(["run", "--help"], workspace).stdout
    assert "--set" in run_help and "--force" in run_help
    assert "<bool>" not in run_help and "<bool>" not in out.stdout  # flags take no value
    assert "<str>" in run_help  # options that take one say which


def test_help_names_every_stage_of_the_dag(workspace):
    from faceops.cli import _stage_names

    names = _stage_names(workspace)
    assert len(names) >= 11 and "train_fr@synthetic" in names
    out = _run(["--help"], workspace)
    assert out.returncode == 0
    for name in names:
        assert name in out.stdout, name


def test_stage_name_suggests_the_closest_stages(workspace):
    out = _run(["stage", "train_fr"], workspace)  # a foreach stage without its item
    assert out.returncode == 2
    assert "unknown stage 'train_fr'. Did you mean 'train_fr@real', 'train_fr@synthetic' or 'train_fr@real_matched'?" \
        in out.stderr
    typo = _run(["stage", "train_fusoin"], workspace)
    assert typo.returncode == 2 and "Did you mean 'train_fusion'?" in typo.stderr


def test_run_stage_suggests_the_closest_stages_and_starts_nothing(workspace, monkeypatch):
    from typer.testing import CliRunner

    import flows.pipeline
    from faceops.cli import app

    monkeypatch.setattr(flows.pipeline, "run_pipeline", lambda **kw: pytest.fail("the flow started"))
    monkeypatch.chdir(workspace)
    before = (workspace / "params.yaml").read_bytes()
    result = CliRunner().invoke(app, ["run", "--set", "fr.epochs=3", "--stage", "train_fr"])
    assert result.exit_code == 2
    hint = re.search(r"unknown stage 'train_fr' for --stage\. Did you mean ('[^?]+)\?", result.output)
    assert hint and sorted(re.findall(r"'([^']+)'", hint.group(1))) == [
        "train_fr@real", "train_fr@real_matched", "train_fr@synthetic"], result.output
    assert (workspace / "params.yaml").read_bytes() == before


# config.json of each kind of model, as its saver writes it (ml/models/io.py save_model, dfa.save_aligner,
# caface.save_caface, facegcd.save_facegcd, uiface.save_generator; "extra" as the train_* stages fill it)
MODELS = {
    "fr/real": {"format": 1, "backbone": "vit_tiny", "kwargs": {"img_size": 64}, "input_contract": {"size": 64},
                "extra": {"training_source": "real", "training_data_source": "procedural", "training_data_path": None,
                          "training_identities": 200, "training_data_digest": "ac158c365b1671a937e4"}},
    "fr/synthetic": {"format": 1, "backbone": "iresnet18", "kwargs": {}, "input_contract": {"size": 112},
                     "extra": {"training_source": "synthetic", "training_data_source": "synthetic",
                               "training_identities": 24, "training_data_digest": "5e1f8ffe62a6aa"}},
    "aligner": {"format": 1, "model": "dfa", "config": {"input_size": 96}, "input_contract": {"size": 96},
                "extra": {"registered_name": "faceops-aligner", "training_data_digest": "e4a43fd68086ff"}},
    "fusion": {"format": 1, "model": "caface", "kwargs": {"dim": 128},
               "extra": {"fr_model": "models/fr/real", "training_data": "procedural", "training_identities": 400}},
    "discovery": {"architecture": "facegcd", "format": 1, "kwargs": {}, "input_contract": {"size": 64},
                  "extra": {"backbone_init": "fr", "training_data_digest": "7e1f8ffe62a6"}},
    "generator": {"format": 1, "model": "uiface", "architecture": "uiface", "kwargs": {},
                  "extra": {"fr_model": "models/fr/real", "space": "pixel", "autoencoder": ""}},
}


def test_ls_shows_each_models_kind_and_source_in_aligned_columns(workspace):
    import json

    for rel, cfg in MODELS.items():
        (workspace / "models" / rel).mkdir(parents=True)
        (workspace / "models" / rel / "config.json").write_text(json.dumps(cfg))
    (workspace / "data" / "prepared" / "train").mkdir(parents=True)
    (workspace / "data" / "prepared" / "train" / "dataset.json").write_text(json.dumps(
        {"source": "procedural", "identity_count": 200, "image_count": 4000, "digest": "ac158c365b16ff"}))
    out = _run(["ls"], workspace, MLFLOW_TRACKING_URI=f"sqlite:///{workspace / 'mlflow.db'}")
    assert out.returncode == 0, out.stderr
    assert "None" not in out.stdout and "?" not in out.stdout, out.stdout
    sections = out.stdout.split("\nModels\n")[1].split("\nRegistry\n")
    models = sections[0].splitlines()
    assert [line.split()[:2] for line in models] == [
        ["models/aligner", "dfa"], ["models/discovery", "facegcd"], ["models/fr/real", "vit_tiny"],
        ["models/fr/synthetic", "iresnet18"], ["models/fusion", "caface"], ["models/generator", "uiface"]]
    assert len({line.index(line.split()[1]) for line in models}) == 1  # the kind column starts at one offset
    assert len({line.index(line.split()[2]) for line in models}) == 1
    facts = {line.split()[0]: " ".join(line.split()[2:]) for line in models}
    assert facts["models/fr/real"] == "source=real data=procedural ids=200 64px digest=ac158c365b16"
    assert facts["models/fr/synthetic"].startswith("source=synthetic data=synthetic")
    assert facts["models/aligner"] == "96px digest=e4a43fd68086"
    assert facts["models/fusion"] == "data=procedural fr=models/fr/real ids=400"
    assert facts["models/discovery"] == "init=fr 64px digest=7e1f8ffe62a6"
    assert facts["models/generator"] == "fr=models/fr/real space=pixel"
    stages = out.stdout.split("Stages\n")[1].split("\nDatasets\n")[0].splitlines()
    assert len({line.index(line.split()[1]) for line in stages}) == 1  # train_fr@synthetic does not push its row
    assert "(no registered models)" in sections[1] and not (workspace / "mlflow.db").exists()


def test_registry_rows_name_what_each_version_was_trained_on():
    from faceops.cli import columns, version_facts

    assert version_facts({"source": "real", "data_source": "procedural", "data_digest": "ac158c365b16ff",
                          "backbone": "vit_tiny", "run_id": "x"}) == "source=real backbone=vit_tiny digest=ac158c365b16"
    assert version_facts({"fr_model": "models/fr/real", "data_digest": "d", "training_data": "procedural"}) == \
        "fr=models/fr/real data=procedural digest=d"
    lines = columns([("faceops-fr", "v1", "@candidate", "source=real", "run=1"),
                     ("faceops-discovery", "v12", "", "init=fr", "run=2")])
    assert lines == ["  faceops-fr         v1   @candidate  source=real  run=1",
                     "  faceops-discovery  v12              init=fr      run=2"]


def test_model_rows_name_a_diffusers_folder_by_its_class():
    from faceops.cli import model_row

    assert model_row({"_class_name": "AutoencoderKL", "latent_channels": 4}) == ("AutoencoderKL", "")
    assert model_row({"backbone": "vit_tiny", "input_contract": {"size": 32}, "extra": {"training_source": "real"}}) \
        == ("vit_tiny", "source=real 32px")


def test_mistyped_key_fails_before_running_and_leaves_params(workspace):
    before = (workspace / "params.yaml").read_text()
    out = _run(["run", "--set", "fr.epoch=2"], workspace)
    assert out.returncode == 2
    assert "unknown params key 'fr.epoch'" in out.stderr and "fr.epochs" in out.stderr
    assert (workspace / "params.yaml").read_text() == before
    assert not (workspace / "data").exists()


def test_unknown_stage(workspace):
    out = _run(["stage", "nosuch"], workspace)
    assert out.returncode == 2 and "unknown stage 'nosuch'" in out.stderr


def test_missing_dataset_path_names_key_and_writes_nothing(workspace):
    params = workspace / "params.yaml"
    params.write_text(params.read_text().replace('ingest_folder: ""', 'ingest_folder: "/no/such/faces"'))
    out = _run(["stage", "prepare"], workspace, MLFLOW_TRACKING_URI=f"sqlite:///{workspace / 'mlflow.db'}")
    assert out.returncode == 2
    assert "data.ingest_folder: /no/such/faces is not a directory" in out.stderr
    assert not (workspace / "data" / "prepared").exists()


def test_outside_repository(tmp_path):
    out = _run(["stage", "prepare"], tmp_path)
    assert out.returncode == 2 and "no dvc.yaml" in out.stderr


def test_export_command_writes_onnx_with_parity(tmp_path):
    from ml.fr.backbones import build_backbone
    from ml.models.io import save_model

    kwargs = {"depth": 1, "dim": 32, "heads": 2, "embed_dim": 16}
    save_model(tmp_path / "m", build_backbone("vit_tiny", **kwargs).eval(), backbone="vit_tiny", kwargs=kwargs)
    out = _run(["export", str(tmp_path / "m"), str(tmp_path / "m.onnx")], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "min cosine 1.0000" in out.stdout and (tmp_path / "m.onnx").is_file()
    missing = _run(["export", str(tmp_path / "nope"), str(tmp_path / "x.onnx")], tmp_path)
    assert missing.returncode == 2 and "nope" in missing.stderr



def test_import_refuses_the_name_of_a_trained_source_before_reading_anything(workspace):
    """The import itself (DVC, registry, `faceops ls`) runs in tests/stages/test_real_pipeline.py."""
    refused = _run(["import", str(workspace / "no-such.onnx"), "--name", "real", "--contract", "sface"], workspace)
    assert refused.returncode == 2 and "models/fr/real is the output of stage train_fr@real" in refused.stderr
    bad = _run(["import", str(workspace / "no-such.onnx"), "--name", "Bad-Name"], workspace)
    assert bad.returncode == 2 and "lower-case letters" in bad.stderr
    missing = _run(["import", str(workspace / "no-such.onnx"), "--name", "mine"], workspace)
    assert missing.returncode == 2 and "no-such.onnx does not exist" in missing.stderr
    assert not (workspace / "models").exists() and not (workspace / "mlflow.db").exists()


def test_an_arcface_torch_import_is_registered_with_its_provenance(workspace, monkeypatch):
    """An insightface-layout IResNet checkpoint through the import's own path (probe check relaxed: random weights
    separate identities about as well as pixels; the check is tested in tests/unit/test_pretrained.py): the model
    directory, the registry version with its sha256 and format, and its `faceops ls` row."""
    import json

    import torch
    from mlflow import MlflowClient

    from faceops.imports import register_import
    from ml.fr import pretrained
    from ml.fr.backbones import build_backbone

    monkeypatch.setattr(pretrained, "MIN_PROBE_AUC", 0.0)
    monkeypatch.setattr(pretrained, "PIXEL_MARGIN", -1.0)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    torch.manual_seed(0)
    torch.save(build_backbone("iresnet18", width=0.25).state_dict(), workspace / "backbone.pth")
    model_dir = workspace / "models" / "fr" / "r18"
    config = pretrained.import_recogniser(workspace / "backbone.pth", model_dir)
    version = register_import(workspace, "r18", model_dir, config)
    client = MlflowClient(tracking_uri=f"sqlite:///{workspace / 'mlflow.db'}")
    registered = client.get_model_version_by_alias("faceops-fr-r18", "pretrained")
    assert str(registered.version) == version
    sha = json.loads((model_dir / "config.json").read_text())["extra"]["sha256"]
    assert registered.tags["import.sha256"] == sha and registered.tags["import.format"] == "arcface_torch"
    assert registered.tags["backbone"] == "iresnet18" and registered.tags["source"] == "pretrained"
    listed = _run(["ls"], workspace)
    row = next(line for line in listed.stdout.splitlines() if "models/fr/r18" in line)
    assert row.split()[1] == "iresnet18" and "source=pretrained" in row, listed.stdout
