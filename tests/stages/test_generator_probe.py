"""experiments/generator_probe.py: the spread over probe seeds against hand-computed values, the sweep's margin set
beside it, and clear refusals."""

from __future__ import annotations

import pytest

from experiments.generator_probe import main, render, summarise


def _row(seed: int, objective: float) -> dict[str, float]:
    return {"seed": seed, "val/objective": objective, "val/identity_gap": objective - 0.1, "val/accuracy": 0.1,
            "val/chance": 0.02}


def test_spread_and_the_sweep_margin_in_units_of_it():
    rows = [_row(0, 0.50), _row(1, 0.54), _row(2, 0.58)]  # mean 0.54, sample std 0.04
    sweep = {"study": "val-train_generator", "metric": "val/objective", "baseline": {"value": 0.55, "gain": 0.01},
             "best": {"value": 0.56, "number": 3}}
    s = summarise(rows, sweep)
    assert s["val/objective"]["mean"] == pytest.approx(0.54) and s["val/objective"]["std"] == pytest.approx(0.04)
    assert s["val/accuracy"]["std"] == 0
    assert s["sweep"]["gain_over_std"] == pytest.approx(0.25) and s["sweep"]["best_trial"] == 3
    text = render({"rows": rows, "summary": s, "measured_at": "2026-01-01 00:00 UTC"})
    assert "| mean ± std | 0.5400 ± 0.0400 |" in text and "within the probe's noise, so the default stays" in text
    wide = summarise(rows, {**sweep, "baseline": {"value": 0.45, "gain": 0.11}})
    assert "beyond twice the probe's std" in render({"rows": rows, "summary": wide, "measured_at": "now"})
    assert "sweep" not in summarise(rows, None)
    with pytest.raises(Exception, match="at least two probe seeds"):
        summarise(rows[:1])


def test_refuses_one_seed_and_a_run_without_a_generator(tmp_path, capsys):
    (tmp_path / "params.yaml").write_text("data: {}\n")
    for argv, message in ((["--seeds", "0"], "at least two --seeds"), ([], "holds no generator")):
        with pytest.raises(SystemExit) as exc:
            main(["--root", str(tmp_path), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "metrics").exists()
