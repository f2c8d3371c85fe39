"""Stage ``validate``: the Great Expectations gate over every manifest ``prepare`` wrote.

One suite per manifest kind (``train``, ``heldout``, ``templates``, ``discovery``, ``videos``, ``unaligned``, and
``fusion`` unless real faces are ingested; the first two and ``discovery`` hold the user's real faces when they are ingested, with counts that are theirs, not
params') plus one for the generalized-face-discovery split (``gfd_split``); each expectation carries the
risk it guards against in ``meta.risk``. Results land in ``reports/validation/<dataset>.json``, as Data Docs
HTML in ``reports/validation/docs/index.html`` and as ``reports/validation/summary.html``. A failed expectation
stops the pipeline with one message naming the dataset, the expectation, the column and the offending rows.

Data Docs load bootstrap, jquery, bootstrap-table and vega from CDNs (GX ships only its own CSS, fonts and images):
without a network their index lists no validation results and renders unstyled. ``summary.html`` is the offline
view: one self-contained file (inline CSS, no script, no external URL) listing every suite and every expectation
with its status, arguments, observed value and risk; the Data Docs index links to it.

GX validates flat columns, so the manifest is viewed with derived columns: ``lm_x0..lm_y4`` (landmarks),
``row`` (manifest row number), ``label_matches_identity`` (label = rank of the identity among sorted
identities, i.e. contiguous 0..K-1), ``is_val`` (for split proportions).
"""

from __future__ import annotations

import html
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ml.atomic import atomic_path
from ml.config import from_mapping
from ml.errors import DataError
from tasks.common import Paths, StageResult, load_params, section, stage_main, write_json, write_text
from tasks.prepare import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidateConfig:
    """``params.yaml`` section ``validate``."""

    split_tolerance: float = 0.05     # |observed val share − data.val_fraction| allowed
    count_tolerance: float = 0.0      # relative slack on expected image/identity counts (0 = exact)
    min_images_per_identity: int = 2
    max_shared_fraction: float = 0.5  # two identities sharing more of their images: one person under two names


def manifest_view(manifest: pd.DataFrame) -> pd.DataFrame:
    """The manifest with the flat derived columns the expectations read."""
    view = manifest.drop(columns=["landmarks"]).copy()
    view.insert(0, "row", np.arange(len(view)))
    lm = np.full((len(manifest), 10), np.nan, dtype=np.float64)
    for i, value in enumerate(manifest["landmarks"]):
        if value is not None and not (isinstance(value, float) and np.isnan(value)):
            arr = np.asarray(value, dtype=np.float64).reshape(-1)
            lm[i, : min(10, arr.size)] = arr[:10]
    for j in range(5):
        view[f"lm_x{j}"] = lm[:, 2 * j]
        view[f"lm_y{j}"] = lm[:, 2 * j + 1]
    # lm_x_frac = x / (width-1): a single 0..1 range works whatever the image size
    for j in range(5):
        view[f"lm_x{j}_frac"] = view[f"lm_x{j}"] / (view["width"] - 1).clip(lower=1)
        view[f"lm_y{j}_frac"] = view[f"lm_y{j}"] / (view["height"] - 1).clip(lower=1)
    ranks = {name: k for k, name in enumerate(sorted(view["identity"].astype(str).unique()))}
    view["label_matches_identity"] = view["label"].to_numpy() == view["identity"].astype(str).map(ranks).to_numpy()
    view["is_val"] = (view["split"] == "val").astype(float)
    per_identity = view.groupby("identity")["path"].transform("count")
    view["images_of_identity"] = per_identity.astype(int)
    return view


def _between(n: int, tol: float) -> dict[str, int]:
    slack = int(np.ceil(n * tol))
    return {"min_value": max(n - slack, 0), "max_value": n + slack}


def build_expectations(
    kind: str, view: pd.DataFrame, data: DataConfig, cfg: ValidateConfig
) -> list[Any]:
    """The expectations of one manifest kind, each with the risk it guards against."""
    import great_expectations as gx

    E = gx.expectations
    size = data.unaligned_size if kind == "unaligned" else data.image_size
    exps: list[Any] = [
        E.ExpectColumnValuesToNotBeNull(column="path", meta={"risk": "rows without an image file"}),
        E.ExpectColumnValuesToBeUnique(column="path", meta={"risk": "duplicate rows double-count an image"}),
        E.ExpectColumnValuesToBeInSet(column="width", value_set=[size], meta={"risk": "images of the wrong size reach the model"}),
        E.ExpectColumnValuesToBeInSet(column="height", value_set=[size], meta={"risk": "images of the wrong size reach the model"}),
        E.ExpectColumnValuesToBeInSet(column="label_matches_identity", value_set=[True],
                                      meta={"risk": "labels not contiguous 0..K-1 or not one per identity: the classifier head and metrics misalign"}),
        E.ExpectColumnValuesToBeBetween(column="quality", min_value=0.0, max_value=1.0, meta={"risk": "quality outside [0,1] breaks quality-weighted fusion"}),
        E.ExpectColumnValuesToBeInSet(column="source", value_set=["procedural", "real", "synthetic"], meta={"risk": "unknown provenance"}),
    ]
    # real faces: an identity with one image is kept for training (and left out of verification pairs), so the
    # minimum applies to the procedural sets, whose counts are set by params
    real = (data.ingested and kind in ("train", "heldout")) or (kind == "discovery" and data.gfd_source == "real")
    exps.append(E.ExpectColumnValuesToBeBetween(column="images_of_identity", min_value=1 if real else cfg.min_images_per_identity,
                                                meta={"risk": "identities with a single image give no genuine pairs"}))
    for j in range(5):
        for axis in ("x", "y"):
            exps.append(E.ExpectColumnValuesToBeBetween(
                column=f"lm_{axis}{j}_frac", min_value=0.0, max_value=1.0,
                meta={"risk": f"landmark {j} ({axis}) outside the image: alignment and KP-RPE read garbage"},
            ))
    expected = {
        "train": (data.train_identities, data.train_identities * data.images_per_identity),
        "heldout": (data.heldout_identities, data.heldout_identities * data.heldout_images_per_identity),
        "templates": (
            data.template_identities,
            data.template_identities * data.templates_per_identity * (data.frames_per_template + 1),
        ),
        "discovery": (data.discovery_identities, data.discovery_identities * data.discovery_images_per_identity),
        "unaligned": (data.unaligned_identities, data.unaligned_identities * data.unaligned_images_per_identity),
        "fusion": (data.fusion_identities,
                   data.fusion_identities * (data.fusion_clean_images + data.fusion_sources * data.fusion_copies)),
    }
    if kind in expected and not real:  # a real set's counts are the user's, not params
        ids, rows = expected[kind]
        exps.append(E.ExpectTableRowCountToBeBetween(**_between(rows, cfg.count_tolerance),
                                                     meta={"risk": "images lost or duplicated while preparing"}))
        exps.append(E.ExpectColumnUniqueValueCountToBeBetween(column="identity", **_between(ids, cfg.count_tolerance),
                                                              meta={"risk": "identities lost or merged"}))
    if kind == "train":
        expected_val = round(data.images_per_identity * data.val_fraction) / data.images_per_identity
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["train", "val"], meta={"risk": "unknown split name"}))
        if not real:  # a real identity's val share depends on its image count
            exps.append(E.ExpectColumnMeanToBeBetween(
                column="is_val", min_value=max(expected_val - cfg.split_tolerance, 0.0),
                max_value=min(expected_val + cfg.split_tolerance, 1.0),
                meta={"risk": "train/val proportions drifted from data.val_fraction"},
            ))
    if kind == "videos":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["gallery", "probe"], meta={"risk": "unknown split name"}))
        exps.append(E.ExpectColumnValuesToNotBeNull(column="template", meta={"risk": "frames outside any probe or gallery"}))
        exps.append(E.ExpectColumnUniqueValueCountToBeBetween(
            column="identity", **_between(data.video_identities + data.video_distractors, cfg.count_tolerance),
            meta={"risk": "enrolled or distractor identities lost"}))
    if kind == "unaligned":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["train", "val", "test"],
                                                  meta={"risk": "unknown split name"}))
        exps.append(E.ExpectColumnValuesToNotBeNull(column="lm_x0", meta={"risk": "an aligner training face without landmarks"}))
    if kind == "fusion":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["clean", "degraded"],
                                                  meta={"risk": "unknown split name"}))
        exps.append(E.ExpectColumnValuesToNotBeNull(column="quality", meta={"risk": "a CAFace training face without "
                                                                                    "its true quality"}))
    if kind == "discovery":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["train"], meta={"risk": "unknown split name"}))
    if kind == "heldout":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["gallery", "probe"], meta={"risk": "unknown split name"}))
    if kind == "synthetic":
        exps.append(E.ExpectColumnValuesToBeInSet(column="split", value_set=["train"], meta={"risk": "unknown split name"}))
        exps.append(E.ExpectColumnValuesToBeInSet(column="source", value_set=["synthetic"],
                                                  meta={"risk": "real faces mixed into the synthetic set: privacy"}))
        if "identity_consistency" in view.columns:  # per-identity mean intra-class cosine, added by synthesize
            exps.append(E.ExpectColumnPairValuesAToBeGreaterThanB(
                column_A="identity_consistency", column_B="min_identity_consistency", or_equal=True,
                meta={"risk": "an identity whose faces do not look like one person teaches the FR model noise"}))
    if kind == "templates":
        exps.append(E.ExpectColumnValuesToNotBeNull(column="template", meta={"risk": "images outside any template"}))
        exps.append(E.ExpectColumnValuesToNotBeNull(column="media", meta={"risk": "media pooling cannot group frames"}))
    return exps


def gfd_view(split: pd.DataFrame) -> pd.DataFrame:
    """The GFD split with the flat derived columns its expectations read."""
    view = split.copy()
    view.insert(0, "row", np.arange(len(view)))
    view["labelled_unknown"] = view["labelled"] & ~view["known"]
    view["labelled_test"] = view["labelled"] & (view["subset"] == "test")
    view["known_consistent"] = view.groupby("identity")["known"].transform("nunique") == 1
    view["is_test"] = (view["subset"] == "test").astype(float)
    # summed over rows: the number of known identities
    view["known_identity_weight"] = view["known"] / view.groupby("identity")["path"].transform("count")
    known_train = view["known"] & (view["subset"] == "train")
    view["labelled_of_known_train"] = view["labelled"].astype(float).where(known_train)
    return view


def gfd_expectations(view: pd.DataFrame, data: DataConfig, cfg: ValidateConfig) -> list[Any]:
    """The GFD split's expectations: no label leakage, consistent known/unknown sets, proportions as asked.

    Proportions are checked with the tolerance ``validate.split_tolerance`` plus the rounding that whole images
    and identities force (half an image of the smallest identity, half an identity).
    """
    import great_expectations as gx

    E = gx.expectations
    per_identity = view.groupby("identity")["path"].count()
    n_ids = len(per_identity)
    rounding = 0.5 / max(int(per_identity.min()), 1)
    known = data.gfd_known_fraction * n_ids
    known_slack = cfg.split_tolerance * n_ids + 0.5
    return [
        E.ExpectColumnValuesToBeInSet(column="labelled_unknown", value_set=[False],
                                      meta={"risk": "a labelled image of an unknown identity leaks the answer: novel accuracy is inflated"}),
        E.ExpectColumnValuesToBeInSet(column="labelled_test", value_set=[False],
                                      meta={"risk": "test images carry labels: the test subset measures memorisation"}),
        E.ExpectColumnValuesToBeInSet(column="known_consistent", value_set=[True],
                                      meta={"risk": "an identity is both known and unknown: the known/novel split overlaps"}),
        E.ExpectColumnValuesToBeInSet(column="subset", value_set=["train", "test"], meta={"risk": "unknown subset name"}),
        E.ExpectColumnValuesToBeUnique(column="path", meta={"risk": "an image counted twice"}),
        E.ExpectColumnMeanToBeBetween(
            column="is_test", min_value=max(data.gfd_test_fraction - cfg.split_tolerance - rounding, 0.0),
            max_value=min(data.gfd_test_fraction + cfg.split_tolerance + rounding, 1.0),
            meta={"risk": "train/test proportions drifted from data.gfd_test_fraction"}),
        E.ExpectColumnSumToBeBetween(
            column="known_identity_weight", min_value=known - known_slack, max_value=known + known_slack,
            meta={"risk": "known/unknown identity proportions drifted from data.gfd_known_fraction"}),
        E.ExpectColumnMeanToBeBetween(
            column="labelled_of_known_train",
            min_value=max(data.gfd_labelled_fraction - cfg.split_tolerance - 2 * rounding, 0.0),
            max_value=min(data.gfd_labelled_fraction + cfg.split_tolerance + 2 * rounding, 1.0),
            meta={"risk": "labelled share of known identities drifted from data.gfd_labelled_fraction"}),
    ]


def _describe_failure(dataset: str, res: Any) -> str:
    cfg = res.expectation_config
    kwargs = {k: v for k, v in cfg.kwargs.items() if k not in ("batch_id", "column")}
    column = cfg.kwargs.get("column")
    rows = res.result.get("unexpected_index_list") or []
    shown = ", ".join(f"row {r.get('row')} ({r.get('path')})" for r in rows[:5] if isinstance(r, dict))
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    observed = res.result.get("observed_value")
    where = f" column '{column}'" if column else ""
    what = f"; offending rows: {shown}{more}" if shown else (f"; observed {observed!r}" if observed is not None else "")
    risk = (cfg.meta or {}).get("risk", "")
    return (
        f"dataset '{dataset}': expectation {cfg.type}{where} {kwargs} failed{what}. "
        f"Risk: {risk}. Fix the data (or rerun `dvc repro prepare`) and validate again."
    )


SUMMARY_NAME = "summary.html"
# inline, so the page renders the same with no network; the status colours carry the verdict
_SUMMARY_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem; color: #1f2328;
       background: #ffffff; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #d0d7de; padding-bottom: 0.3rem; }
p.meta { color: #57606a; margin-top: 0; }
table { border-collapse: collapse; width: 100%; font-size: 0.9rem; margin-top: 0.5rem; }
th, td { border: 1px solid #d0d7de; padding: 0.3rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr.fail td { background: #ffebe9; }
code { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 0.85rem; word-break: break-word; }
.status { display: inline-block; min-width: 4.5em; text-align: center; border-radius: 0.8em; padding: 0.05rem 0.6rem;
          font-weight: 600; color: #ffffff; }
.status.pass { background: #1a7f37; }
.status.fail { background: #cf222e; }
td.risk { color: #57606a; }
"""


def _rounded(value: Any) -> Any:
    """Floats to 6 significant digits (a tolerance bound prints 0.116667, not 0.11666666666666665)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(_rounded(value), sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _observed(result: dict[str, Any]) -> str:
    """What the data showed: an aggregate's observed value, or a per-row expectation's unexpected rows."""
    if "observed_value" in result:
        return _short(result["observed_value"])
    if "unexpected_count" in result:
        count, total = result.get("unexpected_count") or 0, result.get("element_count")
        text = f"{count} unexpected of {total}" if total is not None else f"{count} unexpected"
        rows = [r for r in result.get("unexpected_index_list") or [] if isinstance(r, dict)]
        if rows:
            shown = ", ".join(f"row {r.get('row')} ({r.get('path')})" for r in rows[:5])
            text += f": {shown}" + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
        return _short(text, 400)
    return ""


def _status(success: bool) -> str:
    word = "pass" if success else "fail"
    return f'<span class="status {word}">{"passed" if success else "failed"}</span>'


def summary_html(results: dict[str, dict[str, Any]], docs_pages: dict[str, str] | None = None) -> str:
    """A self-contained HTML page of ``{dataset: validation result JSON}``: an overview table of the suites, then
    every expectation of each with its status, arguments, observed value and risk. No script, no external URL.

    ``docs_pages`` maps a dataset to its Data Docs page, relative to the summary (linked, never loaded).
    """
    esc = html.escape
    docs_pages = docs_pages or {}
    n_exp = sum(p["statistics"]["evaluated_expectations"] for p in results.values())
    n_bad = sum(p["statistics"]["unsuccessful_expectations"] for p in results.values())
    run_times = sorted(str(p.get("meta", {}).get("run_id", {}).get("run_time") or "") for p in results.values())
    version = next((p.get("meta", {}).get("great_expectations_version") for p in results.values()), None)
    overview = []
    for name, payload in results.items():
        stats = payload["statistics"]
        overview.append(
            f'<tr class="{"pass" if payload["success"] else "fail"}"><td><a href="#suite-{esc(name)}">{esc(name)}</a></td>'
            f"<td><code>{esc(payload.get('suite_name', ''))}</code></td><td>{_status(payload['success'])}</td>"
            f"<td>{stats['successful_expectations']} / {stats['evaluated_expectations']}</td>"
            f"<td>{(stats['success_percent'] or 0.0):.1f}%</td></tr>")
    sections = []
    for name, payload in results.items():
        rows = []
        for res in payload["results"]:
            cfg = res["expectation_config"]
            kwargs = {k: v for k, v in cfg["kwargs"].items() if k not in ("batch_id", "column")}
            args = ", ".join(f"{k}={_short(v, 80)}" for k, v in kwargs.items())
            column = cfg["kwargs"].get("column", "")
            if res.get("exception_info", {}).get("raised_exception"):
                observed = "error: " + _short(res["exception_info"].get("exception_message") or "", 300)
            else:
                observed = _observed(res.get("result") or {})
            rows.append(
                f'<tr class="{"pass" if res["success"] else "fail"}"><td>{_status(res["success"])}</td>'
                f"<td><code>{esc(cfg['type'])}</code></td><td><code>{esc(str(column))}</code></td>"
                f"<td><code>{esc(args)}</code></td><td>{esc(observed)}</td>"
                f'<td class="risk">{esc((cfg.get("meta") or {}).get("risk", ""))}</td></tr>')
        link = (f' · <a href="{esc(docs_pages[name])}">Data Docs page</a> (needs network for its styles)'
                if name in docs_pages else "")
        stats = payload["statistics"]
        sections.append(
            f'<section id="suite-{esc(name)}" class="suite"><h2>{esc(name)} {_status(payload["success"])}</h2>'
            f'<p class="meta">suite <code>{esc(payload.get("suite_name", ""))}</code> · '
            f"{stats['successful_expectations']} of {stats['evaluated_expectations']} expectations met{link}</p>"
            "<table><thead><tr><th>Status</th><th>Expectation</th><th>Column</th><th>Arguments</th>"
            "<th>Observed</th><th>Risk</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></section>")
    verdict = "every expectation met" if n_bad == 0 else f"{n_bad} expectation(s) failed"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        "<title>faceops validation summary</title>"
        f"<style>{_SUMMARY_CSS}</style></head><body>"
        f"<h1>Validation summary {_status(n_bad == 0)}</h1>"
        f'<p class="meta">{len(results)} suite(s), {n_exp} expectations: {verdict}. '
        f"Run {esc(run_times[0] if run_times else '?')}"
        f"{' – ' + esc(run_times[-1]) if len(run_times) > 1 else ''}; Great Expectations {esc(str(version))}. "
        'Full Data Docs: <a href="docs/index.html">docs/index.html</a> (loads its scripts and styles from CDNs).</p>'
        '<table class="overview"><thead><tr><th>Dataset</th><th>Suite</th><th>Status</th><th>Met</th><th>Success</th>'
        "</tr></thead><tbody>" + "".join(overview) + "</tbody></table>" + "".join(sections) + "</body></html>\n")


def _docs_pages(docs_dir: Path, results: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each dataset's Data Docs validation page, relative to the report directory (the newest, if several)."""
    pages = {}
    for name, payload in results.items():
        found = sorted((docs_dir / "validations" / str(payload.get("suite_name", ""))).glob("**/*.html"))
        if found:
            pages[name] = found[-1].relative_to(docs_dir.parent).as_posix()
    return pages


def _link_summary_from_docs(index: Path) -> None:
    """Put a plain link to the offline summary at the top of the Data Docs index (its own table needs CDNs)."""
    if not index.is_file():
        return
    text = index.read_text()
    at = text.find("<body")
    end = text.find(">", at)
    if at < 0 or end < 0 or f"../{SUMMARY_NAME}" in text:
        return
    note = (f'\n<p id="faceops-offline-summary" style="margin:0.5rem 1rem">Offline or unstyled? Every validation '
            f'result is also in <a href="../{SUMMARY_NAME}">{SUMMARY_NAME}</a> (self-contained).</p>')
    write_text(index, text[: end + 1] + note + text[end + 1:])


def validate_manifests(
    datasets: dict[str, tuple[str, pd.DataFrame]], data: DataConfig, cfg: ValidateConfig, report_dir: Path
) -> dict[str, Any]:
    """Run one GX checkpoint over ``{name: (kind, manifest)}`` (kind ``gfd_split``: a GFD split, not a manifest);
    write JSON + Data Docs into ``report_dir``.

    Returns ``{name: result_json}``; raises DataError naming the first failure (after writing reports).
    """
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    docs_dir = report_dir / "docs"
    ctx.add_data_docs_site(
        site_name="faceops",
        site_config={
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
        },
    )
    source = ctx.data_sources.add_pandas("faceops")
    definitions, frames = [], {}
    for name, (kind, manifest) in datasets.items():
        view = gfd_view(manifest) if kind == "gfd_split" else manifest_view(manifest)
        frames[name] = view
        batch = source.add_dataframe_asset(name=name).add_batch_definition_whole_dataframe("manifest")
        suite = ctx.suites.add(gx.ExpectationSuite(name=f"{name}_manifest"))
        exps = gfd_expectations(view, data, cfg) if kind == "gfd_split" else build_expectations(kind, view, data, cfg)
        for exp in exps:
            suite.add_expectation(exp)
        definitions.append(ctx.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite)))
    results: dict[str, Any] = {}
    failures: list[str] = []
    for vd in definitions:
        checkpoint = ctx.checkpoints.add(gx.Checkpoint(
            name=f"gate_{vd.name}", validation_definitions=[vd],
            actions=[gx.checkpoint.UpdateDataDocsAction(name="docs", site_names=["faceops"])],
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["row", "path"]},
        ))
        out = checkpoint.run(batch_parameters={"dataframe": frames[vd.name]})
        for vr in out.run_results.values():
            results[vd.name] = vr.to_json_dict()
            failures += [_describe_failure(vd.name, r) for r in vr.results if not r.success]
    for name, payload in results.items():
        write_json(report_dir / f"{name}.json", payload)
    write_text(report_dir / SUMMARY_NAME, summary_html(results, docs_pages=_docs_pages(docs_dir, results)))
    _link_summary_from_docs(docs_dir / "index.html")
    if failures:
        extra = f" ({len(failures) - 1} more failure(s) in {report_dir})" if len(failures) > 1 else ""
        raise DataError(failures[0] + extra)
    return results


def check_sets(datasets: dict[str, tuple[str, pd.DataFrame]], cfg: ValidateConfig, paths: Paths, reports: Path
               ) -> dict[str, float]:
    """The cross-set leakage check (``ml.data.leakage``) over the prepared sets: names everywhere, pixels in the
    sets that hold faces a model is trained or scored on by identity (train, heldout, templates, discovery).
    Writes ``leakage.json`` into ``reports``; a failure raises naming every finding."""
    from ml.data.leakage import check_leakage

    sets = {k: (paths.prepared / k, m) for k, (kind, m) in datasets.items() if kind != "gfd_split"}
    found = check_leakage(sets, hashed=("train", "heldout", "templates", "discovery"),
                          max_shared_fraction=cfg.max_shared_fraction)
    write_json(reports / "leakage.json", {"failures": found.failures, "notes": found.notes, **found.metrics})
    for note in found.notes:
        log.warning("leakage check: %s", note)
    if found.failures:
        raise DataError("the leakage check failed — the same person or image is where it must not be (reports/"
                        "validation-failed/leakage.json); remove or rename them in the source and rerun prepare:\n  "
                        + "\n  ".join(found.failures))
    return found.metrics


def run(data: DataConfig, cfg: ValidateConfig, paths: Paths, *, tracker: Any = None) -> StageResult:
    from ml.data.dataset import MANIFEST_COLUMNS, read_manifest
    from ml.discovery.split import read_gfd_split

    datasets: dict[str, tuple[str, pd.DataFrame]] = {}
    kinds = ("train", "heldout", "templates", "discovery", "videos", "unaligned") + (() if data.ingested else ("fusion",))
    for kind in kinds:
        directory = paths.prepared / kind
        manifest = read_manifest(directory / "manifest.parquet")
        extra = [str(c) for c in manifest.columns if c not in MANIFEST_COLUMNS]
        if extra:  # no expectation covers them, and a name like 'row' would collide with the gate's view
            raise DataError(f"{directory / 'manifest.parquet'}: unexpected column(s) "
                            f"{', '.join(repr(c) for c in extra)}; a prepared manifest has exactly "
                            f"{', '.join(MANIFEST_COLUMNS)}. Rebuild it with the prepare stage")
        datasets[kind] = (kind, manifest)
    datasets["gfd_split"] = ("gfd_split", read_gfd_split(paths.gfd_split))
    result = StageResult("validate")
    with atomic_path(paths.validation_reports) as tmp:
        tmp.mkdir(parents=True)
        try:
            results = validate_manifests(datasets, data, cfg, tmp)
            result.metrics.update(check_sets(datasets, cfg, paths, tmp))
        except DataError:
            # keep the evidence: reports of a failed gate still land, then the stage fails
            _publish_failed(tmp, paths.validation_reports)
            raise
    for name, payload in results.items():
        stats = payload["statistics"]
        result.metrics[f"validate/{name}/expectations"] = stats["evaluated_expectations"]
        result.metrics[f"validate/{name}/success_percent"] = stats["success_percent"] or 0.0
    result.outputs.append(paths.validation_reports)
    result.summary = (f"{len(results)} manifests passed the gate; summary (offline): "
                      f"{paths.validation_reports / SUMMARY_NAME}; Data Docs: {paths.validation_reports / 'docs' / 'index.html'}")
    return result


def _publish_failed(tmp: Path, target: Path) -> None:
    import shutil

    failed = target.with_name(target.name + "-failed")
    shutil.rmtree(failed, ignore_errors=True)
    shutil.copytree(tmp, failed)
    log.error("validation reports of the failed gate: %s", failed)


def main() -> None:
    from ops.tracking import stage_run

    paths = Paths()
    params = load_params(paths.params)
    data = from_mapping(DataConfig, section(params, "data"), "data")
    cfg = from_mapping(ValidateConfig, section(params, "validate"), "validate")
    with stage_run("validate", {"validate": section(params, "validate")}, paths.root) as tracker:
        try:
            result = run(data, cfg, paths, tracker=tracker)
        finally:
            failed = paths.validation_reports.with_name("validation-failed")
            for d in (paths.validation_reports, failed):
                if d.exists():
                    tracker.log_artifact(d, artifact_path=d.name)
        tracker.log_metrics(result.metrics)
        tracker.log_prepared_datasets(paths.prepared)
    log.info(result.summary)


if __name__ == "__main__":
    stage_main(main, "validate")
