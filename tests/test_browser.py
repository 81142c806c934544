"""The real page in headless Debian chromium: run a prompt on the tiny-random stack, wait for the
final state, check that every panel rendered, upload a malformed trace and see the error.
Screenshots go to test-artifacts/ (gitignored) for a human to look at."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (apt-get install -y chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="the playwright package is not installed"),
]


@pytest.fixture(scope="module")
def app_url():
    from hierviz.app.check import free_port
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", HIERVIZ_STACK="tiny-random")
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "browser-app.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                pytest.fail(f"app.py exited early; see {ARTIFACTS / 'browser-app.log'}")
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("app.py did not start within 120 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture()
def page(app_url):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1600, "height": 1000})
        pg.set_default_timeout(60_000)
        pg.goto(app_url)
        pg.wait_for_selector("#hv-tree .js-plotly-plot")
        # the page opens on a recorded trace (demo.load); wait for it so clicks act on a loaded session
        pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('recorded trace')")
        yield pg
        browser.close()


def status_text(pg) -> str:
    return pg.inner_text("#hv-status")


def test_run_a_prompt_and_see_every_panel(page):
    pg = page
    # the page opens on a recorded trace, so a projector never shows empty panels
    assert "recorded trace" in status_text(pg)
    pg.fill("#hv-prompt textarea", "Hello, speculative world")
    pg.locator("#hv-settings button").first.click()
    box = pg.locator("#hv-max-new input[type=number]")
    box.fill("8")
    box.press("Enter")
    # small trees keep the CPU run short; the panels are the same
    for elem, value in (("hv-m-topk", "4"), ("hv-m-size", "8"), ("hv-t-depth", "3"), ("hv-t-topk", "4"),
                        ("hv-t-size", "12")):
        pg.fill(f"#{elem} input", value)
    pg.click("#hv-run")
    pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('Done.')", timeout=180_000)
    time.sleep(1.0)   # let plotly finish drawing the last update
    assert "HierSpec" in status_text(pg) and "EAGLE-2" in status_text(pg)
    # the page reported drawing each update and the run waited for it (render pacing: local page)
    assert "paused while this page drew" in status_text(pg)
    # tree: plotly drew node chips; sequence and verdict: token chips; latency: bars
    assert pg.locator("#hv-tree .annotation").count() > 3
    assert pg.locator("#hv-seq .hv-chip").count() >= 1
    assert pg.locator("#hv-verdict .hv-chip").count() >= 2
    assert pg.locator("#hv-latency .barlayer .point").count() >= 4
    assert "tokens / s" in pg.inner_text("#hv-stats")
    assert "Traceback" not in pg.content()
    pg.screenshot(path=str(ARTIFACTS / "browser-run.png"), full_page=True)

    # scrub to step 2 with the keyboard: every panel follows
    handle = pg.locator("#hv-step input[type=range]")
    handle.focus()
    pg.keyboard.press("Home")
    pg.keyboard.press("ArrowRight")
    pg.wait_for_function("() => document.querySelector('#hv-tree').innerText.includes('Step 2:')", timeout=30_000)


def test_malformed_trace_upload_shows_an_error(page, tmp_path):
    pg = page
    bad = tmp_path / "broken-trace.json"
    bad.write_text('{"version": 1, "meta": {"method": "hierspec"}, "steps": [{"index": "zero"}]}')
    pg.set_input_files("#hv-upload input[type=file]", str(bad))
    pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('Could not read')",
                         timeout=30_000)
    msg = status_text(pg)
    assert "broken-trace.json" in msg and "steps[0]" in msg
    assert "Traceback" not in pg.content()
    pg.screenshot(path=str(ARTIFACTS / "browser-bad-upload.png"), full_page=False)
    # the app stays usable: a recorded trace still loads
    pg.click("text=Load recorded trace")
    pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('Loaded')", timeout=30_000)


def test_replay_and_switch_run(page):
    pg = page
    pg.click("#hv-play")
    pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('Replaying HierSpec: step')",
                         timeout=30_000)
    pg.click("text=■ Stop replay")
    pg.wait_for_function("() => document.querySelector('#hv-status').innerText.includes('Replay stopped')",
                         timeout=30_000)
    pg.locator("#hv-view").get_by_text("EAGLE-2").click()
    pg.wait_for_function("() => document.querySelector('#hv-tree').innerText.includes('EAGLE-2 tree drafted by E_T')",
                         timeout=30_000)
    assert "has no sequence draft" in pg.inner_text("#hv-seq")
    pg.screenshot(path=str(ARTIFACTS / "browser-eagle2-view.png"), full_page=False)


def test_whatif_tab_renders_a_plot(page):
    pg = page
    pg.get_by_role("tab", name="What-if").click()
    pg.wait_for_selector("#hv-whatif-run")
    from hierviz.app.whatif_tab import recorded_results
    if recorded_results():      # shipped results open with the tab
        pg.wait_for_selector("#hv-whatif-a .js-plotly-plot")
        assert "projected with replayed acceptance" in pg.inner_text("#hv-whatif-a")
    else:
        assert "No recorded what-if results" in pg.inner_text("#hv-whatif-table")
    box = pg.locator("#hv-whatif-max-new input[type=number]")
    box.fill("8")
    box.press("Enter")
    pg.click("#hv-whatif-run")
    pg.wait_for_function("() => document.querySelector('#hv-whatif-status').innerText.includes('Done')",
                         timeout=120_000)
    pg.wait_for_selector("#hv-whatif-live-a .js-plotly-plot")
    time.sleep(1.0)   # let plotly finish drawing
    assert "projected with replayed acceptance" in pg.inner_text("#hv-whatif-live-a")
    assert pg.locator("#hv-whatif-live-a .barlayer .point").count() == 3
    assert pg.locator("#hv-whatif-live-b .barlayer .point").count() >= 6
    assert "HierSpec" in pg.inner_text("#hv-whatif-live-table")
    assert "Traceback" not in pg.content()
    pg.screenshot(path=str(ARTIFACTS / "browser-whatif.png"), full_page=True)
    # a bad rate is a message, not a traceback
    pg.fill("#hv-whatif-rates textarea", "0.9, lots")
    pg.click("#hv-whatif-run")
    pg.wait_for_function("() => document.querySelector('#hv-whatif-status').innerText.includes('comma-separated')",
                         timeout=30_000)
    assert "Traceback" not in pg.content()
