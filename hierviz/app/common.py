"""What every tab shares: where the app's assets are and the status box's HTML."""
from __future__ import annotations

from pathlib import Path

from hierviz.viz.style import esc

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "assets"
TRACE_DIR = ASSETS / "traces"


def status_html(text: str, kind: str = "info") -> str:
    """The status box of a tab: one escaped message; kind is info, ok, warn or error (a CSS class)."""
    return f'<div class="hv-status hv-status-{kind}">{esc(text)}</div>'
