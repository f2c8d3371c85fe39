"""Images in and out of the interchange formats: decoding JPEG/PNG/BMP bytes to RGB uint8 (optionally refusing
anything that is not colour RGB), encoding PNG/JPEG, and listing an ``<identity>/<image>`` folder tree."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from ml.errors import DataError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
_PIL_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG"}
_GRAYSCALE_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "I;16N", "F")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def encoded_format(data: bytes | bytearray | memoryview) -> str | None:
    """``"jpg"`` or ``"png"`` from the file's magic bytes, None for anything else (BMP, not an image)."""
    head = bytes(data[:8])
    if head[:3] == b"\xff\xd8\xff":
        return "jpg"
    return "png" if head == b"\x89PNG\r\n\x1a\n" else None


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
