"""The metrics and the report of ``python -m experiments.long_probes``: rank-1 / rank-5 / TPIR@FPIR per gallery
and method, rank-1 versus probe length (``ml.fusion.sets.video_identification``), memory growth with probe length,
the gain plot and ``reports/long_probes.md`` with sentences computed from the numbers.
"""

from __future__ import annotations

import datetime as dt
import math
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments.long_probes.setup import LABELS, LOW_QUALITY, REFERENCES, ROOT, LongProbesConfig, ProbeSpec
from experiments.long_probes.probe_stream import ProbeResult

REPORT = Path("reports") / "long_probes.md"
PLOT = Path("plots") / "long_probes_gain.png"
MIB = 1 << 20


def _prefix_keys(cfg: LongProbesConfig) -> list[int]:
    """The probe-length columns: each distinct ``--prefixes`` N ascending, then 0 = all frames."""
    return [*sorted(set(cfg.prefixes)), 0]


def _gains(metrics: dict[str, Any], method: str, keys: Sequence[int]) -> list[float]:
    """``method``'s rank-1 minus averaging's (single gallery), in points, per probe-length column."""
    return [100 * (metrics["prefix"][method][k] - metrics["prefix"]["average"][k]) for k in keys]


def _tpir_key(row: dict[str, float]) -> str | None:
    """The ``tpir@fpir=…`` key of a ``video_identification`` result (None without non-mated probes)."""
    return next((k for k in row if k.startswith("tpir@fpir=")), None)


def identification(specs: Sequence[ProbeSpec], results: Sequence[ProbeResult], gallery_ids: np.ndarray,
                   gallery: dict[str, dict[str, np.ndarray]], cfg: LongProbesConfig) -> dict[str, Any]:
    """``{"<gallery>": {method: {"rank1", "rank5", "tpir@fpir=1e-2", ...}}, "prefix": {method: {N: rank1}},
    "prefix_frames": {N: mean frames}}`` from ``ml.fusion.sets.video_identification``."""
    from ml.fusion.sets import video_identification

    probe_ids = np.array([s.identity for s in specs])
    mated = np.array([s.enrolled for s in specs])
    out: dict[str, Any] = {}
    for name, per_method in gallery.items():
        out[name] = {}
        for m in cfg.methods:
            probes = np.stack([r.templates[m] for r in results])
            out[name][m] = video_identification(probes, probe_ids, per_method[m], gallery_ids, ranks=cfg.ranks,
                                                fpirs=(cfg.fpir,))
    keys = _prefix_keys(cfg)
    out["prefix"] = {}
    for m in cfg.methods:
        out["prefix"][m] = {}
        for p in keys:
            probes = np.stack([r.templates[m] if p == 0 else r.prefix_templates[m][p]
                               for r, keep in zip(results, mated) if keep])
            out["prefix"][m][p] = video_identification(probes, probe_ids[mated], gallery["single"][m], gallery_ids,
                                                       ranks=(1,))["rank1"]
    kept = [r for r, keep in zip(results, mated) if keep]
    out["prefix_frames"] = {p: float(np.mean([r.prefix_frames[p] if p else r.frames for r in kept])) for p in keys}
    if "average" in cfg.methods:  # how far each method's probe templates are from averaging's (every probe)
        out["cosine"] = {}
        for m in cfg.methods:
            if m == "average":
                continue
            out["cosine"][m] = {}
            for p in keys:
                pick = (lambda r, k: r.templates[k]) if p == 0 else (lambda r, k: r.prefix_templates[k][p])
                cos = np.array([float(np.dot(pick(r, m), pick(r, "average"))) for r in results])
                out["cosine"][m][p] = (float(cos.mean()), float(cos.min()))
    return out


@dataclass
class RunInfo:
    """What the report states besides the metrics."""

    specs: list[ProbeSpec]
    first_identity: int
    image_size: int
    landmarks_source: str  # "dfa" or "truth"
    wall_seconds: float
    probe_wall_seconds: float
    load_before: tuple[float, float, float] | None
    load_after: tuple[float, float, float] | None
    cores: int
    measured_at: str = field(default_factory=lambda: f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}")
    fr_digest: str = ""
    surveillance: dict[str, Any] = field(default_factory=dict)  # data.surveillance (SurveillanceConfig fields)


def _show(path: Path | None) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    if path is None:
        return "none"
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _design_text(cfg: LongProbesConfig, info: RunInfo) -> str:
    """How the report describes the probe frames."""
    size = f"{info.image_size}×{info.image_size} px"
    if cfg.design == "procedural":
        return ("smooth procedural video-like sequences (`ProceduralFaces.sequence` with `data.procedural` of "
                f"`params.yaml`, aligned, {size}; `--design procedural`)")
    fraction = info.surveillance.get("usable_fraction")
    window = f"{100 * fraction:g} %" if isinstance(fraction, (int, float)) else "a share"
    return ("IJB-S-like surveillance sequences as `prepare` writes for the `evaluate` stage "
            "(`ml.data.surveillance.stream_surveillance_sequence`, `data.surveillance` of `params.yaml`: most frames "
            f"heavily degraded, a contiguous usable window of {window} of each probe at a random place; "
            f"`data.procedural`, aligned, {size})")


def _n(count: int, singular: str, plural: str | None = None) -> str:
    """"1 still", "3 stills"."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def _pct(value: float | None) -> str:
    return "—" if value is None or value != value else f"{100 * value:.1f}"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MIB:.0f}"


def plot_gain(metrics: dict[str, Any], cfg: LongProbesConfig, path: Path) -> Path:
    """Rank-1 (left) and its gain over averaging (right) versus the mean frames fused per mated probe."""
    from tasks.common import pyplot, save_figure

    plt = pyplot()
    keys = _prefix_keys(cfg)
    x = [metrics["prefix_frames"][k] for k in keys]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6))
    # one colour per method in both panels; decreasing marker sizes keep methods on top of each other visible
    styles = {"average": ("C0", "-", "o", 7), "norm_weighted": ("C1", "--", "s", 5.5),
              "landmark_score": ("C2", ":", "^", 4.5), "caface": ("C3", "-.", "D", 3),
              "quality_oracle": ("0.45", "--", "v", 8)}  # the headroom reference: grey, drawn under the methods
    for m in cfg.methods:
        colour, line, marker, size = styles[m]
        look = dict(color=colour, linestyle=line, marker=marker, ms=size, label=LABELS[m],
                    zorder=1.5 if m in REFERENCES else 2.0)
        y = [100 * metrics["prefix"][m][k] for k in keys]
        left.plot(x, y, **look)
        if "average" in cfg.methods and m != "average":
            base = [100 * metrics["prefix"]["average"][k] for k in keys]
            right.plot(x, [a - b for a, b in zip(y, base)], **look)
    left.set(xscale="log", xlabel="frames fused per probe (first N; last point: all)", ylabel="rank-1 (%)",
             title="Rank-1 vs probe length (single gallery)")
    right.axhline(0.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="frames fused per probe (first N; last point: all)",
              ylabel="rank-1 − average's (points)", title="Gain over averaging (CAFace Fig. 1c)")
    for ax in (left, right):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def _verdict(metrics: dict[str, Any], cfg: LongProbesConfig, results: Sequence[ProbeResult], info: RunInfo
             ) -> list[str]:
    """Plain sentences about what the numbers show, each computed from them."""
    lines: list[str] = []
    n_mated = cfg.enrolled
    keys = _prefix_keys(cfg)
    tpir = _tpir_key(metrics["single"][cfg.methods[0]])
    methods = [m for m in cfg.methods if m not in REFERENCES]  # the oracle is compared below, not ranked
    for name in ("single", "booking") if methods else ():
        r1 = {m: metrics[name][m]["rank1"] for m in methods}
        best = max(r1.values())
        winners = [LABELS[m] for m in methods if r1[m] == best]
        if min(r1.values()) == best:
            lines.append(f"- {name.capitalize()} gallery: every method reaches the same rank-1, {_pct(best)} %.")
        else:
            lines.append(f"- {name.capitalize()} gallery: the best rank-1 is {_pct(best)} % ({', '.join(winners)}); "
                         f"the methods span {_pct(min(r1.values()))}–{_pct(best)} %.")
    if "caface" in cfg.methods and "average" in cfg.methods:
        diffs = []
        for name in ("single", "booking"):
            for key, label in (("rank1", "rank-1"), ("rank5", "rank-5"), (tpir, "TPIR")):
                if key is None:
                    continue
                a, c = metrics[name]["average"].get(key), metrics[name]["caface"].get(key)
                if a is not None and c is not None:
                    diffs.append((f"{name} {label}", 100 * (c - a)))
        text = ", ".join(f"{k} {d:+.1f}" for k, d in diffs)
        if all(d <= 0 for _, d in diffs):
            lines.append(f"- CAFace shows no gain over averaging on these probes (CAFace − average, points: {text}).")
        else:
            lines.append(f"- CAFace − average, points: {text}.")
        gains = _gains(metrics, "caface", keys)
        frames = [metrics["prefix_frames"][k] for k in keys]
        pairs = ", ".join(f"{g:+.1f} at {f:,.0f} frames" for g, f in zip(gains, frames))
        grows = all(b >= a for a, b in zip(gains, gains[1:])) and gains[-1] > gains[0]
        trend = ("grows with the number of frames fused, as in CAFace Fig. 1c" if grows
                 else "is 0 at every probe length (CAFace Fig. 1c has it growing with the frames fused)"
                 if not any(gains) else
                 "does not grow steadily with the number of frames fused (CAFace Fig. 1c has it growing)")
        lines.append(f"- CAFace's rank-1 gain over averaging (single gallery) {trend}: {pairs}.")
    if "quality_oracle" in cfg.methods and "average" in cfg.methods:
        whole = {name: 100 * (metrics[name]["quality_oracle"]["rank1"] - metrics[name]["average"]["rank1"])
                 for name in ("single", "booking")}
        gains = _gains(metrics, "quality_oracle", keys)
        pairs = ", ".join(f"{g:+.1f} at {metrics['prefix_frames'][k]:,.0f} frames" for g, k in zip(gains, keys))
        caface = ""
        if "caface" in cfg.methods:
            got = 100 * (metrics["single"]["caface"]["rank1"] - metrics["single"]["average"]["rank1"])
            caface = f" CAFace's gain on the same probes (single gallery, all frames) is {got:+.1f} points."
        lines.append(
            "- Headroom: the true-quality oracle (each frame weighted by the renderer's quality, which no method "
            f"sees) − average, rank-1 points: single {whole['single']:+.1f}, booking {whole['booking']:+.1f}; by "
            f"probe length (single gallery): {pairs}.{caface}"
        )
    if metrics.get("cosine"):
        first, last = keys[0], keys[-1]
        parts = [f"{LABELS[m]} {row[first][0]:.3f} for the first {first:,} frames and {row[last][0]:.4f} "
                 f"(lowest {row[last][1]:.4f}) for whole probes" for m, row in metrics["cosine"].items()]
        same = all(metrics["single"][m] == metrics["single"][cfg.methods[0]] for m in cfg.methods)
        lines.append("- How close the methods' probe templates are to averaging's (mean cosine): " + "; ".join(parts)
                     + ". A template that close ranks a gallery as averaging's does"
                     + ("; against the single gallery, the same for every method, every rate coincides, and the "
                        "booking gallery's differences come from its stills being fused differently." if same else "."))
    spreads = [r.caface_spread for r in results if r.caface_spread is not None]
    if spreads:
        a_std, p_dev = np.mean(spreads, axis=0)
        lines.append(
            f"- Why CAFace acts as it does: on the first {cfg.caface_chunk} frames of each probe, a frame's cluster "
            f"assignment differs from the others' by a std of {a_std:.4f} (mean over the clusters and probes; "
            f"assignments lie in [0, 1]) and the aggregation weights P differ from uniform (1/M) by {p_dev:.4f} on "
            "average. "
            + ("Both are near 0: the model weighs every frame and every cluster almost alike, so its template is "
               "nearly the average's, whatever the frames' quality; a CAFace trained to tell good frames from bad "
               "would spread them." if a_std < 0.01 and p_dev < 0.01 else
               "The model does weigh frames differently."))
    lines.append(f"- One mated probe is {100 / n_mated:.1f} points of rank-1, so differences below that are one "
                 f"probe; TPIR@FPIR {100 * cfg.fpir:g} % over {cfg.distractors} non-mated probes allows "
                 f"⌊{cfg.fpir:g}·{cfg.distractors}⌋ = {math.floor(cfg.fpir * cfg.distractors)} false alarms, so its "
                 "threshold is the highest non-mated score (observed FPIR 0)." if cfg.distractors else
                 f"- One mated probe is {100 / n_mated:.1f} points of rank-1; without distractors there is no TPIR.")
    growth = memory_growth(results)
    if len(growth) >= 2:
        (short_n, short_g), (long_n, long_g) = min(growth.items()), max(growth.items())
        frame_bytes = info.image_size * info.image_size * 3
        slope = memory_slope(growth)
        summary = (f"peak RSS above the worker's RSS before its first probe (after loading and warming up the "
                   f"models) was +{_mib(short_g)} MiB for the shortest "
                   f"probe ({short_n:,} frames) and +{_mib(long_g)} MiB for the longest ({long_n:,} frames); a "
                   f"least-squares line over all probes has a slope of {slope:,.0f} bytes per frame, against {frame_bytes:,} "
                   f"bytes per frame to hold the images (the longest probe's alone: {_mib(long_n * frame_bytes)} MiB)")
        if slope < 0.1 * frame_bytes:
            lines.append(f"- Memory stays flat as probes grow: {summary}. Besides the models and the runtime, a "
                         "worker holds one chunk in flight and the fusion states above.")
        else:
            lines.append(f"- Memory is not flat: {summary}.")
    return lines


def memory_slope(growth: dict[int, int]) -> float:
    """Least-squares slope (bytes per frame) of peak-RSS growth against probe length."""
    frames = np.array(list(growth), dtype=np.float64)
    values = np.array(list(growth.values()), dtype=np.float64)
    return float(np.polyfit(frames, values, 1)[0])


def memory_growth(results: Sequence[ProbeResult]) -> dict[int, int]:
    """Frames → peak RSS during that probe minus its worker's RSS before the worker's first probe (the least RSS at
    a probe's start in that process), for probes whose peak was measured per probe."""
    if any(r.peak_is_lifetime or r.rss_peak is None or r.rss_start is None for r in results):
        return {}
    base: dict[int, int] = {}
    for r in results:
        base[r.pid] = min(base.get(r.pid, r.rss_start), r.rss_start)  # type: ignore[arg-type]
    out: dict[int, int] = {}
    for r in results:
        out[r.frames] = max(out.get(r.frames, 0), r.rss_peak - base[r.pid])  # type: ignore[operator]
    return out


def render(metrics: dict[str, Any], cfg: LongProbesConfig, results: Sequence[ProbeResult], info: RunInfo) -> str:
    """``reports/long_probes.md``."""
    lengths = np.array([s.length for s in info.specs])
    total = max(1, sum(r.frames for r in results))
    low, quality = sum(r.low_quality for r in results), sum(r.quality_sum for r in results)
    tpir = _tpir_key(metrics["single"][cfg.methods[0]]) or ""
    aligner = (f"DFA predictions of `{_show(cfg.aligner)}` (landmarks and face score; mean distance to the renderer's "
               f"true landmarks {np.mean([r.landmark_error_px for r in results if r.landmark_error_px is not None]):.2f}"
               " px)" if info.landmarks_source == "dfa" else
               "the renderer's ground-truth landmarks, with its quality score as the face score")
    load = ("" if info.load_before is None or info.load_after is None else
            f" Load average (1 min) {info.load_before[0]:.1f} at the start and {info.load_after[0]:.1f} at the end.")
    lines = [
        "# IJB-S-style long video probes: every fusion method, streamed",
        "",
        f"Measured by `python -m experiments.long_probes` on {info.measured_at}, {platform.machine()} with "
        f"{info.cores} cores, {cfg.workers} worker process(es) × {cfg.torch_threads} torch thread(s); "
        f"{info.wall_seconds:.0f} s in all, {info.probe_wall_seconds:.0f} s for the probes.{load} Every number "
        "below was measured in that run. Chosen on: nothing here (each model as its stage trained it, every "
        "fusion method at its defaults). Scored on: the probes and galleries below, identities rendered for this "
        "report only.",
        "",
        "## Configuration",
        "",
        f"- Probes: {cfg.probes} ({_n(cfg.enrolled, 'enrolled identity', 'enrolled identities')} with a gallery, "
        f"{_n(cfg.distractors, 'distractor')} without), lengths log-uniform (stratified) in [{cfg.min_frames:,}, {cfg.max_frames:,}] frames: "
        f"min {lengths.min():,}, median {int(np.median(lengths)):,}, max {lengths.max():,}; "
        f"{int((lengths >= 10_000).sum())} probes of ≥ 10,000 frames; {int(lengths.sum()):,} frames in all.",
        f"- Frames: {_design_text(cfg, info)}, identities {info.first_identity}–"
        f"{info.first_identity + cfg.probes - 1}: after every set `prepare` renders (as are the gallery-only ones), "
        "so no model saw them. Rendered, "
        f"embedded and fused {cfg.chunk} frames at a time; no probe's images are ever held whole. "
        f"{100 * low / total:.1f} % of the {total:,} frames have true quality < {LOW_QUALITY:g} (mean quality "
        f"{quality / total:.3f}).",
        f"- Galleries of {cfg.enrolled + cfg.gallery_only} identities: the {cfg.enrolled} probed ones and "
        f"{cfg.gallery_only} without a probe (identities {info.first_identity + cfg.probes}–"
        f"{info.first_identity + cfg.probes + cfg.gallery_only - 1}). *Single* = the first of "
        f"{_n(cfg.booking_stills, 'booking still')} per identity, alone (the same for every method); *booking* = "
        f"the {_n(cfg.booking_stills, 'still')} fused with the probe's method.",
        f"- FR model `{_show(cfg.fr_model)}` (features without flip, styles for CAFace)"
        + (f", training data digest `{info.fr_digest[:12]}`" if info.fr_digest else "") + "; "
        + (f"CAFace `{_show(cfg.fusion_model)}`, streamed in chunks of {cfg.caface_chunk} frames" if "caface" in cfg.methods
           else "no CAFace") + f"; landmark × face score from {aligner}.",
        "",
    ]
    ranks = [f"rank{r}" for r in cfg.ranks]
    for name, title in (("single", "Surveillance-to-Single (one still per identity)"),
                        ("booking", f"Surveillance-to-Booking ({_n(cfg.booking_stills, 'still')} per identity)")):
        lines += [f"## {title}", "",
                  "| fusion | " + " | ".join(f"rank-{r} (%)" for r in cfg.ranks)
                  + (f" | TPIR@FPIR {100 * cfg.fpir:g} % (%)" if cfg.distractors else "") + " |",
                  "|---|" + "---|" * (len(ranks) + bool(cfg.distractors))]
        for m in cfg.methods:
            cells = [_pct(metrics[name][m].get(k)) for k in ranks]
            if cfg.distractors:
                cells.append(_pct(metrics[name][m].get(tpir)))
            lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
        lines.append("")
    keys = _prefix_keys(cfg)
    head = [f"first {k:,}" if k else "all" for k in keys]
    lines += ["## Rank-1 versus probe length", "",
              f"Rank-1 (%) of the {cfg.enrolled} mated probes against the single gallery when each probe is fused from "
              "its first N frames (a probe shorter than N uses all of its frames).", "",
              "| fusion | " + " | ".join(head) + " |", "|---|" + "---|" * len(keys),
              "| mean frames fused | " + " | ".join(f"{metrics['prefix_frames'][k]:,.0f}" for k in keys) + " |"]
    for m in cfg.methods:
        lines.append(f"| {LABELS[m]} | " + " | ".join(_pct(metrics["prefix"][m][k]) for k in keys) + " |")
    for m, label in (("caface", "CAFace"), ("quality_oracle", "true-quality oracle")):
        if m in cfg.methods and "average" in cfg.methods:
            lines.append(f"| {label} − average (points) | "
                         + " | ".join(f"{g:+.1f}" for g in _gains(metrics, m, keys)) + " |")
    if metrics.get("cosine"):
        lines += ["", f"Cosine between each method's probe template and the average's, mean (lowest) over all "
                  f"{cfg.probes} probes, for the same frames:", "",
                  "| fusion | " + " | ".join(head) + " |", "|---|" + "---|" * len(keys)]
        for m, row in metrics["cosine"].items():
            lines.append(f"| {LABELS[m]} | " + " | ".join(f"{row[k][0]:.4f} ({row[k][1]:.4f})" for k in keys) + " |")
    lines += ["", f"![rank-1 vs probe length](../{PLOT.as_posix()})", ""]

    total_frames = sum(r.frames for r in results)
    secs = {k: sum(r.seconds[k] for r in results) for k in ("render", "landmarks", "embed", "fuse")}
    stage_names = {"render": f"render ({cfg.design} frames)",
                   "landmarks": "landmarks + face score (DFA)" if info.landmarks_source == "dfa"
                   else "landmarks + face score (ground truth, no cost)",
                   "embed": "embed (FR features + styles)",
                   "fuse": f"fuse ({len(cfg.methods)} methods, incl. prefix templates)"}
    lines += ["## Throughput", "",
              f"Seconds summed over the probes (each worker runs one probe at a time with {cfg.torch_threads} torch "
              "thread(s)), and frames per second of one worker for that stage alone.", "",
              "| stage | seconds | frames/s per worker |", "|---|---|---|"]
    for k, label in stage_names.items():
        rate = total_frames / secs[k] if secs[k] > 0 else float("inf")
        lines.append(f"| {label} | {secs[k]:.1f} | {rate:,.0f} |")
    lines += [f"| all probes, wall clock ({cfg.workers} workers) | {info.probe_wall_seconds:.1f} | "
              f"{total_frames / info.probe_wall_seconds:,.0f} (all workers) |", ""]

    lines += ["## Memory", "",
              "Peak resident memory of the worker process while it ran each probe (VmHWM, reset at the probe's start; "
              "it includes the models and the Python runtime), against the images the probe would take if held "
              "at once. Fusion state: the most bytes any stream held (sums, the CAFace memory and its buffer of "
              "under one CAFace chunk).", "",
              "| frames | worker | RSS at start (MiB) | peak RSS (MiB) | above the worker's first RSS (MiB) | "
              "images at once (MiB) | " + " | ".join(f"{LABELS[m]} state (KiB)" for m in cfg.methods) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(cfg.methods)]
    growth = memory_growth(results)
    for r in sorted(results, key=lambda r: r.frames):
        held = r.frames * info.image_size * info.image_size * 3
        above = f"+{_mib(growth[r.frames])}" if r.frames in growth else "—"
        lines.append(f"| {r.frames:,} | {r.pid} | {_mib(r.rss_start)} | {_mib(r.rss_peak)}"
                     f"{' (lifetime)' if r.peak_is_lifetime else ''} | {above} | {_mib(held)} | "
                     + " | ".join(f"{r.state_bytes[m] / 1024:.1f}" for m in cfg.methods) + " |")
    lines += ["", "## What the numbers show", "", *_verdict(metrics, cfg, results, info), ""]
    return "\n".join(lines)
