"""What-if charts (docs/whatif.md): from the dicts that `python -m hierviz whatif` writes.

- whatif.json (schema "hierviz.whatif/1", key "methods"): tokens/s per method with the speedup
  vs AR on each bar, and the per-stage time per token stacked per method;
- sweep.json (same schema, keys "rows" and "verdicts"): speedup vs AR against the acceptance
  scale, every EAGLE-2 / HierSpec configuration thin, the best of each bold, the winner marked.

Every title says "projected with replayed acceptance" (the timings are measured on synthetic
weights, the accept/reject decisions are given) and names the acceptance source and the machine.
Only plain data is read from the dicts; every string that reaches a label is HTML-escaped.
"""
from __future__ import annotations

from pathlib import PurePath
from typing import Any, Optional

import plotly.graph_objects as go

from hierviz import methods
from hierviz.methods import BASELINE, PEER, SUBJECT
from hierviz.viz.style import STAGE_COLORS, STAGE_LABELS, esc, method_color, method_label

LABEL = "projected with replayed acceptance"   # == hierviz.whatif.LABEL (kept import-free of torch)
# the roles' hues where they mean the same (HierSpec teal as accepted trees, EAGLE-2 orange as T,
# sequence spec. lavender as M drafting alone); distinct under simulated colour blindness
LABEL_TEXT_COLOR = "#1F2937"   # winner labels: the star carries the colour, the text stays readable
STAGE_ORDER = ("draft", "intermediate_verify", "target_verify", "overhead")


def kind(d: Any) -> Optional[str]:
    """"whatif" for a whatif.json dict, "sweep" for a sweep.json dict, else None."""
    if not isinstance(d, dict) or d.get("schema") != "hierviz.whatif/1":
        return None
    if isinstance(d.get("methods"), dict) and d["methods"]:
        return "whatif"
    if isinstance(d.get("rows"), list) and isinstance(d.get("verdicts"), list) and d["verdicts"]:
        return "sweep"
    return None


def _num(x: float) -> str:
    return f"{x:g}"


def machine_label(d: dict[str, Any]) -> str:
    """The GPU's name, or "CPU (torch x)"; tiny shapes say that they only show the plumbing."""
    m = d.get("machine") or {}
    if m.get("gpu"):
        where = str(m["gpu"])
    elif d.get("device") == "cpu":
        where = f"CPU (torch {m['torch']})" if m.get("torch") else "CPU"
    else:
        where = str(d.get("device", "?"))
    return where + (", tiny shapes: plumbing only" if d.get("tiny") else "")


def model_format(d: dict[str, Any], role: str = "intermediate") -> Any:
    """The weight format (hierviz.quant.formats.WeightFormat) a what-if result built a model in,
    read from its description; M: dense where the file does not say, T: the paper's format."""
    from hierviz.quant.formats import DEFAULT_FORMAT, DENSE, format_of_description, get_format  # here: no torch on import
    fallback = DENSE if role == "intermediate" else get_format(DEFAULT_FORMAT)
    return format_of_description((d.get("formats") or {}).get(role)) or fallback


def reduced_draft_vocab(d: dict[str, Any]) -> Optional[int]:
    """The heads' draft vocabulary size if a what-if result used a reduced one (`--draft-vocab`)."""
    dv = d.get("draft_vocab")
    full = ((d.get("configs") or {}).get("target") or {}).get("vocab_size")
    return dv if dv and full and dv < full else None


def published_draft_vocabs(d: dict[str, Any]) -> str:
    """", EAGLE-3 heads draft over 32000 tokens (as published)" for the head types a what-if result
    priced at their published checkpoints' reduced vocabulary; "" where none was."""
    full = ((d.get("configs") or {}).get("target") or {}).get("vocab_size")
    reduced = [f"{methods.label(t)} heads draft over {n} tokens" for t, n in (d.get("draft_vocabs") or {}).items()
               if full and n < full]
    return f", {', '.join(reduced)} (as published)" if reduced else ""


def shapes_label(d: dict[str, Any]) -> str:
    sh = d.get("shapes") or {}
    m = model_format(d)
    m_fmt = "" if m.dense else f" ({m.label})"
    dv = reduced_draft_vocab(d)
    fr = f", heads draft over {dv} tokens (FR-Spec)" if dv else published_draft_vocabs(d)
    t_fmt = str((d.get("formats") or {}).get("target") or model_format(d, "target").label).split()[0]
    return f"{sh.get('target', '?')} ({t_fmt}) / {sh.get('intermediate', '?')}{m_fmt}{fr}"


def _rates(rs: list[float]) -> str:
    return ",".join(_num(round(r, 4)) for r in rs)


def sweep_base_rates(d: dict[str, Any]) -> tuple[list[float], Optional[float]]:
    """The sweep's unscaled tree rates and sequence rate: the rows at scale 1 if there are any,
    else the smallest scale's divided by it (rates are capped at 1 only above scale 1)."""
    hs = [r for r in d.get("rows", []) if r.get("rates")]
    if not hs:
        return [], None
    one = [r for r in hs if abs(float(r["scale"]) - 1.0) < 1e-9]
    ref = (one or sorted(hs, key=lambda r: float(r["scale"])))[0]
    sc = float(ref["scale"])
    seq = next((r["seq_rate"] for r in hs if r.get("seq_rate") is not None and r["scale"] == ref["scale"]), None)
    return [round(x / sc, 4) for x in ref["rates"]], (round(seq / sc, 4) if seq is not None else None)


def acceptance_label(d: dict[str, Any]) -> str:
    """Where the accept/reject decisions came from, in one line."""
    acc = d.get("acceptance") or {}
    imp = acc.get("imported") or {}
    origin = (f"imported from {imp.get('format', '?')} file {PurePath(str(imp.get('source', '?'))).name} "
              f"({imp.get('steps', 0)} steps, mean {_num(imp.get('mean_accepted_length', 0))} draft tokens "
              f"accepted per step): " if imp else "")
    if kind(d) == "sweep":
        rates, seq = sweep_base_rates(d)
        return (origin + f"per-depth tree rates {_rates(rates)}" + (f", sequence rate {_num(seq)}" if seq is not None else "")
                + ", each x the acceptance scale (capped at 1)")
    if acc.get("mode") == "trace":
        src = PurePath(str(acc.get("source", "?"))).name
        stacks = sorted({str(s) for s in (acc.get("source_stack") or {}).values() if s})
        return f"replayed from trace {src}" + (f" ({', '.join(stacks)} stack)" if stacks else "")
    if acc.get("mode") == "rates":
        t, m = acc.get("rates") or [], acc.get("m_rates") or []
        out = origin + f"per-depth tree rates {_rates(t)}"
        if m and m != t:
            out += f" (E_M trees at M: {_rates(m)})"
        out += f", sequence rate {_num(acc.get('seq_rate', 0))}, seed {acc.get('seed', 0)}"
        return out + eagle3_record_label(acc)
    return "unknown acceptance source"


def eagle3_record_label(acc: dict[str, Any]) -> str:
    """The record EAGLE-3-drafted trees drew from, as a clause of the acceptance line ("" if none)."""
    rec = acc.get("eagle3") or {}
    if not rec:
        return ""
    taus = rec.get("published_tau") or {}
    tau = "/".join(_num(float(taus[k])) for k in ("target", "intermediate") if isinstance(taus.get(k), (int, float)))
    return (f"; trees drafted by EAGLE-3 heads: {rec.get('citation', '?')}" + (f" (τ {tau} at T/M)" if tau else "")
            + f", {PurePath(str(rec.get('source', '?'))).name}")


def subtitle(d: dict[str, Any]) -> str:
    """Two lines (plotly does not wrap titles): shapes and machine; the acceptance source."""
    return f"{esc(shapes_label(d))} on {esc(machine_label(d))}<br>acceptance: {esc(acceptance_label(d))}"


def _title(main: str, d: dict[str, Any]) -> dict[str, Any]:
    sub = "<br>".join(f"<sup>{line}</sup>" for line in subtitle(d).split("<br>"))
    return dict(text=f"{esc(main)} — {LABEL}<br>{sub}", x=0.01, xanchor="left", font=dict(size=16))


def _methods(d: dict[str, Any]) -> list[str]:
    return row_order(d.get("methods") or {})


def row_order(rows: Any) -> list[str]:
    """A result's rows (methods and variant rows) in the registry's display order, unknown ones last."""
    order = methods.row_names()
    return sorted(rows, key=lambda m: order.index(m) if m in order else len(order))


def _layout(fig: go.Figure, height: int = 440) -> go.Figure:
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=60, r=20, t=110, b=60),
                      font=dict(size=13), legend=dict(orientation="h", y=-0.18, x=0))
    return fig


def throughput_figure(d: dict[str, Any]) -> go.Figure:
    """Tokens/s per method; each bar labelled with its speedup vs AR."""
    ms, names = d["methods"], _methods(d)
    sp = d.get("speedup_vs_ar") or {}
    labels = [method_label(m) for m in names]
    tps = [float(ms[m]["tokens_per_s"]) for m in names]
    ar = methods.short(BASELINE)
    text = [(f"{sp[m]:.2f}x vs {ar}" if m != BASELINE else f"{ar} (1.00x)") if m in sp else f"{v:.1f} tok/s"
            for m, v in zip(names, tps)]
    fig = go.Figure(go.Bar(
        x=labels, y=tps, text=text, textposition="outside", cliponaxis=False, showlegend=False,
        marker_color=[method_color(m) for m in names],
        customdata=[[ms[m].get("tokens_per_round", 0.0), ms[m].get("ms_per_token", 0.0),
                     esc(str(ms[m].get("acceptance_source") or "as named above"))] for m in names],
        hovertemplate="%{x}: %{y:.1f} tokens/s<br>%{customdata[0]:.2f} tokens per round, "
                      "%{customdata[1]:.2f} ms/token<br>acceptance: %{customdata[2]}<extra></extra>"))
    fig.update_yaxes(title_text="tokens / s (decode, prefill excluded)", rangemode="tozero",
                     range=[0, max(tps + [1e-9]) * 1.18])
    fig.update_layout(title=_title("Tokens per second", d))
    return _layout(fig)


def stages_figure(d: dict[str, Any]) -> go.Figure:
    """ms per output token, stacked by stage (the trace StageTimer's stages), per method."""
    ms, names = d["methods"], _methods(d)
    labels = [method_label(m) for m in names]
    per = [ms[m].get("stages_ms_per_token") or {} for m in names]
    stages = [s for s in STAGE_ORDER if any(p.get(s) for p in per)]
    stages += sorted({k for p in per for k in p} - set(STAGE_ORDER))
    fig = go.Figure()
    for st in stages:
        fig.add_trace(go.Bar(x=labels, y=[float(p.get(st, 0.0)) for p in per], name=STAGE_LABELS.get(st, esc(st)),
                             marker_color=STAGE_COLORS.get(st, "#BBBBBB"),
                             hovertemplate=f"%{{x}} · {esc(st)}: %{{y:.3f}} ms/token<extra></extra>"))
    totals = [sum(float(v) for v in p.values()) for p in per]
    fig.add_trace(go.Scatter(x=labels, y=totals, mode="text", text=[f"{t:.2f} ms" for t in totals],
                             textposition="top center", showlegend=False, hoverinfo="skip", cliponaxis=False))
    fig.update_yaxes(title_text="ms per output token", rangemode="tozero", range=[0, max(totals + [1e-9]) * 1.18])
    # without stage syncs (benchmark mode) a stage's time is the host's: dispatch, plus any wait
    # for earlier GPU work at a read-back; the totals and tokens/s stay exact
    main = "Time per token by stage" if d.get("stage_sync") is not False else "Host time per token by stage (no stage syncs)"
    fig.update_layout(barmode="stack", title=_title(main, d))
    return _layout(fig)


def sweep_figure(d: dict[str, Any]) -> go.Figure:
    """Speedup vs AR against the acceptance scale: every configuration thin, the best of T's own
    tree method (EAGLE-2 or EAGLE-3) and best HierSpec per scale bold, a star on the winner and its
    name above each scale."""
    rows, verdicts = d.get("rows") or [], sorted(d.get("verdicts") or [], key=lambda v: float(v["scale"]))
    tree_method = d.get("tree_method", PEER)
    best_subject = f"best_{SUBJECT}"
    fig = go.Figure()
    for method, key, short in ((tree_method, "t_tree_size", "E_T tree size"), (SUBJECT, "min_draft_len", "min draft")):
        for v in sorted({r[key] for r in rows if r.get("method") == method and key in r}):
            pts = sorted((r for r in rows if r.get("method") == method and r.get(key) == v), key=lambda r: r["scale"])
            fig.add_trace(go.Scatter(
                x=[r["scale"] for r in pts], y=[r["speedup_vs_ar"] for r in pts], mode="lines+markers",
                name=f"{method_label(method)}, {short} {v}", legendgroup=method, opacity=0.45,
                line=dict(color=method_color(method), width=1.2, dash="dot"), marker=dict(size=5),
                hovertemplate=f"{method_label(method)}, {short} {v}<br>scale %{{x}}: %{{y:.2f}}x vs AR<extra></extra>"))
    xs = [v["scale"] for v in verdicts]
    for method, best, cfg, short in ((tree_method, "best_tree", "best_tree_size", "tree size"),
                                     (SUBJECT, best_subject, "best_min_draft_len", "min draft")):
        fig.add_trace(go.Scatter(
            x=xs, y=[v[best] for v in verdicts], mode="lines+markers", name=f"best {method_label(method)}",
            legendgroup=method, line=dict(color=method_color(method), width=3), marker=dict(size=8),
            customdata=[v[cfg] for v in verdicts],
            hovertemplate=f"best {method_label(method)} ({short} %{{customdata}})<br>"
                          "scale %{x}: %{y:.2f}x vs AR<extra></extra>"))
    win_best = [v[best_subject] if v["winner"] == SUBJECT else v["best_tree"] for v in verdicts]
    fig.add_trace(go.Scatter(
        x=xs, y=win_best, mode="markers", name="winner at this scale", hoverinfo="skip",
        marker=dict(symbol="star", size=17, color=[method_color(v["winner"]) for v in verdicts],
                    line=dict(color="#222", width=1))))
    for v in verdicts:
        fig.add_annotation(x=v["scale"], y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"<b>{method_label(v['winner'])}</b>",
                           font=dict(color=LABEL_TEXT_COLOR, size=12))
    fig.add_hline(y=1.0, line=dict(color=method_color(BASELINE), width=1.5, dash="dash"),
                  annotation_text=f"{methods.short(BASELINE)} (1.0x)", annotation_position="bottom right")
    fig.update_xaxes(title_text="acceptance scale (x every base rate)", tickvals=xs or None)
    fig.update_yaxes(title_text="speedup vs AR", rangemode="tozero")
    fig.update_layout(title=_title("Speedup vs acceptance: where each method wins", d))
    fig = _layout(fig, height=500)
    fig.update_layout(margin=dict(t=130))
    return fig


def figures(d: dict[str, Any]) -> list[go.Figure]:
    """The charts of one whatif.json or sweep.json dict (empty for anything else)."""
    k = kind(d)
    if k == "whatif":
        return [throughput_figure(d), stages_figure(d)]
    if k == "sweep":
        return [sweep_figure(d)]
    return []
