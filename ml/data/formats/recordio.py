"""InsightFace/MXNet RecordIO: dmlc-core record framing, the ``IRHeader`` packing, random access through the
``.idx`` (:class:`RecordIOReader`) and the atomic writer of the InsightFace layout (:func:`write_recordio`).

A ``.rec`` holds records written as parts ``[magic u32][lrecord u32][data][zero pad to 4]`` (little-endian,
``lrecord = cflag << 29 | length``); where the payload holds the magic at a 4-byte-aligned offset the writer cuts
it there and drops those 4 bytes (cflag 1 first part, 2 middle, 3 last, 0 whole) and the reader puts it back. The
``.idx`` is text, ``key<TAB>offset`` per line. A payload is an ``IRHeader`` (``<IfQQ``: flag, label, id, id2; 24
bytes), then ``flag`` float32 labels when ``flag > 0`` (the scalar label is then 0), then the encoded image.
InsightFace layout: record 0 is header-only with label ``[n_images + 1, n_images + 1 + K]``, images are keys
``1..n_images``, then one record per identity with label ``[start_key, end_key)``. Without that array label every
key is an image; a record 0 that carries image bytes is an image even if its label is an array.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from collections import namedtuple
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from ml.atomic import atomic_path
from ml.data.formats.images import _check_image, decode_image, encode_image
from ml.errors import DataError

logger = logging.getLogger(__name__)


RECORDIO_MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", RECORDIO_MAGIC)
_MAX_RECORD = 1 << 29  # lrecord keeps 29 bits for the length
_LEN_MASK = _MAX_RECORD - 1


def _part_header(cflag: int, length: int) -> bytes:
    return struct.pack("<II", RECORDIO_MAGIC, (cflag << 29) | length)


def write_record(f: IO[bytes], payload: bytes) -> int:
    """Append one record to ``f`` with dmlc-core framing; returns the offset of its first part header."""
    payload = bytes(payload)
    n = len(payload)
    if n >= _MAX_RECORD:
        raise DataError(f"{getattr(f, 'name', 'recordio')}: record of {n} bytes exceeds the RecordIO limit "
                        f"of {_MAX_RECORD - 1} bytes")
    offset = f.tell()
    start = 0  # first byte of the part being accumulated
    for i in range(0, (n // 4) * 4, 4):
        if payload[i:i + 4] == _MAGIC_BYTES:
            f.write(_part_header(1 if start == 0 else 2, i - start))
            f.write(payload[start:i])  # aligned cut, so this part needs no padding
            start = i + 4
    f.write(_part_header(3 if start > 0 else 0, n - start))
    f.write(payload[start:])
    f.write(b"\x00" * (-n % 4))
    return offset


def read_record_at(f: IO[bytes], offset: int, *, key: int | None = None) -> bytes:
    """Read the record whose first part header is at ``offset``, re-joining split parts."""
    name = getattr(f, "name", "recordio")
    where = f"{name}: record {key} at offset {offset}" if key is not None else f"{name}: record at offset {offset}"
    f.seek(offset)
    chunks: list[bytes] = []
    first = True
    while True:
        head = f.read(8)
        if len(head) < 8:
            if first and not head:
                raise DataError(f"{where}: offset is at or beyond the end of the file; the .rec "
                                "is truncated or the .idx belongs to another file, re-download or rebuild both")
            raise DataError(f"{where}: file ends inside a record header; the .rec is truncated, "
                            "re-download or rebuild it")
        magic, lrec = struct.unpack("<II", head)
        if magic != RECORDIO_MAGIC:
            raise DataError(f"{where}: bad magic 0x{magic:08x} (expected 0x{RECORDIO_MAGIC:08x}); the .idx "
                            "does not match the .rec or the file is corrupt, rebuild the .idx or the dataset")
        cflag, length = lrec >> 29, lrec & _LEN_MASK
        if cflag not in ((0, 1) if first else (2, 3)):
            raise DataError(f"{where}: unexpected part flag {cflag} ({'first' if first else 'continuation'} "
                            "part); the file is corrupt, re-download or rebuild it")
        padded = (length + 3) & ~3
        data = f.read(padded)
        if len(data) < padded:
            raise DataError(f"{where}: file ends inside the record ({len(data)} of {padded} bytes); the .rec is "
                            "truncated, re-download or rebuild it")
        chunks.append(data[:length])
        if cflag in (0, 3):
            return _MAGIC_BYTES.join(chunks)
        first = False


IRHeader = namedtuple("IRHeader", ["flag", "label", "id", "id2"])
IRHeader.__doc__ = "MXNet image-record header; ``label`` is a float or, when flag > 0, a float32 array."
_IR_FORMAT = "<IfQQ"
_IR_SIZE = struct.calcsize(_IR_FORMAT)  # 24


def pack_irheader(label: float | Sequence[float] | np.ndarray, image_bytes: bytes = b"", *,
                  id: int = 0, id2: int = 0) -> bytes:
    """Payload = IRHeader + (array label as float32 if not scalar) + image bytes, as ``mx.recordio.pack``."""
    if np.ndim(label) == 0:
        head = struct.pack(_IR_FORMAT, 0, float(label), id, id2)
        return head + image_bytes
    arr = np.asarray(label, dtype="<f4").reshape(-1)
    return struct.pack(_IR_FORMAT, arr.size, 0.0, id, id2) + arr.tobytes() + image_bytes


def unpack_irheader(payload: bytes, *, source: str = "record") -> tuple[IRHeader, bytes]:
    """Split a payload into (IRHeader, remaining bytes), as ``mx.recordio.unpack``."""
    if len(payload) < _IR_SIZE:
        raise DataError(f"{source}: payload of {len(payload)} bytes is shorter than the {_IR_SIZE}-byte IRHeader")
    flag, label, id_, id2 = struct.unpack(_IR_FORMAT, payload[:_IR_SIZE])
    rest = payload[_IR_SIZE:]
    if flag > 0:
        if len(rest) < 4 * flag:
            raise DataError(f"{source}: IRHeader announces {flag} labels but only {len(rest)} bytes follow")
        label = np.frombuffer(rest, dtype="<f4", count=flag).astype(np.float32)
        rest = rest[4 * flag:]
    return IRHeader(flag, label, id_, id2), rest


class _Index:
    """A ``.idx`` as int64 arrays (16 bytes a record, 32 when the keys are out of order; a dict of Python ints took
    about 130): ``keys`` in file order and the ``offset`` of each; lookups by binary search over the keys (a sorted
    copy and its permutation when the file is not in key order)."""

    def __init__(self, idx_path: Path) -> None:
        keys, offsets = array("q"), array("q")
        with idx_path.open("r", encoding="ascii", errors="replace") as fh:
            for lineno, line in enumerate(fh, start=1):
                line = line.strip()
                if not line:
                    continue
                parts = line.split("\t")
                if len(parts) != 2 or not all(p.isdigit() for p in parts):
                    raise DataError(f"{idx_path}: line {lineno} is {line!r}, expected 'key<TAB>offset' with "
                                    "non-negative integers; rebuild the .idx from the .rec")
                try:
                    keys.append(int(parts[0]))
                    offsets.append(int(parts[1]))
                except OverflowError:
                    raise DataError(f"{idx_path}: line {lineno} holds a key or offset beyond 2^63 ({line!r}); the "
                                    "index is corrupt: rebuild the .idx from the .rec") from None
        if not keys:
            raise DataError(f"{idx_path}: index is empty; rebuild it from the .rec")
        self.keys = np.frombuffer(keys, dtype=np.int64)  # (N,) file order
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        if (self.keys[1:] > self.keys[:-1]).all():  # written in key order, as im2rec and write_recordio do
            self._order, self._sorted = None, self.keys  # no copy: 16 bytes a record
        else:
            self._order = np.argsort(self.keys, kind="stable")
            self._sorted = self.keys[self._order]
        repeated = np.flatnonzero(self._sorted[1:] == self._sorted[:-1])
        if len(repeated):
            key = int(self._sorted[repeated[0]])
            with idx_path.open("r", encoding="ascii", errors="replace") as fh:  # read again for the line numbers
                lines = [n for n, line in enumerate(fh, start=1) if line.split("\t")[0].strip() == str(key)]
            raise DataError(f"{idx_path}: key {key} appears twice (lines {lines[0]} and {lines[1]}); rebuild the .idx")

    def __len__(self) -> int:
        return len(self.keys)

    def offset(self, key: int) -> int | None:
        """The record's offset, None when ``key`` is not indexed."""
        at = int(np.searchsorted(self._sorted, key))
        if at == len(self._sorted) or self._sorted[at] != key:
            return None
        return int(self.offsets[at if self._order is None else self._order[at]])

    def missing(self, keys: np.ndarray) -> np.ndarray:
        """The ``keys`` (int64) that are not indexed."""
        at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
        return keys[self._sorted[at] != keys]


class RecordIOReader:
    """Random access to an InsightFace/MXNet ``.rec`` through its ``.idx``.

    ``reader[i]`` gives ``(image, label)`` for the i-th image record. ``header0`` is record 0's
    ``(first_identity_key, end_key)`` when the file has the InsightFace layout, else None.
    """

    def __init__(self, rec_path: str | os.PathLike, *, rgb_only: bool = False):
        self.rec_path = Path(rec_path)
        self.rgb_only = rgb_only  # refuse images that are not colour RGB (see decode_image)
        self.idx_path = self.rec_path.with_suffix(".idx")
        if not self.rec_path.is_file():
            raise DataError(f"{self.rec_path}: RecordIO file not found; fix the path or download the dataset")
        if not self.idx_path.is_file():
            raise DataError(f"{self.idx_path}: index for {self.rec_path.name} not found; it must sit beside the "
                            ".rec with the same stem. Rebuild it by scanning the .rec (e.g. mxnet's "
                            "tools/rec2idx.py, or RecordIOReader.rebuild_index)")
        self._index = _Index(self.idx_path)
        self._fh: IO[bytes] | None = None
        self._pid = -1
        self.header0: tuple[int, int] | None = None
        header0, rest = (None, b"")
        if self._index.offset(0) is not None:
            header0, rest = self.read_record(0)
        # InsightFace's record 0 is header-only; a record 0 with image bytes is an ordinary image
        if header0 is not None and header0.flag > 0 and not rest:
            if header0.flag < 2:
                raise DataError(f"{self.rec_path}: record 0 has {header0.flag} label(s), expected "
                                "[first_identity_key, end_key]")
            first_id, end = int(header0.label[0]), int(header0.label[1])
            self.header0 = (first_id, end)
            self._image_keys = np.arange(1, max(first_id, 1), dtype=np.int64)  # (N,)
            missing = self._index.missing(self._image_keys)
            if len(missing):
                raise DataError(f"{self.idx_path}: image key {int(missing[0])} (of 1..{first_id - 1} announced by "
                                "record 0) is not in the index; rebuild the .idx from the .rec")
        else:
            self._image_keys = self._index.keys

    # file handle, reopened after fork so DataLoader workers do not share a file position
    def _file(self) -> IO[bytes]:
        if self._fh is None or self._pid != os.getpid():
            self._fh = self.rec_path.open("rb")
            self._pid = os.getpid()
        return self._fh

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fh"], state["_pid"] = None, -1
        return state

    @property
    def keys(self) -> list[int]:
        """All keys of the index, in file order."""
        return self._index.keys.tolist()

    @property
    def image_keys(self) -> np.ndarray:
        """The image records' keys (int64), in file order; a read-only view."""
        view = self._image_keys.view()
        view.flags.writeable = False
        return view

    @property
    def num_identities(self) -> int | None:
        return None if self.header0 is None else self.header0[1] - self.header0[0]

    def read_raw(self, key: int) -> bytes:
        """The whole payload of record ``key`` (IRHeader included)."""
        offset = self._index.offset(key)
        if offset is None:
            raise DataError(f"{self.rec_path}: key {key} is not in {self.idx_path.name}")
        return read_record_at(self._file(), offset, key=key)

    def read_record(self, key: int) -> tuple[IRHeader, bytes]:
        """``(header, image bytes)`` of record ``key``."""
        return unpack_irheader(self.read_raw(key), source=f"{self.rec_path}: record {key}")

    def identity_range(self, identity: int) -> tuple[int, int]:
        """``[start_key, end_key)`` of the images of the identity-th identity record."""
        if self.header0 is None:
            raise DataError(f"{self.rec_path}: no identity records (record 0 has no array label)")
        key = self.header0[0] + identity
        if not 0 <= identity < self.header0[1] - self.header0[0]:
            raise IndexError(identity)
        header, _ = self.read_record(key)
        if header.flag < 2:
            raise DataError(f"{self.rec_path}: identity record {key} has no [start, end) label")
        return int(header.label[0]), int(header.label[1])

    def __len__(self) -> int:
        return len(self._image_keys)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        n = len(self._image_keys)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"image index {index} out of range for {n} images")
        key = int(self._image_keys[index])
        header, payload = self.read_record(key)
        label = header.label[0] if header.flag > 0 else header.label
        return decode_image(payload, source=f"{self.rec_path}: record {key}", rgb_only=self.rgb_only), int(label)

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RecordIOReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @staticmethod
    def rebuild_index(rec_path: str | os.PathLike) -> Path:
        """Scan ``rec_path`` record by record and (re)write its ``.idx``, keying records 0, 1, 2, ... in
        file order (the keys ``write_recordio`` and InsightFace's tools assign)."""
        rec_path = Path(rec_path)
        idx_path = rec_path.with_suffix(".idx")
        lines = []
        with rec_path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            key = 0
            while f.tell() < size:
                offset = f.tell()
                read_record_at(f, offset, key=key)
                lines.append(f"{key}\t{offset}\n")
                key += 1
        with atomic_path(idx_path) as tmp:
            tmp.write_bytes("".join(lines).encode("ascii"))
        return idx_path


_MAX_FLOAT_KEY = 1 << 24  # largest integer float32 holds exactly


def write_recordio(
    rec_path: str | os.PathLike,
    images: Sequence[np.ndarray | bytes],
    labels: Sequence[int] | np.ndarray,
    *,
    image_format: str = "jpg",
    quality: int = 95,
) -> None:
    """Write ``rec_path`` and its ``.idx`` in the InsightFace layout.

    Images are stably sorted by label first, so each identity's images are one contiguous key range;
    identity records follow in ascending label order. Items of ``images`` may be RGB uint8 arrays
    (encoded as ``image_format``) or already-encoded bytes (stored as given). Both files appear
    atomically; an existing ``.idx`` is removed before the new ``.rec`` is moved in, so a crash in
    between leaves a missing index (a clear error), never a stale one.
    """
    rec_path = Path(rec_path)
    idx_path = rec_path.with_suffix(".idx")
    if rec_path == idx_path:
        raise ValueError(f"{rec_path}: the record file needs a suffix other than .idx (use .rec)")
    if image_format.lower() not in ("png", "jpg", "jpeg"):
        raise ValueError(f"image_format {image_format!r} is not 'png' or 'jpg'")
    labels_arr = np.asarray(labels)
    if labels_arr.ndim != 1 or len(labels_arr) != len(images):
        raise DataError(f"{rec_path}: {len(images)} images but labels of shape {labels_arr.shape}; "
                        "pass one integer label per image")
    if len(labels_arr) == 0:
        raise DataError(f"{rec_path}: no images to write")
    if not np.issubdtype(labels_arr.dtype, np.integer) or labels_arr.min() < 0:
        raise DataError(f"{rec_path}: labels must be non-negative integers, got dtype {labels_arr.dtype} "
                        f"with minimum {labels_arr.min()}")
    order = np.argsort(labels_arr, kind="stable")
    sorted_labels = labels_arr[order]
    identities, starts = np.unique(sorted_labels, return_index=True)
    n, k = len(order), len(identities)
    first_id_key = n + 1
    if first_id_key + k > _MAX_FLOAT_KEY:
        raise DataError(f"{rec_path}: {n} images + {k} identities exceed 2**24 keys, which the float32 "
                        "identity-range labels cannot hold exactly; write the dataset as several shards")
    if int(identities.max()) >= _MAX_FLOAT_KEY:
        raise DataError(f"{rec_path}: label {int(identities.max())} exceeds 2**24 and is not exact as float32")

    lines: list[str] = []

    def write_rec(tmp: Path) -> None:
        with tmp.open("wb") as rec_f:
            lines.append(f"0\t{write_record(rec_f, pack_irheader([first_id_key, first_id_key + k]))}\n")
            for key, src in enumerate(order, start=1):
                item = images[int(src)]
                if isinstance(item, (bytes, bytearray, memoryview)):
                    encoded = bytes(item)
                else:
                    encoded = encode_image(_check_image(item, f"{rec_path} image {int(src)}"), image_format, quality)
                payload = pack_irheader(float(sorted_labels[key - 1]), encoded, id=key)
                lines.append(f"{key}\t{write_record(rec_f, payload)}\n")
            ends = np.append(starts[1:], n)
            for j, (s, e) in enumerate(zip(starts, ends)):
                key = first_id_key + j
                lines.append(f"{key}\t{write_record(rec_f, pack_irheader([s + 1, e + 1], id=key))}\n")
        idx_path.unlink(missing_ok=True)  # the new .rec never sits beside the old index

    with atomic_path(rec_path) as tmp:
        write_rec(tmp)
    with atomic_path(idx_path) as tmp:
        tmp.write_bytes("".join(lines).encode("ascii"))
    logger.info("wrote %s: %d images, %d identities", rec_path, n, k)
