"""IJB-S-style video benchmark on probes of tens of thousands of frames, streamed: ``python -m experiments.long_probes``.

IJB-S (Kalka et al., BTAS 2018) searches surveillance videos of up to tens of thousands of frames against one still
(Surveillance-to-Single) or several booking stills per identity. Each probe here is a ``data.surveillance`` sequence
(``ml.data.surveillance``) of unseen identities, rendered ``--chunk`` frames at a time, given landmarks and face scores
(DFA aligner or ground truth), embedded and fused by every method's ``ml.fusion.sets.FusionStream``, then dropped
(``quality_oracle``: a reference, not a method). ``reports/long_probes.md``: rank-1/5, TPIR@FPIR, rank-1 of each
probe's first N frames, seconds per stage, peak RSS per probe. Modules: ``setup``, ``stream``, ``report``.

Differences from the reference (IJB-S, CAFace Fig. 1c): one procedural probe per identity (IJB-S: several videos,
several faces a frame), rendered aligned and degraded by the renderer, not by camera distance; the length curve takes
each probe's first N frames (a live stream) against the single gallery, not random subsets; features without flip.

Examples: ``python -m experiments.long_probes --enrolled 6 --distractors 2 --min-frames 200 --max-frames 2000``;
``--aligner none`` (ground-truth landmarks); ``--design procedural`` (the smooth sequences of the first runs).
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
from experiments.long_probes.probe_stream import galleries, run_probes

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
