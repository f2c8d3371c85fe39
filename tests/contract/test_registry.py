"""The stage registry (``tasks.STAGES``) agrees with everything else that names stages: ``dvc.yaml``, ``params.yaml``,
the stage modules, the flows' routing and areas, and promotion. Adding a stage touches ``dvc.yaml``, ``params.yaml``,
its module in ``tasks/`` and one ``Stage`` entry; this test names whichever of them was forgotten."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

import tasks
from ml.config import from_mapping
from tasks.params import section_class

ROOT = Path(__file__).resolve().parents[2]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())


def _dvc_params(name: str) -> list[str]:
    body = DVC[name].get("do", DVC[name])
    return [p if isinstance(p, str) else next(iter(p)) for p in body.get("params", [])]


def test_dvc_yaml_and_the_registry_name_the_same_stages():
    assert set(DVC) == set(tasks.STAGES), (f"in dvc.yaml only: {set(DVC) - set(tasks.STAGES)}; "
                                            f"in tasks.STAGES only: {set(tasks.STAGES) - set(DVC)}")


@pytest.mark.parametrize("name", list(tasks.STAGES))
def test_each_stage_has_its_module_section_and_config(name):
    stage = tasks.STAGES[name]
    module = importlib.import_module(stage.module)
    assert callable(getattr(module, "main", None)), f"{stage.module} has no main()"
    body = DVC[name].get("do", DVC[name])
    assert f"python -m {stage.module}" in body["cmd"], f"dvc.yaml's cmd for {name} does not run {stage.module}"
    assert {"pipeline.jobs", "pipeline.exclusive"} <= set(_dvc_params(name)), f"{name}: its thread count's params"
    if stage.section is not None:
        assert stage.section in PARAMS, f"params.yaml has no section {stage.section!r} for {name}"
        assert stage.section in _dvc_params(name), f"dvc.yaml's {name} does not depend on params {stage.section}"
        from_mapping(section_class(stage.section), PARAMS[stage.section], stage.section)


def test_every_params_section_is_read_by_a_dataclass():
    assert set(PARAMS) == set(tasks.PARAM_SECTIONS), (f"params.yaml only: {set(PARAMS) - set(tasks.PARAM_SECTIONS)}; "
                                                      f"registry only: {set(tasks.PARAM_SECTIONS) - set(PARAMS)}")


def test_routing_areas_and_promotion_read_the_registry():
    from flows.areas import AREAS
    from flows.routing import GPU_STAGES
    from ops.promote.registry import MODELS, STAGES

    assert GPU_STAGES == {n for n, s in tasks.STAGES.items() if s.gpu}
    assert {n for names in AREAS.values() for n in names} == {n for n, s in tasks.STAGES.items() if s.areas}
    models = {s.section: s.model for s in tasks.STAGES.values() if s.model}
    assert MODELS == models and set(models) <= set(PARAMS["promote"]), "every registered model needs a promote gate"
    for key, stage in STAGES.items():
        assert stage.partition("@")[0] in DVC, (key, stage)
