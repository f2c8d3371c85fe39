"""The Markdown of ``reports/benchmark.md``: one table per benchmark, each model beside the trivial baselines and
chance, each table saying which split chose and which scored. ``tasks.evaluate`` computes the numbers; this module
only lays them out (the set-fusion and discovery sections are ``tasks.evaluate.fusion`` / ``.discovery``'s)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.common import Paths
from tasks.evaluate.cells import FEW_FALSE_ACCEPTS_NOTE, few_false_accepts, thin


def aligner_section(aligner: dict[str, Any], align: dict[str, Any]) -> list[str]:
    """Markdown for the DFA aligner: NME on held-out unaligned faces, the alignment residual, the YuNet reference."""
    if not aligner:
        return []
    row = lambda name, p: (f"| {name} | {aligner[p + 'nme']:.4f} | {100 * aligner[p + 'failure@0.1']:.1f} % | "  # noqa: E731
                           f"{aligner[p + 'auc@0.1']:.3f} |")
    lines = ["", f"## Aligner (DFA) on {int(aligner.get('test/faces', 0))} held-out unaligned faces", "",
             "NME = mean landmark error / inter-pupil distance (5 points have no outer eye corners). Chosen on: "
             "split `val` (the recipe's lr, anchor weight and weight decay by a val sweep, see "
             "docs/methods/aligner.md; the last epoch is kept). Scored on: split `test`, once.", "",
             "| predictor | NME | failure (NME > 0.1) | AUC@0.1 |", "|---|---|---|---|",
             row("DFA", "test/"), row("mean landmarks (trivial)", "test/mean_shape_")]
    if "test/face_auc" in aligner:
        rho = aligner.get("quality/score_spearman", float("nan"))
        lines += ["", f"Face score (pooled face probability) on the held-out faces vs "
                  f"{int(aligner.get('test/nonfaces', 0))} held-out non-face crops, and its rank correlation with the "
                  "procedural quality on "
                  f"{int(aligner.get('quality/faces', 0))} rendered faces:", "",
                  "| ROC AUC | accuracy at 0.5 | mean score: faces | mean score: non-faces | Spearman ρ with quality |",
                  "|---|---|---|---|---|",
                  f"| {aligner['test/face_auc']:.3f} | {100 * aligner['test/face_accuracy@0.5']:.1f} % | "
                  f"{aligner['test/face_score_mean']:.3f} | {aligner['test/nonface_score_mean']:.3f} | {rho:.3f} |"]
    if align:
        lines += ["", f"After `align`, the ground-truth landmarks land {align['align/residual_px']:.2f} px from the "
                  f"ArcFace template on average (NME {align['align/residual_nme']:.4f})."]
    if "align/real/template_nme" in align:  # ingested real faces: already aligned, so the template is the truth
        nme, failed = align["align/real/template_nme"], align["align/real/template_failure@0.1"]
        lines += ["", f"On the {int(align['align/real/faces'])} ingested real faces (aligned before ingest, so their "
                  f"landmarks should sit on the ArcFace template), DFA's landmarks lie NME {nme:.4f} from the template, "
                  f"{100 * failed:.1f} % of faces above 0.1; mean face score {align['align/real/score_mean']:.3f}. "
                  + ("These are the keypoints a KP-RPE model reads on real faces: at this error they are unreliable "
                     "(DFA was trained on procedural faces only)." if nme > 0.1 else
                     "These are the keypoints a KP-RPE model reads on real faces.")]
    yunet = aligner.get("yunet", {})
    if "skipped" in yunet:
        lines += ["", f"YuNet beside DFA on the procedural test faces skipped: {yunet['skipped']}."]
    elif "dfa/nme_box" in yunet:
        cell = lambda p: (f"{yunet[p + 'nme']:.4f} | {yunet[p + 'nme_box']:.4f} | "  # noqa: E731
                          f"{100 * yunet[p + 'failure_box@0.05']:.1f} % |")
        lines += ["", f"A landmark detector nobody here trained, OpenCV Zoo's YuNet, on the same test faces: it finds "
                  f"{100 * yunet['found']:.1f} % of them ({int(yunet['faces'])}); on those, its points as they come "
                  "and mapped to the renderer's landmark convention (an affine map in its own eye frame, fitted on "
                  f"the {int(yunet['fit_faces'])} val faces it found), beside DFA on the same faces:", "",
                  "| predictor, faces YuNet found | NME | NME (face box) | failure (box NME > 0.05) |",
                  "|---|---|---|---|", "| DFA | " + cell("dfa/"), "| YuNet, convention mapped | " + cell("mapped/"),
                  "| YuNet, as it comes | " + cell("raw/")]
    ref = aligner.get("reference", {})
    if "skipped" in ref:
        lines += ["", f"YuNet comparison on real faces skipped: {ref['skipped']}."]
    elif ref:
        lines += ["", f"On {ref['yunet_found']} real aligned faces ({ref['size']}×{ref['size']}"
                  + (f", {ref['source']}" if "source" in ref else "") + ") where OpenCV Zoo's YuNet "
                  f"found a face, DFA vs YuNet landmarks: NME {ref['nme_vs_yunet']:.4f} (median "
                  f"{ref['median_nme_vs_yunet']:.4f}), {100 * ref['failure@0.1_vs_yunet']:.1f} % above 0.1. DFA was "
                  "trained on procedural faces only."]
    return lines + ["", "![CED](../plots/aligner_ced.png)"]


def data_section(paths: Paths, bins: list[Path], metrics: dict[str, float], models: dict[str, dict]) -> list[str]:
    """Markdown: which benchmark read which data (the user's real faces or procedural ones), and with real faces
    ingested, each model's numbers on the held-out real identities."""
    import json

    from ml.data.dataset import read_dataset_info

    def described(directory: Path) -> str:
        if not (directory / "dataset.json").is_file():
            return "—"
        info = read_dataset_info(directory)
        origin = (info.get("generator") or {}).get("ingested_from")
        where = f" from `{origin}`" if origin else ""
        splits = info.get("splits") or {}
        split_text = f" ({', '.join(f'{n} {s}' for s, n in splits.items())})" if len(splits) > 1 else ""
        return f"{info['source']}{where}: {info['identity_count']} identities, {info['image_count']} images{split_text}"

    gfd_info = paths.gfd_split.parent / "split.json"
    gfd = json.loads(gfd_info.read_text())["dataset"] if gfd_info.is_file() else None
    rows = [("FR training (`real`), generator, fusion", described(paths.train_set)),
            ("identification, open set (held-out identities)", described(paths.heldout_set))]
    kind = {"real": "real held-out identities (never trained on)", "procedural": "procedural held-out identities"}
    for b in bins:
        rows.append((f"verification `{b.name}`", kind.get(b.stem, f"your `.bin` from `{b.parent}`")))
    rows += [("templates (IJB-B/C style)", "procedural: video-like sequences + stills (real folders have no sequences)"),
             ("video probes (IJB-S style)", "procedural: long mixed-quality sequences"),
             ("discovery (GFD split)", "—" if gfd is None else described(paths.prepared / gfd)),
             ("aligner", "procedural unaligned crops (training needs exact landmarks)")]
    lines = ["", "## Data: which benchmark used which faces", "", "| benchmark | data |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    if "real" not in {b.stem for b in bins}:
        return lines
    fars = sorted({k.rsplit("/", 1)[1] for k in metrics if "/verification/real/tar@" in k},
                  key=lambda f: float(f.split("=")[1]))
    ranks, trivial = informative_ranks(metrics)
    lines += ["", "## Real faces: held-out identities (never trained on)", "", *trivial,
              "| model | trained on | `real.bin` accuracy | " + " | ".join(f.replace("tar@far", "TAR@FAR") for f in fars)
              + "".join(f" | rank-{r}" for r in ranks) + " |", "|---|---|---|" + "---|" * (len(fars) + len(ranks))]
    pct = lambda v: "—" if v is None else f"{100 * v:.2f} %"  # noqa: E731
    for tag, config in [*models.items(), ("chance", {})]:
        acc = metrics.get(f"{tag}/verification/real/accuracy")
        source = config.get("extra", {}).get("training_data_source", "?") if config else ""
        lines.append(f"| {'chance' if tag == 'chance' else f'`{tag}`'} | {source} | {pct(acc)} | "
                     + " | ".join(pct(metrics.get(f"{tag}/verification/real/{f}")) for f in fars)
                     + "".join(f" | {pct(metrics.get(f'{tag}/identification/rank{r}'))}" for r in ranks) + " |")
    return lines


def informative_ranks(metrics: dict[str, float]) -> tuple[list[int], list[str]]:
    """The closed-set ranks worth a column (rank-r with r below the gallery's identity count: chance under 1), and
    a note naming the others, which every ranking reaches (rank-5 over a gallery of 5 identities is always 100 %)."""
    ranks = sorted({int(k.rsplit("rank", 1)[1]) for k in metrics if "/identification/rank" in k})
    kept = [r for r in ranks if metrics.get(f"chance/identification/rank{r}", 0.0) < 1.0]
    dropped = [r for r in ranks if r not in kept]
    if not dropped:
        return kept, []
    chance1 = metrics.get("chance/identification/rank1")
    gallery = f"{round(1 / chance1)} identities" if chance1 else "its identities"
    return kept, [f"Not shown: {', '.join(f'rank-{r}' for r in dropped)}, which the gallery of {gallery} makes "
                  "100 % for any ranking.", ""]


def preset_note(params: Mapping[str, Any], root: Path) -> list[str]:
    """A line naming each ``presets.yaml`` preset whose every key this run's params carry, so that a toy run
    (``smoke``) says so at the top and nobody reads its numbers as the default's."""
    from tasks.common import load_yaml
    from tasks.params import PRESETS_FILE, lookup

    path = Path(root) / PRESETS_FILE
    presets = (load_yaml(path.read_text()) if path.is_file() else None) or {}
    found = [name for name, delta in presets.items()
             if delta and all(lookup(params, key.split(".")) == value for key, value in delta.items())]
    if not found:
        return []
    names = " and ".join(f"`{n}`" for n in found)
    return [f"**Configuration: the {names} preset of `presets.yaml`** (`faceops run --preset`)"
            + (": toy sizes and one-epoch models that check the pipeline runs; its numbers say nothing about the "
               "methods." if "smoke" in found else "."), ""]


def templates_section(metrics: dict[str, float], models: list[str]) -> list[str]:
    """The IJB-style template table of ``reports/benchmark.md``: TAR at each FAR per model, its pair counts, chance,
    and cells on too few false accepts marked (``few_false_accepts``)."""
    pct = lambda v: "—" if v is None else f"{100 * v:.2f} %"  # noqa: E731
    fars = sorted({k.split("/")[-1] for k in metrics if "/templates/tar@" in k}, key=lambda f: float(f.split("=")[1]))
    lines = ["", "## Templates (IJB-style: media mean → template mean)", "",
             "| model | " + " | ".join(f.replace("tar@", "TAR@") for f in fars) + " | pairs (impostor) |",
             "|---|" + "---|" * (len(fars) + 1)]
    for tag in models:
        impostors = metrics.get(f"{tag}/templates/impostor_pairs")
        lines.append(f"| `{tag}` | " + " | ".join(few_false_accepts(pct(metrics.get(f"{tag}/templates/{f}")), f,
                                                                      impostors) for f in fars) +
                     f" | {int(metrics.get(f'{tag}/templates/pairs', 0))} ({int(impostors or 0)}) |")
    if any(f"chance/templates/{f}" in metrics for f in fars):
        lines.append("| chance (random scores) | " + " | ".join(pct(metrics.get(f"chance/templates/{f}")) for f in fars)
                     + " | |")
    if any(thin(f, metrics.get(f"{tag}/templates/impostor_pairs")) for tag in models for f in fars):
        lines += ["", FEW_FALSE_ACCEPTS_NOTE]
    return lines


def render_report(metrics: dict[str, float], models: dict[str, dict], train_metrics: dict[str, dict],
                  extra_sections: list[str] = (), note: list[str] = ()) -> str:
    """``reports/benchmark.md``: the run's numbers, one row per trained model plus the pixel baselines; ``note``
    (``preset_note``) goes under the title."""
    pct = lambda v: "—" if v is None else f"{100 * v:.2f} %"  # noqa: E731
    lines = [
        "# faceops benchmark",
        "",
        *note,
        f"Generated by the `evaluate` stage on {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}. "
        "Every number below was measured in this run; `metrics/evaluate.json` has all of them.",
        "",
        "## Models",
        "",
        "| model | backbone | training data | trained on: identities / images (split `train`) | digest | train time "
        "| final train/accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for tag, config in models.items():
        extra = config.get("extra", {})
        tm = train_metrics.get(tag, {})
        if extra.get("training_source") == "pretrained":  # `faceops import`: trained elsewhere, on data we never saw
            lines.append(f"| `{tag}` | `{config.get('backbone')}` | pretrained ({extra.get('format')}: "
                         f"`{Path(str(extra.get('file', ''))).name}`) | — | `{str(extra.get('sha256', ''))[:12]}` | — | — |")
            continue
        lines.append(
            f"| `{tag}` | `{config.get('backbone')}` | {extra.get('training_data_source', '?')} | "
            f"{extra.get('training_identities', '?')} / {extra.get('training_images', '?')} | "
            f"`{str(extra.get('training_data_digest', ''))[:12]}` | {tm.get('train/seconds', float('nan')):.0f} s | "
            f"{tm.get('train/accuracy', float('nan')):.3f} |"
        )
    names = sorted({k.split("/")[-2] for k in metrics if "/verification/" in k and k.endswith("/accuracy")})
    lines += ["", "## Verification (10-fold accuracy ± std over folds, flip TTA, held-out identities)", "",
              "Chosen on: the FR models keep their last epoch; `faceops sweep train_fr` tunes `fr` on the training "
              "identities' `val` images. Scored on: the held-out identities below, which nothing above reads.", "",
              "| embedding | " + " | ".join(f"`{n}.bin`" for n in names) + " |", "|---|" + "---|" * len(names)]
    rows = [(f"FR model `{tag}`", f"{tag}/") for tag in models] + [
        ("raw-pixel cosine (baseline)", "baseline/raw_pixels/"), ("linear probe on pixels (baseline)", "baseline/linear_probe/"),
        ("chance (majority share of the pairs)", "chance/")]
    for label, prefix in rows:
        cells = []
        for n in names:
            acc, std = metrics.get(f"{prefix}verification/{n}/accuracy"), metrics.get(f"{prefix}verification/{n}/std")
            skipped = metrics.get(f"{prefix}verification/{n}/skipped_no_landmarks")
            cells.append("no landmarks" if skipped else ("—" if acc is None else f"{100 * acc:.2f} ± {100 * std:.2f} %"))
        if any(c != "—" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += templates_section(metrics, list(models))
    ranks, trivial = informative_ranks(metrics)
    lines += ["", "## Identification (closed set, held-out identities, cosine)", "", *trivial,
              "| model | " + " | ".join(f"rank-{r}" for r in ranks) + " |", "|---|" + "---|" * len(ranks)]
    for tag in [*models, "chance"]:
        name = "chance (r / gallery identities)" if tag == "chance" else f"`{tag}`"
        lines.append(f"| {name} | " + " | ".join(pct(metrics.get(f"{tag}/identification/rank{r}")) for r in ranks) + " |")
    open_keys = sorted({k.split("/", 1)[1] for k in metrics if ("/open_set/" in k or "/distractors/rank" in k)
                        and metrics.get("chance/" + k.split("/", 1)[1], 0.0) < 1.0},  # rank-N ≥ gallery: trivial
                       key=lambda k: (k.startswith("distractors"), int(k.rsplit("rank", 1)[1]) if "rank" in k else 0, k))
    if open_keys:
        lines += ["", "## Open set (enrolled = half the held-out identities)", "",
                  "TPIR@FPIR: rank-1 hits above the threshold that lets that share of non-enrolled probes through. "
                  "Distractors: closed-set rank-N of enrolled probes with every image of the non-enrolled identities "
                  "added to the gallery as its own identity.", "",
                  "| model | " + " | ".join(k.replace("open_set/", "").replace("distractors/", "distractors ") for k in open_keys) + " |",
                  "|---|" + "---|" * len(open_keys)]
        for tag in [*models, "chance"]:
            name = "chance (random scores)" if tag == "chance" else f"`{tag}`"
            lines.append(f"| {name} | " + " | ".join(pct(metrics.get(f"{tag}/{k}")) for k in open_keys) + " |")
    lines += ["", "![ROC](../plots/roc.png)"]
    from tasks.evaluate import discovery as discovery_eval, fusion as sets_eval

    lines += list(extra_sections) + sets_eval.render_section(metrics) + discovery_eval.render_section(metrics) + [""]
    return "\n".join(lines)
