"""A training split streamed from a dataset's shards wherever they lie (a folder or an fsspec URL such as ``s3://…``),
a window of consecutive faces per ranged read, decoded in DataLoader workers.

An epoch's order is a function of (seed, epoch) alone: shards, then their windows of about ``window_bytes``, then a
window's faces, each in a random order (no face read twice, one window in memory per worker). Rank ``r`` of
``world`` takes the ``r``-th contiguous part (``n // world`` faces each: DDP needs equal steps), DataLoader worker
``w`` the ``w``-th contiguous part of its rank's batches. :class:`StreamLoader` saves the epoch and the batches
trained in Lightning's checkpoints and resumes mid-epoch with the uninterrupted run's batches
(``docs/scale-out.md``). A missing or truncated shard, an undecodable face or a store failing after ``retries``
tries stops the stream with one ``DataError`` naming the shard; faces are never skipped (a DDP rank that skipped
would take fewer steps than the others).

Differences from WebDataset's ``WebLoader`` + ``shuffle(n)``: the order is a pure function of the index and (seed,
epoch), not of a buffer's fill, so a resumed or re-run epoch is the same, and ranks get equal numbers of faces from
one index instead of whole shards each.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ml.data.formats.images import decode_image
from ml.data.shards import ShardReader, read_retried
from ml.errors import DataError

__all__ = ["WINDOW_BYTES", "ShardStream", "StreamLoader", "handed_out"]

WINDOW_BYTES = 32 * 2**20  # one ranged read: thousands of faces, a few hundred packs' worth of S3 requests saved


def handed_out(per_worker: Sequence[int], batches: int) -> list[int]:
    """How many of each worker's batches are among the first ``batches`` a DataLoader hands out, taking the workers
    in turn and passing over those that have run out (``per_worker[w]`` batches each)."""
    done = [0] * len(per_worker)
    left = batches
    while left > 0:
        moved = False
        for w, total in enumerate(per_worker):
            if left > 0 and done[w] < total:
                done[w] += 1
                left -= 1
                moved = True
        if not moved:
            raise DataError(f"{batches} batches handed out, but the workers have only {sum(per_worker)}")
    return done


class ShardStream(IterableDataset):
    """Faces ``keys`` (shard index keys, e.g. manifest paths without their extension) of the shard set at
    ``shards``, labelled ``labels``, as ``(uint8 (3, H, W), int64 label)`` items (with ``keypoints`` (N, 5, 2),
    ``(…, float32 (5, 2))``): the items of ``ml.fr.data.LabelledFaces``, in the module docstring's order, for a
    DataLoader of ``batch_size`` (:class:`StreamLoader`; :meth:`training` sets the trainer's batch, seed and
    keypoints). ``image_size`` (the faces' side) is required: faces of another size are refused.
    ``storage_options`` go to fsspec in this process and in every worker (e.g. an S3 ``endpoint_url``; by default
    the environment's settings)."""

    def __init__(self, shards: str | os.PathLike, keys: Sequence[str], labels: np.ndarray, *, image_size: int,
                 batch_size: int = 256, seed: int = 0, keypoints: np.ndarray | None = None,
                 window_bytes: int = WINDOW_BYTES, retries: int = 3, backoff_s: float = 1.0,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        reader = ShardReader(shards, **self.storage_options)
        self.url = reader.url
        rows = reader.locate(keys)
        if (rows < 0).any():
            raise DataError(f"{self.url}: key {list(keys)[int(np.argmax(rows < 0))]!r} is not in its index; the "
                            "shard set is not the dataset's (copy the dataset's shards/ there again)")
        index = reader.index.iloc[rows]
        self.shard_names = np.array(sorted(index["shard"].unique()))
        self.shard = np.searchsorted(self.shard_names, index["shard"].to_numpy()).astype(np.int32)
        self.offset = index["offset"].to_numpy(np.int64)
        self.size = index["size"].to_numpy(np.int64)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.keypoints = None if keypoints is None else np.asarray(keypoints, dtype=np.float32)
        if len(self.labels) != len(rows) or (self.keypoints is not None and len(self.keypoints) != len(rows)):
            raise DataError(f"{len(rows)} faces for {len(self.labels)} labels"
                            + ("" if self.keypoints is None else f" and {len(self.keypoints)} keypoints"))
        if batch_size < 1:
            raise DataError(f"batch_size {batch_size} must be ≥ 1")
        self.batch_size, self.seed, self.image_size = int(batch_size), int(seed), int(image_size)
        self.windows = self._windows(window_bytes)
        self.window_of = np.empty(len(rows), dtype=np.int64)  # item position → its window
        for k, window in enumerate(self.windows):
            self.window_of[window] = k
        self.retries, self.backoff_s = retries, backoff_s
        self.epoch, self.start, self.rank, self.world = 0, 0, 0, 1
        self._fs: Any = None

    def training(self, batch_size: int, seed: int, keypoints: np.ndarray | None) -> ShardStream:
        """A copy of this stream in batches of ``batch_size``, ordered by ``seed``, with ``keypoints``."""
        import copy

        out = copy.copy(self)
        out.batch_size, out.seed = int(batch_size), int(seed)
        out.keypoints = None if keypoints is None else np.asarray(keypoints, dtype=np.float32)
        if out.keypoints is not None and len(out.keypoints) != len(self.labels):
            raise DataError(f"{len(self.labels)} faces for {len(out.keypoints)} keypoints")
        return out

    def _windows(self, window_bytes: int) -> list[np.ndarray]:
        """Item positions grouped into windows: per shard in offset order, cut every ``window_bytes``."""
        out = []
        order = np.lexsort((self.offset, self.shard))
        for run in np.split(order, np.flatnonzero(np.diff(self.shard[order])) + 1):
            ends = np.cumsum(self.size[run])
            cut = np.flatnonzero(np.diff(ends // max(1, window_bytes))) + 1
            out.extend(np.split(run, cut))
        return out

    def batches_per_rank(self, world: int = 1) -> int:
        return len(self.labels) // world // self.batch_size

    def __len__(self) -> int:  # this rank's faces in one epoch: what its DataLoader yields
        world = self.world if get_worker_info() is not None else _rank_world()[1]
        return self.batches_per_rank(world) * self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """Every item position in epoch ``epoch``'s order (all ranks')."""
        rng = np.random.default_rng([self.seed, epoch])
        by_shard: dict[int, list[np.ndarray]] = {}
        for window in self.windows:
            by_shard.setdefault(int(self.shard[window[0]]), []).append(window)
        parts = []
        for s in rng.permutation(sorted(by_shard)):
            windows = by_shard[int(s)]
            for w in rng.permutation(len(windows)):
                parts.append(windows[w][rng.permutation(len(windows[w]))])
        return np.concatenate(parts)

    def worker_batches(self, epoch: int, rank: int, world: int, worker: int, workers: int) -> list[np.ndarray]:
        """The item positions of each batch worker ``worker`` of ``workers`` serves to rank ``rank`` in ``epoch``."""
        per_rank = self.batches_per_rank(world) * self.batch_size
        mine = self.order(epoch)[rank * (len(self.labels) // world):][:per_rank]
        batches = np.split(mine, len(mine) // self.batch_size) if len(mine) else []
        return [batches[j] for j in np.array_split(np.arange(len(batches)), workers)[worker]]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        # a DataLoader starts its turns at worker 0; resumed after `start` batches, the next turn is worker
        # start % workers's: this process serves that worker's batches, the next process the next one's, …
        own = (worker + self.start) % workers
        split = np.array_split(np.arange(self.batches_per_rank(self.world)), workers)
        skip = handed_out([len(s) for s in split], self.start)[own]
        batches = self.worker_batches(self.epoch, self.rank, self.world, own, workers)[skip:]
        window: tuple[int, int, int, bytes] = (-1, 0, 0, b"")
        for batch in batches:
            for i in batch.tolist():
                shard, lo, hi = int(self.shard[i]), int(self.offset[i]), int(self.offset[i] + self.size[i])
                if not (window[0] == shard and window[1] <= lo and hi <= window[2]):
                    window = self._read_window(i)
                where = f"{self.url}/{self.shard_names[shard]} at byte {lo}"
                image = decode_image(window[3][lo - window[1]:hi - window[1]], source=where)
                if image.shape[:2] != (self.image_size, self.image_size):
                    raise DataError(f"{where}: face is {image.shape[0]}x{image.shape[1]}, not "
                                    f"{self.image_size}x{self.image_size}; the shard set is not the dataset's")
                item = (torch.from_numpy(image).permute(2, 0, 1).contiguous(), torch.tensor(self.labels[i]))
                yield item if self.keypoints is None else (*item, torch.from_numpy(self.keypoints[i]))

    def _read_window(self, i: int) -> tuple[int, int, int, bytes]:
        """(shard, first byte, end byte, bytes) of the window holding item ``i``, in one ranged read, retried."""
        window, shard = self.windows[self.window_of[i]], int(self.shard[i])
        lo, hi = int(self.offset[window].min()), int((self.offset[window] + self.size[window]).max())
        path = f"{self.url}/{self.shard_names[shard]}"
        try:
            data = read_retried(lambda: self._filesystem().cat_file(path, start=lo, end=hi), path, self.retries,
                                self.backoff_s)
        except FileNotFoundError:
            raise DataError(f"{path}: the shard is missing; restore it (dvc pull) or copy the dataset again") from None
        if len(data) != hi - lo:
            raise DataError(f"{path}: needs bytes {lo}-{hi} but ends before; the shard is truncated: restore it "
                            "(dvc pull) or copy the dataset again")
        return shard, lo, hi, data

    def _filesystem(self) -> Any:
        if self._fs is None:  # per process: a worker opens its own (nothing open is pickled)
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.url, **self.storage_options)[0]
        return self._fs

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"] = None
        return state


class StreamLoader(DataLoader):
    """A DataLoader of a :class:`ShardStream` in batches of its ``batch_size``, with ``**loader_kwargs`` (workers:
    ``ml.data.records.worker_kwargs``, never persistent: each epoch's workers get that epoch). ``set_epoch`` picks
    the epoch (Lightning: ``ml.train.callbacks.fit``); ``state_dict`` / ``load_state_dict`` carry the epoch and the
    batches handed out, so a loader loaded mid-epoch goes on where the saved one stopped. A consumer that fetches
    ahead sets ``consumed`` (the batches it has finished with this epoch), which ``state_dict`` then reports
    instead (``fit`` does, for Lightning's one batch fetched ahead). The rank and world size are read when
    iterating, i.e. after the process group exists."""

    def __init__(self, stream: ShardStream, **loader_kwargs: Any) -> None:
        if loader_kwargs.get("persistent_workers"):
            raise DataError("a StreamLoader's workers cannot be persistent: each epoch's workers read that epoch")
        super().__init__(stream, batch_size=stream.batch_size, **loader_kwargs)
        self.stream, self.handed = stream, 0
        self.consumed: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.stream.epoch:
            self.stream.epoch, self.stream.start, self.handed, self.consumed = int(epoch), 0, 0, None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.stream.epoch, "batches": self.handed if self.consumed is None else self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if batches >= self.stream.batches_per_rank(_rank_world()[1]):  # saved at the end of an epoch: the next one
            epoch, batches = epoch + 1, 0
        self.stream.epoch, self.stream.start, self.handed, self.consumed = epoch, batches, batches, None

    def __iter__(self) -> Iterator[Any]:
        self.stream.rank, self.stream.world = _rank_world()
        self.handed = self.stream.start
        for batch in super().__iter__():
            self.handed += 1
            yield batch
        self.stream.start = 0


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
