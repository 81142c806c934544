"""axe-core on the real page in headless Debian chromium: no serious or critical violation on
any tab at a desktop (1440x900), a projector (1280x720) and a phone (390x844). The page is loaded
once (module fixture), resized to each screen in turn (the layout follows the width as on a fresh
load) and each tab is checked after it is shown, because axe only judges what is rendered and visible.

axe-core comes from npm into .cache/npm (scripts/setup.sh --test, which pins AXE_VERSION); without
it the test skips, and another version fails (its rules differ)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.browser import NEEDS_CHROMIUM, opened_page

ROOT = Path(__file__).resolve().parent.parent
AXE_VERSION = "4.14.1"          # the one scripts/setup.sh installs
AXE_DIR = ROOT / ".cache" / "npm" / "node_modules" / "axe-core"
AXE_JS = AXE_DIR / "axe.min.js"
ARTIFACTS = ROOT / "test-artifacts"
BOUND_MS = 120_000
TABS = ("Visualizer", "Profile", "What-if", "Analyse", "How it works")
SCREENS = ((1440, 900), (1280, 720), (390, 844))
BLOCKING_IMPACTS = ("serious", "critical")
# Rules below serious impact the page passes too, at any impact
NAMED_RULES = ("heading-order", "page-has-heading-one", "empty-table-header", "image-redundant-alt")

# Known defects still to fix, each as (tab, axe rule id, CSS selector of the one element).
# Not a tolerance: a violation passes only if its element matches its entry's selector, so each
# entry covers one element; remove an entry once its element is fixed and the test guards it.
KNOWN_VIOLATIONS: tuple[tuple[str, str, str], ...] = ()

pytestmark = [
    *NEEDS_CHROMIUM,
    pytest.mark.skipif(not AXE_JS.exists(), reason=f"axe-core is not installed at {AXE_JS} (bash scripts/setup.sh --test)"),
]


@pytest.fixture(scope="module")
def app_url():
    from hierviz.app.check import start_app
    url, demo = start_app("tiny-random")
    yield url
    demo.close()


@pytest.fixture(scope="module")
def page(app_url):
    installed = json.loads((AXE_DIR / "package.json").read_text(encoding="utf-8"))["version"]
    assert installed == AXE_VERSION, f"axe-core {installed} is installed, the suite pins {AXE_VERSION}: bash scripts/setup.sh --test"
    with opened_page(app_url, *SCREENS[0], BOUND_MS) as pg:
        pg.add_script_tag(path=str(AXE_JS))
        assert pg.evaluate("axe.version") == AXE_VERSION
        yield pg


def show_tab(pg, title: str) -> None:
    """Select a tab; on a phone the tabs that do not fit are behind the "More tabs" menu."""
    tab = pg.get_by_role("tab", name=title, exact=True)
    if tab.count() and tab.is_visible():
        tab.click()
    else:
        pg.click('button[aria-label="More tabs"]')
        pg.locator(".overflow-dropdown button", has_text=title).click()
    pg.wait_for_function("(t) => [...document.querySelectorAll('[role=tab]')].some("
                         "e => e.innerText.trim() === t && e.getAttribute('aria-selected') === 'true')", arg=title)


# Runs axe and returns, per violating node of any impact: rule id, impact, target, summary, and the
# selectors of the allow-list entries (passed in) for that rule which the node's element matches.
AXE_SCRIPT = """async (known) => {
  const results = await axe.run(document, {resultTypes: ['violations']});
  return results.violations.flatMap(rule => rule.nodes.map(node => {
    const element = typeof node.target[0] === 'string' ? document.querySelector(node.target[0]) : null;
    const matches = known.filter(([ruleId, selector]) => ruleId === rule.id && element?.matches(selector));
    return {rule: rule.id, impact: node.impact, target: JSON.stringify(node.target),
            summary: (node.failureSummary || '').replace(/\\s+/g, ' ').slice(0, 300),
            known: matches.map(([, selector]) => selector)};
  }));
}"""


def violations(pg, tab: str) -> list[dict]:
    """Every node axe reports on the page, each marked known or not."""
    known = [[rule, selector] for t, rule, selector in KNOWN_VIOLATIONS if t == tab]
    return pg.evaluate(AXE_SCRIPT, known)


def screen_name(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


@pytest.fixture(scope="module")
def violations_by_view(page) -> dict[tuple[str, str], list[dict]]:
    """axe's findings on each tab at each screen size, collected once for every test here."""
    found = {}
    ARTIFACTS.mkdir(exist_ok=True)
    for size in SCREENS:
        page.set_viewport_size({"width": size[0], "height": size[1]})
        # the layout follows the width (the presentation layout from 1200 px) as on a fresh load
        page.wait_for_function("(on) => document.body.classList.contains('hv-present') === on", arg=size[0] >= 1200)
        for tab in TABS:
            show_tab(page, tab)
            found[(screen_name(size), tab)] = violations(page, tab)
            if tab == TABS[0]:
                page.screenshot(path=str(ARTIFACTS / f"accessibility-visualizer-{screen_name(size)}.png"))
    page.set_viewport_size({"width": SCREENS[0][0], "height": SCREENS[0][1]})
    return found


@pytest.mark.parametrize("size", [screen_name(s) for s in SCREENS])
@pytest.mark.parametrize("tab", TABS)
def test_no_serious_axe_violations(violations_by_view, tab, size):
    unexpected = [v for v in violations_by_view[(size, tab)] if v["impact"] in BLOCKING_IMPACTS and not v["known"]]
    assert not unexpected, "\n".join(f'{v["rule"]} {v["target"]}: {v["summary"]}' for v in unexpected)


def test_named_lesser_findings_are_gone(violations_by_view):
    """Heading order, an h1 at every size, no empty header cell, no icon named like its word: at
    any impact, on every tab and screen."""
    found = [(view, v["rule"], v["target"]) for view, vs in violations_by_view.items() for v in vs
             if v["rule"] in NAMED_RULES]
    assert not found, found


def test_known_violations_are_still_there(violations_by_view):
    """An allow-list entry whose defect is fixed must go, or it would hide a regression."""
    seen = {(tab, v["rule"], selector) for (_, tab), found in violations_by_view.items()
            for v in found for selector in v["known"]}
    stale = [entry for entry in KNOWN_VIOLATIONS if entry not in seen]
    assert not stale, f"fixed, remove from KNOWN_VIOLATIONS: {stale}"


# A keyboard user must see where focus is: the step slider, a run radio, a button.
FOCUSABLE_CONTROLS = ("#hv-step input[type=range]", "#hv-view input[type=radio]", "#hv-run")


def focus_ring(pg, selector: str) -> dict:
    """The outline the browser draws around `selector` (or around the label of a radio) once it
    has keyboard focus."""
    pg.keyboard.press("Shift")   # last input from the keyboard: focus then matches :focus-visible
    pg.focus(selector)
    return pg.evaluate("""(sel) => {
      const el = document.querySelector(sel);
      const drawn = el.type === 'radio' ? el.closest('label') : el;
      const style = getComputedStyle(drawn);
      return {visible: el.matches(':focus-visible'), style: style.outlineStyle, width: parseFloat(style.outlineWidth)};
    }""", selector)


@pytest.mark.parametrize("selector", FOCUSABLE_CONTROLS)
def test_keyboard_focus_is_visible(page, violations_by_view, selector):   # after axe: focus moves here
    show_tab(page, "Visualizer")
    ring = focus_ring(page, selector)
    assert ring["visible"] and ring["style"] != "none" and ring["width"] >= 2, ring
