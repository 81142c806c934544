"""HierSpec's sequence-draft settings against EAGLE-2, side by side in one process.

    python -m hierviz draft-sweep --questions assets/data/spec_bench_question.jsonl \
        [--limit 1] [--max-new-tokens 64] [--device cpu] [--stack smollm2-offline] [--eagle-trees 8,12]

Every configuration runs on every question, interleaved per question (machine drift hits all
alike), after one warm-up each; prints tokens/s, target tau per configuration.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from hierviz import methods as registry
from hierviz.engine import generate, load_stack, warm_up
from hierviz.measure.bench import read_questions
from hierviz.settings import default_settings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hierviz draft-sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--questions", required=True)
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--stack", default=None)
    ap.add_argument("--eagle-trees", default="", help="also EAGLE-2 with these tree sizes, e.g. 8,12 (a fair baseline "
                                                      "when the target's kernel changes what verifying a tree costs)")
    a = ap.parse_args(argv)
    questions = read_questions(a.questions, a.limit)
    stack = load_stack(a.stack, a.device)
    base = replace(default_settings(str(stack.device)), max_new_tokens=a.max_new_tokens)
    subject = registry.SUBJECT
    tree = registry.get(subject).counterpart or subject       # the tree method it is set against
    configs = {f"{tree} (defaults)": (tree, base),
               f"{subject} (defaults)": (subject, base),
               f"{subject} drafts >= 3": (subject, replace(base, min_draft_len=3)),
               f"{subject} drafts >= 4": (subject, replace(base, min_draft_len=4)),
               f"{subject} E_M depth 3 / 12 nodes, drafts >= 3": (subject, replace(base, m_depth=3, m_tree_size=12,
                                                                                  min_draft_len=3))}
    for size in (int(x) for x in a.eagle_trees.split(",") if x.strip()):
        configs[f"{tree} tree size {size}"] = (tree, replace(base, t_tree_size=size))
    for method, settings in configs.values():
        warm_up(stack, [method], settings)
    totals = {name: [0.0, 0, 0] for name in configs}
    for q in questions:
        for name, (method, settings) in configs.items():
            stats = generate(stack, method, q["prompt"], settings).stats()
            totals[name][0] += stats["total_ms"]
            totals[name][1] += stats["new_tokens"]
            if stats["tau_target"]:
                totals[name][2] += round(stats["new_tokens"] / stats["tau_target"])   # target forwards
    for name, (ms, tokens, passes) in totals.items():
        tau = f"{tokens / passes:.2f}" if passes else "-"
        print(f"{name:48s} {tokens / ms * 1000:7.2f} tok/s  {tokens} tokens  target tau {tau}")


if __name__ == "__main__":
    main()
