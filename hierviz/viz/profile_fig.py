"""The Profile chart: forward latency against the number of verified tokens
(the memory-bound range a W4 target keeps while it verifies few tokens).

Input is the dict that `python -m hierviz profile` writes (hierviz.measure.profile, schema
"hierviz.profile/1"). One panel per scope (one decoder layer, the whole model); one line per
weight format; each format's bandwidth floor (weight bytes / measured copy rate) as a dotted
horizontal line of the same colour. Estimated curves (a model too large for the device,
scaled from one layer) are dashed and say so in the legend.
"""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hierviz.quant.formats import DEFAULT_FORMAT, format_of_series
from hierviz.quant.w4_verdicts import CUDA_VARIANT, kernel_that_ran

# Blue for full precision, orange for the 4-bit kernel (the tab's text calls it "orange"): lines
# at >= 3:1 on white and apart under simulated colour blindness
DENSE_COLOR = "#0072B2"
W4_COLOR = "#C96A00"
KERNEL_COLORS = {"tinygemm": "#B286E9"}      # a comparison kernel's curve (hierviz.measure.profile)
# kernels drawn for comparison only, off until asked for: torch's tinygemm int4 kernel turns
# compute-bound so early that it rules any axis, and the chart is about fp16 against this app's W4
COMPARISON_KERNELS = ("tinygemm",)
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


def log_ticks(values: list[float]) -> Optional[list[float]]:
    """Round values (1, 2, 5 times a power of ten) across `values`, for a log axis's labels: whole
    numbers instead of plotly's bare minor digits."""
    shown = [v for v in values if v > 0]
    if not shown:
        return None
    lo, hi = min(shown), max(shown)
    ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5)]
    return [t for t in ticks if lo / 1.5 <= t <= hi * 1.5] or None


def crossing(tokens: list[float], dense: list[float], w4: list[float]) -> Optional[float]:
    """The token count where the W4 curve first rises above the dense one, interpolated along the
    log x axis (None: it stays below, or starts above)."""
    pairs = list(zip(tokens, dense, w4))
    for (t0, d0, w0), (t1, d1, w1) in zip(pairs, pairs[1:]):
        if w0 < d0 and w1 >= d1 and t0 > 0 and t1 > t0:
            f = (d0 - w0) / ((d0 - w0) + (w1 - d1))
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return None


def series_name(row: dict, profile_json: dict) -> str:
    """A curve's name: its series, except that a format's own GPU kernel whose fp16 products ran the
    CUDA MMA variant (a profile made with HIERVIZ_W4_CUDA=on: its machine's `w4_fp16_kernel`) is
    named by the kernel that ran."""
    fmt = format_of_series(row["format"])
    if fmt is not None and fmt.gpu_kernel and row["format"] == fmt.series(fmt.gpu_kernel) \
            and kernel_that_ran(profile_json.get("machine")) == CUDA_VARIANT:
        return fmt.series(CUDA_VARIANT)
    return row["format"]


def _is_dense(row: dict) -> bool:
    fmt = format_of_series(row["format"])
    return fmt is not None and fmt.dense


def _is_w4_curve(row: dict) -> bool:
    fmt = format_of_series(row["format"])
    return fmt is not None and fmt.name == DEFAULT_FORMAT and row.get("kernel") not in COMPARISON_KERNELS


def _mark_crossing(fig: go.Figure, rows: list[dict], profile_json: dict, col: int) -> None:
    """A dotted vertical line where W4A16 turns slower than fp16 in this panel, and its words."""
    dense = next((r for r in rows if _is_dense(r)), None)
    w4 = next((r for r in rows if _is_w4_curve(r)), None)
    tokens = profile_json.get("tokens") or []
    at = crossing(tokens, dense["us"], w4["us"]) if dense and w4 else None
    if at is None:
        return
    xref, yref = ("x", "y domain") if col == 1 else (f"x{col}", f"y{col} domain")
    fig.add_shape(type="line", x0=at, x1=at, y0=0, y1=1, xref=xref, yref=yref,
                  line=dict(color="#333333", width=1.5, dash="dot"))
    # an annotation's position on a log axis is the log of the value
    fig.add_annotation(x=math.log10(at), y=1, xref=xref, yref=yref,
                       text=f"{series_name(w4, profile_json)} slower than<br>{dense['format']} from ≈{at:.0f} tokens",
                       showarrow=False, xanchor="right", yanchor="top", align="right", font=dict(size=12),
                       bgcolor="rgba(255,255,255,0.85)")


def _add_curves(fig: go.Figure, rows: list[dict], profile_json: dict, col: int, div: float, unit: str,
                colors: dict[str, str], show_comparison: bool) -> None:
    """One panel's curves and their bandwidth floors; a comparison kernel's are off unless asked for."""
    for r in rows:
        name = series_name(r, profile_json)
        c = _color(r, colors)
        est = bool(r.get("estimated"))
        off = r.get("kernel") in COMPARISON_KERNELS and not show_comparison
        label = name + (" (estimated)" if est else "") + (" (off: click to show)" if off else "")
        visible = "legendonly" if off else True
        ys = [u / div for u in r["us"]]
        toks = profile_json.get("tokens", list(range(1, len(ys) + 1)))
        fig.add_trace(go.Scatter(
            x=toks, y=ys, mode="lines+markers", name=label, legendgroup=name, showlegend=col == 1 or est,
            visible=visible, line=dict(color=c, width=2.5, dash="dash" if est else "solid"), marker=dict(size=6),
            hovertemplate=f"{label}<br>%{{x}} tokens: %{{y:.3g}} {unit}<extra></extra>"), row=1, col=col)
        floor = r.get("floor_us")
        if floor and toks:
            fig.add_trace(go.Scatter(
                x=[min(toks), max(toks)], y=[floor / div] * 2, mode="lines", name=f"{name} bandwidth floor",
                legendgroup=name, showlegend=col == 1, visible=visible, line=dict(color=c, width=1.5, dash="dot"),
                hovertemplate=f"{name}: weight bytes / copy bandwidth = %{{y:.3g}} {unit}<extra></extra>"),
                row=1, col=col)


def profile_figure(profile_json: dict, show_comparison: bool = False) -> go.Figure:
    """Latency (µs, or ms for slower curves) vs tokens, both axes log; fp16 vs W4A16 with floors,
    and where W4A16 turns slower. A comparison kernel's curves (COMPARISON_KERNELS) are off unless
    `show_comparison`; a click on their legend entry shows them."""
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
        drawn = [r for r in rows if show_comparison or r.get("kernel") not in COMPARISON_KERNELS]
        slow = any(max(r.get("us") or [0]) > 5000 for r in drawn)
        unit, div = ("ms", 1000.0) if slow else ("µs", 1.0)
        _add_curves(fig, rows, profile_json, col, div, unit, colors, show_comparison)
        _mark_crossing(fig, rows, profile_json, col)
        fig.update_xaxes(type="log", title_text="tokens verified in one forward",
                         tickvals=tokens_all or None, row=1, col=col)
        # log: a comparison kernel many times slower would squash the others' curves on a linear axis
        ys = [u / div for r in drawn for u in [*(r.get("us") or []), *([r["floor_us"]] if r.get("floor_us") else [])]]
        fig.update_yaxes(type="log", title_text=f"forward latency ({unit}, log scale)", tickvals=log_ticks(ys),
                         row=1, col=col)
    dev = profile_json.get("device", "?")
    bw = profile_json.get("copy_bandwidth_GBps")
    sub = f"{profile_json.get('shape', '?')} · {dev}" + (f" · copy {bw:.0f} GB/s" if bw else "")
    fig.update_layout(title=dict(text=f"Forward latency vs verified tokens<br><sup>{sub}</sup>"),
                      template="plotly_white", height=430, margin=dict(l=60, r=20, t=80, b=50),
                      legend=dict(orientation="h", y=-0.22))
    return fig
