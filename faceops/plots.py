"""``faceops plots``: DVC's plots page rendered without a network.

``dvc plots show`` writes an HTML page whose Vega, Vega-Lite and Vega-Embed come from a CDN, so on an air-gapped
machine (or a cluster node without outbound access) it is blank. DVC takes a page template (``--html-template``,
where ``{plot_divs}`` goes the plots and ``{scripts}`` the CDN tags): this one has no ``{scripts}`` and carries the
three libraries inline instead, bundled by ``vl-convert`` (``vl_convert.javascript_bundle``: they become the globals
``vega``, ``vegaLite`` and ``vegaEmbed`` that DVC's plot divs call). Every plot ``dvc.yaml`` declares is drawn: the
stages' history curves, the top-level val curves and the PNG figures.

The template is written to ``.dvc/plots-offline.html`` (git-ignored: it is built from the installed package, not
committed) by ``make setup`` (``python -m faceops.plots``) and by ``faceops plots``; the repository's
``.dvc/config`` names it as ``plots.html_template``, so plain ``dvc plots show`` draws offline too.
"""

from __future__ import annotations

import subprocess
import webbrowser
from pathlib import Path
from typing import Annotated

import typer

from faceops.console import fail, repo_root
from ml.atomic import atomic_path

TEMPLATE = """<!DOCTYPE html>
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>faceops plots</title>
    <script type="text/javascript">{bundle}</script>
    <style>
        body {{ font-family: sans-serif; }}
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def offline_template() -> str:
    """A DVC plots page template with Vega, Vega-Lite and Vega-Embed inline (no ``{scripts}``: no CDN tags)."""
    import vl_convert

    bundle = vl_convert.javascript_bundle()
    if "</script" in bundle:  # would end the inline script early
        bundle = bundle.replace("</script", "<\\/script")
    return TEMPLATE.format(bundle=bundle)


TEMPLATE_FILE = "plots-offline.html"  # in .dvc/, where .dvc/config's plots.html_template points


def write_template(root: Path) -> Path:
    """Write the offline template to ``<root>/.dvc/plots-offline.html`` (unless it is there with the same text)."""
    template, text = Path(root) / ".dvc" / TEMPLATE_FILE, offline_template()
    if not (template.is_file() and template.read_text(encoding="utf-8") == text):
        template.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(template) as temporary:
            temporary.write_text(text, encoding="utf-8")
    return template


def render(root: Path, out: Path) -> Path:
    """``dvc plots show`` into ``out`` with the offline template (written first) → the page's path. A failure of DVC
    raises ``RuntimeError`` with its message."""
    template = write_template(root)
    done = subprocess.run(["dvc", "plots", "show", "--html-template", str(template), "-o", str(out)], cwd=root,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError((done.stderr or done.stdout).strip() or f"dvc plots show exited {done.returncode}")
    return out / "index.html"


def plots_cmd(
    out: Annotated[Path, typer.Option(help="folder for the page (DVC's default)")] = Path("dvc_plots"),
    open_page: Annotated[bool, typer.Option("--open", help="open the page in a browser when written")] = False,
) -> None:
    """Render every plot dvc.yaml declares into one HTML page that needs no network.

    Same as `dvc plots show`, with Vega bundled into the page instead of loaded from a CDN: the training and val
    curves of each trainer (`plots/*_history.csv`) and the figures (`plots/*.png`). Run it after `make run` (or any
    stage); open dvc_plots/index.html.
    """
    root = repo_root("faceops plots")
    try:
        page = render(root, out if out.is_absolute() else root / out)
    except RuntimeError as exc:
        fail(f"dvc plots show failed: {exc}", code=1)
    typer.echo(f"wrote {page} (offline: Vega is in the page)")
    if open_page:
        webbrowser.open(page.as_uri())


if __name__ == "__main__":  # `make setup`: the template `dvc plots show` reads, from the installed vl-convert
    print(f"wrote {write_template(Path.cwd())}")
