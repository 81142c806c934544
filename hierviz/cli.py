"""`python -m hierviz <command>`: every task a user runs (the app itself: `python app.py`)."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from hierviz import methods
from hierviz.settings import add_settings_args, settings_from_args

# subcommands implemented in their own modules, each exposing main(argv) -> int
DELEGATED = {"bench": "hierviz.measure.bench", "profile": "hierviz.measure.profile", "whatif": "hierviz.measure.whatif",
             "train": "hierviz.train.cli", "kernel-bench": "hierviz.measure.kernel_bench",
             "w4-sweep": "hierviz.measure.w4_sweep", "memory": "hierviz.measure.memory_report",
             "synthetic-stack": "hierviz.measure.synthetic_stack", "app-check": "hierviz.app.check",
             "batch-invariance": "hierviz.measure.batch_invariance", "draft-sweep": "hierviz.measure.draft_sweep",
             "op-profile": "hierviz.measure.op_profile", "engine-bench": "hierviz.measure.engine_bench",
             "endurance": "hierviz.app.endurance", "compat": "hierviz.measure.compat",
             "cost-model": "hierviz.measure.cost_model", "cost-check": "hierviz.measure.cost_check"}


def cmd_generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hierviz generate",
                                description="Generate text with one decoding method and print it.")
    p.add_argument("--method", choices=methods.names(), default=methods.SUBJECT)
    p.add_argument("--prompt", required=True)
    p.add_argument("--trace", default=None, help="write the trace JSON here")
    p.add_argument("--stats", action="store_true", help="print tokens/s and acceptance to stderr")
    add_settings_args(p)
    from hierviz.stack import add_stack_args
    add_stack_args(p)
    a = p.parse_args(argv)
    from hierviz.engine import EngineError, generate, load_stack
    from hierviz.stack import StackError
    try:
        stack = load_stack(a.stack, a.device, a.dtype, a.w4_kernel)
        trace = generate(stack, a.method, a.prompt, settings_from_args(a, str(stack.device)))
    except (EngineError, StackError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(trace.output_text)
    if a.trace:
        try:
            trace.save(a.trace)
        except OSError as e:
            print(f"error: cannot write trace: {e}", file=sys.stderr)
            return 2
    if a.stats:
        s = trace.stats()
        print(f"[{a.method}] {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, tau_target {s['tau_target']:.2f}, "
              f"tau_intermediate {s['tau_intermediate']}, per-depth {s['per_depth_acceptance']}", file=sys.stderr)
    return 0


def cmd_record(argv: list[str]) -> int:
    """Run HierSpec, EAGLE-2 and AR on one prompt and save them as one comparison trace for replay."""
    p = argparse.ArgumentParser(prog="python -m hierviz record",
                                description="Record a HierSpec / EAGLE-2 / AR comparison trace the app can replay.")
    p.add_argument("--out", required=True, help="the trace JSON to write")
    p.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    p.add_argument("--title", default="", help="label of the recorded trace in the app")
    add_settings_args(p)
    from hierviz.stack import add_stack_args
    add_stack_args(p)
    a = p.parse_args(argv)
    from hierviz.decoding.decoders import comparison_methods
    from hierviz.engine import generate, load_stack, warm_up
    from hierviz.trace import save_comparison
    try:
        stack = load_stack(a.stack, a.device, a.dtype, a.w4_kernel)
        methods = comparison_methods(stack.models)
        settings = settings_from_args(a, str(stack.device)).validate()
        # as the app does before a live run: else the first method's trace carries every first-call
        # cost (Triton compiles, CUDA-graph captures) and its timings are not comparable
        warm_up(stack, methods, settings)
        runs = [generate(stack, m, a.prompt, settings) for m in methods]
        for r in runs:
            r.meta["title"] = a.title or f"{stack.name}: {a.prompt[:40]}"
        save_comparison(runs, a.out)
    except (ValueError, OSError) as e:     # EngineError, StackError, SettingsError carry user-facing messages
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: " + ", ".join(f"{r.meta['method']} {len(r.steps)} steps" for r in runs))
    return 0


COMMANDS = {"generate": cmd_generate, "record": cmd_record}
HELP = """\
  generate      generate text with one method, --method (writes a trace with --trace)
  record        record a HierSpec / EAGLE-2 / AR comparison trace for the app's replay
  bench         side-by-side benchmark on Spec-Bench-format questions
  draft-sweep   HierSpec's sequence-draft settings against EAGLE-2, one process
  profile       forward latency vs verified tokens per weight format
  whatif        real-scale projection with replayed acceptance (--exact: lossless at real shapes)
  compat        AR / EAGLE-2 / HierSpec per target weight format (FP16, W8A8, FP8, W4A16), one process
  cost-model    roofline model per format fitted to measured profiles; projections to other GPUs
  cost-check    that model against the single W4 products a what-if timed on a GPU
  train         train the offline stack's intermediate model and EAGLE heads
  kernel-bench  W4A16 kernel micro-benchmark (GPU)
  engine-bench  the engine against transformers on the offline stack's shapes, exactness included
  op-profile    where one decode step's time goes, operator by operator
  w4-sweep      W4A16 product correctness over every preset model shape (GPU; CPU interpreter)
  batch-invariance  where a target's forward stops being batch-invariant
  memory        GPU memory each stack needs, against common GPUs (--load: measure a real load)
  synthetic-stack  a GPU preset's checkpoints with random weights, in its exact layouts
  app-check     drive the web app once through its API and check the outputs
  endurance     many live runs through the app's API: memory and temp files every N runs
"""


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = [*COMMANDS, *DELEGATED]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hierviz {" + ",".join(commands) + "} ...\n\n" + HELP)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in COMMANDS:
        return COMMANDS[cmd](rest)
    if cmd in DELEGATED:
        try:
            mod = importlib.import_module(DELEGATED[cmd])
        except ModuleNotFoundError as e:
            print(f"error: the {cmd!r} command is not available in this build ({e})", file=sys.stderr)
            return 2
        return int(mod.main(rest) or 0)
    print(f"error: unknown command {cmd!r}; choose one of {', '.join(commands)}", file=sys.stderr)
    return 2
