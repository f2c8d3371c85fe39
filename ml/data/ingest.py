"""Ingest a user's real aligned faces (an ``<identity>/<image>`` folder or an InsightFace RecordIO) as prepared
datasets, streaming.

The items (a file path or a record key, and its identity) are listed first, without decoding an image; the
identities are split by seed into training, held-out and discovery groups (disjoint); then the images are decoded
one at a time and written to their group's dataset: a JPEG or PNG face already at ``image_size`` keeps its bytes (it
is decoded only to be checked), one of another size is resized and stored as a PNG. Memory holds the items by column
(:class:`Items`: an identity code and a record key or file name per image; ``DatasetWriter`` spills each image's
manifest values to disk), never the images nor an object per image (``benchmarks/bench_ingest.py``).

Bad input: an image that does not decode is skipped with its file or record named in the log, and the ingest fails
when more than ``max_corrupt_fraction`` of the images are skipped; a non-square face is refused (aligned faces are
square crops); a face of another size is resized only when ``resize`` allows it; an identity with one image is kept
for training and counted; image labels that disagree with the RecordIO's identity records are refused.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
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
    max_images: int = 0                # at most N images, spread over the identities (``cap_items``; 0 = all)
    seed: int = 0                      # which identities and images a cap keeps
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


class Items(Sequence[Item]):
    """A source's images by column, a few bytes each: an identity code per image (``identities[code]`` is its
    name) and the refs, RecordIO keys (int64) or file names under ``<folder>/<identity>/``; an :class:`Item` is
    made when one is read."""

    def __init__(self, identities: list[str], codes: np.ndarray, *, keys: np.ndarray | None = None,
                 folder: Path | None = None, files: list[str] | None = None):
        if (keys is None) == (files is None) or (files is not None and folder is None):
            raise ValueError("Items takes either RecordIO keys, or a folder and its file names")
        self.identities, self.codes, self.keys, self.folder, self.files = identities, codes, keys, folder, files

    def __len__(self) -> int:
        return len(self.codes)

    def _item(self, code: int, i: int) -> Item:
        identity = self.identities[code]
        if self.keys is not None:
            return Item(int(self.keys[i]), identity)
        return Item(self.folder / identity / self.files[i], identity)

    def __getitem__(self, index: int | slice) -> Item | Items:  # type: ignore[override]
        if isinstance(index, slice):
            return Items(self.identities, self.codes[index], folder=self.folder,
                         keys=None if self.keys is None else self.keys[index],
                         files=None if self.files is None else self.files[index])
        i = range(len(self))[index]  # negative indices, IndexError
        return self._item(int(self.codes[i]), i)

    def take(self, indices: np.ndarray) -> Items:
        """The items at ``indices`` (in that order), the identity names unchanged."""
        return Items(self.identities, self.codes[indices], folder=self.folder,
                     keys=None if self.keys is None else self.keys[indices],
                     files=None if self.files is None else [self.files[i] for i in indices.tolist()])

    def __iter__(self) -> Iterator[Item]:
        for i, code in enumerate(self.codes):
            yield self._item(int(code), i)


def list_items(spec: IngestSpec) -> Items:
    """Every image of the source with its identity, in file order (at most ``max_images``, spread over the
    identities by ``cap_items``); decodes nothing."""
    from ml.data.formats import RecordIOReader, ingest_image_folder

    if spec.folder:
        folder = Path(spec.folder)
        codes: dict[str, int] = {}
        files: list[str] = []
        code_of = array("i")
        listed = ingest_image_folder(folder)
        for path, identity in listed:
            code = codes.get(identity)
            if code is None:
                code = codes[identity] = len(codes)
                assert path == folder / identity / path.name, (path, identity)  # <identity>/<image>
            code_of.append(code)
            files.append(path.name)
        del listed
        items = Items(list(codes), np.frombuffer(code_of, dtype=np.intc), folder=folder, files=files)
    else:
        with RecordIOReader(Path(spec.recordio)) as reader:
            keys = np.array(reader.image_keys, dtype=np.int64)
            labels = np.empty(len(keys), dtype=np.int64)
            for i, key in enumerate(keys.tolist()):  # reads each record (no decoding): a cut or corrupt file is named
                header, _ = reader.read_record(key)
                labels[i] = int(header.label[0] if header.flag > 0 else header.label)
            if reader.header0 is not None:
                _check_identity_ranges(reader, keys, labels)
        values, code_of = np.unique(labels, return_inverse=True)
        items = Items([f"{label:06d}" for label in values.tolist()], code_of.astype(np.intc), keys=keys)
    if not len(items):
        raise DataError(f"{spec.source}: no face images to ingest")
    if spec.max_images and len(items) > spec.max_images:
        kept = cap_items(items.codes, spec.max_images, spec.seed)
        log.info("%s: data.ingest_max_images = %d keeps %d images of %d identities (at most %d each) of its %d "
                 "images of %d identities", spec.source, spec.max_images, len(kept),
                 len(np.unique(items.codes[kept])), int(np.bincount(items.codes[kept]).max()), len(items),
                 len(items.identities))
        items = items.take(kept)
    return items


MIN_CAPPED_IMAGES = 4  # a capped identity keeps at least this many images (or all it has): pairs, a val image


def cap_items(codes: np.ndarray, max_images: int, seed: int) -> np.ndarray:
    """Sorted indices of at most ``max_images`` items spread over the identities (``codes``: one identity code per
    item), seeded. Every identity keeps ``min(n_i, c)`` images for the largest per-identity cap ``c`` that fits
    (water-filling, so no identity order of the source, such as a RecordIO's, decides who is kept); where ``c``
    would fall below ``MIN_CAPPED_IMAGES``, a seeded subset of the identities keeps that many each instead. Which
    of an identity's images are kept is a seeded draw."""
    if max_images < 1:
        raise ConfigError(f"max_images = {max_images}: need ≥ 1 (0 means no cap and does not call this)")
    codes = np.asarray(codes)
    rng = np.random.default_rng(seed + 83)
    counts = np.bincount(codes)
    present = np.flatnonzero(counts)
    if counts.sum() <= max_images:
        return np.arange(len(codes))
    low, high = 0, int(counts.max())  # largest c with Σ min(n_i, c) ≤ max_images
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if np.minimum(counts, mid).sum() <= max_images else (low, mid - 1)
    cap = np.zeros_like(counts)
    if low >= MIN_CAPPED_IMAGES:
        cap[present] = np.minimum(counts[present], low)
    else:
        budget = max_images
        for identity in rng.permutation(present):
            take = min(int(counts[identity]), MIN_CAPPED_IMAGES, budget)
            cap[identity], budget = take, budget - take
            if budget == 0:
                break
    order = np.argsort(codes, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    kept = [order[starts[i] + np.sort(rng.choice(counts[i], size=cap[i], replace=False))]
            for i in np.flatnonzero(cap)]
    return np.sort(np.concatenate(kept))


def _check_identity_ranges(reader, keys: np.ndarray, labels: np.ndarray) -> None:
    """InsightFace layout: identity record ``first + i`` announces the key range of one identity's images; every
    image in it must carry the same label, and no label may span two ranges. ``labels[j]`` is image key
    ``keys[j]``; with record 0's header the image keys are ``1..first - 1``."""
    first = reader.header0[0]
    assert np.array_equal(keys, np.arange(1, first)), "RecordIOReader lists keys 1..first-1 under record 0's header"
    owner: dict[int, int] = {}  # label → identity record that holds it

    def not_an_image(identity: int, start: int, end: int, key: int) -> DataError:
        return DataError(f"{reader.rec_path}: identity record {first + identity} announces images {start}..{end - 1}, "
                         f"but key {key} is not an image record (record 0 announces 1..{first - 1}); the header's "
                         "label ranges disagree with the records: rebuild the RecordIO")

    for identity in range(reader.num_identities or 0):
        start, end = reader.identity_range(identity)
        if start >= end:
            continue
        if start < 1:
            raise not_an_image(identity, start, end, start)
        held = labels[start - 1:min(end, first) - 1]  # the images of the range, in key order
        if len(held):
            label = int(held[0])
            wrong = np.flatnonzero(held != label)
            key = start if owner.setdefault(label, identity) != identity else (
                start + int(wrong[0]) if len(wrong) else None)
            if key is not None:
                raise DataError(f"{reader.rec_path}: record {key} has label {int(labels[key - 1])} but identity "
                                f"record {first + identity} puts it in the range {start}..{end - 1} of label "
                                f"{label}; the header's label ranges disagree with the records: rebuild the RecordIO")
        if end > first:
            raise not_an_image(identity, start, end, max(start, first))


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


def decoded(spec: IngestSpec, items: Sequence[Item], skipped: list[str], *,
            progress: bool = True) -> Iterator[tuple[Item, np.ndarray]]:
    """``(item, RGB uint8 image at image_size)`` in item order; an undecodable image is skipped and its reason
    appended to ``skipped``, and a share above ``max_corrupt_fraction`` raises naming the first of them."""
    for _, item, image, _ in _decoded(spec, items, skipped, progress=progress):
        yield item, image


def _decoded(spec: IngestSpec, items: Sequence[Item], skipped: list[str], *,
             progress: bool) -> Iterator[tuple[int, Item, np.ndarray, bytes | None]]:
    """:func:`decoded` with each item's position in ``items`` and, when the face needed no resize, the bytes it was
    decoded from (None when it was resized)."""
    from tqdm.auto import tqdm

    from ml.data.formats import RecordIOReader, decode_image, encoded_format, unpack_irheader

    reader = None if spec.folder else RecordIOReader(Path(spec.recordio), rgb_only=True)
    try:
        for i, item in enumerate(tqdm(items, desc="ingest real", unit="img", leave=False, disable=not progress)):
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
            face = _resized(image, spec, where)
            yield i, item, face, (data if face is image and encoded_format(data) else None)
    finally:
        if reader is not None:
            reader.close()


def ingest_split(
    spec: IngestSpec, writers: dict[str, Callable[[np.ndarray, str, int, int, Path | int, bytes | None], None]], *,
    seed: int, heldout_fraction: float, discovery_fraction: float, progress: bool = True,
) -> dict[str, float]:
    """Stream the source's faces to ``writers[group](image, identity, index within identity, images of identity,
    item ref, encoded)`` (the ref: the image file, or the RecordIO key the face was read from; encoded: the bytes
    ``image`` was decoded from when it needed no resize, else None);
    a group without a writer (``discovery`` when no GFD set is drawn from the real faces) takes no identities.
    Returns counts: images per group, identities, single-image identities, corrupt images skipped."""
    items = list_items(spec)
    names = items.identities
    groups = split_identities(names, seed=seed, heldout_fraction=heldout_fraction,
                              discovery_fraction=discovery_fraction if "discovery" in writers else 0.0)
    group_of = [groups[name] for name in names]  # by identity code
    per_identity = np.bincount(items.codes, minlength=len(names)).tolist()
    seen = [0] * len(names)
    written: Counter[str] = Counter()
    skipped: list[str] = []
    for i, item, image, encoded in _decoded(spec, items, skipped, progress=progress):
        code = int(items.codes[i])
        writers[group_of[code]](image, item.identity, seen[code], per_identity[code], item.ref, encoded)
        seen[code] += 1
        written[group_of[code]] += 1
    stats: dict[str, float] = {f"data/real_{g}_images": float(written[g]) for g in GROUPS if g in writers}
    stats.update({
        "data/real_images": float(sum(written.values())),
        "data/real_identities": float(len(names)),
        "data/real_train_identities": float(group_of.count("train")),
        "data/real_heldout_identities": float(group_of.count("heldout")),
        "data/real_single_image_identities": float(per_identity.count(1)),
        "data/real_corrupt_skipped": float(len(skipped)),
    })
    return stats
