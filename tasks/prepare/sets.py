"""The datasets of stage ``prepare`` (``tasks/prepare``), each written into its own directory by one function:
procedural identity sets, verification pairs (``.bin``), the IJB-style template set, the real faces ingested from
a folder or a RecordIO, the IJB-S-like video set, CAFace's fusion set, the unaligned crops for the aligner and the
GFD split. Each writes only its own directory, so ``tasks/prepare`` runs them in any order or in parallel.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm.auto import tqdm

from ml.data.procedural import FaceSample, ProceduralFaces
from ml.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

    from ml.data.dataset import DatasetWriter
    from tasks.prepare import DataConfig


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


def _add(writer: DatasetWriter, sample: FaceSample, identity: str, split: str, **extra: int) -> str:
    """Add a rendered ``sample`` (image, 5 landmarks, quality) to a ``DatasetWriter``; → its relative path."""
    return writer.add(sample.image, identity=identity, split=split, landmarks=sample.landmarks.reshape(-1),
                      quality=sample.quality, **extra)


def write_pairs_bin(
    path: Path, images: np.ndarray, labels: np.ndarray, n_pairs: int, seed: int, landmarks: np.ndarray | None = None
) -> int:
    """An InsightFace verification ``.bin``; with ``landmarks`` also ``<stem>.landmarks.npy`` (2P, 5, 2) beside it
    (the keypoints KP-RPE models need, in the same order as the ``.bin``'s images). Creates ``path``'s directory."""
    from ml.data.formats import write_verification_bin

    path.parent.mkdir(parents=True, exist_ok=True)
    pairs, issame = _sample_pairs(labels, n_pairs, np.random.default_rng(seed))
    order = pairs.reshape(-1)
    write_verification_bin(path, images[order], issame, image_format="jpg")
    if landmarks is not None:
        np.save(path.with_suffix(".landmarks.npy"), landmarks[order].astype(np.float32))
    return len(issame)


def procedural_split(
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
                _add(w, s, f"id{ident:06d}", split_of(i))
                images.append(s.image)
                labels.append(k)
                landmarks.append(s.landmarks)
    return np.stack(images), np.asarray(labels), np.stack(landmarks)


def _write_face_tid_mid(out: Path, rows: list[tuple[str, int, int]]) -> Path:
    """``meta/face_tid_mid.txt`` under ``out``, one ``img tid mid`` line per face (IJB's layout); → ``meta/``."""
    meta = out / "meta"
    meta.mkdir()
    (meta / "face_tid_mid.txt").write_text("".join(f"{p} {t} {m}\n" for p, t, m in rows))
    return meta


def template_set(
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
                        rel = _add(w, s, f"id{ident:06d}", "template", template=tid, media=media)
                        rows.append((rel, tid, media))
                tid_identity[tid] = ident
                tid += 1
                mid += 2
    meta = _write_face_tid_mid(out, rows)
    tids = sorted(tid_identity)
    lines = []
    for i, a in enumerate(tids):
        for b in tids[i + 1 :]:
            lines.append(f"{a} {b} {int(tid_identity[a] == tid_identity[b])}\n")
    (meta / "template_pair_label.txt").write_text("".join(lines))
    return len(lines)


def ingest_real(out: Path, cfg: DataConfig, progress: bool = True) -> dict[str, float]:
    """Stream the user's real faces into ``train/`` (training identities, split ``train``/``val``), ``heldout/``
    (held-out identities, ``gallery``/``probe``) and, when the GFD split covers real faces, ``discovery/``
    (discovery identities); then ``verification/real.bin`` over the held-out identities with ≥ 2 images."""
    from contextlib import ExitStack

    from ml.data.dataset import DatasetWriter
    from ml.data.ingest import IngestSpec, ingest_split

    spec = IngestSpec(folder=cfg.ingest_folder, recordio=cfg.ingest_recordio, image_size=cfg.image_size,
                      resize=cfg.ingest_resize, max_images=cfg.ingest_max_images, seed=cfg.seed,
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

        records = {}
        if spec.recordio:  # which record each face came from: training can read it there, not the shards
            from ml.data.records import RecordsWriter

            records = {g: RecordsWriter(w.tmp_dir, spec.recordio) for g, w in opened.items()}
            for rw in records.values():  # closed into each dataset before it is moved into place, else removed
                stack.callback(rw.abort)

        def writer(group: str):
            def add(img, identity, i, n, ref, encoded):
                rel = opened[group].add(img, identity=identity, split=split_of[group](i, n), encoded=encoded)
                if group in records:
                    records[group].add(rel, ref)
            return add

        stats = ingest_split(spec, {g: writer(g) for g in opened}, seed=cfg.seed,
                             heldout_fraction=cfg.real_heldout_fraction,
                             discovery_fraction=cfg.real_discovery_fraction, progress=progress)
        for rw in records.values():
            rw.close()
    stats["data/real_verification_pairs"] = _real_pairs_bin(out, cfg)
    return stats


def _real_pairs_bin(out: Path, cfg: DataConfig) -> int:
    """``verification/real.bin`` over the held-out real identities with ≥ 2 images (single-image identities give
    no genuine pair and are left out); only the images the pairs use are decoded."""
    import pyarrow.parquet as pq

    from ml.data.formats import write_verification_bin

    # only the columns the pairs need (the manifest was written just now, by this stage)
    manifest = pq.read_table(out / "heldout" / "manifest.parquet",
                             columns=["path", "identity", "label", "width", "height"]).to_pandas()
    multi = manifest[manifest.groupby("identity")["path"].transform("count") >= 2].reset_index(drop=True)
    if multi["identity"].nunique() < 2:
        raise DataError(f"the held-out real identities have {multi['identity'].nunique()} with ≥ 2 images: "
                        "verification pairs need at least 2; ingest more images per identity or raise "
                        "data.real_heldout_fraction")
    labels = multi["label"].to_numpy()
    pairs, issame = _sample_pairs(labels, min(cfg.verification_pairs, 20 * len(labels)),
                                  np.random.default_rng(cfg.seed))
    (out / "verification").mkdir(exist_ok=True)
    faces = _PairFaces(out / "heldout", multi, pairs.reshape(-1))
    write_verification_bin(out / "verification" / "real.bin", faces, issame, image_format="jpg")
    return len(issame)


class _PairFaces(Sequence):
    """The pairs' faces in ``.bin`` order (rows ``order`` of ``manifest``), decoded a chunk at a time as the ``.bin``
    writer reaches them; it keeps only their encoded bytes, so memory does not hold every decoded face twice over
    (6,000 faces at 112 px would be 230 MB)."""

    def __init__(self, root: Path, manifest: pd.DataFrame, order: np.ndarray, chunk: int = 256) -> None:
        self.root, self.manifest, self.order, self.chunk = root, manifest, order, chunk

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> np.ndarray:
        from ml.data.dataset import load_images

        return load_images(self.root, self.manifest.iloc[[int(self.order[i])]])[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        from ml.data.dataset import load_images

        for start in range(0, len(self.order), self.chunk):
            yield from load_images(self.root, self.manifest.iloc[self.order[start:start + self.chunk]])


def video_set(
    out: Path, gen: ProceduralFaces, cfg: DataConfig, first_identity: int, progress: bool = True
) -> dict[str, float]:
    """IJB-S-like set: per enrolled identity ``booking_stills`` gallery stills (media ``still``) and one long
    surveillance probe (``ml.data.surveillance.surveillance_sequence``: most frames heavily degraded, a short usable
    window); per distractor identity only a probe. Manifest: split ``gallery``/``probe``,
    ``template`` = the probe or gallery id, ``media`` = one id per video or still; ``meta/face_tid_mid.txt`` as IJB.
    A probe is mated when its identity has a gallery."""
    from ml.data.dataset import DatasetWriter
    from ml.data.surveillance import PROBE_SEQ_INDEX, surveillance_sequence

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
                    rel = _add(w, s, identity, "gallery", template=tid, media=mid)
                    rows.append((rel, tid, mid))
                    mid += 1
                tid += 1
            for s in surveillance_sequence(gen, ident, int(lengths[k]), seq_index=PROBE_SEQ_INDEX,
                                            cfg=surveillance):
                rel = _add(w, s, identity, "probe", template=tid, media=mid)
                rows.append((rel, tid, mid))
            tid += 1
            mid += 1
    _write_face_tid_mid(out, rows)
    return {"data/video_frames": int(lengths.sum()), "data/video_probes": n_ids,
            "data/video_max_frames": int(lengths.max())}


def fusion_set(out: Path, gen: ProceduralFaces, cfg: DataConfig, progress: bool = True) -> dict[str, float]:
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
                _add(w, s, identity, "clean")
            for copies in sets:
                for s in copies:
                    _add(w, s, identity, "degraded", template=source)
                source += 1
    return {"data/fusion_images": cfg.fusion_identities * (cfg.fusion_clean_images
                                                           + cfg.fusion_sources * cfg.fusion_copies)}


def unaligned_set(out: Path, cfg: DataConfig, first_identity: int, progress: bool = True) -> int:
    """Unaligned procedural crops (``data.unaligned_size``²) with their exact landmarks; the last
    ``unaligned_val_identities`` identities are split ``val``, the ``unaligned_test_identities`` before them
    ``test``, the rest ``train``."""
    from ml.data.dataset import DatasetWriter
    from ml.data.unaligned import unaligned_faces

    images, landmarks, identities = unaligned_faces(
        cfg.unaligned_identities, cfg.unaligned_images_per_identity, cfg.unaligned_size, cfg.seed,
        first_identity=first_identity, base=cfg.procedural_config(aligned=False), progress=progress,
    )
    first_val = first_identity + cfg.unaligned_identities - cfg.unaligned_val_identities
    first_test = first_val - cfg.unaligned_test_identities
    with DatasetWriter(out, name="unaligned", source="procedural", aligned=False) as w:
        for image, lm, ident in zip(images, landmarks, identities):
            split = "val" if ident >= first_val else "test" if ident >= first_test else "train"
            w.add(image, identity=f"id{ident:06d}", split=split, landmarks=lm.reshape(-1))
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
