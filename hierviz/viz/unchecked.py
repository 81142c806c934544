"""Figures rebuilt on every streamed step (the draft tree, the latency bars), built without plotly's
per-property validation, which was most of a step's render time. Their traces are plain dicts
(`dict(type="scatter", ...)`): a graph_objects trace validates itself when made.
tests/test_viz.py validates every such figure by rebuilding it through plotly's checks."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
import plotly.io as pio


def unchecked_figure(data: Optional[list[dict]] = None, layout: Optional[dict] = None) -> go.Figure:
    """A figure that stores what it is given as given: traces and layout as plain dicts, with no
    magic-underscore names (`font=dict(size=12)`, not `font_size=12`: nothing expands them). The
    one thing resolved is the template, as plotly's checks resolve it: a name (or, without one,
    plotly's default) becomes the template itself, since plotly.js knows no template names."""
    layout = dict(layout or {})
    template = layout.get("template", pio.templates.default)
    if isinstance(template, str):
        layout["template"] = pio.templates[template]
    return go.Figure({"data": data or [], "layout": layout}, _validate=False)
