"""hierviz web demo: hierarchical speculative decoding, step by step (Hugging Face Space app_file).

    python app.py                       # http://127.0.0.1:7860, default stack smollm2-offline
    HIERVIZ_STACK=tiny-random python app.py --port 7861

Recording a comparison trace for replay: `python -m hierviz record --out FILE --prompt P`.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    ap.add_argument("--stack", default=None, help="default model stack preset (or HIERVIZ_STACK)")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="do not load and warm the default stack at start-up (the first run does it then)")
    args = ap.parse_args()
    # warnings and errors of every library, and the app's own notes: a refused input is one line
    # (logger hierviz.app.refused), a fault its traceback
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hierviz").setLevel(logging.INFO)
    # a stopped container or `kill` sends SIGTERM: exit normally, so that the app's temp folders
    # are removed (hierviz/app/tempfiles.py)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    from hierviz.app import build_app, launch_kwargs
    demo = build_app(args.stack)
    if not args.no_warm_up:
        # the default stack loads and warms up while the server starts, not on the first visitor's click
        import threading

        from hierviz.app.live import prewarm
        from hierviz.app.stacks import default_stack
        threading.Thread(target=prewarm, args=(args.stack or default_stack(),), name="warm-up", daemon=True).start()
    demo.launch(server_name=args.host, server_port=args.port, **launch_kwargs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
