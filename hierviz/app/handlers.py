"""The visualizer's event handlers: plain functions from input values to output updates.

Each handler returns (or yields) a tuple in the order of its event's outputs, named by the
*_OUTPUTS constants below; hierviz.app.visualizer wires the components of those names. An output
a handler leaves alone is `gr.skip()`. Every bad input ends in a message in the status box (and a
toast), never a stack trace in the page.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import gradio as gr

from hierviz.app.common import status_html
from hierviz.app.pacing import Pacer, pace_mode
from hierviz.app import downloads
from hierviz.app.gpu import on_gpu, run_duration
from hierviz.app.guard import RATE, VisitorError, check_caps, check_stack, redact_paths
from hierviz.app.render import PANELS, STEP_PANELS, download_update, nav_updates, panel_updates, run_label
from hierviz.app.session import SESSIONS, Session, session_key
from hierviz.app.shipped import shipped_traces
from hierviz.app.stacks import clear_stacks, device_kind, get_stack, stack_choices
from hierviz.config import ConfigError, options
from hierviz.decoding.settings import DecodeSettings, SettingsError
from hierviz.engine import is_warm, run_method, warm_up
from hierviz.trace import MAX_TRACE_BYTES, TraceError, comparison_from_json
from hierviz.viz.style import method_label

log = logging.getLogger(__name__)

RUN_ORDER = ("hierspec", "eagle2", "ar")
# Live updates: panels that change every step at most FAST_S apart, the growing ones (output
# text, latency, stats) at most SLOW_S apart, so a long run does not flood the page. The final
# state is always sent.
FAST_S = 0.2
SLOW_S = 0.6

# Inputs and outputs of each event, by component name (hierviz.app.visualizer builds the components).
RUN_INPUTS = ("prompt", "stack", "max_new", "temperature", "m_depth", "m_topk", "m_size", "min_draft",
              "t_depth", "t_topk", "t_size", "with_ar", "session")
RUN_OUTPUTS = ("status", "session", "download", "step", "view", *PANELS)
LOAD_OUTPUTS = (*RUN_OUTPUTS, "prompt")
PLAY_OUTPUTS = ("status", "step", *PANELS)
VIEW_OUTPUTS = (*PANELS, "step", "view")
SCRUB_OUTPUTS = PANELS

PACED_NOTE = " The runs paused while this page drew each update, so its drawing did not slow the timed steps."
OPEN_STATUS = "Showing a recorded trace. Press Run for a live one, or Replay to animate it."


def pack(names: tuple[str, ...], updates: dict[str, Any]) -> tuple:
    """`updates` (name -> value) in the order of `names`; the outputs not named are left as they are."""
    return tuple(updates.get(n, gr.skip()) for n in names)


def run_update(**updates: Any) -> tuple:
    return pack(RUN_OUTPUTS, updates)


def error_update(message: str) -> tuple:
    return run_update(status=status_html(message, "error"))


# ---- live run ---------------------------------------------------------------------------------

@dataclass
class Throttle:
    """When a live run sends the next update (see FAST_S, SLOW_S)."""
    last_fast: float = 0.0
    last_slow: float = 0.0

    def due(self, now: float) -> Optional[bool]:
        """None: send nothing now; False: the per-step panels only; True: every panel."""
        if now - self.last_fast < FAST_S:
            return None
        self.last_fast = now
        slow = now - self.last_slow >= SLOW_S
        if slow:
            self.last_slow = now
        return slow


@on_gpu(run_duration)
def run_live(prompt: Any, stack: Any, max_new: Any, temperature: Any, m_depth: Any, m_topk: Any, m_size: Any,
             min_draft: Any, t_depth: Any, t_topk: Any, t_size: Any, with_ar: Any, sess: Session,
             request: gr.Request) -> Iterator[tuple]:
    """/run: HierSpec, EAGLE-2 and (with_ar) AR on the prompt, one after the other so that their
    timings do not disturb each other, streaming the panels of the viewed run."""
    key = session_key(request)
    flags = SESSIONS.flags(key)
    flags.stop.clear()
    try:
        settings = DecodeSettings(max_new_tokens=max_new, temperature=temperature, m_depth=m_depth, m_topk=m_topk,
                                  m_tree_size=m_size, min_draft_len=min_draft, t_depth=t_depth, t_topk=t_topk,
                                  t_tree_size=t_size).validate()
        check_caps(settings, device_kind())
        stack_name = check_stack(stack, stack_choices())
    except VisitorError as e:
        yield input_error(str(e), str(e))
        return
    except SettingsError as e:
        yield input_error(str(e), f"Check the settings: {e}")
        return
    except (TypeError, ValueError):
        yield input_error("Every setting must be a number.", "Every setting must be a number.")
        return
    if not isinstance(prompt, str) or not prompt.strip():
        yield input_error("The prompt is empty.", "The prompt is empty: type a question or an instruction first.")
        return
    try:
        RATE.admit(key)
    except VisitorError as e:
        yield input_error(str(e), str(e))
        return
    new = Session(view="hierspec", source="live run")
    methods = [m for m in RUN_ORDER if m != "ar" or with_ar]
    try:
        yield from live_comparison(new, key, stack_name, prompt, methods, settings,
                                   Pacer(request, flags, live_pace_mode()))
    except (SettingsError, TraceError, ValueError) as e:   # EngineError and StackError are ValueErrors
        msg = str(e) if options().allow_custom_stacks else redact_paths(str(e))
        gr.Warning(msg)
        yield run_update(status=status_html(f"Could not run: {msg}", "error"), session=new,
                         **(panel_updates(new) | nav_updates(new) if new.runs else {}))
    except MemoryError:
        clear_stacks()
        yield error_update("Out of memory: try fewer new tokens or smaller trees.")
    except Exception as e:  # last resort: keep the page usable, log the details server-side
        log.exception("run failed")
        yield unexpected_error(e)


def input_error(toast: str, message: str) -> tuple:
    gr.Warning(toast)
    return error_update(message)


def unexpected_error(e: Exception) -> tuple:
    if "out of memory" in str(e).lower():
        clear_stacks()
        return error_update("The device ran out of memory: try fewer new tokens or smaller trees.")
    return error_update(f"Internal error ({type(e).__name__}). The details are in the server log; "
                        "the app is still usable.")


def live_pace_mode() -> str:
    """The render pacing mode; a bad HIERVIZ_UI_PACE must not stop a run, so it means no pacing."""
    try:
        return pace_mode()
    except ConfigError as e:
        log.warning("%s; not pacing", e)
        return "off"


def live_comparison(new: Session, key: str, stack_name: str, prompt: str, methods: list[str],
                    settings: DecodeSettings, pacer: Pacer) -> Iterator[tuple]:
    """Load and warm the stack, run each method into `new`, then the final state with the download."""
    # clear the panels of the previous run or trace, so nothing stale is on screen
    yield run_update(status=status_html(f"Loading the model stack '{stack_name}'…"), session=new,
                     **panel_updates(new), **nav_updates(new))
    stack = get_stack(stack_name)
    if not is_warm(stack, methods, settings):
        # else the first method pays every first-call cost and the comparison is skewed
        yield run_update(status=status_html("Warming up the models (first run with these settings)…"))
        warm_up(stack, methods, settings)
    for method in methods:
        if pacer.flags.stop.is_set():
            break
        yield from stream_method(new, stack, method, prompt, settings, pacer)
    new.download = downloads.save(key, new.runs)
    yield finished_update(new, pacer.flags.stop.is_set(), pacer.paced)


def stream_method(new: Session, stack: Any, method: str, prompt: str, settings: DecodeSettings,
                  pacer: Pacer) -> Iterator[tuple]:
    """One method's run, appended to `new.runs`; a throttled update after its steps."""
    label = method_label(method)
    yield run_update(status=status_html(f"Running {label}: prefill…"))
    throttle = Throttle()
    for trace in run_method(stack, method, prompt, settings, should_stop=pacer.flags.stop.is_set):
        if not new.runs or new.runs[-1] is not trace:
            new.runs.append(trace)
        slow = throttle.due(time.monotonic())
        if slow is None:
            continue
        pacer.before_update()
        yield step_update(new, method, label, slow)
        pacer.wait()


def step_update(new: Session, method: str, label: str, slow: bool) -> tuple:
    """The status line, plus the panels if the run on screen is the one running and follows it."""
    trace = new.runs[-1]
    n_tok = sum(len(s.new_tokens) for s in trace.steps)
    upd: dict[str, Any] = {"status": status_html(f"Running {label}: step {len(trace.steps)}, {n_tok} tokens…")}
    if method == new.view and new.follow:
        upd.update(panel_updates(new, None, None if slow else STEP_PANELS))
        upd.update(nav_updates(new))
    elif slow:
        upd.update(panel_updates(new, new.step, {"latency", "stats"}))
    return pack(RUN_OUTPUTS, upd)


def finished_update(new: Session, stopped: bool, paced: bool) -> tuple:
    msg = ("Stopped. " if stopped else "Done. ") + " · ".join(
        f"{run_label(t)}: {sum(len(s.new_tokens) for s in t.steps)} tokens in {len(t.steps)} steps"
        for t in new.runs) + ". Drag the step slider to inspect any step." + (PACED_NOTE if paced else "")
    return run_update(status=status_html(msg, "warn" if stopped else "ok"), session=new, download=download_update(new),
                      **panel_updates(new, new.step), **nav_updates(new))


def request_stop(request: gr.Request) -> str:
    """/stop: the visitor's run ends after its current step; the later methods are skipped."""
    SESSIONS.flags(session_key(request)).stop.set()
    return status_html("Stopping after the current step…", "warn")


def report_rendered(request: gr.Request) -> None:
    """The page's report that it drew the last status update (render pacing, hierviz.app.pacing)."""
    SESSIONS.mark_rendered(session_key(request))


def forget_session(request: gr.Request) -> None:
    """A closed page's flags (stop, render pacing), run count and download go."""
    key = session_key(request)
    SESSIONS.forget(key)
    RATE.forget(key)
    downloads.forget(key)


# ---- inspecting -------------------------------------------------------------------------------

def scrub(sess: Session, step: float) -> tuple:
    """/scrub: the panels at step `step` (1-based) of the viewed run."""
    main = sess.run()
    if main is None or not main.steps:
        return pack(SCRUB_OUTPUTS, {})
    i = max(0, min(int(step) - 1, len(main.steps) - 1))
    sess.step = i
    sess.follow = i == len(main.steps) - 1
    return pack(SCRUB_OUTPUTS, panel_updates(sess, i))


def switch_view(sess: Session, method: Optional[str]) -> tuple:
    """Show another run of the comparison, at its latest step."""
    if not method or method == sess.view:
        return pack(VIEW_OUTPUTS, {})
    sess.view, sess.step, sess.follow = method, -1, True
    return pack(VIEW_OUTPUTS, {**panel_updates(sess), **nav_updates(sess)})


# ---- recorded traces --------------------------------------------------------------------------

def load_runs(text: bytes | str, name: str, key: str) -> Session:
    """A session showing the runs of a comparison file (hierviz.trace validates it; TraceError)."""
    runs = comparison_from_json(text)
    order = {m: i for i, m in enumerate(RUN_ORDER)}
    runs.sort(key=lambda t: order.get(str(t.meta.get("method")), 9))
    sess = Session(runs=runs, view=str(runs[0].meta.get("method")), source=name)
    sess.download = downloads.save(key, sess.runs)
    return sess


def loaded_updates(sess: Session, msg: str) -> dict[str, Any]:
    # the prompt box shows the loaded trace's prompt, so Run compares live on the same text
    main = sess.run()
    shown = main.meta.get("prompt") if main is not None else None
    return {"status": status_html(msg, "ok"), "session": sess,
            "prompt": gr.Textbox(value=shown) if isinstance(shown, str) and shown else gr.skip(),
            "download": download_update(sess), **panel_updates(sess), **nav_updates(sess)}


def file_updates(path: Optional[str], key: str) -> dict[str, Any]:
    """The updates (LOAD_OUTPUTS names) of loading the trace file at `path`; a message if it is bad."""
    if not path:
        return {}
    name = Path(path).name
    try:
        size = Path(path).stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"the file is {size / 2**20:.1f} MB; the limit is {MAX_TRACE_BYTES / 2**20:.0f} MB")
        sess = load_runs(Path(path).read_bytes(), name, key)
    except (TraceError, OSError) as e:
        gr.Warning(f"Could not read {name}: {e}")
        return {"status": status_html(f"Could not read {name}: {e}", "error")}
    return loaded_updates(sess, f"Loaded {name}: " + ", ".join(run_label(t) for t in sess.runs) + ". Press Replay.")


def load_file(path: Optional[str], request: gr.Request) -> tuple:
    """/load_trace: an uploaded trace file."""
    return pack(LOAD_OUTPUTS, file_updates(path, session_key(request)))


def load_shipped(path: Optional[str], request: gr.Request) -> tuple:
    """One of the recorded traces; the browser sends a path, so only the listed ones are read."""
    known = {p for _, p in shipped_traces()}
    if not path or path not in known:
        return pack(LOAD_OUTPUTS, {"status": status_html("Pick one of the recorded traces first.", "error")})
    return load_file(path, request)


def on_open(request: gr.Request) -> tuple:
    """A new page shows the first recorded trace, if any, so it never opens on empty panels."""
    shipped = shipped_traces()
    if not shipped:
        return pack(LOAD_OUTPUTS, {})
    out = file_updates(shipped[0][1], session_key(request))
    if "status" in out:
        out["status"] = status_html(OPEN_STATUS)
    return pack(LOAD_OUTPUTS, out)


def replay(sess: Session, speed: float) -> Iterator[tuple]:
    """Animate the viewed run step by step, `speed` steps per second."""
    main = sess.run()
    if main is None or not main.steps:
        yield pack(PLAY_OUTPUTS, {"status": status_html("Nothing to replay: run a prompt or load a trace first.",
                                                        "error")})
        return
    delay = 1.0 / max(0.1, float(speed or 1))
    n = len(main.steps)
    for i in range(n):
        sess.step, sess.follow = i, i == n - 1
        yield pack(PLAY_OUTPUTS, {"status": status_html(f"Replaying {run_label(main)}: step {i + 1} of {n}"),
                                  "step": gr.Slider(value=i + 1), **panel_updates(sess, i)})
        time.sleep(delay)
    yield pack(PLAY_OUTPUTS, {"status": status_html(f"Replay finished ({n} steps).", "ok")})


def replay_stopped() -> str:
    return status_html("Replay stopped.", "warn")
