"""draft_tree_on_device keeps every depth, the rerank and the verifier's mask on the device (the
tree is read back once, with the verifier's results); this checks it builds exactly the tree of
a plain host-side statement of EAGLE-2's drafting (docs/architecture.md), on the dynamic path and
through the static (CUDA-graph-shaped) runner."""
from __future__ import annotations

import pytest
import torch

from hierviz.decoding.state import BaseState, HeadState
from hierviz.decoding.tree import TreeGraph, draft_tree_on_device
from hierviz.models import cuda_graphs
from hierviz.stack import tiny_random_stack


def run_all_but_root(state: BaseState) -> None:
    """Features for every token before the root (what an EAGLE head drafts from)."""
    root = state.tokens.pop()
    state.consume_pending()
    state.tokens.append(root)


def drafting_states(stack, static: bool, max_len: int = 200) -> tuple[BaseState, HeadState]:
    """M and E_M states ready to draft from token 60 (features for tokens 40..59), on the
    static (CUDA-graph-shaped) path or the dynamic one."""
    cuda_graphs.force_static(static)
    try:
        base = BaseState(stack.models.intermediate, max_len)
        head = HeadState(stack.models.e_m, base, max_len)
    finally:
        cuda_graphs.force_static(False)
    assert (head.runner is not None) == static
    with torch.no_grad():
        base.tokens = list(range(40, 61))
        run_all_but_root(base)
    return base, head


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[S, S] bool from the host tree, node by node: i sees j iff j is i or an ancestor of i."""
    m = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def reference_tree(head: HeadState, depth: int, topk: int, size: int) -> list[tuple]:
    """(token, parent token path, depth, score) of every kept node, by host lists: expand the
    topk best nodes of each depth (ties: earlier candidate), keep the best `size` overall."""
    base = head.base
    root_hidden = head.root_hidden()
    committed = head.cache.length
    pos = len(base.tokens) - 2
    nodes: list[dict] = []                      # token, parent index, depth, score, hidden, slot

    def expand(parents: list[int], hidden: torch.Tensor, d: int) -> list[int]:
        logp, vocab = head.head.draft_logprobs(hidden)
        lp, ix = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        ix = vocab[ix] if vocab is not None else ix
        new = []
        for row, p in enumerate(parents):
            base_score = nodes[p]["score"] if p >= 0 else 0.0
            for t, l in zip(ix[row].tolist(), lp[row].tolist()):
                nodes.append({"tok": t, "par": p, "dep": d,
                              "score": float(torch.tensor(base_score) + torch.tensor(l)), "slot": None})
                new.append(len(nodes) - 1)
        return new

    cands = expand([-1], root_hidden[None], 1)
    hid = {}
    slots = 0
    for d in range(2, depth + 1):
        frontier = sorted(cands, key=lambda i: -nodes[i]["score"])[:topk]
        for c in frontier:
            nodes[c]["slot"] = slots
            slots += 1
        mask = torch.zeros(len(frontier), committed + slots, dtype=torch.bool)
        mask[:, :committed] = True
        for j, c in enumerate(frontier):
            a = c
            while a >= 0:
                mask[j, committed + nodes[a]["slot"]] = True
                a = nodes[a]["par"]
        feats = torch.stack([hid[nodes[c]["par"]] if nodes[c]["par"] >= 0 else root_hidden for c in frontier])
        out = head.forward([nodes[c]["tok"] for c in frontier], feats, [pos + d - 1] * len(frontier), mask, committed)
        for j, c in enumerate(frontier):
            hid[c] = out[j]
        cands = expand(frontier, out, d)
    head.cache.truncate(committed)
    kept: list[int] = []
    for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i]["score"], nodes[i]["dep"], i)):
        if len(kept) < size and (nodes[i]["par"] < 0 or nodes[i]["par"] in kept):
            kept.append(i)

    def path(i: int) -> tuple:
        return path(nodes[i]["par"]) + (nodes[i]["tok"],) if i >= 0 else ()
    return sorted((nodes[i]["tok"], path(i), nodes[i]["dep"], nodes[i]["score"]) for i in kept)


def draft_tree(head: HeadState, depth: int, topk: int, size: int):
    """The decoders' draft, read back; its device-side verifier inputs must match the host tree."""
    pending = draft_tree_on_device(head, depth, topk, size)
    tree, _ = pending.read()
    assert torch.equal(pending.mask.cpu(), ancestor_mask(tree.parents))
    assert pending.depths.tolist() == tree.depths and pending.tokens.tolist() == tree.tokens
    return tree


@pytest.mark.parametrize("static", [False, True])
# (5, 64, 100): wider than a head runner's window, so the static path falls back per depth
@pytest.mark.parametrize("depth, topk, size", [(1, 4, 3), (3, 4, 10), (4, 5, 16), (5, 10, 60), (5, 64, 100)])
def test_draft_tree_matches_host_reference(static: bool, depth: int, topk: int, size: int) -> None:
    stack = tiny_random_stack()
    got, want = [], []
    for out, fn in ((got, draft_tree), (want, reference_tree)):
        base, head = drafting_states(stack, static, 400)
        with torch.no_grad():
            r = fn(head, depth, topk, size)
            assert head.cache.length == 20        # the tree's pairs are dropped again
        out.append(r)
    tree = got[0]
    rows = sorted((t, tuple(tree.tokens[j] for j in tree.path_to(i)), d, sc)
                  for i, (t, d, sc) in enumerate(zip(tree.tokens, tree.depths, tree.scores)))
    assert rows == want[0]
    assert all(p < i for i, p in enumerate(tree.parents))          # parents come first
    assert 0 < len(tree) <= size


def test_root_pair_is_provisional_when_the_base_is_one_token_short() -> None:
    """HierSpec after a fully accepted round: M has not run its own last bonus token. The head
    predicts that feature itself (as for a node inside a tree), drafts from the root with it,
    and keeps only the pairs of real features afterwards."""
    stack = tiny_random_stack()
    m, e = stack.models.intermediate, stack.models.e_m
    with torch.no_grad():
        short = BaseState(m, 200)
        short.tokens = list(range(40, 59))
        short.consume_pending()                 # features for tokens[:19]
        short.tokens += [59, 60]                # two pending: M's bonus, then the root
        head = HeadState(e, short, 200)
        got = head.root_hidden()
        assert head.cache.length == 20 and head.committed == 19
        predicted = head.last_hidden            # the head's output at pair 18: its guess of feature 19
        tree = draft_tree(head, 3, 4, 10)
        assert head.cache.length == 19           # tree pairs and the provisional root pair dropped

        full = BaseState(m, 200)
        full.tokens = list(range(40, 61))
        run_all_but_root(full)                          # features for tokens[:20] ...
        full.features[19] = predicted            # ... the last one replaced by the head's guess
        ref_head = HeadState(e, full, 200)
        want = ref_head.root_hidden()
        assert ref_head.committed == 20
        torch.testing.assert_close(got, want)
        assert len(tree) > 0 and tree.root == 60


def test_static_drafting_hands_the_runner_back() -> None:
    """The per-runner tree graphs must not keep a decoding state alive: a dropped state's runner
    (with its captured graphs) goes back to the pool for the next state."""
    import gc
    stack = tiny_random_stack()
    runners = []
    for _ in range(3):
        base, head = drafting_states(stack, True)
        with torch.no_grad():
            draft_tree(head, 3, 4, 10)
        runners.append(head.runner)
        del base, head
        gc.collect()
    assert runners[0] is runners[1] is runners[2]
    assert list(runners[0].tree_graphs.values())[0].calls == 3


def test_tree_graphs_per_runner_are_bounded() -> None:
    base, head = drafting_states(tiny_random_stack(), True)
    with torch.no_grad():
        for size in range(3, 3 + TreeGraph.KEEP + 3):
            draft_tree(head, 2, 4, size)
    assert len(head.runner.tree_graphs) == TreeGraph.KEEP
    assert max(k[2] for k in head.runner.tree_graphs) == 2 + TreeGraph.KEEP + 3
