"""Cleaning up after writers killed mid-write.

Every atomic writer in faceops (``tasks.common.atomic_path``, ``ml.data.dataset.DatasetWriter`` and
``write_manifest``, ``ml.models.io.write_model_dir``) writes to a hidden
sibling ``.<name>.<pid>.<...>.tmp`` (or moves the old version aside to ``.<name>.<pid>.old``) and renames it into
place. A SIGKILL between the two leaves that sibling behind, as large as the output (a whole dataset for
``prepare``) and outside anything DVC tracks or cleans; the next writer of the same target removes it when the
process named in it is gone.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
from collections.abc import Callable
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


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` to a hidden sibling of ``path`` (``.<name>.<pid>.tmp``), renamed onto ``path`` on success and
    removed on failure; a dead writer's leftover is cleaned first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
