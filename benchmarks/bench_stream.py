"""Training faces streamed from shards (``ml.data.shard_stream``) at 112×112, per core: read + decode, and read + decode +
the KP-RPE augmentation of each batch, from a local shard set and from an S3 store on loopback.

A child process with one thread packs ``n`` procedural 112-px JPEG faces (quality 90) into shards as ``prepare``
writes them, then iterates one epoch of a ``StreamLoader`` (no workers, batches of 128) and reports images per
CPU-second of that process, so the numbers are one core's whatever else runs; ``by_index_*``: the same faces read
as ``fr.stream`` reads a dataset directory (``ShardDataset``: a face's byte range at a time, in the sampler's order),
the baseline a stream must not fall behind. The S3 rows read the same shards
through moto's S3 server, started as its own process on 127.0.0.1 (its CPU is not counted; wall-clock images/s is
reported beside: moto is a Python server, far slower than MinIO or S3, so the wall rate is moto's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
import numpy as np
import torch
torch.set_num_threads(1)
from ml.data.formats import encode_image
from ml.data.procedural import ProceduralConfig, ProceduralFaces
from ml.data.shards import write_shards
from ml.data.shard_stream import ShardStream, StreamLoader
from ml.train.augment import AugmentConfig, augment_kprpe

n, root, endpoint = int(sys.argv[1]), sys.argv[2], sys.argv[3]
gen = ProceduralFaces(ProceduralConfig(image_size=112), seed=0)
bank = [encode_image(gen.sample(i // 4, i % 4).image, "jpg", quality=90) for i in range(400)]
keys = [f"id{i // 20}/{i}" for i in range(n)]
labels = np.arange(n) // 20
write_shards(((k, "jpg", bank[i % len(bank)]) for i, k in enumerate(keys)), root + "/shards")
keypoints = torch.rand(128, 5, 2) * 80 + 16
g = torch.Generator().manual_seed(0)

def epoch(url, augment, **options):
    stream = ShardStream(url, keys, labels, image_size=112, batch_size=128, storage_options=options)
    cpu, wall, faces = time.process_time(), time.perf_counter(), 0
    for images, _ in StreamLoader(stream):
        if augment:
            augment_kprpe(images.float() / 255.0, keypoints[:len(images)], AugmentConfig(), generator=g)
        faces += len(images)
    return faces / (time.process_time() - cpu), faces / (time.perf_counter() - wall), len(stream.windows)

def by_index(augment):
    # the fr.stream path over a dataset directory of the same JPEGs: random access by byte range, sampler order
    from torch.utils.data import DataLoader
    from ml.data.dataset import DatasetWriter, read_manifest
    from ml.data.formats import decode_image
    from ml.data.records import ShardDataset
    from ml.fr.data import EpochSampler, LabelledFaces
    if not os.path.isdir(root + "/ds"):
        with DatasetWriter(root + "/ds", name="bench", source="real", aligned=True) as w:
            for i, k in enumerate(keys):
                data = bank[i % len(bank)]
                w.add(decode_image(data, source=k), identity=k.split("/")[0], encoded=data)
    rows = read_manifest(root + "/ds/manifest.parquet")
    faces = LabelledFaces(ShardDataset(root + "/ds", rows), rows["label"].to_numpy())
    cpu = time.process_time()
    for images, _ in DataLoader(faces, batch_size=128, sampler=EpochSampler(len(rows), 0), drop_last=True):
        if augment:
            augment_kprpe(images.float() / 255.0, keypoints[:len(images)], AugmentConfig(), generator=g)
    return (len(rows) // 128 * 128) / (time.process_time() - cpu)

out = {"faces": n}
out["local_decode_per_cpu_s"], _, out["windows"] = epoch(root + "/shards", False)
out["local_decode_kprpe_per_cpu_s"], _, _ = epoch(root + "/shards", True)
out["by_index_decode_per_cpu_s"] = by_index(False)
out["by_index_decode_kprpe_per_cpu_s"] = by_index(True)
if endpoint:
    import boto3
    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    s3.create_bucket(Bucket="faces")
    for name in os.listdir(root + "/shards"):
        s3.upload_file(root + "/shards/" + name, "faces", "bench/shards/" + name)
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    out["s3_decode_per_cpu_s"], out["s3_decode_per_s"], _ = epoch("s3://faces/bench/shards", False, **options)
print(json.dumps(out))
"""


def bench_stream_read_112(n: int = 20_000) -> dict[str, object]:
    """Target: ≥ 1,000 images/s per core for read + decode + augmentation at 112 px (the folder path's ~1,070 for
    the kprpe recipe, row ``decode_augment_112``)."""
    from faceops.processes import free_port, wait_healthy

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/", server, seconds=60)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), tmp, f"http://127.0.0.1:{port}"],
                                 capture_output=True, text=True, check=True, env=env)
    finally:
        server.terminate()
        server.wait(10)
    values = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: round(v) if isinstance(v, float) else v for k, v in values.items()}
