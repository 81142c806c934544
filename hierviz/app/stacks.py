"""The model stacks the app offers and the one it keeps loaded.

A stack is loaded once per process and shared by every visitor; only one is kept, so switching
presets frees the previous one's memory (live runs are one at a time: the "gpu" concurrency group).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from hierviz.app.guard import offered_stacks
from hierviz.config import options
from hierviz.engine import load_stack
from hierviz.stack import DEFAULT_STACK


class StackCache:
    """At most one loaded stack, by name."""

    def __init__(self) -> None:
        self._stacks: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        with self._lock:
            if name not in self._stacks:
                self._stacks.clear()
                self._stacks[name] = load_stack(name)
            return self._stacks[name]

    def clear(self) -> None:
        """Drop the loaded stack (after running out of memory, so the next run starts clean)."""
        with self._lock:
            self._stacks.clear()


STACKS = StackCache()


def get_stack(name: str) -> Any:
    return STACKS.get(name)


def clear_stacks() -> None:
    STACKS.clear()


def device_kind() -> str:
    """Where live runs go: "cuda" with a GPU, else "cpu" (what caps and offered stacks depend on)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


_operator: dict[str, Optional[str]] = {"stack": None}


def set_operator_stack(name: Optional[str]) -> None:
    """The stack the operator started the app with (`python app.py --stack`): always offered."""
    _operator["stack"] = name


def stack_choices() -> list[str]:
    """The stacks a visitor may pick: see hierviz.app.guard.offered_stacks."""
    operator = _operator["stack"] or options().stack
    return offered_stacks(operator, device_kind() == "cuda") or [DEFAULT_STACK]


def default_stack() -> str:
    """HIERVIZ_STACK if set, else the offline SmolLM2 stack (else the first preset)."""
    choices = stack_choices()
    return options().stack or (DEFAULT_STACK if DEFAULT_STACK in choices else choices[0])
