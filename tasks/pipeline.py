"""``params.yaml`` section ``pipeline``: which ``train_fr@<source>`` stages the DAG declares, how many stages run at
once, and on how many threads each stage computes.

A stage's thread count is fixed when it starts, from these params and the cores this process may use, never from
what else is running: on the CPU the bits of a float reduction follow the thread count, so a count that followed
the stages beside it would make two runs of one commit differ. A stage in ``exclusive`` runs alone on every core
(the flow waits until nothing else runs); the others run up to ``jobs`` at once on ``cores // jobs`` threads each.
``dvc repro``, one stage at a time, uses the same counts, so it reproduces the flow's bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ml.errors import ConfigError

SOURCE_DEPS = {"real": "data/prepared/train", "synthetic": "data/synthetic", "mixed": "data/synthetic",
               "real_matched": "data/synthetic"}  # real_matched reads the synthetic set's size only
EXCLUSIVE = ("prepare", "validate", "train_fr@real", "synthesize", "train_fr@synthetic", "train_fr@real_matched",
             "evaluate")


@dataclass(frozen=True)
class PipelineConfig:
    """``params.yaml`` section ``pipeline``. ``fr_sources`` maps each ``train_fr@<source>`` stage ``dvc.yaml``
    declares (a ``foreach`` over it) to the dataset DVC tracks for it besides the real training set; ``jobs`` is
    how many stages run at once where the DAG allows; ``exclusive`` lists the stages that run alone on all cores."""

    fr_sources: dict[str, str] = field(
        default_factory=lambda: {k: SOURCE_DEPS[k] for k in ("real", "synthetic", "real_matched")})
    jobs: int = 2
    exclusive: tuple[str, ...] = EXCLUSIVE

    def __post_init__(self) -> None:
        if "real" not in self.fr_sources:
            raise ConfigError("pipeline.fr_sources must keep `real` (the discovery, fusion and evaluate stages read it)")
        for source, dep in self.fr_sources.items():
            if source not in SOURCE_DEPS:
                raise ConfigError(f"pipeline.fr_sources.{source}: unknown training source; "
                                  f"available: {', '.join(SOURCE_DEPS)}")
            if dep != SOURCE_DEPS[source]:
                raise ConfigError(f"pipeline.fr_sources.{source} = {dep!r}: must be {SOURCE_DEPS[source]!r}, the "
                                  "dataset that source reads (DVC tracks it as the stage's dependency)")
        if isinstance(self.jobs, bool) or self.jobs < 1:
            raise ConfigError(f"pipeline.jobs = {self.jobs!r}: need an integer ≥ 1 (1 = one stage after another)")
        from tasks import STAGES

        for stage in self.exclusive:
            base, _, source = stage.partition("@")
            if base not in STAGES or (source and (base != "train_fr" or source not in SOURCE_DEPS)):
                raise ConfigError(f"pipeline.exclusive: {stage!r} is not a stage; stages: {', '.join(STAGES)} "
                                  f"(train_fr as train_fr@<source>, e.g. train_fr@synthetic)")


def stage_threads(stage: str, cfg: PipelineConfig, cores: int) -> int:
    """The torch threads ``stage`` computes on for its whole run, out of this machine's ``cores``: all of them when
    it runs alone (listed in ``exclusive``, or ``jobs`` is 1), else its even share ``cores // jobs`` (at least 1)."""
    if cfg.jobs == 1 or stage in cfg.exclusive:
        return max(1, cores)
    return max(1, cores // cfg.jobs)
