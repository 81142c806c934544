"""`python -m hierviz bench`: methods side by side on Spec-Bench-format questions.

Reads Spec-Bench's question JSONL ({"question_id", "category", "turns": [...]}; the first turn is
the prompt), runs every method on every question in one process (greedy unless --temperature;
first one warm-up generation per method, and on CUDA an untimed pass over every question: --warmup),
and writes to --out:
  summary.json   per method (and per category): tokens_per_s, speedup_vs_ar, tau_target,
                 tau_intermediate, per_depth_acceptance, outputs_identical_to_ar (and
                 identical_questions: how many of the questions match AR token for token)
  <method>.jsonl per-question results in Spec-Bench's answer layout
  summary.md     a markdown table;  chart.html  a plotly bar chart
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hierviz import methods as registry
from hierviz.machine import machine_info
from hierviz.measure.common import refuse, write_chart, write_json
from hierviz.methods import BASELINE, SUBJECT
from hierviz.settings import add_settings_args, settings_from_args
from hierviz.stack import add_stack_args
from hierviz.trace import Trace


class BenchError(ValueError):
    pass


def read_questions(path: str | Path, limit: Optional[int] = None, categories: Optional[list[str]] = None
                   ) -> list[dict[str, Any]]:
    """Spec-Bench JSONL; `limit` = at most that many questions per category (file order)."""
    p = Path(path)
    if not p.exists():
        raise BenchError(f"no questions file at {p}")
    out: list[dict[str, Any]] = []
    per_cat: dict[str, int] = {}
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            qid, cat, turns = q["question_id"], q.get("category", "default"), q["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise KeyError("turns")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BenchError(f"{p}:{i}: not a Spec-Bench question line ({e})") from None
        if categories and cat not in categories:
            continue
        if limit is not None and per_cat.get(cat, 0) >= limit:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        out.append({"question_id": qid, "category": cat, "prompt": turns[0]})
    if not out:
        raise BenchError(f"{p} has no questions (after filters)")
    return out


def _aggregate(traces: list[Trace]) -> dict[str, Any]:
    steps = [s for t in traces for s in t.steps]
    from hierviz.trace import trace_stats
    st = trace_stats(steps)
    return {"tokens_per_s": st["tokens_per_s"], "new_tokens": st["new_tokens"], "total_s": st["total_ms"] / 1000,
            "tau_target": st["tau_target"], "tau_intermediate": st["tau_intermediate"],
            "per_depth_acceptance": {str(k): v for k, v in st["per_depth_acceptance"].items()},
            "stage_s": {k: v / 1000 for k, v in st["stage_ms"].items()}}


def summarize(results: dict[str, list[tuple[dict, Trace]]]) -> dict[str, Any]:
    from hierviz.engine import output_tokens
    ar = {q["question_id"]: output_tokens(t) for q, t in results.get(BASELINE, [])}
    out: dict[str, Any] = {"methods": {}}
    cats = sorted({q["category"] for rs in results.values() for q, _ in rs})
    for method, rs in results.items():
        m = _aggregate([t for _, t in rs])
        m["questions"] = len(rs)
        m["per_category"] = {}
        for c in cats:
            sub = [(q, t) for q, t in rs if q["category"] == c]
            if sub:
                m["per_category"][c] = cm = _aggregate([t for _, t in sub])
                if ar:
                    same = [output_tokens(t) == ar.get(q["question_id"]) for q, t in sub]
                    cm["outputs_identical_to_ar"], cm["identical_questions"] = all(same), sum(same)
        if ar:
            same = sum(cm["identical_questions"] for cm in m["per_category"].values())
            m["outputs_identical_to_ar"], m["identical_questions"] = same == len(rs), same
        out["methods"][method] = m
    if BASELINE in out["methods"]:
        base = out["methods"][BASELINE]
        for m in out["methods"].values():
            m["speedup_vs_ar"] = m["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
            for c, cm in m["per_category"].items():
                b = base["per_category"].get(c, {}).get("tokens_per_s")
                cm["speedup_vs_ar"] = cm["tokens_per_s"] / b if b else None
    out.update(subject_ratios(out["methods"]))
    return out


def subject_ratios(results: dict[str, Any]) -> dict[str, Optional[float]]:
    """SUBJECT's tokens/s over each other compared method's that ran ("hierspec_vs_eagle2", ...;
    over the baseline it is speedup_vs_ar)."""
    if SUBJECT not in results:
        return {}
    others = [m for m in registry.comparison_order() if m not in (SUBJECT, BASELINE) and m in results]
    return {f"{SUBJECT}_vs_{m}": (results[SUBJECT]["tokens_per_s"] / results[m]["tokens_per_s"]
                                  if results[m]["tokens_per_s"] else None) for m in others}


def _identical_cell(m: dict[str, Any]) -> str:
    """"yes" / "no (k/n)": a method's outputs against AR's, question by question."""
    if "identical_questions" not in m:
        return ""
    return "yes" if m["outputs_identical_to_ar"] else f"no ({m['identical_questions']}/{m['questions']})"


def markdown(summary: dict[str, Any]) -> str:
    rows = ["| method | tokens/s | speedup vs AR | tau target | tau intermediate | identical to AR |",
            "|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        ti = m["tau_intermediate"]
        sp = m.get("speedup_vs_ar")
        rows.append(f"| {name} | {m['tokens_per_s']:.2f} | {'' if sp is None else f'{sp:.2f}x'} | "
                    f"{m['tau_target']:.2f} | {'' if ti is None else f'{ti:.2f}'} | "
                    f"{_identical_cell(m)} |")
    ratios = [f"{registry.label(SUBJECT)} / {registry.label(m)} = {summary[f'{SUBJECT}_vs_{m}']:.2f}x"
              for m in registry.comparison_order() if summary.get(f"{SUBJECT}_vs_{m}")]
    if ratios:
        rows.append("\n" + "; ".join(ratios))
    return "\n".join(rows) + "\n"


def chart_html(summary: dict[str, Any]) -> str:
    import plotly.graph_objects as go
    names = list(summary["methods"])
    cats = sorted({c for m in summary["methods"].values() for c in m["per_category"]})
    fig = go.Figure()
    for n in names:
        fig.add_bar(name=n, x=cats + ["ALL"],
                    y=[summary["methods"][n]["per_category"].get(c, {}).get("tokens_per_s", 0) for c in cats]
                    + [summary["methods"][n]["tokens_per_s"]])
    fig.update_layout(barmode="group", title="tokens/s by category", yaxis_title="tokens/s")
    return fig.to_html(include_plotlyjs="cdn", full_html=True)


def _spec_bench_answer(q: dict, t: Trace, method: str, stack: str) -> dict[str, Any]:
    steps = t.steps
    return {"question_id": q["question_id"], "category": q["category"], "answer_id": f"{method}-{q['question_id']}",
            "model_id": f"{stack}-{method}", "tstamp": time.time(),
            "choices": [{"index": 0, "turns": [t.output_text], "decoding_steps": [len(steps)],
                         "new_tokens": [sum(len(s.new_tokens) for s in steps)],
                         "wall_time": [sum(s.step_ms for s in steps) / 1000],
                         "accept_lengths": [len(s.new_tokens) for s in steps]}]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hierviz bench", description=__doc__.splitlines()[0])
    p.add_argument("--questions", required=True, help="Spec-Bench question JSONL")
    p.add_argument("--limit", type=int, default=None, help="at most N questions per category")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, of {', '.join(registry.names())} (default: every one the stack can run)")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", choices=["auto", "short", "all"], default="auto",
                   help="short: each method once on a short prompt; all: each method on every question, "
                        "untimed, before the timed pass (on a GPU new prompt lengths compile Triton kernel "
                        "variants and capture graphs: seconds that would land in the figures); "
                        "auto: all on CUDA, short on the CPU")
    add_settings_args(p)
    add_stack_args(p)
    p.set_defaults(max_new_tokens=128)
    return p


def run_questions(stack: Any, questions: list[dict[str, Any]], methods: list[str], settings: Any, warmup: str
                  ) -> tuple[dict[str, list[tuple[dict, Trace]]], list[dict]]:
    """Every method on every question, interleaved per question (machine drift hits all alike),
    after an untimed pass over every question with warmup "all": the traces per method, and the
    generations the engine refused."""
    from tqdm import tqdm

    from hierviz.engine import EngineError, generate
    if warmup == "all":
        for q in tqdm(questions, desc="warm-up", unit="question", file=sys.stderr):
            for m in methods:
                try:
                    generate(stack, m, q["prompt"], settings)
                except EngineError:
                    pass                     # reported by the timed pass
    results: dict[str, list[tuple[dict, Trace]]] = {m: [] for m in methods}
    skipped: list[dict] = []
    bar = tqdm(total=len(questions) * len(methods), desc="bench", unit="gen", file=sys.stderr)
    for q in questions:
        for m in methods:
            try:
                results[m].append((q, generate(stack, m, q["prompt"], settings)))
            except EngineError as e:
                skipped.append({"question_id": q["question_id"], "method": m, "reason": str(e)})
            bar.update(1)
    bar.close()
    return results, skipped


def write_outputs(out: Path, summary: dict[str, Any], results: dict[str, list[tuple[dict, Trace]]], stack: str) -> None:
    """summary.json, <method>.jsonl (Spec-Bench's answer layout), summary.md and chart.html."""
    write_json(out / "summary.json", summary, indent=2)
    for m, rs in results.items():
        with open(out / f"{m}.jsonl", "w", encoding="utf-8") as f:
            for q, t in rs:
                f.write(json.dumps(_spec_bench_answer(q, t, m, stack)) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    write_chart(out / "chart.html", lambda: chart_html(summary))


def main(argv: Optional[list[str]] = None) -> int:
    a = parser().parse_args(argv)
    methods = [m.strip() for m in (a.methods or ",".join(registry.names())).split(",") if m.strip()]
    bad = [m for m in methods if m not in registry.METHODS]
    if bad or not methods:
        return refuse(f"unknown method(s) {bad}; choose from {', '.join(registry.names())}")
    from hierviz.engine import EngineError, load_stack, warm_up
    from hierviz.stack import StackError
    try:
        questions = read_questions(a.questions, a.limit, a.categories.split(",") if a.categories else None)
        stack = load_stack(a.stack, a.device, a.dtype, a.w4_kernel)
        if a.methods is None:
            methods = [m for m in registry.names() if not stack.models.missing(m)]
        settings = settings_from_args(a, str(stack.device))
        warm_up(stack, methods, settings)   # first-call costs (allocations, kernel packing) stay out of the figures
    except (BenchError, EngineError, StackError, ValueError) as e:
        return refuse(str(e))
    warmup = "all" if a.warmup == "all" or (a.warmup == "auto" and stack.device.type == "cuda") else "short"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results, skipped = run_questions(stack, questions, methods, settings, warmup)
    summary = summarize(results)
    summary.update({"stack": stack.meta, "settings": settings.to_dict(), "questions": a.questions,
                    "limit_per_category": a.limit, "n_questions": len(questions), "skipped": skipped,
                    "warmup": warmup,
                    "machine": {**machine_info(stack.device), "processor": platform.processor(),
                                "device": str(stack.device)}})
    if stack.device.type != "cuda":
        from hierviz.quant.w4 import cpu_matmul_choices
        summary["machine"]["cpu_matmul"] = cpu_matmul_choices()
    write_outputs(Path(a.out), summary, results, stack.name)
    print(markdown(summary))
    return 0
