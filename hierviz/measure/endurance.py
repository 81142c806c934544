"""`python -m hierviz endurance`: many live runs through the app's API, watching memory and temp files.

    python -m hierviz endurance --runs 200 [--stack tiny-random] [--every 20] [--out FILE]

Starts the app in this process (the server a Space runs), then sends `--runs` live comparisons
through `/run` one after another, each from a new client (a new visitor session, closed after its
run, as a closed tab is). Every `--every` runs it prints the process's resident memory and the
files under Gradio's temp folder and the app's own download folder; at the end, the growth per
run after the warm-up (the first `--every` runs). A benchmark, not a test: the figures go to
docs/security.md with the command and machine.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


def rss_mb() -> float:
    """Resident memory of this process (the server's: the app runs in-process), in MB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def temp_files(folders: list[Path]) -> int:
    return sum(1 for d in folders if d.exists() for p in d.rglob("*") if p.is_file())


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz endurance", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--every", type=int, default=20, help="print a sample every N runs")
    ap.add_argument("--stack", default="tiny-random")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write the samples as JSON here")
    a = ap.parse_args(argv)
    if a.runs < 1 or a.every < 1:
        print("error: --runs and --every must be at least 1", file=sys.stderr)
        return 2
    # Gradio's cache in a folder of this run's own, so the count is of this server's files only
    os.environ.setdefault("GRADIO_TEMP_DIR", tempfile.mkdtemp(prefix="hierviz-endurance-"))
    import gradio_client

    from hierviz.app.check import start_app
    from hierviz.app.downloads import DOWNLOAD_ROOT
    url, demo = start_app(a.stack)
    folders = [Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio"), DOWNLOAD_ROOT]
    args = ["endurance run", a.stack, a.max_new_tokens, 0.0, 2, 4, 8, 3, 2, 4, 8, True]
    samples: list[dict[str, Any]] = []
    errors = 0
    t0 = time.perf_counter()
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
    finally:
        demo.close()
    summary: dict[str, Any] = {"command": "python -m hierviz endurance " + " ".join(argv if argv is not None else sys.argv[1:]),
                               "samples": samples, "errors": errors}
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        summary["rss_growth_mb_per_run_after_warmup"] = round((last["rss_mb"] - first["rss_mb"]) /
                                                             max(1, last["runs"] - first["runs"]), 3)
        summary["temp_files_max"] = max(s["temp_files"] for s in samples)
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
