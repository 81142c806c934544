"""Accept/reject decisions, greedy and lossless sampling (tree and sequence level).

Tree level: a node's children are distinct, deterministic candidates; trying them in order
with "accept x with probability p(x), else zero it and renormalise" samples exactly from p.
Sequence level: standard speculative sampling with the drafter's distributions q.
"""
from __future__ import annotations

import torch

from hierviz.decoding.tree import Tree


class Sampler:
    """Temperature / top-p warping and a seeded random source. temperature 0 = greedy."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution(s) [..., V] in float32 on the CPU."""
        p = torch.softmax(logits.float().cpu() / self.temperature, -1)
        if self.top_p < 1.0:
            sp, ix = p.sort(-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (sp.cumsum(-1) - sp) >= self.top_p
            sp = sp.masked_fill(drop, 0.0)
            p = torch.zeros_like(p).scatter_(-1, ix, sp)
            p = p / p.sum(-1, keepdim=True)
        return p

    def sample(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p, 1, generator=self.gen))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen))

    def pick(self, logits: torch.Tensor) -> int:
        """One token from a single row of logits."""
        if self.greedy:
            return int(logits.argmax(-1))
        return self.sample(self.probs(logits))


def verify_tree_greedy(tree: Tree, best: list[int]) -> tuple[list[int], int]:
    """best [S+1]: the verifier's argmax at the root (row 0) and after node i (row i+1). Returns
    the accepted node path and the verifier's bonus token (its argmax after the last accepted node)."""
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if tree.tokens[c] == best[row]), None)
        if nxt is None:
            return path, best[row]
        path.append(nxt)
        row = nxt + 1


def verify_tree_sampling(tree: Tree, logits: torch.Tensor, sampler: Sampler
                         ) -> tuple[list[int], int, list[torch.Tensor]]:
    """Lossless multi-candidate verification. Returns the path, the bonus token (sampled from
    the residual), and the verifier's full distribution at every emitted token's position
    (path tokens then the bonus): each emitted token is an exact sample from it."""
    probs = sampler.probs(logits)
    kids = tree.children()
    path: list[int] = []
    dists: list[torch.Tensor] = []
    row = 0
    while True:
        p = probs[row]
        dists.append(p)
        residual = p.clone()
        accepted = None
        for c in kids[row]:
            t = tree.tokens[c]
            mass = float(residual.sum())
            if mass <= 0:
                break
            if sampler.uniform() < float(residual[t]) / mass:
                accepted = c
                break
            residual[t] = 0.0
        if accepted is None:
            if float(residual.sum()) <= 0:   # numerical corner: all mass on rejected children
                residual = p
            return path, sampler.sample(residual / residual.sum()), dists
        path.append(accepted)
        row = accepted + 1


def verify_sequence_greedy(draft: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """logits [n+1, V]: row i predicts draft[i]. Returns (accepted count, bonus token)."""
    best = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return n, best[n]


def verify_sequence_sampling(draft: list[int], q: list[torch.Tensor], logits: torch.Tensor,
                             sampler: Sampler) -> tuple[int, int]:
    """Speculative sampling: accept draft[i] with prob min(1, p/q); at the first rejection
    sample from norm(max(0, p - q)); if all pass, the bonus comes from p."""
    p = sampler.probs(logits)
    for i, t in enumerate(draft):
        pi, qi = p[i], q[i]
        if sampler.uniform() * float(qi[t]) < float(pi[t]):    # r < p/q without dividing by 0
            continue
        residual = (pi - qi).clamp_min(0.0)
        if float(residual.sum()) <= 0:
            residual = pi
        return i, sampler.sample(residual / residual.sum())
    return len(draft), sampler.sample(p[len(draft)])



# ---- forced decisions (what-if replay, hierviz.measure.whatif) ----------------------------------------
# The what-if projection runs the real decoding loops on synthetic-weight models, whose own
# argmax decisions mean nothing. An "oracle" then dictates only HOW MANY draft tokens the
# verifier accepts; everything else (the forward over the same tokens, the logits readback,
# cache compaction, rollback) runs unchanged. The normal path never passes an oracle.

class AcceptOracle:
    """Interface: the forced accepted length for one verification.
    level: "intermediate" (M verifies an E_M tree), "target" (T verifies a tree or a sequence)."""

    def tree(self, level: str, tree: Tree) -> int:
        raise NotImplementedError

    def sequence(self, level: str, draft: list[int]) -> int:
        raise NotImplementedError


def forced_tree_path(tree: Tree, best: list[int], n: int) -> tuple[list[int], int]:
    """Accept a root path of length min(n, deepest node): the path to the best-scoring node at
    that depth (EAGLE-2's most likely branch). Bonus = the verifier's argmax after it (best, as
    for verify_tree_greedy)."""
    depth = min(max(0, n), max(tree.depths, default=0))
    if depth == 0:
        return [], best[0]
    end = max((i for i, d in enumerate(tree.depths) if d == depth), key=lambda i: (tree.scores[i], -i))
    path = tree.path_to(end)
    return path, best[path[-1] + 1]


def forced_sequence(draft: list[int], logits: torch.Tensor, n: int) -> tuple[int, int]:
    """Accept the first min(n, len(draft)) draft tokens; bonus = the verifier's argmax there."""
    best = logits.argmax(-1).tolist()
    n = min(max(0, n), len(draft))
    return n, best[n]
