"""CAFace training recipes compared over seeds on a finished run's data: ``python -m experiments.fusion_recipes``.

Does a recipe change help for every seed? The run's frozen FR model (``fusion.fr_source``) embeds the
``train_fusion`` stage's material once; CAFace is then trained per (variant, seed) on its training identities and
scored on the fixed sets of its ``fusion.val_identities`` held-out identities (``ml.fusion.train.val_sets``), as the
stage and ``faceops sweep train_fusion`` score it. The video and template test sets are not read: recipes are chosen
on val, and ``evaluate`` reports the chosen one on test.

- Variants: JSON objects of ``fusion.train`` keys over params.yaml's recipe (``'{"lambda_u": 0}'``); seeds replace
  ``seed``; the same data for every run.
- Per run: val rank-1, its paired difference to averaging the same sets (bootstrap 95 % interval over val sets) and
  the last epoch's val ``Lt`` against averaging's.
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
from tasks.train_fusion import FusionStageConfig

__all__ = ["compare_recipes", "render", "main"]


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
    """Train CAFace per (variant, seed) on the stage's training identities and score it on its val sets → (one row
    per run, plain averaging's val rank-1 under ``average``)."""
    from ml.fusion.diagnostics import paired_difference
    from ml.fusion.train import train_fusion, val_scores
    from tasks.train_fusion import load_material, split_val

    if not variants or not seeds:
        raise ConfigError("give at least one variant (e.g. '{}' for params.yaml's recipe) and one seed")
    if not stage.val_identities:
        raise ConfigError("fusion.val_identities is 0: recipes are compared on held-out identities, never on the "
                          "test probes; set it > 0")
    fr_dir = paths.fr_model(stage.fr_source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {stage.fr_source!r} but {fr_dir} holds no model: run `make run` first")
    recipes = [[_recipe(stage.train, v, s) for s in seeds] for v in variants]  # every variant checked before any training
    material, base, _, _ = load_material(stage, data, paths)
    material, val = split_val(material, stage)
    rows, average = [], None
    for variant, row_recipes in zip(variants, recipes):
        for seed, cfg in zip(seeds, row_recipes):
            cfg = dataclasses.replace(cfg, feature_dim=base.feature_dim, style_dim=base.style_dim)
            start = time.perf_counter()
            res = train_fusion(cfg, material.features, material.styles, material.labels, sources=material.sources,
                               centres=material.centres, progress=progress)
            scores = val_scores(res.model, val)
            h, average = scores["caface/hit"].astype(float), scores["average/hit"].astype(float)
            diff = paired_difference(h, average, seed=seed)
            rows.append({"variant": variant, "seed": seed, "steps": res.steps, "seconds": time.perf_counter() - start,
                         "rank1": float(h.mean()), "minus_average": diff["mean"], "ci_low": diff["ci_low"],
                         "ci_high": diff["ci_high"], "lt": float(scores["caface/lt"].mean()),
                         "lt_average": float(scores["average/lt"].mean()), "hits": h})
    return rows, {"average": float(average.mean()), "chance": 1.0 / stage.val_identities}


def _mean_std(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{100 * statistics.fmean(values):+.1f} ± {100 * sd:.1f}"


def render(rows: list[dict[str, Any]], baselines: dict[str, float], probes: int) -> str:
    """Markdown: the baselines, one line per run, and per variant the mean ± sample std over seeds of the gain over
    averaging and the per-seed paired difference to the first variant."""
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    lines = ["# CAFace recipes over seeds", "",
             f"Chosen and scored on val: {probes} fixed sets of the stage's held-out identities (`fusion.val_identities`), "
             f"rank-1 against their targets (%): plain average {pct(baselines['average'])}, chance "
             f"{pct(baselines['chance'])}. No test probe is read.", "",
             "| variant | seed | steps | val rank-1 | − average (95 % CI) | val Lt / Lt of averaging | s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{json.dumps(r['variant'])}` | {r['seed']} | {r['steps']} | {pct(r['rank1'])} | "
                     f"{100 * r['minus_average']:+.1f} ({100 * r['ci_low']:+.1f} to {100 * r['ci_high']:+.1f}) | "
                     f"{r['lt'] / r['lt_average']:.3f} | {r['seconds']:.0f} |")
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
