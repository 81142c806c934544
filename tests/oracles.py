"""Test oracles for lossless decoding with real acceptance.

Two pieces:

* `greedy_continuation`: the target's greedy output as a plain argmax loop (a full forward over
  the whole sequence each step, no KV cache): the ground truth every method must reproduce.

* Steered drafters: wrappers around the intermediate M and the EAGLE heads E_M / E_T that
  propose the target's TRUE greedy continuation, with a controllable error pattern (`Policy`).
  Only proposals are steered. The target T is never wrapped: every acceptance decision T makes
  comes from its own logits (M's logits are steered as a whole, its verification of E_M's trees
  included: M only ever drafts for T).

How a proposal is steered. A drafter's logits are a function of a hidden-state row, and the row
alone does not say which context produced it. So the wrappers see each forward (tokens,
positions, KV cache, attention mask): a `TrackedCache` keeps every cache slot's token and
position, through the engine's truncations and compactions, so a row's context is exactly the
tokens its mask lets it see. The wrapper checks that context against the greedy sequence and
files (the row's exact bits) -> (position predicted, tree depth, on the greedy path?). When the
engine later asks for the logits of a row (a slice of that forward's output, or a head's root
feature kept from an earlier forward), the row's bits find its entry; the real logits are then
rewritten as the policy says. An unknown row, or a row whose visible positions are not exactly
0..p, raises `OracleError`: the oracle cannot go silently unsteered, and the engine's masks and
positions are checked on the way.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from hierviz.decoding.decoders import Models, cache_margin
from hierviz.decoding.state import BaseState
from hierviz.settings import DecodeSettings
from hierviz.models.eagle import EagleHead
from hierviz.models.llama import KVCache, Transformer, causal_mask
from hierviz.trace import DraftTree, Trace

BOOST = 10.0      # steered tokens sit this far above the row's real maximum
RANK_STEP = 0.25  # gap between the boosted tokens of a "rank" row: distinct, never tied


class OracleError(AssertionError):
    """The oracle cannot steer (unknown row, inconsistent mask); a failure, never a skip."""


# ---- the target's greedy output ----------------------------------------------------------------

@torch.no_grad()
def greedy_continuation(model: Transformer, prompt: list[int], n: int, eos: Optional[set[int]] = None,
                        margins: Optional[list[float]] = None) -> list[int]:
    """n greedy tokens (fewer when one is in `eos`, which is kept): each step is one full forward
    over prompt + tokens so far, with no KV cache, and the argmax of the last row. margins, when
    given, receives each step's gap between the best and the second-best logit."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        hidden = model(torch.tensor(seq), torch.arange(len(seq)))
        logits = model.logits(hidden[-1:])[0]
        tok = int(logits.argmax())
        if margins is not None:
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
        out.append(tok)
        seq.append(tok)
        if eos is not None and tok in eos:
            break
    return out


def one_forward_at_a_time(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens through the engine's own state (its KV cache, and its static runner where
    one is on), each token read to the host before the next forward is queued."""
    st = BaseState(model, len(prompt) + n + 8)
    st.tokens = list(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(int(st.next_logits().argmax()))
        st.tokens.append(out[-1])
    return out


# ---- what a steered drafter proposes --------------------------------------------------------------

def _unit(*xs: int) -> float:
    """A deterministic value in [0, 1) from integers (no Python hash randomisation)."""
    h = 0x9E3779B1
    for x in xs:
        h = ((h ^ (x & 0xFFFFFFFF)) * 0x85EBCA6B + 0xC2B2AE35) & 0xFFFFFFFF
        h ^= h >> 15
    return h / 2 ** 32


@dataclass(frozen=True)
class Policy:
    """How a steered drafter ranks the right token (the target's greedy one) on the greedy path.

    exact:    right token first.
    upto:     right through tree depth k, wrong below (a head's depth; 1 = the root's children).
    rank:     k - 1 wrong tokens ranked above the right one (present, not first; k = 1 is exact).
    tie:      the right token and one wrong token share the top logit exactly.
    periodic: wrong at every predicted position p with (p + seed) % (k + 1) == k, right elsewhere:
              after a rejection the next draft is right for exactly k tokens.
    rate:     wrong at position p with probability `rate` (a fixed draw per position and seed).
    off:      no steering: the model's own logits (negative control).
    "Wrong" puts a wrong token first and the right one last."""
    kind: str = "exact"
    k: int = 1
    rate: float = 0.0
    seed: int = 0

    KINDS = ("exact", "upto", "rank", "tie", "periodic", "rate", "off")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown policy {self.kind!r}")

    def action(self, pos: int, depth: int) -> str:
        """'right', 'wrong', 'rank' or 'tie' for the token at absolute position pos (tree depth)."""
        k = self.kind
        if k == "exact" or (k == "rank" and self.k <= 1):
            return "right"
        if k == "upto":
            return "right" if depth <= self.k else "wrong"
        if k == "periodic":
            return "wrong" if (pos + self.seed) % (self.k + 1) == self.k else "right"
        if k == "rate":
            return "wrong" if _unit(self.seed, pos) < self.rate else "right"
        return k    # rank, tie

    def wrong_tokens(self, pos: int, right: int, vocab: int, n: int, salt: int) -> list[int]:
        """n distinct tokens other than `right`, fixed per (seed, salt, position)."""
        start = int(_unit(self.seed, salt, pos) * vocab)
        out: list[int] = []
        t = start
        while len(out) < n:
            if t != right and t not in out:
                out.append(t)
            t = (t + 1) % vocab
        return out

    def choice(self, pos: int, right: int, vocab: int, salt: int, depth: int = 1) -> int:
        """The argmax of a steered row (what a greedy drafter picks)."""
        a = self.action(pos, depth)
        if a == "right" or self.kind == "off":
            return right
        w = self.wrong_tokens(pos, right, vocab, max(1, self.k - 1) if a == "rank" else 1, salt)
        if a == "tie":
            return min(right, w[0])   # torch.argmax: the first of equal maxima
        return w[0]

    def steer(self, row: torch.Tensor, pos: int, right: int, depth: int, salt: int) -> None:
        """Rewrite one row of real logits in place."""
        a = self.action(pos, depth)
        top = float(row.max()) + BOOST
        vocab = row.shape[-1]
        if a == "right":
            row[right] = top
        elif a == "wrong":
            row[right] = float(row[torch.isfinite(row)].min()) - BOOST
            row[self.wrong_tokens(pos, right, vocab, 1, salt)[0]] = top
        elif a == "tie":
            row[self.wrong_tokens(pos, right, vocab, 1, salt)[0]] = top
            row[right] = top
        else:   # rank k: k - 1 wrong tokens above the right one, in a fixed order
            ws = self.wrong_tokens(pos, right, vocab, self.k - 1, salt)
            for i, w in enumerate(ws):
                row[w] = top + RANK_STEP * (len(ws) - i)
            row[right] = top


@dataclass(frozen=True)
class Regime:
    """One policy per steered drafter."""
    name: str
    e_t: Policy
    e_m: Policy
    m: Policy


SALT = {"e_t": 1, "e_m": 2, "m": 3}   # each drafter's wrong tokens differ


# ---- slot bookkeeping ------------------------------------------------------------------------

class TrackedCache(KVCache):
    """A KV cache that also keeps each slot's token, position and whether a tree forward wrote it,
    through every truncate / keep / move_to the engine makes."""

    @classmethod
    def around(cls, cache: KVCache) -> "TrackedCache":
        tc = cls.__new__(cls)
        tc.__dict__.update(cache.__dict__)
        tc.ids = torch.full((cache.max_len,), -1, dtype=torch.long)
        tc.pos = torch.full((cache.max_len,), -1, dtype=torch.long)
        tc.tree = torch.zeros(cache.max_len, dtype=torch.bool)
        return tc

    def write(self, tokens: torch.Tensor, positions: torch.Tensor, tree: bool,
              slots: Optional[torch.Tensor] = None) -> None:
        s, t = self.length, tokens.shape[0]
        at = slice(s, s + t) if slots is None else slots.cpu()
        self.ids[at] = tokens.cpu()
        self.pos[at] = positions.cpu()
        self.tree[at] = tree

    def static_forward(self, positions: torch.Tensor, slots: torch.Tensor) -> tuple[int, bool]:
        """(start, is a draft-tree forward) of a static-path forward, which always has a mask.
        The runner writes at start = slots[0]; the committed slots end at self.length. A tree
        frontier past depth 2 writes after the earlier depths' slots (start > length); depth 2's
        frontier rows share one position (padded rows sit at position 0). A one-node frontier
        looks like one accepted pair, so static-path oracle cases draft with top-k >= 2."""
        start = int(slots[0])
        pos = positions.cpu().tolist()
        return start, start > self.length or (len(pos) > 1 and pos[0] == pos[1] != 0)

    def move_to(self, start: int, src: torch.Tensor) -> None:
        n = src.numel()
        if n:
            s = src.cpu()
            self.ids[start:start + n] = self.ids[s].clone()
            self.pos[start:start + n] = self.pos[s].clone()
            self.tree[start:start + n] = self.tree[s].clone()
        super().move_to(start, src)


@dataclass
class _Row:
    pos: int        # absolute index of the token this row predicts
    depth: int      # 1 + the tree slots the row sees (heads); 0 for M
    on_path: bool   # everything the row sees is the greedy sequence


class _Book:
    """hidden-row bits -> what that row predicts."""

    def __init__(self) -> None:
        self.rows: dict[bytes, Optional[_Row]] = {}

    def file(self, hidden: torch.Tensor, rows: list[Optional[_Row]]) -> None:
        arr = hidden.detach().float().contiguous().cpu().numpy()
        for i, r in enumerate(rows):
            key = arr[i].tobytes()
            old = self.rows.get(key)
            if r is None:                    # a static bucket's padding row: never overwrites a real one
                self.rows.setdefault(key, None)
                continue
            if old is not None and old != r:
                raise OracleError(f"two contexts gave the same hidden row: {old} vs {r}")
            self.rows[key] = r

    def look_up(self, hidden: torch.Tensor) -> list[_Row]:
        arr = hidden.detach().float().contiguous().cpu().numpy()
        out = []
        for i in range(arr.shape[0]):
            key = arr[i].tobytes()
            r = self.rows.get(key)
            if r is None:
                raise OracleError("logits asked for a hidden row no recorded forward produced" if key not in self.rows
                                  else "logits asked for a row that does not see positions 0..p exactly once")
            out.append(r)
        return out


class GreedyPath:
    """The sequence every method must follow: prompt + the target's greedy continuation."""

    def __init__(self, prompt: list[int], continuation: list[int]) -> None:
        self.prompt_len = len(prompt)
        self.tokens = list(prompt) + list(continuation)
        self.full = torch.tensor(self.tokens, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.tokens)

    def on_path(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Slot-wise: token ids[i] is the greedy sequence's token at pos[i]."""
        ok = (pos >= 0) & (pos < len(self.tokens))
        return ok & (self.full[pos.clamp(0, len(self.tokens) - 1)] == ids)


def _rows(cache: TrackedCache, start: int, t: int, positions: torch.Tensor, mask: Optional[torch.Tensor],
          path: GreedyPath, pair_shift: int, static: bool = False) -> list[Optional[_Row]]:
    """Each new row's context from the slots its mask shows. pair_shift: 0 for a model (slot p
    holds token p), 1 for an EAGLE head (slot p holds the pair (feature_p, token_{p+1})).
    static: a static bucket's forward, whose padding rows see only their own slot and are never
    read; a row that breaks the invariant is filed as None and fails only if its logits are asked."""
    n = start + t if mask is None else mask.shape[-1]     # static path: a mask over the whole cache
    vis = (causal_mask(start, t) if mask is None else mask.cpu()).bool()
    if tuple(vis.shape) != (t, n):
        raise OracleError(f"mask has shape {tuple(vis.shape)}, expected {(t, n)}")
    pos = cache.pos[:n]
    rowpos = positions.cpu()
    # the engine's invariant: a row sees each position 0..p exactly once (p: its own position)
    if bool((vis & (pos < 0)[None]).any()):
        raise OracleError("a row sees a cache slot that has no position")
    pos = pos.clamp_min(0)
    span = max(int(rowpos.max()), int(pos.max())) + 1
    seen = vis.float() @ torch.nn.functional.one_hot(pos, span).float()
    want = (torch.arange(span)[None] <= rowpos[:, None]).float()
    broken = (seen != want).any(1)
    if bool(broken.any()) and not static:
        bad = int(broken.nonzero()[0])
        raise OracleError(f"row {bad} (position {int(rowpos[bad])}) does not see positions 0..p exactly once")
    on = path.on_path(cache.ids[:n], pos + pair_shift)
    row_on = ~(vis & ~on[None]).any(1)
    depth = 1 + (vis & cache.tree[:n][None]).sum(1)
    return [None if b else _Row(int(p) + 1 + pair_shift, int(d) if pair_shift else 0, bool(o))
            for p, d, o, b in zip(rowpos, depth, row_on, broken.tolist())]


@dataclass
class SteerLog:
    """What the steered drafters did: rows steered, and off-path rows."""
    steered: Counter = field(default_factory=Counter)
    off_path: Counter = field(default_factory=Counter)


class SteeredModel:
    """The intermediate M with steered logits. Delegates everything else to the real model (the
    decoders read cfg, device, dtype; E_M's head reads its embeddings and rope)."""

    def __init__(self, model: Transformer, path: GreedyPath, policy: Policy, log: SteerLog) -> None:
        self.inner, self.path, self.policy, self.log = model, path, policy, log
        self.calls = 0                   # forwards run, for check_forwards
        self.book = _Book()
        self.static_runners: list = []   # its own pool: a runner calls the model it was made for

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def new_cache(self, max_len: int) -> TrackedCache:
        return TrackedCache.around(self.inner.new_cache(max_len))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Optional[KVCache] = None,
                 attn_mask: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(cache, TrackedCache):
            raise OracleError("the steered intermediate runs only with its own cache")
        self.calls += 1
        start, tree = (cache.length, attn_mask is not None) if slots is None else cache.static_forward(positions, slots)
        cache.write(tokens, positions, tree, slots)
        hidden = self.inner(tokens, positions, cache, attn_mask, slots)
        self.book.file(hidden, _rows(cache, start, tokens.shape[0], positions, attn_mask, self.path, 0,
                                     static=slots is not None))
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.inner.logits(hidden)
        if self.policy.kind == "off":
            return out
        for i, r in enumerate(self.book.look_up(hidden)):
            if not r.on_path:
                self.log.off_path["m"] += 1
                continue   # past a wrong proposal: M's own logits (T rejects there anyway)
            if r.pos >= len(self.path):
                raise OracleError(f"M predicts position {r.pos}, past the oracle's greedy sequence")
            self.policy.steer(out[i], r.pos, self.path.tokens[r.pos], r.depth, SALT["m"])
            self.log.steered["m"] += 1
        return out


class SteeredHead:
    """An EAGLE head with steered draft logits. Rows off the greedy path get flat logits, so that
    the nodes under a wrong proposal never outrank the right one (the tree's shape under a
    steered policy is then known exactly, see `expected_tree_accept`)."""

    def __init__(self, head: EagleHead, path: GreedyPath, policy: Policy, log: SteerLog, name: str) -> None:
        if head.draft_vocab is not None:
            raise OracleError("steering a reduced draft vocabulary is not supported")
        self.inner, self.path, self.policy, self.log, self.name = head, path, policy, log, name
        self.calls = 0                   # forwards run, for check_forwards
        self.book = _Book()
        self.static_runners: list = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def new_cache(self, max_len: int) -> TrackedCache:
        return TrackedCache.around(self.inner.new_cache(max_len))

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                 cache: Optional[KVCache], attn_mask: Optional[torch.Tensor] = None,
                 slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(cache, TrackedCache):
            raise OracleError("the steered head runs only with its own cache")
        self.calls += 1
        # HeadState's causal forwards feed accepted pairs; its masked ones are draft-tree frontiers
        start, tree = (cache.length, attn_mask is not None) if slots is None else cache.static_forward(positions, slots)
        cache.write(tokens, positions, tree, slots)
        out = self.inner(tokens, features, positions, cache, attn_mask, slots)
        self.book.file(out, _rows(cache, start, tokens.shape[0], positions, attn_mask, self.path, 1,
                                  static=slots is not None))
        return out

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        out, _ = self.inner.draft_logits(hidden)
        if self.policy.kind == "off":
            return out, None
        out = out.clone()
        for i, r in enumerate(self.book.look_up(hidden)):
            if not r.on_path:
                out[i] = 0.0
                self.log.off_path[self.name] += 1
                continue
            if r.pos >= len(self.path):
                raise OracleError(f"{self.name} predicts position {r.pos}, past the oracle's greedy sequence")
            self.policy.steer(out[i], r.pos, self.path.tokens[r.pos], r.depth, SALT[self.name])
            self.log.steered[self.name] += 1
        return out, None

    def draft_logprobs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, ids = self.draft_logits(hidden)
        return torch.log_softmax(logits, -1), ids


def steered_models(models: Models, path: GreedyPath, regime: Regime, log: Optional[SteerLog] = None) -> Models:
    """The same T; M, E_M and E_T wrapped to follow `path` as `regime` says (the wrappers share
    the real models' weights: nothing is copied)."""
    log = log if log is not None else SteerLog()
    m = SteeredModel(models.intermediate, path, regime.m, log) if models.intermediate is not None else None
    e_m = SteeredHead(models.e_m, path, regime.e_m, log, "e_m") if models.e_m is not None else None
    e_t = SteeredHead(models.e_t, path, regime.e_t, log, "e_t") if models.e_t is not None else None
    return Models(models.target, m, e_m, e_t)


def continuation_needed(s: DecodeSettings) -> int:
    """Greedy tokens the oracle must know for a run of these settings: the budget plus the most
    any round drafts past the accepted tokens."""
    return s.max_new_tokens + cache_margin(s)


# ---- what the traces show ---------------------------------------------------------------------

@dataclass
class Tally:
    """Acceptance over many runs, from the traces alone."""
    runs: int = 0
    trees: int = 0
    tree_nodes_accepted: int = 0
    accepted_by: Counter = field(default_factory=Counter)          # tree nodes accepted, per verifier
    full_trees: int = 0
    sequences: int = 0
    full_sequences: int = 0
    tree_reject_depth: Counter = field(default_factory=Counter)   # first depth with no accepted node
    seq_reject_at: Counter = field(default_factory=Counter)       # 1-based index of the first rejected token
    eos_from_draft: int = 0          # runs whose EOS was a draft token the verifier accepted
    eos_inside_draft: int = 0        # ... with accepted draft tokens after it (cut by the engine)
    budget_cut_draft: int = 0        # runs whose last round's accepted draft ran past max_new_tokens

    @property
    def full_drafts(self) -> int:
        return self.full_trees + self.full_sequences

    def add(self, other: "Tally") -> None:
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, Counter):
                mine.update(getattr(other, f.name))
            else:
                setattr(self, f.name, mine + getattr(other, f.name))


def greedy_walk(tree: DraftTree, path: GreedyPath, root_index: int) -> list[int]:
    """Node ids of the longest root path whose tokens follow the greedy sequence: what a greedy
    verifier that agrees with the target must accept."""
    kids: dict[int, list] = {}
    for n in tree.nodes:
        kids.setdefault(n.parent, []).append(n)
    out: list[int] = []
    at, idx = 0, root_index + 1
    while idx < len(path):
        nxt = [n for n in kids.get(at, []) if n.token == path.tokens[idx]]
        if not nxt:
            break
        if len(nxt) > 1:
            raise AssertionError(f"node {at} has two children with token {path.tokens[idx]}")
        at = nxt[0].id
        out.append(at)
        idx += 1
    return out


def expected_tree_accept(policy: Policy, topk: int, size: int, depth: int) -> tuple[int, int]:
    """Bounds on the accepted path of one steered tree rooted on the greedy path, verified by a
    verifier that agrees with the target. depth: the tree's deepest node.

    With off-path rows flat, a right node at depth d has a better score than everything under its
    wrong siblings (those lose log(vocab) per level against at most RANK_STEP * (k - 1) gained),
    so its rank among all candidates, and whether it survives the frontier (top-k) and the final
    size cut, follows from the policy alone."""
    kind = policy.kind
    if kind == "exact":
        return depth, depth
    if kind == "upto":
        n = min(policy.k, depth)
        return n, n
    if kind == "rank":
        return (1, depth) if policy.k <= min(topk, size) else (0, 0)
    if kind == "tie":
        return (1, depth) if min(topk, size) >= 2 else (0, depth)
    return 0, depth


def check_run(trace: Trace, method: str, path: GreedyPath, regime: Optional[Regime], s: DecodeSettings,
              eos: set[int], tally: Tally, vocab: int) -> None:
    """Assert a run is lossless and its acceptance is what the oracle implies; add it to tally.

    Output: exactly the greedy tokens, up to the first EOS or the budget. Per round: T accepted
    exactly the longest correct prefix of a sequence draft / path of a tree (it is greedy and
    agrees with itself); the steered drafters proposed what their policies say."""
    p0 = path.prompt_len
    want = path.tokens[p0:p0 + s.max_new_tokens]
    for j, t in enumerate(want):
        if t in eos:
            want = want[:j + 1]
            break
    got = [t for st in trace.steps for t in st.new_tokens]
    assert got == want, f"{method}: output differs from the greedy oracle at {_first_diff(got, want)}"
    assert trace.finish_reason == ("eos" if want and want[-1] in eos else "length"), trace.finish_reason
    tally.runs += 1
    emitted = 0
    for i, st in enumerate(trace.steps):
        base = p0 + emitted            # absolute index of the round's first new token
        emitted += len(st.new_tokens)
        if i == 0:
            continue
        last = i == len(trace.steps) - 1
        if st.sequence:
            _check_sequence(st, method, path, regime, base, vocab, tally, s)
        for k, tree in enumerate(st.trees):
            offset = sum(1 for x in st.sequence if x.tree is not None and x.tree < k)
            _check_tree(tree, method, path, regime, s, base - 1 + offset, tally)
        _check_round_record(st, method, s)
        if last:
            n_acc = st.target_accepted
            if trace.finish_reason == "eos" and st.new_sources[-1] != "target_bonus":
                tally.eos_from_draft += 1
                if n_acc > len(st.new_tokens):
                    tally.eos_inside_draft += 1
            if trace.finish_reason == "length" and n_acc + 1 > len(st.new_tokens) and n_acc > 0:
                tally.budget_cut_draft += 1


def _check_round_record(st, method: str, s: DecodeSettings) -> None:
    """A round's record says what the round did: its new tokens and their sources are the accepted
    draft tokens then T's bonus (cut short only where the run ended inside the round); a HierSpec
    sequence is its trees' accepted paths and M's bonuses in order, and M drafted trees only until
    the sequence held min_draft_len tokens."""
    where = f"{method} round {st.index}"
    n = st.target_accepted
    if method in ("eagle2", "eagle3"):
        (tree,) = st.trees
        drafted = [(tok, "tree") for tok in _accepted_tokens(tree)]
    else:
        drafted = [(x.token, x.source) for x in st.sequence]
    if method == "hierspec":
        seq, lens = [], []
        for k, tree in enumerate(st.trees):
            seq += [(tok, "tree", k) for tok in _accepted_tokens(tree)] + [(tree.bonus_token, "intermediate_bonus", k)]
            lens.append(len(seq))
        assert [(x.token, x.source, x.tree) for x in st.sequence] == seq, f"{where}: the sequence is not its trees' paths and bonuses"
        assert lens[-1] >= s.min_draft_len and (len(lens) == 1 or lens[-2] < s.min_draft_len), (
            f"{where}: sequence lengths {lens} after each tree, min_draft_len {s.min_draft_len}")
    if method == "spec":
        assert len(st.sequence) == s.spec_k and all(x.source == "draft" for x in st.sequence), where
    assert n <= len(drafted), where
    want = drafted[:n] + [(st.target_bonus, "target_bonus")]
    got = list(zip(st.new_tokens, st.new_sources))
    assert got == want[:len(got)] and got, f"{where}: new tokens and sources {got}, the round's record says {want}"


def _accepted_tokens(tree: DraftTree) -> list[int]:
    node = {x.id: x for x in tree.nodes}
    return [node[a].token for a in tree.accepted]


def check_forwards(trace: Trace, calls: dict[str, int]) -> None:
    """The trace's forward counts per model, summed over the run, are the forwards the models ran
    (calls: model name -> forwards counted on the model itself)."""
    for name, n in calls.items():
        recorded = sum(st.forwards.get(name, 0) for st in trace.steps)
        assert recorded == n, f"the trace records {recorded} {name} forwards, the model ran {n}"


def _first_diff(a: list[int], b: list[int]) -> str:
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"token {j} (got {a[j:j + 4]}, want {b[j:j + 4]}; lengths {len(a)}/{len(b)})"


def _check_sequence(st, method: str, path: GreedyPath, regime: Optional[Regime], base: int, vocab: int,
                    tally: Tally, s: DecodeSettings) -> None:
    draft = [x.token for x in st.sequence]
    n = 0
    while n < len(draft) and base + n < len(path) and draft[n] == path.tokens[base + n]:
        n += 1
    assert st.target_accepted == n, (f"{method} round {st.index}: T accepted {st.target_accepted} of a draft "
                                     f"whose first {n} tokens are right")
    assert st.target_bonus == path.tokens[base + n], f"{method} round {st.index}: T's bonus is not its greedy token"
    if regime is not None and regime.m.kind != "off":
        # M's proposals, up to its first wrong one, are what its policy picks (its accepted tree
        # tokens are its own argmax, its bonus too)
        for j in range(min(n + 1, len(draft))):
            pos = base + j
            want = regime.m.choice(pos, path.tokens[pos], vocab, SALT["m"])
            assert draft[j] == want, f"{method} round {st.index}: M proposed {draft[j]} at {pos}, its policy {want}"
        if regime.m.kind == "exact":
            assert n == len(draft), f"{method} round {st.index}: exact M, yet T rejected draft token {n + 1}"
    tally.sequences += 1
    if n == len(draft):
        tally.full_sequences += 1
    else:
        tally.seq_reject_at[n + 1] += 1


def _check_tree(tree: DraftTree, method: str, path: GreedyPath, regime: Optional[Regime], s: DecodeSettings,
                root_index: int, tally: Tally) -> None:
    acc = len(tree.accepted)
    d = tree.depth
    on_root = root_index < len(path) and tree.root_token == path.tokens[root_index]
    if tree.verifier == "target":
        assert on_root, f"{method}: a tree's root is not the last accepted greedy token"
        walk = greedy_walk(tree, path, root_index)
        assert tree.accepted == walk, f"{method}: T accepted {tree.accepted}, the greedy path through the tree is {walk}"
        assert tree.bonus_token == path.tokens[root_index + 1 + acc]
    if regime is not None:
        if tree.verifier == "target":
            pol, topk, size = regime.e_t, s.t_topk, s.t_tree_size
        else:
            pol, topk, size = regime.e_m, s.m_topk, s.m_tree_size
        if pol.kind != "off" and (tree.verifier == "target" or regime.m.kind == "exact"):
            if tree.verifier == "intermediate":
                # an exact M proposes only greedy tokens: its trees sit on the greedy path and it
                # accepts what T would
                assert on_root, f"{method}: with an exact M, a tree's root is off the greedy path"
                walk = greedy_walk(tree, path, root_index)
                assert tree.accepted == walk, f"{method}: exact M accepted {tree.accepted}, greedy path {walk}"
            lo, hi = expected_tree_accept(pol, topk, size, d)
            assert lo <= acc <= hi, (f"{method} {tree.verifier} tree: accepted {acc} nodes, policy {pol} with "
                                     f"top-k {topk} size {size} depth {d} implies {lo}..{hi}")
    tally.trees += 1
    tally.tree_nodes_accepted += acc
    tally.accepted_by[tree.verifier] += acc
    if acc == d:
        tally.full_trees += 1
    else:
        tally.tree_reject_depth[acc + 1] += 1


# ---- the same weights in transformers --------------------------------------------------------

def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under transformers' names, dense: W4 linears as the float matrices they
    represent (the same products the `reference` kernel computes; transformers has no W4 format)."""
    from hierviz.quant.w4 import dequantize_unpermuted

    def dense(lin) -> list[torch.Tensor]:
        full = lin.weight.data if lin.weight is not None else torch.cat([dequantize_unpermuted(w) for w in lin.w4])
        return list(torch.split(full.float(), lin.splits, 0))

    sd = {"model.embed_tokens.weight": model.embed.data.float(), "model.norm.weight": model.norm.weight.data.float()}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}"
        sd[f"{pre}.input_layernorm.weight"] = layer.input_norm.weight.data.float()
        sd[f"{pre}.post_attention_layernorm.weight"] = layer.post_norm.weight.data.float()
        for lin, names in ((layer.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                           (layer.o, ("self_attn.o_proj",)), (layer.gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                           (layer.down, ("mlp.down_proj",))):
            for n, part in zip(names, dense(lin)):
                sd[f"{pre}.{n}.weight"] = part
            if lin.bias is not None:
                for n, part in zip(names, torch.split(lin.bias.data.float(), lin.splits, 0)):
                    sd[f"{pre}.{n}.bias"] = part
    # tied or not: transformers ties after loading only in from_pretrained, so give the head its rows
    sd["lm_head.weight"] = dense(model.lm_head)[0]
    return sd


def hf_model(model: Transformer):
    """A transformers model of the same architecture holding `model`'s weights (dense fp32)."""
    import transformers
    c = model.cfg
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, rms_norm_eps=c.rms_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
              max_position_embeddings=c.max_position, tie_word_embeddings=c.tie_embeddings,
              bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_ids or None)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[c.model_type]
    if c.model_type == "mistral":
        kw["sliding_window"] = None
    if c.model_type == "llama":
        kw["attention_bias"] = c.qkv_bias
    from transformers.initialization import no_init_weights
    with no_init_weights():
        ref = cls[1](cls[0](**kw))
    missing, unexpected = ref.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    if unexpected or missing:
        raise OracleError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return ref.eval()


@torch.no_grad()
def hf_greedy(ref, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """transformers' generate(do_sample=False): n new tokens, stopping after one in `eos`."""
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                       eos_token_id=sorted(eos) or None, pad_token_id=0, num_beams=1, top_k=None, top_p=None,
                       temperature=None)
    return out[0, len(prompt):].tolist()
