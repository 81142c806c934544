"""EAGLE-2 dynamic draft tree (Li et al. 2024), as DESIGN.md 3.2 states it.

Root = the last accepted token. The head drafts the root's top-K children; at each further
depth the K best nodes of the previous depth (by cumulative log-prob) are expanded in one head
forward; finally the best S nodes over all depths are kept (a node only with its parent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
    as it was before the tree (only accepted pairs stay).

    Every depth stays on the model's device: the frontier (the `topk` best candidates of the
    last depth, ties to the earlier candidate) is chosen by a stable sort there and the next
    head forward reads it directly, so a GPU draft makes one host round trip, at the end,
    instead of one per depth."""
    base = head.base
    root = base.tokens[-1]
    h_root = head.root_hidden()
    committed = head.cache.length
    dev = head.head.device
    root_pos = len(base.tokens) - 1     # the root's pair sits at root_pos - 1; depth d at root_pos - 1 + d

    # per depth d = 1..depth: the children drafted there, [rows, k] (row j = the j-th node expanded
    # at that depth, in frontier order), and which of them were expanded next (flat indices)
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    cums: list[torch.Tensor] = []
    picks: list[torch.Tensor] = []

    def add_children(hidden: torch.Tensor, parent_scores: torch.Tensor) -> None:
        logp, vocab = head.head.draft_logprobs(hidden)
        top_lp, top_ix = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        toks.append(vocab[top_ix] if vocab is not None else top_ix)
        lps.append(top_lp)
        cums.append(parent_scores[:, None] + top_lp)

    add_children(h_root[None], torch.zeros(1, device=dev))
    hidden = h_root[None]
    seen: Optional[torch.Tensor] = None      # [frontier, slots so far]: which drafted slots each node sees
    for d in range(2, depth + 1):
        flat = cums[-1].reshape(-1)
        pick = torch.sort(flat, descending=True, stable=True).indices[:topk]
        picks.append(pick)
        n = pick.numel()
        parent_row = torch.div(pick, cums[-1].shape[1], rounding_mode="floor")
        # a frontier node sees the committed pairs, its expanded ancestors and itself
        own = torch.eye(n, dtype=torch.bool, device=dev)
        seen = own if seen is None else torch.cat([seen[parent_row], own], 1)
        out = head.forward_tree(toks[-1].reshape(-1)[pick], hidden[parent_row], root_pos - 1 + (d - 1), seen)
        hidden = out
        add_children(out, flat[pick])
    head.cache.truncate(committed)

    # the one read-back: every depth's candidates and picks
    ints = torch.cat([t.reshape(-1) for t in toks] + picks).tolist()
    floats = torch.cat([x.reshape(-1) for x in lps + cums]).tolist()
    n_cand = [t.numel() for t in toks]
    widths = [t.shape[1] for t in toks]
    total = sum(n_cand)
    tok = ints[:total]
    pick_lists, o = [], total
    for p in picks:
        pick_lists.append(ints[o:o + p.numel()])
        o += p.numel()
    own_lp, score = floats[:total], floats[total:]
    par: list[int] = []
    dep: list[int] = []
    start = 0                             # candidate id of depth d's first child
    for d in range(1, len(toks) + 1):
        if d == 1:
            par.extend([-1] * n_cand[0])
        else:
            prev_start = start - n_cand[d - 2]
            for c in pick_lists[d - 2]:
                par.extend([prev_start + c] * widths[d - 1])
        dep.extend([d] * n_cand[d - 1])
        start += n_cand[d - 1]

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
                depths=[dep[c] for c in nodes], scores=[score[c] for c in nodes], logprobs=[own_lp[c] for c in nodes])
