"""The line for the device: live runs one at a time, in order of arrival, with a bound of their own.

Gradio's queue has one size limit for every event of the app (`queue(max_size=...)` counts the
events waiting in every concurrency group together), so runs waiting in it would lock everyone
out of everything: scrubbing, loading a trace and Stop would be refused "Queue is full" while the
line for runs is full. So runs do not wait in Gradio's queue: a run's event starts at once (no
concurrency limit of its own), checks its inputs, then takes a `Ticket` here, and waits (an
asyncio sleep, holding no worker thread) until its ticket is at the head. The line refuses a
ticket when `options().queue_size` runs already wait, and estimates each waiting run's start
from the measured durations of the last runs (`RECENT` of them). The other tabs' device work
(What-if live run, Profile measurement) takes its turn here too (`DeviceLine.hold`).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from hierviz.app.guard import VisitorError
from hierviz.config import options

RECENT = 8          # runs whose durations the estimate averages
POLL_S = 0.2        # how often a waiting run looks whether its turn came


@dataclass(eq=False)
class Ticket:
    key: str                                   # the visitor's session
    arrived: float = field(default_factory=time.monotonic)
    started: Optional[float] = None            # when it reached the head of the line


class DeviceLine:
    """First come, first served; thread-safe (sync handlers block in `hold`, async ones poll)."""

    def __init__(self) -> None:
        self._tickets: list[Ticket] = []
        self._durations: deque[float] = deque(maxlen=RECENT)
        self._changed = threading.Condition()

    def join(self, key: str) -> Ticket:
        """A place in the line; VisitorError when `options().queue_size` runs already wait."""
        size = options().queue_size
        with self._changed:
            if len(self._tickets) > size:           # the head is running, not waiting
                raise VisitorError(f"The line for live runs is full ({size} runs are waiting). Try again in a "
                                   "minute; recorded traces load and replay meanwhile.")
            ticket = Ticket(key)
            self._tickets.append(ticket)
            self._promote()
            return ticket

    def leave(self, ticket: Ticket) -> None:
        """The run ended, or gave up its place; the next in line goes. Idempotent."""
        with self._changed:
            if ticket not in self._tickets:
                return
            if ticket.started is not None:
                self._durations.append(time.monotonic() - ticket.started)
            self._tickets.remove(ticket)
            self._promote()
            self._changed.notify_all()

    def position(self, ticket: Ticket) -> int:
        """0: its turn; n: n runs go before it; -1: not in the line."""
        with self._changed:
            return self._tickets.index(ticket) if ticket in self._tickets else -1

    def runs_of(self, key: str) -> tuple[bool, int]:
        """Whether the visitor `key` has the running run, and how many of theirs wait."""
        with self._changed:
            mine = [i for i, t in enumerate(self._tickets) if t.key == key]
            return (bool(mine) and mine[0] == 0), len([i for i in mine if i > 0])

    def busy(self) -> bool:
        with self._changed:
            return bool(self._tickets)

    def waiting(self) -> int:
        with self._changed:
            return max(0, len(self._tickets) - 1)

    def typical_s(self) -> Optional[float]:
        """The mean duration of the last runs, None before the first one ended."""
        with self._changed:
            return sum(self._durations) / len(self._durations) if self._durations else None

    def eta_s(self, ticket: Ticket) -> Optional[float]:
        """Seconds until `ticket`'s turn: what is left of the running run, then one typical run
        for each run between; None while no run has been measured."""
        typical = self.typical_s()
        with self._changed:
            if typical is None or ticket not in self._tickets:
                return None
            ahead = self._tickets.index(ticket)
            if ahead == 0:
                return 0.0
            head = self._tickets[0]
            left = typical - (time.monotonic() - head.started) if head.started is not None else typical
            return max(0.0, left) + (ahead - 1) * typical

    @contextmanager
    def hold(self, key: str, stopped: Callable[[], bool] = lambda: False) -> Iterator[bool]:
        """For sync device work: wait in line (blocking this thread) and hold the device inside the
        block; yields False when `stopped()` became true before the turn came."""
        ticket = self.join(key)
        try:
            with self._changed:
                while self._tickets[0] is not ticket and not stopped():
                    self._changed.wait(POLL_S)
                turn = self._tickets[0] is ticket
            yield turn
        finally:
            self.leave(ticket)

    def _promote(self) -> None:
        if self._tickets and self._tickets[0].started is None:
            self._tickets[0].started = time.monotonic()


LINE = DeviceLine()


def ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def waiting_text(position: int, eta: Optional[float]) -> str:
    """What a waiting visitor reads: their place and, once runs were measured, when theirs starts."""
    when = "" if eta is None else (f", starting in about {eta:.0f} s" if eta < 90 else
                                   f", starting in about {eta / 60:.0f} min")
    return (f"Waiting for the device: {ordinal(position)} in line{when}. Press Stop to leave the line; "
            "you can inspect your earlier runs meanwhile.")
