"""Whole-run views of one or more traces: tau and per-depth acceptance as the run goes on, the steps
where the most drafted tokens were thrown away, per-step and summary CSV, and a side-by-side table.

A run is shown as a `Series`: a label and a trace. One comparison file gives one series per method;
two files give "A: ..." and "B: ..." series, so that the same method from two files never shares a
name. Steps are numbered from 1 in everything a person reads (the app's step slider does the same);
`Rejection.step` is the trace's 0-based Step.index, for code that jumps to a step.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Optional

import plotly.graph_objects as go

from hierviz.trace import STAGES, Step, Trace, count_depth_acceptance, target_draft_len, trace_stats
from hierviz.viz.style import COLORS, STAGE_COLORS, esc, method_label

# one colour per series, from the palette's roles (they stay apart under the colour-vision
# simulations of tests/test_palette.py), and one dash per depth, so that up to four series and
# six depths stay readable on one chart
SERIES_COLORS = (COLORS["intermediate_bonus"], COLORS["target_bonus"], COLORS["tree"], COLORS["rejected"],
                 COLORS["draft"], STAGE_COLORS["draft"])
DEPTH_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
MAX_DEPTHS_DRAWN = 6


@dataclass(frozen=True)
class Series:
    label: str
    trace: Trace


@dataclass(frozen=True)
class Rejection:
    method: str         # the series' label: its method, with "A: " / "B: " in front for two files
    step: int           # Step.index (0-based)
    rejected: int       # drafted tokens the verifiers threw away on the paths they checked
    description: str


def series_of(runs: list[Trace], prefix: str = "") -> list[Series]:
    """One series per run, labelled by method (and `prefix`, e.g. "A: ", for a second file)."""
    return [Series(prefix + method_label(str(t.meta.get("method", "?"))), t) for t in runs]


# ---- per-step numbers --------------------------------------------------------------------------

def step_tau(step: Step) -> Optional[float]:
    """Tokens this step added per target forward; None when the target did not run (no tau to show)."""
    target_fw = step.forwards.get("target", 0)
    return len(step.new_tokens) / target_fw if target_fw else None


def rejected_tokens(step: Step) -> int:
    """Drafted tokens thrown away on the longest paths the verifiers checked: for each tree M verified,
    its depth minus its accepted path; for the target, its draft minus what it accepted. A long draft
    with a short acceptance scores high: the step a debugger wants to look at first."""
    by_m = sum(t.depth - len(t.accepted) for t in step.trees if t.verifier == "intermediate")
    return by_m + target_draft_len(step.sequence, step.trees) - step.target_accepted


def depth_acceptance_over_run(steps: list[Step]) -> dict[int, list[tuple[int, float]]]:
    """depth -> (step number from 1, acceptance at that depth over steps 1..that step), from the first
    step that tried the depth on; the last point equals trace_stats' per_depth_acceptance."""
    reached: dict[int, int] = {}
    accepted: dict[int, int] = {}
    out: dict[int, list[tuple[int, float]]] = {}
    for i, s in enumerate(steps):
        count_depth_acceptance(s.trees, reached, accepted)
        for d in sorted(reached):
            out.setdefault(d, []).append((i + 1, accepted.get(d, 0) / reached[d]))
    return out


# ---- figures -----------------------------------------------------------------------------------

def _layout(fig: go.Figure, title: str, y_title: str) -> go.Figure:
    # the legend under the chart wraps to one entry a line on a phone: the chart grows with it,
    # so the plot area keeps its height however many entries there are
    entries = sum(1 for t in fig.data if t.showlegend is not False)
    fig.update_layout(title=dict(text=esc(title), x=0.01), template="plotly_white", height=340 + 24 * max(0, entries - 3),
                      margin=dict(l=50, r=20, t=50, b=40), legend=dict(orientation="h", y=-0.2),
                      xaxis_title="step", yaxis_title=y_title)
    return fig


def tau_figure(series: list[Series]) -> go.Figure:
    """tau per step (tokens / target forward) for each series; steps without a target pass are gaps."""
    fig = go.Figure()
    for k, s in enumerate(series):
        taus = [step_tau(st) for st in s.trace.steps]
        fig.add_trace(go.Scatter(x=list(range(1, len(taus) + 1)), y=taus, mode="lines+markers", name=esc(s.label),
                                 line=dict(color=SERIES_COLORS[k % len(SERIES_COLORS)]),
                                 hovertemplate="step %{x}: τ %{y:.2f}<extra>" + esc(s.label) + "</extra>"))
    return _layout(fig, "τ per step (tokens per target forward)", "tokens / target forward")


def depth_figure(series: list[Series]) -> go.Figure:
    """Acceptance at each depth so far (cumulative) against the step, one colour per series and one
    dash per depth; depths past MAX_DEPTHS_DRAWN are left out (they hold few trees)."""
    fig = go.Figure()
    for k, s in enumerate(series):
        curves = depth_acceptance_over_run(s.trace.steps)
        for d in sorted(curves)[:MAX_DEPTHS_DRAWN]:
            xs, ys = zip(*curves[d])
            name = f"{s.label} · depth {d}"
            fig.add_trace(go.Scatter(x=list(xs), y=list(ys), mode="lines", name=esc(name),
                                     line=dict(color=SERIES_COLORS[k % len(SERIES_COLORS)],
                                               dash=DEPTH_DASHES[(d - 1) % len(DEPTH_DASHES)]),
                                     hovertemplate="step %{x}: %{y:.0%}<extra>" + esc(name) + "</extra>"))
    fig = _layout(fig, "acceptance by depth, over the run so far", "accepted / tried")
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return fig


def position_figure(series: list[Series], imported: Optional[tuple[str, list[float]]] = None) -> go.Figure:
    """Conditional acceptance per draft position (accepted, given the position before was), one bar
    group per position: each run's over the whole run, and `imported` = (label, rates) beside them
    (a deployment's acceptance read by hierviz.measure.acceptance_import: the same definition)."""
    fig = go.Figure()
    for k, s in enumerate(series):
        curves = depth_acceptance_over_run(s.trace.steps)
        depths = sorted(curves)[:MAX_DEPTHS_DRAWN]
        if depths:
            fig.add_trace(go.Bar(x=[f"position {d}" for d in depths], y=[curves[d][-1][1] for d in depths],
                                 name=esc(s.label), marker_color=SERIES_COLORS[k % len(SERIES_COLORS)],
                                 hovertemplate="%{x}: %{y:.0%}<extra>" + esc(s.label) + "</extra>"))
    if imported:
        label, rates = imported
        rates = rates[:MAX_DEPTHS_DRAWN]
        fig.add_trace(go.Bar(x=[f"position {d}" for d in range(1, len(rates) + 1)], y=rates, name=esc(label),
                             marker=dict(color="#777", pattern=dict(shape="/")),
                             hovertemplate="%{x}: %{y:.0%}<extra>" + esc(label) + "</extra>"))
    fig = _layout(fig, "acceptance per draft position (given the one before was accepted)", "accepted / tried")
    fig.update_layout(barmode="group", xaxis_title="draft position")
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return fig


# ---- worst rejections --------------------------------------------------------------------------

def describe_rejection(step: Step) -> str:
    """What each verifier kept of the step's drafts, in words (the step number goes beside it)."""
    parts = []
    m_trees = [t for t in step.trees if t.verifier == "intermediate"]
    if m_trees:
        paths = ", ".join(f"{len(t.accepted)}/{t.depth}" for t in m_trees)
        parts.append(f"M accepted paths {paths} (accepted/depth)")
    draft = target_draft_len(step.sequence, step.trees)
    if draft:
        parts.append(f"T accepted {step.target_accepted} of {draft} drafted")
    n = len(step.new_tokens)
    return "; ".join(parts) + f" → {n} new token{'s' if n != 1 else ''}"


def worst_rejections(series: list[Series], per_run: int = 5) -> list[Rejection]:
    """The `per_run` steps of each series that threw most drafted tokens away (rejected_tokens),
    worst first; ties go to the step that kept fewer tokens, then the earlier step. Steps that
    rejected nothing are left out."""
    out = []
    for s in series:
        scored = [(rejected_tokens(st), st) for st in s.trace.steps]
        scored = sorted((x for x in scored if x[0] > 0), key=lambda x: (-x[0], len(x[1].new_tokens), x[1].index))
        out += [Rejection(s.label, st.index, r, describe_rejection(st)) for r, st in scored[:per_run]]
    return out


# ---- CSV ---------------------------------------------------------------------------------------

STEP_COLUMNS = ("method", "step", "new_tokens", "target_forwards", "tau", "target_draft", "target_accepted",
                "tree_sizes", "accepted_path_lengths", "rejected_tokens",
                *(f"{k}_ms" for k in STAGES), "step_ms")


def step_row(label: str, step: Step) -> dict[str, object]:
    """One CSV row ("method" holds the series label); a step's trees are listed in order, separated
    by ';' (one cell per step)."""
    tau = step_tau(step)
    return {"method": label, "step": step.index + 1, "new_tokens": len(step.new_tokens),
            "target_forwards": step.forwards.get("target", 0), "tau": "" if tau is None else round(tau, 4),
            "target_draft": target_draft_len(step.sequence, step.trees), "target_accepted": step.target_accepted,
            "tree_sizes": ";".join(str(len(t.nodes)) for t in step.trees),
            "accepted_path_lengths": ";".join(str(len(t.accepted)) for t in step.trees),
            "rejected_tokens": rejected_tokens(step),
            **{f"{k}_ms": round(step.timings_ms.get(k, 0.0), 4) for k in STAGES}, "step_ms": round(step.step_ms, 4)}


def _csv(columns: tuple[str, ...] | list[str], rows: list[dict[str, object]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def steps_csv(series: list[Series]) -> str:
    return _csv(STEP_COLUMNS, [step_row(s.label, st) for s in series for st in s.trace.steps])


def _opt_round(v: Optional[float]) -> object:
    return "" if v is None else round(v, 4)


def summary_row(s: Series, max_depth: int) -> dict[str, object]:
    st = trace_stats(s.trace.steps)
    row: dict[str, object] = {
        "method": s.label, "steps": st["steps"], "new_tokens": st["new_tokens"], "total_ms": round(st["total_ms"], 4),
        "tokens_per_s": round(st["tokens_per_s"], 4), "tau_target": round(st["tau_target"], 4),
        "tau_intermediate": _opt_round(st["tau_intermediate"]), "mean_sequence_len": round(st["mean_sequence_len"], 4)}
    row.update({f"accept_depth_{d}": _opt_round(st["per_depth_acceptance"].get(d)) for d in range(1, max_depth + 1)})
    row.update({f"{k}_ms": round(v, 4) for k, v in st["stage_ms"].items()})
    return row


def summary_csv(series: list[Series]) -> str:
    """One row per series: trace_stats' numbers, with a column per depth any series tried."""
    max_depth = max((max(trace_stats(s.trace.steps)["per_depth_acceptance"], default=0) for s in series), default=0)
    rows = [summary_row(s, max_depth) for s in series]
    columns = list(rows[0]) if rows else ["method"]
    return _csv(columns, rows)


# ---- side by side ------------------------------------------------------------------------------

COMPARE_ROWS = (("tokens", "new_tokens", "{:.0f}"), ("steps", "steps", "{:.0f}"),
                ("decode time (ms)", "total_ms", "{:.1f}"), ("tokens / s", "tokens_per_s", "{:.1f}"),
                ("τ target", "tau_target", "{:.2f}"), ("τ intermediate", "tau_intermediate", "{:.2f}"),
                ("mean sequence draft", "mean_sequence_len", "{:.1f}"))


def comparison_table(series: list[Series]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a small stats table, one column per series; '–' where a number does not apply."""
    stats = [trace_stats(s.trace.steps) for s in series]
    for st in stats:      # no sequence draft (EAGLE-2, AR): nothing to average, as the app's stats table shows
        st["mean_sequence_len"] = st["mean_sequence_len"] or None
    rows = []
    for name, key, fmt in COMPARE_ROWS:
        rows.append([name] + ["–" if st[key] is None else fmt.format(st[key]) for st in stats])
    max_depth = max((max(st["per_depth_acceptance"], default=0) for st in stats), default=0)
    for d in range(1, max_depth + 1):
        rates = [st["per_depth_acceptance"].get(d) for st in stats]
        rows.append([f"accepted at depth {d}"] + ["–" if r is None else f"{100 * r:.0f}%" for r in rates])
    return ["", *(s.label for s in series)], rows


def comparison_html(series: list[Series]) -> str:
    header, rows = comparison_table(series)
    # the row names' column has no title on screen; a screen reader still hears one
    head = "".join(f"<th>{esc(h) or '<span class=hv-sr-only>measure</span>'}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    # two files' runs make a wide table: it scrolls sideways in its box (focusable, for a keyboard)
    return ('<div class="hv-table-scroll" tabindex="0" role="region" aria-label="Runs side by side">'
            f'<table class="hv-stats"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')
