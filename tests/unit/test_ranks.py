"""Multi-process FR training: every DDP rank trains, rank 0 alone opens the tracking run and writes the model,
metrics and registry entry (a second node must not register a second `faceops-fr` version or race rank 0's
files)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ml.fr.train import FRConfig, FRResult
from tasks import train_fr
from tasks.common import Paths, launch_rank
from tasks.prepare import DataConfig


@pytest.mark.parametrize("env, devices, rank", [
    ({}, 1, 0),
    ({"LOCAL_RANK": "1"}, 2, 1),  # Lightning re-ran the stage for the second device
    ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, 4, 4),  # first process of the second node
    ({"NODE_RANK": "2", "LOCAL_RANK": "3"}, 4, 11),
    ({"RANK": "5", "NODE_RANK": "0", "LOCAL_RANK": "1"}, 2, 5),  # torchrun's RANK wins
])
def test_launch_rank_reads_the_launchers_environment(monkeypatch, env, devices, rank):
    for key in ("RANK", "NODE_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launch_rank(devices) == rank


def _train_set(paths: Paths, size: int = 32) -> None:
    from ml.data.dataset import DatasetWriter

    rng = np.random.default_rng(0)
    with DatasetWriter(paths.prepared / "train", name="train", source="procedural", aligned=True) as w:
        for identity in ("a", "b"):
            for _ in range(2):
                w.add(rng.integers(0, 255, (size, size, 3), dtype=np.uint8), identity=identity)


class _Tracker:
    def __getattr__(self, name):
        raise AssertionError(f"rank 1 called tracker.{name}")


def test_a_non_zero_rank_trains_but_writes_and_logs_nothing(tmp_path, monkeypatch):
    paths = Paths(tmp_path)
    _train_set(paths)
    trained = []

    def fake_train(cfg, images, labels, **kwargs):
        trained.append(len(labels))
        return FRResult(torch.nn.Linear(1, 1), "vit_tiny", {}, [{"epoch": 0, "train/loss": 1.0}], 1.0, global_rank=1)

    monkeypatch.setattr("ml.fr.train.train_fr", fake_train)
    result = train_fr.run(FRConfig(), DataConfig(image_size=32), paths, tracker=_Tracker())
    assert trained == [4] and result.outputs == [] and "rank 1" in result.summary
    assert not paths.fr_model("real").exists() and not (paths.metrics / "train_fr_real.json").exists()


def test_the_stage_command_opens_no_tracking_run_on_another_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("fr:\n  devices: 2\ndata:\n  image_size: 32\n")
    _train_set(Paths(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    calls = []

    def no_run(*args, **kwargs):
        raise AssertionError("an extra rank opened a tracking run")

    monkeypatch.setattr("ops.tracking.stage_run", no_run)
    monkeypatch.setattr(train_fr, "run", lambda cfg, data, paths, source, tracker=None: calls.append(tracker)
                        or train_fr.StageResult("train_fr@real", summary="rank 1"))
    train_fr.main()
    assert calls == [None]
