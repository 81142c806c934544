"""Speedup over AR against acceptance, per target weight format, with the crossovers marked.

Acceptance does not depend on the weight format, only a forward's price does. The shipped what-if
sweep (W4A16 Llama-3-70B target, the paper's trees) gives, per acceptance scale, each method's
tokens per round and its time per round with a W4A16 target; the compat table (same shapes and
trees, scale 1) gives each format's time per round and per AR token. A format's curve is the
sweep's W4A16 costs moved by the difference compat measured between that format and W4A16 (one
target verification per round, so the difference is one forward's): the same drafts and accept
decisions priced with the other format's target. Projected, and labelled so.
"""
from __future__ import annotations

from typing import Any, Optional

import plotly.graph_objects as go

from hierviz.methods import BASELINE, PEER, SUBJECT
from hierviz.viz.style import method_color, method_label

LABEL = "projected: the W4A16 acceptance sweep repriced with each format's measured forward"
DASHES = {"dense": "solid", "w8a8-int8": "dash", "w8a8-fp8": "dashdot", "w4": "dot"}


def _per_round_ms(tokens_per_s: float, tokens_per_round: float) -> float:
    return 1000.0 * tokens_per_round / tokens_per_s


def format_curves(compat: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    """{format: {"name", "scales", method: [speedup over AR per scale], "crossovers": {...}}} for the
    compat rows that ran; the sweep's best tree size and min draft at the compat's settings."""
    s = compat["settings"]
    tree = sweep.get("tree_method", PEER)
    w4 = next((r for r in compat["rows"] if r["format"] == "w4" and "error" not in r), None)
    if w4 is None:
        raise ValueError("the compat table has no W4A16 row to align the sweep with")
    rows = [r for r in sweep["rows"] if (r["method"] == tree and r.get("t_tree_size") == s["t_tree_size"] + 1)
            or (r["method"] == SUBJECT and r.get("min_draft_len") == s["min_draft_len"])]
    scales = sorted({r["scale"] for r in rows})
    ar_ms_w4 = 1000.0 / sweep["ar_tokens_per_s"]
    out: dict[str, Any] = {}
    for r in compat["rows"]:
        if "error" in r:
            continue
        d_ar = 1000.0 / r["tokens_per_s"][BASELINE] - 1000.0 / w4["tokens_per_s"][BASELINE]
        curve: dict[str, Any] = {"name": r["name"], "scales": scales}
        for m in (tree, SUBJECT):
            delta = (_per_round_ms(r["tokens_per_s"][m], r["tokens_per_round"][m])
                     - _per_round_ms(w4["tokens_per_s"][m], w4["tokens_per_round"][m]))
            by_scale = {x["scale"]: x for x in rows if x["method"] == m}
            curve[m] = [((ar_ms_w4 + d_ar) * by_scale[sc]["tokens_per_round"]
                         / (_per_round_ms(by_scale[sc]["tokens_per_s"], by_scale[sc]["tokens_per_round"]) + delta))
                        if sc in by_scale else None for sc in scales]
        flat = [1.0] * len(scales)
        curve["crossovers"] = {f"{SUBJECT}_over_{tree}": crossing(scales, curve[SUBJECT], curve[tree]),
                               f"{tree}_over_{BASELINE}": crossing(scales, curve[tree], flat),
                               f"{SUBJECT}_over_{BASELINE}": crossing(scales, curve[SUBJECT], flat)}
        out[r["format"]] = curve
    return out


def crossing(xs: list[float], a: list[Optional[float]], b: list[Optional[float]]) -> Optional[float]:
    """The x where a rises above b (linear between the scales around it); None where a never does,
    or is ahead from the first scale on (no crossover inside the sweep)."""
    pts = [(x, u - v) for x, u, v in zip(xs, a, b) if u is not None and v is not None]
    if pts and pts[0][1] > 0:
        return None
    for (x0, d0), (x1, d1) in zip(pts, pts[1:]):
        if d0 <= 0 < d1:
            return x0 + (x1 - x0) * (-d0) / (d1 - d0)
    return None


def format_curves_figure(curves: dict[str, Any], tree: str = PEER, title: str = "") -> go.Figure:
    fig = go.Figure()
    names = {m: method_label(m) for m in (tree, SUBJECT)}
    for fmt, c in curves.items():
        for m in (tree, SUBJECT):
            fig.add_trace(go.Scatter(x=c["scales"], y=c[m], mode="lines+markers",
                                     name=f"{names[m]} · {c['name']}", legendgroup=fmt,
                                     line=dict(color=method_color(m), dash=DASHES.get(fmt, "solid"))))
        x = c["crossovers"][f"{SUBJECT}_over_{tree}"]
        if x is not None:     # the crossover as a marker on the HierSpec curve; the panel's note lists them
            xs, ys = c["scales"], c[SUBJECT]
            k = max(i for i in range(len(xs) - 1) if xs[i] <= x)
            y = ys[k] + (ys[k + 1] - ys[k]) * (x - xs[k]) / (xs[k + 1] - xs[k])
            fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers", marker=dict(symbol="x", size=11, color="#1F2937"),
                                     name=f"HierSpec > {names[tree]} · {c['name']} ({x:.2f})", legendgroup=fmt,
                                     hovertemplate=f"{c['name']}: HierSpec overtakes {names[tree]} at %{{x:.2f}}"
                                                   "<extra></extra>"))
    fig.add_hline(y=1.0, line=dict(color="#999999", width=1))
    fig.update_layout(title=title or f"Speedup over AR against acceptance, per target format ({LABEL})",
                      xaxis_title="acceptance scale (x the default per-depth rates; 1 = the tables' point)",
                      yaxis_title="speedup over AR (same format)", template="plotly_white", height=460,
                      legend=dict(font=dict(size=10)), margin=dict(t=70, l=60, r=20, b=50))
    return fig
