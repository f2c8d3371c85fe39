"""Benchmark runner: each entry of ``BENCHMARKS`` returns a dict of numbers; the table lands in results.md."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent

# name → ("module:function", what it measures, the target)
BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "procedural_throughput": (
        "benchmarks.bench_procedural:bench_procedural_throughput",
        "procedural faces rendered per second on one core",
        "≥ 500 images/s at 112×112",
    ),
    "tar_at_far_10m": (
        "benchmarks.bench_metrics:bench_tar_at_far_10m",
        "`tar_at_far` on 10M scores (1M genuine, 9M impostor)",
        "seconds, not minutes",
    ),
    "kprpe_forward_ratio": (
        "benchmarks.bench_kprpe:bench_kprpe_forward_ratio",
        "KP-RPE ViT-S forward vs plain ViT-S, batch 64, 112×112",
        "≤ 1.25×",
    ),
    "train_throughput": (
        "benchmarks.bench_train:bench_train_throughput",
        "embedded model (vit_tiny, 64×64) training images/s; share of step time outside the model step",
        "outside-step share ≤ 10 %",
    ),
    "pipeline_overhead": (
        "benchmarks.bench_pipeline:bench_pipeline_overhead",
        "stage `prepare` as a Prefect task running its command (with its MLflow run) vs a process calling the stage function",
        "≤ 5 % of stage time",
    ),
    "ssk_100k": (
        "benchmarks.bench_ssk:bench_ssk_100k",
        "semi-supervised k-means (FaceGCD inference) on 100k × 512 features, K = 1000, one restart",
        "seconds",
    ),
    "caface_cost": (
        "benchmarks.bench_caface:bench_caface_cost",
        "CAFace fusion vs the iresnet50 forward of the same N images (paper Table 5's relative FPS), CPU",
        "report (paper: 64.4× at N = 256 on GPU)",
    ),
    "caface_streaming": (
        "benchmarks.bench_caface:bench_caface_streaming",
        "streaming CAFace fusion of N = 1k, 10k, 100k features in chunks of 256: features/s and peak-memory growth",
        "peak memory flat from N = 1k to 100k",
    ),
    "caface_training": (
        "benchmarks.bench_caface:bench_caface_training",
        "CAFace training steps/s at the embedded recipe (32 identities × 32 items, even prefixes, λp 0, λu 0.3; also λp 1 and "
        "one prefix per step), vit_tiny feature sizes, CPU",
        "report (500 default steps in the stage)",
    ),
    "train_step_costs": (
        "benchmarks.bench_steps:bench_train_step_costs",
        "ms per training step, one thread: the latent UNet with the fused AdamW and foreach EMA vs the per-tensor "
        "loops and in channels_last vs NCHW, CAFace with one cluster-network call per prefix length vs every prefix "
        "padded to 16; bfloat16 autocast vs float32 for the UNet, an FR step (vit_tiny 64 px, batch 128) and CAFace",
        "both ratios < 1.0×; `faceops doctor` recommends bf16 (probe_bf16_ratio ≤ 0.9) only where the FR and UNet "
        "bf16 ratios are < 1.0×",
    ),
    "aligner_throughput": (
        "benchmarks.bench_aligner:bench_aligner_throughput",
        "DFA aligner training and inference images/s at the default input size (96², batch 16), CPU, one thread",
        "report",
    ),
    "sampler_cost": (
        "benchmarks.bench_synth:bench_sampler_cost",
        "UIFace two-stage sampling + attention injection (adaptive, and the default fixed t0 = 500) vs plain CFG, per "
        "face, embedded latent UNet, CPU",
        "≤ 1.0×",
    ),
    "synthesis_throughput": (
        "benchmarks.bench_synth:bench_synthesis_throughput",
        "UIFace faces/s of the embedded default (its latent UNet, fixed t0 = 500 + injection, 25 DDIM steps, "
        "decoded to 32 px, batch 64 identities), CPU",
        "report",
    ),
    "ingest_recordio": (
        "benchmarks.bench_ingest:bench_ingest_recordio",
        "real-data ingest of a generated RecordIO (112×112 JPEG payloads → 64×64 train/held-out/discovery + real.bin): "
        "seconds and peak RSS at 10k, 100k and 500k images",
        "peak RSS flat from 10k to 500k",
    ),
    "ingest_recordio_112": (
        "benchmarks.bench_ingest:bench_ingest_recordio_112",
        "real-data ingest of a generated RecordIO of 100k 112×112 JPEG faces at data.image_size 112 (no resize: "
        "JPEG bytes kept): images/s, peak RSS, the datasets' shards over the RecordIO's bytes",
        "≥ 1,500 images/s on 2 cores; shards ≤ 1.1× the RecordIO",
    ),
    "stream_read_112": (
        "benchmarks.bench_stream:bench_stream_read_112",
        "20k 112-px JPEG faces streamed from shards (ml.data.shard_stream, batches of 128, one thread): read + decode, and "
        "with the kprpe augmentation, per CPU-second, from local shards and from moto's S3 server on loopback "
        "(wall images/s beside: moto-bound); `by_index_*`: the same faces read by byte range as `fr.stream` does",
        "≥ 1,000 images/s per core with augmentation; stream ≥ by index",
    ),
    "decode_augment_112": (
        "benchmarks.bench_decode:bench_decode_augment_112",
        "112×112 faces per core (one thread): Pillow JPEG/PNG decode, RecordIO record read + decode, FR augmentation "
        "(basic, kprpe, kprpe + RandAug) of batches of 128, and decode + augmentation together",
        "≥ 1,000 images/s per core for JPEG at 112 px",
    ),
    "recordio_vs_folder": (
        "benchmarks.bench_decode:bench_recordio_vs_folder",
        "3,000 112×112 JPEG faces: re-encoding a RecordIO as a PNG dataset (seconds, MB) vs reading it in place; "
        "DataLoader read images/s of each with 0 and 2 workers",
        "report: in place faster or smaller",
    ),
    "smoke_and_noop": (
        "benchmarks.bench_pipeline:bench_smoke_and_noop",
        "`faceops run --preset smoke` from nothing, then `dvc repro` with nothing changed",
        "smoke ≤ 120 s; no-op ≤ 10 s, every stage skipped",
    ),
    "runcache_restore": (
        "benchmarks.bench_runcache:bench_runcache_restore",
        "param changed and changed back: faceops run restores from the run-cache (stage `train_fr@real`, smoke preset: "
        "`fr.seed` 0 → 1 → 0; seconds of the stage's task when its cmd runs vs when it is restored)",
        "restored, cmd not run, outputs byte-identical; restore in seconds",
    ),
    "make_run": (
        "benchmarks.bench_default_run:bench_make_run",
        "`make run` from a fresh clone (installing included) with nothing else running: wall minutes, CPU seconds, "
        "each stage's seconds, the machine facts that decide the run's numerics, a fixed one-thread workload's "
        "seconds before and after (`probe_s_*`: how fast the machine ran then)",
        "≤ 20 min on 2 cores",
    ),
    "reproducibility": (
        "benchmarks.bench_default_run:bench_reproducibility",
        "a second fresh-clone `make run` beside other work (a busy process per core, or FACEOPS_BENCH_BESIDE: e.g. "
        "the test suite) against the `make_run` one: metric values "
        "(wall-clock keys aside) and model/dataset hashes in dvc.lock that differ",
        "0 differing: two runs of a commit on one machine give the same bits",
    ),
    "gpu_trainers": (
        "benchmarks.bench_gpu:bench_gpu_trainers",
        "each trainer (FR vit_tiny 64 px and the real-112 ViT, DFA aligner, CAFace, FaceGCD, UIFace autoencoder and "
        "latent UNet) fitted on the accelerator with mixed precision: images (or sets) per second after warm-up, "
        "GFLOP per item and MFU, peak GPU memory",
        "report; every trainer runs on the GPU in 16-mixed/bf16-mixed",
    ),
    "caface_paths": (
        "benchmarks.bench_gpu:bench_caface_paths",
        "CAFace training with the cluster network run by set length (the CPU path) vs one masked call over the "
        "padded batch (the GPU path), same device, two repeats each",
        "each device's path the faster there",
    ),
    "gpu_trainers_fp16": (
        "benchmarks.bench_gpu:bench_gpu_trainers_fp16",
        "`gpu_trainers` in 16-mixed (float16 autocast, loss scaling)",
        "report; every trainer runs on the GPU",
    ),
    "fr112_bound": (
        "benchmarks.bench_gpu_bound:bench_fr112_bound",
        "what bounds the real-112 FR training step (ViT-T 112 px, AdaFace over 10,575 classes, batch 512, bf16): "
        "train_fr (eager; ddp on one GPU) vs the step by hand on a device batch with the KP-RPE augmentation's dense "
        "and sparse paths, without augmentation, compiled, at 2× and 4× batch; images/s, MFU against the dense peak, "
        "GPU busy",
        "MFU ≥ 35 %, GPU busy ≥ 0.9 of the step",
    ),
    "fr112_graphs": (
        "benchmarks.bench_gpu_bound:bench_fr112_graphs",
        "the real-112 FR step by hand, eager vs the backbone through torch.compile (default and reduce-overhead: CUDA "
        "graphs), with the augmentation compiled too, at 1× and 4× batch; images/s, MFU, GPU busy",
        "MFU ≥ 35 %, GPU busy ≥ 0.9 of the step",
    ),
    "fr112_fit_compile": (
        "benchmarks.bench_gpu_bound:bench_fr112_fit_compile",
        "train_fr at the real-112 preset with fr.compile true (the preset) vs false: images/s and MFU of the whole fit",
        "report",
    ),
    "uiface112": (
        "benchmarks.bench_gpu_scale:bench_uiface112",
        "UIFace at the real-112 preset (112-px faces, 4×28×28 latent): autoencoder and UNet training images/s, and "
        "synthesis (DDIM with params synthesize.sampler, then decoding) faces/s; GFLOP per item and MFU of each",
        "report",
    ),
    "fr112_stream": (
        "benchmarks.bench_gpu_scale:bench_fr112_stream",
        "train_fr at the real-112 preset with its faces decoded in memory vs streamed from a dataset's shards "
        "(fr.stream, fr.num_workers DataLoader workers decoding PNGs every step): images/s of each",
        "streamed ≥ 0.9× in memory",
    ),
    "gpu_trainers_fp32": (
        "benchmarks.bench_gpu:bench_gpu_trainers_fp32",
        "`gpu_trainers` in 32-true on the same device: the baseline of the mixed-precision rows",
        "report",
    ),
    "shard_ingest": (
        "benchmarks.bench_shards:bench_shard_ingest",
        "a RecordIO of 1M 112-px JPEG faces (FACEOPS_BENCH_FACES) to WebDataset shards over every core, JPEG bytes "
        "kept, packed into 1 MB members (and `*_member_per_face`: a member per face): faces/s, shard bytes over the "
        ".rec's, peak RSS of the parent and the largest writer (`*_tenth`: for 100k faces)",
        "≥ 1,500 faces/s on 2 cores; disk ≤ 1.1× the .rec; RSS flat",
    ),
    "dvc_shards": (
        "benchmarks.bench_shards:bench_dvc_shards",
        "dvc add / status / push to a local remote of 100k faces (FACEOPS_BENCH_DVC_FACES) as loose files vs as "
        "shards, each in a fresh repository",
        "per 1M faces as shards: status ≤ 5 s, push ≤ 1 min",
    ),
    "launch": (
        "benchmarks.bench_launch:bench_launch",
        "train_fr@real (smoke data, float32) in one process vs two Ray nodes on this machine with the same global "
        "batch (faceops launch --pack); Ray's start-up and placement",
        "report",
    ),
    "dvc_shards_1m": (
        "benchmarks.bench_shards:bench_dvc_shards_1m",
        "dvc add / status / push to a local remote of 1M faces as shards (a RecordIO converted with "
        "`faceops data shard`), in a fresh repository",
        "status ≤ 5 s, push ≤ 1 min",
    ),
    "dvc_loose_1m": (
        "benchmarks.bench_shards:bench_dvc_loose_1m",
        "dvc add / status / push to a local remote of the same 1M faces as one file each (the layout before shards), "
        "in a fresh repository",
        "report: against `dvc_shards_1m`",
    ),
}


# benchmarks that run the whole default pipeline, write millions of faces, train the real-112 generator (tens of
# minutes each on a CPU) or start a Ray cluster: only when named (benchmarks/gpu_check.sh names the GPU ones)
ON_REQUEST = frozenset({"make_run", "reproducibility", "shard_ingest", "dvc_shards", "dvc_shards_1m", "dvc_loose_1m",
                        "uiface112", "fr112_stream", "launch"})


def _load(spec: str) -> Callable[[], dict[str, Any]]:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all but {', '.join(sorted(ON_REQUEST))}, "
                                                  f"which run only when named): {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=HERE / "results.json",
                        help="results file, read and updated (the markdown table is written beside it, .md)")
    args = parser.parse_args(argv)
    names = args.names or [n for n in BENCHMARKS if n not in ON_REQUEST]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for name in names:
        spec, _, _ = BENCHMARKS[name]
        start = time.perf_counter()
        values = _load(spec)()
        results[name] = {"values": values, "wall_s": round(time.perf_counter() - start, 2),
                         "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                         "machine": f"{platform.machine()} {os.cpu_count()} cores"
                                    + (f", {values['device']}" if values.get("device", "cpu") != "cpu" else "")}
        print(f"{name}: {values}")
    args.out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    args.out.with_suffix(".md").write_text(render(results))  # the table beside the numbers it renders


def render(results: dict[str, Any]) -> str:
    lines = ["# Benchmark results", "", "Written by `make bench` (`python -m benchmarks`); every number measured in the run noted.", "",
             "| benchmark | measures | target | result | measured |", "|---|---|---|---|---|"]
    for name, (_, what, target) in BENCHMARKS.items():
        if name not in results:
            lines.append(f"| {name} | {what} | {target} | not run | |")
            continue
        r = results[name]
        shown = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in r["values"].items())
        lines.append(f"| {name} | {what} | {target} | {shown} | {r['when']}, {r['machine']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
