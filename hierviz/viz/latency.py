"""Per-stage latency bars: the inspected step, and the cumulative time of each run to the same
number of output tokens (a fair race: each bar is "time to write the first N tokens")."""
from __future__ import annotations

import copy
import functools
from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hierviz.methods import METHODS
from hierviz.trace import STAGES, Step, Trace
from hierviz.viz.style import STAGE_COLORS, STAGE_LABELS, method_label
from hierviz.viz.unchecked import unchecked_figure


def stage_name(method: str, stage: str) -> str:
    """A stage's bar label in a method's run (its registry entry's), else the stage's general label."""
    m = METHODS.get(method)
    return (m.stage_names if m else {}).get(stage, STAGE_LABELS[stage])


def tokens_through(trace: Trace, step: int) -> int:
    return sum(len(s.new_tokens) for s in trace.steps[: step + 1])


def step_reaching(trace: Trace, n_tokens: int) -> Optional[int]:
    """Index of the first step after which the trace has at least n_tokens, else None."""
    total = 0
    for i, s in enumerate(trace.steps):
        total += len(s.new_tokens)
        if total >= n_tokens:
            return i
    return None


def _stage_ms(steps: list[Step]) -> dict[str, float]:
    return {k: sum(s.timings_ms.get(k, 0.0) for s in steps) for k in STAGES}


def latency_rows(main: Trace, step: int, others: list[Trace]) -> tuple[list[tuple[str, dict, str]], list[tuple[str, dict, str]]]:
    """Rows (label, stage -> ms, method) of the two charts: the inspected step, and the cumulative
    time to the same output position. Other runs are shown at the step that produced that position."""
    n = tokens_through(main, step)
    st = main.steps[step]
    step_rows = [(f"{method_label(st.method)} · step {step + 1} ({len(st.new_tokens)} tok)", dict(st.timings_ms), st.method)]
    cum_rows = [(f"{method_label(st.method)} · {n} tok", _stage_ms(main.steps[: step + 1]), st.method)]
    for o in others:
        if not o.steps:
            continue
        j = step_reaching(o, n)
        done = j is not None
        j = j if done else len(o.steps) - 1
        os_ = o.steps[j]
        m = method_label(os_.method)
        step_rows.append((f"{m} · step {j + 1} ({len(os_.new_tokens)} tok)", dict(os_.timings_ms), os_.method))
        got = tokens_through(o, j)
        cum_rows.append((f"{m} · {got} tok" + ("" if done else " (so far)"), _stage_ms(o.steps[: j + 1]), os_.method))
    return step_rows, cum_rows


TOTAL_TEXT_PX = 72   # room right of the plot for the longest total (" 2356.6 ms") at any width


@functools.lru_cache(maxsize=4)
def _two_chart_layout(unit: str) -> dict:
    """The two charts' layout from make_subplots (axis domains, titles), made once per unit: making
    it took half of a figure's time, and the figure is rebuilt on every streamed step. The unit goes
    on the x axes and the titles end at the figure's right edge, so on a narrow screen the titles
    run over the bars' labels instead of past the figure's edge."""
    layout = make_subplots(rows=2, cols=1, vertical_spacing=0.3,
                           subplot_titles=("This step", "Time to write the same number of tokens")
                           ).to_plotly_json()["layout"]
    for title in layout["annotations"]:
        title.update(x=1, xanchor="right", xshift=TOTAL_TEXT_PX - 10, font=dict(size=14))
    for axis in ("xaxis", "xaxis2"):
        layout[axis].update(title=dict(text=unit, font=dict(size=12), standoff=4), nticks=5)
    return layout


def latency_figure(main: Optional[Trace], step: int = -1, others: Optional[list[Trace]] = None,
                   projected: bool = False) -> go.Figure:
    """Stage bars of one step and the time each run took to write the same number of tokens;
    projected: the runs are re-timed at real scale (hierviz.retime), and the titles say so."""
    layout = copy.deepcopy(_two_chart_layout("ms, projected at real scale" if projected else "ms"))
    if main is None or not main.steps:
        layout.update(template="none", height=330, margin=dict(l=10, r=10, t=40, b=10), plot_bgcolor="white")
        layout["annotations"].append(dict(text="Latency bars appear once a run has steps.", showarrow=False, x=0.5,
                                          y=0.5, xref="paper", yref="paper", font=dict(size=14)))
        return unchecked_figure([], layout)
    step = step if step >= 0 else len(main.steps) - 1
    step_rows, cum_rows = latency_rows(main, step, others or [])
    traces = []
    for row_idx, rows, sfx in ((1, step_rows, ""), (2, cum_rows, "2")):     # sfx: the row's axes, x / x2
        axes = dict(xaxis=f"x{sfx}", yaxis=f"y{sfx}")
        rows = rows[::-1]                        # plotly draws the first category at the bottom
        labels = [r[0] for r in rows]
        for stage in STAGES:
            vals = [r[1].get(stage, 0.0) for r in rows]
            if not any(vals):
                continue
            names = [stage_name(r[2], stage) for r in rows]
            traces.append(dict(
                type="bar", y=labels, x=vals, orientation="h", name=STAGE_LABELS[stage], legendgroup=stage,
                showlegend=row_idx == 1, marker=dict(color=STAGE_COLORS[stage]),
                customdata=names, hovertemplate="%{customdata}: %{x:.2f} ms<extra></extra>", **axes))
        totals = [sum(r[1].values()) for r in rows]
        traces.append(dict(type="scatter", y=labels, x=totals, mode="text", text=[f" {t:.1f} ms" for t in totals],
                           textposition="middle right", showlegend=False, hoverinfo="skip", cliponaxis=False,
                           textfont=dict(size=13), **axes))
        layout[f"xaxis{sfx}"].update(
            range=[0, max(totals) * 1.05 if max(totals) > 0 else 1], gridcolor="#eee")
    for axis in ("yaxis", "yaxis2"):
        layout[axis].update(automargin=True, ticksuffix=" ")
    n_rows = len(step_rows) + len(cum_rows)
    layout.update(template="none", barmode="stack", height=200 + 46 * n_rows,
                  margin=dict(l=10, r=TOTAL_TEXT_PX, t=40, b=10),
                  plot_bgcolor="white", paper_bgcolor="white", font=dict(size=13),
                  legend=dict(orientation="h", x=0, y=-0.12, yanchor="top"), bargap=0.35)
    return unchecked_figure(traces, layout)
