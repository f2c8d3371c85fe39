"""Pipeline overhead: what Prefect + MLflow wrapping and DVC's up-to-date check cost."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _workspace(tmp: Path) -> Path:
    from faceops.workspace import copy_project

    return copy_project(REPO, tmp / "ws")


def bench_pipeline_overhead() -> dict:
    """Stage ``prepare`` at the embedded default size: direct call vs inside a Prefect task with its MLflow run."""
    from prefect import flow, task

    from ml.config import from_mapping
    from tasks import prepare
    from tasks.common import Paths, load_params, section
    from tasks.tracking import stage_run

    with tempfile.TemporaryDirectory() as tmp:
        root = _workspace(Path(tmp))
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / 'mlflow.db'}"
        paths = Paths(root)
        params = load_params(paths.params)
        cfg = from_mapping(prepare.DataConfig, section(params, "data"), "data")

        @task
        def wrapped_stage() -> None:
            with stage_run("prepare", {"data": section(params, "data")}, root) as tracker:
                result = prepare.run(cfg, paths, tracker=tracker)
                tracker.log_metrics(result.metrics)

        @flow
        def warm() -> None:
            # once per flow run / store, not per stage: Prefect's server start, MLflow's schema creation
            with stage_run("warm-up", {}, root):
                pass

        @flow
        def one_stage() -> None:
            wrapped_stage()

        def timed(fn) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        warm()
        # alternate the two ways three times and keep the best of each: run-to-run noise here (±20 %) is larger
        # than the overhead itself (stage_run + log_prepared_datasets measure ≈ 0.4 s in isolation)
        direct, wrapped = [], []
        for _ in range(3):
            direct.append(timed(lambda: prepare.run(cfg, paths)))
            wrapped.append(timed(one_stage))
        direct, wrapped = min(direct), min(wrapped)
        os.environ.pop("MLFLOW_TRACKING_URI")
    return {"direct_s": round(direct, 2), "wrapped_s": round(wrapped, 2),
            "overhead_pct": round(100 * (wrapped - direct) / direct, 1)}


def bench_smoke_and_noop() -> dict:
    """``faceops run --preset smoke`` from nothing (target ≤ 2 min), then ``dvc repro`` with nothing changed
    (every stage skipped, target ≤ 10 s)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = _workspace(Path(tmp))
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
        faceops = [sys.executable, "-m", "faceops.cli"]
        start = time.perf_counter()
        subprocess.run(faceops + ["run", "--preset", "smoke"], cwd=root, env=env, check=True, capture_output=True)
        smoke = time.perf_counter() - start
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env, check=True,
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
    skipped = out.stdout.count("didn't change, skipping")
    return {"smoke_run_s": round(smoke, 1), "noop_repro_s": round(seconds, 2), "stages_skipped": skipped,
            "up_to_date": "up to date" in out.stdout}
