"""Per-visitor state.

`Session` is what one browser tab is looking at; it lives in a `gr.State`, so every visitor has
their own copy. `SessionRegistry` holds the few flags that must reach a run from *another* event of
the same visitor (Stop, the page's "drawn" reports): a Stop click is its own event, and Gradio
copies gr.State values between events, so a flag inside the State would not reach the running
generator. The registry is keyed by Gradio's session hash and forgets a visitor when their page
closes, so a public app does not grow.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from hierviz.trace import Trace

SESSION_TTL_S = 1800        # an idle visitor's runs are dropped after this many seconds
STATE_CAPACITY = 64         # visitors whose state Gradio keeps at most (the least recent go first)


@dataclass
class Session:
    runs: list[Trace] = field(default_factory=list)
    view: str = "hierspec"          # the method whose steps the panels show
    step: int = -1                  # inspected step of that run (-1: the latest)
    follow: bool = True             # live updates move the panels to the newest step
    source: str = ""                # "live run" or the trace file name
    download: Optional[str] = None  # path of the saved comparison JSON

    def run(self, method: Optional[str] = None) -> Optional[Trace]:
        """The run of `method` (default: the viewed one), else the first run, else None."""
        method = method or self.view
        return next((t for t in self.runs if t.meta.get("method") == method), self.runs[0] if self.runs else None)

    def others(self, main: Optional[Trace]) -> list[Trace]:
        return [t for t in self.runs if t is not main]


@dataclass
class SessionFlags:
    stop: threading.Event = field(default_factory=threading.Event)      # Stop was pressed
    rendered: threading.Event = field(default_factory=threading.Event)  # the page drew the last update
    reporting: bool = False   # the page has reported drawing at least once (API clients never do)


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
            return self._flags.setdefault(key, SessionFlags())

    def mark_rendered(self, key: str) -> None:
        """The page `key` reports that it drew the last update."""
        flags = self.flags(key)
        flags.reporting = True
        flags.rendered.set()

    def is_reporting(self, key: str) -> bool:
        with self._lock:
            flags = self._flags.get(key)
        return flags is not None and flags.reporting

    def forget(self, key: str) -> None:
        with self._lock:
            self._flags.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._flags


SESSIONS = SessionRegistry()
