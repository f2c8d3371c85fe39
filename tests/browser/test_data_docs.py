"""The validation reports opened as in an air-gapped lab: from disk, every network request refused. The
self-contained summary lists every suite and expectation with its verdict and is styled; the Data Docs index, whose
own tables need CDNs, points to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ml.data.dataset import read_manifest
from ml.errors import DataError
from tasks import validate

from tests.conftest import prepare_smoke

DATASETS = ("train", "heldout", "templates")


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    """Reports of a gate over the smoke preset's manifests, ``train`` broken (a duplicated path, no val split)."""
    data, paths = prepare_smoke(tmp_path_factory.mktemp("ws"))
    datasets = {k: (k, read_manifest(paths.prepared / k / "manifest.parquet")) for k in DATASETS}
    train = datasets["train"][1].copy()
    train.loc[3, "path"] = train.loc[2, "path"]
    train["split"] = "train"
    datasets["train"] = ("train", train)
    out = tmp_path_factory.mktemp("reports")
    with pytest.raises(DataError):
        validate.validate_manifests(datasets, data, validate.ValidateConfig(), out)
    return out


def _css(locator, prop: str) -> str:
    return locator.evaluate(f"e => getComputedStyle(e).getPropertyValue('{prop}')")


def test_summary_lists_every_result_styled_with_no_network(offline, reports):
    page, refused = offline
    page.goto((reports / validate.SUMMARY_NAME).as_uri())
    for name in DATASETS:
        payload = json.loads((reports / f"{name}.json").read_text())
        section = page.locator(f"section#suite-{name}")
        assert section.locator("h2").inner_text().startswith(name)
        rows = section.locator("tbody tr")
        assert rows.count() == payload["statistics"]["evaluated_expectations"] == len(payload["results"])
        for i, res in enumerate(payload["results"]):
            row = rows.nth(i)
            assert row.locator("td").nth(0).inner_text() == ("passed" if res["success"] else "failed")
            assert row.locator("td").nth(1).inner_text() == res["expectation_config"]["type"]
        # the overview table names each suite with its verdict
        overview = page.locator("table.overview tbody tr").filter(has_text=payload["suite_name"])
        assert overview.locator(".status").inner_text() == ("passed" if payload["success"] else "failed")
    assert refused == []  # nothing outside the file was even asked for

    # what a reader acts on: the failure, its observed rows and values, in the colours only the inline CSS gives
    unique = page.locator("section#suite-train tbody tr").filter(has_text="expect_column_values_to_be_unique")
    assert "2 unexpected of" in unique.inner_text() and "row 3 (" in unique.inner_text()
    mean = page.locator("section#suite-train tbody tr").filter(has_text="expect_column_mean_to_be_between")
    assert float(mean.locator("td").nth(4).inner_text()) == 0.0  # observed val share: no val split at all
    assert _css(unique.locator(".status"), "background-color") == "rgb(207, 34, 46)"
    assert _css(unique.locator("td").first, "background-color") == "rgb(255, 235, 233)"
    passed = page.locator("section#suite-heldout .status.pass").first
    assert _css(passed, "background-color") == "rgb(26, 127, 55)"
    assert _css(page.locator("table.overview"), "border-collapse") == "collapse"


def test_data_docs_index_offline_leads_to_the_summary(offline, reports):
    page, refused = offline
    page.goto((reports / "docs" / "index.html").as_uri())
    assert refused, "Data Docs asked for no CDN asset: the summary link may no longer be needed"
    link = page.locator("#faceops-offline-summary a")
    assert link.is_visible()
    link.click()
    page.wait_for_url("**/" + validate.SUMMARY_NAME)
    assert page.locator("section.suite").count() == len(DATASETS)
