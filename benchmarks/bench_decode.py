"""Reading faces for training at 112×112: decode + augmentation per core, and a RecordIO read in place vs the PNG
dataset ingest writes.

``decode_augment_112`` runs in a child process with one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``)
so its numbers are per core (images per CPU-second of that process, so that other work on the machine does not
count): JPEG (quality 90) and PNG decode to a uint8 array with Pillow (the only decoder in
the environment: no OpenCV, torchvision.io, simplejpeg or PyTurboJPEG), a record read + decode through
``RecordIODataset`` (what a DataLoader worker does per face), and the augmentation of a batch of 128 as the FR
training step applies it (uint8 → float, then ``augment_batch`` for ``fr.augment_recipe: basic`` or
``augment_kprpe`` for ``kprpe``, with RandAug at the paper's magnitude as ``params.yaml`` sets it). The pipeline
rate is ``1 / (1/decode + 1/augment)`` when one core does both.

``recordio_vs_folder`` writes N procedural faces as a RecordIO of JPEGs, then measures what ingesting them as a PNG
dataset costs (decode + PNG encode + write to its shards with ``DatasetWriter``, one process) and the disk each
takes, and how fast each is read back through a DataLoader (0 and 2 workers; wall-clock images/s and images per
CPU-second of the process and its workers): the RecordIO in place (``RecordIODataset``) against the PNG dataset's
shards (``ShardDataset``). The ``folder`` keys name that PNG dataset (a folder of loose files before shards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import io, json, sys, time
import numpy as np
import torch
torch.set_num_threads(1)
from ml.data.formats import decode_image, encode_image, write_recordio
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.data.records import RecordIODataset
from ml.train.augment import AugmentConfig, augment_kprpe
from ml.fr.data import augment_batch, normalize

n, root = int(sys.argv[1]), sys.argv[2]
gen = ProceduralFaces(ProceduralConfig(image_size=112), seed=0)
faces = [gen.sample(i // 4, i % 4).image for i in range(n)]
jpg = [encode_image(im, "jpg", quality=90) for im in faces]
png = [encode_image(im, "png") for im in faces]

def rate(fn, items, repeats=3):
    # per CPU-second of this one-threaded process: the per-core rate, whatever else shares the machine
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for it in items:
            fn(it)
        best = min(best, time.process_time() - start)
    return len(items) / max(best, 1e-9)

out = {"threads": torch.get_num_threads(), "jpeg_bytes": float(np.mean([len(b) for b in jpg])),
       "png_bytes": float(np.mean([len(b) for b in png]))}
out["decode_jpeg_per_s"] = rate(lambda b: decode_image(b, source="bench"), jpg)
out["decode_png_per_s"] = rate(lambda b: decode_image(b, source="bench"), png)
write_recordio(root + "/bench.rec", jpg, np.arange(n) // 4)
ds = RecordIODataset(root + "/bench.rec", np.arange(1, n + 1), np.arange(n) // 4)
out["record_read_decode_per_s"] = rate(lambda i: ds[i], range(n))

batch = torch.from_numpy(np.stack(faces[:128])).permute(0, 3, 1, 2).contiguous()  # uint8 (128, 3, 112, 112)
keypoints = torch.rand(128, 5, 2) * 80 + 16
mean = std = torch.full((1, 3, 1, 1), 0.5)
g = torch.Generator().manual_seed(0)
recipes = {
    "basic": lambda: augment_batch(normalize(batch, mean, std), keypoints=keypoints, generator=g),
    "kprpe": lambda: augment_kprpe(batch.float() / 255.0, keypoints, AugmentConfig(), generator=g),
    "kprpe_randaug": lambda: augment_kprpe(batch.float() / 255.0, keypoints,
                                           AugmentConfig(randaug_prob=0.5, randaug_ops=2, randaug_magnitude=14),
                                           generator=g),
}
for name, fn in recipes.items():
    fn()
    out[f"augment_{name}_per_s"] = rate(lambda _: fn(), range(3), repeats=2) * 128
    out[f"pipeline_{name}_per_s"] = 1.0 / (1.0 / out["record_read_decode_per_s"] + 1.0 / out[f"augment_{name}_per_s"])
print(json.dumps(out))
"""


def bench_decode_augment_112(n: int = 600) -> dict[str, float]:
    """Images/s per core at 112 px: decode (JPEG, PNG, a RecordIO record), augmentation, both together."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), tmp], capture_output=True, text=True, check=True,
                             env=env)
    values = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in values.items()}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have exited (DataLoader workers)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def bench_recordio_vs_folder(n: int = 3000, workers: tuple[int, ...] = (0, 2)) -> dict[str, object]:
    """Ingesting a RecordIO of n 112-px JPEG faces as PNGs (seconds, disk) vs reading it in place; read images/s."""
    import torch

    from ml.data.formats import encode_image
    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    gen = ProceduralFaces(ProceduralConfig(image_size=112), seed=0)
    bank = [encode_image(gen.sample(i // 4, i % 4).image, "jpg", quality=90) for i in range(400)]
    labels = np.arange(n) // 20
    out: dict[str, object] = {"images": n}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the collate's copies; idle intra-op threads would only add spin time to the CPU count
    try:
        _read_both(n, bank, labels, workers, out)
    finally:
        torch.set_num_threads(threads)
    out["cores"] = os.cpu_count()
    return out


def _read_both(n: int, bank: list[bytes], labels: np.ndarray, workers: tuple[int, ...], out: dict) -> None:
    import pandas as pd

    from ml.data.dataset import DatasetWriter
    from ml.data.formats import decode_image, write_recordio
    from ml.data.records import RecordIODataset, ShardDataset, decode_all

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rec = root / "train.rec"
        write_recordio(rec, [bank[i % len(bank)] for i in range(n)], labels)
        out["recordio_mb"] = round((rec.stat().st_size + rec.with_suffix(".idx").stat().st_size) / 2**20, 2)
        # what turning it into a prepared dataset costs: every face decoded, encoded as PNG and written to its shards
        start, cpu = time.perf_counter(), _cpu_seconds()
        paths = []
        with DatasetWriter(root / "folder", name="bench", source="real", aligned=True) as writer:
            for i in range(n):
                image = decode_image(bank[i % len(bank)], source="bench")
                paths.append(writer.add(image, identity=f"{labels[i]:06d}"))
        seconds = time.perf_counter() - start
        out["png_reencode_s"] = round(seconds, 2)
        out["png_reencode_per_cpu_s"] = round(n / (_cpu_seconds() - cpu), 1)
        out["png_folder_mb"] = round(_tree_bytes(root / "folder") / 2**20, 2)
        rows = pd.DataFrame({"path": paths, "label": labels})
        datasets = {"recordio": RecordIODataset(rec, np.arange(1, n + 1), labels),
                    "folder": ShardDataset(root / "folder", rows)}
        for w in workers:
            for name, ds in datasets.items():
                decode_all(ds, num_workers=w, batch_size=256)  # warm the page cache: both read from memory
                start, cpu = time.perf_counter(), _cpu_seconds()
                images, got = decode_all(ds, num_workers=w, batch_size=256)
                out[f"read_{name}_w{w}_per_s"] = round(n / (time.perf_counter() - start), 1)
                # CPU of this process and its (joined) workers: the cost whatever else shares the cores
                out[f"read_{name}_w{w}_per_cpu_s"] = round(n / (_cpu_seconds() - cpu), 1)
                assert len(images) == n and (got == labels).all()
