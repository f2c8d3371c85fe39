"""KP-RPE: bucket function against hand values, bias layout, zero-init = plain ViT, keypoint errors, save/load."""

import json

import pytest
import torch

from ml.errors import ConfigError, DataError
from ml.fr.backbones import BACKBONES, input_contract
from ml.fr.backbones import vit as vit_module
from ml.fr.backbones.kprpe import (
    KPRPE,
    KPRPEViT,
    patch_centres,
    piecewise_index,
    relative_position_buckets,
    vit_b_kprpe,
    vit_s_kprpe,
    vit_t_kprpe,
    vit_tiny_kprpe,
)
from ml.models.io import CONFIG, load_model, save_model

TINY = dict(depth=2, dim=32, heads=2, embed_dim=16, drop_path=0.0)
PAIRS = [
    (vit_module.vit_tiny, vit_tiny_kprpe),
    (vit_module.vit_t, vit_t_kprpe),
    (vit_module.vit_s, vit_s_kprpe),
    (vit_module.vit_b, vit_b_kprpe),
]


def _inputs(size: int, b: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (B, 3, S, S) and pixel landmarks (B, 5, 2) inside the image."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, size, size, generator=gen), torch.rand(b, 5, 2, generator=gen) * (size - 1)


def _pair(builder=vit_tiny_kprpe, plain_builder=vit_module.vit_tiny, **kw):
    """A plain ViT and a KP-RPE ViT holding the very same backbone weights (zero keypoint Linear)."""
    torch.manual_seed(0)
    plain = plain_builder(**{**TINY, **kw}).eval()
    model = builder(**{**TINY, **kw}).eval()
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(result.missing_keys) == ["kprpe.linear.bias", "kprpe.linear.weight"]
    assert result.unexpected_keys == []
    return plain, model


# ---- bucket function


def test_piecewise_index_hand_values():
    # |Δ| ≤ 1.9: round(Δ). Beyond: 1.9 + ln(|Δ|/1.9)/ln(8)·1.9, rounded, capped at ⌊3.8⌋ = 3:
    # Δ=2 → 1.947 → 2; Δ=3 → 2.317 → 2; Δ=4 → 2.580 → 3; Δ=5 → 2.784 → 3; Δ=13 → 3.657 → 4 → 3.
    delta = torch.tensor([0, 1, 2, 3, 4, 5, 13, 100])
    expected = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3])
    assert torch.equal(piecewise_index(delta), expected)
    assert torch.equal(piecewise_index(-delta), -expected)  # odd: g(−Δ) = −g(Δ)
    assert piecewise_index(delta).dtype == torch.long


def test_piecewise_index_rounds_half_to_even():
    # The documented convention (torch.round, as iRPE): 0.5 → 0 and 1.5 → 2; half-away would give 1.
    assert piecewise_index(torch.tensor([0.5, 1.5, -0.5, -1.5, 0.49, 0.51])).tolist() == [0, 2, 0, -2, 0, 1]


@pytest.mark.parametrize("grid", [1, 3, 12, 14])
def test_buckets_shape_range_diagonal_and_mirror(grid):
    b = relative_position_buckets(grid)
    t = grid * grid
    assert b.shape == (t, t) and b.dtype == torch.long
    assert int(b.min()) >= 0 and int(b.max()) < 49
    assert (b.diagonal() == 24).all()  # Δ = (0, 0) → (0+3)·7 + (0+3)
    # g(−Δ) = −g(Δ): bucket(j, i) = (−g_r+3)·7 + (−g_c+3) = 48 − bucket(i, j).
    assert torch.equal(b.T, 48 - b)
    if grid == 14:  # offsets up to ±13 reach every one of the 7×7 buckets
        assert b.unique().numel() == 49


def test_buckets_hand_entries_grid3():
    b = relative_position_buckets(3)
    # Token 0 = (row 0, col 0) to (r, c): Δ = (−r, −c), |Δ| ≤ 2 so g = Δ: (3 − r)·7 + (3 − c).
    assert b[0].tolist() == [24, 23, 22, 17, 16, 15, 10, 9, 8]
    # Token 4 = centre (1, 1): Δ = (1 − r, 1 − c) → (4 − r)·7 + (4 − c).
    assert b[4].tolist() == [32, 31, 30, 25, 24, 23, 18, 17, 16]
    assert b[8, 0] == 40  # Δ = (2, 2) → 5·7 + 5


def test_buckets_hand_entries_grid14():
    b = relative_position_buckets(14)

    def tok(r, c):
        return r * 14 + c

    assert b[tok(0, 0), tok(0, 2)] == 3 * 7 + 1  # Δc = −2 → g = −2
    assert b[tok(0, 0), tok(0, 3)] == 3 * 7 + 1  # Δc = −3 → g = −2 as well
    assert b[tok(0, 0), tok(4, 0)] == 0 * 7 + 3  # Δr = −4 → g = −3
    assert b[tok(0, 0), tok(13, 13)] == 0  # Δ = (−13, −13) → (−3, −3)
    assert b[tok(13, 13), tok(0, 0)] == 48
    assert b[tok(7, 2), tok(2, 9)] == 6 * 7 + 0  # Δ = (5, −7) → (3, −3)
    assert b[tok(6, 6), tok(5, 9)] == 4 * 7 + 1  # Δ = (1, −3) → (1, −2)


def test_bucket_arguments_are_checked():
    with pytest.raises(ConfigError, match="grid_size"):
        relative_position_buckets(0)
    with pytest.raises(ConfigError, match="alpha < beta < gamma"):
        relative_position_buckets(4, alpha=4.0, beta=3.8)


# ---- patch centres and the bias layout


def test_patch_centres_follow_the_real_patches():
    c = patch_centres(112, 9)  # 12×12 patches over the first 108 px; pixel centres at integers
    assert c.shape == (144, 2)
    assert torch.allclose(c[0] * 112, torch.tensor([4.0, 4.0]))  # pixels 0..8 → centre 4
    assert torch.allclose(c[1] * 112, torch.tensor([13.0, 4.0]))  # token 1 is one patch to the right (x)
    assert torch.allclose(c[12] * 112, torch.tensor([4.0, 13.0]))  # token 12 starts the second row (y)
    assert torch.allclose(c[-1] * 112, torch.tensor([103.0, 103.0]))  # pixels 99..107
    c8 = patch_centres(112, 8)
    assert torch.allclose(c8[0] * 112, torch.tensor([3.5, 3.5]))


def test_relative_keypoints_are_centre_minus_landmark():
    m = KPRPE(img_size=64, patch_size=8, depth=1, heads=1)
    kp = torch.rand(2, 5, 2)
    d = m.relative_keypoints(kp)  # (B, T, 10) = concat_j (p_i − k_j)
    assert d.shape == (2, 64, 10)
    i, j = 9, 3
    assert torch.allclose(d[1, i, 2 * j:2 * j + 2], patch_centres(64, 8)[i] - kp[1, j])


def test_bias_is_the_table_gathered_by_bucket_layer_major():
    layers, heads, nb = 3, 2, 49
    m = KPRPE(img_size=32, patch_size=8, depth=layers, heads=heads)  # 4×4 grid
    # A keypoint-independent table through the Linear's bias: entry (l·H + h)·49 + k holds value v[l, h, k].
    v = torch.randn(layers, heads, nb)
    with torch.no_grad():
        m.linear.bias.copy_(v.reshape(-1))
    bias = m(torch.rand(2, 5, 2))
    assert bias.shape == (layers, 2, heads, 16, 16)
    assert torch.equal(bias, v[:, None, :, m.buckets].expand(-1, 2, -1, -1, -1))

    # With keypoint-dependent weights: bias[l, b, h, i, j] = E[l, b, h, i, bucket(i, j)] entry by entry.
    torch.manual_seed(1)
    torch.nn.init.normal_(m.linear.weight)
    kp = torch.rand(2, 5, 2)
    e, bias = m.tables(kp), m(kp)
    assert e.shape == (layers, 2, heads, 16, nb)
    # Built from its two terms (W·P_i + b, the same for every face; W·K, the same for every token), the table is
    # the Linear of D_i = concat_j (p_i − k_j), laid out layer-major.
    direct = m.linear(m.relative_keypoints(kp)).view(2, 16, layers, heads, nb).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(e, direct)
    static, per_face = m.parts(kp)
    assert static.shape == (layers, heads, 16, nb) and per_face.shape == (layers, 2, heads, nb)
    for l, b, h, i, j in [(0, 0, 0, 0, 0), (2, 1, 1, 5, 14), (1, 0, 1, 15, 3)]:
        assert bias[l, b, h, i, j] == e[l, b, h, i, m.buckets[i, j]]


# ---- the model


@pytest.mark.parametrize("builder,plain_builder", [(vit_tiny_kprpe, vit_module.vit_tiny), (vit_t_kprpe, vit_module.vit_t)])
def test_zero_init_equals_plain_vit_exactly(builder, plain_builder):
    plain, model = _pair(builder, plain_builder)
    assert model.kprpe.linear.weight.abs().sum() == 0 and model.kprpe.linear.bias.abs().sum() == 0
    size = model.img_size
    x, kp = _inputs(size)
    with torch.no_grad():
        y = plain(x)
        assert torch.equal(model(x, kp), y)
        assert torch.equal(model(x, torch.rand(3, 5, 2) * 1000 - 500), y)  # any keypoints at all


def test_trained_keypoint_linear_changes_output_and_gets_gradients():
    plain, model = _pair()
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)
    x, kp = _inputs(model.img_size)
    _, kp2 = _inputs(model.img_size, seed=1)
    with torch.no_grad():
        y = model(x, kp)
        assert not torch.allclose(y, plain(x))
        assert not torch.allclose(y, model(x, kp2))  # the output depends on where the landmarks are
        # Same as handing the plain ViT the per-layer biases of KPRPE.forward (normalised keypoints).
        biases = model.kprpe(kp / model.img_size)
        torch.testing.assert_close(plain(x, attn_bias=list(biases)), y)

    model.train()
    model(x, kp).square().sum().backward()
    grad = model.kprpe.linear.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert model.kprpe.linear.bias.grad.abs().sum() > 0


def test_token_masking_gathers_the_bias_of_kept_tokens():
    plain, model = _pair(mask_ratio=0.5)
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)
    x, kp = _inputs(model.img_size, b=4)
    biases = list(model.kprpe(kp / model.img_size))
    plain.train(), model.train()
    # Same seed → same kept tokens; the plain ViT gathers rows/columns of the full bias itself.
    torch.manual_seed(3)
    ours = model.forward_features(x, kp)
    torch.manual_seed(3)
    ref = plain.forward_features(x, attn_bias=biases)
    torch.testing.assert_close(ours, ref)
    t = model.num_patches
    is_mask = (ours == model.mask_token).all(dim=-1)  # (B, T)
    assert (is_mask.sum(dim=1) == t - int(t * 0.5)).all()

    keep = model._random_keep(4, x.device)
    table = model.kprpe.tables(kp / model.img_size)[1]
    assert torch.equal(model.kprpe.masked_layer_bias(table, keep),
                       vit_module._gather_tokens_bias(model.kprpe.layer_bias(table), keep))


def test_missing_or_misshapen_keypoints_raise_data_error():
    _, model = _pair()
    x, kp = _inputs(model.img_size)
    with pytest.raises(DataError, match="KP-RPE needs 5 landmarks per image"):
        model(x)
    with pytest.raises(DataError, match=r"\(3, 5, 2\).*got \(3, 4, 2\)"):
        model(x, kp[:, :4])
    with pytest.raises(DataError, match=r"got \(2, 5, 2\)"):
        model(x, kp[:2])
    with pytest.raises(DataError, match=r"got \(3, 10\)"):
        model(x, kp.flatten(1))
    with pytest.raises(DataError, match="float tensor"):
        model(x, kp.long())
    with pytest.raises(DataError, match="float tensor"):
        model(x, kp.tolist())


def test_variants_have_the_plain_sizes_plus_one_linear():
    for plain_builder, builder in PAIRS:
        with torch.device("meta"):  # no weights allocated
            plain, model = plain_builder(), builder()
        assert isinstance(model, KPRPEViT) and model.needs_keypoints
        assert not getattr(plain, "needs_keypoints", False)
        plain_sd, sd = plain.state_dict(), model.state_dict()
        assert {k: v.shape for k, v in sd.items() if k in plain_sd} == {k: v.shape for k, v in plain_sd.items()}
        assert sorted(set(sd) - set(plain_sd)) == ["kprpe.linear.bias", "kprpe.linear.weight"]
        assert sd["kprpe.linear.weight"].shape == (49 * model.heads * model.depth, 10)
        for attr in ("img_size", "dim", "depth", "heads", "embed_dim", "mask_ratio", "num_patches"):
            assert getattr(model, attr) == getattr(plain, attr), (builder.__name__, attr)
        assert [b.drop_path.p for b in model.blocks] == [b.drop_path.p for b in plain.blocks]
        contract = input_contract(model)
        assert contract["needs_keypoints"] is True and "ArcFace" in contract["keypoints"]
        assert {k: v for k, v in contract.items() if k not in ("needs_keypoints", "keypoints")} == input_contract(plain)


def test_save_load_round_trip(tmp_path, monkeypatch):
    # load_model rebuilds by registry name; register the variant for this test only.
    monkeypatch.setitem(BACKBONES, "vit_tiny_kprpe", vit_tiny_kprpe)
    kw = dict(TINY)
    torch.manual_seed(0)
    model = vit_tiny_kprpe(**kw).eval()
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)
    x, kp = _inputs(model.img_size)
    with torch.no_grad():
        y = model(x, kp)
    save_model(tmp_path / "m", model, backbone="vit_tiny_kprpe", kwargs=kw)
    loaded, config = load_model(tmp_path / "m")
    assert isinstance(loaded, KPRPEViT) and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(x, kp), y)
    on_disk = json.loads((tmp_path / "m" / CONFIG).read_text())
    assert on_disk["input_contract"]["needs_keypoints"] is True
    assert config["input_contract"] == on_disk["input_contract"]


def test_keypoint_path_exports_without_graph_breaks():
    # torch.export (the front end of the ONNX exporter) fails on data-dependent Python control flow.
    _, model = _pair(depth=1)
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)
    x, kp = _inputs(model.img_size, b=2)
    exported = torch.export.export(model, (x, kp))
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "aten.gather.default" in ops and not any("nonzero" in op or "index_put" in op for op in ops)
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(x, kp), model(x, kp))


# ---- the MLP keypoint map (fr.keypoint_map: mlp)


def test_linear_keypoint_term_is_shared_by_every_query_token_and_the_mlp_term_is_not():
    """Moving the landmarks changes a Linear map's tables by one offset table per face, the same at every query
    token (it cannot say "attend where the eye now is"); the MLP's change differs from token to token."""
    kp1, kp2 = torch.rand(1, 5, 2), torch.rand(1, 5, 2)
    for name in ("linear", "mlp"):
        torch.manual_seed(0)
        m = KPRPE(32, 8, depth=2, heads=2, keypoint_map=name)
        torch.nn.init.normal_(m.linear.weight, std=0.5)
        with torch.no_grad():
            change = m.tables(kp2) - m.tables(kp1)  # (L, 1, H, T, NB)
        spread_over_tokens = float(change.std(dim=3).max())
        if name == "linear":
            assert spread_over_tokens < 1e-5
        else:
            assert spread_over_tokens > 1e-2
        # the bias built layer by layer is the one gathered from the full tables
        bias, tables = m(kp1), m.tables(kp1)
        for layer in range(2):
            torch.testing.assert_close(bias[layer], m.layer_bias(tables[layer]))


def test_mlp_keypoint_map_starts_as_the_plain_vit_learns_and_round_trips(tmp_path):
    torch.manual_seed(0)
    plain = vit_module.vit_tiny(**TINY).eval()
    model = vit_tiny_kprpe(keypoint_map="mlp", **TINY).eval()
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(k for k in result.missing_keys) == [
        "kprpe.hidden.0.bias", "kprpe.hidden.0.weight", "kprpe.hidden.2.bias", "kprpe.hidden.2.weight",
        "kprpe.linear.bias", "kprpe.linear.weight"]
    x, kp = _inputs(model.img_size)
    with torch.no_grad():
        assert torch.equal(model(x, kp), plain(x))  # zero-initialised output layer: exactly the plain ViT
    model.train()
    model(x, kp).square().sum().backward()
    assert model.kprpe.linear.weight.grad.abs().sum() > 0  # the keypoint path gets a gradient from the start
    torch.nn.init.normal_(model.kprpe.linear.weight, std=0.5)
    model.eval()
    save_model(tmp_path / "m", model, backbone="vit_tiny_kprpe", kwargs={"keypoint_map": "mlp", **TINY})
    loaded, _ = load_model(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, kp), model(x, kp))
        assert not torch.allclose(model(x, kp), plain(x))


def test_unknown_keypoint_map_and_a_map_without_kprpe_are_refused():
    from ml.fr.config import FRConfig

    with pytest.raises(ConfigError, match="keypoint_map 'conv'"):
        vit_tiny_kprpe(keypoint_map="conv")
    with pytest.raises(ConfigError, match="fr.keypoint_map"):
        FRConfig(backbone="vit_tiny", keypoint_map="mlp")
    assert FRConfig(backbone="vit_tiny_kprpe", keypoint_map="mlp").keypoint_map == "mlp"
