"""One module per pipeline stage: ``run(cfg, paths) -> StageResult`` plus a tiny ``main()``; beside them only what
stages share (``common``, ``params``, the evaluations ``evaluate`` draws on). The operations services around the
pipeline (promotion, sweeps, the tracking relay, storage) live in ``ops/``.

``STAGES`` maps each DVC stage to its module; ``PARAM_SECTIONS`` maps each ``params.yaml`` section to the
frozen dataclass that reads it (``module:Class``, ``ops`` included), so a params delta is checked before anything runs.
"""

STAGES: dict[str, str] = {
    "prepare": "tasks.prepare",
    "validate": "tasks.validate",
    "train_fr": "tasks.train_fr",
    "train_aligner": "tasks.train_aligner",
    "align": "tasks.align",
    "train_discovery": "tasks.train_discovery",
    "train_fusion": "tasks.train_fusion",
    "train_generator": "tasks.train_generator",
    "synthesize": "tasks.synthesize",
    "evaluate": "tasks.evaluate",
}

PARAM_SECTIONS: dict[str, str] = {
    "data": "tasks.prepare:DataConfig",
    "validate": "tasks.validate:ValidateConfig",
    "fr": "ml.fr.config:FRConfig",
    "aligner": "tasks.train_aligner:AlignerStageConfig",
    "discovery": "ml.discovery.train:DiscoveryConfig",
    "fusion": "tasks.train_fusion:FusionStageConfig",
    "generator": "tasks.train_generator:GeneratorStageConfig",
    "synthesize": "tasks.synthesize:SynthesizeConfig",
    "pipeline": "tasks.pipeline:PipelineConfig",
    "evaluate": "tasks.evaluate:EvaluateConfig",
    "sweep": "ops.sweep:SweepConfig",
    "promote": "ops.promote:PromoteConfig",
    "storage": "ops.storage:StorageConfig",
}
