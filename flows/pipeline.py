"""The pipeline as a Prefect flow: the DAG comes from ``dvc.yaml``, each stage is reproduced through DVC.

There is no second DAG: ``flows.stages.stage_graph`` reads DVC's own stage graph, and each stage is one Prefect task
(``flows.routing.reproduce_stage``) that does what ``dvc repro --single-item <stage>`` does (``flows/stages.py``), in
this process or, for a GPU stage when a GPU work pool is configured, on that pool (``flows/routing.py``). A stage
starts as soon as the stages it depends on have finished, so independent stages (discovery, fusion, the aligner
and the generator after ``train_fr@real``) run at the same time, up to params
``pipeline.jobs`` at once; the stages in ``pipeline.exclusive`` run alone, on every core (``tasks.pipeline``).
Prefect adds the flow run, one visible task per stage, retries and logs; MLflow gets a parent run per flow run under
which each stage's run nests. The parent run also holds its stages' summary numbers
(``ops.lineage.unique_summary``), so pipeline runs compare in MLflow's table and chart view with their stage runs
folded.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from flows import routing
from flows.stages import DVC_LOCK, limit_jobs, stage_graph
from ml.errors import DataError
from ops import lineage, run_store, tracking
from ops.run_config import config_label, run_config


def benchmark_markdown(report: str, tables: int = 2) -> str:
    """The head of a benchmark report (title, when it was generated) and its first ``tables`` sections holding a
    table (the models and their verification accuracy), with a pointer to the rest."""
    head, *sections = re.split(r"^(?=## )", report, flags=re.MULTILINE)
    with_table = [s for s in sections if re.search(r"^\|", s, flags=re.MULTILINE)]
    kept = "".join(with_table[:tables]).rstrip()
    rest = len(sections) - len(with_table[:tables])
    return f"{head.rstrip()}\n\n{kept}\n\n_{rest} more section(s) in `reports/benchmark.md`._\n"


def publish_benchmark(root: Path) -> None:
    """This flow run's ``benchmark`` markdown artifact (Prefect UI → Artifacts), from reports/benchmark.md."""
    from prefect.artifacts import create_markdown_artifact

    report = root / "reports" / "benchmark.md"
    markdown = (benchmark_markdown(report.read_text(encoding="utf-8")) if report.is_file() else
                "No benchmark yet: the `evaluate` stage writes `reports/benchmark.md`; run it (stage `evaluate`).")
    create_markdown_artifact(markdown=markdown, key="benchmark", description="faceops benchmark (reports/benchmark.md)")


@flow(name="faceops-pipeline")
def pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False, jobs: int | None = None,
             params_delta: dict[str, str] | None = None, preset: str | None = None) -> list[dict[str, Any]]:
    """Reproduce the DVC pipeline (all stages, or ``stages`` and what they need); a stage starts as soon as the
    stages it depends on have finished, up to params ``pipeline.jobs`` at once (the critical path first when more
    are ready; ``pipeline.exclusive`` stages alone); an out-of-date stage whose run DVC's run-cache holds is restored
    from it unless ``force``. ``preset`` then ``params_delta`` (e.g. ``{"fr.epochs": "2"}``) are written into
    params.yaml first (``flows.routing.apply_params``). GPU stages run on the GPU work pool when
    ``FACEOPS_GPU_DEPLOYMENT`` is set. The run ends with a ``benchmark`` artifact.

    Args:
        root: the repository root.
        stages: only these dvc.yaml stages and what they need, e.g. ["evaluate"]; empty: all of them.
        force: rerun the stages even when DVC finds them up to date (no run-cache restore either).
        jobs: how many independent stages run at once (params pipeline.jobs; each stage's thread count follows it,
            so a new value reruns the stages); empty: params.yaml's.
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g. {"fr.epochs": "20"}.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke.
    """
    import mlflow

    from ml.config import from_mapping
    from tasks.params import load_yaml
    from tasks.pipeline import PipelineConfig

    logger = get_run_logger()
    root_path = Path(root).resolve()
    routing.apply_params(root_path, preset, with_jobs(params_delta, jobs), logger)
    # only the pipeline section: each stage checks its own, and a plain DVC project's sections are its own affair
    params_file = root_path / "params.yaml"
    params = (load_yaml(params_file.read_text(encoding="utf-8")) if params_file.is_file() else None) or {}
    schedule = from_mapping(PipelineConfig, params.get("pipeline") or {}, "pipeline")
    if deployment := routing.gpu_deployment():
        logger.info("GPU stages run on deployment %s", deployment)
    if publish := routing.publish_requested():  # a throw-away clone: no remote, nothing of this run would survive
        routing.require_remote(root_path)
    graph = stage_graph(root_path)
    order = list(graph)
    if stages:
        unknown = [s for s in stages if s not in graph]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; dvc.yaml has {order}")
        keep = _with_upstream(graph, stages)
        order = [s for s in order if s in keep]
    logger.info("stages in dependency order: %s", " → ".join(order))
    limit_jobs(schedule.jobs, {s: [u for u in graph[s] if u in order] for s in order}, schedule.exclusive)
    run_store.configure(root_path)
    config = run_config(root_path)  # in the run's name and tags: a smoke or custom run stands apart
    with mlflow.start_run(run_name=f"pipeline {config_label(config)}".strip(), tags={
        "prefect.flow_run_id": str(flow_run.id), "faceops.kind": "pipeline", "git.commit": tracking.git_commit(root_path),
        **config,
    }) as parent:
        started = time.perf_counter()
        futures: dict[str, Any] = {}
        for stage in order:
            upstream = [futures[u] for u in graph[stage] if u in futures]
            futures[stage] = routing.reproduce_stage.submit(stage, str(root_path), parent.info.run_id, force,
                                                    wait_for=upstream)
        results, failure = [], None
        for stage in order:  # dependency order: the first failure reported is the root cause
            state = futures[stage].wait() or futures[stage].state
            if state.is_completed():
                results.append(futures[stage].result())
            elif failure is None:
                failure = futures[stage]
        if failure is not None:
            failure.result()  # raises the stage's StageFailed
        restored = [r["stage"] for r in results if r.get("restored")]
        logger.info("%d stage(s) ran, %d restored from DVC's run-cache%s, %d up to date",
                    sum(r["ran"] for r in results), len(restored), f" ({', '.join(restored)})" if restored else "",
                    sum(not r["ran"] and not r.get("restored") for r in results))
        try:
            with DVC_LOCK:
                summary = lineage.unique_summary(root_path, [r["stage"] for r in results])
        except DataError as exc:  # the stages' own runs hold their numbers: the pipeline's are a view
            logger.warning("the pipeline run shows no stage numbers: a stage's %s", exc)
            summary = {}
        tracking.log_summary({k: v for k, v in summary.items() if not tracking.DETAIL.search(k)})
        mlflow.log_metrics({
            "pipeline/stages_ran": float(sum(r["ran"] for r in results)),
            "pipeline/stages_restored": float(len(restored)),
            # stages run side by side (`jobs` > 1): their times add up to more than the run's wall time
            "pipeline/stage_seconds_sum": float(sum(r["seconds"] for r in results)),
            "pipeline/wall_seconds": time.perf_counter() - started,
        })
    if publish:
        uploaded = routing.publish_outputs(root_path, [r["stage"] for r in results])
        logger.info("outputs in the DVC remote (%d file(s) uploaded); dvc.lock: artifact %s", uploaded,
                    routing.LOCK_KEY)
    publish_benchmark(root_path)
    return results


def run_pipeline(root: str = ".", stages: list[str] | None = None, force: bool = False, jobs: int | None = None
                 ) -> list[dict[str, Any]]:
    """``pipeline`` with a thread per stage in the task runner (a task waiting for its upstream stages must not
    hold up a ready one); params ``pipeline.jobs`` slots limit how many run."""
    return pipeline.with_options(task_runner=ThreadPoolTaskRunner(max_workers=64))(
        root=root, stages=stages, force=force, jobs=jobs)


def with_jobs(params_delta: dict[str, str] | None, jobs: int | None) -> dict[str, str] | None:
    """``params_delta`` with ``pipeline.jobs`` set to ``jobs`` when one is given (the flows' ``jobs`` parameter
    is a shortcut for that params key)."""
    if jobs is None:
        return params_delta
    return {**(params_delta or {}), "pipeline.jobs": str(jobs)}


def _with_upstream(graph: dict[str, list[str]], stages: list[str]) -> set[str]:
    keep: set[str] = set()
    todo = list(stages)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo += graph[name]
    return keep
