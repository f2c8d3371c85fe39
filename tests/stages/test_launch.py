"""Multi-node training through Ray (``ops.launch``, the ``launch`` flow): two "nodes" on a local Ray instance train
``train_fr@real`` as one DDP job over gloo and give the model of one process with the same global batch; a node
that fails stops the other and is named."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import copy_project

pytestmark = pytest.mark.slow

# float32 (bf16 rounds one global batch and two half batches differently), no augmentation (it draws per rank)
FR = {"augment": False, "epochs": 2, "batch_size": 16, "accelerator": "cpu", "num_workers": 0, "lr": 2e-3,
      "precision": "32-true"}
# the shifts a following BatchNorm cancels get only rounding noise as gradient, which AdamW scales to full steps
# (tests/unit/test_train_features.py): they differ between the runs without changing any output
REL_TOL, MIN_COSINE = 1e-2, 0.9999  # per-tensor relative difference; embeddings of the held-out faces
CANCELLED = {"norm.bias", "feature.1.bias", "feature.1.running_mean", "feature.3.running_mean"}


def _faceops(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}"}
    out = subprocess.run([sys.executable, "-m", "faceops.cli", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _set_fr(root: Path, **keys) -> None:
    from tasks.params import load_preset

    params = yaml.safe_load((root / "params.yaml").read_text())
    for key, value in load_preset("smoke", root).items():
        section, name = key.split(".", 1)
        params[section][name] = value
    params["fr"].update({**FR, **keys})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(model_dir / "model.safetensors")


def _embeddings(model_dir: Path, root: Path) -> np.ndarray:
    """Unit embeddings of the held-out faces under the model in ``model_dir``."""
    from ml.data.dataset import load_images, read_manifest
    from ml.fr.train import embed
    from ml.models.io import load_model

    heldout = root / "data" / "prepared" / "heldout"
    model, _ = load_model(model_dir)
    feats = embed(model, load_images(heldout, read_manifest(heldout / "manifest.parquet")))
    return feats / np.linalg.norm(feats, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A project copy with the smoke preset's data prepared and gated."""
    root = copy_project(tmp_path_factory.mktemp("launch") / "ws")
    _set_fr(root)
    _faceops(["stage", "prepare"], root)
    _faceops(["stage", "validate"], root)
    return root


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_nodes_train_the_single_process_model_from_a_prefect_flow(workspace, ray_local, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.launch import launch_flow
    from tests.servers import prefect_server

    model = workspace / "models" / "fr" / "real"
    _set_fr(workspace)  # one process, batches of 16
    _faceops(["stage", "train_fr@real"], workspace)
    shutil.copytree(model, workspace.parent / "single")
    single = _weights(workspace.parent / "single")

    _set_fr(workspace, batch_size=8, num_nodes=2, strategy="ddp")  # two nodes of one process, 8 each
    with prefect_server(tmp_path / "prefect") as env, temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        results = launch_flow(stage="train_fr@real", nodes=2, root=str(workspace), pack=True)
        with get_client(sync_client=True) as client:  # the run is the server's, and it completed
            runs = client.read_flow_runs()
        assert [(r.name is not None, r.state_type.value) for r in runs] == [(True, "COMPLETED")]
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=5)  # the flow run's last log lines reach the server before it stops
    assert [r["rank"] for r in results] == [0, 1] and all(r["returncode"] == 0 for r in results)
    log0 = (workspace / results[0]["log"]).read_text()
    assert "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in log0, log0[-2000:]
    both = _weights(model)
    assert single.keys() == both.keys()
    # Adam amplifies float differences in coordinates whose gradient is near zero: compare each tensor as a whole
    worst = max(float(np.linalg.norm(both[k] - single[k]) / max(np.linalg.norm(single[k]), 1e-12))
                for k in single.keys() - CANCELLED if single[k].dtype.kind == "f")
    assert worst < REL_TOL, worst
    cosine = (_embeddings(model, workspace) * _embeddings(workspace.parent / "single", workspace)).sum(1)
    assert cosine.min() > MIN_COSINE, cosine.min()


def test_a_failing_node_stops_the_launch_and_is_named(workspace, ray_local):
    from ml.errors import ConfigError
    from ops.launch import LaunchError, launch

    _set_fr(workspace, batch_size=8, num_nodes=2, strategy="ddp")
    with pytest.raises(ConfigError, match=r"fr.num_nodes is 2 but the launch has 3 nodes"):
        launch("train_fr@real", 3, root=workspace, pack=True)
    with pytest.raises(ConfigError, match=r"train_fusion: only train_fr trains across nodes"):
        launch("train_fusion", 2, root=workspace, pack=True)
    with pytest.raises(LaunchError, match=r"(?s)node \d \(.*\) exited with status 2; the end of .*unknown stage"):
        launch("train_fr@nosuch", 2, root=workspace, pack=True, timeout=300)


def test_a_node_lost_mid_run_stops_the_other_and_is_named(workspace, ray_local):
    """Node 1's training is killed (SIGKILL, as a lost machine) while both nodes train: the launch ends, names node
    1, and leaves no node process behind. (Over gloo node 0's all-reduce fails by itself once its peer's socket
    closes; that the launcher stops a node still running is the timeout test's.)"""
    import threading
    import time

    import psutil

    from ops.launch import LaunchError, launch

    _set_fr(workspace, batch_size=8, num_nodes=2, strategy="ddp", epochs=200)
    log1 = workspace / "logs" / "launch" / "train_fr-real-node1.log"
    log1.unlink(missing_ok=True)

    def kill_node1() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if log1.is_file() and "MEMBER: 2/2" in log1.read_text(errors="replace"):  # node 1 joined the group
                break
            time.sleep(0.5)
        time.sleep(3)  # a few steps in
        for proc in psutil.process_iter(["environ"]):
            with contextlib.suppress(psutil.Error):
                if (proc.info["environ"] or {}).get("NODE_RANK") == "1":
                    proc.kill()

    killer = threading.Thread(target=kill_node1, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"node 1 \(.*\) exited with status -9"):
        launch("train_fr@real", 2, root=workspace, pack=True, timeout=400)
    killer.join()
    assert time.monotonic() - start < 300
    assert not [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("NODE_RANK") == "0"]


def test_nodes_still_running_at_the_timeout_are_stopped_and_named(workspace, ray_local):
    """A launch past its timeout terminates every node's process group (Lightning's processes with it)."""
    import psutil

    from ops.launch import LaunchError, launch

    _set_fr(workspace, batch_size=8, num_nodes=2, strategy="ddp", epochs=500)
    with pytest.raises(LaunchError, match=r"nodes \[0, 1\] still running after 30 s; stopped them"):
        launch("train_fr@real", 2, root=workspace, pack=True, timeout=30)
    assert not [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("NODE_RANK")]
