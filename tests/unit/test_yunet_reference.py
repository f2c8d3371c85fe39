"""DFA beside YuNet on procedural faces: the map from YuNet's landmark convention to the renderer's (fitted on val),
and the stage's comparison on the faces YuNet finds."""

from __future__ import annotations

import numpy as np
import pytest

from ml.aligner.yunet import ConventionMap, yunet_available

TEMPLATE = np.array([[38.3, 51.7], [73.5, 51.5], [56.0, 71.7], [41.5, 92.4], [70.7, 92.2]])


def _faces(n: int, seed: int) -> np.ndarray:
    """n template faces at random roll, scale and position, with a little per-point noise."""
    rng = np.random.default_rng(seed)
    angle, scale, shift = rng.uniform(-0.5, 0.5, n), rng.uniform(0.6, 1.5, n), rng.uniform(-20, 20, (n, 2))
    rot = np.stack([np.stack([np.cos(angle), -np.sin(angle)], -1), np.stack([np.sin(angle), np.cos(angle)], -1)], 1)
    pts = np.einsum("nij,kj->nki", rot * scale[:, None, None], TEMPLATE - TEMPLATE.mean(0)) + 64 + shift[:, None]
    return pts + rng.normal(0, 0.3, pts.shape)


def _other_convention(points: np.ndarray) -> np.ndarray:
    """The same faces annotated elsewhere: mouth corners 0.3 eye distances lower, the nose 0.1 lower, in each face's
    own eye frame (down = perpendicular to the eye line)."""
    d = points[:, 1] - points[:, 0]
    down = np.stack([-d[:, 1], d[:, 0]], -1)  # the eye vector turned 90° towards the mouth (image y grows down)
    out = points.copy()
    out[:, 2] += 0.1 * down
    out[:, 3:] += 0.3 * down[:, None]
    return out


def test_the_convention_map_learns_a_shift_in_the_eye_frame_and_holds_at_any_pose():
    fit, test = _faces(60, 0), _faces(20, 1)
    mapping = ConventionMap(fit, _other_convention(fit))
    error = np.abs(mapping(test) - _other_convention(test)).max()
    assert error < 0.5  # pixels; the shift is ~10 px on the mouth
    assert np.abs(test - _other_convention(test)).max() > 8  # what it had to learn
    with pytest.raises(ValueError, match="≥ 11 faces"):
        ConventionMap(fit[:5], fit[:5])


@pytest.mark.skipif(yunet_available() is not None, reason=str(yunet_available()))
def test_yunet_beside_dfa_scores_both_on_the_faces_it_finds_with_the_map_fitted_on_val():
    from ml.data.unaligned import unaligned_faces
    from tasks.train_aligner import detector_comparison

    val = unaligned_faces(6, 8, 128, seed=0, first_identity=900)[:2]
    test = unaligned_faces(6, 8, 128, seed=0, first_identity=910)[:2]
    dfa_box = np.linspace(0.0, 0.1, len(test[0]))  # a stand-in DFA: its per-face errors, known
    out = detector_comparison(val, test, 2 * dfa_box, dfa_box)
    assert 0 < out["faces"] <= len(test[0]) and out["found"] == pytest.approx(out["faces"] / len(test[0]))
    assert out["dfa/nme_box"] < 0.1 and out["dfa/nme"] == pytest.approx(2 * out["dfa/nme_box"])
    assert out["mapped/nme_box"] < out["raw/nme_box"]  # the mouth and nose convention, learnt on val
    assert 0.0 <= out["mapped/failure_box@0.05"] <= 1.0
    assert detector_comparison(None, test, dfa_box, dfa_box) == {
        "skipped": "no val split to fit YuNet's landmark convention on (data.unaligned_val_identities: 0)"}
