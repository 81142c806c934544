"""The model stacks the app offers and the one it keeps loaded.

A stack is loaded once per process and shared by every visitor; only one is kept, so switching
presets frees the previous one's memory (live runs are one at a time: the "gpu" concurrency group).
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Optional

import torch

from hierviz import memory
from hierviz.app.guard import offered_stacks
from hierviz.config import options
from hierviz.engine import load_stack
from hierviz.stack import DEFAULT_STACK, MODEL_KEYS, PRESET_DIR


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

    def loaded(self, name: str) -> bool:
        """Whether `name` is the stack in memory (a run of it needs no loading)."""
        with self._lock:
            return name in self._stacks

    def clear(self) -> None:
        """Drop the loaded stack (after running out of memory, so the next run starts clean)."""
        with self._lock:
            self._stacks.clear()


STACKS = StackCache()


def get_stack(name: str) -> Any:
    return STACKS.get(name)


def is_loaded(name: str) -> bool:
    return STACKS.loaded(name)


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


# The stack the page opens with on a GPU it fits: the HierSpec paper's (Llama-3-70B W4A16 target, ~71 GB);
# README.md's front matter preloads its hub repositories into a Space's cache at build time
LARGE_GPU_STACK = "paper-llama3-70b"
TRUE_WORDS = {"1", "on", "yes", "true"}


def gpu_memory_bytes() -> Optional[int]:
    """The first CUDA GPU's memory in bytes; None without one."""
    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def preset_spec(name: str) -> Optional[dict[str, Any]]:
    """A preset's stack file as a dict; None when it is missing or unreadable."""
    try:
        spec = json.loads((PRESET_DIR / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return spec if isinstance(spec, dict) else None


def fits_this_gpu(name: str) -> bool:
    """Whether the preset fits this machine's GPU by hierviz.memory's estimate (from the bundled
    model shapes, no download), with its margin; False without a GPU or an estimate."""
    capacity, spec = gpu_memory_bytes(), preset_spec(name)
    parts = memory.shape_estimate(spec) if spec else None
    if capacity is None or parts is None:
        return False
    try:
        memory.check_fits(name, parts, capacity, "this GPU")
    except memory.StackTooLarge:
        return False
    return True


def hub_repos(name: str) -> list[str]:
    """The hub repositories a preset's models and tokenizer come from (what a Space preloads)."""
    spec = preset_spec(name) or {}
    paths = [(spec.get(k) or {}).get("path") for k in MODEL_KEYS] + [spec.get("tokenizer")]
    return list(dict.fromkeys(p for p in paths if isinstance(p, str) and p.count("/") == 1
                              and not p.startswith(("pypi:", ".", "/", "~"))))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE_WORDS


def models_reachable(name: str) -> bool:
    """Whether a preset's models can be loaded: online, from the hub (or its cache); with
    HF_HUB_OFFLINE=1, only when every repository's config.json is in the local hub cache."""
    if not hub_offline():
        return True
    from huggingface_hub import try_to_load_from_cache
    return all(isinstance(try_to_load_from_cache(repo, "config.json"), str) for repo in hub_repos(name))


def default_stack() -> str:
    """HIERVIZ_STACK if set; else the paper's stack (LARGE_GPU_STACK) on a CUDA GPU that it fits and
    whose models it can reach; else the offline SmolLM2 stack (else the first preset)."""
    choices = stack_choices()
    if options().stack:
        return options().stack
    if (device_kind() == "cuda" and LARGE_GPU_STACK in choices and fits_this_gpu(LARGE_GPU_STACK)
            and models_reachable(LARGE_GPU_STACK)):
        return LARGE_GPU_STACK
    return DEFAULT_STACK if DEFAULT_STACK in choices else choices[0]
