"""The `faceops` command: help that teaches, and bad input that fails with one clear message and no output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import copy_project

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
    assert "--set" in _run(["run", "--help"], workspace).stdout


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
    from ml.models.backbones import build_backbone
    from ml.models.io import save_model

    kwargs = {"depth": 1, "dim": 32, "heads": 2, "embed_dim": 16}
    save_model(tmp_path / "m", build_backbone("vit_tiny", **kwargs).eval(), backbone="vit_tiny", kwargs=kwargs)
    out = _run(["export", str(tmp_path / "m"), str(tmp_path / "m.onnx")], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "min cosine 1.0000" in out.stdout and (tmp_path / "m.onnx").is_file()
    missing = _run(["export", str(tmp_path / "nope"), str(tmp_path / "x.onnx")], tmp_path)
    assert missing.returncode == 2 and "nope" in missing.stderr

