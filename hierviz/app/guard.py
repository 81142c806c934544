"""What a visitor of a public deployment may ask for (docs/security.md).

The stack box offers presets only: a stack name from a visitor is a key into that list, never a
path, unless the operator sets HIERVIZ_ALLOW_CUSTOM_STACKS=1 for a local or private run (the stack
given to `python app.py --stack` is the operator's and always allowed). Hub presets are offered
only where a GPU can run them. Live runs are capped per device (new tokens, tree sizes) and per
visitor (runs a minute); messages shown to a visitor never carry a server path.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from typing import Optional

from hierviz.config import options
from hierviz.decoding.settings import DecodeSettings, SettingsError
from hierviz.engine import STACK_PRESETS
from hierviz.stack import is_local_preset

# caps of a live run where the operator sets none (HIERVIZ_MAX_NEW_TOKENS / HIERVIZ_MAX_TREE_SIZE):
# a CPU decodes the offline stack at a few tokens a second, a GPU two orders faster
DEVICE_CAPS = {"cpu": {"max_new_tokens": 256, "tree_size": 64}, "cuda": {"max_new_tokens": 1024, "tree_size": 128}}
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[.~]{0,2}/)[^\s'\"(),:;]+")


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


def check_caps(s: DecodeSettings, device: str) -> None:
    """SettingsError when a validated run asks for more than this server gives one run."""
    c = caps(device)
    if s.max_new_tokens > c["max_new_tokens"]:
        raise SettingsError(f"max_new_tokens must be at most {c['max_new_tokens']} on this server")
    for name, size in (("E_M", s.m_tree_size), ("E_T", s.t_tree_size)):
        if size > c["tree_size"]:
            raise SettingsError(f"{name} tree size must be at most {c['tree_size']} on this server")


def redact_paths(message: str) -> str:
    """A message without file-system paths (load errors name files the visitor must not learn of)."""
    return _PATH.sub("<file>", message)


class RateLimit:
    """At most `options().runs_per_minute` live runs started per visitor in any 60 s."""

    def __init__(self) -> None:
        self._starts: dict[str, deque] = {}
        self._lock = threading.Lock()

    def admit(self, key: str, now: Optional[float] = None) -> None:
        limit = options().runs_per_minute
        now = time.monotonic() if now is None else now
        with self._lock:
            starts = self._starts.setdefault(key, deque())
            while starts and now - starts[0] >= 60.0:
                starts.popleft()
            if len(starts) >= limit:
                wait = 60.0 - (now - starts[0])
                raise VisitorError(f"You started {limit} runs in the last minute; the next can start in "
                                   f"{wait:.0f} s.")
            starts.append(now)

    def forget(self, key: str) -> None:
        with self._lock:
            self._starts.pop(key, None)


RATE = RateLimit()
