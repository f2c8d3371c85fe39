"""Make a throw-away working copy of the project (tests and benchmarks run the pipeline there)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

OUTPUT_DIRS = ("data/", "models/", "metrics/", "plots/", "reports/")


def copy_project(src: Path, dst: Path) -> Path:
    """Copy ``src``'s tracked and untracked-but-not-ignored files (no outputs, no dvc.lock) into a new git repo."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=src, capture_output=True, text=True, check=True
    )
    for rel in listed.stdout.splitlines():
        path = src / rel
        if not path.is_file() or rel.startswith(OUTPUT_DIRS) or rel == "dvc.lock":
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / rel)
    env = {**os.environ, "GIT_AUTHOR_NAME": "faceops", "GIT_AUTHOR_EMAIL": "faceops@localhost",
           "GIT_COMMITTER_NAME": "faceops", "GIT_COMMITTER_EMAIL": "faceops@localhost"}
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True)
    subprocess.run(["git", "commit", "-qm", "snapshot", "--no-verify"], cwd=dst, check=True, env=env)
    return dst
