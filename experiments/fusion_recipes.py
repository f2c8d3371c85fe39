"""CAFace training recipes compared over seeds on a finished run's data: ``python -m experiments.fusion_recipes``.

Does a recipe change help for every seed? The run's frozen FR model (``fusion.fr_source``) embeds the
``train_fusion`` stage's material and the ``evaluate`` stage's IJB-S-style video probes once; CAFace is then
trained per (variant, seed) and scored on those same probes (single gallery).

- Variants: JSON objects of ``fusion.train`` keys over params.yaml's recipe (``'{"lambda_u": 0}'``); seeds replace
  ``seed``; the same data for every run.
- Per run: rank-1 of the mated probes, its paired difference to averaging (bootstrap 95 % interval), the last
  epoch's ``Lt`` against averaging's and the frame-weight diagnostics (``ml.fusion.diagnostics``).
- Per variant: mean ± sample std over seeds of the gain over averaging, and per seed the paired difference to the
  first variant, so a recipe is judged seed by seed, not by its best seed.

Writes ``reports/fusion_recipes.md`` (``--out``). The ``fusion.train.lambda_u`` comparison is
``--variants '{"lambda_u": 0}' '{"lambda_u": 0.3}' --seeds 0 1 2`` after ``make run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from tasks.common import Paths, load_params, section, write_text
from tasks.prepare import DataConfig
from tasks.evaluate.fusion import VideoSplit
from tasks.train_fusion import FusionStageConfig

__all__ = ["compare_recipes", "render", "main"]


def load_probes(paths: Paths, data: DataConfig, fr_model: Any, batch_size: int = 256) -> VideoSplit:
    """``data/prepared/videos`` embedded by ``fr_model`` (as the ``evaluate`` stage does, manifest landmarks) and
    split into probes and galleries by ``tasks.evaluate.fusion.split_videos``."""
    from ml.data.dataset import read_manifest
    from tasks.evaluate.fusion import _frames, split_videos

    manifest = paths.video_set / "manifest.parquet"
    if not manifest.is_file():
        raise DataError(f"{manifest} is missing: run `dvc repro prepare` (or `make run`) first")
    rows = read_manifest(manifest)
    return split_videos(rows, _frames(fr_model, None, paths.video_set, rows, data, batch_size))


def _recipe(base: Any, variant: dict[str, Any], seed: int) -> Any:
    unknown = sorted(set(variant) - {f.name for f in dataclasses.fields(base)})
    if unknown:
        raise ConfigError(f"variant {json.dumps(variant)}: unknown FusionConfig key(s) {unknown}; use keys of "
                          "params.yaml fusion.train")
    values = {**dataclasses.asdict(base), **variant, "seed": seed}
    values["lr_steps"] = tuple(values["lr_steps"])
    return type(base)(**values)


def compare_recipes(paths: Paths, data: DataConfig, stage: FusionStageConfig, variants: list[dict[str, Any]],
                    seeds: list[int], progress: bool = False) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Train CAFace per (variant, seed) on the run's material and score it on its video probes → (one row per run,
    the baselines' rank-1: ``average``, ``norm_weighted``, ``quality_oracle``)."""
    from ml.fusion.diagnostics import caface_diagnostics, paired_difference, rank1_hits
    from ml.fusion.sets import fuse_templates
    from ml.models.io import load_model
    from ml.fusion.train import train_fusion
    from tasks.train_fusion import procedural_material, real_material

    if not variants or not seeds:
        raise ConfigError("give at least one variant (e.g. '{}' for params.yaml's recipe) and one seed")
    fr_dir = paths.fr_model(stage.fr_source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {stage.fr_source!r} but {fr_dir} holds no model: run `make run` first")
    model, fr_config = load_model(fr_dir)
    contract = fr_config["input_contract"]
    base = dataclasses.replace(stage.train, feature_dim=int(contract["embedding_dim"]),
                               style_dim=int(contract["style_dim"]))
    recipes = [[_recipe(base, v, s) for s in seeds] for v in variants]  # every variant checked before any training
    material = real_material(model, paths, data, base.seed) if data.ingested else procedural_material(model, paths, data)
    videos = load_probes(paths, data, model)
    probe, groups, gallery = videos.probe, videos.probe_groups, videos.single  # scored on the single gallery
    hits = {m: rank1_hits(fuse_templates(m, probe.feats, groups, quality=probe.quality), videos.probe_ids, gallery,
                          videos.gallery_ids) for m in ("average", "norm_weighted", "quality_oracle")}
    rows = []
    for variant, row_recipes in zip(variants, recipes):
        for seed, cfg in zip(seeds, row_recipes):
            start = time.perf_counter()
            res = train_fusion(cfg, material.features, material.styles, material.labels, sources=material.sources,
                               centres=material.centres, progress=progress)
            fused = fuse_templates("caface", probe.feats, groups, styles=probe.styles, model=res.model, chunk_size=64)
            h = rank1_hits(fused, videos.probe_ids, gallery, videos.gallery_ids)
            diff = paired_difference(h, hits["average"], seed=seed)
            diag = caface_diagnostics(res.model, probe.feats, probe.styles, groups, probe.quality)
            last = res.history[-1]
            rows.append({"variant": variant, "seed": seed, "steps": res.steps, "seconds": time.perf_counter() - start,
                         "rank1": float(h.mean()), "minus_average": diff["mean"], "ci_low": diff["ci_low"],
                         "ci_high": diff["ci_high"], "lt": last["train/lt"], "lt_average": last["train/lt_average"],
                         "hits": h, **diag})
    return rows, {m: float(h.mean()) for m, h in hits.items()}


def _mean_std(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{100 * statistics.fmean(values):+.1f} ± {100 * sd:.1f}"


def render(rows: list[dict[str, Any]], baselines: dict[str, float], probes: int) -> str:
    """Markdown: the baselines, one line per run, and per variant the mean ± sample std over seeds of the gain over
    averaging and the per-seed paired difference to the first variant."""
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    lines = ["# CAFace recipes over seeds", "",
             f"{probes} mated IJB-S-style video probes, single gallery, rank-1 (%): average {pct(baselines['average'])}, "
             f"norm-weighted {pct(baselines['norm_weighted'])}, true-quality oracle {pct(baselines['quality_oracle'])} "
             "(headroom).", "",
             "| variant | seed | steps | rank-1 | − average (95 % CI) | Lt / Lt of averaging | weight–quality ρ | "
             "weight CV | effective clusters | s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{json.dumps(r['variant'])}` | {r['seed']} | {r['steps']} | {pct(r['rank1'])} | "
                     f"{100 * r['minus_average']:+.1f} ({100 * r['ci_low']:+.1f} to {100 * r['ci_high']:+.1f}) | "
                     f"{r['lt'] / r['lt_average']:.3f} | {r['weight_quality_spearman']:.2f} | {r['weight_cv']:.2f} | "
                     f"{r['effective_clusters']:.2f} | {r['seconds']:.0f} |")
    names = list(dict.fromkeys(json.dumps(r["variant"]) for r in rows))
    first = {r["seed"]: r for r in rows if json.dumps(r["variant"]) == names[0]}
    lines += ["", "| variant | gain over averaging, mean ± sd over seeds (pp) | paired − first variant, per seed (pp) |",
              "|---|---|---|"]
    for name in names:
        mine = [r for r in rows if json.dumps(r["variant"]) == name]
        paired = [100 * (r["rank1"] - first[r["seed"]]["rank1"]) for r in mine if r["seed"] in first]
        lines.append(f"| `{name}` | {_mean_std([r['minus_average'] for r in mine])} | "
                     + ", ".join(f"{p:+.1f}" for p in paired) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.fusion_recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository with a finished run (default: .)")
    parser.add_argument("--variants", nargs="+", default=['{"lambda_u": 0}', "{}"],
                        help="JSON objects of fusion.train keys, one per recipe (default: without Lu, params.yaml's)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="report path (default: ROOT/reports/fusion_recipes.md)")
    args = parser.parse_args(argv)
    try:
        variants = [json.loads(v) for v in args.variants]
    except json.JSONDecodeError as exc:
        parser.error(f"--variants: {exc}: give JSON objects such as '{{\"lambda_u\": 0}}'")
    if not all(isinstance(v, dict) for v in variants):
        parser.error("--variants: each must be a JSON object of fusion.train keys")
    paths = Paths(args.root.resolve())
    try:
        params = load_params(paths.params)
        stage = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
        data = from_mapping(DataConfig, section(params, "data"), "data")
        rows, baselines = compare_recipes(paths, data, stage, variants, args.seeds, progress=True)
    except (ConfigError, DataError) as exc:
        parser.exit(2, f"error: {exc}\n")
    out = args.out or paths.root / "reports" / "fusion_recipes.md"
    write_text(out, render(rows, baselines, int(rows[0]["hits"].size)))
    print(out.read_text())


if __name__ == "__main__":
    main()
