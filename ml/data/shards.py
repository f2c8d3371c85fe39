"""Faces as WebDataset shards: a few tar files of encoded images instead of one file per face (docs/scale-out.md).

A shard set is a folder of ``faces-<writer>-<n>.tar`` (the faces' encoded bytes as given, never re-encoded, packed
back to back into members ``pack-<n>.faces`` of about ``pack_bytes``; each tar at most ``max_bytes``) and an
``index.parquet`` (``key``, ``ext``, ``shard``, ``offset``, ``size``, + ``label`` from a RecordIO) of where each
face's bytes lie. A tar member costs a 512-byte header and pads to 512 bytes, a fifth of a 112-px JPEG face; a pack
shares that among hundreds of faces. With ``pack_bytes=0`` each face is its own member ``<key>.<ext>``, as a plain
WebDataset reader expects; readers here go through the index, so both read alike.

A face is a byte range of an uncompressed tar: ``ShardReader.read_many`` reads ranges shard by shard,
``ShardReader.stream`` yields a rank's share of an epoch in an order fixed by (seed, epoch), from any position.
Shards are reproducible (members carry a fixed mtime, owner and mode), and DVC hashes a few hundred files, not one
per face. Why WebDataset and not litdata or MosaicML Streaming: ``docs/scale-out.md``.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ml.errors import DataError

__all__ = ["INDEX_COLUMNS", "INDEX_FILE", "INDEX_TYPES", "PACK_BYTES", "ShardReader", "ShardWriter", "Sharded",
           "export_folder", "shard_recordio", "write_shards"]

INDEX_FILE = "index.parquet"
MAX_BYTES = 256 * 2**20  # per tar: hundreds of shards for millions of faces, few enough for DVC and S3
PACK_BYTES = 2**20  # per packed member: its 0.8 kB of header and padding is under 0.1 % of it
PACK_EXT = "faces"
_HEADER = 512  # a tar member's header (GNU format, a name under 100 characters: no long-name block before it)
INDEX_COLUMNS = ("key", "ext", "shard", "offset", "size")
INDEX_TYPES = ("string", "string", "string", "int64", "int64")  # their Arrow types in index.parquet
_OWNER = "faceops"
log = logging.getLogger(__name__)


def _check_key(key: str, ext: str) -> None:
    """WebDataset splits a member name at the first dot of its last path part: the key's last part has none."""
    if not key or "." in key.rsplit("/", 1)[-1] or key.startswith("/") or ".." in key.split("/"):
        raise DataError(f"shard key {key!r}: need a relative path whose last part has no dot (e.g. 'alice/3')")
    if not ext or "." in ext or "/" in ext:
        raise DataError(f"shard key {key!r}: extension {ext!r} must be a plain suffix such as 'png' or 'jpg'")


class ShardWriter:
    """Append ``(key, ext, encoded bytes)`` faces, in order, to ``out_dir/<prefix>-NNNNNN.tar`` shards of at most
    ``max_bytes`` each (a face larger than that gets a shard of its own); :meth:`close` writes
    ``out_dir/index.parquet`` and returns the index (``INDEX_COLUMNS``), :meth:`abort` removes what was written.
    Keys must be unique. Faces are packed into members of about ``pack_bytes`` (0: a member per face).
    Memory holds the index's rows and one pack, not the faces; with ``index=False`` not even the rows: a caller that
    keeps :meth:`add`'s returned place itself writes the index (``DatasetWriter`` spills it to disk)."""

    def __init__(self, out_dir: str | os.PathLike, *, prefix: str = "faces-00", max_bytes: int = MAX_BYTES,
                 index: bool = True, pack_bytes: int = PACK_BYTES) -> None:
        if pack_bytes < 0:
            raise DataError(f"pack_bytes {pack_bytes!r}: need 0 (a member per face) or a positive size")
        self.out, self.prefix, self.max_bytes, self.pack_bytes = Path(out_dir), prefix, max_bytes, pack_bytes
        self.out.mkdir(parents=True, exist_ok=True)
        self._columns: dict[str, list[Any]] | None = {c: [] for c in INDEX_COLUMNS} if index else None
        self._writer: Any = None
        self._written = 0  # bytes in the open shard, roughly
        self._pack = bytearray()  # the faces of the pack being filled
        self._pack_at = 0  # where the pack's bytes will start in the open shard
        self._packs = 0  # packs written, for their member names
        self.names: list[str] = []  # the shards written, in order

    def shard_name(self, number: int) -> str:
        return f"{self.prefix}-{number:06d}.tar"

    def _open_shard_for(self, size: int) -> None:
        """Start a new shard unless the open one takes ``size`` more bytes (and its header and padding)."""
        import webdataset as wds

        if self._writer is not None and not (self._written and self._written + size + 1024 > self.max_bytes):
            return
        if self._writer is not None:
            self._flush_pack()
            self._writer.close()
        name = self.shard_name(len(self.names))
        self.names.append(name)
        self._written = 0
        # GNU headers (long names allowed), a fixed mtime, owner and mode: the same faces give the same bytes
        self._writer = wds.TarWriter(str(self.out / name), encoder=False, mtime=0, user=_OWNER, group=_OWNER,
                                     mode=0o444, format="GNU_FORMAT")

    def _flush_pack(self) -> None:
        if not self._pack:
            return
        self._writer.write({"__key__": f"pack-{self._packs:08d}", PACK_EXT: bytes(self._pack)})
        start = self._writer.tarstream.offset - math.ceil(len(self._pack) / 512) * 512
        if start != self._pack_at:  # the places already handed out assumed a one-block header
            raise RuntimeError(f"{self.out}: pack {self._packs} starts at {start}, not {self._pack_at}")
        self._packs += 1
        self._pack = bytearray()

    def add(self, key: str, ext: str, data: bytes) -> tuple[int, int, int]:
        """Append one face → where its bytes lie: (shard number, byte offset, size)."""
        _check_key(key, ext)
        self._open_shard_for(len(data))
        if self.pack_bytes:
            if self._pack and len(self._pack) + len(data) > self.pack_bytes:
                self._flush_pack()
            if not self._pack:  # the pack's bytes follow its header at the shard's current end
                self._pack_at = self._writer.tarstream.offset + _HEADER
            offset = self._pack_at + len(self._pack)
            self._pack += data
            self._written += len(data) + (1024 if len(self._pack) == len(data) else 0)
        else:
            self._writer.write({"__key__": key, ext: bytes(data)})
            # the member's bytes end where the tar now ends, before their padding to a 512-byte block
            offset = self._writer.tarstream.offset - math.ceil(len(data) / 512) * 512
            self._written += len(data) + 1024  # the member's header and padding, roughly
        if self._columns is not None:
            for column, value in zip(INDEX_COLUMNS, (key, ext, self.names[-1], offset, len(data))):
                self._columns[column].append(value)
        return len(self.names) - 1, offset, len(data)

    def close(self, *, write_index: bool = True) -> pd.DataFrame | None:
        """Finish the last shard → the index, also written to ``index.parquet`` unless ``write_index`` is False (a
        caller that merges several writers' indexes); None when the index was not kept."""
        try:
            if self._writer is not None:
                self._flush_pack()
                self._writer.close()
                self._writer = None
            if self._columns is None:
                return None
            index = pd.DataFrame(self._columns)
            if index["key"].duplicated().any():
                raise DataError(f"{self.out}: key {index['key'][index['key'].duplicated()].iloc[0]!r} was written "
                                "twice")
            if write_index:
                index.to_parquet(self.out / INDEX_FILE, index=False)
        except BaseException:
            self.abort()
            raise
        return index

    def abort(self) -> None:
        self._pack = bytearray()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for name in self.names:
            (self.out / name).unlink(missing_ok=True)


def write_shards(items: Iterable[tuple[str, str, bytes]], out_dir: str | os.PathLike, *, prefix: str = "faces-00",
                 max_bytes: int = MAX_BYTES, index: bool = True, pack_bytes: int = PACK_BYTES) -> pd.DataFrame:
    """:class:`ShardWriter` over ``items`` → the index (also written to ``out_dir/index.parquet`` unless ``index`` is
    False: a caller that merges several writers' indexes). On an error the shards written so far are removed."""
    writer = ShardWriter(out_dir, prefix=prefix, max_bytes=max_bytes, pack_bytes=pack_bytes)
    try:
        for key, ext, data in items:
            writer.add(key, ext, data)
        return writer.close(write_index=index)
    except BaseException:
        writer.abort()
        raise


def _fs(url: str, **storage_options: Any) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url, **storage_options)


class ShardReader:
    """A shard set's faces by key (``read``, ``read_many``) or as a deterministic, resumable stream (``stream``).
    ``storage_options`` go to fsspec (e.g. an S3 ``endpoint_url``; by default the environment's settings)."""

    def __init__(self, shards_dir: str | os.PathLike, **storage_options: Any):
        self.url = str(shards_dir).rstrip("/")
        self.fs, self.root = _fs(self.url, **storage_options)
        index_path = f"{self.root}/{INDEX_FILE}"
        try:
            with self.fs.open(index_path, "rb") as f:
                self.index = pd.read_parquet(f)
        except FileNotFoundError:
            raise DataError(f"{self.url}: no {INDEX_FILE}; not a shard set (write it with write_shards)") from None
        missing = [c for c in INDEX_COLUMNS if c not in self.index.columns]
        if missing:
            raise DataError(f"{self.url}/{INDEX_FILE}: columns {missing} are missing; rewrite the shard set")
        self._row = pd.Index(self.index["key"])
        self.skipped: dict[str, int] = {}  # the last stream's faces skipped per bad shard

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shards(self) -> list[str]:
        return sorted(self.index["shard"].unique())

    def locate(self, keys: Sequence[str]) -> np.ndarray:
        """Index rows of ``keys`` (int64, -1 where a key is not in the index)."""
        return self._row.get_indexer(list(keys))

    def _rows(self, keys: Sequence[str]) -> np.ndarray:
        rows = self.locate(keys)
        if (rows < 0).any():
            raise DataError(f"{self.url}: key {list(keys)[int(np.argmax(rows < 0))]!r} is not in {INDEX_FILE}")
        return rows

    def read(self, key: str) -> bytes:
        return self.read_many([key])[0]

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """The encoded bytes of ``keys``, in their order; each shard is opened once and read in offset order."""
        return self.read_rows(self._rows(keys))

    def read_rows(self, rows: np.ndarray) -> list[bytes]:
        """The encoded bytes of index rows ``rows``, in their order (see :meth:`read_many`)."""
        out: list[bytes | None] = [None] * len(rows)
        part = self.index.iloc[rows].assign(_at=np.arange(len(rows)))
        for shard, group in part.sort_values(["shard", "offset"]).groupby("shard", sort=False):
            try:
                f = self.fs.open(f"{self.root}/{shard}", "rb")
            except FileNotFoundError:
                raise DataError(f"{self.url}/{shard}: the shard is missing; restore it (dvc checkout) or write the "
                                "shard set again") from None
            with f:
                for at, offset, size, key in zip(group["_at"], group["offset"], group["size"], group["key"]):
                    f.seek(int(offset))
                    data = f.read(int(size))
                    if len(data) != int(size):
                        raise DataError(f"{self.url}/{shard}: {key!r} needs {int(size)} bytes at offset {int(offset)}"
                                        f" but the shard ends after {len(data)}; the shard is truncated: write the "
                                        "shard set again or restore it (dvc checkout)")
                    out[at] = data
        return out  # type: ignore[return-value]

    def epoch_order(self, seed: int, epoch: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """Index rows of rank ``rank`` of ``world`` in epoch ``epoch``: the shards in an order drawn from
        (seed, epoch), every ``world``-th one from ``rank`` on, each shard's faces in an order drawn likewise."""
        if not 0 <= rank < world:
            raise DataError(f"rank {rank} is not in 0..{world - 1}")
        rng = np.random.default_rng([seed, epoch])
        shards = np.array(self.shards)
        mine = shards[rng.permutation(len(shards))][rank::world]
        by_shard = self.index.groupby("shard").indices
        return np.concatenate([by_shard[s][rng.permutation(len(by_shard[s]))] for s in mine] or
                              [np.zeros(0, dtype=np.int64)])

    def stream(self, *, seed: int, epoch: int, rank: int = 0, world: int = 1, start: int = 0,
               max_skipped_fraction: float = 0.0, retries: int = 3, backoff_s: float = 1.0
               ) -> Iterator[tuple[str, bytes]]:
        """``(key, bytes)`` of ``epoch_order``, from its ``start``-th item (a resumed epoch), one shard open at a
        time (read whole: the unit a remote store serves well).

        A missing or truncated shard loses the faces it cannot serve: they are skipped, with a warning naming the
        shard, and counted in ``self.skipped`` ({shard: faces}) until they exceed ``max_skipped_fraction`` of this
        stream's faces; then a ``DataError`` names the shards (the default 0 refuses the first). A read that fails
        otherwise (a store unreachable, a connection reset) is tried ``retries`` more times, ``backoff_s`` × 2^k
        apart, then ends the stream with one ``DataError`` naming the shard and the last error."""
        if not 0.0 <= max_skipped_fraction < 1.0:
            raise DataError(f"max_skipped_fraction {max_skipped_fraction!r} must be in [0, 1)")
        rows = self.epoch_order(seed, epoch, rank, world)[start:]
        allowed = int(max_skipped_fraction * len(rows))
        shard_of = self.index["shard"].to_numpy()
        keys = self.index["key"].to_numpy()
        offsets, sizes = self.index["offset"].to_numpy(np.int64), self.index["size"].to_numpy(np.int64)
        self.skipped = {}
        for shard, run in itertools.groupby(rows, key=shard_of.__getitem__):  # epoch_order keeps a shard together
            blob = self._fetch(shard, retries, backoff_s)
            lost = 0
            for row in run:
                offset, size = int(offsets[row]), int(sizes[row])
                if blob is None or offset + size > len(blob):
                    lost += 1
                    continue
                yield str(keys[row]), blob[offset:offset + size]
            if lost:
                self.skipped[shard] = lost
                total = sum(self.skipped.values())
                why = "missing" if blob is None else f"truncated at {len(blob)} bytes"
                if total > allowed:
                    raise DataError(
                        f"{self.url}/{shard}: the shard is {why}; {total} of this stream's {len(rows)} faces are "
                        f"unreadable (shards {sorted(self.skipped)}), above max_skipped_fraction "
                        f"{max_skipped_fraction:g}: restore them (dvc checkout / dvc pull) or write the shard set again")
                log.warning("%s/%s: the shard is %s; skipped its %d unreadable face(s) (%d of %d so far, at most %d)",
                            self.url, shard, why, lost, total, len(rows), allowed)

    def _fetch(self, shard: str, retries: int, backoff_s: float) -> bytes | None:
        """A shard's bytes (None when it is missing), a failing read retried ``retries`` times with backoff."""
        def read() -> bytes:
            with self.fs.open(f"{self.root}/{shard}", "rb") as f:
                return f.read()

        try:
            return read_retried(read, f"{self.url}/{shard}", retries, backoff_s)
        except FileNotFoundError:
            return None


def read_retried(read: Callable[[], bytes], where: str, retries: int, backoff_s: float) -> bytes:
    """``read()`` from a store, retried ``retries`` times after a failure, ``backoff_s`` × 2^attempt apart; then one
    error naming ``where``. A missing file (``FileNotFoundError``) is not retried: the caller says what it means."""
    attempt = 0
    while True:
        try:
            return read()
        except FileNotFoundError:
            raise
        except OSError as exc:  # ConnectionError, TimeoutError and s3fs's wrapped failures are OSErrors
            if attempt == retries:
                raise DataError(f"{where}: unreadable after {retries + 1} tries ({exc!r}); check that the store is "
                                "reachable, then resume") from exc
            log.warning("%s: read failed (%r); retry %d of %d in %.1f s", where, exc, attempt + 1, retries,
                        backoff_s * 2**attempt)
            time.sleep(backoff_s * 2**attempt)
            attempt += 1


def export_folder(shards_dir: str | os.PathLike, out_dir: str | os.PathLike, *, limit: int | None = None) -> int:
    """Write the shard set's faces as ``out_dir/<key>.<ext>`` files (the first ``limit`` keys in index order, all
    when None), for people who want to look → the number written."""
    reader = ShardReader(shards_dir)
    index = reader.index if limit is None else reader.index.head(limit)
    out = Path(out_dir)
    for start in range(0, len(index), 4096):
        part = index.iloc[start:start + 4096]
        for key, ext, data in zip(part["key"], part["ext"], reader.read_many(part["key"].tolist())):
            file = out / f"{key}.{ext}"
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(data)
    return len(index)


def _image_ext(data: bytes, where: str) -> str:
    from ml.data.formats.images import encoded_format

    if (ext := encoded_format(data)) is None:
        raise DataError(f"{where}: the payload is neither JPEG nor PNG; convert the RecordIO's images first")
    return ext


def _image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except Exception as exc:  # PIL raises several types for a bad header
        raise DataError(f"{where}: cannot read the image header ({exc})") from exc


_INDEX_BLOCK_ROWS = 65_536  # index rows a RecordIO writer holds before it appends them to its part file


def _index_schema(label: bool = False) -> Any:
    import pyarrow as pa

    fields = [(c, pa.type_for_alias(t)) for c, t in zip(INDEX_COLUMNS, INDEX_TYPES)]
    return pa.schema(fields + ([("label", pa.int64())] if label else []))


def _shard_keys(rec: str, keys: np.ndarray, out: str, prefix: str, max_bytes: int, size: int | None,
                pack_bytes: int) -> tuple[str, set[int]]:
    """One writer process: records ``keys`` of ``rec`` → shards ``<prefix>-NNNNNN.tar``, their index rows in the
    Parquet file ``<out>/.<prefix>.index`` (appended a block of rows at a time: memory stays flat however many
    faces the writer takes) → (that file, the labels seen)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ml.data.formats.recordio import RecordIOReader, unpack_irheader

    part = f"{out}/.{prefix}.index"
    schema = _index_schema(label=True)
    rows: dict[str, list[Any]] = {name: [] for name in schema.names}
    labels: set[int] = set()
    writer = ShardWriter(out, prefix=prefix, max_bytes=max_bytes, index=False, pack_bytes=pack_bytes)
    with RecordIOReader(rec) as reader, pq.ParquetWriter(part, schema) as index:
        def flush() -> None:
            index.write_batch(pa.record_batch([pa.array(rows[n], schema.field(n).type) for n in schema.names],
                                              schema=schema))
            for column in rows.values():
                column.clear()

        try:
            for key in keys:
                where = f"{rec}: record {int(key)}"
                header, payload = unpack_irheader(reader.read_raw(int(key)), source=where)
                label = int(header.label[0] if header.flag > 0 else header.label)
                if size is not None and (found := _image_size(payload, where)) != (size, size):
                    raise DataError(f"{where}: image is {found} (width, height), not {size}x{size}; ingest it with "
                                    "`faceops run --set data.ingest_recordio=…` to resize")
                name, ext = f"{label}/{int(key)}", _image_ext(payload, where)
                shard, offset, length = writer.add(name, ext, payload)
                for column, value in zip(schema.names, (name, ext, writer.shard_name(shard), offset, length, label)):
                    rows[column].append(value)
                labels.add(label)
                if len(rows["key"]) >= _INDEX_BLOCK_ROWS:
                    flush()
            flush()
            writer.close(write_index=False)
        except BaseException:
            writer.abort()
            raise
    return part, labels


@dataclass(frozen=True)
class Sharded:
    """What :func:`shard_recordio` wrote: faces, identities (distinct labels) and shard files."""

    faces: int
    identities: int
    shards: int


def shard_recordio(rec_path: str | os.PathLike, out_dir: str | os.PathLike, *, workers: int | None = None,
                   max_bytes: int = MAX_BYTES, size: int | None = None, pack_bytes: int = PACK_BYTES) -> Sharded:
    """Convert an InsightFace RecordIO's image records to a shard set, keeping each payload's bytes as they are,
    over ``workers`` processes (default: every core), each writing its own shard series from a contiguous key
    range, at flat memory: no process holds the faces or the index (each writer appends its rows to a part file,
    merged a row group at a time; ``index.parquet`` has each face's ``label`` too). ``size``: refuse faces whose
    header says another width or height (resizing means re-encoding: that is ``prepare``'s ingest). Keys are
    ``<label>/<record key>``. Packed (``pack_bytes``), the set is about the RecordIO's size."""
    import pyarrow.parquet as pq

    from ml.data.formats.recordio import RecordIOReader

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out}: not empty; shard into a new folder (or remove this one)")
    with RecordIOReader(rec_path) as reader:
        keys = reader.image_keys.copy()
    if not len(keys):
        raise DataError(f"{rec_path}: no image records to shard")
    workers = max(1, min(workers or os.cpu_count() or 1, len(keys)))
    parts = np.array_split(keys, workers)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # moved onto ``out`` only when every writer succeeded
    tmp.mkdir(parents=True)
    jobs = [(str(rec_path), part, str(tmp), f"faces-{w:02d}", max_bytes, size, pack_bytes)
            for w, part in enumerate(parts)]
    try:
        if workers == 1:
            written = [_shard_keys(*jobs[0])]
        else:
            with ProcessPoolExecutor(workers) as pool:
                written = list(pool.map(_shard_keys, *zip(*jobs)))
        faces = 0
        with pq.ParquetWriter(tmp / INDEX_FILE, _index_schema(label=True)) as index:
            for part, _ in written:  # in key order: writer 0's rows, then writer 1's, …
                for batch in pq.ParquetFile(part).iter_batches():
                    index.write_batch(batch)
                    faces += batch.num_rows
                Path(part).unlink()
        if out.exists():
            out.rmdir()
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Sharded(faces, len(set().union(*(labels for _, labels in written))), len(list(out.glob("*.tar"))))
