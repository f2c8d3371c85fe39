"""UIFace's ID-conditioned UNet: shapes, the context recipe (L2 normalisation, element dropout, empty-context
replacement) measured over many samples, gradients to c_e, save/load, and the pluggable autoencoder's errors."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKL, VQModel

from ml.errors import ConfigError, DataError
from ml.generator.uiface import (
    GeneratorModelConfig,
    IDConditionedUNet,
    check_latent_shape,
    decode_latents,
    encode_images,
    load_autoencoder,
    load_generator,
    save_generator,
)
from ml.models.io import write_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = GeneratorModelConfig(
    image_size=16, block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4, id_dim=32, context_dim=16
)


def _tiny(seed: int = 0, **overrides) -> IDConditionedUNet:
    torch.manual_seed(seed)
    cfg = GeneratorModelConfig(**{**TINY.to_dict(), **overrides})
    return IDConditionedUNet(cfg)


def _ids(b: int, dim: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, dim, generator=torch.Generator().manual_seed(seed))


def tiny_vq() -> VQModel:
    torch.manual_seed(0)
    return VQModel(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=3, norm_num_groups=4,
        num_vq_embeddings=16, sample_size=16,
    ).eval()


def tiny_kl() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=16,
    ).eval()


# ---------------------------------------------------------------------------------------------- structure
def test_default_config_builds_the_embedded_generator() -> None:
    torch.manual_seed(0)
    model = IDConditionedUNet().eval()
    cfg = model.config
    assert (cfg.image_size, cfg.in_channels, cfg.block_out_channels) == (32, 3, (32, 64, 64))
    assert (cfg.id_dim, cfg.context_dim, cfg.context_tokens) == (512, 256, 1)
    assert (cfg.element_dropout, cfg.empty_context_prob) == (0.25, 0.2)
    kinds = [type(b).__name__ for b in model.unet.down_blocks]
    assert kinds == ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"]  # cross-attn at 16 and 8 px
    assert type(model.unet.mid_block).__name__ == "UNetMidBlock2DCrossAttn"
    assert model.unet.config.cross_attention_dim == 256
    assert model.context_proj.in_features == 512 and model.context_proj.out_features == 256
    assert isinstance(model.empty_context, torch.nn.Parameter) and model.empty_context.shape == (1, 1, 256)
    cross = [m for n, m in model.unet.named_modules() if n.endswith("attn2")]
    assert cross and all(m.is_cross_attention and m.heads == 8 for m in cross)
    ctx = model.encode_context(torch.randn(2, 512))
    with torch.no_grad():
        eps = model(torch.randn(2, 3, 32, 32), torch.tensor([10, 900]), ctx)
    assert eps.shape == (2, 3, 32, 32) and bool(torch.isfinite(eps).all())


def test_context_shapes_with_several_tokens() -> None:
    model = _tiny(context_tokens=3).eval()
    ids = _ids(5)
    assert model.encode_context(ids).shape == (5, 3, 16)
    assert model.training_context(ids).shape == (5, 3, 16)
    assert model.empty(5).shape == (5, 3, 16)
    assert torch.equal(model.empty(5)[4], model.empty_context[0])
    with torch.no_grad():
        eps = model(torch.randn(5, 3, 16, 16), 500, model.empty(5))  # a scalar timestep works too
    assert eps.shape == (5, 3, 16, 16)
    with pytest.raises(DataError, match=r"\(B, 32\)"):
        model.encode_context(torch.randn(5, 31))


def test_encode_context_l2_normalises_the_embedding() -> None:
    model = _tiny()
    ids = _ids(6)
    base = model.encode_context(ids)
    torch.testing.assert_close(model.encode_context(ids * 7.3), base, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(model.encode_context(ids * 0.01), base, atol=1e-6, rtol=1e-6)
    manual = model.context_proj(ids / ids.norm(dim=1, keepdim=True)).view(6, 1, 16)
    torch.testing.assert_close(base, manual)


# ---------------------------------------------------------------------------------------------- context recipe
def test_empty_context_replaces_about_a_fifth_of_the_samples_exactly() -> None:
    model = _tiny(element_dropout=0.0, context_tokens=2)
    n = 20_000
    ids = _ids(n, seed=1)
    with torch.no_grad():
        ctx = model.training_context(ids, generator=torch.Generator().manual_seed(3))
        plain = model.encode_context(ids)
    empty = model.empty_context.detach()  # (1, 2, 16)
    is_empty = (ctx == empty).all(dim=(1, 2))
    is_plain = (ctx == plain).all(dim=(1, 2))
    assert bool((is_empty ^ is_plain).all())  # every row is exactly one of the two
    rate = is_empty.float().mean().item()
    assert abs(rate - 0.2) < 0.015  # σ = √(0.2·0.8/20000) ≈ 0.0028: a 5σ bound
    again = model.training_context(ids[:100], generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(again, ctx[:100])  # the generator alone decides the draws


def test_element_dropout_zeroes_a_quarter_and_rescales_the_rest() -> None:
    model = _tiny(empty_context_prob=0.0, context_dim=64)
    ids = _ids(2_000, seed=2)
    with torch.no_grad():
        ctx = model.training_context(ids, generator=torch.Generator().manual_seed(4))
        plain = model.encode_context(ids)
    dropped = ctx == 0
    rate = dropped.float().mean().item()
    assert abs(rate - 0.25) < 0.01  # 128k elements: σ ≈ 0.0012
    torch.testing.assert_close(ctx[~dropped], plain[~dropped] / 0.75)
    model.eval()  # inference path: no dropout, whatever the mode
    torch.testing.assert_close(model.encode_context(ids[:10]), plain[:10])


def test_gradient_reaches_the_empty_context() -> None:
    model = _tiny()
    ids = _ids(16, seed=5)
    gen = torch.Generator().manual_seed(0)
    ctx = model.training_context(ids, generator=gen)
    replaced = (ctx == model.empty_context).all(dim=(1, 2))
    assert 0 < int(replaced.sum()) < 16
    eps = model(torch.randn(16, 3, 16, 16), torch.randint(0, 1000, (16,)), ctx)
    eps.pow(2).mean().backward()
    assert model.empty_context.grad is not None and float(model.empty_context.grad.abs().sum()) > 0
    assert float(model.context_proj.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(image_size=18, block_out_channels=(8, 16, 16)), "multiple of 4"),
        (dict(attention_heads=3), "attention_heads"),
        (dict(cross_attention_from=3), "cross_attention_from"),
        (dict(element_dropout=1.0), "element_dropout"),
        (dict(norm_num_groups=3), "norm_num_groups"),
        (dict(block_out_channels=()), "block_out_channels"),
    ],
)
def test_bad_model_config(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        GeneratorModelConfig(**{**TINY.to_dict(), **kwargs})


# ---------------------------------------------------------------------------------------------- save / load
def test_save_load_round_trip_reproduces_eps_exactly(tmp_path) -> None:
    model = _tiny(seed=7, context_tokens=2).eval()
    with torch.no_grad():
        model.empty_context.normal_()  # not the initial value
    x, t = torch.randn(3, 3, 16, 16), torch.tensor([1, 400, 999])
    ctx = torch.cat([model.encode_context(_ids(2)), model.empty(1)])
    with torch.no_grad():
        before = model(x, t, ctx)
    save_generator(tmp_path / "gen", model, model.config, extra={"space": "pixel"})
    saved = json.loads((tmp_path / "gen" / "config.json").read_text())
    assert saved["architecture"] == "uiface" and saved["extra"] == {"space": "pixel"}
    loaded, cfg = load_generator(tmp_path / "gen")
    assert cfg == model.config and not loaded.training
    with torch.no_grad():
        after = loaded(x, t, torch.cat([loaded.encode_context(_ids(2)), loaded.empty(1)]))
    assert torch.equal(before, after)


def test_load_generator_refuses_other_model_dirs(tmp_path) -> None:
    write_model_dir(tmp_path / "other", torch.nn.Linear(2, 2), {"model": "caface", "kwargs": {}}, what="x")
    with pytest.raises(DataError, match="not a UIFace generator"):
        load_generator(tmp_path / "other")
    with pytest.raises(DataError, match="config.json"):
        load_generator(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------- autoencoders
def test_load_autoencoder_missing_directory_names_it(tmp_path) -> None:
    missing = tmp_path / "vq-f4"
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_autoencoder(missing, kind="vq")
    assert str(missing) in str(err.value) and "save_pretrained" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_autoencoder(tmp_path / "empty", kind="kl")
    with pytest.raises(ConfigError, match="kind"):
        load_autoencoder(tmp_path, kind="gan")


def test_check_latent_shape_names_both_shapes() -> None:
    vq = tiny_vq()
    assert check_latent_shape(vq, 16, GeneratorModelConfig(**{**TINY.to_dict(), "image_size": 8})) == (3, 8)
    with pytest.raises(ConfigError) as err:
        check_latent_shape(vq, 16, TINY)  # the UNet wants 3×16×16, the latent is 3×8×8
    assert "3×8×8" in str(err.value) and "3×16×16" in str(err.value)
    with pytest.raises(ConfigError, match="4×8×8"):
        check_latent_shape(tiny_kl(), 16, GeneratorModelConfig(**{**TINY.to_dict(), "image_size": 8}))


@pytest.mark.parametrize("kind", ["vq", "kl"])
def test_saved_autoencoder_loads_back_and_encodes(tmp_path, kind) -> None:
    ae = tiny_vq() if kind == "vq" else tiny_kl()
    ae.save_pretrained(tmp_path / kind)
    loaded = load_autoencoder(tmp_path / kind, kind=kind)
    assert type(loaded) is type(ae) and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = encode_images(loaded, x)
    if kind == "vq":
        assert z.shape == (2, 3, 8, 8)
        codes = loaded.quantize.embedding.weight  # (16, 3): every latent vector is a codebook entry
        dist = (z.permute(0, 2, 3, 1).reshape(-1, 1, 3) - codes).norm(dim=-1).min(dim=1).values
        assert float(dist.max()) < 1e-5
    else:
        assert z.shape == (2, 4, 8, 8)
        mean = loaded.encode(x).latent_dist.mean
        torch.testing.assert_close(z, mean * loaded.config.scaling_factor)
    assert decode_latents(loaded, z).shape == (2, 3, 16, 16)


def test_time_context_makes_the_identity_reach_the_time_embedding(tmp_path) -> None:
    """With ``time_context`` the UNet gets a projection class embedding fed the flattened context: two contexts
    give different ε even with every cross-attention layer's output zeroed (so not through cross-attention), and
    the model saves and loads with that route."""
    model = _tiny(seed=3, context_tokens=2, time_context=True).eval()
    assert model.unet.config.class_embed_type == "projection"
    assert model.unet.config.projection_class_embeddings_input_dim == 2 * 16
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([500, 500])
    with torch.no_grad():
        for name, module in model.unet.named_modules():
            if name.endswith("attn2"):
                module.to_out[0].weight.zero_()
                module.to_out[0].bias.zero_()
        c1, c2 = model.encode_context(_ids(1, seed=1)), model.encode_context(_ids(1, seed=2))
        eps1, eps2 = model(x[:1], t[:1], c1), model(x[:1], t[:1], c2)
        assert not torch.allclose(eps1, eps2, atol=1e-6)
        plain = _tiny(seed=3, context_tokens=2).eval()  # cross-attention only: zeroed, the context cannot matter
        for name, module in plain.unet.named_modules():
            if name.endswith("attn2"):
                module.to_out[0].weight.zero_()
                module.to_out[0].bias.zero_()
        assert torch.allclose(plain(x[:1], t[:1], plain.encode_context(_ids(1, seed=1))),
                              plain(x[:1], t[:1], plain.encode_context(_ids(1, seed=2))), atol=1e-6)
        save_generator(tmp_path / "gen", model)
        loaded, cfg = load_generator(tmp_path / "gen")
        assert cfg.time_context and torch.equal(loaded(x[:1], t[:1], c1), eps1)


def test_sampler_feeds_the_time_context_route() -> None:
    """The UIFace sampler gives a ``time_context`` UNet the flattened context: samples of two identities differ
    even when every cross-attention output is zeroed."""
    from ml.generator.sampler import SamplerConfig, sample

    model = _tiny(seed=4, context_tokens=2, time_context=True).eval()
    with torch.no_grad():
        for name, module in model.unet.named_modules():
            if name.endswith("attn2"):
                module.to_out[0].weight.zero_()
                module.to_out[0].bias.zero_()
        ctx = model.encode_context(_ids(2, seed=5))
    cfg = SamplerConfig(mode="baseline", steps=5, attention_injection=False)
    out = sample(model.unet, ctx, model.empty(1), (2, 3, 16, 16), cfg, generator=torch.Generator().manual_seed(0))
    same = sample(model.unet, ctx[[0, 0]], model.empty(1), (2, 3, 16, 16), cfg,
                  generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(out.x0).all()
    assert not torch.allclose(out.x0[1], same.x0[1], atol=1e-5)  # only the context of sample 1 changed
    assert torch.allclose(out.x0[0], same.x0[0], atol=1e-5)


def test_patch_layout_is_a_lossless_round_trip_and_sets_the_unet_shape() -> None:
    model = _tiny(patch_size=2)
    assert model.config.unet_shape == (12, 8)  # 3 × 2² channels at 16 / 2
    assert (model.unet.config.in_channels, model.unet.config.sample_size) == (12, 8)
    assert model.sample_shape(5) == (5, 12, 8, 8)
    x = torch.randn(2, 3, 16, 16)
    packed = model.to_unet(x)
    # the 2×2 patch whose top-left pixel is (2, 4) sits at (1, 2); channel c·4 + dy·2 + dx holds pixel (2 + dy, 4 + dx)
    assert packed[0, 1 * 4 + 1 * 2 + 0, 1, 2] == x[0, 1, 3, 4]
    torch.testing.assert_close(model.from_unet(packed), x, rtol=0, atol=0)
    eps = model(packed, torch.tensor([10, 900]), model.encode_context(_ids(2)))
    assert eps.shape == packed.shape
    plain = _tiny()
    assert plain.to_unet(x) is x and plain.sample_shape(1) == (1, 3, 16, 16)
    with pytest.raises(ConfigError, match="not a multiple of 4"):  # a 2-level UNet on 2×2 patches needs 16 | 4·k
        GeneratorModelConfig(**{**TINY.to_dict(), "image_size": 18, "patch_size": 2})
