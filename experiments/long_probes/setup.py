"""What ``python -m experiments.long_probes`` runs: its configuration (``LongProbesConfig``, the fusion methods and
probe designs), the identities and settings it reads from ``params.yaml`` (``data``: the ``prepare`` stage's
procedural faces and surveillance degradations), the probes (stratified log-uniform lengths) and the models it
loads (FR, CAFace, DFA aligner). ``experiments/long_probes`` describes the experiment.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ml.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("average", "norm_weighted", "landmark_score", "caface", "quality_oracle")  # ml.fusion.sets.STREAM_METHODS
LABELS = {"average": "average", "norm_weighted": "norm-weighted average",
          "landmark_score": "KP-RPE landmark × face score", "caface": "CAFace",
          "quality_oracle": "true-quality oracle (headroom, not a method)"}
REFERENCES = ("quality_oracle",)  # rows that know what no method can (the renderer's quality): not ranked as methods
DESIGNS = ("surveillance", "procedural")  # probe frames: ml.data.surveillance, or the smooth ProceduralFaces.sequence
LOW_QUALITY = 0.1  # a frame of true quality below this is counted as unusable in the report
STILL_INDEX = 20_000  # booking still t of an identity is sample (identity, STILL_INDEX + t), as tasks/prepare/sets.py


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
                raise ConfigError(f"--{key.replace('_', '-')} must be an integer ≥ {low}, got {value!r}")
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
    from ml.fr.backbones import input_contract
    from ml.fusion.caface import load_caface
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
        from ml.aligner.dfa import load_aligner

        if not (cfg.aligner / "config.json").is_file():
            raise DataError(f"--aligner {cfg.aligner}: no aligner there; train it with `faceops stage train_aligner` "
                            "or pass --aligner none for ground-truth landmarks and quality scores")
        models.aligner, _ = load_aligner(cfg.aligner)
    return models
