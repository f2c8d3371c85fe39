"""reports/benchmark.md's cells: a TAR@FAR threshold set by fewer than ten impostor scores is marked, with its count,
in the template table and the set-fusion table alike; the synthetic set's gates table, the copy gate included."""

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


def test_the_gates_table_shows_consistency_before_its_own_filter_and_the_copy_gate_below_its_threshold():
    from tasks.evaluate.synthetic import gates_table

    gate = lambda name, value, pct, median, size: {  # noqa: E731
        f"synthetic/gate/{name}/threshold": value, f"synthetic/gate/{name}/percentile": pct,
        f"synthetic/gate/{name}/reference_median": median, f"synthetic/gate/{name}/reference_size": size}
    synth = {**gate("privacy", 0.821, 50, 0.821, 50), **gate("memorisation", 0.918, 99, 0.742, 350),
             **gate("consistency", 0.368, 5, 0.564, 50), **gate("copy", 0.0386, 0.1, 0.0901, 3600),
             "synthetic/nearest_train_pixel_distance_min": 0.0446, "synthetic/pixel_copies": 2,
             "synthetic/identity_consistency_min": 0.390, "synthetic/identity_consistency_min_before_gates": 0.301,
             "synthetic/dropped_inconsistent": 1}
    row = next(line for line in gates_table(synth) if line.startswith("| copy |"))
    assert "| 0.039 | p0.1 of 3600 real values | 0.090 | 0.045 (min) | 2 faces below" in row
    row = next(line for line in gates_table(synth) if line.startswith("| consistency |"))
    assert "| 0.301 (min before the gates) | 1 identities below: dropped |" in row  # not the kept ones' 0.390
    before = {k: v for k, v in synth.items() if "/copy/" not in k}  # a run from before the copy gate
    assert not [line for line in gates_table(before) if line.startswith("| copy |")]
    assert len([line for line in gates_table(before) if line.startswith("| ")]) == 1 + 3  # the header, 3 gates
