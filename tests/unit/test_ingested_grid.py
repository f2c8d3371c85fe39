"""The real-data report's sample grid: one row per identity in order of first appearance, its images left to right."""

from __future__ import annotations

import numpy as np
from PIL import Image

from ml.data.dataset import DatasetWriter
from tasks.prepare import ingested_grid

SIZE, PAD = 8, 2


def _cell(grid: np.ndarray, row: int, col: int) -> np.ndarray:
    y0, x0 = PAD + row * (SIZE + PAD), PAD + col * (SIZE + PAD)
    return grid[y0:y0 + SIZE, x0:x0 + SIZE]


def test_each_identity_fills_its_own_row_in_order_and_extra_rows_and_columns_stay_blank(tmp_path):
    order = ["bo", "al", "bo", "cy", "al", "bo", "bo"]  # bo: 4 images, one more than the grid's 3 columns
    with DatasetWriter(tmp_path / "ds", name="toy", source="real", aligned=True) as w:
        for i, identity in enumerate(order):
            w.add(np.full((SIZE, SIZE, 3), 10 * (i + 1), np.uint8), identity=identity)
    ingested_grid(tmp_path / "ds", tmp_path / "grid.png", rows=2, cols=3)
    grid = np.asarray(Image.open(tmp_path / "grid.png").convert("RGB"))
    assert grid.shape == (2 * (SIZE + PAD) + PAD, 3 * (SIZE + PAD) + PAD, 3)
    expected = {(0, 0): 10, (0, 1): 30, (0, 2): 60, (1, 0): 20, (1, 1): 50}  # bo's 4th and cy are left out
    for (row, col), value in expected.items():
        assert (_cell(grid, row, col) == value).all(), (row, col)
    assert (_cell(grid, 1, 2) == 255).all()  # al has two images: the third cell stays white
