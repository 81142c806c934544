"""What the browser tests share: Debian's chromium driven by Playwright (never `playwright
install`), and a page of the app opened and loaded as a visitor first sees it."""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
NEEDS_CHROMIUM = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (apt-get install -y chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="the playwright package is not installed"),
]


@contextmanager
def launched_browser() -> Iterator[Any]:
    """Debian's chromium under Playwright, closed on leaving."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def opened_page(url: str, width: int, height: int, bound_ms: int, browser: Any = None) -> Iterator[Any]:
    """The app at `url` in a fresh browser context (of `browser`, else of a browser of its own),
    once its opening recorded trace has loaded (the page opens on one: clicks and checks then act
    on a loaded session). bound_ms bounds every wait."""
    if browser is None:
        with launched_browser() as own:
            with opened_page(url, width, height, bound_ms, own) as pg:
                yield pg
        return
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        pg = context.new_page()
        pg.set_default_timeout(bound_ms)
        pg.goto(url)
        pg.wait_for_selector("#hv-tree .js-plotly-plot")
        pg.wait_for_function("() => document.querySelector('#hv-status')?.innerText.includes('recorded trace')")
        yield pg
    finally:
        context.close()
