"""The pipeline as a Prefect flow: the DAG comes from ``dvc.yaml``, each stage is reproduced through DVC.

There is no second DAG: ``stage_order`` reads DVC's own stage graph, and every task runs
``dvc repro --single-item <stage>``, so DVC's cache decides what is up to date and ``dvc.lock`` records
every data version. Prefect adds the flow run, one visible task per stage, retries and logs; MLflow gets a
parent run per flow run under which each stage's run nests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from collections.abc import Iterator
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run

from tasks import tracking


class StageFailed(RuntimeError):
    pass


def stage_order(root: Path) -> list[str]:
    """Stage names (``train_fr@real`` for foreach stages) in dependency order, from DVC's graph."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph  # edge A → B: A depends on B
        order = list(reversed(list(nx.topological_sort(graph))))
        return [stage.addressing for stage in order if not stage.addressing.endswith(".dvc")]  # .dvc files: data, not stages


def dvc_lock_deps(root: Path, stage: str) -> dict[str, str]:
    """``{dep path: md5}`` of ``stage`` as DVC recorded it in ``dvc.lock``."""
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage, {})
    return {d["path"]: d.get("md5") or d.get("hash", "") for d in entry.get("deps", [])}


def stage_env(root: Path, invocation: str, parent_run_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    # DVC runs `python -m tasks.x` through the shell: make that the interpreter running this flow
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env[tracking.ENV_INVOCATION] = invocation
    env.setdefault("TQDM_MININTERVAL", "5")  # progress bars become log lines here: one every few seconds
    env["PYTHONUNBUFFERED"] = "1"  # Lightning's bar writes to stdout, block-buffered on a pipe otherwise
    env.setdefault("MLFLOW_TRACKING_URI", tracking.tracking_uri(root))
    if parent_run_id:
        env[tracking.ENV_PARENT_RUN] = parent_run_id
    if flow_run.id:
        env[tracking.ENV_FLOW_RUN] = str(flow_run.id)
    return env


@task(retries=0, task_run_name="{stage}")
def reproduce_stage(stage: str, root: str, parent_run_id: str | None = None, force: bool = False) -> dict[str, Any]:
    """``dvc repro --single-item STAGE``: runs the stage's cmd only if DVC finds it out of date."""
    logger = get_run_logger()
    invocation = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage] + (["--force"] if force else [])
    start = time.perf_counter()
    rc, tail = run_logged(cmd, Path(root), stage_env(Path(root), invocation, parent_run_id), logger)
    seconds = time.perf_counter() - start
    if rc != 0:
        errors = [l for l in tail if l.startswith(("error:", "ERROR"))]
        raise StageFailed(f"stage '{stage}' failed (dvc exit {rc}): {(errors or tail[-1:] or ['no output'])[-1]}")
    ran = not any("didn't change, skipping" in l for l in tail)
    if ran:
        _tag_stage_run(Path(root), stage, invocation)
    logger.info("%s: %s in %.1fs", stage, "ran" if ran else "up to date", seconds)
    return {"stage": stage, "ran": ran, "seconds": seconds}


def run_logged(cmd: list[str], cwd: Path, env: dict[str, str], logger: Any) -> tuple[int, list[str]]:
    """Run ``cmd``, every output line to ``logger`` as it comes; → (exit code, the last 40 lines)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail: list[str] = []
    for line in _lines(proc.stdout):
        tail = (tail + [line])[-40:]
        logger.info(line)
    return proc.wait(), tail


def _lines(stream: Any) -> Iterator[str]:
    """Non-empty lines of a byte stream split at \\n *and* \\r, so progress bars reach the log as they advance."""
    pending = ""
    for chunk in iter(lambda: stream.read1(65536), b""):
        parts = re.split(r"[\r\n]", pending + chunk.decode("utf-8", errors="replace"))
        pending = parts.pop()
        yield from (p.rstrip() for p in parts if p.strip())
    if pending.strip():
        yield pending.rstrip()


def _tag_stage_run(root: Path, stage: str, invocation: str) -> None:
    """Tag the stage's MLflow run with DVC's dependency hashes (known only once dvc.lock is written)."""
    from mlflow import MlflowClient

    experiment_id = tracking.configure(root)
    client = MlflowClient()
    runs = client.search_runs(
        experiment_ids=[experiment_id],
        filter_string=f"tags.`faceops.invocation` = '{invocation}'", max_results=1,
    )
    for run in runs:
        for path, md5 in dvc_lock_deps(root, stage).items():
            client.set_tag(run.info.run_id, f"dvc.dep.{path}", md5)


@flow(name="faceops-pipeline")
def pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False) -> list[dict[str, Any]]:
    """Reproduce the DVC pipeline stage by stage (all stages, or ``stages`` and what they need)."""
    import mlflow

    logger = get_run_logger()
    root_path = Path(root).resolve()
    order = stage_order(root_path)
    if stages:
        unknown = [s for s in stages if s not in order]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has {order}")
        order = [s for s in order if s in _with_upstream(root_path, stages)]
    logger.info("stages in order: %s", " → ".join(order))
    tracking.configure(root_path)
    with mlflow.start_run(run_name="pipeline", tags={
        "prefect.flow_run_id": str(flow_run.id), "faceops.kind": "pipeline", "git.commit": tracking.git_commit(root_path),
    }) as parent:
        results = []
        for stage in order:
            results.append(reproduce_stage(stage, str(root_path), parent.info.run_id, force))
        mlflow.log_metrics({
            "pipeline/stages_ran": float(sum(r["ran"] for r in results)),
            "pipeline/seconds": float(sum(r["seconds"] for r in results)),
        })
    return results


def _with_upstream(root: Path, stages: list[str]) -> set[str]:
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        by_name = {s.addressing: s for s in graph.nodes}
        keep: set[str] = set()
        for name in stages:
            keep.add(name)
            keep.update(s.addressing for s in nx.descendants(graph, by_name[name]))
        return keep
