"""The repository's own MLflow store (``mlflow.db`` + ``mlruns/``) belongs to the folder it is in: a workspace
copied with ``cp -r`` logs into its own ``mlruns/``, never into the original's, and keeps reading its old runs'
artifacts after the original is gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

STAGE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ops.tracking import stage_run

    name = sys.argv[1]
    artifact = Path(name + ".txt")
    artifact.write_text(name)
    with stage_run("toy", {}, Path.cwd()) as tracker:
        tracker.log_artifact(artifact, artifact_path="out")
        print("run", tracker.run_id)
""")


def _stage(workspace: Path, name: str) -> str:
    """A stage run as `dvc repro` starts one in ``workspace`` (no tracking URI set: the folder's own store)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "FACEOPS_", "DVC_"))}
    done = subprocess.run([sys.executable, "-c", STAGE, name], cwd=workspace, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO)}, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split("run ", 1)[1].split()[0]


def test_a_copied_workspace_logs_into_its_own_mlruns_and_keeps_its_old_artifacts(tmp_path):
    import mlflow

    original = tmp_path / "original"
    original.mkdir()
    first = _stage(original, "first")
    assert list((original / "mlruns").rglob("first.txt"))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)

    second = _stage(copy, "second")
    assert list((copy / "mlruns").rglob("second.txt"))
    assert not list((original / "mlruns").rglob("second.txt"))  # before the fix: written into the original

    shutil.rmtree(original)
    client = mlflow.MlflowClient(f"sqlite:///{copy / 'mlflow.db'}")
    for run_id, name in ((first, "first"), (second, "second")):
        uri = client.get_run(run_id).info.artifact_uri
        assert uri.removeprefix("file://").startswith(str(copy / "mlruns")), uri
        local = mlflow.artifacts.download_artifacts(f"{uri}/out/{name}.txt", dst_path=str(tmp_path / "read"))
        assert Path(local).read_text() == name
    experiment = client.get_experiment_by_name("faceops")
    assert experiment.artifact_location.removeprefix("file://").startswith(str(copy / "mlruns"))
