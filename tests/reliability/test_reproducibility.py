"""Reproducibility on the CPU, under load: the same commit and params give bit-identical datasets and models, and
identical metrics, whatever else the machine is doing.

Two working copies reproduce the whole smoke DAG at the same time, competing for the cores: one through
``faceops run`` (the Prefect flow, stages side by side up to ``pipeline.jobs``), the other through plain ``dvc repro``
(one stage after another, nothing beside it but the other copy). Each stage fixes its thread count from params at
its start and ``precision: auto`` follows the instruction set, so every output DVC hashes must match between the
two, apart from the files that record wall-clock time (``TIMED``, each with its reason).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.stages import flat_items
from tests.conftest import copy_project
from tests.servers import prefect_server

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
# wall-clock measurements: the only metric keys allowed to differ between two runs
TIME_KEYS = ("seconds", "per_s", "throughput", "elapsed")
# outputs that hold wall-clock times or dates by design, so their hashes differ between any two runs
TIMED = {
    "reports/validation": "Great Expectations' Data Docs and results carry each validation run's time and id",
    "reports/validation_synthetic": "the same, for the synthetic set",
    "reports/benchmark.md": "says when it was generated",
}


def _env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **(extra or {}), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path]:
    from tasks.params import apply_delta, load_preset

    flow_root, repro_root = (copy_project(tmp_path_factory.mktemp(name)) for name in ("flow", "repro"))
    apply_delta(repro_root / "params.yaml", load_preset("smoke", repro_root))
    with prefect_server(tmp_path_factory.mktemp("prefect")) as prefect_env:
        flow = subprocess.Popen([str(BIN / "faceops"), "run", "--preset", "smoke"], cwd=flow_root,
                                env=_env(flow_root, prefect_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        repro = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repro_root, env=_env(repro_root),
                               capture_output=True, text=True, timeout=1500)
        flow_out, _ = flow.communicate(timeout=1500)
    assert repro.returncode == 0, repro.stdout[-3000:] + repro.stderr[-3000:]
    assert flow.returncode == 0, flow_out[-6000:]
    return flow_root, repro_root


def _outs(root: Path) -> dict[str, str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    return {o["path"]: o["md5"] for entry in lock.values() for o in entry.get("outs", [])}


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in flat_items(metrics, "/").items() if not any(t in k for t in TIME_KEYS)}


def test_every_dataset_and_model_is_bit_identical(two_runs):
    flow, repro = two_runs
    a, b = _outs(flow), _outs(repro)
    assert set(a) == set(b)
    assert {"data/prepared", "data/synthetic", "models/fr/real", "models/fr/synthetic", "models/generator",
            "models/fusion", "models/discovery", "models/aligner"} <= set(a)
    # metrics files hold wall-clock seconds beside the numbers: compared value by value below
    differ = sorted(path for path in a if a[path] != b[path] and path not in TIMED and not path.startswith("metrics/"))
    assert not differ, f"outputs that differ between the flow run and dvc repro: {differ}"
    for rel in ("models/fr/real/model.safetensors", "models/generator/model.safetensors",
                "data/prepared/verification/procedural.bin"):
        assert (flow / rel).read_bytes() == (repro / rel).read_bytes(), rel


def test_metrics_are_identical_apart_from_wall_clock(two_runs):
    flow, repro = two_runs
    files = sorted(p.name for p in (flow / "metrics").glob("*.json"))
    assert len(files) >= 8 and files == sorted(p.name for p in (repro / "metrics").glob("*.json"))
    for name in files:
        a = _untimed(json.loads((flow / "metrics" / name).read_text()))
        b = _untimed(json.loads((repro / "metrics" / name).read_text()))
        assert a == b, (name, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)})
    curve = _untimed(json.loads((flow / "metrics/train_fr_real.json").read_text()))
    assert any("loss" in k for k in curve), "the comparison must cover the training curve"


def test_the_model_config_records_what_decided_the_numerics(two_runs):
    flow, _ = two_runs
    for model in ("fr/real", "generator", "fusion", "discovery", "aligner"):
        extra = json.loads((flow / "models" / model / "config.json").read_text())["extra"]
        assert extra["precision"] in ("32-true", "bf16-mixed") and extra["threads"] >= 1, model


def test_a_different_seed_changes_the_data(two_runs, tmp_path):
    """The check above can fail: one changed seed and the prepared data's hash moves."""
    from tasks.params import apply_delta, load_preset

    flow, _ = two_runs
    root = copy_project(tmp_path / "seeded")
    apply_delta(root / "params.yaml", {**load_preset("smoke", root), "data.seed": 1})
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "prepare"], cwd=root, env=_env(root),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _outs(root)["data/prepared"] != _outs(flow)["data/prepared"]
