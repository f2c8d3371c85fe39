"""FaceGCD: zero-prefix = plain ViT, what trains, prefix shapes and per-sample generation, GCD losses against hand
values, a short training run, exact resume, save/load, config errors."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.discovery.contrastive import gcd_loss, gcd_loss_terms, supcon_loss, unsup_contrastive_loss
from ml.fr.backbones.vit import ViT, vit_tiny
from ml.discovery.facegcd import FaceGCD, load_facegcd, save_facegcd
from ml.discovery.facegcd import prefixed_block
from ml.models.io import CONFIG, save_model
from ml.discovery.train import DiscoveryConfig, train_discovery
from tests.conftest import separable, stop_after

# 32 px, patch 8 → 16 tokens; dim 32, 2 heads → head_dim 16, bottleneck 4
TINY = dict(img_size=32, patch_size=8, dim=32, depth=2, heads=2, embed_dim=16, drop_path=0.0)
HEAD = dict(proj_dim=32, proj_hidden=64, proj_bottleneck=16)


def _vit(seed: int = 0) -> ViT:
    torch.manual_seed(seed)
    return vit_tiny(**TINY).eval()


def _model(seed: int = 0, **kwargs) -> FaceGCD:
    vit = _vit(seed)
    torch.manual_seed(seed + 1)
    return FaceGCD(vit, **{**HEAD, "prefix_length": 3, **kwargs})


def _x(b: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- model
def test_zero_prefix_is_the_plain_vit():
    vit = _vit()
    model = FaceGCD(vit, prefix_length=0, **HEAD).eval()
    x = _x()
    with torch.no_grad():
        assert torch.equal(model(x)[0], vit(x))
        t = vit.patch_embed(x) + vit.pos_embed
        empty = torch.zeros(4, 2, 0, 16)
        assert torch.equal(prefixed_block(vit.blocks[0], t, empty, empty), vit.blocks[0](t))
    # the static ViT and the trainable ViT start from the same weights, and the caller's ViT is not shared
    pairs = zip(model.vit.state_dict().values(), model.static_vit.state_dict().values())
    assert all(torch.equal(a, b) for a, b in pairs)
    assert model.vit is not vit and model.static_vit is not vit


def test_only_hypernetwork_last_block_and_head_train():
    model = _model()
    names = set(model.trainable_parameter_names())
    expected = {"base_prefix"} | {n for n, _ in model.named_parameters()
                                  if n.startswith(("hyper.", "head.", "vit.blocks.1."))}
    assert names == expected
    assert "hyper.layer_embed" in names and not any(n.startswith("static_vit.") for n in names)
    model.train()
    assert model.training and model.vit.blocks[-1].training
    assert not model.vit.training and not model.vit.blocks[0].training and not model.vit.feature.training
    assert not model.static_vit.training

    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _, z = model(torch.cat([_x(4, 1), _x(4, 2)]))
    gcd_loss(*z.chunk(2), torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, False, True])).backward()
    opt.step()
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= names  # buffers (BatchNorm statistics) and frozen weights bit-for-bit unchanged
    assert any(k.startswith("hyper.") for k in changed) and "base_prefix" in changed
    assert any(k.startswith("vit.blocks.1.") for k in changed) and any(k.startswith("head.") for k in changed)


def test_prefix_shapes(monkeypatch):
    model = _model(prefix_length=5).eval()
    x = _x(3)
    kv = model.prefixes(x)
    assert kv.shape == (2, 3, 2, 2, 5, 16)  # (L, B, key/value, heads, P, head_dim)
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape, k.shape, v.shape))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        tokens = model.forward_tokens(x)
        features, proj = model(x)
    assert tokens.shape == (3, 16, 32)  # T unchanged
    prefixed = ((3, 2, 16, 16), (3, 2, 21, 16), (3, 2, 21, 16))  # T queries, P + T keys and values
    plain = ((3, 2, 16, 16),) * 3  # the static ViT's own attention
    assert seen.count(prefixed) == 4 and seen.count(plain) == 4 and len(seen) == 8  # 2 layers × 2 calls each
    assert features.shape == (3, 16) and proj.shape == (3, 32)
    assert torch.allclose(proj.norm(dim=1), torch.ones(3))
    assert model.input_contract == model.vit.input_contract and model.input_contract["size"] == 32


def test_prefixes_are_per_sample_but_static_prefix_is_not():
    x = torch.stack([_x(1, 1)[0], _x(1, 2)[0]])
    kv = _model().eval().prefixes(x)
    assert not torch.allclose(kv[:, 0], kv[:, 1])
    static = _model(static_prefix=True).eval()
    assert static.static_vit is None and static.hyper is None
    kv = static.prefixes(x)
    assert torch.equal(kv[:, 0], kv[:, 1])
    assert set(static.trainable_parameter_names()) >= {"kv_prefix"}
    with torch.no_grad():  # the prefixes still change the trainable ViT's output
        assert not torch.allclose(static(x)[0], static.vit(x))


def test_random_base_prefix_redraws_in_training_only():
    model = _model(learn_base_prefix=False)
    assert "base_prefix" not in dict(model.named_parameters())
    x = _x(2)
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(x)[1], model(x)[1])
        model.eval()  # eval: one fixed draw from prefix_seed
        assert torch.equal(model(x)[1], model(x)[1])
        assert torch.allclose(model.prefixes(x)[:, 0], model.prefixes(x[:1])[:, 0], atol=1e-6)  # same draw for all


def test_embed_is_normalised_and_checks_input():
    model = _model()
    images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    e = model.embed(images, batch_size=2)
    assert e.shape == (5, 16) and e.dtype == np.float32
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert np.allclose(e, model.embed(images, batch_size=5), atol=1e-6)
    assert model.training  # restored
    # flip TTA: the normalised f(x) + f(flip x), so an image and its mirror image embed alike
    flipped = model.embed(images, flip=True)
    assert np.allclose(flipped, model.embed(images[:, :, ::-1].copy(), flip=True), atol=1e-5)
    assert np.allclose(np.linalg.norm(flipped, axis=1), 1.0, atol=1e-5) and not np.allclose(flipped, e, atol=1e-3)
    with pytest.raises(DataError, match="uint8"):
        model.embed(images.astype(np.float32))
    with pytest.raises(DataError, match="32, 32, 3"):
        model.embed(images[:, :16])


@pytest.mark.parametrize("variant", [{}, {"learn_base_prefix": False}, {"static_prefix": True}])
def test_save_load_round_trip(tmp_path, variant):
    model = _model(**variant).eval()
    x = _x(3)
    with torch.no_grad():
        f, z = model(x)
    save_facegcd(model, tmp_path / "m", extra={"note": "x"})
    loaded, config = load_facegcd(tmp_path / "m")
    assert not loaded.training
    with torch.no_grad():
        f2, z2 = loaded(x)
    assert torch.equal(f, f2) and torch.equal(z, z2)
    on_disk = json.loads((tmp_path / "m" / CONFIG).read_text())
    assert {"format", "kwargs", "input_contract", "extra"} <= set(on_disk) and on_disk["extra"] == {"note": "x"}
    assert on_disk == config
    save_model(tmp_path / "fr", _vit(), backbone="vit_tiny", kwargs=TINY)
    with pytest.raises(DataError, match="not a FaceGCD model"):
        load_facegcd(tmp_path / "fr")


def test_from_fr_model(tmp_path):
    vit = _vit(3)
    save_model(tmp_path / "fr", vit, backbone="vit_tiny", kwargs=TINY)
    model = FaceGCD.from_fr_model(tmp_path / "fr", prefix_length=0, **HEAD).eval()
    x = _x(2)
    with torch.no_grad():
        assert torch.equal(model(x)[0], vit(x)) and torch.equal(model.static_vit(x), vit(x))
    with pytest.raises(ConfigError, match="plain ViT"):
        FaceGCD("iresnet18")


# ---------------------------------------------------------------------------- losses
E = math.e


def test_losses_against_hand_values():
    # two images, two identical views each, orthogonal: every anchor sees its positive at cos 1, the others at 0
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert unsup_contrastive_loss(z, z.clone(), temperature=1.0).item() == pytest.approx(math.log(1 + 2 / E))
    # same label: positives are all 3 other views → −⅓[log(e/(e+2)) + 2·log(1/(e+2))] = log(e+2) − ⅓
    same = supcon_loss(z, z.clone(), torch.tensor([0, 0]), temperature=1.0).item()
    assert same == pytest.approx(math.log(E + 2) - 1 / 3)
    # distinct labels: SupCon reduces to InfoNCE
    distinct = supcon_loss(z, z, torch.tensor([3, 7]), 0.5).item()
    assert distinct == pytest.approx(unsup_contrastive_loss(z, z, 0.5).item())
    # only image 0 labelled: its 2 views are each other's only candidate → L_s = 0
    terms = gcd_loss_terms(z, z, torch.tensor([0, 0]), torch.tensor([True, False]), lam=0.35, temperature=1.0)
    assert terms["sup"].item() == pytest.approx(0.0)
    assert terms["loss"].item() == pytest.approx(0.65 * math.log(1 + 2 / E))
    none = gcd_loss(z, z, torch.tensor([0, 0]), torch.tensor([False, False]), lam=0.35, temperature=1.0)
    assert none.item() == pytest.approx(0.65 * math.log(1 + 2 / E))
    both = gcd_loss(z, z, torch.tensor([0, 0]), torch.tensor([True, True]), lam=0.35, temperature=1.0)
    assert both.item() == pytest.approx(0.65 * math.log(1 + 2 / E) + 0.35 * (math.log(E + 2) - 1 / 3))


def test_unsup_loss_at_a_general_angle():
    # views at angles: image A (0, a), image B (π/2, π/2 + b); τ = 0.5; loss by the formula, term by term
    a, b, tau = 0.3, 0.7, 0.5
    angles = [0.0, math.pi / 2, a, math.pi / 2 + b]  # [z1_A, z1_B, z2_A, z2_B]
    pos = {0: 2, 1: 3, 2: 0, 3: 1}
    total = 0.0
    for i in range(4):
        sims = {j: math.cos(angles[i] - angles[j]) / tau for j in range(4) if j != i}
        total += -math.log(math.exp(sims[pos[i]]) / sum(math.exp(s) for s in sims.values()))
    z = torch.tensor([[math.cos(t), math.sin(t)] for t in angles], dtype=torch.float64)
    got = unsup_contrastive_loss(z[:2] * 3.0, z[2:], tau).item()  # scale does not matter: normalised inside
    assert got == pytest.approx(total / 4, rel=1e-12)


def test_losses_are_permutation_and_view_invariant():
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 3, 3])
    mask = torch.tensor([True, False, True, True, False, True, False, True])
    perm = torch.randperm(8, generator=g)
    for fn in (lambda a, b, y, m: unsup_contrastive_loss(a, b), lambda a, b, y, m: supcon_loss(a, b, y),
               lambda a, b, y, m: gcd_loss(a, b, y, m)):
        ref = fn(z1, z2, labels, mask)
        assert torch.allclose(fn(z1[perm], z2[perm], labels[perm], mask[perm]), ref, atol=1e-6)
        assert torch.allclose(fn(z2, z1, labels, mask), ref, atol=1e-6)
    z1.requires_grad_(True)
    gcd_loss(z1, z2, labels, mask).backward()
    assert torch.isfinite(z1.grad).all()
    with pytest.raises(DataError, match="labelled_mask"):
        gcd_loss(z1, z2, labels, mask.long())


# ---------------------------------------------------------------------------- training
def _fr_dir(tmp_path):
    save_model(tmp_path / "fr", _vit(5), backbone="vit_tiny", kwargs=TINY)
    return tmp_path / "fr"


def _cfg(**kw) -> DiscoveryConfig:
    base = dict(backbone_init="fr", prefix_length=3, warmup_epochs=0.0, batch_size=16, lr=2e-3, **HEAD)
    return DiscoveryConfig(**{**base, **kw})


def test_short_training_lowers_the_loss(tmp_path):
    images, labels = separable(k=4, per_class=8, size=32, seed=0)
    mask = np.arange(len(labels)) % 2 == 0
    result = train_discovery(_cfg(epochs=4), images, labels, mask, init_model_dir=_fr_dir(tmp_path), progress=False)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert not result.model.training


def test_resume_gives_the_uninterrupted_weights(tmp_path):
    images, labels = separable(k=4, per_class=8, size=32, seed=1)
    mask = labels < 2
    fr = _fr_dir(tmp_path)
    cfg = _cfg(epochs=2, learn_base_prefix=False)  # random base prefix: the model's own RNG must resume too
    full = train_discovery(cfg, images, labels, mask, init_model_dir=fr, checkpoint_dir=tmp_path / "a",
                           progress=False)
    first = train_discovery(cfg, images, labels, mask, init_model_dir=fr, checkpoint_dir=tmp_path / "b",
                            callbacks=[stop_after(1)], progress=False)
    assert [h["epoch"] for h in first.history] == [0]
    resumed = train_discovery(cfg, images, labels, mask, init_model_dir=fr, checkpoint_dir=tmp_path / "b",
                              resume=True, progress=False)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["epoch"] for h in resumed.history] == [0, 1]  # the history travels in the checkpoint
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["last.ckpt"]  # no temporary files left
    with pytest.raises(ConfigError, match="lr"):
        train_discovery(_cfg(epochs=2, learn_base_prefix=False, lr=1e-4), images, labels, mask, init_model_dir=fr,
                        checkpoint_dir=tmp_path / "b", resume=True, progress=False)
    with pytest.raises(DataError, match="trained on other data \(data_digest"):
        train_discovery(cfg, images[::-1].copy(), labels[::-1].copy(), mask[::-1].copy(), init_model_dir=fr,
                        checkpoint_dir=tmp_path / "b", resume=True, progress=False)
    with pytest.raises(ConfigError, match="resume=True"):
        train_discovery(cfg, images, labels, mask, init_model_dir=fr, checkpoint_dir=tmp_path / "b", progress=False)


def test_device_settings_are_honoured_or_refused(tmp_path):
    images, labels = separable(k=4, per_class=8, size=32, seed=2)
    mask = labels < 2
    result = train_discovery(_cfg(epochs=1, accelerator="cpu", precision="bf16-mixed"), images, labels, mask,
                             init_model_dir=_fr_dir(tmp_path), progress=False)
    assert math.isfinite(result.history[0]["loss"]) and result.history[0]["seconds"] > 0
    assert next(result.model.parameters()).device.type == "cpu"
    with pytest.raises(ConfigError, match="discovery.precision '16-mixed' needs a GPU"):
        train_discovery(_cfg(epochs=1, accelerator="cpu", precision="16-mixed"), images, labels, mask,
                        init_model_dir=_fr_dir(tmp_path), progress=False)
    with pytest.raises(ConfigError, match="discovery.devices"):
        _cfg(devices=2)
    with pytest.raises(ConfigError, match="discovery.accelerator"):
        _cfg(accelerator="tpu9")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"prefix_length": -1}, "discovery.prefix_length"),
        ({"backbone": "iresnet50"}, "discovery.backbone"),
        ({"backbone": "vit_tiny_kprpe"}, "discovery.backbone"),
        ({"backbone_init": "dino"}, "discovery.backbone_init"),
        ({"sup_weight": 1.5}, "discovery.sup_weight"),
        ({"temperature": 0.0}, "discovery.temperature"),
        ({"batch_size": 1}, "discovery.batch_size"),
        ({"static_prefix": True, "learn_base_prefix": False}, "learn_base_prefix"),
        ({"learn_base_prefix": 1}, "discovery.learn_base_prefix"),
        ({"lr": "fast"}, "discovery.lr"),
    ],
)
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        DiscoveryConfig(**kwargs)


def test_config_loads_from_a_params_section():
    cfg = from_mapping(DiscoveryConfig, {"prefix_length": 20, "augmentation": {"flip_prob": 0.3}}, "discovery")
    assert cfg.prefix_length == 20 and cfg.augmentation.flip_prob == 0.3
    with pytest.raises(ConfigError, match="discovery.prefix_lenght"):
        from_mapping(DiscoveryConfig, {"prefix_lenght": 20}, "discovery")


def test_bad_inputs_are_refused(tmp_path):
    images, labels = separable(k=2, per_class=4, size=32, seed=0)
    mask = np.ones(len(labels), bool)
    with pytest.raises(ConfigError, match="init_model_dir"):
        train_discovery(_cfg(), images, labels, mask, progress=False)
    with pytest.raises(DataError, match="labelled_mask"):
        train_discovery(_cfg(), images, labels, mask.astype(int), init_model_dir=_fr_dir(tmp_path), progress=False)
    with pytest.raises(DataError, match="16×16"):
        train_discovery(_cfg(), images[:, :16, :16], labels, mask, init_model_dir=_fr_dir(tmp_path), progress=False)
