"""`python -m hierviz endurance`: many live runs through the app's API, watching memory and temp files.

    python -m hierviz endurance --runs 200 [--stack tiny-random] [--every 20] [--out FILE]
    python -m hierviz endurance --runs 0 --holders 64 --every 8 [--out FILE]

Starts the app in this process (the server a Space runs), then sends `--runs` live comparisons
through `/run` one after another, each from a new client (a new visitor session, closed after its
run, as a closed tab is). Every `--every` runs it prints the process's resident memory and the
files under Gradio's temp folder and the app's own download folder; at the end, the growth per
run after the warm-up (the first `--every` runs).

`--holders N` then has N new visitors each upload the largest trace the app lets one visitor
hold (just under HIERVIZ_STATE_MB once loaded, built from the shipped tiny-random trace's steps)
and keep it: the server's memory with N visitors' states full, against the bound the app states
(N x (HIERVIZ_STATE_MB + SESSION_MB) over the memory before them). A benchmark, not a test: the figures go to
docs/security.md with the command and machine.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from hierviz.app.common import TRACE_DIR
from hierviz.config import ENV_NAMES, recorded_command

SHIPPED_TRACE = TRACE_DIR / "tiny-random-plumbing.json"
# What a visitor's session costs the server beside their runs: Gradio's per-session copy of the
# page's config and last outputs, and the allocator's slack (measured 1.6-2.1 MB on the 2-core CPU)
SESSION_MB = 3


def rss_mb() -> float:
    """Resident memory of this process (the server's: the app runs in-process), in MB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def temp_files(folders: list[Path]) -> int:
    return sum(1 for d in folders if d.exists() for p in d.rglob("*") if p.is_file())


def largest_trace(path: Path, limit_bytes: int) -> float:
    """Write to `path` a comparison whose runs take just under `limit_bytes` once loaded (the app's
    estimate, hierviz.app.session.state_bytes): the shipped trace's runs, their steps repeated.
    Returns that estimate in MB."""
    from hierviz.app.session import run_bytes, state_bytes, step_bytes
    from hierviz.trace import comparison_from_json, save_comparison
    runs = comparison_from_json(SHIPPED_TRACE.read_bytes())
    size = state_bytes(runs)
    k = 0
    while True:
        run = runs[k % len(runs)]
        step = run.steps[1 + k % (len(run.steps) - 1)]       # any step but the prefill
        if size + step_bytes(step) > 0.99 * limit_bytes:
            break
        run.steps.append(replace(step, index=len(run.steps)))
        size += step_bytes(step)
        k += 1
    save_comparison(runs, path)
    size = state_bytes(comparison_from_json(path.read_bytes()))
    assert size == sum(run_bytes(t) + sum(step_bytes(s) for s in t.steps) for t in runs) and size <= limit_bytes
    return size / 2**20


def hold(url: str, n: int, every: int, trace: Path) -> list[dict[str, Any]]:
    """`n` new visitors each load `trace` and keep it; samples of memory every `every` of them."""
    import gradio_client
    samples = []
    for i in range(1, n + 1):
        client = gradio_client.Client(url, verbose=False, download_files=False)
        out = client.predict(gradio_client.handle_file(str(trace)), api_name="/load_trace")
        if "Loaded" not in str(out[0]):
            raise RuntimeError(f"visitor {i} could not load the trace: {out[0]}")
        client.close()
        if i % every == 0 or i == n:
            samples.append({"holders": i, "rss_mb": round(rss_mb(), 1)})
            print(json.dumps(samples[-1]), flush=True)
    return samples


def holders_report(url: str, n: int, every: int) -> dict[str, Any]:
    """The memory before and after `n` visitors each hold the largest trace, against the bound."""
    import gc

    from hierviz.config import options
    limit_mb = options().state_mb
    with tempfile.TemporaryDirectory(prefix="hierviz-endurance-trace-") as tmp:
        trace = Path(tmp) / "largest-allowed-trace.json"
        estimate = largest_trace(trace, limit_mb * 2**20)
        file_mb = trace.stat().st_size / 2**20
        gc.collect()
        before = rss_mb()
        samples = hold(url, n, every, trace)
    gc.collect()
    after = rss_mb()
    return {"holders": n, "state_mb_limit": limit_mb, "trace_file_mb": round(file_mb, 2),
            "trace_state_mb": round(estimate, 2), "rss_before_holders_mb": round(before, 1),
            "rss_after_holders_mb": round(after, 1), "rss_per_holder_mb": round((after - before) / n, 2),
            "stated_bound_mb": round(before + n * (limit_mb + SESSION_MB), 1),
            "within_bound": after <= before + n * (limit_mb + SESSION_MB),
            "holder_samples": samples}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz endurance", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="print a sample every N runs")
    ap.add_argument("--stack", default="tiny-random")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--holders", type=int, default=0,
                    help="then this many new visitors each load the largest trace one visitor may hold")
    ap.add_argument("--out", default=None, help="write the samples as JSON here")
    a = ap.parse_args(argv)
    if a.runs < 0 or a.holders < 0 or a.runs + a.holders < 1 or a.every < 1:
        print("error: --runs and --holders must not be negative, not both 0, and --every at least 1", file=sys.stderr)
        return 2
    # Gradio's cache in a folder of this run's own, so the count is of this server's files only;
    # removed when the benchmark ends
    if not os.environ.get("GRADIO_TEMP_DIR"):
        os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="hierviz-endurance-")
        atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)
    # this one machine plays every visitor: the per-address limit would refuse it after 20 runs a minute
    os.environ.setdefault(ENV_NAMES["runs_per_address"], "6000")
    import gradio_client

    from hierviz.app.check import start_app
    from hierviz.app.downloads import DOWNLOAD_ROOT
    url, demo = start_app(a.stack)
    folders = [Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio"), DOWNLOAD_ROOT]
    args = ["endurance run", a.stack, a.max_new_tokens, 0.0, 2, 4, 8, 3, 2, 4, 8, True]
    samples: list[dict[str, Any]] = []
    errors = 0
    t0 = time.perf_counter()
    held: dict[str, Any] = {}
    try:
        for i in range(1, a.runs + 1):
            client = gradio_client.Client(url, verbose=False, download_files=False)   # the server's files only
            out = client.predict(*args, api_name="/run")
            errors += "Done." not in str(out[0])
            client.close()
            if i % a.every == 0 or i == a.runs:
                samples.append({"runs": i, "rss_mb": round(rss_mb(), 1), "temp_files": temp_files(folders),
                                "errors": errors, "seconds": round(time.perf_counter() - t0, 1)})
                print(json.dumps(samples[-1]), flush=True)
        if a.holders:
            held = holders_report(url, a.holders, a.every)
    finally:
        demo.close()
    summary: dict[str, Any] = {"command": recorded_command("endurance", argv),
                               "samples": samples, "errors": errors}
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        summary["rss_growth_mb_per_run_after_warmup"] = round((last["rss_mb"] - first["rss_mb"]) /
                                                             max(1, last["runs"] - first["runs"]), 3)
        summary["temp_files_max"] = max(s["temp_files"] for s in samples)
    summary.update(held)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "holder_samples")}))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))
    return 0 if errors == 0 and held.get("within_bound", True) else 1


if __name__ == "__main__":
    sys.exit(main())
