"""The long-preset report (experiments/uiface_long.py): both runs' targets side by side from their metrics files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from experiments import uiface_long


def _run(root, face_share, accuracy, seconds, run_file=False):
    (root / "metrics").mkdir(parents=True)
    (root / "plots").mkdir()
    synth = {"synthetic/judge/face_share": face_share, "synthetic/judge/real_at_size_face_share": 0.8,
             "synthetic/judge/detector_face_share": 0.6, "synthetic/judge/detector_real_at_size_face_share": 0.6,
             "synthetic/judge/frechet": 2.0, "synthetic/judge/frechet_nonface": 10.0, "synthetic/seconds": 100.0,
             "synthetic/identities": 4.0, "synthetic/images": 16.0}
    evaluate = {"synthetic/verification/procedural/accuracy": accuracy,
                "real_matched/verification/procedural/accuracy": 0.75,
                "baseline/linear_probe/verification/procedural/accuracy": 0.70}
    (root / "metrics" / "synthesize.json").write_text(json.dumps(synth))
    (root / "metrics" / "evaluate.json").write_text(json.dumps(evaluate))
    (root / "metrics" / "train_generator.json").write_text(json.dumps({"train/seconds": seconds}))
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / "plots" / "synthetic_samples.png")
    if run_file:
        (root / uiface_long.RUN_FILE).write_text(json.dumps(
            {"commit": "abc", "minutes": 95.0, "stage_s": {"train_generator": 4000.0, "synthesize": 200.0},
             "cpu": "CPU", "cores": 2, "cpu_has_bf16": True, "cpu_has_amx": False}))


def test_the_report_sets_each_target_of_both_runs_side_by_side(tmp_path):
    default, long = tmp_path / "default", tmp_path / "long"
    _run(default, face_share=0.2, accuracy=0.70, seconds=400.0)
    _run(long, face_share=0.76, accuracy=0.74, seconds=4000.0, run_file=True)
    text = uiface_long.write(long, out_root=default)
    row = lambda what: next(line for line in text.splitlines() if line.startswith(f"| {what} |"))  # noqa: E731
    # 0.2 / 0.8 of real faces' rate: missed; 0.76 / 0.8 = 95 %: met
    assert row("synthetic faces the aligner calls faces, % of real faces at their size") == (
        "| synthetic faces the aligner calls faces, % of real faces at their size | ≥ 90 % | 25.0 % (missed) | 95.0 % |")
    assert row("synthetic-trained FR − `real_matched` (`procedural.bin`)").endswith(
        "| -5.0 pp (missed) | -1.0 pp |")
    assert row("`train_generator` + `synthesize` seconds").endswith("| 500.0 s | 4100.0 s (missed) |")
    assert "took 95.0 min wall" in text and "`train_generator` 4000 s" in text
    assert "](uiface_long/synthetic_samples.png)" in text and "../plots/" not in text
    assert (default / "reports" / "uiface_long" / "synthetic_samples.png").is_file()
    stored = json.loads((default / "metrics" / "uiface_long.json").read_text())
    assert stored["uiface_long"]["synthetic faces YuNet detects, % of real faces at their size"]["met"] is True


def test_a_finished_run_is_recorded_from_its_summary_table(tmp_path):
    stdout = "  prepare  ran  53.5s\n  train_generator  ran  4012.0s\nnoise\n  evaluate  restored  1.0s\n"
    assert uiface_long.stage_seconds(stdout) == {"prepare": 53.5, "train_generator": 4012.0, "evaluate": 1.0}
    with pytest.raises(SystemExit):
        uiface_long.main(["--workspace", str(tmp_path), "--log", str(tmp_path / "log")])  # no wall time


def test_the_denoising_profile_of_an_exact_and_of_a_useless_unet():
    """A UNet that knows ε removes all the noise (cosine 1, norm ratio 1, x̂_0 exact); one that answers 0 removes
    none (x̂_0's error is the noisy input's own)."""
    import torch

    from ml.generator.train import make_noise_scheduler

    schedule = {"num_train_timesteps": 1000, "beta_start": 1e-4, "beta_end": 0.02, "beta_schedule": "linear",
                "prediction_type": "epsilon"}
    abar = make_noise_scheduler(schedule).alphas_cumprod.double()
    x0 = torch.rand(4, 3, 8, 8) * 2 - 1
    oracle = lambda x_t, t, c: ((x_t.double() - abar[t[0]].sqrt() * x0) / (1 - abar[t[0]]).sqrt()).float()  # noqa: E731
    exact = uiface_long.denoising_profile(oracle, x0, None, schedule, timesteps=(20, 300))
    assert [r["t"] for r in exact] == [20, 300]
    for r in exact:
        assert r["eps_cosine"] == pytest.approx(1.0, abs=1e-5) and r["eps_norm_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert r["x0_mse"] < 1e-9 < r["undenoised_mse"]
    assert exact[0]["sigma"] == pytest.approx(float(((1 - abar[20]) / abar[20]).sqrt()))
    useless = uiface_long.denoising_profile(lambda x_t, t, c: torch.zeros_like(x_t), x0, None, schedule, timesteps=(60,))
    assert useless[0]["eps_norm_ratio"] == 0.0
    assert useless[0]["x0_mse"] == pytest.approx(useless[0]["undenoised_mse"])


def test_a_stage_metrics_file_is_read_flat_wrapped_or_not(tmp_path):
    from tasks.common import read_stage_metrics

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "discovery.json").write_text(json.dumps({"metrics": {"a/b": 0.5}, "seconds": 3}))
    (tmp_path / "metrics" / "evaluate.json").write_text(json.dumps({"a/b": 0.25}))
    assert read_stage_metrics(tmp_path, "discovery") == {"a/b": 0.5}
    assert read_stage_metrics(tmp_path, "evaluate") == {"a/b": 0.25}
    assert read_stage_metrics(tmp_path, "synthesize") == {}  # not written yet
