"""What the visualizer's panels show for a session: plain values and component updates, by panel name.

Handlers combine these dicts and `handlers.pack` puts them in an event's output order, so nothing
here knows about the components themselves.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import gradio as gr

from hierviz.models.drafter import HEAD_TYPES, head_label
from hierviz.app.session import Session
from hierviz.retime import RETIMED, TIME_SCALES, at_time_scale, default_time_scale
from hierviz.methods import tree_on_target
from hierviz.trace import Step, Trace
from hierviz.viz.compare import side_by_side_html
from hierviz.viz.crossover import crossover_figure
from hierviz.viz.latency import latency_figure
from hierviz.viz.panels import (PREFILL_TEXT, headline_html, is_prefill, live_headline_html, output_html,
                                sequence_html, stats_html, verdict_html)
from hierviz.viz.style import method_label
from hierviz.viz.tree import tree_figure

LIVE_SOURCE = "live run"         # Session.source of a live run's session
PANELS = ("tree", "seq", "verdict", "output", "latency", "stats")
# HierSpec and EAGLE-2 at the same token count (a panel that is shown only when asked for); the
# events that move the step send it after their other outputs, so API clients' positions hold
SIDE = "side"
# the panels that change with every step; the others only grow and are sent less often
STEP_PANELS = {"tree", "seq", "verdict", SIDE}
NO_TREE_TEXT = "No draft tree in this step: the target decodes one token at a time."


def tree_title(trace: Trace, i: int) -> str:
    st = trace.steps[i]
    if is_prefill(st):
        return f"Step {i + 1}: prefill"
    if st.trees and st.trees[0].verifier == "intermediate":
        n = len(st.trees)
        head = head_note((trace.meta.get("head_types") or {}).get("e_m"))
        return (f"Step {i + 1}: {n} tree{'s' if n != 1 else ''} drafted by E_M{head} and checked by the intermediate M"
                + _unavoidable(st))
    if tree_on_target(st.method):
        return f"Step {i + 1}: {method_label(st.method)} tree drafted by E_T and checked by the target T" + _unavoidable(st)
    return f"Step {i + 1} ({method_label(st.method)})"


def head_note(head_type: Optional[str]) -> str:
    """" (an EAGLE-3 head)" for a head of any type but the default one (the EAGLE-1/2 layout)."""
    if not head_type or head_type == next(iter(HEAD_TYPES)):
        return ""
    return f" (an {head_label(head_type)} head)"


def _unavoidable(st: Step) -> str:
    """A note for the trees whose rejection no draft could avoid (the verifier's token lay outside
    the head's draft vocabulary)."""
    n = sum(t.undraftable for t in st.trees)
    return f" · {n} unavoidable rejection{'s' if n != 1 else ''} (outside the draft vocabulary)" if n else ""


@functools.cache
def empty_panels() -> dict[str, Any]:
    """The panels with nothing to show, made once: every live run starts by clearing them. Gradio
    only reads the figures it is given, so one copy serves every visitor."""
    return dict(tree=tree_figure([]), seq=sequence_html(None), verdict=verdict_html(None),
                output=output_html(None), latency=latency_figure(None), stats=stats_html([]),
                side=side_by_side_html(None, 0, []))


def chosen_time_scale(runs: list[Trace], time_scale: Optional[str]) -> str:
    """The visitor's choice when it is one of TIME_SCALES, else the runs' default."""
    return time_scale if time_scale in TIME_SCALES else default_time_scale(runs)


def render_panels(sess: Session, step: Optional[int] = None, time_scale: Optional[str] = None,
                  only: Optional[set[str]] = None) -> dict[str, Any]:
    """What the panels named in `only` (default: all) show for the inspected run and step (None or
    -1: the latest). `time_scale`: one of hierviz.retime.TIME_SCALES for the speed line and stats
    (None: the default for these runs); the panels of tokens and trees are the same either way.
    Only the panels asked for are built: a replay step sends a few, and building the others would
    take the CPU the page draws with."""
    main = sess.run()
    if main is None or not main.steps:
        return {k: v for k, v in empty_panels().items() if only is None or k in only}
    last = len(main.steps) - 1
    i = last if step is None or step < 0 else min(step, last)
    st = main.steps[i]
    scale = chosen_time_scale(sess.runs, time_scale or sess.time_scale)

    def latency() -> Any:
        # the latency bars follow the time scale too: the same runs, re-timed when asked
        timed = dict(zip(map(id, sess.runs), at_time_scale(sess.runs, scale)))
        main_timed = timed.get(id(main), main)
        others = [timed.get(id(t), t) for t in sess.others(main)]
        return latency_figure(main_timed, i, others, projected=main_timed.meta.get("time_scale") == RETIMED)

    build = dict(tree=lambda: tree_figure(st.trees, tree_title(main, i), PREFILL_TEXT if is_prefill(st) else NO_TREE_TEXT),
                 seq=lambda: sequence_html(st), verdict=lambda: verdict_html(st), output=lambda: output_html(main, i, i),
                 latency=latency, stats=lambda: stats_html(sess.runs, {main.meta.get("method", ""): i}, scale),
                 side=lambda: side_panel(sess, i))
    return {k: make() for k, make in build.items() if only is None or k in only}


def side_panel(sess: Session, i: int) -> str:
    """The side-by-side panel of step i of the inspected run; empty while the visitor has it off
    (nothing to build or send for a hidden panel)."""
    return side_by_side_html(sess.run(), i, sess.runs, sess.source == LIVE_SOURCE) if sess.side_by_side else ""


def side_update(sess: Session) -> Any:
    """The side-by-side panel shown or hidden, at the inspected step."""
    main = sess.run()
    i = (len(main.steps) - 1 if sess.step < 0 else sess.step) if main is not None and main.steps else 0
    return gr.HTML(value=side_panel(sess, i), visible=sess.side_by_side)


def panel_updates(sess: Session, step: Optional[int] = None, only: Optional[set[str]] = None,
                  time_scale: Optional[str] = None) -> dict[str, Any]:
    """render_panels, limited to the panels named in `only` (default: all)."""
    return render_panels(sess, step, time_scale, only)


def time_scale_update(sess: Session) -> Any:
    """The time-scale choice, set to the session's: the default for the runs just loaded (a new
    Session, whose own choice is None), the live run's own from its start."""
    return gr.Radio(choices=list(TIME_SCALES), value=chosen_time_scale(sess.runs, sess.time_scale))


def runs_shown_updates(sess: Session) -> dict[str, Any]:
    """What changes once per set of runs (a trace loaded, a live run finished), not per step."""
    return {"time_scale": time_scale_update(sess), "crossover": crossover_panel(sess), "headline": headline_update(sess)}


def headline_update(sess: Session) -> str:
    """The whole comparison's speed line at the visitor's time scale (top of the page); after a
    repeated live run of the same prompt and settings, the median and range over those runs.
    While a live run goes: what runs, and what it measured so far."""
    scale = chosen_time_scale(sess.runs, sess.time_scale)
    if sess.live is not None:
        return live_headline_html(sess.runs, list(sess.live.methods), sess.live.running, sess.live.device, scale)
    repeats = sess.history.repeats() if sess.counted else None
    return headline_html(sess.runs, scale, repeats, "Your live run: " if sess.source == LIVE_SOURCE else "")


def crossover_panel(sess: Session) -> Any:
    """Where the runs sit on the real-scale acceptance sweep (projected); the bare curve without runs
    (a live run's mark once it has HierSpec and EAGLE-2 tokens)."""
    name = "live run so far" if sess.live is not None else "your live run" if sess.source == LIVE_SOURCE else "this run"
    return crossover_figure(sess.runs, name)


def run_label(t: Trace) -> str:
    return method_label(str(t.meta.get("method", "?")))


def view_choices(sess: Session) -> list[tuple[str, str]]:
    return [(run_label(t), str(t.meta.get("method"))) for t in sess.runs]


def nav_updates(sess: Session) -> dict[str, Any]:
    """The step slider and the run chooser, set to the inspected run and step."""
    main = sess.run()
    n = len(main.steps) if main else 0
    i = (n if sess.step < 0 else sess.step + 1) if n else 1
    return {"step": gr.Slider(minimum=1, maximum=max(n, 2), value=max(1, min(i, n or 1)), interactive=n > 1),
            "view": gr.Radio(choices=view_choices(sess), value=sess.view if sess.runs else None)}


def download_update(sess: Session) -> Any:
    return gr.DownloadButton(value=sess.download, interactive=sess.download is not None)
