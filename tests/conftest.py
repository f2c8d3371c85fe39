"""Shared fixtures. Tests run offline and quiet; the servers they start listen on 127.0.0.1 only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from faceops.workspace import copy_project as _copy_project

REPO = Path(__file__).resolve().parents[1]
GLINT24 = REPO.parent / "shared" / "data" / "glint24"

for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_k, _v)


def copy_project(dst: Path) -> Path:
    return _copy_project(REPO, dst)


@pytest.fixture
def glint24() -> Path:
    if not GLINT24.is_dir():
        pytest.skip(f"real faces not available at {GLINT24} (shared/data/glint24 is not shipped with the product)")
    return GLINT24
