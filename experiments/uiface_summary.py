"""The UIFace ablation's definition and its pure parts: the scale (``Scale``, ``QUICK``), the Table-2 rows
(``MODES``), the adaptive switch threshold, and the aggregation over seeds, verdict and markdown report of the
per-seed numbers (no training, no torch). ``experiments/uiface_claims.py`` runs the ablation, ``uiface_runs``
averages its runs over generator seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from experiments.test_sets import LOOKED_AT, across_test_sets, corrected, now_utc, over_test_sets


@dataclasses.dataclass(frozen=True)
class Scale:
    # real procedural faces
    image_size: int = 64
    train_identities: int = 150  # (a): teacher FR + generator training set, and the real-budget subsets
    images_per_identity: int = 16  # ≥ M: the real arm takes M images of each of K identities
    test_identities: int = 150  # (b): held-out real identities for verification (8 images: 4,200 distinct genuine pairs)
    test_images_per_identity: int = 8
    pairs: int = 6000  # half genuine, half impostor
    # FR models: teacher (batch 64, as experiments/claims.py) and the K × M budget models (batch 32: their sets
    # are ~6× smaller, so 64 would leave ~5 optimiser steps per epoch)
    fr_epochs: int = 10
    teacher_batch_size: int = 64
    fr_batch_size: int = 32
    # generator: as the pipeline's default (params generator), an AutoencoderTiny of gen_size-px faces (2 × 16 × 16
    # latents) trained first on (a) with the teacher's identity term, then the UNet on its 2×2 patches with
    # v-prediction, min-SNR weighting and a cosine lr; latent=False: the UNet denoises pixels. One generator per
    # generator seed: the seeds give the spread a training run adds (stability), the data seeds the test sets.
    gen_size: int = 32  # the faces' side the generator makes (upsampled to image_size for the FR models)
    latent: bool = True
    ae_architecture: str = "tiny"  # | "kl" (AutoencoderKL)
    ae_channels: tuple[int, ...] = (32, 32)  # encoder levels: gen_size / 2^(levels − 1) = the latent side
    ae_latent_channels: int = 2
    ae_epochs: int = 6  # 900 steps of 16, as the pipeline's autoencoder
    ae_batch_size: int = 16
    ae_lr: float = 2e-3
    gen_channels: tuple[int, ...] = (48, 96)
    gen_heads: int = 4
    gen_context_tokens: int = 4  # > 1, else cross-attention injection is a no-op (softmax over one key)
    gen_patch_size: int = 2
    gen_prediction_type: str = "v_prediction"
    gen_loss_weighting: str = "min_snr"
    gen_lr_schedule: str = "cosine"
    gen_epochs: int = 27  # 1,026 steps of 64 on (a)'s 2,400 faces: the pipeline's step count
    gen_batch_size: int = 64
    gen_lr: float = 2e-3
    gen_ema_decay: float = 0.995
    generator_seeds: tuple[int, ...] = (0, 1, 2)
    # synthesis: sampling dominates the run (K·M faces × steps × 1–2 UNet evaluations × 5 modes × generators ×
    # seeds)
    candidates: int = 200
    max_cosine: float = 0.7  # the pipeline's synthesize.max_cosine
    identities: int = 50  # N asked; K ≤ N found
    images_per_synthetic_identity: int = 16  # M
    steps: int = 25  # DDIM steps (paper 50; the pipeline 25); must divide T = 1000
    fixed_t0: int = 500
    threshold: float = 0.005  # paper's th, for its DDIM step Δt = 20 (50 steps)
    threshold_per_paper_step: bool = True  # th × Δt/20: d_t is a change per step, ∝ Δt to first order
    sample_batch_size: int = 128
    recall_k: int = 10

    def __post_init__(self) -> None:
        if self.images_per_identity < self.images_per_synthetic_identity:
            raise ValueError(f"images_per_identity = {self.images_per_identity} < images_per_synthetic_identity = "
                             f"{self.images_per_synthetic_identity}: the real arm of a K × M budget needs M real "
                             "images of each identity")

    @property
    def unet_side(self) -> int:
        """The UNet's input side: the latent's (gen_size over the autoencoder's downsampling), or gen_size."""
        return self.gen_size // 2 ** (len(self.ae_channels) - 1) if self.latent else self.gen_size


QUICK = Scale(
    train_identities=12, images_per_identity=4, test_identities=8, test_images_per_identity=6, pairs=120,
    fr_epochs=1, gen_size=16, ae_channels=(8, 8), ae_epochs=8, gen_channels=(8, 16), gen_epochs=2, candidates=12,
    max_cosine=0.9999, identities=4, images_per_synthetic_identity=3, steps=5, sample_batch_size=64,
    generator_seeds=(0, 1),
)

# what results stored before a field existed were measured with (``scale_of``): the KL latent, ε, one generator
LEGACY_SCALE = {"ae_architecture": "kl", "ae_channels": (16, 32, 64), "ae_latent_channels": 4, "ae_epochs": 10,
                "ae_batch_size": 32, "gen_channels": (64, 128), "gen_patch_size": 1, "gen_prediction_type": "epsilon",
                "gen_loss_weighting": "uniform", "gen_lr_schedule": "constant", "gen_epochs": 50, "gen_lr": 1e-3,
                "generator_seeds": (0,)}

MODES = {
    "baseline": "CFG with the ID context at every step",
    "two_stage_fixed": "`c_e` for t ≥ t0 = 500, then CFG",
    "two_stage_fixed+injection": "t0 = 500 + attention injection: make run's sampler",
    "two_stage_adaptive": "adaptive t0: switch when d_t < th",
    "two_stage_adaptive+injection": "adaptive t0 + attention injection",
}
CLAIM_MODE = "two_stage_adaptive+injection"
EARLY_SWITCH = 800  # a mean adaptive t0 above this: most DDIM steps already run with the ID context
REALS = {"real_32px": "real faces through the 32-px bottleneck", "real_64px": "native 64-px real faces"}

# (key, header, format) of the main table; accuracy in %
COLUMNS = [
    ("accuracy", "verification acc. (held-out real)", "pct"),
    ("identity_consistency", "identity consistency", "3f"),
    ("ssim_diversity", "image diversity (1 − SSIM)", "3f"),
    ("diversity", "1 − IC", "3f"),
    ("recall", "recall@k", "3f"),
    ("precision", "precision@k", "3f"),
    ("inter_class_mean_cos", "inter-class mean cos", "3f"),
    ("t0_mean", "t0 mean", "0f"),
    ("never_switched", "never switched", "pct"),
    ("unet_evals_per_face", "UNet evals/face", "1f"),
    ("synthesis_seconds", "synthesis s", "0f"),
]


# (key, header, format) of the table of each mode against the baseline
VERSUS = [("ssim_diversity", "image diversity", "3f"), ("diversity", "1 − IC", "3f"), ("accuracy", "accuracy", "pct"),
          ("identity_consistency", "identity consistency", "3f"), ("recall", "recall", "3f")]


def effective_threshold(scale: Scale, train_timesteps: int = 1000) -> float:
    """The adaptive switch threshold used: the paper's ``th`` (for Δt = 20) times Δt/20 when
    ``threshold_per_paper_step``, so that fewer, larger DDIM steps ask for the same rate of change of the map."""
    return scale.threshold * (train_timesteps // scale.steps) / 20.0 if scale.threshold_per_paper_step \
        else scale.threshold


def _mean_std(values: list[float]) -> dict[str, Any]:
    """Mean ± sample std (ddof 1; 0 for one value) of per-seed values, the values kept."""
    v = np.asarray(values, dtype=float)
    return {"values": [float(x) for x in v], "mean": float(v.mean()), "std": _sample_std(v)}


def _sample_std(v: np.ndarray) -> float:
    return float(v.std(ddof=1)) if len(v) > 1 else 0.0


def with_sample_std(summary: dict[str, Any]) -> dict[str, Any]:
    """A stored summary with every per-seed std recomputed from its values as the sample std: results written
    before the summary used it (population std) re-render with the same rule as new ones. The verdicts over test
    sets already used the sample std (``experiments.test_sets``); a one-std verdict keeps its stored value."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if "values" in out and "std" in out:
                out["std"] = _sample_std(np.asarray(out["values"], dtype=float))
            return out
        return node

    out = walk(summary)
    for mode, metrics in out.get("versus_baseline", {}).items():
        for m, c in metrics.items():
            a, b = out["modes"][mode][m]["values"], out["modes"]["baseline"][m]["values"]
            c["paired_std"] = _sample_std(np.asarray(a, dtype=float) - np.asarray(b, dtype=float))
    return with_holm(out)


def with_holm(summary: dict[str, Any]) -> dict[str, Any]:
    """Holm's correction over the table of each mode against the baseline (every comparison judged over test
    sets): a "higher" / "lower" whose p does not survive it becomes "within noise after Holm", and the claim holds
    only on verdicts that survive. Each judged comparison records ``holm`` (True: survives). Unchanged for results
    without test sets."""
    judged = [c for metrics in summary.get("versus_baseline", {}).values() for c in metrics.values()
              if "test_sets" in c]
    for c, survives in zip(judged, corrected([c["test_sets"] for c in judged])):
        c["holm"] = survives
        c["holm_family"] = len(judged)
        if c["verdict"] in ("higher", "lower") and not survives:
            c["verdict"] = "within noise after Holm"
    if judged:
        claim = summary["versus_baseline"][CLAIM_MODE]
        summary["claim_diversity"] = claim[diversity_key(claim)]["verdict"]
        summary["claim_accuracy"] = claim["accuracy"]["verdict"]
        summary["claim_holds"] = summary["claim_diversity"] == summary["claim_accuracy"] == "higher"
    return summary


def diversity_key(metrics: dict[str, Any]) -> str:
    """The diversity the claim is judged on: image-space (``ssim_diversity``, 1 − SSIM within an identity), a
    measurement of its own; results stored before it have only the embedding proxy ``diversity`` (1 − identity
    consistency, the same number as consistency with its sign turned)."""
    return "ssim_diversity" if "ssim_diversity" in metrics else "diversity"


def present(modes: dict[str, Any]) -> list[str]:
    """``MODES`` in their order, those ``modes`` has (results stored before a mode was added lack it)."""
    return [m for m in MODES if m in modes]


def compare(a: list[float], b: list[float], test_sets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Mode ``a`` against ``b`` over the same seeds: difference of means and the paired per-seed differences (same
    contexts and noise within a seed). With ``test_sets`` (each seed's own held-out identities as the unit,
    ``experiments.test_sets``) the verdict is "higher" / "lower" when the difference is beyond noise there, else
    "within noise"; without (results from before the rule), "higher" / "lower" beyond a one-std margin (the larger
    of the two sample stds), else "within one std"."""
    sa, sb = _mean_std(a), _mean_std(b)
    diff = sa["mean"] - sb["mean"]
    paired = _mean_std([x - y for x, y in zip(a, b)])
    out = {"diff": diff, "paired_mean": paired["mean"], "paired_std": paired["std"],
           "paired_positive": int(sum(x > y for x, y in zip(a, b)))}
    if test_sets is None:
        margin = max(sa["std"], sb["std"])
        verdict = "higher" if diff > margin else ("lower" if diff < -margin else "within one std")
        return {**out, "margin": margin, "verdict": verdict}
    beyond = test_sets["beyond_noise"]
    verdict = "higher" if beyond and diff > 0 else "lower" if beyond and diff < 0 else "within noise"
    return {**out, "margin": 2 * (test_sets["se"] or 0.0), "verdict": verdict, "test_sets": test_sets}


def summarize(per_seed: dict[str, dict]) -> dict[str, Any]:
    """Aggregates of the per-seed results: mean ± std of every mode metric and of the real-data models'
    accuracy, the gaps ``(REAL − SYN)/SYN`` per seed, each mode against the baseline, and the verdict.

    ``per_seed[seed] = {"modes": {mode: {metric: value}}, "real": {real: accuracy}, "real_stats": {metric: value},
    "identities_found": K}``, and ``"_correct": {mode or real: (pairs,) bool}`` when each seed scored its own
    held-out identities: then every comparison is judged over the seeds as independent test sets (accuracy with a
    bootstrap interval over pairs), and ``real_vs_claim`` holds each real arm − the claimed mode's accuracy."""
    seeds = list(per_seed)
    modes: dict[str, dict] = {}
    names = present(per_seed[seeds[0]]["modes"])
    for mode in names:
        keys = per_seed[seeds[0]]["modes"][mode].keys()
        agg = {k: _mean_std([per_seed[s]["modes"][mode][k] for s in seeds]) for k in keys}
        for real in REALS:
            agg[f"gap_{real}"] = _mean_std([
                (per_seed[s]["real"][real] - per_seed[s]["modes"][mode]["accuracy"])
                / per_seed[s]["modes"][mode]["accuracy"] for s in seeds])
        modes[mode] = agg
    real = {r: _mean_std([per_seed[s]["real"][r] for s in seeds]) for r in REALS}
    real_stats = {k: _mean_std([per_seed[s]["real_stats"][k] for s in seeds])
                  for k in per_seed[seeds[0]]["real_stats"]}
    found = _mean_std([per_seed[s]["identities_found"] for s in seeds])
    per_set = all("_correct" in per_seed[s] for s in seeds)
    if per_set:
        def outcomes(arm: str) -> list[np.ndarray]:
            return [per_seed[s]["_correct"][arm] for s in seeds]

        data_of = [int(s) for s in seeds]
        # the bootstrap draws identities (each pair's first face's) where the runs kept them, else pairs
        ids = ([per_seed[s]["_identities"] for s in seeds] if all("_identities" in per_seed[s] for s in seeds)
               else None)

    def judged(mode: str, m: str) -> dict[str, Any]:
        a, b = modes[mode][m]["values"], modes["baseline"][m]["values"]
        if not per_set:
            return compare(a, b)
        sets = (across_test_sets(outcomes(mode), outcomes("baseline"), data_of, identities=ids) if m == "accuracy"
                else over_test_sets([x - y for x, y in zip(a, b)]))
        return compare(a, b, sets)

    judged_metrics = [m for m in ("ssim_diversity", "diversity", "accuracy", "identity_consistency", "recall")
                      if m in modes["baseline"]]
    versus = {mode: {m: judged(mode, m) for m in judged_metrics} for mode in names if mode != "baseline"}
    claim = versus[CLAIM_MODE]
    extra = {"real_vs_claim": {r: across_test_sets(outcomes(r), outcomes(CLAIM_MODE), data_of, identities=ids)
                               for r in REALS}} if per_set else {}
    div = claim[diversity_key(claim)]["verdict"]
    return with_holm({"modes": modes, "real": real, "real_stats": real_stats, "identities_found": found,
                      "versus_baseline": versus, **extra,
                      "claim_holds": div == "higher" and claim["accuracy"]["verdict"] == "higher",
                      "claim_diversity": div, "claim_accuracy": claim["accuracy"]["verdict"]})


def _family(summary: dict) -> int:
    return max((c.get("holm_family", 0) for v in summary["versus_baseline"].values() for c in v.values()), default=0)


def _fmt(r: dict, kind: str) -> str:
    if kind == "pct":
        return f"{100 * r['mean']:.2f} ± {100 * r['std']:.2f} %"
    digits = int(kind[0])
    return f"{r['mean']:.{digits}f} ± {r['std']:.{digits}f}"


def _signed(x: float, kind: str) -> str:
    return f"{100 * x:+.2f} pp" if kind == "pct" else f"{x:+.3f}"


def _claim_paragraph(summary: dict, setup: dict, scale: Scale) -> str:
    v = summary["versus_baseline"][CLAIM_MODE]
    div, acc = v[diversity_key(v)], v["accuracy"]
    image = diversity_key(v) == "ssim_diversity"
    words = {"higher": "higher than", "lower": "lower than", "within one std": "not distinguishable from"}

    words["within noise"] = words["within one std"]
    words["within noise after Holm"] = "not distinguishable, after Holm's correction over the table, from"
    by_sets = "test_sets" in acc

    def part(c: dict, kind: str) -> str:
        if by_sets:
            t = c["test_sets"]
            interval = (f"; 95 % over pairs {_signed(t['ci_low'], kind)} to {_signed(t['ci_high'], kind)}"
                        if "ci_low" in t else "")
            return (f"is {words[c['verdict']]} the baseline's (per test set {_signed(t['mean'], kind)} ± "
                    f"{_signed(t['std'], kind).lstrip('+')}, higher in {t['higher']} of {t['units']} test sets"
                    f"{interval})")
        return (f"is {words[c['verdict']]} the baseline's (Δ of means {_signed(c['diff'], kind)}, one-std margin "
                f"{_signed(c['margin'], kind).lstrip('+')}; paired per seed {_signed(c['paired_mean'], kind)} ± "
                f"{_signed(c['paired_std'], kind).lstrip('+')}, higher in {c['paired_positive']} of "
                f"{len(summary['modes']['baseline']['accuracy']['values'])} seeds)")

    verdict = "**Yes, in direction at this scale**" if summary["claim_holds"] else "**No, not at this scale**"
    rule = ("beyond noise over the independent test sets (at least two, the mean beyond 2 standard errors, every set "
            "on its side; for accuracy also the pair interval excluding 0), surviving Holm's correction over the "
            "table" if by_sets else "beyond one std")
    what = "image-space diversity (1 − SSIM within an identity)" if image else "embedding diversity"
    text = (f"{verdict}: with adaptive t0 and attention injection, the {what} {part(div, '3f')}; the "
            f"accuracy on held-out real faces of the FR model trained on the set {part(acc, 'pct')}. The claim needs "
            f"both to be higher {rule}.")
    ic = v["identity_consistency"]
    moved = "within noise" if ic["verdict"].startswith("within") else "beyond noise" if by_sets else "beyond one std"
    text += (f" Identity consistency {'falls' if ic['diff'] < 0 else 'rises'} by {abs(ic['diff']):.3f} ({moved})"
             + ("; the paper accepts such a fall as the price of diversity." if ic["diff"] < 0 else "."))
    if not summary["claim_holds"]:
        gen_ic = summary["modes"]["baseline"]["identity_consistency"]["mean"]
        real_ic = summary["real_stats"]["identity_consistency"]["mean"]
        text += (
            " Why it may not hold here: the generator is a "
            f"{len(scale.gen_channels)}-level UNet {generator_space(scale)} trained for "
            f"{setup.get('generator_steps', '?')} steps on a CPU (the reference: 250k steps of 512 images in a VQ "
            f"latent); under the teacher its baseline faces have identity consistency {gen_ic:.3f} against "
            f"{real_ic:.3f} for real faces of the same budget through the same 32-px bottleneck"
            + (", so the identity signal that two-stage sampling trades for diversity is weak to begin with."
               if gen_ic < real_ic else
               ", i.e. its faces of one identity vary less than real ones, with little identity-free variation "
               "for the first stage to add.")
            + f" The contexts come from a teacher trained on {scale.train_identities} procedural identities; each FR "
            f"model sees only ~{summary['identities_found']['mean']:.0f} × {scale.images_per_synthetic_identity} "
            f"faces for {scale.fr_epochs} epochs")
        if acc["verdict"] == "within noise after Holm":
            text += (f", and the accuracy difference ({100 * acc['diff']:+.2f} pp) is beyond noise on its own but "
                     f"not after Holm's correction over the table's {acc['holm_family']} comparisons.")
        elif acc["verdict"] == "within noise":
            text += (f", and the accuracy difference ({100 * acc['diff']:+.2f} pp) is within two standard errors "
                     f"over test sets ({100 * acc['margin']:.2f} pp) or changes sign between them: more test sets "
                     "or a larger scale would be needed to resolve it.")
        elif acc["verdict"] == "within one std":
            text += (f", and the seed-to-seed std of its accuracy ({100 * acc['margin']:.2f} pp) exceeds the "
                     f"difference between the modes ({100 * abs(acc['diff']):.2f} pp): more seeds or a larger scale "
                     "would be needed to resolve it.")
        elif by_sets:
            text += (f"; the accuracy difference ({100 * acc['diff']:+.2f} pp) is beyond noise over the test sets, "
                     "so at this scale it is a measured effect.")
        else:
            text += (f"; the accuracy difference ({100 * acc['diff']:+.2f} pp) is beyond the seed-to-seed std "
                     f"({100 * acc['margin']:.2f} pp), so at this scale it is a measured effect, not noise.")
        with_inj = summary["modes"][CLAIM_MODE]["identity_consistency"]["values"]
        without = summary["modes"]["two_stage_adaptive"]["identity_consistency"]["values"]
        inj_effect = max(abs(a - b) for a, b in zip(with_inj, without))
        if inj_effect < 0.01:
            text += (f" Attention injection itself barely changes the faces here: identity consistency with and "
                     f"without it differs by at most {inj_effect:.4f} per seed (the conditional pass's own "
                     "cross-attention over the weak ID context is what injection rescales, and there is little of it).")
        never = summary["modes"][CLAIM_MODE]["never_switched"]["mean"]
        if never > 0.5:
            text += (f" {100 * never:.0f} % of the adaptive faces never reached d_t < th and stayed on `c_e` to the "
                     "end, so they carry no identity context at all (see the d_t profile above).")
        t0 = summary["modes"][CLAIM_MODE]["t0_mean"]["mean"]
        if t0 > EARLY_SWITCH:
            text += (f" The adaptive rule switched early, at t0 ≈ {t0:.0f} on average: d_t is below th from the "
                     "first steps (the d_t profile above), so most steps run with the ID context, as the baseline's do; "
                     "the fixed switch at t0 = 500 is the two-stage sampler this generator can be judged on (its row).")
        text += (f" Sampling uses {scale.steps} DDIM steps (the paper: 50; the switch threshold "
                 f"{'is rescaled' if scale.threshold_per_paper_step else 'is not rescaled'} to the step), and "
                 + ("image diversity is 1 − SSIM, not LPIPS (no VGG weights offline)." if image else
                    "diversity is an FR-embedding proxy, not LPIPS (no VGG weights offline)."))
    return text


def scale_of(stored: dict[str, Any]) -> Scale:
    """The ``Scale`` of stored results: a field they lack takes its ``LEGACY_SCALE`` value (what was run before
    the field existed), lists become tuples."""
    fields = {f.name for f in dataclasses.fields(Scale)}
    merged = {**{k: v for k, v in LEGACY_SCALE.items() if k not in stored}, **stored}
    return Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in merged.items() if k in fields})


def generator_space(scale: Scale) -> str:
    """Where the UNet denoises, in words."""
    if not scale.latent:
        return f"in pixel space at {scale.gen_size} px"
    side = scale.unet_side
    kind = "an AutoencoderTiny" if scale.ae_architecture == "tiny" else "a KL autoencoder"
    patches = f" in {scale.gen_patch_size}×{scale.gen_patch_size} patches" if scale.gen_patch_size > 1 else ""
    return (f"in the {scale.ae_latent_channels}×{side}×{side} latent of {kind} of {scale.gen_size}-px "
            f"faces{patches}, {scale.gen_prediction_type}, {scale.gen_loss_weighting} weighting, "
            f"{scale.gen_lr_schedule} lr")


def autoencoder_note(scale: Scale, setup: dict[str, Any]) -> str:
    """The autoencoder's training and reconstruction numbers (latent runs), for the setup paragraph."""
    if not scale.latent or "autoencoder_psnr" not in setup:
        return ""
    return (f" (autoencoder: channels {list(scale.ae_channels)}, {scale.ae_epochs} epochs, batch "
            f"{scale.ae_batch_size}, lr {scale.ae_lr}, {setup['autoencoder_seconds']:.0f} s; reconstructions of the "
            f"training faces {setup['autoencoder_psnr']:.1f} dB PSNR, teacher cosine to the face "
            f"{setup['autoencoder_fr_cosine']:.2f})")


def render(results: dict, scale: Scale) -> str:
    """The markdown report of ``results`` (``seeds``, ``setup``, ``per_seed``, ``summary``), every std a sample std
    (``with_sample_std``, for results stored before)."""
    s, setup, seeds = with_sample_std(results["summary"]), results["setup"], results["seeds"]
    names = present(s["modes"])
    gens = list(setup.get("generator_seeds", [0]))
    k = setup.get("recall_k", scale.recall_k)
    found = s["identities_found"]
    when = results.get("measured_at") or now_utc()
    lines = [
        "# UIFace claims at embedded scale (Table 2 ablation, Table 3 gap)",
        "",
        f"Measured by `python -m experiments.uiface_claims` on {when}, seeds {seeds}"
        + (f", in {results['seconds'] / 60:.1f} min" if "seconds" in results else "") + ". Chosen on: nothing per "
        "seed (the teacher, the generator and every mode's FR model keep their last epoch; the scale below was set "
        f"while data seeds {', '.join(map(str, LOOKED_AT))} were looked at). Scored on: each seed's own held-out "
        "identities and pairs, read once per mode.",
        "",
        f"**Data.** Procedural faces at {scale.image_size}×{scale.image_size}: (a) {scale.train_identities} "
        f"identities × {scale.images_per_identity} images train the teacher FR model and the generator; (b) "
        f"{scale.test_identities} held-out identities × {scale.test_images_per_identity} images give {scale.pairs} "
        "verification pairs (half genuine), scored by 10-fold verification accuracy with flip TTA (InsightFace "
        "protocol)" + ("; each seed draws its own held-out identities and pairs (the seed is also the data seed), so "
                       "the seeds are independent test sets." if "real_vs_claim" in s else "."),
        "",
        (f"**Trained once per generator seed ({', '.join(map(str, gens))}).** The teacher once (seed 0, the same "
         "for every run). " if len(gens) > 1 else "**Trained once, seed 0 (the same for every seed).** ")
        + f"Teacher FR: `vit_tiny`, ArcFace, {scale.fr_epochs} "
        f"epochs, batch {scale.teacher_batch_size}, {setup['teacher_seconds']:.0f} s; its own accuracy on the "
        f"held-out pairs of data seed 0 is {100 * setup['teacher_accuracy']:.2f} % (native 64 px) and "
        f"{100 * setup['teacher_accuracy_32px']:.2f} % on the faces through the 32-px bottleneck. Generator: UIFace "
        f"ID-conditioned UNet {generator_space(scale)}{autoencoder_note(scale, setup)}, channels "
        f"{list(scale.gen_channels)}, "
        f"{scale.gen_heads} heads, {scale.gen_context_tokens} context tokens, {scale.gen_epochs} epochs "
        f"({setup['generator_steps']} steps, batch {scale.gen_batch_size}, lr {scale.gen_lr}, EMA "
        f"{scale.gen_ema_decay}), {setup['generator_seconds']:.0f} s, final loss {setup['generator_loss']:.4f}"
        + (" (means over the generators)" if len(gens) > 1 else "") + "; "
        "contexts are the teacher's L2-normalised embeddings of the 32-px training faces (upsampled to 64 px, as the "
        "generated faces are).",
        "",
        f"**Per seed.** {scale.candidates} empty-context candidates → teacher embeddings → DCFace-style filter "
        f"(cosine < {scale.max_cosine}) for N = {scale.identities} identities: found {found['mean']:.1f} ± "
        f"{found['std']:.1f} ({', '.join(str(int(x)) for x in found['values'])}"
        + ("; the fewest over the generators" if len(gens) > 1 else "") + "). Each mode samples M = "
        f"{scale.images_per_synthetic_identity} faces per identity with the same contexts and initial noise, "
        f"{scale.steps} DDIM steps (η = 0, w = 1); an FR model (`vit_tiny`, {scale.fr_epochs} epochs, batch "
        f"{scale.fr_batch_size}, seed = the seed) is trained on the faces upsampled to 64 px. Consistency, diversity "
        "(1 − IC: 1 − mean intra-class cosine, the same measurement as consistency), inter-class separation and "
        f"improved precision/recall (k = {k}, against as many real training faces through the 32-px bottleneck) are "
        "under the teacher; image diversity is 1 − SSIM between faces of one identity (its first 8, grey levels; "
        "LPIPS needs VGG weights we do not have offline), a measurement of the pixels, beside real identities' own. "
        "t0: `c_e` only for t ≥ t0 (1000 = CFG "
        "throughout, 0 = never switched). Adaptive switch: d_t = mean |h_{t+Δt} − h_t| of the normalised "
        f"cross-attention maps, th = {effective_threshold(scale):g} at Δt = {1000 // scale.steps}"
        + (f" (the paper's {scale.threshold:g} for Δt = 20, scaled by Δt/20, since d_t is a change per step)"
           if scale.threshold_per_paper_step else " (the paper's value, not rescaled to the step)")
        + ". Mean ± sample std (ddof 1) over seeds"
        + (f", each seed's numbers the mean over its {len(gens)} generators (their spread: the stability section "
           "below)." if len(gens) > 1 else "."),
        "",
        "| mode | " + " | ".join(h.replace("@k", f"@{k}") for _, h, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for mode in names:
        r = s["modes"][mode]
        lines.append(f"| `{mode}` ({MODES[mode]}) | "
                     + " | ".join(_fmt(r[key], kind) if key in r else "—" for key, _, kind in COLUMNS) + " |")
    ref = {**s["real_stats"], "accuracy": s["real"]["real_32px"]}
    lines.append("| *reference: real faces, same budget, 32-px bottleneck* | "
                 + " | ".join(_fmt(ref[key], kind) if key in ref else "—" for key, _, kind in COLUMNS) + " |")
    first = next(iter(results["per_seed"].values()))
    if "d_profile" in first:
        p = first["d_profile"]
        lines += ["", f"Adaptive switch, seed {seeds[0]}: d_t per DDIM step (median [10 %, 90 %] over "
                  f"{min(32, first['identities_found'])} faces): "
                  + ", ".join(f"t = {t}: {md:.4f} [{lo:.4f}, {hi:.4f}]"
                              for t, md, lo, hi in zip(p["timesteps"], p["median"], p["q10"], p["q90"])) + "."]
    lines += [
        "",
        "## Synthetic–real gap (Table 3)",
        "",
        "Real-data FR models with the same identity × image budget as each seed's synthetic sets (K found × "
        f"{scale.images_per_synthetic_identity} images of real identities from (a), chosen per seed), same config:",
        "",
        "| real set | verification acc. | " + " | ".join(f"gap vs `{m}`" for m in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for real, desc in REALS.items():
        gaps = [f"{100 * g['mean']:+.1f} ± {100 * g['std']:.1f} %"
                for g in (s["modes"][m][f"gap_{real}"] for m in names)]
        lines.append(f"| {desc} | {_fmt(s['real'][real], 'pct')} | " + " | ".join(gaps) + " |")
    lines += [
        "",
        "Gap = (REAL − SYN)/SYN per seed, then mean ± std; positive = the real set trains a better FR model.",
    ]
    if "real_vs_claim" in s:
        lines.append("")
    for real, t in s.get("real_vs_claim", {}).items():
        lines.append(f"- {REALS[real].capitalize()} − `{CLAIM_MODE}`, accuracy per test set: {_signed(t['mean'], 'pct')} "
                     f"± {_signed(t['std'], 'pct').lstrip('+')} (higher in {t['higher']} of {t['units']}; 95 % over "
                     f"pairs {_signed(t['ci_low'], 'pct')} to {_signed(t['ci_high'], 'pct')}): "
                     + ("beyond noise." if t["beyond_noise"] else "not beyond noise."))
    lines += [
        "",
        "## Each mode against the baseline",
        "",
        "| mode | " + " | ".join(f"Δ {h}" for m, h, _ in VERSUS if m in s["versus_baseline"][CLAIM_MODE]) + " |",
        "|---|" + "---|" * sum(m in s["versus_baseline"][CLAIM_MODE] for m, _, _ in VERSUS),
    ]
    for mode, v in sorted(s["versus_baseline"].items(), key=lambda kv: list(MODES).index(kv[0])):  # json sorts keys
        cells = [f"{_signed(v[m]['diff'], kind)} ({v[m]['verdict']})" for m, _, kind in VERSUS if m in v]
        lines.append(f"| `{mode}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Δ = difference of the means over seeds; \"higher\"/\"lower\" = beyond noise over the seeds' independent test "
        "sets (at least two, the mean beyond 2 standard errors, every set on its side; accuracy also needs its "
        "bootstrap interval over pairs to exclude 0) and surviving Holm's correction over the table's "
        f"{_family(s)} comparisons (p of a one-sample t-test over the test sets, α = 0.05), else \"within noise\"."
        if "real_vs_claim" in s else
        "Δ = difference of the means over seeds; \"higher\"/\"lower\" = beyond one std (the larger of the two modes' "
        "stds), else \"within one std\".",
        "",
        "## Does the claim hold?",
        "",
        _claim_paragraph(s, setup, scale),
        "",
    ]
    if "stability" in results:
        lines += stability_lines(results["stability"])
    lines += [
        "## Per seed",
        "",
        "| seed | K found | " + " | ".join(f"acc `{m}`" for m in names) + " | " + " | ".join(f"acc {r}" for r in REALS)
        + " |",
        "|---|---|" + "---|" * (len(names) + len(REALS)),
    ]
    for seed, r in results["per_seed"].items():
        lines.append(f"| {seed} | {r['identities_found']} | "
                     + " | ".join(f"{100 * r['modes'][m]['accuracy']:.2f}" for m in names) + " | "
                     + " | ".join(f"{100 * r['real'][x]:.2f}" for x in REALS) + " |")
    lines.append("")
    return "\n".join(lines)


def stability_lines(stability: dict[str, Any]) -> list[str]:
    """The report's section on generator seeds (``over_generators``); with one generator, what to run for it."""
    gens = stability["generator_seeds"]
    if len(gens) < 2:
        return ["## Over generator seeds (stability)", "",
                f"One generator (training seed {gens[0]}): its spread over training runs is not measured. "
                "`python -m experiments.uiface_claims --generator-seeds 0 1 2 --resume` adds two more generators to "
                "the parts already run and writes this section.", ""]
    metrics = [(m, h, kind) for m, h, kind in COLUMNS if m in stability["modes"]["baseline"]]
    lines = ["## Over generator seeds (stability)", "",
             f"Each of {len(gens)} generators (training seeds {', '.join(map(str, gens))}) scored as above, its "
             "numbers the mean over the data seeds; mean ± sample std over the generators, and each mode − baseline "
             "per generator. A data seed, not a generator, is the unit of the verdicts above: this says whether "
             "another training run of the generator would have told another story.", "",
             "| mode | " + " | ".join(h for _, h, _ in metrics) + " | "
             + " | ".join(f"Δ {h} vs baseline (higher in)" for _, h, _ in metrics) + " |",
             "|---|" + "---|" * (2 * len(metrics))]
    for mode, row in stability["modes"].items():
        deltas = stability["versus_baseline"].get(mode)
        cells = [_fmt(row[m], kind) for m, _, kind in metrics]
        cells += (["—"] * len(metrics) if deltas is None else
                  [f"{_signed(deltas[m]['mean'], kind)} ± {_signed(deltas[m]['std'], kind).lstrip('+')} "
                   f"({deltas[m]['higher']} of {deltas[m]['units']})" for m, _, kind in metrics])
        lines.append(f"| `{mode}` | " + " | ".join(cells) + " |")
    return lines + [""]
