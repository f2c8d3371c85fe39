"""Stage ``prepare``: build every dataset the pipeline reads, under ``data/prepared/``.

- ``train/``      procedural faces of the training identities (split ``train``/``val``)
- ``heldout/``    procedural faces of identities never seen in training (split ``gallery``/``probe``)
- ``templates/``  IJB-style template set from video-like sequences, with ``meta/face_tid_mid.txt``
                  (``img tid mid``) and ``meta/template_pair_label.txt`` (``tid1 tid2 label``)
- ``verification/procedural.bin``  InsightFace verification pairs over the held-out identities
- ``discovery/``  procedural faces of further unseen identities, for generalized face discovery (FaceGCD)
- ``gfd/split.parquet``  the GFD split of ``discovery/`` (or ``real/``): known/unknown identities, labelled
                  images, train/test per identity; ``gfd/split.json`` names the dataset and the counts
- ``videos/``      IJB-S-like set fusion benchmark: booking galleries of stills and long surveillance probes, most
                  frames heavily degraded and a short usable window (``data.surveillance``; mated and non-mated),
                  ``meta/face_tid_mid.txt``
- ``fusion/``      CAFace's training sets: identities no other set uses, ``clean`` renders (the targets) and
                  ``degraded`` copies of a few source poses each (``template`` = the source)
- ``unaligned/``   unaligned crops (rotation, scale, shift) with exact landmarks for the DFA aligner (``train`` /
                  ``test`` identities)

With real faces ingested (``data.ingest_folder`` or ``data.ingest_recordio``) their identities are split by seed
into training, held-out and discovery identities (disjoint; ``data.real_heldout_fraction``,
``data.real_discovery_fraction``), and the real faces take the procedural ones' places, so every stage that
trains on faces reads them: ``train/`` holds the real training identities, ``heldout/`` + ``verification/real.bin``
the held-out ones (never trained on), and with ``data.gfd_dataset`` ``auto`` or ``real``, ``discovery/`` the real
discovery identities that the GFD split covers (``fusion/`` is not written: CAFace then trains on degraded copies of
the real training faces, see tasks/train_fusion.py). ``verification/procedural.bin`` stays as a procedural reference; the
template, video and unaligned sets stay procedural (real folders have no sequences and no exact landmarks). A
RecordIO's faces are also recorded by key (``records.parquet`` in each real dataset, ``ml.data.records``), so that
``train_fr`` can read them from the RecordIO in place (``data.train_reader``).

The whole directory is written to a temporary sibling and renamed on success. Its parts are independent and are
written by as many processes as the stage has cores (same bytes whatever the count).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ml.config import from_mapping
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.data.surveillance import SurveillanceConfig
from ml.errors import ConfigError, DataError
from tasks.common import Paths, StageResult, atomic_path, load_params, section, stage_cores, stage_main

log = logging.getLogger(__name__)


TRAIN_READERS = ("auto", "png", "recordio")  # data.train_reader: where train_fr reads ingested faces from
GFD_DATASETS = ("auto", "discovery", "real")  # what the generalized-face-discovery split covers (auto: real if ingested)


@dataclass(frozen=True)
class DataConfig:
    """``params.yaml`` section ``data``."""

    seed: int = 0
    image_size: int = 64
    train_identities: int = 200
    images_per_identity: int = 20
    val_fraction: float = 0.1
    heldout_identities: int = 100
    heldout_images_per_identity: int = 12
    gallery_images_per_identity: int = 2
    verification_pairs: int = 3000
    template_identities: int = 60
    templates_per_identity: int = 3
    frames_per_template: int = 6
    procedural: dict = field(default_factory=dict)
    ingest_folder: str = ""
    ingest_recordio: str = ""
    ingest_max_images: int = 0
    ingest_resize: bool = True          # real faces of another square size are resized to image_size (False: refused)
    ingest_max_corrupt_fraction: float = 0.01  # undecodable images skipped (logged) up to this share, then refused
    real_heldout_fraction: float = 0.2  # share of the real identities held out: verification, identification only
    real_discovery_fraction: float = 0.2  # share drawn for the GFD set when data.gfd_dataset resolves to real
    # how train_fr reads ingested training faces: recordio (the RecordIO's JPEGs in place, decoded in DataLoader
    # workers), png (the prepared PNG copies), auto (recordio when the faces came from a RecordIO)
    train_reader: str = "auto"
    # generalized face discovery (FaceGCD): identities disjoint from train and held-out, and the GFD split
    discovery_identities: int = 100
    discovery_images_per_identity: int = 20
    gfd_dataset: str = "auto"           # what the GFD split covers: discovery | real | auto (real when ingested)
    gfd_known_fraction: float = 0.5     # share of identities that are known (some of their images labelled)
    gfd_labelled_fraction: float = 0.5  # share of a known identity's training images that carry a label
    gfd_test_fraction: float = 0.1      # per identity, share of images held out for the test subset
    # IJB-S-style video probes for set fusion: mated probes of enrolled identities + non-mated ones
    video_identities: int = 30          # enrolled: a booking gallery of stills and one surveillance-like probe each
    video_distractors: int = 10         # not enrolled: probes only (open-set TPIR@FPIR)
    video_frames: tuple[int, int] = (50, 400)  # probe length drawn log-uniformly in [min, max] frames
    booking_stills: int = 3             # gallery stills per identity (the first is the "single" gallery)
    surveillance: dict = field(default_factory=dict)  # probe and CAFace-set degradation: SurveillanceConfig keys
    # CAFace's training sets (the reference recipe): identities no other set uses, clean renders for the targets
    # and a few source poses per identity, each copied under surveillance degradations
    fusion_identities: int = 400
    fusion_clean_images: int = 4        # undegraded renders per identity: the target f_GT (with their flips)
    fusion_sources: int = 3             # source poses per identity; a training set draws from 1–3 of them
    fusion_copies: int = 16             # degraded copies of each source
    # unaligned crops with exact landmarks for the DFA aligner (rotation ±30°, scale 0.7–1.2, shift ±15 %)
    unaligned_identities: int = 100
    unaligned_images_per_identity: int = 20
    unaligned_test_identities: int = 20  # of those, identities kept for testing the aligner (split "test")
    unaligned_size: int = 128

    def surveillance_config(self) -> SurveillanceConfig:
        return from_mapping(SurveillanceConfig, self.surveillance, "data.surveillance")

    def procedural_config(self, aligned: bool = True) -> ProceduralConfig:
        if "image_size" in self.procedural or "aligned" in self.procedural:
            raise ConfigError("params key 'data.procedural.image_size'/'aligned': set 'data.image_size' instead.")
        cfg = from_mapping(ProceduralConfig, self.procedural, "data.procedural")
        return dataclasses.replace(cfg, image_size=self.image_size, aligned=aligned)

    @property
    def ingested(self) -> bool:
        """Real faces are ingested: they replace the procedural training and held-out sets."""
        return bool(self.ingest_folder or self.ingest_recordio)

    @property
    def gfd_source(self) -> str:
        """The prepared dataset the GFD split covers: ``real`` (ingested discovery identities) or ``discovery``."""
        if self.gfd_dataset == "auto":
            return "real" if self.ingested else "discovery"
        return self.gfd_dataset

    def __post_init__(self) -> None:
        checks = {
            "train_identities": self.train_identities >= 2,
            "images_per_identity": self.images_per_identity >= 2,
            "heldout_identities": self.heldout_identities >= 2,
            "heldout_images_per_identity": self.heldout_images_per_identity > self.gallery_images_per_identity >= 1,
            "val_fraction": 0.0 <= self.val_fraction < 1.0,
            "template_identities": 2 <= self.template_identities <= self.heldout_identities,
            "templates_per_identity": self.templates_per_identity >= 2,
            "frames_per_template": self.frames_per_template >= 1,
            "verification_pairs": self.verification_pairs >= 20,
            "image_size": 32 <= self.image_size <= 256,
            "discovery_identities": self.discovery_identities >= 4,
            "discovery_images_per_identity": self.discovery_images_per_identity >= 4,
            "gfd_known_fraction": 0.0 < self.gfd_known_fraction < 1.0,
            "gfd_labelled_fraction": 0.0 < self.gfd_labelled_fraction <= 1.0,
            "gfd_test_fraction": 0.0 < self.gfd_test_fraction < 1.0,
            "video_identities": self.video_identities >= 2,
            "video_distractors": self.video_distractors >= 1,
            "video_frames": 1 <= self.video_frames[0] <= self.video_frames[1],
            "booking_stills": self.booking_stills >= 1,
            "fusion_identities": self.fusion_identities >= 2,
            "fusion_clean_images": self.fusion_clean_images >= 1,
            "fusion_sources": self.fusion_sources >= 1,
            "fusion_copies": self.fusion_copies >= 2,
            "unaligned_identities": self.unaligned_identities >= 2,
            "unaligned_images_per_identity": self.unaligned_images_per_identity >= 1,
            "unaligned_test_identities": 1 <= self.unaligned_test_identities < self.unaligned_identities,
            "unaligned_size": 64 <= self.unaligned_size <= 512,
            "ingest_max_images": self.ingest_max_images >= 0,
            "ingest_max_corrupt_fraction": 0.0 <= self.ingest_max_corrupt_fraction < 1.0,
            "real_heldout_fraction": 0.0 < self.real_heldout_fraction < 1.0,
            "real_discovery_fraction": 0.0 <= self.real_discovery_fraction < 1.0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"params key 'data.{key}' = {getattr(self, key)!r} is out of range.")
        self.surveillance_config()  # a bad key or range fails here, naming it
        if self.train_reader not in TRAIN_READERS:
            raise ConfigError(f"params key 'data.train_reader' = {self.train_reader!r}: use one of "
                              f"{', '.join(TRAIN_READERS)}.")
        if self.gfd_dataset not in GFD_DATASETS:
            raise ConfigError(f"params key 'data.gfd_dataset' = {self.gfd_dataset!r}: use one of {', '.join(GFD_DATASETS)}.")


def _sample_pairs(labels: np.ndarray, n_pairs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Half genuine, half impostor index pairs, shuffled so every unshuffled fold is balanced."""
    by_label: dict[int, np.ndarray] = {int(l): np.flatnonzero(labels == l) for l in np.unique(labels)}
    multi = [l for l, idx in by_label.items() if len(idx) >= 2]
    if len(multi) < 1 or len(by_label) < 2:
        raise DataError("cannot build verification pairs: need ≥2 identities, one with ≥2 images.")
    n_pos = n_pairs // 2
    pairs, same = [], []
    for _ in range(n_pos):
        idx = by_label[multi[rng.integers(len(multi))]]
        a, b = rng.choice(idx, size=2, replace=False)
        pairs.append((a, b))
        same.append(True)
    keys = list(by_label)
    for _ in range(n_pairs - n_pos):
        la, lb = rng.choice(len(keys), size=2, replace=False)
        pairs.append((rng.choice(by_label[keys[la]]), rng.choice(by_label[keys[lb]])))
        same.append(False)
    order = rng.permutation(len(pairs))
    return np.asarray(pairs, dtype=np.int64)[order], np.asarray(same, dtype=bool)[order]


def write_pairs_bin(
    path: Path, images: np.ndarray, labels: np.ndarray, n_pairs: int, seed: int, landmarks: np.ndarray | None = None
) -> int:
    """An InsightFace verification ``.bin``; with ``landmarks`` also ``<stem>.landmarks.npy`` (2P, 5, 2) beside it
    (the keypoints KP-RPE models need, in the same order as the ``.bin``'s images)."""
    from ml.data.formats import write_verification_bin

    pairs, issame = _sample_pairs(labels, n_pairs, np.random.default_rng(seed))
    order = pairs.reshape(-1)
    write_verification_bin(path, images[order], issame, image_format="jpg")
    if landmarks is not None:
        np.save(path.with_suffix(".landmarks.npy"), landmarks[order].astype(np.float32))
    return len(issame)


def _procedural_split(
    out: Path, gen: ProceduralFaces, identities: range, per_identity: int, split_of, *, name: str,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write one procedural dataset directory; returns (images, labels, landmarks) kept for pair building."""
    from ml.data.dataset import DatasetWriter

    images, labels, landmarks = [], [], []
    meta = {"generator": "procedural", "seed": gen.seed, "config": dataclasses.asdict(gen.config)}
    with DatasetWriter(out, name=name, source="procedural", aligned=gen.config.aligned, generator=meta) as w:
        bar = tqdm(identities, desc=f"prepare {name}", unit="id", leave=False, disable=not progress)
        for k, ident in enumerate(bar):
            for i in range(per_identity):
                s = gen.sample(ident, i)
                w.add(
                    s.image,
                    identity=f"id{ident:06d}",
                    split=split_of(i),
                    landmarks=s.landmarks.reshape(-1),
                    quality=s.quality,
                )
                images.append(s.image)
                labels.append(k)
                landmarks.append(s.landmarks)
    return np.stack(images), np.asarray(labels), np.stack(landmarks)


def _template_set(
    out: Path, gen: ProceduralFaces, cfg: DataConfig, first_identity: int, progress: bool = True
) -> int:
    """IJB-style template set: each template = one video-like sequence (one media) + one still (another)."""
    from ml.data.dataset import DatasetWriter

    rows: list[tuple[str, int, int]] = []
    tid_identity: dict[int, int] = {}
    with DatasetWriter(out, name="templates", source="procedural", aligned=gen.config.aligned) as w:
        tid = mid = 0
        for k in tqdm(range(cfg.template_identities), desc="prepare templates", unit="id", leave=False,
                      disable=not progress):
            ident = first_identity + k
            for t in range(cfg.templates_per_identity):
                frames = gen.sequence(ident, cfg.frames_per_template, seq_index=t)
                still = gen.sample(ident, 10_000 + t)
                for media, samples in ((mid, frames), (mid + 1, [still])):
                    for s in samples:
                        rel = w.add(
                            s.image, identity=f"id{ident:06d}", split="template",
                            landmarks=s.landmarks.reshape(-1), quality=s.quality, template=tid, media=media,
                        )
                        rows.append((rel, tid, media))
                tid_identity[tid] = ident
                tid += 1
                mid += 2
    meta = out / "meta"
    meta.mkdir()
    (meta / "face_tid_mid.txt").write_text("".join(f"{p} {t} {m}\n" for p, t, m in rows))
    tids = sorted(tid_identity)
    lines = []
    for i, a in enumerate(tids):
        for b in tids[i + 1 :]:
            lines.append(f"{a} {b} {int(tid_identity[a] == tid_identity[b])}\n")
    (meta / "template_pair_label.txt").write_text("".join(lines))
    return len(lines)


def _ingest_real(out: Path, cfg: DataConfig, progress: bool = True) -> dict[str, float]:
    """Stream the user's real faces into ``train/`` (training identities, split ``train``/``val``), ``heldout/``
    (held-out identities, ``gallery``/``probe``) and, when the GFD split covers real faces, ``discovery/``
    (discovery identities); then ``verification/real.bin`` over the held-out identities with ≥ 2 images."""
    from contextlib import ExitStack

    from ml.data.dataset import DatasetWriter
    from ml.data.ingest import IngestSpec, ingest_split

    spec = IngestSpec(folder=cfg.ingest_folder, recordio=cfg.ingest_recordio, image_size=cfg.image_size,
                      resize=cfg.ingest_resize, max_images=cfg.ingest_max_images,
                      max_corrupt_fraction=cfg.ingest_max_corrupt_fraction)
    meta = {"ingested_from": str(Path(spec.source).resolve()), "seed": cfg.seed,
            "heldout_fraction": cfg.real_heldout_fraction, "discovery_fraction": cfg.real_discovery_fraction}
    groups = {"train": ("train", "real-train"), "heldout": ("heldout", "real-heldout")}
    if cfg.gfd_source == "real":
        groups["discovery"] = ("discovery", "real-discovery")

    def train_split(i: int, n: int) -> str:  # the last round(n × val_fraction) images of an identity, ≥ 1 kept
        return "val" if i >= n - min(int(round(n * cfg.val_fraction)), n - 1) else "train"

    def heldout_split(i: int, n: int) -> str:  # an identity with too few images for a probe is gallery only
        return "gallery" if i < cfg.gallery_images_per_identity or n <= cfg.gallery_images_per_identity else "probe"

    split_of = {"train": train_split, "heldout": heldout_split, "discovery": lambda i, n: "train"}
    with ExitStack() as stack:
        opened = {g: stack.enter_context(DatasetWriter(out / d, name=name, source="real", aligned=True, generator=meta))
                  for g, (d, name) in groups.items()}

        records: dict[str, tuple[list[str], list[int]]] = {g: ([], []) for g in opened}

        def writer(group: str):
            def add(img, identity, i, n, ref):
                rel = opened[group].add(img, identity=identity, split=split_of[group](i, n))
                if spec.recordio:  # which record each face came from: training can read it there, not the PNG
                    records[group][0].append(rel)
                    records[group][1].append(int(ref))
            return add

        stats = ingest_split(spec, {g: writer(g) for g in opened}, seed=cfg.seed,
                             heldout_fraction=cfg.real_heldout_fraction,
                             discovery_fraction=cfg.real_discovery_fraction, progress=progress)
        if spec.recordio:
            from ml.data.records import write_records

            for g, (rels, keys) in records.items():  # into each dataset before it is moved into place
                write_records(opened[g].tmp_dir, rels, keys, spec.recordio)
    stats["data/real_verification_pairs"] = _real_pairs_bin(out, cfg)
    return stats


def _real_pairs_bin(out: Path, cfg: DataConfig) -> int:
    """``verification/real.bin`` over the held-out real identities with ≥ 2 images (single-image identities give
    no genuine pair and are left out); only the images the pairs use are decoded."""
    from ml.data.dataset import load_images, read_manifest
    from ml.data.formats import write_verification_bin

    manifest = read_manifest(out / "heldout" / "manifest.parquet")
    multi = manifest[manifest.groupby("identity")["path"].transform("count") >= 2].reset_index(drop=True)
    if multi["identity"].nunique() < 2:
        raise DataError(f"the held-out real identities have {multi['identity'].nunique()} with ≥ 2 images: "
                        "verification pairs need at least 2; ingest more images per identity or raise "
                        "data.real_heldout_fraction")
    labels = multi["label"].to_numpy()
    pairs, issame = _sample_pairs(labels, min(cfg.verification_pairs, 20 * len(labels)),
                                  np.random.default_rng(cfg.seed))
    used = np.unique(pairs)
    images = load_images(out / "heldout", multi.iloc[used])
    position = np.searchsorted(used, pairs.reshape(-1))
    (out / "verification").mkdir(exist_ok=True)
    write_verification_bin(out / "verification" / "real.bin", images[position], issame, image_format="jpg")
    return len(issame)


def _video_set(
    out: Path, gen: ProceduralFaces, cfg: DataConfig, first_identity: int, progress: bool = True
) -> dict[str, float]:
    """IJB-S-like set: per enrolled identity ``booking_stills`` gallery stills (media ``still``) and one long
    surveillance probe (``ml.data.surveillance.surveillance_sequence``: most frames heavily degraded, a short usable
    window); per distractor identity only a probe. Manifest: split ``gallery``/``probe``,
    ``template`` = the probe or gallery id, ``media`` = one id per video or still; ``meta/face_tid_mid.txt`` as IJB.
    A probe is mated when its identity has a gallery."""
    from ml.data.dataset import DatasetWriter
    from ml.data.surveillance import surveillance_sequence

    surveillance = cfg.surveillance_config()
    rng = np.random.default_rng(cfg.seed + 17)
    lo, hi = cfg.video_frames
    n_ids = cfg.video_identities + cfg.video_distractors
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), n_ids)).round().astype(int)
    rows: list[tuple[str, int, int]] = []
    tid = mid = 0
    with DatasetWriter(out, name="videos", source="procedural", aligned=gen.config.aligned) as w:
        for k in tqdm(range(n_ids), desc="prepare videos", unit="id", leave=False, disable=not progress):
            ident = first_identity + k
            identity = f"id{ident:06d}"
            if k < cfg.video_identities:
                for t in range(cfg.booking_stills):
                    s = gen.sample(ident, 20_000 + t)
                    rel = w.add(s.image, identity=identity, split="gallery", landmarks=s.landmarks.reshape(-1),
                                quality=s.quality, template=tid, media=mid)
                    rows.append((rel, tid, mid))
                    mid += 1
                tid += 1
            for s in surveillance_sequence(gen, ident, int(lengths[k]), seq_index=7, cfg=surveillance):
                rel = w.add(s.image, identity=identity, split="probe", landmarks=s.landmarks.reshape(-1),
                            quality=s.quality, template=tid, media=mid)
                rows.append((rel, tid, mid))
            tid += 1
            mid += 1
    meta = out / "meta"
    meta.mkdir()
    (meta / "face_tid_mid.txt").write_text("".join(f"{p} {t} {m}\n" for p, t, m in rows))
    return {"data/video_frames": int(lengths.sum()), "data/video_probes": n_ids,
            "data/video_max_frames": int(lengths.max())}


def _fusion_set(out: Path, gen: ProceduralFaces, cfg: DataConfig, progress: bool = True) -> dict[str, float]:
    """CAFace's training material (``ml.data.surveillance.fusion_faces``) for ``fusion_identities`` identities from
    ``FUSION_FIRST_IDENTITY`` on: split ``clean`` (the targets) and ``degraded`` (``template`` = the source pose a
    copy was rendered from, numbered across the set)."""
    from ml.data.dataset import DatasetWriter
    from ml.data.surveillance import FUSION_FIRST_IDENTITY, fusion_faces

    surveillance = cfg.surveillance_config()
    meta = {"generator": "procedural", "seed": gen.seed, "surveillance": dataclasses.asdict(surveillance)}
    source = 0
    with DatasetWriter(out, name="procedural-fusion", source="procedural", aligned=True, generator=meta) as w:
        bar = tqdm(range(cfg.fusion_identities), desc="prepare fusion", unit="id", leave=False, disable=not progress)
        for k in bar:
            ident = FUSION_FIRST_IDENTITY + k
            identity = f"id{ident:07d}"
            clean, sets = fusion_faces(gen, ident, cfg.fusion_clean_images, cfg.fusion_sources, cfg.fusion_copies,
                                       surveillance)
            for s in clean:
                w.add(s.image, identity=identity, split="clean", landmarks=s.landmarks.reshape(-1), quality=s.quality)
            for copies in sets:
                for s in copies:
                    w.add(s.image, identity=identity, split="degraded", landmarks=s.landmarks.reshape(-1),
                          quality=s.quality, template=source)
                source += 1
    return {"data/fusion_images": cfg.fusion_identities * (cfg.fusion_clean_images
                                                           + cfg.fusion_sources * cfg.fusion_copies)}


def _unaligned_set(out: Path, cfg: DataConfig, first_identity: int, progress: bool = True) -> int:
    """Unaligned procedural crops (``data.unaligned_size``²) with their exact landmarks; the last
    ``unaligned_test_identities`` identities are split ``test``, the rest ``train``."""
    from ml.data.dataset import DatasetWriter
    from ml.data.unaligned import unaligned_faces

    images, landmarks, identities = unaligned_faces(
        cfg.unaligned_identities, cfg.unaligned_images_per_identity, cfg.unaligned_size, cfg.seed,
        first_identity=first_identity, base=cfg.procedural_config(aligned=False), progress=progress,
    )
    first_test = first_identity + cfg.unaligned_identities - cfg.unaligned_test_identities
    with DatasetWriter(out, name="unaligned", source="procedural", aligned=False) as w:
        for image, lm, ident in zip(images, landmarks, identities):
            w.add(image, identity=f"id{ident:06d}", split="test" if ident >= first_test else "train",
                  landmarks=lm.reshape(-1))
    return len(images)


def write_gfd_split(prepared: Path, cfg: DataConfig) -> dict[str, float]:
    """``gfd/split.parquet`` over ``prepared/discovery`` (procedural, or the real discovery identities) +
    ``gfd/split.json`` naming the dataset, its source and the counts."""
    from ml.data.dataset import read_manifest
    from ml.discovery.split import gfd_split, write_gfd_split as write_split

    manifest = read_manifest(prepared / "discovery" / "manifest.parquet")
    split = gfd_split(manifest, seed=cfg.seed, known_fraction=cfg.gfd_known_fraction,
                      labelled_fraction=cfg.gfd_labelled_fraction, test_fraction=cfg.gfd_test_fraction)
    out = prepared / "gfd"
    out.mkdir()
    write_split(split, out / "split.parquet")
    known_ids = split.loc[split["known"], "identity"].nunique()
    counts = {
        "identities": int(split["identity"].nunique()), "known_identities": int(known_ids),
        "images": len(split), "labelled_images": int(split["labelled"].sum()),
        "test_images": int((split["subset"] == "test").sum()),
    }
    (out / "split.json").write_text(json.dumps({
        "dataset": "discovery", "source": "real" if cfg.gfd_source == "real" else "procedural", "seed": cfg.seed, "known_fraction": cfg.gfd_known_fraction,
        "labelled_fraction": cfg.gfd_labelled_fraction, "test_fraction": cfg.gfd_test_fraction, **counts,
    }, indent=2) + "\n")
    return {f"data/gfd_{k}": v for k, v in counts.items()}


def _check_sources(cfg: DataConfig) -> None:
    """Fail before any work when a named real-data source is missing."""
    if cfg.ingest_folder and cfg.ingest_recordio:
        raise ConfigError("set only one of 'data.ingest_folder' and 'data.ingest_recordio'.")
    if cfg.ingest_folder and not Path(cfg.ingest_folder).is_dir():
        raise DataError(f"data.ingest_folder: {cfg.ingest_folder} is not a directory. "
                        "Point it at an image folder laid out as <identity>/<image>.")
    if cfg.gfd_dataset == "real" and not (cfg.ingest_folder or cfg.ingest_recordio):
        raise ConfigError("data.gfd_dataset is 'real' but no real data is ingested: set 'data.ingest_folder' or "
                          "'data.ingest_recordio', or use data.gfd_dataset: discovery.")
    if cfg.ingest_recordio and not Path(cfg.ingest_recordio).is_file():
        raise DataError(f"data.ingest_recordio: {cfg.ingest_recordio} does not exist. "
                        "Point it at an InsightFace train.rec with train.idx beside it.")
    # the layout is cheap to check: a folder's tree, a RecordIO's index and header record (the images are decoded
    # while ingesting)
    from ml.data.formats import RecordIOReader, ingest_image_folder

    if cfg.ingest_folder:
        ingest_image_folder(Path(cfg.ingest_folder))
    if cfg.ingest_recordio:
        RecordIOReader(Path(cfg.ingest_recordio)).close()


def sample_grid(gen: ProceduralFaces, cfg: DataConfig, path: Path, rows: int = 6, cols: int = 8) -> None:
    """A PNG of faces with their 5 landmarks: one row per training identity, the last row a video-like sequence."""
    from PIL import Image, ImageDraw

    size, pad = cfg.image_size, 2
    canvas = Image.new("RGB", (cols * (size + pad) + pad, (rows + 1) * (size + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    grid = [[gen.sample(r, c) for c in range(cols)] for r in range(min(rows, cfg.train_identities))]
    grid.append(gen.sequence(cfg.train_identities, cols, seq_index=0))
    colours = [(255, 0, 0), (0, 255, 0), (0, 128, 255), (255, 0, 255), (255, 200, 0)]
    for r, samples in enumerate(grid):
        for c, s in enumerate(samples):
            x0, y0 = pad + c * (size + pad), pad + r * (size + pad)
            canvas.paste(Image.fromarray(s.image), (x0, y0))
            for (x, y), colour in zip(s.landmarks, colours):
                draw.ellipse((x0 + x - 1, y0 + y - 1, x0 + x + 1, y0 + y + 1), fill=colour)
    with atomic_path(path) as tmp:
        canvas.resize((canvas.width * 2, canvas.height * 2), Image.NEAREST).save(tmp, format="PNG")


# The independent parts of ``data/prepared/``: the user's real data first (the likeliest to be refused, so a bad
# input fails before the rendering), then longest first; each writes only its own subdirectory.
PARTS = ("real", "fusion", "videos", "train", "unaligned", "discovery", "heldout", "templates")


def _prepare_part(name: str, cfg: DataConfig, out: Path, progress: bool = True) -> dict[str, float]:
    """Write one part of the prepared directory under ``out``; returns its metrics. Faces are rendered from
    (seed, identity, index) alone, so the parts can run in any order or in parallel and give the same bytes."""
    gen = ProceduralFaces(cfg.procedural_config(aligned=True), seed=cfg.seed)
    n_train_imgs = cfg.images_per_identity - int(round(cfg.images_per_identity * cfg.val_fraction))
    heldout_first = cfg.train_identities
    discovery_first = heldout_first + cfg.heldout_identities
    video_first = discovery_first + cfg.discovery_identities
    if name == "heldout" and cfg.ingested:  # the held-out set is real; the procedural pairs stay as a reference
        per = cfg.heldout_images_per_identity
        samples = [gen.sample(ident, i) for ident in range(heldout_first, discovery_first) for i in range(per)]
        (out / "verification").mkdir(exist_ok=True)
        pairs = write_pairs_bin(out / "verification" / "procedural.bin", np.stack([s.image for s in samples]),
                                np.repeat(np.arange(cfg.heldout_identities), per), cfg.verification_pairs, cfg.seed,
                                landmarks=np.stack([s.landmarks for s in samples]))
        return {"data/verification_pairs": pairs}
    if name == "train":
        _procedural_split(out / "train", gen, range(cfg.train_identities), cfg.images_per_identity,
                          lambda i: "train" if i < n_train_imgs else "val", name="procedural-train", progress=progress)
        return {"data/train_images": cfg.train_identities * cfg.images_per_identity}
    if name == "heldout":
        images, labels, landmarks = _procedural_split(
            out / "heldout", gen, range(heldout_first, discovery_first), cfg.heldout_images_per_identity,
            lambda i: "gallery" if i < cfg.gallery_images_per_identity else "probe", name="procedural-heldout",
            progress=progress,
        )
        (out / "verification").mkdir(exist_ok=True)
        pairs = write_pairs_bin(out / "verification" / "procedural.bin", images, labels, cfg.verification_pairs,
                                cfg.seed, landmarks=landmarks)
        return {"data/heldout_images": len(labels), "data/verification_pairs": pairs}
    if name == "templates":
        return {"data/template_pairs": _template_set(out / "templates", gen, cfg, heldout_first, progress)}
    if name == "discovery":
        _procedural_split(out / "discovery", gen, range(discovery_first, video_first),
                          cfg.discovery_images_per_identity, lambda i: "train", name="procedural-discovery",
                          progress=progress)
        return {}
    if name == "real":
        return _ingest_real(out, cfg, progress)
    if name == "videos":
        return _video_set(out / "videos", gen, cfg, video_first, progress)
    if name == "fusion":
        return _fusion_set(out / "fusion", gen, cfg, progress)
    if name == "unaligned":
        first = video_first + cfg.video_identities + cfg.video_distractors
        return {"data/unaligned_images": _unaligned_set(out / "unaligned", cfg, first, progress)}
    raise ValueError(f"unknown prepare part {name!r}")


def _prepare_parts(cfg: DataConfig, out: Path, workers: int) -> dict[str, float]:
    """Every part of ``PARTS`` that the config asks for, in ``workers`` processes (in-process when 1)."""
    skip = {"train", "fusion"} if cfg.ingested else {"real"}  # ingested real faces replace the procedural training set
    if cfg.gfd_source == "real":
        skip.add("discovery")
    parts = [p for p in PARTS if p not in skip]
    workers = max(1, min(workers, len(parts)))
    metrics: dict[str, float] = {}
    if workers == 1:
        for name in parts:
            metrics.update(_prepare_part(name, cfg, out))
        return metrics
    # spawn: the parent may hold threads (tracking, BLAS) that a fork would copy mid-lock
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {pool.submit(_prepare_part, name, cfg, out, False): name for name in parts}
        with tqdm(total=len(parts), desc=f"prepare ({workers} processes)", unit="part") as bar:
            try:
                for future in as_completed(futures):
                    metrics.update(future.result())  # a part's error is raised here, naming its input
                    bar.set_postfix_str(futures[future])
                    bar.update()
            except BaseException:
                for future in futures:  # the parts not started yet are not rendered for nothing
                    future.cancel()
                raise
    return metrics


def run(cfg: DataConfig, paths: Paths, *, tracker: Any = None, workers: int | None = None) -> StageResult:
    """Write ``data/prepared/`` (atomically) with ``workers`` processes (default: the cores this stage has)."""
    _check_sources(cfg)
    result = StageResult("prepare")
    with atomic_path(paths.prepared) as tmp:
        tmp.mkdir()
        result.metrics.update(_prepare_parts(cfg, tmp, stage_cores() if workers is None else workers))
        result.metrics.update(write_gfd_split(tmp, cfg))
    gen = ProceduralFaces(cfg.procedural_config(aligned=True), seed=cfg.seed)
    sample_grid(gen, cfg, paths.plots / "samples.png")
    result.outputs += [paths.prepared, paths.plots / "samples.png"]
    m = result.metrics
    if cfg.ingested:
        faces = (f"real faces from {cfg.ingest_folder or cfg.ingest_recordio}: {m['data/real_train_images']:.0f} "
                 f"images of {m['data/real_train_identities']:.0f} training identities, "
                 f"{m['data/real_heldout_identities']:.0f} held-out identities, "
                 f"{m['data/real_verification_pairs']:.0f} real verification pairs "
                 f"({m['data/real_corrupt_skipped']:.0f} undecodable images skipped)")
    else:
        faces = (f"{cfg.train_identities} train identities × {cfg.images_per_identity} images, "
                 f"{cfg.heldout_identities} held-out identities, {m['data/verification_pairs']} verification pairs")
    result.summary = f"{faces}, {m['data/template_pairs']} template pairs → {paths.prepared}"
    return result


def main() -> None:
    from tasks.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("prepare", {"data": section(params, "data")}, paths.root) as tracker:
        result = run(cfg, paths, tracker=tracker)
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "samples.png", artifact_path="plots")
        tracker.log_prepared_datasets(paths.prepared)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main)
