"""The benchmarks a promotion gate runs (``BENCHMARKS``), each declaring the metrics it produces and their direction.

They reuse the evaluation code of the stages (``tasks/evaluate``, ``sets_eval.py``, ``discovery_eval.py``, the
aligner and generator evaluations) on ``data/prepared``, so a gate measures what those stages report, under the same
names. See ``ops/promote``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ml.errors import DataError
from ops.promote.registry import PromotionError
from tasks.common import Paths


@dataclass(frozen=True)
class BenchContext:
    """What benchmarks read besides the model: the prepared data and the params sections of the stages whose
    evaluation they reuse, and for benchmarks that embed faces, the FR champion's model directory."""

    paths: Paths
    promote: Any     # ops.promote.PromoteConfig
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
    from ml.aligner.dfa import load_aligner
    from ml.aligner.train import evaluate_aligner

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
    from ml.discovery.facegcd import load_facegcd
    from tasks.evaluate.discovery import facegcd_ssk, gfd_inputs

    model, _ = load_facegcd(model_dir)
    _, outcome = facegcd_ssk(model, gfd_inputs(ctx.paths, ctx.data), ctx.evaluate, ctx.data)
    return {f"discovery/facegcd/{k}": float(v) for k, v in outcome.metrics.items()}


def _fusion_metrics(ctx: BenchContext) -> dict[str, bool]:
    from tasks.evaluate.fusion import FARS

    return {f"sets/templates/{m}/tar@far={_fmt_rate(f)}": True for m in ("caface", "average") for f in FARS}


def _fusion(model_dir: Path, ctx: BenchContext) -> dict[str, float]:
    """IJB-B/C-style template TAR@FAR with CAFace over the FR champion's features and styles, beside plain averaging
    of the same features (the evaluate stage's ``sets/templates/...``)."""
    from ml.fusion.caface import load_caface
    from ml.models.io import load_model
    from tasks.evaluate.fusion import template_fusion

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
    from ml.generator.diversity import diversity_report
    from ml.generator.uiface import load_generator
    from ml.models.io import load_model, read_model_config
    from ml.fr.train import needs_keypoints
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
