"""InsightFace verification ``.bin`` files (e.g. ``lfw.bin``): a pickle of ``(bins, issame_list)``, read with an
allow-listing unpickler so a crafted file cannot run code, and written atomically."""

from __future__ import annotations

import builtins
import os
import pickle
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ml.atomic import atomic_path
from ml.data.formats.images import _check_image, decode_image, encode_image
from ml.errors import DataError


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

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            pickle.dump((bins, issame_list), f, protocol=pickle.HIGHEST_PROTOCOL)

    with atomic_path(path) as tmp:
        write(tmp)
