"""Every trainer keeps the same contract, checked over all six with tiny inputs: the same seed gives the same
weights bit for bit on the CPU, and a resume follows the one policy (``ml.train.checkpoint.check_resume``): another
recipe is refused naming the params key, where the run trains may change."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ml.errors import ConfigError
from tests.conftest import caface_toy, separable

pytestmark = pytest.mark.usefixtures("one_thread")


def _fr() -> tuple[Any, Callable[..., Any]]:
    from ml.fr.train import FRConfig, train_fr

    images, labels = separable(k=4, per_class=8, size=32)
    cfg = FRConfig(epochs=2, batch_size=16, embedding_dim=16, accelerator="cpu")
    return cfg, lambda c, **kw: train_fr(c, images, labels, backbone_overrides={"depth": 1}, progress=False, **kw).model


def _aligner() -> tuple[Any, Callable[..., Any]]:
    from ml.aligner.train import AlignerConfig, train_aligner

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (32, 64, 64, 3), dtype=np.uint8)
    landmarks = rng.uniform(20, 44, (32, 5, 2)).astype(np.float32)
    cfg = AlignerConfig(input_size=64, fpn_channels=16, mixer_depth=1, mixer_dim=8, mixer_token_hidden=8,
                        mixer_channel_hidden=8, epochs=2, batch_size=16, accelerator="cpu", seed=0)
    return cfg, lambda c, **kw: train_aligner(c, images, landmarks, progress=False, **kw).model


def _generator() -> tuple[Any, Callable[..., Any]]:
    from ml.generator.train import GeneratorConfig, train_generator
    from ml.generator.uiface import GeneratorModelConfig

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (16, 16, 16, 3), dtype=np.uint8)
    ids = rng.normal(size=(16, 32)).astype(np.float32)
    model = GeneratorModelConfig(image_size=16, block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4,
                                 id_dim=32, context_dim=16)
    cfg = GeneratorConfig(model=model, batch_size=8, epochs=2, accelerator="cpu", seed=0)
    return cfg, lambda c, **kw: train_generator(c, images, ids, progress=False, **kw).model


def _autoencoder() -> tuple[Any, Callable[..., Any]]:
    from ml.generator.autoencoder import AutoencoderConfig, train_autoencoder

    images = np.random.default_rng(0).integers(0, 256, (16, 16, 16, 3), dtype=np.uint8)
    cfg = AutoencoderConfig(block_out_channels=(8, 16), norm_num_groups=4, fr_weight=0.0, batch_size=8, epochs=2,
                            accelerator="cpu")
    return cfg, lambda c, **kw: train_autoencoder(c, images, progress=False, **kw)[0]


def _fusion() -> tuple[Any, Callable[..., Any]]:
    from ml.fusion.train import FusionConfig, train_fusion

    feats, styles, labels, _ = caface_toy(k=16, per=8)
    cfg = FusionConfig(feature_dim=32, style_dim=8, epochs=2, steps_per_epoch=2, batch_size=8, accelerator="cpu")
    return cfg, lambda c, **kw: train_fusion(c, feats, styles, labels, progress=False, **kw).model


def _discovery() -> tuple[Any, Callable[..., Any]]:
    from ml.discovery.train import DiscoveryConfig, train_discovery

    images, labels = separable(k=4, per_class=8, size=32)
    mask = labels < 2
    cfg = DiscoveryConfig(backbone_init="random", prefix_length=2, epochs=2, batch_size=16, warmup_epochs=0.0,
                          proj_dim=16, proj_hidden=32, proj_bottleneck=8, labelled_identities_per_batch=0,
                          val_per_identity=0, anchor_weight=0.0, accelerator="cpu")
    return cfg, lambda c, **kw: train_discovery(c, images, labels, mask, progress=False, **kw).model


# trainer → (params section its config is, a factory of (config, fit))
TRAINERS: dict[str, tuple[str, Callable[[], tuple[Any, Callable[..., Any]]]]] = {
    "train_fr": ("fr", _fr),
    "train_aligner": ("aligner.train", _aligner),
    "train_generator": ("generator.train", _generator),
    "train_autoencoder": ("generator.autoencoder_train", _autoencoder),
    "train_fusion": ("fusion.train", _fusion),
    "train_discovery": ("discovery", _discovery),
}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_the_same_seed_gives_the_same_weights(name):
    _, factory = TRAINERS[name]
    cfg, fit = factory()
    a, b = _weights(fit(cfg)), _weights(fit(cfg))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("name", list(TRAINERS))
def test_resume_refuses_another_recipe_and_allows_another_device_setting(name, tmp_path: Path):
    section, factory = TRAINERS[name]
    cfg, fit = factory()
    one = dataclasses.replace(cfg, epochs=1)
    fit(one, checkpoint_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"{section}\.lr: "):
        fit(dataclasses.replace(cfg, lr=cfg.lr * 3), checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ConfigError, match="resume=True"):  # an existing checkpoint is never overwritten silently
        fit(cfg, checkpoint_dir=tmp_path)
    fit(dataclasses.replace(cfg, precision="bf16-mixed"), checkpoint_dir=tmp_path, resume=True)  # where, not what
