"""UIFace generator training: the loss falls, EMA weights are what is returned and saved, c_e learns, exact
resume, the NaN stop, input errors, the config section, and a latent-space step through a saved diffusers
VQModel / AutoencoderKL. Tiny UNets (8/16 channels) on 16×16 images."""

from __future__ import annotations

import dataclasses
import math

import lightning
import numpy as np
import pytest
import torch

from ml.config import from_mapping
from ml.errors import ConfigError, DataError, TrainingError
from ml.generator.uiface import GeneratorModelConfig, IDConditionedUNet, load_autoencoder, load_generator
from ml.models.io import read_model_config
from ml.generator.train import GeneratorConfig, ema_decay_at, make_noise_scheduler, train_generator

from tests.conftest import TRAIN_DEVICE, separable, stop_after
from tests.unit.test_generator_model import tiny_kl, tiny_vq

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = GeneratorModelConfig(
    image_size=16, block_out_channels=(8, 16), attention_heads=2, norm_num_groups=4, context_dim=16
)
# 32 images in batches of 8: 4 steps per epoch
CFG = GeneratorConfig(model=TINY, batch_size=8, epochs=3, lr=2e-3, accelerator="cpu", seed=0)


class Steps(lightning.Callback):
    """Records the global step at the start of every batch."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)


class Poison(lightning.Callback):
    """Makes the UNet's first convolution NaN from global step ``step`` on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.unet.conv_in.weight.fill_(float("nan"))


def faces(n_ids: int = 4, per_id: int = 8, size: int = 16, dim: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Images with a per-identity pattern, and an FR-like embedding per image (identity direction + noise)."""
    images, labels = separable(n_ids, per_id, size=size)
    rng = np.random.default_rng(1)
    centres = rng.normal(size=(n_ids, dim))
    ids = centres[labels] + 0.3 * rng.normal(size=(len(labels), dim))
    return images, ids.astype(np.float32)


def _states_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], atol=1e-6, rtol=0, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    images, ids = faces()
    cfg = dataclasses.replace(CFG, **TRAIN_DEVICE)
    full = train_generator(cfg, images, ids, progress=False)
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    first = train_generator(cfg, images, ids, checkpoint_dir=ckpt_dir, callbacks=[stop_after(1)], progress=False)
    steps = Steps()
    second = train_generator(cfg, images, ids, checkpoint_dir=ckpt_dir, resume=True, callbacks=[steps], progress=False)
    return images, ids, full, first, second, ckpt_dir, steps


def test_loss_decreases_on_a_tiny_dataset(runs) -> None:
    *_, full, _, _, _, _ = runs
    losses = [r["train/loss"] for r in full.history]
    assert [r["epoch"] for r in full.history] == [0, 1, 2]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.85 * losses[0], losses
    assert full.space == "pixel" and full.image_size == 16 and full.seconds > 0


def test_ema_differs_from_raw_weights_and_is_what_gets_saved(runs, tmp_path) -> None:
    *_, full, _, _, _, _ = runs
    ema, raw = full.model.state_dict(), full.raw_model.state_dict()
    assert any(not torch.equal(ema[k], raw[k]) for k in ema)
    # c_e was trained (the gradient reached it), and its EMA trails it
    lightning.seed_everything(CFG.seed, verbose=False)
    init = IDConditionedUNet(CFG.model)
    assert not torch.equal(full.raw_model.empty_context, init.empty_context)
    assert not torch.equal(full.model.empty_context, full.raw_model.empty_context)
    full.save(tmp_path / "gen")
    loaded, cfg = load_generator(tmp_path / "gen")
    assert cfg == CFG.model
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, ema[key]), key
    extra = read_model_config(tmp_path / "gen", what="generator")["extra"]
    assert extra["noise_schedule"] == CFG.noise_schedule() and extra["space"] == "pixel"
    assert extra["image_size"] == 16


def test_first_ema_update_keeps_a_tenth_of_the_initial_weights() -> None:
    # update n = 0 decays by min(ema_decay, (1 + 0)/(10 + 0)) = 0.1: θ_ema = 0.1·θ_init + 0.9·θ_1
    one = train_generator(dataclasses.replace(CFG, max_steps=1), *faces(), progress=False)
    lightning.seed_everything(CFG.seed, verbose=False)
    init = IDConditionedUNet(CFG.model).state_dict()
    raw = one.raw_model.state_dict()
    assert max(float((raw[k] - init[k]).abs().max()) for k in raw) > 1e-4  # the step moved the weights
    for key, value in one.model.state_dict().items():
        torch.testing.assert_close(value, 0.1 * init[key] + 0.9 * raw[key], atol=1e-7, rtol=1e-6, msg=key)


def test_resume_after_an_epoch_equals_an_uninterrupted_run(runs) -> None:
    *_, full, first, second, ckpt_dir, steps = runs
    assert [r["epoch"] for r in first.history] == [0]
    assert steps.steps == list(range(4, 12))  # the resumed run did epochs 1 and 2 only
    assert [r["epoch"] for r in second.history] == [0, 1, 2]  # history travels in the checkpoint
    assert second.checkpoint == ckpt_dir / "last.ckpt"
    _states_equal(full.raw_model, second.raw_model)
    _states_equal(full.model, second.model)  # the EMA resumes too
    for x, y in zip(full.history, second.history):
        assert x["train/loss"] == pytest.approx(y["train/loss"], abs=1e-6)


def test_resume_refuses_another_model_and_unasked_overwrites(runs) -> None:
    images, ids, *_, ckpt_dir, _ = runs
    wider = dataclasses.replace(CFG, model=dataclasses.replace(TINY, block_out_channels=(8, 32)))
    with pytest.raises(ConfigError, match=r"generator.train.model.block_out_channels: \[8, 16\] → \[8, 32\]") as err:
        train_generator(wider, images, ids, checkpoint_dir=ckpt_dir, resume=True, progress=False)
    assert str(ckpt_dir / "last.ckpt") in str(err.value)
    with pytest.raises(DataError, match=r"trained on other data \(data \["):
        train_generator(CFG, images[:16], ids[:16], checkpoint_dir=ckpt_dir, resume=True, progress=False)
    with pytest.raises(ConfigError, match="resume=True"):
        train_generator(CFG, images, ids, checkpoint_dir=ckpt_dir, progress=False)


def test_nan_loss_stops_naming_the_step_and_the_checkpoint(tmp_path) -> None:
    images, ids = faces()
    with pytest.raises(TrainingError, match="global step 5") as err:
        train_generator(CFG, images, ids, checkpoint_dir=tmp_path, callbacks=[Poison(5)], progress=False)
    assert str(tmp_path / "last.ckpt") in str(err.value)


def test_bad_inputs_fail_before_training() -> None:
    images, ids = faces()
    with pytest.raises(DataError, match="32 images but 31 id_embeddings"):
        train_generator(CFG, images, ids[:31], progress=False)
    big, big_ids = faces(size=32)
    with pytest.raises(DataError, match=r"32×32.*expects 16×16"):
        train_generator(CFG, big, big_ids, progress=False)
    small, small_ids = faces(size=8)
    with pytest.raises(DataError, match=r"8×8 — smaller than the UNet needs.*16×16"):
        train_generator(CFG, small, small_ids, progress=False)
    with pytest.raises(DataError, match="id_dim"):
        train_generator(CFG, images, ids[:, :128], progress=False)
    zero = ids.copy()
    zero[3] = 0.0
    with pytest.raises(DataError, match="row 3"):
        train_generator(CFG, images, zero, progress=False)
    with pytest.raises(DataError, match="uint8"):
        train_generator(CFG, images.astype(np.float32), ids, progress=False)
    four = dataclasses.replace(CFG, model=dataclasses.replace(TINY, in_channels=4))
    with pytest.raises(ConfigError, match="pixel space"):
        train_generator(four, images, ids, progress=False)
    with pytest.raises(ConfigError, match="16-mixed"):
        train_generator(dataclasses.replace(CFG, precision="16-mixed"), images, ids, progress=False)


@pytest.mark.parametrize("kind", ["vq", "kl", "tiny"])
def test_one_latent_space_step_through_a_saved_autoencoder(tmp_path, kind) -> None:
    from ml.generator.autoencoder import AutoencoderConfig, build_autoencoder

    tiny = AutoencoderConfig(architecture="tiny", block_out_channels=(8, 8), latent_channels=2)
    ae = {"vq": tiny_vq, "kl": tiny_kl, "tiny": lambda: build_autoencoder(tiny, 16)}[kind]()  # ×2: 16 px → 8×8
    ae.save_pretrained(tmp_path / kind)
    autoencoder = load_autoencoder(tmp_path / kind, kind=kind)
    channels = {"vq": 3, "kl": 4, "tiny": 2}[kind]
    latent = dataclasses.replace(TINY, image_size=8, in_channels=channels)
    cfg = dataclasses.replace(CFG, model=latent, epochs=1, max_steps=1)
    images, ids = faces(2, 4)
    result = train_generator(cfg, images, ids, autoencoder=autoencoder, progress=False)
    assert result.space == kind and len(result.history) == 1
    assert np.isfinite(result.history[0]["train/loss"])
    assert not torch.equal(result.model.unet.conv_in.weight, result.raw_model.unet.conv_in.weight)
    with torch.no_grad():
        eps = result.model(torch.randn(2, channels, 8, 8), torch.tensor([3, 700]), result.model.empty(2))
    assert eps.shape == (2, channels, 8, 8)
    other = dataclasses.replace(cfg, model=dataclasses.replace(latent, in_channels=channels + 1))
    with pytest.raises(ConfigError, match=f"{channels}×8×8.*{channels + 1}×8×8"):  # UNet built for another latent
        train_generator(other, images, ids, autoencoder=autoencoder, progress=False)
    with pytest.raises(DataError, match=r"expects 16×16 images"):  # pixel size 16 = 8 (latent) × 2 (encoder)
        train_generator(cfg, *faces(2, 4, size=32), autoencoder=autoencoder, progress=False)


def test_config_section_noise_schedule_and_ema_warmup() -> None:
    cfg = from_mapping(
        GeneratorConfig,
        {"model": {"image_size": 16, "block_out_channels": [8, 16], "attention_heads": 2, "norm_num_groups": 4},
         "lr": 1e-3, "epochs": 2},
        "generator",
    )
    assert cfg.model.block_out_channels == (8, 16) and cfg.lr == 1e-3 and cfg.num_train_timesteps == 1000
    with pytest.raises(ConfigError, match="generator.model.image_sise"):
        from_mapping(GeneratorConfig, {"model": {"image_sise": 16}}, "generator")
    with pytest.raises(ConfigError, match="ema_decay"):
        GeneratorConfig(ema_decay=1.0)
    scheduler = make_noise_scheduler(GeneratorConfig().noise_schedule())
    betas = scheduler.betas
    assert betas.shape == (1000,) and scheduler.config.prediction_type == "epsilon"
    assert betas[0].item() == pytest.approx(1e-4) and betas[-1].item() == pytest.approx(0.02)
    torch.testing.assert_close(betas, torch.linspace(1e-4, 0.02, 1000))
    assert ema_decay_at(0, 0.999) == pytest.approx(0.1) and ema_decay_at(10**6, 0.999) == 0.999


def test_min_snr_weights_are_min_snr_gamma_over_snr_against_hand_values() -> None:
    from ml.generator.train import GeneratorModule

    cfg = dataclasses.replace(CFG, loss_weighting="min_snr", min_snr_gamma=5.0)
    module = GeneratorModule(IDConditionedUNet(dataclasses.replace(TINY, id_dim=512)), cfg, 4, pixel=True)
    abar = make_noise_scheduler(cfg.noise_schedule()).alphas_cumprod
    t = torch.tensor([0, 100, 999])
    snr = abar[t] / (1 - abar[t])
    assert snr[0] > 5 > snr[2]  # t = 0 is nearly clean (SNR ≈ 1e4), t = 999 nearly pure noise
    want = torch.tensor([5.0 / float(snr[0]), min(5.0, float(snr[1])) / float(snr[1]), 1.0])
    torch.testing.assert_close(module.loss_weights(t), want)
    uniform = GeneratorModule(IDConditionedUNet(dataclasses.replace(TINY, id_dim=512)), CFG, 4, pixel=True)
    assert torch.equal(uniform.loss_weights(t), torch.ones(3))
    with pytest.raises(ConfigError, match="loss_weighting"):
        GeneratorConfig(loss_weighting="snr")
    with pytest.raises(ConfigError, match="already weights"):
        GeneratorConfig(prediction_type="edm", loss_weighting="min_snr")


def test_log_normal_timesteps_follow_edms_noise_levels() -> None:
    """Each drawn t is the first whose σ_t = √((1 − ᾱ_t)/ᾱ_t) reaches the log-normal draw: σ_t's median lands at
    exp(p_mean) and half the draws sit below σ = exp(p_mean), against ~8 % of uniform ones."""
    from ml.generator.train import GeneratorModule

    cfg = dataclasses.replace(CFG, timestep_sampling="log_normal", p_mean=-1.2, p_std=1.2)
    module = GeneratorModule(IDConditionedUNet(dataclasses.replace(TINY, id_dim=512)), cfg, 4, pixel=True)
    abar = make_noise_scheduler(cfg.noise_schedule()).alphas_cumprod.double()
    sigma = ((1 - abar) / abar).sqrt()
    t = module.draw_timesteps(20000, torch.Generator().manual_seed(0))
    assert t.dtype == torch.int64 and 0 <= int(t.min()) and int(t.max()) <= 999
    median = float(sigma[t].median())
    step = float(sigma[int((sigma < math.exp(-1.2)).sum())] / sigma[int((sigma < math.exp(-1.2)).sum()) - 1])
    assert math.exp(-1.2) * 0.97 <= median <= math.exp(-1.2) * step * 1.03  # ±3 %: the median of 20,000 draws
    assert 0.47 < float((sigma[t] < 0.35).double().mean()) < 0.6
    uniform = GeneratorModule(IDConditionedUNet(dataclasses.replace(TINY, id_dim=512)), CFG, 4, pixel=True)
    u = uniform.draw_timesteps(20000, torch.Generator().manual_seed(0))
    assert float((sigma[u] < 0.35).double().mean()) < 0.15  # a linear β schedule's uniform t: mostly high noise
    with pytest.raises(ConfigError, match="timestep_sampling"):
        GeneratorConfig(timestep_sampling="cosine")
    with pytest.raises(ConfigError, match="p_std"):
        GeneratorConfig(p_std=0.0)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction", "edm"])
def test_the_loss_target_is_the_noise_or_the_velocity_by_hand(prediction) -> None:
    """With a UNet that answers 0 the loss is the target's mean square: ε, or v = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0 drawn from
    the same seeded generator (noise first, then t)."""
    from ml.generator.train import GeneratorModule

    cfg = dataclasses.replace(CFG, prediction_type=prediction)
    module = GeneratorModule(IDConditionedUNet(dataclasses.replace(TINY, id_dim=512)), cfg, 4, pixel=True)
    module.model.forward = lambda x_t, t, context: torch.zeros_like(x_t)
    x0 = torch.rand(4, 3, 16, 16) * 2 - 1
    ids = torch.randn(4, 512)
    loss = module.diffusion_loss(x0, ids, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    noise = torch.randn(x0.shape, generator=g)
    t = torch.randint(0, 1000, (4,), generator=g)
    abar = make_noise_scheduler(cfg.noise_schedule()).alphas_cumprod[t].view(4, 1, 1, 1)
    x_t = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
    sigma2 = (1 - abar) / abar  # EDM at σ_d = 0.5: F's target (x_0 − c_skip·x_t/√ᾱ)/c_out
    c_skip, c_out = 0.25 / (sigma2 + 0.25), sigma2.sqrt() * 0.5 / (sigma2 + 0.25).sqrt()
    target = {"epsilon": noise, "v_prediction": abar.sqrt() * noise - (1 - abar).sqrt() * x0,
              "edm": (x0 - c_skip * x_t / abar.sqrt()) / c_out}[prediction]
    torch.testing.assert_close(loss, target.pow(2).mean(), rtol=1e-4, atol=1e-5)
    assert cfg.noise_schedule()["prediction_type"] == prediction


def test_a_patch_generator_trains_and_samples_faces_of_its_own_size(tmp_path) -> None:
    from ml.generator.sampler import SamplerConfig, sample

    images, ids = faces()
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(TINY, patch_size=2), epochs=1, **TRAIN_DEVICE)
    result = train_generator(cfg, images, ids, progress=False)
    result.save(tmp_path / "g")
    model, _ = load_generator(tmp_path / "g")
    assert model.config.patch_size == 2
    with torch.no_grad():
        res = sample(model.unet, model.encode_context(torch.from_numpy(ids[:2])), model.empty(1),
                     model.sample_shape(2), SamplerConfig(mode="two_stage_fixed", steps=5))
    assert model.from_unet(res.x0).shape == (2, 3, 16, 16)


# ---------------------------------------------------------------------------------------------- latent autoencoder
@pytest.mark.parametrize("architecture", ["kl", "tiny"])
@pytest.mark.parametrize("seed", [0, 1])
def test_autoencoder_reconstructs_held_out_faces_better_than_the_mean_face(seed, architecture) -> None:
    """The phase-1 autoencoder learns: on faces it never saw, its reconstructions beat the trivial answer (the
    training set's mean face) in PSNR, for every seed and architecture; its latent scale is set to unit std."""
    from ml.generator.autoencoder import AutoencoderConfig, reconstruct, train_autoencoder

    images, _ = separable(4, 24, size=16, seed=seed)
    train, held = images[::2], images[1::2]
    epochs = 12 if architecture == "kl" else 24  # no normalisation: the tiny one starts slower at this lr
    cfg = AutoencoderConfig(architecture=architecture, block_out_channels=(8, 16) if architecture == "kl" else (16, 16),
                            norm_num_groups=4, fr_weight=0.0, epochs=epochs, batch_size=8, lr=3e-3, seed=seed,
                            **TRAIN_DEVICE)
    autoencoder, history, _ = train_autoencoder(cfg, train, progress=False)
    assert len(history) == epochs and history[-1]["train/loss"] < history[0]["train/loss"]
    recon, means = reconstruct(autoencoder, held)
    assert means.shape[1:] == (4, 8, 8)

    def psnr(a: np.ndarray, b: np.ndarray) -> float:
        return float(10 * np.log10(255.0 ** 2 / ((a.astype(float) - b.astype(float)) ** 2).mean()))

    mean_face = np.broadcast_to(train.astype(float).mean(axis=0), held.shape)
    assert psnr(recon, held) > psnr(mean_face, held) + 2.0
    assert float(means.std()) == pytest.approx(1.0, rel=0.25)  # latents as the UNet sees them: × scaling_factor


def test_only_the_tiny_autoencoder_returns_each_face_its_own_colour() -> None:
    """Faces that differ in nothing but their colour (uniform fills, pixel noise): the KL decoder ends in a GroupNorm,
    which takes each image's mean per channel group away, so it returns every fill in about one colour; the tiny
    one (no normalisation) returns each its own. Mean absolute error of the reconstructions' mean colour."""
    from ml.generator.autoencoder import AutoencoderConfig, reconstruct, train_autoencoder

    rng = np.random.default_rng(0)
    colours = rng.integers(30, 226, (64, 1, 1, 3))
    images = np.clip(colours + rng.normal(0, 6, (64, 16, 16, 3)), 0, 255).astype(np.uint8)
    errors = {}
    for architecture, channels in (("kl", (8, 16)), ("tiny", (16, 16))):
        cfg = AutoencoderConfig(architecture=architecture, block_out_channels=channels, norm_num_groups=4,
                                fr_weight=0.0, epochs=10, batch_size=8, lr=3e-3, **TRAIN_DEVICE)
        autoencoder, _, _ = train_autoencoder(cfg, images, progress=False)
        recon, _ = reconstruct(autoencoder, images)
        errors[architecture] = float(np.abs(recon.mean(axis=(1, 2)) - images.mean(axis=(1, 2))).mean())
    assert errors["tiny"] < 12 and errors["kl"] > 2 * errors["tiny"], errors
    with pytest.raises(ConfigError, match="architecture tiny"):
        AutoencoderConfig(architecture="tiny", block_out_channels=(16, 32))


def test_autoencoder_identity_term_needs_the_fr_model() -> None:
    from ml.generator.autoencoder import AutoencoderConfig, train_autoencoder

    images, _ = separable(2, 4, size=16)
    with pytest.raises(ConfigError, match="fr_weight"):
        train_autoencoder(AutoencoderConfig(block_out_channels=(8, 16), norm_num_groups=4), images, progress=False)
    with pytest.raises(ConfigError, match="norm_num_groups"):
        AutoencoderConfig(block_out_channels=(8, 12), norm_num_groups=8)


@pytest.mark.parametrize("size", [64, 32])
def test_autoencoder_identity_term_gives_a_kprpe_fr_model_its_landmarks(size) -> None:
    """With a KP-RPE FR model as the identity teacher, the autoencoder's FR term calls it with each face's
    landmarks (it cannot embed a face without them) and refuses to start when none are given. Faces smaller than
    the FR model's input (the default latent space works on 32-px faces, the FR model on 64) reach it resized to
    its input, their landmarks scaled with them."""
    from ml.fr.backbones import build_backbone
    from ml.generator.autoencoder import AutoencoderConfig, train_autoencoder

    images, _ = separable(2, 4, size=size)
    fr = build_backbone("vit_tiny_kprpe", depth=1).eval()
    seen = []
    fr.register_forward_pre_hook(lambda _, args: seen.append((tuple(args[0].shape), args[1].detach().clone())))
    ids = np.random.default_rng(0).normal(size=(len(images), 128)).astype(np.float32)
    points = np.array([[22, 26], [42, 26], [32, 36], [24, 46], [40, 46]], np.float32)  # in 64-px pixels
    landmarks = np.tile(points * (size / 64), (len(images), 1, 1))
    cfg = AutoencoderConfig(block_out_channels=(8, 16), norm_num_groups=4, fr_batch=4, epochs=1, batch_size=4,
                            accelerator="cpu")
    with pytest.raises(DataError, match="landmarks"):
        train_autoencoder(cfg, images, ids, fr, progress=False)
    _, history, _ = train_autoencoder(cfg, images, ids, fr, landmarks, progress=False)
    assert np.isfinite(history[-1]["train/fr_cosine"])
    shape, keypoints = seen[0]
    assert shape == (4, 3, 64, 64)
    np.testing.assert_allclose(keypoints.numpy(), np.tile(points, (4, 1, 1)), rtol=1e-6)
