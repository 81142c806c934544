"""Sampling (temperature > 0) is lossless, tested with stated statistical power.

Every method must emit each token exactly from the target's distribution p, with temperature and
top-p applied. Two levels:

(a) The verification functions (hierviz.decoding.verify) on synthetic distributions.
    Drafters close to p (~84% acceptance): tree levels 1..3 (and the bonus after depth 3) of a
    full top-3 tree of depth 3, sequence drafts of length 1..6, at temperature/top-p (0.5, 1.0),
    (1.0, 1.0), (1.5, 0.9).
    Drafters far from p, where most decisions take the residual: sequence drafts whose every
    position accepts with probability exactly 50% (length 4; q = `far_q`: TV(p, q) = 1 - overlap,
    at top-p 0.9 with q mass outside the nucleus) or 10% (length 3); trees whose candidates are
    any 3 of the 6 tokens (a node accepts 50% on average) or 2 of the 3 least likely (10%); 50%
    at (1.0, 1.0) and (1.5, 0.9), 10% at (1.0, 1.0).
    Accepted lengths: the number of accepted draft tokens against its exact distribution,
    P(L = j) = a_1 ... a_j (1 - a_{j+1}) with a_i = sum_x min(p_i(x), q_i(x)) (and, sharper, with
    min(1, p_i(d_i)/q_i(d_i)) of the drawn draft), and a tree's accepted path length against its
    exact distribution (a child c of a reached node is accepted with probability p(c) whatever
    its rank among its siblings, so a node is reached with the product of p along its path).
    Pairs: on a synthetic Markov target (p depends on the previous token; the drafter M ~50% off
    it), runs decoded round by round as spec, eagle2 and hierspec decode them (hierspec: M
    verifies drafted trees into a sequence draft, their distributions are T's q; one sampler for
    M and T, as in generate()), and the joint of output positions (1, 2) and (2, 3), within a
    round and across round boundaries, against the target's exact joint over the V * V pairs, at
    (0.7, 0.9) (slow: (1.0, 1.0) and (1.5, 0.9)).
(b) End to end through engine.generate() on a tiny stack, for spec, eagle2 and hierspec, at every
    position after the prefill token (the prefill token is the target's own sample, never verified).
    tests/test_gpu.py runs the same check on CUDA (static runners, CUDA graphs) through
    `e2e_stack_on` and `assert_e2e_lossless`.

The statistic. Every emitted token is a fresh draw from its row's distribution given everything
before it (that is what lossless means), so its rank under that distribution (0 = most likely) is
a draw from the row's sorted probabilities. In (a) every row is a random permutation of one logit
vector, temperature * log(SHAPE): after the sampler's temperature every row has the probabilities
SHAPE (top-p then cuts the same ranks), so the rank counts of any set of emissions chosen by a
stopping rule (a tree level, a draft length, a position) are a martingale around n * SHAPE with
the multinomial covariance, and Pearson's chi-square over the ranks is chi-square(m - 1) under the
null (m = ranks with probability > 0; a token outside the nucleus fails at once). A wrong row (an
off-by-one after an acceptance) scrambles ranks; a wrong accept/residual rule or a temperature or
top-p left out moves mass between ranks. In (b) the rows are the target's exact conditionals at the
generated contexts (one batched forward over the finished sequences, temperature/top-p applied by
`reference_probs`, written independently of Sampler.probs); the ranks 0, 1, 2 and "rest" are
pooled over positions with the summed per-token multinomial covariance (a martingale again).
Accepted lengths and pairs are counts of independent trials with known per-trial probabilities:
`outcome_check` compares the counts with their expectation against the exact covariance (the sum
of the trials' multinomial covariances; Pearson's statistic when the trials are identical, as
for the pairs), chi-square with (possible outcomes - 1) dof. Rank checks whose least likely rank
expects fewer than 5 counts are left out (Pearson's statistic has a heavy tail there).

Threshold and false alarms. A check fails at p < ALPHA = 1e-5. A default run makes 167 checks of
correct samplers (95 in (a), 72 in (b)), so one fails with probability < 1.7e-3 (Bonferroni);
seeds are fixed, so a run is reproducible and a benign change of the random stream trips it for
about 1 seed in 600.

Power. The alternative: 3 points of probability moved from one token to another (delta = 0.03). Its
chi-square noncentrality is lambda = n * delta^2 * (1/s_i + 1/s_j), smallest for the two most likely
ranks. For (a), SHAPE = (.42, .26, .17, .07, .05, .03): lambda = 0.0056 n; with m - 1 = 5 degrees of
freedom the critical value at 1e-5 is 30.9 and P(chi2'(5, lambda) > 30.9) >= 0.99 needs lambda >= 57.3,
so n >= 10.2k emissions per check (top-p 0.9 keeps 4 ranks: lambda = 0.0051 n, 3 dof, n >= 10.2k
too). Each check computes its own power from its realised n (scipy's noncentral chi-square): tree
levels 1..3, every draft length 1..6 and draft positions 1..3 assert >= 0.99; draft positions 4..7
and the bonus after depth 3 are reached less often and run with the power they print. Against ANY
distortion of total variation 0.03, Cauchy-Schwarz gives lambda >= 4 n TV^2 = 0.0036 n: power 0.80
at n = 10.2k, 0.99 at n = 16k (tree level 1, draft positions 1 and 2).
Far drafters, asserted >= 0.99 against the same 3-point move: draft position 1 (22k and 40k
calls) and position 2 at 50% (~11k of 22k calls reach it; at 10% only ~4k of 40k do: power ~0.35,
0.99 in the slow run's 120k calls), tree level 1 (12-14k trees). Length checks, >= 0.99 against a
first acceptance rate 3 points lower (DELTA more mass on "nothing accepted"): the sequence's
(realised 1.000) and the tree path length's (0.997-1.000). Pairs, >= 0.99 against 3 points moved
between the two most likely pairs: at top-p 0.9 24 possible pairs, 23 dof, critical value 64.0,
lambda >= 81.5, ~5.6k runs; 6k run (realised 0.995-0.999).
Negative controls run the same checks at the same sizes and must fail: the verifier's p with 3
points moved (every tree level 1..3 flags it), q handed to the verifier at temperature 1 while
drafting at 1.2 (exact first-token bias TV 0.03-0.045, computed in the test, with its power), and
two gross bugs (a tree residual not renormalised, q without its temperature at T = 0.5). And the
shared uniform (`SharedUniformSampler`: one uniform per verification call, reused at every draft
position and tree candidate), which the close-drafter sequence checks and (b)'s checks do not
flag (they pass with it planted in verify_sequence_sampling): draft position 2, the positions
after an acceptance, both length checks (p = 0, also with a quarter of the 10% drafter's calls) and every
pair check (p < 1e-9) flag it; in trees, the path length (p < 1e-298, with a third of the trees).
Timing: the far-drafter, length and pair tests and these controls take ~20 s on one core; the
slow run adds the pairs at (1.0, 1.0) and (1.5, 0.9) with 4x the runs and the 10% drafter with
120k calls (~1 minute).

(b) has fewer samples (a round costs ~1-2 ms of model forwards on this CPU): each cell computes
its "resolution", the mass moved between two rank classes at every position that the pooled check
detects with power 0.99 (from the realised covariance, 3 dof), and asserts it is <= 0.07 (it is
0.05-0.065); the per-position checks (n = runs) only catch large shifts. The slow run has 8x the
trajectories and also T = 1.0 (resolution <= 0.03; 5-8 minutes):
    HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider tests/test_sampling_power.py -m slow
A gross wiring bug only generate() shows (q passed to T without its temperature) must fail (b).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

from hierviz.decoding import decoders
from hierviz.decoding.decoders import Models
from hierviz.settings import DecodeSettings
from hierviz.decoding.tree import Tree
from hierviz.decoding.verify import Sampler, verify_sequence_sampling, verify_tree_sampling
from hierviz.engine import generate, output_tokens
from hierviz.models.config import ModelConfig
from hierviz.models.eagle import EagleHead
from hierviz.models.llama import Transformer
from hierviz.stack import Stack
from hierviz.tokenizer import Tokenizer
from hierviz.models.synthetic import synthetic_eagle3_head

ALPHA = 1e-5
DELTA = 0.03
POWER = 0.99
V = 6
SHAPE = torch.tensor([0.42, 0.26, 0.17, 0.07, 0.05, 0.03], dtype=torch.float64)
CONFIGS = [(0.5, 1.0), (1.0, 1.0), (1.5, 0.9)]       # (temperature, top_p)
TreeVerify = Callable[[Tree, torch.Tensor, Sampler], tuple]


# ---- shared statistics -------------------------------------------------------------------------

def reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampling distribution in float64, as the method must use it: softmax(logits / T), then
    the smallest most-likely prefix whose mass reaches top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p >= 1.0:
        return p
    sp, order = p.sort(-1, descending=True)
    mass_before = sp.cumsum(-1) - sp
    sp = torch.where(mass_before < top_p, sp, torch.zeros_like(sp))
    return torch.zeros_like(p).scatter(-1, order, sp / sp.sum(-1, keepdim=True))


def nucleus_margin(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Per row, how far the nucleus boundary is from top_p: where it is within float32 rounding,
    the method's float32 cut and the reference's may differ, so such a row has no reference."""
    if top_p >= 1.0:
        return torch.full(logits.shape[:-1], math.inf, dtype=torch.float64)
    sp = torch.softmax(logits.double() / temperature, -1).sort(-1, descending=True).values
    return (sp.cumsum(-1) - sp - top_p).abs().min(-1).values


def shape_for(top_p: float) -> torch.Tensor:
    return reference_probs(SHAPE.log(), 1.0, top_p)


def needed_lambda(dof: int, alpha: float = ALPHA, power: float = POWER) -> float:
    crit = chi2.isf(alpha, dof)
    return brentq(lambda lam: ncx2.sf(crit, dof, lam) - power, 1e-3, 1e4)


@dataclass
class Check:
    name: str
    n: int
    pvalue: float
    power: float          # against DELTA moved between the two most likely ranks

    def __str__(self) -> str:
        return f"{self.name}: n={self.n} p={self.pvalue:.2e} power={self.power:.3f}"


def rank_check(name: str, counts: torch.Tensor, s: torch.Tensor) -> Check:
    """Pearson chi-square of rank counts [V] against probabilities s [V] (zeros: impossible)."""
    counts = counts.double()
    n = int(counts.sum())
    live = s > 0
    if counts[~live].sum() > 0:     # a token outside the nucleus: no statistics needed
        return Check(name + " (token outside the nucleus)", n, 0.0, 1.0)
    e = n * s[live]
    stat = float(((counts[live] - e) ** 2 / e).sum())
    dof = int(live.sum()) - 1
    top = s[live].sort(descending=True).values
    lam = n * DELTA ** 2 * float(1 / top[0] + 1 / top[1])
    return Check(name, n, float(chi2.sf(stat, dof)), float(ncx2.sf(chi2.isf(ALPHA, dof), dof, lam)))


def assert_lossless(checks: list[Check], powered: list[str]) -> None:
    """Every check passes; those named in `powered` have power >= POWER."""
    report = "\n".join(map(str, checks))
    bad = [c for c in checks if c.pvalue < ALPHA]
    assert not bad, f"not the target distribution:\n{report}"
    weak = [c for c in checks if c.name in powered and c.power < POWER]
    assert not weak, f"too few samples for the stated power:\n{report}"


def flagged(checks: list[Check]) -> set[str]:
    return {c.name for c in checks if c.pvalue < ALPHA}


# ---- (a) verification functions on synthetic distributions --------------------------------------

def permuted_rows(g: torch.Generator, n: int, rows: int, temperature: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """n x rows logit rows over V tokens, each a random permutation of temperature * log(SHAPE)
    plus a random offset; and rank[c, r, token] (0 = most likely)."""
    token_of_rank = torch.rand(n, rows, V, generator=g).argsort(-1)
    base = (temperature * SHAPE.log()).float().expand(n, rows, V)
    logits = torch.empty(n, rows, V).scatter_(-1, token_of_rank, base)
    return logits + torch.randn(n, rows, 1, generator=g), token_of_rank.argsort(-1)


K, DEPTH = 3, 3


def _full_tree(k: int = K, depth: int = DEPTH) -> tuple[list[int], list[int]]:
    """Parents and depths of the full k-ary tree of the given depth, breadth first (39 nodes for
    K = DEPTH = 3); node i is child i % k of its parent."""
    parents: list[int] = []
    depths: list[int] = []
    level = [-1]
    for d in range(1, depth + 1):
        nxt = []
        for par in level:
            for _ in range(k):
                parents.append(par)
                depths.append(d)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents, depths


PARENTS, DEPTHS = _full_tree()
NODES = len(PARENTS)


def tree_counts(n: int, temperature: float, top_p: float, seed: int, sampler: Optional[Sampler] = None,
                verify: TreeVerify = verify_tree_sampling) -> torch.Tensor:
    """Rank counts [DEPTH + 1, V] of the tokens verify() emits at each level over n trees (level
    l + 1 = the verifier's choice at a depth-l node; level DEPTH + 1 = the bonus after a leaf).
    Every node has its own permuted row; its children are the top-K tokens of a noisy copy of the
    row, tried in that order (like a draft head's), so the candidate set and order vary."""
    g = torch.Generator().manual_seed(seed)
    logits, rank = permuted_rows(g, n, NODES + 1, temperature)
    draft = logits / temperature + 0.3 * torch.randn(n, NODES + 1, V, generator=g)
    kids = draft.topk(K, -1).indices
    parent_row = torch.tensor([p + 1 for p in PARENTS])
    tokens = kids[:, parent_row, torch.arange(NODES) % K].tolist()
    scores = [-1e-3 * i for i in range(NODES)]      # siblings are tried in index order
    plain = sampler is None and verify is verify_tree_sampling
    sampler = sampler or Sampler(temperature, top_p, seed)
    ranks = rank.tolist()
    counts = [[0] * V for _ in range(DEPTH + 1)]     # counted in Python: a tensor element += 1 costs ~10 us
    for c in range(n):
        tree = Tree(0, tokens[c], PARENTS, DEPTHS, scores, scores)
        path, bonus, dists = verify(tree, logits[c], sampler)
        rows = [0] + [i + 1 for i in path]
        emitted = [tokens[c][i] for i in path] + [bonus]
        for level, (row, tok) in enumerate(zip(rows, emitted)):
            counts[level][ranks[c][row][tok]] += 1
        if plain and c < 50:
            # HierSpec's q for T: the verifier's distribution at every emitted token
            want = reference_probs(logits[c, rows], temperature, top_p)
            torch.testing.assert_close(torch.stack(dists).double(), want, atol=1e-5, rtol=0)
    return torch.tensor(counts, dtype=torch.long)


def tree_checks(counts: torch.Tensor, top_p: float) -> list[Check]:
    s = shape_for(top_p)
    names = [f"tree level {lvl}" for lvl in range(1, DEPTH + 1)] + [f"tree bonus after depth {DEPTH}"]
    return [rank_check(nm, row, s) for nm, row in zip(names, counts)]


TREE_N = 16000
TREE_POWERED = [f"tree level {lvl}" for lvl in range(1, DEPTH + 1)]


@pytest.mark.parametrize("temperature,top_p", CONFIGS)
def test_tree_verification_is_lossless(temperature: float, top_p: float):
    """Each tree level's emitted token has the target's (tempered, nucleus) distribution; depth 2
    and 3 are reached in most trees (children hold ~85% of the mass)."""
    counts = tree_counts(TREE_N, temperature, top_p, seed=11)
    reached = counts.sum(-1)
    assert reached[2] > 0.6 * TREE_N, reached         # acceptance at depth 2 is common
    assert_lossless(tree_checks(counts, top_p), TREE_POWERED)


class MovedMassSampler(Sampler):
    """A sampler whose p has DELTA moved from the most likely token to the second (the deliberate
    3-point bias of the negative controls)."""

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = super().probs(logits)
        top2 = p.topk(2, -1).indices
        p = p.clone()
        p.scatter_add_(-1, top2[..., :1], torch.full_like(p[..., :1], -DELTA))
        p.scatter_add_(-1, top2[..., 1:], torch.full_like(p[..., :1], DELTA))
        return p


def test_tree_check_flags_a_3_point_bias():
    """The same checks at the same size, with 3 points moved in the verifier's p, fail at every
    level they claim power for."""
    counts = tree_counts(TREE_N, 1.0, 1.0, seed=11, sampler=MovedMassSampler(1.0, 1.0, 11))
    checks = tree_checks(counts, 1.0)
    assert set(TREE_POWERED) <= flagged(checks), "\n".join(map(str, checks))


def verify_tree_unnormalised(tree: Tree, logits: torch.Tensor, sampler: Sampler):
    """verify_tree_sampling with the classic bug: a later child is accepted with its raw p, not
    p / (mass left after the rejected siblings)."""
    probs = sampler.probs(logits)
    kids = tree.children()
    path: list[int] = []
    row = 0
    while True:
        residual = probs[row].clone()
        accepted = None
        for c in kids[row]:
            t = tree.tokens[c]
            if sampler.uniform() < float(probs[row][t]):
                accepted = c
                break
            residual[t] = 0.0
        if accepted is None:
            return path, sampler.sample(residual / residual.sum()), None
        path.append(accepted)
        row = accepted + 1


def test_tree_check_flags_an_unnormalised_residual():
    counts = tree_counts(3000, 1.0, 1.0, seed=12, verify=verify_tree_unnormalised)
    assert "tree level 1" in flagged(tree_checks(counts, 1.0))


# sequence drafts: calls per draft length, so that each length emits >= 10.2k tokens
# (a length-k draft emits 1 + a + ... + a^k tokens, a ~ 0.84 the per-token acceptance)
SEQ_CALLS = {1: 6000, 2: 4400, 3: 3500, 4: 3100, 5: 2800, 6: 2600}
SEQ_POWERED = [f"draft length {k}" for k in SEQ_CALLS] + [f"draft position {i}" for i in (1, 2, 3)]


@dataclass
class SeqCounts:
    by_length: dict[int, torch.Tensor]    # rank counts of all tokens a length-k round emits
    by_position: torch.Tensor             # [7, V]: the i-th emitted token of a round
    bonus: torch.Tensor                   # [V]: bonus tokens after fully accepted drafts
    first: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]   # per length: p, q, q seen, row 0


def sequence_counts(calls: dict[int, int], temperature: float, top_p: float, seed: int,
                    q_seen_temperature: Optional[float] = None) -> SeqCounts:
    """Draft d_i ~ q_i (q = the sampler's warp of a noisy copy of p's logits, as decode_spec makes
    it), verify with verify_sequence_sampling, count emitted ranks under p. q_seen_temperature:
    the verifier is handed q warped at this temperature instead (a drafter that forgot its own
    temperature) while the draft still comes from the right q."""
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(temperature, top_p, seed)
    by_position, bonus_counts = [[0] * V for _ in range(7)], [0] * V     # counted in Python, as in tree_counts
    by_length: dict[int, torch.Tensor] = {}
    first: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for k, n in calls.items():
        logits, rank = permuted_rows(g, n, k + 1, temperature)
        q_logits = logits[:, :k] + 0.5 * temperature * torch.randn(n, k, V, generator=g)
        q = sampler.probs(q_logits)
        draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, k)
        q_seen = q if q_seen_temperature is None else Sampler(q_seen_temperature, top_p).probs(q_logits)
        first.append((reference_probs(logits[:, 0], temperature, top_p), q[:, 0].double(), q_seen[:, 0].double()))
        counts = [0] * V
        drafts, ranks = draft.tolist(), rank.tolist()
        for c in range(n):
            accepted, bonus = verify_sequence_sampling(drafts[c], list(q_seen[c]), logits[c], sampler)
            for i, tok in enumerate(drafts[c][:accepted] + [bonus]):
                r = ranks[c][i][tok]
                counts[r] += 1
                by_position[i][r] += 1
            if accepted == k:
                bonus_counts[ranks[c][k][bonus]] += 1
        by_length[k] = torch.tensor(counts, dtype=torch.long)
    return SeqCounts(by_length, torch.tensor(by_position, dtype=torch.long), torch.tensor(bonus_counts, dtype=torch.long),
                     first)


def sequence_checks(sc: SeqCounts, top_p: float) -> list[Check]:
    s = shape_for(top_p)
    checks = [rank_check(f"draft length {k}", c, s) for k, c in sc.by_length.items()]
    checks += [rank_check(f"draft position {i + 1}", c, s) for i, c in enumerate(sc.by_position) if c.sum() > 0]
    return checks + [rank_check("bonus after a full draft", sc.bonus, s)]


@pytest.mark.parametrize("temperature,top_p", CONFIGS)
def test_sequence_verification_is_lossless(temperature: float, top_p: float):
    """Speculative sampling emits the target's distribution for drafts of length 1..6, at every
    draft length and position, with the residual path taken in ~16% of positions."""
    sc = sequence_counts(SEQ_CALLS, temperature, top_p, seed=21)
    pos = sc.by_position.sum(-1)
    assert 0.1 < 1 - pos[1] / pos[0] < 0.3, pos    # rejections are common, so is acceptance
    assert_lossless(sequence_checks(sc, top_p), SEQ_POWERED)


def first_token_bias(sc: SeqCounts, top_p: float) -> tuple[float, float]:
    """Exact distribution of the first emitted token (rank space) under the verification rule
    'accept d with min(1, p/q_seen), else sample norm(max(0, p - q_seen))' with d ~ q, averaged
    over the calls: (its TV from the target's, the position-1 check's power against it)."""
    e = torch.zeros(V, dtype=torch.float64)
    n = 0
    for p, q, q_seen in sc.first:
        accept = q * torch.minimum(torch.ones(()), p / q_seen)
        residual = (p - q_seen).clamp_min(0)
        residual = residual / residual.sum(-1, keepdim=True)
        emit = accept + (1 - accept.sum(-1, keepdim=True)) * residual
        # to rank space: p's rows are permutations of one profile, ranked by p itself
        e += emit.gather(-1, p.argsort(-1, descending=True)).sum(0)
        n += p.shape[0]
    e /= n
    s = shape_for(top_p)
    live = s > 0
    lam = n * float(((e[live] - s[live]) ** 2 / s[live]).sum())
    dof = int(live.sum()) - 1
    return 0.5 * float((e - s).abs().sum()), float(ncx2.sf(chi2.isf(ALPHA, dof), dof, lam))


def test_sequence_check_flags_q_without_temperature_3_points():
    """A drafter that hands the verifier q at temperature 1 while drafting at 1.2: an exact
    3-4 point bias on the first emitted token, which the position-1 check catches."""
    sc = sequence_counts(SEQ_CALLS, 1.2, 1.0, seed=22, q_seen_temperature=1.0)
    tv, power = first_token_bias(sc, 1.0)
    assert 0.03 <= tv <= 0.045 and power >= POWER, (tv, power)
    assert "draft position 1" in flagged(sequence_checks(sc, 1.0))


def test_sequence_check_flags_q_without_temperature_gross():
    sc = sequence_counts({1: 1000, 4: 1000}, 0.5, 1.0, seed=23, q_seen_temperature=1.0)
    assert "draft position 1" in flagged(sequence_checks(sc, 1.0))


@pytest.mark.parametrize("temperature,top_p", CONFIGS + [(0.7, 0.5)])
def test_sampler_probs_match_the_reference(temperature: float, top_p: float):
    """The warp every method uses, row by row (deterministic): the statistical checks above rely
    on the sampler's p being the reference's, so any drift would show here first."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2000, V, generator=g) * 1.5
    torch.testing.assert_close(Sampler(temperature, top_p).probs(logits).double(),
                               reference_probs(logits, temperature, top_p), atol=1e-6, rtol=0)


# ---- (a, continued) q far from p, pairs of positions, accepted lengths, the shared uniform -------

def far_q(p: torch.Tensor, overlap: float, g: torch.Generator) -> torch.Tensor:
    """A drafter's q [..., V] (float64) far from p with sum_x min(p(x), q(x)) = overlap exactly:
    the mass 1 - overlap is taken, in proportion, from S, the smallest set of p's most likely
    tokens holding that much, and spread over the other tokens with random (exponential) weights.
    q <= p on S and q >= p elsewhere, so TV(p, q) = 1 - overlap and a draft token is accepted with
    probability `overlap`. At top-p < 1 part of q lies outside p's nucleus (always rejected)."""
    moved = 1.0 - overlap
    sp, order = p.sort(-1, descending=True)
    in_s = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, (sp.cumsum(-1) - sp) < moved)
    assert bool((~in_s).any(-1).all()), "no token left to move the mass to"
    mass_s = (p * in_s).sum(-1, keepdim=True)
    w = -(1 - torch.rand(p.shape, generator=g, dtype=torch.float64)).log() * (~in_s)
    return torch.where(in_s, p * (1 - moved / mass_s), p + moved * w / w.sum(-1, keepdim=True))


def outcome_check(name: str, outcome: torch.Tensor, probs: torch.Tensor,
                  alt: Optional[torch.Tensor] = None) -> Check:
    """Independent trials with known per-trial probabilities probs [n, C] and outcomes [n]: the
    counts' deviation from their expectation against its exact covariance (the sum of the trials'
    multinomial covariances), chi-square with (possible categories - 1) dof; for identical trials
    this is Pearson's statistic. Power at ALPHA against per-trial probabilities `alt` [n, C]."""
    n, c = probs.shape
    hit = torch.zeros(n, c, dtype=torch.float64).scatter_(1, outcome.long()[:, None], 1.0)
    live = probs.sum(0) > 0
    if hit[:, ~live].sum() > 0:
        return Check(name + " (an impossible outcome)", n, 0.0, 1.0)
    idx = live.nonzero()[:-1, 0]           # one possible category is implied by the others
    cov = (torch.diag(probs.sum(0)) - probs.T @ probs)[idx][:, idx]
    d = (hit - probs).sum(0)[idx]
    dof = len(idx)
    stat = float(d @ torch.linalg.solve(cov, d))
    power = float("nan")
    if alt is not None:
        shift = (alt - probs).sum(0)[idx]
        power = float(ncx2.sf(chi2.isf(ALPHA, dof), dof, float(shift @ torch.linalg.solve(cov, shift))))
    return Check(name, n, float(chi2.sf(stat, dof)), power)


def length_probs(passes: torch.Tensor) -> torch.Tensor:
    """Per-step pass probabilities [n, k] (independent given the row) -> probabilities of 0..k
    passes in a row [n, k + 1]."""
    reach = torch.cat([torch.ones_like(passes[:, :1]), passes.cumprod(-1)], -1)     # P(L >= j)
    return reach - torch.cat([reach[:, 1:], torch.zeros_like(passes[:, :1])], -1)


def fewer_accepted(probs: torch.Tensor, delta: float = DELTA) -> torch.Tensor:
    """The alternative the length checks are sized for: DELTA more probability of accepting
    nothing (the first acceptance rate DELTA lower), the rest scaled down in proportion."""
    rest = (1 - probs[:, :1] - delta) / (1 - probs[:, :1])
    return torch.cat([probs[:, :1] + delta, probs[:, 1:] * rest], -1)


class SharedUniformSampler(Sampler):
    """The planted bug of the negative controls: one uniform per verification call, reused at
    every draft position and for every tree candidate (the verify functions call probs() once,
    first: it throws the last call's uniform away)."""
    _u: Optional[float] = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        self._u = None
        return super().probs(logits)

    def uniform(self) -> float:
        if self._u is None:
            self._u = super().uniform()
        return self._u


@dataclass
class FarSequence:
    by_position: torch.Tensor   # [k + 1, V]: rank counts of the i-th emitted token of a round
    accepted: torch.Tensor      # [n]: accepted draft tokens per call
    overlap: torch.Tensor       # [n, k]: a_i = sum_x min(p_i(x), q_i(x)), draft position i's acceptance
    ratio: torch.Tensor         # [n, k]: min(1, p_i(d_i) / q_i(d_i)), the drawn d_i's acceptance


def far_sequence(n: int, k: int, overlap: float, temperature: float, top_p: float, seed: int,
                 sampler: Optional[Sampler] = None) -> FarSequence:
    """n length-k drafts d_i ~ q_i = far_q(p_i, overlap) over independent permuted rows, verified by
    verify_sequence_sampling."""
    g = torch.Generator().manual_seed(seed)
    logits, rank = permuted_rows(g, n, k + 1, temperature)
    p = reference_probs(logits[:, :k], temperature, top_p)
    q = far_q(p, overlap, g)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, k)
    q32 = q.float()
    sampler = sampler or Sampler(temperature, top_p, seed)
    by_position = [[0] * V for _ in range(k + 1)]     # counted in Python, as in tree_counts
    accepted = []
    drafts, ranks = draft.tolist(), rank.tolist()
    for c in range(n):
        a, bonus = verify_sequence_sampling(drafts[c], list(q32[c]), logits[c], sampler)
        accepted.append(a)
        for i, tok in enumerate(drafts[c][:a] + [bonus]):
            by_position[i][ranks[c][i][tok]] += 1
    ratio = (p.gather(-1, draft[..., None]) / q.gather(-1, draft[..., None]))[..., 0].clamp(max=1.0)
    return FarSequence(torch.tensor(by_position, dtype=torch.long), torch.tensor(accepted), torch.minimum(p, q).sum(-1),
                       ratio)


def rank_checks(named: list[tuple[str, torch.Tensor]], s: torch.Tensor) -> list[Check]:
    """rank_check of every (name, counts) whose least likely rank expects >= 5 counts (below that,
    Pearson's statistic has a heavy tail and would raise false alarms)."""
    return [rank_check(nm, c, s) for nm, c in named if float(c.sum()) * float(s[s > 0].min()) >= 5]


def far_sequence_checks(fs: FarSequence, top_p: float) -> list[Check]:
    k = fs.by_position.shape[0] - 1
    named = [(f"draft position {i + 1}", c) for i, c in enumerate(fs.by_position[:k])]
    named += [("after an accepted draft token", fs.by_position[1:].sum(0)), ("bonus after a full draft", fs.by_position[k])]
    return rank_checks(named, shape_for(top_p))


def sequence_length_checks(fs: FarSequence) -> list[Check]:
    """The accepted count against its distribution from the a_i, and given the drawn draft."""
    probs = length_probs(fs.overlap)
    return [outcome_check("accepted length", fs.accepted, probs, fewer_accepted(probs)),
            outcome_check("accepted length given the draft", fs.accepted, length_probs(fs.ratio))]


# (overlap, draft length, calls, temperature, top_p): 50% reaches draft position 2 in ~11k calls
# of 22k (power >= 0.99 there), 10% in ~4k of 40k (position 1: 40k, 90% of them from the residual)
FAR_SEQ = [(0.5, 4, 22000, 1.0, 1.0), (0.5, 4, 22000, 1.5, 0.9), (0.1, 3, 40000, 1.0, 1.0)]
FAR_SEQ_IDS = ["50%-T1", "50%-T1.5-top_p0.9", "10%-T1"]


@functools.lru_cache(maxsize=None)
def far_sequence_cached(overlap: float, k: int, n: int, temperature: float, top_p: float) -> FarSequence:
    return far_sequence(n, k, overlap, temperature, top_p, seed=31)


@pytest.mark.parametrize("overlap,k,n,temperature,top_p", FAR_SEQ, ids=FAR_SEQ_IDS)
def test_far_sequence_verification_is_lossless(overlap: float, k: int, n: int, temperature: float, top_p: float):
    """A drafter far from the target (every draft position accepted with probability 50% or 10%
    exactly): every emitted position still has the target's distribution, the residual path
    dominating."""
    fs = far_sequence_cached(overlap, k, n, temperature, top_p)
    # the design; the realised rates are test_sequence_accepted_lengths_follow_the_acceptance_rates
    assert torch.allclose(fs.overlap, torch.full_like(fs.overlap, overlap), atol=1e-9)
    powered = ["draft position 1"] + (["draft position 2"] if overlap >= 0.5 else [])
    assert_lossless(far_sequence_checks(fs, top_p), powered)


@pytest.mark.parametrize("overlap,k,n,temperature,top_p", FAR_SEQ, ids=FAR_SEQ_IDS)
def test_sequence_accepted_lengths_follow_the_acceptance_rates(overlap: float, k: int, n: int,
                                                               temperature: float, top_p: float):
    """The number of accepted draft tokens: P(L = j) = a_1 ... a_j (1 - a_{j+1}) (a_{k+1} = 0),
    a_i = sum_x min(p_i, q_i); and, sharper, with min(1, p_i(d_i)/q_i(d_i)) of the drawn draft in
    place of a_i. Power >= 0.99 against a first-position acceptance rate 3 points off."""
    fs = far_sequence_cached(overlap, k, n, temperature, top_p)
    assert_lossless(sequence_length_checks(fs), ["accepted length"])


@dataclass
class FarTrees:
    by_level: torch.Tensor      # [depth + 1, V]: rank counts of the emitted token per level (last: bonus after a leaf)
    path_len: torch.Tensor      # [n]: accepted path length per tree
    len_probs: torch.Tensor     # [n, depth + 1]: its exact distribution


def far_trees(n: int, k: int, depth: int, low: int, temperature: float, top_p: float, seed: int,
              sampler: Optional[Sampler] = None) -> FarTrees:
    """n full k-ary trees of the given depth; every node has its own permuted row; its children
    are k distinct tokens drawn uniformly from the `low` least likely tokens of its row, in random
    order (low = V: any k tokens, so a node accepts k / V of p's mass on average; k = 2 of the
    3 least likely: 2/3 of 0.15 = 10%). Child c of a reached node is accepted with probability
    p(c) whatever its rank among its siblings, so the path length has an exact distribution: the
    probability of reaching a node is the product of p along its path."""
    parents, depths = _full_tree(k, depth)
    nodes = len(parents)
    g = torch.Generator().manual_seed(seed)
    logits, rank = permuted_rows(g, n, nodes + 1, temperature)
    keys = torch.rand(n, nodes + 1, V, generator=g).masked_fill(rank < V - low, -1.0)
    kids = keys.topk(k, -1).indices
    parent_row = torch.tensor([par + 1 for par in parents])
    tok = kids[:, parent_row, torch.arange(nodes) % k]                   # [n, nodes]
    p = reference_probs(logits, temperature, top_p)
    reach = p[:, parent_row].gather(-1, tok[..., None])[..., 0]
    for i, par in enumerate(parents):
        if par >= 0:
            reach[:, i] *= reach[:, par]
    at_least = torch.stack([torch.ones(n, dtype=torch.float64)] +
                           [reach[:, torch.tensor(depths) == d].sum(-1) for d in range(1, depth + 1)], -1)
    len_probs = at_least - torch.cat([at_least[:, 1:], torch.zeros(n, 1, dtype=torch.float64)], -1)
    scores = [-1e-3 * i for i in range(nodes)]      # siblings are tried in index order
    sampler = sampler or Sampler(temperature, top_p, seed)
    tokens, ranks = tok.tolist(), rank.tolist()
    by_level = [[0] * V for _ in range(depth + 1)]     # counted in Python, as in tree_counts
    path_len = []
    for c in range(n):
        path, bonus, _ = verify_tree_sampling(Tree(0, tokens[c], parents, depths, scores, scores), logits[c], sampler)
        rows = [0] + [i + 1 for i in path]
        for level, (row, t) in enumerate(zip(rows, [tokens[c][i] for i in path] + [bonus])):
            by_level[level][ranks[c][row][t]] += 1
        path_len.append(len(path))
    return FarTrees(torch.tensor(by_level, dtype=torch.long), torch.tensor(path_len), len_probs)


def far_tree_checks(ft: FarTrees, top_p: float) -> list[Check]:
    depth = ft.by_level.shape[0] - 1
    names = [f"tree level {lvl}" for lvl in range(1, depth + 1)] + [f"tree bonus after depth {depth}"]
    checks = rank_checks(list(zip(names, ft.by_level)), shape_for(top_p))
    return checks + [outcome_check("tree path length", ft.path_len, ft.len_probs, fewer_accepted(ft.len_probs))]


# (k, depth, low, trees, temperature, top_p): any 3 of 6 tokens (50% on average), 2 of the 3
# least likely (10% on average)
FAR_TREE = [(3, 3, V, 14000, 1.0, 1.0), (3, 3, V, 14000, 1.5, 0.9), (2, 2, 3, 12000, 1.0, 1.0)]
FAR_TREE_IDS = ["50%-T1", "50%-T1.5-top_p0.9", "10%-T1"]


@pytest.mark.parametrize("k,depth,low,n,temperature,top_p", FAR_TREE, ids=FAR_TREE_IDS)
def test_far_tree_verification_is_lossless(k: int, depth: int, low: int, n: int, temperature: float, top_p: float):
    """Tree candidates the target rarely wants (a level accepts 50% or 10% of the time): every
    level's token has the target's distribution, and the accepted path length its exact one
    (power >= 0.99 against 3 points more trees accepting nothing)."""
    ft = far_trees(n, k, depth, low, temperature, top_p, seed=41)
    want = k / low * float(shape_for(top_p)[V - low:].sum())        # the profile is sorted
    assert abs(float(1 - ft.len_probs[:, 0].mean()) - want) < 0.01, want     # the realised rate: "tree path length"
    assert_lossless(far_tree_checks(ft, top_p), ["tree level 1", "tree path length"])


# pairs of consecutive positions, on a target whose distribution depends on the previous token

PAIR_LEN = 3              # output tokens per run: pairs (1, 2) and (2, 3)
PAIR_DRAFT = 3            # spec's draft length; hierspec drafts trees until it has >= 3 tokens
PAIR_TREE = (2, 2)        # drafted trees: 2 children per node, depth 2 (6 nodes)
PAIR_RUNS = 6000         # power >= 0.99 for every pair check (~5.6k needed)


@dataclass
class MarkovTarget:
    logits: torch.Tensor      # [V, V] float32: T's logits after each previous token
    p: torch.Tensor           # [V, V] float64: T's sampling distribution after each previous token
    m_logits: torch.Tensor    # [V, V] float32: the drafter's (M's) logits
    q: torch.Tensor           # [V, V] float64: the drafter's sampling distribution, overlap with p's row ~ 50%


def markov_target(temperature: float, top_p: float, seed: int, overlap: float = 0.5) -> MarkovTarget:
    """Every previous token has its own permutation of the profile (T) and a far_q of it (M, given
    to the sampler as logits, so the drafter's distribution is the sampler's warp of M's logits)."""
    g = torch.Generator().manual_seed(seed)
    logits = permuted_rows(g, 1, V, temperature)[0][0]
    p = reference_probs(logits, temperature, top_p)
    m_logits = (temperature * far_q(p, overlap, g).clamp_min(1e-12).log()).float()
    return MarkovTarget(logits, p, m_logits, reference_probs(m_logits, temperature, top_p))


def pair_probs(mt: MarkovTarget, t: int) -> torch.Tensor:
    """The target's exact joint of output positions t and t + 1 [V * V] (position 0 uniform)."""
    marginal = torch.full((V,), 1.0 / V, dtype=torch.float64)
    for _ in range(t):
        marginal = marginal @ mt.p
    return (marginal[:, None] * mt.p).reshape(-1)


def _gumbel_topk(probs: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct tokens per row drawn without replacement from probs [..., V], in drawing order."""
    gumbel = -(-(1 - torch.rand(probs.shape, generator=g, dtype=torch.float64)).log()).log()
    return (probs.clamp_min(1e-30).log() + gumbel).topk(k, -1).indices


def _markov_tree(mt: MarkovTarget, roots: torch.Tensor, g: torch.Generator) -> list[list[int]]:
    """Node tokens [R, nodes] of trees drafted from M's distribution after each root (children
    drawn without replacement from q of their parent's token, in drawing order)."""
    k, depth = PAIR_TREE
    parents, _ = _full_tree(k, depth)
    tok: list[torch.Tensor] = []
    for i, par in enumerate(parents):
        if i % k == 0:
            prev = roots if par < 0 else tok[par]
            kids = _gumbel_topk(mt.q[prev], k, g)
        tok.append(kids[:, i % k])
    return torch.stack(tok, -1).tolist()


def markov_runs(method: str, runs: int, temperature: float, top_p: float, seed: int,
                sampler: Optional[Sampler] = None) -> tuple[torch.Tensor, float]:
    """Position 0 and PAIR_LEN output tokens [runs, PAIR_LEN + 1] per run, and the mean number of
    draft tokens T accepted per verification; decoded in rounds as the decoder `method`
    does on the synthetic Markov stack: spec (a sequence draft from M, T verifies it with q),
    eagle2 (T verifies trees drafted from M's distribution) or hierspec (M verifies its trees into
    a sequence draft with their distributions as q, T verifies that). One sampler for M and T, as
    in generate(). Drafting is vectorised over the runs; every verification is the real one."""
    mt = markov_target(temperature, top_p, seed)
    g = torch.Generator().manual_seed(seed + 1)
    sampler = sampler or Sampler(temperature, top_p, seed)
    k, depth = PAIR_TREE
    parents, depths = _full_tree(k, depth)
    scores = [-1e-3 * i for i in range(len(parents))]
    out = [[int(x)] for x in torch.randint(V, (runs,), generator=g)]     # position 0: uniform
    active = list(range(runs))
    accepted = verifications = 0
    while active:
        before = sum(len(out[r]) for r in active)
        verifications += len(active)
        ctx = torch.tensor([out[r][-1] for r in active])
        if method == "spec":
            draft = [ctx]
            for _ in range(PAIR_DRAFT):
                draft.append(torch.multinomial(mt.q[draft[-1]], 1, generator=g)[:, 0])
            seqs = torch.stack(draft, -1)                                # [R, 1 + PAIR_DRAFT]
            qs = mt.q[seqs[:, :-1]].float()
            for j, r in enumerate(active):
                s = seqs[j].tolist()
                n, bonus = verify_sequence_sampling(s[1:], list(qs[j]), mt.logits[s], sampler)
                out[r] += s[1:1 + n] + [bonus]
        elif method == "eagle2":
            trees = _markov_tree(mt, ctx, g)
            for j, r in enumerate(active):
                toks = trees[j]
                path, bonus, _ = verify_tree_sampling(Tree(out[r][-1], toks, parents, depths, scores, scores),
                                                      mt.logits[[out[r][-1]] + toks], sampler)
                out[r] += [toks[i] for i in path] + [bonus]
        else:
            drafts: list[list[int]] = [[] for _ in active]
            qs_h: list[list[torch.Tensor]] = [[] for _ in active]
            todo = list(range(len(active)))
            while todo:          # M drafts trees and verifies them until each draft has >= PAIR_DRAFT tokens
                roots = [drafts[j][-1] if drafts[j] else out[active[j]][-1] for j in todo]
                trees = _markov_tree(mt, torch.tensor(roots), g)
                for j, root, toks in zip(todo, roots, trees):
                    path, bonus, dists = verify_tree_sampling(Tree(root, toks, parents, depths, scores, scores),
                                                              mt.m_logits[[root] + toks], sampler)
                    drafts[j] += [toks[i] for i in path] + [bonus]
                    qs_h[j] += dists
                todo = [j for j in todo if len(drafts[j]) < PAIR_DRAFT]
            for j, r in enumerate(active):
                s = [out[r][-1]] + drafts[j]
                n, bonus = verify_sequence_sampling(drafts[j], qs_h[j], mt.logits[s], sampler)
                out[r] += drafts[j][:n] + [bonus]
        accepted += sum(len(out[r]) for r in active) - before - len(active)     # less one bonus each
        active = [r for r in active if len(out[r]) <= PAIR_LEN]
    return torch.tensor([o[:PAIR_LEN + 1] for o in out]), accepted / verifications


def pair_checks(tokens: torch.Tensor, mt: MarkovTarget) -> list[Check]:
    """Chi-square of the V * V pairs (x_t, x_t+1) of every t against the target's exact joint;
    power against DELTA moved between the two most likely pairs."""
    checks = []
    for t in range(1, PAIR_LEN):
        probs = pair_probs(mt, t)
        top2 = probs.topk(2).indices
        alt = probs.clone()
        alt[top2[0]] -= DELTA
        alt[top2[1]] += DELTA
        n = tokens.shape[0]
        checks.append(outcome_check(f"pair ({t}, {t + 1})", tokens[:, t] * V + tokens[:, t + 1],
                                    probs.expand(n, -1), alt.expand(n, -1)))
    return checks


PAIR_METHODS = ["spec", "eagle2", "hierspec"]


def assert_pairs_lossless(method: str, temperature: float, top_p: float, runs: int) -> None:
    mt = markov_target(temperature, top_p, seed=51)
    tokens, accepted = markov_runs(method, runs, temperature, top_p, seed=51)
    assert accepted > 0.3, accepted           # T accepts drafts (~0.45 tokens a tree for eagle2, ~0.8 spec, hierspec)
    assert_lossless(pair_checks(tokens, mt), [f"pair ({t}, {t + 1})" for t in range(1, PAIR_LEN)])


@pytest.mark.parametrize("method", PAIR_METHODS)
def test_pairs_of_positions_have_the_targets_joint(method: str):
    """Consecutive output tokens, within a round and across round boundaries (after a rejection,
    a bonus, a full draft), have the target's joint distribution, on a target whose distribution
    depends on the previous token and a drafter ~50% off it, at T = 0.7, top-p 0.9 (q has mass
    outside the nucleus): a wrong row after an acceptance or a random draw shared between
    positions shows here even where each position's marginal looks right."""
    assert_pairs_lossless(method, 0.7, 0.9, PAIR_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.5, 0.9)])
@pytest.mark.parametrize("method", PAIR_METHODS)
def test_pairs_of_positions_have_the_targets_joint_slow(method: str, temperature: float, top_p: float):
    assert_pairs_lossless(method, temperature, top_p, PAIR_RUNS * SLOW_FACTOR // 2)


@pytest.mark.slow
def test_far_sequence_position_2_at_10_percent_slow():
    """The 10% drafter with enough calls (120k) for power 0.99 at draft position 2."""
    fs = far_sequence(120000, 3, 0.1, 1.0, 1.0, seed=32)
    assert_lossless(far_sequence_checks(fs, 1.0) + sequence_length_checks(fs), ["draft position 1", "draft position 2"])


def test_checks_flag_a_shared_uniform_in_sequence_verification():
    """Negative control, the audit's planted bug: one uniform for all positions of a sequence
    draft. The far-q position and length checks and the pair checks fail on it at their sizes."""
    fs = far_sequence(22000, 4, 0.5, 1.0, 1.0, seed=31, sampler=SharedUniformSampler(1.0, 1.0, 31))
    assert {"draft position 2", "after an accepted draft token"} <= flagged(far_sequence_checks(fs, 1.0))
    assert {"accepted length", "accepted length given the draft"} <= flagged(sequence_length_checks(fs))
    fs = far_sequence(10000, 3, 0.1, 1.0, 1.0, seed=31, sampler=SharedUniformSampler(1.0, 1.0, 31))
    assert {"accepted length", "accepted length given the draft"} <= flagged(sequence_length_checks(fs))
    mt = markov_target(0.7, 0.9, seed=51)
    tokens, _ = markov_runs("spec", PAIR_RUNS, 0.7, 0.9, seed=51, sampler=SharedUniformSampler(0.7, 0.9, 51))
    checks = pair_checks(tokens, mt)
    assert len(flagged(checks)) == PAIR_LEN - 1, "\n".join(map(str, checks))


def test_checks_flag_a_shared_uniform_in_tree_verification():
    """The same bug in tree verification (one uniform for every candidate and level of a tree):
    the far-tree path-length check fails on it at both acceptance rates, with a third of the trees."""
    for k, depth, low, n, temperature, top_p in (FAR_TREE[0], FAR_TREE[2]):
        ft = far_trees(n // 3, k, depth, low, temperature, top_p, seed=41,
                       sampler=SharedUniformSampler(temperature, top_p, 41))
        checks = far_tree_checks(ft, top_p)
        assert "tree path length" in flagged(checks), "\n".join(map(str, checks))


# ---- (b) end to end through generate() ---------------------------------------------------------

class DigitTokenizer(Tokenizer):
    """Token ids written as numbers, no EOS (runs always last max_new_tokens)."""
    vocab_size = V

    def __init__(self) -> None:
        self.eos_ids: set[int] = set()

    def encode_chat(self, prompt: str) -> list[int]:
        return [int(x) for x in prompt.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


H, HEADS, KV_HEADS, INTER = 16, 2, 1, 32


def _cfg() -> ModelConfig:
    return ModelConfig.from_dict(dict(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, num_hidden_layers=1, max_position_embeddings=256,
                                      tie_word_embeddings=True, rms_norm_eps=1e-6, model_type="llama"))


def _layer(g: torch.Generator) -> dict[str, torch.Tensor]:
    kv = KV_HEADS * H // HEADS

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3
    p = "model.layers.0"
    return {f"{p}.input_layernorm.weight": torch.ones(H), f"{p}.post_attention_layernorm.weight": torch.ones(H),
            f"{p}.self_attn.q_proj.weight": r(H, H), f"{p}.self_attn.k_proj.weight": r(kv, H),
            f"{p}.self_attn.v_proj.weight": r(kv, H), f"{p}.self_attn.o_proj.weight": r(H, H),
            f"{p}.mlp.gate_proj.weight": r(INTER, H), f"{p}.mlp.up_proj.weight": r(INTER, H),
            f"{p}.mlp.down_proj.weight": r(H, INTER)}


def e2e_models(seed: int = 0, device: torch.device | str = "cpu") -> Models:
    """One-layer T over 6 tokens, with logits scaled down (final norm weight 0.085) so that its
    conditionals spread over several tokens even at temperature 0.5; M = T with 40% weight noise;
    E_T / E_M = a copy of their base's layer fed the token embedding only (fc = [I | 0]). With unit
    RMS embeddings (= T's normalised layer input) such a head reproduces its base's residual stream
    up to the first position's key and the final norm's scale, so its top-3 are mostly the base's
    and trees are accepted to depth 2-3 often: plausible drafts, verified by the real code. The
    weights are drawn on the CPU and moved to `device`: the same models on every device."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g)
    emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    t_w = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.full((H,), 0.085), **_layer(g)}
    m_w = {k: v + 0.4 * v.std() * torch.randn(v.shape, generator=g) if "proj" in k else v for k, v in t_w.items()}
    target, inter = Transformer(_cfg(), t_w, device=device), Transformer(_cfg(), m_w, device=device)

    def head(w: dict[str, torch.Tensor], base: Transformer) -> EagleHead:
        hw = {k.replace("model.layers.0", "layers.0"): v for k, v in w.items()
              if k.startswith("model.layers.0.") and "input_layernorm" not in k}
        hw["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
        return EagleHead(_cfg(), hw, base)
    models = Models(target, inter, head(m_w, inter), head(t_w, target))
    # a random EAGLE-3 head on T that can draft 5 of the 6 tokens: T's sixth is never in a tree
    models.e_t3 = synthetic_eagle3_head(target, seed + 7, draft_vocab_size=V - 1, feature_layers=(0,))
    target.add_feature_layers(models.e_t3.feature_layers)
    return models


PROMPT = [1, 5, 3, 2]
NEW_TOKENS = 12
E2E_CONFIGS = [(0.5, 1.0), (1.5, 0.9)]
E2E_RUNS = {"spec": 260, "eagle2": 240, "hierspec": 180}
SLOW_FACTOR = 8


def e2e_settings(temperature: float, top_p: float) -> DecodeSettings:
    return DecodeSettings(max_new_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, spec_k=4,
                          t_depth=3, t_topk=3, t_tree_size=12, m_depth=3, m_topk=3, m_tree_size=12, min_draft_len=4)


def e2e_stack_on(device: torch.device | str) -> Stack:
    """The end-to-end stack on `device` (on CUDA, generate() takes the static runners and CUDA graphs)."""
    return Stack("digits", e2e_models(device=device), DigitTokenizer(), {})


@pytest.fixture(scope="module")
def e2e_stack() -> Stack:
    return e2e_stack_on("cpu")


@dataclass
class E2ERun:
    probs: torch.Tensor      # [runs, NEW_TOKENS - 1, V]: the target's exact distribution per emitted token
    tokens: torch.Tensor     # [runs, NEW_TOKENS - 1]: the tokens after the prefill token
    keep: torch.Tensor       # [runs, NEW_TOKENS - 1] bool: the reference is unambiguous there
    target_accepted: list[int]
    tree_paths: list[int]    # accepted path length of every verified tree


def run_e2e(stack: Stack, method: str, temperature: float, top_p: float, runs: int, first_seed: int = 0) -> E2ERun:
    s = e2e_settings(temperature, top_p)
    prompt = " ".join(map(str, PROMPT))
    seqs, acc, paths = [], [], []
    for seed in range(first_seed, first_seed + runs):
        s.seed = seed
        trace = generate(stack, method, prompt, s)
        seqs.append(PROMPT + output_tokens(trace))
        acc += [st.target_accepted for st in trace.steps[1:]]
        paths += [len(t.accepted) for st in trace.steps[1:] for t in st.trees]
    target = stack.models.target
    x = torch.tensor(seqs, device=target.device)
    with torch.no_grad():
        logits = target.logits(target(x, torch.arange(x.shape[1], device=x.device)))[:, len(PROMPT):-1].float().cpu()
    x = x.cpu()
    # leaving out rows by their context alone keeps every remaining token a fresh draw
    keep = nucleus_margin(logits, temperature, top_p) > 1e-5
    assert keep.double().mean() > 0.98
    # logits at the prefill token predict the first verified token
    return E2ERun(reference_probs(logits, temperature, top_p), x[:, len(PROMPT) + 1:], keep, acc, paths)


def conditional_checks(run: E2ERun) -> tuple[list[Check], float]:
    """Ranks 0, 1, 2 and rest of every emitted token under its exact conditional: pooled over
    positions and per position. Returns the checks and the pooled resolution (the smallest mass
    moved between two rank classes at every position that the pooled check detects with power
    POWER)."""
    sp, order = run.probs.sort(-1, descending=True)
    rank = (order == run.tokens[..., None]).double().argmax(-1)
    emitted_p = run.probs.gather(-1, run.tokens[..., None])[..., 0]
    if (emitted_p[run.keep] <= 0).any():
        return [Check("a token outside the nucleus", rank.numel(), 0.0, 1.0)], math.inf
    pi = torch.cat([sp[..., :3], sp[..., 3:].sum(-1, keepdim=True)], -1)         # [runs, pos, 4]
    hit = torch.nn.functional.one_hot(rank.long().clamp(max=3), 4).double()
    w = run.keep[..., None].double()
    pi, hit = pi * w, hit * w
    cov = torch.diag_embed(pi) - pi[..., :, None] * pi[..., None, :]

    def check(name: str, d: torch.Tensor, c: torch.Tensor, n: int) -> Check:
        stat = float(d[:3] @ torch.linalg.solve(c[:3, :3], d[:3]))
        return Check(name, n, float(chi2.sf(stat, 3)), float("nan"))
    positions = rank.shape[1]
    kept = run.keep.sum(0).tolist()
    checks = [check("all positions", (hit - pi).sum((0, 1)), cov.sum((0, 1)), sum(kept))]
    checks += [check(f"position {j + 2}", (hit - pi)[:, j].sum(0), cov[:, j].sum(0), kept[j]) for j in range(positions)]
    # moving delta from class a to class b at every token shifts the pooled d by n delta (e_a - e_b):
    # noncentrality n^2 delta^2 v' C^-1 v, C the summed covariance
    inv = torch.linalg.inv(cov.sum((0, 1))[:3, :3])
    eye = torch.eye(4, dtype=torch.float64)
    moves = [(eye[a] - eye[b])[:3] for a in range(4) for b in range(a + 1, 4)]
    per = sum(kept) ** 2 * min(float(v @ inv @ v) for v in moves)
    return checks, math.sqrt(needed_lambda(3) / per)


def assert_e2e_lossless(stack: Stack, method: str, temperature: float, top_p: float, runs: int,
                        resolution: float) -> None:
    run = run_e2e(stack, method, temperature, top_p, runs)
    big = (run.probs >= 0.1).sum(-1)[run.keep]
    assert (big >= 3).double().mean() >= 0.6, "the conditionals should spread over >= 3 tokens"
    acc = torch.tensor(run.target_accepted)
    if method == "spec":
        assert 0.15 < float((acc == 4).double().mean()) < 0.9, torch.bincount(acc)
    if method == "eagle2":
        assert float((acc >= 2).double().mean()) > 0.2 and float((acc == 3).double().mean()) > 0.05, torch.bincount(acc)
    if method == "hierspec":
        paths = torch.tensor(run.tree_paths)
        assert float((paths >= 2).double().mean()) > 0.2, torch.bincount(paths)
        assert float((acc >= 4).double().mean()) > 0.2, torch.bincount(acc)
    checks, res = conditional_checks(run)
    report = "\n".join(map(str, checks)) + f"\nresolution {res:.3f}"
    assert not flagged(checks), f"{method} at T={temperature}, top_p={top_p}: not the target distribution\n{report}"
    assert res <= resolution, report


@pytest.mark.parametrize("temperature,top_p", E2E_CONFIGS)
@pytest.mark.parametrize("method", list(E2E_RUNS))
def test_end_to_end_sampling_is_lossless(e2e_stack, method: str, temperature: float, top_p: float):
    """Every token after the prefill token has the target's exact conditional distribution, with
    drafts accepted deep often enough that every verification path is taken."""
    assert_e2e_lossless(e2e_stack, method, temperature, top_p, E2E_RUNS[method], resolution=0.07)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p", E2E_CONFIGS + [(1.0, 1.0)])
@pytest.mark.parametrize("method", list(E2E_RUNS))
def test_end_to_end_sampling_is_lossless_slow(e2e_stack, method: str, temperature: float, top_p: float):
    assert_e2e_lossless(e2e_stack, method, temperature, top_p, E2E_RUNS[method] * SLOW_FACTOR, resolution=0.03)


def test_end_to_end_sampling_with_an_eagle3_head_is_lossless(e2e_stack):
    """eagle3 drafts through its own LM head over a reduced vocabulary (ids through d2t) and T's
    layer features; its rounds are EAGLE-2's otherwise, so one configuration at a coarser
    resolution checks the wiring (the tree verification itself is checked above)."""
    assert_e2e_lossless(e2e_stack, "eagle3", 1.5, 0.9, 100, resolution=0.12)


def test_end_to_end_check_flags_q_without_temperature(e2e_stack, monkeypatch):
    """The end-to-end check catches a wiring bug only generate() can show: the drafter's q handed
    to T's verification without its temperature (top_p = 1: softmax(T log q) is q at T = 1)."""
    def forgetful(draft, q, logits, sampler):
        q1 = [torch.softmax(torch.log(x) * sampler.temperature, -1) for x in q]
        return verify_sequence_sampling(draft, q1, logits, sampler)
    monkeypatch.setattr(decoders, "verify_sequence_sampling", forgetful)
    run = run_e2e(e2e_stack, "spec", 0.5, 1.0, 120)
    checks, _ = conditional_checks(run)
    assert "all positions" in flagged(checks), "\n".join(map(str, checks))
