"""FR training on a tiny separable problem: learning, determinism, logging, embed() and I/O."""

import csv
import dataclasses
import multiprocessing
import time

import lightning
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from ml.config import from_mapping
from ml.errors import ConfigError, DataError
from ml.fr import backbones
from ml.fr.backbones.vit import vit_tiny
from ml.models.io import load_model, save_model
from ml.fr.train import FRConfig, embed, images_to_tensor, train_fr, warmup_cosine

from tests.conftest import TRAIN_DEVICE, separable

SMALL = dict(depth=1)  # vit_tiny at 32 px: 16 tokens, one block




CFG = FRConfig(epochs=5, batch_size=32, lr=2e-3, warmup_epochs=1.0, embedding_dim=32, accelerator="cpu")


class CountSteps(lightning.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args, **kwargs) -> None:
        self.steps += 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    images, labels = separable()
    logdir = tmp_path_factory.mktemp("logs")
    counter = CountSteps()
    cfg = dataclasses.replace(CFG, **TRAIN_DEVICE)
    first = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL,
                  loggers=[CSVLogger(logdir, name="fr")], callbacks=[counter])
    second = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL)
    return images, labels, first, second, logdir, counter


def test_loss_decreases_and_accuracy_beats_chance(runs):
    _, _, result, _, _, counter = runs
    losses = [row["train/loss"] for row in result.history]
    assert [row["epoch"] for row in result.history] == list(range(5))
    assert losses[-1] < 0.7 * losses[0]
    assert result.history[-1]["train/accuracy"] > 0.5  # chance = 0.25
    assert counter.steps == 5 * 4  # 128 images / batch 32, user callbacks are called
    assert not result.model.training
    assert result.backbone == "vit_tiny"
    assert result.backbone_kwargs == {"depth": 1, "img_size": 32, "embed_dim": 32}


def test_same_seed_same_weights(runs):
    _, _, first, second, _, _ = runs
    assert first.history == second.history
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dataloader_workers_do_not_change_the_bits(runs):
    """Every random draw (order, augmentation, head init) is keyed by (seed, epoch, step) in the main process, so
    decoding in worker processes gives the same model bit for bit."""
    images, labels, first, *_ = runs
    if TRAIN_DEVICE != {"accelerator": "cpu", "precision": "32-true"}:
        pytest.skip("bit-for-bit comparison with the fixture's CPU float32 run")
    cfg = dataclasses.replace(CFG, num_workers=2, **TRAIN_DEVICE)
    workers = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL)
    assert workers.history == first.history
    a, b = workers.model.state_dict(), first.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_metrics_reach_the_logger(runs):
    *_, logdir, _ = runs
    (metrics,) = logdir.glob("fr/*/metrics.csv")
    with metrics.open() as f:
        columns = set(csv.DictReader(f).fieldnames)
    assert {"train/loss", "train/accuracy", "train/lr"} <= columns


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_val_accuracy_each_epoch_in_history_and_at_the_steps_of_train_metrics(tmp_path, seed):
    """Every training seed tried learns beyond chance on held-out images of the training identities."""
    images, labels = separable(per_class=40)
    held = np.arange(len(labels)) % 40 >= 32  # the last 8 images of each class: same identities, not trained on
    result = train_fr(dataclasses.replace(CFG, seed=seed), images[~held], labels[~held], progress=False,
                      backbone_overrides=SMALL, loggers=[CSVLogger(tmp_path, name="fr")], val=(images[held], labels[held]))
    accuracies = [row["val/accuracy"] for row in result.history]
    assert len(accuracies) == 5 and all(0.0 <= a <= 1.0 for a in accuracies)
    assert accuracies[-1] > 0.5  # chance = 0.25
    assert not result.model.training
    (metrics,) = tmp_path.glob("fr/*/metrics.csv")
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    steps = {key: [int(r["step"]) for r in rows if r.get(key)] for key in ("train/loss", "val/accuracy")}
    assert steps["val/accuracy"] == steps["train/loss"] and len(steps["val/accuracy"]) == 5
    logged = [float(r["val/accuracy"]) for r in rows if r.get("val/accuracy")]
    np.testing.assert_allclose(logged, accuracies, rtol=1e-6)


def test_val_must_hold_training_identities_at_the_training_size():
    images, labels = separable(per_class=4)
    with pytest.raises(DataError, match=r"validation labels must be 2 integers in \[0, 4\)"):
        train_fr(CFG, images, labels, progress=False, val=(images[:2], np.array([0, 9])))
    with pytest.raises(DataError, match="validation images must be 32×32"):
        train_fr(CFG, images, labels, progress=False, val=(images[:2, :16, :16], labels[:2]))


def test_embed_flip_is_sum_of_both_views_and_survives_save_load(runs, tmp_path):
    images, _, result, _, _, _ = runs
    subset = images[:10]
    model = result.model
    with torch.no_grad():
        x = images_to_tensor(subset)
        manual = (model(x) + model(x.flip(3))).numpy()
    flipped = embed(model, subset, batch_size=10, flip=True)
    assert flipped.dtype == np.float32 and flipped.shape == (10, 32)
    np.testing.assert_array_equal(flipped, manual)
    np.testing.assert_array_equal(embed(model, subset, batch_size=10, flip=False), model(x).detach().numpy())

    save_model(tmp_path / "fr", model, backbone=result.backbone, kwargs=result.backbone_kwargs,
               extra={"history": result.history})
    loaded, config = load_model(tmp_path / "fr")
    np.testing.assert_array_equal(embed(loaded, subset, batch_size=10), flipped)
    assert config["input_contract"]["size"] == 32


def test_images_to_tensor_matches_contract():
    images = np.array([0, 128, 255], dtype=np.uint8).reshape(1, 1, 3, 1).repeat(3, axis=3)  # (1, 1, 3, 3)
    x = images_to_tensor(images)
    assert x.shape == (1, 3, 1, 3) and x.dtype == torch.float32
    torch.testing.assert_close(x[0, 0, 0], torch.tensor([-1.0, (128 / 255 - 0.5) / 0.5, 1.0]))


def test_adamw_is_fused_and_makes_the_per_tensor_update():
    """The shared optimiser takes the fused kernel on the CPU, and its step equals the default per-tensor loop's up
    to rounding (param groups, weight decay and all); under a Trainer that clips gradients in mixed precision it is
    the plain AdamW, which Lightning can clip."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    from ml.train.schedules import adamw

    torch.manual_seed(0)
    weights = [torch.randn(5, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    twins = [w.detach().clone().requires_grad_(True) for w in weights]
    initial = [w.detach().clone() for w in weights]
    groups = [{"params": [weights[0]], "weight_decay": 0.05}, {"params": [weights[1]], "weight_decay": 0.0, "lr": 0.3}]
    fused = adamw(groups, lr=0.1)
    plain = torch.optim.AdamW([{**g, "params": [t]} for g, t in zip(groups, twins)], lr=0.1, foreach=False)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for step in range(5):
        for opt, params in ((fused, weights), (plain, twins)):
            grads = [torch.full_like(p, 0.1 * step + 0.2) * torch.arange(p.numel()).reshape(p.shape) for p in params]
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
    for w, t, w0 in zip(weights, twins, initial):
        torch.testing.assert_close(w, t, rtol=1e-6, atol=1e-7)
        assert float((w - w0).abs().max()) > 0.1  # five steps moved them
    clipping = SimpleNamespace(_trainer=SimpleNamespace(gradient_clip_val=1.0,
                                                        precision_plugin=MixedPrecision("bf16-mixed", "cpu")))
    assert not adamw([torch.zeros(2, requires_grad=True)], clipping, lr=0.1).defaults["fused"]
    clipping._trainer.precision_plugin = Precision()
    assert adamw([torch.zeros(2, requires_grad=True)], clipping, lr=0.1).defaults["fused"] is True


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 4, 20) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20) == pytest.approx(0.5)  # halfway through the cosine
    assert warmup_cosine(20, 4, 20) == pytest.approx(0.0)


def test_fr_config_from_params_section():
    cfg = from_mapping(FRConfig, {"epochs": 3, "margin": "cosface", "lr": 1}, "fr")
    assert cfg == FRConfig(epochs=3, margin="cosface", lr=1.0)
    with pytest.raises(ConfigError, match="fr.epoch"):
        from_mapping(FRConfig, {"epoch": 3}, "fr")
    with pytest.raises(ConfigError, match="fr.margin"):
        from_mapping(FRConfig, {"margin": "sphereface"}, "fr")
    with pytest.raises(ConfigError, match="fr.backbone"):
        from_mapping(FRConfig, {"backbone": "vit_xxl"}, "fr")


def test_bad_labels_and_images_raise_data_error():
    images, labels = separable(per_class=2)
    with pytest.raises(DataError, match="contiguous"):
        train_fr(CFG, images, np.where(labels == 1, 7, labels), progress=False)
    with pytest.raises(DataError, match="uint8"):
        train_fr(CFG, images.astype(np.float32), labels, progress=False)
    with pytest.raises(DataError, match="square"):
        train_fr(CFG, images[:, :, :16], labels, progress=False)


def test_fixed_size_backbone_rejects_other_sizes(monkeypatch):
    def fixed64(embed_dim: int = 128):  # a registry entry that cannot change its input size
        return vit_tiny(embed_dim=embed_dim, depth=1)

    monkeypatch.setitem(backbones.BACKBONES, "fixed64", fixed64)
    images, labels = separable(per_class=2)
    with pytest.raises(ConfigError, match="64×64.*32×32"):
        train_fr(FRConfig(backbone="fixed64"), images, labels, progress=False)


def test_bf16_probe_measures_a_step_ratio_and_leaves_the_random_stream():
    from ml.train import device

    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ratio = device.bf16_step_ratio(repeats=2)
    assert torch.equal(torch.rand(3), expected)  # a seeded training's random stream is left as it was
    assert 0.05 < ratio < 20  # a time ratio, whichever way this CPU goes


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_precision_auto_is_decided_from_the_instruction_set_not_a_clock(monkeypatch):
    from ml.train import device

    def no_clock(*_a, **_k):
        raise AssertionError("precision auto measured something")

    monkeypatch.setattr(device, "bf16_step_ratio", no_clock)
    monkeypatch.setattr(device.time, "process_time", no_clock)
    monkeypatch.setattr(device.time, "perf_counter", no_clock)
    here = device.resolve_precision("cpu", "auto")
    assert here == ("bf16-mixed" if device.cpu_has_amx() else "32-true")
    # under load (every core busy in other processes) the answer is the same
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_busy, args=(3.0,)) for _ in range(device.available_cores())]
    for h in hogs:
        h.start()
    try:
        assert [device.resolve_precision("cpu", "auto") for _ in range(3)] == [here] * 3
    finally:
        for h in hogs:
            h.join()


def test_precision_auto_is_bf16_with_amx_and_is_recorded(runs, monkeypatch):
    from ml.train import device

    images, labels, full_precision, *_ = runs
    for amx, expected in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(device, "cpu_has_amx", lambda amx=amx: amx)
        assert device.resolve_precision("cpu", "auto") == expected
        assert device.resolve_precision("cpu", "32-true") == "32-true"  # a value set by hand is kept as it is
        assert device.resolve_precision("cpu", "bf16-mixed") == "bf16-mixed"
    monkeypatch.setattr(device, "cpu_has_amx", lambda: False)
    cfg = dataclasses.replace(CFG, accelerator="cpu", precision="auto")
    fallback = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL)
    assert fallback.precision == "32-true"
    if TRAIN_DEVICE == {"accelerator": "cpu", "precision": "32-true"}:  # the same run as the fixture's, bit for bit
        a, b = fallback.model.state_dict(), full_precision.model.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(device, "cpu_has_amx", lambda: True)
    mixed = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL)
    assert mixed.precision == "bf16-mixed"
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())  # autocast: the weights stay float32
    losses = [row["train/loss"] for row in mixed.history]
    assert losses[-1] < 0.7 * losses[0] and mixed.history[-1]["train/accuracy"] > 0.5  # it learns (chance 0.25)
    assert any(not torch.equal(p, q) for p, q in zip(mixed.model.parameters(), fallback.model.parameters()))
    with pytest.raises(ConfigError, match=r"fr\.precision 'fp8' is not one of \['auto'"):
        FRConfig(precision="fp8")


def test_compiled_training_forward_gives_the_eager_runs_losses_and_state_dict_keys():
    """``fr.compile`` runs the training forward through torch.compile: the same steps within float tolerance (fused
    kernels round differently, and AdamW's normalised steps turn that into weight differences of up to lr per step
    in near-zero gradients), the saved backbone a plain module with the eager run's keys and embeddings."""
    images, labels = separable()
    cfg = dataclasses.replace(CFG, epochs=1, max_steps=3, augment_recipe="kprpe", **TRAIN_DEVICE)
    eager = train_fr(cfg, images, labels, progress=False, backbone_overrides=SMALL)
    compiled = train_fr(dataclasses.replace(cfg, compile=True), images, labels, progress=False,
                        backbone_overrides=SMALL)
    assert compiled.history[0]["train/loss"] == pytest.approx(eager.history[0]["train/loss"], rel=1e-3)
    a, b = eager.model.state_dict(), compiled.model.state_dict()
    assert a.keys() == b.keys()
    x = images_to_tensor(images[:32])
    with torch.no_grad():
        cosine = torch.nn.functional.cosine_similarity(eager.model(x), compiled.model(x), dim=1)
    assert float(cosine.min()) > 0.99


class _Attend(lightning.LightningModule):
    """One self-attention over 16 tokens; records the autograd node each training step's attention made."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)
        self.kernels: list[str] = []

    def training_step(self, batch, batch_idx):
        q, k, v = self.proj(batch[0]).view(-1, 2, 16, 12).chunk(3, dim=-1)  # (B, heads, tokens, 4) each
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        self.kernels.append(out.grad_fn.name())
        return out.float().square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision, flash", [("bf16-mixed", False), ("32-true", True)])
def test_a_bfloat16_cpu_fit_runs_attention_as_matmuls_not_the_flash_kernel(precision, flash):
    # the fused CPU flash kernel's backward is slow under bfloat16 (train_step_costs *_flash_ratio); float32 keeps
    # PyTorch's own choice, which on the CPU is that kernel
    from torch.utils.data import DataLoader, TensorDataset

    from ml.train.callbacks import EpochHistory, fit

    module = _Attend()
    loader = DataLoader(TensorDataset(torch.randn(8, 32, 8)), batch_size=4)
    fit(module, loader, section="test", epochs=1, steps_per_epoch=2, history=EpochHistory(()), accelerator="cpu",
        precision=precision, progress=False)
    assert len(module.kernels) == 2
    assert all(("Flash" in k) == flash for k in module.kernels), module.kernels
    assert torch.backends.cuda.flash_sdp_enabled()  # the choice ends with the fit
