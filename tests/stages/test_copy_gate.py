"""experiments/copy_gate.py: the planted copies' report, and `_decode_off` moving latents by ε × their std."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from experiments.copy_gate import _decode_off, main, render


def _results() -> dict:
    row = lambda cos, copy: {"faces": 200, "cosine_median": 0.85, "rms_median": 0.01,  # noqa: E731
                             "cosine_gate": cos, "copy_gate": copy, "either": max(cos, copy)}
    return {"kinds": {"copies, ε = 0": row(0.105, 1.0), "the run's synthetic set": row(0.0, 0.0)}, "size": 32,
            "cosine": {"threshold": 0.918, "source": "p99 of 350 real reference values", "reference_median": 0.742},
            "copy": {"threshold": 0.0386, "source": "p0.1 of 3600 real reference values", "reference_median": 0.0901},
            "seconds": 120.0, "measured_at": "2026-01-01 00:00 UTC"}


def test_the_report_names_both_thresholds_and_each_planted_kind(tmp_path):
    text = render(_results())
    assert "above 0.918 (p99 of 350 real reference values" in text and "below 0.0386 (p0.1 of 3600" in text
    assert "| copies, ε = 0 | 200 | 0.850 | 0.0100 | 10.5 % | 100.0 % | 100.0 % |" in text
    assert "Chosen on: nothing" in text and "no test split" in text
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "copy_gate.json").write_text(json.dumps(_results()))
    main(["--root", str(tmp_path), "--render"])
    assert (tmp_path / "reports" / "copy_gate.md").read_text() == text


def test_a_copy_is_decoded_from_latents_moved_by_eps_times_their_std():
    from ml.generator.autoencoder import AutoencoderConfig, build_autoencoder, reconstruct

    torch.manual_seed(0)
    decoder = build_autoencoder(AutoencoderConfig(block_out_channels=(8, 16)), 16).eval()
    faces = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_decode_off(decoder, faces, 0.0, seed=0), reconstruct(decoder, faces)[0])
    near, far = (_decode_off(decoder, faces, eps, seed=0).astype(float) for eps in (0.1, 2.0))
    exact = reconstruct(decoder, faces)[0].astype(float)
    assert 0 < np.abs(near - exact).mean() < np.abs(far - exact).mean()  # further off with ε
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(_decode_off(decoder, faces, 0.5, seed=0), _decode_off(decoder, faces, 0.5, 1))
