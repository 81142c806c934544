"""Runtime options: every HIERVIZ_* environment variable is read here and nowhere else.

`options()` reads the environment on each call (cheap), so a test's monkeypatch or a deployment's
variables take effect without re-imports; `overrides(...)` replaces single options for a block of
code in this process without touching os.environ. docs/configuration.md lists every option.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence


class ConfigError(ValueError):
    """An environment variable with a value it cannot take; the message names it."""


@dataclass(frozen=True)
class Options:
    stack: Optional[str]        # HIERVIZ_STACK: the app's default stack (preset name)
    cache_dir: Path             # HIERVIZ_CACHE: converted GGUF weights, W4 proof verdicts (default ~/.cache/hierviz)
    static: bool                # HIERVIZ_STATIC: static-shape runners on CUDA (default on)
    cuda_graphs: bool           # HIERVIZ_CUDA_GRAPHS: CUDA graphs over the static runners (default on)
    fused: bool                 # HIERVIZ_FUSED: fused Triton layer kernels on CUDA fp16/bf16 (default on)
    w4_deterministic: bool      # HIERVIZ_W4_DETERMINISTIC: ordered split-K reduction (default on)
    w4_cuda: str                # HIERVIZ_W4_CUDA: auto | on | target | off, the CUDA MMA W4 kernel for fp16 products
    cpu_matmul: str             # HIERVIZ_CPU_MATMUL: auto | plain | nt, the CPU dense product's layout
    timing_sync: bool           # HIERVIZ_TIMING_SYNC: per-stage device syncs for exact stage times
    timing_events: bool         # HIERVIZ_TIMING_EVENTS: CUDA events for stage times (default on)
    ar_ahead: str               # HIERVIZ_AR_AHEAD: cuda | off | on, greedy AR's next forward queued before its token is read
    ui_pace: str                # HIERVIZ_UI_PACE: auto | on | off, the app's render pacing
    train_bf16: bool            # HIERVIZ_TRAIN_BF16: bf16 training on the CPU too (dry runs)
    # the public app (docs/security.md)
    allow_custom_stacks: bool   # HIERVIZ_ALLOW_CUSTOM_STACKS: visitors may name stack files (default off)
    queue_size: int             # HIERVIZ_QUEUE_SIZE: live runs waiting in the device line at most (default 20)
    runs_per_minute: int        # HIERVIZ_RUNS_PER_MINUTE: live runs one visitor (page) may start a minute (default 6)
    runs_per_address: int       # HIERVIZ_RUNS_PER_ADDRESS: live runs one client address may start a minute (default 20)
    proxy_hops: int             # HIERVIZ_PROXY_HOPS: proxies that append to X-Forwarded-For (default 1 on a Space, else 0)
    state_mb: int               # HIERVIZ_STATE_MB: memory one visitor's runs may take, as loaded (default 16)
    max_new_tokens: int         # HIERVIZ_MAX_NEW_TOKENS: cap on a live run's new tokens (default: by device)
    max_tree_size: int          # HIERVIZ_MAX_TREE_SIZE: cap on a live run's tree sizes (default: by device)


# HIERVIZ_W4_CUDA, the default first: "auto" runs a kind of fp16 W4 weight in the CUDA MMA kernel
# where it is proven and timed at least as fast at every row count (hierviz.quant.w4_choice), the
# Triton kernel elsewhere; "on" gives it every W4 weight (a warning where it cannot load), "target"
# a verifier's weights only, "off" none
W4_CUDA_MODES = ("auto", "off", "on", "target")
# HIERVIZ_AR_AHEAD, the default first: "cuda" queues greedy AR's forwards ahead
# (decoders.greedy_ar_ahead) on CUDA devices, where the host's work then overlaps the GPU's (on the
# CPU a forward is done before it returns: ahead, each token's step would only come one forward
# later); "off" one forward at a time; "on" on every device (the CPU tests run it so)
AR_AHEAD_MODES = ("cuda", "off", "on")

_FLAGS = {"static": "HIERVIZ_STATIC", "cuda_graphs": "HIERVIZ_CUDA_GRAPHS", "fused": "HIERVIZ_FUSED",
          "w4_deterministic": "HIERVIZ_W4_DETERMINISTIC", "timing_sync": "HIERVIZ_TIMING_SYNC",
          "timing_events": "HIERVIZ_TIMING_EVENTS"}
_CHOICES = {"cpu_matmul": ("HIERVIZ_CPU_MATMUL", ("auto", "plain", "nt")),
            "ui_pace": ("HIERVIZ_UI_PACE", ("auto", "on", "off")),
            "w4_cuda": ("HIERVIZ_W4_CUDA", W4_CUDA_MODES),
            "ar_ahead": ("HIERVIZ_AR_AHEAD", AR_AHEAD_MODES)}
_INTS = {"queue_size": ("HIERVIZ_QUEUE_SIZE", 20, 1, 1000), "runs_per_minute": ("HIERVIZ_RUNS_PER_MINUTE", 6, 1, 600),
         "runs_per_address": ("HIERVIZ_RUNS_PER_ADDRESS", 20, 1, 6000),
         "state_mb": ("HIERVIZ_STATE_MB", 16, 1, 4096),
         "max_new_tokens": ("HIERVIZ_MAX_NEW_TOKENS", 0, 0, 8192), "max_tree_size": ("HIERVIZ_MAX_TREE_SIZE", 0, 0, 512)}
ENV_NAMES = {**_FLAGS, **{k: v[0] for k, v in _CHOICES.items()}, **{k: v[0] for k, v in _INTS.items()},
             "stack": "HIERVIZ_STACK", "cache_dir": "HIERVIZ_CACHE", "train_bf16": "HIERVIZ_TRAIN_BF16",
             "allow_custom_stacks": "HIERVIZ_ALLOW_CUSTOM_STACKS", "proxy_hops": "HIERVIZ_PROXY_HOPS"}
# options that change what a measurement runs (kernels, graphs, timing): a recorded command names
# the ones set in its environment, so that running it again runs the same thing
MEASURED_OPTIONS = ("static", "cuda_graphs", "fused", "w4_deterministic", "w4_cuda", "cpu_matmul",
                    "timing_sync", "timing_events", "ar_ahead")
# variables that are not options but change a default
_DEFAULTS_FROM = ("SPACE_ID",)

_global_overrides: dict[str, Any] = {}


def _choice(name: str, allowed: tuple[str, ...]) -> str:
    v = (os.environ.get(name, allowed[0]).strip().lower() or allowed[0])
    if v not in allowed:
        raise ConfigError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {v!r}")
    return v


_cached: list[Any] = [None, None]     # (environment snapshot + overrides, Options)


def _int(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, not {raw!r}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, not {v}")
    return v


_ENV_READ = (*ENV_NAMES.values(), *_DEFAULTS_FROM)
# os.environ's own dict (bytes keys on POSIX), which setenv and `os.environ[k] = v` update: reading
# it skips the per-name encoding of os.environ.get, which made the snapshot 42 us of every call
_RAW_ENV = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_READ_RAW = tuple(os.fsencode(n) for n in _ENV_READ)


def _env_snapshot() -> tuple:
    if _RAW_ENV is not None:
        return tuple(map(_RAW_ENV.get, _ENV_READ_RAW))
    return tuple(os.environ.get(n) for n in _ENV_READ)


def options() -> Options:
    """The options in effect: the environment, then any `overrides` around the caller. Cached
    against a snapshot of the variables, since kernels consult it on every launch."""
    key = (_env_snapshot(), tuple(sorted(_global_overrides.items())) if _global_overrides else ())
    if _cached[0] == key:
        return _cached[1]
    opts = _read()
    _cached[0], _cached[1] = key, opts
    return opts


def _read() -> Options:
    env = os.environ
    values: dict[str, Any] = {k: env.get(v, "1") != "0" for k, v in _FLAGS.items()}
    values.update({k: _choice(*spec) for k, spec in _CHOICES.items()})
    values["stack"] = env.get("HIERVIZ_STACK") or None
    values["cache_dir"] = Path(env.get("HIERVIZ_CACHE") or Path.home() / ".cache" / "hierviz")
    values["train_bf16"] = env.get("HIERVIZ_TRAIN_BF16") == "1"
    values["allow_custom_stacks"] = env.get("HIERVIZ_ALLOW_CUSTOM_STACKS") == "1"
    values.update({k: _int(*spec) for k, spec in _INTS.items()})
    # a Hugging Face Space (SPACE_ID set) sees every visitor through its proxy, which appends the
    # visitor's address to X-Forwarded-For; elsewhere the peer address is the visitor's
    values["proxy_hops"] = _int("HIERVIZ_PROXY_HOPS", 1 if env.get("SPACE_ID") else 0, 0, 10)
    values.update(_global_overrides)
    return Options(**values)


@contextmanager
def overrides(**kw: Any) -> Iterator[None]:
    """Replace options for the code inside the block (None leaves one as it is). Process-wide,
    since runners and kernels consult the options from whichever thread runs them."""
    bad = [k for k in kw if k not in {f.name for f in dataclasses.fields(Options)}]
    if bad:
        raise TypeError(f"unknown option(s) {bad}")
    saved = dict(_global_overrides)
    _global_overrides.update({k: v for k, v in kw.items() if v is not None})
    try:
        yield
    finally:
        _global_overrides.clear()
        _global_overrides.update(saved)


def measured_settings() -> list[str]:
    """`NAME=value` for each of MEASURED_OPTIONS set in the environment, in that order."""
    names = [ENV_NAMES[o] for o in MEASURED_OPTIONS]
    return [f"{n}={shlex.quote(os.environ[n].strip())}" for n in names if os.environ.get(n, "").strip()]


def recorded_command(command: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command line a measurement records: the settings in the environment that change what it
    ran (MEASURED_OPTIONS, e.g. `HIERVIZ_W4_CUDA=target`), then `python -m hierviz <command>` and
    its arguments (sys.argv's when argv is None), quoted for a shell."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join([*measured_settings(), "python -m hierviz", command, shlex.join(args)]).rstrip()
