"""FR training options: AdaFace, PartialFC, LVFace, step schedule, clipping, precision checks, checkpoints with
exact resume, mismatch and NaN errors. Tiny ViTs (one block, 32 px) on a separable toy problem."""

from __future__ import annotations

import dataclasses
import math

import lightning
import numpy as np
import pytest
import torch

from ml.errors import ConfigError, DataError, TrainingError
from ml.fr.losses import AdaFaceLoss, LVFaceSchedule, PartialFC
from ml.fr.backbones import build_backbone
from ml.fr.train import EpochSampler, FRConfig, FRModule, build_head, train_fr, warmup_step_decay

from tests.conftest import separable, stop_after

TINY = {"depth": 1}




class Probe(lightning.Callback):
    """Records the LR before every step and keeps the module's head and the trainer's clip value."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.head = None
        self.clip = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.head, self.clip = pl_module.head, trainer.gradient_clip_val


class Poison(lightning.Callback):
    """Makes the embeddings NaN from global step ``step`` on."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.backbone.feature[0].weight.fill_(float("nan"))


# 16 classes × 4 images, batches of 8 (8 steps/epoch): PartialFC at 0.5 keeps 8 of 16 classes, so it samples.
RESUME_CFG = FRConfig(
    epochs=4, batch_size=8, lr=2e-3, embedding_dim=32, accelerator="cpu", warmup_epochs=1.0,
    augment_recipe="kprpe", sample_rate=0.5, lvface=True, schedule="step", lr_steps=(0.5, 0.8), grad_clip=5.0,
)
RESUME_OVERRIDES = {"depth": 1, "mask_ratio": 0.25}  # token masking: the model's own randomness must resume too


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    images, labels = separable(16, 4)
    val = (images[::4], labels[::4])  # measured after every epoch: must not change what training does
    probe = Probe()
    full = train_fr(RESUME_CFG, images, labels, progress=False, backbone_overrides=RESUME_OVERRIDES, callbacks=[probe],
                 val=val)
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    first = train_fr(RESUME_CFG, images, labels, progress=False, backbone_overrides=RESUME_OVERRIDES,
                  checkpoint_dir=ckpt_dir, callbacks=[stop_after(2)], val=val)
    second = train_fr(RESUME_CFG, images, labels, progress=False, backbone_overrides=RESUME_OVERRIDES,
                   checkpoint_dir=ckpt_dir, resume=True, val=val)
    return images, labels, full, first, second, ckpt_dir, probe


def test_resume_gives_the_weights_of_an_uninterrupted_run(resumed):
    *_, full, first, second, ckpt_dir, _ = resumed
    assert [r["epoch"] for r in first.history] == [0, 1]
    assert [r["epoch"] for r in second.history] == [0, 1, 2, 3]  # history travels in the checkpoint
    assert second.checkpoint == ckpt_dir / "last.ckpt"
    a, b = full.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0, msg=key)
    for x, y in zip(full.history, second.history):
        assert x["train/loss"] == pytest.approx(y["train/loss"], abs=1e-6)
        assert x["val/accuracy"] == y["val/accuracy"]


def test_a_run_streamed_from_shards_resumes_to_the_in_memory_runs_weights(resumed, tmp_path):
    """``fr.stream``: the faces stay PNGs in a dataset's shards, decoded by two DataLoader workers per batch; stopped
    after two epochs and resumed, the run ends with the weights of the uninterrupted in-memory run (with workers, the
    resumed epoch's first batches are drawn before Lightning sets the sampler's epoch: ``fit`` sets it first)."""
    from ml.data.dataset import DatasetWriter, read_manifest
    from ml.data.records import ShardDataset

    images, labels, full, *_ = resumed
    with DatasetWriter(tmp_path / "faces", name="toy", source="procedural", aligned=True) as w:
        for image, label in zip(images, labels):
            w.add(image, identity=f"id{label:02d}")
    faces = ShardDataset(tmp_path / "faces", read_manifest(tmp_path / "faces" / "manifest.parquet"))
    np.testing.assert_array_equal(faces.labels, labels)
    cfg = dataclasses.replace(RESUME_CFG, stream=True, num_workers=2)
    val = (images[::4], labels[::4])
    first = train_fr(cfg, faces, labels, progress=False, backbone_overrides=RESUME_OVERRIDES,
                     checkpoint_dir=tmp_path / "ckpt", callbacks=[stop_after(2)], val=val)
    second = train_fr(cfg, faces, labels, progress=False, backbone_overrides=RESUME_OVERRIDES,
                      checkpoint_dir=tmp_path / "ckpt", resume=True, val=val)
    assert [r["epoch"] for r in first.history] == [0, 1] and len(second.history) == 4
    a, b = full.model.state_dict(), second.model.state_dict()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0, msg=key)
    with pytest.raises(DataError, match=r"labels must be integers of shape \(64,\)"):
        train_fr(cfg, faces, labels[:-1], progress=False, backbone_overrides=RESUME_OVERRIDES)


class SaveAt(lightning.Callback):
    """Saves a checkpoint to ``path`` once ``step`` optimiser steps are done, in the middle of an epoch."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_a_run_streamed_from_a_shard_copy_resumes_exactly_at_and_within_an_epoch(resumed, tmp_path):
    """``fr.stream_from``: the faces stream from a shard set a window at a time, by two workers that start afresh
    every epoch. Stopped after two epochs, or checkpointed after 11 of 32 steps (3 batches into epoch 1) and
    resumed from there, the run ends with the weights of the uninterrupted streamed run."""
    import shutil

    from ml.data.formats import encode_image
    from ml.data.shards import write_shards
    from ml.data.shard_stream import ShardStream

    images, labels, *_ = resumed
    keys = [f"id{label:02d}/{i}" for i, label in enumerate(labels)]
    write_shards([(k, "png", encode_image(im, "png")) for k, im in zip(keys, images)], tmp_path / "shards",
                 max_bytes=60_000, pack_bytes=8_000)
    stream = ShardStream(tmp_path / "shards", keys, labels, image_size=32, window_bytes=20_000)
    assert len(stream.windows) >= 4
    cfg = dataclasses.replace(RESUME_CFG, num_workers=2)
    val = (images[::4], labels[::4])

    def run(**kw):
        return train_fr(cfg, stream, labels, progress=False, backbone_overrides=RESUME_OVERRIDES, val=val, **kw)

    full = run(callbacks=[SaveAt(11, tmp_path / "step11.ckpt")])
    first = run(checkpoint_dir=tmp_path / "a", callbacks=[stop_after(2)])
    second = run(checkpoint_dir=tmp_path / "a", resume=True)
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "step11.ckpt", tmp_path / "b" / "last.ckpt")
    within = run(checkpoint_dir=tmp_path / "b", resume=True)
    assert [r["epoch"] for r in first.history] == [0, 1] and len(second.history) == 4
    a = full.model.state_dict()
    for other in (second, within):
        b = other.model.state_dict()
        for key in a:
            torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0, msg=key)
    assert full.history[-1]["train/accuracy"] > 4 / 16  # it learns from the stream (16 classes: chance 1/16)


def test_partial_fc_lvface_step_schedule_and_clipping(resumed):
    *_, full, _, _, _, probe = resumed
    head = probe.head
    assert isinstance(head, LVFaceSchedule) and isinstance(head.head, PartialFC)
    assert head.stable and head.head.sample_rate == 1.0  # switched at epoch 4 // 2
    assert bool(head.prototype_seen.all())
    assert probe.clip == 5.0
    steps = 4 * 8
    expected = [2e-3 * warmup_step_decay(s, 8, [16, round(0.8 * steps)]) for s in range(steps)]
    assert probe.lrs == pytest.approx(expected)
    assert all(math.isfinite(r["train/loss"]) for r in full.history)


def test_resume_refuses_other_architecture_classes_or_head(resumed):
    images, labels, *_, ckpt_dir, _ = resumed
    last = str(ckpt_dir / "last.ckpt")
    with pytest.raises(ConfigError, match="backbone") as err:
        train_fr(RESUME_CFG, images, labels, progress=False, backbone_overrides={"depth": 2, "mask_ratio": 0.25},
              checkpoint_dir=ckpt_dir, resume=True)
    assert last in str(err.value) and "fr.backbone_kwargs.depth: 1 → 2" in str(err.value)
    keep = labels < 15
    with pytest.raises(DataError, match="num_classes 16, these are 15") as err:
        train_fr(RESUME_CFG, images[keep], labels[keep], progress=False, backbone_overrides=RESUME_OVERRIDES,
              checkpoint_dir=ckpt_dir, resume=True)
    assert last in str(err.value)
    other_head = dataclasses.replace(RESUME_CFG, sample_rate=1.0)
    with pytest.raises(ConfigError, match="head"):
        train_fr(other_head, images, labels, progress=False, backbone_overrides=RESUME_OVERRIDES,
              checkpoint_dir=ckpt_dir, resume=True)
    with pytest.raises(ConfigError, match="resume=True"):  # an existing last.ckpt is not silently overwritten
        train_fr(RESUME_CFG, images, labels, progress=False, backbone_overrides=RESUME_OVERRIDES, checkpoint_dir=ckpt_dir)


def test_nan_loss_stops_naming_step_and_last_checkpoint(tmp_path):
    images, labels = separable(4, 16)
    cfg = FRConfig(epochs=3, batch_size=16, embedding_dim=32, accelerator="cpu")  # 4 steps per epoch
    with pytest.raises(TrainingError, match="global step 6") as err:
        train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY, checkpoint_dir=tmp_path,
              callbacks=[Poison(6)])
    assert str(tmp_path / "last.ckpt") in str(err.value)
    with pytest.raises(TrainingError, match="global step 1.*no checkpoint was saved"):
        train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY, callbacks=[Poison(1)])


def test_adaface_head_trains_on_unnormalised_embeddings():
    images, labels = separable(4, 16)
    probe = Probe()
    cfg = FRConfig(epochs=2, batch_size=16, embedding_dim=32, accelerator="cpu", margin="adaface")
    result = train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY, callbacks=[probe])
    assert isinstance(probe.head, AdaFaceLoss)
    assert float(probe.head.batch_mean) != 20.0  # the norm EMA saw the raw feature norms
    assert all(math.isfinite(r["train/loss"]) for r in result.history)


def test_precision_needs_a_gpu_for_fp16_but_bf16_runs_on_cpu():
    images, labels = separable(4, 8)
    with pytest.raises(ConfigError, match="needs a GPU"):
        train_fr(FRConfig(precision="16-mixed", accelerator="cpu"), images, labels, progress=False)
    cfg = FRConfig(epochs=1, batch_size=16, embedding_dim=32, accelerator="cpu", precision="bf16-mixed", max_steps=2)
    result = train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY)
    assert math.isfinite(result.history[-1]["train/loss"])


@pytest.mark.parametrize("margin", ["arcface", "adaface"])
def test_bf16_mixed_trains_the_kprpe_recipe_with_every_op_drawn(margin):
    """Under autocast the blur's and the resample's outputs and the head's cos θ came out in bfloat16 and could not be
    written into the float32 batch / cosine matrix (the real-112 preset failed at its first step on a GPU). Every
    photometric op on, so the failure cannot hide behind a draw; and the head's cosines stay float32."""
    from ml.train.augment import AugmentConfig

    images, labels = separable(4, 8)
    every = AugmentConfig(blur_prob=1.0, cutout_prob=1.0, brightness_prob=1.0, contrast_prob=1.0,
                          saturation_prob=1.0, randaug_prob=1.0)
    cfg = FRConfig(epochs=1, batch_size=16, embedding_dim=32, accelerator="cpu", precision="bf16-mixed", max_steps=2,
                   augment_recipe="kprpe", augmentation=every, margin=margin)
    seen = []

    class HeadDtype(lightning.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            x = torch.randn(4, 32)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                seen.append(module._loss(x, torch.arange(4) % 4)[0].dtype)

    result = train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY, callbacks=[HeadDtype()])
    assert math.isfinite(result.history[-1]["train/loss"])
    assert seen and all(d == torch.float32 for d in seen)


def test_config_rejects_inconsistent_options():
    for bad, match in [
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(margin="adaface", sample_rate=0.5), "adaface"),
        (dict(margin="adaface", lvface=True), "adaface"),
        (dict(lvface=True, epochs=4, lvface_switch_epoch=4), "lvface_switch_epoch"),
        (dict(schedule="poly"), "schedule"),
        (dict(lr_steps=(0.9, 0.6)), "lr_steps"),
        (dict(strategy="fsdp"), "strategy"),
        (dict(precision="16"), "precision"),
        (dict(grad_clip=-1.0), "grad_clip"),
        (dict(augment_recipe="randaug"), "augment_recipe"),
    ]:
        with pytest.raises(ConfigError, match=match):
            FRConfig(**bad)
    assert FRConfig(lvface=True, epochs=6).switch_epoch == 3
    with pytest.raises(ConfigError, match="checkpoint_dir"):
        train_fr(FRConfig(), *separable(2, 4), resume=True)


def test_warmup_step_decay():
    assert warmup_step_decay(0, 4, [10, 15]) == pytest.approx(0.25)
    assert warmup_step_decay(9, 4, [10, 15]) == 1.0
    assert warmup_step_decay(10, 4, [10, 15]) == pytest.approx(0.1)
    assert warmup_step_decay(15, 4, [10, 15]) == pytest.approx(0.01)


def test_epoch_sampler_depends_on_seed_and_epoch_only():
    s = EpochSampler(20, seed=3)
    first = list(s)
    assert sorted(first) == list(range(20)) and list(s) == first
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first and list(EpochSampler(20, seed=3)) == first


def test_module_builds_a_sharded_head_in_configure_model():
    cfg = FRConfig(embedding_dim=32, sample_rate=0.5)
    module = FRModule(build_backbone("vit_tiny", depth=1, embed_dim=32), lambda: build_head(cfg, 10), cfg, 1)
    assert "head" not in module._modules
    module.configure_model()
    assert isinstance(module.head, PartialFC) and module.head.num_local == 10
    assert module._ddp_params_and_buffers_to_ignore == ["head.weight", "head.step"]


@pytest.mark.slow
def test_two_ddp_ranks_train_the_model_of_one_process_with_their_global_batch():
    """Two CPU ranks (gloo) with batches of 8 against one process with batches of 16: the same images per step
    (``EpochSampler`` gives rank r every second image of the epoch's order), gradients averaged over the ranks, and
    BatchNorm over the global batch (``ml.train.batchnorm``), so the weights agree to float tolerance. Exempt: the
    final LayerNorm's and first BatchNorm's shifts, which the next BatchNorm cancels (their gradient is rounding
    noise, which AdamW scales to full steps), and the running means they move; the embeddings agree regardless.
    (Augmentation is off: it draws per rank.) Without the global BatchNorm the embeddings part (cosine ≈ 0.8)."""
    from ml.fr.train import embed

    images, labels = separable(8, 8)
    cfg = FRConfig(epochs=2, batch_size=16, embedding_dim=32, accelerator="cpu", augment=False, lr=2e-3)
    single = train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY)
    ranks = train_fr(dataclasses.replace(cfg, batch_size=8, devices=2, strategy="ddp_spawn"), images, labels,
                     progress=False, backbone_overrides=TINY)
    a, b = single.model.state_dict(), ranks.model.state_dict()
    cancelled = {"norm.bias", "feature.1.bias", "feature.1.running_mean", "feature.3.running_mean"}
    for key in a.keys() - cancelled:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=1e-4, msg=key)
    ea, eb = embed(single.model, images), embed(ranks.model, images)
    cosine = (ea * eb).sum(1) / np.linalg.norm(ea, axis=1) / np.linalg.norm(eb, axis=1)
    assert cosine.min() > 0.9999


@pytest.mark.slow
def test_two_ddp_ranks_train_in_step_on_their_own_parts_of_a_stream(tmp_path):
    """Two CPU ranks (gloo) streaming from one shard set: each reads its own equal part of the epoch (the split is
    ``test_stream.py``'s), so both take the same number of steps and the run ends instead of waiting on a rank."""
    from ml.data.formats import encode_image
    from ml.data.shards import write_shards
    from ml.data.shard_stream import ShardStream
    from ml.fr.train import embed

    images, labels = separable(8, 9)  # 72 faces: 36 per rank, 4 batches of 8 each (4 faces a rank left over)
    keys = [f"id{label}/{i}" for i, label in enumerate(labels)]
    write_shards([(k, "png", encode_image(im, "png")) for k, im in zip(keys, images)], tmp_path / "shards",
                 max_bytes=40_000, pack_bytes=6_000)
    stream = ShardStream(tmp_path / "shards", keys, labels, image_size=32, window_bytes=12_000)
    cfg = FRConfig(epochs=2, batch_size=8, embedding_dim=32, accelerator="cpu", augment=False, lr=2e-3, devices=2,
                   strategy="ddp_spawn")
    result = train_fr(cfg, stream, labels, progress=False, backbone_overrides=TINY, checkpoint_dir=tmp_path / "ckpt")
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["global_step"]) == (1, 8)  # 2 epochs × 4 steps on each rank
    assert np.isfinite(embed(result.model, images)).all()


@pytest.mark.slow
def test_ddp_checkpoint_holds_every_class_and_resumes_in_one_process(tmp_path):
    """Two CPU ranks (gloo): PartialFC shards of 8 classes are gathered into a 16-class checkpoint, AdamW
    moments included, and a single process resumes from it."""
    images, labels = separable(16, 4)
    cfg = FRConfig(epochs=1, batch_size=8, embedding_dim=32, accelerator="cpu", devices=2, strategy="ddp_spawn",
                   sample_rate=0.5, lvface=True, lvface_switch_epoch=0)
    # val/accuracy of the sharded head: each rank gathers all 16 class centres
    train_fr(cfg, images, labels, progress=False, backbone_overrides=TINY, checkpoint_dir=tmp_path,
          val=(images[::4], labels[::4]))
    ckpt = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    state = ckpt["state_dict"]
    assert state["head.head.weight"].shape == (16, 32) and state["head.prototypes"].shape == (16, 32)
    assert {tuple(s["exp_avg"].shape) for s in ckpt["optimizer_states"][0]["state"].values()} >= {(16, 32)}
    single = dataclasses.replace(cfg, devices=1, strategy="auto", epochs=2)
    result = train_fr(single, images, labels, progress=False, backbone_overrides=TINY, checkpoint_dir=tmp_path,
                   resume=True)
    assert [r["epoch"] for r in result.history] == [0, 1]
    assert math.isfinite(result.history[-1]["train/loss"])
    assert 0.0 <= result.history[0]["val/accuracy"] <= 1.0 and "val/accuracy" not in result.history[1]
