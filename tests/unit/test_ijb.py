"""IJB-style meta files: round trips, the IJB release layout, tasks/prepare's files, and every bad line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ml.data.ijb_meta import (
    read_landmark_scores,
    read_template_pairs,
    read_tid_mid,
    write_landmark_scores,
    write_template_pairs,
    write_tid_mid,
)
from ml.errors import DataError


def _write(tmp_path, text: str, name: str = "meta.txt"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- round trips


def test_tid_mid_round_trip(tmp_path):
    table = pd.DataFrame({"path": ["img/1.jpg", "frames/2_0.png", "3.jpg"], "template": [1, 1, 11065],
                          "media": [69544, 7, -2]})
    path = write_tid_mid(tmp_path / "meta" / "face_tid_mid.txt", table)
    assert path.read_text() == "img/1.jpg 1 69544\nframes/2_0.png 1 7\n3.jpg 11065 -2\n"
    back = read_tid_mid(path)
    assert list(back.columns) == ["path", "template", "media"]
    assert back["template"].dtype == np.int64 and back["media"].dtype == np.int64
    pd.testing.assert_frame_equal(back, table.astype({"template": np.int64, "media": np.int64}))
    assert not list(tmp_path.joinpath("meta").glob(".*.tmp"))  # no temporary file left behind


def test_template_pairs_round_trip(tmp_path):
    pairs = np.array([[1, 11065], [1, 2], [2 ** 40, 3]], dtype=np.int64)
    labels = np.array([1, 0, 0])
    path = write_template_pairs(tmp_path / "pairs.txt", pairs, labels)
    assert path.read_text().splitlines()[0] == "1 11065 1"
    got_pairs, got_labels = read_template_pairs(path)
    assert got_pairs.dtype == np.int64 and got_labels.dtype == np.int8
    np.testing.assert_array_equal(got_pairs, pairs)
    np.testing.assert_array_equal(got_labels, labels)


def test_landmark_scores_round_trip_is_exact_in_float32(tmp_path):
    rng = np.random.default_rng(0)
    landmarks = (rng.random((4, 5, 2)) * 300).astype(np.float32)
    landmarks[0, 0] = (-3.5, 1e-7)  # negative and tiny values survive too
    scores = rng.random(4).astype(np.float32)
    names = ["1.jpg", "2.jpg", "a/3.jpg", "4.jpg"]
    path = write_landmark_scores(tmp_path / "5pts.txt", names, landmarks, scores)
    assert len(path.read_text().splitlines()[1].split()) == 12
    got_names, got_landmarks, got_scores = read_landmark_scores(path)
    assert got_names == names
    assert got_landmarks.dtype == np.float32 and got_landmarks.shape == (4, 5, 2)
    np.testing.assert_array_equal(got_landmarks, landmarks)  # bit-exact
    np.testing.assert_array_equal(got_scores, scores)


def test_reads_the_ijb_release_layout(tmp_path):
    """Lines as in IJB-C's meta files (3-decimal landmarks, tabs or several spaces, trailing blank line)."""
    tid_mid = _write(tmp_path, "1.jpg 1 69544\n2.jpg\t1\t69544\n\n", "ijbc_face_tid_mid.txt")
    assert read_tid_mid(tid_mid).to_dict("list") == {"path": ["1.jpg", "2.jpg"], "template": [1, 1], "media": [69544, 69544]}
    pairs = _write(tmp_path, "1 11065 1\n1  11066 0\n", "ijbc_template_pair_label.txt")
    p, l = read_template_pairs(pairs)
    assert p.tolist() == [[1, 11065], [1, 11066]] and l.tolist() == [1, 0]
    pts = _write(tmp_path, "1.jpg 46.060 62.026 87.785 60.323 68.851 77.656 52.162 104.450 87.584 104.013 0.999\n",
                 "ijbc_name_5pts_score.txt")
    names, lm, sc = read_landmark_scores(pts)
    assert names == ["1.jpg"]
    np.testing.assert_allclose(lm[0], [[46.060, 62.026], [87.785, 60.323], [68.851, 77.656], [52.162, 104.450],
                                       [87.584, 104.013]], rtol=1e-6)
    assert sc[0] == np.float32(0.999)


def test_reads_what_tasks_prepare_writes(tmp_path):
    """The template set of tasks/prepare/sets.py (its exact writer, on a tiny config) reads back consistently."""
    from ml.data.dataset import read_manifest
    from ml.data.procedural import ProceduralFaces
    from tasks.prepare import DataConfig
    from tasks.prepare.sets import template_set

    cfg = DataConfig(template_identities=2, templates_per_identity=2, frames_per_template=2, heldout_identities=2)
    gen = ProceduralFaces(cfg.procedural_config(), seed=0)
    n_pairs = template_set(tmp_path / "templates", gen, cfg, 0)
    meta = tmp_path / "templates" / "meta"
    table = read_tid_mid(meta / "face_tid_mid.txt")
    manifest = read_manifest(tmp_path / "templates" / "manifest.parquet")
    assert len(table) == len(manifest) == 2 * 2 * (2 + 1)  # identities × templates × (frames + still)
    by_path = manifest.set_index("path")
    assert (by_path.loc[table["path"], "template"].to_numpy() == table["template"].to_numpy()).all()
    assert (by_path.loc[table["path"], "media"].to_numpy() == table["media"].to_numpy()).all()
    pairs, labels = read_template_pairs(meta / "template_pair_label.txt")
    assert len(pairs) == n_pairs == 6 and labels.sum() == 2  # 4 templates: C(4,2), 2 same-identity pairs
    assert set(pairs.ravel()) <= set(table["template"])


# ---- bad input: every error names the file and line


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1.jpg 1 2\n2.jpg 1\n", r"line 2: expected 3 .*got 2"),
        ("1.jpg 1 2\n\n2.jpg 1 2 3\n", r"line 3: expected 3"),
        ("1.jpg 1.0 2\n", r"line 1: template id '1.0' is not an integer"),
        ("1.jpg 1 x\n", r"line 1: media id 'x' is not an integer"),
        ("1.jpg 1 99999999999999999999\n", r"line 1: media id .* not an integer \(int64\)"),
        ("1.jpg 1 nan\n", r"line 1: media id 'nan'"),
        ("", r"holds no records"),
        ("\n  \n", r"holds no records"),
    ],
)
def test_bad_tid_mid_lines(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(DataError, match=match) as info:
        read_tid_mid(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1 2 1\n1 2 2\n", r"line 2: label '2' must be 1 .* or 0"),
        ("1 2 -1\n", r"line 1: label '-1'"),
        ("1 2 1.0\n", r"line 1: label '1.0'"),
        ("1 2 nan\n", r"line 1: label 'nan'"),
        ("1 a 1\n", r"line 1: template id 'a' is not an integer"),
        ("1 2\n", r"line 1: expected 3"),
    ],
)
def test_bad_pair_lines(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(DataError, match=match) as info:
        read_template_pairs(path)
    assert str(path) in str(info.value)


GOOD_5PTS = "1.jpg 1 2 3 4 5 6 7 8 9 10 0.9\n"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (GOOD_5PTS + "2.jpg 1 2 3 4 5 6 7 8 9 10\n", r"line 2: expected 12 .*got 11"),
        (GOOD_5PTS + "2.jpg 1 2 3 4 5 nan 7 8 9 10 0.9\n", r"line 2: landmark coordinate 'nan' is not a finite"),
        ("1.jpg 1 2 3 4 5 6 7 8 9 inf 0.9\n", r"line 1: landmark coordinate 'inf'"),
        ("1.jpg 1 2 3 4 5 6 7 8 9 10 NaN\n", r"line 1: face score 'NaN'"),
        ("1.jpg 1 2 3 4 5 6 7 8 9 1e999 0.9\n", r"line 1: landmark coordinate out of the float32 range"),
        ("1.jpg 1 2 3 4 5 6 7 8 9 1_0 0.9\n", r"line 1: landmark coordinate '1_0'"),
    ],
)
def test_bad_landmark_lines(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(DataError, match=match) as info:
        read_landmark_scores(path)
    assert str(path) in str(info.value)


def test_missing_file_is_named(tmp_path):
    for reader in (read_tid_mid, read_template_pairs, read_landmark_scores):
        with pytest.raises(DataError, match="missing.txt does not exist"):
            reader(tmp_path / "missing.txt")


def test_writers_refuse_what_they_could_not_read_back(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(DataError, match="whitespace"):
        write_tid_mid(target, pd.DataFrame({"path": ["a b.jpg"], "template": [1], "media": [1]}))
    with pytest.raises(DataError, match="columns"):
        write_tid_mid(target, pd.DataFrame({"path": ["a.jpg"], "template": [1]}))
    with pytest.raises(DataError, match="template must be 1 integers"):
        write_tid_mid(target, pd.DataFrame({"path": ["a.jpg"], "template": [1.5], "media": [1]}))
    with pytest.raises(DataError, match="no rows"):
        write_tid_mid(target, pd.DataFrame({"path": [], "template": [], "media": []}))
    with pytest.raises(DataError, match="label 2 of pair 1 must be 0 or 1"):
        write_template_pairs(target, np.array([[1, 2], [3, 4]]), np.array([1, 2]))
    with pytest.raises(DataError, match=r"pairs must be integer"):
        write_template_pairs(target, np.array([[1.0, 2.0]]), np.array([1]))
    with pytest.raises(DataError, match="row 1 is NaN"):
        write_landmark_scores(target, ["a.jpg", "b.jpg"], np.array([np.zeros((5, 2)), np.full((5, 2), np.nan)]),
                              np.ones(2))
    with pytest.raises(DataError, match=r"landmarks must be numbers of shape \(1, 5, 2\)"):
        write_landmark_scores(target, ["a.jpg"], np.zeros((1, 4, 2)), np.ones(1))
    with pytest.raises(DataError, match="scores of row 0"):
        write_landmark_scores(target, ["a.jpg"], np.zeros((1, 5, 2)), np.array([np.inf]))
    assert not target.exists()


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = write_template_pairs(tmp_path / "pairs.txt", np.array([[1, 2]]), np.array([1]))
    import ml.data.ijb_meta as ijb

    def boom(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ijb.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_template_pairs(path, np.array([[3, 4]]), np.array([0]))
    assert path.read_text() == "1 2 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pairs.txt"]
