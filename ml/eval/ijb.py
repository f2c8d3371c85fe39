"""IJB-B / IJB-C 1:1 template verification on the real release folders, for any FR backbone.

A set is ``meta/<prefix>_{face_tid_mid,template_pair_label,name_5pts_score}.txt`` (``ml.data.ijb_meta``) plus
``loose_crop/``, as InsightFace's ``ijb_11.py`` reads it; :func:`read_ijb_set` cross-checks it before anything is
embedded. Crops stream in batches, are aligned on their 5 landmarks at the model's input size (``ml.aligner.align``)
and embedded with flip TTA (``ml.fr.train.embed``); only the (N, D) float32 features are kept. Template ``t`` pools
its media ``m`` (a still or a video) of image features ``x_i`` with faceness scores ``s_i``:

    v_m = (1/|m|) Σ_{i∈m} s_i·x_i,        f_t = normalise( (1/M_t) Σ_{m∈t} v_m )

then ``ml.fusion.sets.template_verification`` scores the listed pairs by cosine: TAR at FAR 1e-5 … 1e-1.

Differences from the reference (``ijb_11.py``, mode N1D1F1: image norm kept, score weighting, flip test):
- Media vectors are averaged, not summed (same direction, same scores); only 1:1, not ``ijb_1n.py``'s 1:N search.
- Umeyama fit + ``grid_sample`` instead of skimage + ``cv2.warpAffine``: pixels may differ by about one grey level.
- Landmark rows are matched by image name, not by line order; an image listed twice is embedded once.
- TAR@FAR is the exact impostor order statistic, not an interpolated sklearn ROC (observed FAR 0 below 1/n_impostor).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ml.data.ijb_meta import read_landmark_scores, read_template_pairs, read_tid_mid
from ml.errors import DataError
from ml.eval.metrics import template_features
from ml.fusion.sets import index_pairs, template_verification
from ml.aligner.align import align_faces, transform_points
from ml.fr.backbones import input_contract
from ml.fr.train import embed

__all__ = [
    "IJB_FARS",
    "IJBSet",
    "align_crop",
    "find_ijb_folders",
    "ijb_image_features",
    "ijb_template_features",
    "ijb_verification",
    "load_ijb_sets",
    "read_ijb_set",
]

log = logging.getLogger(__name__)

IJB_FARS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # the columns of the IJB-B/C 1:1 tables
SET_FOLDERS = ("IJBB", "IJBC")  # the release's folder names, looked for under a parent folder
TID_MID, PAIRS, LANDMARKS = "_face_tid_mid.txt", "_template_pair_label.txt", "_name_5pts_score.txt"
CROP_DIR = "loose_crop"


@dataclass(frozen=True)
class IJBSet:
    """One IJB-B/C 1:1 protocol, read and cross-checked; images are kept as paths, never decoded here."""

    name: str  # the meta files' prefix: "ijbb", "ijbc"
    root: Path  # the folder holding meta/ and loose_crop/
    images: tuple[str, ...]  # (U,) distinct image paths under loose_crop/, in first-listed order
    landmarks: np.ndarray  # (U, 5, 2) float32 pixel x, y in each loose crop, ArcFace order
    scores: np.ndarray  # (U,) float32 faceness scores, ≥ 0
    image_index: np.ndarray  # (N,) int64: row of each face_tid_mid record in ``images``
    templates: np.ndarray  # (N,) int64 template id of each record
    media: np.ndarray  # (N,) int64 media id of each record
    pairs: np.ndarray  # (P, 2) int64 template ids
    labels: np.ndarray  # (P,) int8, 1 = same subject

    @property
    def crop_dir(self) -> Path:
        return self.root / CROP_DIR

    def meta(self, suffix: str) -> Path:
        """The meta file ``<name><suffix>``, e.g. ``meta(TID_MID)`` → ``meta/ijbb_face_tid_mid.txt``."""
        return self.root / "meta" / f"{self.name}{suffix}"


# ---------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------


def _line_of(path: Path, record: int) -> int:
    """1-based line number of the 0-based ``record``-th non-blank line of ``path`` (the readers skip blank lines)."""
    seen = -1
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            seen += bool(line.split())
            if seen == record:
                return number
    raise AssertionError(f"{path} has no record {record}")


def find_ijb_folders(folder: str | os.PathLike, what: str = "IJB folder") -> list[Path]:
    """The IJB-B/C folders under ``folder``: ``[folder]`` when it holds ``meta/`` itself, else its ``IJBB/`` and
    ``IJBC/`` subfolders (either or both). ``what`` names the setting in the messages."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{what}: {folder} is not a directory; point it at an IJB-B/C folder (meta/ + loose_crop/), "
                        "or at the folder holding IJBB/ and IJBC/, or set it to ''")
    if (folder / "meta").is_dir():
        return [folder]
    children = {p.name.upper(): p for p in folder.iterdir() if p.is_dir()}
    found = [children[name] for name in SET_FOLDERS if name in children]
    if not found:
        raise DataError(f"{what}: {folder} has no meta/ folder and no {' or '.join(SET_FOLDERS)} subfolder; point it "
                        f"at an IJB-B/C folder (meta/*{TID_MID}, meta/*{PAIRS}, meta/*{LANDMARKS}, {CROP_DIR}/) or at "
                        "the folder holding IJBB/ and IJBC/")
    return found


def _set_name(root: Path) -> str:
    """The prefix of ``meta/<prefix>_face_tid_mid.txt``, once the three meta files and loose_crop/ are found."""
    meta = root / "meta"
    if not meta.is_dir():
        raise DataError(f"{root} has no meta/ folder; an IJB-B/C folder holds meta/*{TID_MID}, meta/*{PAIRS}, "
                        f"meta/*{LANDMARKS} and {CROP_DIR}/ as the IJB release ships them")
    found = sorted(meta.glob(f"*{TID_MID}"))
    if len(found) > 1:
        raise DataError(f"{meta} holds {len(found)} *{TID_MID} files ({', '.join(p.name for p in found)}); keep one "
                        "protocol per folder (IJBB/ and IJBC/ side by side)")
    if not found:
        others = sorted(p.name for p in meta.glob("*.txt"))
        raise DataError(f"{meta} has no *{TID_MID} (e.g. ijbb{TID_MID}, lines 'img tid mid'); copy it from the IJB "
                        f"release's meta folder (it holds: {', '.join(others) or 'no .txt file'})")
    name = found[0].name[: -len(TID_MID)]
    if not name:
        raise DataError(f"{found[0]}: name it <set>{TID_MID} (e.g. ijbb{TID_MID}); the prefix names the set's metrics")
    missing = [f"{name}{s}" for s in (PAIRS, LANDMARKS) if not (meta / f"{name}{s}").is_file()]
    if missing:
        raise DataError(f"{meta} lacks {' and '.join(missing)} beside {found[0].name}; copy them from the IJB "
                        f"release's meta folder (lines 'tid1 tid2 label' and 'img x1 y1 … x5 y5 score')")
    if not (root / CROP_DIR).is_dir():
        raise DataError(f"{root} has no {CROP_DIR}/ folder; extract the release's loose crops there "
                        f"({CROP_DIR}/1.jpg, …, the names {found[0].name} lists)")
    return name


def _landmark_rows(path: Path, names: list[str], landmarks: np.ndarray) -> dict[str, int]:
    """Image name → its row in the landmark file; a name listed twice with different values is an error."""
    rows: dict[str, int] = {}
    for row, name in enumerate(names):
        first = rows.setdefault(name, row)
        if first != row and not np.array_equal(landmarks[first], landmarks[row]):
            raise DataError(f"{path}, lines {_line_of(path, first)} and {_line_of(path, row)}: image {name!r} is "
                            "listed twice with different landmarks; keep one row per image")
    return rows


def _missing_crops(crop_dir: Path, images: Sequence[str]) -> list[int]:
    """Indices of ``images`` with no file under ``crop_dir`` (one directory listing for flat names)."""
    present = {entry.name for entry in os.scandir(crop_dir)}
    return [i for i, p in enumerate(images)
            if not ((p in present) if "/" not in p else (crop_dir / p).is_file())]


def read_ijb_set(root: str | os.PathLike) -> IJBSet:
    """Read and cross-check the IJB-B/C protocol in ``root`` (``meta/`` + ``loose_crop/``); see the module docstring."""
    root = Path(root)
    name = _set_name(root)
    meta = root / "meta"
    tid_path, pair_path, lm_path = (meta / f"{name}{s}" for s in (TID_MID, PAIRS, LANDMARKS))
    table = read_tid_mid(tid_path)
    pairs, labels = read_template_pairs(pair_path)
    lm_names, lm_points, lm_scores = read_landmark_scores(lm_path)

    records = table["path"].tolist()
    images = list(dict.fromkeys(records))  # distinct, first-listed order
    position = {p: i for i, p in enumerate(images)}
    image_index = np.fromiter((position[p] for p in records), dtype=np.int64, count=len(records))

    def record_line(image: int) -> int:
        return _line_of(tid_path, int(np.flatnonzero(image_index == image)[0]))

    missing = _missing_crops(root / CROP_DIR, images)
    if missing:
        raise DataError(f"{len(missing)} of the {len(images)} images listed in {tid_path} are missing from "
                        f"{root / CROP_DIR}, e.g. {images[missing[0]]!r} (line {record_line(missing[0])}); extract the "
                        "release's loose crops there completely, or drop those lines")
    rows = _landmark_rows(lm_path, lm_names, lm_points)
    no_row = [i for i, p in enumerate(images) if p not in rows]
    if no_row:
        raise DataError(f"{len(no_row)} of the {len(images)} images listed in {tid_path} have no row in {lm_path}, "
                        f"e.g. {images[no_row[0]]!r} (line {record_line(no_row[0])}); add their 5 landmarks and "
                        "faceness score (lines 'img x1 y1 … x5 y5 score') or drop them from both files")
    take = np.array([rows[p] for p in images], dtype=np.int64)
    landmarks, scores = lm_points[take], lm_scores[take]
    negative = np.flatnonzero(scores < 0)
    if negative.size:
        k = int(take[negative[0]])
        raise DataError(f"{lm_path}, line {_line_of(lm_path, k)}: faceness score {lm_scores[k]} of {lm_names[k]!r} is "
                        f"negative ({negative.size} such images); scores weight the features and must be ≥ 0")
    flat = np.flatnonzero(np.ptp(landmarks, axis=1).max(axis=1) == 0)
    if flat.size:
        k = int(take[flat[0]])
        raise DataError(f"{lm_path}, line {_line_of(lm_path, k)}: the 5 landmarks of {lm_names[k]!r} coincide, so no "
                        f"alignment is defined ({flat.size} such images); fix or drop that row")

    templates = table["template"].to_numpy()
    known = np.unique(templates)
    unknown = np.flatnonzero(~np.isin(pairs, known).all(axis=1))
    if unknown.size:
        k = int(unknown[0])
        tid = int(pairs[k][~np.isin(pairs[k], known)][0])
        raise DataError(f"{pair_path}, line {_line_of(pair_path, k)}: template {tid} has no image in {tid_path} "
                        f"({unknown.size} pairs name such templates); use the face_tid_mid file of the same protocol, "
                        "or drop those pairs")
    n_gen = int(labels.sum())
    if n_gen == 0 or n_gen == len(labels):
        raise DataError(f"{pair_path}: {n_gen} genuine and {len(labels) - n_gen} impostor pairs; TAR@FAR needs both "
                        "(label 1 = same subject, 0 = different)")
    return IJBSet(name=name, root=root, images=tuple(images), landmarks=landmarks, scores=scores,
                  image_index=image_index, templates=templates, media=table["media"].to_numpy(), pairs=pairs,
                  labels=labels)


def load_ijb_sets(folder: str | os.PathLike, what: str = "IJB folder") -> list[IJBSet]:
    """``read_ijb_set`` of every folder ``find_ijb_folders`` finds; two sets with the same name are an error."""
    sets = [read_ijb_set(root) for root in find_ijb_folders(folder, what)]
    seen: dict[str, Path] = {}
    for s in sets:
        if s.name in seen:
            raise DataError(f"{what}: {s.root} and {seen[s.name]} both hold the set {s.name!r} (their meta file "
                            "prefix); each set's name is one table of the report, keep one of them")
        seen[s.name] = s.root
    return sets


# ---------------------------------------------------------------------------------------------------------
# images → features
# ---------------------------------------------------------------------------------------------------------


def align_crop(image: np.ndarray, landmarks: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Align one loose crop uint8 (H, W, 3) on its ``landmarks`` (5, 2) to the ArcFace template at ``size``:
    (aligned uint8 (size, size, 3), the landmarks in the aligned crop (5, 2) float32)."""
    image = np.require(image, dtype=np.uint8, requirements=["C", "W"])  # PIL's arrays are read-only
    x = torch.from_numpy(image).permute(2, 0, 1).unsqueeze(0).float()  # (1, 3, H, W)
    p = torch.from_numpy(np.asarray(landmarks, dtype=np.float32)).unsqueeze(0)  # (1, 5, 2)
    crop, m = align_faces(x, p, out_size=size)
    aligned = crop[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    return aligned, transform_points(p, m)[0].numpy()


def _load_aligned(ijb: IJBSet, image: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode image ``image`` of ``ijb`` as RGB and align it; DataError naming the file when it does not decode."""
    from PIL import Image

    path = ijb.crop_dir / ijb.images[image]
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        line = _line_of(ijb.meta(TID_MID), int(np.flatnonzero(ijb.image_index == image)[0]))
        raise DataError(f"{path}: cannot decode the image ({' '.join(str(exc).split())}), listed in "
                        f"{ijb.meta(TID_MID)} line {line}; copy it again from the IJB release") from exc
    return align_crop(rgb, ijb.landmarks[image], size)


def ijb_image_features(
    model: nn.Module,
    ijb: IJBSet,
    *,
    batch_size: int = 256,
    flip: bool = True,
    progress: bool = True,
    workers: int = 4,
) -> np.ndarray:
    """float32 (U, D) features of the distinct images of ``ijb``, in ``ijb.images`` order: each loose crop aligned
    to ``model``'s input size, then ``ml.fr.train.embed`` (``f(x) + f(flip x)`` when ``flip``, not normalised).
    Images are decoded ``batch_size`` at a time by ``workers`` threads, the next batch while this one embeds."""
    if batch_size < 1 or workers < 1:
        raise DataError(f"ijb_image_features: batch_size ({batch_size}) and workers ({workers}) must be ≥ 1")
    size = int(input_contract(model)["size"])
    n = len(ijb.images)
    starts = range(0, n, batch_size)
    out: np.ndarray | None = None
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ijb-decode") as pool, \
            tqdm(total=n, unit="img", desc=f"{ijb.name}: embed", disable=not progress) as bar:

        def submit(start: int) -> list[Future]:
            return [pool.submit(_load_aligned, ijb, i, size) for i in range(start, min(start + batch_size, n))]

        ahead = submit(0) if n else []
        try:
            for start in starts:
                batch, ahead = ahead, (submit(start + batch_size) if start + batch_size < n else [])
                loaded = [f.result() for f in batch]
                crops = np.stack([c for c, _ in loaded])  # (B, size, size, 3) uint8
                keypoints = np.stack([k for _, k in loaded])  # (B, 5, 2), read by KP-RPE models only
                feats = embed(model, crops, batch_size=batch_size, flip=flip, keypoints=keypoints)
                if out is None:
                    out = np.empty((n, feats.shape[1]), dtype=np.float32)
                out[start:start + len(feats)] = feats
                bar.update(len(feats))
        finally:
            for f in ahead:
                f.cancel()
    if out is None:
        raise DataError(f"{ijb.meta(TID_MID)} lists no image")
    return out


# ---------------------------------------------------------------------------------------------------------
# templates and verification
# ---------------------------------------------------------------------------------------------------------


def ijb_template_features(
    features: np.ndarray, scores: np.ndarray, templates: np.ndarray, media: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Faceness-weighted IJB pooling: ``v_m = mean_{i∈m} s_i·x_i``, ``f_t = normalise(mean_{m∈t} v_m)``.

    ``features`` (N, D) image features (norms kept, as the reference's default), ``scores`` (N,) faceness ≥ 0,
    ``templates`` and ``media`` (N,) ids; a media id is scoped to its template. Returns (sorted template ids (T,),
    unit template features (T, D) float32). The pooling is ``ml.eval.metrics.template_features`` with the scores as
    weights; this checks the IJB inputs and names the faceness scores in its errors. Source: InsightFace
    ``ijb_11.py`` (``image2template_feature`` after ``img_feats * faceness_scores``); Whitelam et al. 2017, Maze et
    al. 2018 (IJB-B/C 1:1 protocols).
    """
    features = np.asarray(features)
    n = len(features)
    if features.ndim != 2 or features.size == 0 or not np.issubdtype(features.dtype, np.floating):
        raise DataError(f"features must be float (N, D) with N, D ≥ 1, got {features.dtype} {features.shape}")
    scores = np.asarray(scores, dtype=np.float64)
    templates, media = np.asarray(templates), np.asarray(media)
    for what, arr in (("scores", scores), ("templates", templates), ("media", media)):
        if arr.shape != (n,):
            raise DataError(f"{what} must have one entry per image, shape ({n},), got {arr.shape}")
    if not np.isfinite(scores).all() or (scores < 0).any():
        bad = int(np.flatnonzero(~(np.isfinite(scores) & (scores >= 0)))[0])
        raise DataError(f"faceness score {scores[bad]} of image {bad} must be finite and ≥ 0")
    bad = np.flatnonzero(~np.isfinite(features).all(axis=1))
    if bad.size:
        raise DataError(f"feature of image {int(bad[0])} is not finite ({bad.size} such images); check the model")

    ids, pooled = template_features(features, templates, media, weights=scores, normalize_items=False,
                                    normalize=False)  # (T,), (T, D) float64
    norms = np.linalg.norm(pooled, axis=1)
    zero = np.flatnonzero(norms <= 1e-12)
    if zero.size:
        raise DataError(f"template {ids[int(zero[0])]} fuses to a zero vector ({zero.size} such templates): all "
                        "its images have faceness score 0, or their features cancel; check its images' scores")
    return ids, (pooled / norms[:, None]).astype(np.float32)


def ijb_verification(
    model: nn.Module,
    ijb: IJBSet,
    *,
    fars: Sequence[float] = IJB_FARS,
    batch_size: int = 256,
    flip: bool = True,
    progress: bool = True,
) -> dict[str, float]:
    """IJB-B/C 1:1 verification of ``model`` on ``ijb``: ``tar@far=1e-5``-style keys (one per ``fars``), plus
    ``pairs``, ``impostor_pairs``, ``images`` (distinct images embedded) and ``templates``."""
    feats = ijb_image_features(model, ijb, batch_size=batch_size, flip=flip, progress=progress)
    same = len(ijb.image_index) == len(feats) and np.array_equal(ijb.image_index, np.arange(len(feats)))
    per_record = feats if same else feats[ijb.image_index]  # (N, D); a copy only when images repeat
    ids, templates = ijb_template_features(per_record, ijb.scores[ijb.image_index], ijb.templates, ijb.media)
    result = template_verification(templates, index_pairs(ijb.pairs, ids), ijb.labels, fars)
    metrics = {k: v for k, v in result.items() if k.startswith("tar@far=")}
    metrics.update(pairs=float(len(ijb.labels)), impostor_pairs=result["n_impostor"], images=float(len(ijb.images)),
                   templates=float(len(ids)))
    log.info("%s: %d images, %d templates, %d pairs: %s", ijb.name, len(ijb.images), len(ids), len(ijb.labels),
             ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("tar@")))
    return metrics
