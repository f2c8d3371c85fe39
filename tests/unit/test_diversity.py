"""ml/generator/diversity.py and ml/generator/image_diversity.py: identity consistency, diversity, class separation,
improved precision / recall and LPIPS, against hand-computed values and brute-force references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ml.errors import ConfigError, DataError
from ml.generator import diversity
from ml.generator.diversity import (
    diversity_report,
    embedding_diversity,
    identity_consistency,
    improved_precision_recall,
    inter_class_separation,
)
from ml.generator.image_diversity import LPIPS, load_lpips, lpips_distance

pytestmark = pytest.mark.usefixtures("one_thread")


def _deg(*angles: float, scale: float = 1.0) -> list[list[float]]:
    return [[scale * math.cos(math.radians(a)), scale * math.sin(math.radians(a))] for a in angles]


def _line(*xs: float) -> np.ndarray:
    """Points on the x axis of the plane."""
    return np.array([[x, 0.0] for x in xs])


# Class 7: two embeddings along 0 degrees, one 3x longer (cosine ignores length) -> mean cos 1.
# Class 3: 0, 60 and 120 degrees -> pair cosines 0.5, -0.5, 0.5 -> mean 1/6.
# Macro average: (1 + 1/6) / 2 = 7/12. (The pair-weighted average would be (1 + 0.5) / 4 = 0.375.)
HAND_EMB = np.array(_deg(0) + _deg(0, scale=3.0) + _deg(0, 60, 120))
HAND_LABELS = np.array([7, 7, 3, 3, 3])


# ------------------------------------------------------------------------------------------
# identity consistency / diversity / inter-class separation
# ------------------------------------------------------------------------------------------


def test_identity_consistency_hand_worked_macro_average():
    assert identity_consistency(HAND_EMB, HAND_LABELS) == pytest.approx(7 / 12)


def test_embedding_diversity_is_mean_cosine_distance():
    # class 7: 1 - 1 = 0; class 3: 1 - 1/6 = 5/6 -> (0 + 5/6) / 2 = 5/12
    assert embedding_diversity(HAND_EMB, HAND_LABELS) == pytest.approx(5 / 12)


def test_identity_consistency_matches_explicit_pairs_on_random_data():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 6, 200)
    emb = rng.normal(size=(200, 12)) + 2.0 * rng.normal(size=(6, 12))[labels]
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    per_class = []
    for c in np.unique(labels):
        u = unit[labels == c]
        iu = np.triu_indices(len(u), k=1)
        per_class.append((u @ u.T)[iu].mean())
    assert identity_consistency(emb, labels) == pytest.approx(np.mean(per_class), abs=1e-12)
    assert embedding_diversity(emb, labels) == pytest.approx(1 - np.mean(per_class), abs=1e-12)


def test_inter_class_separation_hand_worked():
    # centres: class 7 at 0 deg; class 3: 0 + 60 + 120 deg sums to (1, sqrt 3), i.e. 60 deg; class 5 a single
    # embedding at 90 deg. Pair cosines: (7, 3) cos 60 = 0.5, (7, 5) cos 90 = 0, (3, 5) cos 30 = sqrt(3)/2.
    emb = np.concatenate([HAND_EMB, _deg(90)])
    labels = np.append(HAND_LABELS, 5)
    out = inter_class_separation(emb, labels)
    assert out["mean_cos"] == pytest.approx((0.5 + 0.0 + math.sqrt(3) / 2) / 3)
    assert out["max_cos"] == pytest.approx(math.sqrt(3) / 2)


def test_inter_class_separation_blocked_max_matches_dense(monkeypatch):
    rng = np.random.default_rng(1)
    emb, labels = rng.normal(size=(90, 8)), np.repeat(np.arange(30), 3)
    dense = inter_class_separation(emb, labels)
    monkeypatch.setattr(diversity, "_BATCH_ELEMENTS", 70)  # blocks of 2 centres
    assert inter_class_separation(emb, labels) == pytest.approx(dense, abs=1e-12)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    centres = unit.reshape(30, 3, 8).sum(1)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    cos = (centres @ centres.T)[np.triu_indices(30, k=1)]
    assert dense == pytest.approx({"mean_cos": cos.mean(), "max_cos": cos.max()}, abs=1e-12)


def test_singleton_class_is_named():
    with pytest.raises(DataError, match=r"class 9 has 1 embedding"):
        identity_consistency(np.concatenate([HAND_EMB, _deg(45)]), np.append(HAND_LABELS, 9))
    with pytest.raises(DataError, match=r"class 9 has 1 embedding"):
        embedding_diversity(np.concatenate([HAND_EMB, _deg(45)]), np.append(HAND_LABELS, 9))


@pytest.mark.parametrize(
    "emb, labels, match",
    [
        (HAND_EMB, HAND_LABELS[:4], r"one entry per embedding \(5\)"),
        (HAND_EMB[0], HAND_LABELS, r"\(N, D\)"),
        (np.where(np.arange(10).reshape(5, 2) == 7, np.nan, HAND_EMB), HAND_LABELS, r"NaN or inf \(first at row 3\)"),
        (np.where(np.arange(10).reshape(5, 2) >= 8, 0.0, HAND_EMB), HAND_LABELS, r"all-zero row\(s\) \(first at row 4"),
        (HAND_EMB, HAND_LABELS.astype(float), r"integer class ids"),
    ],
)
def test_embedding_input_errors(emb, labels, match):
    with pytest.raises(DataError, match=match):
        identity_consistency(emb, labels)


def test_inter_class_separation_needs_two_classes():
    with pytest.raises(DataError, match="at least 2 classes"):
        inter_class_separation(HAND_EMB[:2], HAND_LABELS[:2])


def test_torch_inputs_are_accepted():
    assert identity_consistency(torch.tensor(HAND_EMB), torch.tensor(HAND_LABELS)) == pytest.approx(7 / 12)


# ------------------------------------------------------------------------------------------
# improved precision / recall
# ------------------------------------------------------------------------------------------


def _brute_force_pr(real: np.ndarray, fake: np.ndarray, k: int) -> dict[str, float]:
    """Kynkäänniemi et al. 2019 straight from the definition: explicit differences, full matrices."""

    def dist(a, b):
        return np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))

    def radii(x):
        d = dist(x, x)
        np.fill_diagonal(d, np.inf)
        return np.sort(d, axis=1)[:, k - 1]

    precision = (dist(fake, real) <= radii(real)[None, :]).any(axis=1).mean()
    recall = (dist(real, fake) <= radii(fake)[None, :]).any(axis=1).mean()
    return {"precision": float(precision), "recall": float(recall)}


def test_precision_recall_hand_worked_on_a_line():
    # real 0, 1, 2, 3 with k = 1: every real radius is 1.
    # fake 1.5, 1.6, 3.9, 10: radii 0.1, 0.1, 2.3 (3.9 -> 1.6), 6.1 (10 -> 3.9).
    # precision: 1.5 (0.5 from 1), 1.6, 3.9 (0.9 from 3) inside; 10 out -> 3/4.
    # recall: real 0 and 1 are > 0.1 from 1.5 / 1.6, > 2.3 from 3.9, > 6.1 from 10 -> out; 2 is 1.9 from
    # 3.9 <= 2.3 and 3 is 0.9 from it -> in -> 2/4.
    out = improved_precision_recall(_line(0, 1, 2, 3), _line(1.5, 1.6, 3.9, 10), k=1)
    assert out == {"precision": 0.75, "recall": 0.5}


def test_precision_recall_radius_boundary_is_inside():
    # fake 4 is exactly at real 3's radius 1 (<= counts); 4.5 is not. Squared distances are exact here.
    assert improved_precision_recall(_line(0, 1, 2, 3), _line(4, 4.5), k=1)["precision"] == 0.5


def test_precision_recall_k_is_the_kth_other_neighbour():
    # real 0, 1, 3, 7. k = 2: radii are the 2nd nearest others: 3, 2, 3, 6; k = 1: 1, 1, 2, 4.
    # fake 5: 2 from 3 -> inside for both k (at the k = 1 radius exactly). fake 10.5: 3.5 from 7 -> inside for
    # both. fake 12.5: 5.5 from 7 -> inside the k = 2 radius 6 only. So precision is 1 at k = 2 and 2/3 at k = 1.
    real, fake = _line(0, 1, 3, 7), _line(5, 10.5, 12.5)
    assert improved_precision_recall(real, fake, k=2)["precision"] == 1.0
    assert improved_precision_recall(real, fake, k=1)["precision"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_precision_recall_match_brute_force(k):
    rng = np.random.default_rng(k)
    real = rng.normal(size=(150, 16))
    fake = 0.8 * rng.normal(size=(120, 16)) + 0.4  # shifted and narrower: both numbers strictly inside (0, 1)
    expected = _brute_force_pr(real, fake, k)
    assert 0 < expected["precision"] < 1 and 0 < expected["recall"] < 1
    assert improved_precision_recall(real, fake, k=k) == expected


def test_precision_recall_do_not_depend_on_batch_size():
    rng = np.random.default_rng(5)
    real, fake = rng.normal(size=(97, 8)), 1.3 * rng.normal(size=(83, 8))
    results = [improved_precision_recall(real, fake, k=4, batch_size=b) for b in (1, 7, 32, 83, 10_000)]
    assert all(r == results[0] for r in results)
    assert results[0] == _brute_force_pr(real, fake, 4)


def test_precision_recall_default_blocks_stay_within_the_memory_budget(monkeypatch):
    # budget 512 elements -> 512 // 97 = 5 rows per block; every distance block must respect it
    rng = np.random.default_rng(6)
    real, fake = rng.normal(size=(97, 8)), rng.normal(size=(60, 8))
    shapes = []
    block = diversity._sq_dist_block

    def spy(a, a_sq, b, b_sq):
        out = block(a, a_sq, b, b_sq)
        shapes.append(out.shape)
        return out

    monkeypatch.setattr(diversity, "_BATCH_ELEMENTS", 512)
    monkeypatch.setattr(diversity, "_sq_dist_block", spy)
    out = improved_precision_recall(real, fake, k=3)
    assert max(r * c for r, c in shapes) <= 512
    assert out == _brute_force_pr(real, fake, 3)


def test_identical_sets_have_full_precision_and_recall():
    x = np.random.default_rng(7).normal(size=(50, 512))
    assert improved_precision_recall(x, x.copy(), k=10) == {"precision": 1.0, "recall": 1.0}


def test_far_away_fakes_have_zero_precision_and_recall():
    rng = np.random.default_rng(8)
    real = rng.normal(size=(40, 16))
    assert improved_precision_recall(real, rng.normal(size=(30, 16)) + 100.0, k=3) == {"precision": 0.0, "recall": 0.0}


def test_precision_recall_errors():
    rng = np.random.default_rng(9)
    real, fake = rng.normal(size=(12, 4)), rng.normal(size=(10, 4))
    with pytest.raises(DataError, match="k=10 needs more than k samples in each set, but fake has 10"):
        improved_precision_recall(real, fake, k=10)
    with pytest.raises(DataError, match="differ in dimension: 4 vs 3"):
        improved_precision_recall(real, fake[:, :3], k=2)
    bad = fake.copy()
    bad[6, 1] = np.nan
    with pytest.raises(DataError, match=r"fake has 1 row\(s\) with NaN or inf \(first at row 6\)"):
        improved_precision_recall(real, bad, k=2)
    with pytest.raises(ConfigError, match="k must be a positive integer"):
        improved_precision_recall(real, fake, k=0)
    with pytest.raises(ConfigError, match="batch_size"):
        improved_precision_recall(real, fake, k=2, batch_size=0)


# ------------------------------------------------------------------------------------------
# diversity_report
# ------------------------------------------------------------------------------------------


def test_diversity_report_names_and_values():
    rng = np.random.default_rng(10)
    labels = np.repeat(np.arange(8), 6)
    emb = rng.normal(size=(48, 32)) + 3.0 * rng.normal(size=(8, 32))[labels]
    real = rng.normal(size=(40, 32)) * 5.0  # lengths differ from emb: the report normalises both

    base = diversity_report(emb, labels)
    assert set(base) == {
        "synthetic/identity_consistency", "synthetic/diversity",
        "synthetic/inter_class_mean_cos", "synthetic/inter_class_max_cos",
    }
    assert base["synthetic/identity_consistency"] == pytest.approx(identity_consistency(emb, labels))
    assert base["synthetic/diversity"] == pytest.approx(embedding_diversity(emb, labels))
    assert base["synthetic/inter_class_max_cos"] == inter_class_separation(emb, labels)["max_cos"]

    full = diversity_report(emb, labels, real_emb=real, k=10)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    pr = _brute_force_pr(unit(real), unit(emb), 10)
    assert full["synthetic/precision@k10"] == pr["precision"]
    assert full["synthetic/recall@k10"] == pr["recall"]
    assert all(isinstance(v, float) for v in full.values())


# ------------------------------------------------------------------------------------------
# LPIPS with random local weights (no download)
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lpips_weights(tmp_path_factory):
    """A random LPIPS saved as the two public files merged: torchvision vgg16 keys + lpips 'lin<l>.model.1'."""
    torch.manual_seed(0)
    model = LPIPS()
    state = {k.removeprefix("net."): v for k, v in model.net.state_dict().items()}  # features.<i>.weight|bias
    for i, lin in enumerate(model.lins):
        state[f"lin{i}.model.1.weight"] = lin.weight.detach().abs()  # trained LPIPS weights are >= 0
    state["classifier.0.weight"] = torch.zeros(2, 2)  # part of a torchvision vgg16 file: ignored
    path = tmp_path_factory.mktemp("lpips") / "lpips_vgg16.pth"
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def lpips_model(lpips_weights):
    return load_lpips(lpips_weights[0])


def _images(seed: int, n: int = 2, side: int = 16) -> torch.Tensor:
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_lpips_loads_local_weights_and_is_a_distance(lpips_weights, lpips_model):
    path, state = lpips_weights
    assert torch.equal(lpips_model.net.features[28].weight, state["features.28.weight"])
    assert torch.equal(lpips_model.lins[4].weight, state["lin4.model.1.weight"])
    a, b = _images(1), _images(2)
    same = lpips_distance(a, a, path)  # loads from the path
    assert same.shape == (2,) and np.allclose(same, 0.0, atol=1e-7)
    ab = lpips_distance(a, b, model=lpips_model)
    assert np.all(ab > 0)
    assert np.allclose(ab, lpips_distance(b, a, model=lpips_model), rtol=1e-6)
    assert np.allclose(ab, lpips_distance(a.numpy(), b.numpy(), model=lpips_model, batch_size=1), rtol=1e-6)


def test_lpips_first_layer_by_hand(lpips_model):
    # With only lin0 = 1 the distance is the spatial mean of ||n(relu1_2(a)) - n(relu1_2(b))||^2, where n()
    # normalises over channels; computed here with F.conv2d on the loaded first two convs.
    model = LPIPS()
    model.load_state_dict(lpips_model.state_dict())
    with torch.no_grad():
        for i, lin in enumerate(model.lins):
            lin.weight.fill_(1.0 if i == 0 else 0.0)
    a, b = _images(3, side=20), _images(4, side=20)
    shift = torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1)
    scale = torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1)
    f = model.net.features

    def relu1_2(x):
        x = F.relu(F.conv2d((x - shift) / scale, f[0].weight, f[0].bias, padding=1))
        x = F.relu(F.conv2d(x, f[2].weight, f[2].bias, padding=1))
        return x / (x.norm(dim=1, keepdim=True) + 1e-10)

    expected = (relu1_2(a) - relu1_2(b)).pow(2).sum(1).mean(dim=(1, 2))
    assert np.allclose(lpips_distance(a, b, model=model), expected.detach().numpy(), rtol=1e-5)


def test_lpips_without_weights_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="LPIPS needs VGG16 \\+ LPIPS weights available offline") as err:
        lpips_distance(_images(1), _images(2))
    assert "weights_path" in str(err.value) and "embedding_diversity" in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        lpips_distance(_images(1), _images(2), tmp_path / "nope.pth")


def test_lpips_incomplete_weights_name_the_missing_keys(lpips_weights, tmp_path):
    partial = {k: v for k, v in lpips_weights[1].items() if not k.startswith("lin3")}
    torch.save(partial, tmp_path / "partial.pth")
    with pytest.raises(ConfigError, match=r"missing \['lins.3.weight'\]"):
        load_lpips(tmp_path / "partial.pth")


@pytest.mark.parametrize(
    "a, b, match",
    [
        (_images(1), _images(2, n=3), "same shape"),
        (_images(1)[:, :2], _images(2)[:, :2], r"\(N, 3, H, W\)"),
        (_images(1, side=8), _images(2, side=8), "at least 16x16"),
        (_images(1) * 100, _images(2), r"LPIPS expects \[-1, 1\]"),
        ((_images(1) > 0).to(torch.uint8), _images(2), "float images"),
    ],
)
def test_lpips_image_errors(lpips_model, a, b, match):
    with pytest.raises(DataError, match=match):
        lpips_distance(a, b, model=lpips_model)


# ---------------------------------------------------------------------------------------- identity gap, pixels
def test_identity_gap_matches_hand_computed_pairs() -> None:
    from ml.generator.diversity import identity_gap

    e = np.array([[1, 0], [0.8, 0.6], [0, 1], [0.6, 0.8], [-1, 0]], dtype=np.float64)
    labels = np.array([0, 0, 1, 1, 1])
    u = e / np.linalg.norm(e, axis=1, keepdims=True)
    intra = np.mean([u[0] @ u[1], np.mean([u[2] @ u[3], u[2] @ u[4], u[3] @ u[4]])])
    inter = np.mean([u[i] @ u[j] for i in (0, 1) for j in (2, 3, 4)])
    out = identity_gap(e, labels)
    assert out["intra"] == pytest.approx(intra) and out["inter"] == pytest.approx(inter)
    assert out["gap"] == pytest.approx(intra - inter)
    with pytest.raises(DataError, match="one embedding"):
        identity_gap(e[:3], labels[:3])


def test_adjacent_pixel_correlation_tells_faces_from_noise() -> None:
    from ml.generator.image_diversity import adjacent_pixel_correlation

    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (4, 16, 16, 3)).astype(np.uint8)
    ramp = np.broadcast_to(np.linspace(0, 255, 16)[None, None, :, None], (4, 16, 16, 3)).astype(np.uint8)
    assert abs(adjacent_pixel_correlation(noise)) < 0.15
    assert adjacent_pixel_correlation(ramp) > 0.99
    assert adjacent_pixel_correlation(np.zeros((1, 4, 4, 3))) == 1.0  # flat: smooth, not undefined


def test_nearest_real_finds_the_copied_identity_and_face() -> None:
    from ml.generator.diversity import nearest_real

    rng = np.random.default_rng(1)
    real = rng.normal(size=(12, 8))
    real_labels = np.repeat([10, 20, 30], 4)
    fake = np.concatenate([real[4:8] + 1e-3, rng.normal(size=(2, 8))])  # identity 0 copies real identity 20
    out = nearest_real(fake, np.array([0, 0, 0, 0, 1, 1]), real, real_labels)
    assert out["identity_nearest"][0] == 20 and out["identity_max_cos"][0] > 0.999
    assert out["identity_max_cos"][1] < 0.9
    assert out["face_nearest"][:4].tolist() == [4, 5, 6, 7] and out["face_max_cos"][:4].min() > 0.999


def test_ssim_diversity_zero_for_copies_positive_for_variation() -> None:
    from ml.generator.image_diversity import ssim_diversity

    rng = np.random.default_rng(2)
    face = rng.integers(0, 256, (1, 16, 16, 3)).astype(np.uint8)
    copies = np.repeat(face, 4, axis=0)
    assert ssim_diversity(copies, np.zeros(4, int)) == pytest.approx(0.0, abs=1e-6)
    varied = rng.integers(0, 256, (4, 16, 16, 3)).astype(np.uint8)
    assert ssim_diversity(varied, np.zeros(4, int)) > 0.5


# ── Fréchet distance ─────────────────────────────────────────────────────────────────────────────────────────────


def test_frechet_distance_of_diagonal_gaussians_is_the_closed_form():
    """Sets built to have exactly the means and (diagonal) covariances below: ‖Δμ‖² + Σ (σa − σb)²."""
    from ml.generator.diversity import frechet_distance

    unit = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])  # mean 0, sample covariance 4/3 · I
    scale_a, scale_b, shift = np.array([1.0, 2.0]), np.array([3.0, 0.5]), np.array([2.0, -1.0])
    a, b = unit * scale_a, unit * scale_b + shift
    sd_a, sd_b = scale_a * math.sqrt(4 / 3), scale_b * math.sqrt(4 / 3)
    assert frechet_distance(a, b) == pytest.approx(shift @ shift + np.sum((sd_a - sd_b) ** 2))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a))


def test_frechet_distance_grows_with_a_shift_and_refuses_mismatched_features():
    from ml.generator.diversity import frechet_distance

    rng = np.random.default_rng(0)
    real = rng.normal(size=(400, 8))
    near, far = rng.normal(size=(400, 8)) + 0.1, rng.normal(size=(400, 8)) + 1.0
    assert frechet_distance(real, near) < frechet_distance(real, far)
    with pytest.raises(DataError, match="8 and 4 dimensions"):
        frechet_distance(real, real[:, :4])
    with pytest.raises(DataError, match="≥ 2 rows"):
        frechet_distance(real, real[:1])
