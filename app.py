"""hierviz web demo: hierarchical speculative decoding, step by step (Hugging Face Space app_file).

    python app.py                       # http://127.0.0.1:7860, default stack smollm2-offline
    HIERVIZ_STACK=tiny-random python app.py --port 7861
    python app.py --record assets/traces/x.json --stack tiny-random --prompt "Hi" --max-new-tokens 24
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def record(path: str, stack_name: str, prompt: str, max_new_tokens: int, title: str) -> int:
    """Run HierSpec, EAGLE-2 and AR on one prompt and save them as one comparison trace for replay."""
    from hierviz.decoding.settings import DecodeSettings
    from hierviz.engine import generate, load_stack, warm_up
    from hierviz.trace import save_comparison
    methods = ["hierspec", "eagle2", "ar"]
    try:
        stack = load_stack(stack_name)
        settings = DecodeSettings(max_new_tokens=max_new_tokens).validate()
        # as the app does before a live run: else the first method's trace carries every first-call
        # cost (Triton compiles, CUDA-graph captures) and its timings are not comparable
        warm_up(stack, methods, settings)
        runs = [generate(stack, m, prompt, settings) for m in methods]
    except ValueError as e:          # EngineError, StackError, SettingsError carry user-facing messages
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in runs:
        r.meta["title"] = title or f"{stack_name}: {prompt[:40]}"
    save_comparison(runs, path)
    print(f"wrote {path}: " + ", ".join(f"{r.meta['method']} {len(r.steps)} steps" for r in runs))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    ap.add_argument("--stack", default=None, help="default model stack preset (or HIERVIZ_STACK)")
    ap.add_argument("--record", metavar="PATH", help="record a HierSpec/EAGLE-2/AR comparison trace and exit")
    ap.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--title", default="", help="label of the recorded trace in the app")
    args = ap.parse_args()
    if args.record:
        return record(args.record, args.stack or os.environ.get("HIERVIZ_STACK", "smollm2-offline"), args.prompt,
                      args.max_new_tokens, args.title)
    from hierviz.app.visualizer import build_app, launch_kwargs
    demo = build_app(args.stack)
    demo.launch(server_name=args.host, server_port=args.port, **launch_kwargs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
