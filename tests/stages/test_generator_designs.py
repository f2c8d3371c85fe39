"""The generator design comparison: each design is a valid params delta, deltas nest, and the report shows each
judge beside its real-face rate (a dash where YuNet could not run)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.generator_designs import DESIGNS, design_section, report, with_delta
from ml.config import from_mapping
from ml.errors import ConfigError
from tasks.common import Paths, load_params, section
from tasks.train_generator import GeneratorStageConfig


def test_deltas_set_nested_keys_and_leave_the_rest():
    base = {"space": "latent", "train": {"epochs": 3, "model": {"image_size": 8}}}
    out = with_delta(base, {"space": "pixel", "train.model.patch_size": 2})
    assert out == {"space": "pixel", "train": {"epochs": 3, "model": {"image_size": 8, "patch_size": 2}}}
    assert base["train"]["model"] == {"image_size": 8}  # a copy


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_every_design_is_a_valid_generator_section(name):
    params = section(load_params(Paths().params), "generator")
    cfg = from_mapping(GeneratorStageConfig, design_section(params, name), "generator")
    # every design makes 32-px faces: the pixels themselves, or a latent its own autoencoder decodes to that size
    factor = cfg.autoencoder_train.factor if cfg.space == "latent" else 1
    assert cfg.train.model.image_size * factor == 32
    if cfg.space == "latent":
        assert cfg.train.model.in_channels == cfg.autoencoder_train.latent_channels
    with pytest.raises(ConfigError):  # a misspelt key in a design is refused, not ignored
        from_mapping(GeneratorStageConfig, with_delta(design_section(params, name), {"train.epoch": 3}), "generator")


def test_designs_keep_their_base_when_the_default_moves():
    """A design row means what was measured: its delta applies to BEFORE (the KL latent), whatever params.yaml's
    default is now; the design make run adopted is the default itself on that base."""
    params = section(load_params(Paths().params), "generator")
    kl = from_mapping(GeneratorStageConfig, design_section(params, "kl"), "generator")
    assert (kl.autoencoder_train.architecture, kl.train.model.in_channels, kl.train.prediction_type) == \
        ("kl", 4, "epsilon")
    moved = with_delta(params, {"train.prediction_type": "edm", "train.loss_weighting": "uniform", "train.lr": 0.5})
    assert design_section(moved, "edm_p2") == design_section(params, "edm_p2")  # every key a design reads is fixed
    adopted = from_mapping(GeneratorStageConfig, design_section(params, "tiny32_f2_c2_lean"), "generator")
    default = from_mapping(GeneratorStageConfig, params, "generator")  # the design adopted, in the stage's precision
    assert dataclasses.replace(adopted.train, precision=default.train.precision) == default.train
    assert dataclasses.replace(adopted.autoencoder_train, precision=default.autoencoder_train.precision) == \
        default.autoencoder_train


def test_report_puts_each_judge_beside_its_real_rate():
    row = {"design": "edm_p2", "what": "x", "train/seconds": 300.0, "sample/ms_per_face": 80.0,
           "judge/face_share": 0.25, "judge/real_at_size_face_share": 0.9, "context_cosine": 0.3,
           "identity_consistency": 0.4}
    line = next(line for line in report([row]).splitlines() if line.startswith("| `edm_p2`"))
    assert "| 25.0 % (90.0 %) | — (—) | 0.300 | 0.400 |" in line
    assert "![edm_p2](generator_designs/edm_p2.png)" in report([row])


def test_report_adds_the_autoencoder_ceilings_when_measured():
    row = {"design": "tiny_f2_c2", "what": "x", "train/seconds": 250.0, "psnr": 27.31,
           "judge/face_share": 0.59, "judge/real_at_size_face_share": 0.93,
           "judge/detector_face_share": 0.52, "judge/detector_real_at_size_face_share": 0.63}
    assert "ceiling" not in report([])
    text = report([], [row])
    line = next(line for line in text.splitlines() if line.startswith("| `tiny_f2_c2`"))
    assert line == "| `tiny_f2_c2` | 250 | 27.3 | 59.0 % (93.0 %) | 52.0 % (63.0 %) | x |"
    assert "![autoencoder tiny_f2_c2](generator_designs/autoencoder_tiny_f2_c2.png)" in text


def test_report_puts_the_stage_contexts_beside_real_faces_contexts():
    rows = [{"contexts": "candidates", "guidance_scale": 1.0, "judge/face_share": 0.06,
             "judge/real_at_size_face_share": 0.95, "context_cosine": 0.434, "identity_consistency": 0.413},
            {"contexts": "val faces", "guidance_scale": 2.0, "judge/face_share": 0.1,
             "judge/real_at_size_face_share": 0.95, "judge/detector_face_share": 0.34,
             "judge/detector_real_at_size_face_share": 0.69, "context_cosine": 0.5, "identity_consistency": 0.47}]
    assert "## Identity contexts" not in report([])
    lines = report([], [], rows).splitlines()
    assert "| candidates | 1 | 6.0 % (95.0 %) | — (—) | 0.434 | 0.413 |" in lines
    assert "| val faces | 2 | 10.0 % (95.0 %) | 34.0 % (69.0 %) | 0.500 | 0.470 |" in lines
