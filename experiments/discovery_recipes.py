"""FaceGCD training recipes against the features they start from: ``python -m experiments.discovery_recipes``.

Which part of the recipe decides whether FaceGCD + SSK lands above or below SSK on the FR features it starts from?
One FR model and one discovery set (``experiments.discovery_claims``' data, data seed 0, which the claims never
score). Each recipe is a delta on ``DiscoveryConfig``'s class defaults (τ 0.07 for both terms, λ 0.35, lr 1e-3,
uniform batches, the last epoch, no anchor), trained from that FR model per seed and scored by SSK on the test
images, paired with SSK on the FR features under the same seed: ``default``; ``gcd`` (no prefixes); ``tau_u_1``
(InfoNCE τ 1.0, GCD's); ``balanced`` (P × K = 8 × 4 batches); ``block_lr_0.1`` (the last block at lr/10);
``val_select`` (2 labelled images per known identity held out, the best epoch kept); ``combined`` (all four).

Writes one JSON line per (recipe, seed) to ``--out`` as it goes (a run cut short keeps what it measured) and
``reports/discovery_recipes.md`` (mean ± sample std over seeds, the paired difference to FR + SSK with its sign count).
``FACEOPS_EXPERIMENT_ACCELERATOR`` (``auto``) and ``FACEOPS_EXPERIMENT_PRECISION`` (``32-true``) choose the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.discovery_claims import Scale, make_data
from experiments.test_sets import DATA_SEEDS, LOOKED_AT, now_utc
from ml.discovery.protocol import gfd_ssk
from ml.models.io import save_model
from ml.discovery.train import DiscoveryConfig, train_discovery
from ml.fr.train import FRConfig, embed, train_fr

log = logging.getLogger("experiments.discovery_recipes")
ROOT = Path(__file__).resolve().parents[1]
KEYS = ("test/all", "test/known", "test/novel")
DATA_SEED = LOOKED_AT[0]  # the discovery set the recipes are chosen on; the claims never score it

RECIPES: dict[str, dict] = {
    "default": {},
    "gcd": {"prefix_length": 0},
    "tau_u_1": {"temperature": 1.0},
    "balanced": {"labelled_identities_per_batch": 8, "images_per_identity": 4},
    "block_lr_0.1": {"block_lr_scale": 0.1},
    "val_select": {"val_per_identity": 2},
    "combined": {"temperature": 1.0, "labelled_identities_per_batch": 8, "images_per_identity": 4,
                 "block_lr_scale": 0.1, "val_per_identity": 2},
}


def device_keys() -> dict[str, str]:
    return {"accelerator": os.environ.get("FACEOPS_EXPERIMENT_ACCELERATOR", "auto"),
            "precision": os.environ.get("FACEOPS_EXPERIMENT_PRECISION", "32-true")}


def run(recipes: list[str], seeds: list[int], scale: Scale, out: Path) -> list[dict]:
    """Train every recipe for every seed; → one row per (recipe, seed) with its and FR + SSK's metrics."""
    data = make_data(scale, DATA_SEED)
    dev = device_keys()
    fr = train_fr(FRConfig(backbone="vit_tiny", epochs=scale.fr_epochs, batch_size=64, **dev), data["x"], data["y"],
               progress=False)
    train_mask = ~data["test"]
    labels = np.where(data["labelled"], data["dy"], -1)[train_mask]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fr_dir = Path(tmp) / "fr"
        save_model(fr_dir, fr.model, backbone=fr.backbone, kwargs=fr.backbone_kwargs)
        fr_feats = embed(fr.model.cpu(), data["dx"], flip=True)
        for seed in seeds:
            base = gfd_ssk(fr_feats, data["dy"], data["labelled"], data["known"], data["test"], seed=seed).metrics
            for name in recipes:
                cfg = DiscoveryConfig(epochs=scale.discovery_epochs, seed=seed, **dev, **RECIPES[name])
                start = time.perf_counter()
                res = train_discovery(cfg, data["dx"][train_mask], labels, data["labelled"][train_mask],
                                      init_model_dir=fr_dir, progress=False)
                seconds = time.perf_counter() - start
                feats = res.model.embed(data["dx"], flip=True)
                m = gfd_ssk(feats, data["dy"], data["labelled"], data["known"], data["test"], seed=seed).metrics
                last = res.history[-1]
                row = {"recipe": name, "seed": seed, "data_seed": DATA_SEED, "measured_at": now_utc(),
                       "seconds": seconds, "best_epoch": res.best_epoch,
                       **{k: float(m[k]) for k in KEYS}, **{f"fr_ssk/{k}": float(base[k]) for k in KEYS},
                       "loss/unsup": float(last["loss/unsup"]), "loss/sup": float(last["loss/sup"]),
                       "first/loss/unsup": float(res.history[0]["loss/unsup"]),
                       "first/loss/sup": float(res.history[0]["loss/sup"])}
                rows.append(row)
                with out.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                log.info("seed %d %-13s test all %.3f (FR+SSK %.3f) novel %.3f (%.3f) in %.0fs", seed, name,
                         row["test/all"], row["fr_ssk/test/all"], row["test/novel"], row["fr_ssk/test/novel"], seconds)
    return rows


def render(rows: list[dict], scale: Scale, note: str = "") -> str:
    """Markdown: per recipe mean ± sample std of test all/novel, and the paired difference to FR + SSK."""
    seeds = sorted({r["seed"] for r in rows})
    data_seed = rows[0].get("data_seed", DATA_SEED)
    lines = [
        "# FaceGCD recipes against their starting features",
        "",
        f"Measured by `python -m experiments.discovery_recipes` on {rows[-1].get('measured_at') or now_utc()}"
        f"{note}, seeds {seeds}. Chosen and scored on: data seed {data_seed}'s test images, a discovery set that "
        f"`experiments.discovery_claims` never scores (its data seeds are {', '.join(map(str, DATA_SEEDS))}): these "
        "numbers chose the default recipe, so they are not an estimate of it. "
        f"FR model: `vit_tiny` ArcFace on {scale.fr_identities} × {scale.fr_images_per_identity}"
        f" procedural faces, {scale.fr_epochs} epochs; discovery set: {scale.discovery_identities} unseen identities × "
        f"{scale.discovery_images_per_identity} images, GFD split; every recipe trained {scale.discovery_epochs} "
        "epochs from the FR model. Clustering accuracy (%) of semi-supervised k-means on the test images; Δ = recipe "
        "− FR features + SSK under the same seed, mean ± sample std (ddof 1) and how many seeds were above.",
        "",
        "| recipe | test all | test novel | Δ all | Δ novel | seeds Δ all > 0 | L_unsup first → last | L_sup first → last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fr = [r for r in rows if r["recipe"] == rows[0]["recipe"]]
    a, n = np.array([r["fr_ssk/test/all"] for r in fr]), np.array([r["fr_ssk/test/novel"] for r in fr])
    lines.append(f"| FR features + SSK | {_ms(a)} | {_ms(n)} | | | | | |")
    for name in dict.fromkeys(r["recipe"] for r in rows):
        sel = [r for r in rows if r["recipe"] == name]
        all_, nov = np.array([r["test/all"] for r in sel]), np.array([r["test/novel"] for r in sel])
        da = all_ - np.array([r["fr_ssk/test/all"] for r in sel])
        dn = nov - np.array([r["fr_ssk/test/novel"] for r in sel])
        lu = f"{np.mean([r['first/loss/unsup'] for r in sel]):.2f} → {np.mean([r['loss/unsup'] for r in sel]):.2f}"
        ls = f"{np.mean([r['first/loss/sup'] for r in sel]):.2f} → {np.mean([r['loss/sup'] for r in sel]):.2f}"
        lines.append(f"| {name} | {_ms(all_)} | {_ms(nov)} | {_ms(da, signed=True)} | {_ms(dn, signed=True)} | "
                     f"{int((da > 0).sum())}/{len(da)} | {lu} | {ls} |")
    lines.append("")
    return "\n".join(lines)


def _ms(values: np.ndarray, signed: bool = False) -> str:
    mean = 100 * float(np.mean(values))
    std = 100 * float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return f"{mean:+.1f} ± {std:.1f}" if signed else f"{mean:.1f} ± {std:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.discovery_recipes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--epochs", type=int, default=6, help="discovery epochs per recipe")
    parser.add_argument("--out", type=Path, default=ROOT / "metrics" / "discovery_recipes.jsonl")
    parser.add_argument("--render", action="store_true", help="only render reports/discovery_recipes.md from --out")
    parser.add_argument("--note", default="", help="appended to the report's first line (e.g. the device)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    scale = dataclasses.replace(Scale(), discovery_epochs=args.epochs)
    if not args.render:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("")
        run(args.recipes, args.seeds, scale, args.out)
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "discovery_recipes.md").write_text(render(rows, scale, args.note))


if __name__ == "__main__":
    main()
