"""What a visitor of a public deployment may ask for (docs/security.md).

The stack box offers presets only: a stack name from a visitor is a key into that list, never a
path, unless the operator sets HIERVIZ_ALLOW_CUSTOM_STACKS=1 for a local or private run (the stack
given to `python app.py --stack` is the operator's and always allowed). Hub presets are offered
only where a GPU can run them. Live runs are capped per device (new tokens, tree sizes), per
visitor (runs a minute of one page) and per client address (runs a minute of every page and
script from one address); messages shown to a visitor never carry a server path. A refused input
is logged as one line (`log_refusal`), never a traceback, and at most REFUSALS_LOGGED a minute.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import re
import threading
import time
from collections import deque
from typing import Any, Optional

from hierviz.config import options
from hierviz.settings import DecodeSettings, SettingsError
from hierviz.engine import STACK_PRESETS
from hierviz.stack import is_local_preset

# caps of a live run where the operator sets none (HIERVIZ_MAX_NEW_TOKENS / HIERVIZ_MAX_TREE_SIZE):
# a CPU decodes the offline stack at a few tokens a second, a GPU two orders faster
DEVICE_CAPS = {"cpu": {"max_new_tokens": 256, "tree_size": 64}, "cuda": {"max_new_tokens": 1024, "tree_size": 128}}
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[.~]{0,2}/)[^\s'\"(),:;]+")
REFUSALS_LOGGED = 60        # refused inputs logged a minute at most; the rest are counted
WINDOW_S = 60.0             # the rate limits' window
MAX_TRACKED = 10_000        # sessions and addresses the rate limit remembers before it drops idle ones
log = logging.getLogger("hierviz.app.refused")


class VisitorError(ValueError):
    """A request a visitor may not make; the message is fit to show them."""


def offered_stacks(operator_stack: Optional[str], gpu: bool) -> list[str]:
    """The stacks the page lists: local presets always, hub presets with a GPU, and the operator's."""
    names = [n for n in STACK_PRESETS if gpu or is_local_preset(n)]
    if operator_stack and operator_stack not in names:
        names.append(operator_stack)
    return names


def check_stack(name: object, offered: list[str]) -> str:
    """The stack to load for a visitor's choice `name`; VisitorError when it is not offered."""
    if isinstance(name, str) and (name in offered or (options().allow_custom_stacks and name.strip())):
        return name
    raise VisitorError("Unknown model stack: choose one of the stacks in the list.")


def caps(device: str) -> dict[str, int]:
    o = options()
    base = DEVICE_CAPS["cuda" if device.startswith("cuda") else "cpu"]
    return {"max_new_tokens": o.max_new_tokens or base["max_new_tokens"], "tree_size": o.max_tree_size or base["tree_size"]}


def check_caps(s: DecodeSettings, device: str, names: Optional[dict[str, str]] = None) -> None:
    """SettingsError when a validated run asks for more than this server gives one run; `names`:
    what the message calls each setting (DecodeSettings.validate's)."""
    c, names = caps(device), names or {}
    if s.max_new_tokens > c["max_new_tokens"]:
        raise SettingsError(f"{names.get('max_new_tokens', 'max_new_tokens')} must be at most "
                            f"{c['max_new_tokens']} on this server", setting="max_new_tokens")
    for field, name in (("m_tree_size", "E_M"), ("t_tree_size", "E_T")):
        if getattr(s, field) > c["tree_size"]:
            raise SettingsError(f"{names.get(field, f'{name} tree size')} must be at most {c['tree_size']} "
                                "on this server", setting=field)


def redact_paths(message: str) -> str:
    """A message without file-system paths (load errors name files the visitor must not learn of)."""
    return _PATH.sub("<file>", message)


def client_address(request: Any) -> str:
    """The visitor's address for the per-address limit. Behind `options().proxy_hops` proxies it is
    the entry the outermost of them appended to X-Forwarded-For (counted from the right: entries to
    its left are whatever the client sent, so a script could vary them at will); with no proxy it
    is the peer's. IPv6 addresses count by their /64 network, which one subscriber gets whole."""
    hops = options().proxy_hops
    peer = getattr(getattr(request, "client", None), "host", None) or "unknown"
    entries: list[str] = []
    if hops:
        headers = getattr(request, "headers", None) or {}
        values = headers.getlist("x-forwarded-for") if hasattr(headers, "getlist") else [headers.get("x-forwarded-for", "")]
        entries = [e.strip() for v in values if v for e in v.split(",") if e.strip()]
    address = entries[-hops] if hops and len(entries) >= hops else peer
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class RateLimit:
    """Live runs started in any WINDOW_S, per visitor (session) and per client address."""

    def __init__(self) -> None:
        self._starts: dict[str, deque] = {}
        self._lock = threading.Lock()

    def admit(self, session: str, address: str, now: Optional[float] = None) -> None:
        """Count a run of this visitor from this address; VisitorError (nothing counted) when
        either has started its limit of runs in the window."""
        o = options()
        now = time.monotonic() if now is None else now
        with self._lock:
            self._drop_idle(now)
            checks = ((f"session:{session}", o.runs_per_minute, "You started {runs} in the last minute"),
                      (f"address:{address}", o.runs_per_address,
                       "{runs} were started from your network address in the last minute"))
            for key, limit, said in checks:
                starts = self._starts.setdefault(key, deque())
                while starts and now - starts[0] >= WINDOW_S:
                    starts.popleft()
                if len(starts) >= limit:
                    wait = math.ceil(WINDOW_S - (now - starts[0]))
                    runs = f"{limit} run{'s' if limit != 1 else ''}"
                    raise VisitorError(said.format(runs=runs) + f"; the next can start in {wait} s.")
            for key, _, _ in checks:
                self._starts[key].append(now)

    def forget(self, session: str) -> None:
        """A closed page. Its address keeps its count: a new page from there must not reset it."""
        with self._lock:
            self._starts.pop(f"session:{session}", None)

    def _drop_idle(self, now: float) -> None:
        if len(self._starts) < MAX_TRACKED:
            return
        for key in [k for k, d in self._starts.items() if not d or now - d[-1] >= WINDOW_S]:
            del self._starts[key]


RATE = RateLimit()


class RefusalLog:
    """One line per refused input, at most REFUSALS_LOGGED a minute: a visitor can send bad inputs
    as fast as they like, and the log must not grow at their will."""

    def __init__(self) -> None:
        self._window_start = 0.0
        self._logged = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def __call__(self, where: str, message: str, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._window_start >= WINDOW_S:
                if self._dropped:
                    log.info("%d more refused inputs in the last minute were not logged", self._dropped)
                self._window_start, self._logged, self._dropped = now, 0, 0
            if self._logged >= REFUSALS_LOGGED:
                self._dropped += 1
                return
            self._logged += 1
        # ascii(): a visitor's text may hold newlines or terminal escapes that would forge log lines
        log.info("refused %s: %s", where, ascii(message[:200]))


log_refusal = RefusalLog()
