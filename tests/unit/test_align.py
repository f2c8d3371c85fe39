"""Differentiable 5-point alignment: least squares against numpy, exact recovery, gradients, warp geometry."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ml.data.procedural import ARCFACE_TEMPLATE_112
from ml.errors import DataError
from ml.aligner.align import (
    ARCFACE_TEMPLATE,
    align_faces,
    invert_affine,
    similarity_transform,
    template_for,
    transform_points,
    warp_affine,
)


def _random_similarity(rng: np.random.Generator, b: int) -> torch.Tensor:
    """(B, 2, 3) float64 similarities: scale 0.5–2, any rotation, shift ±50 px."""
    s = rng.uniform(0.5, 2.0, b)
    th = rng.uniform(-math.pi, math.pi, b)
    t = rng.uniform(-50, 50, (b, 2))
    m = np.zeros((b, 2, 3))
    m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = s * np.cos(th), -s * np.sin(th), s * np.sin(th), s * np.cos(th)
    m[:, :, 2] = t
    return torch.from_numpy(m)


def _lstsq(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Closed-form reference: the 4-parameter system [x −y 1 0; y x 0 1]·(a, b, tx, ty) = (x', y')."""
    rows, rhs = [], []
    for (x, y), (u, v) in zip(src, dst):
        rows += [[x, -y, 1.0, 0.0], [y, x, 0.0, 1.0]]
        rhs += [u, v]
    a, b, tx, ty = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    return np.array([[a, -b, tx], [b, a, ty]])


def _umeyama(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Umeyama (1991) with the reflection correction, via SVD, as skimage/insightface estimate it."""
    ms, md = src.mean(0), dst.mean(0)
    a, b = src - ms, dst - md
    cov = b.T @ a / len(src)
    u, d, vt = np.linalg.svd(cov)
    s = np.diag([1.0, np.sign(np.linalg.det(u) * np.linalg.det(vt))])
    r = u @ s @ vt
    scale = np.trace(np.diag(d) @ s) / (a**2).sum(1).mean()
    return np.concatenate([scale * r, (md - scale * r @ ms)[:, None]], axis=1)


def test_template_matches_methods_card_and_procedural():
    assert ARCFACE_TEMPLATE.shape == (5, 2)
    np.testing.assert_allclose(ARCFACE_TEMPLATE.numpy(), ARCFACE_TEMPLATE_112, atol=1e-6)
    np.testing.assert_allclose(template_for(224).numpy(), ARCFACE_TEMPLATE_112 * 2.0, atol=1e-5)
    with pytest.raises(DataError, match="crop size"):
        template_for(0)


def test_similarity_matches_closed_form_least_squares():
    rng = np.random.default_rng(0)
    src = rng.uniform(0, 200, (16, 5, 2))
    dst = ARCFACE_TEMPLATE.double().numpy() + rng.normal(0, 4.0, (16, 5, 2))  # not an exact similarity
    got = similarity_transform(torch.from_numpy(src), torch.from_numpy(dst)).numpy()
    for i in range(16):
        np.testing.assert_allclose(got[i], _lstsq(src[i], dst[i]), atol=1e-6)
        np.testing.assert_allclose(got[i], _umeyama(src[i], dst[i]), atol=1e-6)


def test_similarity_never_reflects_and_matches_umeyama_on_mirrored_points():
    """A mirrored target has a better reflection; Umeyama's correction and our closed form both refuse it."""
    src = ARCFACE_TEMPLATE.double().unsqueeze(0)
    dst = src.clone()
    dst[..., 0] = 112.0 - dst[..., 0]  # mirror image
    m = similarity_transform(src, dst)[0]
    assert torch.linalg.det(m[:, :2]) >= 0
    np.testing.assert_allclose(m.numpy(), _umeyama(src[0].numpy(), dst[0].numpy()), atol=1e-6)


def test_similarity_recovers_known_transform_exactly():
    rng = np.random.default_rng(1)
    truth = _random_similarity(rng, 8)
    src = torch.from_numpy(rng.uniform(0, 160, (8, 5, 2)))
    dst = transform_points(src, truth)
    got = similarity_transform(src, dst)
    torch.testing.assert_close(got, truth, atol=1e-9, rtol=0)
    torch.testing.assert_close(transform_points(dst, invert_affine(got)), src, atol=1e-9, rtol=0)


def test_similarity_gradcheck():
    rng = np.random.default_rng(2)
    src = torch.from_numpy(rng.uniform(0, 100, (3, 5, 2))).requires_grad_()
    dst = torch.from_numpy(rng.uniform(0, 100, (3, 5, 2))).requires_grad_()
    assert torch.autograd.gradcheck(similarity_transform, (src, dst), eps=1e-6, atol=1e-5)


def test_warp_gradcheck_through_landmarks():
    """Gradient of the aligned pixels with respect to the landmarks (the point of a differentiable aligner)."""
    rng = np.random.default_rng(3)
    img = torch.from_numpy(rng.uniform(0, 1, (1, 1, 12, 12)))
    pts = (ARCFACE_TEMPLATE.double() * (12 / 112) + torch.from_numpy(rng.normal(0, 0.3, (5, 2)))).unsqueeze(0)
    pts.requires_grad_()

    def f(p):
        return align_faces(img, p, out_size=8)[0]

    assert torch.autograd.gradcheck(f, (pts,), eps=1e-6, atol=1e-4)


@pytest.mark.parametrize("align_corners", [False, True])
def test_warp_pure_translation_and_scale(align_corners):
    """A dot at pixel (x, y) lands at M·(x, y) for integer translations and a 2× zoom, in both normalisations."""
    img = torch.zeros(1, 1, 20, 30, dtype=torch.float64)
    img[0, 0, 7, 11] = 1.0  # row 7, column 11 → (x, y) = (11, 7)
    shift = torch.tensor([[[1.0, 0.0, 4.0], [0.0, 1.0, -3.0]]], dtype=torch.float64)
    out = warp_affine(img, shift, (20, 30), align_corners=align_corners)
    assert out[0, 0, 4, 15] == pytest.approx(1.0) and out.sum() == pytest.approx(1.0)
    zoom = torch.tensor([[[2.0, 0.0, 1.0], [0.0, 2.0, 2.0]]], dtype=torch.float64)  # (11, 7) → (23, 16)
    out = warp_affine(img, zoom, 40, align_corners=align_corners)
    assert out[0, 0, 16, 23] == pytest.approx(1.0)
    ys, xs = torch.meshgrid(torch.arange(40.0), torch.arange(40.0), indexing="ij")
    mass = out[0, 0].sum()
    centroid = ((out[0, 0] * xs).sum() / mass, (out[0, 0] * ys).sum() / mass)
    assert centroid == (pytest.approx(23.0), pytest.approx(16.0))


def test_warp_normalisations_agree():
    rng = np.random.default_rng(4)
    img = torch.from_numpy(rng.uniform(0, 1, (2, 3, 40, 50)))
    m = _random_similarity(rng, 2)
    m[:, :, :2] *= 0.5
    m[:, :, 2] = torch.tensor([[10.0, 5.0], [-3.0, 12.0]], dtype=torch.float64)
    a = warp_affine(img, m, 32, align_corners=False)
    b = warp_affine(img, m, 32, align_corners=True)
    torch.testing.assert_close(a, b, atol=1e-9, rtol=0)


def _dots(landmarks: np.ndarray, h: int, w: int, sigma: float = 1.5) -> torch.Tensor:
    """(5, H, W) image: channel k holds a Gaussian dot at landmark k."""
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float64)
    return torch.from_numpy(
        np.stack([np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * sigma**2)) for x, y in landmarks])
    )


def test_aligned_dots_land_on_the_template():
    """Landmark-marked synthetic images, randomly rotated/scaled/shifted: after align_faces the dots sit on
    the 112 template within 1 px (centroids), and the returned matrices send the landmarks there too."""
    rng = np.random.default_rng(5)
    images, landmarks = [], []
    for _ in range(3):
        th, s = rng.uniform(-0.6, 0.6), rng.uniform(1.1, 1.6)
        r = s * np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        pts = (ARCFACE_TEMPLATE_112 - 56.0) @ r.T + np.array([90.0, 80.0]) + rng.normal(0, 0.5, (5, 2))
        images.append(_dots(pts, 160, 180))
        landmarks.append(pts)
    imgs = torch.stack(images)  # (3, 5, 160, 180)
    lms = torch.from_numpy(np.stack(landmarks))
    aligned, mats = align_faces(imgs, lms, out_size=112)
    assert aligned.shape == (3, 5, 112, 112) and mats.shape == (3, 2, 3)
    ys, xs = torch.meshgrid(torch.arange(112.0, dtype=torch.float64), torch.arange(112.0, dtype=torch.float64),
                            indexing="ij")
    mass = aligned.sum(dim=(2, 3))
    centroids = torch.stack([(aligned * xs).sum((2, 3)) / mass, (aligned * ys).sum((2, 3)) / mass], -1)
    mapped = transform_points(lms, mats)
    # the dots follow the landmarks exactly (sub-pixel), and the fit puts the landmarks near the template
    assert (centroids - mapped).norm(dim=-1).max() < 0.2
    assert (centroids - ARCFACE_TEMPLATE.double()).norm(dim=-1).max() < 1.0


def test_align_faces_rejects_bad_inputs():
    img = torch.zeros(2, 3, 64, 64)
    good = template_for(64).unsqueeze(0).expand(2, -1, -1).clone()
    bad = good.clone()
    bad[1, 2, 0] = float("nan")
    with pytest.raises(DataError, match="not finite.*rows \\[1\\]"):
        align_faces(img, bad)
    with pytest.raises(DataError, match="one set of landmarks per image"):
        align_faces(img[:1], good)
    with pytest.raises(DataError, match="floating point"):
        align_faces(img.to(torch.uint8), good)
    with pytest.raises(DataError, match=r"\(B, K, 2\)"):
        similarity_transform(good[..., :1], good)
