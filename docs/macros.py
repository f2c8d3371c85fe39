"""The docs' figures, read from the committed outputs when the site is built (mkdocs-macros), never typed by hand.

In a page: ``{{ metric("evaluate", "real/verification/procedural/accuracy", ".1%") }}`` (``metrics/evaluate.json``),
``{{ tar("sets", "sets/templates/caface", "1e-4") }}`` (a TAR cell, marked when few false accepts set it),
``{{ bench("make_run", "minutes") }}`` (``benchmarks/results.json``), ``{{ bench_when("make_run") }}``,
``{{ param("fr.epochs") }}`` (``params.yaml``), ``{{ report("claims.md", "## Verdicts") }}`` (a generated report,
whole or one section), ``{{ include("CHANGELOG.md") }}`` and ``{{ figure("plots/roc.png", "ROC") }}`` (a figure the
run drew and git tracks, shown on the page; ``docs/hooks.py`` puts it on the site; with ``FACEOPS_DOCS_DRAFT=1`` a
figure not drawn yet is a placeholder, for drafting a page). A key that is not there fails the build (``mkdocs build --strict``), so a page cannot cite a
number its outputs no longer hold.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def _fmt(value: Any, fmt: str | None) -> str:
    if fmt is None:
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    return format(value, fmt)


def metric(file: str, key: str, fmt: str | None = None) -> str:
    """``key`` of ``metrics/<file>.json`` (nested keys joined with ``/``; a file's ``metrics`` mapping is searched
    too), formatted with ``fmt`` (e.g. ``".1%"``, ``".3f"``)."""
    doc = json.loads((ROOT / "metrics" / f"{file}.json").read_text())
    flat = {**_flat(doc), **_flat(doc.get("metrics", {}) if isinstance(doc, dict) else {})}
    if key not in flat:
        raise KeyError(f"metrics/{file}.json has no {key!r}")
    return _fmt(flat[key], fmt)


def tar(file: str, prefix: str, far: str, impostors: str = "n_impostor") -> str:
    """TAR at ``far`` (``<prefix>/tar@far=<far>`` of ``metrics/<file>.json``, as a percentage) marked as the
    benchmark report marks it (``tasks.evaluate.cells.few_false_accepts``) when fewer than ten false accepts
    (``far`` × ``<prefix>/<impostors>``) set its threshold."""
    from tasks.evaluate.cells import few_false_accepts

    cell = metric(file, f"{prefix}/tar@far={far}", ".1%")
    return few_false_accepts(cell, far, float(metric(file, f"{prefix}/{impostors}")))


def _bench(name: str) -> dict[str, Any]:
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    if name not in results:
        raise KeyError(f"benchmarks/results.json has no row {name!r}: run `python -m benchmarks {name}`")
    return results[name]


def bench(name: str, key: str, fmt: str | None = None) -> str:
    """Value ``key`` of benchmark row ``name`` (``benchmarks/results.json``)."""
    values = _bench(name)["values"]
    if key not in values:
        raise KeyError(f"benchmark {name!r} has no value {key!r}")
    return _fmt(values[key], fmt)


def bench_when(name: str) -> str:
    """When and on what machine benchmark row ``name`` was measured."""
    row = _bench(name)
    return f"{row['when']}, {row['machine']}"


def param(key: str) -> str:
    """The value of dotted ``key`` in ``params.yaml``."""
    node: Any = yaml.safe_load((ROOT / "params.yaml").read_text())
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"params.yaml has no {key!r}")
        node = node[part]
    return json.dumps(node) if isinstance(node, (list, dict)) else str(node)


def report(path: str, heading: str | None = None, page: Any = None) -> str:
    """``reports/<path>`` (a generated report), whole or the section under ``heading`` (e.g. ``"## Verdicts"``) up to
    the next heading of its level or above; the report's own title line is dropped."""
    text = _local_links((ROOT / "reports" / path).read_text(), page)
    if heading is None:
        return re.sub(r"\A# [^\n]*\n", "", text)
    level = len(heading) - len(heading.lstrip("#"))
    match = re.search(rf"^{re.escape(heading)}\s*$", text, flags=re.M)
    if match is None:
        raise KeyError(f"reports/{path} has no heading {heading!r}")
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[: end.start() if end else len(rest)].strip() + "\n"


def include(path: str) -> str:
    """A file of the repository (``CHANGELOG.md``), without its title line."""
    return re.sub(r"\A# [^\n]*\n", "", (ROOT / path).read_text())


@functools.lru_cache(maxsize=1)
def site_figures() -> tuple[str, ...]:
    """The figures the site shows: every committed ``plots/*.png`` (git-tracked, ``cache: false`` in ``dvc.yaml``),
    repository-relative; listed once per build."""
    try:
        listed = subprocess.run(["git", "ls-files", "plots/*.png"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked release): what is on disk
        listed = [p.relative_to(ROOT).as_posix() for p in (ROOT / "plots").glob("*.png")]
    return tuple(sorted(listed))


def _to_root(page: Any) -> str:
    """The relative path from ``page``'s source file to the docs root (``"../"`` for ``methods/fusion.md``)."""
    depth = page.file.src_uri.count("/") if page is not None else 0
    return "../" * depth


def figure(path: str, caption: str, page: Any = None) -> str:
    """``path`` (``plots/roc.png``) as an image captioned ``caption``; a figure the repository does not hold fails the
    build, naming the stage that draws it."""
    if path not in site_figures():
        if os.environ.get("FACEOPS_DOCS_DRAFT"):  # drafting a page before the run has drawn its figures
            return f"*[figure {path}: not drawn yet]*"
        raise KeyError(f"{path} is not a committed figure: `make run` draws it; commit it (its `dvc.yaml` out has "
                       f"`cache: false`)")
    return f"![{caption}]({_to_root(page)}{path})"


def _local_links(text: str, page: Any = None) -> str:
    """A report's links to repository files: a committed figure (``![roc](../plots/roc.png)``) stays an image, with
    a path from the page; any other file (a DVC output outside the site) becomes its path in code,
    ``roc (`plots/roc.png`)``; web links are kept."""
    def repl(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+://", target):
            return m.group(0)
        path = re.sub(r"^(\.\./)+", "", target)
        if m.group(0).startswith("!") and path in site_figures():
            return f"![{label}]({_to_root(page)}{path})"
        return f"{label} (`{path}`)" if label else f"`{path}`"
    return re.sub(r"!?\[([^\]]*)\]\(([^)\s]+)\)", repl, text)


def define_env(env: Any) -> None:
    for fn in (metric, tar, bench, bench_when, param, include):
        env.macro(fn)
    env.macro(lambda path, heading=None: report(path, heading, env.page), "report")
    env.macro(lambda path, caption: figure(path, caption, env.page), "figure")
