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
truth and quality), its FR features and CAFace styles (``ml.eval.sets.features_and_styles``) and is fused by every
method's ``ml.eval.sets.FusionStream`` (running sums for average / norm-weighted / KP-RPE landmark × face score /
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
- Metrics (``ml.eval.sets.video_identification``): rank-1 / rank-5 of the mated probes, TPIR at FPIR ``--fpir`` at
  rank 1; rank-1 (single gallery) of each probe's first N frames for N in ``--prefixes`` and all frames (CAFace
  Fig. 1c: the gain over averaging versus the number of frames fused, CAFace's and the oracle's).
- Cost: seconds per stage (render, landmarks, embed, fuse) and the peak RSS of the process during each probe
  (``/proc/self/status`` VmHWM, reset per probe), to show memory stays flat as probes grow.

Probes run in ``--workers`` processes (one torch thread each by default), longest first. Writes
``reports/long_probes.md`` and ``plots/long_probes_gain.png`` under ``--out-dir`` (default: the repository).

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
import datetime as dt
import logging
import math
import os
import platform
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ml.errors import ConfigError, DataError

log = logging.getLogger("experiments.long_probes")
ROOT = Path(__file__).resolve().parents[1]
REPORT = Path("reports") / "long_probes.md"
PLOT = Path("plots") / "long_probes_gain.png"
METHODS = ("average", "norm_weighted", "landmark_score", "caface", "quality_oracle")  # ml.eval.sets.STREAM_METHODS
LABELS = {"average": "average", "norm_weighted": "norm-weighted average",
          "landmark_score": "KP-RPE landmark × face score", "caface": "CAFace",
          "quality_oracle": "true-quality oracle (headroom, not a method)"}
REFERENCES = ("quality_oracle",)  # rows that know what no method can (the renderer's quality): not ranked as methods
DESIGNS = ("surveillance", "procedural")  # probe frames: ml.data.surveillance, or the smooth ProceduralFaces.sequence
LOW_QUALITY = 0.1  # a frame of true quality below this is counted as unusable in the report
STILL_INDEX = 20_000  # booking still t of an identity is sample (identity, STILL_INDEX + t), as tasks/prepare.py
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LongProbesConfig:
    """What to run; every field is a command-line option (``--min-frames`` for ``min_frames``)."""

    enrolled: int = 12
    distractors: int = 4
    gallery_only: int = 200  # enrolled identities without a probe: IJB-S's gallery has 202 subjects
    min_frames: int = 1000
    max_frames: int = 20000
    booking_stills: int = 3
    chunk: int = 256  # frames rendered, embedded and fused at a time
    caface_chunk: int = 64  # CAFace's N' (the evaluate stage's fusion_chunk_size)
    prefixes: tuple[int, ...] = (10, 100, 1000, 10000)
    methods: tuple[str, ...] = METHODS
    ranks: tuple[int, ...] = (1, 5)
    fpir: float = 0.01
    workers: int = 2
    threads: int = 0  # torch threads per worker; 0 = the machine's cores / workers
    seed: int = 0
    design: str = "surveillance"
    fr_model: Path = Path("models/fr/real")
    fusion_model: Path | None = Path("models/fusion")
    aligner: Path | None = Path("models/aligner")

    def __post_init__(self) -> None:
        ints = {"enrolled": (self.enrolled, 0), "distractors": (self.distractors, 0),
                "gallery_only": (self.gallery_only, 0),
                "min_frames": (self.min_frames, 1), "max_frames": (self.max_frames, 1),
                "booking_stills": (self.booking_stills, 1), "chunk": (self.chunk, 1),
                "caface_chunk": (self.caface_chunk, 1), "workers": (self.workers, 1), "threads": (self.threads, 0),
                "seed": (self.seed, 0)}
        for key, (value, low) in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"--{_opt(key)} must be an integer ≥ {low}, got {value!r}")
        if self.probes == 0:
            raise ConfigError("no probes: --enrolled 0 and --distractors 0; give at least 1 enrolled identity "
                              "(e.g. --enrolled 12 --distractors 4)")
        if self.enrolled < 1:
            raise ConfigError(
                f"--enrolled {self.enrolled}: there are no mated probes to identify; give at least 1 enrolled "
                "identity (e.g. --enrolled 12 --distractors 4)"
            )
        if self.min_frames > self.max_frames:
            raise ConfigError(
                f"probe length bounds are reversed: --min-frames {self.min_frames} > --max-frames {self.max_frames}; "
                "swap them (e.g. --min-frames 1000 --max-frames 20000)"
            )
        if not self.prefixes or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.prefixes):
            raise ConfigError(f"--prefixes must be positive frame counts, got {list(self.prefixes)}")
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise ConfigError(f"--methods must name fusion methods among {', '.join(METHODS)}, got {list(self.methods)}")
        if not self.ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.ranks):
            raise ConfigError(f"ranks must be positive integers, got {list(self.ranks)}")
        if not 0 < self.fpir < 1:
            raise ConfigError(f"--fpir must be in (0, 1), got {self.fpir}")
        if self.design not in DESIGNS:
            raise ConfigError(f"--design must be one of {', '.join(DESIGNS)}, got {self.design!r}")
        if "caface" in self.methods and self.fusion_model is None:
            raise ConfigError("--methods includes caface but --fusion-model is none; give the CAFace model directory "
                              "or leave caface out of --methods")

    @property
    def probes(self) -> int:
        return self.enrolled + self.distractors

    @property
    def torch_threads(self) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // self.workers)


def _opt(key: str) -> str:
    return key.replace("_", "-")


def _data_config(params_path: Path) -> Any:
    """The ``data`` section of ``params_path`` as ``tasks.prepare.DataConfig`` (unknown keys and bad types refused)."""
    from ml.config import from_mapping
    from tasks.common import load_params, section
    from tasks.prepare import DataConfig

    return from_mapping(DataConfig, section(load_params(params_path), "data"), "data")


def first_free_identity(params_path: Path) -> int:
    """The first procedural identity id after every set ``prepare`` renders (``data`` section of ``params_path``):
    train, held-out, discovery, video probes and distractors, unaligned crops, in that order of ids."""
    data = _data_config(params_path)
    return (data.train_identities + data.heldout_identities + data.discovery_identities + data.video_identities
            + data.video_distractors + data.unaligned_identities)


def procedural_config(params_path: Path, image_size: int) -> tuple[Any, int]:
    """The ``prepare`` stage's procedural faces (``data.procedural``, aligned) at the FR model's input size, and
    ``data.seed``."""
    data = _data_config(params_path)
    return dataclasses.replace(data.procedural_config(aligned=True), image_size=image_size), data.seed


def surveillance_config(params_path: Path) -> Any:
    """The ``prepare`` stage's probe degradations: ``data.surveillance`` as ``ml.data.surveillance.SurveillanceConfig``
    (unknown keys and bad ranges refused)."""
    return _data_config(params_path).surveillance_config()


def probe_lengths(cfg: LongProbesConfig) -> np.ndarray:
    """(P,) probe lengths: log-uniform in [min, max], stratified: draw k lies in the k-th of P equal slices of
    [log min, log max]; the draws are shuffled over the probes (seeded)."""
    rng = np.random.default_rng([cfg.seed, 29])
    p = cfg.probes
    u = (np.arange(p) + rng.random(p)) / p  # one uniform draw per slice
    lo, hi = math.log(cfg.min_frames), math.log(cfg.max_frames)
    lengths = np.exp(lo + u * (hi - lo)).round().astype(np.int64).clip(cfg.min_frames, cfg.max_frames)
    return lengths[rng.permutation(p)]


@dataclass(frozen=True)
class ProbeSpec:
    """One probe: its row, procedural identity, length and sequence index; enrolled = has a gallery."""

    index: int
    identity: int
    length: int
    seq_index: int
    enrolled: bool


def probe_specs(cfg: LongProbesConfig, first_identity: int) -> list[ProbeSpec]:
    """Enrolled probes first (rows 0..enrolled-1), then the distractors; identities consecutive from
    ``first_identity`` (the gallery-only identities follow them)."""
    lengths = probe_lengths(cfg)
    return [ProbeSpec(k, first_identity + k, int(lengths[k]), 7 + cfg.seed, k < cfg.enrolled) for k in range(cfg.probes)]


# ---------------------------------------------------------------------------------------------------------
# frames, one at a time
# ---------------------------------------------------------------------------------------------------------


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


def _chunks(frames: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for frame in frames:
        chunk.append(frame)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Models:
    """The FR model (features + styles), CAFace (or None) and the DFA aligner (or None: ground truth)."""

    fr: Any
    image_size: int
    embedding_dim: int
    caface: Any = None
    aligner: Any = None


def load_models(cfg: LongProbesConfig) -> Models:
    """Load the models ``cfg`` names; a missing or mismatched directory raises naming it and what to run."""
    from ml.models.backbones import input_contract
    from ml.models.fusion.caface import load_caface
    from ml.models.io import load_model

    if not (cfg.fr_model / "config.json").is_file():
        raise DataError(f"--fr-model {cfg.fr_model}: no FR model there (config.json); train one with "
                        "`faceops stage train_fr@real` or point --fr-model at a model directory")
    fr, _ = load_model(cfg.fr_model)
    contract = input_contract(fr)
    if "style_dim" not in contract:
        raise DataError(f"--fr-model {cfg.fr_model}: {type(fr).__name__} returns no CAFace styles; use a ViT, "
                        "KP-RPE ViT or IResNet model")
    models = Models(fr, int(contract["size"]), int(contract["embedding_dim"]))
    if "caface" in cfg.methods:
        assert cfg.fusion_model is not None  # checked by LongProbesConfig
        if not (cfg.fusion_model / "config.json").is_file():
            raise DataError(f"--fusion-model {cfg.fusion_model}: no CAFace model there; train it with "
                            "`faceops stage train_fusion` or leave caface out of --methods")
        caface = load_caface(cfg.fusion_model)
        if (caface.feature_dim, caface.style_dim) != (models.embedding_dim, int(contract["style_dim"])):
            raise DataError(
                f"--fusion-model {cfg.fusion_model} fuses {caface.feature_dim}-d features with {caface.style_dim} "
                f"style channels, but --fr-model {cfg.fr_model} gives {models.embedding_dim} and "
                f"{contract['style_dim']}; use the FR model CAFace was trained on (its config.json names it)"
            )
        models.caface = caface
    if cfg.aligner is not None:
        from ml.models.aligner.dfa import load_aligner

        if not (cfg.aligner / "config.json").is_file():
            raise DataError(f"--aligner {cfg.aligner}: no aligner there; train it with `faceops stage train_aligner` "
                            "or pass --aligner none for ground-truth landmarks and quality scores")
        models.aligner, _ = load_aligner(cfg.aligner)
    return models


def frame_inputs(models: Models, images: np.ndarray, truth: np.ndarray, quality: np.ndarray,
                 seconds: dict[str, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Landmarks (n, 5, 2) and face scores (n,) (DFA, else the renderer's truth and quality), then features (n, D)
    and styles (n, style_dim, 2) of uint8 ``images`` (n, S, S, 3); adds the seconds to ``seconds``."""
    from ml.eval.sets import features_and_styles

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


# ---------------------------------------------------------------------------------------------------------
# one probe, streamed
# ---------------------------------------------------------------------------------------------------------


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
    from ml.eval.sets import FusionStream

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
        images = np.stack([s.image for s in chunk])  # (n, S, S, 3) uint8
        truth = np.stack([s.landmarks for s in chunk])  # (n, 5, 2)
        quality = np.array([s.quality for s in chunk], dtype=np.float32)
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


# ---------------------------------------------------------------------------------------------------------
# galleries
# ---------------------------------------------------------------------------------------------------------


def galleries(specs: Sequence[ProbeSpec], cfg: LongProbesConfig, models: Models, gen: Any
              ) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """Gallery identities (G,) and ``{gallery: {method: templates (G, D)}}`` over the enrolled probes' identities and
    ``gallery_only`` more (the ids after every probe's): ``single`` = each identity's first still, L2-normalised (the
    same for every method); ``booking`` = its ``booking_stills`` stills fused with the method."""
    from ml.eval.sets import fuse_templates

    after = max(s.identity for s in specs) + 1
    enrolled = [s.identity for s in specs if s.enrolled] + list(range(after, after + cfg.gallery_only))
    samples = [gen.sample(ident, STILL_INDEX + t) for ident in enrolled for t in range(cfg.booking_stills)]
    images = np.stack([s.image for s in samples])
    truth = np.stack([s.landmarks for s in samples])
    quality = np.array([s.quality for s in samples], dtype=np.float32)
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


# ---------------------------------------------------------------------------------------------------------
# running every probe
# ---------------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def warm_up(models: Models, gen: Any) -> None:
    """One pass over two frames, so that lazy imports (Lightning, via ``features_and_styles``) and first-call
    allocations happen before the first probe and are not counted in its memory."""
    samples = [gen.sample(0, k) for k in range(2)]
    frame_inputs(models, np.stack([s.image for s in samples]), np.stack([s.landmarks for s in samples]),
                 np.array([s.quality for s in samples], dtype=np.float32), {"landmarks": 0.0, "embed": 0.0})


def _worker_init(cfg: LongProbesConfig, proc_config: Any, proc_seed: int, surveillance: Any, queue: Any) -> None:
    import torch

    from ml.data.procedural import ProceduralFaces

    torch.set_num_threads(cfg.torch_threads)
    models, gen = load_models(cfg), ProceduralFaces(proc_config, seed=proc_seed)
    warm_up(models, gen)
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

            from ml.data.procedural import ProceduralFaces

            before = torch.get_num_threads()
            torch.set_num_threads(cfg.torch_threads)
            try:
                models = models or load_models(cfg)
                gen = ProceduralFaces(proc_config, seed=proc_seed)
                warm_up(models, gen)
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


# ---------------------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------------------


def _tpir_key(row: dict[str, float]) -> str | None:
    """The ``tpir@fpir=…`` key of a ``video_identification`` result (None without non-mated probes)."""
    return next((k for k in row if k.startswith("tpir@fpir=")), None)


def identification(specs: Sequence[ProbeSpec], results: Sequence[ProbeResult], gallery_ids: np.ndarray,
                   gallery: dict[str, dict[str, np.ndarray]], cfg: LongProbesConfig) -> dict[str, Any]:
    """``{"<gallery>": {method: {"rank1", "rank5", "tpir@fpir=1e-2", ...}}, "prefix": {method: {N: rank1}},
    "prefix_frames": {N: mean frames}}`` from ``ml.eval.sets.video_identification``."""
    from ml.eval.sets import video_identification

    probe_ids = np.array([s.identity for s in specs])
    mated = np.array([s.enrolled for s in specs])
    out: dict[str, Any] = {}
    for name, per_method in gallery.items():
        out[name] = {}
        for m in cfg.methods:
            probes = np.stack([r.templates[m] for r in results])
            out[name][m] = video_identification(probes, probe_ids, per_method[m], gallery_ids, ranks=cfg.ranks,
                                                fpirs=(cfg.fpir,))
    prefixes = sorted(set(cfg.prefixes))
    out["prefix"] = {}
    for m in cfg.methods:
        out["prefix"][m] = {}
        for p in [*prefixes, 0]:  # 0 = all frames
            probes = np.stack([r.templates[m] if p == 0 else r.prefix_templates[m][p]
                               for r, keep in zip(results, mated) if keep])
            out["prefix"][m][p] = video_identification(probes, probe_ids[mated], gallery["single"][m], gallery_ids,
                                                       ranks=(1,))["rank1"]
    kept = [r for r, keep in zip(results, mated) if keep]
    out["prefix_frames"] = {p: float(np.mean([r.prefix_frames[p] for r in kept])) for p in prefixes}
    out["prefix_frames"][0] = float(np.mean([r.frames for r in kept]))
    if "average" in cfg.methods:  # how far each method's probe templates are from averaging's (every probe)
        out["cosine"] = {}
        for m in cfg.methods:
            if m == "average":
                continue
            out["cosine"][m] = {}
            for p in [*prefixes, 0]:
                pick = (lambda r, k: r.templates[k]) if p == 0 else (lambda r, k: r.prefix_templates[k][p])
                cos = np.array([float(np.dot(pick(r, m), pick(r, "average"))) for r in results])
                out["cosine"][m][p] = (float(cos.mean()), float(cos.min()))
    return out


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------


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
    keys = [*sorted(set(cfg.prefixes)), 0]
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
        keys = [*sorted(set(cfg.prefixes)), 0]
        gains = [100 * (metrics["prefix"]["caface"][k] - metrics["prefix"]["average"][k]) for k in keys]
        frames = [metrics["prefix_frames"][k] for k in keys]
        pairs = ", ".join(f"{g:+.1f} at {f:,.0f} frames" for g, f in zip(gains, frames))
        grows = all(b >= a for a, b in zip(gains, gains[1:])) and gains[-1] > gains[0]
        trend = ("grows with the number of frames fused, as in CAFace Fig. 1c" if grows
                 else "is 0 at every probe length (CAFace Fig. 1c has it growing with the frames fused)"
                 if not any(gains) else
                 "does not grow steadily with the number of frames fused (CAFace Fig. 1c has it growing)")
        lines.append(f"- CAFace's rank-1 gain over averaging (single gallery) {trend}: {pairs}.")
    if "quality_oracle" in cfg.methods and "average" in cfg.methods:
        keys = [*sorted(set(cfg.prefixes)), 0]
        whole = {name: 100 * (metrics[name]["quality_oracle"]["rank1"] - metrics[name]["average"]["rank1"])
                 for name in ("single", "booking")}
        gains = [100 * (metrics["prefix"]["quality_oracle"][k] - metrics["prefix"]["average"][k]) for k in keys]
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
        keys = [*sorted(set(cfg.prefixes)), 0]
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
        "below was measured in that run.",
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
    keys = [*sorted(set(cfg.prefixes)), 0]
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
            lines.append(f"| {label} − average (points) | " + " | ".join(
                f"{100 * (metrics['prefix'][m][k] - metrics['prefix']['average'][k]):+.1f}" for k in keys) + " |")
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


# ---------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------


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
    fr_config = (cfg.fr_model / "config.json").read_text()
    import json

    digest = str(json.loads(fr_config).get("extra", {}).get("training_data_digest", ""))
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


if __name__ == "__main__":
    # run through the importable module, so worker processes unpickle the same classes
    from experiments.long_probes import main as _main
    from tasks.common import stage_main

    stage_main(_main)
