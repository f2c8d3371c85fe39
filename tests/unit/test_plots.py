"""Plots people look at say what they show: labelled rows, and lines drawn on top of each other named together."""

from __future__ import annotations

import numpy as np

from tasks.common import coinciding


def test_aligned_samples_rows_are_labelled(tmp_path):
    from PIL import Image

    from tasks.align import sample_grid

    rng = np.random.default_rng(0)
    blank = np.full((4, 128, 128, 3), 255, np.uint8)
    sample_grid(blank, np.full((4, 64, 64, 3), 255, np.uint8), tmp_path / "a.png", margin=64)
    labelled = np.asarray(Image.open(tmp_path / "a.png").convert("L"))  # saved at twice the size
    margin, rows = labelled[:, : 2 * 64], [labelled[4: 2 * 66], labelled[2 * 66 + 4:]]
    assert (margin < 128).any()
    for row in rows:  # each row has dark text in the margin, nothing else is dark (the faces are blank)
        assert (row[:, : 2 * 64] < 128).sum() > 50
        assert (row[:, 2 * 64:] == 255).all()
    faces = rng.integers(0, 255, (12, 96, 96, 3), dtype=np.uint8)
    sample_grid(faces, faces[:, ::2, ::2], tmp_path / "b.png", n=10)
    assert Image.open(tmp_path / "b.png").size == (2 * (64 + 10 * 50 + 2), 2 * (2 * 50 + 2))


def test_coinciding_curves_are_grouped():
    curves = {"average": {1: 0.5, 4: 0.75}, "norm_weighted": {1: 0.5, 4: 0.75 + 1e-12},
              "caface": {1: 0.5, 4: 0.8}, "landmark_score": {1: 0.5, 4: 0.75}, "short": {1: 0.5}}
    assert coinciding(curves) == [["average", "norm_weighted", "landmark_score"], ["caface"], ["short"]]
    assert coinciding({"a": {1: float("nan")}, "b": {1: float("nan")}}) == [["a"], ["b"]]
