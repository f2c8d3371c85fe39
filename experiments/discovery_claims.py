"""FaceGCD's claims at embedded scale, mean ± std over seeds: ``python -m experiments.discovery_claims``.

FaceGCD (hypernetwork-generated, sample-specific prefixes) discovers unknown identities better than
(a) the FR model's features with the same semi-supervised k-means (the paper's ArcFace row, Tables 1–2) and
(b) a static-prefix ablation, learned prefixes shared by every sample (Table 3).

One FR model (``vit_tiny``, ArcFace) is trained on procedural identities; the discovery set is further identities
it never saw, split the GFD way (half the identities known, half of their training images labelled, 10 % of every
identity held out as test). Each seed trains both FaceGCD arms from the FR model and runs SSK (K = all identities)
with that seed; the FR-features arm differs between seeds only through SSK's seeding. Writes
``reports/discovery_claims.md`` and ``metrics/discovery_claims.json``; every number is measured in that run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.discovery.protocol import gfd_ssk
from ml.discovery.split import gfd_split
from ml.models.io import save_model
from ml.train.discovery import DiscoveryConfig, train_discovery
from ml.train.fr import FRConfig, embed, train

log = logging.getLogger("experiments.discovery_claims")
ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Scale:
    fr_identities: int = 150
    fr_images_per_identity: int = 12
    fr_epochs: int = 10
    discovery_identities: int = 80
    discovery_images_per_identity: int = 20
    discovery_epochs: int = 10
    image_size: int = 64


ARMS = {
    "fr_ssk": "FR features + SSK",
    "facegcd": "FaceGCD (hypernetwork prefixes) + SSK",
    "static_prefix": "static prefix (ablation) + SSK",
}


def _render_set(gen: ProceduralFaces, ids: range, per: int) -> tuple[np.ndarray, np.ndarray]:
    samples = [(k, gen.sample(i, j).image) for k, i in enumerate(ids) for j in range(per)]
    return np.stack([im for _, im in samples]), np.array([k for k, _ in samples])


def make_data(scale: Scale) -> dict[str, np.ndarray]:
    gen = ProceduralFaces(ProceduralConfig(image_size=scale.image_size), seed=0)
    x, y = _render_set(gen, range(scale.fr_identities), scale.fr_images_per_identity)
    first = scale.fr_identities
    dx, dy = _render_set(gen, range(first, first + scale.discovery_identities), scale.discovery_images_per_identity)
    manifest = pd.DataFrame({"path": [f"{i:06d}.png" for i in range(len(dy))], "identity": [f"id{k:04d}" for k in dy],
                             "label": dy})
    split = gfd_split(manifest, seed=0)
    return {"x": x, "y": y, "dx": dx, "dy": dy, "known": split["known"].to_numpy(bool),
            "labelled": split["labelled"].to_numpy(bool), "test": (split["subset"] == "test").to_numpy()}


def run_claims(seeds: list[int], scale: Scale) -> dict:
    data = make_data(scale)
    fr = train(FRConfig(backbone="vit_tiny", epochs=scale.fr_epochs, batch_size=64), data["x"], data["y"],
               progress=False)
    train_mask = ~data["test"]
    results: dict[str, dict[str, list[float]]] = {arm: {} for arm in ARMS}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        fr_dir = Path(tmp) / "fr"
        save_model(fr_dir, fr.model, backbone=fr.backbone, kwargs=fr.backbone_kwargs)
        fr_feats = embed(fr.model, data["dx"])
        for seed in seeds:
            feats = {"fr_ssk": fr_feats}
            for arm, static in (("facegcd", False), ("static_prefix", True)):
                cfg = DiscoveryConfig(static_prefix=static, epochs=scale.discovery_epochs, seed=seed)
                labels = np.where(data["labelled"], data["dy"], -1)[train_mask]
                start = time.perf_counter()
                res = train_discovery(cfg, data["dx"][train_mask], labels, data["labelled"][train_mask],
                                      init_model_dir=fr_dir, progress=False)
                seconds[arm].append(time.perf_counter() - start)
                feats[arm] = res.model.embed(data["dx"], flip=True)  # the flip TTA the FR features get
            for arm, f in feats.items():
                out = gfd_ssk(f, data["dy"], data["labelled"], data["known"], data["test"], seed=seed)
                for key, value in out.metrics.items():
                    results[arm].setdefault(key, []).append(float(value))
                log.info("seed %d %s: test all %.3f novel %.3f | transductive all %.3f novel %.3f", seed, arm,
                         out.metrics["test/all"], out.metrics["test/novel"], out.metrics["transductive/all"],
                         out.metrics["transductive/novel"])
    return {arm: {"values": vals, "mean": {k: float(np.mean(v)) for k, v in vals.items()},
                  "std": {k: float(np.std(v)) for k, v in vals.items()},
                  "train_seconds": float(np.mean(seconds[arm])) if seconds[arm] else 0.0}
            for arm, vals in results.items()}


def render(results: dict, seeds: list[int], scale: Scale) -> str:
    cols = [f"{s}/{k}" for s in ("test", "transductive") for k in ("all", "known", "novel")]
    lines = [
        "# FaceGCD claims at embedded scale",
        "",
        f"Measured by `python -m experiments.discovery_claims` on {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}, "
        f"seeds {seeds}. FR model: `vit_tiny` ArcFace on {scale.fr_identities} × {scale.fr_images_per_identity} procedural "
        f"faces, {scale.fr_epochs} epochs. Discovery set: {scale.discovery_identities} unseen identities × "
        f"{scale.discovery_images_per_identity} images ({scale.image_size}×{scale.image_size}), GFD split (half the "
        "identities known, half of their training images labelled, 10 % test); FaceGCD arms trained "
        f"{scale.discovery_epochs} epochs from the FR model. Clustering accuracy (%, one Hungarian matching over all "
        "identities) after semi-supervised k-means with K = all identities; mean ± std over seeds.",
        "",
        "| arm | " + " | ".join(c.replace("/", " ") for c in cols) + " | train s/run |",
        "|---|" + "---|" * (len(cols) + 1),
    ]
    for arm, r in results.items():
        cells = [f"{100 * r['mean'][c]:.1f} ± {100 * r['std'][c]:.1f}" for c in cols]
        lines.append(f"| {ARMS[arm]} | " + " | ".join(cells) + f" | {r['train_seconds']:.0f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.discovery_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=Scale.discovery_epochs, help="FaceGCD epochs per arm")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    scale = Scale(discovery_epochs=args.epochs)
    start = time.perf_counter()
    results = run_claims(args.seeds, scale)
    (ROOT / "metrics").mkdir(exist_ok=True)
    (ROOT / "metrics" / "discovery_claims.json").write_text(json.dumps(results, indent=2) + "\n")
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "discovery_claims.md").write_text(render(results, args.seeds, scale))
    log.info("done in %.0fs → reports/discovery_claims.md", time.perf_counter() - start)


if __name__ == "__main__":
    main()
