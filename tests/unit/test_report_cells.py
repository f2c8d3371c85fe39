"""reports/benchmark.md's TAR@FAR cells: a threshold set by fewer than ten impostor scores is marked, with its count,
in the template table and the set-fusion table alike."""

from __future__ import annotations

from tasks.evaluate.fusion import render_section
from tasks.evaluate.cells import FEW_FALSE_ACCEPTS_NOTE, few_false_accepts
from tasks.evaluate.report import templates_section


def test_a_cell_under_ten_false_accepts_is_italic_with_its_count():
    assert few_false_accepts("13.33 %", "tar@far=1e-4", 15930) == "*13.33 %* (1.6 FA)"  # 1e-4 × 15,930 = 1.593
    assert few_false_accepts("39.44 %", "tar@far=1e-3", 15930) == "39.44 %"  # 15.9 false accepts
    assert few_false_accepts("5.0", 1e-3, 10_000) == "5.0"  # exactly 10: enough
    assert few_false_accepts("5.0", 1e-3, 9_999) == "*5.0* (10.0 FA)"  # 9.999, shown rounded
    assert few_false_accepts("—", 1e-5, 100) == "—" and few_false_accepts("5.0", 1e-5, None) == "5.0"


def test_both_tables_mark_their_thin_cells_and_say_why_once():
    metrics = {"real/templates/tar@far=1e-4": 0.1333, "real/templates/tar@far=1e-2": 0.7333,
               "real/templates/pairs": 16110, "real/templates/impostor_pairs": 15930}
    lines = templates_section(metrics, ["real"])
    row = next(line for line in lines if line.startswith("| `real`"))
    assert row == "| `real` | *13.33 %* (1.6 FA) | 73.33 % | 16110 (15930) |"
    assert lines.count(FEW_FALSE_ACCEPTS_NOTE) == 1
    plenty = {**metrics, "real/templates/impostor_pairs": 10**6}
    assert FEW_FALSE_ACCEPTS_NOTE not in templates_section(plenty, ["real"])
    sets = {f"sets/templates/average/tar@far={f}": 0.5 for f in ("1e-5", "1e-4", "1e-3", "1e-2")}
    text = "\n".join(render_section({**sets, "sets/templates/average/n_impostor": 15930}))
    assert "| average | *50.0* (0.2 FA) | *50.0* (1.6 FA) | 50.0 | 50.0 |" in text
    assert text.count(FEW_FALSE_ACCEPTS_NOTE) == 1
