"""Interchange formats: InsightFace verification ``.bin``, InsightFace/MXNet RecordIO, image folders.

Readers return RGB uint8 (H, W, 3) and raise :class:`ml.errors.DataError` naming the file (and record, key or
index) and what to do; writers are atomic (``ml.atomic.atomic_path``). ``.bin``: a pickle of ``(bins, issame)``,
2P encoded images and P booleans. RecordIO: dmlc-core framing, each payload an ``IRHeader`` (``<IfQQ``) and an
encoded image; InsightFace's record 0 announces the image keys and each identity's key range. Byte layouts:
``docs/data.md``. Modules ``images``, ``verification_bin`` and ``recordio``; this package exports their names.

Differences from the reference:
- No mxnet or OpenCV: ``struct`` and Pillow; images decode straight to RGB (``cv2.imdecode`` returns BGR).
- ``.bin`` files are unpickled with an allow-list of globals (builtin containers, numpy's array rebuilders), so a
  crafted file cannot run code; insightface uses plain ``pickle.load``. Same py2 ``encoding="bytes"`` fallback.
- ``write_recordio`` refuses keys above 2**24, where the float32 identity-range labels stop being exact.
- ``RecordIOReader`` reopens its file after a fork, so DataLoader workers can share one reader.
"""

from ml.data.formats.images import (
    IMAGE_EXTENSIONS,
    decode_image,
    encode_image,
    encoded_format,
    ingest_image_folder,
)
from ml.data.formats.recordio import (
    RECORDIO_MAGIC,
    IRHeader,
    RecordIOReader,
    pack_irheader,
    read_record_at,
    unpack_irheader,
    write_record,
    write_recordio,
)
from ml.data.formats.verification_bin import read_verification_bin, write_verification_bin

__all__ = [
    "IMAGE_EXTENSIONS",
    "IRHeader",
    "RECORDIO_MAGIC",
    "RecordIOReader",
    "decode_image",
    "encode_image",
    "encoded_format",
    "ingest_image_folder",
    "pack_irheader",
    "read_record_at",
    "read_verification_bin",
    "unpack_irheader",
    "write_record",
    "write_recordio",
    "write_verification_bin",
]
