"""Multi-node launch through Ray (``ops.launch``) against one process, on this machine.

A copy of the project at the smoke preset's size (``prepare`` and ``validate`` run first, untimed) trains
``train_fr@real`` (float32, no augmentation, ``EPOCHS`` epochs) three ways: ``faceops stage`` in one process with
batch 16; ``launch`` on two "nodes" of one process each with batch 8 (the same global batch) on a local Ray instance
(``pack``: one machine, gloo); and the Ray overhead alone: starting the local instance and placing two node actors.
On two cores the two nodes share the cores the single process had, so the ratio measures the launch and DDP's cost,
not a speed-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 4


def _faceops(root: Path, *args: str) -> float:
    start = time.perf_counter()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    out = subprocess.run([sys.executable, "-m", "faceops.cli", *args], cwd=root, capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise RuntimeError(f"faceops {' '.join(args)} failed: {out.stderr[-2000:]}")
    return time.perf_counter() - start


def _params(root: Path, **fr: object) -> None:
    from tasks.params import load_preset

    params = yaml.safe_load((root / "params.yaml").read_text())
    for key, value in load_preset("smoke", root).items():
        section, name = key.split(".", 1)
        params[section][name] = value
    params["fr"].update({"augment": False, "epochs": EPOCHS, "accelerator": "cpu", "num_workers": 0,
                         "precision": "32-true", **fr})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def bench_launch() -> dict:
    """Target: report the two-node run's wall time against one process, and Ray's start-up.

    Returns:
        ``{"single_s", "two_nodes_s", "two_over_single", "ray_start_s"`` (``ray.init`` of a local instance),
        ``"place_s"`` (a placement group of two bundles and two node actors answering), ``"epochs"}``.
    """
    import ray

    from faceops.workspace import copy_project
    from ops.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        root = copy_project(REPO, Path(tmp) / "ws")
        _params(root, batch_size=16)
        _faceops(root, "stage", "prepare")
        _faceops(root, "stage", "validate")
        single = _faceops(root, "stage", "train_fr@real")
        _params(root, batch_size=8, num_nodes=2, strategy="ddp")
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_start = time.perf_counter() - start
        try:
            start = time.perf_counter()
            group = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
            ray.get(group.ready())

            @ray.remote(num_cpus=1)
            def ping() -> str:
                return ray.util.get_node_ip_address()

            ray.get([ping.options(scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=k)).remote() for k in range(2)])
            place = time.perf_counter() - start
            ray.util.remove_placement_group(group)
            start = time.perf_counter()
            launch("train_fr@real", 2, root=root, pack=True)
            two = time.perf_counter() - start
        finally:
            ray.shutdown()
    return {"single_s": round(single, 1), "two_nodes_s": round(two, 1), "two_over_single": round(two / single, 2),
            "ray_start_s": round(ray_start, 1), "place_s": round(place, 2), "epochs": EPOCHS}
