"""CAFace against its baselines on independent test sets: ``python -m experiments.fusion_claims``.

The claim (CAFace, Table 2): a set fused by CAFace identifies its person better than the average of its features. The
benchmark (``evaluate``) scores it on one test set; this experiment asks whether the gain holds on several
independent ones, with a finished run's frozen FR model (``fusion.fr_source``) and ``params.yaml``'s recipe:

- ``--data-seeds`` (default ``experiments.test_sets.DATA_SEEDS``): per data seed, ``data.fusion_identities`` new
  identities rendered as ``prepare`` renders CAFace's material but with the data seed as the procedural seed (the
  default run's is 0), embedded by the FR model; CAFace trains on all but the last ``fusion.val_identities`` as the
  stage does, and those are drawn into sets as the stage draws its val sets (``ml.fusion.train.val_sets``) and
  scored. The data seeds share no identity and no training item: the unit the claim rests on.
- ``--folds``: on the run's own material, its identities except the last ``fusion.val_identities`` (the val block the
  recipe and the sweeps were chosen on, never a test fold here) cut into contiguous blocks of as many identities;
  per fold CAFace trains on every other identity (the val block included) and the fold is scored. The folds' test
  identities are disjoint; their training sets overlap (k-fold), which the report says.

Both score CAFace's template and plain averaging's by rank-1 against the held-out targets (chance: 1 / identities
scored); the data seeds also score the baselines that weigh a set's items as ``evaluate`` does (``BASELINES``:
norm-weighted, the KP-RPE landmark × face score from the run's DFA aligner) and the renderer's true quality as a
reference. Statistics: the data seed or fold is the unit (``experiments.test_sets.across_test_sets``): the paired
difference in rank-1 per unit, mean ± sample std, how many were higher, a percentile bootstrap interval over
identities (every set of a drawn identity); beyond noise when at least two units, the mean beyond 2 standard errors,
every unit on its side and the interval excluding 0, and Holm's correction over CAFace − each baseline. The folds
train on overlapping identities, so they get spreads and no verdict. Writes ``metrics/fusion_claims.json`` (one
part per way, a run replacing its own) and ``reports/fusion_claims.md`` under ``--root``.
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.test_sets import DATA_SEEDS, across_test_sets, corrected, now_utc
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from tasks.common import Paths, load_params, section, write_json, write_text
from tasks.prepare import DataConfig, procedural_identities
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
        hits.append({"caface": scores["caface/hit"], "average": scores["average/hit"],
                     "labels": np.asarray(sets.labels)})
        rows.append({"fold": f, "identities": [block.start, block.stop - 1], "sets": int(len(sets.labels)),
                     "caface": float(scores["caface/hit"].mean()), "average": float(scores["average/hit"].mean()),
                     "lt": float(scores["caface/lt"].mean()), "lt_average": float(scores["average/lt"].mean()),
                     "seconds": time.perf_counter() - start})
        log.info("fold %d: rank-1 CAFace %.3f, average %.3f (%.0f s)", f, rows[-1]["caface"], rows[-1]["average"],
                 rows[-1]["seconds"])
    return {"folds": rows, "summary": _summary(rows, hits, list(range(len(blocks))), stage),
            "identities": len(material.centres), "val_identities": stage.val_identities, "recipe": _recipe(cfg)}


BASELINES = ("average", "norm_weighted", "landmark_score")  # CAFace's claims: one paired difference each
REFERENCE = "quality_oracle"  # weighted by the renderer's true quality: headroom, neither a method nor a claim
ARM_LABELS = {"caface": "CAFace", "average": "plain average", "norm_weighted": "norm-weighted",
              "landmark_score": "landmark × face score", REFERENCE: "true-quality weights"}


def _summary(rows: list[dict], hits: list[dict[str, np.ndarray]], units: list[int],
             stage: FusionStageConfig) -> dict[str, Any]:
    """Each arm's mean ± sample std over the units, CAFace − each baseline measured (``BASELINES``) with the unit as
    the unit and an interval over identities, Holm's verdicts over those differences (``holm``), chance."""
    arms = [a for a in ("caface", *BASELINES, REFERENCE) if all(a in r for r in rows)]
    summary = {arm: {"mean": float(np.mean([r[arm] for r in rows])), "std": float(np.std([r[arm] for r in rows],
                                                                                       ddof=1))}
               for arm in arms}
    labels = [h["labels"] for h in hits] if all("labels" in h for h in hits) else None
    diffs = {f"caface_minus_{b}": across_test_sets([h["caface"] for h in hits], [h[b] for h in hits], units,
                                                   identities=labels)
             for b in BASELINES if b in arms}
    for d, rejected in zip(diffs.values(), corrected(list(diffs.values()))):
        d["holm"] = rejected
    return {**summary, **diffs, "chance": 1.0 / stage.val_identities}


def _baseline_hits(val: Any, landmarks: np.ndarray, scores: np.ndarray, quality: np.ndarray,
                   image_size: float) -> dict[str, np.ndarray]:
    """Per val set, whether the template of each baseline that needs more than features (norm-weighted: the raw
    features; landmark × face score: the aligner's landmarks and face score of each item; the true-quality reference)
    has its own identity's target nearest. ``landmarks`` (S, n, 5, 2), ``scores`` / ``quality`` (S, n): per set item,
    as ``val.features`` (S, n, D)."""
    import torch
    import torch.nn.functional as F

    from ml.fusion.sets import fuse_templates

    s, n, dim = val.features.shape
    feats, groups = val.features.reshape(s * n, dim).numpy(), np.repeat(np.arange(s), n)
    extra = {"norm_weighted": {},
             "landmark_score": {"landmarks": landmarks.reshape(s * n, 5, 2), "face_scores": scores.reshape(-1),
                                "image_size": image_size},
             REFERENCE: {"quality": quality.reshape(-1)}}
    out = {}
    for method, kwargs in extra.items():
        templates = F.normalize(torch.from_numpy(fuse_templates(method, feats, groups, **kwargs)), dim=-1)
        out[method] = ((templates @ val.centres.T).argmax(dim=1) == val.labels).numpy()
    return out


def _recipe(cfg: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def scored_identities(data: DataConfig, data_seed: int) -> dict[str, tuple[int, range]]:
    """The identities ``_data_seed_run`` renders for ``data_seed``, as {name: (procedural seed, identities)}: the
    default run's fusion layout (``tasks.prepare.procedural_identities``) drawn with the data seed as the seed."""
    return {"fusion": (data_seed, procedural_identities(dataclasses.replace(data, seed=data_seed))["fusion"])}


def _data_seed_run(root: str, data: DataConfig, stage: FusionStageConfig, data_seed: int,
                   threads: int = 0) -> dict[str, Any]:
    """One data seed: ``fusion_identities`` identities rendered afresh (procedural seed ``data_seed``), the frozen FR
    model's features of them, CAFace trained as the stage trains it on all but the last ``val_identities``, and
    CAFace's template, each baseline's (``BASELINES``) and the true-quality reference's scored on sets of those, on
    ``threads`` torch threads (0: as they are). → the row, with the per-set hits under ``_hits``."""
    import tempfile

    import torch

    from ml.data.procedural import ProceduralFaces
    from ml.fusion.train import train_fusion, val_scores
    from ml.models.io import load_model
    from tasks.prepare.sets import fusion_set
    from tasks.train_fusion import procedural_material, split_val

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    model, fr_config = load_model(Paths(Path(root)).fr_model(stage.fr_source))
    contract = fr_config["input_contract"]
    cfg = dataclasses.replace(stage.train, feature_dim=int(contract["embedding_dim"]),
                              style_dim=int(contract["style_dim"]))
    fresh = dataclasses.replace(data, seed=data_seed)
    with tempfile.TemporaryDirectory(prefix=f"fusion-claims-{data_seed}-") as tmp:
        paths = Paths(Path(tmp))
        fusion_set(paths.fusion_set, ProceduralFaces(fresh.procedural_config(aligned=True), seed=data_seed), fresh,
                   progress=False)
        material = procedural_material(model, paths, fresh)
        train, held = split_val(material, stage)  # the held-out block: never read until it is scored
        landmarks, face_scores, quality = _item_faces(Paths(Path(root)), paths, material, held, fresh)
    res = train_fusion(cfg, train.features, train.styles, train.labels, sources=train.sources,
                       centres=train.centres, progress=False)
    scores = val_scores(res.model, held)
    hits = {"caface": scores["caface/hit"], "average": scores["average/hit"],
            **_baseline_hits(held, landmarks, face_scores, quality, float(fresh.image_size)),
            "labels": np.asarray(held.labels)}
    row = {"data_seed": data_seed, "identities": int(len(material.centres)), "sets": int(len(held.labels)),
           **{arm: float(h.mean()) for arm, h in hits.items() if arm != "labels"},
           "lt": float(scores["caface/lt"].mean()), "lt_average": float(scores["average/lt"].mean()),
           "seconds": time.perf_counter() - start}
    log.info("data seed %d: rank-1 %s (%.0f s)", data_seed,
             ", ".join(f"{arm} {row[arm]:.3f}" for arm in ("caface", *BASELINES, REFERENCE)), row["seconds"])
    return {**row, "_hits": hits}


def _item_faces(run: Paths, rendered: Paths, material: FusionMaterial, held: Any,
                data: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(landmarks (S, n, 5, 2) px, face scores (S, n), true quality (S, n)) of the items of ``held``'s sets: the
    finished run's DFA aligner (``models/aligner``) on those degraded images, exactly as ``evaluate`` weighs video
    frames (``tasks.evaluate.fusion.face_inputs``: without an aligner, or its face score, the manifest's)."""
    from ml.data.dataset import load_images, read_manifest
    from tasks.evaluate.fusion import face_inputs, load_frame_aligner

    manifest = read_manifest(rendered.fusion_set / "manifest.parquet")
    degraded = manifest[manifest["split"] == "degraded"].reset_index(drop=True)  # the material's rows, in order
    first = len(material.centres) - len(held.centres)
    rows = np.flatnonzero(material.labels >= first)[held.rows.numpy()]  # (S, n) rows of the material
    used, inverse = np.unique(rows, return_inverse=True)
    items = degraded.iloc[used].reset_index(drop=True)
    images = load_images(rendered.fusion_set, items, expected_size=(data.image_size, data.image_size), progress=False)
    landmarks, scores = face_inputs(load_frame_aligner(run), images, items, batch_size=256)
    quality = items["quality"].fillna(1.0).to_numpy(np.float32)
    shape = rows.shape
    return (landmarks[inverse].reshape(*shape, 5, 2), scores[inverse].reshape(shape),
            quality[inverse].reshape(shape))


def run_data_seeds(paths: Paths, data: DataConfig, stage: FusionStageConfig, data_seeds: list[int],
                   workers: int = 1) -> dict[str, Any]:
    """CAFace against averaging on freshly rendered identities per data seed (``_data_seed_run``), ``workers``
    data seeds at once on one thread each → {"data_seeds": one row per data seed, "summary", ...}."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    if data.ingested:
        raise ConfigError("--data-seeds renders procedural identities; this run ingests real faces (data.ingest_*): "
                          "use --folds")
    if not stage.val_identities:
        raise ConfigError("fusion.val_identities is 0: a data seed's held-out block has no identities to score")
    fr_dir = paths.fr_model(stage.fr_source)
    if not (fr_dir / "config.json").is_file():
        raise DataError(f"fusion.fr_source is {stage.fr_source!r} but {fr_dir} holds no model: run `make run` first")
    args = [(str(paths.root), data, stage, d, 1 if workers > 1 else 0) for d in data_seeds]
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            rows = list(pool.map(_data_seed_run, *zip(*args)))
    else:
        rows = [_data_seed_run(*a) for a in args]
    hits = [r.pop("_hits") for r in rows]
    return {"data_seeds": rows, "summary": _summary(rows, hits, list(data_seeds), stage),
            "val_identities": stage.val_identities, "recipe": _recipe(stage.train)}


def _verdict(d: dict[str, Any], unit: str, baseline: str) -> str:
    """One difference's sentence: mean ± sample std over the units, the sign count, the bootstrap interval and the
    verdict, Holm-corrected over the table's differences where they were (``d["holm"]``)."""
    over = "identities" if d.get("resampled") == "identities" else "sets"
    text = (f"CAFace − {ARM_LABELS[baseline]} over the {d['units']} {unit}s: {100 * d['mean']:+.1f} ± "
            f"{100 * d['std']:.1f} pp (higher in {d['higher']} of {d['units']}; 95 % bootstrap over {over} "
            f"{100 * d['ci_low']:+.1f} to {100 * d['ci_high']:+.1f}")
    p = "" if d.get("p") is None else ("; p < 0.001" if d["p"] < 0.001 else f"; p {d['p']:.3f}")
    if "holm" not in d:
        return text + "): " + ("**beyond noise**" if d["beyond_noise"] else "**not beyond noise**")
    if d["beyond_noise"] and d["holm"]:
        return text + f"{p}): **beyond noise, and after Holm**"
    if d["beyond_noise"]:
        return text + f"{p}): **beyond noise alone, not after Holm**"
    return text + f"{p}): **not beyond noise**"


def _section(title: str, protocol: str, part: dict[str, Any], unit: str, label: Any,
             independent: bool = True) -> list[str]:
    """A part's section: its protocol, one table row per unit (``label(row)``: the unit's first cells; one column
    per arm measured), the verdict on CAFace − each baseline with that unit; units that are not ``independent``
    (folds whose training sets overlap) get their spread, never a verdict."""
    summary, head = part["summary"], label(None)
    rows = part[unit.replace(" ", "_") + "s"]
    arms = [a for a in ("caface", *BASELINES, REFERENCE) if all(a in r for r in rows)]
    baselines = [b for b in BASELINES if f"caface_minus_{b}" in summary]
    cols = " | ".join(ARM_LABELS[a] for a in arms) + " | " + " | ".join(f"CAFace − {ARM_LABELS[b]}" for b in baselines)
    lines = [f"## {title}", "", protocol, "", f"| {head} {cols} | Lt / Lt of averaging | s |",
             "|---" * (head.count("|") + len(arms) + len(baselines) + 2) + "|"]
    for r in rows:
        lines.append(f"| {label(r)} | " + " | ".join(f"{100 * r[a]:.1f}" for a in arms) + " | "
                     + " | ".join(f"{100 * (r['caface'] - r[b]):+.1f}" for b in baselines)
                     + f" | {r['lt'] / r['lt_average']:.3f} | {r['seconds']:.0f} |")
    if not independent:
        d = summary["caface_minus_average"]
        return lines + ["", f"CAFace − averaging over the {d['units']} {unit}s: {100 * d['mean']:+.1f} ± "
                        f"{100 * d['std']:.1f} pp (higher in {d['higher']} of {d['units']}). No verdict: the {unit}s "
                        "train on overlapping identities, so they are not independent units; read this as the "
                        "spread over test identities, and the fresh data seeds for the claim.", ""]
    lines.append("")
    lines += [f"- {_verdict(summary[f'caface_minus_{b}'], unit, b)}." for b in baselines]
    rule = (f"Beyond noise: at least two {unit}s, the mean beyond 2 standard errors, every {unit} on its side and the "
            "interval excluding 0")
    if len(baselines) > 1 and all("holm" in summary[f"caface_minus_{b}"] for b in baselines):
        rule += (f"; after Holm: also the one-sample t-test's p over the {unit}s survives Holm's correction for the "
                 f"{len(baselines)} differences of this table")
    lines += ["", rule + "."]
    if REFERENCE in arms:
        lines += ["", f"{ARM_LABELS[REFERENCE].capitalize()}: the items weighted by the quality the renderer gave them, "
                  "a reference for how much knowing each item's quality is worth here, neither a method nor a bound."]
    return lines + [""]


def render_data_seeds(part: dict[str, Any]) -> list[str]:
    """The fresh-identities section: one row per data seed, the verdict with the data seed as the unit."""
    rows, held = part["data_seeds"], part["val_identities"]
    protocol = (
        f"Measured on {part['measured_at']} in {part['seconds'] / 60:.0f} minutes. Each data seed renders "
        f"{rows[0]['identities']} new procedural identities as `prepare` renders CAFace's material (procedural seed = "
        "the data seed; the default run's is 0), the default run's frozen FR model embeds them, and CAFace trains "
        f"with `params.yaml`'s recipe on all but the last {held}, as the stage does. Chosen on: nothing here (the "
        "recipe was chosen on the default run's val block, data seed 0). Scored on: each data seed's last "
        f"{held} identities, drawn into {rows[0]['sets']} sets as the stage's val sets are, read once; the data seeds "
        "share no identity and no training item. Rank-1 against their targets (%); chance "
        f"{100 * part['summary']['chance']:.1f}.")
    return _section("Fresh identities per data seed", protocol, part, "data seed",
                    lambda r: "data seed |" if r is None else str(r["data_seed"]))


def render_folds(part: dict[str, Any]) -> list[str]:
    """The folds section: one row per fold of the finished run's identities and their spread (no verdict: the folds'
    training sets overlap)."""
    rows, held = part["folds"], part["val_identities"]
    protocol = (
        f"Measured on {part['measured_at']} in {part['seconds'] / 60:.0f} minutes, on a finished run's fusion "
        f"material ({part['identities']} identities, the frozen FR model's features). Chosen on: the last {held} "
        "identities (the val block the recipe and the sweeps read), never scored here. Scored on: "
        f"{len(rows)} folds of {held} other identities, each drawn into {rows[0]['sets']} sets as the stage's val sets "
        "are; per fold CAFace is trained with `params.yaml`'s recipe on every other identity (so the folds' training "
        "sets overlap; their test identities do not). Rank-1 against the fold's targets (%); chance "
        f"{100 * part['summary']['chance']:.1f}.")
    return _section("Folds of the default run's identities", protocol, part, "fold",
                    lambda r: "fold | identities |" if r is None
                    else f"{r['fold']} | {r['identities'][0]}-{r['identities'][1]}", independent=False)


def stored(results: dict[str, Any]) -> dict[str, Any]:
    """``metrics/fusion_claims.json`` as {"data_seeds": part, "folds": part} (a file from before the data seeds
    holds the folds part alone)."""
    return {"folds": results} if "summary" in results else results


def render(results: dict[str, Any]) -> str:
    """Markdown: the protocol and verdict of each part measured (fresh data seeds first, then folds)."""
    results = stored(results)
    lines = ["# CAFace against its baselines on independent test sets", "",
             "Does CAFace's gain over averaging, and over the baselines that weigh a set's items (norm-weighted, "
             "landmark × face score), hold on identities no choice read? Two ways to get independent test "
             "sets: fresh identities per data seed (`--data-seeds`, the claim's unit), and folds of the default "
             "run's own identities (`--folds`).", ""]
    if "data_seeds" in results:
        lines += render_data_seeds(results["data_seeds"])
    if "folds" in results:
        lines += render_folds(results["folds"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.fusion_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository with a finished run (default: .)")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--data-seeds", type=int, nargs="+", default=list(DATA_SEEDS),
                     help="render fresh identities per data seed, each an independent test set (the default)")
    how.add_argument("--folds", type=int, default=0,
                     help="instead: test folds of fusion.val_identities of the finished run's own identities each")
    parser.add_argument("--workers", type=int, default=2, help="data seeds at once, one thread each")
    parser.add_argument("--render", action="store_true", help="only rewrite the report from metrics/fusion_claims.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    paths = Paths(args.root.resolve())
    metrics, out = paths.root / "metrics" / "fusion_claims.json", paths.root / "reports" / "fusion_claims.md"
    results = stored(json.loads(metrics.read_text())) if metrics.is_file() else {}
    if not args.render:
        start = time.perf_counter()
        try:
            params = load_params(paths.params)
            stage = from_mapping(FusionStageConfig, section(params, "fusion"), "fusion")
            data = from_mapping(DataConfig, section(params, "data"), "data")
            if args.folds:
                key, part = "folds", run_folds(paths, data, stage, args.folds, progress=True)
            else:
                key, part = "data_seeds", run_data_seeds(paths, data, stage, args.data_seeds, args.workers)
        except (ConfigError, DataError) as exc:
            parser.exit(2, f"error: {exc}\n")
        results[key] = {**part, "seconds": time.perf_counter() - start, "measured_at": now_utc()}
        write_json(metrics, results)
    write_text(out, render(results))
    print(out.read_text())


if __name__ == "__main__":
    main()
