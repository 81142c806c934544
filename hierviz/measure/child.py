"""Run a piece of a measurement in a fresh Python process and read back its JSON result.

For work that can take its process down (a kernel that faults, a compiled forward whose process
segfaults at exit): the measuring process keeps going and gets a clear error instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ChildError(RuntimeError):
    """The child printed no JSON result (it failed, or ran out of time)."""


def run_json(code: str, *args: str, timeout: float = 900) -> Any:
    """`python -c code args...` with this repository importable; the last stdout line that parses
    as JSON, whatever the exit code after it was printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildError(f"timed out after {timeout:.0f} s") from None
    for line in reversed(p.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise ChildError(f"the child process failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
