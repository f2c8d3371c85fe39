"""The documentation site as a reader opens it, from disk with every network request refused: the formulas are drawn
(MathML from the build, no TeX source left on the page) and every figure loads.

The site is the run's one strict build (``docs_site`` in ``tests/conftest.py``), with the repository's committed
figures. What counts as a failure is checked on planted pages first: a raw ``\\(…\\)`` span and a broken image are
found, so the checks can fail."""

from __future__ import annotations

import pytest

PAGES = ["", "methods/recognition", "methods/aligner", "methods/generator", "methods/fusion",
         "methods/discovery", "results", "real-data"]

# what TeX looks like to a reader when no renderer ran: delimiters and the commands the pages use most
RAW_TEX = r"""(() => {
  const walker = document.createTreeWalker(document.querySelector('article') || document.body,
                                           NodeFilter.SHOW_TEXT);
  const found = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest('pre, code, script, style')) continue;
    // inside MathML only a command the converter copied through as text (\foo) is TeX left to the reader
    const pattern = n.parentElement.closest('math') ? /\\[A-Za-z]+/
      : /\\\(|\\\)|\\\[|\\\]|\$\$|\\(frac|sum|mathbf|operatorname|lVert|cdot|top)\b/;
    const m = n.textContent.match(pattern);
    if (m) found.push(n.textContent.trim().slice(0, 80));
  }
  return found;
})()"""

BROKEN_IMAGES = """Array.from(document.images)
  .filter(img => !(img.complete && img.naturalWidth > 0))
  .map(img => img.getAttribute('src'))"""

DRAWN_MATH = """Array.from(document.querySelectorAll('math'))
  .filter(m => m.getBoundingClientRect().width > 0).length"""


def _problems(page, url: str) -> tuple[list[str], list[str], int]:
    page.goto(url)
    page.wait_for_load_state("load")
    return page.evaluate(RAW_TEX), page.evaluate(BROKEN_IMAGES), page.evaluate(DRAWN_MATH)


def test_the_checks_find_raw_tex_and_a_broken_image(offline, tmp_path):
    page, _ = offline
    (tmp_path / "ok.png").write_bytes(_png())
    planted = tmp_path / "planted.html"
    planted.write_text('<article><p>Loss <span class="arithmatex">\\(\\frac{a}{b}\\)</span></p>'
                       '<p><code>\\(kept in code\\)</code></p><img src="ok.png"><img src="missing.png">'
                       '<math><mi>x</mi></math><math><mi>\\foo</mi></math></article>')
    raw, broken, drawn = _problems(page, planted.as_uri())
    assert raw == ["\\(\\frac{a}{b}\\)", "\\foo"]
    assert broken == ["missing.png"]
    assert drawn == 2


@pytest.mark.slow
def test_every_page_shows_formulas_and_figures_offline(offline, docs_site):
    """Every page the build wrote (the API reference and the changelog included), not only the method pages."""
    page, refused = offline
    built = sorted(p.parent.relative_to(docs_site).as_posix() for p in docs_site.rglob("index.html"))
    assert set(PAGES) <= {"" if b == "." else b for b in built}, built
    problems = {}
    for name in built:
        raw, broken, _ = _problems(page, (docs_site / name / "index.html").as_uri())
        if raw or broken:
            problems[name] = {"raw TeX": raw[:3], "broken images": broken}
    assert not problems, f"pages that show TeX source or broken images: {problems}"
    assert refused == [], f"the site asked the network for {sorted(set(refused))[:5]}"


@pytest.mark.slow
def test_method_pages_hold_drawn_formulas_and_figures(offline, docs_site):
    page, _ = offline
    for name in [p for p in PAGES if p.startswith("methods/")]:
        _, _, drawn = _problems(page, (docs_site / name / "index.html").as_uri())
        assert drawn > 0, f"{name}: no formula drawn"
        assert page.locator("article img").count() > 0, f"{name}: no figure on the page"


def _png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()
