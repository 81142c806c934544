"""Where a Space's GPU comes from: ZeroGPU's `@spaces.GPU` when the `spaces` package is there.

On ZeroGPU (the free Hugging Face tier) a GPU is attached only inside a function decorated with
`spaces.GPU`, for at most the duration it asks for; the live run asks for a duration sized from
its settings. Elsewhere (a dedicated GPU Space, a CPU, a laptop) the decorator does nothing.
"""
from __future__ import annotations

from typing import Any, Callable

from hierviz.methods import comparison_order

try:
    import spaces  # type: ignore[import-not-found]
except ImportError:          # not on a Hugging Face Space
    spaces = None

# seconds: load/warm-up allowance, and per new token of each method (a GPU decodes the 70B
# preset's HierSpec at tens of tokens a second; AR at ~20)
BASE_S, PER_TOKEN_S, MAX_S = 60, 0.15, 300


def run_duration(settings: Any = None, methods: Any = tuple(comparison_order()), *rest: Any, **kw: Any) -> int:
    """The GPU time a live run asks ZeroGPU for, from its (validated) settings' new-token count and
    the number of methods; called with the device run's own arguments."""
    tokens = max(1, min(int(getattr(settings, "max_new_tokens", 64)), 8192))
    return int(min(MAX_S, BASE_S + max(1, len(methods)) * PER_TOKEN_S * tokens))


def on_gpu(duration: Callable[..., int]) -> Callable[[Callable], Callable]:
    """`spaces.GPU(duration=duration)` where the spaces package is installed, else nothing."""
    def wrap(fn: Callable) -> Callable:
        return fn if spaces is None else spaces.GPU(duration=duration)(fn)
    return wrap
