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
def opened_page(url: str, width: int, height: int, bound_ms: int) -> Iterator[Any]:
    """The app at `url` in a new browser, once its opening recorded trace has loaded (the page
    opens on one: clicks and checks then act on a loaded session). bound_ms bounds every wait."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": width, "height": height})
        pg.set_default_timeout(bound_ms)
        pg.goto(url)
        pg.wait_for_selector("#hv-tree .js-plotly-plot")
        pg.wait_for_function("() => document.querySelector('#hv-status')?.innerText.includes('recorded trace')")
        try:
            yield pg
        finally:
            browser.close()
