"""A live run owns the page, and its time left earns trust.

The ETA's arithmetic (the whole run from measured costs, prefill growing with the prompt, this
run's pace, "cannot be estimated yet"), the live headline's words, and a live comparison on the
tiny-random stack right after the start-up warm-up: every update's time left is judged against
the run's own measured duration, and no update puts the recorded trace's figures back on the page.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hierviz.app import handlers as h
from hierviz.app.progress import MethodCost, RunPlan, Timings, fitted_cost
from hierviz.retime import MEASURED, RETIMED
from hierviz.viz.panels import live_headline_html
from tests.test_retime import hand_runs

METHODS = ["hierspec", "eagle2", "ar"]


def timings(**rates: tuple[float, float, float]) -> Timings:
    """Costs of stack "s" at settings (): method -> (prefill fixed s, prefill s per prompt token, s per new token)."""
    return Timings(costs={("s", m, ()): MethodCost(*r) for m, r in rates.items()})


def test_a_cost_is_fitted_from_two_prefills_and_the_decoding_rate() -> None:
    cost = fitted_cost((110, 1.2), (10, 0.2), 0.05)            # either order
    assert (cost.prefill_s, cost.prefill_s_per_token, cost.decode_s_per_token) == pytest.approx((0.1, 0.01, 0.05))
    assert cost.run_s(prompt_tokens=50, new_tokens=11) == pytest.approx(0.6 + 0.5)   # the prefill writes token 1
    # a busy machine made the long prompt's prefill the faster one: no negative cost per token
    noisy = fitted_cost((10, 0.5), (110, 0.4), 0.05)
    assert noisy.prefill_s_per_token == 0 and noisy.prefill_s == pytest.approx(0.5)


def test_the_eta_covers_every_method_prefill_included_and_grows_with_the_prompt() -> None:
    t = timings(hierspec=(0.5, 0.01, 0.1), eagle2=(0.5, 0.01, 0.2), ar=(0.2, 0.01, 0.3))
    plan = RunPlan("s", METHODS, 41, timings=t)
    plan.use_prompt("x" * 200)                                  # 50 tokens by its characters
    assert plan.prompt_tokens == 50
    # prefills 1.0, 1.0, 0.7 s; then 40 tokens at 0.1, 0.2, 0.3 s
    assert plan.left_s() == pytest.approx(1.0 + 4 + 1.0 + 8 + 0.7 + 12)
    assert "about 27 s left of the whole run" in plan.stage_text("Loading the model stack", 0.0, 0.0)
    # the tokenizer's count replaces the estimate; a 5,000-token prompt costs 50 s more of prefill in each method
    plan.use_prompt("ignored", tokens=5050)
    assert plan.left_s() == pytest.approx(26.7 + 3 * 50.0)
    assert "about 3 min left" in plan.method_text("hierspec", 0, 0.0)


def test_the_eta_follows_this_runs_pace_and_hands_it_to_the_next_run() -> None:
    t = timings(hierspec=(0.0, 0.0, 0.1), eagle2=(0.0, 0.0, 0.1), ar=(0.0, 0.0, 0.1))
    plan = RunPlan("s", METHODS, 41, timings=t)                 # 4 s each: 12 s, prior weight 1.2 s
    assert plan.left_s("hierspec", 21, 10, 2.0) == pytest.approx(10.0)          # at the measured pace
    slow = plan.left_s("hierspec", 21, 10, 6.0)                 # three times slower than measured
    whole = (6.0 + 1.2) / (2.0 + 1.2)                           # the run's pace, weighed against the prior
    weight = 2.0 / (2.0 + 0.2 * 4.0)                            # HierSpec's own pace, as far as it got
    assert slow == pytest.approx(2.0 * (weight * 3.0 + (1 - weight) * whole) + 8.0 * whole)
    plan.method_done("hierspec", 41, 20, 12.0)
    assert plan.left_s("eagle2", 0, 0, 0.0) == pytest.approx(8.0 * (12.0 + 1.2) / (4.0 + 1.2))
    plan.method_done("eagle2", 41, 20, 12.0)
    plan.method_done("ar", 41, 41, 12.0)
    plan.run_done()
    assert t.pace["s"] == pytest.approx(3.0)
    nxt = RunPlan("s", METHODS, 41, timings=t)                  # starts at the last run's pace
    assert nxt.left_s() == pytest.approx(36.0)


def test_the_eta_counts_the_steps_and_the_updates_they_send() -> None:
    """Each decoding step sends an update when 0.2 s passed since the last: short steps share one,
    and for a page the run waits for (drawing every update), the drawing counts."""
    from hierviz.app.progress import step_wall_s
    assert step_wall_s(0.05, 0.0, 0.2) == 0.05                  # nothing to send: the computing alone
    assert step_wall_s(0.05, 0.1, 0.2) == pytest.approx(0.1)    # one update every other step
    assert step_wall_s(0.3, 0.1, 0.2) == pytest.approx(0.4)     # an update after every step
    assert step_wall_s(0.01, 0.5, 0.2) == pytest.approx(0.51)   # drawing slower than the steps: every step waits
    t = timings(ar=(0.0, 0.0, 0.01), hierspec=(0.0, 0.0, 0.01))
    t.costs[("s", "hierspec", ())] = MethodCost(0.0, 0.0, 0.01, tokens_per_step=4.0)
    plan = RunPlan("s", ["hierspec", "ar"], 41, timings=t, paced=True)
    # a page the run waits for, and none of its updates timed yet: no guess
    assert "cannot be estimated yet: this page's drawing of an update is not timed yet" in plan.method_text("ar", 0, 0)
    plan.update_sent("hierspec", 0.5)                            # it takes half a second to draw one
    # AR: 40 steps of 0.01 s, each waiting 0.5 s (AR's own not timed yet: HierSpec's); HierSpec: 10
    # steps of 4 tokens; and each prefill's update
    assert plan.left_s() == pytest.approx(0.5 + 10 * 0.54 + 0.5 + 40 * 0.51)
    plan.update_sent("ar", 0.1)                                  # AR's updates draw no tree: its own
    assert plan.update_s("ar") == pytest.approx((0.1 + 3 * 0.5) / 4)   # ... weighed against HierSpec's
    assert plan.update_s("hierspec") == pytest.approx((0.5 + 3 * 0.1) / 4)
    plan.method_done("hierspec", 41, 11, 6.4)
    plan.method_done("ar", 41, 41, 20.9)
    plan.run_done()                                              # the next run starts from each method's own
    assert t.update_s == {(True, "hierspec"): 0.5, (True, "ar"): 0.1}
    assert RunPlan("s", ["ar"], 41, timings=t, paced=True).update_s("ar") == pytest.approx(0.1)


def test_the_eta_says_so_when_it_cannot_be_estimated() -> None:
    t = timings(hierspec=(0.0, 0.0, 0.1), eagle2=(0.0, 0.0, 0.1))      # AR never measured
    plan = RunPlan("s", METHODS, 41, timings=t)
    assert plan.left_s("hierspec", 11, 5, 1.0) is None
    assert "the time left cannot be estimated yet: nothing was measured" in plan.method_text("hierspec", 11, 1.0, 5)
    measured = RunPlan("s", METHODS[:2], 41, timings=t)
    assert "cannot be estimated yet: this stage was never timed" in measured.stage_text("Warming up", None, 2.0)
    assert "about 8 s left" in measured.stage_text("Warming up", 3.0, 3.0)
    # the settings are part of what was measured: other tree settings are not estimated
    other = RunPlan("s", METHODS[:2], 41, settings=(("m_depth", 4),), timings=t)
    assert "cannot be estimated yet" in other.method_text("hierspec", 0, 0.0)


def text(html: str) -> str:
    """What a reader sees of a fragment: its blocks apart, its inline marks gone."""
    spaced = re.sub(r"</?div[^>]*>", " ", html)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", spaced)).strip()


def test_the_live_headline_says_what_runs_and_what_it_measured_so_far() -> None:
    hierspec, eagle2, ar = hand_runs()        # 1 ms a step; HierSpec 1 + 5 tokens, EAGLE-2 1 + 3, AR 1 a step
    before = text(live_headline_html([hierspec], METHODS, "hierspec", "CPU"))
    assert before.startswith("Live on this CPU: now running HierSpec (method 1 of 3) ") and "×" not in before
    assert "HierSpec, EAGLE-2 and Autoregressive run in turn" in before
    # a run that has only its prefill is not compared yet
    assert "×" not in text(live_headline_html([hierspec, replace(eagle2, steps=eagle2.steps[:1])], METHODS, "eagle2", "CPU"))
    line = text(live_headline_html([hierspec, eagle2], METHODS, "eagle2", "CPU"))
    assert line.startswith("Live on this CPU, measured so far (first 4 tokens of each run): HierSpec is 1.00× faster "
                           "than EAGLE-2")
    assert "Now running EAGLE-2 (method 2 of 3); the whole comparison when the run ends." in line
    # every method with tokens, in comparison order; one faster than HierSpec is named as faster
    fast_ar = replace(ar, steps=[replace(s, timings_ms={"target_verify": 0.25}) for s in ar.steps])
    line = text(live_headline_html([hierspec, eagle2, fast_ar], METHODS, "ar", "CPU"))
    assert "(first 3 tokens of each run): HierSpec is 1.00× faster than EAGLE-2. Autoregressive is 2.67× faster than " \
           "HierSpec" in line
    retimed = text(live_headline_html([hierspec, eagle2], METHODS, "eagle2", "GPU", RETIMED))
    assert retimed.startswith("Live on this GPU, re-timed at real scale (projected) so far")
    assert text(live_headline_html([], METHODS, None, "CPU", MEASURED)).startswith(
        "Live on this CPU: loading and warming up the models ")


def test_the_time_scale_chosen_mid_run_redraws_the_live_headline() -> None:
    from hierviz.app.session import LiveRun, Session
    sess = Session(runs=list(hand_runs()[:2]), source="live run", live=LiveRun(tuple(METHODS), "CPU", "eagle2"))
    headline = h.set_time_scale(sess, RETIMED)[h.TIME_SCALE_OUTPUTS.index("headline")]
    assert text(headline).startswith("Live on this CPU, re-timed at real scale (projected) so far")
    sess.live = None           # the run ended: one line for every method
    assert text(h.set_time_scale(sess, MEASURED)[h.TIME_SCALE_OUTPUTS.index("headline")]).startswith(
        "Your live run: HierSpec is")


# ---- a live comparison on the tiny-random stack, as the page drives it ---------------------------

RUN_TOKENS = 256         # the CPU cap: a run of a few seconds, long enough to judge its time left


@pytest.fixture()
def fresh_timings(monkeypatch):
    """This process's measurements of tiny-random forgotten: the start-up warm-up measures afresh."""
    from hierviz.app.progress import TIMINGS
    monkeypatch.setenv("HIERVIZ_RUNS_PER_ADDRESS", "6000")
    monkeypatch.setenv("HIERVIZ_RUNS_PER_MINUTE", "600")
    for table in (TIMINGS.load_s, TIMINGS.warm_s_per_method, TIMINGS.pace):
        table.pop("tiny-random", None)
    for key in [k for k in TIMINGS.costs if k[0] == "tiny-random"]:
        del TIMINGS.costs[key]


def live_updates(sess, prompt: str) -> list[tuple[float, tuple]]:
    """Every update of /run with the page's default settings, and when it came (seconds from the start)."""
    from hierviz.app.live import run_live
    from hierviz.settings import default_settings
    d = default_settings()
    request = SimpleNamespace(session_hash=f"eta-{uuid.uuid4().hex}", client=SimpleNamespace(host="127.0.0.1"),
                              headers={})

    async def run() -> list[tuple[float, tuple]]:
        t0, outs = time.monotonic(), []
        async for out in run_live(prompt, "tiny-random", RUN_TOKENS, 0.0, d.m_depth, d.m_topk, d.m_tree_size,
                                  d.min_draft_len, d.t_depth, d.t_topk, d.t_tree_size, True, sess, request):
            outs.append((time.monotonic() - t0, out))
        return outs
    return asyncio.run(run())


def seconds_left(status: str) -> float:
    """The time left a status says, in seconds ("less than a second": 0.5)."""
    if "less than a second left" in status:
        return 0.5
    m = re.search(r"about (\d+) (s|min) left", status)
    assert m, status
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


@pytest.mark.quiet
def test_a_live_run_owns_the_page_and_its_eta_holds_from_the_first_update(fresh_timings) -> None:
    """A live run's time left is judged against its wall time: it has the CPU to itself (quiet), as
    no estimate can foresee the other worker taking a core halfway."""
    from hierviz.app.live import prewarm
    from hierviz.app.shipped import shipped_runs, shipped_traces
    from hierviz.app.session import Session
    assert prewarm("tiny-random")                  # what app.py does at start-up
    # the visitor's page shows the recorded trace it opens on, then they press Run
    shown = Session(runs=shipped_runs(shipped_traces()[0][1]), source="recorded")
    updates = live_updates(shown, "Explain in two sentences why the sky is blue.")
    status, headline, time_scale, crossover = (h.RUN_OUTPUTS.index(n) for n in ("status", "headline", "time_scale",
                                                                                 "crossover"))
    total = updates[-1][0]
    assert "Done." in updates[-1][1][status] and total > 2, updates[-1][1][status]
    # the time left of the whole run, from the first update on: within 2x of what was left (1 s of
    # slack: the status gives whole seconds)
    judged = []
    for at, out in updates[:-1]:
        said, left = seconds_left(out[status]), total - at
        judged.append((round(at, 2), said, round(left, 2)))
        assert said <= 2 * left + 1 and left <= 2 * said + 1, str(judged)
    # the page is the live run's from its first update: its headline, measured time scale, no recorded mark
    first = updates[0][1]
    assert text(first[headline]).startswith("Live on this CPU") and first[time_scale].value == MEASURED
    assert [t.name for t in first[crossover].data if t.name.startswith(("this run", "live run"))] == []
    headlines = [text(out[headline]) for _, out in updates if isinstance(out[headline], str)]
    assert all(hl.startswith("Live on this CPU") for hl in headlines[:-1]), headlines
    assert any("HierSpec is" in hl or "faster than HierSpec" in hl for hl in headlines[:-1])   # measured so far
    # (the recorded trace's line is re-timed, projected at H200 costs; this run's is measured on this CPU)
    assert not any("H200" in hl or "re-timed" in hl or "projected" in hl for hl in headlines), headlines
    marks = [[t.name for t in out[crossover].data] for _, out in updates if hasattr(out[crossover], "data")]
    assert not any(name.startswith("this run") for names in marks for name in names), marks
    assert any(name.startswith("live run so far") for names in marks[:-1] for name in names), marks
    # the end: one line for every method, the live run's mark
    assert headlines[-1].startswith("Your live run:") and "Over the first 256 tokens" in headlines[-1]
    assert any(name.startswith("your live run (scale") for name in marks[-1])
