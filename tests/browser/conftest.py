"""Headless Chromium for tests that drive a UI as a user would (the MLflow run page, Data Docs).

``browser`` (session) is a Playwright ``Browser`` on the system's Chromium; ``page`` (per test) is a fresh page in a
fresh context, closed after the test. Chromium comes from the OS, never from Playwright's download: ``make test``
installs Debian's ``chromium`` with apt-get where it is missing, and ``FACEOPS_CHROMIUM`` names another binary. With
no Chromium, or without the ``playwright`` package, every browser test is skipped saying which is missing.

The flags keep Chromium off the network it would otherwise try on start-up (on a machine without one it hangs
there). Playwright gives each launch a fresh, temporary profile directory (its ``--user-data-dir``), removed on close.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LAUNCH_TIMEOUT_MS = 60_000


def chromium_path() -> str | None:
    """``FACEOPS_CHROMIUM`` if set, else ``/usr/bin/chromium``, else a ``chromium``/``chromium-browser`` on PATH."""
    named = os.environ.get("FACEOPS_CHROMIUM")
    if named:
        return named if Path(named).is_file() else None
    if Path("/usr/bin/chromium").is_file():
        return "/usr/bin/chromium"
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    """One Chromium for the browser tests, closed once they are done: while Playwright's sync API is open its
    event loop counts as the thread's running loop, and Prefect's sync calls in later tests would return
    coroutines."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="browser tests need playwright (pip install -e '.[test]')")
    executable = chromium_path()
    if executable is None:
        where = os.environ.get("FACEOPS_CHROMIUM") or "/usr/bin/chromium or PATH"
        pytest.skip(f"browser tests need Chromium, none found at {where} "
                    f"(`apt-get install -y chromium`, or set FACEOPS_CHROMIUM)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS,
                                     timeout=LAUNCH_TIMEOUT_MS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def offline(page):
    """``page`` with every request that is not ``file://`` aborted; yields (page, the aborted URLs)."""
    refused: list[str] = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    page.route("**/*", route)
    return page, refused
