"""The engine's front door: run a method on a stack and stream a growing trace.

    stack = load_stack("smollm2-offline")
    for trace in run_method(stack, "hierspec", "Explain RoPE", DecodeSettings(max_new_tokens=64)):
        step = trace.steps[-1]
"""
from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from typing import Callable, Iterator, Optional

import torch

from hierviz import methods
from hierviz.decoding.decoders import cache_margin
from hierviz.settings import DecodeSettings, SettingsError
from hierviz.decoding.verify import Sampler
from hierviz.machine import gpu_name
from hierviz.models import cuda_graphs
from hierviz.stack import Stack, StackError, load_stack, preset_names, stack_comparison
from hierviz.methods import METHODS
from hierviz.trace import Trace, output_tokens

__all__ = ["EngineError", "run_method", "generate", "load_stack", "STACK_PRESETS", "DecodeSettings"]

STACK_PRESETS = preset_names()
MAX_PROMPT_CHARS = 20000


class EngineError(ValueError):
    """A run that cannot start or continue; the message is fit to show a user."""


def _versions() -> dict[str, str]:
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def prepare(stack: Stack, method: str, prompt: str, settings: DecodeSettings) -> tuple[list[int], int]:
    """Validate the request; returns (prompt token ids, KV cache length to allocate)."""
    if method not in METHODS:
        raise EngineError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    try:
        settings.validate()
    except SettingsError as e:
        raise EngineError(str(e)) from None
    if not isinstance(prompt, str) or not prompt.strip():
        raise EngineError("the prompt is empty: type a question or instruction")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise EngineError(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    missing = stack.models.missing(method)
    if missing:
        raise EngineError(f"stack {stack.name!r} has no {missing[0]}, which {method} needs")
    ids = stack.tokenizer.encode_chat(prompt)
    margin = cache_margin(settings)
    context = stack.max_position
    if len(ids) + 1 > context:
        raise EngineError(f"the prompt is {len(ids)} tokens long; the model's context is {context} tokens")
    if len(ids) + settings.max_new_tokens + margin > context:
        room = context - len(ids) - margin
        if room < 1:
            raise EngineError(f"the prompt ({len(ids)} tokens) plus the draft/tree room ({margin} slots) does not fit "
                              f"the {context}-token context: shorten the prompt or the trees")
        raise EngineError(f"prompt ({len(ids)} tokens) + max_new_tokens ({settings.max_new_tokens}) + draft room "
                          f"({margin}) exceeds the {context}-token context: ask for at most {room} new tokens")
    return ids, len(ids) + settings.max_new_tokens + margin


def run_method(stack: Stack, method: str, prompt: str, settings: DecodeSettings,
               should_stop: Optional[Callable[[], bool]] = None) -> Iterator[Trace]:
    """Yields the same growing Trace after every step; stops on EOS, max_new_tokens or should_stop()."""
    ids, max_len = prepare(stack, method, prompt, settings)
    tok = stack.tokenizer
    trace = Trace(meta={"method": method, **stack.meta, "settings": settings.to_dict(), "prompt": prompt,
                        "versions": _versions(), "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "host": platform.node(), **({"gpu": gpu} if (gpu := gpu_name(stack.device)) else {})},
                  prompt_tokens=len(ids))
    torch.manual_seed(settings.seed)
    sampler = Sampler(settings.temperature, settings.top_p, settings.seed)
    gen = methods.get(method).decode(stack.models, ids, settings, sampler, tok.token_text, max_len)
    out: list[int] = []
    t0 = time.perf_counter()
    while True:
        if should_stop is not None and should_stop():
            trace.finish_reason = "stopped"
            break
        try:
            with torch.no_grad():
                step = next(gen)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise EngineError("the GPU ran out of memory: try fewer new tokens or smaller trees") from None
        room = settings.max_new_tokens - len(out)
        cut = len(step.new_tokens)
        for j, t in enumerate(step.new_tokens[:room]):
            if t in tok.eos_ids:
                cut = j + 1
                trace.finish_reason = "eos"
                break
        cut = min(cut, room)
        if cut < len(step.new_tokens):
            step.new_tokens, step.new_text, step.new_sources = (step.new_tokens[:cut], step.new_text[:cut],
                                                                step.new_sources[:cut])
        out += step.new_tokens
        trace.steps.append(step)
        if step.index == 0:
            trace.prefill_ms = step.step_ms
        trace.output_text = tok.decode(out)
        if len(out) >= settings.max_new_tokens and not trace.finish_reason:
            trace.finish_reason = "length"
        trace.meta["wall_s"] = time.perf_counter() - t0
        yield trace
        if trace.finish_reason:
            break
    gen.close()


def generate(stack: Stack, method: str, prompt: str, settings: DecodeSettings) -> Trace:
    """Run to completion; returns the finished trace."""
    trace = None
    for trace in run_method(stack, method, prompt, settings):
        pass
    assert trace is not None
    return trace


WARMUP_PROMPT = "Say hello."


def _warm_key(method: str, settings: DecodeSettings) -> tuple:
    # graphs and buffers depend on the tree shapes, not on how many tokens a run writes
    return (method,) + tuple(sorted((k, v) for k, v in settings.to_dict().items() if k != "max_new_tokens"))


def is_warm(stack: Stack, methods: list[str], settings: DecodeSettings) -> bool:
    done = stack.warmed
    return all(_warm_key(m, settings) in done for m in methods)


def warm_up(stack: Stack, methods: list[str], settings: DecodeSettings, max_new_tokens: int = 8) -> None:
    """Run each method briefly once per stack and settings, so that first-call costs (dequantized
    weight caches, kernel packing, CUDA-graph captures) stay out of the runs that are timed and
    compared: otherwise whichever method runs first pays them all."""
    done = stack.warmed
    short = type(settings)(**{**settings.to_dict(), "max_new_tokens": max_new_tokens})
    ran = False
    for m in methods:
        if _warm_key(m, settings) not in done:
            generate(stack, m, WARMUP_PROMPT, short)
            done.add(_warm_key(m, settings))
            ran = True
    if ran:
        # the short run reaches few static buckets: a longer prompt's prefill compiled its W4 tiles
        # inside the first recorded H200 trace (HierSpec 1.76 s vs 0.40 s in a second process)
        cuda_graphs.prepare_models(stack.models.present())


__all__ += ["StackError", "output_tokens", "prepare", "warm_up", "is_warm", "stack_comparison"]
