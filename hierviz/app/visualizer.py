"""The Gradio Blocks layout and its event wiring.

The UI consumes traces only: live ones from hierviz.engine.run_method, or recorded ones from a
file. One function builds each tab; other tabs (Profile, What-if) register themselves in
TAB_BUILDERS. Every handler turns bad input into a message in the status box (and a toast),
never a stack trace in the page.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# Gradio's launch analytics phone home and, with this theme's plain font names, fail in launch()
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
import gradio as gr  # noqa: E402

from hierviz.decoding.settings import DecodeSettings, SettingsError, default_settings
from hierviz.trace import MAX_TRACE_BYTES, Trace, TraceError, comparison_from_json, save_comparison
from hierviz.viz.latency import latency_figure
from hierviz.viz.panels import (PREFILL_TEXT, is_prefill, legend_html, output_html, sequence_html, stats_html,
                                verdict_html)
from hierviz.viz.style import esc, method_label
from hierviz.viz.tree import tree_figure

log = logging.getLogger("hierviz.app.visualizer")

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
TRACE_DIR = ASSETS / "traces"
FALLBACK_STACKS = ["smollm2-offline", "tiny-random"]
# Live updates: panels that change every step at most FAST_S apart, the growing ones (output
# text, latency, stats) at most SLOW_S apart. The final state is always sent.
FAST_S = 0.2
SLOW_S = 0.6
RUN_ORDER = ("hierspec", "eagle2", "ar")

# (tab title, builder). A builder is called inside `with gr.Tab(title):` and builds that tab.
TAB_BUILDERS: list[tuple[str, Callable[[], None]]] = []


def register_tab(title: str, builder: Callable[[], None]) -> None:
    """Add a tab (e.g. Profile, What-if) after the visualizer; call before build_app()."""
    TAB_BUILDERS.append((title, builder))


# ---- per-session state ------------------------------------------------------------------------

@dataclass
class Session:
    runs: list[Trace] = field(default_factory=list)
    view: str = "hierspec"          # the method whose steps the panels show
    step: int = -1                  # inspected step of that run (-1: the latest)
    follow: bool = True             # live updates move the panels to the newest step
    source: str = ""                # "live run" or the trace file name
    download: Optional[str] = None  # path of the saved comparison JSON

    def run(self, method: Optional[str] = None) -> Optional[Trace]:
        method = method or self.view
        return next((t for t in self.runs if t.meta.get("method") == method), self.runs[0] if self.runs else None)

    def others(self, main: Optional[Trace]) -> list[Trace]:
        return [t for t in self.runs if t is not main]


# Stop flags live outside gr.State so that the Stop click (its own event) reaches the running
# generator of the same browser session without depending on how Gradio copies state.
_STOP: dict[str, threading.Event] = {}
_STOP_LOCK = threading.Lock()


def _session_key(request: Optional[gr.Request]) -> str:
    return getattr(request, "session_hash", None) or "anonymous"


def _session_flag(flags: dict[str, threading.Event], request: Optional[gr.Request]) -> threading.Event:
    with _STOP_LOCK:
        return flags.setdefault(_session_key(request), threading.Event())


def _stop_flag(request: Optional[gr.Request]) -> threading.Event:
    return _session_flag(_STOP, request)


# Render pacing. A browser on the machine that computes renders every streamed update on the same
# cores: measured on the 2-core CPU (session 16), the offline stack ran at ~9.5 tok/s (5.3-10.3 per
# method) watched in a local Chromium against 12-17 for the same runs streamed to an API client, and
# a first run's comparison said the opposite of `bench` (HierSpec 0.59x EAGLE-2); paced, ~12. With
# pacing, the page reports each rendered status update (a `change` listener, RENDERED_JS) and the
# run waits for that report before its next step, up to PACE_MAX_S: steps are timed
# by the engine, not the time between them, so the figures stay those of an unwatched run. Only
# sessions whose page has reported at least once are waited for (API clients never report).
PACE_MAX_S = 1.0
# Resolves once the page has painted the update and its main thread has gone idle (the plots
# finish drawing after the status line); browsers without requestIdleCallback use a timer.
RENDERED_JS = """() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => {
    const idle = window.requestIdleCallback || ((f) => setTimeout(f, 50));
    idle(() => done([]), {timeout: 900});
})))"""
_RENDERED: dict[str, threading.Event] = {}
_REPORTING: set[str] = set()
_LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost"}


def _rendered_flag(request: Optional[gr.Request]) -> threading.Event:
    return _session_flag(_RENDERED, request)


def report_rendered(request: gr.Request) -> None:
    """The page's report that it rendered the last status update."""
    with _STOP_LOCK:
        _REPORTING.add(_session_key(request))
    _rendered_flag(request).set()


def forget_session(request: gr.Request) -> None:
    """A closed page's per-session flags (stop, render pacing) go, so a public app does not grow."""
    key = _session_key(request)
    with _STOP_LOCK:
        _STOP.pop(key, None)
        _RENDERED.pop(key, None)
        _REPORTING.discard(key)


def pace_mode() -> str:
    """HIERVIZ_UI_PACE: 'auto' (default: pace pages on this machine), 'on' (every page) or 'off'."""
    mode = os.environ.get("HIERVIZ_UI_PACE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"HIERVIZ_UI_PACE must be auto, on or off, not {mode!r}")
    return mode


def should_pace(request: Optional[gr.Request], mode: Optional[str] = None) -> bool:
    """Whether a run waits for this page to render each update (see PACE_MAX_S)."""
    mode = mode or pace_mode()
    if mode == "off":
        return False
    with _STOP_LOCK:
        reporting = _session_key(request) in _REPORTING
    if not reporting:
        return False
    if mode == "on":
        return True
    host = getattr(getattr(request, "client", None), "host", None)
    return host in _LOOPBACK


# ---- engine access (lazy: the UI works for replay even where the engine cannot load) ----------

_STACK_CACHE: dict[str, Any] = {}
_STACK_LOCK = threading.Lock()


def engine_available() -> bool:
    return importlib.util.find_spec("hierviz.engine") is not None


def stack_choices() -> list[str]:
    try:
        presets = list(importlib.import_module("hierviz.engine").STACK_PRESETS)
    except Exception:  # the engine may be missing or broken; replay still works
        presets = []
    return presets or list(FALLBACK_STACKS)


def default_stack() -> str:
    env = os.environ.get("HIERVIZ_STACK")
    choices = stack_choices()
    if env:
        return env
    return "smollm2-offline" if "smollm2-offline" in choices else choices[0]


def get_stack(name: str) -> Any:
    """Load a stack once per process; keep one at a time so switching presets frees memory."""
    engine = importlib.import_module("hierviz.engine")
    with _STACK_LOCK:
        if name not in _STACK_CACHE:
            _STACK_CACHE.clear()
            _STACK_CACHE[name] = engine.load_stack(name)
        return _STACK_CACHE[name]


# ---- rendering --------------------------------------------------------------------------------

def status_html(text: str, kind: str = "info") -> str:
    return f'<div class="hv-status hv-status-{kind}">{esc(text)}</div>'


def _tree_title(trace: Trace, i: int) -> str:
    st = trace.steps[i]
    if is_prefill(st):
        return f"Step {i + 1}: prefill"
    if st.method == "hierspec":
        n = len(st.trees)
        return f"Step {i + 1}: {n} tree{'s' if n != 1 else ''} drafted by E_M and checked by the intermediate M"
    if st.method == "eagle2":
        return f"Step {i + 1}: EAGLE-2 tree drafted by E_T and checked by the target T"
    return f"Step {i + 1} ({method_label(st.method)})"


def render_panels(sess: Session, step: Optional[int] = None) -> dict[str, Any]:
    """Everything the panels show for the inspected run and step."""
    main = sess.run()
    if main is None or not main.steps:
        return dict(tree=tree_figure([]), seq=sequence_html(None), verdict=verdict_html(None),
                    output=output_html(None), latency=latency_figure(None), stats=stats_html([]))
    last = len(main.steps) - 1
    i = last if step is None or step < 0 else min(step, last)
    st = main.steps[i]
    empty = PREFILL_TEXT if is_prefill(st) else "No draft tree in this step: the target decodes one token at a time."
    return dict(tree=tree_figure(st.trees, _tree_title(main, i), empty), seq=sequence_html(st), verdict=verdict_html(st),
                output=output_html(main, i, i), latency=latency_figure(main, i, sess.others(main)),
                stats=stats_html(sess.runs, {main.meta.get("method", ""): i}))


def _run_label(t: Trace) -> str:
    return method_label(str(t.meta.get("method", "?")))


def _view_choices(sess: Session) -> list[tuple[str, str]]:
    return [(_run_label(t), str(t.meta.get("method"))) for t in sess.runs]


def _save_download(sess: Session) -> Optional[str]:
    if not sess.runs:
        return None
    d = tempfile.mkdtemp(prefix="hierviz-")
    methods = "-".join(str(t.meta.get("method")) for t in sess.runs)
    path = Path(d) / f"hierviz-trace-{methods}.json"
    save_comparison(sess.runs, path)
    return str(path)


# ---- the visualizer tab -----------------------------------------------------------------------

TEACH = {
    "tree": """**1 · Draft tree.** A tiny EAGLE head (E_M) guesses many continuations at once: each column
is one token further ahead. The intermediate model **M** checks the whole tree in one pass and keeps
the longest branch that matches its own choices.

<span class="hv-dot" style="background:#009E73"></span> accepted by M<br>
<span class="hv-dot" style="background:#D55E00"></span> compared with M's choice, rejected<br>
<span class="hv-dot" style="background:#C9CED6"></span> grows from a rejected token<br>
<span class="hv-dot" style="background:#0072B2"></span> M's own next token (bonus): the root of the next tree

The top row is the text M proposes. Hover a token for its probability. In the EAGLE-2 run the
picture is the same, but E_T drafts and the big target T checks the tree itself.""",
    "seq": """**2 · Sequence draft → 3 · Target verdict.** M joins its accepted branches and bonus tokens
into one line of at least *min draft length* tokens. The big 4-bit target **T** checks only this short
line, not a 30-60-token tree: 4-bit weights are cheap to read, but checking many tokens at once is not.

T keeps the line up to its first disagreement (✗) and drops the rest. It always adds one token of its
own (orange): a correction, or a bonus if all passed. The result is exactly what T alone would write.""",
    "output": """**4 · Output.** Each token is tinted by who proposed it; the outlined part is the step you
inspect. Hover for the step number.""",
    "latency": """**5 · Where the time goes.** Top: the inspected step, split by stage. Bottom: the race - how long
each method needed for the same number of tokens. EAGLE-2 makes T verify a big tree; HierSpec hands that
job to the smaller M and gives T a short line.""",
    "stats": """**6 · τ (tau)** = tokens gained per verification. *τ target*: output tokens per forward pass of T
(plain decoding: 1). *τ intermediate*: tokens per tree M checks (accepted branch + bonus). Higher τ,
fewer expensive passes. *Accepted at depth d*: how often a tree's accepted branch reached depth d,
given it reached d-1.""",
}


def _teach(key: str) -> None:
    gr.Markdown(TEACH[key], elem_classes=["hv-teach"])


def shipped_traces() -> list[tuple[str, str]]:
    """(label, path) of the recorded traces in assets/traces, labelled from their metadata."""
    out = []
    for p in sorted(TRACE_DIR.glob("*.json")):
        label = p.stem
        try:
            head = json.loads(p.read_text(encoding="utf-8"))
            first = head["runs"][0] if "runs" in head else head
            meta = first.get("meta", {})
            label = meta.get("title") or label
            if meta.get("synthetic"):
                label += " (hand-made, no model)"
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        out.append((label, str(p)))
    return out


def visualizer_tab(stack_default: Optional[str] = None) -> None:
    sess_state = gr.State(Session())
    with gr.Row(equal_height=False):
        # ---------------- run panel ----------------
        with gr.Column(scale=1, min_width=320, elem_classes=["hv-side"]):
            prompt = gr.Textbox(label="Prompt", lines=3, elem_id="hv-prompt",
                                value="Explain in two sentences why the sky is blue.",
                                placeholder="Ask the model something…")
            prompts = _example_prompts()
            if prompts:
                gr.Examples(prompts, inputs=[prompt], label="Example prompts")
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="hv-run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="hv-stop")
            status = gr.HTML(status_html("Ready. Press Run, or load a recorded trace below."), elem_id="hv-status")
            with gr.Accordion("Settings", open=False, elem_id="hv-settings"):
                choices = stack_choices()
                stack = gr.Dropdown(choices, value=stack_default or default_stack(), label="Model stack",
                                    allow_custom_value=True, elem_id="hv-stack",
                                    info="Target T (4-bit), intermediate M and EAGLE heads")
                d = default_settings()   # this machine's: small trees on a CPU (settings.CPU_TREES)
                max_new = gr.Slider(1, 512, value=d.max_new_tokens, step=1, label="Max new tokens", elem_id="hv-max-new")
                temperature = gr.Slider(0.0, 2.0, value=d.temperature, step=0.05, label="Temperature (0 = greedy)")
                gr.Markdown("**HierSpec: E_M tree, checked by M**")
                with gr.Row():
                    m_depth = gr.Number(d.m_depth, label="depth", precision=0, elem_id="hv-m-depth")
                    m_topk = gr.Number(d.m_topk, label="top-k", precision=0, elem_id="hv-m-topk")
                    m_size = gr.Number(d.m_tree_size, label="size", precision=0, elem_id="hv-m-size")
                min_draft = gr.Slider(1, 32, value=d.min_draft_len, step=1, label="Min sequence-draft length for T")
                gr.Markdown("**EAGLE-2 baseline: E_T tree, checked by T**")
                with gr.Row():
                    t_depth = gr.Number(d.t_depth, label="depth", precision=0, elem_id="hv-t-depth")
                    t_topk = gr.Number(d.t_topk, label="top-k", precision=0, elem_id="hv-t-topk")
                    t_size = gr.Number(d.t_tree_size, label="size", precision=0, elem_id="hv-t-size")
                with_ar = gr.Checkbox(True, label="Also run plain autoregressive decoding (for the speedup)",
                                      elem_id="hv-with-ar")
            with gr.Accordion("Replay a recorded trace", open=True):
                shipped = shipped_traces()
                trace_pick = gr.Dropdown(shipped, value=shipped[0][1] if shipped else None, label="Recorded traces",
                                         elem_id="hv-trace-pick")
                load_btn = gr.Button("Load recorded trace")
                upload = gr.File(label=f"…or upload a trace JSON (max {MAX_TRACE_BYTES // 2**20} MB)",
                                 file_types=[".json"], type="filepath", elem_id="hv-upload")
                speed = gr.Slider(0.5, 20, value=3, step=0.5, label="Replay speed (steps per second)")
                with gr.Row():
                    play_btn = gr.Button("▶ Replay", elem_id="hv-play")
                    pause_btn = gr.Button("■ Stop replay")
            download = gr.DownloadButton("Download trace JSON", value=None, interactive=False, elem_id="hv-download")

        # ---------------- live view ----------------
        with gr.Column(scale=4, min_width=640):
            gr.HTML(legend_html())
            with gr.Row(elem_classes=["hv-scrub"]):
                view = gr.Radio([], label="Inspect run", scale=2, elem_id="hv-view")
                step_sl = gr.Slider(1, 2, value=1, step=1, label="Step", scale=5, interactive=False, elem_id="hv-step")
            with gr.Row(equal_height=False):
                with gr.Column(scale=3, min_width=480):
                    tree_plot = gr.Plot(label="Draft tree(s)", elem_id="hv-tree", elem_classes=["hv-tree"])
                with gr.Column(scale=1, min_width=260):
                    _teach("tree")
            with gr.Row(equal_height=False):
                with gr.Column(scale=3, min_width=480):
                    seq_html = gr.HTML(sequence_html(None), elem_id="hv-seq")
                    verdict = gr.HTML(verdict_html(None), elem_id="hv-verdict")
                    out_html = gr.HTML(output_html(None), elem_id="hv-output")
                with gr.Column(scale=1, min_width=260):
                    _teach("seq")
                    _teach("output")
            with gr.Row(equal_height=False):
                with gr.Column(scale=1, min_width=420):
                    lat_plot = gr.Plot(label="Latency per stage", elem_id="hv-latency")
                    _teach("latency")
                with gr.Column(scale=1, min_width=360):
                    stats = gr.HTML(stats_html([]), elem_id="hv-stats")
                    _teach("stats")

    panels = [tree_plot, seq_html, verdict, out_html, lat_plot, stats]
    keys = ["tree", "seq", "verdict", "output", "latency", "stats"]

    def panel_updates(sess: Session, step: Optional[int] = None, only: Optional[set[str]] = None) -> dict:
        vals = render_panels(sess, step)
        return {c: vals[k] for c, k in zip(panels, keys) if only is None or k in only}

    def nav_updates(sess: Session) -> dict:
        main = sess.run()
        n = len(main.steps) if main else 0
        i = (n if sess.step < 0 else sess.step + 1) if n else 1
        return {step_sl: gr.Slider(minimum=1, maximum=max(n, 2), value=max(1, min(i, n or 1)), interactive=n > 1),
                view: gr.Radio(choices=_view_choices(sess), value=sess.view if sess.runs else None)}

    # ---- live run ----
    def run_live(prompt_v, stack_v, max_new_v, temp_v, md, mk, ms, mind, td, tk, ts, ar_v, sess: Session,
                 request: gr.Request) -> Iterator[dict]:
        stop = _stop_flag(request)
        stop.clear()
        rendered = _rendered_flag(request)
        fail = lambda msg: {status: status_html(msg, "error")}  # noqa: E731
        try:
            settings = DecodeSettings(max_new_tokens=max_new_v, temperature=temp_v, m_depth=md, m_topk=mk,
                                      m_tree_size=ms, min_draft_len=mind, t_depth=td, t_topk=tk,
                                      t_tree_size=ts).validate()
        except SettingsError as e:
            gr.Warning(str(e))
            yield fail(f"Check the settings: {e}")
            return
        except (TypeError, ValueError):
            gr.Warning("Every setting must be a number.")
            yield fail("Every setting must be a number.")
            return
        if not isinstance(prompt_v, str) or not prompt_v.strip():
            gr.Warning("The prompt is empty.")
            yield fail("The prompt is empty: type a question or an instruction first.")
            return
        if not engine_available():
            yield fail("The decoding engine is not part of this build; you can still replay recorded traces.")
            return
        engine = importlib.import_module("hierviz.engine")
        new = Session(view="hierspec", source="live run")
        try:
            # clear the panels of the previous run or trace, so nothing stale is on screen
            yield {status: status_html(f"Loading the model stack '{stack_v}'…"), sess_state: new,
                   **panel_updates(new), **nav_updates(new)}
            stack_obj = get_stack(str(stack_v))
            methods = [m for m in RUN_ORDER if m != "ar" or ar_v]
            if not engine.is_warm(stack_obj, methods, settings):
                # else the first method pays every first-call cost and the comparison is skewed
                yield {status: status_html("Warming up the models (first run with these settings)…")}
                engine.warm_up(stack_obj, methods, settings)
            try:
                mode = pace_mode()
            except ValueError as e:
                log.warning("%s; not pacing", e)
                mode = "off"
            paced = False
            for method in methods:
                if stop.is_set():
                    break
                label = method_label(method)
                yield {status: status_html(f"Running {label}: prefill…")}
                last_fast = last_slow = 0.0
                trace = None
                for trace in engine.run_method(stack_obj, method, prompt_v, settings, should_stop=stop.is_set):
                    if not new.runs or new.runs[-1] is not trace:
                        new.runs.append(trace)
                    now = time.monotonic()
                    if now - last_fast < FAST_S:
                        continue
                    last_fast = now
                    n_tok = sum(len(s.new_tokens) for s in trace.steps)
                    upd: dict = {status: status_html(f"Running {label}: step {len(trace.steps)}, {n_tok} tokens…")}
                    slow = now - last_slow >= SLOW_S
                    if slow:
                        last_slow = now
                    if method == new.view and new.follow:
                        upd.update(panel_updates(new, None, None if slow else {"tree", "seq", "verdict"}))
                        upd.update(nav_updates(new))
                    elif slow:
                        upd.update(panel_updates(new, new.step, {"latency", "stats"}))
                    rendered.clear()
                    yield upd
                    if should_pace(request, mode):
                        paced = True
                        rendered.wait(PACE_MAX_S)   # untimed: the browser renders, the engine waits
            new.download = _save_download(new)
            stopped = stop.is_set()
            msg = ("Stopped. " if stopped else "Done. ") + " · ".join(
                f"{_run_label(t)}: {sum(len(s.new_tokens) for s in t.steps)} tokens in {len(t.steps)} steps"
                for t in new.runs) + ". Drag the step slider to inspect any step." + (
                " The runs paused while this page drew each update, so its drawing did not slow the timed steps."
                if paced else "")
            yield {status: status_html(msg, "warn" if stopped else "ok"), sess_state: new,
                   download: gr.DownloadButton(value=new.download, interactive=new.download is not None),
                   **panel_updates(new, new.step), **nav_updates(new)}
        except (SettingsError, TraceError, ValueError) as e:   # EngineError and StackError are ValueErrors
            gr.Warning(str(e))
            yield {status: status_html(f"Could not run: {e}", "error"), sess_state: new,
                   **(panel_updates(new) | nav_updates(new) if new.runs else {})}
        except MemoryError:
            _STACK_CACHE.clear()
            yield fail("Out of memory: try fewer new tokens or smaller trees.")
        except Exception as e:  # last resort: keep the page usable, log the details server-side
            log.exception("run failed")
            if "out of memory" in str(e).lower():
                _STACK_CACHE.clear()
                yield fail("The device ran out of memory: try fewer new tokens or smaller trees.")
            else:
                yield fail(f"Internal error ({type(e).__name__}). The details are in the server log; "
                           "the app is still usable.")

    run_inputs = [prompt, stack, max_new, temperature, m_depth, m_topk, m_size, min_draft, t_depth, t_topk,
                  t_size, with_ar, sess_state]
    run_outputs = [status, sess_state, download, step_sl, view, *panels]
    run_btn.click(run_live, run_inputs, run_outputs, concurrency_id="gpu", concurrency_limit=1,
                            show_progress="hidden", api_name="run")
    prompt.submit(run_live, run_inputs, run_outputs, concurrency_id="gpu", concurrency_limit=1,
                  show_progress="hidden", api_visibility="private")

    def request_stop(request: gr.Request) -> str:
        _stop_flag(request).set()
        return status_html("Stopping after the current step…", "warn")

    stop_btn.click(request_stop, None, [status], queue=False, api_name="stop")
    # the page reports each rendered status update (render pacing, see PACE_MAX_S)
    status.change(report_rendered, None, None, queue=False, show_progress="hidden", api_visibility="private",
                  js=RENDERED_JS)

    # ---- scrubbing ----
    def scrub(sess: Session, step_v: float) -> dict:
        main = sess.run()
        if main is None or not main.steps:
            return {tree_plot: gr.skip()}  # Gradio needs at least one key
        i = max(0, min(int(step_v) - 1, len(main.steps) - 1))
        sess.step = i
        sess.follow = i == len(main.steps) - 1
        return panel_updates(sess, i)

    step_sl.input(scrub, [sess_state, step_sl], panels, trigger_mode="always_last", show_progress="hidden",
                  api_name="scrub")

    def switch_view(sess: Session, method: Optional[str]) -> dict:
        if not method or method == sess.view:
            return {tree_plot: gr.skip()}
        sess.view, sess.step, sess.follow = method, -1, True
        return {**panel_updates(sess), **nav_updates(sess)}

    view.input(switch_view, [sess_state, view], [*panels, step_sl, view], show_progress="hidden",
               api_visibility="private")

    # ---- replay ----
    def load_runs(text: bytes | str, name: str) -> Session:
        runs = comparison_from_json(text)
        order = {m: i for i, m in enumerate(RUN_ORDER)}
        runs.sort(key=lambda t: order.get(str(t.meta.get("method")), 9))
        sess = Session(runs=runs, view=str(runs[0].meta.get("method")), source=name)
        sess.download = _save_download(sess)
        return sess

    def loaded(sess: Session, msg: str) -> dict:
        # the prompt box shows the loaded trace's prompt, so Run compares live on the same text
        main = sess.run()
        shown = main.meta.get("prompt") if main is not None else None
        return {status: status_html(msg, "ok"), sess_state: sess,
                prompt: gr.Textbox(value=shown) if isinstance(shown, str) and shown else gr.skip(),
                download: gr.DownloadButton(value=sess.download, interactive=sess.download is not None),
                **panel_updates(sess), **nav_updates(sess)}

    def load_file(path: Optional[str]) -> dict:
        if not path:
            return {status: gr.skip()}
        name = Path(path).name
        try:
            size = Path(path).stat().st_size
            if size > MAX_TRACE_BYTES:
                raise TraceError(f"the file is {size / 2**20:.1f} MB; the limit is {MAX_TRACE_BYTES / 2**20:.0f} MB")
            sess = load_runs(Path(path).read_bytes(), name)
        except (TraceError, OSError) as e:
            gr.Warning(f"Could not read {name}: {e}")
            return {status: status_html(f"Could not read {name}: {e}", "error")}
        return loaded(sess, f"Loaded {name}: " + ", ".join(_run_label(t) for t in sess.runs) + ". Press Replay.")

    replay_outputs = [status, sess_state, download, step_sl, view, *panels, prompt]
    upload.upload(load_file, [upload], replay_outputs, show_progress="hidden", api_name="load_trace")

    def load_shipped(path: Optional[str]) -> dict:
        known = {p for _, p in shipped_traces()}
        if not path or path not in known:
            return {status: status_html("Pick one of the recorded traces first.", "error")}
        return load_file(path)

    load_btn.click(load_shipped, [trace_pick], replay_outputs, show_progress="hidden", api_visibility="private")

    def replay(sess: Session, speed_v: float) -> Iterator[dict]:
        main = sess.run()
        if main is None or not main.steps:
            yield {status: status_html("Nothing to replay: run a prompt or load a trace first.", "error")}
            return
        delay = 1.0 / max(0.1, float(speed_v or 1))
        n = len(main.steps)
        for i in range(n):
            sess.step, sess.follow = i, i == n - 1
            yield {status: status_html(f"Replaying {_run_label(main)}: step {i + 1} of {n}"),
                   step_sl: gr.Slider(value=i + 1), **panel_updates(sess, i)}
            time.sleep(delay)
        yield {status: status_html(f"Replay finished ({n} steps).", "ok")}

    play_evt = play_btn.click(replay, [sess_state, speed], [status, step_sl, *panels], show_progress="hidden",
                              api_visibility="private")
    # the message is sent only after the cancellation went through, so a late step update from
    # the cancelled replay cannot overwrite it
    pause_btn.click(None, None, None, cancels=[play_evt], queue=False, api_visibility="private").then(
        lambda: status_html("Replay stopped.", "warn"), None, [status], queue=False, api_visibility="private")

    # show something good on first open: the first recorded trace, if any
    def on_open() -> dict:
        if not shipped:
            return {status: gr.skip()}
        out = load_file(shipped[0][1])
        if status in out:
            out[status] = status_html("Showing a recorded trace. Press Run for a live one, or Replay to animate it.")
        return out

    _OPEN_HANDLERS.append((on_open, replay_outputs))


_OPEN_HANDLERS: list[tuple[Callable[[], dict], list]] = []


def _example_prompts() -> list[list[str]]:
    p = ASSETS / "prompts.json"
    try:
        items = json.loads(p.read_text(encoding="utf-8"))
        return [[str(x)] for x in items if isinstance(x, str)]
    except (OSError, ValueError):
        return []


def about_tab() -> None:
    gr.Markdown((ASSETS / "about.md").read_text(encoding="utf-8") if (ASSETS / "about.md").exists()
                else "HierSpec visualizer.")


HEADER = """<div class="hv-header"><h1>HierSpec, step by step</h1>
<p>A tiny draft head guesses a <b>tree</b> of tokens → a mid-size model <b>M</b> checks the tree and turns it into a
short <b>sequence</b> → the big <b>4-bit target T</b> checks only that sequence. Same text as T alone, fewer expensive
passes. Compare it live with EAGLE-2, where T checks the whole tree itself.</p></div>"""


def build_app(stack_default: Optional[str] = None) -> gr.Blocks:
    _OPEN_HANDLERS.clear()
    with gr.Blocks(title="hierviz: hierarchical speculative decoding", fill_width=True) as demo:
        gr.HTML(HEADER)
        with gr.Tabs():
            with gr.Tab("Visualizer", id="viz"):
                visualizer_tab(stack_default)
            from hierviz.app.profile_tab import profile_tab
            from hierviz.app.whatif_tab import whatif_tab
            for title, builder in [("Profile", profile_tab), ("What-if", whatif_tab), *TAB_BUILDERS]:
                with gr.Tab(title):
                    builder()
            with gr.Tab("How it works", id="about"):
                about_tab()
        for fn, outs in _OPEN_HANDLERS:
            demo.load(fn, None, outs, show_progress="hidden", api_visibility="private")
        demo.unload(forget_session)
    demo.queue(default_concurrency_limit=8)
    return demo


def launch_kwargs() -> dict:
    """Theme, CSS and limits; Gradio 6 takes these in launch()."""
    css = (ASSETS / "app.css").read_text(encoding="utf-8") if (ASSETS / "app.css").exists() else ""
    return dict(css=css, theme=gr.themes.Soft(font=("ui-sans-serif", "system-ui", "DejaVu Sans", "sans-serif"),
                                                     font_mono=("DejaVu Sans Mono", "ui-monospace", "monospace")), max_file_size=f"{MAX_TRACE_BYTES // 2**20 + 1}mb",
                show_error=False)
