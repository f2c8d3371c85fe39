"""Cost of CAFace fusion: relative to the backbone (paper Table 5), and streaming over very large sets.

Both run on the CPU, in eval mode under ``torch.inference_mode``, with ``threads`` intra-op threads
(default 1: on a shared machine two threads fighting over two cores make the small fusion ops 10-30×
slower and the comparison meaningless). The paper measured on a GPU, so only the trend is comparable.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ml.fr.backbones import build_backbone
from ml.fusion import CAFace

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    """Best of ``repeats`` wall times (ms) after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000.0 * best


def _inputs(b: int, n: int, model: CAFace, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feats = torch.nn.functional.normalize(torch.randn(b, n, model.feature_dim, generator=g), dim=-1)
    feats = feats * (5.0 + 20.0 * torch.rand(b, n, 1, generator=g))  # spread norms like a real backbone's
    return feats, torch.randn(b, n, model.style_dim, 2, generator=g)


def bench_caface_cost(
    ns: Sequence[int] = (16, 32, 64, 256, 512),
    backbone: str = "iresnet50",
    backbone_batch: int = 8,
    backbone_repeats: int = 2,
    repeats: int = 5,
    threads: int = 1,
    seed: int = 0,
) -> dict:
    """Relative FPS of ``CAFace()`` with respect to the backbone (paper Table 5), for sets of N images.

    Table 5: "relative FPS of the fusion model with respect to the FPS of the backbone", i.e.
    ``(N / t_fusion(N)) / (N / t_backbone(N)) = t_backbone(N) / t_fusion(N)``: how many times faster fusing N
    features is than embedding the N images. ``t_backbone(N) = N · t_image`` with ``t_image`` the best-of-
    ``backbone_repeats`` forward time (with styles) of a batch of ``backbone_batch`` random 112×112 images
    divided by the batch (an image's forward does not depend on the others, so the cost is linear in N; timing 512
    images of an iresnet50 on the CPU would take minutes). ``t_fusion(N)``: one ``CAFace()`` call on one set of
    N (512-d features, 384×2 styles), best of ``repeats``. The paper's backbone is an IR-101; here
    ``iresnet50`` (43.6M parameters, ~6.3 GFLOPs per image), untrained (timing only).

    Returns:
        ``{"backbone", "backbone_ms_per_image", "threads", "rows": [{"n", "fusion_ms", "backbone_ms",
        "relative_fps"}], "paper_relative_fps": {...}}``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        net = build_backbone(backbone).eval()
        images = torch.randn(backbone_batch, 3, 112, 112, generator=torch.Generator().manual_seed(seed))
        model = CAFace().eval()
        with torch.inference_mode():
            per_image = _best_ms(lambda: net(images, return_styles=True), backbone_repeats) / backbone_batch
            rows = []
            for n in ns:
                feats, styles = _inputs(1, n, model, seed + n)
                fusion_ms = _best_ms(lambda: model(feats, styles), repeats)
                rows.append({"n": n, "fusion_ms": round(fusion_ms, 3), "backbone_ms": round(n * per_image, 1),
                             "relative_fps": round(n * per_image / fusion_ms, 1)})
    finally:
        torch.set_num_threads(before)
    return {"backbone": backbone, "backbone_ms_per_image": round(per_image, 2), "threads": threads, "rows": rows,
            "paper_relative_fps": {"16": 4.2, "32": 8.2, "64": 16.4, "256": 64.4, "512": 129.3}}


def _status_bytes(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux ≥ 4.0: write 5 to clear_refs)."""
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_growth(fn: Callable[[], object]) -> tuple[float, int | None]:
    """Run ``fn``; return (seconds, peak RSS above the RSS at the start in bytes, None where unsupported)."""
    base = _status_bytes("VmRSS")
    ok = _reset_peak() and base is not None
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM") if ok else None
    return seconds, (None if peak is None else max(0, peak - base))


def bench_caface_streaming(
    ns: Sequence[int] = (1_000, 10_000, 100_000),
    chunk: int = 256,
    pool: int = 8,
    contrast_ns: Sequence[int] = (2_000, 8_000),
    threads: int = 1,
    seed: int = 0,
) -> dict:
    """Streaming fusion of one set of N features in chunks of ``chunk`` (the paper's N' = 256): features/s
    and peak memory, which must not grow with N.

    The inputs come from a pool of ``pool`` pre-made chunks, cycled, so that the input itself is not what
    is measured (a 100,000-item set of 512-d features and 384×2 styles would be 512 MB). Memory: the growth
    of the process's peak resident set (``VmHWM``, reset to the current RSS just before each run through
    ``/proc/self/clear_refs``) above the RSS at the start of the run: a high-water mark, so a transient
    allocation is caught even when it is freed before the end, unlike an RSS delta. After the warm-up call
    the chunk-sized intermediates reuse freed heap memory, so a streaming run whose memory is O(chunk)
    shows (almost) no growth at any N. The mark only moves for memory beyond what the heap already holds
    from earlier calls, so it shows growth, not the working set. As a check that it sees growth when there
    is some, ``contrast`` gives the same for one all-at-once call over ``contrast_ns`` items (the CN's
    activations are O(N); a small N can still fit in freed heap and show ~0). ``state_bytes`` is the size of
    the memory (c̄, F̄', S̄'): 4·(4 + 4·512 + 4·128) = 10,256 bytes per set.

    Returns:
        ``{"chunk", "threads", "state_bytes", "rows": [{"n", "seconds", "features_per_s", "peak_rss_growth_bytes"}],
        "contrast": [{"n", "peak_rss_growth_bytes"}]}`` (growth ``None`` where /proc does not support it).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        model = CAFace().eval()
        chunks = [_inputs(1, chunk, model, seed + k) for k in range(pool)]

        def stream(n: int) -> torch.Tensor:
            state = model.init_state(1)
            for k, lo in enumerate(range(0, n, chunk)):
                feats, styles = chunks[k % pool]
                width = min(chunk, n - lo)
                state = model.update(state, feats[:, :width], styles[:, :width])
            return model.fuse(state)

        rows, contrast = [], []
        with torch.inference_mode():
            stream(2 * chunk)  # warm-up: allocator, kernel selection
            state_bytes = sum(t.nbytes for t in model.init_state(1))
            for n in ns:
                seconds, growth = _peak_rss_growth(lambda: stream(n))
                rows.append({"n": n, "seconds": round(seconds, 3), "features_per_s": round(n / seconds),
                             "peak_rss_growth_bytes": growth})
            for n in contrast_ns:
                feats, styles = _inputs(1, n, model, seed + n)
                _, growth = _peak_rss_growth(lambda: model(feats, styles))
                contrast.append({"n": n, "peak_rss_growth_bytes": growth})
    finally:
        torch.set_num_threads(before)
    return {"chunk": chunk, "threads": threads, "state_bytes": state_bytes, "rows": rows, "contrast": contrast}


if __name__ == "__main__":
    cost = bench_caface_cost()
    print(f"{cost['backbone']} {cost['backbone_ms_per_image']} ms/image, {cost['threads']} thread(s)")
    for row in cost["rows"]:
        paper = cost["paper_relative_fps"].get(str(row["n"]), "-")
        print(f"  N={row['n']:>4}: fusion {row['fusion_ms']:8.2f} ms, backbone {row['backbone_ms']:9.1f} ms, "
              f"relative FPS {row['relative_fps']:7.1f}× (paper {paper}×)")
    streaming = bench_caface_streaming()
    print(f"streaming, chunks of {streaming['chunk']}, state {streaming['state_bytes']} bytes")
    for row in streaming["rows"]:
        print(f"  N={row['n']:>7}: {row['features_per_s']:>7} features/s, peak RSS growth {row['peak_rss_growth_bytes']} B")
    for row in streaming["contrast"]:
        print(f"  all at once N={row['n']}: peak RSS growth {row['peak_rss_growth_bytes']} B")


def bench_caface_training(
    steps: int = 20, identities: int = 400, sources: int = 3, copies: int = 16, feature_dim: int = 128,
    style_dim: int = 256, threads: int | None = 2, seed: int = 0,
) -> dict:
    """Optimiser steps/s of ``train_fusion`` at the embedded default recipe (params.yaml ``fusion.train``: 32
    identities × 32 items per step, every even prefix 2..16, λp 0, λu 0.3 and, for comparison, λp 1 and one prefix per
    step) on random features of the embedded FR model's sizes (vit_tiny: 128-d features, 256×2 styles) for
    ``identities × sources × copies`` items. Batches are built on the CPU inside the timed loop, as in the stage.
    """
    import numpy as np

    from benchmarks.bench_aligner import TrainTimer
    from ml.fusion.train import FusionConfig, train_fusion

    rng = np.random.default_rng(seed)
    n = identities * sources * copies
    labels = np.repeat(np.arange(identities), sources * copies)
    src = np.repeat(np.arange(identities * sources), copies)
    feats = rng.normal(size=(n, feature_dim)).astype(np.float32) * rng.uniform(5, 25, size=(n, 1)).astype(np.float32)
    styles = rng.normal(size=(n, style_dim, 2)).astype(np.float32)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    out: dict = {"steps": steps, "threads": torch.get_num_threads(), "items": n}
    try:
        for name, extra in (("default", {}), ("lambda_p_1", {"lambda_p": 1.0}), ("one_prefix", {"prefixes": "one"})):
            recipe = dict(feature_dim=feature_dim, style_dim=style_dim, epochs=1, steps_per_epoch=steps,
                          lr_steps=(4,), batch_size=32, lr=1e-4, lambda_p=0.0, lambda_u=0.3, accelerator="cpu",
                          seed=seed)
            cfg = FusionConfig(**{**recipe, **extra})
            timer = TrainTimer()
            train_fusion(cfg, feats, styles, labels, sources=src, progress=False, callbacks=[timer])
            out[f"{name}_steps_per_s"] = timer.steps / timer.wall_s
        out["default_500_steps_s"] = 500 / out["default_steps_per_s"]
        return out
    finally:
        torch.set_num_threads(previous)
