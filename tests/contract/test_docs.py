"""The docs stay true: the site builds offline with ``--strict`` (every macro finds its figure in the committed
outputs, every link resolves), and no measured figure is typed by hand in the README or a docs page unless the
output it cites holds it."""

from __future__ import annotations

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
def test_docs_build_offline_and_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "methods" / "discovery" / "index.html").is_file()
