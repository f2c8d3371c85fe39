"""The docs stay true: the site builds offline with ``--strict`` (every macro finds its figure in the committed
outputs, every link resolves), no measured figure is typed by hand in the README or a docs page unless the output
it cites holds it, and each method page keeps one shape (at most about 250 lines, the paper and the authors' code
linked, no recipe history, one Python snippet that runs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# a measured figure: a number with a unit of measurement, or a decimal with 3+ places (0.0466)
FIGURE = re.compile(
    r"(?<![\w.\-/])(?<![≤≥<>~] )(?<![≤≥<>~])[-+±]?\d[\d,]*(?:\.\d+)?"
    r"(?:\s?(?:%|pp\b|×(?!\s?\d)|ms\b|s\b|min\b|minutes\b|seconds\b|hours?\b|dB\b|[KMG]B\b|images/s|faces/s|/s\b))"
    r"|(?<![\w.])\d+\.\d{3,}\b")
CITED = re.compile(r"(?:metrics/[\w./-]+\.json|reports/[\w./-]+\.md|benchmarks/results\.md)")
PAPER = re.compile(r"\bpaper\b|\bTable \d|\bEq\. ?\d", re.I)


def _paragraphs(text: str) -> list[str]:
    """Paragraphs of a markdown page without its code blocks and macro calls."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}", "", text, flags=re.S)
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def hand_typed_figures(text: str, root: Path = ROOT) -> list[str]:
    """Figures in ``text`` that no committed output cited in the same paragraph holds (paper figures aside)."""
    found = []
    for paragraph in _paragraphs(text):
        cited = [root / c for c in CITED.findall(paragraph)]
        sources = "".join(p.read_text() for p in cited if p.is_file())
        prose = re.sub(r"`[^`\n]*`", "", paragraph)  # code spans: names, commands, keys
        for match in FIGURE.finditer(prose):
            if PAPER.search(paragraph):
                continue
            number = re.match(r"[-+±]?\d[\d,]*(?:\.\d+)?", match.group(0)).group(0).lstrip("+±")
            if not sources or number.replace(",", "") not in sources.replace(",", ""):
                found.append(f"{match.group(0)!r} in: {paragraph.strip()[:120]}")
    return found


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_figure_is_typed_by_hand():
    problems = {str(p.relative_to(ROOT)): f for p in _pages() if (f := hand_typed_figures(p.read_text()))}
    assert not problems, f"figures typed by hand (use a docs macro, or cite the output that holds them): {problems}"


def test_the_figure_check_finds_a_typed_figure(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "x.json").write_text('{"acc": 0.718}')
    assert hand_typed_figures("The model reaches 71.8 % on held-out faces.", tmp_path)
    assert hand_typed_figures("Box NME 0.0466 at the default.", tmp_path)
    assert not hand_typed_figures("It reaches 0.718 (`metrics/x.json`).", tmp_path)
    assert not hand_typed_figures("The paper reports +9 pp (Table 3).", tmp_path)
    assert not hand_typed_figures("It reaches {{ metric('x', 'acc') }} at 112×112, target ≤ 20 min.", tmp_path)


@pytest.mark.slow
def test_docs_build_offline_and_strict(docs_site):
    assert (docs_site / "methods" / "discovery" / "index.html").is_file()
    assert sorted(p.name for p in (docs_site / "plots").glob("*.png")), "no committed figure reached the site"


METHOD_PAGES = sorted((ROOT / "docs" / "methods").glob("*.md"))
MAX_METHOD_PAGE_LINES = 250  # what a reader takes in at one sitting
HISTORY = re.compile(r"\b(?:since then|the previous default|we tried|was tried|used to be)\b", re.I)


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page."""
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", METHOD_PAGES, ids=lambda p: p.stem)
def test_method_page_keeps_its_shape(page):
    text = page.read_text()
    lines = text.count("\n")
    assert lines <= MAX_METHOD_PAGE_LINES, f"{page.name}: {lines} lines (at most {MAX_METHOD_PAGE_LINES})"
    assert len(python_blocks(text)) == 1, f"{page.name}: one runnable ```python block, not {len(python_blocks(text))}"
    assert "https://arxiv.org/" in text or "openreview.net" in text, f"{page.name}: no link to the paper"
    assert "https://github.com/" in text, f"{page.name}: no link to the authors' code"
    history = [m.group(0) for m in HISTORY.finditer(text)]
    assert not history, f"{page.name}: recipe history belongs in CHANGELOG.md, found {history}"


def test_the_shape_check_finds_a_second_block_and_history():
    assert len(python_blocks("```python\na = 1\n```\n\n```python\nb = 2\n```\n")) == 2
    assert HISTORY.search("Since then the default changed.")


@pytest.mark.slow
@pytest.mark.parametrize("page", METHOD_PAGES, ids=lambda p: p.stem)
def test_method_page_snippet_runs(page, tmp_path):
    """Each method page's snippet runs as a reader would paste it: from the repository root of a checkout that has
    not run the pipeline, on one thread."""
    (block,) = python_blocks(page.read_text())
    out = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"{page.name}'s snippet failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{page.name}'s snippet prints nothing"
