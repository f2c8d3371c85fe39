"""The Great Expectations gate: a clean prepared set passes; each kind of broken manifest is rejected
with a message naming the dataset, the expectation and the offending rows, and nothing half-written."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pandas as pd
import pytest

from ml.data.dataset import read_manifest
from ml.errors import DataError
from tasks import validate
from tasks.common import Paths

from tests.conftest import prepare_smoke


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare_smoke(tmp_path_factory.mktemp("ws"))


def _datasets(paths, **overrides):
    out = {k: (k, read_manifest(paths.prepared / k / "manifest.parquet")) for k in ("train", "heldout", "templates")}
    for k, df in overrides.items():
        out[k] = (k, df)
    return out


def test_clean_data_passes_and_writes_reports(prepared, tmp_path):
    data, paths = prepared
    result = validate.run(data, validate.ValidateConfig(), dataclasses.replace(paths))
    assert result.metrics["validate/train/success_percent"] == 100.0
    assert (paths.validation_reports / "train.json").is_file()
    assert result.metrics["validate/fusion/success_percent"] == 100.0  # CAFace's procedural training sets
    assert (paths.validation_reports / "docs" / "index.html").is_file()
    summary = (paths.validation_reports / validate.SUMMARY_NAME).read_text()
    assert 'class="status fail"' not in summary and "every expectation met" in summary
    leakage = json.loads((paths.validation_reports / "leakage.json").read_text())
    assert leakage["failures"] == [] and leakage["validate/leakage/train_heldout/shared_identities"] == 0
    assert result.metrics["validate/leakage/train/identities_under_two_names"] == 0


def _corrupt(paths, kind, fn):
    df = read_manifest(paths.prepared / kind / "manifest.parquet").copy()
    fn(df)
    return df


@pytest.mark.parametrize(("kind", "mutate", "expectation", "row"), [
    ("train", lambda df: df.__setitem__("path", df["path"].where(df.index != 3, df["path"][2])),
     "expect_column_values_to_be_unique", "row 3"),
    ("train", lambda df: df.__setitem__("landmarks", [np.array([70.0] + [30.0] * 9, dtype=np.float32) if i == 5 else v
                                                     for i, v in enumerate(df["landmarks"])]),
     "lm_x0_frac", "row 5"),
    ("heldout", lambda df: df.__setitem__("label", df["label"].where(df.index != 7, 999)),
     "label_matches_identity", "row 7"),
    ("train", lambda df: df.__setitem__("width", df["width"].where(df.index != 0, 32)),
     "column 'width'", "row 0"),
    ("train", lambda df: df.__setitem__("split", "train"), "is_val", "observed"),
    ("templates", lambda df: df.drop(index=[0, 1], inplace=True), "expect_table_row_count_to_be_between", "observed"),
    ("fusion", lambda df: df.__setitem__("split", df["split"].where(df.index != 2, "noisy")),
     "expect_column_values_to_be_in_set", "row 2"),
    ("fusion", lambda df: df.__setitem__("quality", df["quality"].where(df.index != 4, np.nan)),
     "expect_column_values_to_not_be_null", "row 4"),
])
def test_broken_manifest_is_rejected_naming_dataset_expectation_rows(prepared, tmp_path, kind, mutate, expectation, row):
    data, paths = prepared
    broken = _corrupt(paths, kind, mutate)
    with pytest.raises(DataError) as err:
        validate.validate_manifests(_datasets(paths, **{kind: broken}), data, validate.ValidateConfig(), tmp_path)
    message = str(err.value)
    assert f"dataset '{kind}'" in message and expectation in message and row in message, message


def test_summary_is_self_contained_and_lists_every_expectation(prepared, tmp_path):
    data, paths = prepared
    broken = _corrupt(paths, "train", lambda df: df.__setitem__("width", df["width"].where(df.index != 0, 32)))
    with pytest.raises(DataError):
        validate.validate_manifests(_datasets(paths, train=broken), data, validate.ValidateConfig(), tmp_path)
    text = (tmp_path / validate.SUMMARY_NAME).read_text()
    # offline: nothing to fetch, no script to run
    assert re.search(r"https?://|src=|url\(|@import|<link|<script", text, re.IGNORECASE) is None
    assert "<style>" in text
    for name in ("train", "heldout", "templates"):
        payload = json.loads((tmp_path / f"{name}.json").read_text())
        section = text.split(f'<section id="suite-{name}"', 1)[1].split("</section>", 1)[0]
        types = re.findall(r'<tr class="(pass|fail)"><td>.*?</td><td><code>([a-z_]+)</code>', section)
        assert types == [("pass" if r["success"] else "fail", r["expectation_config"]["type"])
                         for r in payload["results"]]
    failed = text.split('<section id="suite-train"', 1)[1].split('<tr class="fail">', 1)[1].split("</tr>", 1)[0]
    assert "width" in failed and "value_set=[64]" in failed and "1 unexpected of" in failed and "row 0 (" in failed
    docs = (tmp_path / "docs" / "index.html").read_text()
    assert docs.count(f'href="../{validate.SUMMARY_NAME}"') == 1


def test_failed_gate_leaves_no_half_written_reports(prepared, tmp_path, monkeypatch):
    data, paths = prepared
    target = Paths(tmp_path)
    (tmp_path / "data").symlink_to(paths.prepared.parent)
    import ml.data.dataset as dataset

    real_read = dataset.read_manifest

    def read_broken(path):
        df = real_read(path)
        if "train" in str(path):
            df.loc[1, "path"] = df.loc[0, "path"]
        return df

    monkeypatch.setattr(dataset, "read_manifest", read_broken)
    with pytest.raises(DataError, match="dataset 'train'"):
        validate.run(data, validate.ValidateConfig(), target)
    assert not target.validation_reports.exists()
    assert (tmp_path / "reports" / "validation-failed" / "train.json").is_file()
    assert not [p for p in (tmp_path / "reports").iterdir() if p.name.startswith(".")]


def _rewrite_with(dataset_dir, manifest, at: int, image) -> None:
    """Write the dataset again with ``image`` in place of face ``at`` (every row's annotations kept)."""
    from ml.data.dataset import DatasetWriter, load_images, read_dataset_info

    info, images = read_dataset_info(dataset_dir), load_images(dataset_dir, manifest)
    images[at] = image
    with DatasetWriter(dataset_dir, name=info["name"], source=info["source"], aligned=info["aligned"],
                       generator=info["generator"]) as w:
        for face, row in zip(images, manifest.itertuples()):
            w.add(face, identity=row.identity, split=row.split, landmarks=row.landmarks,
                  quality=None if pd.isna(row.quality) else row.quality,
                  template=None if pd.isna(row.template) else int(row.template),
                  media=None if pd.isna(row.media) else int(row.media))


def test_an_image_planted_in_two_sets_stops_the_gate_naming_both_paths(prepared, tmp_path):
    """A training face written over a held-out one (the same pixels under another name): names differ, pixels do
    not."""
    import shutil

    from ml.data.dataset import load_images

    data, paths = prepared
    target = Paths(tmp_path)
    shutil.copytree(paths.prepared, target.prepared)
    train, heldout = (read_manifest(target.prepared / k / "manifest.parquet") for k in ("train", "heldout"))
    _rewrite_with(target.prepared / "heldout", heldout, 2, load_images(target.prepared / "train", train.iloc[[4]])[0])
    with pytest.raises(DataError, match=re.escape(f"images in both train and heldout (1): train/{train['path'][4]} = "
                                                  f"heldout/{heldout['path'][2]}")):
        validate.run(data, validate.ValidateConfig(), target)
    leakage = json.loads((tmp_path / "reports" / "validation-failed" / "leakage.json").read_text())
    assert leakage["validate/leakage/train_heldout/shared_images"] == 1
    assert not target.validation_reports.exists()


def _gfd(paths):
    from ml.discovery.split import read_gfd_split

    return read_gfd_split(paths.gfd_split).copy()


def test_clean_gfd_split_passes_with_the_discovery_manifest(prepared, tmp_path):
    data, paths = prepared
    datasets = {"discovery": ("discovery", read_manifest(paths.discovery_set / "manifest.parquet")),
                "gfd_split": ("gfd_split", _gfd(paths))}
    results = validate.validate_manifests(datasets, data, validate.ValidateConfig(), tmp_path)
    assert results["gfd_split"]["statistics"]["success_percent"] == 100.0


def _label_an_unknown(df):
    row = df.index[~df["known"] & (df["subset"] == "train")][0]
    df.loc[row, "labelled"] = True
    return row


def _label_a_test_image(df):
    row = df.index[df["known"] & (df["subset"] == "test")][0]
    df.loc[row, "labelled"] = True
    return row


def _overlap_known_unknown(df):
    identity = df.loc[df["known"], "identity"].iloc[0]
    row = df.index[(df["identity"] == identity) & ~df["labelled"]][0]
    df.loc[row, "known"] = False
    return row


@pytest.mark.parametrize(("mutate", "column"), [
    (_label_an_unknown, "labelled_unknown"),
    (_label_a_test_image, "labelled_test"),
    (_overlap_known_unknown, "known_consistent"),
])
def test_broken_gfd_split_is_rejected_naming_the_row(prepared, tmp_path, mutate, column):
    data, paths = prepared
    df = _gfd(paths)
    row = mutate(df)
    with pytest.raises(DataError) as err:
        validate.validate_manifests({"gfd_split": ("gfd_split", df)}, data, validate.ValidateConfig(), tmp_path)
    message = str(err.value)
    assert "dataset 'gfd_split'" in message and column in message and f"row {row} " in message, message


def test_gfd_proportions_out_of_tolerance_are_rejected(prepared, tmp_path):
    data, paths = prepared
    df = _gfd(paths)
    df["known"] = True  # every identity known: nothing left to discover
    df["labelled"] = False
    with pytest.raises(DataError, match="known_identity_weight"):
        validate.validate_manifests({"gfd_split": ("gfd_split", df)}, data, validate.ValidateConfig(), tmp_path)
