"""ViT backbones: named variants, patching, attention-bias hook, token masking, errors (the registry contract of every
backbone: tests/contract/test_backbones.py)."""

import json

import pytest
import torch

from ml.errors import ConfigError, DataError
from ml.fr.backbones import build_backbone, input_contract
from ml.fr.backbones.vit import INPUT_CONTRACT, ViT, vit_t, vit_tiny
from ml.models.io import CONFIG, WEIGHTS, load_model, save_model

# Small enough for the CPU, but each entry keeps its own image and patch size.
TINY = dict(depth=1, dim=32, heads=2, embed_dim=16, drop_path=0.0)
# per family: the registry contract test covers every entry with the family's tiny overrides
TINY_BY_FAMILY = {"vit": TINY, "iresnet": dict(img_size=32, embed_dim=16, width=0.125)}


def tiny_kwargs(name: str) -> dict:
    return next(v for k, v in TINY_BY_FAMILY.items() if name.startswith(k))


def _images(model: torch.nn.Module, b: int = 3, seed: int = 0) -> torch.Tensor:
    size = model.input_contract["size"]
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


def test_named_variant_sizes():
    # Sizes from meta-device builds: no weights are allocated.
    assert input_contract("vit_tiny") == {**INPUT_CONTRACT, "size": 64, "embedding_dim": 128, "style_dim": 256}
    for name in ("vit_t", "vit_s", "vit_b", "vit_l"):
        assert input_contract(name)["size"] == 112
        assert input_contract(name)["embedding_dim"] == 512


def test_patch9_on_112_gives_144_tokens_and_ignores_last_4_pixels():
    model = vit_t(**TINY).eval()
    assert model.num_patches == 144
    x = _images(model, b=2)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape == (2, 144, 32)
        # The stride-9 convolution covers 12·9 = 108 px; rows/columns 108..111 are never read.
        x2 = x.clone()
        x2[:, :, 108:, :] = 5.0
        x2[:, :, :, 108:] = -5.0
        assert torch.equal(model(x2), model(x))


def test_wrong_image_size_raises_data_error():
    model = vit_tiny(**TINY).eval()
    with pytest.raises(DataError, match="64, 64"):
        model(torch.zeros(1, 3, 32, 32))


def test_zero_attention_bias_equals_none():
    model = vit_tiny(**{**TINY, "depth": 2}).eval()
    x = _images(model)
    t = model.num_patches
    with torch.no_grad():
        plain = model(x)
        assert torch.equal(model(x, attn_bias=torch.zeros(3, 2, t, t)), plain)
        assert torch.equal(model(x, attn_bias=[torch.zeros(1, 2, t, t), None]), plain)  # per layer
        assert not torch.allclose(model(x, attn_bias=torch.randn(3, 2, t, t)), plain)


def test_token_masking_only_in_training():
    torch.manual_seed(0)
    masked = vit_tiny(**TINY, mask_ratio=0.5)
    plain = vit_tiny(**TINY, mask_ratio=0.0)
    plain.load_state_dict(masked.state_dict())
    x = _images(masked, b=4)
    t = masked.num_patches

    masked.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(masked.forward_features(x), plain.forward_features(x))

    masked.train()
    bias = torch.randn(4, 2, t, t)  # gathered to the kept tokens when masking
    tokens = masked.forward_features(x, attn_bias=bias)  # (B, T, dim)
    is_mask = (tokens == masked.mask_token).all(dim=-1)  # (B, T)
    assert (is_mask.sum(dim=1) == t - int(t * 0.5)).all()
    tokens.sum().backward()
    assert masked.mask_token.grad is not None and masked.mask_token.grad.abs().sum() > 0


def test_bad_arguments_raise_config_error():
    with pytest.raises(ConfigError, match="vit_tiny, vit_t"):
        build_backbone("resnet")
    with pytest.raises(ConfigError, match="divisible"):
        ViT(dim=30, heads=4)
    with pytest.raises(ConfigError, match="does not accept"):
        build_backbone("vit_tiny", depthh=2)


def test_load_model_errors_name_the_file(tmp_path):
    model = vit_tiny(**TINY)
    save_model(tmp_path / "m", model, backbone="vit_tiny", kwargs=TINY)
    save_model(tmp_path / "m", model, backbone="vit_tiny", kwargs=TINY)  # replacing is atomic and clean
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    config = json.loads((tmp_path / "m" / CONFIG).read_text())
    config["kwargs"]["depth"] = 2
    (tmp_path / "m" / CONFIG).write_text(json.dumps(config))
    with pytest.raises(DataError, match=WEIGHTS):
        load_model(tmp_path / "m")

    (tmp_path / "m" / WEIGHTS).unlink()
    with pytest.raises(DataError, match=WEIGHTS):
        load_model(tmp_path / "m")
