"""Losslessness with real acceptance: every method against the target's greedy output while the
drafters propose that output, right, partly right, or wrong in controlled ways.

The tiny random stack's own heads almost never get a tree node accepted, so comparing methods on
it checks the rejection paths only. Here M, E_M and E_T are steered (tests/oracles.py) to propose
the target's true greedy continuation under a drawn policy; T still verifies with its own logits.
Each drawn case runs spec, EAGLE-2 and HierSpec and checks, round by round, that the output is
the greedy one, that T accepted exactly the right prefix of each draft, and that the acceptance is
what the policy implies; the totals over all cases must reach deep, full and partial acceptance,
rejections at every depth, EOS inside accepted drafts and drafts cut by the token budget.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from hierviz.methods import METHODS
from hierviz.settings import DecodeSettings
from hierviz.engine import generate
from hierviz.stack import Stack, tiny_random_stack
from hierviz.tokenizer import ByteTokenizer
from tests.oracles import (GreedyPath, OracleError, Policy, Regime, SteerLog, Tally, check_forwards, check_run,
                           continuation_needed, greedy_continuation, steered_models)

PROMPTS = ["The quick brown fox", "abc", "hello there", "Explain RoPE", "x", "1 + 1 =", "tree of drafts",
           "Once upon a time"]
N_CASES = 140
DRAFT_METHODS = ("spec", "eagle2", "hierspec")
REGIMES = ("exact", "upto", "rank", "tie", "periodic", "rate")
# which steered drafters each method calls
USES = {"spec": ("m",), "eagle2": ("e_t",), "hierspec": ("e_m", "m")}


@dataclass
class Case:
    index: int
    prompt: str
    regime: Regime
    settings: DecodeSettings
    eos_at: int     # index into the continuation of the token made EOS for this case; -1: none


def _tokenizer(eos: set[int]) -> ByteTokenizer:
    tok = ByteTokenizer()
    tok.eos_ids = set(eos)
    return tok


def draw_settings(rng: random.Random) -> DecodeSettings:
    def tree(max_depth: int, max_topk: int, max_size: int) -> tuple[int, int, int]:
        d, k = rng.randint(1, max_depth), rng.randint(1, max_topk)
        return d, k, rng.randint(1, min(max_size, k + (d - 1) * k * k))
    md, mk, ms = tree(4, 5, 12)
    td, tk, ts = tree(5, 5, 16)
    return DecodeSettings(max_new_tokens=rng.randint(1, 24), m_depth=md, m_topk=mk, m_tree_size=ms, t_depth=td,
                          t_topk=tk, t_tree_size=ts, min_draft_len=rng.randint(1, 8), spec_k=rng.randint(1, 6))


def draw_regime(rng: random.Random, s: DecodeSettings) -> Regime:
    name = rng.choice(REGIMES)
    seed = rng.randrange(1 << 16)
    exact = Policy("exact")
    if name == "exact":
        return Regime(name, exact, exact, exact)
    if name == "upto":      # k = 0: the heads are wrong from the root's children on
        return Regime(name, Policy("upto", rng.randint(0, s.t_depth)), Policy("upto", rng.randint(0, s.m_depth)), exact)
    if name == "rank":      # up to one past top-k: the right token just outside the tree
        return Regime(name, Policy("rank", rng.randint(2, s.t_topk + 1), seed=seed),
                      Policy("rank", rng.randint(2, s.m_topk + 1), seed=seed + 1), exact)
    if name == "tie":
        return Regime(name, Policy("tie", seed=seed), Policy("tie", seed=seed + 1), Policy("tie", seed=seed + 2))
    if name == "periodic":  # M right for k tokens after each miss; E_T wrong at random positions
        return Regime(name, Policy("rate", rate=0.3, seed=seed), exact,
                      Policy("periodic", rng.randint(0, 4), seed=seed))
    r = rng.choice((0.1, 0.25, 0.5))
    return Regime(name, Policy("rate", rate=r, seed=seed), Policy("rate", rate=r, seed=seed + 1),
                  Policy("rate", rate=r, seed=seed + 2))


def draw_cases(n: int) -> list[Case]:
    out = []
    for i in range(n):
        rng = random.Random(i)           # case i alone reproduces from its index
        s = draw_settings(rng)
        out.append(Case(i, rng.choice(PROMPTS), draw_regime(rng, s), s,
                        rng.randrange(s.max_new_tokens) if rng.random() < 0.35 else -1))
    return out


CASES = draw_cases(N_CASES)


@pytest.fixture(scope="module")
def world() -> tuple[Stack, dict[str, GreedyPath]]:
    """The tiny random stack and, per prompt, the target's greedy sequence (plain argmax loop),
    long enough for every case's budget plus its drafts."""
    stack = tiny_random_stack()
    # the same bits as its `reference` W4 kernel (both multiply by the dequantized matrix), without
    # dequantizing every weight at every forward
    for mod in stack.models.target.modules():
        if getattr(mod, "w4", None):
            mod.w4_kernel = "dequant_cached"
    need = max(continuation_needed(c.settings) for c in CASES)
    paths = {}
    for p in PROMPTS:
        ids = stack.tokenizer.encode_chat(p)
        margins: list[float] = []
        paths[p] = GreedyPath(ids, greedy_continuation(stack.models.target, ids, need, None, margins))
        # a near tie would let float rounding, not the engine, decide between the loop and a method
        assert min(margins) > 1e-3, f"{p!r}: near tie in the target's greedy path: {min(margins)}"
    return stack, paths


def _eos_for(case: Case, path: GreedyPath) -> set[int]:
    if case.eos_at < 0:
        return set()
    return {path.tokens[path.prompt_len + case.eos_at]}


def run_case(stack: Stack, path: GreedyPath, case: Case, tally: Tally, static: bool = False) -> None:
    eos = _eos_for(case, path)
    vocab = stack.models.target.cfg.vocab_size
    for method in DRAFT_METHODS:
        log = SteerLog()
        models = steered_models(stack.models, path, case.regime, log)
        st = Stack("oracle", models, _tokenizer(eos), {})
        target_calls = [0]
        hook = models.target.register_forward_hook(lambda *_: target_calls.__setitem__(0, target_calls[0] + 1))
        try:
            trace = generate(st, method, case.prompt, case.settings)
        finally:
            hook.remove()
        where = f"case {case.index} ({case.regime}, {case.settings}, eos {sorted(eos)})"
        try:
            check_run(trace, method, path, case.regime, case.settings, eos, tally, vocab)
            # the trace counts forwards under the names of the parts a method uses (the registry's needs)
            check_forwards(trace, {"target": target_calls[0],
                                   **{part: getattr(models, part).calls for part in METHODS[method].needs}})
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None
        if len(trace.steps) > 1:         # a drafting round ran: the steered drafters were asked
            for d in USES[method]:
                assert log.steered[d] > 0, f"{where}: {method} never asked the steered {d}"
                # on the static path each steered drafter ran through its own static runners
                assert not static or getattr(models, {"m": "intermediate"}.get(d, d)).static_runners, where


def test_steered_drafters_all_methods_lossless_with_acceptance(world):
    """The drawn cases, each through spec, EAGLE-2 and HierSpec, then the acceptance they add up to."""
    stack, paths = world
    per_regime = {r: Tally() for r in REGIMES}
    eos_cases = 0
    for case in CASES:
        run_case(stack, paths[case.prompt], case, per_regime[case.regime.name])
        eos_cases += case.eos_at >= 0
    tally = Tally()
    for t in per_regime.values():
        tally.add(t)
    summary = (f"{len(CASES)} cases, {tally.runs} runs, {tally.trees} trees, {tally.tree_nodes_accepted} tree nodes "
               f"accepted {dict(tally.accepted_by)}, full trees {tally.full_trees}, sequences {tally.sequences}, "
               f"full {tally.full_sequences}, "
               f"tree rejections by depth {dict(sorted(tally.tree_reject_depth.items()))}, sequence rejections at "
               f"{dict(sorted(tally.seq_reject_at.items()))}, EOS cases {eos_cases}, EOS from a draft "
               f"{tally.eos_from_draft} (inside {tally.eos_inside_draft}), drafts cut by the budget "
               f"{tally.budget_cut_draft}")
    print(summary)
    assert len(CASES) >= 140 and tally.runs == len(CASES) * len(DRAFT_METHODS)
    assert tally.tree_nodes_accepted >= 1000, summary
    assert tally.full_drafts >= 300 and tally.full_trees >= 100 and tally.full_sequences >= 100, summary
    assert all(tally.tree_reject_depth[d] > 0 for d in range(1, 5)), summary
    assert all(tally.seq_reject_at[d] > 0 for d in range(1, 5)), summary
    assert tally.eos_from_draft >= 10 and tally.eos_inside_draft >= 5, summary
    assert tally.budget_cut_draft >= 10, summary
    for name, t in per_regime.items():   # every regime got real acceptance somewhere
        assert t.tree_nodes_accepted > 0 and t.full_drafts > 0, f"regime {name}: {t}"


STATIC_CASES = [c for c in CASES if c.settings.m_topk >= 2 and c.settings.t_topk >= 2][:40]


def test_steered_drafters_on_the_static_path(world, monkeypatch):
    """The same oracle through the static-shape runners and tree graphs the GPU uses (forced on
    the CPU, without CUDA graphs): drawn cases with real acceptance, checked round by round."""
    from hierviz.models import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_force", True)
    stack, paths = world
    tally = Tally()
    for case in STATIC_CASES:
        run_case(stack, paths[case.prompt], case, tally, static=True)
    summary = f"{len(STATIC_CASES)} cases: {tally}"
    print(summary)
    assert len(STATIC_CASES) == 40 and tally.runs == 3 * len(STATIC_CASES)
    assert tally.tree_nodes_accepted >= 300 and tally.full_trees >= 100 and tally.full_sequences >= 80, summary
    assert all(tally.tree_reject_depth[d] > 0 for d in (1, 2, 3)), summary
    assert all(tally.seq_reject_at[d] > 0 for d in (1, 2, 3)), summary


def test_ar_matches_the_plain_greedy_loop(world):
    """AR on the engine against the oracle's ground truth (plain argmax loop, no KV cache), with
    and without an EOS in the continuation."""
    stack, paths = world
    s = DecodeSettings(max_new_tokens=32)
    for p, path in paths.items():
        trace = generate(stack, "ar", p, s)
        check_run(trace, "ar", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
        eos = {path.tokens[path.prompt_len + 5]}
        trace = generate(Stack("eos", stack.models, _tokenizer(eos), {}), "ar", p, s)
        check_run(trace, "ar", path, None, s, eos, Tally(), 259)


def test_negative_controls(world):
    """The acceptance counter is not trivially satisfied: the stack's own random heads get (almost)
    nothing accepted, heads wrong from depth 1 get exactly nothing, and the checker rejects an
    output or an acceptance count that is off by one token."""
    stack, paths = world
    s = DecodeSettings(max_new_tokens=24, m_depth=3, m_topk=3, m_tree_size=8, t_depth=4, t_topk=3, t_tree_size=10,
                       min_draft_len=4, spec_k=4)
    random_heads, wrong_heads = Tally(), Tally()
    exact = Policy("exact")
    wrong = Regime("wrong", Policy("upto", 0), Policy("upto", 0), exact)
    for p in PROMPTS[:3]:
        path = paths[p]
        for method in ("eagle2", "hierspec"):
            check_run(generate(stack, method, p, s), method, path, None, s, stack.tokenizer.eos_ids, random_heads, 259)
            st = Stack("wrong", steered_models(stack.models, path, wrong), stack.tokenizer, {})
            check_run(generate(st, method, p, s), method, path, wrong, s, stack.tokenizer.eos_ids, wrong_heads, 259)
    assert random_heads.trees > 50 and random_heads.tree_nodes_accepted * 50 < random_heads.trees, random_heads
    assert wrong_heads.trees > 30 and wrong_heads.tree_nodes_accepted == 0, wrong_heads
    assert wrong_heads.full_sequences == wrong_heads.sequences > 0   # M's own bonus tokens: all right

    path = paths["abc"]
    st = Stack("exact", steered_models(stack.models, path, Regime("exact", exact, exact, exact)), stack.tokenizer, {})
    trace = generate(st, "hierspec", "abc", s)
    check_run(trace, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    step = next(x for x in trace.steps[1:] if x.target_accepted >= 2)
    step.target_accepted -= 1          # an engine that under-reports what T accepted
    with pytest.raises(AssertionError, match="T accepted"):
        check_run(trace, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    step.target_accepted += 1
    step.new_tokens[1] = (step.new_tokens[1] + 1) % 259   # a wrong token in the output
    with pytest.raises(AssertionError, match="differs from the greedy oracle"):
        check_run(trace, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    step.new_tokens[1] = (step.new_tokens[1] - 1) % 259
    step.new_sources[0] = "intermediate_bonus"            # a token credited to the wrong source
    with pytest.raises(AssertionError, match="the round's record says"):
        check_run(trace, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    step.new_sources[0] = "tree"
    check_run(trace, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    long = replace(s, min_draft_len=6)                     # two exact 3-deep trees a round
    two_trees = generate(st, "hierspec", "abc", long)
    check_run(two_trees, "hierspec", path, None, long, stack.tokenizer.eos_ids, Tally(), 259)
    assert any(len(x.trees) > 1 for x in two_trees.steps)
    with pytest.raises(AssertionError, match="min_draft_len"):   # M drafted a tree more than 4 tokens ask
        check_run(two_trees, "hierspec", path, None, s, stack.tokenizer.eos_ids, Tally(), 259)
    recorded = sum(x.forwards.get("intermediate", 0) for x in trace.steps)
    check_forwards(trace, {"intermediate": recorded})
    with pytest.raises(AssertionError, match="forwards"):    # one forward a round more than recorded
        check_forwards(trace, {"intermediate": recorded + len(trace.steps)})


def test_oracle_refuses_rows_it_did_not_see(world):
    stack, paths = world
    path = paths["abc"]
    exact = Policy("exact")
    m = steered_models(stack.models, path, Regime("exact", exact, exact, exact)).intermediate
    with pytest.raises(OracleError, match="no recorded forward"):
        m.logits(torch.randn(2, stack.models.target.cfg.hidden_size))


def test_an_eos_just_past_the_budget_ends_the_run_by_length(world):
    """A round whose accepted draft runs past max_new_tokens is cut at the budget; an EOS among the
    cut tokens was never output, so the run ends by length, not EOS."""
    stack, paths = world
    p = "The quick brown fox"
    path = paths[p]
    exact = Policy("exact")
    models = steered_models(stack.models, path, Regime("exact", exact, exact, exact))
    crossed = 0
    for budget in range(8, 16):
        s = DecodeSettings(max_new_tokens=budget, m_depth=3, m_topk=2, m_tree_size=6, t_depth=4, t_topk=2,
                           t_tree_size=8, min_draft_len=5, spec_k=5)
        eos = {path.tokens[path.prompt_len + budget]}         # the first token past the budget
        if eos & set(path.tokens[path.prompt_len:path.prompt_len + budget]):
            continue                                          # it occurs earlier: another case
        for method in DRAFT_METHODS:
            trace = generate(Stack("oracle", models, _tokenizer(eos), {}), method, p, s)
            check_run(trace, method, path, None, s, eos, Tally(), 259)
            assert trace.finish_reason == "length", (method, budget)
            last = trace.steps[-1]
            crossed += last.index > 0 and last.target_accepted + 1 > len(last.new_tokens)
    assert crossed >= 3          # rounds did cross the budget with the EOS among their cut tokens
