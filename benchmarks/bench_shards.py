"""Datasets as WebDataset shards (``ml.data.shards``) against one file per face, at scale.

``shard_ingest``: a RecordIO of ``FACEOPS_BENCH_FACES`` (default 1,000,000) JPEG faces at 112×112 (a bank of 400
procedural faces, 20 images per identity) converted to shards by ``faceops data shard``'s function in a fresh process
over every core, keeping the JPEG bytes packed into 1 MB tar members (its default): faces/s, the shard set's size
against the ``.rec``, peak RSS of the parent and of the largest writer process; then again with a tar member per face
(``--pack-kb 0``, ``*_member_per_face``), and the largest writer's peak RSS for a tenth of the faces (``*_tenth``).

``dvc_shards``: the same faces as a folder of loose files (``export_folder``) and as shards, each ``dvc add``-ed,
``dvc status``-ed and ``dvc push``-ed to a local remote in its own fresh repository: seconds per command
(``FACEOPS_BENCH_DVC_FACES``, default 100,000).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_ingest import face_recordio
from ml.data.shards import PACK_BYTES

CHILD = r"""
import json, resource, sys, time
from ml.data.shards import shard_recordio

rec, out, pack_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.perf_counter()
done = shard_recordio(rec, out, pack_bytes=pack_bytes)
seconds = time.perf_counter() - start
print(json.dumps({"faces": done.faces, "seconds": seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "writer_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def _count(env: str, default: int) -> int:
    raw = os.environ.get(env, str(default))
    try:
        return max(1, int(raw))
    except ValueError:
        raise SystemExit(f"{env} = {raw!r}: need a number of faces") from None


def bench_shard_ingest() -> dict[str, object]:
    """Target: ≥ 1,500 faces/s on 2 cores for 112-px JPEGs that need no resize; shards ≤ 1.1× the ``.rec``; the
    writers' memory flat (it does not hold the faces)."""
    n = _count("FACEOPS_BENCH_FACES", 1_000_000)
    with tempfile.TemporaryDirectory() as tmp:
        rec = Path(tmp) / "train.rec"
        face_recordio(rec, n)
        rec_bytes = rec.stat().st_size + rec.with_suffix(".idx").stat().st_size
        result: dict[str, object] = {"faces": n, "cores": os.cpu_count(), "rec_mb": round(rec_bytes / 2**20, 1)}
        for suffix, pack_bytes in (("", PACK_BYTES), ("_member_per_face", 0)):
            folder = Path(tmp) / f"shards{suffix}"
            out = subprocess.run([sys.executable, "-c", CHILD, str(rec), str(folder), str(pack_bytes)],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            shard_bytes = sum(p.stat().st_size for p in folder.iterdir())
            result.update({f"seconds{suffix}": round(row["seconds"], 1),
                           f"faces_per_s{suffix}": round(row["faces"] / row["seconds"]),
                           f"shards{suffix}": len(list(folder.glob("*.tar"))),
                           f"disk_over_rec{suffix}": round(shard_bytes / rec_bytes, 3),
                           f"peak_rss_mb{suffix}": round(row["peak_rss_mb"], 1),
                           f"writer_peak_rss_mb{suffix}": round(row["writer_peak_rss_mb"], 1)})
            shutil.rmtree(folder)
        # the same conversion of a tenth of the faces: the writers' memory must not grow with the faces
        small = Path(tmp) / "small.rec"
        face_recordio(small, max(1, n // 10))
        out = subprocess.run([sys.executable, "-c", CHILD, str(small), str(Path(tmp) / "small"), str(PACK_BYTES)],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        result["writer_peak_rss_mb_tenth"] = round(row["writer_peak_rss_mb"], 1)
    return result


def _dvc(repo: Path, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, check=True, capture_output=True, text=True)
    return time.perf_counter() - start


def _repo(path: Path, remote: Path) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-q", "-d", "local", str(remote)], cwd=path,
                   check=True)
    return path


def bench_dvc_shards(n: int | None = None, kinds: tuple[str, ...] = ("loose", "shards")) -> dict[str, object]:
    """Target (per 1M faces): ``dvc status`` ≤ 5 s and ``dvc push`` ≤ 1 min to a local remote for shards."""
    from ml.data.shards import export_folder, shard_recordio

    n = n or _count("FACEOPS_BENCH_DVC_FACES", 100_000)
    out: dict[str, object] = {"faces": n}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        face_recordio(root / "train.rec", n)
        shard_recordio(root / "train.rec", root / "shards-src")
        for kind in kinds:
            repo = _repo(root / f"repo-{kind}", root / f"remote-{kind}")
            if kind == "loose":
                export_folder(root / "shards-src", repo / "faces")
            else:
                (root / "shards-src").rename(repo / "faces")
            out[f"{kind}_files"] = sum(1 for p in (repo / "faces").rglob("*") if p.is_file())
            out[f"{kind}_add_s"] = round(_dvc(repo, "add", "-q", "faces"), 1)
            out[f"{kind}_status_s"] = round(_dvc(repo, "status", "-q"), 2)
            out[f"{kind}_push_s"] = round(_dvc(repo, "push", "-q"), 1)
            if kind == "shards":
                out["shards_gb"] = round(sum(p.stat().st_size for p in (repo / "faces").iterdir()) / 1e9, 2)
    return out


def bench_dvc_shards_1m() -> dict[str, object]:
    """``bench_dvc_shards`` of a million faces as shards alone (as loose files they would take tens of minutes).
    Target: ``dvc status`` ≤ 5 s, ``dvc push`` ≤ 1 min to a local remote."""
    return bench_dvc_shards(1_000_000, ("shards",))


def bench_dvc_loose_1m() -> dict[str, object]:
    """The same million faces as one file each, the layout shards replaced: what the shards save at that size."""
    return bench_dvc_shards(1_000_000, ("loose",))
