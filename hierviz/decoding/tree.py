"""EAGLE-2 dynamic draft tree (Li et al. 2024), as DESIGN.md 3.2 states it.

Root = the last accepted token. The head drafts the root's top-K children; at each further
depth the K best nodes of the previous depth (by cumulative log-prob) are expanded in one head
forward; finally the best S nodes over all depths are kept (a node only with its parent).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hierviz.decoding.state import HeadState


@dataclass
class Tree:
    root: int
    tokens: list[int]        # node i's token (nodes ordered so that parents come first)
    parents: list[int]       # node index of the parent, -1 for the root
    depths: list[int]        # 1..D
    scores: list[float]      # cumulative log-prob
    logprobs: list[float]    # own log-prob given the parent

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """children()[i + 1] lists node i's children; children()[0] the root's, best first."""
        out: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        for c in out:
            c.sort(key=lambda i: -self.scores[i])
        return out

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[S, S] bool: node i sees node j iff j is i or an ancestor of i (root excluded)."""
        rows, cols = ancestor_pairs(self.parents)
        m = torch.zeros(len(self.tokens), len(self.tokens), dtype=torch.bool)
        m[rows, cols] = True      # one indexed write: per-element writes cost ~2 us each on the host
        return m.to(device)

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def ancestor_pairs(parents: list[int]) -> tuple[list[int], list[int]]:
    """(row, column) of every True of the ancestor mask (self included) of nodes whose parents
    come first (parents[i] < i; -1 = the root)."""
    chains: list[list[int]] = []
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(parents):
        chain = (chains[p] if p >= 0 else []) + [i]
        chains.append(chain)
        rows.extend([i] * len(chain))
        cols.extend(chain)
    return rows, cols


def draft_tree(head: HeadState, depth: int, topk: int, size: int) -> Tree:
    """Draft an EAGLE-2 tree rooted at the base state's last token. The head's cache is left
    as it was before the tree (only accepted pairs stay)."""
    base = head.base
    root = base.tokens[-1]
    h_root = head.root_hidden()
    committed = head.cache.length
    dev = head.head.device
    root_pos = len(base.tokens) - 1     # the root's pair sits at root_pos - 1; depth d at root_pos - 1 + d

    # candidate store: every drafted node, with its parent (-1 = root)
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    score: list[float] = []
    own: list[float] = []
    slot: dict[int, int] = {}           # candidate -> head cache slot (offset from `committed`)

    def add_children(parent_ids: list[int], hidden: torch.Tensor, parent_scores: torch.Tensor, d: int) -> list[int]:
        logp, vocab = head.head.draft_logprobs(hidden)
        k = min(topk, logp.shape[-1])
        top_lp, top_ix = logp.topk(k, dim=-1)
        if vocab is not None:
            top_ix = vocab[top_ix]
        cum = (parent_scores[:, None] + top_lp)
        new = []
        for row, pid in enumerate(parent_ids):
            for t, lp, c in zip(top_ix[row].tolist(), top_lp[row].tolist(), cum[row].tolist()):
                new.append(len(tok))
                tok.append(t)
                par.append(pid)
                dep.append(d)
                score.append(c)
                own.append(lp)
        return new

    frontier = add_children([-1], h_root[None], torch.zeros(1, device=dev), 1)
    frontier = sorted(frontier, key=lambda i: -score[i])[:topk]
    hid_of: dict[int, torch.Tensor] = {-1: h_root}   # expanded node -> its predicted feature
    for d in range(2, depth + 1):
        n = len(frontier)
        base_slot = len(slot)
        for j, c in enumerate(frontier):
            slot[c] = base_slot + j
        # each frontier node sees the committed pairs, its processed ancestors and itself
        mask = torch.zeros(n, committed + len(slot), dtype=torch.bool)
        mask[:, :committed] = True
        rows: list[int] = []
        cols: list[int] = []
        for j, c in enumerate(frontier):
            a = c
            while a >= 0:
                rows.append(j)
                cols.append(committed + slot[a])
                a = par[a]
        mask[rows, cols] = True
        parent_hidden = torch.stack([hid_of[par[c]] for c in frontier])
        # HeadState.forward takes the static (CUDA-graph) path on a GPU; columns before
        # `committed` are all visible, which is what that path needs to know
        out = head.forward([tok[c] for c in frontier], parent_hidden, [root_pos - 1 + (d - 1)] * n, mask, committed)
        for j, c in enumerate(frontier):
            hid_of[c] = out[j]
        parent_scores = torch.tensor([score[c] for c in frontier], device=dev)
        children = add_children(frontier, out, parent_scores, d)
        frontier = sorted(children, key=lambda i: -score[i])[:topk]
    head.cache.truncate(committed)

    # rerank: best `size` by score; ties prefer shallower nodes so parents come first
    order = sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))
    kept: dict[int, int] = {}
    for i in order:
        if len(kept) == size:
            break
        if par[i] < 0 or par[i] in kept:
            kept[i] = len(kept)
    # renumber in (depth, score) order so that parents precede children
    nodes = sorted(kept, key=lambda i: (dep[i], -score[i], i))
    new_ix = {c: j for j, c in enumerate(nodes)}
    return Tree(root=root, tokens=[tok[c] for c in nodes],
                parents=[new_ix[par[c]] if par[c] >= 0 else -1 for c in nodes],
                depths=[dep[c] for c in nodes], scores=[score[c] for c in nodes], logprobs=[own[c] for c in nodes])
