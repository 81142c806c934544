"""HierSpec and EAGLE-2 side by side at the same token count: the matched step on hand-made and
recorded traces, and the panel following scrubbing, step buttons, replay, a change of run and a newly
loaded trace, driven through the handlers (a live run: tests/test_ui_live_runs.py)."""
from __future__ import annotations

import re

from hierviz.app import handlers as h
from hierviz.app.session import Session
from hierviz.app.shipped import shipped_runs, shipped_traces
from hierviz.retime import tokens_of
from hierviz.trace import Step, Trace
from hierviz.viz.compare import matching_step, side_by_side_html, tokens_after

SIDE = h.SCRUB_OUTPUTS.index("side")


def steps_of(counts: list[int]) -> list[Step]:
    return [Step(i, "eagle2", list(range(n)), ["x"] * n, ["target_bonus"] * n, {"target_verify": 1.0})
            for i, n in enumerate(counts)]


def test_matching_step_is_the_same_count_or_the_nearest_not_beyond() -> None:
    steps = steps_of([1, 3, 2, 4])                 # 1, 4, 6, 10 tokens after each step
    assert [matching_step(steps, n) for n in (1, 4, 5, 6, 9, 10, 99)] == [0, 1, 1, 2, 2, 3, 3]
    assert matching_step(steps, 0) is None         # the first step already produced more
    assert matching_step([], 5) is None
    assert tokens_after(steps, 2) == 6


def shipped_session(name: str) -> Session:
    path = next(p for _, p in shipped_traces() if name in p)
    return Session(runs=h.sorted_runs(shipped_runs(path)))


def heads(html: str) -> list[str]:
    """The two columns' headings, tags stripped."""
    return [re.sub(r"<[^>]+>", "", m) for m in re.findall(r'<div class="hv-pair-col"><div class="hv-head">(.*?)</div>', html)]


def test_the_recorded_h200_trace_pairs_every_hierspec_step_with_eagle2_at_its_token_count() -> None:
    sess = shipped_session("h200-smollm2")
    hs, e2 = sess.run("hierspec"), sess.run("eagle2")
    for i in range(len(hs.steps)):
        n = tokens_of(hs.steps[: i + 1])
        j = matching_step(e2.steps, n)
        produced = tokens_of(e2.steps[: j + 1])
        assert produced <= n and (j == len(e2.steps) - 1 or tokens_of(e2.steps[: j + 2]) > n)
        left, right = heads(side_by_side_html(hs, i, sess.runs))
        assert left == f"HierSpec, step {i + 1} of {len(hs.steps)} · {n} token{'s' if n != 1 else ''} of output so far"
        assert right.startswith(f"EAGLE-2, step {j + 1} of {len(e2.steps)} · after {produced} token")
        assert ("(the same count)" in right) == (produced == n)
    # a drafting step: HierSpec's trees (verified by M) and EAGLE-2's tree (verified by T), each with its verdict
    html = side_by_side_html(hs, 19, sess.runs)
    assert "M accepted a path of" in html and "T accepted a path of" in html
    assert "T checks a <b>60-node tree</b>" in html and re.search(r"T checks a <b>\d+-token sequence</b>", html)
    assert html.count("Target T's verdict") == 2


def test_nothing_to_pair_is_said_in_words() -> None:
    sess = shipped_session("tiny-random")
    assert "inspect one of those two runs" in side_by_side_html(sess.run("ar"), 3, sess.runs)
    assert "no EAGLE-2 run" in side_by_side_html(sess.run("hierspec"), 3, [sess.run("hierspec")])
    assert "Run a prompt" in side_by_side_html(None, 0, [])
    # while a live run streams HierSpec, EAGLE-2's run is there without steps yet
    waiting = Trace(dict(sess.run("eagle2").meta))
    assert "EAGLE-2 has not run yet" in side_by_side_html(sess.run("hierspec"), 3, [sess.run("hierspec"), waiting])
    assert "EAGLE-2 has not run yet" in side_by_side_html(sess.run("hierspec"), 3, [sess.run("hierspec")], live=True)
    # viewing EAGLE-2, HierSpec is the one beside it
    assert heads(side_by_side_html(sess.run("eagle2"), 4, sess.runs))[1].startswith("HierSpec, step")


def test_the_panel_follows_scrubbing_step_buttons_replay_and_a_change_of_run() -> None:
    sess = shipped_session("tiny-random")
    assert h.scrub(sess, 5)[SIDE] == ""                      # off: nothing is built or sent
    shown = h.set_side_by_side(sess, True)
    assert shown.visible is True and "hv-pair-grid" in shown.value
    assert heads(h.scrub(sess, 5)[SIDE])[0].startswith("HierSpec, step 5 of")
    assert heads(h.next_step(sess, 5)[h.STEP_OUTPUTS.index("side")])[0].startswith("HierSpec, step 6 of")
    replayed = list(h.replay(sess, 20, 9))
    assert heads(replayed[0][h.PLAY_OUTPUTS.index("side")])[0].startswith("HierSpec, step 10 of")
    view = h.switch_view(sess, "eagle2")
    assert heads(view[h.VIEW_OUTPUTS.index("side")])[0].startswith("EAGLE-2, step")
    assert h.set_side_by_side(sess, False).visible is False
    assert h.set_side_by_side(sess, "yes").visible is False   # only a checkbox's True turns it on


def test_a_loaded_trace_keeps_the_choice() -> None:
    sess = shipped_session("tiny-random")
    h.set_side_by_side(sess, True)
    path = next(p for _, p in shipped_traces() if "h200" in p)
    out = h.load_shipped(path, sess)
    new = out[h.LOAD_OUTPUTS.index("session")]
    assert new is not sess and new.side_by_side
    assert heads(out[h.LOAD_OUTPUTS.index("side")])[0].startswith("HierSpec, step 49 of 49")
    assert h.load_shipped(path, Session())[h.LOAD_OUTPUTS.index("side")] == ""
