"""Faces as torch Datasets, decoded in DataLoader workers: a prepared dataset's shards, or the records of the
InsightFace RecordIO its faces were ingested from, read in place.

When ``prepare`` ingests a RecordIO it writes, beside each real dataset's manifest, ``records.parquet``: the
manifest ``path`` of every face and the ``record`` key it was read from, with the RecordIO's path and size in the
file's metadata. :func:`recordio_dataset` turns manifest rows into a :class:`RecordIODataset` over those keys, so a
training stage can read the JPEG payloads where they lie instead of the dataset's copies (a PNG when ingest resized
the face: cheaper to decode, from a smaller file, ``benchmarks/bench_decode.py``). The faces are the ones ingest wrote:
the same decoder, and the same bicubic resize when the RecordIO's faces are of another size, so the pixels equal the
copy's (a kept JPEG, or a lossless PNG).

Both datasets give ``(uint8 tensor (H, W, 3), label)``: the decoded array itself (a batch's ``permute(0, 3, 1, 2)``
makes the (B, 3, H, W) view a model reads). :class:`RecordIODataset` opens the ``.rec`` lazily, once
per process (a worker forked or spawned from a pickled copy opens its own handle; nothing open is pickled), and
reads each record by its ``.idx`` offset. A record that no longer decodes was decodable at ingest, so the RecordIO
changed since: the error names the file and record and says to run ``prepare`` again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from ml.data.formats import RecordIOReader, decode_image, unpack_irheader
from ml.errors import DataError

__all__ = ["RECORDS_FILE", "RecordIODataset", "RecordsWriter", "ShardDataset", "decode_all", "has_records",
           "recordio_dataset"]

RECORDS_FILE = "records.parquet"
_META_REC, _META_SIZE = b"faceops.recordio", b"faceops.recordio_size"


def _to_tensor(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image)  # (H, W, 3) as decoded, no copy: the collate stacks (B, H, W, 3) contiguously


class RecordIODataset(Dataset):
    """Faces of a RecordIO by key: ``keys`` (N,) record keys, ``labels`` (N,); each face at ``image_size``²
    (resized as ingest resized it; None keeps the stored size)."""

    def __init__(self, rec_path: str | os.PathLike, keys: Any, labels: Any, *, image_size: int | None = None):
        self.rec_path = Path(rec_path)
        self.keys = np.asarray(keys, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        if self.keys.shape != self.labels.shape or self.keys.ndim != 1:
            raise DataError(f"{self.rec_path}: {self.keys.shape} record keys for {self.labels.shape} labels")
        self.image_size = image_size
        self._reader: RecordIOReader | None = None
        self._pid = -1

    def _open(self) -> RecordIOReader:
        if self._reader is None or self._pid != os.getpid():
            self._reader = RecordIOReader(self.rec_path, rgb_only=True)  # reads the .idx: once per process
            self._pid = os.getpid()
        return self._reader

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_reader"], state["_pid"] = None, -1
        return state

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from ml.data.ingest import resize_face

        key = int(self.keys[index])
        where = f"{self.rec_path}: record {key}"
        try:
            _, payload = unpack_irheader(self._open().read_raw(key), source=where)
            image = decode_image(payload, source=where, rgb_only=True)
            if self.image_size is not None:
                image = resize_face(image, self.image_size, True, where)
        except DataError as exc:
            raise DataError(f"{exc} (this face was read at ingest: the RecordIO changed since; run `dvc repro "
                            "prepare` to ingest it again)") from exc
        return _to_tensor(image), int(self.labels[index])


class ShardDataset(Dataset):
    """Faces of a prepared dataset directory by manifest row (``path``, ``label``), each read from the dataset's
    shards by its byte range; a process opens each shard once, lazily (nothing open is pickled)."""

    _pid = -1  # the process whose descriptors ``_files`` holds (set here too: ``__del__`` of a failed ``__init__``)

    def __init__(self, dataset_dir: str | os.PathLike, rows: pd.DataFrame):
        from ml.data.dataset import shard_places

        self.root = Path(dataset_dir)
        self.paths = [str(p) for p in rows["path"]]
        self.labels = rows["label"].to_numpy(dtype=np.int64)
        self.shards, self.shard_of, self.offsets, self.sizes = shard_places(self.root, rows)
        self._files: dict[int, int] = {}
        self._pid = -1

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"], state["_pid"] = {}, -1
        return state

    def __del__(self) -> None:
        if self._pid == os.getpid():
            for fd in self._files.values():
                os.close(fd)

    def __len__(self) -> int:
        return len(self.paths)

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            try:
                self._files[shard] = os.open(self.shards[shard], os.O_RDONLY)
            except OSError as exc:
                raise DataError(f"{self.shards[shard]}: cannot open the shard ({exc}); restore the dataset (dvc "
                                "checkout) or rebuild it") from exc
        return self._files[shard]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        shard, size = int(self.shard_of[index]), int(self.sizes[index])
        where = f"{self.root / self.paths[index]} (in {self.shards[shard].name})"
        data = os.pread(self._fd(shard), size, int(self.offsets[index]))
        if len(data) != size:
            raise DataError(f"{where}: the shard ends before the image's {size} bytes; the shard is truncated: "
                            "restore the dataset (dvc checkout) or rebuild it")
        return _to_tensor(decode_image(data, source=where)), int(self.labels[index])


def worker_kwargs(num_workers: int, *, persistent: bool = False) -> dict:
    """DataLoader keyword arguments for ``num_workers`` worker processes (0: load in this process). Workers start
    from a fresh forkserver, not a fork of this process: a process that has run Prefect or MLflow in-process carries
    their service threads and fork handlers, and a plain fork of it can exit at once (code 1, no traceback). Tensors
    of a ``TensorDataset`` reach the workers through shared memory, not a copy per worker."""
    if num_workers <= 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": "forkserver", "persistent_workers": persistent}


def decode_all(dataset: Dataset, *, num_workers: int = 0, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Every face of ``dataset`` decoded by ``num_workers`` DataLoader workers (0: this process, see
    ``worker_kwargs``), in order: (uint8 (N, H, W, 3), int64 labels (N,))."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, **worker_kwargs(num_workers))
    images, labels = [], []
    for x, y in loader:
        images.append(x.numpy())
        labels.append(y.numpy())
    if not images:
        return np.empty((0, 0, 0, 3), np.uint8), np.empty(0, np.int64)
    return np.concatenate(images), np.concatenate(labels)


# --------------------------------------------------------------------------------------------------
# records.parquet: which RecordIO record each face of an ingested dataset came from
# --------------------------------------------------------------------------------------------------


class RecordsWriter:
    """Stream ``records.parquet`` into ``dataset_dir`` as faces are ingested: ``add(path, key)`` per face, ``close()``
    at the end. Rows are written as Parquet row groups of ``rows_per_group``, so memory holds one group, not one
    row per face of the whole RecordIO; the file appears under its name only on ``close`` (until then it is a hidden
    temporary beside it, removed by ``abort``)."""

    def __init__(self, dataset_dir: str | os.PathLike, rec_path: str | os.PathLike, *,
                 rows_per_group: int = 8_192) -> None:
        rec_path = Path(rec_path).resolve()
        self.path = Path(dataset_dir) / RECORDS_FILE
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        if not rec_path.is_file():
            raise DataError(f"{rec_path}: RecordIO file not found; fix data.ingest_recordio")
        meta = {_META_REC: str(rec_path).encode(), _META_SIZE: str(rec_path.stat().st_size).encode()}
        schema = pa.schema([("path", pa.string()), ("record", pa.int64())], metadata=meta)
        # the system allocator hands freed pages back to malloc (Arrow's default pool keeps them: see
        # ml.data.manifest.write_parquet)
        self._pool = pa.system_memory_pool()
        self._writer = pq.ParquetWriter(self._tmp, schema, memory_pool=self._pool)
        self._paths: list[str] = []
        self._keys: list[int] = []
        self.rows_per_group = rows_per_group

    def add(self, path: str, key: int) -> None:
        self._paths.append(path)
        self._keys.append(int(key))
        if len(self._paths) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._paths:
            columns = [pa.array(self._paths, pa.string(), memory_pool=self._pool),
                       pa.array(self._keys, pa.int64(), memory_pool=self._pool)]
            self._writer.write_batch(pa.record_batch(columns, schema=self._writer.schema))
            self._paths, self._keys = [], []

    def close(self) -> None:
        try:
            self._flush()
            self._writer.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop what was written (a no-op after ``close``)."""
        if self._writer.is_open:
            self._writer.close()
        self._tmp.unlink(missing_ok=True)


def has_records(dataset_dir: str | os.PathLike) -> bool:
    """Whether the dataset was ingested from a RecordIO (and can be read in place)."""
    return (Path(dataset_dir) / RECORDS_FILE).is_file()


def recordio_dataset(dataset_dir: str | os.PathLike, rows: pd.DataFrame, *, image_size: int) -> RecordIODataset:
    """A :class:`RecordIODataset` of ``rows`` of the ingested dataset at ``dataset_dir`` (their ``label``s), read
    from the RecordIO they were ingested from; DataError when that file is gone or changed size, or a row has no
    record."""
    file = Path(dataset_dir) / RECORDS_FILE
    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{file}: cannot read ({exc}); run `dvc repro prepare` to ingest again") from exc
    meta = table.schema.metadata or {}
    if _META_REC not in meta or _META_SIZE not in meta:
        raise DataError(f"{file}: does not name the RecordIO its faces came from; run `dvc repro prepare`")
    rec, size = Path(meta[_META_REC].decode()), int(meta[_META_SIZE].decode())
    if not rec.is_file():
        raise DataError(f"{rec}: the RecordIO {Path(dataset_dir).name!r} was ingested from is gone; put it back, or "
                        "read the prepared copies (data.train_reader: png)")
    if rec.stat().st_size != size:
        raise DataError(f"{rec}: {rec.stat().st_size} bytes, but {size} when it was ingested; the RecordIO changed: "
                        "run `dvc repro prepare` to ingest it again, or read the prepared copies (data.train_reader: "
                        "png)")
    key_of = dict(zip(table.column("path").to_pylist(), table.column("record").to_pylist()))
    try:
        keys = [key_of[str(p)] for p in rows["path"]]
    except KeyError as exc:
        raise DataError(f"{file}: no record for {exc.args[0]}; run `dvc repro prepare` to ingest again") from None
    return RecordIODataset(rec, keys, rows["label"].to_numpy(), image_size=image_size)
