"""Live runs on the tiny-random stack driven through the /run handler as a page would: the
side-by-side panel after a live run, and the headline's median and range over a visitor's repeated
runs of one prompt and one set of settings (a new prompt or new settings start afresh)."""
from __future__ import annotations

import asyncio
import re
import statistics
import uuid
from types import SimpleNamespace

import pytest

from hierviz.app import handlers as h
from hierviz.app.session import Session
from hierviz.retime import tokens_of
from hierviz.viz.compare import matching_step
from hierviz.viz.panels import whole_run_ratios

SESSION, HEADLINE, SIDE = (h.RUN_OUTPUTS.index(n) for n in ("session", "headline", "side"))


@pytest.fixture(autouse=True)
def generous_rate_limits(monkeypatch):
    monkeypatch.setenv("HIERVIZ_RUNS_PER_ADDRESS", "6000")
    monkeypatch.setenv("HIERVIZ_RUNS_PER_MINUTE", "600")


def live_run(sess: Session, prompt: str = "side by side", max_new: int = 8) -> tuple:
    """The final outputs of /run on the tiny-random stack (HierSpec and EAGLE-2, small trees)."""
    from hierviz.app.live import run_live
    request = SimpleNamespace(session_hash=f"live-{uuid.uuid4().hex}", client=SimpleNamespace(host="127.0.0.1"),
                              headers={})

    async def final() -> tuple:
        outs = [out async for out in run_live(prompt, "tiny-random", max_new, 0.0, 2, 4, 8, 3, 2, 4, 8, False, sess,
                                              request)]
        return outs[-1]
    out = asyncio.run(final())
    assert "Done." in out[0], out[0]
    return out


def test_a_live_run_shows_the_side_by_side_panel() -> None:
    sess = Session()
    h.set_side_by_side(sess, True)
    final = live_run(sess)
    new = final[SESSION]
    assert new.side_by_side
    hs, e2 = new.run("hierspec"), new.run("eagle2")
    produced = tokens_of(e2.steps[: matching_step(e2.steps, tokens_of(hs.steps)) + 1])
    text = re.sub(r"<[^>]+>", "", final[SIDE])
    assert f"HierSpec, step {len(hs.steps)} of {len(hs.steps)}" in text and f"after {produced} token" in text


def as_shown(ratios: list[float]) -> list[float]:
    """HierSpec's speedups as the headline gives them: as they are while their median is at least
    1, else EAGLE-2's over HierSpec (on the tiny random stack the two are close, either may win)."""
    return ratios if statistics.median(ratios) >= 1 else [1 / r for r in ratios]


def test_repeated_runs_report_the_median_and_range_and_a_change_starts_afresh() -> None:
    sess, finals = Session(), []
    for _ in range(3):
        finals.append(live_run(sess, "again and again"))
        sess = finals[-1][SESSION]
    ratios = [whole_run_ratios(f[SESSION].runs)["eagle2"] for f in finals]
    first, second, third = (f[HEADLINE] for f in finals)
    assert "median" not in first and f"<b>{as_shown(ratios[:1])[0]:.2f}×</b>" in first
    assert f"<b>median {statistics.median(as_shown(ratios[:2])):.2f}×</b>" in second and "over 2 runs" in second
    shown = as_shown(ratios)
    assert (f"<b>median {statistics.median(shown):.2f}×</b> (range {min(shown):.2f}–{max(shown):.2f} over 3 runs)"
            in third and "Median and range over your 3 runs" in third)
    # the time scale's choice redraws the headline with the same history
    assert "over 3 runs" in h.set_time_scale(sess, None)[h.TIME_SCALE_OUTPUTS.index("headline")]
    # another prompt, then other settings: each starts a new history
    other = live_run(sess, "something else")
    assert "median" not in other[HEADLINE] and len(other[SESSION].history.ratios) == 1
    changed = live_run(other[SESSION], "something else", max_new=7)
    assert "median" not in changed[HEADLINE] and len(changed[SESSION].history.ratios) == 1
