"""Every method on real faces over a pretrained recogniser: ``python -m experiments.pretrained_real --faces DIR``.

The papers build UIFace, CAFace and FaceGCD on a pretrained face recogniser; a run on real faces can stand on one
through ``faceops import``. This experiment does what ``docs/real-data.md`` tells a user to do and measures it: in a
throw-away copy of the project it writes the aligned faces of ``--faces`` (identity subfolders) to an InsightFace
RecordIO, imports OpenCV Zoo's SFace (``--sface``; the ``reference`` extra ships it) as FR source ``sface`` and runs
the pipeline on the RecordIO (``--preset pretrained``: ``params.yaml``'s budgets, a few sizes fitted to a set of tens
of identities, UIFace's consistency gate off) with SFace as UIFace's, CAFace's and the discovery baselines'
recogniser. The run splits the people by identity: training (the run's own FR model, UIFace, CAFace), held-out
(verification) and discovery identities, none shared. It then reads, from the run's outputs:

- **verification** of the held-out real identities (``evaluate``'s ``real.bin``, 10-fold): SFace beside the run's own
  real-trained model and the pixel baselines (raw pixels, a linear probe on the training identities' pixels);
- **discovery** of the discovery identities (``metrics/discovery.json``): FR + SSK and the clustering baselines on
  SFace's features, FaceGCD (it adapts ViTs only, so the run's own ViT, ``discovery.fr_source``), chance;
- **UIFace on SFace** (``metrics/synthesize.json``): identity consistency of the synthetic identities under SFace
  before the gates against the real training identities' own (the consistency gate's reference), and the share of
  synthetic faces YuNet finds against real faces shrunk to the generator's size;

and measures one thing no stage does, **CAFace on real templates**: the held-out and discovery identities' faces
(nobody trained on them: SFace never saw them, CAFace trained on the training identities) are cut per identity into
one gallery still and templates of ``--frames`` faces, clean and, with CAFace's training degradations
(``data.surveillance``, a copy usable with probability ``usable_fraction``), degraded. Each template is fused by
averaging, the norm-weighted average, KP-RPE's landmark × face score (the run's DFA aligner) and CAFace over SFace's
features and styles, then scored by rank-1 against the gallery stills (chance 1 / identities) and TAR at FAR 1e-2
over every pair of templates. CAFace − averaging and CAFace − the strongest baseline (strongest on these very
templates, which favours the baseline) are paired rank-1 differences with a bootstrap interval over identities
(``experiments.test_sets.across_test_sets``). One set of identities: a single test set, so intervals, not verdicts
over test sets. Nothing here chose a recipe: every stage keeps ``params.yaml``'s, chosen on procedural val splits.

Writes ``metrics/pretrained_real.json`` and ``reports/pretrained_real.md`` (with the run's synthetic and real sample
grids under ``reports/pretrained_real/``); ``--render`` rewrites the report from the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.test_sets import across_test_sets, now_utc
from ml.errors import ConfigError, DataError
from ml.fr.pretrained import reference_sface_file
from tasks.common import Paths, read_stage_metrics, write_json, write_text

log = logging.getLogger("experiments.pretrained_real")

REPO = Path(__file__).resolve().parents[1]
SOURCE = "sface"
FR_SOURCES = ("generator.fr_source", "synthesize.fr_source", "fusion.fr_source", "evaluate.discovery_fr_source")
METHODS = ("average", "norm_weighted", "landmark_score", "caface")
BASELINES = METHODS[:-1]
LABELS = {"average": "average", "norm_weighted": "norm-weighted average", "landmark_score": "landmark × face score",
          "caface": "CAFace"}
CONDITIONS = ("clean", "degraded")
FIGURES = ("synthetic_samples.png", "samples.png")


def faceops(ws: Path, args: list[str], log_file: Path) -> None:
    """``faceops ARGS`` in the workspace ``ws``, its output appended to ``log_file``; DataError naming the log when it
    fails."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    log.info("faceops %s", " ".join(args))
    with log_file.open("a") as out:
        done = subprocess.run([str(bin_dir / "faceops"), *args], cwd=ws, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise DataError(f"`faceops {' '.join(args)}` failed (exit {done.returncode}); its output is in {log_file}")


def run_pipeline(ws: Path, faces: Path, sface: Path, preset: str | None, log_file: Path) -> Path:
    """A copy of the project at ``ws`` that ran on ``faces`` with SFace imported as every stage's FR source."""
    from faceops.workspace import copy_project
    from ml.data.formats import ingest_image_folder, write_recordio

    copy_project(REPO, ws)
    items = ingest_image_folder(faces)
    names = sorted({identity for _, identity in items})
    rec = ws / "data" / "ingest" / "train.rec"
    rec.parent.mkdir(parents=True, exist_ok=True)
    write_recordio(rec, [path.read_bytes() for path, _ in items], [names.index(i) for _, i in items])
    faceops(ws, ["import", str(sface), "--name", SOURCE, "--contract", "sface"], log_file)
    sets = ["--set", f"data.ingest_recordio={rec}"] + [a for key in FR_SOURCES for a in ("--set", f"{key}={SOURCE}")]
    faceops(ws, ["run", *(["--preset", preset] if preset else []), *sets], log_file)
    return rec


def template_split(rows: Any, frames: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per identity (rows shuffled with ``seed``): its first image is its gallery still, the rest are cut into
    templates of ``frames`` images (a remainder dropped). → (gallery rows (G,), template rows (T·frames,),
    template number of each template row (T·frames,)), row positions into ``rows``."""
    rng = np.random.default_rng(seed)
    gallery, members = [], []
    for identity in sorted(rows["identity"].unique()):
        where = rng.permutation(np.flatnonzero((rows["identity"] == identity).to_numpy()))
        usable = (len(where) - 1) // frames * frames
        if usable == 0:
            continue
        gallery.append(where[0])
        for t in range(usable // frames):
            members.extend(where[1 + t * frames: 1 + (t + 1) * frames])
    templates = np.asarray(members, dtype=np.int64)
    return np.asarray(gallery, dtype=np.int64), templates, np.arange(len(templates)) // frames


def all_pairs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every unordered pair of the templates of identities ``ids`` (T,) → (pairs (P, 2), labels (P,) 1 = same)."""
    a, b = np.triu_indices(len(ids), k=1)
    return np.stack([a, b], axis=1), (ids[a] == ids[b]).astype(np.int64)


def real_templates(ws: Path, frames: int = 4, seed: int = 0, batch_size: int = 64) -> dict[str, Any]:
    """CAFace and its baselines on templates of the run's unseen real identities (see the module docstring)."""
    import pandas as pd

    from ml.config import from_mapping
    from ml.data.dataset import load_images, read_manifest
    from ml.fusion.caface import load_caface
    from ml.fusion.diagnostics import rank1_hits
    from ml.fusion.sets import features_and_styles, template_verification
    from ml.models.io import load_model
    from tasks.common import load_params, section
    from tasks.evaluate.fusion import Frames, face_inputs, fuse_frames, load_frame_aligner
    from tasks.prepare import DataConfig
    from tasks.train_fusion import degraded_copies

    paths = Paths(ws)
    data = from_mapping(DataConfig, section(load_params(paths.params), "data"), "data")
    parts = [(d, read_manifest(d / "manifest.parquet")) for d in (paths.heldout_set, paths.discovery_set)
             if (d / "manifest.parquet").is_file()]
    if not parts or any(set(rows["source"]) != {"real"} for _, rows in parts):
        raise DataError(f"{ws} holds no real held-out and discovery faces: run the pipeline on real faces first")
    images = np.concatenate([load_images(d, rows, progress=True) for d, rows in parts])
    rows = pd.concat([rows for _, rows in parts], ignore_index=True)
    gallery, members, groups = template_split(rows, frames, seed)
    ids = rows["identity"].to_numpy()
    template_ids = ids[members][::frames]
    fr_model, _ = load_model(paths.fr_models / SOURCE)
    caface = load_caface(paths.fusion_model)
    aligner = load_frame_aligner(paths)
    still, _ = features_and_styles(fr_model, images[gallery], batch_size=batch_size, resize=True)
    still /= np.linalg.norm(still, axis=1, keepdims=True)
    pairs, labels = all_pairs(template_ids)
    out: dict[str, Any] = {"identities": int(len(gallery)), "templates": int(len(template_ids)), "frames": frames,
                           "genuine_pairs": int(labels.sum()), "impostor_pairs": int((labels == 0).sum()),
                           "chance_rank1": 1.0 / len(gallery), "seed": seed, "conditions": {}}
    for condition in CONDITIONS:
        faces = images[members]
        if condition == "degraded":
            faces = degraded_copies(faces, 1, data.surveillance_config(), np.random.default_rng([seed, 17]))
        feats, styles = features_and_styles(fr_model, faces, batch_size=batch_size, resize=True, progress=True)
        landmarks, scores = face_inputs(aligner, faces, rows.iloc[members], batch_size)
        hits, part = {}, {}
        inputs = Frames(feats, styles, landmarks, scores, np.ones(len(feats), np.float32))
        for method in METHODS:
            fused = fuse_frames(method, inputs, groups, caface, data)
            hits[method] = rank1_hits(fused, template_ids, still, ids[gallery])
            verified = template_verification(fused, pairs, labels, fars=(1e-2,))
            part[method] = {"rank1": float(hits[method].mean()), "tar@far=1e-2": verified["tar@far=1e-2"]}
        best = max(BASELINES, key=lambda m: part[m]["rank1"])
        part["strongest_baseline"] = best
        for name, reference in (("vs_average", "average"), ("vs_strongest", best)):
            part[name] = {k: v for k, v in across_test_sets([hits["caface"]], [hits[reference]], [0],
                                                            identities=[template_ids]).items()
                          if k in ("mean", "ci_low", "ci_high", "resampled")}
        out["conditions"][condition] = part
    return out


def read_run(ws: Path) -> dict[str, Any]:
    """The numbers of the run in ``ws`` this report shows (see the module docstring)."""
    evaluate, synthesize, discovery = (read_stage_metrics(ws, n) for n in ("evaluate", "synthesize", "discovery"))
    verification = {}
    for row, key in ((SOURCE, SOURCE), ("real", "real"), ("synthetic", "synthetic"), ("real_matched", "real_matched"),
                     ("raw_pixels", "baseline/raw_pixels"),
                     ("linear_probe", "baseline/linear_probe"), ("chance", "chance")):
        verification[row] = {m: evaluate.get(f"{key}/verification/real/{m}") for m in ("accuracy", "std")}
    verification[SOURCE]["rank1"] = evaluate.get(f"{SOURCE}/identification/rank1")
    verification["real"]["rank1"] = evaluate.get("real/identification/rank1")
    verification["chance"]["rank1"] = evaluate.get("chance/identification/rank1")
    methods = ("fr_ssk", "kmeans", "agglomerative", "facegcd", "chance")
    found = {m: {k: discovery.get(f"discovery/{m}/transductive/{k}") for k in ("all", "known", "novel")}
             for m in methods}
    uiface = {k: synthesize.get(f"synthetic/{k}") for k in (
        "identity_consistency_before_gates", "gate/consistency/reference_median", "identity_consistency",
        "judge/detector_face_share", "judge/detector_real_at_size_face_share", "judge/face_share",
        "judge/real_at_size_face_share", "judge/identity_auc", "judge/real_at_size_identity_auc",
        "dropped_inconsistent")}
    from ml.data.dataset import read_manifest

    paths = Paths(ws)
    identities = {name: int(read_manifest(d / "manifest.parquet")["identity"].nunique())
                  for name, d in (("train", paths.train_set), ("heldout", paths.heldout_set),
                                  ("discovery", paths.discovery_set))}
    return {"verification": verification, "discovery": found, "uiface": uiface, "identities": identities}


def _pct(value: float | None, fmt: str = ".1%") -> str:
    return "—" if value is None else format(value, fmt)


def render(results: dict[str, Any]) -> str:
    """The Markdown report of ``results`` (``metrics/pretrained_real.json``)."""
    if not results:
        return "# Pretrained recogniser on real faces\n\nNot measured yet: `python -m experiments.pretrained_real`.\n"
    v, d, u, t = results["verification"], results["discovery"], results["uiface"], results["templates"]
    lines = ["# Pretrained recogniser on real faces", "",
             f"`python -m experiments.pretrained_real` ({results['measured_at']}; "
             + ("a finished run's workspace read again" if results.get("reused") else
                f"{results['seconds'] / 60:.0f} min, the run included") + "): "
             f"{results['faces']} real aligned faces of {results['people']} people, OpenCV Zoo's SFace imported as "
             f"`{SOURCE}` and every downstream stage's FR source, {results['budget']}. Nobody here trained SFace; "
             "the identities each part scores were trained on by no model of the run. Every recipe is "
             "`params.yaml`'s, chosen on procedural val splits; these real faces chose nothing and are scored once.",
             "", "## Verification of held-out real identities", "",
             "`evaluate` on `verification/real.bin` (balanced pairs of the held-out identities, 10-fold) and rank-1 "
             "against one gallery image per identity.", "",
             "| embedding | accuracy ± std over the folds | rank-1 |", "|---|---|---|"]
    names = {SOURCE: "SFace (pretrained, imported)", "real": "the run's own ViT (trained on the training identities)",
             "synthetic": "a ViT trained on UIFace's synthetic set (conditioned on SFace)",
             "real_matched": "a ViT trained on as many real identities × images (`real_matched`)",
             "linear_probe": "linear probe on pixels (training identities)", "raw_pixels": "raw pixels",
             "chance": "chance"}
    for row, label in names.items():
        if row not in v:  # a report of an earlier version
            continue
        acc, std = v[row]["accuracy"], v[row]["std"]
        lines.append(f"| {label} | {_pct(acc)}{'' if not std else f' ± {std:.1%}'} | "
                     f"{_pct(v[row].get('rank1'))} |")
    lines += ["", "## CAFace on real templates", "",
              f"{t['identities']} unseen identities (held-out and discovery), one gallery still each and "
              f"{t['templates']} templates of {t['frames']} faces; rank-1 against the stills (chance "
              f"{t['chance_rank1']:.1%}), TAR at FAR 1e-2 over {t['genuine_pairs']} genuine and "
              f"{t['impostor_pairs']:,} impostor template pairs. All fusions over SFace's features; CAFace "
              "over its styles too (`conv_6_relu`, `conv_12_relu`).", "",
              "| fusion | " + " | ".join(f"{c} rank-1 | {c} TAR@1e-2" for c in CONDITIONS) + " |",
              "|---|" + "---|---|" * len(CONDITIONS)]
    for method in METHODS:
        cells = [f"{_pct(t['conditions'][c][method]['rank1'])} | {_pct(t['conditions'][c][method]['tar@far=1e-2'])}"
                 for c in CONDITIONS]
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    lines.append("")
    for c in CONDITIONS:
        part = t["conditions"][c]
        diffs, strongest = [], part["strongest_baseline"]
        for name, ref in (("vs_average", "averaging"), ("vs_strongest", LABELS[strongest])):
            if name == "vs_strongest" and strongest == "average":
                diffs.append("averaging is the strongest baseline")
                continue
            x = part[name]
            diffs.append(f"{x['mean'] * 100:+.1f} pp over {ref} (95 % interval over identities "
                         f"{x['ci_low'] * 100:+.1f} to {x['ci_high'] * 100:+.1f})" if name == "vs_average" else
                         f"{x['mean'] * 100:+.1f} pp over the strongest baseline, the {ref} (chosen on these "
                         f"templates; interval {x['ci_low'] * 100:+.1f} to {x['ci_high'] * 100:+.1f})")
        lines.append(f"- {c}: CAFace rank-1 {'; '.join(diffs)}.")
    lines += ["", "## Discovery of real identities", "",
              f"The {results['identities']['discovery'] or '—'} discovery identities (a share of them labelled, the "
              "rest novel); clustering accuracy over all of them (transductive). FR + SSK and the clustering "
              "baselines cluster SFace's features; FaceGCD adapts the run's own ViT (it adapts ViTs only; SFace is "
              "an ONNX graph).", "", "| method | all | known | novel |", "|---|---|---|---|"]
    names = {"fr_ssk": "FR + SSK (SFace)", "kmeans": "k-means (SFace)", "agglomerative": "agglomerative (SFace)",
             "facegcd": "FaceGCD (the run's ViT)", "chance": "chance"}
    for m, label in names.items():
        lines.append(f"| {label} | " + " | ".join(_pct(d[m][k]) for k in ("all", "known", "novel")) + " |")
    lines += ["", "## UIFace conditioned on SFace", "",
              "| measurement | synthetic faces | real faces |", "|---|---|---|",
              f"| identity consistency under SFace (before the gates) | "
              f"{_pct(u['identity_consistency_before_gates'], '.3f')} | "
              f"{_pct(u['gate/consistency/reference_median'], '.3f')} (training identities' median) |",
              f"| same- vs different-identity ROC AUC under SFace (chance 0.5) | "
              f"{_pct(u['judge/identity_auc'], '.3f')} | {_pct(u['judge/real_at_size_identity_auc'], '.3f')} "
              "(as many training identities, at the generator's size) |",
              f"| YuNet finds a face | {_pct(u['judge/detector_face_share'])} | "
              f"{_pct(u['judge/detector_real_at_size_face_share'])} (shrunk to the generator's size) |",
              f"| the aligner's face score accepts | {_pct(u['judge/face_share'])} | "
              f"{_pct(u['judge/real_at_size_face_share'])} |", "",
              "Synthetic faces (`reports/pretrained_real/synthetic_samples.png`) beside the real faces they were "
              "trained on (`reports/pretrained_real/samples.png`):", "",
              "![synthetic](pretrained_real/synthetic_samples.png) ![real](pretrained_real/samples.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.pretrained_real", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faces", type=Path, help="aligned real faces, one subfolder per identity (required)")
    parser.add_argument("--sface", type=Path, help="SFace's ONNX file (default: the `reference` extra's)")
    parser.add_argument("--preset", default="pretrained", help="the run's preset of presets.yaml (default: "
                        "`pretrained`, params.yaml's budgets sized for a set of tens of identities)")
    parser.add_argument("--frames", type=int, default=4, help="faces per real template (default: 4)")
    parser.add_argument("--workspace", type=Path, help="where the run's copy of the project goes (default: a "
                        "temporary folder, removed after); an existing one that finished its run is reused")
    parser.add_argument("--out-dir", type=Path, default=REPO, help="writes reports/ and metrics/ under it")
    parser.add_argument("--render", action="store_true", help="only rewrite the report from the metrics JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    metrics = args.out_dir / "metrics" / "pretrained_real.json"
    report = args.out_dir / "reports" / "pretrained_real.md"
    if args.render:
        write_text(report, render(json.loads(metrics.read_text()) if metrics.is_file() else {}))
        return
    if args.faces is None or not args.faces.is_dir():
        parser.exit(2, f"error: --faces must be a folder of identity subfolders of aligned faces, got {args.faces}\n")
    start = time.perf_counter()
    scratch = None if args.workspace else Path(tempfile.mkdtemp(prefix="faceops-pretrained-"))
    ws = (args.workspace or scratch / "ws").resolve()
    reused = (ws / "metrics" / "evaluate.json").is_file()
    try:
        if not reused:
            sface = args.sface or reference_sface_file()
            if not sface.is_file():
                raise ConfigError(f"SFace's ONNX file {sface} does not exist: give --sface PATH")
            ws.parent.mkdir(parents=True, exist_ok=True)
            run_pipeline(ws, args.faces.resolve(), sface, args.preset, ws.parent / "pretrained_real.log")
        results = read_run(ws)
        results["templates"] = real_templates(ws, frames=args.frames)
        (report.parent / "pretrained_real").mkdir(parents=True, exist_ok=True)
        for name in FIGURES:
            shutil.copy2(ws / "plots" / name, report.parent / "pretrained_real" / name)
    except (ConfigError, DataError) as exc:
        parser.exit(2, f"error: {exc}\n")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    people = sorted(p.name for p in args.faces.iterdir() if p.is_dir())
    results.update(faces=sum(1 for p in args.faces.rglob("*") if p.is_file()), people=len(people),
                   budget=f"preset `{args.preset}`" if args.preset else "`params.yaml`'s budgets",
                   seconds=time.perf_counter() - start, reused=reused, measured_at=now_utc())
    write_json(metrics, results)
    write_text(report, render(results))
    print(report.read_text())


if __name__ == "__main__":
    main()
