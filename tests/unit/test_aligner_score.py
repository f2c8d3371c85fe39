"""DFA face score: non-face crops, the score losses by hand, a tiny run that learns face vs non-face, exact resume
with negatives, the score metrics, and the set fusion taking its landmarks and scores from a saved aligner."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from ml.data.procedural import NONFACE_KINDS, ProceduralConfig, nonface_kind, render_nonface, render_nonfaces
from ml.data.unaligned import unaligned_faces
from ml.errors import ConfigError, DataError
from ml.aligner.metrics import score_auc, spearman
from ml.aligner.dfa import build_aligner, save_aligner
from ml.aligner.train import LAST_CHECKPOINT, AlignerConfig, train_aligner
from ml.aligner.data import HELDOUT_NONFACE_START, nonface_crops
from ml.aligner.evaluate import evaluate_aligner
from ml.aligner.losses import hard_negatives, score_losses

# Tiny but complete: 64-px input (168 anchors), narrow FPN, one mixer block (as in test_dfa.py).
TINY = dict(input_size=64, fpn_channels=16, mixer_depth=1, mixer_dim=8, mixer_token_hidden=8,
            mixer_channel_hidden=8)

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------
# non-face crops


def test_nonface_renders_are_deterministic_uint8_and_cover_every_kind():
    images = render_nonfaces(7, range(12), size=64)
    assert images.shape == (12, 64, 64, 3) and images.dtype == np.uint8
    again = render_nonfaces(7, range(12), size=64)
    np.testing.assert_array_equal(images, again)
    np.testing.assert_array_equal(images[5], render_nonface(7, 5, 64))  # one index = one crop, in any batch
    other = render_nonfaces(8, range(12), size=64)
    assert all(not np.array_equal(a, b) for a, b in zip(images, other))  # the seed matters
    assert len({img.tobytes() for img in images}) == 12
    assert all(img.std() > 1.0 for img in images)  # not blank
    kinds = [nonface_kind(7, i) for i in range(40)]
    assert set(kinds) == set(NONFACE_KINDS)
    assert render_nonface(7, 3, 96).shape == (96, 96, 3)
    narrow = ProceduralConfig(aligned=False, clutter_max=0, stripes_prob=0.0, noise_prob=0.0)
    assert not np.array_equal(render_nonface(7, 0, 64, narrow), images[0])  # the config's nuisance is used


def test_off_frame_nonfaces_keep_every_landmark_outside_the_crop(monkeypatch):
    """Spy on the renderer: for ``off_frame`` crops the face's 5 landmarks are ≥ 3 % of the side outside."""
    from ml.data.procedural import geometry

    seen: list[list[tuple[float, float]]] = []
    real = geometry._View.points

    def spy(self, pts):
        out = real(self, pts)
        seen.append(out)
        return out

    monkeypatch.setattr(geometry._View, "points", spy)
    off = [i for i in range(40) if nonface_kind(3, i) == "off_frame"][:5]
    assert off
    for index in off:
        seen.clear()
        render_nonface(3, index, 64)
        final = seen[-1]  # the accepted placement is the last one tried
        margin = 0.03 * 64
        assert all(x < -0.5 - margin or x > 63.5 + margin or y < -0.5 - margin or y > 63.5 + margin
                   for x, y in final), (index, final)


def test_nonface_bad_arguments_name_the_argument():
    with pytest.raises(ConfigError, match="seed"):
        render_nonface(-1, 0)
    with pytest.raises(ConfigError, match="index"):
        render_nonface(0, 1.5)
    with pytest.raises(ConfigError, match="image_size"):
        render_nonface(0, 0, size=16)
    with pytest.raises(ConfigError, match="ProceduralConfig"):
        render_nonface(0, 0, config={"clutter_max": 2})


def test_nonface_crops_are_disjoint_from_the_heldout_range():
    train = nonface_crops(0, 0, 3, 64)
    held = nonface_crops(0, HELDOUT_NONFACE_START, 3, 64)
    np.testing.assert_array_equal(train, render_nonfaces(0, range(3), 64))
    assert not any(np.array_equal(a, b) for a in train for b in held)
    assert nonface_crops(0, 0, 0, 64).shape == (0, 64, 64, 3)


# --------------------------------------------------------------------------------------------------
# the score losses


def _priors() -> torch.Tensor:
    """Four anchors (cx, cy, w, h): two over the face box [0.4, 0.6]², two far from it."""
    return torch.tensor([[0.5, 0.5, 0.4, 0.4], [0.55, 0.45, 0.4, 0.4], [0.95, 0.95, 0.4, 0.4], [0.05, 0.95, 0.4, 0.4]])


def _face_target() -> torch.Tensor:
    return torch.tensor([[[0.4, 0.4], [0.6, 0.4], [0.5, 0.5], [0.42, 0.6], [0.58, 0.6]]])


def _logits(xs: list[float]) -> torch.Tensor:
    """Per-anchor logits (background 0, face x): p_face = sigmoid(x)."""
    x = torch.tensor(xs)
    return torch.stack([torch.zeros_like(x), x], dim=-1)


def test_score_losses_by_hand():
    l3 = math.log(3.0)
    logits = torch.stack([_logits([0.0, l3, 0.0, l3]), _logits([-l3, 0.0, l3, -math.log(7.0)])])
    logits.requires_grad_(True)
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]], requires_grad=True)
    out = {"anchor_scores": logits, "weights": weights}
    target = torch.cat([_face_target(), torch.full((1, 5, 2), 0.5)])  # row 1: a non-face placeholder
    face = torch.tensor([True, False])
    # ratio 0.5: each crop keeps ⌈0.5·2⌉ = 1 hard negative (the non-face crop uses the faces' mean |P| = 2)
    anchor, pooled = score_losses(out, target, face, _priors(), anchor_radius=0.0, negative_ratio=0.5)
    # positives a0 (p = ½), a1 (p = ¾); face-crop negatives a2 (CE_bg = log 2), a3 (log 4) → a3;
    # non-face negatives: CE_bg = log(4/3), log 2, log 4, log(8/7) → log 4
    expected = (math.log(2.0) + math.log(4.0 / 3.0) + math.log(4.0) + math.log(4.0)) / 4
    assert anchor.item() == pytest.approx(expected, rel=1e-6)
    # pooled scores Σ w·p: ½·½ + ½·¾ = 0.625 (a face) and 1·⅛ (a non-face)
    assert pooled.item() == pytest.approx(-(math.log(0.625) + math.log(1 - 0.125)) / 2, rel=1e-6)
    (anchor + pooled).backward()
    assert weights.grad is None  # the pooling weights belong to the landmark loss
    logits.grad = None
    anchor, _ = score_losses(out, target, face, _priors(), anchor_radius=0.0, negative_ratio=0.5)
    anchor.backward()
    grad = logits.grad
    assert torch.all(grad[0, 2] == 0) and torch.all(grad[1, [0, 1, 3]] == 0)  # unselected anchors: no gradient
    assert grad[0, 3, 1] > 0 and grad[1, 2, 1] > 0  # the hard negatives' face logits are pushed down
    assert grad[0, 0, 1] < 0  # a positive's face logit is pushed up
    # ratio 3: every candidate is kept (quota 6 > 2 and > 4)
    anchor3, _ = score_losses(out, target, face, _priors(), anchor_radius=0.0, negative_ratio=3.0)
    all_ce = [math.log(2.0), math.log(4.0 / 3.0), math.log(2.0), math.log(4.0),
              math.log(4.0 / 3.0), math.log(2.0), math.log(4.0), math.log(8.0 / 7.0)]
    assert anchor3.item() == pytest.approx(sum(all_ce) / 8, rel=1e-6)


def test_score_losses_are_zero_and_finite_with_nothing_to_score():
    """A face whose box holds no anchor centre: no positives, so no quota for negatives anywhere → 0, zero grads;
    an empty batch → (0, 0)."""
    logits = torch.zeros(2, 4, 2, requires_grad=True)  # p = ½ everywhere
    weights = torch.full((2, 4), 0.25)
    target = torch.cat([torch.full((1, 5, 2), 0.3) + torch.linspace(0, 0.01, 10).view(1, 5, 2),
                        torch.full((1, 5, 2), 0.5)])
    anchor, bce = score_losses({"anchor_scores": logits, "weights": weights}, target, torch.tensor([True, False]),
                               _priors(), anchor_radius=0.0, negative_ratio=3.0)
    assert anchor.item() == 0.0
    anchor.backward()
    assert torch.all(logits.grad == 0)
    assert bce.item() == pytest.approx(math.log(2.0), rel=1e-6)  # pooled ½ for either label
    empty = score_losses({"anchor_scores": torch.zeros(0, 4, 2), "weights": torch.zeros(0, 4)},
                         torch.zeros(0, 5, 2), torch.zeros(0, dtype=torch.bool), _priors(), 0.0, 3.0)
    assert [v.item() for v in empty] == [0.0, 0.0]


def test_hard_negatives_pick_the_highest_loss_candidates_per_row():
    hardness = torch.tensor([[0.1, 0.9, 0.5, 0.9], [3.0, 2.0, 1.0, 0.0]])
    candidates = torch.tensor([[True, True, True, False], [True, False, True, True]])
    picked = hard_negatives(hardness, candidates, torch.tensor([2, 5]))
    assert picked.tolist() == [[False, True, True, False], [True, False, True, True]]  # quota > candidates: all
    assert not hard_negatives(hardness, candidates, torch.tensor([0, 0])).any()


# --------------------------------------------------------------------------------------------------
# metrics


def test_score_metrics_by_hand():
    assert score_auc(np.array([0.9, 0.8, 0.3]), np.array([0.2, 0.85])) == pytest.approx(4 / 6)
    assert score_auc(np.array([0.5, 0.5]), np.array([0.5])) == pytest.approx(0.5)  # ties count half
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([10.0, 30.0, 20.0, 40.0])) == pytest.approx(0.8)
    assert math.isnan(spearman(np.ones(3), np.arange(3.0)))
    with pytest.raises(DataError, match="same length"):
        spearman(np.ones(3), np.ones(4))
    with pytest.raises(DataError, match="finite"):
        score_auc(np.array([np.nan]), np.ones(2))


class _FixedAligner:
    """Stands in for a DFA: ``predict`` returns the landmarks it was given and a score per image size."""

    def __init__(self, landmarks: np.ndarray, scores: dict[int, np.ndarray]):
        self.landmarks, self.scores = landmarks, scores

    def predict(self, images: np.ndarray, batch_size: int = 128):
        return self.landmarks[: len(images)], self.scores[images.shape[1]]


def test_evaluate_aligner_score_metrics_by_hand():
    faces = np.zeros((3, 32, 32, 3), np.uint8)
    nonfaces = np.zeros((2, 24, 24, 3), np.uint8)
    gt = np.tile(np.array([[10, 12], [22, 12], [16, 17], [11, 23], [21, 23]], np.float32), (3, 1, 1))
    model = _FixedAligner(gt, {32: np.array([0.9, 0.8, 0.3], np.float32), 24: np.array([0.2, 0.85], np.float32)})
    res = evaluate_aligner(model, faces, gt, nonfaces=nonfaces, qualities=np.array([0.7, 0.9, 0.1]))
    assert res["nme"] == 0.0 and res["nme_box"] == 0.0 and res["failure_box@0.05"] == 0.0
    assert res["face_auc"] == pytest.approx(4 / 6)
    assert res["face_accuracy@0.5"] == pytest.approx(3 / 5)  # 0.9, 0.8 ≥ ½ and 0.2 < ½ are right
    assert res["face_score_mean"] == pytest.approx(2.0 / 3) and res["nonface_score_mean"] == pytest.approx(0.525)
    assert res["score_quality_spearman"] == pytest.approx(0.5)  # ranks (3, 2, 1) vs (2, 3, 1)
    with pytest.raises(DataError, match="qualities"):
        evaluate_aligner(model, faces, gt, qualities=np.ones(2))


# --------------------------------------------------------------------------------------------------
# training


@pytest.fixture(scope="module")
def faces():
    """Unaligned 64-px procedural faces: 256 for training, 64 held out (other identities)."""
    train = unaligned_faces(32, 8, size=64, seed=3)
    held = unaligned_faces(16, 4, size=64, seed=3, first_identity=10_000)
    return train, held


def test_config_keys_are_checked_and_nonfaces_per_batch_rounds():
    assert AlignerConfig(batch_size=32, nonface_fraction=0.125).nonfaces_per_batch == 4
    assert AlignerConfig(batch_size=10, nonface_fraction=0.0).nonfaces_per_batch == 0
    for key, bad in (("nonface_fraction", 0.6), ("nonface_fraction", -0.1), ("score_loss_weight", -1.0),
                     ("pooled_score_loss_weight", -1.0), ("negative_ratio", 0.0)):
        with pytest.raises(ConfigError, match=f"aligner.{key}"):
            AlignerConfig(**{key: bad})


def test_tiny_training_separates_faces_from_nonfaces(faces):
    (images, landmarks, _), (held_images, held_landmarks, _) = faces
    cfg = AlignerConfig(**TINY, epochs=4, batch_size=16, lr=2e-2, seed=0, nonface_fraction=0.25)
    result = train_aligner(cfg, images, landmarks, progress=False)  # 12 faces + 4 non-faces per batch, 84 steps
    scores = [row["train/score_loss"] for row in result.history]
    assert scores[-1] < 0.7 * scores[0], scores
    held_nonfaces = nonface_crops(11, HELDOUT_NONFACE_START, 64, 64)  # another seed, never-trained indices
    res = evaluate_aligner(result.model, held_images, held_landmarks, nonfaces=held_nonfaces)
    # Measured over seeds 0–2: AUC 0.95–0.97, accuracy 0.86–0.91; the same runs with nonface_fraction 0 (an
    # untrained score): AUC 0.46–0.85, accuracy 0.5, faces and non-faces on the same side of ½.
    assert res["face_auc"] > 0.8, res
    assert res["face_accuracy@0.5"] > 0.7, res
    assert res["face_score_mean"] > 0.5 > res["nonface_score_mean"], res


def test_resume_with_nonfaces_equals_uninterrupted(faces, tmp_path):
    (images, landmarks, _), _ = faces
    images, landmarks = images[:48], landmarks[:48]
    cfg = AlignerConfig(**TINY, epochs=2, batch_size=32, seed=5, nonface_fraction=0.25)
    full = train_aligner(cfg, images, landmarks, progress=False)
    assert all("train/score_loss" in row for row in full.history)

    class Stop(Exception):
        pass

    def stop(row):
        raise Stop

    with pytest.raises(Stop):
        train_aligner(cfg, images, landmarks, checkpoint_dir=tmp_path, progress=False, on_epoch_end=stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LAST_CHECKPOINT]
    resumed = train_aligner(cfg, images, landmarks, checkpoint_dir=tmp_path, resume=True, progress=False)
    assert resumed.history == full.history
    for key, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    faces_only = train_aligner(AlignerConfig(**TINY, epochs=1, batch_size=32, seed=5, nonface_fraction=0.0),
                               images, landmarks, progress=False)
    assert "train/score_loss" not in faces_only.history[0]


# --------------------------------------------------------------------------------------------------
# set fusion takes the aligner's landmarks and scores


def _rows(n: int, size: int) -> pd.DataFrame:
    lm = np.array([[20, 24], [44, 24], [32, 36], [22, 46], [42, 46]], np.float32) * (size / 64)
    return pd.DataFrame({"landmarks": [lm.reshape(-1) + i for i in range(n)],
                         "quality": [0.2, np.nan, 0.9][:n]})


def test_sets_eval_uses_the_saved_aligner_when_present(tmp_path):
    from tasks.common import Paths
    from tasks.evaluate.fusion import face_inputs, face_inputs_note, load_frame_aligner

    paths = Paths(root=tmp_path)
    rows = _rows(3, 64)
    images = render_nonfaces(0, range(3), 64)
    assert load_frame_aligner(paths) is None
    lm, scores = face_inputs(None, images, rows, batch_size=2)  # no aligner: the manifest's landmarks and quality
    np.testing.assert_array_equal(lm[2], rows["landmarks"][2].reshape(5, 2))
    np.testing.assert_array_equal(scores, np.array([0.2, 1.0, 0.9], np.float32))

    torch.manual_seed(0)
    model = build_aligner(**TINY).eval()
    save_aligner(paths.aligner_model, model, extra={"face_score_trained": True})
    aligner = load_frame_aligner(paths)
    assert aligner is not None and aligner.scores
    lm, scores = face_inputs(aligner, images, rows, batch_size=2)  # batches of 2: the chunks join up
    want_lm, want_scores = model.predict(images)
    np.testing.assert_allclose(lm, want_lm, atol=1e-5)
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)
    assert not np.allclose(scores, [0.2, 1.0, 0.9])

    save_aligner(paths.aligner_model, model, extra={})  # a score never trained on non-faces: quality stands in
    untrained = load_frame_aligner(paths)
    assert untrained is not None and not untrained.scores
    lm, scores = face_inputs(untrained, images, rows, batch_size=4)
    np.testing.assert_allclose(lm, want_lm, atol=1e-5)
    np.testing.assert_array_equal(scores, np.array([0.2, 1.0, 0.9], np.float32))

    assert "manifest's landmarks and quality" in face_inputs_note({})
    assert "manifest's quality" in face_inputs_note({"sets/face_inputs/aligner_landmarks": 1.0})
    note = face_inputs_note({"sets/face_inputs/aligner_landmarks": 1.0, "sets/face_inputs/aligner_scores": 1.0,
                             "sets/face_inputs/score_quality_spearman": 0.4})
    assert "predicted landmarks and face scores" in note and "ρ = 0.40" in note


def test_benchmark_aligner_section_shows_the_face_score_row():
    from tasks.evaluate import aligner_section

    metrics = {"test/faces": 400.0, "test/nme": 0.1, "test/failure@0.1": 0.4, "test/auc@0.1": 0.2,
               "test/mean_shape_nme": 0.4, "test/mean_shape_failure@0.1": 1.0, "test/mean_shape_auc@0.1": 0.0,
               "test/face_auc": 0.987, "test/face_accuracy@0.5": 0.95, "test/face_score_mean": 0.91,
               "test/nonface_score_mean": 0.08, "test/nonfaces": 400.0, "quality/score_spearman": 0.31,
               "quality/faces": 200.0}
    text = "\n".join(aligner_section(metrics, {}))
    assert "| 0.987 | 95.0 % | 0.910 | 0.080 | 0.310 |" in text
    assert "400 held-out non-face crops" in text and "200 rendered faces" in text
    older = {k: v for k, v in metrics.items() if not k.startswith(("test/face", "test/nonface", "quality/"))}
    text = "\n".join(aligner_section(older, {}))  # a model trained before the score had metrics
    assert "ROC AUC" not in text and "| DFA | 0.1000 |" in text


def test_train_aligner_stage_writes_the_face_score_metrics(tmp_path):
    """The stage end to end at toy size (no tracker): metrics JSON, the model's score flag, the report rows."""
    import json

    from ml.data.dataset import DatasetWriter
    from ml.aligner.dfa import load_aligner
    from tasks.common import Paths
    from tasks.evaluate import aligner_section
    from tasks.train_aligner import AlignerStageConfig, run

    paths = Paths(root=tmp_path)
    images, landmarks, identities = unaligned_faces(8, 4, size=64, seed=1)
    with DatasetWriter(paths.unaligned_set, name="unaligned", source="procedural", aligned=False) as w:
        for image, lm, ident in zip(images, landmarks, identities):
            w.add(image, identity=f"id{ident:06d}", split="test" if ident >= 6 else "train", landmarks=lm.reshape(-1))
    cfg = AlignerStageConfig(train=AlignerConfig(**TINY, epochs=1, batch_size=8, nonface_fraction=0.25),
                             reference_faces="", score_nonfaces=12, score_quality_faces=6)
    result = run(cfg, paths)
    saved = json.loads((paths.metrics / "train_aligner.json").read_text())
    assert saved["test/nonfaces"] == 8.0 and saved["quality/faces"] == 6.0  # non-faces: at most one per test face
    assert saved["train/nonfaces_per_batch"] == 2.0
    for key in ("test/face_auc", "test/face_accuracy@0.5", "test/face_score_mean", "test/nonface_score_mean"):
        assert 0.0 <= saved[key] <= 1.0, key
    assert -1.0 <= saved["quality/score_spearman"] <= 1.0
    for key in ("test/nme_box", "test/nme_box_top_anchor", "test/nme_top_anchor", "test/mean_shape_nme_box"):
        assert saved[key] > 0.0, key
    for key in ("test/failure_box@0.05", "test/failure_box@0.07", "test/auc_box@0.07",
                "test/failure_box@0.05_top_anchor", "test/mean_shape_failure_box@0.05"):
        assert 0.0 <= saved[key] <= 1.0, key
    # the two conventions differ by the normaliser only: the box one is ≈ 2.3× smaller here
    assert 1.5 < saved["test/nme"] / saved["test/nme_box"] < 3.5
    assert "face score AUC" in result.summary and "test NME (face box)" in result.summary
    assert (paths.plots / "aligner_ced.png").is_file()
    _, config = load_aligner(paths.aligner_model)
    assert config["extra"]["face_score_trained"] is True
    assert "| ROC AUC |" in "\n".join(aligner_section(saved, {}))
    with pytest.raises(ConfigError, match="aligner.score_nonfaces"):
        AlignerStageConfig(score_nonfaces=-1)


def test_real_faces_for_the_yunet_comparison_come_from_the_param_or_a_real_runs_held_out_identities(tmp_path):
    """``aligner.reference_faces`` wins; unset, a run that ingests real faces compares on its held-out identities
    and a procedural run says why it has none."""
    from ml.data.dataset import DatasetWriter
    from tasks.common import Paths
    from tasks.train_aligner import AlignerStageConfig, reference_images

    paths = Paths(root=tmp_path)
    faces, _, identities = unaligned_faces(3, 2, size=32, seed=2)

    def heldout(source: str) -> None:
        with DatasetWriter(paths.heldout_set, name="heldout", source=source, aligned=True) as w:
            for image, ident in zip(faces, identities):
                w.add(image, identity=f"id{ident:06d}", split="test")

    cfg = AlignerStageConfig(reference_max_images=4)
    assert reference_images(cfg, paths) == (None, "aligner.reference_faces is empty and the run's faces are procedural")
    heldout("procedural")
    assert reference_images(cfg, paths)[0] is None
    heldout("real")
    images, source = reference_images(cfg, paths)
    assert images.shape == (4, 32, 32, 3) and source.startswith("data/prepared/heldout")  # at most 4
    np.testing.assert_array_equal(images[0], faces[0])
    folder = tmp_path / "faces" / "person"
    folder.mkdir(parents=True)
    from PIL import Image

    Image.fromarray(faces[1]).save(folder / "a.png")
    images, source = reference_images(AlignerStageConfig(reference_faces=str(tmp_path / "faces")), paths)
    assert len(images) == 1 and source == str(tmp_path / "faces")  # the param wins over the held-out faces
    missing = reference_images(AlignerStageConfig(reference_faces=str(tmp_path / "nowhere")), paths)
    assert missing[0] is None and "not found" in missing[1]
