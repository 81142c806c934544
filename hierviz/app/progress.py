"""What a live run's status box says while it works: the stage (loading, warm-up, method k of n),
tokens done of asked, and the time left of the whole run.

The time left comes from costs measured on this machine (`Timings`): how long loading each stack
took, how long warming one method up took, and, per stack, method and tree settings, a
`MethodCost`: what a prompt's prefill costs (a fixed part plus a part per prompt token) and what
each new token after it costs. The warm-up measures them (hierviz.app.live.calibrate), the
start-up warm-up for the page's default settings, so the first visitor's run has its estimate.
While the run goes, the estimate is corrected by how its own work went against those costs (the
machine's load, the page's drawing, how well the drafts fare on this prompt). Where a cost was
never measured, the box says the time left cannot be estimated yet instead of guessing.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, TypeVar

from hierviz.viz.style import method_label

T = TypeVar("T")
HEARTBEAT_S = 1.0      # a blocking stage (loading, warm-up) reports its elapsed time this often
# A prompt's tokens before the stack's tokenizer is loaded, from its characters (English BPE text)
CHARS_PER_TOKEN = 4.0
# The weight of the earlier runs' pace against this run's own, as a share of the run's expected
# seconds: at the start the estimate is the measured costs alone, later mostly this run's pace
PRIOR_SHARE = 0.1
PRIOR_UPDATES = 3      # the earlier runs' time per update counts as this many of this run's updates
NOT_MEASURED = "nothing was measured on this machine with these settings yet"
NOT_DRAWN = "this page's drawing of an update is not timed yet"


@dataclass(frozen=True)
class MethodCost:
    """One method's measured costs on one stack with one set of tree settings, in seconds."""
    prefill_s: float              # a prefill costs prefill_s + prefill_s_per_token × prompt tokens
    prefill_s_per_token: float
    decode_s_per_token: float     # each new token after the first (the prefill writes the first)
    tokens_per_step: float = 1.0  # the new tokens a decoding step writes, on average

    def prefill(self, prompt_tokens: int) -> float:
        return self.prefill_s + self.prefill_s_per_token * prompt_tokens

    def run_s(self, prompt_tokens: int, new_tokens: int) -> float:
        """The whole method's computing: the prefill, then the new tokens after the first."""
        return self.prefill(prompt_tokens) + self.decode_s_per_token * max(0, new_tokens - 1)

    def done_s(self, prompt_tokens: int, tokens_done: int, steps: int) -> float:
        """The expected seconds of the work a run has done after `steps` steps and `tokens_done` tokens."""
        return self.run_s(prompt_tokens, tokens_done) if steps > 0 else 0.0


def fitted_cost(short: tuple[int, float], long: tuple[int, float], decode_s_per_token: float,
                tokens_per_step: float = 1.0) -> MethodCost:
    """A MethodCost from two measured prefills, (prompt tokens, seconds) each, and the decoding's
    costs; a slope or fixed part that the machine's noise made negative counts as 0."""
    (p0, s0), (p1, s1) = sorted((short, long))
    slope = max(0.0, (s1 - s0) / (p1 - p0)) if p1 > p0 else 0.0
    return MethodCost(max(0.0, s0 - slope * p0), slope, max(0.0, decode_s_per_token), max(1.0, tokens_per_step))


def settings_key(settings: Any) -> tuple:
    """What a method's costs depend on besides the stack: every setting but the tokens asked."""
    return tuple(sorted((k, v) for k, v in settings.to_dict().items() if k != "max_new_tokens"))


CostKey = tuple[str, str, tuple]     # (stack, method, settings_key)


@dataclass
class Timings:
    """Measured durations of this process; thread-safe enough (one run at a time)."""
    load_s: dict[str, float] = field(default_factory=dict)                 # by stack
    warm_s_per_method: dict[str, float] = field(default_factory=dict)      # by stack, measuring included
    costs: dict[CostKey, MethodCost] = field(default_factory=dict)
    pace: dict[str, float] = field(default_factory=dict)   # by stack: the last live run's computing / expected
    # the last run's seconds per streamed update of each method (built, sent and, for a page that is
    # waited for, drawn: a tree method's updates draw trees, AR's none), by (paced, method)
    update_s: dict[tuple[bool, str], float] = field(default_factory=dict)


TIMINGS = Timings()


def seconds_text(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


def left_text(left: Optional[float], why: str = NOT_MEASURED) -> str:
    """'about 12 s left of the whole run', or why there is no estimate."""
    if left is None:
        return f"the time left cannot be estimated yet: {why}"
    return "less than a second left" if left < 1 else f"about {seconds_text(left)} left of the whole run"


def step_wall_s(compute_s: float, update_s: float, update_every_s: float) -> float:
    """A decoding step's wall time: its computing, plus the updates it sends. A step sends one when
    update_every_s passed since the last, so steps shorter than that share one."""
    if compute_s + update_s >= update_every_s or update_s >= update_every_s:
        return compute_s + update_s
    return compute_s / (1 - update_s / update_every_s)


@dataclass
class RunPlan:
    """One live run's methods, tokens asked and prompt; says where it stands and what is left.

    A method's time is its prefill and its decoding steps, each step's computing (the measured
    costs times this run's pace) plus its share of the streamed updates (their measured time)."""
    stack: str
    methods: list[str]
    tokens_asked: int
    settings: tuple = ()               # settings_key of the run's settings
    prompt_tokens: int = 0
    timings: Timings = field(default_factory=lambda: TIMINGS)
    paced: bool = False                # the run waits for its page to draw each update (hierviz.app.pacing)
    update_every_s: float = 0.2        # the most often a step's update is sent (hierviz.app.live.FAST_S)
    spent_s: float = 0.0               # wall seconds of the methods finished
    spent_expected_s: float = 0.0      # what their costs said their computing would take
    updates_s: float = 0.0             # seconds the run's updates took so far
    updates_before_s: float = 0.0      # updates_s when the running method started
    method_updates: dict[str, tuple[float, int]] = field(default_factory=dict)   # method -> (seconds, count)

    def use_prompt(self, prompt: str, tokens: Optional[int] = None) -> None:
        """The prompt's length in tokens (`tokens`: counted by the stack's tokenizer; else from its characters)."""
        self.prompt_tokens = tokens if tokens is not None else round(len(prompt) / CHARS_PER_TOKEN)

    def cost(self, method: str) -> Optional[MethodCost]:
        return self.timings.costs.get((self.stack, method, self.settings))

    def measured(self) -> bool:
        """Whether every method's costs with these settings are known."""
        return all(self.cost(m) is not None for m in self.methods)

    def expected_s(self, method: str) -> float:
        cost = self.cost(method)
        return cost.run_s(self.prompt_tokens, self.tokens_asked) if cost else 0.0

    def update_s(self, method: str) -> Optional[float]:
        """Seconds per streamed update of `method`: this run's, weighed against the last run's, or
        where the method has none of those, against the mean of the methods timed. None for a
        page the run waits for before any of its updates was timed."""
        seconds, n = self.method_updates.get(method, (0.0, 0))
        prior = self.timings.update_s.get((self.paced, method))
        if prior is None:
            others = [s / k for m, (s, k) in self.method_updates.items() if k and m != method] or [
                v for (paced, _), v in self.timings.update_s.items() if paced == self.paced]
            prior = sum(others) / len(others) if others else None
        if prior is None:
            return seconds / n if n else (None if self.paced else 0.0)
        return (seconds + PRIOR_UPDATES * prior) / (n + PRIOR_UPDATES)

    def update_sent(self, method: str, seconds: float) -> None:
        total, n = self.method_updates.get(method, (0.0, 0))
        self.method_updates[method] = (total + seconds, n + 1)
        self.updates_s += seconds

    def method_left_s(self, method: str, tokens_left: int, prefill: bool, pace: float, update_s: float) -> float:
        """Seconds `method` still takes with `tokens_left` to write (`prefill`: its prefill first)."""
        cost = self.cost(method)
        assert cost is not None
        decoded = max(0, tokens_left - (1 if prefill else 0))
        steps = decoded / cost.tokens_per_step
        step = step_wall_s(pace * cost.decode_s_per_token * cost.tokens_per_step, update_s, self.update_every_s)
        return (pace * cost.prefill(self.prompt_tokens) + update_s if prefill else 0.0) + steps * step

    def left_s(self, method: Optional[str] = None, tokens_done: int = 0, steps: int = 0,
               elapsed: float = 0.0) -> Optional[float]:
        """Seconds left of the whole run while `method` runs (None: before the first), its steps
        and tokens so far done in `elapsed` seconds: the measured costs of what is left at this
        run's pace so far, with its updates; None when a cost was never measured."""
        update_s = {m: self.update_s(m) for m in self.methods}
        if not self.measured() or None in update_s.values():
            return None
        k = self.methods.index(method) if method else -1
        cost = self.cost(method) if method else None
        done = cost.done_s(self.prompt_tokens, tokens_done, steps) if cost else 0.0
        whole, own = self.pace(method, done, elapsed)
        this = (self.method_left_s(method, self.tokens_asked - tokens_done, steps == 0, own, update_s[method])
                if method else 0.0)
        return this + sum(self.method_left_s(m, self.tokens_asked, True, whole, update_s[m]) for m in self.methods[k + 1:])

    def pace(self, method: Optional[str], done: float, elapsed: float) -> tuple[float, float]:
        """How much longer than its measured costs this run's computing takes (its wall time but its
        updates'): (over the whole run so far, weighed against the earlier runs' pace; for the
        running method, that pace turning into its own as it gets on). `done`: the expected
        seconds of the running method's work so far; `elapsed`: its wall seconds."""
        prior = PRIOR_SHARE * sum(self.expected_s(m) for m in self.methods)
        computing = max(0.0, self.spent_s + elapsed - self.updates_s)
        whole = ((computing + prior * self.timings.pace.get(self.stack, 1.0))
                 / max(1e-9, self.spent_expected_s + done + prior))
        if not method or done <= 0:
            return whole, whole
        own = max(0.0, elapsed - (self.updates_s - self.updates_before_s)) / done
        weight = done / (done + PRIOR_SHARE * 2 * self.expected_s(method))
        return whole, weight * own + (1 - weight) * whole

    def method_started(self) -> None:
        self.updates_before_s = self.updates_s

    def why_unknown(self) -> str:
        return NOT_MEASURED if not self.measured() else NOT_DRAWN

    def stage_text(self, stage: str, stage_s: Optional[float], elapsed: float, after_s: Optional[float] = 0.0) -> str:
        """Loading or warm-up: which stage, and the time left of the whole run when known
        (`stage_s`: the stage's expected seconds; `after_s`: the stages after it, before the methods)."""
        rest = self.left_s()
        known = stage_s is not None and after_s is not None and rest is not None
        left = max(0.0, stage_s - elapsed) + after_s + rest if known else None
        why = self.why_unknown() if rest is None else "this stage was never timed here"
        return f"{stage}: {seconds_text(elapsed)} so far, then {self.methods_text()}; {left_text(left, why)}."

    def methods_text(self) -> str:
        return ", ".join(method_label(m) for m in self.methods)

    def method_text(self, method: str, tokens_done: int, elapsed: float, steps: int = 0) -> str:
        """'Running EAGLE-2 (method 2 of 3), step 5: 12 of 64 tokens; about 8 s left of the whole run.'"""
        k = self.methods.index(method)
        left = left_text(self.left_s(method, tokens_done, steps, elapsed), self.why_unknown())
        at = f", step {steps}" if steps else ""
        return (f"Running {method_label(method)} (method {k + 1} of {len(self.methods)}){at}: {tokens_done} of "
                f"{self.tokens_asked} tokens; {left}.")

    def method_done(self, method: str, tokens: int, steps: int, elapsed: float) -> None:
        """A method ended after `steps` steps and `tokens` tokens in `elapsed` seconds: its pace counts."""
        cost = self.cost(method)
        if cost is not None:
            self.spent_s += elapsed
            self.spent_expected_s += cost.done_s(self.prompt_tokens, tokens, steps)

    def run_done(self) -> None:
        """The run's pace against the measured costs and its time per update start the next run's estimate."""
        computing = self.spent_s - self.updates_s
        if self.spent_expected_s > 0 and computing > 0:
            self.timings.pace[self.stack] = computing / self.spent_expected_s
        for method, (seconds, n) in self.method_updates.items():
            self.timings.update_s[(self.paced, method)] = seconds / n


def with_heartbeat(work: Callable[[], T], report: Callable[[float], Any]) -> Generator[Any, None, T]:
    """Run `work` in a thread and yield `report(elapsed)` every HEARTBEAT_S until it ends; its
    result is this generator's return value, its exception raised here. The device work of a
    live run is a generator, so a stage that blocks for seconds must still send news."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as e:   # re-raised in the caller's thread below
            box["error"] = e

    start = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        while True:
            thread.join(HEARTBEAT_S)
            if not thread.is_alive():
                break
            yield report(time.monotonic() - start)
    finally:
        # closed early (the page went away): the work still holds the device, so the run, and
        # its place at the head of the device line, end only when it did
        thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
