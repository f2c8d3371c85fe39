"""The site's build hooks (mkdocs ``hooks:``): formulas rendered to MathML when the site is built, and the run's
committed figures put on the site, so that every page reads offline with nothing loaded from a CDN.

``pymdownx.arithmatex`` (generic mode) finds the TeX, skipping code, and wraps it as
``<span class="arithmatex">\\(…\\)</span>`` or ``<div class="arithmatex">\\[…\\]</div>``; :func:`on_page_content`
turns each into MathML with ``latex2mathml``, which every current browser draws natively. A formula it cannot convert
fails the build, naming the page and the TeX.

:func:`on_files` adds each committed ``plots/*.png`` (``docs/macros.py``: ``site_figures``) at ``plots/`` in the
site, where the ``figure`` macro's links point.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

from latex2mathml.converter import convert
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
from macros import ROOT, site_figures  # noqa: E402  (docs/ is not a package)

_MATH = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
_DELIMS = {"span": (r"\(", r"\)"), "div": (r"\[", r"\]")}


# commands latex2mathml lacks, as TeX it knows that reads the same
_SAME = {r"\arg": r"\operatorname{arg}", r"\lVert": r"\|", r"\rVert": r"\|"}
_LEFTOVER = re.compile(r">(\\[A-Za-z]+|&amp;|&)<")  # a command latex2mathml copied through as text; a stray &


def tex_to_mathml(tex: str, display: bool) -> str:
    """One formula's TeX (without delimiters) as a ``<math>`` element, ``display="block"`` for a display formula.
    latex2mathml copies a command it does not know into the output as text (``<mi>\\foo</mi>``), which a reader
    would see as TeX: that is a ``ValueError`` naming the command."""
    for command, same in _SAME.items():
        tex = re.sub(re.escape(command) + r"(?![A-Za-z])", lambda _: same, tex)
    out = convert(tex.strip(), display="block" if display else "inline")
    left = _LEFTOVER.search(out)
    if left:
        raise ValueError(f"latex2mathml does not know {html.unescape(left.group(1))!r}")
    return out


def render_math(content: str, where: str = "page") -> str:
    """``content`` (a page's HTML) with every arithmatex span and div replaced by MathML."""
    def repl(m: re.Match) -> str:
        tag, body = m.group(1), html.unescape(m.group(2)).strip()
        start, end = _DELIMS[tag]
        if not (body.startswith(start) and body.endswith(end)):
            raise ValueError(f"{where}: arithmatex output {body[:60]!r} is not delimited by {start} … {end}")
        tex = body[len(start):-len(end)]
        try:
            return tex_to_mathml(tex, display=tag == "div")
        except Exception as exc:  # latex2mathml raises its own exception types for TeX it cannot parse
            raise ValueError(f"{where}: the formula {tex.strip()[:80]!r} does not convert to MathML ({exc!r}); "
                             f"write it with commands latex2mathml knows") from exc
    return _MATH.sub(repl, content)


def on_page_content(html_text: str, page: Any, **_: Any) -> str:
    return render_math(html_text, page.file.src_uri)


def on_files(files: Any, config: Any, **_: Any) -> Any:
    for path in site_figures():
        files.append(File(path, src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
