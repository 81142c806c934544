"""The Profile chart: forward latency against the number of verified tokens
(the memory-bound range a W4 target keeps while it verifies few tokens).

Input is the dict that `python -m hierviz profile` writes (hierviz.measure.profile, schema
"hierviz.profile/1"). One panel per scope (one decoder layer, the whole model); one line per
weight format; each format's bandwidth floor (weight bytes / measured copy rate) as a dotted
horizontal line of the same colour. Estimated curves (a model too large for the device,
scaled from one layer) are dashed and say so in the legend.
"""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hierviz.quant.formats import DEFAULT_FORMAT, format_of_series

# Blue for full precision, orange for the 4-bit kernel (the tab's text calls it "orange"): lines
# at >= 3:1 on white and apart under simulated colour blindness
DENSE_COLOR = "#0072B2"
W4_COLOR = "#C96A00"
KERNEL_COLORS = {"tinygemm": "#B286E9"}      # a comparison kernel's curve (hierviz.measure.profile)
_FALLBACK = ["#297B7A", "#333333", "#56B4E9", "#999999"]
SCOPE_TITLES = {"layer": "one decoder layer", "model": "whole model"}


def _color(row: dict, seen: dict[str, str]) -> str:
    """A curve's colour by its format (hierviz.quant.formats) and kernel, the same in both scopes."""
    name = row["format"]
    if name not in seen:
        fmt = format_of_series(name)
        if fmt is not None and fmt.dense:
            seen[name] = DENSE_COLOR
        elif row.get("kernel") in KERNEL_COLORS:
            seen[name] = KERNEL_COLORS[row["kernel"]]
        elif fmt is not None and fmt.name == DEFAULT_FORMAT and W4_COLOR not in seen.values():
            seen[name] = W4_COLOR
        else:
            seen[name] = _FALLBACK[len(seen) % len(_FALLBACK)]
    return seen[name]


def profile_figure(profile_json: dict) -> go.Figure:
    """Latency (µs, or ms for slower curves) vs tokens, log x; fp16 vs W4A16 with floors."""
    series = profile_json.get("series") or []
    scopes = [s for s in ("layer", "model") if any(r.get("scope") == s for r in series)] or ["layer"]
    cfg = profile_json.get("config") or {}
    layers = cfg.get("num_layers")
    titles = [SCOPE_TITLES.get(s, s) + (f" ({layers} layers + LM head)" if s == "model" and layers else "")
              for s in scopes]
    fig = make_subplots(rows=1, cols=len(scopes), subplot_titles=titles, horizontal_spacing=0.08)
    colors: dict[str, str] = {}
    tokens_all = sorted({t for t in profile_json.get("tokens", [])})
    for col, scope in enumerate(scopes, start=1):
        rows = [r for r in series if r.get("scope") == scope]
        slow = any(max(r.get("us") or [0]) > 5000 for r in rows)
        unit, div = ("ms", 1000.0) if slow else ("µs", 1.0)
        for r in rows:
            name = r["format"]
            c = _color(r, colors)
            est = bool(r.get("estimated"))
            label = name + (" (estimated)" if est else "")
            ys = [u / div for u in r["us"]]
            toks = profile_json.get("tokens", list(range(1, len(ys) + 1)))
            fig.add_trace(go.Scatter(
                x=toks, y=ys, mode="lines+markers", name=label, legendgroup=name, showlegend=col == 1 or est,
                line=dict(color=c, width=2.5, dash="dash" if est else "solid"), marker=dict(size=6),
                hovertemplate=f"{label}<br>%{{x}} tokens: %{{y:.3g}} {unit}<extra></extra>"), row=1, col=col)
            floor = r.get("floor_us")
            if floor and toks:
                fig.add_trace(go.Scatter(
                    x=[min(toks), max(toks)], y=[floor / div] * 2, mode="lines", name=f"{name} bandwidth floor",
                    legendgroup=name, showlegend=col == 1, line=dict(color=c, width=1.5, dash="dot"),
                    hovertemplate=f"{name}: weight bytes / copy bandwidth = %{{y:.3g}} {unit}<extra></extra>"),
                    row=1, col=col)
        fig.update_xaxes(type="log", title_text="tokens verified in one forward",
                         tickvals=tokens_all or None, row=1, col=col)
        fig.update_yaxes(title_text=f"forward latency ({unit})", rangemode="tozero", row=1, col=col)
    dev = profile_json.get("device", "?")
    bw = profile_json.get("copy_bandwidth_GBps")
    sub = f"{profile_json.get('shape', '?')} · {dev}" + (f" · copy {bw:.0f} GB/s" if bw else "")
    fig.update_layout(title=dict(text=f"Forward latency vs verified tokens<br><sup>{sub}</sup>"),
                      template="plotly_white", height=430, margin=dict(l=60, r=20, t=80, b=50),
                      legend=dict(orientation="h", y=-0.22))
    return fig
