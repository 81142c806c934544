"""Per-visitor state.

`Session` is what one browser tab is looking at; it lives in a `gr.State`, so every visitor has
their own copy (Gradio copies the initial value once per visitor; their events then share that
object, so a Session's own fields, such as the replay counter, reach a running generator).
`SessionRegistry` holds the few flags that must reach a run from *another* event of the same
visitor without its State (Stop and the page's "drawn" reports are queue-free events that take no
inputs, and a closed page must stop its runs, waiting in line included). The registry is keyed by
Gradio's session hash and forgets a visitor when their page closes, so a public app does not grow.

What one visitor's runs may take in memory is bounded (HIERVIZ_STATE_MB), counted as loaded:
`state_bytes` estimates the parsed traces' size from what they hold (steps, trees, tree nodes,
tokens and every text), not from the size of a file as uploaded; a 20 MB upload of small nodes
takes 50-90 MB once parsed, one of long texts about its own size.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hierviz.methods import SUBJECT
from hierviz.config import options
from hierviz.trace import Step, Trace

_REPLAY_LOCK = threading.Lock()   # a replay's check-and-step, atomic with every stop (any visitor: tiny sections)
SESSION_TTL_S = 1800        # an idle visitor's runs are dropped after this many seconds
STATE_CAPACITY = 64         # visitors whose state Gradio keeps at most (the least recent go first)
MAX_FLAGS = 10_000          # visitors' flags kept before those idle for SESSION_TTL_S are dropped
LOAD_WAITS_FOR_RUN_S = 10.0 # a trace load waits this long at most for the visitor's run to end


@dataclass(frozen=True)
class RepeatHistory:
    """HierSpec's whole-run speedups in each of a visitor's live runs of one prompt, one set of
    settings and one stack (`key`), oldest first; a run of anything else starts a new history."""
    key: tuple = ()
    ratios: tuple[dict[str, dict[str, float]], ...] = ()   # per run: time scale -> other method -> speedup

    def add(self, key: tuple, ratios: dict[str, dict[str, float]]) -> "RepeatHistory":
        """This history with one more run of `key`; a run of another key replaces it."""
        return RepeatHistory(key, (self.ratios if key == self.key else ()) + (ratios,))

    def repeats(self) -> dict[str, dict[str, list[float]]]:
        """time scale -> other method -> the speedup in each run (viz.panels.Repeats)."""
        out: dict[str, dict[str, list[float]]] = {}
        for run in self.ratios:
            for scale, by_method in run.items():
                for method, speedup in by_method.items():
                    out.setdefault(scale, {}).setdefault(method, []).append(speedup)
        return out


@dataclass
class LiveRun:
    """A live run in flight, for what the page's headline says while it runs."""
    methods: tuple[str, ...]          # in the order they run
    device: str                       # where it runs, in words: "CPU", "GPU"
    running: Optional[str] = None     # the method running now (None: loading or warming up)


@dataclass
class Session:
    runs: list[Trace] = field(default_factory=list)
    view: str = SUBJECT             # the method whose steps the panels show
    step: int = -1                  # inspected step of that run (-1: the latest)
    follow: bool = True             # live updates move the panels to the newest step
    source: str = ""                # "live run" or the trace file name
    download: Optional[str] = None  # path of the comparison JSON the page offers
    time_scale: Optional[str] = None  # hierviz.retime.TIME_SCALES choice (None: the runs' default)
    side_by_side: bool = False      # show EAGLE-2's step at the same token count beside HierSpec's
    history: RepeatHistory = field(default_factory=RepeatHistory)   # the visitor's repeated live runs
    counted: bool = False           # these runs are the history's latest (a whole live run, not stopped)
    replay: int = 0                 # the replay that may move the step; every stop (hierviz.app.handlers) counts
    live: Optional[LiveRun] = None  # the live run in flight that these runs come from (None once it ended)

    def carried(self, **fields: Any) -> "Session":
        """A new Session for a new set of runs that keeps what the visitor chose and ran before: the
        side-by-side view and the history of their repeated live runs. A replay of the old runs stops."""
        self.stop_replay()
        return Session(side_by_side=self.side_by_side, history=self.history, **fields)

    def stop_replay(self) -> int:
        """Stops a running replay before its next step: once this returns, no replay moves the step.
        Returns the number a new replay runs under."""
        with _REPLAY_LOCK:
            self.replay += 1
            return self.replay

    def replay_moves(self, replay: int, move: Callable[[], Any]) -> bool:
        """Runs `move` (a replay's next step) only while `replay` is still the running one: a replay
        the visitor stopped (Pause, another step, run or trace) must not move the step they see."""
        with _REPLAY_LOCK:
            if self.replay != replay:
                return False
            move()
            return True

    def run(self, method: Optional[str] = None) -> Optional[Trace]:
        """The run of `method` (default: the viewed one), else the first run, else None."""
        method = method or self.view
        return next((t for t in self.runs if t.meta.get("method") == method), self.runs[0] if self.runs else None)

    def others(self, main: Optional[Trace]) -> list[Trace]:
        return [t for t in self.runs if t is not main]


# Bytes each part of a parsed trace takes, its texts aside (CPython 3.11, tracemalloc over traces
# of thousands of steps): a step with its dicts and lists, one new token (id, text and source
# entries), a tree, a tree node, a sequence-draft token
STEP_BYTES, TOKEN_BYTES, TREE_BYTES, NODE_BYTES, SEQ_BYTES = 1040, 90, 340, 220, 170


def text_bytes(text: str) -> int:
    # CPython shares the empty string and one-character Latin-1 strings; any other text is its own object
    return 0 if len(text) == 0 or (len(text) == 1 and ord(text) < 256) else sys.getsizeof(text)


def value_bytes(value: object) -> int:
    """A JSON value's size in memory, containers included (a trace's meta: any JSON an upload holds)."""
    size, todo = 0, [value]
    while todo:
        v = todo.pop()
        size += text_bytes(v) if isinstance(v, str) else sys.getsizeof(v)
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return size


def step_bytes(step: Step) -> int:
    """What one step takes in memory (see the constants above)."""
    size = STEP_BYTES + len(step.new_tokens) * TOKEN_BYTES + sum(text_bytes(t) for t in step.new_text)
    size += text_bytes(step.target_bonus_text)
    for tree in step.trees:
        size += TREE_BYTES + text_bytes(tree.root_text) + text_bytes(tree.bonus_text)
        size += len(tree.nodes) * NODE_BYTES + sum(text_bytes(n.text) for n in tree.nodes)
    return size + len(step.sequence) * SEQ_BYTES + sum(text_bytes(t.text) for t in step.sequence)


def run_bytes(trace: Trace) -> int:
    """One trace's size in memory but its steps: its metadata and texts."""
    return value_bytes(trace.meta) + text_bytes(trace.output_text) + text_bytes(trace.finish_reason)


def state_bytes(runs: list[Trace]) -> int:
    """What a visitor's runs take in memory, estimated from what they hold (module docstring)."""
    return sum(run_bytes(t) + sum(step_bytes(s) for s in t.steps) for t in runs)


def state_limit_mb() -> int:
    """What one visitor's runs may take (HIERVIZ_STATE_MB), in MB of state_bytes' estimate."""
    return options().state_mb


@dataclass
class SessionFlags:
    stops: int = 0            # Stop presses so far; a run stops when this passes the count at its start
    loads: int = 0            # traces loaded so far; a run started before one stops and shows nothing more
    running: int = 0          # live runs of the visitor in flight (waiting in line included)
    rendered: threading.Event = field(default_factory=threading.Event)  # the page drew the last update
    reporting: bool = False   # the page has reported drawing at least once (API clients never do)
    tree_drawn: tuple[str, float] = ("", 0.0)   # the last draft tree the page drew (its title) and when
    used: float = field(default_factory=time.monotonic)   # when an event of the visitor last asked

    def stop_signal(self) -> Callable[[], bool]:
        """Whether Stop was pressed since now: a run takes this when it is submitted, so a Stop
        pressed while it waits in line reaches it, and a Stop before it (a stale one) does not."""
        since = self.stops
        return lambda: self.stops > since

    def load_signal(self) -> Callable[[], bool]:
        """Whether a trace was loaded since now: the page shows it, so a run in flight must stop and
        send nothing more (its updates would put its own runs back over the trace)."""
        since = self.loads
        return lambda: self.loads > since


def session_key(request: Any) -> str:
    """The registry key of a request: Gradio's session hash (one per open page)."""
    return getattr(request, "session_hash", None) or "anonymous"


class SessionRegistry:
    """Flags per visitor, created on first use; thread-safe (events run in worker threads)."""

    def __init__(self) -> None:
        self._flags: dict[str, SessionFlags] = {}
        self._lock = threading.Lock()

    def flags(self, key: str) -> SessionFlags:
        with self._lock:
            if key not in self._flags and len(self._flags) >= MAX_FLAGS:
                self._drop_idle()
            flags = self._flags.setdefault(key, SessionFlags())
            flags.used = time.monotonic()
            return flags

    def _drop_idle(self) -> None:
        # API clients never close a page, so their flags would pile up; a visitor idle this long
        # has no run left (a run is far shorter), and their next event starts afresh
        now = time.monotonic()
        for key in [k for k, f in self._flags.items() if now - f.used > SESSION_TTL_S]:
            del self._flags[key]

    def request_stop(self, key: str) -> None:
        flags = self.flags(key)
        with self._lock:
            flags.stops += 1

    def trace_loaded(self, key: str, wait_s: float = LOAD_WAITS_FOR_RUN_S) -> None:
        """The visitor's page is about to show a loaded trace: a run of theirs in flight stops and
        sends nothing more. Returns once it has ended (at most `wait_s`): it ends after the step it
        is taking, and an update it sent before must reach the page before the trace does."""
        flags = self.flags(key)
        with self._lock:
            flags.loads += 1      # first: a run that sees the stop must already see it is replaced
            flags.stops += 1
        until = time.monotonic() + wait_s
        while flags.running > 0 and time.monotonic() < until:
            time.sleep(0.02)

    def mark_rendered(self, key: str) -> None:
        """The page `key` reports that it drew the last update."""
        flags = self.flags(key)
        flags.reporting = True
        flags.rendered.set()

    def mark_tree_drawn(self, key: str, title: str) -> None:
        """The page `key` reports the draft tree on screen, by its title, once it is drawn; it reports
        again when nothing changed, so only a new title counts."""
        flags = self.flags(key)
        flags.reporting = True
        if title != flags.tree_drawn[0]:
            flags.tree_drawn = (title, time.monotonic())

    def is_reporting(self, key: str) -> bool:
        with self._lock:
            flags = self._flags.get(key)
        return flags is not None and flags.reporting

    def forget(self, key: str) -> None:
        """A closed page: its runs, running or waiting in line, stop; its flags go."""
        with self._lock:
            flags = self._flags.pop(key, None)
            if flags is not None:
                flags.stops += 1

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._flags


SESSIONS = SessionRegistry()
