"""Stage ``prepare``: build every dataset the pipeline reads, under ``data/prepared/``.

``train/`` and ``heldout/`` (training and never-trained identities), ``verification/procedural.bin`` (pairs of
held-out faces), ``templates/`` (IJB-style, with ``meta/``), ``discovery/`` and ``gfd/`` (FaceGCD's GFD split),
``videos/`` (IJB-S-like probes), ``fusion/`` (CAFace's sets) and ``unaligned/`` (the DFA aligner's crops with exact
landmarks), each written by one function of ``tasks/prepare/sets.py``. With real faces ingested
(``data.ingest_folder`` or ``data.ingest_recordio``) their identities are split by seed into disjoint training,
held-out and discovery groups that take the procedural ones' places (``train/``, ``heldout/`` +
``verification/real.bin`` and, when the GFD split covers real faces, ``discovery/``; ``fusion/`` is not written);
templates, videos and unaligned crops stay procedural, and a RecordIO's faces are recorded by key
(``records.parquet``) so that ``train_fr`` can read them in place (``data.train_reader``).

The directory is written to a temporary sibling and renamed on success; its parts are independent and written by as
many processes as the stage has cores (same bytes whatever the count). This module holds the ``data`` section
(``DataConfig``), the checks of the real-data sources, the sample grid and the run over the parts.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ml.atomic import atomic_path
from ml.config import from_mapping
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.data.surveillance import SurveillanceConfig
from ml.errors import ConfigError, DataError
from tasks.common import (
    Paths, StageResult, load_params, section, single_threaded_children, stage_cores, stage_main,
)
from tasks.prepare.sets import (
    fusion_set, ingest_real, procedural_split, template_set, unaligned_set, video_set, write_gfd_split, write_pairs_bin,
)

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
    # workers), png (the dataset's own shards), auto (recordio when the faces came from a RecordIO)
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
    unaligned_val_identities: int = 0  # and identities for choosing its epoch and recipe (split "val", the last ones)
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
            "unaligned_val_identities": 0 <= self.unaligned_val_identities
            < self.unaligned_identities - self.unaligned_test_identities,
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


def ingested_grid(dataset: Path, path: Path, rows: int = 6, cols: int = 8) -> None:
    """A PNG of ingested faces: one row per training identity (the first ``rows``), up to ``cols`` images each,
    with their landmarks where the source had them."""
    import pandas as pd
    from PIL import Image, ImageDraw

    from ml.data.dataset import landmarks_array, load_images, read_manifest

    manifest = read_manifest(dataset / "manifest.parquet")
    chosen = manifest[manifest["identity"].isin(manifest["identity"].drop_duplicates().head(rows))]
    chosen = chosen.groupby("identity", sort=False).head(cols).reset_index(drop=True)
    images, points = load_images(dataset, chosen), landmarks_array(chosen)
    size, pad = images.shape[1], 2
    canvas = Image.new("RGB", (cols * (size + pad) + pad, rows * (size + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    grid_rows = pd.factorize(chosen["identity"])[0]  # identities in order of first appearance
    grid_cols = chosen.groupby("identity", sort=False).cumcount().to_numpy()
    for image, marks, r, c in zip(images, points, grid_rows, grid_cols):
        x0, y0 = pad + c * (size + pad), pad + r * (size + pad)
        canvas.paste(Image.fromarray(image), (x0, y0))
        for x, y in marks[~np.isnan(marks).any(axis=1)]:
            draw.ellipse((x0 + x - 1, y0 + y - 1, x0 + x + 1, y0 + y + 1), fill=(255, 0, 0))
    with atomic_path(path) as tmp:
        canvas.save(tmp, format="PNG")


# The independent parts of ``data/prepared/``: the user's real data first (the likeliest to be refused, so a bad
# input fails before the rendering), then longest first; each writes only its own subdirectory.
PARTS = ("real", "fusion", "videos", "train", "unaligned", "discovery", "heldout", "templates")


def procedural_identities(cfg: DataConfig) -> dict[str, range]:
    """The identities each procedural part of ``data/prepared/`` renders, all with procedural seed ``cfg.seed``
    (``templates`` are drawn from the held-out identities). The one layout ``_prepare_part`` renders, and what the
    claims experiments' test sets are checked disjoint from (``experiments.test_sets.shared_faces``)."""
    from ml.data.surveillance import FUSION_FIRST_IDENTITY

    heldout = cfg.train_identities
    discovery = heldout + cfg.heldout_identities
    videos = discovery + cfg.discovery_identities
    unaligned = videos + cfg.video_identities + cfg.video_distractors
    return {"train": range(cfg.train_identities), "heldout": range(heldout, discovery),
            "templates": range(heldout, heldout + cfg.template_identities), "discovery": range(discovery, videos),
            "videos": range(videos, unaligned), "unaligned": range(unaligned, unaligned + cfg.unaligned_identities),
            "fusion": range(FUSION_FIRST_IDENTITY, FUSION_FIRST_IDENTITY + cfg.fusion_identities)}


def _prepare_part(name: str, cfg: DataConfig, out: Path, progress: bool = True) -> dict[str, float]:
    """Write one part of the prepared directory under ``out``; returns its metrics. Faces are rendered from
    (seed, identity, index) alone, so the parts can run in any order or in parallel and give the same bytes."""
    gen = ProceduralFaces(cfg.procedural_config(aligned=True), seed=cfg.seed)
    n_train_imgs = cfg.images_per_identity - int(round(cfg.images_per_identity * cfg.val_fraction))
    ids = procedural_identities(cfg)
    if name == "heldout" and cfg.ingested:  # the held-out set is real; the procedural pairs stay as a reference
        per = cfg.heldout_images_per_identity
        samples = [gen.sample(ident, i) for ident in ids["heldout"] for i in range(per)]
        pairs = write_pairs_bin(out / "verification" / "procedural.bin", np.stack([s.image for s in samples]),
                                np.repeat(np.arange(cfg.heldout_identities), per), cfg.verification_pairs, cfg.seed,
                                landmarks=np.stack([s.landmarks for s in samples]))
        return {"data/verification_pairs": pairs}
    if name == "train":
        procedural_split(out / "train", gen, ids["train"], cfg.images_per_identity,
                         lambda i: "train" if i < n_train_imgs else "val", name="procedural-train", progress=progress)
        return {"data/train_images": cfg.train_identities * cfg.images_per_identity}
    if name == "heldout":
        images, labels, landmarks = procedural_split(
            out / "heldout", gen, ids["heldout"], cfg.heldout_images_per_identity,
            lambda i: "gallery" if i < cfg.gallery_images_per_identity else "probe", name="procedural-heldout",
            progress=progress,
        )
        pairs = write_pairs_bin(out / "verification" / "procedural.bin", images, labels, cfg.verification_pairs,
                                cfg.seed, landmarks=landmarks)
        return {"data/heldout_images": len(labels), "data/verification_pairs": pairs}
    if name == "templates":
        return {"data/template_pairs": template_set(out / "templates", gen, cfg, ids["templates"].start, progress)}
    if name == "discovery":
        procedural_split(out / "discovery", gen, ids["discovery"],
                         cfg.discovery_images_per_identity, lambda i: "train", name="procedural-discovery",
                         progress=progress)
        return {}
    if name == "real":
        return ingest_real(out, cfg, progress)
    if name == "videos":
        return video_set(out / "videos", gen, cfg, ids["videos"].start, progress)
    if name == "fusion":
        return fusion_set(out / "fusion", gen, cfg, progress)
    if name == "unaligned":
        return {"data/unaligned_images": unaligned_set(out / "unaligned", cfg, ids["unaligned"].start, progress)}
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
    # spawn: the parent may hold threads (tracking, BLAS) that a fork would copy mid-lock. One thread each: the
    # processes are the parallelism, and a part's bits must not depend on how many cores the stage had.
    context = multiprocessing.get_context("spawn")
    with single_threaded_children(), ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
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
    if cfg.ingested:  # the faces the FR model trains on are the user's: show those
        ingested_grid(paths.train_set, paths.plots / "samples.png")
    else:
        sample_grid(ProceduralFaces(cfg.procedural_config(aligned=True), seed=cfg.seed), cfg,
                    paths.plots / "samples.png")
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
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    cfg = from_mapping(DataConfig, section(params, "data"), "data")
    with stage_run("prepare", {"data": section(params, "data")}, paths.root) as tracker:
        result = run(cfg, paths, tracker=tracker)
        tracker.log_metrics(result.metrics)
        tracker.log_artifact(paths.plots / "samples.png", artifact_path="plots")
        tracker.log_prepared_datasets(paths.prepared)
    log.info(result.summary)
