"""Two of the same thing at once on the same stores: two sweeps on one SQLite study and one SQLite MLflow store, two
`dvc repro` and two `faceops run` in one working copy. Each pair either both succeed with every store intact, or
the second is refused with a message naming the lock.

Already proven elsewhere (tests/stages/test_sweep.py): two `faceops sweep` commands (one with two workers) on one Optuna
*journal* file lose and repeat no trial. Added here: the default SQLite study storage, created by both at once, and
a PostgreSQL server (the storage for many workers).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import copy_project
from tests.stages.test_sweep import TINY

from .report_faults import prepared_workspace, record

REPO = Path(__file__).resolve().parents[2]
AREA = "Concurrency"
BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _integrity(db: Path) -> str:
    with sqlite3.connect(db) as con:
        return con.execute("PRAGMA integrity_check").fetchone()[0]


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_two_sweeps_at_once_on_one_study_and_mlflow_store(tmp_path_factory, tmp_path, storage):
    """SQLite: both processes find no optuna.db and no mlflow.db and race to create them. PostgreSQL (the storage
    for many workers, a real server on a Unix socket): both race to create the study's tables and the study."""
    import optuna
    from mlflow import MlflowClient

    from tests.servers import postgres_server

    root = prepared_workspace(tmp_path_factory, tmp_path / "ws")
    env = _env(MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}")
    k = 2
    with contextlib.ExitStack() as stack:
        url = (f"sqlite:///{root / 'optuna.db'}" if storage == "sqlite" else
               stack.enter_context(postgres_server(tmp_path / "pg")))
        cmd = [sys.executable, "-m", "ops.sweep", "train_fr", "--study", "both", "--trials", str(k)]
        env["FACEOPS_SWEEP_STORAGE"] = url  # how a worker is told its storage (never on the command line)
        start = time.monotonic()
        procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        seconds = time.monotonic() - start
        for proc, out in zip(procs, outs):
            assert proc.returncode == 0, out[-3000:]
        assert storage != "sqlite" or _integrity(root / "optuna.db") == "ok"
        assert _integrity(root / "mlflow.db") == "ok"
        trials = optuna.load_study(study_name="both", storage=url).get_trials()
    assert sorted(t.number for t in trials) == list(range(2 * k))  # none lost, none run twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    run_ids = [t.user_attrs["mlflow_run_id"] for t in trials]
    assert len(set(run_ids)) == 2 * k
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("faceops")
    parents = client.search_runs([exp.experiment_id], "tags.`faceops.kind` = 'sweep'")
    assert len(parents) == 1  # one parent run, created by whichever process created the study
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(r.info.run_id for r in children) == sorted(run_ids)
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == list(range(2 * k))
    where = "SQLite study (optuna.db)" if storage == "sqlite" else "PostgreSQL 16 study"
    record(AREA, f"two sweep processes at once on one new {where} and one SQLite MLflow store",
           f"both exit 0; {len(trials)} trials numbered 0..{2 * k - 1}, all COMPLETE, each with its own MLflow "
           "run under one parent; PRAGMA integrity_check ok on the SQLite databases", True, seconds=seconds,
           trials=len(trials))


def _cache_problems(root: Path) -> list[str]:
    """Cache files whose md5 is not their name, and .dir listings naming files missing from the cache."""
    cache = root / ".dvc" / "cache" / "files" / "md5"
    problems, names = [], set()
    for path in cache.rglob("*"):
        if path.is_file():
            name = path.parent.name + path.name
            names.add(name.removesuffix(".dir"))
            if not name.endswith(".dir") and hashlib.md5(path.read_bytes()).hexdigest() != name:
                problems.append(f"{path}: content hash differs from its name")
    for path in cache.rglob("*.dir"):
        problems += [f"{path}: lists {e['md5']} not in the cache" for e in json.loads(path.read_text())
                     if e["md5"] not in names]
    return problems + ([] if names else ["empty cache"])


def _dvc_status(root: Path, stage: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "dvc", "status", stage, "--json"], cwd=root, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout or "{}")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A working copy of the project (git + DVC) with test_sweep's tiny data params."""
    from tasks.params import apply_delta

    root = copy_project(tmp_path_factory.mktemp("concurrency"))
    apply_delta(root / "params.yaml", {k: v for k, v in TINY.items() if k.startswith("data.")})
    return root


@pytest.mark.slow
def test_second_dvc_repro_at_once_is_refused_by_dvcs_lock(project):
    cmd = [sys.executable, "-m", "dvc", "repro", "prepare"]
    first = subprocess.Popen(cmd, cwd=project, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3.0)  # DVC takes its lock at start; the second comes while the first runs prepare
    second = subprocess.run(cmd, cwd=project, env=_env(), capture_output=True, text=True, timeout=300)
    out = first.communicate(timeout=600)[0]
    assert first.returncode == 0, out[-3000:]
    message = second.stdout + second.stderr
    # DVC's repository lock, or its per-output read/write lock naming the process that holds the outputs
    assert second.returncode != 0, message[-2000:]
    assert "Unable to acquire lock" in message or re.search(rf"is being blocked by:\s+\(PID {first.pid}\)", message), \
        message
    how = "repository lock" if "Unable to acquire lock" in message else "output lock (rwlock), naming the first's PID"
    assert _dvc_status(project, "prepare") == {} and _cache_problems(project) == []
    record(AREA, "two `dvc repro prepare` at once in one working copy",
           f"the second is refused at once by DVC's {how}; the first finishes; `dvc status prepare` clean, every "
           "cache file's md5 = its name", True)


@pytest.mark.slow
def test_second_faceops_run_at_once_is_refused_and_changes_nothing(project):
    lock = project / ".faceops" / "run.lock"
    params = (project / "params.yaml").read_text()
    env = _env()
    env.pop("PREFECT_API_URL", None)  # each run on its own temporary Prefect server, as on a laptop
    first = subprocess.Popen([sys.executable, "-m", "faceops.cli", "run", "--stage", "prepare", "--force"],
                             cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (lock.is_file() and f"pid {first.pid}" in lock.read_text()) and first.poll() is None:
        assert time.monotonic() < deadline, "the first run never took the run lock"
        time.sleep(0.1)
    start = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "faceops.cli", "run", "--stage", "prepare", "--set",
                             "fr.epochs=9"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    refused_s = time.monotonic() - start
    out = first.communicate(timeout=600)[0]
    assert second.returncode == 3, second.stdout + second.stderr
    assert "another `faceops run`" in second.stderr and f"pid {first.pid}" in second.stderr
    assert str(lock) in second.stderr.replace("\n", "") or "run.lock" in second.stderr
    assert (project / "params.yaml").read_text() == params  # the refused run wrote no delta
    assert first.returncode == 0, out[-3000:]
    assert lock.read_text() == ""  # released
    assert _dvc_status(project, "prepare") == {} and _cache_problems(project) == []
    record(AREA, "two `faceops run` at once in one working copy",
           "the second is refused (exit 3) naming the first's pid and .faceops/run.lock, before it touches "
           "params.yaml; the first finishes; `dvc status prepare` clean, cache hashes match", True,
           refused_after_s=refused_s)
