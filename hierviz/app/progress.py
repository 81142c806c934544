"""What a live run's status box says while it works: the stage (loading, warm-up, method k of n),
tokens done of asked, and the time left, estimated from what this process measured before.

The estimates are per stack: how long loading it took, how long warming one method up took, and
each method's tokens per second in its last run. Before a stage was ever measured the box shows
the seconds spent so far instead of a time left.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, TypeVar

from hierviz.viz.style import method_label

T = TypeVar("T")
HEARTBEAT_S = 1.0      # a blocking stage (loading, warm-up) reports its elapsed time this often


@dataclass
class Timings:
    """Measured durations of this process, by stack name; thread-safe enough (one run at a time)."""
    load_s: dict[str, float] = field(default_factory=dict)
    warm_s_per_method: dict[str, float] = field(default_factory=dict)
    tokens_per_s: dict[tuple[str, str], float] = field(default_factory=dict)   # (stack, method)

    def method_s(self, stack: str, method: str, tokens: int) -> Optional[float]:
        rate = self.tokens_per_s.get((stack, method))
        return tokens / rate if rate else None


TIMINGS = Timings()


def seconds_text(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


def left_text(left: Optional[float]) -> str:
    """'about 12 s left', or why there is no estimate."""
    if left is None:
        return "no earlier run here to estimate the time left from"
    return "less than a second left" if left < 1 else f"about {seconds_text(left)} left"


@dataclass
class RunPlan:
    """One live run's methods and tokens asked; says where it stands and what is left."""
    stack: str
    methods: list[str]
    tokens_asked: int
    timings: Timings = field(default_factory=lambda: TIMINGS)

    def later_s(self, after: int) -> Optional[float]:
        """Seconds the methods after index `after` should take; None if one was never measured."""
        parts = [self.timings.method_s(self.stack, m, self.tokens_asked) for m in self.methods[after + 1:]]
        return None if any(p is None for p in parts) else sum(parts)

    def stage_text(self, stage: str, expected_s: Optional[float], elapsed: float) -> str:
        """Loading or warm-up: which stage, and the time left of the whole run when known."""
        rest = self.later_s(-1)
        left = None if expected_s is None or rest is None else max(0.0, expected_s - elapsed) + rest
        return f"{stage}: {seconds_text(elapsed)} so far, then {self.methods_text()}; {left_text(left)}."

    def methods_text(self) -> str:
        return ", ".join(method_label(m) for m in self.methods)

    def method_text(self, method: str, tokens_done: int, elapsed: float, steps: int = 0) -> str:
        """'Running EAGLE-2 (method 2 of 3), step 5: 12 of 64 tokens; about 8 s left.'"""
        k = self.methods.index(method)
        this = self.timings.method_s(self.stack, method, self.tokens_asked - tokens_done)
        if tokens_done > 0 and elapsed > 0:      # this run's own rate is the freshest measure
            this = (self.tokens_asked - tokens_done) * elapsed / tokens_done
        later = self.later_s(k)
        if this is not None and later is None:
            left = f"{left_text(this)} for {method_label(method)}, the rest not measured yet"
        else:
            left = left_text(None if this is None else this + (later or 0.0))
        at = f", step {steps}" if steps else ""
        return (f"Running {method_label(method)} (method {k + 1} of {len(self.methods)}){at}: {tokens_done} of "
                f"{self.tokens_asked} tokens; {left}.")


def record_method(stack: str, method: str, tokens: int, seconds: float) -> None:
    if tokens > 0 and seconds > 0:
        TIMINGS.tokens_per_s[(stack, method)] = tokens / seconds


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
