"""One module (or package) per pipeline stage: ``run(cfg, paths) -> StageResult`` plus a small ``main()``; beside them
only what stages share (``common``, ``params``, ``pipeline``). Operations around the pipeline (promotion, sweeps,
the tracking relay, storage) live in ``ops/``.

``STAGES`` is the registry of stages: its module, the ``params.yaml`` section it owns and the dataclass that reads
it, whether it goes to the ``gpu`` work pool, the per-area Prefect flows that run it, and the MLflow registered
model it makes. The flows, the command line and promotion read it; adding a stage means its ``dvc.yaml`` entry, its
``params.yaml`` section, its module here and one ``Stage`` below (``tests/contract/test_registry.py`` checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One ``dvc.yaml`` stage (a ``foreach`` stage by its base name, ``train_fr`` for ``train_fr@real``)."""

    module: str  # its main() is the stage's command: `python -m <module>`
    section: str | None = None  # the params.yaml section it owns
    config: str | None = None  # "module:Class": the frozen dataclass that reads that section
    gpu: bool = False  # sent to the `gpu` work pool when one is configured (flows/routing.py)
    areas: tuple[str, ...] = ()  # per-area Prefect flows that run it (flows/areas.py)
    model: str | None = None  # the MLflow registered model its new versions go to (@candidate)
    model_stage: str | None = None  # the DVC stage that makes the promoted version, when not the stage itself


STAGES: dict[str, Stage] = {
    "prepare": Stage("tasks.prepare", "data", "tasks.prepare:DataConfig"),
    "validate": Stage("tasks.validate", "validate", "tasks.validate:ValidateConfig"),
    "train_fr": Stage("tasks.train_fr", "fr", "ml.fr.config:FRConfig", gpu=True, areas=("train",),
                      model="faceops-fr", model_stage="train_fr@real"),
    "train_aligner": Stage("tasks.train_aligner", "aligner", "tasks.train_aligner:AlignerStageConfig", gpu=True,
                           areas=("train",), model="faceops-aligner"),
    "align": Stage("tasks.align"),
    "train_discovery": Stage("tasks.train_discovery", "discovery", "ml.discovery.train:DiscoveryConfig", gpu=True,
                             areas=("train",), model="faceops-discovery"),
    "train_fusion": Stage("tasks.train_fusion", "fusion", "tasks.train_fusion:FusionStageConfig", gpu=True,
                          areas=("train",), model="faceops-fusion"),
    "train_generator": Stage("tasks.train_generator", "generator", "tasks.train_generator:GeneratorStageConfig",
                             gpu=True, areas=("train", "synthesize"), model="faceops-generator"),
    "synthesize": Stage("tasks.synthesize", "synthesize", "tasks.synthesize:SynthesizeConfig", gpu=True,
                        areas=("synthesize",)),
    "evaluate": Stage("tasks.evaluate", "evaluate", "tasks.evaluate:EvaluateConfig", areas=("evaluate",)),
}

# params.yaml sections that no stage owns: the schedule, and the operations around the pipeline
OTHER_SECTIONS: dict[str, str] = {
    "pipeline": "tasks.pipeline:PipelineConfig",
    "sweep": "ops.sweep:SweepConfig",
    "promote": "ops.promote:PromoteConfig",
    "storage": "ops.remote:StorageConfig",
}

# every params.yaml section → the frozen dataclass that reads it ("module:Class"), so a delta is checked up front
PARAM_SECTIONS: dict[str, str] = {
    **{s.section: s.config for s in STAGES.values() if s.section and s.config}, **OTHER_SECTIONS,
}


def registered_model(stage: str) -> str:
    """The MLflow registered model ``stage`` (a base name) makes new versions of."""
    model = STAGES[stage].model
    if model is None:
        raise KeyError(f"stage {stage!r} registers no model")
    return model
