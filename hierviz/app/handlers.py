"""The visualizer's event handlers, but the live run (hierviz.app.live): plain functions from
input values to output updates.

Each handler returns (or yields) a tuple in the order of its event's outputs, named by the
*_OUTPUTS constants below; hierviz.app.visualizer wires the components of those names. An output
a handler leaves alone is `gr.skip()`. Every bad input ends in a message in the status box (replaced
each time; no toasts, which pile up), and a bad upload's also under the upload (hierviz.app.notes),
never a stack trace in the page, and one line in the server log (guard.log_refusal).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import gradio as gr

from hierviz.app import downloads
from hierviz.app.common import status_html
from hierviz.app.guard import RATE, log_refusal
from hierviz.app.line import LINE
from hierviz.app.notes import note_html
from hierviz.app.render import (PANELS, SIDE, STEP_PANELS, download_update, headline_update, nav_updates,
                                panel_updates, run_label, runs_shown_updates, side_update)
from hierviz.app.session import SESSIONS, Session, SessionFlags, session_key, state_bytes, state_limit_mb
from hierviz.app.shipped import shipped_runs, shipped_traces
from hierviz.retime import TIME_SCALES
from hierviz.trace import MAX_TRACE_BYTES, Trace, TraceError, comparison_from_json
from hierviz.viz.export import step_svg
from hierviz import methods

# Inputs and outputs of each event, by component name (hierviz.app.visualizer builds the components).
SETTING_INPUTS = ("max_new", "temperature", "m_depth", "m_topk", "m_size", "min_draft", "t_depth", "t_topk", "t_size")
RUN_INPUTS = ("prompt", "stack", *SETTING_INPUTS, "with_ar", "session")
# API clients read these by position: new outputs go at the end
RUN_CORE = ("status", "session", "download", "step", "view", *PANELS)
RUN_OUTPUTS = (*RUN_CORE, "time_scale", "crossover", "headline", SIDE)
# the trace's message also goes under the upload and the list of traces (on a phone they are screens
# below the status box); a refused upload is taken out of the upload box, ready for the next file
LOAD_OUTPUTS = (*RUN_CORE, "prompt", "time_scale", "crossover", "headline", SIDE, "trace_note", "upload")
TIME_SCALE_OUTPUTS = (*PANELS, "headline")
PLAY_OUTPUTS = ("status", "step", *PANELS, SIDE)
VIEW_OUTPUTS = (*PANELS, "step", "view", SIDE)
SCRUB_OUTPUTS = (*PANELS, SIDE)
STEP_OUTPUTS = ("step", *PANELS, SIDE)
MIN_SPEED, MAX_SPEED = 0.2, 20.0      # replay speeds offered, steps per second
REPLAY_SLOW_S = 0.5
TREE_REST = 4.0          # a replay leaves the page this many times a tree's drawing time before the next
TREE_WAIT_MAX_S = 1.0    # a tree whose drawing is not reported by then counts as drawn

OPEN_STATUS = "Showing a recorded trace. Press Run for a live one, or Play to replay it."


def pack(names: tuple[str, ...], updates: dict[str, Any]) -> tuple:
    """`updates` (name -> value) in the order of `names`; the outputs not named are left as they are."""
    return tuple(updates.get(n, gr.skip()) for n in names)


def run_update(**updates: Any) -> tuple:
    return pack(RUN_OUTPUTS, updates)


def error_update(message: str) -> tuple:
    return run_update(status=status_html(message, "error"))


def input_error(where: str, message: str) -> tuple:
    """A refused input: one line in the log and the message in the status box (no toast: toasts
    pile up, the status box is replaced)."""
    log_refusal(where, message)
    return error_update(message)


def request_stop(request: gr.Request) -> str:
    """/stop: the visitor's running run ends after its current step (the later methods are
    skipped); a run of theirs still waiting in line leaves it without starting."""
    key = session_key(request)
    running, waiting = LINE.runs_of(key)
    SESSIONS.request_stop(key)
    if running:
        return status_html("Stopping after the current step…", "warn")
    if waiting:
        return status_html("Stopped: your run leaves the line without starting.", "warn")
    return status_html("No run of yours is running or waiting.", "warn")


def run_button_busy() -> Any:
    return gr.Button(interactive=False)


def run_button_ready() -> Any:
    return gr.Button(interactive=True)


def report_rendered(request: gr.Request) -> None:
    """The page's report that it drew the last status update (render pacing, hierviz.app.pacing)."""
    SESSIONS.mark_rendered(session_key(request))


def report_tree_drawn(request: gr.Request) -> None:
    """The page's report that it drew the last draft tree it was sent (a replay's pace, TreePace)."""
    SESSIONS.mark_tree_drawn(session_key(request))


def forget_session(request: gr.Request) -> None:
    """A closed page's flags (stop, render pacing), run count and download go; its runs stop."""
    key = session_key(request)
    SESSIONS.forget(key)
    RATE.forget(key)
    downloads.forget(key)


# ---- inspecting -------------------------------------------------------------------------------

def scrub(sess: Session, step: Any) -> tuple:
    """/scrub: the panels at step `step` (1-based) of the viewed run."""
    main = sess.run()
    if main is None or not main.steps:
        return pack(SCRUB_OUTPUTS, {})
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != step:
        log_refusal("scrub", f"step must be a number, got {step!r}")
        return pack(SCRUB_OUTPUTS, {})
    sess.stop_replay()
    return pack(SCRUB_OUTPUTS, panel_updates(sess, inspect_step(sess, main, int(step) - 1)))


def inspect_step(sess: Session, main: Trace, i: int) -> int:
    """Step i (0-based, clamped to main's steps) becomes the one inspected; live updates follow
    new steps only from the last one. Returns the step shown."""
    i = max(0, min(i, len(main.steps) - 1))
    sess.step, sess.follow = i, i == len(main.steps) - 1
    return i


def set_time_scale(sess: Session, time_scale: Optional[str]) -> tuple:
    """The visitor's time scale: the speed line, stats and latency bars of the step on screen."""
    sess.time_scale = time_scale if time_scale in TIME_SCALES else None
    if sess.run() is None:
        return pack(TIME_SCALE_OUTPUTS, {})
    return pack(TIME_SCALE_OUTPUTS, {**panel_updates(sess, sess.step, {"latency", "stats"}),
                                     "headline": headline_update(sess)})


def set_side_by_side(sess: Session, on: Any) -> Any:
    """Show or hide EAGLE-2's step at the same token count beside the inspected HierSpec step; the
    choice is the visitor's and stays for the next runs or traces they show."""
    sess.side_by_side = bool(on) if isinstance(on, bool) else False
    return side_update(sess)


def switch_view(sess: Session, method: Optional[str]) -> tuple:
    """Show another run of the comparison, at its latest step."""
    if not method or method == sess.view:
        return pack(VIEW_OUTPUTS, {})
    sess.stop_replay()
    sess.view, sess.step, sess.follow = method, -1, True
    return pack(VIEW_OUTPUTS, {**panel_updates(sess), **nav_updates(sess)})


# ---- a step for slides ------------------------------------------------------------------------

def step_picture_name(trace: Trace, i: int) -> str:
    """The exported picture's file name: the run and the step (from 1) it shows."""
    return f"hierviz-{run_slug(trace)}-step-{i + 1}{downloads.STEP_PICTURE_SUFFIX}"


def run_slug(trace: Trace) -> str:
    method = str(trace.meta.get("method", "run"))
    return method if method.isidentifier() else "run"


def export_step(sess: Session, request: gr.Request) -> tuple:
    """The inspected step's panels (and the other method's step beside them when the side-by-side
    view is on) as one standalone SVG, offered for download (the page clicks the hidden button)."""
    main = sess.run()
    if main is None or not main.steps:
        return (status_html("Nothing to export yet: run a prompt or load a trace first.", "error"),
                gr.update(value=None))
    i = len(main.steps) - 1 if sess.step < 0 else min(sess.step, len(main.steps) - 1)
    svg = step_svg(main, i, sess.runs if sess.side_by_side else None)
    path = downloads.save_step_picture(session_key(request), step_picture_name(main, i), svg)
    return (status_html(f"Exported step {i + 1} of {run_label(main)} as {Path(path).name} (opens in any browser, "
                        "offline; drop it on a slide).", "ok"),
            # an update, not a new component: Gradio serves the file from the download folder (a static path)
            gr.update(value=path))


# ---- recorded traces --------------------------------------------------------------------------

def sorted_runs(runs: list[Trace]) -> list[Trace]:
    order = {m: i for i, m in enumerate(methods.comparison_order())}   # HierSpec first
    return sorted(runs, key=lambda t: order.get(str(t.meta.get("method")), 9))


def check_holdable(runs: list[Trace]) -> None:
    """TraceError when `runs` take more memory than one visitor's runs may (session.state_bytes)."""
    size, most = state_bytes(runs), state_limit_mb()
    if size > most * 2**20:
        raise TraceError(f"once loaded it takes {size / 2**20:.1f} MB of memory; this server holds at most "
                         f"{most} MB per visitor")


# how a JSON text can start (a trace is an object, but an array or a word is JSON too, and refused
# as no trace by the schema's own message); a UTF-8 byte-order mark is left to the parser to name
JSON_STARTS = ("{", "[", '"', "-", *"0123456789", "true", "false", "null", "\ufeff")


def read_upload(path: str) -> list[Trace]:
    """The runs of an uploaded trace file: TraceError (or OSError) with a message for the visitor."""
    if not path.lower().endswith(".json"):
        raise TraceError("not a trace file (a trace is a .json file)")
    size = Path(path).stat().st_size
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"the file is {size / 2**20:.1f} MB; the limit is {MAX_TRACE_BYTES / 2**20:.0f} MB")
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError("not a trace file (it is not text; a trace is JSON text)") from None
    start = text.lstrip(" \t\r\n")
    if not start:
        raise TraceError("not a trace file (it is empty)")
    if not start.startswith(JSON_STARTS):
        raise TraceError("not a trace file (it is not JSON)")
    runs = comparison_from_json(text)
    check_holdable(runs)
    return runs


def loaded_updates(sess: Session, msg: str) -> dict[str, Any]:
    # the prompt box shows the loaded trace's prompt, so Run compares live on the same text
    main = sess.run()
    shown = main.meta.get("prompt") if main is not None else None
    return {"status": status_html(msg, "ok"), "session": sess,
            "prompt": gr.Textbox(value=shown) if isinstance(shown, str) and shown else gr.skip(),
            "download": download_update(sess), **runs_shown_updates(sess), **panel_updates(sess), **nav_updates(sess)}


def trace_updates(name: str, read: Any, download: Optional[str], shown: Optional[Session] = None) -> dict[str, Any]:
    """The updates (LOAD_OUTPUTS names) of showing the runs `read()` returns, keeping the view
    choices of the session `shown` (the one on screen); a message if it fails."""
    try:
        runs = sorted_runs(read())
    except (TraceError, OSError) as e:
        message = f"Could not read {name}: {e}"
        log_refusal("trace", message)
        return {"status": status_html(message, "error"), "trace_note": note_html(message, "error")}
    sess = (shown if isinstance(shown, Session) else Session()).carried(
        runs=runs, view=str(runs[0].meta.get("method")), source=name, download=download)
    message = f"Loaded {name}: " + ", ".join(run_label(t) for t in runs) + ". Press Play to replay."
    return {**loaded_updates(sess, message), "trace_note": note_html(message, "ok")}


def shown_instead(updates: dict[str, Any], request: Optional[gr.Request]) -> dict[str, Any]:
    """A trace the visitor loaded is now on their page: a live run of theirs in flight stops and
    sends nothing more, which would put its own runs back over the trace (a failed load changes
    nothing)."""
    if "session" in updates and request is not None:
        SESSIONS.trace_loaded(session_key(request))
    return updates


def load_file(path: Optional[str], shown: Optional[Session] = None, request: Optional[gr.Request] = None) -> tuple:
    """/load_trace: an uploaded trace file. Nothing is offered for download: the visitor has the file."""
    if not path:
        return pack(LOAD_OUTPUTS, {})
    updates = trace_updates(Path(path).name, lambda: read_upload(path), None, shown)
    if "session" not in updates:         # refused: the message names the file
        updates["upload"] = None
    return pack(LOAD_OUTPUTS, shown_instead(updates, request))


def shipped_updates(path: Optional[str], shown: Optional[Session] = None) -> dict[str, Any]:
    """The updates of showing a recorded trace; only the listed ones are read (the browser sends a
    path). Its download is the shipped file itself."""
    if not path or path not in {p for _, p in shipped_traces()}:
        message = "Pick one of the recorded traces first."
        return {"status": status_html(message, "error"), "trace_note": note_html(message, "error")}
    return trace_updates(Path(path).name, lambda: shipped_runs(path), path, shown)


def load_shipped(path: Optional[str], shown: Optional[Session] = None, request: Optional[gr.Request] = None) -> tuple:
    """One of the recorded traces."""
    return pack(LOAD_OUTPUTS, shown_instead(shipped_updates(path, shown), request))


def on_open() -> tuple:
    """A new page shows the first recorded trace, if any, so it never opens on empty panels."""
    shipped = shipped_traces()
    if not shipped:
        return pack(LOAD_OUTPUTS, {})
    out = shipped_updates(shipped[0][1])
    out["status"] = status_html(OPEN_STATUS)
    out.pop("trace_note", None)          # nothing was asked for: nothing to answer beside the list
    return pack(LOAD_OUTPUTS, out)


def replay_start(main: Trace, shown: Any) -> int:
    """The 0-based step a replay starts from: the one after the step on screen (Play resumes
    where Pause left it), or the first once the end was reached."""
    try:
        i = int(shown)
    except (TypeError, ValueError):
        return 0
    return i if 0 <= i < len(main.steps) else 0


@dataclass
class TreePace:
    """Whether a replay step may send the draft tree. A page reports each tree it has drawn
    (report_tree_drawn); a tree takes a browser several times longer to draw than the rest of a step,
    so while one is being drawn the steps go on without one, and after each the page has a rest of
    TREE_REST times its drawing time for the lighter panels: the steps keep their pace on the
    page. An API client never reports drawing and gets every tree."""
    flags: Optional[SessionFlags]
    sent_at: float = 0.0        # when the tree being drawn was sent (0: none)

    def ready(self, now: float) -> bool:
        if self.flags is None or not self.flags.reporting or not self.sent_at:
            return True
        drawn = self.flags.tree_drawn_at
        if drawn < self.sent_at:            # still drawing it, unless its report was lost
            return now - self.sent_at >= TREE_WAIT_MAX_S
        return now - drawn >= TREE_REST * (drawn - self.sent_at)

    def sent(self, now: float) -> None:
        self.sent_at = now


def replay(sess: Session, speed: Any, shown: Any = 0, request: Optional[gr.Request] = None) -> Iterator[tuple]:
    """Animate the viewed run step by step at `speed` steps per second, from the step after
    `shown` (1-based). Each step is due at a fixed time from the start, so the time spent
    rendering is not added to the wait and the speed holds."""
    main = sess.run()
    if main is None or not main.steps:
        yield pack(PLAY_OUTPUTS, {"status": status_html("Nothing to replay: run a prompt or load a trace first.",
                                                        "error")})
        return
    try:
        rate = min(MAX_SPEED, max(MIN_SPEED, float(speed)))
    except (TypeError, ValueError):
        rate = 1.0
    n, start = len(main.steps), replay_start(main, shown)
    mine = sess.stop_replay()          # a replay still running (a second Play) stops here
    pace = TreePace(SESSIONS.flags(session_key(request)) if request is not None else None)
    t0 = last_slow = time.monotonic()
    for i in range(start, n):
        due = t0 + (i - start) / rate
        time.sleep(max(0.0, due - time.monotonic()))
        # stopped (Pause, another step, run or trace) while waiting: its step must not land
        if not sess.replay_moves(mine, lambda i=i: inspect_step(sess, main, i)):
            return
        now = time.monotonic()
        only = replay_panels(i == n - 1, now - last_slow, now - due, rate, pace.ready(now))
        if only is None or "tree" in only:
            pace.sent(now)
        if only is None or "stats" in only:
            last_slow = now
        yield pack(PLAY_OUTPUTS, {"status": status_html(f"Replaying {run_label(main)}: step {i + 1} of {n}"),
                                  "step": gr.Slider(value=i + 1), **panel_updates(sess, i, only)})
    time.sleep(max(0.0, t0 + (n - start) / rate - time.monotonic()))
    if sess.replay == mine:
        yield pack(PLAY_OUTPUTS, {"status": status_html(f"Replay finished ({n} steps).", "ok")})


def replay_panels(last: bool, since_slow: float, late: float, rate: float, page_ready: bool = True) -> Optional[set[str]]:
    """The panels a replay step sends (None: all). Every step's sequence, verdict and output are
    sent. The slower growing ones (latency, stats) go at most every REPLAY_SLOW_S and at the last
    step; the tree, the one slow figure of a step, goes when the page is ready for it (TreePace)
    and the step is not already a step late on this machine, so a speed faster than trees are
    drawn keeps its pace. The figures go only with the tree: they take the page's time too."""
    if last:
        return None
    only = STEP_PANELS | {"output"}
    if not page_ready or late > 1.0 / rate:
        return only - {"tree"}
    return only | {"latency", "stats"} if since_slow >= REPLAY_SLOW_S else only


def replay_stopped(sess: Optional[Session] = None) -> str:
    """Pause: the replay stops before its next step (its event is cancelled too, but a step it was
    already taking would still land in the session), and the step on screen stays."""
    if isinstance(sess, Session):
        sess.stop_replay()
    return status_html("Replay paused: Play resumes from this step.", "warn")


def step_by(sess: Session, shown: Any, delta: int) -> tuple:
    """Previous / next step: the panels and the slider one step away from the one on screen."""
    main = sess.run()
    if main is None or not main.steps:
        return pack(STEP_OUTPUTS, {})
    sess.stop_replay()
    try:
        i = inspect_step(sess, main, int(shown) - 1 + delta)
    except (TypeError, ValueError):
        i = inspect_step(sess, main, 0)
    return pack(STEP_OUTPUTS, {"step": gr.Slider(value=i + 1), **panel_updates(sess, i)})


def previous_step(sess: Session, shown: Any) -> tuple:
    return step_by(sess, shown, -1)


def next_step(sess: Session, shown: Any) -> tuple:
    return step_by(sess, shown, 1)
