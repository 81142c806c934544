"""Where a run sits: HierSpec's speedup over EAGLE-2 against acceptance, at real-scale costs.

The curve is the shipped what-if sweep (Llama-3-70B W4 target, 8B W4 intermediate, on an H200;
hierviz.retime.WHATIF_SWEEP): per acceptance scale, the best HierSpec configuration over the best
EAGLE-2 one. Marked on it: the crossover (speedup 1, linear between the two scales around it), the
paper's operating point (scale 1: the what-if default rates with which the tab's headline ran) and
this run (its measured acceptance on the sweep's scale, hierviz.retime.acceptance_scale, against
its own tokens re-timed at real scale). Everything on it is projected.
"""
from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any, Optional

import plotly.graph_objects as go

from hierviz.methods import PEER, SUBJECT
from hierviz.retime import RETIMED, WHATIF_SWEEP, acceptance_scale, at_time_scale, equal_token_ratios
from hierviz.trace import Trace, TraceError, comparison_from_json
from hierviz.viz.style import COLORS, method_color
from hierviz.viz.unchecked import unchecked_figure
from hierviz.viz.whatif_fig import sweep_base_rates

PAPER_SCALE = 1.0
TITLE = "Where this run sits: HierSpec / EAGLE-2 against acceptance (projected at Llama-3-70B / 8B, H200)"


@functools.cache
def shipped_sweep() -> Optional[dict[str, Any]]:
    try:
        return json.loads(WHATIF_SWEEP.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def sweep_ratios(sweep: dict[str, Any]) -> list[tuple[float, float]]:
    """(acceptance scale, best HierSpec / best of T's own tree method) per scale of a sweep, by scale."""
    verdicts = sorted(sweep.get("verdicts") or [], key=lambda v: float(v["scale"]))
    return [(float(v["scale"]), v["best_hierspec"] / v["best_tree"]) for v in verdicts if v.get("best_tree")]


def ratio_at(points: list[tuple[float, float]], scale: float) -> Optional[float]:
    """The sweep's ratio at `scale`, linear between its points; None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= scale <= x1:
            return y0 + (y1 - y0) * (scale - x0) / (x1 - x0)
    return None


def crossover_scale(points: list[tuple[float, float]]) -> Optional[float]:
    """The first scale where the ratio crosses 1, linear between the sweep's points."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if (y0 - 1) * (y1 - 1) <= 0 and y0 != y1:
            return x0 + (1 - y0) * (x1 - x0) / (y1 - y0)
    return None


def run_point(traces: list[Trace], sweep: dict[str, Any]) -> Optional[tuple[float, float]]:
    """This run's (acceptance scale, HierSpec / EAGLE-2 re-timed at real scale over equal tokens)."""
    rates, seq = sweep_base_rates(sweep)
    scale = acceptance_scale(traces, rates, seq)
    runs = {str(t.meta.get("method")): t.steps for t in at_time_scale(traces, RETIMED)}
    ratio = next((r.speedup for r in equal_token_ratios(runs) if r.other == PEER), None)
    return (scale, ratio) if scale is not None and ratio is not None else None


def marker(x: float, y: float, name: str, symbol: str, color: str, hover: str) -> dict:
    return dict(type="scatter", x=[x], y=[y], mode="markers", name=name, hovertemplate=hover + "<extra></extra>",
                marker=dict(symbol=symbol, size=14, color=color, line=dict(color="#222", width=1)))


@functools.lru_cache(maxsize=1)
def sweep_figure_json() -> dict:
    """The crossover figure without a run (the sweep's curve, the crossover, the paper's point), as
    JSON: it depends on the shipped sweep alone, and building it was most of the figure's time."""
    fig = go.Figure()
    sweep = shipped_sweep()
    points = sweep_ratios(sweep) if sweep else []
    if points:
        fig.add_trace(go.Scatter(
            x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name="what-if sweep (projected)",
            line=dict(color=method_color(SUBJECT), width=3),
            hovertemplate="acceptance scale %{x}: HierSpec %{y:.2f}× EAGLE-2 (projected)<extra></extra>"))
    cross = crossover_scale(points)
    if cross is not None:
        fig.add_trace(marker(cross, 1.0, f"crossover (scale {cross:.2f})", "x", COLORS["rejected"],
                             f"crossover: below scale {cross:.2f} EAGLE-2 wins"))
    paper = ratio_at(points, PAPER_SCALE)
    if paper is not None:
        fig.add_trace(marker(PAPER_SCALE, paper, "paper's operating point (scale 1)", "diamond", COLORS["intermediate_bonus"],
                             f"scale 1: the default rates the What-if headline assumes (with the paper's trees); "
                             f"the sweep's best configurations: {paper:.2f}× (projected)"))
    fig.add_hline(y=1.0, line=dict(color="#8C8C8C", width=1.5, dash="dash"),
                  annotation_text="EAGLE-2 (1.0×)", annotation_position="bottom right")
    fig.update_xaxes(title_text="acceptance scale (× the what-if default per-depth rates)")
    fig.update_yaxes(title_text="HierSpec / EAGLE-2 (projected)", rangemode="tozero")
    fig.update_layout(title=dict(text=TITLE, font=dict(size=14)), height=420, template="plotly_white",
                      margin=dict(t=70, l=60, r=20, b=50), legend=dict(orientation="h", y=-0.2))
    return fig.to_plotly_json()


def crossover_figure(traces: list[Trace], name: str = "this run") -> go.Figure:
    """The sweep's curve with the crossover, the paper's operating point and the run marked, in
    words `name` (the run only when it has both HierSpec and EAGLE-2 and drafts to measure
    acceptance on)."""
    fig = copy.deepcopy(sweep_figure_json())
    sweep = shipped_sweep()
    here = run_point(traces, sweep) if sweep else None
    if here is not None:
        fig["data"].append(marker(here[0], here[1], f"{name} (scale {here[0]:.2f})", "star", COLORS["target_bonus"],
                                  f"{name}: acceptance scale {here[0]:.2f}, HierSpec {here[1]:.2f}× EAGLE-2 "
                                  "re-timed at real scale (projected)"))
    return unchecked_figure(fig["data"], fig["layout"])


# The trace the Visualizer opens on (the first recorded trace, by name); quoted by the What-if tab.
OPENING_TRACE = WHATIF_SWEEP.parent.parent / "traces" / "h200-smollm2-python-tips.json"


@dataclass(frozen=True)
class Position:
    """Where a run sits against the sweep: all projected at the sweep's shapes."""
    crossover_scale: Optional[float]
    run_scale: float
    run_speedup: float          # HierSpec / EAGLE-2, the run's tokens re-timed at real scale


@functools.cache
def opening_trace_position() -> Optional[Position]:
    """The opening trace's Position, or None when the sweep or the trace is not shipped."""
    sweep = shipped_sweep()
    try:
        traces = comparison_from_json(OPENING_TRACE.read_bytes())
    except (OSError, TraceError):
        return None
    here = run_point(traces, sweep) if sweep else None
    return Position(crossover_scale(sweep_ratios(sweep)), *here) if here else None
