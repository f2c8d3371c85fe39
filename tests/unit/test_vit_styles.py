"""CAFace styles of the ViT backbones: hand-checked token mean/std of the tapped blocks (forward hooks), shapes,
default taps, KP-RPE, token masking in training, old saved models, and bad ``style_layers``."""

from __future__ import annotations

import json

import pytest
import torch

from ml.errors import ConfigError
from ml.fr.backbones import build_backbone, input_contract
from ml.fr.backbones.kprpe import vit_tiny_kprpe
from ml.fr.backbones.vit import ViT, default_style_layers, token_style, vit_t, vit_tiny
from ml.models.io import CONFIG, load_model, save_model

TINY = dict(depth=4, dim=32, heads=2, embed_dim=16, drop_path=0.0)


pytestmark = pytest.mark.usefixtures("one_thread")


def _images(size: int, b: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _keypoints(size: int, b: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.rand(b, 5, 2, generator=torch.Generator().manual_seed(seed)) * (size - 1)


def _capture(model: torch.nn.Module) -> tuple[dict[int, torch.Tensor], list]:
    """Forward hooks recording every block's output by 1-based block number."""
    seen: dict[int, torch.Tensor] = {}
    handles = [
        block.register_forward_hook(lambda _m, _i, out, n=n: seen.__setitem__(n, out.detach().clone()))
        for n, block in enumerate(model.blocks, start=1)
    ]
    return seen, handles


def _hand_style(tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, C) → (B, C, 2) by the written formula, in float64: mean = Σ_t x / T, std = sqrt(Σ_t (x − mean)² / T)."""
    x = tokens.double()
    t = x.shape[1]
    mean = x.sum(dim=1) / t
    std = (((x - mean[:, None]) ** 2).sum(dim=1) / t).sqrt()
    return torch.stack([mean, std], dim=-1)


def test_default_style_layers():
    assert default_style_layers(12) == (6, 9)
    assert default_style_layers(24) == (12, 18)
    assert default_style_layers(4) == (2, 3)
    assert default_style_layers(2) == (1,)
    assert default_style_layers(1) == (1,)
    assert vit_t(**{**TINY, "depth": 12}).style_layers == (6, 9)
    tiny = vit_tiny()  # the embedded CPU default: dim 128, depth 4
    assert tiny.style_layers == (2, 3) and tiny.style_dim == 256
    assert input_contract("vit_tiny")["style_dim"] == 256  # from the name alone (meta device)
    assert input_contract("vit_s")["style_dim"] == 1024  # dim 512 · 2 taps


def test_styles_are_the_token_mean_and_std_of_the_tapped_blocks():
    torch.manual_seed(0)
    model = vit_tiny(**TINY).eval()
    seen, handles = _capture(model)
    x = _images(64)
    with torch.no_grad():
        emb, styles = model(x, return_styles=True)
    for h in handles:
        h.remove()
    assert model.style_layers == (2, 3)
    assert styles.shape == (3, 2 * 32, 2) and styles.dtype == torch.float32
    assert emb.shape == (3, 16)
    expected = torch.cat([_hand_style(seen[2]), _hand_style(seen[3])], dim=1)  # blocks in order, channels concatenated
    torch.testing.assert_close(styles.double(), expected, rtol=1e-5, atol=1e-6)
    assert (styles[..., 1] >= 0).all()
    with torch.no_grad():
        assert torch.equal(model(x), emb)  # the styles do not change the embedding
        tokens, styles2 = model.forward_features(x, return_styles=True)
        assert torch.equal(styles2, styles) and torch.equal(model.forward_features(x), tokens)
    assert model.input_contract["style_dim"] == 64


def test_token_style_matches_the_iresnet_definition_on_a_grid():
    from ml.fr.backbones.iresnet import channel_style

    x = torch.randn(2, 5, 4, 4)  # (B, C, H, W) feature map
    tokens = x.flatten(2).transpose(1, 2)  # (B, H·W, C), the ViT's token layout
    torch.testing.assert_close(token_style(tokens), channel_style(x))


def test_custom_layers_are_sorted_and_json_lists_accepted():
    torch.manual_seed(0)
    model = vit_tiny(**TINY, style_layers=[4, 1]).eval()
    assert model.style_layers == (1, 4) and model.style_dim == 64
    seen, handles = _capture(model)
    with torch.no_grad():
        _, styles = model(_images(64, b=2), return_styles=True)
    for h in handles:
        h.remove()
    torch.testing.assert_close(styles.double(), torch.cat([_hand_style(seen[1]), _hand_style(seen[4])], 1),
                               rtol=1e-5, atol=1e-6)
    one = vit_tiny(**TINY, style_layers=(3,))
    assert one.style_dim == 32 and one.input_contract["style_dim"] == 32


@pytest.mark.parametrize("bad", [(), (0,), (5,), (2, 2), (1.0,), (True,), "23", 3])
def test_bad_style_layers_raise_config_error(bad):
    with pytest.raises(ConfigError, match="style_layers"):
        ViT(img_size=64, patch_size=8, **{**TINY, "style_layers": bad})


def test_kprpe_styles_and_signature():
    torch.manual_seed(0)
    model = vit_tiny_kprpe(**TINY).eval()
    with torch.no_grad():  # a non-zero keypoint bias, so the keypoints really shape the tapped outputs
        model.kprpe.linear.weight.normal_(0.0, 2.0)
    seen, handles = _capture(model)
    x, k = _images(64), _keypoints(64)
    with torch.no_grad():
        emb, styles = model(x, k, return_styles=True)
        emb_kw, styles_kw = model(x, keypoints=k, return_styles=True)
    for h in handles:
        h.remove()
    expected = torch.cat([_hand_style(seen[2]), _hand_style(seen[3])], dim=1)
    torch.testing.assert_close(styles.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(emb, emb_kw) and torch.equal(styles, styles_kw)
    with torch.no_grad():
        assert torch.equal(model(x, k), emb)  # the old positional call is unchanged
        _, other = model(x, _keypoints(64, seed=7), return_styles=True)
    assert not torch.allclose(other, styles)  # the keypoint bias reaches the styles
    assert model.input_contract["style_dim"] == 64 and model.input_contract["needs_keypoints"] is True


def test_zero_init_kprpe_styles_equal_plain_vit_styles():
    torch.manual_seed(0)
    plain = vit_tiny(**TINY).eval()
    model = vit_tiny_kprpe(**TINY).eval()
    model.load_state_dict(plain.state_dict(), strict=False)
    x = _images(64)
    with torch.no_grad():
        torch.testing.assert_close(model(x, _keypoints(64), return_styles=True)[1], plain(x, return_styles=True)[1])


@pytest.mark.parametrize("builder", [vit_tiny, vit_tiny_kprpe])
def test_masked_training_styles_cover_the_kept_tokens_only(builder):
    torch.manual_seed(0)
    model = builder(**TINY, mask_ratio=0.5).train()
    t = model.num_patches
    seen, handles = _capture(model)
    x = _images(64, b=4)
    args = (x, _keypoints(64, b=4)) if getattr(model, "needs_keypoints", False) else (x,)
    torch.manual_seed(1)
    emb, styles = model(*args, return_styles=True)
    for h in handles:
        h.remove()
    kept = t - int(t * 0.5)
    assert seen[2].shape == (4, kept, 32)  # the blocks see only the kept tokens
    expected = torch.cat([_hand_style(seen[2]), _hand_style(seen[3])], dim=1)
    torch.testing.assert_close(styles.detach().double(), expected, rtol=1e-5, atol=1e-6)
    # the mask token is put back after the final norm: it never enters a style
    with torch.no_grad():
        model.mask_token.add_(100.0)
    torch.manual_seed(1)
    emb2, styles2 = model(*args, return_styles=True)
    assert torch.equal(styles2, styles) and not torch.equal(emb2, emb)
    # gradients reach the network through the styles
    styles.sum().backward()
    assert model.patch_embed.proj.weight.grad is not None


def test_eval_styles_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    model = vit_tiny(**TINY).eval()
    x = _images(64, b=4)
    with torch.no_grad():
        whole = model(x, return_styles=True)[1]
        single = model(x[2:3], return_styles=True)[1]
    torch.testing.assert_close(single, whole[2:3], rtol=1e-5, atol=1e-6)


def test_models_saved_without_style_layers_load_unchanged(tmp_path):
    """An old model directory (kwargs without style_layers, contract without style_dim) loads with the default
    taps and the same weights; a saved style_layers (a JSON list) is rebuilt."""
    torch.manual_seed(0)
    kwargs = {k: v for k, v in TINY.items()}
    model = build_backbone("vit_tiny", **kwargs).eval()
    save_model(tmp_path / "old", model, backbone="vit_tiny", kwargs=kwargs)
    config_path = tmp_path / "old" / CONFIG
    config = json.loads(config_path.read_text())
    del config["input_contract"]["style_dim"]  # as written before styles existed
    config_path.write_text(json.dumps(config))
    loaded, _ = load_model(tmp_path / "old")
    assert loaded.style_layers == (2, 3)
    x = _images(64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
        assert torch.equal(loaded(x, return_styles=True)[1], model(x, return_styles=True)[1])

    custom = build_backbone("vit_tiny", **kwargs, style_layers=(1, 4)).eval()
    save_model(tmp_path / "new", custom, backbone="vit_tiny", kwargs={**kwargs, "style_layers": (1, 4)})
    again, config = load_model(tmp_path / "new")
    assert config["kwargs"]["style_layers"] == [1, 4] and again.style_layers == (1, 4)
    assert config["input_contract"]["style_dim"] == 64
