"""Run-cache restore: a stage whose param changed and changed back, restored by `faceops run` vs run again."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STAGE = "train_fr@real"
MODEL = "models/fr/real/model.safetensors"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def bench_runcache_restore() -> dict:
    """Stage ``train_fr@real`` on the ``smoke`` preset, each time as ``faceops run --stage train_fr@real`` runs it
    (the flow in this process; its upstream ``prepare`` and ``validate`` run once, then are up to date):

    ``run_s``: ``fr.seed`` 0, the stage's cmd runs (a training of one epoch, with its MLflow run);
    ``changed_s``: ``fr.seed`` 1, the cmd runs again;
    ``restore_s``: ``fr.seed`` back to 0: DVC's run-cache holds the first run, so the stage is restored (its
    outputs checked out, dvc.lock written, a ``dvc.restored`` MLflow run) and the cmd does not run.
    The seconds are the stage task's own (status, restore or cmd, commit, MLflow); ``restore_flow_s`` is the whole
    flow of the restoring run. ``identical``: the restored model file is byte-identical to the first run's.
    """
    from flows.pipeline import run_pipeline
    from tasks.params import apply_delta, load_preset

    from faceops.workspace import copy_project

    before = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI",)}
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        root = copy_project(REPO, Path(tmp) / "ws")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        os.chdir(root)  # as `faceops run` runs: DVC names stages relative to the working directory
        try:
            apply_delta(root / "params.yaml", {**load_preset("smoke", root), "fr.seed": 0})

            def stage_result(**delta: Any) -> tuple[dict, float]:
                if delta:
                    apply_delta(root / "params.yaml", delta)
                start = time.perf_counter()
                results = run_pipeline(root=str(root), stages=[STAGE], jobs=1)
                wall = time.perf_counter() - start
                return next(r for r in results if r["stage"] == STAGE), wall

            first, _ = stage_result()
            model = _sha256(root / MODEL)
            changed, _ = stage_result(**{"fr.seed": 1})
            restored, restore_wall = stage_result(**{"fr.seed": 0})
            identical = _sha256(root / MODEL) == model
        finally:
            os.chdir(cwd)
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    assert first["ran"] and changed["ran"], (first, changed)
    return {"run_s": round(first["seconds"], 2), "changed_s": round(changed["seconds"], 2),
            "restore_s": round(restored["seconds"], 2), "restore_flow_s": round(restore_wall, 2),
            "restored": bool(restored.get("restored")), "cmd_ran_on_restore": bool(restored["ran"]),
            "identical": identical, "speedup": round(first["seconds"] / max(restored["seconds"], 1e-6), 1)}
