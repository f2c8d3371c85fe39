"""The ``evaluate`` report's synthetic-data section: the UIFace set's metrics, its calibrated gates and the
synthetic–real gap (UIFace Table 3)."""

from __future__ import annotations

from typing import Any

GATES = (  # (gate, what it compares, its outcome: the count past the threshold and what that does)
    ("privacy", "synthetic identity centre ↔ nearest real training identity (cosine)",
     "{n} identities above: dropped"),
    ("memorisation", "synthetic face ↔ nearest real training face (cosine)",
     "{n} faces above (above `synthesize.max_memorised_fraction` of the faces the stage fails)"),
    ("consistency", "mean cosine within a synthetic identity", "{n} identities below: dropped"),
    ("copy", "synthetic face ↔ nearest training face through the generator's decoder (RMS pixel difference)",
     "{n} faces below (above `synthesize.max_memorised_fraction` of the faces the stage fails)"),
)


def gates_table(synth: dict[str, Any]) -> list[str]:
    """Each gate's threshold, where it came from and its real reference (``synthetic/gate/*``)."""
    if "synthetic/gate/privacy/threshold" not in synth:
        return []
    lines = ["", "Gates, calibrated on real faces of never-trained identities (the GFD split's labelled images) "
             "under the same FR model; the copy gate on the training faces themselves, made at the generator's size "
             "and passed through its decoder (a decoded copy's FR cosine falls within a second photo's):", "",
             "| gate | compares | threshold | from | real reference median | synthetic | outcome |",
             "|---|---|---|---|---|---|---|"]
    observed = {"privacy": ("max_real_cosine_mean", "mean; max {max_real_cosine:.3f}", "dropped_too_close_to_real"),
                "memorisation": ("nearest_real_cosine_p99", "p99", "memorised_faces"),
                "consistency": ("identity_consistency_min_before_gates", "min before the gates",
                                "dropped_inconsistent"),
                "copy": ("nearest_train_pixel_distance_min", "min", "pixel_copies")}
    for gate, compares, action in GATES:
        if f"synthetic/gate/{gate}/threshold" not in synth:  # a run from before the gate
            continue
        g = lambda key: synth.get(f"synthetic/gate/{gate}/{key}", float("nan"))  # noqa: E731
        percentile = g("percentile")
        source = "set by hand" if percentile < 0 else f"p{percentile:g} of {int(g('reference_size'))} real values"
        key, how, count = observed[gate]
        how = how.format(max_real_cosine=synth.get("synthetic/max_real_cosine", float("nan")))
        lines.append(f"| {gate} | {compares} | {g('threshold'):.3f} | {source} | {g('reference_median'):.3f} | "
                     f"{synth.get(f'synthetic/{key}', float('nan')):.3f} ({how}) | "
                     + action.format(n=int(synth.get(f"synthetic/{count}", 0))) + " |")
    return lines


def synthetic_gap(metrics: dict[str, float]) -> dict[str, float]:
    """UIFace Table 3's synthetic–real gap ``(REAL − SYN)/SYN`` of verification accuracy, per verification set and
    per non-real model (``synthetic``, ``mixed``): ``gap/<model>/<set>`` against the model trained on the whole real
    set, ``gap_matched/<model>/<set>`` against ``real_matched`` (the real set at the synthetic set's budget)."""
    out = {}
    for reference, prefix in (("real", "gap"), ("real_matched", "gap_matched")):
        for key, real in metrics.items():
            if key.startswith(f"{reference}/verification/") and key.endswith("/accuracy"):
                name = key.split("/")[-2]
                for tag in ("synthetic", "mixed"):
                    syn = metrics.get(f"{tag}/verification/{name}/accuracy")
                    if syn:
                        out[f"{prefix}/{tag}/{name}"] = (real - syn) / syn
    return out


def table3(metrics: dict[str, float], models: dict[str, dict]) -> list[str]:
    """UIFace Table 3: verification accuracy of the real-trained models (at the synthetic set's budget and at their
    own) and the synthetic-trained one, beside the pixel baselines and chance, with the gaps."""
    names = sorted({k.split("/")[2] for k in metrics if k.startswith(("gap/", "gap_matched/"))})
    if not names:
        return []

    def budget(tag: str) -> str:
        """"identities × images per identity" of a model's training data."""
        extra = models.get(tag, {}).get("extra", {})
        ids = int(extra.get("training_identities", 0) or 0)
        return f"{ids} × {int(extra.get('training_images', 0)) // max(ids, 1)}" if ids else "?"

    rows = [(f"`real_matched`: real faces at the synthetic set's budget ({budget('real_matched')})", "real_matched",
             "gap_matched"),
            (f"`real`: the whole real training set ({budget('real')})", "real", "gap"),
            (f"`synthetic`: UIFace faces ({budget('synthetic')})", "synthetic", None),
            ("linear probe on pixels (baseline)", "baseline/linear_probe", None),
            ("raw-pixel cosine (baseline)", "baseline/raw_pixels", None),
            ("chance (majority share of the pairs)", "chance", None)]
    lines = ["", "Table 3 (UIFace): verification accuracy by training data; gap `(REAL − SYN)/SYN` against the "
             "synthetic-trained model (0 = no gap). Like for like is the first row: equal identities × images.", "",
             "| trained on | " + " | ".join(f"`{n}.bin`" for n in names) + " | gap to `synthetic` |",
             "|---|" + "---|" * len(names) + "---|"]
    for label, prefix, gap in rows:
        cells = [metrics.get(f"{prefix}/verification/{n}/accuracy") for n in names]
        if all(c is None for c in cells):
            continue
        gaps = ", ".join(f"{metrics[f'{gap}/synthetic/{n}']:+.3f}" for n in names
                         if gap and f"{gap}/synthetic/{n}" in metrics) or "—"
        lines.append(f"| {label} | " + " | ".join("—" if c is None else f"{100 * c:.2f} %" for c in cells)
                     + f" | {gaps} |")
    return lines


def _accuracy(m: dict[str, float], model: str) -> float:
    return m[f"{model}/verification/procedural/accuracy"]


def _share_of_real(key: str, real: str) -> Any:
    """A judge's acceptance of synthetic faces as a percentage of its acceptance of real faces at their size."""
    return lambda s, m, g: 100 * s[f"synthetic/judge/{key}"] / max(s[f"synthetic/judge/{real}"], 1e-9)


# (what, its value, its ceiling at this run's set size and decoder (CEILINGS), the goal, unit, ≥ or ≤);
# value and ceiling from (synthesize.json, evaluate metrics, train_generator.json); a ceiling of None: none known
TARGETS = (
    ("synthetic-trained FR − `real_matched` (`procedural.bin`)",
     lambda s, m, g: 100 * (_accuracy(m, "synthetic") - _accuracy(m, "real_matched")), None, -2.0, "pp", "≥"),
    ("synthetic-trained FR − linear probe on pixels (`procedural.bin`)",
     lambda s, m, g: 100 * (_accuracy(m, "synthetic") - _accuracy(m, "baseline/linear_probe")),
     lambda s, m, g: 100 * (_accuracy(m, "real_matched") - _accuracy(m, "baseline/linear_probe")), 3.0, "pp", "≥"),
    ("synthetic faces the aligner calls faces, % of real faces at their size",
     _share_of_real("face_share", "real_at_size_face_share"),
     _share_of_real("reconstruction_face_share", "real_at_size_face_share"), 90.0, "%", "≥"),
    ("synthetic faces YuNet detects, % of real faces at their size",
     _share_of_real("detector_face_share", "detector_real_at_size_face_share"), None, 90.0, "%", "≥"),
    ("Fréchet distance to real faces, % of the non-face crops'",
     lambda s, m, g: 100 * s["synthetic/judge/frechet"] / s["synthetic/judge/frechet_nonface"], None, 25.0, "%", "≤"),
    ("latent autoencoder PSNR (training faces)", lambda s, m, g: g["autoencoder/psnr"], None, 26.0, "dB", "≥"),
    ("`train_generator` + `synthesize` seconds",
     lambda s, m, g: g["train/seconds"] + g.get("autoencoder/seconds", 0.0) + s["synthetic/seconds"], None, 600.0,
     "s", "≤"),
)
CEILINGS = ("Ceiling at this budget: for the FR target, what real faces give in place of the synthetic ones at as "
            "many identities × images (`real_matched`), i.e. a generator whose faces were as good as real ones; for "
            "the aligner, a latent generator's autoencoder reconstructions of real faces, as no face decoded through "
            "it is sharper (a pixel-space generator has no decoder: its ceiling is 100 %). A goal above its ceiling "
            "needs a larger synthetic set or a sharper decoder before a better generator can meet it.")


def targets_table(synth: dict[str, Any], metrics: dict[str, float], generator: dict[str, Any] | None) -> list[str]:
    """The synthetic data's targets at the embedded default (docs/methods/generator.md), each beside its
    measurement, by how much it is met or missed, and its ceiling at this budget (``CEILINGS``); a target whose
    inputs this run lacks is left out, a ceiling whose inputs it lacks is a dash."""
    rows = []
    for what, value, ceiling, target, unit, sense in TARGETS:
        args = (synth, metrics, generator or {})
        try:
            v = float(value(*args))
        except KeyError:
            continue
        try:
            top = None if ceiling is None else float(ceiling(*args))
        except KeyError:
            top = None
        met = v >= target if sense == "≥" else v <= target
        shown = "pp" if unit == "%" else unit
        outcome = "met" if met else f"**missed by {abs(target - v):.1f} {shown}**"
        reach = "—" if top is None else f"{top:.1f} {unit}" + (" (**below the goal**)" if top < target else "")
        rows.append(f"| {what} | {sense} {target:g} {unit} | {v:.1f} {unit} | {outcome} | {reach} |")
    if not rows:
        return []
    return ["", "Targets for the synthetic data at the embedded default (why a miss happens: "
            "docs/methods/generator.md, \"Known limitations and honest nulls\"):", "",
            "| target | goal | this run | outcome | ceiling at this budget |", "|---|---|---|---|---|", *rows,
            "", CEILINGS]


def synthetic_section(synth: dict[str, Any], metrics: dict[str, float], models: dict[str, dict],
                      generator: dict[str, Any] | None = None) -> list[str]:
    """Markdown for the UIFace synthetic set: its diversity metrics, the synthetic–real gap and the targets
    (``generator``: ``metrics/train_generator.json``, for the autoencoder's PSNR)."""
    if not synth:
        return []
    k = lambda name: synth.get(f"synthetic/{name}", float("nan"))  # noqa: E731
    pr = sorted(key.split("@")[1] for key in synth if key.startswith("synthetic/precision@"))
    lines = ["", f"## Synthetic data (UIFace): {int(k('identities'))} identities × "
             f"{int(k('images')) // max(int(k('identities')), 1)} faces", "",
             "Under the FR model `real`; diversity = mean intra-class (1 − cos), an embedding proxy for LPIPS (whose "
             "VGG weights are not available offline); precision/recall: Improved P/R against real training faces. "
             "Chosen on: nothing (the generator keeps its last epoch). Scored on: its samples.", "",
             "| identity consistency (min), kept / before the gates | diversity | inter-class cos mean / max | "
             + " | ".join(f"precision / recall @{p}" for p in pr) + " | t0 mean ± std | UNet evals / face |",
             "|---|---|---|" + "---|" * len(pr) + "---|---|",
             f"| {k('identity_consistency'):.3f} ({k('identity_consistency_min'):.3f}) / "
             f"{k('identity_consistency_before_gates'):.3f} ({k('identity_consistency_min_before_gates'):.3f}) | "
             f"{k('diversity'):.3f} | "
             f"{k('inter_class_mean_cos'):.3f} / {k('inter_class_max_cos'):.3f} | "
             + " | ".join(f"{k('precision@' + p):.3f} / {k('recall@' + p):.3f}" for p in pr)
             + f" | {k('t0_mean'):.0f} ± {k('t0_std'):.0f} | {k('unet_evals_per_image'):.1f} |"]
    if "synthetic/judge/face_share" in synth:  # a second opinion: not the FR model that conditions the generator
        lines += ["", f"Are they faces? The DFA aligner's face score (trained on procedural faces against non-face "
                  f"crops, never on generated faces; its own threshold 0.5) accepts "
                  f"{100 * k('judge/face_share'):.1f} % of the synthetic faces (mean score "
                  f"{k('judge/face_score_mean'):.2f}), {100 * k('judge/real_face_share'):.1f} % of real training "
                  f"faces and {100 * k('judge/nonface_share'):.1f} % of held-out non-face crops."]
        ceilings = [f"{what} pass at {100 * k(f'judge/{key}'):.1f} % ({bound})" for key, what, bound in (
            ("real_at_size_face_share", "real faces made at the generator's face size and resized back",
             "the most a generator of that size can reach"),
            ("reconstruction_face_share", "the autoencoder's reconstructions of those faces",
             "the most a generator decoding through it can reach"))
            if f"synthetic/judge/{key}" in synth]
        if ceilings:
            lines[-1] += " Ceilings: " + "; ".join(ceilings) + "."
        if "synthetic/judge/detector_face_share" in synth:
            lines[-1] += (f" A second judge nobody here trained, OpenCV Zoo's YuNet face detector (faces upscaled to "
                          f"128 px), finds {100 * k('judge/detector_face_share'):.1f} % of the synthetic faces and "
                          f"{100 * k('judge/detector_real_at_size_face_share'):.1f} % of real faces made at the "
                          "generator's size.")
    if "synthetic/judge/frechet" in synth:
        lines += ["", f"Fréchet distance to {k('judge/frechet_faces'):.0f} real training faces in the aligner's "
                  f"backbone features (FID's formula; lower is closer; equal sample sizes): synthetic faces "
                  f"{k('judge/frechet'):.2f}, a second real sample {k('judge/frechet_real'):.2f} (the floor), "
                  f"non-face crops {k('judge/frechet_nonface'):.2f}."]
    if "synthetic/judge/identity_auc" in synth:
        real = ("" if "synthetic/judge/real_at_size_identity_auc" not in synth else
                f"; as many real training identities made at the generator's size: "
                f"{k('judge/real_at_size_identity_consistency'):.3f} and {k('judge/real_at_size_identity_auc'):.3f}")
        lines += ["", f"Identities to a recogniser nobody here trained (`synthesize.identity_judge`, before the "
                  f"gates; chance AUC 0.5): consistency {k('judge/identity_consistency'):.3f}, same- vs "
                  f"different-identity ROC AUC {k('judge/identity_auc'):.3f}{real}."]
    return (lines + table3(metrics, models) + targets_table(synth, metrics, generator) + gates_table(synth)
            + ["", "![synthetic faces](../plots/synthetic_samples.png)"])
