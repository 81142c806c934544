"""The what-if's outputs: whatif.json, whatif.md and whatif.html (and sweep.json / sweep.html with
--sweep), from the report dict hierviz.measure.whatif builds."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from hierviz import methods as registry
from hierviz.measure.common import write_chart, write_json
from hierviz.methods import SUBJECT
from hierviz.models.drafter import head_label
from hierviz.quant.formats import DENSE, format_of_description, get_format

LABEL = "projected with replayed acceptance"


def _title(info: dict[str, Any]) -> str:
    sh = info["shapes"]
    where = info["machine"].get("gpu", info["device"])
    m = format_of_description(info["formats"]["intermediate"])
    head = get_format(info.get("intermediate_lm_head") or DENSE.name)     # --intermediate-lm-head
    parts = ([m.label] if m is not None and not m.dense else []) + ([f"LM head {head.label}"] if not head.dense else [])
    m_fmt = f" ({', '.join(parts)})" if parts else ""
    t_fmt = str(info["formats"]["target"]).split()[0]
    heads = get_format(info.get("head_format") or DENSE.name)     # --head-format
    h_fmt = f", heads {heads.label}" if not heads.dense else ""
    return f"{sh['target']} ({t_fmt}) / {sh['intermediate']}{m_fmt}{h_fmt} on {where} — {LABEL}"


def _speedup_text(info: dict[str, Any], method: str) -> str:
    """A row's speedup over AR ("1.76x"), or "no AR row" where the run had none to divide by."""
    speedup = info["speedup_vs_ar"].get(method)
    return "no AR row" if speedup is None else f"{speedup:.2f}x"


def chart_html(info: dict[str, Any]) -> str:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    ms = info["methods"]
    names = list(ms)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"tokens/s ({LABEL})", f"ms per token by stage ({LABEL})"))
    fig.add_trace(go.Bar(x=names, y=[ms[m]["tokens_per_s"] for m in names], showlegend=False,
                         text=[_speedup_text(info, m) for m in names],
                         customdata=[html.escape(ms[m].get("acceptance_source", "")) for m in names],
                         hovertemplate="%{x}: %{y:.1f} tokens/s<br>acceptance: %{customdata}<extra></extra>"), 1, 1)
    stages = sorted({k for m in names for k in ms[m]["stages_ms_per_token"]})
    for st in stages:
        fig.add_trace(go.Bar(name=st, x=names, y=[ms[m]["stages_ms_per_token"].get(st, 0.0) for m in names]), 1, 2)
    sources = [html.escape(f"{m}: {ms[m]['acceptance_source']}") for m in names if ms[m].get("acceptance_source")]
    fig.update_layout(barmode="stack", title=_title(info), template="plotly_white", margin={"b": 60 + 18 * len(sources)})
    fig.add_annotation(text="<br>".join(["acceptance per row:"] + sources), xref="paper", yref="paper", x=0, y=-0.15,
                       xanchor="left", yanchor="top", showarrow=False, align="left", font={"size": 11})
    return fig.to_html(include_plotlyjs="cdn", full_html=True)


def sweep_html(info: dict[str, Any]) -> str:
    import plotly.graph_objects as go
    sw = info["sweep"]
    fig = go.Figure()
    for key, method in (("t_tree_size", sw["tree_method"]), ("min_draft_len", SUBJECT)):
        for v in sorted({r[key] for r in sw["rows"] if r["method"] == method}):
            pts = [r for r in sw["rows"] if r["method"] == method and r[key] == v]
            fig.add_trace(go.Scatter(x=[r["scale"] for r in pts], y=[r["speedup_vs_ar"] for r in pts],
                                     mode="lines+markers", name=f"{method} {key}={v}",
                                     line={"dash": registry.get(method).dash}))
    fig.update_layout(title=f"Speedup vs AR against acceptance scale — {_title(info)}",
                      xaxis_title="acceptance-rate scale (x the base per-depth rates)",
                      yaxis_title=f"speedup vs AR ({LABEL})", template="plotly_white")
    return fig.to_html(include_plotlyjs="cdn", full_html=True)


def markdown(info: dict[str, Any]) -> str:
    lines = [f"# What-if: {_title(info)}", "",
             "| method | tokens/s | speedup vs AR | tokens/round | " +
             " | ".join(f"{k} ms/tok" for k in ("draft", "intermediate_verify", "target_verify", "overhead")) + " |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r in info["methods"].items():
        st = r["stages_ms_per_token"]
        lines.append(f"| {m} | {r['tokens_per_s']:.1f} | {_speedup_text(info, m)} | "
                     f"{r['tokens_per_round']:.2f} | " +
                     " | ".join(f"{st.get(k, 0.0):.2f}" for k in ("draft", "intermediate_verify", "target_verify", "overhead")) + " |")
    heads = " and ".join(head_label(k) for k in info.get("heads") or [info["head"]])
    lines.append(f"\nAll figures {LABEL} ({info['acceptance']['mode']}); synthetic weights, real kernels; "
                 f"{heads} draft heads.")
    lines += ["", "Acceptance per row:"] + [f"- {registry.label(m)} (`{m}`): {r['acceptance_source']}"
                                            for m, r in info["methods"].items() if r.get("acceptance_source")]
    if "sweep" in info:
        tree_name = registry.label(info["sweep"]["tree_method"])
        lines += ["", f"| scale | best {tree_name} | (tree size) | best {registry.label(SUBJECT)} | (min draft) | winner |",
                  "|---|---|---|---|---|---|"]
        for v in info["sweep"]["verdicts"]:
            lines.append(f"| {v['scale']} | {v['best_tree']:.2f}x | {v['best_tree_size']} | "
                         f"{v['best_hierspec']:.2f}x | {v['best_min_draft_len']} | {v['winner']} |")
    return "\n".join(lines) + "\n"


def write_outputs(info: dict[str, Any], out: Path) -> None:
    """whatif.json, whatif.md and whatif.html; with a sweep also sweep.json (the run's context and
    the sweep) and sweep.html."""
    sweep = info.pop("sweep", None)
    write_json(out / "whatif.json", info)
    if sweep is not None:
        context = ("schema", "shapes", "formats", "device", "machine", "settings", "w4_kernel", "tiny", "stage_sync",
                   "draft_vocab", "acceptance", "command")
        write_json(out / "sweep.json", {**{k: info[k] for k in context if k in info}, **sweep})
        info["sweep"] = sweep
    (out / "whatif.md").write_text(markdown(info))
    if write_chart(out / "whatif.html", lambda: chart_html(info)) and sweep is not None:
        write_chart(out / "sweep.html", lambda: sweep_html(info))
