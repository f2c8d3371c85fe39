"""The cross-set leakage check: planted people and images in two sets, one person under two names."""

from __future__ import annotations

import numpy as np
import pytest

from ml.data.dataset import DatasetWriter, read_manifest
from ml.data.leakage import check_leakage, dhash


def _face(seed: int) -> np.ndarray:
    """A smooth 48-px image (bilinear upsampling of 6 × 6 noise): informative hashes, unlike white noise."""
    import torch
    import torch.nn.functional as F

    low = torch.from_numpy(np.random.default_rng(seed).uniform(40, 215, (1, 3, 6, 6))).float()
    return F.interpolate(low, size=(48, 48), mode="bilinear", align_corners=False)[0].permute(1, 2, 0).round().byte().numpy()


def _write(root, name, people: dict[str, list[np.ndarray]]):
    with DatasetWriter(root / name, name=name, source="procedural", aligned=True) as w:
        for identity, images in people.items():
            for img in images:
                w.add(img, identity=identity)
    return root / name, read_manifest(root / name / "manifest.parquet")


def _sets(tmp_path, train=None, heldout=None):
    train = train or {f"t{i}": [_face(10 * i + j) for j in range(3)] for i in range(4)}
    heldout = heldout or {f"h{i}": [_face(1000 + 10 * i + j) for j in range(3)] for i in range(3)}
    return {"train": _write(tmp_path, "train", train), "heldout": _write(tmp_path, "heldout", heldout)}


def test_disjoint_sets_pass_with_zero_counts(tmp_path):
    found = check_leakage(_sets(tmp_path), hashed=("train", "heldout"))
    assert found.failures == [] and found.notes == []
    assert found.metrics["validate/leakage/train_heldout/shared_images"] == 0
    assert found.metrics["validate/leakage/train/identities_under_two_names"] == 0


def test_a_person_in_training_and_held_out_fails_naming_the_identity(tmp_path):
    heldout = {"t2": [_face(500 + j) for j in range(3)], "h1": [_face(600 + j) for j in range(3)]}
    found = check_leakage(_sets(tmp_path, heldout=heldout), hashed=())
    assert found.failures == ["identities in both train and heldout (1): t2"]


def test_one_image_in_two_sets_fails_naming_both_paths(tmp_path):
    heldout = {"h0": [_face(1000), _face(1), _face(1002)], "h1": [_face(1010 + j) for j in range(3)]}
    found = check_leakage(_sets(tmp_path, heldout=heldout), hashed=("train", "heldout"))
    assert found.failures == ["images in both train and heldout (1): train/images/t0/1.png = heldout/images/h0/1.png"]
    # by name alone the sets are disjoint: only pixels see it
    assert check_leakage(_sets(tmp_path / "names", heldout=heldout), hashed=()).failures == []


def test_one_person_under_two_names_fails_and_a_few_shared_images_are_label_noise(tmp_path):
    twin = [_face(j) for j in range(3)]
    train = {"t0": twin, "t0_copy": twin, "t1": [_face(20 + j) for j in range(3)]}
    found = check_leakage(_sets(tmp_path, train=train), hashed=("train",))
    assert found.failures == ["train: 1 pair(s) of identities share most of their images — one person under two "
                              "names: t0 and t0_copy share 3 of 3"]
    noisy = {"t0": [_face(j) for j in range(3)], "t1": [_face(20), _face(21), _face(0)]}
    found = check_leakage(_sets(tmp_path / "noise", train=noisy), hashed=("train",))
    assert found.failures == [] and found.metrics["validate/leakage/train/duplicates_across_identities"] == 1
    assert "1 image(s) appear under two identities (label noise" in found.notes[0]


def test_a_brightened_copy_is_reported_as_a_near_duplicate_not_a_failure(tmp_path):
    copy = np.clip(_face(2).astype(int) + 3, 0, 255).astype(np.uint8)
    assert (dhash(copy[None]) == dhash(_face(2)[None])).all()
    heldout = {"h0": [copy, _face(1001), _face(1002)], "h1": [_face(1010 + j) for j in range(3)]}
    found = check_leakage(_sets(tmp_path, heldout=heldout), hashed=("train", "heldout"))
    assert found.failures == []
    assert found.metrics["validate/leakage/train_heldout/near_duplicate_images"] == 1
    assert found.notes == ["1 image(s) of heldout look like images of train (equal dHash; re-encoded copies?): "
                           "heldout/images/h0/0.png"]


def test_flat_images_do_not_match_each_other(tmp_path):
    grey = {"t0": [np.full((48, 48, 3), 90, np.uint8), _face(1)], "t1": [_face(2), _face(3)]}
    dark = {"h0": [np.full((48, 48, 3), 10, np.uint8), _face(4)], "h1": [_face(5), _face(6)]}
    found = check_leakage(_sets(tmp_path, train=grey, heldout=dark), hashed=("train", "heldout"))
    assert found.notes == [] and found.failures == []


@pytest.mark.parametrize("block", [1, 2, 1000])
def test_fingerprints_do_not_depend_on_the_block_size(tmp_path, block):
    from ml.data.leakage import fingerprints

    d, m = _write(tmp_path, "s", {"a": [_face(j) for j in range(5)]})
    ref = fingerprints(d, m)
    assert fingerprints(d, m, block=block) == ref
