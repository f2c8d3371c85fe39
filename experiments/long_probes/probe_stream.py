"""One long probe, streamed, and every probe in worker processes: the frames of a probe rendered one at a time
(``--design surveillance`` or ``procedural``), their landmarks, face scores, FR features and CAFace styles a chunk
at a time, fused by every method's ``ml.fusion.sets.FusionStream`` and dropped; the galleries; peak RSS per probe.
Part of ``python -m experiments.long_probes`` (``experiments/long_probes``).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.long_probes.setup import LOW_QUALITY, STILL_INDEX, LongProbesConfig, Models, ProbeSpec, load_models


def stream_sequence(gen: Any, identity: int, length: int, seq_index: int = 0) -> Iterator[Any]:
    """The frames of ``ProceduralFaces.sequence(identity, length, seq_index)``, identical, rendered one at a time
    (``--design procedural``: the smooth walk without surveillance degradations).

    ``sequence`` returns every frame in a list (a 20,000-frame probe at 64 px is 246 MB of images); this generator
    renders each frame of ``ProceduralFaces.iter_sequence_nuisance`` (the same walk, knots only) when it is asked
    for, so the frames are the same bytes (a test checks it against ``sequence``)."""
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
        raise ValueError(f"stream_sequence: length must be a positive integer, got {length!r}.")
    for nuisance in gen.iter_sequence_nuisance(identity, length, seq_index):
        yield gen.render(identity, nuisance)


def probe_frames(spec: ProbeSpec, design: str, gen: Any, surveillance: Any) -> Iterator[Any]:
    """``spec``'s frames, one at a time: ``surveillance`` = ``ml.data.surveillance.stream_surveillance_sequence``
    with ``surveillance`` (``data.surveillance``), the frames ``prepare`` writes for the ``evaluate`` stage's probes;
    ``procedural`` = ``stream_sequence``."""
    from ml.data.surveillance import stream_surveillance_sequence

    designs: dict[str, Callable[[], Iterator[Any]]] = {
        "surveillance": lambda: stream_surveillance_sequence(gen, spec.identity, spec.length, spec.seq_index,
                                                             surveillance),
        "procedural": lambda: stream_sequence(gen, spec.identity, spec.length, spec.seq_index),
    }
    return designs[design]()


def _frame_arrays(samples: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images (n, S, S, 3) uint8, true landmarks (n, 5, 2) and true quality (n,) of rendered ``samples``."""
    return (np.stack([s.image for s in samples]), np.stack([s.landmarks for s in samples]),
            np.array([s.quality for s in samples], dtype=np.float32))


def frame_inputs(models: Models, images: np.ndarray, truth: np.ndarray, quality: np.ndarray,
                 seconds: dict[str, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Landmarks (n, 5, 2) and face scores (n,) (DFA, else the renderer's truth and quality), then features (n, D)
    and styles (n, style_dim, 2) of uint8 ``images`` (n, S, S, 3); adds the seconds to ``seconds``."""
    from ml.fusion.sets import features_and_styles

    start = time.perf_counter()
    if models.aligner is not None:
        landmarks, scores = models.aligner.predict(images, batch_size=64)
    else:
        landmarks, scores = truth, quality
    mid = time.perf_counter()
    feats, styles = features_and_styles(models.fr, images, keypoints=landmarks, batch_size=128)
    seconds["landmarks"] += mid - start
    seconds["embed"] += time.perf_counter() - mid
    return feats, styles, landmarks.astype(np.float32), scores.astype(np.float32)


def _status_bytes(key: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc/self/status, in bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux: ``5`` into /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


@dataclass
class ProbeResult:
    """A probe's templates (final and per prefix), the frames each prefix used, and what it cost."""

    index: int
    frames: int
    templates: dict[str, np.ndarray]  # method → (D,)
    prefix_templates: dict[str, dict[int, np.ndarray]]  # method → {N: (D,)}
    prefix_frames: dict[int, int]  # N → frames actually fused (min(N, length))
    seconds: dict[str, float]  # render, landmarks, embed, fuse
    rss_start: int | None
    rss_peak: int | None  # highest RSS while this probe ran
    peak_is_lifetime: bool  # True when the peak could not be reset per probe (then it is the process's lifetime peak)
    state_bytes: dict[str, int]  # method → largest FusionStream.state_nbytes()
    landmark_error_px: float | None  # mean distance of predicted to true landmarks (DFA only)
    pid: int = 0
    caface_spread: tuple[float, float] | None = None  # (std of A over frames, mean |P − 1/M|) on the first chunk
    low_quality: int = 0  # frames of true quality < LOW_QUALITY
    quality_sum: float = 0.0  # Σ true quality over the frames


def run_probe(spec: ProbeSpec, cfg: LongProbesConfig, models: Models, gen: Any, surveillance: Any,
              progress: Callable[[int], None] = lambda n: None) -> ProbeResult:
    """Render (``cfg.design``; ``surveillance``: ``data.surveillance``), embed and fuse one probe ``cfg.chunk``
    frames at a time with every method in ``cfg.methods`` (the oracle weighted by each frame's true quality); the
    templates of its first N frames (N in ``cfg.prefixes``) are read from the streams on the way."""
    from ml.fusion.sets import FusionStream

    started = _reset_peak()
    rss_start = _status_bytes("VmRSS")
    streams = {m: FusionStream(m, model=models.caface, image_size=float(models.image_size),
                               chunk_size=cfg.caface_chunk) for m in cfg.methods}
    seconds = {"render": 0.0, "landmarks": 0.0, "embed": 0.0, "fuse": 0.0}
    cuts = sorted({p for p in cfg.prefixes if p < spec.length})
    spread = None
    prefix_templates: dict[str, dict[int, np.ndarray]] = {m: {} for m in cfg.methods}
    state_bytes = {m: 0 for m in cfg.methods}
    error_sum, seen = 0.0, 0
    low_quality, quality_sum = 0, 0.0
    frames = probe_frames(spec, cfg.design, gen, surveillance)
    lo = 0
    while lo < spec.length:
        start = time.perf_counter()
        chunk = [next(frames) for _ in range(min(cfg.chunk, spec.length - lo))]
        images, truth, quality = _frame_arrays(chunk)  # (n, S, S, 3) uint8, (n, 5, 2), (n,)
        del chunk
        seconds["render"] += time.perf_counter() - start
        low_quality += int((quality < LOW_QUALITY).sum())
        quality_sum += float(quality.astype(np.float64).sum())
        feats, styles, landmarks, scores = frame_inputs(models, images, truth, quality, seconds)
        if models.aligner is not None:
            error_sum += float(np.linalg.norm(landmarks - truth, axis=-1).mean(axis=1).sum())
            seen += len(images)
        if lo == 0 and "caface" in streams:
            spread = caface_spread(models.caface, feats[: cfg.caface_chunk], styles[: cfg.caface_chunk])
        start = time.perf_counter()
        hi = lo + len(images)
        bounds = [lo] + [p for p in cuts if lo < p < hi] + [hi]
        for a, b in zip(bounds[:-1], bounds[1:]):
            rows = slice(a - lo, b - lo)
            for m, stream in streams.items():
                stream.update(feats[rows], styles=styles[rows], landmarks=landmarks[rows], face_scores=scores[rows],
                              quality=quality[rows])
                state_bytes[m] = max(state_bytes[m], stream.state_nbytes())
                if b in cuts:
                    prefix_templates[m][b] = stream.template()
        seconds["fuse"] += time.perf_counter() - start
        progress(hi - lo)
        lo = hi
    start = time.perf_counter()
    templates = {m: s.template() for m, s in streams.items()}
    seconds["fuse"] += time.perf_counter() - start
    for m in cfg.methods:  # prefixes at least as long as the probe: all of it
        for p in cfg.prefixes:
            prefix_templates[m].setdefault(p, templates[m])
    peak = _status_bytes("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return ProbeResult(
        spec.index, spec.length, templates, prefix_templates, {p: min(p, spec.length) for p in cfg.prefixes}, seconds,
        rss_start, peak, not started, state_bytes, error_sum / seen if seen else None, os.getpid(), spread,
        low_quality, quality_sum,
    )


def caface_spread(model: Any, feats: np.ndarray, styles: np.ndarray) -> tuple[float, float]:
    """How much CAFace weighs frames differently, on one chunk: the std over the frames of their cluster
    assignment ``A`` (M, N) (mean over clusters), and the mean ``|P − 1/M|`` of its aggregation weights. Both 0:
    every frame counts the same and the clusters alike, so the template is the average's direction."""
    import torch

    with torch.no_grad():
        out = model.cluster(torch.from_numpy(feats)[None], torch.from_numpy(styles)[None])
        _, weights = model.aggregate(type(model.init_state(1))(out.count, out.features, out.styles))  # (1, M, D)
    a_std = float(out.assignment[0].std(dim=1).mean()) if feats.shape[0] > 1 else 0.0
    return a_std, float((weights[0] - 1.0 / model.num_clusters).abs().mean())


def galleries(specs: Sequence[ProbeSpec], cfg: LongProbesConfig, models: Models, gen: Any
              ) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """Gallery identities (G,) and ``{gallery: {method: templates (G, D)}}`` over the enrolled probes' identities and
    ``gallery_only`` more (the ids after every probe's): ``single`` = each identity's first still, L2-normalised (the
    same for every method); ``booking`` = its ``booking_stills`` stills fused with the method."""
    from ml.fusion.sets import fuse_templates

    after = max(s.identity for s in specs) + 1
    enrolled = [s.identity for s in specs if s.enrolled] + list(range(after, after + cfg.gallery_only))
    samples = [gen.sample(ident, STILL_INDEX + t) for ident in enrolled for t in range(cfg.booking_stills)]
    images, truth, quality = _frame_arrays(samples)
    feats, styles, landmarks, scores = frame_inputs(models, images, truth, quality,
                                                    {"landmarks": 0.0, "embed": 0.0})
    groups = np.repeat(np.arange(len(enrolled)), cfg.booking_stills)
    first = feats[:: cfg.booking_stills]
    single = first / np.linalg.norm(first, axis=1, keepdims=True)
    out: dict[str, dict[str, np.ndarray]] = {"single": {}, "booking": {}}
    for m in cfg.methods:
        out["single"][m] = single.astype(np.float32)
        out["booking"][m] = fuse_templates(m, feats, groups, styles=styles, landmarks=landmarks, face_scores=scores,
                                           model=models.caface, image_size=float(models.image_size),
                                           chunk_size=cfg.caface_chunk, quality=quality)
    return np.asarray(enrolled), out


_WORKER: dict[str, Any] = {}


def ready_worker(cfg: LongProbesConfig, proc_config: Any, proc_seed: int, models: Models | None = None
                 ) -> tuple[Models, Any]:
    """The models (loaded unless given) and the face renderer of a process that runs probes, after one pass over
    two frames, so that lazy imports (Lightning, via ``features_and_styles``) and first-call allocations happen
    before the first probe and are not counted in its memory."""
    from ml.data.procedural import ProceduralFaces

    models, gen = models or load_models(cfg), ProceduralFaces(proc_config, seed=proc_seed)
    frame_inputs(models, *_frame_arrays([gen.sample(0, k) for k in range(2)]), {"landmarks": 0.0, "embed": 0.0})
    return models, gen


def _worker_init(cfg: LongProbesConfig, proc_config: Any, proc_seed: int, surveillance: Any, queue: Any) -> None:
    import torch

    torch.set_num_threads(cfg.torch_threads)
    models, gen = ready_worker(cfg, proc_config, proc_seed)
    _WORKER.update(cfg=cfg, models=models, gen=gen, surveillance=surveillance, queue=queue)


def _worker_probe(spec: ProbeSpec) -> ProbeResult:
    w = _WORKER
    return run_probe(spec, w["cfg"], w["models"], w["gen"], w["surveillance"], progress=w["queue"].put)


def run_probes(specs: Sequence[ProbeSpec], cfg: LongProbesConfig, proc_config: Any, proc_seed: int,
               surveillance: Any, models: Models | None = None, progress: bool = True) -> list[ProbeResult]:
    """Every probe, longest first, in ``cfg.workers`` processes (in this one when 1); a tqdm bar counts frames."""
    import queue as queue_mod

    from tqdm.auto import tqdm

    order = sorted(specs, key=lambda s: -s.length)
    total = sum(s.length for s in specs)
    results: list[ProbeResult] = []
    with tqdm(total=total, desc="probe frames", unit="frame", unit_scale=True, disable=not progress) as bar:
        if cfg.workers == 1:
            import torch

            before = torch.get_num_threads()
            torch.set_num_threads(cfg.torch_threads)
            try:
                models, gen = ready_worker(cfg, proc_config, proc_seed, models)
                results = [run_probe(s, cfg, models, gen, surveillance, progress=bar.update) for s in order]
            finally:
                torch.set_num_threads(before)
        else:
            import multiprocessing
            from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

            context = multiprocessing.get_context("spawn")  # no forked copies of torch's thread pools
            frames_done = context.Queue()
            with ProcessPoolExecutor(max_workers=min(cfg.workers, len(order)), mp_context=context,
                                     initializer=_worker_init,
                                     initargs=(cfg, proc_config, proc_seed, surveillance, frames_done)) as pool:
                pending = {pool.submit(_worker_probe, s) for s in order}
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in done:
                        results.append(future.result())  # a worker's error is raised here
                    while True:
                        try:
                            bar.update(frames_done.get_nowait())
                        except queue_mod.Empty:
                            break
    return sorted(results, key=lambda r: r.index)
