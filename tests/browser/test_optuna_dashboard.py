"""Optuna's dashboard on a sweep's study, as `docs/operations/sweeps.md` tells a user to open it: `optuna-dashboard
sqlite:///optuna.db` lists the study faceops made (its stage and metric as attributes) and draws its history, with
nothing loaded from outside the machine."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.servers import QUIET, free_port, spawn, stop, wait_healthy

pytestmark = pytest.mark.slow


def _study(db: Path) -> str:
    """A finished study as a sweep leaves it: faceops' storage (heartbeats on) and study attributes, five trials."""
    import optuna

    from ops.sweep.config import open_storage, resolve_storage

    storage = open_storage(resolve_storage(f"sqlite:///{db}", db.parent, "--storage"), heartbeat_s=60)
    study = optuna.create_study(storage=storage, study_name="train_fr-dashboard", direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    study.set_user_attr("faceops.stage", "train_fr")
    study.set_user_attr("faceops.metric", "val/accuracy")
    study.optimize(lambda t: 1.0 - (t.suggest_float("fr.lr", 1e-4, 1e-2, log=True) - 2e-3) ** 2, n_trials=5)
    return study.study_name


def test_optuna_dashboard_shows_a_sweeps_study(page, tmp_path):
    name = _study(tmp_path / "optuna.db")
    port = free_port()
    refused: list[str] = []

    def route(r):
        if r.request.url.startswith(f"http://127.0.0.1:{port}/"):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    proc = spawn([str(Path(sys.executable).parent / "optuna-dashboard"), f"sqlite:///{tmp_path / 'optuna.db'}",
                  "--host", "127.0.0.1", "--port", str(port), "--quiet"], env={**os.environ, **QUIET},
                 log=tmp_path / "dashboard.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/api/studies", proc)
        page.goto(f"http://127.0.0.1:{port}/dashboard")
        page.get_by_text(name).first.wait_for()
        page.get_by_text(name).first.click()
        page.locator(".js-plotly-plot").first.wait_for()  # the study page's history chart
        assert page.get_by_text("Best Trial").first.is_visible() or page.get_by_text("Best Trials").first.is_visible()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        stop(proc)
    assert (tmp_path / "dashboard.png").stat().st_size > 5_000
    assert refused == []  # the dashboard's bundle is served by itself, not a CDN
