"""Drive the web app once through its API, as a visitor's browser would, and check the result.

    python -m hierviz app-check --stack STACK [--prompt P] [--max-new-tokens N] [--out TRACE]
    python -m hierviz app-check --url http://host:7860/ --stack STACK ...   # an app already running

Without --url the app is started in this process on a free local port. One live comparison
(HierSpec, EAGLE-2, AR) runs through the `/run` endpoint with the stack's device defaults; the
command prints (JSON) the updates streamed, the time to the first step and to the end, each
method's tokens/s, and whether HierSpec's and EAGLE-2's outputs equal AR's token for token
(exit code 1 otherwise). --out keeps the comparison trace the page offers for download.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import sys
import time
from typing import Any, Optional

from hierviz.methods import BASELINE
from hierviz.settings import default_settings
from hierviz.trace import comparison_from_json, output_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(stack: str) -> tuple[str, Any]:
    """The app on `stack`, served from this process on a free local port: (its URL, the Blocks)."""
    from hierviz.app import build_app, launch_kwargs
    demo = build_app(stack)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_kwargs())
    return f"http://127.0.0.1:{port}/", demo


def _download_path(value: Any) -> Optional[str]:
    if isinstance(value, dict):
        value = value.get("value", value)
        if isinstance(value, dict):
            value = value.get("path")
    return value if isinstance(value, str) else None


def drive(url: str, stack: str, prompt: str, max_new_tokens: int, device: str) -> tuple[dict[str, Any], Optional[str]]:
    """One /run through gradio_client; the report and the downloaded trace's path."""
    import gradio_client
    s = default_settings(device)
    client = gradio_client.Client(url, verbose=False)
    t0 = time.perf_counter()
    job = client.submit(prompt, stack, max_new_tokens, 0.0, s.m_depth, s.m_topk, s.m_tree_size, s.min_draft_len,
                        s.t_depth, s.t_topk, s.t_tree_size, True, api_name="/run")
    first_step, updates, last = None, 0, None
    for out in job:
        updates += 1
        last = out
        if first_step is None and "step" in str(out[0]):
            first_step = time.perf_counter() - t0
    final = job.outputs()[-1] if job.outputs() else last
    report: dict[str, Any] = {"url": url, "stack": stack, "updates": updates,
                              "first_step_s": None if first_step is None else round(first_step, 2),
                              "total_s": round(time.perf_counter() - t0, 2),
                              "status": re.sub(r"<[^>]+>", "", str(final[0])) if final else "no output"}
    path = _download_path(final[1]) if final else None   # outputs: status, download, step, view, panels
    if path is None:
        return report, None
    with open(path, "rb") as f:
        runs = comparison_from_json(f.read())
    outputs = {}
    for tr in runs:
        m = str(tr.meta.get("method"))
        outputs[m] = output_tokens(tr)
        report[f"{m}_tokens"] = len(outputs[m])
        report[f"{m}_steps"] = len(tr.steps)
        report[f"{m}_tokens_per_s"] = round(tr.stats()["tokens_per_s"], 1)
    if BASELINE in outputs:
        report["identical_to_ar"] = {m: outputs[m] == outputs[BASELINE] for m in outputs if m != BASELINE}
    return report, path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz app-check", description=__doc__.splitlines()[0])
    ap.add_argument("--stack", required=True, help="preset name or stack JSON the app runs")
    ap.add_argument("--url", default=None, help="a running app (default: start one here)")
    ap.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None, help="whose tree defaults to send (default: cuda if available)")
    ap.add_argument("--out", default=None, help="keep the downloaded comparison trace here")
    a = ap.parse_args(argv)
    try:
        import gradio_client  # noqa: F401
    except ImportError:
        print("error: app-check needs gradio_client (pip install -r requirements.txt)", file=sys.stderr)
        return 2
    import torch
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    demo = None
    url = a.url
    if url is None:
        url, demo = start_app(a.stack)
    try:
        report, path = drive(url, a.stack, a.prompt, a.max_new_tokens, device)
    finally:
        if demo is not None:
            demo.close()
    if path and a.out:
        shutil.copyfile(path, a.out)
        report["trace"] = a.out
    print(json.dumps(report))
    same = report.get("identical_to_ar")
    return 0 if same and all(same.values()) and "Done." in report["status"] else 1


if __name__ == "__main__":
    sys.exit(main())
