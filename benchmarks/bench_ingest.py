"""Ingest of a large InsightFace RecordIO: seconds and peak RSS at 10k, 100k and 500k images.

For each size a RecordIO of JPEG payloads at 112×112 (procedural faces, 20 per identity) is written, then a fresh
process (its own peak RSS, nothing of the writing in it) runs ``prepare``'s real-data ingest, which streams it into the
training / held-out / discovery datasets at 64×64 with the real verification pairs. Streaming holds neither the
images nor a row per image of the metadata it writes, so peak RSS should stay flat as the set grows fifty-fold.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from tasks.prepare import DataConfig
from tasks.prepare.sets import ingest_real

n, root, size = int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = DataConfig(ingest_recordio=str(root / "train.rec"), verification_pairs=3000, image_size=size)
out = root / "prepared"
out.mkdir()
start = time.perf_counter()
stats = ingest_real(out, cfg, progress=False)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"images": int(stats["data/real_images"]), "seconds": seconds, "images_per_s": n / seconds,
                  "peak_rss_mb": peak / 1024, "rss_before_ingest_mb": before / 1024}))
"""


def face_recordio(rec: Path, n: int) -> None:
    """A RecordIO of ``n`` JPEG faces at 112×112 (quality 90): a bank of 400 procedural faces repeated, 20 images
    per identity."""
    from ml.data.formats import encode_image, write_recordio
    from ml.data.procedural import ProceduralConfig, ProceduralFaces

    gen = ProceduralFaces(ProceduralConfig(image_size=112), seed=0)
    bank = [encode_image(gen.sample(i // 4, i % 4).image, "jpg", quality=90) for i in range(400)]
    write_recordio(rec, [bank[i % len(bank)] for i in range(n)], np.arange(n) // 20)


def bench_ingest_recordio(sizes: tuple[int, ...] = (10_000, 100_000, 500_000)) -> dict[str, object]:
    """``rows``: per size, images, seconds, images/s and peak RSS of the ingesting process; the peak's growth from the
    first size to each later one."""
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            face_recordio(Path(tmp) / "train.rec", n)
            out = subprocess.run([sys.executable, "-c", CHILD, str(n), tmp, "64"], capture_output=True, text=True,
                                 check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    growth = {f"peak_rss_growth_to_{r['images'] // 1000}k_mb": round(r["peak_rss_mb"] - rows[0]["peak_rss_mb"], 1)
              for r in rows[1:]}
    return {"rows": rows, **growth}


def bench_ingest_recordio_112(n: int = 100_000) -> dict[str, object]:
    """``prepare``'s ingest of ``n`` 112-px JPEG faces at ``image_size`` 112: no resize, so each face is decoded to be
    checked and stored as the JPEG it was. Target: ≥ 1,500 images/s on 2 cores; the datasets' shards ≤ 1.1× the
    RecordIO (``.rec`` + ``.idx``); the verification ``.bin`` is counted apart."""
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "train.rec"
        face_recordio(rec, n)
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), tmp, "112"], capture_output=True, text=True,
                             check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rec_bytes = rec.stat().st_size + rec.with_suffix(".idx").stat().st_size
        shard_bytes = sum(p.stat().st_size for p in (Path(tmp) / "prepared").glob("*/shards/*"))
        bin_bytes = sum(p.stat().st_size for p in (Path(tmp) / "prepared").glob("verification/*.bin"))
    return {"images": row["images"], "seconds": round(row["seconds"], 1), "images_per_s": round(row["images_per_s"]),
            "peak_rss_mb": round(row["peak_rss_mb"], 1), "rec_mb": round(rec_bytes / 2**20, 1),
            "shards_over_rec": round(shard_bytes / rec_bytes, 3), "bin_mb": round(bin_bytes / 2**20, 1)}
