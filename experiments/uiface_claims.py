"""UIFace's Table 2 ablation and Table 3 gap at embedded scale, over seeds: ``python -m experiments.uiface_claims``.

Claim (paper Table 2): two-stage sampling with an adaptive switch and attention injection makes a synthetic set more
diverse than CFG with the ID context at every step, and an FR model trained on it verifies real faces better; Table 3:
the gap (REAL − SYN)/SYN at equal budget. Once (seed 0), on procedural faces (a): a teacher FR model (``vit_tiny``)
and the generator as the pipeline trains it (KL autoencoder of 32-px faces, then the latent UNet). Per seed: contexts
filtered from empty-context faces; per sampler mode (``MODES``) K × M faces with the same contexts and noise, their
metrics under the teacher and an FR model trained on them, scored on that seed's held-out real identities (b: drawn
with the seed as data seed, so each seed is an independent test set; the defaults are ``experiments.test_sets.DATA_SEEDS``);
real-data FR models of the same budget (32-px bottleneck, native 64 px) give the gap. The accuracy verdict takes the
test set as its unit (``experiments.test_sets.across_test_sets``, with a bootstrap interval over pairs). Writes
``reports/uiface_claims.md`` and ``metrics/uiface_claims.json``; ``--estimate-only`` prints the expected time. Scale
and report: ``uiface_summary``.

Differences from the reference (Sec. 4, appendix A.1), for a CPU run:
- A small KL autoencoder and a 2-level latent UNet trained briefly, not VQ-f4 and 250k steps; FR models ``vit_tiny``
  on 64-px procedural faces, not IR-50/ArcFace on 112-px CASIA; contexts from the teacher's 32-px-face embeddings.
- 25 DDIM steps (paper 50), threshold × Δt/20 (``Scale.threshold_per_paper_step``); 4 context tokens (public: 32).
- Diversity = 1 − intra-class cosine under the teacher, P/R on its embeddings: no VGG / Inception weights offline.
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
from experiments.uiface_summary import QUICK, Scale, effective_threshold, render, summarize

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
    return {k: split[k] for k in ("x", "y", "tx", "pairs", "issame")}


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


def train_once(scale: Scale, data: dict[str, np.ndarray]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Teacher FR, autoencoder (latent runs) and generator, seed 0: (teacher, generator result, autoencoder or
    None, setup numbers)."""
    from ml.generator.uiface import GeneratorModelConfig
    from ml.generator.train import GeneratorConfig, train_generator
    from tasks.train_generator import identity_embeddings, resize_faces

    log.info("[setup] training the teacher FR model on %d faces (%d identities), %d epochs",
             len(data["x"]), scale.train_identities, scale.fr_epochs)
    teacher = fit_fr(data["x"], data["y"], scale, 0, scale.teacher_batch_size)
    setup: dict[str, Any] = {"teacher_seconds": teacher.seconds,
                             "teacher_accuracy": verification(teacher.model, data["tx"], data),
                             "teacher_accuracy_32px": verification(
                                 teacher.model, through_bottleneck(data["tx"], scale), data)}
    log.info("[setup] teacher: %.1f s, held-out accuracy %.4f (native), %.4f (32-px bottleneck)",
             teacher.seconds, setup["teacher_accuracy"], setup["teacher_accuracy_32px"])

    x32 = resize_faces(data["x"], scale.gen_size)
    contexts = identity_embeddings(teacher.model, x32, None)  # (N, 128) unit rows
    autoencoder, faces = None, x32
    if scale.latent:  # as the pipeline's train_generator: the autoencoder first, on the same faces
        from ml.generator.autoencoder import AutoencoderConfig, reconstruct, train_autoencoder

        ae_cfg = AutoencoderConfig(block_out_channels=scale.ae_channels, epochs=scale.ae_epochs,
                                   batch_size=scale.ae_batch_size, lr=scale.ae_lr, seed=0)
        log.info("[setup] training the autoencoder on %d faces at %d px, %d epochs", len(x32), scale.gen_size,
                 scale.ae_epochs)
        native = identity_embeddings(teacher.model, data["x"], None)
        autoencoder, _, ae_seconds = train_autoencoder(ae_cfg, x32, native, teacher.model, progress=False)
        recon, _ = reconstruct(autoencoder, x32)
        mse = ((recon.astype(np.float64) - x32.astype(np.float64)) ** 2).mean(axis=(1, 2, 3))
        setup.update({"autoencoder_seconds": ae_seconds,
                      "autoencoder_psnr": float(np.mean(10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-10)))),
                      "autoencoder_fr_cosine": float(np.mean(np.sum(
                          identity_embeddings(teacher.model, recon, None) * native, axis=1)))})
        log.info("[setup] autoencoder: %.1f s, PSNR %.1f dB, teacher cosine %.3f", ae_seconds,
                 setup["autoencoder_psnr"], setup["autoencoder_fr_cosine"])
    side = scale.unet_side
    model_cfg = GeneratorModelConfig(
        image_size=side, in_channels=autoencoder.config.latent_channels if autoencoder is not None else 3,
        block_out_channels=scale.gen_channels,
        attention_heads=scale.gen_heads, context_tokens=scale.gen_context_tokens, time_context=True,
        id_dim=contexts.shape[1])
    gen_cfg = GeneratorConfig(model=model_cfg, epochs=scale.gen_epochs, batch_size=scale.gen_batch_size,
                              lr=scale.gen_lr, ema_decay=scale.gen_ema_decay, seed=0)
    log.info("[setup] training the generator on %d faces (%d px, UNet side %d), %d epochs", len(x32),
             scale.gen_size, side, scale.gen_epochs)
    gen = train_generator(gen_cfg, faces, contexts, autoencoder=autoencoder, progress=False)
    setup.update({"generator_seconds": gen.seconds, "generator_loss": float(gen.history[-1]["train/loss"]),
                  "generator_loss_history": [float(h["train/loss"]) for h in gen.history],
                  "generator_steps": scale.gen_epochs * math.ceil(len(x32) / min(scale.gen_batch_size, len(x32))),
                  "generator_images_per_second": scale.gen_epochs * len(x32) / gen.seconds})
    log.info("[setup] generator: %.1f s (%.1f img/s), loss %s", gen.seconds, setup["generator_images_per_second"],
             " → ".join(f"{v:.4f}" for v in setup["generator_loss_history"]))
    return teacher.model, gen, autoencoder, setup


def sampler_configs(scale: Scale, extra: dict[str, Any]) -> dict[str, Any]:
    from ml.generator.sampler import SamplerConfig
    from tasks.synthesize import sampler_for

    base = sampler_for(SamplerConfig(steps=scale.steps, t0=scale.fixed_t0), extra)
    base = dataclasses.replace(base, threshold=effective_threshold(scale, base.train_timesteps))
    return {
        "baseline": dataclasses.replace(base, mode="baseline", attention_injection=False),
        "two_stage_fixed": dataclasses.replace(base, mode="two_stage_fixed", attention_injection=False),
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


def run_seed(seed: int, scale: Scale, data: dict[str, np.ndarray], teacher: Any, gen: Any,
             autoencoder: Any = None) -> dict[str, Any]:
    """One seed: sampling, synthetic and real FR models, scored on the seed's own held-out identities. The result's
    ``_correct`` (per mode and real arm, each pair's outcome) feeds the summary and is not written out."""
    from ml.errors import DataError
    from ml.generator.diversity import diversity_report
    from ml.generator.contexts import select_identity_contexts
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

    test = make_data(scale, seed) if seed else data  # seed 0's held-out set is the one the setup scored
    correct: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(seed)
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
        log.info("[seed %d] %s: acc %.4f, IC %.3f, div %.3f, recall %.3f, precision %.3f, t0 %.0f, evals %.1f "
                 "(sampling %.0f s, FR %.0f s)", seed, mode, r["accuracy"], r["identity_consistency"], r["diversity"],
                 r["recall"], r["precision"], r["t0_mean"], r["unet_evals_per_face"], synth_s, fr.seconds)

    # real-data FR models with the same K × M budget: K real identities of (a), their first M images
    ids = np.sort(rng.choice(scale.train_identities, size=min(k, scale.train_identities), replace=False))
    sel = np.concatenate([np.flatnonzero(data["y"] == i)[:m] for i in ids])
    real_labels = np.searchsorted(ids, data["y"][sel])
    real32 = through_bottleneck(data["x"][sel], scale)
    stats = diversity_report(identity_embeddings(teacher, real32, None), real_labels)
    real_stats = {"identity_consistency": stats["synthetic/identity_consistency"],
                  "diversity": stats["synthetic/diversity"],
                  "inter_class_mean_cos": stats["synthetic/inter_class_mean_cos"]}
    real = {}
    for name, images in (("real_32px", real32), ("real_64px", data["x"][sel])):
        fr = fit_fr(images, real_labels, scale, seed, scale.fr_batch_size)
        real[name], correct[name] = scored(fr.model, test["tx"], test)
        log.info("[seed %d] %s FR model on %d × %d real faces: acc %.4f (%.0f s)", seed, name, len(ids), m,
                 real[name], fr.seconds)
    return {"identities_found": int(k), "recall_k": int(recall_k), "modes": modes, "real": real,
            "real_stats": real_stats, "d_profile": d_profile, "_correct": correct}


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

    channels, side = (AutoencoderConfig().latent_channels if scale.latent else 3), scale.unet_side
    model = IDConditionedUNet(GeneratorModelConfig(
        image_size=side, in_channels=channels, block_out_channels=scale.gen_channels, attention_heads=scale.gen_heads,
        context_tokens=scale.gen_context_tokens, id_dim=128))
    opt = torch.optim.AdamW(model.parameters(), lr=scale.gen_lr)
    b = scale.gen_batch_size
    x, ids = torch.randn(b, channels, side, side), torch.randn(b, 128)
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
    xs, ctx = torch.randn(n, channels, side, side), model.empty(n)
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

        ae = build_autoencoder(AutoencoderConfig(block_out_channels=scale.ae_channels), scale.gen_size)
        opt = torch.optim.AdamW(ae.parameters(), lr=scale.ae_lr)
        x = torch.randn(scale.ae_batch_size, 3, scale.gen_size, scale.gen_size)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            loss = (ae.decode(ae.encode(x).latent_dist.sample()).sample - x).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t)
        rates["ae_train_s_per_image"] = 1.3 * min(times[1:]) / len(x)  # ×1.3: the identity term's 8 faces
    return rates


def estimate_seconds(scale: Scale, rates: dict[str, float], n_seeds: int) -> dict[str, float]:
    """Expected wall time per part; adaptive modes are assumed to spend 1.5 UNet evaluations per step."""
    n_train = scale.train_identities * scale.images_per_identity
    n_faces = n_train + scale.test_identities * scale.test_images_per_identity
    budget = scale.identities * scale.images_per_synthetic_identity
    spacing = 1000 // scale.steps
    stage2_fixed = sum(1 for i in range(scale.steps) if i * spacing < scale.fixed_t0)
    evals_per_face = 2 * scale.steps + (scale.steps + stage2_fixed) + 2 * 1.5 * scale.steps
    fr = lambda n: n * scale.fr_epochs * FR_SECONDS_PER_IMAGE_EPOCH + FR_OVERHEAD_SECONDS  # noqa: E731
    parts = {
        "data": n_faces * rates["render_s_per_face"],
        "teacher": fr(n_train),
        "generator": scale.gen_epochs * n_train * rates["gen_train_s_per_image"]
        + scale.latent * scale.ae_epochs * n_train * rates.get("ae_train_s_per_image", 0.0),
        "sampling": n_seeds * (scale.candidates * scale.steps + budget * evals_per_face) * rates["unet_s_per_eval"],
        "fr_models": n_seeds * 6 * fr(budget),
    }
    parts["total"] = sum(parts.values())
    return parts


def run_claims(seeds: list[int], scale: Scale) -> dict[str, Any]:
    log.info("rendering procedural faces: %d train, %d held-out", scale.train_identities * scale.images_per_identity,
             scale.test_identities * scale.test_images_per_identity)
    data = make_data(scale)
    teacher, gen, autoencoder, setup = train_once(scale, data)
    per_seed: dict[str, dict] = {}
    for seed in seeds:
        start = time.perf_counter()
        per_seed[str(seed)] = run_seed(seed, scale, data, teacher, gen, autoencoder)
        per_seed[str(seed)]["seconds"] = time.perf_counter() - start
        log.info("[seed %d] done in %.0f s", seed, per_seed[str(seed)]["seconds"])
    setup["recall_k"] = min(r["recall_k"] for r in per_seed.values())
    summary = summarize(per_seed)
    for r in per_seed.values():
        r.pop("_correct")
    return {"seeds": seeds, "setup": setup, "per_seed": per_seed, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.uiface_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DATA_SEEDS),
                        help="sampling and training seeds, each also the data seed of its held-out identities "
                             "(default: test sets no recipe was chosen on)")
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
        scale = Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in results["scale"].items()})
        write_text(args.out_dir / "reports" / "uiface_claims.md", render(results, scale))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import lightning  # noqa: F401  (sets its loggers to INFO on import; quiet its per-run banners after that)
    import torch

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.estimate_only:
        scale = QUICK if args.quick else Scale()
        est = estimate_seconds(scale, probe(scale), len(args.seeds))
        log.info("estimated wall time on this machine now (%d torch threads): %.1f min (%s)",
                 torch.get_num_threads(), est["total"] / 60,
                 ", ".join(f"{k} {v:.0f} s" for k, v in est.items() if k != "total"))
        return
    ablation(args.seeds, args.quick, args.out_dir)


def ablation(seeds: list[int], quick: bool = False, out_dir: Path = ROOT) -> dict[str, Any]:
    """Run the Table 2 ablation over ``seeds`` and write ``reports/uiface_claims.md`` and
    ``metrics/uiface_claims.json`` under ``out_dir``; → the results (what the command and ``flows.experiments``
    run)."""
    import torch

    from tasks.common import write_json, write_text

    scale = QUICK if quick else Scale()
    est = estimate_seconds(scale, probe(scale), len(seeds))
    log.info("scale %s", scale)
    log.info("estimated wall time on this machine now (%d torch threads): %.1f min", torch.get_num_threads(),
             est["total"] / 60)
    start = time.perf_counter()
    results = run_claims(list(seeds), scale)
    results["seconds"] = time.perf_counter() - start
    results["measured_at"] = now_utc()
    results["scale"] = dataclasses.asdict(scale)
    results["quick"] = quick
    results["estimate_seconds"] = est
    results["torch_threads"] = torch.get_num_threads()
    out_dir = Path(out_dir)
    write_json(out_dir / "metrics" / "uiface_claims.json", results)
    write_text(out_dir / "reports" / "uiface_claims.md", render(results, scale))
    log.info("done in %.1f min (estimated %.1f) → %s", results["seconds"] / 60, est["total"] / 60,
             out_dir / "reports" / "uiface_claims.md")
    return results


if __name__ == "__main__":
    main()
