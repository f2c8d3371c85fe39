"""IJB-S-style video benchmark with probes of tens of thousands of frames, every fusion method and the true-quality
oracle, streamed: ``python -m experiments.long_probes``.

IJB-S (Kalka et al., BTAS 2018) searches surveillance videos of hundreds to tens of thousands of frames of mixed
quality against galleries of one still per identity (Surveillance-to-Single) or of several booking stills
(Surveillance-to-Booking). The ``evaluate`` stage runs that protocol on probes of 50–400 frames that ``prepare``
writes to disk and loads at once. Here the probes are as long as IJB-S's and never exist whole: each probe is a
surveillance sequence of the ``evaluate`` stage's design (``ml.data.surveillance``, ``params.yaml``
``data.surveillance``: most frames heavily degraded, of true quality ≈ 0.01–0.2, and one contiguous usable window of
``usable_fraction`` of the frames at a random place) rendered by ``stream_surveillance_sequence`` ``--chunk`` frames
at a time; each chunk gets its landmarks and face scores (the DFA aligner's predictions, or the renderer's ground
truth and quality), its FR features and CAFace styles (``ml.fusion.sets.features_and_styles``) and is fused by every
method's ``ml.fusion.sets.FusionStream`` (running sums for average / norm-weighted / KP-RPE landmark × face score /
the oracle, the CAFace memory for CAFace, streamed in ``--caface-chunk`` frames), then dropped.

- Probes: ``--enrolled`` identities with a gallery and a probe, ``--distractors`` identities with a probe only
  (open-set TPIR@FPIR); ``--gallery-only`` further identities are enrolled without a probe, so that a probe searches
  a gallery of IJB-S's size (202 subjects) rather than of the few probed identities. Lengths are log-uniform in
  [``--min-frames``, ``--max-frames``], stratified (one draw per equal-width slice of the log range, shuffled over
  the identities) so that every run covers the range. ``--design procedural`` renders the smooth, mostly usable
  sequences of ``ProceduralFaces.sequence`` instead (the design this experiment was first measured on).
- Identities: the first ids after every set ``prepare`` renders (train, held-out, discovery, videos, unaligned; read
  from ``params.yaml`` ``data``), so neither the FR model, nor CAFace, nor the aligner saw them.
- Galleries (every enrolled identity, probed or gallery-only): *single* = the first booking still alone,
  L2-normalised (the same for every method); *booking* = ``--booking-stills`` stills per identity fused with the
  probe's method (``fuse_templates``).
- ``quality_oracle`` is a headroom reference, not a method: the unit features weighted by each frame's true quality
  (the renderer's ``quality_score``, which no method sees; the ``evaluate`` stage's row of the same name). Its gain
  over averaging is what weighting frames by their quality alone can give on these probes, the bar CAFace's gain is
  read against; the report does not rank it among the methods.
- Metrics (``ml.fusion.sets.video_identification``): rank-1 / rank-5 of the mated probes, TPIR at FPIR ``--fpir`` at
  rank 1; rank-1 (single gallery) of each probe's first N frames for N in ``--prefixes`` and all frames (CAFace
  Fig. 1c: the gain over averaging versus the number of frames fused, CAFace's and the oracle's).
- Cost: seconds per stage (render, landmarks, embed, fuse) and the peak RSS of the process during each probe
  (``/proc/self/status`` VmHWM, reset per probe), to show memory stays flat as probes grow.

Probes run in ``--workers`` processes (one torch thread each by default), longest first. Writes
``reports/long_probes.md`` and ``plots/long_probes_gain.png`` under ``--out-dir`` (default: the repository).
This module is the command and the run; the configuration, probes and models are ``long_probes_setup``, the
streaming ``long_probes_stream``, the metrics and report ``long_probes_report``.

Examples::

    python -m experiments.long_probes                                  # the defaults (99k frames): 5–15 minutes on 2 cores
    python -m experiments.long_probes --enrolled 6 --distractors 2 --min-frames 200 --max-frames 2000  # a minute
    python -m experiments.long_probes --aligner none                   # ground-truth landmarks + quality scores
    python -m experiments.long_probes --methods average caface quality_oracle --prefixes 16 256 4096
    python -m experiments.long_probes --design procedural              # the smooth sequences of the first runs

Differences from the reference (IJB-S, CAFace Fig. 1c):

- One probe per identity, one procedural surveillance sequence each; IJB-S has several videos per subject and
  detections of several faces per frame. Frames are rendered aligned (the renderer's 5-point fit plus jitter), as
  the FR model expects, and degraded in the renderer (capture resolution, blur, noise, JPEG), not by distance to a
  real camera; the aligner only supplies landmarks and face scores for ``landmark_score``.
- The probe-length curve uses each probe's first N frames (what a live stream has seen), not a random subset, and
  the single gallery, which does not depend on the fusion method, so only the probe's fusion changes. A prefix
  shorter than the frames before a probe's usable window holds heavy frames only.
- Features without flip TTA (as the ``evaluate`` stage's set benchmark).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.long_probes.report import PLOT, REPORT, RunInfo, identification, plot_gain, render
from experiments.long_probes.setup import (
    DESIGNS, METHODS, ROOT, LongProbesConfig, first_free_identity, load_models, probe_specs, procedural_config,
    surveillance_config,
)
from experiments.long_probes.stream import galleries, run_probes

log = logging.getLogger("experiments.long_probes")


def run_experiment(cfg: LongProbesConfig, *, out_dir: Path = ROOT, params_path: Path | None = None,
                   progress: bool = True) -> dict[str, Any]:
    """Run the benchmark, write ``reports/long_probes.md`` and ``plots/long_probes_gain.png`` under ``out_dir``
    (atomically), return ``{"metrics", "results", "specs", "report"}``."""
    from tasks.common import write_text

    start = time.perf_counter()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    params_path = params_path or ROOT / "params.yaml"
    models = load_models(cfg)
    proc_config, proc_seed = procedural_config(params_path, models.image_size)
    surveillance = surveillance_config(params_path)
    first = first_free_identity(params_path)
    specs = probe_specs(cfg, first)
    log.info("%d probes, %s frames (%d–%d per probe), identities from %d", len(specs),
             f"{sum(s.length for s in specs):,}", min(s.length for s in specs), max(s.length for s in specs), first)
    from ml.data.procedural import ProceduralFaces

    gen = ProceduralFaces(proc_config, seed=proc_seed)
    gallery_ids, gallery = galleries(specs, cfg, models, gen)
    probe_start = time.perf_counter()
    results = run_probes(specs, cfg, proc_config, proc_seed, surveillance,
                         models=models if cfg.workers == 1 else None, progress=progress)
    probe_wall = time.perf_counter() - probe_start
    metrics = identification(specs, results, gallery_ids, gallery, cfg)
    fr_config = json.loads((cfg.fr_model / "config.json").read_text())
    digest = str(fr_config.get("extra", {}).get("training_data_digest", ""))
    info = RunInfo(specs, first, models.image_size, "dfa" if models.aligner is not None else "truth",
                   0.0, probe_wall, load_before, os.getloadavg() if hasattr(os, "getloadavg") else None,
                   os.cpu_count() or 1, fr_digest=digest, surveillance=dataclasses.asdict(surveillance))
    plot_gain(metrics, cfg, out_dir / PLOT)
    info.wall_seconds = time.perf_counter() - start
    text = render(metrics, cfg, results, info)
    write_text(out_dir / REPORT, text)
    log.info("done in %.0f s → %s, %s", info.wall_seconds, out_dir / REPORT, out_dir / PLOT)
    return {"metrics": metrics, "results": results, "specs": specs, "report": text}


def _path_or_none(value: str) -> Path | None:
    return None if value.lower() == "none" else Path(value)


def parse_args(argv: Sequence[str] | None = None) -> tuple[LongProbesConfig, Path, Path]:
    """Command line → (config, output directory, params.yaml); a bad value raises ``ConfigError`` naming it."""
    d = LongProbesConfig()
    parser = argparse.ArgumentParser(prog="python -m experiments.long_probes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--enrolled", type=int, default=d.enrolled, help="identities with a gallery and a probe")
    parser.add_argument("--distractors", type=int, default=d.distractors,
                        help="identities with a probe only (non-mated searches for TPIR@FPIR)")
    parser.add_argument("--gallery-only", type=int, default=d.gallery_only,
                        help="identities enrolled without a probe (a larger gallery to search)")
    parser.add_argument("--min-frames", type=int, default=d.min_frames, help="shortest probe (frames)")
    parser.add_argument("--max-frames", type=int, default=d.max_frames, help="longest probe (frames)")
    parser.add_argument("--booking-stills", type=int, default=d.booking_stills, help="gallery stills per identity")
    parser.add_argument("--chunk", type=int, default=d.chunk, help="frames rendered, embedded and fused at a time")
    parser.add_argument("--caface-chunk", type=int, default=None,
                        help="CAFace streams in chunks of this many frames (default: evaluate.fusion_chunk_size)")
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(d.prefixes),
                        help="rank-1 of each probe's first N frames, for these N")
    parser.add_argument("--methods", nargs="+", default=list(d.methods), help=f"fusion methods: {', '.join(METHODS)}")
    parser.add_argument("--fpir", type=float, default=d.fpir, help="open-set FPIR for TPIR")
    parser.add_argument("--workers", type=int, default=d.workers, help="processes, one probe each at a time")
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker (0: cores/workers)")
    parser.add_argument("--seed", type=int, default=d.seed, help="probe lengths and sequences")
    parser.add_argument("--design", default=d.design,
                        help=f"probe frames: {' or '.join(DESIGNS)} (the smooth sequences the experiment used first)")
    parser.add_argument("--fr-model", type=Path, default=d.fr_model, help="FR model directory (features + styles)")
    parser.add_argument("--fusion-model", type=_path_or_none, default=d.fusion_model, help="CAFace model directory")
    parser.add_argument("--aligner", type=_path_or_none, default=d.aligner,
                        help="DFA aligner directory for landmarks + face scores; 'none': ground truth + quality")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml",
                        help="params.yaml: data.* (procedural faces, surveillance degradations, identities used) and "
                        "evaluate.fusion_chunk_size")
    parser.add_argument("--out-dir", type=Path, default=ROOT, help="writes reports/ and plots/ under it")
    args = parser.parse_args(argv)
    caface_chunk = args.caface_chunk if args.caface_chunk is not None else _params_chunk(args.params, d.caface_chunk)
    root = lambda p: p if p is None or p.is_absolute() else ROOT / p  # noqa: E731
    cfg = LongProbesConfig(
        enrolled=args.enrolled, distractors=args.distractors, gallery_only=args.gallery_only, min_frames=args.min_frames, max_frames=args.max_frames,
        booking_stills=args.booking_stills, chunk=args.chunk, caface_chunk=caface_chunk, prefixes=tuple(args.prefixes),
        methods=tuple(args.methods), fpir=args.fpir, workers=args.workers, threads=args.threads, seed=args.seed,
        design=args.design, fr_model=root(args.fr_model), fusion_model=root(args.fusion_model),
        aligner=root(args.aligner),
    )
    return cfg, args.out_dir, args.params


def _params_chunk(params: Path, default: int) -> int:
    """``evaluate.fusion_chunk_size`` of ``params`` (the default when the file or the key is absent)."""
    if not params.is_file():
        return default
    from tasks.common import load_params, section

    value = section(load_params(params), "evaluate").get("fusion_chunk_size", default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def main(argv: Sequence[str] | None = None) -> None:
    cfg, out_dir, params = parse_args(argv)
    run_experiment(cfg, out_dir=out_dir, params_path=params)
