"""The one atomic writer (``atomic_path``) and the cleaning up after writers killed mid-write.

Every output faceops writes (a file or a whole directory; ``ml.data.dataset.DatasetWriter`` and
``ml.models.io.write_model_dir`` build on it the same way) is written to a hidden
sibling ``.<name>.<pid>.<...>.tmp`` (or moves the old version aside to ``.<name>.<pid>.old``) and renames it into
place. A SIGKILL between the two leaves that sibling behind, as large as the output (a whole dataset for
``prepare``) and outside anything DVC tracks or cleans; the next writer of the same target removes it when the
process named in it is gone.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_temporaries(path: Path) -> None:
    """Delete ``path``'s temporary siblings ``.<name>.<pid>[.<any>].tmp`` / ``.<name>.<pid>.old`` (files or
    directories) whose writer no longer runs; a live writer's temporaries are kept."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.(?:(?:[^/]*\.)?tmp|old)")
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*"):
        match = pattern.fullmatch(tmp.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        log.info("removing %s, left by a writer that died mid-write", tmp)
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(target: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling path; on success move it onto ``target``, on error delete it.

    Works for files and directories: whatever the body creates at the yielded path replaces
    ``target`` in one rename, so readers never see half-written output.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent))
    tmp.rmdir()  # the body decides whether it is a file or a directory
    try:
        yield tmp
        if not tmp.exists():
            raise RuntimeError(f"nothing was written for {target}")
        if target.is_dir() and not target.is_symlink():
            old = target.with_name(f".{target.name}.{os.getpid()}.old")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
