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


@dataclass
class PendingTree:
    """A drafted tree still on the model's device, never read back: what a verifier's forward
    needs (tokens, depths, ancestor mask) and what the host needs afterwards, which `read`
    fetches in one transfer together with the verifier's own results. Node order as in Tree."""
    root: int
    tokens: torch.Tensor     # [S] long
    parents: torch.Tensor    # [S] long, -1 = the root
    depths: torch.Tensor     # [S] long, 1..D
    scores: torch.Tensor     # [S] float32
    logprobs: torch.Tensor   # [S] float32
    mask: torch.Tensor       # [S, S] bool: ancestor_mask

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def read(self, *extra: torch.Tensor) -> tuple[Tree, list[list[int]]]:
        """The host Tree and each `extra` integer tensor as a flat list, in one transfer (the
        ids travel as float64, exact below 2**53, next to the float32 scores)."""
        s = len(self)
        parts = [self.tokens, self.parents, self.depths, self.scores, self.logprobs] + [e.reshape(-1) for e in extra]
        vals = torch.cat([x.double() for x in parts]).tolist()
        ints = [int(v) for v in vals[:3 * s]]
        tree = Tree(self.root, ints[:s], ints[s:2 * s], ints[2 * s:], vals[3 * s:4 * s], vals[4 * s:5 * s])
        out, o = [], 5 * s
        for e in extra:
            out.append([int(v) for v in vals[o:o + e.numel()]])
            o += e.numel()
        return tree, out


def draft_tree(head: HeadState, depth: int, topk: int, size: int) -> Tree:
    """draft_tree_on_device, read back: the host Tree."""
    return draft_tree_on_device(head, depth, topk, size).read()[0]


def draft_tree_on_device(head: HeadState, depth: int, topk: int, size: int) -> PendingTree:
    """Draft an EAGLE-2 tree rooted at the base state's last token. The head's cache is left
    as it was before the tree (only accepted pairs stay).

    Nothing is read back: every depth's frontier (the `topk` best candidates of the last depth,
    ties to the earlier candidate) is chosen by a stable sort on the device and the next head
    forward reads it directly; the rerank and the verifier's mask are built there too, so the
    verifier's forward is queued behind the draft without a host round trip and the tree comes
    back with the verifier's results (PendingTree.read)."""
    base = head.base
    root = base.tokens[-1]
    h_root = head.root_hidden()
    dev = head.head.device
    root_pos = len(base.tokens) - 1     # the root's pair sits at root_pos - 1; depth d at root_pos - 1 + d

    # per depth d = 1..depth: the children drafted there, [rows, k] (row j = the j-th node expanded
    # at that depth, in frontier order), their parents as candidate ids (-1 = root)
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    cums: list[torch.Tensor] = []
    pars: list[torch.Tensor] = []

    def add_children(hidden: torch.Tensor, parent_scores: torch.Tensor, parent_ids: torch.Tensor) -> None:
        logp, vocab = head.head.draft_logprobs(hidden)
        top_lp, top_ix = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        toks.append(vocab[top_ix] if vocab is not None else top_ix)
        lps.append(top_lp)
        cums.append(parent_scores[:, None] + top_lp)
        pars.append(parent_ids[:, None].expand_as(top_ix))

    add_children(h_root[None], torch.zeros(1, device=dev), torch.full((1,), -1, dtype=torch.long, device=dev))
    hidden = h_root[None]
    first = 0                                # candidate id of the last depth's first child
    seen: Optional[torch.Tensor] = None      # [frontier, slots so far]: which drafted slots each node sees
    for d in range(2, depth + 1):
        flat = cums[-1].reshape(-1)
        pick = torch.sort(flat, descending=True, stable=True).indices[:topk]
        n = pick.numel()
        parent_row = torch.div(pick, cums[-1].shape[1], rounding_mode="floor")
        # a frontier node sees the committed pairs, its expanded ancestors and itself
        own = torch.eye(n, dtype=torch.bool, device=dev)
        seen = own if seen is None else torch.cat([seen[parent_row], own], 1)
        out = head.forward_tree(toks[-1].reshape(-1)[pick], hidden[parent_row], root_pos - 1 + (d - 1), seen)
        hidden = out
        add_children(out, flat[pick], pick + first)
        first += toks[-2].numel()
    head.end_tree()

    # rerank: the best `size` candidates by score, ties to the shallower then earlier one. A
    # child's score is its parent's plus a log-prob <= 0, so its parent always ranks before it
    # and the kept set is closed under parents without a check.
    tok = torch.cat([t.reshape(-1) for t in toks])
    own_lp = torch.cat([x.reshape(-1) for x in lps]).float()
    score = torch.cat([x.reshape(-1) for x in cums]).float()
    par = torch.cat([x.reshape(-1) for x in pars])
    dep = torch.cat([torch.full((t.numel(),), i + 1, dtype=torch.long, device=dev) for i, t in enumerate(toks)])
    kept = torch.sort(score, descending=True, stable=True).indices[:size]   # candidates are in (depth, id) order
    # renumber in (depth, score) order so that parents precede children
    nodes = kept[torch.sort(dep[kept], stable=True).indices]
    new_ix = torch.full_like(tok, -1)
    new_ix[nodes] = torch.arange(nodes.numel(), device=dev)
    p = par[nodes]
    parents = torch.where(p >= 0, new_ix[p.clamp_min(0)], p)
    # ancestor mask: self, then one generation up per depth below the deepest
    s = nodes.numel()
    rows = torch.arange(s, device=dev)
    mask = torch.eye(s, dtype=torch.bool, device=dev)
    up = parents
    for _ in range(depth - 1):
        has = up >= 0
        mask[rows, up.clamp_min(0)] |= has
        up = torch.where(has, parents[up.clamp_min(0)], up)
    return PendingTree(root, tok[nodes], parents, dep[nodes], score[nodes], own_lp[nodes], mask)
