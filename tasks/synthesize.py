"""Stage ``synthesize``: a UIFace synthetic face dataset of identities that do not exist.

1. Identity contexts: ``candidates`` faces sampled with the empty context only, embedded by the FR model
   ``models/fr/<fr_source>`` and filtered greedily to pairwise cosine < ``max_cosine`` (``ml.generator.contexts``).
2. Sampling: ``images_per_identity`` faces per context in ``sampler.mode``, with or without attention injection.
3. Calibrated gates (``ml.generator.gates``), thresholds from real faces of never-trained identities (the GFD
   split's labelled images) under the same FR model unless set by hand: more memorised faces than
   ``max_memorised_fraction`` fails the stage; identities above the privacy threshold to a real training identity
   (``max_real_cosine``) or below the consistency one (``min_identity_consistency``) are dropped, fewer than
   ``min_identities`` left fails. Real faces: up to 2,000 sampled training faces; ``plots/synthetic_privacy.png``.
4. Gate: identity gap ≥ ``min_identity_gap`` and adjacent-pixel correlation ≥ ``min_pixel_correlation``, else the
   stage fails, after writing the metrics and plots and before exporting anything.
5. Export: ``data/synthetic/`` (source ``synthetic``, DFA landmarks per face, ``contexts.npy``), a sample grid; then
   the GX ``synthetic`` suite with per-identity consistency ≥ the consistency threshold.

Metrics (``metrics/synthesize.json``): identity gap, pixel correlation, privacy distributions, SSIM and embedding
diversity, identity consistency, inter-class separation, Improved P/R (k = 10) against real training faces, the
t0 distribution, UNet evaluations per face, each gate's threshold and reference (``synthetic/gate/*``) and the
judges other than the FR model conditioning the generator (``synthetic/judge/*``: ``tasks/synthesize_judges.py``).
Keys are ``synthesize.*`` params.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ml.atomic import atomic_path
from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.generator.sampler import SamplerConfig
from tasks.common import (
    Paths, StageResult, load_params, section, stage_main, write_json,
)
from tasks.prepare import DataConfig
from tasks.synthesize_judges import face_judge, judge_identities, load_identity_judge
from tasks.synthesize_plots import plot_nearest_real, plot_t0, sample_grid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthesizeConfig:
    """``params.yaml`` section ``synthesize``; ``sampler`` holds ml/generator/sampler.py's SamplerConfig keys (its noise
    schedule is the generator's, whatever is written there)."""

    fr_source: str = "real"             # FR model embedding candidate faces into identity contexts
    identity_judge: str = "sface"       # a recogniser nobody here trained judging the identities ('' = none)
    identities: int = 24
    images_per_identity: int = 8
    candidates: int = 96                # empty-context samples to find identity contexts among
    max_cosine: float = 0.4             # kept contexts are pairwise below this cosine
    allow_fewer: bool = False           # fewer identities than asked: continue (true) or stop (false)
    min_identity_consistency: float | None = None  # drop identities agreeing less (None: consistency_percentile)
    consistency_percentile: float = 5.0  # … of never-trained real identities' consistency
    min_identity_gap: float = 0.2       # gate: mean intra-class − mean pairwise inter-class cosine (real faces ≈ 0.6)
    min_pixel_correlation: float = 0.9  # gate: adjacent-pixel correlation (faces ≈ 0.95–0.99, colour noise ≲ 0.8)
    max_real_cosine: float | None = None  # privacy: drop identities closer to a real one (None: privacy_percentile)
    privacy_percentile: float = 50.0    # … of never-trained real identities' nearest training identity
    max_face_cosine: float | None = None  # memorisation: a face this near a real one is a copy (None: percentile)
    memorisation_percentile: float = 99.0  # … of never-trained real faces' nearest face of their own identity
    max_memorised_fraction: float = 0.01   # more copies than this share of the faces: the stage fails
    max_copy_distance: float | None = None  # copy: a face this near (RMS pixels) a decoded training face (None:
    copy_percentile: float = 0.1        # … this percentile of training faces' distance to the nearest other)
    copy_reference_max: int = 10_000    # training faces the copy gate compares with (more: a seeded sample)
    min_identities: int = 2             # fewer left after the drops: the stage fails
    batch_size: int = 64
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(steps=25))
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("identities", "images_per_identity", "candidates", "batch_size", "min_identities",
                    "copy_reference_max"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"synthesize.{key} = {value!r}: need a positive integer")
        if self.images_per_identity < 2:
            raise ConfigError("synthesize.images_per_identity must be ≥ 2: an identity needs genuine pairs")
        if self.candidates < self.identities:
            raise ConfigError(f"synthesize.candidates ({self.candidates}) < synthesize.identities "
                              f"({self.identities}): there must be at least one candidate per identity")
        if not -1.0 < self.max_cosine <= 1.0:
            raise ConfigError(f"synthesize.max_cosine = {self.max_cosine!r}: need a cosine in (−1, 1]")
        for key in ("consistency_percentile", "privacy_percentile", "memorisation_percentile", "copy_percentile"):
            if not 0.0 <= getattr(self, key) <= 100.0:
                raise ConfigError(f"synthesize.{key} = {getattr(self, key)!r}: need a percentile in [0, 100]")
        if not 0.0 <= self.max_memorised_fraction <= 1.0:
            raise ConfigError(f"synthesize.max_memorised_fraction = {self.max_memorised_fraction!r}: need a share "
                              "in [0, 1]")


def load_generator_for(paths: Paths, generator_cfg: Any, model_dir: Path | None = None
                       ) -> tuple[Any, dict[str, Any], Any]:
    """(EMA generator in eval mode, its saved ``extra``, autoencoder or None) from ``model_dir`` (default
    ``models/generator``)."""
    import torch

    from ml.generator.uiface import load_generator
    from ml.models.io import read_model_config
    from tasks.train_generator import generator_autoencoder

    model_dir = model_dir or paths.generator_model
    if not (model_dir / "config.json").is_file():
        raise DataError(f"{model_dir} holds no generator: run `dvc repro train_generator` first.")
    model, _ = load_generator(model_dir)
    extra = read_model_config(model_dir, what="UIFace generator").get("extra", {})
    # channels_last: the UNet's convolutions sample faster on the CPU (oneDNN) and on tensor cores
    model = model.eval().to(memory_format=torch.channels_last)
    return model, extra, generator_autoencoder(paths, extra, generator_cfg, model_dir)


def embed_generated(fr: Any, aligner: Any, faces: np.ndarray, size: int
                    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(unit FR embeddings, landmarks, the aligner's face scores) of generated faces resized to ``size``; with an
    aligner its landmarks are clipped into the face (a prediction past the border of a generated face goes on it),
    without one landmarks and scores are None."""
    from tasks.train_generator import identity_embeddings, resize_faces

    faces = resize_faces(faces, size)
    landmarks = scores = None
    if aligner is not None:
        landmarks, scores = aligner.predict(faces)
        landmarks = np.clip(landmarks, 0.0, float(faces.shape[1] - 1))  # pixel centres 0 … size − 1
    return identity_embeddings(fr, faces, landmarks), landmarks, scores


def sampler_for(cfg: SamplerConfig, extra: dict[str, Any]) -> SamplerConfig:
    """The sampler config with the generator's own noise schedule (T, β range, what the UNet predicts)."""
    schedule = extra.get("noise_schedule", {})
    return dataclasses.replace(
        cfg, train_timesteps=int(schedule.get("num_train_timesteps", cfg.train_timesteps)),
        beta_start=float(schedule.get("beta_start", cfg.beta_start)),
        beta_end=float(schedule.get("beta_end", cfg.beta_end)),
        prediction_type=str(schedule.get("prediction_type", cfg.prediction_type)))


def generate(model: Any, contexts: Any | None, count_per_context: int, cfg: SamplerConfig, *, batch_size: int,
             seed: int, autoencoder: Any = None, desc: str = "sample") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Faces for each row of ``contexts`` (N, id_dim) ``count_per_context`` times, or ``count_per_context`` faces
    with the empty context only when ``contexts`` is None; → (uint8 images (M, H, W, 3), t0 (M,),
    UNet evaluations (M,)). Each batch has its own seed (``seed`` + batch index), so results do not depend on
    how many batches ran before."""
    import torch
    from tqdm.auto import tqdm

    from ml.generator.uiface import decode_latents
    from ml.generator.sampler import sample

    with torch.no_grad():
        if contexts is None:
            cond = model.empty(count_per_context)
            cfg = dataclasses.replace(cfg, mode="two_stage_fixed", t0=0, attention_injection=False)
        else:
            ctx = torch.as_tensor(np.asarray(contexts), dtype=torch.float32)
            cond = model.encode_context(ctx).repeat_interleave(count_per_context, dim=0)
        empty = model.empty_context.detach()
    images, t0s, evals = [], [], []
    total = cond.shape[0]
    with tqdm(total=total, unit="img", desc=desc) as bar:
        for b, start in enumerate(range(0, total, batch_size)):
            part = cond[start:start + batch_size]
            gen = torch.Generator().manual_seed(seed + b)
            res = sample(model.unet, part, empty, model.sample_shape(len(part)),
                         dataclasses.replace(cfg, seed=seed + b), generator=gen)
            x = model.from_unet(res.x0)
            x = x if autoencoder is None else decode_latents(autoencoder, x).float()
            images.append(((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy())
            t0s.append(res.t0.numpy())
            evals.append(res.unet_evals.numpy())
            bar.update(len(part))
    return np.concatenate(images), np.concatenate(t0s), np.concatenate(evals)


def per_identity_consistency(emb: np.ndarray, labels: np.ndarray) -> dict[int, float]:
    """Mean pairwise cosine within each identity (``ml.generator.diversity.per_class_consistency``)."""
    from ml.generator.diversity import per_class_consistency

    return per_class_consistency(emb, labels)


def reference_faces(paths: Paths) -> tuple[Path, Any]:
    """(dataset dir, rows) of real faces of identities the FR model never trained on: the labelled images of the
    GFD split's known identities (labels the discovery methods are given; never a test split)."""
    from tasks.train_discovery import gfd_rows

    dataset, rows = gfd_rows(paths)
    rows = rows[(rows["subset"] == "train") & rows["labelled"]].reset_index(drop=True)
    if rows["identity"].nunique() < 2:
        raise DataError(f"{paths.gfd_split}: the calibrated synthesize gates need labelled images of ≥ 2 known "
                        f"identities, found {rows['identity'].nunique()}; set synthesize.max_real_cosine, "
                        "max_face_cosine and min_identity_consistency by hand")
    return dataset, rows


def calibrated_gates(cfg: SynthesizeConfig, fr: Any, paths: Paths, train_emb: np.ndarray,
                     train_labels: np.ndarray) -> dict[str, Any]:
    """{"privacy", "memorisation", "consistency": Threshold}: each gate's param, or its percentile of the reference
    (``ml.generator.gates``) embedded by ``fr``."""
    from ml.data.dataset import landmarks_array, load_images
    from ml.generator.gates import (
        calibrate, nearest_same_identity, reference_consistency, reference_privacy,
    )
    from tasks.train_generator import identity_embeddings

    dataset, rows = reference_faces(paths)
    emb = identity_embeddings(fr, load_images(dataset, rows, progress=True), landmarks_array(rows))
    labels = rows["label"].to_numpy()
    return {
        "privacy": calibrate(cfg.max_real_cosine, reference_privacy(emb, labels, train_emb, train_labels),
                             cfg.privacy_percentile, "synthesize.max_real_cosine"),
        "memorisation": calibrate(cfg.max_face_cosine, nearest_same_identity(emb, labels),
                                  cfg.memorisation_percentile, "synthesize.max_face_cosine"),
        "consistency": calibrate(cfg.min_identity_consistency, reference_consistency(emb, labels),
                                 cfg.consistency_percentile, "synthesize.min_identity_consistency"),
    }


def gate_metrics(gates: dict[str, Any]) -> dict[str, float]:
    """``synthetic/gate/<gate>/{threshold,reference_median,reference_size,percentile}`` (percentile −1: by hand)."""
    out = {}
    for name, t in gates.items():
        out.update({f"synthetic/gate/{name}/threshold": t.value,
                    f"synthetic/gate/{name}/reference_median": t.reference_median,
                    f"synthetic/gate/{name}/reference_size": float(t.reference_size),
                    f"synthetic/gate/{name}/percentile": -1.0 if t.percentile is None else t.percentile})
    return out


def check_memorisation(cfg: SynthesizeConfig, memorised: np.ndarray, total: int, labels: np.ndarray,
                       privacy: dict[str, np.ndarray], real_rows: Any, gate: Any) -> None:
    """Fail when more than ``max_memorised_fraction`` of the faces sit nearer a real training face than the
    memorisation threshold, naming the synthetic identities and the real faces they copy."""
    if len(memorised) <= cfg.max_memorised_fraction * total:
        return
    worst = memorised[np.argsort(-privacy["face_max_cos"][memorised])][:5]
    nearest = real_rows["path"].to_numpy()[privacy["face_nearest"]]
    pairs = "; ".join(f"synthetic identity {int(labels[i])} face {int(i)} ~ {nearest[i]} "
                      f"(cos {privacy['face_max_cos'][i]:.3f})" for i in worst)
    raise DataError(
        f"memorisation: {len(memorised)} of {total} synthetic faces sit nearer a real training face than "
        f"synthesize.max_face_cosine = {gate.value:.3f} ({gate.source}; a second photo of the same real person "
        f"sits at median {gate.reference_median:.3f}), above synthesize.max_memorised_fraction = "
        f"{cfg.max_memorised_fraction}: {pairs}. The generator reproduces training faces: see "
        "plots/synthetic_privacy.png; train it on more data or for fewer steps")


def copy_reference(cfg: SynthesizeConfig, paths: Paths, size: int,
                   reconstruct: Callable[[np.ndarray], np.ndarray] | None) -> tuple[np.ndarray, Any, Any]:
    """(the training faces (up to ``copy_reference_max``, a seeded sample beyond) made at ``size`` and passed through
    ``reconstruct``, their manifest rows, the copy ``Threshold``): what the copy gate compares with, calibrated on the
    faces' distance to the nearest other one (``ml.generator.gates.pixel_copy_reference``)."""
    from ml.data.dataset import load_images, read_manifest
    from ml.generator.gates import calibrate, pixel_copy_reference
    from tasks.train_generator import resize_faces

    rows = read_manifest(paths.train_set / "manifest.parquet")
    rows = rows[rows["split"] == "train"].reset_index(drop=True)
    if len(rows) > cfg.copy_reference_max:  # a copy of a face outside the sample goes unseen (reference_size)
        rows = rows.sample(n=cfg.copy_reference_max, random_state=cfg.seed).reset_index(drop=True)
    chunks = []
    for i in range(0, len(rows), 2048):  # a chunk at a time: only the generator-sized faces are held
        small = resize_faces(load_images(paths.train_set, rows.iloc[i:i + 2048]), size)
        chunks.append(small if reconstruct is None else reconstruct(small))
    reference = np.concatenate(chunks)
    gate = calibrate(cfg.max_copy_distance, pixel_copy_reference(reference), cfg.copy_percentile,
                     "synthesize.max_copy_distance")
    return reference, rows, gate


def pixel_copies(cfg: SynthesizeConfig, faces: np.ndarray, labels: np.ndarray, paths: Paths,
                 reconstruct: Callable[[np.ndarray], np.ndarray] | None) -> tuple[np.ndarray, Any, np.ndarray]:
    """(copies, the copy ``Threshold``, each face's nearest distance): ``faces`` (N, s, s, 3) as the generator made
    them against ``copy_reference`` (a copy returns through the decoder, its FR cosine down among a second photo's);
    more copies than ``max_memorised_fraction`` fail the stage, naming them and what they copy."""
    from ml.generator.gates import nearest_image

    reference, rows, gate = copy_reference(cfg, paths, faces.shape[1], reconstruct)
    dist, nearest = nearest_image(faces, reference)
    copies = np.flatnonzero(dist < gate.value)
    if len(copies) > cfg.max_memorised_fraction * len(faces):
        pairs = "; ".join(f"synthetic identity {int(labels[i])} face {int(i)} ~ {rows['path'].iloc[nearest[i]]} "
                          f"(RMS {dist[i]:.4f})" for i in copies[np.argsort(dist[copies])][:5])
        raise DataError(
            f"memorisation: {len(copies)} of {len(faces)} synthetic faces are pixel copies of a training face as the "
            f"decoder returns it, nearer than synthesize.max_copy_distance = {gate.value:.4f} ({gate.source}; two "
            f"distinct training faces sit at median {gate.reference_median:.4f}), above "
            f"synthesize.max_memorised_fraction = {cfg.max_memorised_fraction}: {pairs}. The generator reproduces "
            "training faces: train it on more data or for fewer steps")
    return copies, gate, dist


def run(cfg: SynthesizeConfig, data: DataConfig, generator_cfg: Any, paths: Paths, *, tracker: Any = None
        ) -> StageResult:
    from ml.data.dataset import DatasetWriter, landmarks_array, load_images, read_manifest
    from ml.generator.diversity import diversity_report, identity_gap, nearest_real
    from ml.generator.image_diversity import adjacent_pixel_correlation, ssim_diversity
    from ml.aligner.dfa import load_aligner
    from ml.generator.autoencoder import reconstruct
    from ml.generator.contexts import select_identity_contexts
    from tasks.train_generator import identity_embeddings, load_fr, resize_faces
    from tasks.validate import ValidateConfig, validate_manifests

    start = time.perf_counter()
    fr, _, fr_dir = load_fr(paths, cfg.fr_source, "synthesize.fr_source")
    model, extra, autoencoder = load_generator_for(paths, generator_cfg)
    sampler = sampler_for(cfg.sampler, extra)
    aligner, _ = load_aligner(paths.aligner_model)
    judge = load_identity_judge(paths, cfg.identity_judge)

    def embed_faces(faces: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return embed_generated(fr, aligner, faces, data.image_size)

    # 1. identity contexts among empty-context faces
    candidates, _, _ = generate(model, None, cfg.candidates, sampler, batch_size=cfg.batch_size,
                                seed=cfg.seed * 1_000_003, autoencoder=autoencoder, desc="candidates")
    cand_emb, _, _ = embed_faces(candidates)
    keep = select_identity_contexts(cand_emb, cfg.identities, cfg.max_cosine, allow_fewer=cfg.allow_fewer)
    contexts = cand_emb[keep]
    # 2. faces per identity
    faces, t0, evals = generate(model, contexts, cfg.images_per_identity, sampler, batch_size=cfg.batch_size,
                                seed=cfg.seed * 1_000_003 + 7919, autoencoder=autoencoder, desc="synthesize")
    labels = np.repeat(np.arange(len(keep)), cfg.images_per_identity)
    emb, landmarks, face_scores = embed_faces(faces)
    generated, generated_size = faces, faces.shape[1]
    reconstruct_faces = None if autoencoder is None else (lambda x: reconstruct(autoencoder, x)[0])
    faces = resize_faces(faces, data.image_size)
    judged = {} if judge is None else judge_identities(judge, generated, labels, paths, generated_size, cfg.seed)
    # 3. calibrated gates: memorisation fails the stage; privacy and consistency drop identities
    real_rows = read_manifest(paths.train_set / "manifest.parquet")
    real_rows = real_rows[real_rows["split"] == "train"].reset_index(drop=True)
    real_rows = real_rows.sample(n=min(len(real_rows), 2000), random_state=cfg.seed).reset_index(drop=True)
    real_faces = load_images(paths.train_set, real_rows, progress=True)
    real_emb = identity_embeddings(fr, real_faces, landmarks_array(real_rows))
    privacy = nearest_real(emb, labels, real_emb, real_rows["label"].to_numpy())
    plot_nearest_real(faces, labels, privacy, real_faces, paths.plots / "synthetic_privacy.png")
    gates = calibrated_gates(cfg, fr, paths, real_emb, real_rows["label"].to_numpy())
    memorised = np.flatnonzero(privacy["face_max_cos"] > gates["memorisation"].value)
    if gates["memorisation"].value >= 1.0:  # by hand, off: a cosine of 1 + rounding is not a copy
        memorised = memorised[:0]
    check_memorisation(cfg, memorised, len(faces), labels, privacy, real_rows, gates["memorisation"])
    copies, gates["copy"], copy_dist = pixel_copies(cfg, generated, labels, paths, reconstruct_faces)
    consistency = per_identity_consistency(emb, labels)
    before_gates = np.fromiter(consistency.values(), dtype=np.float64)  # not filtered on itself
    too_close = np.flatnonzero(privacy["identity_max_cos"] > gates["privacy"].value)
    if gates["privacy"].value >= 1.0:
        too_close = too_close[:0]
    inconsistent = np.array([c for c, v in consistency.items() if v < gates["consistency"].value], dtype=np.int64)
    kept_ids = np.setdiff1d(np.arange(len(keep)), np.union1d(too_close, inconsistent))
    if len(kept_ids) < cfg.min_identities:
        raise DataError(
            f"only {len(kept_ids)} of {len(keep)} synthetic identities pass the privacy and consistency gates "
            f"(need synthesize.min_identities = {cfg.min_identities}): {len(too_close)} sit closer than "
            f"{gates['privacy'].value:.3f} ({gates['privacy'].source}) to a real training identity, "
            f"{len(inconsistent)} agree less than {gates['consistency'].value:.3f} ({gates['consistency'].source}) — "
            "see plots/synthetic_privacy.png; sample more candidates, lower synthesize.max_cosine, or set "
            "synthesize.max_real_cosine / min_identity_consistency knowingly")
    rows_kept = np.isin(labels, kept_ids)
    faces, landmarks, emb, t0, evals, face_scores = (a[rows_kept] for a in (faces, landmarks, emb, t0, evals,
                                                                              face_scores))
    labels = np.searchsorted(kept_ids, labels[rows_kept])
    contexts = contexts[kept_ids]
    consistency = {new: consistency[int(old)] for new, old in enumerate(kept_ids)}  # per identity: unchanged
    # 4. faces, not noise; identities, not one face: the gate's numbers
    gap = identity_gap(emb, labels)
    pixel_corr = adjacent_pixel_correlation(faces)
    sample_grid(faces, labels, paths.plots / "synthetic_samples.png",
                title=f"UIFace synthetic identities (one per row): identity gap {gap['gap']:.2f}, adjacent-pixel "
                      f"correlation {pixel_corr:.2f}")
    # the numbers and the gate come before the export: a set that fails leaves no dataset behind
    report = diversity_report(emb, labels, real_emb=real_emb, k=min(10, len(emb) - 1, len(real_emb) - 1))
    result = StageResult("synthesize", outputs=[paths.synthetic_set])
    result.metrics = {**report, "synthetic/identities": float(len(kept_ids)), "synthetic/images": float(len(faces)),
                      "synthetic/identity_gap": gap["gap"],  # its intra term is synthetic/identity_consistency
                      "synthetic/inter_class_pair_cos": gap["inter"],
                      "synthetic/adjacent_pixel_correlation": pixel_corr,
                      "synthetic/ssim_diversity": ssim_diversity(faces, labels),
                      "synthetic/max_real_cosine": float(privacy["identity_max_cos"].max()),
                      "synthetic/max_real_cosine_mean": float(privacy["identity_max_cos"].mean()),
                      "synthetic/nearest_real_cosine_p99": float(np.percentile(privacy["face_max_cos"], 99)),
                      "synthetic/dropped_too_close_to_real": float(len(too_close)),
                      "synthetic/dropped_inconsistent": float(len(inconsistent)),
                      "synthetic/memorised_faces": float(len(memorised)),
                      "synthetic/pixel_copies": float(len(copies)),
                      "synthetic/nearest_train_pixel_distance_min": float(copy_dist.min()),
                      **gate_metrics(gates),
                      "synthetic/identity_consistency_min": float(min(consistency.values())),
                      "synthetic/identity_consistency_before_gates": float(before_gates.mean()),
                      "synthetic/identity_consistency_min_before_gates": float(before_gates.min()),
                      "synthetic/t0_mean": float(t0.mean()), "synthetic/t0_std": float(t0.std()),
                      "synthetic/unet_evals_per_image": float(evals.mean()),
                      "synthetic/candidates_kept_fraction": float(len(keep) / cfg.candidates),
                      **face_judge(aligner, faces, face_scores, real_faces, data.image_size, seed=cfg.seed,
                                   generator_size=generated_size, reconstruct=reconstruct_faces),
                      **judged,
                      "synthetic/seconds": time.perf_counter() - start}
    write_json(paths.metrics / "synthesize.json", result.metrics)
    failed = [f"{name} {value:.3f} < synthesize.{key} = {bound}" for name, value, key, bound in (
        ("identity gap", gap["gap"], "min_identity_gap", cfg.min_identity_gap),
        ("adjacent-pixel correlation", pixel_corr, "min_pixel_correlation", cfg.min_pixel_correlation))
        if value < bound]
    if failed:
        raise DataError(
            f"the synthetic set fails the gate: {'; '.join(failed)} (real faces: gap ≈ 0.6, correlation ≈ 0.95–0.99). "
            "The generator did not learn faces that carry their identity — see plots/synthetic_samples.png and "
            "metrics/synthesize.json; train it longer (generator.train.epochs) or in latent space "
            "(generator.space: latent) before training an FR model on its faces")
    # 5. export
    names = [f"syn_{i:05d}" for i in range(len(kept_ids))]
    with DatasetWriter(paths.synthetic_set, name="synthetic", source="synthetic", aligned=True, generator={
        "generator": str(paths.generator_model.relative_to(paths.root)), "fr_model": str(fr_dir.relative_to(paths.root)),
        "sampler": dataclasses.asdict(sampler), "identities": len(kept_ids), "images_per_identity": cfg.images_per_identity,
        "candidates": cfg.candidates, "max_cosine": cfg.max_cosine, "seed": cfg.seed,
    }) as w:
        for img, lm, label in zip(faces, landmarks, labels):
            w.add(img, identity=names[label], split="train", landmarks=lm.reshape(-1))
        np.save(w.tmp_dir / "contexts.npy", contexts.astype(np.float32))
    plot_t0(t0, sampler.train_timesteps, paths.plots / "synthetic_t0.png")
    # 6. the data-quality suite
    manifest = read_manifest(paths.synthetic_set / "manifest.parquet")
    manifest["identity_consistency"] = manifest["label"].map(consistency).astype(float)
    manifest["min_identity_consistency"] = gates["consistency"].value
    report_dir = paths.root / "reports" / "validation_synthetic"
    with atomic_path(report_dir) as tmp:
        tmp.mkdir(parents=True)
        validate_manifests({"synthetic": ("synthetic", manifest)}, data, ValidateConfig(), tmp)

    result.summary = (f"{len(kept_ids)} synthetic identities × {cfg.images_per_identity} faces ({sampler.mode}"
                      f"{' + attention injection' if sampler.attention_injection else ''}, {sampler.steps} DDIM steps): "
                      f"identity gap {gap['gap']:.3f}, identity consistency {report['synthetic/identity_consistency']:.3f}, diversity "
                      f"{report['synthetic/diversity']:.3f} → {paths.synthetic_set}")
    if tracker is not None:
        tracker.log_dataset(paths.synthetic_set, context="synthetic")
        tracker.log_metrics(result.metrics)
        for plot in ("synthetic_samples.png", "synthetic_t0.png", "synthetic_privacy.png"):
            tracker.log_artifact(paths.plots / plot, artifact_path="plots")
        tracker.log_artifact(report_dir, artifact_path="validation")
    return result


@dataclasses.dataclass(frozen=True)
class ProbeSetup:
    """What every generator probe reuses (``probe_setup``): the ``synthesize.fr_source`` FR model that embeds the
    generated faces, the aligner, and the val identities' real faces at ``data.image_size`` — images (N, S, S, 3),
    landmarks (N, 5, 2) at that size (NaN where the source has none), labels (N,), and which are the gallery (N,)."""

    fr: Any
    aligner: Any
    images: np.ndarray
    landmarks: np.ndarray
    labels: np.ndarray
    gallery: np.ndarray


def probe_setup(cfg: SynthesizeConfig, data: DataConfig, paths: Paths) -> ProbeSetup:
    """Load what ``probe_generator`` needs besides the generator, once per sweep process: each identity's
    even-numbered labelled images are its gallery, the odd ones its probes."""
    from ml.aligner.dfa import load_aligner
    from ml.data.dataset import landmarks_array, load_images
    from tasks.train_generator import load_fr, resize_faces

    fr, _, _ = load_fr(paths, cfg.fr_source, "synthesize.fr_source")
    aligner = load_aligner(paths.aligner_model)[0] if (paths.aligner_model / "config.json").is_file() else None
    dataset, rows = reference_faces(paths)
    raw = load_images(dataset, rows)
    landmarks = landmarks_array(rows) * (data.image_size / raw.shape[1])
    return ProbeSetup(fr, aligner, resize_faces(raw, data.image_size), landmarks, rows["label"].to_numpy(),
                      rows.groupby("label").cumcount().to_numpy() % 2 == 0)


def probe_generator(model_dir: Path, generator_cfg: Any, cfg: SynthesizeConfig, data: DataConfig, fr_cfg: Any,
                    paths: Paths, setup: ProbeSetup | None = None) -> dict[str, float]:
    """The generator's val objective (``faceops sweep train_generator``): ``generator.probe`` sets the size of a
    small synthetic set sampled from ``model_dir`` as this stage samples (contexts among empty-context candidates,
    same sampler, no gates) → ``val/identity_gap`` (its identity gap under the ``synthesize.fr_source`` FR model),
    ``val/accuracy`` (a small FR model, params ``fr`` for ``probe.fr_epochs`` epochs, trained on it and scored on real
    faces of val identities — the GFD split's labelled images, never trained on, no test split: nearest class mean
    over ``probe_setup``'s gallery and probes), ``val/chance`` (1 / val identities) and ``val/objective`` = gap +
    accuracy. ``setup``: ``probe_setup``'s, loaded here when not given."""
    from ml.discovery.train import nearest_mean_accuracy
    from ml.fr.train import embed, needs_keypoints, train_fr
    from ml.generator.contexts import select_identity_contexts
    from ml.generator.diversity import identity_gap
    from tasks.train_generator import resize_faces

    setup = setup or probe_setup(cfg, data, paths)
    probe = generator_cfg.probe
    model, extra, autoencoder = load_generator_for(paths, generator_cfg, model_dir)
    sampler = sampler_for(cfg.sampler, extra)
    k = probe.synthetic_identities
    candidates, _, _ = generate(model, None, max(k, round(cfg.candidates * k / cfg.identities)), sampler,
                                batch_size=cfg.batch_size, seed=cfg.seed * 1_000_003, autoencoder=autoencoder,
                                desc="probe candidates")
    cand_emb, _, _ = embed_generated(setup.fr, setup.aligner, candidates, data.image_size)
    keep = select_identity_contexts(cand_emb, k, cfg.max_cosine, allow_fewer=True)
    faces, _, _ = generate(model, cand_emb[keep], probe.images_per_identity, sampler, batch_size=cfg.batch_size,
                           seed=cfg.seed * 1_000_003 + 7919, autoencoder=autoencoder, desc="probe faces")
    labels = np.repeat(np.arange(len(keep)), probe.images_per_identity)
    emb, landmarks, _ = embed_generated(setup.fr, setup.aligner, faces, data.image_size)
    small = train_fr(dataclasses.replace(fr_cfg, epochs=probe.fr_epochs), resize_faces(faces, data.image_size),
                     labels, keypoints=landmarks, progress=False).model.eval()
    keypoints = setup.landmarks if needs_keypoints(small) else None
    real = embed(small, setup.images, keypoints=keypoints, progress=False)
    real = real / np.linalg.norm(real, axis=1, keepdims=True).clip(1e-12)
    gallery, real_labels = setup.gallery, setup.labels
    accuracy = nearest_mean_accuracy(real[gallery], real_labels[gallery], real[~gallery], real_labels[~gallery])
    gap = identity_gap(emb, labels)["gap"]
    return {"val/identity_gap": float(gap), "val/accuracy": accuracy, "val/objective": float(gap) + accuracy,
            "val/chance": 1.0 / len(np.unique(real_labels)), "val/synthetic_identities": float(len(keep))}


def main() -> None:
    from ops.tracking import stage_run
    from tasks.train_generator import GeneratorStageConfig

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(SynthesizeConfig, section(params, "synthesize"), "synthesize")
    data = from_mapping(DataConfig, section(params, "data"), "data")
    generator = from_mapping(GeneratorStageConfig, section(params, "generator"), "generator")
    with stage_run("synthesize", {"synthesize": section(params, "synthesize")}, paths.root) as tracker:
        result = run(cfg, data, generator, paths, tracker=tracker)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "synthesize")
