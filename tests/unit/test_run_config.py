"""Which configuration a run's params are (default, a preset, custom) and whether its models may become
@candidate: the registry rule every entry point (faceops run, dvc repro, dvc exp run, a deployment) goes through."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from ops.run_config import config_label, promotable, run_config

PARAMS = {"fr": {"epochs": 12, "lr": 0.1}, "data": {"image_size": 64, "ingest_folder": ""}}
PRESETS = {"smoke": {"fr.epochs": 1, "data.image_size": 32}, "real-112": {"data.image_size": 112}}


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    (tmp_path / "presets.yaml").write_text(yaml.safe_dump(PRESETS))
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "params"]):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True, env=env)
    return tmp_path


def _set(repo, **changes):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split("__")
        params[section][name] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    return run_config(repo)


def test_the_committed_params_are_the_default_and_promotable(repo):
    tags = run_config(repo)
    assert tags["faceops.config"] == "default" and len(tags["faceops.params_digest"]) == 64
    assert config_label(tags) == ""  # the default run keeps the plain name
    assert promotable("default")
    # the user's data is not the recipe: the default on ingested faces is still the default
    assert _set(repo, data__ingest_folder="/faces")["faceops.config"] == "default"


def test_a_preset_is_named_and_the_smoke_preset_is_a_toy(repo):
    assert _set(repo, fr__epochs=1, data__image_size=32)["faceops.config"] == "preset:smoke"
    assert not promotable("preset:smoke") and config_label(run_config(repo)) == "preset:smoke"
    assert _set(repo, fr__epochs=12, data__image_size=112)["faceops.config"] == "preset:real-112"
    assert promotable("preset:real-112")


def test_any_other_delta_is_custom_and_listed(repo):
    tags = _set(repo, fr__lr=0.05)
    assert tags["faceops.config"] == "custom" and tags["faceops.config_delta"] == "fr.lr=0.05"
    assert not promotable("custom") and config_label(tags) == "custom fr.lr=0.05"
    assert config_label({"faceops.config": "custom", "faceops.config_delta": "x" * 80}) == f"custom {'x' * 60}…"
    partial = _set(repo, fr__lr=0.1, fr__epochs=1)  # half of the smoke preset is not the smoke preset
    assert partial["faceops.config"] == "custom"


def test_outside_a_project_the_config_is_unknown(tmp_path):
    assert run_config(tmp_path) == {"faceops.config": "unknown"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(PARAMS))  # no git history to compare with
    assert run_config(tmp_path)["faceops.config"] == "unknown" and promotable("unknown")


def test_the_experiment_opens_as_model_training_not_genai(tmp_path, monkeypatch):
    import mlflow

    from ops.run_store import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, configure

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment_id = configure(tmp_path)
    tags = mlflow.MlflowClient().get_experiment(experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    mlflow.MlflowClient().set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, "genai_development")
    configure(tmp_path)  # a kind the user chose in the UI is kept
    assert mlflow.MlflowClient().get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == "genai_development"
