"""Hand-made traces for developing and testing the UI without a model.

No model runs here. A fixed sentence plays the target's greedy output; the intermediate model
agrees with it except at a few random positions; the EAGLE drafters propose top-K children with
made-up log-probs that include the verifier's token with some probability. Trees are built the
way EAGLE-2 builds them (expand the best K per depth, keep the global best S by cumulative
log-prob) and verified the way the engine verifies them (follow the verifier's tokens from the
root), so every trace is self-consistent. Timings are invented. Traces carry
meta["synthetic"] = True so that nobody mistakes them for measurements.
"""
from __future__ import annotations

import math
import random

from hierviz.trace import DraftTree, SeqToken, Step, Trace, TreeNode

SENTENCE = (
    " Speculative decoding lets a small model guess several tokens ahead, and the large model"
    " checks all the guesses in a single pass. Every guess it agrees with is a token we get"
    " almost for free; the first guess it rejects is replaced by its own choice, so the text is"
    " exactly what the large model would have written alone."
)
FILLER = [" the", " a", " model", " tokens", " fast", " and", " of", " we", " it", " small", " large",
          " so", " guess", " in", " time", " text", ",", ".", " one", " more", " pass", " draft"]
PROMPT = "Explain speculative decoding in two sentences."
SYNTHETIC_NOTE = "hand-made by hierviz.viz.sample for UI development: no model ran, timings are invented"


class _Vocab:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.ids.setdefault(text, 100 + len(self.ids))


def _words(text: str) -> list[str]:
    out, cur = [], ""
    for ch in text:
        if ch == " " and cur:
            out.append(cur)
            cur = ""
        if ch in ",.;" and cur:
            out.append(cur)
            out.append(ch)
            cur = ""
            continue
        cur += ch
    if cur:
        out.append(cur)
    return out


def build_tree(rng: random.Random, vocab: _Vocab, root_text: str, truth: list[str], depth: int, topk: int,
               size: int, hit: float, verifier: str) -> DraftTree:
    """An EAGLE-2-style tree whose drafter proposes truth[d] at on-path nodes with probability `hit`."""
    nodes: list[dict] = []           # candidate nodes: text, parent (candidate index or -1), depth, logprob, score
    frontier = [(-1, 0.0, True)]     # (candidate index, cumulative score, on the verifier's path)
    for d in range(depth):
        cands = []
        for parent, pscore, on_path in frontier:
            texts = []
            if on_path and d < len(truth) and rng.random() < hit:
                texts.append(truth[d])
            while len(texts) < topk:
                w = rng.choice(FILLER)
                if w not in texts and not (on_path and d < len(truth) and w == truth[d]):
                    texts.append(w)
            probs = sorted((rng.random() ** 2 for _ in texts), reverse=True)
            total = sum(probs) * rng.uniform(1.05, 1.6)
            for rank, w in enumerate(texts):
                lp = math.log(probs[rank] / total)
                cands.append(dict(text=w, parent=parent, depth=d + 1, logprob=lp, score=pscore + lp,
                                  on_path=on_path and d < len(truth) and w == truth[d]))
        start = len(nodes)
        nodes.extend(cands)
        best = sorted(range(start, len(nodes)), key=lambda i: -nodes[i]["score"])[:topk]
        frontier = [(i, nodes[i]["score"], nodes[i]["on_path"]) for i in best]
    # global rerank: best `size` by cumulative score, then make sure every kept node's parent is kept
    keep = set(sorted(range(len(nodes)), key=lambda i: -nodes[i]["score"])[:size])
    for i in sorted(keep, key=lambda i: -nodes[i]["depth"]):
        p = nodes[i]["parent"]
        while p >= 0 and p not in keep:
            keep.add(p)
            p = nodes[p]["parent"]
    order = sorted(keep, key=lambda i: (nodes[i]["depth"], -nodes[i]["score"]))
    new_id = {c: k + 1 for k, c in enumerate(order)}
    tree_nodes = [TreeNode(new_id[c], vocab(nodes[c]["text"]), nodes[c]["text"],
                           new_id.get(nodes[c]["parent"], 0), nodes[c]["depth"],
                           round(nodes[c]["score"], 4), round(nodes[c]["logprob"], 4)) for c in order]
    # verification: from the root follow the child whose token is the verifier's own token
    accepted, cur = [], 0
    for d in range(len(truth)):
        nxt = next((n for n in tree_nodes if n.parent == cur and n.text == truth[d]), None)
        if nxt is None:
            break
        accepted.append(nxt.id)
        cur = nxt.id
    bonus = truth[len(accepted)] if len(accepted) < len(truth) else rng.choice(FILLER)
    return DraftTree(vocab(root_text), root_text, tree_nodes, accepted, vocab(bonus), bonus, verifier)


def _meta(method: str, **extra) -> dict:
    return {"method": method, "synthetic": True, "source": SYNTHETIC_NOTE, "prompt": PROMPT,
            "stack": "hand-made", "device": "none", **extra}


def hierspec_trace(seed: int = 0, max_new_tokens: int = 48, m_depth: int = 3, m_topk: int = 10,
                   m_tree_size: int = 30, min_draft_len: int = 6) -> Trace:
    rng = random.Random(seed)
    vocab = _Vocab()
    target = _words(SENTENCE)
    settings = dict(m_depth=m_depth, m_topk=m_topk, m_tree_size=m_tree_size, min_draft_len=min_draft_len,
                    max_new_tokens=max_new_tokens, temperature=0.0)
    trace = Trace(_meta("hierspec", settings=settings), prompt_tokens=9, prefill_ms=14.0)
    out: list[str] = []
    last = ":"
    while len(out) < min(max_new_tokens, len(target)):
        pos = len(out)
        # M agrees with T except at a few positions; after its first disagreement it wanders off
        m_out, diverged = [], False
        for j in range(pos, pos + min_draft_len + m_depth + 2):
            t = target[j] if j < len(target) else "."
            if diverged or rng.random() < 0.2:
                diverged = True
                t = rng.choice(FILLER)
            m_out.append(t)
        d: list[SeqToken] = []
        trees: list[DraftTree] = []
        root = last
        while len(d) < min_draft_len:
            tree = build_tree(rng, vocab, root, m_out[len(d):], m_depth, m_topk, m_tree_size, 0.8, "intermediate")
            ti = len(trees)
            trees.append(tree)
            by_id = {n.id: n for n in tree.nodes}
            d += [SeqToken(by_id[a].token, by_id[a].text, "tree", ti) for a in tree.accepted]
            d.append(SeqToken(tree.bonus_token, tree.bonus_text, "intermediate_bonus", ti))
            root = tree.bonus_text
        n = 0
        while n < len(d) and pos + n < len(target) and d[n].text == target[pos + n]:
            n += 1
        bonus_t = target[pos + n] if pos + n < len(target) else "."
        new = d[:n] + [SeqToken(vocab(bonus_t), bonus_t, "target_bonus")]
        new = new[: max_new_tokens - pos]
        out += [s.text for s in new]
        last = out[-1]
        timings = {"draft": round(sum(1.1 * m_depth + rng.uniform(0, 0.4) for _ in trees), 3),
                   "intermediate_verify": round(sum(2.2 + rng.uniform(0, 0.5) for _ in trees), 3),
                   "target_verify": round(9.0 + 0.12 * (len(d) + 1) + rng.uniform(0, 0.8), 3),
                   "overhead": round(0.5 + 0.1 * len(trees) + rng.uniform(0, 0.2), 3)}
        trace.steps.append(Step(len(trace.steps), "hierspec", [s.token for s in new], [s.text for s in new],
                                [s.source for s in new], timings, trees, d, n, vocab(bonus_t), bonus_t,
                                {"target": 1, "intermediate": len(trees), "e_m": len(trees) * m_depth}))
    trace.output_text = "".join(out)
    trace.finish_reason = "length"
    return trace


def eagle2_trace(seed: int = 1, max_new_tokens: int = 48, t_depth: int = 5, t_topk: int = 10,
                 t_tree_size: int = 60) -> Trace:
    rng = random.Random(seed)
    vocab = _Vocab()
    target = _words(SENTENCE)
    settings = dict(t_depth=t_depth, t_topk=t_topk, t_tree_size=t_tree_size, max_new_tokens=max_new_tokens,
                    temperature=0.0)
    trace = Trace(_meta("eagle2", settings=settings), prompt_tokens=9, prefill_ms=30.0)
    out: list[str] = []
    last = ":"
    while len(out) < min(max_new_tokens, len(target)):
        pos = len(out)
        truth = target[pos: pos + t_depth + 1]
        tree = build_tree(rng, vocab, last, truth, t_depth, t_topk, t_tree_size, 0.75, "target")
        by_id = {n.id: n for n in tree.nodes}
        texts = [by_id[a].text for a in tree.accepted] + [tree.bonus_text]
        sources = ["tree"] * len(tree.accepted) + ["target_bonus"]
        texts, sources = texts[: max_new_tokens - pos], sources[: max_new_tokens - pos]
        out += texts
        last = out[-1]
        timings = {"draft": round(1.4 * t_depth + rng.uniform(0, 0.5), 3), "intermediate_verify": 0.0,
                   "target_verify": round(9.0 + 0.15 * (len(tree.nodes) + 1) + rng.uniform(0, 1.0), 3),
                   "overhead": round(0.6 + rng.uniform(0, 0.2), 3)}
        trace.steps.append(Step(len(trace.steps), "eagle2", [vocab(t) for t in texts], texts, sources, timings,
                                [tree], [], len(tree.accepted), tree.bonus_token, tree.bonus_text,
                                {"target": 1, "e_t": t_depth}))
    trace.output_text = "".join(out)
    trace.finish_reason = "length"
    return trace


def ar_trace(seed: int = 2, max_new_tokens: int = 48) -> Trace:
    rng = random.Random(seed)
    vocab = _Vocab()
    target = _words(SENTENCE)[:max_new_tokens]
    trace = Trace(_meta("ar", settings=dict(max_new_tokens=max_new_tokens, temperature=0.0)),
                  prompt_tokens=9, prefill_ms=12.0)
    for i, t in enumerate(target):
        trace.steps.append(Step(i, "ar", [vocab(t)], [t], ["target_bonus"],
                                {"draft": 0.0, "intermediate_verify": 0.0,
                                 "target_verify": round(8.8 + rng.uniform(0, 0.6), 3), "overhead": 0.2},
                                target_bonus=vocab(t), target_bonus_text=t, forwards={"target": 1}))
    trace.output_text = "".join(target)
    trace.finish_reason = "length"
    return trace


def comparison(seed: int = 0, max_new_tokens: int = 48) -> list[Trace]:
    """HierSpec, EAGLE-2 and AR on the same (pretend) prompt."""
    return [hierspec_trace(seed, max_new_tokens), eagle2_trace(seed + 1, max_new_tokens),
            ar_trace(seed + 2, max_new_tokens)]


if __name__ == "__main__":   # python -m hierviz.viz.sample assets/traces/handmade-demo.json
    import sys

    from hierviz.trace import save_comparison

    runs = comparison(0, 48)
    for r in runs:
        r.meta["title"] = "Hand-made demo: HierSpec vs EAGLE-2 vs AR"
    save_comparison(runs, sys.argv[1])
