"""CAFace against plain averaging on disjoint folds of held-out identities: ``python -m experiments.fusion_claims``.

The claim (CAFace, Table 2): a set fused by CAFace identifies its person better than the average of its features. The
benchmark (``evaluate``) scores it on one test set; this experiment asks whether the gain holds on several
independent ones. On a finished run's data (``make run``), the frozen FR model (``fusion.fr_source``) embeds the
``train_fusion`` stage's material once. Its identities, except the last ``fusion.val_identities`` (the val block the
recipe and the sweeps were chosen on, never a test fold here), are cut into ``--folds`` contiguous blocks of as many
identities. Per fold: CAFace is trained with ``params.yaml``'s recipe on every other identity (the val block
included, so each fold trains on as many identities as the stage), then the fold's identities are drawn into sets
as the stage draws its val sets (``ml.fusion.train.val_sets``) and scored by rank-1 against their targets, CAFace's
template and plain averaging's alike (chance: 1 / identities per fold).

Statistics: the fold is the unit (``experiments.test_sets.across_test_sets``): per fold the paired difference in rank-1
over its sets, mean ± sample std over folds, how many folds were higher, a percentile bootstrap interval over sets;
beyond noise when at least two folds, the mean beyond 2 standard errors, every fold on its side and the interval
excluding 0. The folds' test identities are disjoint; their training sets overlap (k-fold), which the report says.
Writes ``reports/fusion_claims.md`` and ``metrics/fusion_claims.json`` under ``--root``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.test_sets import across_test_sets, now_utc
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from tasks.common import Paths, load_params, section, write_json, write_text
from tasks.prepare import DataConfig
from tasks.train_fusion import FusionMaterial, FusionStageConfig

log = logging.getLogger("experiments.fusion_claims")


def fold_blocks(identities: int, held: int, folds: int) -> list[range]:
    """``folds`` contiguous blocks of ``held`` identities from 0, none reaching the last ``held`` (the val block);
    ConfigError when they do not fit."""
    if held < 2:
        raise ConfigError(f"fusion.val_identities is {held}: a fold needs at least 2 identities (and it sizes the folds)")
    room = (identities - held) // held
    if folds < 2 or folds > room:
        raise ConfigError(f"{folds} folds of {held} identities do not fit the {identities - held} identities outside "
                          f"the val block: give --folds between 2 and {room}")
    return [range(f * held, (f + 1) * held) for f in range(folds)]


def split_fold(material: FusionMaterial, block: range) -> tuple[FusionMaterial, FusionMaterial]:
    """(training material: every identity outside ``block``, test material: the identities in ``block``), each with
    contiguous labels 0..K−1 and its own centres."""
    test = (material.labels >= block.start) & (material.labels < block.stop)
    keep_ids = np.setdiff1d(np.arange(len(material.centres)), np.arange(block.start, block.stop))

    def part(rows: np.ndarray, ids: np.ndarray) -> FusionMaterial:
        return dataclasses.replace(material, features=material.features[rows], styles=material.styles[rows],
                                   labels=np.searchsorted(ids, material.labels[rows]), sources=material.sources[rows],
                                   centres=material.centres[ids])

    return part(~test, keep_ids), part(test, np.arange(block.start, block.stop))


def run_folds(paths: Paths, data: DataConfig, stage: FusionStageConfig, folds: int,
              progress: bool = False) -> dict[str, Any]:
    """Train and score CAFace per fold → {"folds": one row per fold, "summary", "identities", "sets"}."""
    from ml.fusion.train import train_fusion, val_scores, val_sets
    from tasks.train_fusion import load_material

    fr_dir = paths.fr_model(stage.fr_source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {stage.fr_source!r} but {fr_dir} holds no model: run `make run` first")
    material, cfg, _, _ = load_material(stage, data, paths)
    blocks = fold_blocks(len(material.centres), stage.val_identities, folds)
    rows, hits = [], []
    for f, block in enumerate(blocks):
        train, test = split_fold(material, block)
        start = time.perf_counter()
        log.info("fold %d: test identities %d-%d, training on %d identities", f, block.start, block.stop - 1,
                 len(train.centres))
        res = train_fusion(cfg, train.features, train.styles, train.labels, sources=train.sources,
                           centres=train.centres, progress=progress)
        sets = val_sets(test.features, test.styles, test.labels, test.centres, sources=test.sources,
                        set_size=stage.val_set_size, sets_per_identity=stage.val_sets_per_identity)
        scores = val_scores(res.model, sets)
        hits.append((scores["caface/hit"], scores["average/hit"]))
        rows.append({"fold": f, "identities": [block.start, block.stop - 1], "sets": int(len(sets.labels)),
                     "caface": float(scores["caface/hit"].mean()), "average": float(scores["average/hit"].mean()),
                     "lt": float(scores["caface/lt"].mean()), "lt_average": float(scores["average/lt"].mean()),
                     "seconds": time.perf_counter() - start})
        log.info("fold %d: rank-1 CAFace %.3f, average %.3f (%.0f s)", f, rows[-1]["caface"], rows[-1]["average"],
                 rows[-1]["seconds"])
    diff = across_test_sets([h[0] for h in hits], [h[1] for h in hits], list(range(len(blocks))))
    summary = {arm: {"mean": float(np.mean([r[arm] for r in rows])), "std": float(np.std([r[arm] for r in rows],
                                                                                       ddof=1))}
               for arm in ("caface", "average")}
    return {"folds": rows, "summary": {**summary, "caface_minus_average": diff, "chance": 1.0 / stage.val_identities},
            "identities": len(material.centres), "val_identities": stage.val_identities,
            "recipe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}}


def render(results: dict[str, Any]) -> str:
    """Markdown: the protocol, one row per fold, the verdict."""
    s, rows = results["summary"], results["folds"]
    d = s["caface_minus_average"]
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    held = results["val_identities"]
    lines = [
        "# CAFace against averaging on independent test folds", "",
        f"Measured by `python -m experiments.fusion_claims` on {results['measured_at']} in "
        f"{results['seconds'] / 60:.0f} minutes, on a finished run's fusion material ({results['identities']} "
        f"identities, the frozen FR model's features). Chosen on: the last {held} identities (the val block the "
        f"recipe and the sweeps read), never scored here. Scored on: {len(rows)} folds of {held} other identities, "
        f"each drawn into {rows[0]['sets']} sets as the stage's val sets are; per fold CAFace is trained with "
        "`params.yaml`'s recipe on every other identity (so the folds' training sets overlap; their test identities "
        f"do not). Rank-1 against the fold's targets (%); chance {pct(s['chance'])}.", "",
        "| fold | identities | CAFace | plain average | CAFace − average | Lt / Lt of averaging | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['fold']} | {r['identities'][0]}-{r['identities'][1]} | {pct(r['caface'])} | "
                     f"{pct(r['average'])} | {100 * (r['caface'] - r['average']):+.1f} | "
                     f"{r['lt'] / r['lt_average']:.3f} | {r['seconds']:.0f} |")
    verdict = "**beyond noise**" if d["beyond_noise"] else "**not beyond noise**"
    lines += ["", f"CAFace − averaging over the {d['units']} folds: {100 * d['mean']:+.1f} ± {100 * d['std']:.1f} pp "
              f"(higher in {d['higher']} of {d['units']}; 95 % bootstrap over sets {100 * d['ci_low']:+.1f} to "
              f"{100 * d['ci_high']:+.1f}): {verdict} (at least two folds, the mean beyond 2 standard errors, every "
              "fold on its side and the interval excluding 0).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.fusion_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository with a finished run (default: .)")
    parser.add_argument("--folds", type=int, default=5, help="test folds of fusion.val_identities identities each")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    paths = Paths(args.root.resolve())
    start = time.perf_counter()
    try:
        params = load_params(paths.params)
        stage = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
        data = from_mapping(DataConfig, section(params, "data"), "data")
        results = run_folds(paths, data, stage, args.folds, progress=True)
    except (ConfigError, DataError) as exc:
        parser.exit(2, f"error: {exc}\n")
    results["seconds"] = time.perf_counter() - start
    results["measured_at"] = now_utc()
    write_json(paths.root / "metrics" / "fusion_claims.json", results)
    out = paths.root / "reports" / "fusion_claims.md"
    write_text(out, render(results))
    print(out.read_text())


if __name__ == "__main__":
    main()
