"""What ships with the app in assets/: the recorded traces offered for replay and the example prompts."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from hierviz.app.common import ASSETS, TRACE_DIR
from hierviz.trace import Trace, comparison_from_json

# parsed recorded traces by path, with the file's modification time: every new page opens on the
# first one, and the visitors who show it share one copy in memory (the app never changes a loaded trace)
_parsed: dict[str, tuple[int, list[Trace]]] = {}
_parsed_lock = threading.Lock()


def shipped_traces() -> list[tuple[str, str]]:
    """(label, path) of the recorded traces in assets/traces, labelled from their metadata."""
    out = []
    for p in sorted(TRACE_DIR.glob("*.json")):
        label = p.stem
        try:
            head = json.loads(p.read_text(encoding="utf-8"))
            first = head["runs"][0] if "runs" in head else head
            meta = first.get("meta", {})
            label = meta.get("title") or label
            if meta.get("synthetic"):
                label += " (hand-made, no model)"
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
        out.append((label, str(p)))
    return out


def example_prompts() -> list[list[str]]:
    """assets/prompts.json as gr.Examples rows; none if the file is missing or malformed."""
    p = ASSETS / "prompts.json"
    try:
        items = json.loads(p.read_text(encoding="utf-8"))
        return [[str(x)] for x in items if isinstance(x, str)]
    except (OSError, ValueError):
        return []


def shipped_runs(path: str) -> list[Trace]:
    """The runs of the recorded trace at `path` (one of shipped_traces()), parsed once; TraceError
    or OSError as hierviz.trace.comparison_from_json and reading the file give them."""
    mtime = Path(path).stat().st_mtime_ns
    with _parsed_lock:
        if path not in _parsed or _parsed[path][0] != mtime:
            _parsed[path] = (mtime, comparison_from_json(Path(path).read_bytes()))
        return _parsed[path][1]
