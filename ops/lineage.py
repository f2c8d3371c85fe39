"""Lineage between DVC and MLflow: which versions of data and code a stage run read and wrote.

A stage run carries DVC's hash of each dependency and output as a tag, ``dvc.dep.<path>`` / ``dvc.out.<path>``
(the md5 ``dvc.lock`` records: ``<md5>`` for a file, ``<md5>.dir`` for a folder), and each model version the run
registered carries its model folder's ``dvc.out.models/...``; the run-cache restore (``flows.stages``) finds the run
that made an output by them. The hashes come from one of two places:

- ``faceops run`` reads them from ``dvc.lock`` after DVC has written it (``flows.stages``);
- a stage DVC runs on its own (``dvc repro``, ``dvc exp run``, queued or not) asks DVC to hash its deps and outs as
  it ends (``dvc_hashes``): DVC writes ``dvc.lock`` only after the stage process has exited, and nothing of ours
  runs then. DVC keeps the hashes in its state database, so its own hashing right after costs nothing extra.

The stages of one ``dvc exp run`` nest under one parent run, ``dvc exp <name>`` (``experiment_parent``), as a
``faceops run``'s nest under its pipeline run. A parent run also shows its stages' numbers (``unique_summary``):
each key of their DVC metrics files that exactly one stage writes, so parent runs compare in MLflow's table and its
chart view has charts with the stage runs folded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ml.errors import DataError

log = logging.getLogger(__name__)

KIND = "dvc-experiment"  # faceops.kind of a `dvc exp run`'s parent run


def tag_runs(client: object, run_ids: Iterable[str], deps: Mapping[str, str], outs: Mapping[str, str]) -> None:
    """Tag ``run_ids`` with ``dvc.dep.*`` / ``dvc.out.*`` and the model versions they registered with their model
    folder's ``dvc.out.models/...``. ``client``: an ``mlflow.MlflowClient``."""
    tags = {**{f"dvc.dep.{p}": md5 for p, md5 in deps.items()}, **{f"dvc.out.{p}": md5 for p, md5 in outs.items()}}
    models = {f"dvc.out.{p}": md5 for p, md5 in outs.items() if p.startswith("models/")}
    for run_id in run_ids:
        for key, md5 in tags.items():
            client.set_tag(run_id, key, md5)
        if not models:
            continue
        for version in client.search_model_versions(f"run_id = '{run_id}'"):
            for key, md5 in models.items():
                client.set_model_version_tag(version.name, version.version, key, md5)


def dvc_hashes(root: Path, stage: str) -> tuple[dict[str, str], dict[str, str]]:
    """DVC's hashes of ``stage``'s (an address such as ``train_fr@real``) deps and outs in ``root`` as they are now
    → ``({path: md5}, {path: md5})``; params are not hashed (the run logs them as params), nor are outputs not
    written yet."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    def md5s(items: Iterable) -> dict[str, str]:
        out = {}
        for item in items:
            if isinstance(item, ParamsDependency) or not item.exists:  # an out the stage writes after its run
                continue
            value = item.get_hash()
            if value and value.value:
                out[str(item.def_path)] = str(value.value)
        return out

    with Repo(str(root)) as repo:
        (found,) = repo.stage.collect(stage)
        return md5s(found.deps), md5s(found.outs)


def tag_from_dvc(root: Path, run_id: str) -> None:
    """When DVC runs this stage (``DVC_STAGE`` set), tag ``run_id`` with DVC's hashes (``dvc_hashes``). A failure
    is a warning: the run's metrics and model stand without the tags."""
    stage = os.environ.get("DVC_STAGE")
    if not stage:
        return
    from mlflow import MlflowClient

    try:
        deps, outs = dvc_hashes(root, stage)
        tag_runs(MlflowClient(), [run_id], deps, outs)
    except Exception as exc:  # noqa: BLE001 - lineage is an annotation; the stage's work is done
        log.warning("could not tag run %s with DVC's hashes of stage %s: %s", run_id, stage, exc)


def experiment_parent(experiment_id: str, tags: Mapping[str, str]) -> str | None:
    """Inside ``dvc exp run`` (``DVC_EXP_NAME`` set): the id of the run its stages nest under, ``dvc exp <name>``
    (created by the first stage, with ``tags`` and the experiment's name and baseline commit; closed at once, as a
    folder for its stages). None outside a DVC experiment. Call it holding the store's lock
    (``ops.run_store.store_creation_lock``), so that two stages never create two parents."""
    name = os.environ.get("DVC_EXP_NAME")
    if not name:
        return None
    from mlflow import MlflowClient

    baseline = os.environ.get("DVC_EXP_BASELINE_REV", "")
    client = MlflowClient()
    quoted = name.replace("'", "''")
    query = f"tags.`faceops.kind` = '{KIND}' AND tags.`dvc.exp_name` = '{quoted}'"
    if baseline:
        query += f" AND tags.`dvc.exp_baseline_rev` = '{baseline}'"
    found = client.search_runs([experiment_id], filter_string=query, max_results=1)
    if found:
        return found[0].info.run_id
    run = client.create_run(experiment_id, run_name=f"dvc exp {name}", tags={
        **tags, "faceops.kind": KIND, "dvc.exp_name": name, "dvc.exp_baseline_rev": baseline})
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def flat_items(tree: Any, sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """Key path (keys joined with ``sep``) → value of every leaf of a nested mapping (lists are leaves; empty mappings
    have none)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_items(value, sep, f"{prefix}{sep}{key}" if prefix else str(key)))
    return out


def stage_metrics(root: Path, metrics_files: Sequence[str]) -> dict[str, float]:
    """The numbers in a stage's DVC ``metrics_files`` (``metrics/train_fr_real.json``; a file holding a ``metrics``
    mapping beside its settings contributes that mapping), nested keys joined with ``/``. An unreadable file is a
    DataError naming it."""
    metrics: dict[str, float] = {}
    for rel in metrics_files:
        path = root / rel
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise DataError(f"its metrics file {path} cannot be read ({exc})") from exc
        if isinstance(doc, dict) and isinstance(doc.get("metrics"), dict):
            doc = doc["metrics"]
        flat = flat_items(doc if isinstance(doc, dict) else {}, "/")
        metrics.update({k: float(v) for k, v in flat.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return metrics


def unique_summary(root: Path, stages: Sequence[str] | None = None, only: str | None = None) -> dict[str, float]:
    """What a parent run shows of ``stages`` (DVC addresses; default every stage of ``root``'s pipeline): each key of
    their DVC metrics files that exactly one of them writes (``test/nme``, ``sets/caface/rank1``), restricted to
    stage ``only``'s keys when given. A key several stages write (``train/loss``, the FR arms' ``val/accuracy``)
    stays on the stage runs: on the parent it would be ambiguous. Metrics files not written yet add nothing."""
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(root)) as repo:
        # train_fr@real: foreach stages come expanded; a `.dvc` file (an imported model) is a stage without a name
        by_name = {s.name: s for s in repo.index.stages if isinstance(s, PipelineStage)}
        names = list(stages) if stages is not None else list(by_name)
        files = {s: [str(o.def_path) for o in by_name[s].outs if o.is_metric] for s in names}
    owners: dict[str, list[str]] = {}
    values: dict[str, float] = {}
    for stage, paths in files.items():
        for key, value in stage_metrics(root, [p for p in paths if (root / p).is_file()]).items():
            owners.setdefault(key, []).append(stage)
            values[key] = value
    unique = {k: v for k, v in values.items() if len(owners[k]) == 1}
    return unique if only is None else {k: v for k, v in unique.items() if owners[k] == [only]}

