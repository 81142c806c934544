"""The live run (/run): HierSpec, EAGLE-2 and (optionally) AR on the visitor's prompt, one after
the other so that their timings do not disturb each other, streaming the panels of the viewed run.

A run's event starts at once (docs/app.md, "Queueing"): its inputs are checked, the rate limits
count it, it takes its place in the device line (hierviz.app.line) and waits there, in an asyncio
sleep that holds no worker thread, with its place and expected start in the status box. Stop, or
the page closing, takes it out of the line. On its turn the device work runs in a worker thread
(`device_run`, ZeroGPU's unit on a Space), one step at a time.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterator, Optional, TypeVar

import anyio
import gradio as gr

from hierviz.methods import BASELINE, SUBJECT
from hierviz.app import downloads
from hierviz.app.common import status_html
from hierviz.app.gpu import on_gpu, run_duration
from hierviz.app.guard import RATE, VisitorError, check_caps, check_stack, client_address, log_refusal, redact_paths
from hierviz.app.handlers import RUN_OUTPUTS, input_error, pack, run_update
from hierviz.app.line import LINE, POLL_S, Ticket, waiting_text
from hierviz.app.notes import SETTING_LABELS
from hierviz.app.pacing import Pacer, pace_mode, should_pace
from hierviz.app.progress import TIMINGS, RunPlan, fitted_cost, settings_key, with_heartbeat
from hierviz.app.render import (LIVE_SOURCE, STEP_PANELS, crossover_panel, download_update, headline_update,
                                nav_updates, panel_updates, run_label, runs_shown_updates)
from hierviz.app.session import (SESSIONS, LiveRun, Session, SessionFlags, run_bytes, session_key, state_limit_mb,
                                 step_bytes)
from hierviz.app.shipped import example_prompts
from hierviz.app.stacks import clear_stacks, device_kind, get_stack, is_loaded, stack_choices
from hierviz.config import ConfigError, options
from hierviz.settings import DecodeSettings, SettingsError, default_settings
from hierviz.engine import StackError, is_warm, run_method, stack_comparison, warm_up
from hierviz.retime import MEASURED, TIME_SCALES, default_time_scale_of, real_scale_available, tokens_of
from hierviz.trace import Trace, TraceError
from hierviz.viz.panels import whole_run_ratios

log = logging.getLogger(__name__)
T = TypeVar("T")

# Live updates: panels that change every step at most FAST_S apart, the growing ones (output
# text, latency, stats) at most SLOW_S apart, so a long run does not flood the page. The final
# state is always sent. A waiting run's place is sent when it changes, its expected start at most
# every WAIT_UPDATE_S.
FAST_S = 0.2
SLOW_S = 0.6
WAIT_UPDATE_S = 5.0
PACED_NOTE = " The runs paused while this page drew each update, so its drawing did not slow the timed steps."


async def run_live(prompt: Any, stack: Any, max_new: Any, temperature: Any, m_depth: Any, m_topk: Any, m_size: Any,
                   min_draft: Any, t_depth: Any, t_topk: Any, t_size: Any, with_ar: Any, sess: Session,
                   request: gr.Request) -> AsyncIterator[tuple]:
    """/run: check, queue and run one live comparison (see the module docstring)."""
    key = session_key(request)
    flags = SESSIONS.flags(key)
    stopped = flags.stop_signal()        # taken at once: a Stop while it waits in line reaches it
    replaced = flags.load_signal()       # a trace loaded meanwhile: stop, and send nothing more
    try:
        settings = checked_settings(max_new, temperature, m_depth, m_topk, m_size, min_draft, t_depth, t_topk, t_size)
        stack_name = check_stack(stack, stack_choices())
        methods = [m for m in comparison_of(stack_name) if m != BASELINE or with_ar]
        if not isinstance(prompt, str) or not prompt.strip():
            raise VisitorError("The prompt is empty: type a question or an instruction first.")
        ticket = admit(key, client_address(request))
    except VisitorError as e:
        yield input_error("run", str(e))
        return
    flags.running += 1                   # a trace loaded meanwhile waits for this run's end
    try:
        async for update in wait_turn(ticket, stopped, flags):
            if replaced():
                return
            yield update
        if LINE.position(ticket) != 0 or stopped():
            if not replaced():
                yield run_update(status=status_html("Stopped before it started: your run left the line.", "warn"))
            return
        new = (sess if isinstance(sess, Session) else Session()).carried(view=SUBJECT, source=LIVE_SOURCE)
        pacer = Pacer(request, flags, live_pace_mode())
        async for update in in_thread(device_run(settings, methods, new, key, stack_name, prompt, pacer, stopped)):
            # an update is only taken once the one before it went out: one sent from here on
            # could reach the page after the trace the visitor loaded
            if replaced():
                return
            yield update
    finally:
        LINE.leave(ticket)
        flags.running -= 1


def comparison_of(stack_name: str) -> list[str]:
    """The methods a live comparison runs on this stack (VisitorError for a stack file that cannot be read)."""
    try:
        return stack_comparison(stack_name)
    except StackError as e:
        raise VisitorError(str(e) if options().allow_custom_stacks else redact_paths(str(e))) from None


def checked_settings(max_new: Any, temperature: Any, m_depth: Any, m_topk: Any, m_size: Any, min_draft: Any,
                     t_depth: Any, t_topk: Any, t_size: Any) -> DecodeSettings:
    """The run's settings, validated (DecodeSettings.validate: one rule, whole numbers where whole
    numbers are meant, for every setting) and within this server's caps; VisitorError otherwise."""
    try:
        settings = DecodeSettings(max_new_tokens=max_new, temperature=temperature, m_depth=m_depth, m_topk=m_topk,
                                  m_tree_size=m_size, min_draft_len=min_draft, t_depth=t_depth, t_topk=t_topk,
                                  t_tree_size=t_size).validate(SETTING_LABELS)
        check_caps(settings, device_kind(), SETTING_LABELS)
    except SettingsError as e:
        raise VisitorError(f"Check the settings: {e}") from None
    return settings


def admit(key: str, address: str) -> Ticket:
    """A place in the device line, counted by the rate limits; VisitorError when the line is full
    or the visitor (or their address) started their runs for this minute. Nothing is counted for
    a refused run."""
    ticket = LINE.join(key)
    try:
        RATE.admit(key, address)
    except VisitorError:
        LINE.leave(ticket)
        raise
    return ticket


async def wait_turn(ticket: Ticket, stopped: Callable[[], bool], flags: SessionFlags) -> AsyncIterator[tuple]:
    """The status updates of a run waiting in line; ends on its turn or when Stop was pressed."""
    shown_at, shown_place = 0.0, None
    while LINE.position(ticket) > 0 and not stopped():
        place, now = LINE.position(ticket), time.monotonic()
        flags.used = now                 # a visitor waiting in line is not idle (session.MAX_FLAGS)
        if place != shown_place or now - shown_at >= WAIT_UPDATE_S:
            shown_at, shown_place = now, place
            yield run_update(status=status_html(waiting_text(place, LINE.eta_s(ticket))))
        await asyncio.sleep(POLL_S)


async def in_thread(gen: Iterator[T]) -> AsyncIterator[T]:
    """`gen`'s items, each computed in a worker thread; `gen` is closed however this ends (anyio
    lets a cancellation in only once the running step returned, so closing it is safe)."""
    end = object()
    try:
        while (item := await anyio.to_thread.run_sync(next, gen, end)) is not end:
            yield item
    finally:
        # closing waits for device work still running (a load or warm-up, progress.with_heartbeat),
        # so it happens in a worker thread, never on the event loop, and a cancellation waits for it
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(gen.close)


def live_pace_mode() -> str:
    """The render pacing mode; a bad HIERVIZ_UI_PACE must not stop a run, so it means no pacing."""
    try:
        return pace_mode()
    except ConfigError as e:
        log.warning("%s; not pacing", e)
        return "off"


# ---- on the device ----------------------------------------------------------------------------

@on_gpu(run_duration)
def device_run(settings: DecodeSettings, methods: list[str], new: Session, key: str, stack_name: str, prompt: str,
               pacer: Pacer, stopped: Callable[[], bool]) -> Iterator[tuple]:
    """The run's device work, its turn come: every failure ends in a message."""
    try:
        yield from live_comparison(new, key, stack_name, prompt, methods, settings, pacer, stopped)
    except (SettingsError, TraceError, ValueError) as e:   # EngineError and StackError are ValueErrors
        msg = str(e) if options().allow_custom_stacks else redact_paths(str(e))
        log_refusal("run", msg)
        yield run_update(status=status_html(f"Could not run: {msg}", "error"), session=new, **ended_updates(new),
                         **(panel_updates(new) | nav_updates(new) if new.runs else {}))
    except MemoryError:
        clear_stacks()
        yield failed_update("Out of memory: try fewer new tokens or smaller trees.", new)
    except Exception as e:  # last resort: keep the page usable, log the details server-side
        log.exception("run failed")
        yield unexpected_error(e, new)


def ended_updates(new: Session) -> dict[str, Any]:
    """A run that failed is no longer live: the headline and the crossover say what its runs so far showed."""
    new.live = None
    return runs_shown_updates(new)


def failed_update(message: str, new: Session) -> tuple:
    return run_update(status=status_html(message, "error"), **ended_updates(new))


def unexpected_error(e: Exception, new: Session) -> tuple:
    if "out of memory" in str(e).lower():
        clear_stacks()
        return failed_update("The device ran out of memory: try fewer new tokens or smaller trees.", new)
    return failed_update(f"Internal error ({type(e).__name__}). The details are in the server log; "
                        "the app is still usable.", new)


@dataclass
class StateBudget:
    """The memory the visitor's runs may take (session.state_limit_mb), counted step by step as they grow."""
    limit_mb: int
    used: int = 0
    counted: Optional[tuple[Trace, int]] = None   # the trace being counted and its steps counted

    def count(self, trace: Trace) -> None:
        start = self.counted[1] if self.counted and self.counted[0] is trace else 0
        self.used += (run_bytes(trace) if start == 0 else 0) + sum(step_bytes(s) for s in trace.steps[start:])
        self.counted = (trace, len(trace.steps))

    @property
    def full(self) -> bool:
        return self.used > self.limit_mb * 2**20


def live_comparison(new: Session, key: str, stack_name: str, prompt: str, methods: list[str],
                    settings: DecodeSettings, pacer: Pacer, stopped: Callable[[], bool]) -> Iterator[tuple]:
    """Load and warm the stack, run each method into `new`, then the final state with the download."""
    plan = RunPlan(stack_name, methods, settings.max_new_tokens, settings_key(settings),
                   paced=should_pace(pacer.request, pacer.mode), update_every_s=FAST_S)
    plan.use_prompt(prompt)
    # the page is the live run's from its first update: its headline says what runs, its time
    # scale is the one this stack's runs are shown at, and nothing of the trace shown before stays
    kind = device_kind()
    new.live = LiveRun(tuple(methods), "CPU" if kind == "cpu" else "GPU")
    new.time_scale = default_time_scale_of([{"stack": stack_name, "device": kind}])
    load_s, warm_s = before_methods_s(plan, settings)
    loading = status_html(plan.stage_text(LOADING, load_s, 0, warm_s))
    # the status first, with what must not show the trace's figures a moment longer (the headline,
    # the time scale, the crossover's mark): with the panels in the same update the page redraws
    # the previous run's plots before the visitor sees the run begin
    yield run_update(status=loading, **runs_shown_updates(new))
    # then clear the panels of the previous run or trace, so nothing stale is on screen (the status
    # again: every update of a run carries one, for API clients that read each)
    yield run_update(status=loading, session=new, **panel_updates(new), **nav_updates(new))
    stack = yield from timed_stage(plan, LOADING, TIMINGS.load_s, lambda: get_stack(stack_name), warm_s)
    plan.use_prompt(prompt, len(stack.tokenizer.encode_chat(prompt)))
    if not is_warm(stack, methods, settings) or not plan.measured():
        # else the first method pays every first-call cost and the comparison is skewed
        stage = "Warming up the models and timing them (first run with these settings)"
        yield run_update(status=status_html(plan.stage_text(stage, warm_s, 0)))
        yield from with_heartbeat(lambda: timed_warm_up(stack_name, stack, methods, settings), lambda elapsed: run_update(
            status=status_html(plan.stage_text(stage, warm_s, elapsed))))
    budget = StateBudget(state_limit_mb())
    for method in methods:
        if stopped() or budget.full:
            break
        yield from stream_method(new, stack, method, prompt, settings, pacer, lambda: stopped() or budget.full, budget,
                                 plan)
    if not stopped() and not budget.full and len(new.runs) == len(methods):
        # a whole run: its ratios join the visitor's history of runs of this prompt and settings
        new.history = new.history.add(repeat_key(stack_name, prompt, settings, methods), run_ratios(new.runs))
        new.counted = True
        plan.run_done()
    new.download = downloads.save(key, new.runs)
    # the comparison's subject is HierSpec: the final screen shows it, the other runs are a click away
    new.view, new.step, new.follow = methods[0], -1, True
    yield finished_update(new, stopped(), budget, pacer.paced)


LOADING = "Loading the model stack"


def before_methods_s(plan: RunPlan, settings: DecodeSettings) -> tuple[Optional[float], Optional[float]]:
    """The expected seconds of loading the stack and of warming it up: 0 for a stage the run
    skips, None for one it needs that was never timed here."""
    per_method = TIMINGS.warm_s_per_method.get(plan.stack)
    warm_s = None if per_method is None else per_method * len(plan.methods)
    if not is_loaded(plan.stack):
        return TIMINGS.load_s.get(plan.stack), warm_s
    warm = is_warm(get_stack(plan.stack), plan.methods, settings) and plan.measured()
    return 0.0, 0.0 if warm else warm_s


def repeat_key(stack_name: str, prompt: str, settings: DecodeSettings, methods: list[str]) -> tuple:
    """What makes two live runs repeats of one another: the stack, prompt, settings and methods."""
    return stack_name, prompt, repr(settings), tuple(methods)


def run_ratios(runs: list[Trace]) -> dict[str, dict[str, float]]:
    """HierSpec's whole-run speedups at each time scale the headline can show."""
    scales = TIME_SCALES if real_scale_available() else (MEASURED,)
    return {scale: whole_run_ratios(runs, scale) for scale in scales}


def timed_warm_up(stack_name: str, stack: Any, methods: list[str], settings: DecodeSettings) -> None:
    """engine.warm_up, then each method's costs measured warm (`calibrate`); the time per method
    recorded for later runs' estimates."""
    started = time.monotonic()
    warm_up(stack, methods, settings)
    calibrate(stack_name, stack, methods, settings)
    # the warm-up's garbage goes now, not in a collection inside the first timed method's steps
    gc.collect()
    TIMINGS.warm_s_per_method[stack_name] = (time.monotonic() - started) / len(methods)


# What `calibrate` runs for each method: one run of CALIBRATION_TOKENS new tokens on the page's
# first example prompt (the one it opens with: the prompt run most), and twice each the prefill
# alone of that prompt and of the prompt said LONG_PROMPT_TIMES times (how the prefill grows with
# the prompt). The machine may be shared: the slowest step (another process took the cores) is
# left out of the decoding cost, and each prefill is the faster of its two.
FALLBACK_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CALIBRATION_TOKENS = 32
LONG_PROMPT_TIMES = 8


def calibration_prompt() -> str:
    examples = example_prompts()
    return examples[0][0] if examples else FALLBACK_PROMPT


def calibrate(stack_name: str, stack: Any, methods: list[str], settings: DecodeSettings) -> None:
    """Each method's costs with these settings on this machine (progress.MethodCost), from warm
    runs: the time left of a live run is estimated from them."""
    key, prompt = settings_key(settings), calibration_prompt()
    prompts = (prompt, " ".join([prompt] * LONG_PROMPT_TIMES))
    for method in methods:
        decode_s = decode_cost(stack, method, prompt, settings)
        points: list[tuple[int, float]] = []
        for prompt in prompts:
            try:
                points.append(prefill_point(stack, method, prompt, settings))
            except ValueError:     # a context too short for the long prompt (EngineError): a flat prefill
                points.append(points[0])
        if decode_s is not None:
            TIMINGS.costs[(stack_name, method, key)] = fitted_cost(points[0], points[1], *decode_s)


def prefill_point(stack: Any, method: str, prompt: str, settings: DecodeSettings) -> tuple[int, float]:
    """(prompt tokens, seconds of its prefill): the faster of two prefills."""
    runs = [timed_steps(stack, method, prompt, settings, 1) for _ in range(2)]
    return runs[0][0], min(steps_s[0] for _, steps_s, _ in runs)


def decode_cost(stack: Any, method: str, prompt: str, settings: DecodeSettings) -> Optional[tuple[float, float]]:
    """(seconds per new token after the prefill, new tokens per decoding step): the mean decoding
    step's time (the slowest left out) over the tokens a step wrote on average; None when the run
    wrote none after its prefill."""
    _, steps_s, tokens = timed_steps(stack, method, prompt, settings, CALIBRATION_TOKENS)
    if len(steps_s) < 2 or sum(tokens[1:]) == 0:
        return None
    kept = sorted(steps_s[1:])[:-1] or steps_s[1:]
    per_step = sum(tokens[1:]) / (len(steps_s) - 1)
    return statistics.fmean(kept) / per_step, per_step


def timed_steps(stack: Any, method: str, prompt: str, settings: DecodeSettings,
                tokens: int) -> tuple[int, list[float], list[int]]:
    """One run of at most `tokens` new tokens, timed as a live run goes: (prompt tokens, each
    step's seconds, each step's new tokens); the first step is the prefill."""
    asked = type(settings)(**{**settings.to_dict(), "max_new_tokens": tokens})
    times, trace, last = [], None, time.monotonic()
    for trace in run_method(stack, method, prompt, asked):
        times.append(time.monotonic() - last)
        last = time.monotonic()
    assert trace is not None       # a run yields after every step, the prefill first
    return trace.prompt_tokens, times, [len(s.new_tokens) for s in trace.steps]


def timed_stage(plan: RunPlan, stage: str, record: dict[str, float], work: Callable[[], T],
                after_s: Optional[float] = 0.0) -> Iterator[Any]:
    """`work()` with a status update every second; its duration is recorded when it took a while
    (an already loaded stack returns at once and must not spoil the estimate of a real load)."""
    started = time.monotonic()
    value = yield from with_heartbeat(work, lambda elapsed: run_update(
        status=status_html(plan.stage_text(stage, record.get(plan.stack), elapsed, after_s))))
    if time.monotonic() - started > 1.0:
        record[plan.stack] = time.monotonic() - started
    return value


def stream_method(new: Session, stack: Any, method: str, prompt: str, settings: DecodeSettings, pacer: Pacer,
                  should_stop: Callable[[], bool], budget: StateBudget, plan: RunPlan) -> Iterator[tuple]:
    """One method's run, appended to `new.runs`; a throttled update after its steps. The panels
    follow the running method unless the visitor moved away from the newest step."""
    if new.follow:
        new.view, new.step = method, -1
    if new.live is not None:
        new.live.running = method
    # the crossover chart marks the live run once two runs are done (HierSpec and EAGLE-2 first)
    marked = {"crossover": crossover_panel(new)} if len(new.runs) >= 2 else {}
    yield run_update(status=status_html(plan.method_text(method, 0, 0.0)), headline=headline_update(new), **marked)
    throttle = Throttle()
    plan.method_started()
    started, n_tok, n_steps = time.monotonic(), 0, 0
    for trace in run_method(stack, method, prompt, settings, should_stop=should_stop):
        if not new.runs or new.runs[-1] is not trace:
            new.runs.append(trace)
        budget.count(trace)
        n_tok, n_steps = tokens_of(trace.steps), len(trace.steps)
        slow = throttle.due(time.monotonic())
        if slow is None:
            continue
        sent = time.monotonic()
        pacer.before_update()
        progress = plan.method_text(method, n_tok, sent - started, n_steps)
        yield step_update(new, method, progress, slow)
        pacer.wait()
        plan.update_sent(method, time.monotonic() - sent)   # built, sent and, when waited for, drawn
    plan.method_done(method, n_tok, n_steps, time.monotonic() - started)


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


def step_update(new: Session, method: str, progress: str, slow: bool) -> tuple:
    """The progress line, plus the panels if the run on screen is the one running and follows it."""
    upd: dict[str, Any] = {"status": status_html(progress)}
    if method == new.view and new.follow:
        upd.update(panel_updates(new, None, None if slow else STEP_PANELS))
        upd.update(nav_updates(new))
    elif slow:
        upd.update(panel_updates(new, new.step, {"latency", "stats"}))
    if slow:
        upd["headline"] = headline_update(new)
    return pack(RUN_OUTPUTS, upd)


def finished_update(new: Session, stopped: bool, budget: StateBudget, paced: bool) -> tuple:
    new.live = None          # the headline now says where every method stands
    head = ("Stopped. " if stopped else
            f"Stopped at this server's limit of {budget.limit_mb} MB of runs per visitor. "
            if budget.full else "Done. ")
    runs = " · ".join(f"{run_label(t)}: {sum(len(s.new_tokens) for s in t.steps)} tokens in {len(t.steps)} steps"
                      for t in new.runs)
    msg = head + (f"{runs}. Drag the step slider to inspect any step." if runs else "No step had run yet.") + \
        (PACED_NOTE if paced else "")
    return run_update(status=status_html(msg, "ok" if head == "Done. " else "warn"), session=new,
                      download=download_update(new), **runs_shown_updates(new), **panel_updates(new, new.step),
                      **nav_updates(new))


def prewarm(stack_name: str) -> bool:
    """Load and warm `stack_name` with the page's default settings at start-up, in its turn on the
    device line, so that the first visitor's run pays neither; the times and costs measured
    (`calibrate`) give the first runs their ETA. A failure is logged and left to the first run to
    report. True when warmed."""
    try:
        methods = stack_comparison(stack_name)
        with LINE.hold("start-up warm-up"):
            started = time.monotonic()
            stack = get_stack(stack_name)
            TIMINGS.load_s[stack_name] = time.monotonic() - started
            settings = default_settings()
            measured = RunPlan(stack_name, methods, settings.max_new_tokens, settings_key(settings)).measured()
            if not is_warm(stack, methods, settings) or not measured:
                timed_warm_up(stack_name, stack, methods, settings)
        return True
    except Exception:          # a broken stack must not keep the server from serving
        log.exception("start-up warm-up of %s failed", stack_name)
        return False

