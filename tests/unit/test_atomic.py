"""What a writer killed mid-write leaves beside its target is removed by the next writer, and only that."""

from __future__ import annotations

import os
import subprocess

from ml.atomic import atomic_path, remove_dead_temporaries
from ml.data.dataset import DatasetWriter


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_temporaries_of_dead_writers_of_that_target_are_removed(tmp_path):
    dead = _dead_pid()
    leftovers = [f".prepared.{dead}.tmp", f".prepared.{dead}.k2x9.tmp", f".prepared.{dead}.old"]
    kept = [f".prepared.{os.getpid()}.tmp", ".prepared.notapid.tmp", f".other.{dead}.tmp", "prepared"]
    for name in leftovers + kept:
        (tmp_path / name).mkdir()
    (tmp_path / leftovers[0] / "0001.png").write_bytes(b"half a dataset")
    remove_dead_temporaries(tmp_path / "prepared")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


def test_every_atomic_writer_clears_a_killed_writers_leftovers(tmp_path):
    import numpy as np

    dead = _dead_pid()
    for target in ("report.json", "train"):
        (tmp_path / f".{target}.{dead}.tmp").mkdir()
    with atomic_path(tmp_path / "report.json") as tmp:
        tmp.write_text("{}")
    with DatasetWriter(tmp_path / "train", name="train", source="procedural", aligned=True) as w:
        w.add(np.zeros((32, 32, 3), np.uint8), identity="a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "train"]
