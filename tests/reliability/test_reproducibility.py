"""Reproducibility on the CPU: the same params and seed give bit-identical datasets and models, and identical
metrics, in two independent working copies (plain ``dvc repro``, smoke preset, each its own MLflow store).

The MLflow side (every stage run's ``dvc.dep.*`` / ``dvc.out.*`` tags equal ``dvc.lock``, registered models carry
their directory's hash) is checked on the full smoke pipeline in ``tests/test_pipeline.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import copy_project

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
TARGET = "train_fr@real"  # prepare → validate → train_fr@real: the datasets, a trained model and its metrics
# wall-clock measurements: the only metrics allowed to differ between two runs
TIME_KEYS = ("seconds", "per_s", "throughput", "elapsed")


def _repro(root: Path) -> None:
    from tasks.params import apply_delta, load_preset

    apply_delta(root / "params.yaml", load_preset("smoke", root))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", TARGET], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    roots = [copy_project(tmp_path_factory.mktemp(name)) for name in ("first", "second")]
    for root in roots:
        _repro(root)
    return roots[0], roots[1]


def _outs(root: Path) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {f"{stage}:{o['path']}": o["md5"] for stage, entry in lock.items() for o in entry.get("outs", [])}


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIME_KEYS)}


def test_datasets_and_model_are_bit_identical(two_runs):
    first, second = two_runs
    a, b = _outs(first), _outs(second)
    assert set(a) == set(b) and {"prepare:data/prepared", f"{TARGET}:models/fr/real"} <= set(a)
    bit_identical = {"prepare:data/prepared", f"{TARGET}:models/fr/real"}
    assert {k: a[k] for k in bit_identical} == {k: b[k] for k in bit_identical}
    for rel in ("models/fr/real/model.safetensors", "data/prepared/train/manifest.parquet",
                "data/prepared/verification/procedural.bin"):
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel


def test_metrics_are_identical_apart_from_wall_clock(two_runs):
    first, second = two_runs
    a = json.loads((first / "metrics/train_fr_real.json").read_text())
    b = json.loads((second / "metrics/train_fr_real.json").read_text())
    assert _untimed(a) == _untimed(b)
    assert any("loss" in k for k in _untimed(a)), "the comparison must cover the training curve"


def test_a_different_seed_changes_the_data(two_runs, tmp_path):
    """The check above can fail: one changed seed and the prepared data's hash moves."""
    from tasks.params import apply_delta, load_preset

    first, _ = two_runs
    root = copy_project(tmp_path / "seeded")
    apply_delta(root / "params.yaml", {**load_preset("smoke", root), "data.seed": 1})
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _outs(root)["prepare:data/prepared"] != _outs(first)["prepare:data/prepared"]
