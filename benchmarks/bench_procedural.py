"""Throughput of the procedural face generator on one CPU core.

Rendering is single-threaded numpy and PIL (no BLAS calls), so one process is one core. Throughput is
images per second of process CPU time: unlike wall time it does not drop when other processes share
the machine. Each size is timed over several rounds of the dataset-building pattern (identity-major,
a fresh identity every ``images_per_identity`` images, default nuisance config) and the best round is
kept, the usual way to strip scheduler noise from a micro-benchmark.
"""

from __future__ import annotations

import time

from ml.data.procedural import ProceduralConfig, ProceduralFaces


def _images_per_cpu_second(size: int, *, identities: int, images_per_identity: int, rounds: int) -> float:
    gen = ProceduralFaces(ProceduralConfig(image_size=size), seed=0)
    for i in range(10):  # warm-up: per-size grids and noise bank, first identities
        gen.sample(i, 0)
    best = float("inf")
    for r in range(rounds):
        first = 1_000 + r * identities  # new identities each round: their set-up cost is counted
        start = time.process_time()
        for ident in range(first, first + identities):
            for index in range(images_per_identity):
                gen.sample(ident, index)
        best = min(best, time.process_time() - start)
    return identities * images_per_identity / best


def bench_procedural_throughput(
    sizes: tuple[int, ...] = (112, 64), identities: int = 20, images_per_identity: int = 10, rounds: int = 3
) -> dict[str, float]:
    """Images per second on one core at each size: ``{"images_per_s_112": ..., "images_per_s_64": ...}``."""
    try:  # numpy's BLAS is not used by the renderer; pin it anyway so nothing else can spread out
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: the measurement is single-threaded without it too
        threadpool_limits = None
    results = {}
    limits = threadpool_limits(limits=1) if threadpool_limits is not None else None
    try:
        for size in sizes:
            results[f"images_per_s_{size}"] = _images_per_cpu_second(
                size, identities=identities, images_per_identity=images_per_identity, rounds=rounds
            )
    finally:
        if limits is not None:
            limits.restore_original_limits()
    return results
