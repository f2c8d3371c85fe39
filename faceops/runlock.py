"""One ``faceops run`` at a time per working copy.

``faceops run`` holds DVC's repository lock only while it checks a stage and commits its outputs, so that
independent stages can run side by side (``flows/pipeline.py``). Two ``faceops run`` commands in the same
working copy would therefore both run the same stage at once and write the same outputs. The second one is
refused instead: the first holds an ``flock`` on ``.faceops/run.lock`` for its whole run and records in the file
who it is, which the refusal quotes. The kernel drops an ``flock`` when its process dies, so a killed run never
leaves a stale lock behind. POSIX only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ml.errors import FaceopsError

LOCK_FILE = Path(".faceops") / "run.lock"


class RunLocked(FaceopsError, RuntimeError):
    """Another ``faceops run`` is reproducing the pipeline in the same working copy."""


@contextlib.contextmanager
def run_lock(root: Path) -> Iterator[Path]:
    """Hold ``root/.faceops/run.lock`` for the block; RunLocked, naming the holder, when another process has it."""
    import fcntl

    path = Path(root) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "a process that has not written its name yet"
            raise RunLocked(
                f"another `faceops run` is reproducing the pipeline in {Path(root).resolve()} ({holder}); two runs at "
                f"once would run the same stages into the same outputs. Wait for it to finish (or stop it) and run "
                f"again. Lock: {path}") from None
        fh.seek(0)
        fh.truncate()
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        fh.write(f"pid {os.getpid()}, started {started}: {' '.join(sys.argv[1:]) or 'faceops run'}\n")
        fh.flush()
        try:
            yield path
        finally:
            fh.seek(0)
            fh.truncate()  # an empty file: nobody holds it
