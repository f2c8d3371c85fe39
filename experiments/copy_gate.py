"""Does ``synthesize`` catch a memorised face as it leaves a latent generator? ``python -m experiments.copy_gate``.

A generator that memorised a training face emits it through its decoder, slightly off. This plants such faces on a
finished run's own models (``models/generator`` and its autoencoder, ``models/fr/<synthesize.fr_source>``, the DFA
aligner) and passes them through both memorisation gates as the stage calibrates them:

- the cosine gate: the FR cosine to the nearest of the sampled real training faces (``synthesize`` samples 2,000)
  above ``synthesize.max_face_cosine``'s threshold (a percentile of never-trained faces' nearest same-identity face);
- the pixel copy gate: the RMS pixel difference to the nearest training face made at the generator's size and
  passed through its decoder, below ``synthesize.max_copy_distance``'s threshold (a percentile of the training
  faces' distance to the nearest other one; ``tasks.synthesize.pixel_copies``).

What is planted: **copies**, training faces from the cosine gate's own sample encoded, their latents moved by
ε·σ (σ: the latents' std; ε = 0 is the decoder's exact reconstruction) and decoded; **lookalikes**, the val photos
of training identities, decoded (other photos of training people, not copies: the gates should pass them, but for
their percentile); and the run's own **synthetic set**. Per kind, the share each gate flags. No test split is read.
Writes ``metrics/copy_gate.json`` and ``reports/copy_gate.md`` under ``--root``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.test_sets import now_utc
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from tasks.common import Paths, load_params, section, write_json, write_text

log = logging.getLogger("experiments.copy_gate")
EPS = (0.0, 0.1, 0.2, 0.3, 0.5)  # latent offsets of the planted copies, in units of the latents' std
COPIES = 200  # planted copies per offset


def _decode_off(autoencoder: Any, faces: np.ndarray, eps: float, seed: int) -> np.ndarray:
    """uint8 ``faces`` encoded, their latents moved by ``eps`` × their std (seeded Gaussian), decoded."""
    import torch

    from ml.generator.autoencoder import reconstruct
    from ml.generator.uiface import decode_latents

    _, latents = reconstruct(autoencoder, faces)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = decode_latents(autoencoder, latents + eps * latents.std() * noise).clamp(-1, 1)
    return ((y + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def measure(paths: Paths) -> dict[str, Any]:
    """Each planted kind's share flagged by the cosine gate, the copy gate and either, with both thresholds."""
    from ml.aligner.dfa import load_aligner
    from ml.data.dataset import landmarks_array, load_images, read_manifest
    from ml.generator.autoencoder import reconstruct
    from ml.generator.diversity import nearest_real
    from ml.generator.gates import nearest_image
    from tasks.prepare import DataConfig
    from tasks.synthesize import (
        SynthesizeConfig, calibrated_gates, copy_reference, embed_generated, load_generator_for,
    )
    from tasks.train_generator import GeneratorStageConfig, identity_embeddings, load_fr, resize_faces

    params = load_params(paths.params)
    cfg = from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    generator_cfg = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    if not (paths.generator_model / "config.json").is_file():
        raise DataError(f"{paths.generator_model} holds no generator: run `make run` first")
    _, extra, autoencoder = load_generator_for(paths, generator_cfg)
    if autoencoder is None:
        raise ConfigError("the run's generator is a pixel design: no decoder for a copy to come back through")
    size = int(extra["image_size"])  # the faces' side the generator makes (its latent side × the decoder's factor)
    fr, _, _ = load_fr(paths, cfg.fr_source, "synthesize.fr_source")
    aligner, _ = load_aligner(paths.aligner_model)
    rows = read_manifest(paths.train_set / "manifest.parquet")
    train = rows[rows["split"] == "train"].reset_index(drop=True)
    sampled = train.sample(n=min(len(train), 2000), random_state=cfg.seed).reset_index(drop=True)  # as synthesize
    sampled_faces = load_images(paths.train_set, sampled, progress=True)
    real_emb = identity_embeddings(fr, sampled_faces, landmarks_array(sampled))
    cosine = calibrated_gates(cfg, fr, paths, real_emb, sampled["label"].to_numpy())["memorisation"]
    reference, _, copy = copy_reference(cfg, paths, size, lambda x: reconstruct(autoencoder, x)[0])

    def flagged(faces: np.ndarray) -> dict[str, float]:
        emb, _, _ = embed_generated(fr, aligner, faces, data.image_size)
        cos = nearest_real(emb, np.zeros(len(emb), np.int64), real_emb, sampled["label"].to_numpy())["face_max_cos"]
        dist = nearest_image(faces, reference)[0]
        by_cos, by_pixels = cos > cosine.value, dist < copy.value
        return {"faces": len(faces), "cosine_median": float(np.median(cos)), "rms_median": float(np.median(dist)),
                "cosine_gate": float(by_cos.mean()), "copy_gate": float(by_pixels.mean()),
                "either": float((by_cos | by_pixels).mean())}

    small = resize_faces(sampled_faces[:COPIES], size)
    kinds = {f"copies, ε = {eps:g}": flagged(_decode_off(autoencoder, small, eps, seed=i))
             for i, eps in enumerate(EPS)}
    val = rows[rows["split"] == "val"].reset_index(drop=True)
    kinds["lookalikes: val photos of training people, decoded"] = flagged(
        reconstruct(autoencoder, resize_faces(load_images(paths.train_set, val, progress=True), size))[0])
    synthetic = read_manifest(paths.synthetic_set / "manifest.parquet")
    kinds["the run's synthetic set"] = flagged(resize_faces(load_images(paths.synthetic_set, synthetic), size))
    for kind, row in kinds.items():
        log.info("%s: cosine gate %.3f, copy gate %.3f", kind, row["cosine_gate"], row["copy_gate"])
    return {"kinds": kinds, "size": size,
            "cosine": {"threshold": cosine.value, "source": cosine.source, "reference_median": cosine.reference_median},
            "copy": {"threshold": copy.value, "source": copy.source, "reference_median": copy.reference_median}}


def render(results: dict[str, Any]) -> str:
    """Markdown: the protocol, both thresholds, one row per planted kind."""
    cos, copy = results["cosine"], results["copy"]
    lines = [
        "# Memorised faces through the decoder: the cosine gate and the copy gate", "",
        f"`python -m experiments.copy_gate`, measured on {results['measured_at']} in "
        f"{results['seconds'] / 60:.0f} minutes on a finished run's models. Chosen on: nothing (both thresholds are "
        "`synthesize`'s calibrated ones). Read: training faces and the val photos of training identities (no test "
        f"split). Faces at the generator's size, {results['size']} px.", "",
        f"- cosine gate (`synthesize.max_face_cosine`): FR cosine to the nearest sampled training face above "
        f"{cos['threshold']:.3f} ({cos['source']}; a second photo of a person sits at median "
        f"{cos['reference_median']:.3f});",
        f"- copy gate (`synthesize.max_copy_distance`): RMS pixel difference to the nearest training face through "
        f"the decoder below {copy['threshold']:.4f} ({copy['source']}; two distinct training faces sit at median "
        f"{copy['reference_median']:.4f}).", "",
        "| planted | faces | FR cosine (median) | RMS (median) | cosine gate flags | copy gate flags | either |",
        "|---|---|---|---|---|---|---|"]
    for kind, r in results["kinds"].items():
        lines.append(f"| {kind} | {r['faces']} | {r['cosine_median']:.3f} | {r['rms_median']:.4f} | "
                     f"{100 * r['cosine_gate']:.1f} % | {100 * r['copy_gate']:.1f} % | {100 * r['either']:.1f} % |")
    lines += ["", "Copies: training faces from the cosine gate's own sample (so it has each original to compare "
              "with), encoded, their latents moved by ε × the latents' std and decoded: what a generator that "
              "memorised them emits. Lookalikes should pass (a gate flags about its percentile of them); the synthetic "
              "set fails the stage when more than `synthesize.max_memorised_fraction` of it is flagged.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.copy_gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="repository with a finished run (default: .)")
    parser.add_argument("--render", action="store_true", help="only rewrite the report from metrics/copy_gate.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    paths = Paths(args.root.resolve())
    metrics, out = paths.root / "metrics" / "copy_gate.json", paths.root / "reports" / "copy_gate.md"
    if args.render:
        results = json.loads(metrics.read_text())
    else:
        start = time.perf_counter()
        try:
            results = measure(paths)
        except (ConfigError, DataError) as exc:
            parser.exit(2, f"error: {exc}\n")
        results = {**results, "seconds": time.perf_counter() - start, "measured_at": now_utc()}
        write_json(metrics, results)
    write_text(out, render(results))
    print(out.read_text())


if __name__ == "__main__":
    main()
