"""Paper claims at embedded scale, mean ± std over seeds: ``python -m experiments.claims [--seeds 0 1 2]``.

1. KP-RPE (keypoint relative position bias) beats the plain ViT of the same size on misaligned procedural
   faces, and is not worse on aligned ones (KP-RPE paper, main claim). "Misaligned" = the aligned crop with
   strong jitter (rotation std 12°, log-scale std 0.12, shift std 6 % of the side); fully unaligned crops
   (``aligned=False``) are also offered (``--conditions``) but need more data than this scale to learn at all.
2. The LVFace staged schedule (margin + PartialFC sampling, then prototype-stabilised centres) is at least
   as good as plain ArcFace for the same budget (LVFace paper).

Each arm trains on the same procedural identities and is scored by 10-fold verification accuracy (flip TTA)
on pairs of held-out identities. Keypoints are the generator's exact landmarks. Writes
``reports/claims.md`` and ``metrics/claims.json``; every number is measured in the run that writes them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import time
from pathlib import Path

import numpy as np

from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.eval.metrics import verification_accuracy
from ml.train.fr import FRConfig, embed, train

log = logging.getLogger("experiments.claims")
ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Scale:
    train_identities: int = 150
    images_per_identity: int = 12
    test_identities: int = 60
    test_images_per_identity: int = 6
    pairs: int = 1200
    epochs: int = 10
    image_size: int = 64


CONDITIONS = {
    "aligned": {"aligned": True},
    "misaligned": {"aligned": True, "aligned_rotation_deg": 12.0, "aligned_scale_jitter": 0.12, "aligned_shift": 0.06},
    "unaligned": {"aligned": False},
}


def make_split(condition: str, scale: Scale, seed: int = 0) -> dict[str, np.ndarray]:
    config = ProceduralConfig(image_size=scale.image_size, **CONDITIONS[condition])
    gen = ProceduralFaces(config, seed=seed)

    def render(ids: range, per: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        samples = [(k, gen.sample(i, j)) for k, i in enumerate(ids) for j in range(per)]
        return (np.stack([s.image for _, s in samples]), np.array([k for k, _ in samples]),
                np.stack([s.landmarks for _, s in samples]).astype(np.float32))

    x, y, kp = render(range(scale.train_identities), scale.images_per_identity)
    tx, ty, tkp = render(range(scale.train_identities, scale.train_identities + scale.test_identities),
                         scale.test_images_per_identity)
    rng = np.random.default_rng(seed)
    pairs, same = [], []
    for n in range(scale.pairs):
        if n % 2 == 0:
            ident = rng.integers(scale.test_identities)
            a, b = rng.choice(np.flatnonzero(ty == ident), 2, replace=False)
        else:
            ia, ib = rng.choice(scale.test_identities, 2, replace=False)
            a, b = rng.choice(np.flatnonzero(ty == ia)), rng.choice(np.flatnonzero(ty == ib))
        pairs.append((a, b))
        same.append(n % 2 == 0)
    order = rng.permutation(len(pairs))
    return {"x": x, "y": y, "kp": kp, "tx": tx, "tkp": tkp,
            "pairs": np.asarray(pairs)[order], "issame": np.asarray(same)[order]}


def score(cfg: FRConfig, data: dict[str, np.ndarray]) -> tuple[float, float]:
    """(verification accuracy on the held-out pairs, training seconds)."""
    res = train(cfg, data["x"], data["y"], keypoints=data["kp"], progress=False)
    feats = embed(res.model, data["tx"], keypoints=data["tkp"])
    a, b = data["pairs"][:, 0], data["pairs"][:, 1]
    return verification_accuracy(feats[a], feats[b], data["issame"])["accuracy"], res.seconds


def run_claims(seeds: list[int], scale: Scale, only: str | None = None,
               conditions: tuple[str, ...] = ("aligned", "misaligned")) -> dict:
    base = FRConfig(backbone="vit_tiny", epochs=scale.epochs, batch_size=64)
    arms = {
        "kprpe": {
            cond: {"vit_tiny": base, "vit_tiny_kprpe": dataclasses.replace(base, backbone="vit_tiny_kprpe")}
            for cond in conditions
        },
        "lvface": {
            "aligned": {
                "arcface": base,
                "lvface": dataclasses.replace(base, lvface=True, sample_rate=0.5),
            }
        },
    }
    results: dict = {}
    splits = {cond: make_split(cond, scale) for cond in {*conditions, "aligned"}}
    for claim, conditions in arms.items():
        if only and claim != only:
            continue
        for cond, models in conditions.items():
            for name, cfg in models.items():
                accs, secs = [], []
                for seed in seeds:
                    acc, sec = score(dataclasses.replace(cfg, seed=seed), splits[cond])
                    accs.append(acc)
                    secs.append(sec)
                    log.info("%s/%s/%s seed %d: %.4f (%.0fs)", claim, cond, name, seed, acc, sec)
                results.setdefault(claim, {}).setdefault(cond, {})[name] = {
                    "accuracy": accs, "mean": float(np.mean(accs)), "std": float(np.std(accs)),
                    "train_seconds": float(np.mean(secs)),
                }
    return results


def render(results: dict, seeds: list[int], scale: Scale) -> str:
    lines = [
        "# Paper claims at embedded scale",
        "",
        f"Measured by `python -m experiments.claims` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}, "
        f"seeds {seeds}. Verification accuracy (10-fold, flip TTA) on {scale.pairs} pairs of "
        f"{scale.test_identities} held-out procedural identities; training on {scale.train_identities} identities × "
        f"{scale.images_per_identity} images at {scale.image_size}×{scale.image_size}, {scale.epochs} epochs, "
        "`vit_tiny` dims for every arm; conditions: " + ", ".join(f"{k} = {v}" for k, v in CONDITIONS.items()) +
        ". Mean ± std over seeds (the seed changes initialisation, data order and "
        "augmentation; the data are fixed).",
        "",
        "| claim | condition | arm | accuracy | per seed | train s/run |",
        "|---|---|---|---|---|---|",
    ]
    for claim, conds in results.items():
        for cond, arms in conds.items():
            for arm, r in arms.items():
                lines.append(f"| {claim} | {cond} | `{arm}` | {100 * r['mean']:.2f} ± {100 * r['std']:.2f} % | "
                             f"{', '.join(f'{100 * a:.1f}' for a in r['accuracy'])} | {r['train_seconds']:.0f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=Scale.epochs)
    parser.add_argument("--only", choices=["kprpe", "lvface"], default=None)
    parser.add_argument("--conditions", nargs="+", choices=list(CONDITIONS), default=["aligned", "misaligned"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    scale = Scale(epochs=args.epochs)
    start = time.perf_counter()
    results = run_claims(args.seeds, scale, args.only, tuple(args.conditions))
    path = ROOT / "metrics" / "claims.json"
    if args.only and path.is_file():  # keep the other claim's measured numbers
        results = {**json.loads(path.read_text()), **results}
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "claims.md").write_text(render(results, args.seeds, scale))
    log.info("done in %.0fs → reports/claims.md", time.perf_counter() - start)


if __name__ == "__main__":
    main()
