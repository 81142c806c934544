"""`python -m hierviz memory`: the GPU memory each stack needs, and what a real load costs.

    python -m hierviz memory                    # every preset against common GPUs (a table)
    python -m hierviz memory --stack NAME       # one stack file or preset
    python -m hierviz memory --load STACK [--compare PROMPT --trace FILE]
                                                # load it: time, checkpoint bytes read, peak host
                                                # RSS (VmHWM), GPU memory vs the estimate;
                                                # optionally one AR/EAGLE-2/HierSpec run

The estimates are hierviz.memory's (what is counted is said there).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from hierviz import methods as registry
from hierviz.measure.common import refuse
from hierviz.memory import DEFAULT_CONTEXT, GB, shape_estimate, stack_estimate, table
from hierviz.stack import PRESET_DIR, TINY_STACKS, preset_names, resolve_path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz memory", description=__doc__.split("\n")[0])
    ap.add_argument("--stack", default=None, help="a preset name or stack JSON (default: every GPU preset)")
    ap.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="longest prompt + new tokens")
    ap.add_argument("--load", default=None, help="load this stack and measure it (on this machine's device)")
    ap.add_argument("--compare", default=None, help="with --load: a prompt run with every method of the stack's comparison")
    ap.add_argument("--trace", default=None, help="with --compare: write the comparison trace here")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    if a.load:
        return measure_load(a.load, a.compare, a.trace, a.max_new_tokens, a.context)
    names = [a.stack] if a.stack else [n for n in preset_names() if n not in TINY_STACKS]
    rows = []
    for name in names:
        try:
            spec, base = _stack_file(name)
        except (OSError, json.JSONDecodeError) as e:
            return refuse(f"cannot read stack {name!r}: {e}")
        # one stack: its own models' configs (local or fetched); the preset table: bundled shapes
        parts = stack_estimate(spec, _resolver(base), a.context) if a.stack else None
        if parts is None:
            parts = shape_estimate(spec, a.context)
        if parts is None:
            if a.stack:
                return refuse(f"cannot read the model configs of stack {name!r}")
            continue
        rows.append((spec.get("name", name), parts))
    print(table(rows))
    return 0


def _stack_file(name: str) -> tuple[dict[str, Any], Path]:
    """(the stack JSON, its folder) of a stack file, a folder holding stack.json, or a preset name,
    found as load_stack finds it."""
    p = Path(name).expanduser()
    p = p / "stack.json" if p.is_dir() else p
    if not p.exists():
        p = PRESET_DIR / f"{name}.json"
    return json.loads(p.read_text()), p.parent


def _resolver(base: Path):
    return lambda source: resolve_path(source, base)


def host_rss_gb() -> tuple[float, float]:
    """(resident now, peak so far) of this process in GB: VmRSS and VmHWM (file-mapped pages
    included), else getrusage's peak for both."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024 / GB, int(fields["VmHWM"].split()[0]) * 1024 / GB
    except (OSError, KeyError, ValueError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024) / GB
        return peak, peak


def checkpoint_bytes(spec: dict[str, Any], base: Path) -> int:
    """Bytes of the weight files of a stack's local models (what a load reads from disk)."""
    total = 0
    for role in ("target", "intermediate", "e_m", "e_t"):
        if not spec.get(role):
            continue
        p = Path(resolve_path(spec[role]["path"], base)).expanduser()
        files = [p] if p.is_file() else (list(p.glob("*.safetensors")) + list(p.glob("*.bin")) if p.is_dir() else [])
        total += sum(f.stat().st_size for f in files)
    return total


def measure_load(name: str, prompt: Optional[str], trace: Optional[str], max_new: int, context: int) -> int:
    """Load a stack through load_stack and print what it cost (JSON), against the estimate."""
    import time

    import torch

    from hierviz.stack import StackError, load_stack
    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")    # the CUDA context: in the baseline, not in the load
    rss_before, _ = host_rss_gb()
    t0 = time.perf_counter()
    try:
        stack = load_stack(name)
    except StackError as e:
        return refuse(str(e))
    load_s = time.perf_counter() - t0
    rss_after, peak = host_rss_gb()
    out: dict[str, Any] = {"stack": stack.name, "device": str(stack.device), "load_s": round(load_s, 1),
                           "peak_host_rss_gb": round(peak, 2), "host_rss_before_load_gb": round(rss_before, 2),
                           "host_rss_after_load_gb": round(rss_after, 2)}
    if cuda:
        out["gpu_allocated_gb"] = round(torch.cuda.memory_allocated() / GB, 2)
        out["gpu_peak_gb"] = round(torch.cuda.max_memory_allocated() / GB, 2)
    if name not in TINY_STACKS:
        spec, base = _stack_file(name)
        read = checkpoint_bytes(spec, base)
        out["checkpoint_gb"] = round(read / GB, 2)
        out["read_gb_per_s"] = round(read / GB / max(load_s, 1e-9), 2)
        parts = stack_estimate(spec, _resolver(base), context, torch.finfo(stack.models.target.dtype).bits / 8)
        if parts is not None:
            out["estimate_gb"] = {k: round(v / GB, 2) for k, v in parts.items()}
    if prompt:
        from hierviz.settings import default_settings
        from hierviz.engine import generate, output_tokens, warm_up
        from hierviz.trace import save_comparison
        s = default_settings(str(stack.device))
        s.max_new_tokens = max_new
        runs, outputs = [], {}
        methods = registry.comparison_having(lambda part: getattr(stack.models, part, None) is not None)
        warm_up(stack, methods, s)     # first-call costs (compiles, graph captures) stay out of the timings
        for method in methods:
            tr = generate(stack, method, prompt, s)
            runs.append(tr)
            outputs[method] = output_tokens(tr)
            out[f"{method}_tokens_per_s"] = round(tr.stats()["tokens_per_s"], 1)
        out["identical_to_ar"] = {m: outputs[m] == outputs[registry.BASELINE] for m in methods if m != registry.BASELINE}
        if cuda:
            out["gpu_peak_after_runs_gb"] = round(torch.cuda.max_memory_allocated() / GB, 2)
        if trace:
            save_comparison(runs, trace)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
