"""The hierviz web app (Gradio): `build_app()` makes it, `launch_kwargs()` are its launch options.

    from hierviz.app import build_app, launch_kwargs
    demo = build_app("tiny-random")
    demo.launch(**launch_kwargs())

Modules: layout (the page and its tabs), visualizer (the Visualizer tab's components and events),
handlers (its event handlers), live (the live run), line (the device line runs wait in), render
(what its panels show), session (per-visitor state), guard (what a visitor may ask for: caps,
rate limits, refusals), fields (visitor-proof input processing), pacing (render pacing), stacks
(the loaded model stack), shipped (assets that ship with the app), downloads and tempfiles (the
app's files), common (what every tab shares), profile_tab and whatif_tab (the other tabs), check
(`app-check`).
"""
from __future__ import annotations

import os
from typing import Any

# Gradio's launch analytics phone home and, with this theme's plain font names, fail in launch();
# set before any module of the app imports gradio
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

__all__ = ["build_app", "launch_kwargs", "register_tab"]


def __getattr__(name: str) -> Any:
    # imported on first use, so that `app-check --help` or `app-check --url` (a client of an app
    # running elsewhere) load neither gradio nor torch
    if name in __all__:
        from hierviz.app import layout
        return getattr(layout, name)
    raise AttributeError(f"module 'hierviz.app' has no attribute {name!r}")
