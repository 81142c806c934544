"""Sampling (temperature > 0) is lossless, tested with stated statistical power.

Every method must emit each token exactly from the target's distribution p, with temperature and
top-p applied. Two levels:

(a) The verification functions (hierviz.decoding.verify) on synthetic distributions: tree levels
    1..3 (and the bonus after depth 3) of a full top-3 tree of depth 3, sequence drafts of length
    1..6, at temperature/top-p (0.5, 1.0), (1.0, 1.0), (1.5, 0.9).
(b) End to end through engine.generate() on a tiny stack, for spec, eagle2 and hierspec, at every
    position after the prefill token (the prefill token is the target's own sample, never verified).

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

Threshold and false alarms. A check fails at p < ALPHA = 1e-5. A default run makes 126 checks of
correct samplers (54 in (a), 72 in (b)), so one fails with probability < 1.3e-3 (Bonferroni);
seeds are fixed, so a run is reproducible and a benign change of the random stream trips it for
about 1 seed in 800.

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
Negative controls run the same checks at the same sizes and must fail: the verifier's p with 3
points moved (every tree level 1..3 flags it), q handed to the verifier at temperature 1 while
drafting at 1.2 (exact first-token bias TV 0.03-0.045, computed in the test, with its power), and
two gross bugs (a tree residual not renormalised, q without its temperature at T = 0.5).

(b) has fewer samples (a round costs ~1-2 ms of model forwards on this CPU): each cell computes
its "resolution", the mass moved between two rank classes at every position that the pooled check
detects with power 0.99 (from the realised covariance, 3 dof), and asserts it is <= 0.07 (it is
0.05-0.065); the per-position checks (n = runs) only catch large shifts. The slow run has 8x the
trajectories and also T = 1.0 (resolution <= 0.03; 5-8 minutes):
    HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider tests/test_sampling_power.py -m slow
A gross wiring bug only generate() shows (q passed to T without its temperature) must fail (b).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

from hierviz.decoding import decoders
from hierviz.decoding.decoders import Models
from hierviz.decoding.settings import DecodeSettings
from hierviz.decoding.tree import Tree
from hierviz.decoding.verify import Sampler, verify_sequence_sampling, verify_tree_sampling
from hierviz.engine import generate, output_tokens
from hierviz.models.config import ModelConfig
from hierviz.models.eagle import EagleHead
from hierviz.models.llama import Transformer
from hierviz.stack import Stack
from hierviz.tokenizer import Tokenizer

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


def _full_tree() -> tuple[list[int], list[int]]:
    """Parents and depths of the full K-ary tree of depth DEPTH, breadth first (39 nodes)."""
    parents: list[int] = []
    depths: list[int] = []
    level = [-1]
    for d in range(1, DEPTH + 1):
        nxt = []
        for par in level:
            for _ in range(K):
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
    counts = torch.zeros(DEPTH + 1, V, dtype=torch.long)
    for c in range(n):
        tree = Tree(0, tokens[c], PARENTS, DEPTHS, scores, scores)
        path, bonus, dists = verify(tree, logits[c], sampler)
        rows = [0] + [i + 1 for i in path]
        emitted = [tokens[c][i] for i in path] + [bonus]
        for level, (row, tok) in enumerate(zip(rows, emitted)):
            counts[level, ranks[c][row][tok]] += 1
        if plain and c < 50:
            # HierSpec's q for T: the verifier's distribution at every emitted token
            want = reference_probs(logits[c, rows], temperature, top_p)
            torch.testing.assert_close(torch.stack(dists).double(), want, atol=1e-5, rtol=0)
    return counts


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
    out = SeqCounts({}, torch.zeros(7, V, dtype=torch.long), torch.zeros(V, dtype=torch.long), [])
    for k, n in calls.items():
        logits, rank = permuted_rows(g, n, k + 1, temperature)
        q_logits = logits[:, :k] + 0.5 * temperature * torch.randn(n, k, V, generator=g)
        q = sampler.probs(q_logits)
        draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(n, k)
        q_seen = q if q_seen_temperature is None else Sampler(q_seen_temperature, top_p).probs(q_logits)
        out.first.append((reference_probs(logits[:, 0], temperature, top_p), q[:, 0].double(), q_seen[:, 0].double()))
        counts = torch.zeros(V, dtype=torch.long)
        drafts, ranks = draft.tolist(), rank.tolist()
        for c in range(n):
            accepted, bonus = verify_sequence_sampling(drafts[c], list(q_seen[c]), logits[c], sampler)
            for i, tok in enumerate(drafts[c][:accepted] + [bonus]):
                r = ranks[c][i][tok]
                counts[r] += 1
                out.by_position[i, r] += 1
            if accepted == k:
                out.bonus[ranks[c][k][bonus]] += 1
        out.by_length[k] = counts
    return out


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


def e2e_models(seed: int = 0) -> Models:
    """One-layer T over 6 tokens, with logits scaled down (final norm weight 0.085) so that its
    conditionals spread over several tokens even at temperature 0.5; M = T with 40% weight noise;
    E_T / E_M = a copy of their base's layer fed the token embedding only (fc = [I | 0]). With unit
    RMS embeddings (= T's normalised layer input) such a head reproduces its base's residual stream
    up to the first position's key and the final norm's scale, so its top-3 are mostly the base's
    and trees are accepted to depth 2-3 often: plausible drafts, verified by the real code."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g)
    emb = emb / emb.pow(2).mean(-1, keepdim=True).sqrt()
    t_w = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.full((H,), 0.085), **_layer(g)}
    m_w = {k: v + 0.4 * v.std() * torch.randn(v.shape, generator=g) if "proj" in k else v for k, v in t_w.items()}
    target, inter = Transformer(_cfg(), t_w), Transformer(_cfg(), m_w)

    def head(w: dict[str, torch.Tensor], base: Transformer) -> EagleHead:
        hw = {k.replace("model.layers.0", "layers.0"): v for k, v in w.items()
              if k.startswith("model.layers.0.") and "input_layernorm" not in k}
        hw["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
        return EagleHead(_cfg(), hw, base)
    return Models(target, inter, head(m_w, inter), head(t_w, target))


PROMPT = [1, 5, 3, 2]
NEW_TOKENS = 12
E2E_CONFIGS = [(0.5, 1.0), (1.5, 0.9)]
E2E_RUNS = {"spec": 260, "eagle2": 240, "hierspec": 180}
SLOW_FACTOR = 8


def e2e_settings(temperature: float, top_p: float) -> DecodeSettings:
    return DecodeSettings(max_new_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, spec_k=4,
                          t_depth=3, t_topk=3, t_tree_size=12, m_depth=3, m_topk=3, m_tree_size=12, min_draft_len=4)


@pytest.fixture(scope="module")
def e2e_stack() -> Stack:
    return Stack("digits", e2e_models(), DigitTokenizer(), {})


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
    x = torch.tensor(seqs)
    target = stack.models.target
    with torch.no_grad():
        logits = target.logits(target(x, torch.arange(x.shape[1])))[:, len(PROMPT):-1]
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
