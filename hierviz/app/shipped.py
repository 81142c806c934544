"""What ships with the app in assets/: the recorded traces offered for replay and the example prompts."""
from __future__ import annotations

import json

from hierviz.app.common import ASSETS, TRACE_DIR


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
