"""Interchange formats: InsightFace verification ``.bin``, InsightFace/MXNet RecordIO, image folders.

All readers return RGB uint8 images of shape (H, W, 3) and raise :class:`ml.errors.DataError` with one
message naming the file (and record, key or index) and what to do. All writers are atomic: they write
to a temporary file beside the target and ``os.replace`` it on success.

Verification ``.bin`` (e.g. ``lfw.bin``): a pickle of ``(bins, issame_list)``; ``bins`` holds 2P encoded
images (pair ``i`` is ``bins[2i], bins[2i+1]``), ``issame_list`` P booleans.

RecordIO (dmlc-core framing, one ``.rec`` plus a text ``.idx`` of ``key<TAB>offset`` lines). A record
is written as one or more parts ``[magic u32][lrecord u32][data][zero pad to 4]``, little-endian, with
``lrecord = cflag << 29 | length``. When the payload holds the magic at a 4-byte-aligned offset the
writer cuts it there and drops those 4 bytes: cflag 1 = first part, 2 = middle, 3 = last, 0 = whole.
The reader puts the magic back between parts. Each payload starts with an ``IRHeader`` (``<IfQQ``:
flag, label, id, id2; 24 bytes); ``flag > 0`` means ``flag`` float32 labels follow the header (and
the header's scalar label is 0), then the encoded image.

InsightFace layout: record 0 is header-only with array label ``[n_images + 1, n_images + 1 + K]``,
image records are keys ``1..n_images``, then one record per identity with array label
``[start_key, end_key)``. Without record 0's array label every key in the ``.idx`` is an image. A
record 0 that carries image bytes is taken as an image even if its label is an array.

Differences from the reference:
- No mxnet or OpenCV: framing, ``IRHeader`` packing and image coding are done here with ``struct`` and
  Pillow. Images decode straight to RGB (``mx.image.imdecode`` also returns RGB; ``cv2.imdecode`` in
  ``mx.recordio.unpack_img`` returns BGR).
- ``.bin`` files are unpickled with an allow-list of globals (builtin containers and the numpy
  functions that rebuild arrays), so a crafted file cannot run code; insightface uses plain
  ``pickle.load``. The py2 fallback is the same: retry with ``encoding="bytes"`` on UnicodeDecodeError.
- ``write_recordio`` refuses datasets whose keys exceed 2**24, where the float32 identity-range
  labels of the InsightFace layout stop being exact.
- ``RecordIOReader`` reopens its file after a fork, so DataLoader workers can share one reader.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import pickle
import struct
import tempfile
from collections import namedtuple
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ml.errors import DataError

logger = logging.getLogger(__name__)

__all__ = [
    "IMAGE_EXTENSIONS",
    "IRHeader",
    "RECORDIO_MAGIC",
    "RecordIOReader",
    "decode_image",
    "encode_image",
    "ingest_image_folder",
    "pack_irheader",
    "read_record_at",
    "read_verification_bin",
    "unpack_irheader",
    "write_record",
    "write_recordio",
    "write_verification_bin",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")

# --------------------------------------------------------------------------------------------------
# Image coding
# --------------------------------------------------------------------------------------------------

_PIL_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}


_GRAYSCALE_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def decode_image(data: bytes | bytearray | memoryview, *, source: str, rgb_only: bool = False) -> np.ndarray:
    """Decode JPEG/PNG/BMP bytes to an RGB uint8 (H, W, 3) array; ``source`` names it in errors.

    Any mode is converted to RGB, unless ``rgb_only``: then an image that is not colour RGB (grayscale, with an
    alpha channel, CMYK, ...) is refused, as the ingestion of real faces wants (a palette PNG without
    transparency counts as RGB)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if rgb_only:
                _check_rgb(im, source)
            # an RGB image (every JPEG face) is read out as it is: convert() would copy it once more
            rgb = np.array(im if im.mode == "RGB" else im.convert("RGB"), dtype=np.uint8)
    except DataError:
        raise
    except UnidentifiedImageError as exc:
        raise DataError(f"{source}: cannot decode image: the bytes are not a JPEG/PNG/BMP file (empty, cut short "
                        "in the header, or another kind of file); re-export or remove this image") from exc
    except Exception as exc:  # Pillow raises many types for bad input (OSError, SyntaxError, ...)
        detail = " ".join(str(exc).split())
        raise DataError(
            f"{source}: cannot decode image ({type(exc).__name__}: {detail}); "
            "the bytes are not a complete JPEG/PNG/BMP, re-export or remove this image"
        ) from exc
    return rgb


def _check_rgb(im: Image.Image, source: str) -> None:
    mode = im.mode
    if mode == "P" and "transparency" in im.info:
        mode = "PA"
    if mode in ("RGB", "P"):
        return
    if mode in _GRAYSCALE_MODES:
        raise DataError(f"{source}: grayscale image (mode {mode}); faces are ingested as RGB colour images, convert "
                        "it to RGB (e.g. PIL's .convert('RGB')) or remove it")
    if mode in _ALPHA_MODES:
        raise DataError(f"{source}: image has an alpha channel (mode {mode}); faces are ingested as RGB colour "
                        "images, flatten it onto a background (RGB) or remove it")
    raise DataError(f"{source}: image mode {mode} is not RGB; faces are ingested as RGB colour images, convert it "
                    "to RGB or remove it")


def _check_image(image: Any, what: str) -> np.ndarray:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        desc = f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray) else type(image).__name__
        raise DataError(f"{what}: expected an RGB uint8 array of shape (H, W, 3), got {desc}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise DataError(f"{what}: image has zero size {image.shape}")
    return image


def encode_image(image: np.ndarray, fmt: str, quality: int = 95) -> bytes:
    """Encode an RGB uint8 (H, W, 3) array as ``fmt`` ("png", "jpg" or "jpeg"); quality is JPEG-only."""
    pil_format = _PIL_FORMATS.get(fmt.lower())
    if pil_format is None:
        raise ValueError(f"image format {fmt!r} is not one of {sorted(_PIL_FORMATS)}")
    image = _check_image(image, "encode_image")
    buf = io.BytesIO()
    options = {"quality": int(quality)} if pil_format == "JPEG" else {}
    Image.fromarray(np.ascontiguousarray(image), mode="RGB").save(buf, format=pil_format, **options)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Atomic file helpers
# --------------------------------------------------------------------------------------------------


def _temp_beside(path: Path) -> tuple[IO[bytes], Path]:
    """Open a new temporary file in ``path``'s directory (same filesystem, so os.replace is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return os.fdopen(fd, "wb"), Path(tmp)


def _discard(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------------
# Verification .bin
# --------------------------------------------------------------------------------------------------


def _latin1_encode(text: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # Protocol <= 2 pickles written by Python 3 store bytes as _codecs.encode(str, "latin1").
    if not isinstance(text, str) or encoding.lower().replace("-", "") != "latin1" or errors != "strict":
        raise pickle.UnpicklingError("_codecs.encode is only allowed as encode(str, 'latin1')")
    return text.encode("latin1")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    from numpy._core import multiarray, numeric

    allowed: dict[tuple[str, str], Any] = {("_codecs", "encode"): _latin1_encode}
    for name in ("bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "bool", "int", "float", "str"):
        allowed[("builtins", name)] = getattr(builtins, name)
    # numpy 1.x pickles say numpy.core.*, numpy 2.x say numpy._core.*; both rebuild the same objects.
    for pkg in ("numpy.core", "numpy._core"):
        allowed[(f"{pkg}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{pkg}.multiarray", "scalar")] = multiarray.scalar
        allowed[(f"{pkg}.numeric", "_frombuffer")] = numeric._frombuffer
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only allow-listed globals; anything else is refused before it is called."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _RestrictedUnpickler._allowed is None:
            _RestrictedUnpickler._allowed = _allowed_globals()
        obj = _RestrictedUnpickler._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")
        return obj


def _restricted_load(path: Path) -> Any:
    """Load like insightface's ``load_bin``: plain first, ``encoding="bytes"`` for py2-era files."""
    try:
        with path.open("rb") as f:
            return _RestrictedUnpickler(f).load()
    except UnicodeDecodeError:
        with path.open("rb") as f:
            return _RestrictedUnpickler(f, encoding="bytes").load()


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    return None


def read_verification_bin(path: str | os.PathLike, *, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Read an InsightFace verification ``.bin``.

    Returns ``(images, issame)``: uint8 (2P, H, W, 3) RGB, where pair ``i`` is ``images[2i], images[2i+1]``,
    and bool (P,).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: verification .bin not found; download it (e.g. lfw.bin from the InsightFace "
                        "face-recognition datasets) or fix the path")
    try:
        obj = _restricted_load(path)
    except pickle.UnpicklingError as exc:
        detail = " ".join(str(exc).split())  # one line: some pickle messages span two
        if "is not allowed" in detail:
            raise DataError(f"{path}: refused to unpickle: {detail}; a verification .bin holds only "
                            "(list of image bytes, list of bools), so this file is not one") from exc
        raise DataError(f"{path}: corrupt or truncated pickle ({detail}); re-download the file") from exc
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, MemoryError,
            RecursionError, struct.error, UnicodeDecodeError) as exc:
        detail = " ".join(str(exc).split())
        raise DataError(f"{path}: corrupt or truncated pickle ({type(exc).__name__}: {detail}); "
                        "re-download the file") from exc

    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        raise DataError(f"{path}: expected a pickled pair (bins, issame_list), got {type(obj).__name__}; "
                        "this is not an InsightFace verification .bin")
    bins, issame_raw = obj
    if isinstance(issame_raw, np.ndarray):
        issame_raw = issame_raw.tolist()
    if not isinstance(bins, (list, tuple)) or not isinstance(issame_raw, (list, tuple)):
        raise DataError(f"{path}: expected (list of encoded images, list of bools), got "
                        f"({type(bins).__name__}, {type(issame_raw).__name__})")
    if len(issame_raw) == 0:
        raise DataError(f"{path}: issame_list is empty; the file holds no pairs")
    if len(bins) != 2 * len(issame_raw):
        raise DataError(f"{path}: {len(bins)} images for {len(issame_raw)} pairs (expected "
                        f"{2 * len(issame_raw)}); the file is incomplete, re-download or rebuild it")
    issame = np.empty(len(issame_raw), dtype=bool)
    for i, v in enumerate(issame_raw):
        b = _as_bool(v)
        if b is None:
            raise DataError(f"{path}: issame_list[{i}] is {v!r}, expected a bool")
        issame[i] = b

    images: np.ndarray | None = None
    indices: Iterable[int] = range(len(bins))
    if progress:
        from tqdm.auto import tqdm

        indices = tqdm(indices, desc=f"decode {path.name}", unit="img")
    for i in indices:
        raw = bins[i]
        if isinstance(raw, np.ndarray):
            if raw.dtype != np.uint8:
                raise DataError(f"{path}: image {i} is a numpy array of dtype {raw.dtype}, expected encoded "
                                "uint8 bytes")
            raw = raw.tobytes()
        if not isinstance(raw, (bytes, bytearray)):
            raise DataError(f"{path}: image {i} is a {type(raw).__name__}, expected encoded image bytes")
        img = decode_image(raw, source=f"{path} image {i}")
        if images is None:
            images = np.empty((len(bins), *img.shape), dtype=np.uint8)
        elif img.shape != images.shape[1:]:
            raise DataError(f"{path}: image {i} has size {img.shape[:2]} but image 0 has "
                            f"{images.shape[1:3]}; all images of a .bin must share one size")
        images[i] = img
    assert images is not None
    return images, issame


def write_verification_bin(
    path: str | os.PathLike,
    images: np.ndarray | Sequence[np.ndarray],
    issame: Sequence[bool] | np.ndarray,
    *,
    image_format: str = "png",
    quality: int = 95,
) -> None:
    """Write ``(bins, issame_list)`` exactly as insightface's loader expects; pairs are consecutive images."""
    path = Path(path)
    if image_format.lower() not in ("png", "jpg", "jpeg"):
        raise ValueError(f"image_format {image_format!r} is not 'png' or 'jpg'")
    issame_list = []
    for i, v in enumerate(np.asarray(issame).tolist() if isinstance(issame, np.ndarray) else list(issame)):
        b = _as_bool(v)
        if b is None:
            raise DataError(f"{path}: issame[{i}] is {v!r}, expected a bool")
        issame_list.append(b)
    if not issame_list:
        raise DataError(f"{path}: no pairs to write")
    if len(images) != 2 * len(issame_list):
        raise DataError(f"{path}: {len(images)} images for {len(issame_list)} pairs; pass 2 images per pair")
    size = None
    bins: list[bytes] = []
    for i, img in enumerate(images):
        img = _check_image(img, f"{path} image {i}")
        if size is None:
            size = img.shape
        elif img.shape != size:
            raise DataError(f"{path}: image {i} has shape {img.shape} but image 0 has {size}; "
                            "a .bin holds one image size")
        bins.append(encode_image(img, image_format, quality))
    f, tmp = _temp_beside(path)
    try:
        with f:
            pickle.dump((bins, issame_list), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise


# --------------------------------------------------------------------------------------------------
# RecordIO framing
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# IRHeader
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# RecordIO reader / writer (InsightFace layout)
# --------------------------------------------------------------------------------------------------


def _read_idx(idx_path: Path) -> dict[int, int]:
    offsets: dict[int, int] = {}
    with idx_path.open("r", encoding="ascii", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            line = line.strip()
            if not line:
                continue
            parts = line.split("\t")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise DataError(f"{idx_path}: line {lineno} is {line!r}, expected 'key<TAB>offset' with "
                                "non-negative integers; rebuild the .idx from the .rec")
            key, offset = int(parts[0]), int(parts[1])
            if key in offsets:
                raise DataError(f"{idx_path}: key {key} appears twice (line {lineno}); rebuild the .idx")
            offsets[key] = offset
    if not offsets:
        raise DataError(f"{idx_path}: index is empty; rebuild it from the .rec")
    return offsets


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
        self._offsets = _read_idx(self.idx_path)
        self._fh: IO[bytes] | None = None
        self._pid = -1
        self.header0: tuple[int, int] | None = None
        self._image_keys: list[int]
        header0, rest = (None, b"")
        if 0 in self._offsets:
            header0, rest = self.read_record(0)
        # InsightFace's record 0 is header-only; a record 0 with image bytes is an ordinary image
        if header0 is not None and header0.flag > 0 and not rest:
            if header0.flag < 2:
                raise DataError(f"{self.rec_path}: record 0 has {header0.flag} label(s), expected "
                                "[first_identity_key, end_key]")
            first_id, end = int(header0.label[0]), int(header0.label[1])
            self.header0 = (first_id, end)
            self._image_keys = list(range(1, first_id))
            missing = next((k for k in self._image_keys if k not in self._offsets), None)
            if missing is not None:
                raise DataError(f"{self.idx_path}: image key {missing} (of 1..{first_id - 1} announced by record 0) "
                                "is not in the index; rebuild the .idx from the .rec")
        else:
            self._image_keys = list(self._offsets)

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
        return list(self._offsets)

    @property
    def image_keys(self) -> list[int]:
        return list(self._image_keys)

    @property
    def num_identities(self) -> int | None:
        return None if self.header0 is None else self.header0[1] - self.header0[0]

    def read_raw(self, key: int) -> bytes:
        """The whole payload of record ``key`` (IRHeader included)."""
        if key not in self._offsets:
            raise DataError(f"{self.rec_path}: key {key} is not in {self.idx_path.name}")
        return read_record_at(self._file(), self._offsets[key], key=key)

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
        key = self._image_keys[index]
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
        out, tmp = _temp_beside(idx_path)
        try:
            with out:
                out.write("".join(lines).encode("ascii"))
            os.replace(tmp, idx_path)
        except BaseException:
            _discard(tmp)
            raise
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

    rec_f, rec_tmp = _temp_beside(rec_path)
    idx_tmp = None
    try:
        lines = []
        with rec_f:
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
        idx_f, idx_tmp = _temp_beside(idx_path)
        with idx_f:
            idx_f.write("".join(lines).encode("ascii"))
        _discard(idx_path)
        os.replace(rec_tmp, rec_path)
        os.replace(idx_tmp, idx_path)
    except BaseException:
        _discard(rec_tmp, *([idx_tmp] if idx_tmp else []))
        raise
    logger.info("wrote %s: %d images, %d identities", rec_path, n, k)


# --------------------------------------------------------------------------------------------------
# Image folders
# --------------------------------------------------------------------------------------------------


def ingest_image_folder(
    src_dir: str | os.PathLike, *, extensions: Sequence[str] = IMAGE_EXTENSIONS
) -> list[tuple[Path, str]]:
    """List ``(image path, identity)`` for a ``<identity>/<image>`` tree, sorted by identity then file name.

    Hidden entries (names starting with ".") and non-image files are skipped. An identity folder without any
    image is an error (a copy that went wrong); one whose images all have extensions outside ``extensions`` is
    skipped with a warning.
    """
    src = Path(src_dir)
    exts = tuple(e.lower() for e in extensions)
    if not src.is_dir():
        raise DataError(f"{src}: image folder not found; expected a directory of <identity>/<image> files")

    def is_image(p: Path) -> bool:
        return p.is_file() and p.suffix.lower() in exts

    pairs: list[tuple[Path, str]] = []
    for entry in sorted(src.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if is_image(entry):
            raise DataError(f"{entry}: image at the top level of {src}; move it into a folder named after "
                            "its identity (<identity>/<image>)")
        if not entry.is_dir():
            continue
        found = []
        for item in sorted(entry.iterdir(), key=lambda p: p.name):
            if item.name.startswith("."):
                continue
            if item.is_dir():
                nested = next((p for p in sorted(item.rglob("*")) if is_image(p)), None)
                if nested is not None:
                    raise DataError(f"{nested}: image nested more than one level below {src}; the layout "
                                    "is <identity>/<image>, flatten this folder or move it to the top level")
            elif is_image(item):
                found.append((item, entry.name))
        if not found:
            if any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in entry.iterdir()):
                logger.warning("%s: identity folder has no images with the extensions asked for (%s), skipped",
                               entry, ", ".join(exts))
                continue
            raise DataError(f"{entry}: identity folder has no images ({', '.join(exts)}); add its images or remove "
                            "the folder")
        pairs.extend(found)
    if not pairs:
        raise DataError(f"{src}: no images found (extensions {', '.join(exts)}); expected <identity>/<image> files")
    return pairs
