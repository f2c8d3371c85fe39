"""A dataset logged as a run's MLflow input: its manifest and digest, and none of MLflow's warnings about a local
source it resolves twice or integer columns (they printed dozens of lines per smoke run)."""

from __future__ import annotations

import warnings

import numpy as np

from ml.data.dataset import DatasetWriter, read_dataset_info


def test_a_logged_dataset_keeps_its_digest_and_warns_nothing(tmp_path, monkeypatch):
    import mlflow

    from ops.tracking import StageTracker
    from ops.run_store import configure

    with DatasetWriter(tmp_path / "faces", name="faces", source="procedural", aligned=True) as w:
        for i in range(4):
            w.add(np.full((8, 8, 3), 40 * i, np.uint8), identity=f"id{i % 2}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    configure(tmp_path)
    with mlflow.start_run() as run, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        digest = StageTracker(run.info.run_id, tmp_path).log_dataset(tmp_path / "faces", context="train")
    assert digest == read_dataset_info(tmp_path / "faces")["digest"]
    assert [str(w.message)[:80] for w in caught] == []
    (logged,) = mlflow.get_run(run.info.run_id).inputs.dataset_inputs
    assert logged.dataset.name == "faces" and {t.key: t.value for t in logged.tags}["mlflow.data.context"] == "train"
