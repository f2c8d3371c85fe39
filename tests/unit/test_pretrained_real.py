"""The real-template protocol of ``experiments.pretrained_real``: what is a still, what is a template, which pairs."""

from __future__ import annotations

import numpy as np
import pandas as pd

from experiments.pretrained_real import all_pairs, template_split


def test_each_identity_gives_one_still_and_whole_templates_of_its_other_faces():
    # a: a still and 2 templates; b: a still, 1 template and a face left over; c: too few faces for a template
    rows = pd.DataFrame({"identity": ["a"] * 9 + ["b"] * 6 + ["c"] * 3})
    gallery, members, groups = template_split(rows, frames=4, seed=0)
    ids = rows["identity"].to_numpy()
    assert list(ids[gallery]) == ["a", "b"]
    assert list(np.bincount(groups)) == [4, 4, 4]
    assert [set(ids[members[groups == g]]) for g in range(3)] == [{"a"}, {"a"}, {"b"}]
    assert not set(gallery) & set(members) and len(set(members)) == len(members)  # a still is never in a template
    again, members_again, _ = template_split(rows, frames=4, seed=0)
    assert np.array_equal(gallery, again) and np.array_equal(members, members_again)  # seeded
    draws = {tuple(template_split(rows, frames=4, seed=s)[0]) for s in range(5)}
    assert len(draws) > 1  # another seed draws other stills


def test_every_unordered_template_pair_once_labelled_by_identity():
    pairs, labels = all_pairs(np.array(["a", "a", "b"]))
    assert pairs.tolist() == [[0, 1], [0, 2], [1, 2]] and labels.tolist() == [1, 0, 0]
