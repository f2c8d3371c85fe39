"""Interchange formats: InsightFace verification ``.bin``, InsightFace/MXNet RecordIO, image folders.

All readers return RGB uint8 images of shape (H, W, 3) and raise :class:`ml.errors.DataError` with one
message naming the file (and record, key or index) and what to do. All writers are atomic: they write
to a temporary file beside the target and ``os.replace`` it on success (``ml.atomic.atomic_path``).

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

Modules: ``images`` (``decode_image``, ``encode_image``, ``ingest_image_folder``), ``verification_bin`` (the
``.bin`` reader and writer) and ``recordio`` (framing, ``IRHeader``, ``RecordIOReader``, ``write_recordio``); this
package exports their public names.
"""

from ml.data.formats.images import IMAGE_EXTENSIONS, decode_image, encode_image, ingest_image_folder
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
    "ingest_image_folder",
    "pack_irheader",
    "read_record_at",
    "read_verification_bin",
    "unpack_irheader",
    "write_record",
    "write_recordio",
    "write_verification_bin",
]
