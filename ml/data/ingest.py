"""Ingest a user's real aligned faces (an ``<identity>/<image>`` folder or an InsightFace RecordIO) as prepared
datasets, streaming.

The items (a file path or a record key, and its identity) are listed first, without decoding an image; the
identities are split by seed into training, held-out and discovery groups (disjoint); then the images are decoded
one at a time and written to their group's dataset. Memory holds the item list and the manifest rows (about 1.6 KB
per image, ``benchmarks/bench_ingest.py``), never the images.

Bad input: an image that does not decode is skipped with its file or record named in the log, and the ingest fails
when more than ``max_corrupt_fraction`` of the images are skipped; a non-square face is refused (aligned faces are
square crops); a face of another size is resized only when ``resize`` allows it; an identity with one image is kept
for training and counted; image labels that disagree with the RecordIO's identity records are refused.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ml.errors import ConfigError, DataError

log = logging.getLogger(__name__)

GROUPS = ("train", "heldout", "discovery")


@dataclass(frozen=True)
class IngestSpec:
    """Where the real faces are and how to take them in."""

    folder: str = ""
    recordio: str = ""
    image_size: int = 64
    resize: bool = True                # faces of another (square) size are resized to image_size; False refuses them
    max_images: int = 0                # the first N images in file order (0 = all)
    max_corrupt_fraction: float = 0.01  # undecodable images skipped up to this share of the set, then the ingest fails

    @property
    def source(self) -> str:
        return self.folder or self.recordio

    def __post_init__(self) -> None:
        if bool(self.folder) == bool(self.recordio):
            raise ConfigError("set exactly one of 'data.ingest_folder' and 'data.ingest_recordio'.")
        if not 0.0 <= self.max_corrupt_fraction < 1.0:
            raise ConfigError(f"params key 'data.ingest_max_corrupt_fraction' = {self.max_corrupt_fraction!r} "
                              "is out of range [0, 1).")


@dataclass(frozen=True)
class Item:
    ref: Path | int      # image file, or RecordIO image key
    identity: str


def list_items(spec: IngestSpec) -> list[Item]:
    """Every image of the source with its identity, in file order (the first ``max_images``); decodes nothing."""
    from ml.data.formats import RecordIOReader, ingest_image_folder

    items: list[Item] = []
    if spec.folder:
        items = [Item(path, identity) for path, identity in ingest_image_folder(Path(spec.folder))]
    else:
        with RecordIOReader(Path(spec.recordio)) as reader:
            labels = {}
            for key in reader.image_keys:  # reads each record (no decoding): a cut or corrupt file is named here
                header, _ = reader.read_record(key)
                labels[key] = int(header.label[0] if header.flag > 0 else header.label)
            if reader.header0 is not None:
                _check_identity_ranges(reader, labels)
            items = [Item(key, f"{label:06d}") for key, label in labels.items()]
    if spec.max_images:
        items = items[: spec.max_images]
    if not items:
        raise DataError(f"{spec.source}: no face images to ingest")
    return items


def _check_identity_ranges(reader, labels: dict[int, int]) -> None:
    """InsightFace layout: identity record ``first + i`` announces the key range of one identity's images; every
    image in it must carry the same label, and no label may span two ranges."""
    first = reader.header0[0]
    owner: dict[int, int] = {}  # label → identity record that holds it
    for identity in range(reader.num_identities or 0):
        start, end = reader.identity_range(identity)
        for key in range(start, end):
            if key not in labels:
                raise DataError(f"{reader.rec_path}: identity record {first + identity} announces images {start}.."
                                f"{end - 1}, but key {key} is not an image record (record 0 announces 1..{first - 1});"
                                " the header's label ranges disagree with the records: rebuild the RecordIO")
            if labels[key] != labels[start] or owner.setdefault(labels[key], identity) != identity:
                raise DataError(f"{reader.rec_path}: record {key} has label {labels[key]} but identity record "
                                f"{first + identity} puts it in the range {start}..{end - 1} of label "
                                f"{labels[start]}; the header's label ranges disagree with the records: rebuild the "
                                "RecordIO")


def split_identities(identities: list[str], *, seed: int, heldout_fraction: float,
                     discovery_fraction: float) -> dict[str, str]:
    """identity → ``train`` | ``heldout`` | ``discovery``: a seeded permutation of the sorted names, cut by the
    fractions (each non-zero group gets ≥ 2 identities, training keeps ≥ 2)."""
    names = sorted(set(identities))
    n = len(names)

    def count(fraction: float) -> int:
        return 0 if fraction <= 0 else max(2, int(round(n * fraction)))

    n_held, n_disc = count(heldout_fraction), count(discovery_fraction)
    if n - n_held - n_disc < 2:
        raise DataError(
            f"the real set has {n} identities: too few to split into ≥ 2 training identities, {n_held} held-out and "
            f"{n_disc} discovery identities; ingest more identities or lower 'data.real_heldout_fraction' / "
            "'data.real_discovery_fraction'")
    order = np.random.default_rng(seed + 29).permutation(n)
    groups = ["heldout"] * n_held + ["discovery"] * n_disc + ["train"] * (n - n_held - n_disc)
    return {names[i]: g for i, g in zip(order, groups)}


def _resized(img: np.ndarray, spec: IngestSpec, where: str) -> np.ndarray:
    return resize_face(img, spec.image_size, spec.resize, where)


def resize_face(img: np.ndarray, size: int, resize: bool, where: str) -> np.ndarray:
    """A square face at ``size``² (bicubic when it is another size and ``resize`` allows it); DataError naming
    ``where`` for a non-square face, or one of another size when ``resize`` is false."""
    from PIL import Image

    if img.shape[0] != img.shape[1]:  # aligned faces are square crops: resizing would distort the face
        raise DataError(f"{where}: image is {img.shape[0]}x{img.shape[1]} (HxW), not square; real faces are "
                        "ingested as aligned square crops (e.g. 112x112), re-align or crop it")
    if img.shape[:2] == (size, size):
        return img
    if not resize:
        raise DataError(f"{where}: image is {img.shape[0]}x{img.shape[1]}, not data.image_size {size}x{size}; "
                        "set data.ingest_resize: true to resize it, or data.image_size to the faces' size")
    return np.array(Image.fromarray(img).resize((size, size), Image.BICUBIC))  # writable (asarray is not)


def decoded(spec: IngestSpec, items: list[Item], skipped: list[str], *,
            progress: bool = True) -> Iterator[tuple[Item, np.ndarray]]:
    """``(item, RGB uint8 image at image_size)`` in item order; an undecodable image is skipped and its reason
    appended to ``skipped``, and a share above ``max_corrupt_fraction`` raises naming the first of them."""
    from tqdm.auto import tqdm

    from ml.data.formats import RecordIOReader, decode_image, unpack_irheader

    reader = None if spec.folder else RecordIOReader(Path(spec.recordio), rgb_only=True)
    try:
        for item in tqdm(items, desc="ingest real", unit="img", leave=False, disable=not progress):
            if reader is None:
                where, data = str(item.ref), Path(item.ref).read_bytes()
            else:
                where = f"{reader.rec_path}: record {item.ref}"
                _, data = unpack_irheader(reader.read_raw(int(item.ref)), source=where)
            try:
                image = decode_image(data, source=where, rgb_only=True)
            except DataError as exc:
                skipped.append(str(exc))
                log.warning("skipped: %s", exc)
                if len(skipped) > spec.max_corrupt_fraction * len(items):
                    raise DataError(f"{len(skipped)} of {len(items)} images could not be ingested (above "
                                    f"data.ingest_max_corrupt_fraction = {spec.max_corrupt_fraction}); the first: "
                                    f"{skipped[0]}") from exc
                continue
            yield item, _resized(image, spec, where)
    finally:
        if reader is not None:
            reader.close()


def ingest_split(
    spec: IngestSpec, writers: dict[str, Callable[[np.ndarray, str, int, int, Path | int], None]], *, seed: int,
    heldout_fraction: float, discovery_fraction: float, progress: bool = True,
) -> dict[str, float]:
    """Stream the source's faces to ``writers[group](image, identity, index within identity, images of identity,
    item ref)`` (the ref: the image file, or the RecordIO key the face was read from);
    a group without a writer (``discovery`` when no GFD set is drawn from the real faces) takes no identities.
    Returns counts: images per group, identities, single-image identities, corrupt images skipped."""
    items = list_items(spec)
    groups = split_identities([it.identity for it in items], seed=seed, heldout_fraction=heldout_fraction,
                              discovery_fraction=discovery_fraction if "discovery" in writers else 0.0)
    per_identity = Counter(it.identity for it in items)
    seen: Counter[str] = Counter()
    written: Counter[str] = Counter()
    skipped: list[str] = []
    for item, image in decoded(spec, items, skipped, progress=progress):
        group = groups[item.identity]
        writers[group](image, item.identity, seen[item.identity], per_identity[item.identity], item.ref)
        seen[item.identity] += 1
        written[group] += 1
    stats: dict[str, float] = {f"data/real_{g}_images": float(written[g]) for g in GROUPS if g in writers}
    stats.update({
        "data/real_images": float(sum(written.values())),
        "data/real_identities": float(len(per_identity)),
        "data/real_train_identities": float(sum(g == "train" for g in groups.values())),
        "data/real_heldout_identities": float(sum(g == "heldout" for g in groups.values())),
        "data/real_single_image_identities": float(sum(n == 1 for n in per_identity.values())),
        "data/real_corrupt_skipped": float(len(skipped)),
    })
    return stats
