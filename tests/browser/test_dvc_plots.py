"""DVC's plots page opened as on an air-gapped machine: `faceops plots`, and plain `dvc plots show` in a checkout set
up as `make setup` sets it up, draw every declared curve and figure with no request leaving the file, where DVC's
default page asks a CDN for Vega and stays blank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
DVC_YAML = """\
stages: {}
plots:
  - loss and val accuracy:
      x: epoch
      y:
        plots/history.csv: [train/loss, val/accuracy]
  - plots/figure.png
"""


def _project(root: Path) -> Path:
    """A git + DVC repository declaring one curve over a history CSV and one PNG figure."""
    (root / "plots").mkdir(parents=True)
    rows = ["epoch,train/loss,val/accuracy"] + [f"{e},{2.0 / (e + 1):.3f},{0.1 * e:.2f}" for e in range(6)]
    (root / "plots" / "history.csv").write_text("\n".join(rows) + "\n")
    Image.fromarray(np.full((40, 60, 3), (200, 30, 30), np.uint8)).save(root / "plots" / "figure.png")
    (root / "dvc.yaml").write_text(DVC_YAML)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=root, env=env, check=True)
    return root


def test_faceops_plots_draws_every_plot_with_no_network(offline, tmp_path, monkeypatch):
    from faceops.plots import render

    page, refused = offline
    root = _project(tmp_path / "proj")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    index = render(root, root / "dvc_plots")
    html = index.read_text()
    assert "cdn.jsdelivr" not in html and "vegaEmbed" in html
    page.goto(index.as_uri())
    page.wait_for_selector(".vega-embed canvas, .vega-embed svg", state="attached")
    chart = page.locator(".vega-embed").first
    box = chart.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 100  # a drawn chart, not an empty div
    figure = page.locator("img").first
    assert figure.evaluate("img => img.complete && img.naturalWidth") == 60
    page.screenshot(path=str(tmp_path / "plots.png"), full_page=True)
    assert (tmp_path / "plots.png").stat().st_size > 5_000
    assert refused == []  # nothing outside the file was even asked for


def _dvc_plots_show(root: Path) -> Path:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["dvc", "plots", "show", "-o", "out"], cwd=root, env=env, check=True, capture_output=True)
    return root / "out" / "index.html"


def test_plain_dvc_plots_show_draws_offline_with_the_projects_dvc_config(offline, tmp_path):
    page, refused = offline
    root = _project(tmp_path / "proj")
    shutil.copy(REPO / ".dvc" / "config", root / ".dvc" / "config")  # plots.html_template
    subprocess.run([sys.executable, "-m", "faceops.plots"], cwd=root, check=True, capture_output=True)  # make setup
    page.goto(_dvc_plots_show(root).as_uri())
    page.wait_for_selector(".vega-embed canvas, .vega-embed svg", state="attached")
    assert page.locator("img").first.evaluate("img => img.complete && img.naturalWidth") == 60
    assert refused == []


def test_dvc_plots_show_without_the_template_needs_a_cdn(offline, tmp_path):
    """Why the template exists: DVC's default page asks jsdelivr for Vega, and offline it draws nothing."""
    page, refused = offline
    page.goto(_dvc_plots_show(_project(tmp_path / "proj")).as_uri())
    page.wait_for_timeout(1000)
    assert any("jsdelivr" in url for url in refused)
    assert page.locator(".vega-embed canvas, .vega-embed svg").count() == 0
