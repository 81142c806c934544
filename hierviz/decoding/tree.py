"""EAGLE-2 dynamic draft tree (Li et al. 2024), drafted by any head type (hierviz.models.drafter).

Root = the last accepted token. The head drafts the root's top-K children; at each further
depth the K best nodes of the previous depth (by cumulative log-prob) are expanded in one head
forward; finally the best S nodes over all depths are kept (a node only with its parent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hierviz.decoding.state import HeadState
from hierviz.models import cuda_graphs
from hierviz.models.drafter import Drafter


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

    def path_to(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


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
    mask: torch.Tensor       # [S, S] bool: node i sees node j iff j is i or one of its ancestors

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
    back with the verifier's results (PendingTree.read). With a static runner (GPU) everything
    after the root's hidden state is one CUDA graph (TreeGraph)."""
    base = head.base
    root = base.tokens[-1]
    h_root = head.root_hidden()
    root_pos = len(base.tokens) - 1     # the root's pair sits at root_pos - 1; depth d at root_pos - 1 + d
    if head.runner is not None and TreeGraph.fits(head.runner, depth, topk, head.cache.length):
        head.forwards += depth - 1
        out = TreeGraph.get(head, depth, topk, size).run(h_root, head.cache.length, root_pos)
    else:   # no static runner (CPU), or a tree wider than its buckets: one forward_tree per depth
        def step(d: int, tokens: torch.Tensor, features: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
            return head.forward_tree(tokens, features, root_pos - 1 + (d - 1), seen)
        out = _expand(head.head, h_root, depth, topk, size, step)
    head.end_tree()
    return PendingTree(root, *out)


Step = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _expand(draft_head: Drafter, h_root: torch.Tensor, depth: int, topk: int, size: int, step: Step) -> tuple:
    """The tree below the root: (tokens, parents, depths, scores, logprobs, ancestor mask) on the
    device. step(d, tokens, features, seen) runs the head over depth d's frontier."""
    dev = h_root.device
    # per depth d = 1..depth: the children drafted there, [rows, k] (row j = the j-th node expanded
    # at that depth, in frontier order), their parents as candidate ids (-1 = root)
    toks: list[torch.Tensor] = []
    lps: list[torch.Tensor] = []
    cums: list[torch.Tensor] = []
    pars: list[torch.Tensor] = []

    def add_children(hidden: torch.Tensor, parent_scores: torch.Tensor, parent_ids: torch.Tensor) -> None:
        logp, vocab = draft_head.draft_logprobs(hidden)
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
        hidden = step(d, toks[-1].reshape(-1)[pick], hidden[parent_row], seen)
        add_children(hidden, flat[pick], pick + first)
        first += toks[-2].numel()

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
    return tok[nodes], parents, dep[nodes], score[nodes], own_lp[nodes], mask


class TreeGraph:
    """draft_tree's work after the root's hidden state for one head runner and tree shape, with
    every head forward written as device ops on the runner's static buffers, so that it takes
    only two numbers from the host (the committed pairs, the root's position) and is captured
    as ONE CUDA graph on the second call (the first runs eagerly: kernel compilation, and any
    one-time host read a head makes). A tree is ~90 small kernels; launched one by one from
    Python they left the GPU waiting for the host between them."""

    KEEP = 8   # tree shapes kept per runner (each graph holds its own memory pool)

    def __init__(self, draft_head: Drafter, runner: cuda_graphs.StaticRunner, depth: int, topk: int,
                 size: int) -> None:
        # no reference to a HeadState: the runner (pooled on the model) keeps this object, and
        # a state it held alive would never hand the runner back to the pool
        self.draft_head, self.runner, self.depth, self.topk, self.size = draft_head, runner, depth, topk, size
        dev = runner.device
        pin = dev.type == "cuda"
        self.h_root = torch.zeros(draft_head.cfg.hidden_size, dtype=runner.model.dtype, device=dev)
        self.scalars = torch.zeros(2, dtype=torch.long, device=dev)             # committed, root position
        self.scalars_host = torch.zeros(2, dtype=torch.long, pin_memory=pin)
        self.scalars_np = self.scalars_host.numpy()
        self.copied = torch.cuda.Event() if pin else None
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.out: Optional[tuple] = None
        self.calls = 0
        self.tree_pairs = 0                              # head cache slots the tree's forwards fill

    @staticmethod
    def fits(runner: cuda_graphs.StaticRunner, depth: int, topk: int, committed: int) -> bool:
        """Whether every depth's forward fits the runner's buckets, windows and cache (the frontier
        has at most topk nodes; depth d's forward sees (d - 1) x frontier tree slots)."""
        b = cuda_graphs.bucket_for(topk)
        slots = (depth - 1) * topk
        return b is not None and slots <= b + runner.window_extra and committed + slots <= runner.live_len

    @staticmethod
    def get(head: HeadState, depth: int, topk: int, size: int) -> "TreeGraph":
        key = (depth, topk, size, id(head.head.draft_vocab))
        graphs = head.runner.tree_graphs
        tg = graphs.pop(key, None)
        if tg is None or tg.draft_head is not head.head:
            tg = TreeGraph(head.head, head.runner, depth, topk, size)
        graphs[key] = tg                                  # most recently used last
        while len(graphs) > TreeGraph.KEEP:               # a UI user trying many tree settings
            graphs.pop(next(iter(graphs)))
        return tg

    def _step(self, d: int, tokens: torch.Tensor, features: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Depth d's head forward (HeadState.forward_tree's inputs, built on the device from the
        two scalars): rows at depth d's position, after the tree slots of earlier depths."""
        self.tree_pairs = seen.shape[1]
        return self.runner.run_on_device(tokens, self.scalars[1:2] + (d - 2), self.scalars[0:1],
                                         seen.shape[1] - tokens.shape[0], seen, features)

    def _body(self) -> tuple:
        return _expand(self.draft_head, self.h_root, self.depth, self.topk, self.size, self._step)

    def run(self, h_root: torch.Tensor, committed: int, root_pos: int) -> tuple:
        runner = self.runner
        if self.copied is not None:
            self.copied.synchronize()                    # the previous upload from the pinned buffer is done
        self.scalars_np[0] = committed             # a numpy store: ~1 us, a torch one ~10
        self.scalars_np[1] = root_pos
        self.scalars.copy_(self.scalars_host, non_blocking=self.copied is not None)
        if self.copied is not None:
            self.copied.record()
        self.h_root.copy_(h_root)
        with torch.no_grad():
            if runner.graphs and self.calls >= 1:
                if self.graph is None:
                    self.graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(self.graph):
                        self.out = self._body()
                self.graph.replay()
                out = self.out
            else:
                out = self._body()
        self.calls += 1
        runner.cache.length = committed + self.tree_pairs   # the tree's pairs, until end_tree
        return out
