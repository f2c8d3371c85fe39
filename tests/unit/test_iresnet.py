"""IResNet backbones: shapes per variant, full-size parameter counts, CAFace styles, save/load."""

import json

import pytest
import torch

from ml.errors import ConfigError, DataError
from ml.fr.backbones import BACKBONES, build_backbone, input_contract
from ml.fr.backbones.iresnet import (
    INPUT_CONTRACT,
    IResNet,
    iresnet18,
    iresnet34,
    iresnet50,
    iresnet100,
)
from ml.models.io import CONFIG, load_model, save_model

VARIANTS = {"iresnet18": iresnet18, "iresnet34": iresnet34, "iresnet50": iresnet50, "iresnet100": iresnet100}
# Every variant keeps its depth; 1/8 width (8, 16, 32, 64 channels) on 32 px keeps the CPU fast.
TINY = dict(img_size=32, embed_dim=16, width=0.125)


def _images(b: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def registered(monkeypatch):
    """The IResNet variants in the backbone registry, for this test only."""
    for name, builder in VARIANTS.items():
        monkeypatch.setitem(BACKBONES, name, builder)
    return VARIANTS


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_shapes_and_finite_outputs(name):
    torch.manual_seed(0)
    model = VARIANTS[name](**TINY).eval()
    assert model.planes == (8, 16, 32, 64)
    assert model.style_dim == 16 + 32
    x = _images(3, 32)
    with torch.no_grad():
        y = model(x)
        y2, styles = model(x, return_styles=True)
    assert y.shape == (3, 16)
    assert styles.shape == (3, 48, 2)
    assert torch.isfinite(y).all() and torch.isfinite(styles).all()
    assert torch.equal(y, y2)  # collecting styles does not change the embedding


# Counted on the meta device (no memory). ``features.weight`` is a buffer here; insightface's frozen
# parameter adds 512 to each count (43,590,848 for r50).
FULL_SIZE_PARAMS = {
    "iresnet18": 24_025_088,
    "iresnet34": 34_138_816,
    "iresnet50": 43_590_336,
    "iresnet100": 65_155_648,
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_full_size_parameter_counts(name):
    with torch.device("meta"):
        model = VARIANTS[name]()
    assert sum(p.numel() for p in model.parameters()) == FULL_SIZE_PARAMS[name]
    assert model.final_size == 7 and model.fc.in_features == 512 * 7 * 7
    assert model.style_dim == 384
    assert model.input_contract == INPUT_CONTRACT


def test_iresnet50_matches_the_known_43_6m():
    with torch.device("meta"):
        model = iresnet50()
    trainable = sum(p.numel() for p in model.parameters())
    assert round((trainable + model.features.weight.numel()) / 1e6, 1) == 43.6


@pytest.mark.parametrize(("img_size", "side"), [(112, 7), (64, 4), (32, 2), (100, 7), (7, 1)])
def test_final_map_size_follows_img_size(img_size, side):
    with torch.device("meta"):
        model = iresnet18(img_size=img_size)
    assert model.final_size == side
    assert model.fc.in_features == 512 * side * side


def test_final_map_matches_a_real_forward_at_64px():
    model = iresnet18(img_size=64, width=0.125, embed_dim=8).eval()
    seen = {}
    model.layer4.register_forward_hook(lambda m, i, o: seen.update(layer4=o.shape))
    with torch.no_grad():
        assert model(_images(2, 64)).shape == (2, 8)
    assert seen["layer4"] == (2, 64, 4, 4)


def _hooked_styles(model: IResNet, x: torch.Tensor, stages: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``model(x, return_styles=True)`` and also capture the named stages' outputs by hooks."""
    captured = {}
    handles = [
        getattr(model, s).register_forward_hook(lambda m, i, o, s=s: captured.__setitem__(s, o.detach().clone()))
        for s in stages
    ]
    try:
        _, styles = model(x, return_styles=True)
    finally:
        for h in handles:
            h.remove()
    manual = []
    for s in stages:
        flat = captured[s].double().flatten(2)  # (B, C, H·W)
        mean = flat.mean(-1)
        std = ((flat - mean[..., None]) ** 2).mean(-1).sqrt()  # population std, divisor H·W
        manual.append(torch.stack((mean, std), dim=-1))
    return styles, torch.cat(manual, dim=1)


@pytest.mark.parametrize("training", [False, True])
def test_styles_equal_hooked_mean_and_std_of_layer2_and_layer3(training):
    torch.manual_seed(0)
    model = iresnet18(img_size=32, embed_dim=32).train(training)  # full width: 128 + 256 channels
    with torch.no_grad():
        styles, manual = _hooked_styles(model, _images(4, 32), ("layer2", "layer3"))
    assert styles.shape == (4, 384, 2)
    assert (styles[..., 1] >= 0).all()
    torch.testing.assert_close(styles.double(), manual, rtol=1e-5, atol=1e-5)


def test_style_layers_choose_the_stages_in_stage_order():
    torch.manual_seed(0)
    model = iresnet18(**TINY, style_layers=[4, 1]).eval()
    assert model.style_layers == (1, 4)
    assert model.style_dim == 8 + 64 and model.input_contract["style_dim"] == 72
    with torch.no_grad():
        styles, manual = _hooked_styles(model, _images(2, 32), ("layer1", "layer4"))
    assert styles.shape == (2, 72, 2)
    torch.testing.assert_close(styles.double(), manual, rtol=1e-5, atol=1e-5)


def test_eval_is_deterministic_and_takes_a_batch_of_one():
    torch.manual_seed(0)
    model = iresnet34(**TINY, dropout=0.5).eval()
    x = _images(3, 32)
    with torch.no_grad():
        a, sa = model(x, return_styles=True)
        b, sb = model(x, return_styles=True)
        single = model(x[:1])
    assert torch.equal(a, b) and torch.equal(sa, sb)
    assert single.shape == (1, 16) and torch.isfinite(single).all()
    torch.testing.assert_close(single, a[:1], rtol=1e-5, atol=1e-5)


def test_features_scale_is_a_fixed_buffer_and_the_shift_trains():
    torch.manual_seed(0)
    model = iresnet18(**TINY)
    assert "features.weight" not in dict(model.named_parameters())
    assert "features.weight" in model.state_dict()  # same key as insightface checkpoints
    model.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_images(4, 32)).pow(2).sum().backward()
    assert model.features.bias.grad is not None
    opt.step()
    assert torch.equal(model.features.weight, torch.ones(16))


def test_state_dict_keys_follow_the_insightface_layout():
    with torch.device("meta"):
        keys = set(iresnet50().state_dict())
    for key in ("conv1.weight", "bn1.running_var", "prelu.weight", "layer1.0.bn1.weight", "layer1.0.conv1.weight",
                "layer1.0.bn2.bias", "layer1.0.prelu.weight", "layer1.0.conv2.weight", "layer1.0.bn3.running_mean",
                "layer1.0.downsample.0.weight", "layer1.0.downsample.1.weight", "layer3.13.conv2.weight",
                "layer4.2.bn3.num_batches_tracked", "bn2.weight", "fc.weight", "fc.bias", "features.weight",
                "features.bias", "features.running_var"):
        assert key in keys, key
    assert "layer1.1.downsample.0.weight" not in keys  # only a stage's first block downsamples
    assert "layer3.14.conv1.weight" not in keys  # r50 has 14 blocks in stage 3


def test_round_trip_through_the_registry(registered, tmp_path):
    torch.manual_seed(0)
    kwargs = dict(TINY)
    model = build_backbone("iresnet50", **kwargs)
    model(_images(4, 32))  # one training step's worth of BN statistics, so eval differs from init
    model.eval()
    x = _images(2, 32, seed=1)
    with torch.no_grad():
        y, styles = model(x, return_styles=True)

    contract = input_contract(model)
    assert contract == input_contract("iresnet50", **kwargs)  # from the name, on the meta device
    assert contract["style_dim"] == 48 and contract["embedding_dim"] == 16 and contract["size"] == 32

    save_model(tmp_path / "m", model, backbone="iresnet50", kwargs=kwargs, extra={"note": "tiny"})
    loaded, config = load_model(tmp_path / "m")
    assert isinstance(loaded, IResNet) and not loaded.training
    with torch.no_grad():
        y2, styles2 = loaded(x, return_styles=True)
    assert torch.equal(y2, y) and torch.equal(styles2, styles)
    on_disk = json.loads((tmp_path / "m" / CONFIG).read_text())
    assert on_disk["backbone"] == "iresnet50" and on_disk["kwargs"] == kwargs
    assert on_disk["input_contract"]["style_dim"] == 48
    assert config == on_disk


def test_style_layers_survive_json_kwargs(registered, tmp_path):
    kwargs = dict(TINY, style_layers=[1, 2])  # a tuple would come back from JSON as a list
    model = build_backbone("iresnet18", **kwargs).eval()
    save_model(tmp_path / "m", model, backbone="iresnet18", kwargs=kwargs)
    loaded, _ = load_model(tmp_path / "m")
    assert loaded.style_layers == (1, 2) and loaded.style_dim == 24


def test_wrong_image_size_raises_data_error():
    model = iresnet18(**TINY).eval()
    with pytest.raises(DataError, match="32, 32"):
        model(torch.zeros(1, 3, 64, 64))
    with pytest.raises(DataError, match="got \\(3, 32, 32\\)"):
        model(torch.zeros(3, 32, 32))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(layers=(2, 2, 2)), "4 positive integers"),
        (dict(img_size=0), "img_size"),
        (dict(embed_dim=1.5), "embed_dim"),
        (dict(dropout=1.0), "dropout"),
        (dict(width=0), "width"),
        (dict(style_layers=[]), "style_layers"),
        (dict(style_layers=[0, 2]), "style_layers"),
        (dict(style_layers=[2, 2]), "style_layers"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        with torch.device("meta"):
            IResNet(**kwargs)


def test_variants_fix_their_depth(registered):
    with pytest.raises(ConfigError, match="fixes 'layers'"):
        iresnet18(layers=(1, 1, 1, 1))
    with pytest.raises(ConfigError, match="does not accept"):
        build_backbone("iresnet18", depth=3)
