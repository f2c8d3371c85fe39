"""How much the generator's val objective moves by its probe alone: ``python -m experiments.generator_probe``.

``faceops sweep train_generator`` scores each trial once with ``tasks.synthesize.probe_generator`` (a small synthetic
set sampled from the trial's generator, its identity gap, and the val accuracy of a small FR model trained on it).
Before a trial's margin over the default is read as a better recipe, it has to exceed what the probe gives for one
and the same generator. This runs the probe on a finished run's generator (``models/generator``, the default recipe)
once per seed, the seed set as both ``synthesize.seed`` (candidates, contexts, noise) and ``fr.seed`` (the small FR
model), and reports mean ± sample std of each score. With a sweep's summary (``reports/sweeps/<study>.json``,
``--study``) it sets the best trial's gain over the baseline trial beside that spread. Only val faces are read (the
GFD split's labelled images). Writes ``metrics/generator_probe.json`` and ``reports/generator_probe.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.test_sets import now_utc
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from tasks.common import Paths, load_params, section, write_json, write_text

log = logging.getLogger("experiments.generator_probe")
KEYS = ("val/objective", "val/identity_gap", "val/accuracy")


def probe_seeds(paths: Paths, seeds: list[int]) -> list[dict[str, float]]:
    """``probe_generator`` on ``paths.generator_model`` per seed → one row of scores per seed."""
    from ml.fr.config import FRConfig
    from tasks.prepare import DataConfig
    from tasks.synthesize import SynthesizeConfig, probe_generator, probe_setup
    from tasks.train_generator import GeneratorStageConfig

    if not (paths.generator_model / "config.json").is_file():
        raise DataError(f"{paths.generator_model} holds no generator: run `make run` (or `dvc repro train_generator`)")
    params = load_params(paths.params)
    data = from_mapping(DataConfig, section(params, "data"), "data")
    synthesize = from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize")
    fr = from_mapping(FRConfig, section(params, "fr"), "fr")
    generator = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    setup = probe_setup(synthesize, data, paths)
    rows = []
    for seed in seeds:
        start = time.perf_counter()
        scores = probe_generator(paths.generator_model, generator, dataclasses.replace(synthesize, seed=seed), data,
                                 dataclasses.replace(fr, seed=seed), paths, setup)
        rows.append({"seed": seed, **scores, "seconds": time.perf_counter() - start})
        log.info("probe seed %d: %s", seed, ", ".join(f"{k} {scores[k]:.4f}" for k in KEYS))
    return rows


def summarise(rows: list[dict[str, float]], sweep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Mean ± sample std per key over the seeds; with a sweep summary, its baseline and best values, the best
    trial's ``gain`` and ``gain_over_std`` (the gain in units of the probe's std of the sweep's metric)."""
    if len(rows) < 2:
        raise ConfigError("the spread needs at least two probe seeds")
    out: dict[str, Any] = {k: {"mean": statistics.fmean(r[k] for r in rows), "std": statistics.stdev(r[k] for r in rows)}
                           for k in KEYS}
    if sweep and sweep.get("baseline") and sweep.get("best"):
        metric = sweep.get("metric", "val/objective")
        gain = sweep["baseline"]["gain"]
        out["sweep"] = {"study": sweep.get("study"), "metric": metric, "baseline": sweep["baseline"]["value"],
                        "best": sweep["best"]["value"], "best_trial": sweep["best"]["number"], "gain": gain,
                        "gain_over_std": gain / out[metric]["std"] if out.get(metric, {}).get("std") else None}
    return out


def render(results: dict[str, Any]) -> str:
    s, rows = results["summary"], results["rows"]
    lines = ["# The generator's probe on one generator", "",
             f"Measured by `python -m experiments.generator_probe` on {results['measured_at']}: the default run's "
             f"generator probed with seeds {[r['seed'] for r in rows]} (sampling and the small FR model). Chosen and "
             "scored on: val identities only, as `faceops sweep train_generator` is (chance "
             f"{100 * rows[0]['val/chance']:.1f} %); no test split is read.", "",
             "| seed | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for r in rows:
        lines.append(f"| {r['seed']} | " + " | ".join(f"{r[k]:.4f}" for k in KEYS) + " |")
    lines.append("| mean ± std | " + " | ".join(f"{s[k]['mean']:.4f} ± {s[k]['std']:.4f}" for k in KEYS) + " |")
    sw = s.get("sweep")
    if sw:
        ratio = f"{sw['gain_over_std']:.2f}" if sw["gain_over_std"] is not None else "—"
        lines += ["", f"Sweep `{sw['study']}`: the best trial ({sw['best_trial']}, {sw['metric']} {sw['best']:.4f}) "
                  f"beat the baseline trial (params.yaml's values, {sw['baseline']:.4f}) by {sw['gain']:+.4f}, "
                  f"{ratio} × the probe's own std on one generator: "
                  + ("within the probe's noise, so the default stays." if abs(sw["gain"]) < 2 * s[sw["metric"]]["std"]
                     else "beyond twice the probe's std.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.generator_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository with a finished run (default: .)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--study", default="val-train_generator",
                        help="sweep whose reports/sweeps/<study>.json to set beside the spread (skipped if absent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    paths = Paths(args.root.resolve())
    summary_file = paths.root / "reports" / "sweeps" / f"{args.study}.json"
    sweep = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    try:
        if len(args.seeds) < 2:
            raise ConfigError("give at least two --seeds: the spread needs them")
        rows = probe_seeds(paths, args.seeds)
    except (ConfigError, DataError) as exc:
        parser.exit(2, f"error: {exc}\n")
    results = {"rows": rows, "summary": summarise(rows, sweep),
               "measured_at": now_utc()}
    write_json(paths.root / "metrics" / "generator_probe.json", results)
    write_text(paths.root / "reports" / "generator_probe.md", render(results))
    print(render(results))


if __name__ == "__main__":
    main()
