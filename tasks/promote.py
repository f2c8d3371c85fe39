"""Model-registry promotion: judge a registered model's ``@candidate`` against its ``@champion`` on a declared gate.

Each registered model (``faceops-fr``, ``-fusion``, ``-aligner``, ``-generator``, ``-discovery``) has a gate in
``params.yaml`` section ``promote`` (``PromoteConfig``, one ``Gate`` per model): the benchmarks to run (the explicit
registry ``BENCHMARKS``), a **primary** metric that must improve on the champion by at least ``min_improvement``,
**guard** metrics that may not regress by more than their tolerance, and absolute **floors** (a minimum, or a maximum
for lower-is-better metrics). Each benchmark declares the metrics it produces and their direction (↑ higher is better,
↓ lower is better), so a gate is checked completely before anything is downloaded, measured or written. Benchmarks
reuse the evaluation code of the stages (``tasks/evaluate.py``, ``sets_eval.py``, ``discovery_eval.py``, the aligner
and generator evaluations) on ``data/prepared``, so a gate measures what those stages report, under the same names.

The decision (``decide``):

- with a champion: promoted when the primary improves by ``min_improvement`` or more, every guard holds and every
  floor holds (comparisons to 1e-9, so a margin written as 0.01 is met by 0.81 − 0.80);
- without one (the first candidate): promoted when every floor holds; primary and guards are reported as n/a;
- a NaN number fails its rule; a candidate that already is the champion is left alone (``unchanged``).

Recording (``record``), for promoted and rejected candidates alike: a ``promote`` MLflow run with both models' numbers
as metrics (``candidate/...``, ``champion/...``) and ``promotion/decision.md`` + ``decision.json``; tags on the
candidate version: ``promotion.decision`` (promoted | rejected), ``promotion.summary`` (the JSON), ``promotion.time``
(UTC), ``promotion.champion`` (the version it was compared with, or ``none``) and ``promotion.run_id``. A promotion then
moves ``@previous`` to the old champion and ``@champion`` to the candidate; ``@candidate`` stays where the training
stage put it.

Rollback (``rollback``): ``@champion`` goes back to ``@previous``. The demoted version loses ``@champion`` and any
``candidate*`` alias that points at it (otherwise the next promotion would bring it straight back) and is tagged
``promotion.rolled_back_at`` / ``promotion.rolled_back_to``; ``@previous`` is cleared. So a rollback undoes exactly one
promotion, and a second rollback is refused until the next promotion sets ``@previous`` again.

Registry writes come last, after every check, inside ``RegistryChange``: each step records how to undo itself before
it runs, and when a step fails the steps before it are undone in reverse order, so an error never leaves the aliases
half moved or a decision tag without its aliases. Just before writing, the aliases are read again; if another
promotion moved them meanwhile, nothing is written. ``flows/promote.py`` composes these steps as a Prefect flow with
retries (exponential backoff) on the MLflow I/O; ``faceops promote`` runs that flow.

Importing this module is light (no torch, no MLflow): ``tasks.params`` imports it to check the ``promote`` section.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError, FaceopsError
from tasks.common import Paths, load_params, redact, section

log = logging.getLogger(__name__)

# params key → registered model name; and the stage that registers new versions of it
MODELS: dict[str, str] = {
    "fr": "faceops-fr", "fusion": "faceops-fusion", "aligner": "faceops-aligner",
    "generator": "faceops-generator", "discovery": "faceops-discovery",
}
STAGES: dict[str, str] = {
    "fr": "train_fr@real", "fusion": "train_fusion", "aligner": "train_aligner",
    "generator": "train_generator", "discovery": "train_discovery",
}
CANDIDATE, CHAMPION, PREVIOUS = "candidate", "champion", "previous"
EPS = 1e-9  # comparisons of measured numbers with thresholds written in params


class PromotionError(FaceopsError):
    """The registry is not in a state the operation can start from (no candidate, nothing to roll back to, aliases
    moved meanwhile), or a failed change could not be undone."""


class RegistryUnreachable(FaceopsError):
    """The MLflow tracking server did not answer; the message names the endpoint (password masked)."""


# ───────────────────────────────────────────────────────────────────────────── benchmarks


@dataclass(frozen=True)
class BenchContext:
    """What benchmarks read besides the model: the prepared data and the params sections of the stages whose
    evaluation they reuse, and for benchmarks that embed faces, the FR champion's model directory."""

    paths: Paths
    promote: "PromoteConfig"
    data: Any        # tasks.prepare.DataConfig
    evaluate: Any    # tasks.evaluate.EvaluateConfig
    synthesize: Any  # tasks.synthesize.SynthesizeConfig
    generator: Any   # tasks.train_generator.GeneratorStageConfig
    fr_dir: Path | None = None
    fr_model: str = ""  # "faceops-fr v2": where fr_dir came from, for the record


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: which registered model it measures, what it produces (metric → higher is better) and how.

    ``run(model_dir, ctx)`` → ``{metric: value}`` for a model directory (``model.safetensors`` + ``config.json``);
    ``metrics(ctx)`` declares the names without measuring anything (they may depend on the prepared data, e.g. one
    accuracy per verification ``.bin``). ``needs_fr``: the benchmark embeds faces with ``faceops-fr@champion``."""

    model: str
    run: Callable[[Path, BenchContext], dict[str, float]]
    metrics: Callable[[BenchContext], dict[str, bool]]
    needs_fr: bool = False
    about: str = ""


def _fmt_rate(rate: float) -> str:
    from tasks.evaluate import _fmt_far  # the metric-name format of the evaluate stage

    return _fmt_far(rate)


def _recognition_metrics(ctx: BenchContext) -> dict[str, bool]:
    e = ctx.evaluate
    names = [f"verification/{p.stem}/accuracy" for p in sorted(ctx.paths.verification_dir.glob("*.bin"))]
    if not names:
        raise DataError(f"no verification .bin in {ctx.paths.verification_dir}: run `dvc repro prepare` first.")
    names += ["verification/mean_accuracy"]
    names += [f"templates/tar@far={_fmt_rate(f)}" for f in e.fars]
    names += [f"identification/rank{r}" for r in e.ranks]
    names += [f"open_set/tpir@fpir={_fmt_rate(f)}" for f in e.fpirs]
    names += [f"distractors/rank{r}" for r in e.distractor_ranks]
    return dict.fromkeys(names, True)


def _recognition(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """The evaluate stage's numbers for one FR model (``tasks.evaluate.evaluate_model``), without its tag, plus the
    mean verification accuracy over every ``.bin``."""
    from ml.models.io import load_model
    from tasks.evaluate import _verification_sets, evaluate_model, verification_bins

    model, _ = load_model(model_dir)
    sets = _verification_sets(verification_bins(ctx.paths))
    raw, _ = evaluate_model(model, "m", ctx.evaluate, ctx.paths, sets)
    out = {k.removeprefix("m/"): float(v) for k, v in raw.items()}
    accuracies = [out[k] for k in (f"verification/{name}/accuracy" for name, *_ in sets) if k in out]
    if len(accuracies) == len(sets):
        out["verification/mean_accuracy"] = float(sum(accuracies) / len(accuracies))
    return out


def _alignment_metrics(ctx: BenchContext) -> dict[str, bool]:
    return {"test/nme": False, "test/failure@0.1": False, "test/auc@0.1": True}


def _alignment(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """NME / failure rate / AUC@0.1 on the unaligned test split (identities the aligner never saw), as the
    train_aligner stage reports them (``test/...``)."""
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.models.aligner.dfa import load_aligner
    from ml.train.aligner import evaluate_aligner

    model, _ = load_aligner(model_dir)
    manifest = read_manifest(ctx.paths.unaligned_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "test"].reset_index(drop=True)
    if rows.empty:
        raise DataError(f"{ctx.paths.unaligned_set / 'manifest.parquet'} has no 'test' rows: rerun "
                        "`dvc repro prepare`.")
    res = evaluate_aligner(model, load_images(ctx.paths.unaligned_set, rows), landmarks_array(rows))
    return {"test/nme": res["nme"], "test/failure@0.1": res["failure@0.1"], "test/auc@0.1": res["auc@0.1"]}


def _discovery_metrics(ctx: BenchContext) -> dict[str, bool]:
    names = [f"discovery/facegcd/{s}/{k}" for s in ("test", "transductive") for k in ("all", "known", "novel")]
    return dict.fromkeys(names + ["discovery/facegcd/nnc"], True)


def _discovery(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """FaceGCD + semi-supervised k-means on the GFD split: clustering accuracy All / Known / Novel on the test subset
    and transductively, and NNC (the evaluate stage's ``discovery/facegcd/...``)."""
    from ml.models.discovery.facegcd import load_facegcd
    from tasks.discovery_eval import facegcd_ssk, gfd_inputs

    model, _ = load_facegcd(model_dir)
    _, outcome = facegcd_ssk(model, gfd_inputs(ctx.paths, ctx.data), ctx.evaluate, ctx.data)
    return {f"discovery/facegcd/{k}": float(v) for k, v in outcome.metrics.items()}


def _fusion_metrics(ctx: BenchContext) -> dict[str, bool]:
    from tasks.sets_eval import FARS

    return {f"sets/templates/{m}/tar@far={_fmt_rate(f)}": True for m in ("caface", "average") for f in FARS}


def _fusion(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """IJB-B/C-style template TAR@FAR with CAFace over the FR champion's features and styles, beside plain averaging
    of the same features (the evaluate stage's ``sets/templates/...``)."""
    from ml.models.fusion.caface import load_caface
    from ml.models.io import load_model
    from tasks.sets_eval import template_fusion

    fr, fr_config = load_model(_fr_dir(ctx, "fusion"))
    caface = load_caface(model_dir)
    contract = fr_config["input_contract"]
    if (caface.feature_dim, caface.style_dim) != (contract.get("embedding_dim"), contract.get("style_dim")):
        raise DataError(f"the CAFace model (features {caface.feature_dim}, styles {caface.style_dim}) does not fit "
                        f"{ctx.fr_model} (features {contract.get('embedding_dim')}, styles "
                        f"{contract.get('style_dim')}): "
                        "retrain fusion on the FR champion (`dvc repro train_fusion`).")
    metrics = template_fusion(fr, caface, ctx.paths, ctx.data, ctx.evaluate.batch_size, ["caface", "average"],
                              ctx.evaluate.fusion_chunk_size)
    return {f"sets/templates/{k}": float(v) for k, v in metrics.items() if "/tar@far=" in k}


def _generation_metrics(ctx: BenchContext) -> dict[str, bool]:
    return {"synthetic/identity_consistency": True, "synthetic/diversity": True, "synthetic/context_cosine": True,
            "synthetic/inter_class_mean_cos": False, "synthetic/inter_class_max_cos": False}


def _generation(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """A small sample under the FR champion: ``promote.generator_identities`` identity contexts (the FR champion's
    embeddings of one held-out gallery face per identity, the same for every generator judged), and
    ``generator_images_per_identity`` faces each with the ``synthesize`` sampler at ``generator_steps`` DDIM steps.
    Reports the synthesize stage's identity consistency, diversity and inter-class cosines, and ``context_cosine``:
    the mean cosine between a face's embedding and the context it was generated from."""
    import numpy as np

    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.eval.diversity import diversity_report
    from ml.models.generator.uiface import load_generator
    from ml.models.io import load_model, read_model_config
    from ml.train.fr import needs_keypoints
    from tasks.synthesize import generate, sampler_for
    from tasks.train_generator import generator_autoencoder, identity_embeddings

    cfg = ctx.promote
    fr, _ = load_model(_fr_dir(ctx, "generator"))
    if needs_keypoints(fr):
        raise DataError(f"{ctx.fr_model} is a KP-RPE model: it needs landmarks, which generated faces do not have; "
                        "judge generators under a plain FR champion.")
    model, model_cfg = load_generator(model_dir)
    extra = read_model_config(model_dir, what="UIFace generator").get("extra", {})
    autoencoder = generator_autoencoder(ctx.paths, extra, ctx.generator, model_dir)
    manifest = read_manifest(ctx.paths.heldout_set / "manifest.parquet")
    rows = manifest[manifest["split"] == "gallery"].drop_duplicates("identity").head(cfg.generator_identities)
    rows = rows.reset_index(drop=True)
    if len(rows) < 2:
        raise DataError(f"{ctx.paths.heldout_set}: the generation benchmark needs ≥ 2 held-out identities, found "
                        f"{len(rows)}.")
    contexts = identity_embeddings(fr, load_images(ctx.paths.heldout_set, rows), landmarks_array(rows))
    if contexts.shape[1] != model_cfg.id_dim:
        raise DataError(f"the generator takes {model_cfg.id_dim}-d identity contexts but {ctx.fr_model} embeds "
                        f"{contexts.shape[1]}-d: retrain the generator on the FR champion "
                        "(`dvc repro train_generator`).")
    sampler = dataclasses.replace(sampler_for(ctx.synthesize.sampler, extra), steps=cfg.generator_steps)
    faces, _, _ = generate(model, contexts, cfg.generator_images_per_identity, sampler,
                           batch_size=ctx.synthesize.batch_size, seed=cfg.seed, autoencoder=autoencoder,
                           desc="promotion sample")
    labels = np.repeat(np.arange(len(contexts)), cfg.generator_images_per_identity)
    emb = identity_embeddings(fr, faces, None)
    report = diversity_report(emb, labels)
    report["synthetic/context_cosine"] = float(np.mean(np.sum(emb * contexts[labels], axis=1)))
    return report


def _fr_dir(ctx: BenchContext, what: str) -> Path:
    if ctx.fr_dir is None:
        raise PromotionError(f"the {what} benchmark embeds faces with faceops-fr@champion, and none was given.")
    return ctx.fr_dir


BENCHMARKS: dict[str, Benchmark] = {
    "recognition": Benchmark("fr", _recognition, _recognition_metrics,
                             about="verification accuracy on every .bin, template TAR@FAR, rank-N, open set"),
    "alignment": Benchmark("aligner", _alignment, _alignment_metrics,
                           about="NME, failure rate, AUC@0.1 on the unaligned test split"),
    "discovery": Benchmark("discovery", _discovery, _discovery_metrics,
                           about="FaceGCD + SSK clustering accuracy on the GFD split"),
    "fusion": Benchmark("fusion", _fusion, _fusion_metrics, needs_fr=True,
                        about="CAFace template TAR@FAR over the FR champion's features"),
    "generation": Benchmark("generator", _generation, _generation_metrics, needs_fr=True,
                            about="identity consistency / diversity of a small sample under the FR champion"),
}


# ───────────────────────────────────────────────────────────────────────────── config


@dataclass(frozen=True)
class Gate:
    """``promote.<model>``: benchmarks to run and the rules a candidate must pass (see the module docstring)."""

    benchmarks: tuple[str, ...]
    primary: str
    min_improvement: float = 0.0
    guards: dict = field(default_factory=dict)  # metric → tolerated regression (absolute, ≥ 0)
    floors: dict = field(default_factory=dict)  # metric → minimum (↑ metrics) or maximum (↓ metrics)


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


def model_key(model: str) -> str:
    """``fr`` or ``faceops-fr`` → ``fr``; anything else → ConfigError listing the registered models."""
    key = model.removeprefix("faceops-")
    if key not in MODELS:
        raise ConfigError(f"unknown model {model!r}. Registered models: {', '.join(MODELS.values())} "
                          f"(or their short names {', '.join(MODELS)}).")
    return key


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


# ───────────────────────────────────────────────────────────────────────────── decision


@dataclass(frozen=True)
class Rule:
    """One gate rule with its numbers. ``threshold``: the margin (primary), tolerance (guard) or bound (floor);
    ``passed`` None: not applicable (no champion to compare with)."""

    kind: str  # primary | guard | floor
    metric: str
    higher_is_better: bool
    candidate: float
    champion: float | None
    threshold: float
    passed: bool | None

    @property
    def check(self) -> str:
        """The comparison in numbers, e.g. ``+0.0125 ≥ 0.0020`` or ``0.7500 ≥ 0.8000 − 0.0200``."""
        c, p, t, up = _f(self.candidate), _f(self.champion), _f(self.threshold), self.higher_is_better
        if self.kind == "floor":
            return f"{c} {'≥' if up else '≤'} {t}"
        if self.passed is None:
            return "no champion to compare with"
        if self.kind == "primary":
            return f"improvement {_signed(self.improvement)} ≥ {t} ({c} vs {p})"
        return f"{c} ≥ {p} − {t}" if up else f"{c} ≤ {p} + {t}"

    @property
    def improvement(self) -> float:
        if self.champion is None:
            return float("nan")
        return self.candidate - self.champion if self.higher_is_better else self.champion - self.candidate

    @property
    def result(self) -> str:
        return {True: "pass", False: "FAIL", None: "n/a"}[self.passed]


def _f(x: float | None) -> str:
    return "—" if x is None else ("nan" if x != x else f"{x:.4f}")


def _signed(x: float) -> str:
    return "nan" if x != x else f"{x:+.4f}"


def _arrow(up: bool) -> str:
    return "↑" if up else "↓"


def _holds(value: float) -> bool:
    return math.isfinite(value) and value >= -EPS


@dataclass(frozen=True)
class Decision:
    """A gate's verdict on one candidate, with both models' numbers and every rule."""

    model: str                      # registered name
    key: str                        # params key of the gate
    outcome: str                    # promoted | rejected | unchanged
    candidate: str                  # version
    champion: str | None            # the version it was compared with (None: first candidate)
    candidate_alias: str
    rules: tuple[Rule, ...]
    metrics: dict                   # {"candidate": {metric: value}, "champion": {...}}
    directions: dict                # metric → higher is better
    benchmarks: tuple[str, ...]
    time: str                       # UTC, ISO 8601
    fr_model: str = ""              # the FR champion the benchmarks embedded with, if any
    run_id: str | None = None       # the MLflow ``promote`` run that records it
    dry_run: bool = False

    @property
    def promoted(self) -> bool:
        return self.outcome == "promoted"

    def headline(self) -> str:
        v, name = f"v{self.candidate}", self.model
        if self.outcome == "unchanged":
            return f"UNCHANGED: {name} {v} (@{self.candidate_alias}) already is @champion; nothing to promote."
        if self.promoted:
            text = (f"PROMOTED: {name} {v} is now @champion (v{self.champion} → @previous)" if self.champion
                    else f"PROMOTED: {name} {v} is the first @champion (it passed every floor)")
        else:
            failed = ", ".join(f"{r.kind} {r.metric}" for r in self.rules if r.passed is False)
            stays = f"@champion stays v{self.champion}" if self.champion else "there is still no @champion"
            text = f"REJECTED: {name} {v} failed {failed}; {stays}"
        return f"DRY RUN, nothing written — would be {text}" if self.dry_run else text

    def summary(self) -> dict[str, Any]:
        """JSON-ready record (NaN → null) for ``promotion.summary`` and ``decision.json``."""
        clean = lambda x: None if isinstance(x, float) and not math.isfinite(x) else x  # noqa: E731
        return {
            "model": self.model, "decision": self.outcome, "candidate": self.candidate, "champion": self.champion,
            "candidate_alias": self.candidate_alias, "time": self.time, "benchmarks": list(self.benchmarks),
            "fr_model": self.fr_model, "run_id": self.run_id,
            "rules": [{**{k: clean(v) for k, v in dataclasses.asdict(r).items()}, "check": r.check}
                      for r in self.rules],
            "metrics": {who: {k: clean(v) for k, v in m.items()} for who, m in self.metrics.items()},
        }

    def version_tags(self) -> dict[str, str]:
        return {"promotion.decision": self.outcome, "promotion.time": self.time,
                "promotion.champion": self.champion or "none", "promotion.run_id": self.run_id or "",
                "promotion.summary": json.dumps(self.summary(), sort_keys=True)}

    def markdown(self) -> str:
        """Both models' numbers side by side, then every rule pass/fail with its numbers."""
        cand, champ = self.metrics.get("candidate", {}), self.metrics.get("champion", {})
        ch = f"champion v{self.champion}" if self.champion else "champion (none)"
        lines = [f"### {self.headline()}", "",
                 f"Gate `promote.{self.key}` · benchmarks: {', '.join(self.benchmarks) or '—'} · {self.time}"
                 + (f" · faces embedded by {self.fr_model}" if self.fr_model else "")
                 + (f" · MLflow run `{self.run_id}`" if self.run_id else ""), ""]
        if cand:
            lines += [f"| metric | candidate v{self.candidate} | {ch} | Δ |", "|---|---|---|---|"]
            for metric, value in cand.items():
                other = champ.get(metric)
                delta = _signed(value - other) if other is not None else "—"
                lines.append(f"| `{metric}` {_arrow(self.directions.get(metric, True))} | {_f(value)} | {_f(other)} "
                             f"| {delta} |")
            lines += ["", "| rule | metric | check | result |", "|---|---|---|---|"]
            for r in self.rules:
                lines.append(f"| {r.kind} | `{r.metric}` {_arrow(r.higher_is_better)} | {r.check} | **{r.result}** |")
        return "\n".join(lines) + "\n"


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def decide(key: str, gate: Gate, directions: Mapping[str, bool], candidate: str, cand: Mapping[str, float],
           champion: str | None, champ: Mapping[str, float] | None, *, candidate_alias: str = CANDIDATE,
           fr_model: str = "", time: str | None = None, dry_run: bool = False) -> Decision:
    """Apply ``gate`` to the candidate's numbers ``cand`` and the champion's ``champ`` (None: no champion)."""
    rules: list[Rule] = []
    up = lambda m: bool(directions[m])  # noqa: E731
    if champion is None or champ is None:
        rules.append(Rule("primary", gate.primary, up(gate.primary), cand[gate.primary], None,
                          gate.min_improvement, None))
        rules += [Rule("guard", m, up(m), cand[m], None, float(t), None) for m, t in gate.guards.items()]
    else:
        c, p = cand[gate.primary], champ[gate.primary]
        gain = c - p if up(gate.primary) else p - c
        rules.append(Rule("primary", gate.primary, up(gate.primary), c, p, gate.min_improvement,
                          _holds(gain - gate.min_improvement)))
        for m, tol in gate.guards.items():
            c, p = cand[m], champ[m]
            slack = c - (p - tol) if up(m) else (p + tol) - c
            rules.append(Rule("guard", m, up(m), c, p, float(tol), _holds(slack)))
    for m, bound in gate.floors.items():
        c = cand[m]
        rules.append(Rule("floor", m, up(m), c, None if champ is None else champ.get(m), float(bound),
                          _holds(c - bound if up(m) else bound - c)))
    promoted = all(r.passed is not False for r in rules)
    return Decision(
        model=MODELS[key], key=key, outcome="promoted" if promoted else "rejected", candidate=str(candidate),
        champion=None if champion is None else str(champion), candidate_alias=candidate_alias, rules=tuple(rules),
        metrics={"candidate": dict(cand), **({"champion": dict(champ)} if champ is not None else {})},
        directions=dict(directions), benchmarks=tuple(gate.benchmarks), time=time or utc_now(), fr_model=fr_model,
        dry_run=dry_run,
    )


def unchanged(key: str, state: "RegistryState") -> Decision:
    """The decision when ``@candidate`` already is ``@champion``: nothing to evaluate or write."""
    return Decision(model=MODELS[key], key=key, outcome="unchanged", candidate=str(state.candidate),
                    champion=state.champion, candidate_alias=state.candidate_alias, rules=(), metrics={},
                    directions={}, benchmarks=(), time=utc_now())


# ───────────────────────────────────────────────────────────────────────────── registry


def check_tracking(uri: str, timeout_s: float = 5.0) -> None:
    """For an HTTP(S) tracking URI: the server must answer at all (any HTTP status; ``/health`` is asked), or
    RegistryUnreachable naming the endpoint. MLflow's own client would retry a refused connection for minutes
    before failing. Proxy settings apply as they do to MLflow's client. Local stores pass."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s)
        return
    except requests.RequestException as exc:
        reason = type(exc).__name__
    raise RegistryUnreachable(
        f"MLflow tracking server {redact(uri)} is unreachable ({reason}). Start it, or point MLFLOW_TRACKING_URI at "
        "a running server (unset it to use the local mlflow.db)."
    )


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: an unreachable tracking server, a dropped connection or a timeout."""
    if isinstance(exc, (RegistryUnreachable, ConnectionError, TimeoutError)):
        return True
    try:
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:  # pragma: no cover - requests comes with MLflow
        pass
    text = str(exc)
    return "Max retries exceeded" in text or "Connection refused" in text


def connect(root: Path) -> str:
    """Check the tracking server answers, point MLflow at it; → its URI (password masked)."""
    from tasks.tracking import configure, tracking_uri

    uri = tracking_uri(Path(root))
    check_tracking(uri)
    configure(Path(root))
    return redact(uri)


def client_for(root: Path) -> Any:
    from mlflow import MlflowClient

    from tasks.tracking import configure

    configure(Path(root))
    return MlflowClient()


@dataclass(frozen=True)
class RegistryState:
    """A registered model's aliases (alias → version) when it was read."""

    name: str
    aliases: dict
    candidate_alias: str = CANDIDATE

    @property
    def candidate(self) -> str | None:
        return self.aliases.get(self.candidate_alias)

    @property
    def champion(self) -> str | None:
        return self.aliases.get(CHAMPION)

    @property
    def previous(self) -> str | None:
        return self.aliases.get(PREVIOUS)


def _not_found(exc: Exception) -> bool:
    return getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def registry_state(client: Any, name: str, candidate_alias: str = CANDIDATE) -> RegistryState:
    """Read ``name``'s aliases; a model that is not registered is a PromotionError saying which stage registers it."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as exc:
        if _not_found(exc):
            stage = STAGES[model_key(name)]
            raise PromotionError(f"{name} is not in the MLflow registry: run `faceops run --stage {stage}` (or "
                                 f"`dvc repro {stage}`) to register a candidate first.") from None
        raise
    return RegistryState(name, {str(a): str(v) for a, v in (model.aliases or {}).items()}, candidate_alias)


def require_candidate(state: RegistryState) -> str:
    if state.candidate is None:
        stage = STAGES[model_key(state.name)]
        aliases = ", ".join(f"@{a} v{v}" for a, v in sorted(state.aliases.items())) or "none"
        raise PromotionError(f"{state.name} has no @{state.candidate_alias} version (aliases: {aliases}): run "
                             f"`faceops run --stage {stage}` to register one, or name another alias.")
    return state.candidate


def find_model_dir(local: Path, what: str) -> Path:
    """The one directory under ``local`` holding ``model.safetensors`` + ``config.json`` (a pyfunc model keeps it
    under ``artifacts/``, a registered run artifact is it)."""
    found = sorted({p.parent for p in Path(local).rglob("model.safetensors") if (p.parent / "config.json").is_file()})
    if len(found) != 1:
        raise DataError(f"{what}: expected one faceops model directory (model.safetensors + config.json) in its "
                        f"artifacts, found {len(found)} under {local}.")
    return found[0]


def download_version(name: str, version: str, dst: Path) -> Path:
    """Download registered version ``name`` v``version`` into ``dst`` → its model directory."""
    import mlflow

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst))
    return find_model_dir(Path(local), f"{name} v{version}")


class RegistryChange:
    """Alias moves and version tags of one registered model applied as one change.

    Each step records how to undo itself before it runs; if a step raises, the steps before it (and the failing one,
    in case it took effect) are undone in reverse order and the error propagates. If undoing fails too, a
    PromotionError lists what to restore by hand.
    """

    def __init__(self, client: Any, name: str, aliases: Mapping[str, str]):
        self.client, self.name = client, name
        self.aliases: dict[str, str] = dict(aliases)
        self._undo: list[tuple[str, Callable[[], None]]] = []

    def __enter__(self) -> "RegistryChange":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        failed = []
        for what, undo in reversed(self._undo):
            try:
                undo()
            except Exception as err:  # keep undoing the rest; report all
                failed.append(f"{what} ({type(err).__name__}: {err})")
        if failed:
            raise PromotionError(f"{self.name}: a registry change failed ({exc}) and could not be fully undone; "
                                 f"restore by hand: {'; '.join(failed)}") from exc
        return False

    def set_alias(self, alias: str, version: str) -> None:
        before = self.aliases.get(alias)
        self._undo.append((f"@{alias} → {'v' + before if before else 'unset'}", lambda: self._put(alias, before)))
        self.client.set_registered_model_alias(self.name, alias, str(version))
        self.aliases[alias] = str(version)

    def delete_alias(self, alias: str) -> None:
        before = self.aliases.get(alias)
        self._undo.append((f"@{alias} → {'v' + before if before else 'unset'}", lambda: self._put(alias, before)))
        self._put(alias, None)
        self.aliases.pop(alias, None)

    def set_version_tags(self, version: str, tags: Mapping[str, str]) -> None:
        old = dict(self.client.get_model_version(self.name, str(version)).tags or {})
        for key, value in tags.items():
            before = old.get(key)
            self._undo.append((f"v{version} tag {key} → {before!r}", lambda k=key, b=before: self._tag(version, k, b)))
            self.client.set_model_version_tag(self.name, str(version), key, str(value))

    def _put(self, alias: str, version: str | None) -> None:
        from mlflow.exceptions import MlflowException

        if version is not None:
            self.client.set_registered_model_alias(self.name, alias, version)
            return
        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as exc:
            if not _not_found(exc):
                raise

    def _tag(self, version: str, key: str, value: str | None) -> None:
        if value is None:
            self.client.delete_model_version_tag(self.name, str(version), key)
        else:
            self.client.set_model_version_tag(self.name, str(version), key, value)


def _start_record_run(client: Any, root: Path, name: str, tags: Mapping[str, str], flow_run_id: str | None) -> str:
    from tasks.tracking import configure, git_commit

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
    import time

    from mlflow.entities import Metric

    from tasks.tracking import mlflow_metric_name

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
