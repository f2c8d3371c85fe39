"""The generalized face discovery split (ml/discovery/split.py): proportions, determinism, no leakage, checks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ml.discovery.split import check_gfd_split, gfd_split, read_gfd_split, write_gfd_split
from ml.errors import ConfigError, DataError


def _manifest(counts: list[int]) -> pd.DataFrame:
    """Identity ``id{i:02d}`` with counts[i] images ``id{i:02d}/{j:03d}.jpg``; extra manifest columns kept."""
    rows = [(f"id{i:02d}/{j:03d}.jpg", f"id{i:02d}", i) for i, n in enumerate(counts) for j in range(n)]
    df = pd.DataFrame(rows, columns=["path", "identity", "label"])
    df["split"] = "train"
    return df


COUNTS = [20] * 10 + [15, 2, 1, 37]  # 14 identities


def test_proportions_per_identity():
    split = gfd_split(_manifest(COUNTS), seed=0)
    assert list(split.columns) == ["path", "identity", "known", "labelled", "subset"]
    per_id = split.groupby("identity").agg(
        n=("path", "size"), known=("known", "first"),
        test=("subset", lambda s: int((s == "test").sum())), labelled=("labelled", "sum"),
    )
    assert per_id["known"].sum() == 7  # round(0.5 * 14)
    # n_test = clip(round_half_up(0.1 n), 1, n - 1): 20 → 2, 15 → 2 (1.5 up), 2 → 1, 1 → 0, 37 → 4
    expected_test = {20: 2, 15: 2, 2: 1, 1: 0, 37: 4}
    assert (per_id["test"] == per_id["n"].map(expected_test)).all()
    # labelled = clip(round_half_up(0.5 n_train), 1, n_train) for known identities, 0 for unknown
    n_train = per_id["n"] - per_id["test"]
    expected_lab = np.where(per_id["known"], np.clip(np.floor(0.5 * n_train + 0.5), 1, n_train), 0)
    np.testing.assert_array_equal(per_id["labelled"].to_numpy(), expected_lab)


def test_no_leakage():
    split = gfd_split(_manifest(COUNTS), seed=3)
    check_gfd_split(split)
    assert not (split["labelled"] & ~split["known"]).any()  # unknown identities never labelled
    assert not (split["labelled"] & (split["subset"] == "test")).any()  # test never labelled
    assert split.groupby("identity")["known"].nunique().max() == 1  # disjoint known / unknown sets
    known_ids = set(split.loc[split["known"], "identity"])
    assert known_ids == set(split.loc[split["labelled"], "identity"])  # every known identity has a label


def test_keeps_manifest_row_order_and_ignores_it_for_the_draw():
    manifest = _manifest(COUNTS)
    split = gfd_split(manifest, seed=1)
    np.testing.assert_array_equal(split["path"], manifest["path"])
    shuffled = manifest.sample(frac=1.0, random_state=0)
    again = gfd_split(shuffled, seed=1).set_index("path").loc[split["path"]].reset_index()
    pd.testing.assert_frame_equal(again, split)


def test_deterministic_by_seed():
    manifest = _manifest(COUNTS)
    pd.testing.assert_frame_equal(gfd_split(manifest, seed=5), gfd_split(manifest, seed=5))
    a, b = gfd_split(manifest, seed=5), gfd_split(manifest, seed=6)
    assert not (a["known"].equals(b["known"]) and a["subset"].equals(b["subset"]))


def test_fractions_are_parameters():
    split = gfd_split(_manifest([20] * 10), seed=0, known_fraction=0.3, labelled_fraction=0.25, test_fraction=0.2)
    assert split.groupby("identity")["known"].first().sum() == 3
    assert (split["subset"] == "test").sum() == 10 * 4
    assert split["labelled"].sum() == 3 * 4  # round(0.25 * 16)


@pytest.mark.parametrize("kwargs", [{"known_fraction": 0.0}, {"labelled_fraction": 1.5}, {"test_fraction": 1.0},
                                    {"seed": -1}])
def test_bad_parameters(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        gfd_split(_manifest([4, 4]), **kwargs)


def test_bad_manifest():
    with pytest.raises(DataError, match=r"missing column\(s\) \['identity'\]"):
        gfd_split(pd.DataFrame({"path": ["a.jpg"]}))
    dup = _manifest([3, 3])
    dup.loc[4, "path"] = dup.loc[0, "path"]
    with pytest.raises(DataError, match=r"'path' repeats in rows \[0, 4\]"):
        gfd_split(dup)


def _good() -> pd.DataFrame:
    return gfd_split(_manifest([10, 10, 10, 10]), seed=0)


def test_check_rejects_missing_column():
    with pytest.raises(DataError, match=r"missing column\(s\) \['subset'\]"):
        check_gfd_split(_good().drop(columns="subset"))


def test_check_rejects_identity_both_known_and_unknown():
    df = _good()
    name = df.loc[df["known"], "identity"].iloc[0]
    row = df.index[df["identity"] == name][3]
    df.loc[row, ["known", "labelled"]] = False
    with pytest.raises(DataError, match=rf"identities \['{name}'\] are known in some rows and unknown"):
        check_gfd_split(df)


def test_check_rejects_labelled_unknown_identity():
    df = _good()
    row = df.index[~df["known"] & (df["subset"] == "train")][0]
    df.loc[row, "labelled"] = True
    with pytest.raises(DataError, match=rf"rows \[{row}\] \(1 in all\) label images of unknown identities"):
        check_gfd_split(df)


def test_check_rejects_labelled_test_image():
    df = _good()
    row = df.index[df["known"] & (df["subset"] == "test")][0]
    df.loc[row, "labelled"] = True
    with pytest.raises(DataError, match=rf"rows \[{row}\] \(1 in all\) are labelled test images"):
        check_gfd_split(df)


def test_check_rejects_bad_subset_and_types():
    df = _good()
    df.loc[2, "subset"] = "val"
    with pytest.raises(DataError, match=r"'subset' must be 'train' or 'test'; rows \[2\]"):
        check_gfd_split(df)
    df = _good()
    df["known"] = df["known"].astype(int)
    with pytest.raises(DataError, match=r"'known' must be bool"):
        check_gfd_split(df)


def test_parquet_round_trip(tmp_path):
    df = _good()
    path = tmp_path / "splits" / "gfd.parquet"
    write_gfd_split(df, path)
    assert [p.name for p in path.parent.iterdir()] == ["gfd.parquet"]  # no temp file left behind
    pd.testing.assert_frame_equal(read_gfd_split(path), df)


def test_write_refuses_a_broken_split_and_read_checks(tmp_path):
    bad = _good()
    bad.loc[bad.index[bad["subset"] == "test"][0], "labelled"] = True
    with pytest.raises(DataError, match="labelled test images"):
        write_gfd_split(bad, tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()
    bad.to_parquet(tmp_path / "y.parquet", index=False)  # written behind the checker's back
    with pytest.raises(DataError, match="labelled test images"):
        read_gfd_split(tmp_path / "y.parquet")
    with pytest.raises(DataError, match="GFD split not found"):
        read_gfd_split(tmp_path / "missing.parquet")
