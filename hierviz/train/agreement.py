"""How well the intermediate M predicts the target T on benchmark prompts: the quantity that bounds
HierSpec's target tau, measured directly.

    python -m hierviz train agreement --questions assets/data/spec_bench_question.jsonl --limit 1 \
        [--stack smollm2-offline] [--max-new-tokens 64] [--draft-len 6] [--device cpu] --out agreement.json

For every question T writes its greedy answer (the engine's AR decoder); then T and M each read
prompt + answer in one causal forward, and at every position that predicts an answer token the
two argmaxes are compared (M through its own output vocabulary, as it runs in HierSpec). Reported
per category and overall: the top-1 agreement, and `tau_bound` = 1 + the mean number of
consecutive agreements from a position, capped at --draft-len: the target tau HierSpec would reach
if its draft were always M's own greedy continuation of that length (E_M's tree only loses from there).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz.methods import BASELINE
from hierviz.config import recorded_command


@torch.no_grad()
def argmax_along(model, ids: list[int], start: int) -> torch.Tensor:
    """The model's greedy prediction at positions start-1 .. len(ids)-2 (those predicting ids[start:])."""
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    hidden = model.forward(tokens, torch.arange(len(ids), device=model.device))
    return model.logits(hidden[start - 1:len(ids) - 1]).argmax(-1).cpu()


def agreement_runs(agree: list[bool], cap: int) -> list[int]:
    """For each position, how many consecutive agreements start there (at most cap)."""
    runs, cur = [0] * len(agree), 0
    for i in range(len(agree) - 1, -1, -1):
        cur = cur + 1 if agree[i] else 0
        runs[i] = min(cur, cap)
    return runs


def _summary(agree: list[bool], runs: list[int]) -> dict[str, Any]:
    n = len(agree)
    return {"positions": n, "top1_agreement": round(sum(agree) / n, 4) if n else None,
            "tau_bound": round(1 + sum(runs) / n, 3) if n else None}


def measure(stack, questions: list[dict[str, Any]], max_new_tokens: int, draft_len: int,
            progress=None) -> dict[str, Any]:
    from hierviz.settings import DecodeSettings
    from hierviz.engine import EngineError, generate, output_tokens, prepare
    if stack.models.intermediate is None:
        raise ValueError(f"stack {stack.name!r} has no intermediate model")
    settings = DecodeSettings(max_new_tokens=max_new_tokens)
    per_q, by_cat, skipped = [], {}, []
    for q in questions:
        try:
            prompt_ids, _ = prepare(stack, BASELINE, q["prompt"], settings)
            trace = generate(stack, BASELINE, q["prompt"], settings)
        except EngineError as e:        # e.g. a prompt longer than the model's context: skipped, reported
            skipped.append({"question_id": q["question_id"], "category": q["category"], "reason": str(e)})
            if progress:
                progress()
            continue
        answer = output_tokens(trace)
        if not answer:
            continue
        ids = prompt_ids + answer
        t_pred = argmax_along(stack.models.target, ids, len(prompt_ids))
        m_pred = argmax_along(stack.models.intermediate, ids, len(prompt_ids))
        # T's own argmax must give back its answer: the forward here is the decoder's computation
        consistent = t_pred.tolist() == answer
        agree = (t_pred == m_pred).tolist()
        runs = agreement_runs(agree, draft_len)
        per_q.append({"question_id": q["question_id"], "category": q["category"], **_summary(agree, runs),
                      "target_consistent": consistent})
        a, r = by_cat.setdefault(q["category"], ([], []))
        a.extend(agree)
        r.extend(runs)
        if progress:
            progress()
    all_a = [x for a, _ in by_cat.values() for x in a]
    all_r = [x for _, r in by_cat.values() for x in r]
    return {"stack": stack.name, "intermediate": stack.meta.get("intermediate"), "max_new_tokens": max_new_tokens,
            "draft_len": draft_len, "overall": _summary(all_a, all_r),
            "per_category": {c: _summary(a, r) for c, (a, r) in sorted(by_cat.items())}, "questions": per_q,
            "skipped": skipped}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz train agreement", description=__doc__.split("\n")[0])
    ap.add_argument("--questions", required=True, help="Spec-Bench-style JSONL")
    ap.add_argument("--limit", type=int, default=None, help="questions per category (file order)")
    ap.add_argument("--stack", default=None, help="preset name or stack JSON (default: smollm2-offline)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=6, help="longest sequence draft counted in tau_bound")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True, help="JSON report")
    a = ap.parse_args(argv)
    if a.max_new_tokens < 1 or a.draft_len < 1:
        ap.error("--max-new-tokens and --draft-len must be >= 1")
    from tqdm import tqdm

    from hierviz.measure.bench import BenchError, read_questions
    from hierviz.engine import EngineError, load_stack
    from hierviz.stack import StackError
    try:
        questions = read_questions(a.questions, a.limit)
        stack = load_stack(a.stack, a.device)
        bar = tqdm(total=len(questions), desc="agreement", unit="q", file=sys.stderr)
        report = measure(stack, questions, a.max_new_tokens, a.draft_len, progress=bar.update)
        bar.close()
    except (BenchError, EngineError, StackError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report["command"] = recorded_command("train agreement", argv)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"{'category':16s} {'positions':>9s} {'top-1':>7s} {'tau_bound':>9s}")
    for c, s in [*report["per_category"].items(), ("overall", report["overall"])]:
        print(f"{c:16s} {s['positions']:9d} {s['top1_agreement']!s:>7s} {s['tau_bound']!s:>9s}")
    for sk in report["skipped"]:
        print(f"skipped question {sk['question_id']} ({sk['category']}): {sk['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
