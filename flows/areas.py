"""Per-area flows: the pipeline restricted to one area's stages (and the stages they need), with typed parameters a
person fills in from the Prefect UI (prefect.yaml deploys each one): ``synthesize`` (``train_generator``,
``synthesize``), ``train`` (the training stages, or some of them), ``evaluate`` (optionally on an ingested face
folder or RecordIO) and ``pipeline`` (the whole DAG). Which stages belong to an area is ``tasks.STAGES``'s.

Each flow first writes ``preset`` then ``params_delta`` into params.yaml (``flows.routing.apply_params``; an unknown
key fails the run at once, naming it) in the working copy it runs in — on a worker, the run's fresh clone — then
runs the stages as a ``faceops-pipeline`` subflow run. ``register_candidates`` decides whether the models trained
become ``@candidate``: by default the run's params do (``ops.run_config.promotable``: the default or a real-data preset
yes; ``preset: smoke`` or any other delta no, registered as versions tagged ``faceops.alias_withheld``). The ``Args:`` section of each flow's docstring is what the Prefect UI shows beside
each field of a deployment's run form.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.pipeline import pipeline, with_jobs
from flows.routing import apply_params, moving_aliases, yaml_value
from flows.stages import stage_order
from ml.errors import ConfigError
from ops.run_config import TOY_PRESETS
from tasks import STAGES

# area → the dvc.yaml stages it runs, by base name (``train_fr`` covers every ``train_fr@<source>``): tasks.STAGES
AREAS: dict[str, tuple[str, ...]] = {
    area: tuple(name for name, stage in STAGES.items() if area in stage.areas)
    for area in ("synthesize", "train", "evaluate")
}


def area_stages(area: str, all_stages: Iterable[str], only: list[str] | None = None) -> list[str]:
    """The stages of ``area`` in dependency order, or ``only`` of them (each must belong to the area)."""
    members = [s for s in all_stages if s.partition("@")[0] in AREAS[area]]
    if not only:
        return members
    foreign = [s for s in only if s not in members]
    if foreign:
        raise ConfigError(f"stage(s) {', '.join(foreign)} not in the '{area}' flow; its stages: {', '.join(members)} "
                          f"(the whole DAG: the pipeline-nightly deployment).")
    return [s for s in members if s in only]


def _run_area(area: str | None, root: str, only: list[str] | None, params_delta: dict[str, str] | None,
              preset: str | None, force: bool, jobs: int | None, register_candidates: bool | None = None
              ) -> list[dict[str, Any]]:
    logger = get_run_logger()
    root_path = Path(root).resolve()
    apply_params(root_path, preset, with_jobs(params_delta, jobs), logger)
    stages = area_stages(area, stage_order(root_path), only) if area else only
    with moving_aliases(register_candidates):
        if register_candidates is None and preset in TOY_PRESETS:
            logger.info("new model versions are registered without @candidate (preset %s; set "
                        "register_candidates to true to move the aliases)", preset)
        return pipeline(root=str(root_path), stages=stages, force=force)


@flow(name="pipeline")
def whole_pipeline(params_delta: dict[str, str] | None = None, preset: str | None = None,
                   stages: list[str] | None = None, force: bool = False, jobs: int | None = None,
                   register_candidates: bool | None = None, root: str = ".") -> list[dict[str, Any]]:
    """The whole DAG (or some stages and what they need); DVC skips the stages whose inputs did not change.

    Args:
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g.
            {"fr.epochs": "20"}; an unknown key fails the run at once, naming it.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke (the whole DAG at toy
            size in a few minutes).
        stages: only these dvc.yaml stages and what they need, e.g. ["evaluate"]; empty: all of them.
        force: rerun the stages even when DVC finds them up to date.
        jobs: how many independent stages run at once (params pipeline.jobs); empty: params.yaml's.
        register_candidates: make the models trained `@candidate` in the MLflow registry (what the promote
            deployment judges); empty: when the params are the default or a real-data preset, not the smoke
            preset (toy models) or another delta.
        root: the repository root (on a worker: the clone its pull steps made).
    """
    return _run_area(None, root, stages, params_delta, preset, force, jobs, register_candidates)


@flow(name="synthesize")
def synthesize(params_delta: dict[str, str] | None = None, preset: str | None = None, force: bool = False,
               jobs: int | None = None, register_candidates: bool | None = None, root: str = ".") -> list[dict[str, Any]]:
    """Train the UIFace generator and synthesize a face set (and whatever they need that is out of date).

    Args:
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g.
            {"synthesize.identities": "200"}.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke.
        force: rerun the stages even when DVC finds them up to date.
        jobs: how many independent stages run at once (params pipeline.jobs); empty: params.yaml's.
        register_candidates: make the models trained `@candidate` in the MLflow registry (what the promote
            deployment judges); empty: when the params are the default or a real-data preset, not the smoke
            preset (toy models) or another delta.
        root: the repository root (on a worker: the clone its pull steps made).
    """
    return _run_area("synthesize", root, None, params_delta, preset, force, jobs, register_candidates)


@flow(name="train")
def train(stages: list[str] | None = None, params_delta: dict[str, str] | None = None, preset: str | None = None,
          force: bool = False, jobs: int | None = None, register_candidates: bool | None = None, root: str = "."
          ) -> list[dict[str, Any]]:
    """Train the models: every training stage, or some of them, and whatever they need that is out of date.

    Args:
        stages: only these training stages, e.g. ["train_fr@real"]; empty: all of them.
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g.
            {"fr.epochs": "20", "fr.backbone": "vit_s"}.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke.
        force: rerun the stages even when DVC finds them up to date.
        jobs: how many independent stages run at once (params pipeline.jobs); empty: params.yaml's.
        register_candidates: make the models trained `@candidate` in the MLflow registry (what the promote
            deployment judges); empty: when the params are the default or a real-data preset, not the smoke
            preset (toy models) or another delta.
        root: the repository root (on a worker: the clone its pull steps made).
    """
    return _run_area("train", root, stages, params_delta, preset, force, jobs, register_candidates)


@flow(name="evaluate")
def evaluate(ingest_folder: str = "", ingest_recordio: str = "", params_delta: dict[str, str] | None = None,
             preset: str | None = None, force: bool = False, jobs: int | None = None, register_candidates: bool | None = None,
             root: str = ".") -> list[dict[str, Any]]:
    """Benchmark every model (FR, fusion, discovery, the synthetic set), training whatever is out of date.

    Args:
        ingest_folder: a folder <identity>/<image> of aligned faces on the worker to benchmark as well
            (data.ingest_folder); empty keeps params.yaml's value.
        ingest_recordio: or an InsightFace RecordIO train.rec on the worker (data.ingest_recordio).
        params_delta: dotted params key → YAML value, as `faceops run --set` takes them, e.g.
            {"evaluate.fars": "[0.0001, 0.001]"}.
        preset: a named delta from presets.yaml applied before params_delta, e.g. smoke.
        force: rerun the stages even when DVC finds them up to date.
        jobs: how many independent stages run at once (params pipeline.jobs); empty: params.yaml's.
        register_candidates: make the models trained `@candidate` in the MLflow registry (what the promote
            deployment judges); empty: when the params are the default or a real-data preset, not the smoke
            preset (toy models) or another delta.
        root: the repository root (on a worker: the clone its pull steps made).
    """
    datasets = {key: yaml_value(value) for key, value in
                (("data.ingest_folder", ingest_folder), ("data.ingest_recordio", ingest_recordio)) if value}
    return _run_area("evaluate", root, None, {**(params_delta or {}), **datasets}, preset, force, jobs,
                     register_candidates)
