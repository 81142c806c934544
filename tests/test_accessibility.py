"""axe-core on the real page in headless Debian chromium: no serious or critical violation on
any tab. The page is loaded once (module fixture) and each tab is checked after it is shown,
because axe only judges what is rendered and visible.

axe-core comes from npm into .cache/npm (scripts/setup.sh --test); without it the test skips."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import NEEDS_CHROMIUM, opened_page

ROOT = Path(__file__).resolve().parent.parent
AXE_JS = ROOT / ".cache" / "npm" / "node_modules" / "axe-core" / "axe.min.js"
ARTIFACTS = ROOT / "test-artifacts"
BOUND_MS = 120_000
TABS = ("Visualizer", "Profile", "What-if", "Analyse", "How it works")
BLOCKING_IMPACTS = ("serious", "critical")

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
    with opened_page(app_url, 1440, 900, BOUND_MS) as pg:
        pg.add_script_tag(path=str(AXE_JS))
        yield pg


def show_tab(pg, title: str) -> None:
    pg.get_by_role("tab", name=title, exact=True).click()
    pg.wait_for_function("(t) => [...document.querySelectorAll('[role=tab]')].some("
                         "e => e.innerText.trim() === t && e.getAttribute('aria-selected') === 'true')", arg=title)


# Runs axe and returns, per violating node: rule id, impact, target, summary, and the selectors of
# the allow-list entries (passed in) for that rule which the node's element matches.
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


def blocking_violations(pg, tab: str) -> list[dict]:
    """Every serious or critical node axe reports on the page, each marked known or not."""
    known = [[rule, selector] for t, rule, selector in KNOWN_VIOLATIONS if t == tab]
    return [v for v in pg.evaluate(AXE_SCRIPT, known) if v["impact"] in BLOCKING_IMPACTS]


@pytest.fixture(scope="module")
def violations_by_tab(page) -> dict[str, list[dict]]:
    """axe's serious and critical findings on each tab, collected once for every test here."""
    found = {}
    for tab in TABS:
        show_tab(page, tab)
        found[tab] = blocking_violations(page, tab)
        if tab == TABS[0]:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "accessibility-visualizer.png"))
    return found


@pytest.mark.parametrize("tab", TABS)
def test_no_serious_axe_violations(violations_by_tab, tab):
    unexpected = [v for v in violations_by_tab[tab] if not v["known"]]
    assert not unexpected, "\n".join(f'{v["rule"]} {v["target"]}: {v["summary"]}' for v in unexpected)


def test_known_violations_are_still_there(violations_by_tab):
    """An allow-list entry whose defect is fixed must go, or it would hide a regression."""
    seen = {(tab, v["rule"], selector) for tab, found in violations_by_tab.items()
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
def test_keyboard_focus_is_visible(page, violations_by_tab, selector):   # after axe: focus moves here
    show_tab(page, "Visualizer")
    ring = focus_ring(page, selector)
    assert ring["visible"] and ring["style"] != "none" and ring["width"] >= 2, ring
