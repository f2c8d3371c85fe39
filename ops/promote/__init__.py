"""Model-registry promotion: judge a registered model's ``@candidate`` against its ``@champion`` on a declared gate.

Each registered model has a gate in params ``promote`` (``PromoteConfig``, one ``Gate`` per model): the benchmarks
to run (``ops.promote.bench.BENCHMARKS``, each declaring its metrics and their direction), a primary metric that must
improve by ``min_improvement``, guards that may not regress beyond their tolerance, and absolute floors; a first
candidate needs the floors only (``ops.promote.decision.decide``). ``record`` logs a ``promote`` MLflow run and tags
the candidate with the decision; a promotion moves ``@previous`` to the old champion and ``@champion`` to the
candidate; ``rollback`` undoes exactly one promotion. Registry writes come last, inside ``RegistryChange``
(``ops.promote.registry``): each step records its undo first, a failure undoes the steps before it, and aliases
moved meanwhile by another promotion stop the write. ``flows/promote.py`` composes these steps with retries.
Importing this package is light (no torch, no MLflow): ``tasks.params`` reads ``PromoteConfig`` from here.
See ``docs/operations/promotion.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ops.promote.bench import BENCHMARKS, BenchContext
from ops.promote.decision import Decision, Gate, decide, unchanged, utc_now
from ops.promote.registry import (CANDIDATE, CHAMPION, MODELS, PREVIOUS, PromotionError, RegistryChange, RegistryState,
                                  RegistryUnreachable, check_tracking, client_for, connect, download_version,
                                  find_model_dir, is_transient, model_key, registry_state, require_candidate)
from ops.tracking import git_commit, mlflow_metric_name
from ops.run_store import configure
from tasks.common import Paths, load_params, section

# the promotion API in one place: flows/promote.py and the tests use ``p.<name>``
__all__ = ["BENCHMARKS", "CANDIDATE", "MODELS", "BenchContext", "Decision", "Gate", "PromoteConfig", "PromotionError",
           "RegistryState", "RegistryUnreachable", "Rollback", "bench_context", "check_gate", "check_tracking",
           "client_for", "connect", "decide", "download_version", "find_model_dir", "is_transient", "load_config",
           "model_key", "needs_fr", "plan_rollback", "produced_metrics", "record", "registry_state",
           "require_candidate", "rollback", "run_benchmarks", "unchanged"]

log = logging.getLogger(__name__)


# ───────────────────────────────────────────────────────────────────────────── config


def _gate(benchmarks: tuple[str, ...], primary: str, min_improvement: float, guards: dict, floors: dict) -> Any:
    return field(default_factory=lambda: Gate(benchmarks, primary, min_improvement, dict(guards), dict(floors)))


@dataclass(frozen=True)
class PromoteConfig:
    """``params.yaml`` section ``promote``: retries of the MLflow I/O, the generation benchmark's sample size, and one
    ``Gate`` per registered model (``fr``, ``fusion``, ``aligner``, ``generator``, ``discovery``)."""

    retries: int = 3                    # attempts after the first when the tracking server does not answer
    retry_delay_s: float = 2.0          # first retry delay; doubles with each retry
    generator_identities: int = 8
    generator_images_per_identity: int = 4
    generator_steps: int = 10
    seed: int = 0
    fr: Gate = _gate(("recognition",), "verification/mean_accuracy", 0.002,
                     {"templates/tar@far=1e-2": 0.02, "identification/rank1": 0.02},
                     {"verification/mean_accuracy": 0.6})
    fusion: Gate = _gate(("fusion",), "sets/templates/caface/tar@far=1e-2", 0.002,
                         {"sets/templates/caface/tar@far=1e-3": 0.03}, {"sets/templates/caface/tar@far=1e-2": 0.1})
    aligner: Gate = _gate(("alignment",), "test/nme", 0.001, {"test/failure@0.1": 0.02}, {"test/nme": 0.1})
    generator: Gate = _gate(("generation",), "synthetic/identity_consistency", 0.005,
                            {"synthetic/inter_class_mean_cos": 0.05}, {"synthetic/context_cosine": 0.0})
    discovery: Gate = _gate(("discovery",), "discovery/facegcd/test/all", 0.005,
                            {"discovery/facegcd/test/known": 0.03}, {"discovery/facegcd/test/all": 0.1})

    def __post_init__(self) -> None:
        for key, low in (("retries", 0), ("generator_identities", 2), ("generator_images_per_identity", 2),
                         ("generator_steps", 1), ("seed", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"params key 'promote.{key}' = {value!r}: need an integer ≥ {low}.")
        if self.retries > 20:
            raise ConfigError(f"params key 'promote.retries' = {self.retries}: at most 20.")
        if not 0.0 <= self.retry_delay_s <= 600.0:
            raise ConfigError(f"params key 'promote.retry_delay_s' = {self.retry_delay_s!r}: need seconds in [0, 600].")
        for key in MODELS:
            _check_gate_shape(key, getattr(self, key))

    def gate(self, key: str) -> Gate:
        return getattr(self, key)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_gate_shape(key: str, gate: Gate) -> None:
    """Types and ranges of one gate, and that its benchmarks exist and measure this model (metric names are checked
    by ``check_gate``, which needs the prepared data)."""
    prefix = f"promote.{key}"
    mine = sorted(n for n, b in BENCHMARKS.items() if b.model == key)
    if not gate.benchmarks:
        raise ConfigError(f"params key '{prefix}.benchmarks' is empty: name at least one of {', '.join(mine)}.")
    for name in gate.benchmarks:
        if name not in BENCHMARKS:
            raise ConfigError(f"params key '{prefix}.benchmarks': unknown benchmark {name!r}. Benchmarks for "
                              f"{MODELS[key]}: {', '.join(mine)}.")
        if BENCHMARKS[name].model != key:
            raise ConfigError(f"params key '{prefix}.benchmarks': {name!r} measures {MODELS[BENCHMARKS[name].model]}, "
                              f"not {MODELS[key]}. Benchmarks for {MODELS[key]}: {', '.join(mine)}.")
    if not gate.primary:
        raise ConfigError(f"params key '{prefix}.primary' is empty: name the metric that must improve.")
    if not gate.min_improvement >= 0:
        raise ConfigError(f"params key '{prefix}.min_improvement' = {gate.min_improvement!r}: need a margin ≥ 0.")
    for metric, tolerance in gate.guards.items():
        if not _number(tolerance) or tolerance < 0:
            raise ConfigError(f"params key '{prefix}.guards.{metric}' = {tolerance!r}: need a tolerance ≥ 0.")
    for metric, bound in gate.floors.items():
        if not _number(bound):
            raise ConfigError(f"params key '{prefix}.floors.{metric}' = {bound!r}: need a number.")


def load_config(root: Path) -> PromoteConfig:
    """The ``promote`` section of ``root/params.yaml``."""
    return from_mapping(PromoteConfig, section(load_params(Paths(root).params), "promote"), "promote")


def bench_context(root: Path, cfg: PromoteConfig | None = None) -> BenchContext:
    """Everything benchmarks read from ``root``: ``data/prepared`` and the params sections of the stages whose
    evaluation they reuse (``data``, ``evaluate``, ``synthesize``, ``generator``)."""
    from tasks.evaluate import EvaluateConfig
    from tasks.prepare import DataConfig
    from tasks.synthesize import SynthesizeConfig
    from tasks.train_generator import GeneratorStageConfig

    paths = Paths(Path(root))
    params = load_params(paths.params)
    return BenchContext(
        paths=paths,
        promote=cfg or from_mapping(PromoteConfig, section(params, "promote"), "promote"),
        data=from_mapping(DataConfig, section(params, "data"), "data"),
        evaluate=from_mapping(EvaluateConfig, section(params, "evaluate"), "evaluate"),
        synthesize=from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize"),
        generator=from_mapping(GeneratorStageConfig, section(params, "generator"), "generator"),
    )


def produced_metrics(key: str, ctx: BenchContext) -> dict[str, bool]:
    """metric → higher is better, for every metric the gate's benchmarks produce (in benchmark order)."""
    out: dict[str, bool] = {}
    for name in ctx.promote.gate(key).benchmarks:
        out.update(BENCHMARKS[name].metrics(ctx))
    return out


def check_gate(key: str, ctx: BenchContext) -> dict[str, bool]:
    """Every metric the gate names (primary, guards, floors) is produced by its benchmarks, or ConfigError naming
    the params key and listing what they produce. Returns ``produced_metrics``. Reads nothing but params and file
    names, so it runs before the registry is touched."""
    gate = ctx.promote.gate(key)
    produced = produced_metrics(key, ctx)
    named = [("primary", gate.primary)] + [("guards", m) for m in gate.guards] + [("floors", m) for m in gate.floors]
    for where, metric in named:
        if metric not in produced:
            raise ConfigError(
                f"params key 'promote.{key}.{where}' names metric {metric!r}, which the gate's benchmarks "
                f"({', '.join(gate.benchmarks)}) do not produce. They produce: {', '.join(produced)}."
            )
    return produced


def needs_fr(key: str, cfg: PromoteConfig) -> bool:
    """Whether the gate's benchmarks embed faces with ``faceops-fr@champion``."""
    return any(BENCHMARKS[name].needs_fr for name in cfg.gate(key).benchmarks)


def run_benchmarks(key: str, model_dir: Path | str, ctx: BenchContext) -> dict[str, float]:
    """Run the gate's benchmarks on one model directory → the declared metrics (a declared metric that a benchmark
    did not produce is a DataError naming both)."""
    out: dict[str, float] = {}
    for name in ctx.promote.gate(key).benchmarks:
        bench = BENCHMARKS[name]
        declared = bench.metrics(ctx)
        values = bench.run(Path(model_dir), ctx)
        missing = [m for m in declared if m not in values]
        if missing:
            raise DataError(f"benchmark {name!r} did not produce {', '.join(missing)} for {model_dir} (it produced "
                            f"{', '.join(sorted(values)) or 'nothing'}); check data/prepared and the model.")
        out.update({m: float(values[m]) for m in declared})
    return out


# ───────────────────────────────────────────────────────────────────────────── record


def _start_record_run(client: Any, root: Path, name: str, tags: Mapping[str, str], flow_run_id: str | None) -> str:
    experiment_id = configure(Path(root))
    all_tags = {"faceops.stage": "promote", "git.commit": git_commit(Path(root)), **tags}
    if flow_run_id:
        all_tags["prefect.flow_run_id"] = str(flow_run_id)
    return client.create_run(experiment_id, run_name=f"promote {name}", tags=all_tags).info.run_id


@contextlib.contextmanager
def _record_run(client: Any, run_id: str):
    """End the run FINISHED, or FAILED with tag ``promotion.error`` when the body raises."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(Exception):
            client.set_tag(run_id, "promotion.error", f"{type(exc).__name__}: {exc}"[:4000])
            client.log_text(run_id, f"The registry was left as it was: {type(exc).__name__}: {exc}\n",
                            "promotion/NOT_APPLIED.txt")
            client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")


def record(decision: Decision, state: RegistryState, *, root: Path, client: Any = None,
           flow_run_id: str | None = None) -> Decision:
    """Write ``decision`` (see the module docstring): the MLflow run first, then tags and alias moves as one
    ``RegistryChange``, after checking the aliases did not move since ``state`` was read. → the decision with its
    ``run_id``."""
    from mlflow.entities import Metric

    client = client or client_for(root)
    run_id = _start_record_run(client, root, decision.model, {
        "faceops.promote.model": decision.model, "faceops.promote.candidate": decision.candidate,
        "faceops.promote.champion": decision.champion or "none", "faceops.promote.decision": decision.outcome,
    }, flow_run_id)
    decision = dataclasses.replace(decision, run_id=run_id)
    with _record_run(client, run_id):
        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_metric_name(f"{who}/{k}"), float(v), now_ms, 0)
                   for who, values in decision.metrics.items() for k, v in values.items() if math.isfinite(v)]
        for start in range(0, len(metrics), 500):
            client.log_batch(run_id, metrics=metrics[start:start + 500])
        client.log_text(run_id, decision.markdown(), "promotion/decision.md")
        client.log_text(run_id, json.dumps(decision.summary(), indent=2, sort_keys=True) + "\n",
                        "promotion/decision.json")
        now = registry_state(client, state.name, state.candidate_alias)
        watched = (state.candidate_alias, CHAMPION, PREVIOUS)
        before, after = ({a: s.aliases.get(a) for a in watched} for s in (state, now))
        if before != after:
            raise PromotionError(f"{state.name}'s aliases changed while the candidate was evaluated ({before} → "
                                 f"{after}); nothing was written to the registry. Run the promotion again.")
        with RegistryChange(client, state.name, now.aliases) as change:
            change.set_version_tags(decision.candidate, decision.version_tags())
            if decision.promoted:
                if decision.champion:
                    change.set_alias(PREVIOUS, decision.champion)
                change.set_alias(CHAMPION, decision.candidate)
    log.info("%s (MLflow run %s)", decision.headline(), run_id)
    return decision


# ───────────────────────────────────────────────────────────────────────────── rollback


@dataclass(frozen=True)
class Rollback:
    """What a rollback changes: ``@champion`` v``demoted`` → v``restored``; ``dropped`` aliases leave ``demoted``."""

    model: str
    demoted: str
    restored: str
    dropped: tuple[str, ...]
    time: str
    run_id: str | None = None
    dry_run: bool = False

    def headline(self) -> str:
        text = (f"ROLLED BACK: {self.model} @champion v{self.demoted} → v{self.restored}; @previous cleared"
                + (f"; v{self.demoted} also lost @{', @'.join(self.dropped)}" if self.dropped else ""))
        return f"DRY RUN, nothing written — would be {text}" if self.dry_run else text

    def markdown(self) -> str:
        return (f"### {self.headline()}\n\n{self.time}" + (f" · MLflow run `{self.run_id}`" if self.run_id else "")
                + f"\n\nv{self.demoted} is tagged `promotion.rolled_back_at` / `promotion.rolled_back_to`. A second "
                "rollback is refused until the next promotion sets @previous again.\n")

    def summary(self) -> dict[str, Any]:
        return {"model": self.model, "decision": "rolled_back", "demoted": self.demoted, "restored": self.restored,
                "dropped_aliases": list(self.dropped), "time": self.time, "run_id": self.run_id}


def plan_rollback(state: RegistryState, *, dry_run: bool = False) -> Rollback:
    """What ``rollback`` would do from ``state``; PromotionError when there is nothing to roll back to."""
    if state.champion is None:
        raise PromotionError(f"{state.name} has no @champion: there is nothing to roll back.")
    if state.previous is None or state.previous == state.champion:
        raise PromotionError(
            f"{state.name} has no @previous version to roll back to (@champion is v{state.champion}). A rollback "
            "undoes one promotion and clears @previous, so it cannot be repeated; to go back further, set the alias "
            f"by hand: MlflowClient().set_registered_model_alias('{state.name}', 'champion', VERSION)."
        )
    dropped = tuple(sorted(a for a, v in state.aliases.items() if v == state.champion and a.startswith(CANDIDATE)))
    return Rollback(state.name, state.champion, state.previous, dropped, utc_now(), dry_run=dry_run)


def rollback(name: str, *, root: Path, client: Any = None, flow_run_id: str | None = None,
             dry_run: bool = False) -> Rollback:
    """``@champion`` back to ``@previous`` (see the module docstring), recorded as a ``promote`` MLflow run."""
    client = client or client_for(root)
    state = registry_state(client, name)
    plan = plan_rollback(state, dry_run=dry_run)
    if dry_run:
        return plan
    run_id = _start_record_run(client, root, name, {
        "faceops.promote.model": name, "faceops.promote.decision": "rolled_back",
        "faceops.promote.demoted": plan.demoted, "faceops.promote.restored": plan.restored}, flow_run_id)
    plan = dataclasses.replace(plan, run_id=run_id)
    with _record_run(client, run_id):
        client.log_text(run_id, plan.markdown(), "promotion/rollback.md")
        client.log_text(run_id, json.dumps(plan.summary(), indent=2) + "\n", "promotion/rollback.json")
        with RegistryChange(client, name, state.aliases) as change:
            change.set_version_tags(plan.demoted, {"promotion.rolled_back_at": plan.time,
                                                   "promotion.rolled_back_to": plan.restored,
                                                   "promotion.rollback_run_id": run_id})
            change.set_alias(CHAMPION, plan.restored)
            change.delete_alias(PREVIOUS)
            for alias in plan.dropped:
                change.delete_alias(alias)
    log.info("%s (MLflow run %s)", plan.headline(), run_id)
    return plan
