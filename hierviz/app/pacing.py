"""Render pacing: a live run waits for a page on this machine to draw each streamed update.

A browser on the machine that computes draws every update on the same cores as the engine: on a
2-core CPU the offline stack ran markedly slower watched in a local Chromium than streamed to an
API client, and a first run's comparison could say the opposite of `bench`. So the page reports each
drawn status update (a `change` listener running RENDERED_JS) and the run waits for that report
before its next step, up to PACE_MAX_S. Steps are timed by the engine, not the time between them,
so the figures stay those of an unwatched run. Only pages that have reported at least once are
waited for: API clients never report, and must never be slowed down.

HIERVIZ_UI_PACE (hierviz.config): auto (pace pages on this machine), on (every reporting page), off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hierviz.app.session import SESSIONS, SessionFlags, session_key
from hierviz.config import options

PACE_MAX_S = 1.0
# Resolves once the page has painted the update and its main thread has gone idle (the plots
# finish drawing after the status line); browsers without requestIdleCallback use a timer.
RENDERED_JS = """() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => {
    const idle = window.requestIdleCallback || ((f) => setTimeout(f, 50));
    idle(() => done([]), {timeout: 900});
})))"""
# Resolves once the page has painted the update (a replay's tree: the page is busy with the next
# steps meanwhile, so it would not go idle before RENDERED_JS's timeout).
PAINTED_JS = "() => new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done([]))))"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost"}


def pace_mode() -> str:
    """'auto', 'on' or 'off'; hierviz.config.ConfigError (a ValueError) for any other value."""
    return options().ui_pace


def should_pace(request: Any, mode: Optional[str] = None) -> bool:
    """Whether a run waits for this request's page to draw each update (see the module docstring)."""
    mode = mode or pace_mode()
    if mode == "off" or not SESSIONS.is_reporting(session_key(request)):
        return False
    if mode == "on":
        return True
    host = getattr(getattr(request, "client", None), "host", None)
    return host in LOOPBACK


@dataclass
class Pacer:
    """One live run's pacing: `wait` after each streamed update; `paced` says whether it ever waited."""
    request: Any
    flags: SessionFlags
    mode: str
    paced: bool = False

    def before_update(self) -> None:
        self.flags.rendered.clear()

    def wait(self) -> None:
        if should_pace(self.request, self.mode):
            self.paced = True
            self.flags.rendered.wait(PACE_MAX_S)   # untimed: the browser draws, the engine waits
