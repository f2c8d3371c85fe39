"""`evaluate.ijb_dir`: a real IJB-B/C folder (meta/ + loose_crop/) scored for every FR model: the faceness-weighted
template fusion against hand-computed values, alignment of loose crops, TAR@FAR keys and the report, a model that
separates identities against one that does not, both folder forms, and every bad input named."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from ml.data.ijb_meta import write_landmark_scores, write_template_pairs, write_tid_mid
from ml.errors import DataError
from ml.eval.ijb import (
    IJB_FARS, align_crop, ijb_image_features, ijb_template_features, ijb_verification, load_ijb_sets,
)
from ml.eval.metrics import pair_scores, template_features
from tasks.evaluate import EvaluateConfig, evaluate_ijb, ijb_section, ijb_sets

pytestmark = pytest.mark.usefixtures("one_thread")

IDENTITIES, PER_IDENTITY = 6, 4  # 2 templates per identity: 12 templates, 66 pairs (6 genuine, 60 impostor)
CFG = EvaluateConfig(batch_size=8, flip=True)
FAR_KEYS = [f"tar@far={f}" for f in ("1e-5", "1e-4", "1e-3", "1e-2", "1e-1")]


class PixelFR(nn.Module):
    """Embedding = the aligned crop pooled to 8×8, centred: procedural identities differ in face shape and colour,
    so this separates them, but only where alignment put the face where the template says."""

    input_contract = {"size": 32, "colour": "RGB", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
                      "embedding_dim": 192}

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))  # embed() reads the device from the parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional.avg_pool2d(x, 4).flatten(1)  # (B, 3·8·8)
        return f - f.mean(dim=1, keepdim=True)


class RandomFR(PixelFR):
    """Features that ignore the image: every identity looks alike."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape[0], 192, generator=self.gen)


@pytest.fixture(scope="module")
def faces():
    from ml.data.procedural import ProceduralConfig
    from ml.data.unaligned import unaligned_faces

    calm = ProceduralConfig(yaw_deg=10.0, pitch_deg=5.0, clutter_max=2, glasses_prob=0.0, sunglasses_prob=0.0,
                            mask_prob=0.0, bar_prob=0.0, blur_prob=0.0, noise_prob=0.0, jpeg_prob=0.0, lowres_prob=0.0)
    return unaligned_faces(IDENTITIES, PER_IDENTITY, size=64, seed=0, rotation_deg=20.0, scale=(0.6, 0.9), base=calm)


def write_ijb(root: Path, name: str, faces) -> Path:
    """An IJB-like folder: loose JPEG crops of 48, 64 and 80 px with their landmarks, identity i → template 2i+1
    (its 2 first faces as one video) and 2i+2 (2 stills), every template pair listed."""
    from PIL import Image

    images, landmarks, identities = faces
    crop_dir = root / "loose_crop"
    crop_dir.mkdir(parents=True)
    names, points = [], []
    for k, (image, lm) in enumerate(zip(images, landmarks)):
        side = (48, 64, 80)[k % 3]
        s = side / image.shape[0]
        names.append(f"{k + 1}.jpg")
        Image.fromarray(image).resize((side, side), Image.BILINEAR).save(crop_dir / names[-1], quality=95)
        points.append((lm + 0.5) * s - 0.5)  # pixel centres at integers
    within = np.arange(len(images)) % PER_IDENTITY
    templates = 2 * identities + 1 + (within >= 2)
    media = np.where(within < 2, 1000 + identities, 2000 + np.arange(len(images)))
    write_tid_mid(root / "meta" / f"{name}_face_tid_mid.txt",
                  pd.DataFrame({"path": names, "template": templates, "media": media}))
    scores = np.random.default_rng(1).uniform(0.5, 1.0, len(images))
    write_landmark_scores(root / "meta" / f"{name}_name_5pts_score.txt", names, np.stack(points), scores)
    tids = np.unique(templates)
    a, b = np.triu_indices(len(tids), k=1)
    write_template_pairs(root / "meta" / f"{name}_template_pair_label.txt", np.stack([tids[a], tids[b]], axis=1),
                         ((tids[a] - 1) // 2 == (tids[b] - 1) // 2).astype(int))
    return root


@pytest.fixture(scope="module")
def ijbb(faces, tmp_path_factory) -> Path:
    return write_ijb(tmp_path_factory.mktemp("data") / "IJBB", "ijbb", faces)


def broken_copy(ijbb: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(ijbb, tmp_path / "IJBB"))


# ---- fusion and alignment


def test_template_fusion_weights_by_score_then_averages_media_then_templates():
    features = np.array([[2.0, 0.0], [0.0, 2.0], [0.0, 1.0], [3.0, 4.0]], dtype=np.float32)
    scores = np.array([1.0, 0.5, 1.0, 2.0])
    templates = np.array([7, 7, 7, 3])
    media = np.array([10, 10, 11, 10])  # media 10 of template 3 is not media 10 of template 7
    ids, fused = ijb_template_features(features, scores, templates, media)
    np.testing.assert_array_equal(ids, [3, 7])
    # template 7: media 10 = (1·[2, 0] + 0.5·[0, 2]) / 2 = [1, 0.5]; media 11 = [0, 1]; mean [0.5, 0.75]
    expected_7 = np.array([0.5, 0.75]) / math.sqrt(0.5 ** 2 + 0.75 ** 2)
    np.testing.assert_allclose(fused, [[0.6, 0.8], expected_7], atol=1e-6)
    # not the unweighted pooling of unit features (which would give [0.25, 0.75] for template 7)
    _, plain = template_features(features, templates, media)
    assert not np.allclose(plain[1], expected_7, atol=1e-2)
    with pytest.raises(DataError, match="template 3 fuses to a zero vector .* faceness score 0"):
        ijb_template_features(features, np.array([1.0, 0.5, 1.0, 0.0]), templates, media)


def test_alignment_puts_the_landmarks_on_the_template_in_a_non_square_crop():
    from ml.aligner.align import template_for

    # five bright dots at the landmarks of a rotated, scaled face in a 70×90 (H×W) loose crop
    template = template_for(112).numpy().astype(np.float64)
    angle, scale, shift = math.radians(25.0), 0.55, np.array([20.0, 6.0])
    rot = scale * np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    landmarks = np.round(template @ rot.T + shift)  # integer pixels, so each dot is exactly one pixel
    image = np.zeros((70, 90, 3), dtype=np.uint8)
    for x, y in landmarks.astype(int):
        image[y, x] = 255
    crop, kp = align_crop(image, landmarks.astype(np.float32), 56)
    target = template_for(56).numpy()
    np.testing.assert_allclose(kp, target, atol=0.6)  # least-squares fit of rounded points
    for x, y in target:  # each dot lands on its template point: the brightest pixel of its neighbourhood
        i, j = int(round(y)), int(round(x))
        window = crop[i - 2:i + 3, j - 2:j + 3, 0]
        assert window.max() > 20 and np.unravel_index(window.argmax(), window.shape) in {
            (a, b) for a in (1, 2, 3) for b in (1, 2, 3)}


# ---- scoring


def test_every_far_key_and_count_in_range_and_the_report_shows_them(ijbb):
    sets = ijb_sets(EvaluateConfig(ijb_dir=str(ijbb)))
    assert [s.name for s in sets] == ["ijbb"]
    metrics = evaluate_ijb(PixelFR(), "real", CFG, sets)
    for key in FAR_KEYS:
        assert 0.0 <= metrics[f"real/ijb/ijbb/{key}"] <= 1.0, key
    assert {k: metrics[f"real/ijb/ijbb/{k}"] for k in ("pairs", "impostor_pairs", "images", "templates")} == {
        "pairs": 66.0, "impostor_pairs": 60.0, "images": 24.0, "templates": 12.0}
    lines = "\n".join(ijb_section(metrics, {"real": {}, "synthetic": {}}, sets))
    assert f"## IJB 1:1 verification: `ijbb` from `{ijbb}`" in lines
    assert "| model | TAR@FAR=1e-5 | TAR@FAR=1e-4 | TAR@FAR=1e-3 | TAR@FAR=1e-2 | TAR@FAR=1e-1 |" in lines
    # 60 impostor pairs: every FAR below 1e-1 rests on under 10 false accepts (1e-1: 6.0), so every cell is marked
    assert f"| `real` | *{100 * metrics['real/ijb/ijbb/tar@far=1e-5']:.2f} %* (0.0 FA) |" in lines
    assert f"*{100 * metrics['real/ijb/ijbb/tar@far=1e-1']:.2f} %* (6.0 FA) |" in lines
    assert "| `synthetic` | — | — | — | — | — |" in lines and "66 pairs (60 impostor)" in lines


def test_a_model_that_separates_identities_beats_one_that_does_not(ijbb):
    (ijb,) = load_ijb_sets(ijbb)
    good = ijb_verification(PixelFR(), ijb, batch_size=5, progress=False)
    chance = ijb_verification(RandomFR(), ijb, batch_size=5, progress=False)
    assert good["tar@far=1e-1"] > chance["tar@far=1e-1"]  # measured: 2 of 6 genuine pairs against none

    def gap(model: nn.Module) -> float:
        """Mean genuine minus mean impostor template cosine."""
        feats = ijb_image_features(model, ijb, batch_size=7, progress=False)  # 7 does not divide 24
        ids, fused = ijb_template_features(feats[ijb.image_index], ijb.scores[ijb.image_index], ijb.templates,
                                           ijb.media)
        rows = np.searchsorted(ids, ijb.pairs)  # ids are sorted
        scores = pair_scores(fused[rows[:, 0]], fused[rows[:, 1]])
        return float(scores[ijb.labels == 1].mean() - scores[ijb.labels == 0].mean())

    assert gap(PixelFR()) > 0.3 and abs(gap(RandomFR())) < 0.1  # measured: 0.41 and −0.04


def test_real_backbones_from_their_model_dirs_including_kprpe(ijbb, tmp_path):
    from ml.fr.backbones import build_backbone
    from ml.models.io import load_model, save_model

    sets = load_ijb_sets(ijbb)
    kwargs = dict(img_size=32, depth=1, dim=32, heads=2, embed_dim=16, drop_path=0.0)
    for name in ("vit_tiny", "vit_tiny_kprpe"):
        torch.manual_seed(0)
        save_model(tmp_path / name, build_backbone(name, **kwargs).eval(), backbone=name, kwargs=kwargs)
        model, config = load_model(tmp_path / name)
        assert config["input_contract"]["size"] == 32
        metrics = evaluate_ijb(model, name, EvaluateConfig(batch_size=16, flip=False), sets)
        assert all(0.0 <= metrics[f"{name}/ijb/ijbb/{k}"] <= 1.0 for k in FAR_KEYS), metrics


def test_ijb_fars_are_the_protocol_columns():
    assert IJB_FARS == (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


# ---- folder forms


def test_the_parent_folder_form_finds_ijbb_and_ijbc(faces, tmp_path):
    parent = tmp_path / "IJB_release"
    write_ijb(parent / "IJBB", "ijbb", faces)
    write_ijb(parent / "IJBC", "ijbc", faces)
    (parent / "notes").mkdir()
    sets = ijb_sets(EvaluateConfig(ijb_dir=str(parent)))
    assert [(s.name, s.root.name) for s in sets] == [("ijbb", "IJBB"), ("ijbc", "IJBC")]
    assert [s.name for s in ijb_sets(EvaluateConfig(ijb_dir=str(parent / "IJBC")))] == ["ijbc"]
    assert ijb_sets(EvaluateConfig()) == []
    shutil.rmtree(parent / "IJBC" / "meta")
    with pytest.raises(DataError, match=r"IJBC has no meta/ folder"):
        ijb_sets(EvaluateConfig(ijb_dir=str(parent)))
    with pytest.raises(DataError, match=r"evaluate.ijb_dir: .*notes has no meta/ folder and no IJBB or IJBC"):
        ijb_sets(EvaluateConfig(ijb_dir=str(parent / "notes")))


def test_params_yaml_declares_ijb_dir_empty():
    import yaml

    from ml.config import from_mapping

    params = yaml.safe_load((Path(__file__).resolve().parents[2] / "params.yaml").read_text())
    assert from_mapping(EvaluateConfig, params["evaluate"], "evaluate").ijb_dir == ""


# ---- bad input, each named


def test_ijb_dir_not_a_directory(tmp_path):
    with pytest.raises(DataError, match=r"evaluate.ijb_dir: .*missing is not a directory; point it at an IJB-B/C"):
        ijb_sets(EvaluateConfig(ijb_dir=str(tmp_path / "missing")))


@pytest.mark.parametrize("meta_file", ["template_pair_label", "name_5pts_score", "face_tid_mid"])
def test_a_missing_meta_file_is_named(ijbb, tmp_path, meta_file):
    root = broken_copy(ijbb, tmp_path)
    (root / "meta" / f"ijbb_{meta_file}.txt").unlink()
    expected = {"template_pair_label": r"lacks ijbb_template_pair_label.txt beside ijbb_face_tid_mid.txt",
                "name_5pts_score": r"lacks ijbb_name_5pts_score.txt beside",
                "face_tid_mid": r"meta has no \*_face_tid_mid.txt .*\(it holds: ijbb_name_5pts_score.txt, "
                                r"ijbb_template_pair_label.txt"}[meta_file]
    with pytest.raises(DataError, match=expected):
        ijb_sets(EvaluateConfig(ijb_dir=str(root)))


def test_images_missing_from_loose_crop_are_counted_and_the_first_named(ijbb, tmp_path):
    root = broken_copy(ijbb, tmp_path)
    for name in ("5.jpg", "9.jpg"):
        (root / "loose_crop" / name).unlink()
    with pytest.raises(DataError, match=r"2 of the 24 images listed in .*ijbb_face_tid_mid.txt are missing from "
                                        r".*loose_crop, e.g. '5.jpg' \(line 5\)"):
        ijb_sets(EvaluateConfig(ijb_dir=str(root)))


def test_an_image_without_a_landmark_row(ijbb, tmp_path):
    root = broken_copy(ijbb, tmp_path)
    path = root / "meta" / "ijbb_name_5pts_score.txt"
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                            if not line.startswith("7.jpg ")))
    with pytest.raises(DataError, match=r"1 of the 24 images listed in .*ijbb_face_tid_mid.txt have no row in "
                                        r".*ijbb_name_5pts_score.txt, e.g. '7.jpg' \(line 7\)"):
        ijb_sets(EvaluateConfig(ijb_dir=str(root)))


def test_a_pair_naming_a_template_without_images(ijbb, tmp_path):
    root = broken_copy(ijbb, tmp_path)
    path = root / "meta" / "ijbb_template_pair_label.txt"
    path.write_text(path.read_text() + "\n3 999 0\n")  # a blank line first: the line number still counts it
    with pytest.raises(DataError, match=r"ijbb_template_pair_label.txt, line 68: template 999 has no image in "
                                        r".*ijbb_face_tid_mid.txt \(1 pairs"):
        ijb_sets(EvaluateConfig(ijb_dir=str(root)))


def test_a_corrupt_image_is_named_with_its_line(ijbb, tmp_path):
    root = broken_copy(ijbb, tmp_path)
    (root / "loose_crop" / "3.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    sets = ijb_sets(EvaluateConfig(ijb_dir=str(root)))  # the listing is fine; decoding is not
    with pytest.raises(DataError, match=r"loose_crop/3.jpg: cannot decode the image .*ijbb_face_tid_mid.txt line 3; "
                                        "copy it again"):
        evaluate_ijb(PixelFR(), "real", CFG, sets)


def test_a_negative_faceness_score_is_named(ijbb, tmp_path):
    root = broken_copy(ijbb, tmp_path)
    path = root / "meta" / "ijbb_name_5pts_score.txt"
    lines = path.read_text().splitlines()
    lines[3] = " ".join(lines[3].split()[:-1] + ["-0.5"])
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"ijbb_name_5pts_score.txt, line 4: faceness score -0.5 of '4.jpg' is negative"):
        ijb_sets(EvaluateConfig(ijb_dir=str(root)))
