"""UIFace's Table 2 ablation and Table 3 gap at embedded scale, over seeds: ``python -m experiments.uiface_claims``.

Claim (paper Table 2): two-stage sampling with an adaptive switch and attention injection makes a synthetic set more
diverse than CFG with the ID context at every step, and an FR model trained on it verifies real faces better; Table 3:
the gap (REAL − SYN)/SYN at equal budget. On procedural faces (a): a teacher FR model (``vit_tiny``, seed 0) and, per
generator seed (``Scale.generator_seeds``), the generator as the pipeline trains it (an AutoencoderTiny of 32-px
faces, then the lean latent UNet). Per generator and data seed: contexts filtered from empty-context faces; per sampler
mode (``MODES``, make run's ``two_stage_fixed+injection`` among them) K × M faces with the same contexts and noise,
their metrics under the teacher (identity consistency) and in pixels (1 − SSIM within an identity: diversity measured
apart from consistency), and an FR model trained on them, scored on that seed's held-out real identities (b: drawn
with the seed as data seed, so each seed is an independent test set; the defaults are
``experiments.test_sets.DATA_SEEDS``); real-data FR models of the same budget (32-px bottleneck, native 64 px) give
the gap. Units: the data seed (test set) for "beyond noise", its numbers the mean over the generators
(``experiments.test_sets.across_test_sets``, with a bootstrap interval over identities); the generator seed for
stability (``uiface_runs.over_generators``). Writes ``reports/uiface_claims.md``, ``metrics/uiface_claims.json``
and, part by part, ``metrics/uiface_claims_units.jsonl`` (``--resume`` goes on from it); ``--estimate-only`` prints
the expected time. Scale and report: ``uiface_summary``; parts and aggregation: ``uiface_runs``.

Differences from the reference (Sec. 4, appendix A.1), for a CPU run:
- A small AutoencoderTiny and a 2-level latent UNet (v-prediction, min-SNR) trained briefly, not VQ-f4 and 250k
  steps; FR models ``vit_tiny`` on 64-px procedural faces, not IR-50/ArcFace on 112-px CASIA; contexts from the
  teacher's 32-px-face embeddings.
- 25 DDIM steps (paper 50), threshold × Δt/20 (``Scale.threshold_per_paper_step``); 4 context tokens (public: 32).
- Diversity = 1 − SSIM within an identity, not LPIPS (no VGG weights offline); P/R on the teacher's embeddings.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from experiments.test_sets import DATA_SEEDS, now_utc
from experiments.uiface_runs import Units, aggregate
from experiments.uiface_summary import MODES, QUICK, REALS, Scale, effective_threshold, render, scale_of

log = logging.getLogger("experiments.uiface_claims")
ROOT = Path(__file__).resolve().parents[1]

# Seconds per image-epoch of the FR trainer (vit_tiny, 64 px, 2 threads, as measured in reports/claims.md's run)
# plus Lightning's set-up per run; only used for the start-up estimate.
FR_SECONDS_PER_IMAGE_EPOCH = 76.0 / 18000.0
FR_OVERHEAD_SECONDS = 3.0


# ------------------------------------------------------------------------------------------------ the run
def _split_scale(scale: Scale):
    from experiments.claims import Scale as SplitScale

    return SplitScale(train_identities=scale.train_identities, images_per_identity=scale.images_per_identity,
                      test_identities=scale.test_identities, test_images_per_identity=scale.test_images_per_identity,
                      pairs=scale.pairs, image_size=scale.image_size)


def scored_identities(scale: Scale, data_seed: int) -> dict[str, tuple[int, range]]:
    """The identities ``make_data(scale, data_seed)`` verifies, as {name: (procedural seed, identities)}."""
    from experiments.claims import scored_identities as split_identities

    return split_identities("aligned", _split_scale(scale), data_seed)


def make_data(scale: Scale, data_seed: int = 0) -> dict[str, np.ndarray]:
    """(a) x, y and (b) tx with the verification pairs, from ``experiments.claims.make_split`` (aligned faces) with
    ``data_seed``: another seed draws other identities and other pairs."""
    from experiments.claims import make_split

    split = make_split("aligned", _split_scale(scale), seed=data_seed)
    return {k: split[k] for k in ("x", "y", "tx", "ty", "pairs", "issame")}


def through_bottleneck(images: np.ndarray, scale: Scale) -> np.ndarray:
    """Real faces as the generator sees and makes them: down to ``gen_size`` and back up to ``image_size``."""
    from tasks.train_generator import resize_faces

    return resize_faces(resize_faces(images, scale.gen_size), scale.image_size)


def verification(model: Any, tx: np.ndarray, data: dict[str, np.ndarray]) -> float:
    return scored(model, tx, data)[0]


def scored(model: Any, tx: np.ndarray, data: dict[str, np.ndarray]) -> tuple[float, np.ndarray]:
    """The verification accuracy on ``data``'s pairs and each pair's outcome (``pair_correct``)."""
    from ml.eval.metrics import pair_correct, verification_accuracy
    from ml.fr.train import embed

    feats = embed(model, tx)
    a, b = data["pairs"][:, 0], data["pairs"][:, 1]
    return (float(verification_accuracy(feats[a], feats[b], data["issame"])["accuracy"]),
            pair_correct(feats[a], feats[b], data["issame"]))


def fit_fr(images: np.ndarray, labels: np.ndarray, scale: Scale, seed: int, batch_size: int) -> Any:
    from ml.fr.train import FRConfig, train_fr

    cfg = FRConfig(backbone="vit_tiny", epochs=scale.fr_epochs, batch_size=batch_size, seed=seed)
    return train_fr(cfg, images, labels, progress=False)


def train_teacher(scale: Scale, data: dict[str, np.ndarray]) -> tuple[Any, dict[str, Any]]:
    """The teacher FR model (seed 0, the same for every run) and its numbers."""
    log.info("[setup] training the teacher FR model on %d faces (%d identities), %d epochs",
             len(data["x"]), scale.train_identities, scale.fr_epochs)
    teacher = fit_fr(data["x"], data["y"], scale, 0, scale.teacher_batch_size)
    setup: dict[str, Any] = {"teacher_seconds": teacher.seconds,
                             "teacher_accuracy": verification(teacher.model, data["tx"], data),
                             "teacher_accuracy_32px": verification(
                                 teacher.model, through_bottleneck(data["tx"], scale), data)}
    log.info("[setup] teacher: %.1f s, held-out accuracy %.4f (native), %.4f (32-px bottleneck)",
             teacher.seconds, setup["teacher_accuracy"], setup["teacher_accuracy_32px"])
    return teacher.model, setup


def train_generator_seed(scale: Scale, data: dict[str, np.ndarray], teacher: Any,
                         seed: int) -> tuple[Any, Any, dict[str, Any]]:
    """Autoencoder (latent runs) and generator trained with ``seed`` as the pipeline trains them: (generator
    result, autoencoder or None, its numbers)."""
    from ml.generator.uiface import GeneratorModelConfig
    from ml.generator.train import GeneratorConfig, train_generator
    from tasks.train_generator import identity_embeddings, resize_faces

    x32 = resize_faces(data["x"], scale.gen_size)
    contexts = identity_embeddings(teacher, x32, None)  # (N, 128) unit rows
    autoencoder, faces, numbers = None, x32, {}
    if scale.latent:  # as the pipeline's train_generator: the autoencoder first, on the same faces
        from ml.generator.autoencoder import AutoencoderConfig, reconstruct, train_autoencoder

        ae_cfg = AutoencoderConfig(architecture=scale.ae_architecture, block_out_channels=scale.ae_channels,
                                   latent_channels=scale.ae_latent_channels, epochs=scale.ae_epochs,
                                   batch_size=scale.ae_batch_size, lr=scale.ae_lr, seed=seed)
        log.info("[generator %d] training the autoencoder on %d faces at %d px, %d epochs", seed, len(x32),
                 scale.gen_size, scale.ae_epochs)
        native = identity_embeddings(teacher, data["x"], None)
        autoencoder, _, ae_seconds = train_autoencoder(ae_cfg, x32, native, teacher, progress=False)
        recon, _ = reconstruct(autoencoder, x32)
        mse = ((recon.astype(np.float64) - x32.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
        numbers = {"autoencoder_seconds": ae_seconds,
                   "autoencoder_psnr": float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10)))),
                   "autoencoder_fr_cosine": float(np.mean(np.sum(identity_embeddings(teacher, recon, None) * native,
                                                                 axis=1)))}
        log.info("[generator %d] autoencoder: %.1f s, PSNR %.1f dB, teacher cosine %.3f", seed, ae_seconds,
                 numbers["autoencoder_psnr"], numbers["autoencoder_fr_cosine"])
    side = scale.unet_side
    model_cfg = GeneratorModelConfig(
        image_size=side, in_channels=scale.ae_latent_channels if autoencoder is not None else 3,
        patch_size=scale.gen_patch_size, block_out_channels=scale.gen_channels, attention_heads=scale.gen_heads,
        context_tokens=scale.gen_context_tokens, time_context=True, id_dim=contexts.shape[1])
    gen_cfg = GeneratorConfig(model=model_cfg, epochs=scale.gen_epochs, batch_size=scale.gen_batch_size,
                              lr=scale.gen_lr, lr_schedule=scale.gen_lr_schedule, ema_decay=scale.gen_ema_decay,
                              prediction_type=scale.gen_prediction_type, loss_weighting=scale.gen_loss_weighting,
                              seed=seed)
    log.info("[generator %d] training on %d faces (%d px, UNet side %d), %d epochs", seed, len(x32), scale.gen_size,
             side, scale.gen_epochs)
    gen = train_generator(gen_cfg, faces, contexts, autoencoder=autoencoder, progress=False)
    numbers.update({"generator_seconds": gen.seconds, "generator_loss": float(gen.history[-1]["train/loss"]),
                    "generator_loss_history": [float(h["train/loss"]) for h in gen.history],
                    "generator_steps": scale.gen_epochs * math.ceil(len(x32) / min(scale.gen_batch_size, len(x32))),
                    "generator_images_per_second": scale.gen_epochs * len(x32) / gen.seconds})
    log.info("[generator %d] %.1f s (%.1f img/s), loss %s", seed, gen.seconds, numbers["generator_images_per_second"],
             " → ".join(f"{v:.4f}" for v in numbers["generator_loss_history"]))
    return gen, autoencoder, numbers


def sampler_configs(scale: Scale, extra: dict[str, Any]) -> dict[str, Any]:
    from ml.generator.sampler import SamplerConfig
    from tasks.synthesize import sampler_for

    base = sampler_for(SamplerConfig(steps=scale.steps, t0=scale.fixed_t0), extra)
    base = dataclasses.replace(base, threshold=effective_threshold(scale, base.train_timesteps))
    return {
        "baseline": dataclasses.replace(base, mode="baseline", attention_injection=False),
        "two_stage_fixed": dataclasses.replace(base, mode="two_stage_fixed", attention_injection=False),
        "two_stage_fixed+injection": dataclasses.replace(base, mode="two_stage_fixed", attention_injection=True),
        "two_stage_adaptive": dataclasses.replace(base, mode="two_stage_adaptive", attention_injection=False),
        "two_stage_adaptive+injection": dataclasses.replace(base, mode="two_stage_adaptive", attention_injection=True),
    }


def switch_profile(model: Any, contexts: np.ndarray, cfg: Any, seed: int) -> dict[str, list]:
    """The adaptive switch's d_t = dist(h_{t+1}, h_t) per DDIM step (from the second on) for one face per context:
    median and 10/90 % quantiles over the faces, to read against the threshold."""
    import torch

    from ml.generator.sampler import sample

    with torch.no_grad():
        cond = model.encode_context(torch.as_tensor(contexts, dtype=torch.float32))
    res = sample(model.unet, cond, model.empty_context.detach(), model.sample_shape(len(contexts)),
                 dataclasses.replace(cfg, seed=seed), generator=torch.Generator().manual_seed(seed))
    d = res.d_history[1:].numpy()  # (steps − 1, n); the first step has no previous map
    return {"timesteps": [int(t) for t in res.timesteps[1:]], "median": np.median(d, axis=1).tolist(),
            "q10": np.quantile(d, 0.1, axis=1).tolist(), "q90": np.quantile(d, 0.9, axis=1).tolist()}


def test_split(scale: Scale, data: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The held-out identities and pairs data seed ``seed`` scores on (seed 0's: those the setup scored)."""
    return make_data(scale, seed) if seed else data


def run_modes(seed: int, scale: Scale, data: dict[str, np.ndarray], test: dict[str, np.ndarray], teacher: Any,
              gen: Any, autoencoder: Any = None) -> dict[str, Any]:
    """One generator on one data seed: identity contexts, every mode's faces, their metrics under the teacher and
    in pixels, and an FR model trained on them scored on the seed's held-out pairs (``_correct``: each pair's
    outcome per mode)."""
    from ml.errors import DataError
    from ml.generator.diversity import diversity_report
    from ml.generator.contexts import select_identity_contexts
    from ml.generator.image_diversity import ssim_diversity
    from tasks.synthesize import generate
    from tasks.train_generator import identity_embeddings, resize_faces

    samplers = sampler_configs(scale, gen.extra())
    model = gen.model.eval()
    m = scale.images_per_synthetic_identity
    base_seed = seed * 1_000_003

    log.info("[seed %d] %d candidate faces with the empty context", seed, scale.candidates)
    cands, _, _ = generate(model, None, scale.candidates, samplers["baseline"], batch_size=scale.sample_batch_size,
                           seed=base_seed, autoencoder=autoencoder, desc="candidates")
    cand_emb = identity_embeddings(teacher, cands, None)
    keep = select_identity_contexts(cand_emb, scale.identities, scale.max_cosine, allow_fewer=True)
    k = len(keep)
    log.info("[seed %d] %d of %d identities found among %d candidates (cosine < %.2f)", seed, k, scale.identities,
             scale.candidates, scale.max_cosine)
    if k < 2:
        raise DataError(
            f"seed {seed}: only {k} identity context(s) passed the cosine < {scale.max_cosine} filter among "
            f"{scale.candidates} candidates; an FR model needs ≥ 2 identities. Raise Scale.max_cosine or "
            "Scale.candidates, or train the generator longer (its empty-context faces look alike to the teacher)")
    contexts = cand_emb[keep]
    labels = np.repeat(np.arange(k), m)
    d_profile = switch_profile(model, contexts[:32], samplers["two_stage_adaptive"], base_seed + 1)
    log.info("[seed %d] adaptive switch: median d_t per step %s (threshold %g)", seed,
             ", ".join(f"t={t}: {d:.4f}" for t, d in zip(d_profile["timesteps"], d_profile["median"])),
             samplers["two_stage_adaptive"].threshold)

    correct: dict[str, np.ndarray] = {}
    rng = np.random.default_rng([seed, 1])
    real_idx = np.sort(rng.choice(len(data["x"]), size=min(k * m, len(data["x"])), replace=False))
    real_ref = identity_embeddings(teacher, resize_faces(data["x"][real_idx], scale.gen_size), None)
    recall_k = min(scale.recall_k, k * m - 1, len(real_ref) - 1)

    modes: dict[str, dict[str, float]] = {}
    for mode, cfg in samplers.items():
        log.info("[seed %d] %s: sampling %d × %d faces, %d DDIM steps", seed, mode, k, m, scale.steps)
        start = time.perf_counter()
        faces, t0, evals = generate(model, contexts, m, cfg, batch_size=scale.sample_batch_size,
                                    seed=base_seed + 7919, autoencoder=autoencoder, desc=mode)
        synth_s = time.perf_counter() - start
        report = diversity_report(identity_embeddings(teacher, faces, None), labels, real_emb=real_ref, k=recall_k)
        fr = fit_fr(resize_faces(faces, scale.image_size), labels, scale, seed, scale.fr_batch_size)
        accuracy, correct[mode] = scored(fr.model, test["tx"], test)
        modes[mode] = {
            "accuracy": accuracy,
            "identity_consistency": report["synthetic/identity_consistency"],
            "ssim_diversity": ssim_diversity(faces, labels),
            "diversity": report["synthetic/diversity"],
            "inter_class_mean_cos": report["synthetic/inter_class_mean_cos"],
            "inter_class_max_cos": report["synthetic/inter_class_max_cos"],
            "precision": report[f"synthetic/precision@k{recall_k}"],
            "recall": report[f"synthetic/recall@k{recall_k}"],
            "t0_mean": float(t0.mean()),
            "t0_std": float(t0.std()),
            "never_switched": float((t0 == 0).mean()),
            "unet_evals_per_face": float(evals.mean()),
            "synthesis_seconds": synth_s,
            "fr_train_seconds": fr.seconds,
        }
        r = modes[mode]
        log.info("[seed %d] %s: acc %.4f, IC %.3f, 1 − SSIM %.3f, recall %.3f, precision %.3f, t0 %.0f, evals %.1f "
                 "(sampling %.0f s, FR %.0f s)", seed, mode, r["accuracy"], r["identity_consistency"],
                 r["ssim_diversity"], r["recall"], r["precision"], r["t0_mean"], r["unet_evals_per_face"], synth_s,
                 fr.seconds)
    return {"identities_found": int(k), "recall_k": int(recall_k), "modes": modes, "d_profile": d_profile,
            "_correct": correct}


def run_reals(seed: int, scale: Scale, data: dict[str, np.ndarray], test: dict[str, np.ndarray], teacher: Any,
              k: int) -> dict[str, Any]:
    """The real arms of one data seed: FR models on ``k`` real identities of (a) × M images (the synthetic sets'
    budget), through the 32-px bottleneck and native, scored on the seed's pairs; the real faces' own statistics
    under the teacher and in pixels (at the generator's size)."""
    from ml.generator.diversity import diversity_report
    from ml.generator.image_diversity import ssim_diversity
    from tasks.train_generator import identity_embeddings, resize_faces

    m = scale.images_per_synthetic_identity
    rng = np.random.default_rng([seed, 2])
    ids = np.sort(rng.choice(scale.train_identities, size=min(k, scale.train_identities), replace=False))
    sel = np.concatenate([np.flatnonzero(data["y"] == i)[:m] for i in ids])
    real_labels = np.searchsorted(ids, data["y"][sel])
    real32 = through_bottleneck(data["x"][sel], scale)
    stats = diversity_report(identity_embeddings(teacher, real32, None), real_labels)
    real_stats = {"identity_consistency": stats["synthetic/identity_consistency"],
                  "ssim_diversity": ssim_diversity(resize_faces(data["x"][sel], scale.gen_size), real_labels),
                  "diversity": stats["synthetic/diversity"],
                  "inter_class_mean_cos": stats["synthetic/inter_class_mean_cos"]}
    real, correct = {}, {}
    for name, images in (("real_32px", real32), ("real_64px", data["x"][sel])):
        fr = fit_fr(images, real_labels, scale, seed, scale.fr_batch_size)
        real[name], correct[name] = scored(fr.model, test["tx"], test)
        log.info("[seed %d] %s FR model on %d × %d real faces: acc %.4f (%.0f s)", seed, name, len(ids), m,
                 real[name], fr.seconds)
    return {"real": real, "real_stats": real_stats, "_correct": correct,
            "_identities": test["ty"][test["pairs"][:, 0]]}


# ------------------------------------------------------------------------------------------------ estimate
def probe(scale: Scale) -> dict[str, float]:
    """Seconds per generator training image and per UNet evaluation, measured on this machine now (a few s)."""
    import torch

    from ml.data.procedural import ProceduralConfig, ProceduralFaces
    from ml.generator.uiface import GeneratorModelConfig, IDConditionedUNet

    start = time.perf_counter()
    gen = ProceduralFaces(ProceduralConfig(image_size=scale.image_size), seed=0)
    for j in range(8):
        gen.sample(0, j)
    render_s = (time.perf_counter() - start) / 8
    from ml.generator.autoencoder import AutoencoderConfig

    channels, side = (scale.ae_latent_channels if scale.latent else 3), scale.unet_side
    model = IDConditionedUNet(GeneratorModelConfig(
        image_size=side, in_channels=channels, patch_size=scale.gen_patch_size, block_out_channels=scale.gen_channels,
        attention_heads=scale.gen_heads, context_tokens=scale.gen_context_tokens, id_dim=128))
    opt = torch.optim.AdamW(model.parameters(), lr=scale.gen_lr)
    b = scale.gen_batch_size
    x, ids = torch.randn(model.sample_shape(b)), torch.randn(b, 128)  # the UNet's layout (patches as channels)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        loss = (model(x, torch.randint(0, 1000, (b,)), model.training_context(ids)) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    train_s = min(times[1:]) / b
    model.eval()
    n = scale.sample_batch_size
    xs, ctx = torch.randn(model.sample_shape(n)), model.empty(n)
    times = []
    with torch.no_grad():
        for _ in range(3):
            t = time.perf_counter()
            model(xs, 500, ctx)
            times.append(time.perf_counter() - t)
    rates = {"render_s_per_face": render_s, "gen_train_s_per_image": train_s,
             "unet_s_per_eval": 1.3 * min(times[1:]) / n}  # ×1.3: attention processors and DDIM bookkeeping
    if scale.latent:
        from ml.generator.autoencoder import build_autoencoder

        ae = build_autoencoder(AutoencoderConfig(architecture=scale.ae_architecture,
                                                 block_out_channels=scale.ae_channels,
                                                 latent_channels=scale.ae_latent_channels), scale.gen_size)
        opt = torch.optim.AdamW(ae.parameters(), lr=scale.ae_lr)
        x = torch.randn(scale.ae_batch_size, 3, scale.gen_size, scale.gen_size)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            encoded = ae.encode(x)
            z = encoded.latent_dist.sample() if hasattr(encoded, "latent_dist") else encoded.latents
            loss = (ae.decode(z).sample - x).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
        rates["ae_train_s_per_image"] = 1.3 * min(times[1:]) / len(x)  # ×1.3: the identity term's 8 faces
    return rates


def estimate_seconds(scale: Scale, rates: dict[str, float], n_seeds: int) -> dict[str, float]:
    """Expected wall time per part, every generator seed on every data seed; adaptive modes are assumed to spend
    1.5 UNet evaluations per step."""
    n_train = scale.train_identities * scale.images_per_identity
    n_faces = n_train + scale.test_identities * scale.test_images_per_identity
    budget = scale.identities * scale.images_per_synthetic_identity
    spacing = 1000 // scale.steps
    stage2_fixed = sum(1 for i in range(scale.steps) if i * spacing < scale.fixed_t0)
    evals_per_face = 2 * scale.steps + 2 * (scale.steps + stage2_fixed) + 2 * 1.5 * scale.steps
    gens = len(scale.generator_seeds)
    fr = lambda n: n * scale.fr_epochs * FR_SECONDS_PER_IMAGE_EPOCH + FR_OVERHEAD_SECONDS  # noqa: E731
    parts = {
        "data": n_faces * rates["render_s_per_face"],
        "teacher": fr(n_train),
        "generator": gens * (scale.gen_epochs * n_train * rates["gen_train_s_per_image"]
                            + scale.latent * scale.ae_epochs * n_train * rates.get("ae_train_s_per_image", 0.0)),
        "sampling": gens * n_seeds * (scale.candidates * scale.steps + budget * evals_per_face)
        * rates["unet_s_per_eval"],
        "fr_models": n_seeds * (gens * len(MODES) + len(REALS)) * fr(budget),
    }
    parts["total"] = sum(parts.values())
    return parts


def run_claims(seeds: list[int], scale: Scale, units_path: Path | None = None, resume: bool = False
               ) -> dict[str, Any]:
    """Teacher once, one generator per ``scale.generator_seeds``, each on every data seed of ``seeds`` with every
    mode, and each data seed's real arms: the results (aggregated with ``uiface_summary``). Finished parts go to
    ``units_path`` as they finish (``Units``); ``resume`` skips those already there."""
    import tempfile

    units = Units(units_path or Path(tempfile.mkdtemp()) / "units.jsonl", scale, resume)
    gens = list(scale.generator_seeds)
    todo = [f"modes {g} {s}" for g in gens for s in seeds if f"modes {g} {s}" not in units.done]
    todo += [f"real {s}" for s in seeds if f"real {s}" not in units.done]
    log.info("rendering procedural faces: %d train, %d held-out", scale.train_identities * scale.images_per_identity,
             scale.test_identities * scale.test_images_per_identity)
    data = make_data(scale)
    teacher = None
    if todo or "teacher" not in units.done:
        teacher, numbers = train_teacher(scale, data)
        if "teacher" not in units.done:
            units.add("teacher", numbers)
    tests: dict[int, dict[str, np.ndarray]] = {}

    def test_of(seed: int) -> dict[str, np.ndarray]:  # each data seed's test set rendered once
        if seed not in tests:
            tests[seed] = test_split(scale, data, seed)
        return tests[seed]

    for g in gens:
        if not any(u.startswith(f"modes {g} ") for u in todo) and f"generator {g}" in units.done:
            continue
        gen, autoencoder, numbers = train_generator_seed(scale, data, teacher, g)
        if f"generator {g}" not in units.done:
            units.add(f"generator {g}", numbers)
        for seed in seeds:
            if f"modes {g} {seed}" in units.done:
                continue
            start = time.perf_counter()
            result = run_modes(seed, scale, data, test_of(seed), teacher, gen, autoencoder)
            units.add(f"modes {g} {seed}", {**result, "generator_seed": g, "data_seed": seed,
                                             "seconds": time.perf_counter() - start})
            log.info("[generator %d, seed %d] done in %.0f s", g, seed, time.perf_counter() - start)
    for seed in seeds:
        if f"real {seed}" in units.done:
            continue
        k = min(units.done[f"modes {g} {seed}"]["identities_found"] for g in gens)
        units.add(f"real {seed}", run_reals(seed, scale, data, test_of(seed), teacher, k))
    return aggregate(units.done, seeds, gens)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.uiface_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DATA_SEEDS),
                        help="data seeds, each the sampling and FR training seed and the data seed of its own held-out "
                             "identities (default: test sets no recipe was chosen on)")
    parser.add_argument("--generator-seeds", type=int, nargs="+", default=None, metavar="SEED",
                        help="generator training seeds, each on every data seed "
                             f"(default: {list(Scale().generator_seeds)})")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished parts in --out-dir's metrics/uiface_claims_units.jsonl (same scale) "
                             "and run only the rest: a stopped run goes on where it left off")
    parser.add_argument("--quick", action="store_true", help="tiny scale to test the code end to end (< 2 min)")
    parser.add_argument("--out-dir", type=Path, default=ROOT, help="writes reports/ and metrics/ under it")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--estimate-only", action="store_true", help="probe throughput, print the estimate, exit")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite reports/uiface_claims.md from the numbers in --out-dir's metrics JSON")
    args = parser.parse_args()
    if args.render:
        import json

        from tasks.common import write_text

        results = json.loads((args.out_dir / "metrics" / "uiface_claims.json").read_text())
        write_text(args.out_dir / "reports" / "uiface_claims.md", render(results, scale_of(results["scale"])))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import lightning  # noqa: F401  (sets its loggers to INFO on import; quiet its per-run banners after that)
    import torch

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.threads:
        torch.set_num_threads(args.threads)
    scale = choose_scale(args.quick, args.generator_seeds)
    if args.estimate_only:
        est = estimate_seconds(scale, probe(scale), len(args.seeds))
        log.info("estimated wall time on this machine now (%d torch threads): %.1f min (%s)",
                 torch.get_num_threads(), est["total"] / 60,
                 ", ".join(f"{k} {v:.0f} s" for k, v in est.items() if k != "total"))
        return
    ablation(args.seeds, args.quick, args.out_dir, generator_seeds=args.generator_seeds, resume=args.resume)


def choose_scale(quick: bool, generator_seeds: list[int] | None = None) -> Scale:
    """``QUICK`` or the full ``Scale``, with ``generator_seeds`` where given."""
    scale = QUICK if quick else Scale()
    return dataclasses.replace(scale, generator_seeds=tuple(generator_seeds)) if generator_seeds else scale


def ablation(seeds: list[int], quick: bool = False, out_dir: Path = ROOT, *, generator_seeds: list[int] | None = None,
             resume: bool = False) -> dict[str, Any]:
    """Run the Table 2 ablation over data ``seeds`` × ``generator_seeds`` and write ``reports/uiface_claims.md``,
    ``metrics/uiface_claims.json`` and the finished parts (``metrics/uiface_claims_units.jsonl``) under ``out_dir``;
    ``resume`` keeps the parts already there; → the results (what the command and ``flows.experiments`` run)."""
    import torch

    from tasks.common import write_json, write_text

    scale = choose_scale(quick, generator_seeds)
    est = estimate_seconds(scale, probe(scale), len(seeds))
    log.info("scale %s", scale)
    log.info("estimated wall time on this machine now (%d torch threads), every part run: %.1f min",
             torch.get_num_threads(), est["total"] / 60)
    out_dir = Path(out_dir)
    start = time.perf_counter()
    results = run_claims(list(seeds), scale, out_dir / "metrics" / "uiface_claims_units.jsonl", resume)
    results["seconds"] = time.perf_counter() - start
    results["measured_at"] = now_utc()
    results["scale"] = dataclasses.asdict(scale)
    results["quick"] = quick
    results["estimate_seconds"] = est
    results["torch_threads"] = torch.get_num_threads()
    write_json(out_dir / "metrics" / "uiface_claims.json", results)
    write_text(out_dir / "reports" / "uiface_claims.md", render(results, scale))
    log.info("done in %.1f min (estimated %.1f) → %s", results["seconds"] / 60, est["total"] / 60,
             out_dir / "reports" / "uiface_claims.md")
    return results


if __name__ == "__main__":
    main()
