"""`python -m hierviz op-profile`: where one decode step's time goes, operator by operator.

    python -m hierviz op-profile --shape llama3-70b --layers 8 --out DIR        # on a GPU
    python -m hierviz op-profile --shape smollm2 --layers 2 --device cpu --out DIR
    python -m hierviz op-profile --shape llama3-8b --layers 1 --draft 3,10,29 --out DIR   # E_M's trees

Why: the engine's Llama-3-70B W4A16 one-token step takes ~36 ms on an H200 against a 9 ms
weight-read floor, and a 12% faster W4 GEMM did not move it (docs/kernels.md, docs/whatif.md).
This command builds a synthetic-weight model of the shape (the what-if's builder, `--layers`
of them so a big shape fits quickly), runs decode steps through the engine's own decoding
state (`BaseState`: the static-shape path on CUDA, run eagerly here because kernels inside a
CUDA graph are invisible to the profiler), and prints the operators by self device time
(CUDA) or self CPU time, per step and per layer, next to the step's wall time with and
without CUDA graphs. With --draft DEPTH,TOPK,SIZE a step is instead one EAGLE-2 draft tree of
that shape from a synthetic head on the model (HierSpec's E_M on M: the paper's 3,10,29), read
back as a decoder reads it; the tree runs as one CUDA graph (TreeGraph) in the reference timing.
Writes DIR/op_profile.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hierviz.machine import gpu_name, machine_info, w4_fp16_kernel
from hierviz.measure.common import (MeasureError, add_device_args, default_device, environment, load_shape, refuse, stamp,
                                    stopwatch, write_json)
from hierviz.quant.formats import DENSE, canonical_name
from hierviz.settings import DecodeSettings

SCHEMA = "hierviz.op_profile/1"


def _self_time_us(evt: Any, cuda: bool) -> float:
    if cuda:
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(evt, name):
                return float(getattr(evt, name))
        return 0.0
    return float(evt.self_cpu_time_total)


def _step(state: Any, tokens: int) -> None:
    """One verification-like step: a forward of `tokens` new tokens (the pending one and a
    causal draft of tokens - 1), all their logits read back, one token kept."""
    if tokens == 1:
        state.tokens.append(int(state.next_logits().argmax()))
        return
    start = state.processed
    draft = [(state.tokens[-1] + 1 + i) % state.model.cfg.vocab_size for i in range(tokens - 1)]
    hidden = state.run_pending(draft)
    best = state.model.logits(hidden).argmax(-1).tolist()
    state.commit_prefix(start, hidden, 1, [best[0]])


def _step_ms(state: Any, steps: int, step: Callable[[Any], None], device: torch.device) -> float:
    """Wall time of one step (`step(state)`)."""
    with stopwatch(device, pause_gc=False) as took:
        for _ in range(steps):
            step(state)
    return took() * 1000.0 / steps


def run(shape: str, layers: int, device: str, dtype: torch.dtype, kernel: str, steps: int,
        prompt_len: int, top: int, tokens: int = 1, draft: Optional[tuple[int, int, int]] = None,
        draft_vocab: Optional[int] = None, head_format: str = DENSE.name) -> dict[str, Any]:
    import dataclasses

    from hierviz.decoding.state import BaseState, HeadState
    from hierviz.decoding.tree import draft_tree_on_device
    from hierviz.models import cuda_graphs
    from hierviz.models.synthetic import synthetic_model
    from hierviz.quant import w4_choice
    from hierviz.quant.w4 import FORMAT as W4A16

    name, cfg = load_shape(shape)
    if layers < 1:
        raise ValueError("--layers must be at least 1")
    from hierviz.measure.whatif import check_draft_vocab, sharp_eagle2_head
    check_draft_vocab(draft_vocab, cfg.vocab_size)
    cfg = dataclasses.replace(cfg, num_layers=min(layers, cfg.num_layers))
    cuda = device == "cuda"
    model = synthetic_model(cfg, W4A16.name, dtype, device, kernel, 0)
    head = None if draft is None else sharp_eagle2_head(model, 1, draft_vocab, head_format, kernel)
    w4_choice.choose_for_models([model, head], device)     # each W4 weight's kernel, before any product
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(prompt_len)]
    max_len = prompt_len + 4 * steps + tokens + 16 + (draft[2] + draft[0] if draft else 0)

    def fresh_state() -> Any:
        """The model's state after the prompt; drafting: the head's state on it."""
        st = BaseState(model, max_len)
        st.tokens = list(prompt)
        st.tokens.append(int(st.next_logits().argmax()))
        return st if head is None else HeadState(head, st, max_len)

    def step(state: Any) -> None:
        if head is None:
            _step(state, tokens)
        else:     # one tree, read back as a decoder reads it
            draft_tree_on_device(state, *draft).read()

    out: dict[str, Any] = {"schema": SCHEMA, "shape": name, "layers": cfg.num_layers, "device": device,
                           "dtype": str(dtype).replace("torch.", ""), "w4_kernel": kernel, "steps": steps,
                           "prompt_tokens": prompt_len, "tokens_per_forward": tokens,
                           "gpu": gpu_name(device), "machine": machine_info(device)}
    if draft is not None:
        out["draft_tree"] = {"depth": draft[0], "topk": draft[1], "size": draft[2], "draft_vocab": draft_vocab,
                             "head_format": head_format}
    if cuda:   # reference: the same step replayed from CUDA graphs, as the engine runs it
        # w4_kernel names the engine's kernel family, "triton" also when fp16 products run the CUDA variant
        out["w4_fp16_kernel"] = w4_fp16_kernel(torch.device(device))
        st = fresh_state()
        _step_ms(st, 3, step, model.device)
        out["step_ms_graphs"] = _step_ms(st, steps, step, model.device)
    with cuda_graphs.path_switches(graphs=False):   # profiled run: same static path, eager launches
        cuda_graphs.drop_runners(model)
        if head is not None:
            cuda_graphs.drop_runners(head)
        st = fresh_state()
        _step_ms(st, 3, step, model.device)
        out["step_ms_eager"] = _step_ms(st, steps, step, model.device)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            _step_ms(st, steps, step, model.device)
    rows = []
    for evt in prof.key_averages():
        us = _self_time_us(evt, cuda)
        if us > 0:
            rows.append({"op": evt.key, "calls_per_step": evt.count / steps, "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    for r in rows:
        r["share"] = r["us_per_step"] / total if total else 0.0
        r["us_per_layer"] = r["us_per_step"] / cfg.num_layers if draft is None else None   # a tree has no layers
    out["timing"] = "self device time (CUDA kernels)" if cuda else "self CPU time"
    out["profiled_us_per_step"] = total
    out["ops"] = rows[:top]
    return out


def table(info: dict[str, Any]) -> str:
    kernel = info.get("w4_fp16_kernel", info["w4_kernel"])
    tree = info.get("draft_tree")
    what = (f"one EAGLE-2 draft tree per step (depth {tree['depth']}, top-{tree['topk']}, {tree['size']} nodes"
            + (f", {tree['draft_vocab']} draft ids" if tree.get("draft_vocab") else "")
            + (f", head linears {tree['head_format']}" if tree.get("head_format", DENSE.name) != DENSE.name else "") + ")") if tree else \
        f"{info.get('tokens_per_forward', 1)} token(s) per forward"
    lines = [f"# {info['shape']} x {info['layers']} layers, W4A16 ({kernel}), {info['dtype']} on "
             f"{info.get('gpu') or info['device']}, {what}: {info['timing']}",
             "",
             f"step wall time: eager {info['step_ms_eager']:.2f} ms"
             + (f", CUDA graphs {info['step_ms_graphs']:.2f} ms" if "step_ms_graphs" in info else "")
             + f"; profiled op time {info['profiled_us_per_step'] / 1000:.2f} ms per step",
             "",
             "| op | calls / step | us / step | us / layer | share |",
             "|---|---|---|---|---|"]
    for r in info["ops"]:
        per_layer = "-" if r.get("us_per_layer") is None else f"{r['us_per_layer']:.2f}"
        lines.append(f"| `{r['op'][:80]}` | {r['calls_per_step']:.1f} | {r['us_per_step']:.1f} | "
                     f"{per_layer} | {100 * r['share']:.1f}% |")
    return "\n".join(lines) + "\n"


def _draft_shape(text: Optional[str]) -> Optional[tuple[int, int, int]]:
    """--draft "DEPTH,TOPK,SIZE" -> the three numbers; MeasureError naming what is wrong."""
    if text is None:
        return None
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise MeasureError(f"bad --draft {text!r}: expected DEPTH,TOPK,SIZE, e.g. 3,10,29")
    depth, topk, size = (int(p) for p in parts)
    # the decoders' own bounds on an E_M tree (SettingsError is a ValueError: main refuses it)
    DecodeSettings(m_depth=depth, m_topk=topk, m_tree_size=size).validate(
        {"m_depth": "--draft depth", "m_topk": "--draft top-k", "m_tree_size": "--draft size"})
    return depth, topk, size


def main(argv: Optional[list[str]] = None) -> int:
    from hierviz.measure.whatif import target_formats
    ap = argparse.ArgumentParser(prog="python -m hierviz op-profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-70b", help="llama3-8b | llama3-70b | smollm2 | a config.json")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers to build (the shape's count at most)")
    add_device_args(ap, default_device())
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed and profiled")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per forward (>1: a sequence verification with all logits read)")
    ap.add_argument("--draft", default=None, metavar="DEPTH,TOPK,SIZE",
                    help="profile EAGLE-2 draft trees of this shape on the model instead of forwards (the paper's E_M: 3,10,29)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="with --draft: the head drafts over the first N ids (FR-Spec rows of the LM head)")
    ap.add_argument("--head-format", default=DENSE.name, type=canonical_name, choices=target_formats(),
                    help="with --draft: the head's linears (fc and its decoder layer) in this weight format")
    ap.add_argument("--top", type=int, default=25, help="operators to keep in the table")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        device, dtype, kernel = environment(a.device, a.dtype, a.w4_kernel, "no CUDA GPU here; use --device cpu")
        if a.steps < 1 or a.prompt_len < 1 or not 1 <= a.tokens <= 128:
            raise MeasureError("--steps and --prompt-len must be at least 1, --tokens 1..128")
        draft = _draft_shape(a.draft)
        if (a.draft_vocab is not None or a.head_format != DENSE.name) and draft is None:
            raise MeasureError("--draft-vocab and --head-format need --draft (they set the draft head)")
        info = run(a.shape, a.layers, device, dtype, kernel, a.steps, a.prompt_len, a.top, a.tokens, draft,
                   a.draft_vocab, a.head_format)
    except ValueError as e:      # MeasureError included
        return refuse(str(e))
    write_json(Path(a.out) / "op_profile.json", stamp(info, "op-profile", argv))
    print(table(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
