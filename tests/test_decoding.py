"""Every decoder reproduces the target's own greedy output token for token, and samples from
the target's distribution when temperature > 0 (small checks here; tests/test_sampling_power.py
tests sampling end to end and level by level with stated power)."""
from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz import methods
from hierviz.decoding.decoders import Models
from hierviz.settings import DecodeSettings
from hierviz.decoding.tree import Tree
from hierviz.decoding.verify import Sampler, verify_sequence_sampling, verify_tree_sampling
from hierviz.engine import generate, output_tokens
from hierviz.models.llama import Transformer
from hierviz.quant.w4 import dequantize
from hierviz.models.synthetic import tiny_models
from hierviz.stack import Stack, tiny_random_stack

METHODS = ("ar", "spec", "eagle2", "hierspec")


@pytest.fixture(scope="module")
def stack() -> Stack:
    torch.set_num_threads(1)   # tiny models: threads only add overhead
    return tiny_random_stack(eagle3=True)


@pytest.fixture(scope="module")
def oracle_stack(stack) -> Stack:
    """The intermediate is an exact dense copy of the target: the target accepts whole
    sequence drafts, which exercises the fully-accepted paths (M has two pending tokens)."""
    t = stack.models.target
    w = {}
    for name, p in t.named_parameters():
        w[name] = p.data
    dense = {"model.embed_tokens.weight": t.embed.data, "model.norm.weight": t.norm.weight.data}
    for i, layer in enumerate(t.layers):
        pre = f"model.layers.{i}"
        dense[f"{pre}.input_layernorm.weight"] = layer.input_norm.weight.data
        dense[f"{pre}.post_attention_layernorm.weight"] = layer.post_norm.weight.data
        for lin, names in ((layer.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                           (layer.o, ("self_attn.o_proj",)), (layer.gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                           (layer.down, ("mlp.down_proj",))):
            full = dequantize(lin.w4[0]) if lin.weight is None else lin.weight.data
            for n, part in zip(names, torch.split(full, lin.splits, 0)):
                dense[f"{pre}.{n}.weight"] = part
    m = Transformer(t.cfg, dense)
    from hierviz.models.eagle import EagleHead
    e_m = EagleHead(stack.models.e_m.cfg, _head_weights(stack.models.e_m), m)
    return Stack("oracle", Models(t, m, e_m, stack.models.e_t), stack.tokenizer, stack.meta)


def _head_weights(head) -> dict[str, torch.Tensor]:
    layer = head.layer
    w = {"fc.weight": head.fc.weight.data, "layers.0.post_attention_layernorm.weight": layer.post_norm.weight.data}
    for lin, names in ((layer.qkv, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                       (layer.o, ("self_attn.o_proj",)), (layer.gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                       (layer.down, ("mlp.down_proj",))):
        for n, part in zip(names, torch.split(lin.weight.data, lin.splits, 0)):
            w[f"layers.0.{n}.weight"] = part
    return w


def _all_equal(stack: Stack, prompt: str, s: DecodeSettings) -> dict[str, list[int]]:
    methods = [m for m in METHODS if not stack.models.missing(m)]
    outs = {m: output_tokens(generate(stack, m, prompt, s)) for m in methods}
    for m in methods:
        assert outs[m] == outs["ar"], f"{m} differs from AR on {prompt!r} with {s}"
    return outs


def test_default_settings_all_methods_identical(stack):
    outs = _all_equal(stack, "The quick brown fox", DecodeSettings(max_new_tokens=48))
    assert len(outs["ar"]) == 48


def test_full_acceptance_paths(oracle_stack):
    s = DecodeSettings(max_new_tokens=40, min_draft_len=5, m_depth=2, m_topk=3, m_tree_size=5, spec_k=4)
    _all_equal(oracle_stack, "abc", s)
    tr = generate(oracle_stack, "hierspec", "abc", s)
    assert tr.stats()["tau_target"] > 3.0    # the oracle intermediate is accepted wholesale


@hsettings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=20),
       depth=st.integers(1, 4), topk=st.integers(1, 6), size=st.integers(1, 25), min_draft=st.integers(1, 8),
       spec_k=st.integers(1, 6), n=st.integers(1, 30))
def test_property_all_methods_match_ar(stack, prompt, depth, topk, size, min_draft, spec_k, n):
    if not prompt.strip():
        prompt = "x" + prompt
    size = min(size, topk + (depth - 1) * topk * topk)
    s = DecodeSettings(max_new_tokens=n, m_depth=depth, m_topk=topk, m_tree_size=size, t_depth=depth + 1,
                       t_topk=topk, t_tree_size=min(size * 2, topk + depth * topk * topk), min_draft_len=min_draft,
                       spec_k=spec_k)
    outs = _all_equal(stack, prompt, s)
    assert len(outs["ar"]) <= n


def test_trace_shapes(stack):
    s = DecodeSettings(max_new_tokens=20, min_draft_len=4, m_depth=3, m_topk=4, m_tree_size=10)
    tr = generate(stack, "hierspec", "hello", s)
    assert tr.steps[0].index == 0 and tr.finish_reason in ("length", "eos")
    for step in tr.steps[1:]:
        assert len(step.sequence) >= s.min_draft_len
        assert step.target_accepted <= len(step.sequence)
        assert step.new_tokens[:step.target_accepted] == [x.token for x in step.sequence][:len(step.new_tokens)][:step.target_accepted]
        for t in step.trees:
            assert len(t.nodes) <= s.m_tree_size
            ids = {n.id for n in t.nodes}
            assert all(n.parent == 0 or n.parent in ids for n in t.nodes)
        assert step.forwards["target"] == 1
    assert tr.stats()["new_tokens"] == 20
    assert "gpu" not in tr.meta and tr.meta["versions"]["torch"]     # a CPU run names no GPU (test_gpu.py: one does)


# the stages each method's rounds time (hierviz.trace.STAGES); "overhead" is the rest of the round
METHOD_STAGES = {"ar": {"target_verify", "overhead"}, "spec": {"draft", "target_verify", "overhead"},
                 "eagle2": {"draft", "target_verify", "overhead"},
                 "hierspec": {"draft", "intermediate_verify", "target_verify", "overhead"}}


@pytest.mark.parametrize("method", METHODS)
def test_stage_times_name_the_methods_stages_and_fit_the_wall_time(stack, method):
    """Each round times exactly its method's stages, in ms: the rounds' times are disjoint spans
    inside the call, so they add up to no more than the wall time measured around it, and to most
    of it (a ms/s mix-up would miss by 1000x either way)."""
    import math
    import time
    s = DecodeSettings(max_new_tokens=20, min_draft_len=4, m_depth=3, m_topk=4, m_tree_size=10, t_depth=3,
                       t_topk=4, t_tree_size=10, spec_k=3)
    generate(stack, method, "warm", dataclasses.replace(s, max_new_tokens=4))   # first-call costs stay out
    t0 = time.perf_counter()
    tr = generate(stack, method, "hello", s)
    wall_ms = (time.perf_counter() - t0) * 1000.0
    for step in tr.steps:
        assert all(isinstance(v, float) and math.isfinite(v) and v >= 0.0 for v in step.timings_ms.values()), step
        assert set(step.timings_ms) <= METHOD_STAGES[method]
    assert all(set(step.timings_ms) == METHOD_STAGES[method] for step in tr.steps[1:])
    assert "target_verify" in tr.steps[0].timings_ms and tr.prefill_ms == tr.steps[0].step_ms
    timed = sum(step.step_ms for step in tr.steps)
    assert timed <= tr.meta["wall_s"] * 1000.0 <= wall_ms
    assert timed >= 0.5 * wall_ms, (timed, wall_ms)


# ---- sampling: distributions, not tokens -------------------------------------------------------

def test_tree_sampling_matches_target_distribution():
    """Multi-candidate tree verification emits tokens distributed exactly as p."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    logits = p.log()[None].repeat(4, 1)
    tree = Tree(root=0, tokens=[1, 4, 0], parents=[-1, -1, -1], depths=[1, 1, 1], scores=[-0.1, -0.2, -0.3],
                logprobs=[-0.1, -0.2, -0.3])
    sampler = Sampler(temperature=1.0, seed=0)
    n = 8000
    counts = Counter()
    for _ in range(n):
        path, bonus, dists = verify_tree_sampling(tree, logits, sampler)
        counts[tree.tokens[path[0]] if path else bonus] += 1
    _chi2_ok(counts, p, n)


def test_sequence_sampling_matches_target_distribution():
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.5, 0.2, 0.3])
    sampler = Sampler(temperature=1.0, seed=1)
    gen = torch.Generator().manual_seed(5)
    n = 10000
    counts = Counter()
    logits = p.log()[None].repeat(2, 1)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        k, bonus = verify_sequence_sampling([d], [q], logits, sampler)
        counts[d if k == 1 else bonus] += 1
    _chi2_ok(counts, p, n)


def _chi2_ok(counts: Counter, p: torch.Tensor, n: int, alpha: float = 1e-4) -> None:
    from scipy.stats import chi2
    exp = (p * n).tolist()
    keep = [i for i, e in enumerate(exp) if e >= 5]
    obs = [counts.get(i, 0) for i in keep]
    e = [exp[i] for i in keep]
    rest_o = n - sum(obs)
    rest_e = n - sum(e)
    stat = sum((o - x) ** 2 / x for o, x in zip(obs, e)) + ((rest_o - rest_e) ** 2 / rest_e if rest_e >= 5 else 0)
    dof = len(keep) - (0 if rest_e >= 5 else 1)
    pval = chi2.sf(stat, max(dof, 1))
    assert pval > alpha, f"chi-square p={pval:.2e} counts={dict(counts)} expected={exp}"


def test_top_p_filter_keeps_nucleus():
    s = Sampler(temperature=1.0, top_p=0.5)
    p = s.probs(torch.tensor([0.4, 0.3, 0.2, 0.1]).log())
    assert torch.allclose(p, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)


@pytest.mark.parametrize("static", [False, True])
def test_hierspec_with_an_eagle3_head_on_the_intermediate(static):
    """E_M may be an EAGLE-3 head: M hands it the rows entering its layers 0 and 1, it drafts over
    a reduced vocabulary through d2t, and HierSpec still reproduces AR, eagerly and on the static
    (CUDA-graph-shaped) path."""
    from hierviz.models import cuda_graphs
    from hierviz.models.synthetic import synthetic_eagle3_head
    from hierviz.tokenizer import ByteTokenizer
    models = Models(*tiny_models(259, seed=5))
    models.e_m = synthetic_eagle3_head(models.intermediate, 11, draft_vocab_size=180, feature_layers=(0, 1))
    models.intermediate.add_feature_layers(models.e_m.feature_layers)
    stack = Stack("eagle3-on-m", models, ByteTokenizer(), {})
    s = DecodeSettings(max_new_tokens=30, m_depth=3, m_topk=4, m_tree_size=10, min_draft_len=4)
    cuda_graphs.force_static(static)
    try:
        want = output_tokens(generate(stack, "ar", "hello there", s))
        tr = generate(stack, "hierspec", "hello there", s)
    finally:
        cuda_graphs.force_static(False)
    assert output_tokens(tr) == want
    assert tr.stats()["tree_rejections"] > 0 and tr.stats()["undraftable_rejections"] > 0


@pytest.mark.parametrize("static", [False, True])
def test_greedy_ar_queues_each_forward_before_it_reads_the_token(stack, static, monkeypatch):
    """Greedy AR launches the forward after token k (taking k from the device) before it reads k
    to the host, never past the token budget, and gives the tokens of one forward at a time,
    eagerly and on the static path; every decode step carries its forward's time."""
    from hierviz.decoding import decoders, state
    from hierviz.models import cuda_graphs
    from tests.oracles import one_forward_at_a_time
    monkeypatch.setenv("HIERVIZ_AR_AHEAD", "on")     # on the CPU too, where `cuda` leaves it off
    events: list[str] = []
    launch, read = state.BaseState.next_logits, decoders.TokenAhead.value

    def next_logits(self, after=None):
        if after is not None:            # a forward queued on a token still on the device
            events.append("launch")
        return launch(self, after)
    monkeypatch.setattr(state.BaseState, "next_logits", next_logits)
    monkeypatch.setattr(decoders.TokenAhead, "value", lambda self: events.append("read") or read(self))
    n = 12
    cuda_graphs.force_static(static)
    try:
        tr = generate(stack, "ar", "hello there", DecodeSettings(max_new_tokens=n))
        ids = stack.tokenizer.encode_chat("hello there")
        want = one_forward_at_a_time(stack.models.target, ids, n)
        # a consumer that goes past the budget gets one forward at a time, the same tokens
        gen = decoders.decode_ar(stack.models, ids, DecodeSettings(max_new_tokens=4), Sampler(), str, len(ids) + n + 8)
        past_budget = [next(gen).new_tokens[0] for _ in range(n)]
    finally:
        cuda_graphs.force_static(False)
    assert output_tokens(tr) == want and past_budget == want
    # tokens 1..n-1 are read; the forward after token k (k = 1..n-2) is queued before k is read
    assert events[:2 * (n - 1) - 1] == ["launch", "read"] * (n - 2) + ["read"]
    assert all(st.timings_ms["target_verify"] > 0 for st in tr.steps[1:])
    # a step's time is its forward's, not the consumer's time between steps (the app paces them)
    gen = decoders.decode_ar(stack.models, ids, DecodeSettings(max_new_tokens=6), Sampler(), str, len(ids) + n + 8)
    paced = []
    for _ in range(6):
        paced.append(next(gen).timings_ms["target_verify"])
        time.sleep(0.1)
    assert max(paced[1:]) < 100, paced
    # HIERVIZ_AR_AHEAD: on everywhere, cuda (the default) on CUDA devices only, off nowhere
    assert decoders.ar_ahead(torch.device("cpu")) and decoders.ar_ahead(torch.device("cuda"))
    monkeypatch.setenv("HIERVIZ_AR_AHEAD", "cuda")
    assert decoders.ar_ahead(torch.device("cuda")) and not decoders.ar_ahead(torch.device("cpu"))
    monkeypatch.delenv("HIERVIZ_AR_AHEAD")
    assert decoders.ar_ahead(torch.device("cuda")) and not decoders.ar_ahead(torch.device("cpu"))
    monkeypatch.setenv("HIERVIZ_AR_AHEAD", "off")
    events.clear()
    assert output_tokens(generate(stack, "ar", "hello there", DecodeSettings(max_new_tokens=n))) == want
    assert events == []


def test_reduced_vocabularies_stay_lossless():
    """FR-Spec: heads draft over a token subset and M predicts over it too; T keeps the full
    vocabulary, so every method still reproduces AR exactly."""
    models = Models(*tiny_models(259, seed=7))
    vocab = torch.arange(3, 140)
    models.e_m.set_draft_vocab(vocab)
    models.e_t.set_draft_vocab(vocab)
    models.intermediate.restrict_output_vocab(vocab)
    from hierviz.tokenizer import ByteTokenizer
    stack = Stack("reduced", models, ByteTokenizer(), {})
    s = DecodeSettings(max_new_tokens=30, m_depth=3, m_topk=4, m_tree_size=10, t_depth=3, t_topk=4, t_tree_size=12,
                       min_draft_len=4)
    _all_equal(stack, "hello there", s)
    logits = models.intermediate.logits(torch.zeros(2, 64))
    assert torch.isinf(logits[:, 200]).all() and torch.isfinite(logits[:, vocab]).all()
    # a rejection whose correct token lies outside the draft vocabulary is marked as one no draft
    # could avoid, and counted; T's own vocabulary is full, so such rejections happen here
    in_vocab = set(vocab.tolist())
    marked = 0
    for method in ("eagle2", "hierspec"):
        tr = generate(stack, method, "hello there, zebra QUIZ {~}", s)
        for t in (t for step in tr.steps for t in step.trees):
            last = t.accepted[-1] if t.accepted else 0
            rejected = any(n.parent == last for n in t.nodes)
            assert t.undraftable == (rejected and t.bonus_token not in in_vocab)
        marked += tr.stats()["undraftable_rejections"]
        assert tr.stats()["undraftable_rejections"] == sum(t.undraftable for step in tr.steps for t in step.trees)
    assert marked > 0


def test_reduced_vocabulary_rows_of_a_w4_lm_head_are_its_rows() -> None:
    """FR-Spec rows of a W4 LM head (an intermediate's, quantize_lm_head): M's restricted logits and
    its head's draft logits over the rows equal the full head's logits at those ids; other ids -inf."""
    from hierviz.measure.whatif import tiny_config
    from hierviz.models.synthetic import synthetic_head, synthetic_model
    m = synthetic_model(tiny_config(False), "w4a16", torch.float32, "cpu", "reference", 1, lm_head_format="w4a16")
    hidden = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    full = m.logits(hidden)
    ids = torch.tensor([5, 7, 100, 300, 511])
    head = synthetic_head(m, 3)
    head.set_draft_vocab(ids)
    drafted, drafted_ids = head.draft_logits(hidden)
    m.restrict_output_vocab(ids)
    part = m.logits(hidden)
    assert torch.allclose(part[:, ids], full[:, ids], atol=1e-5) and torch.allclose(drafted, full[:, ids], atol=1e-5)
    assert torch.equal(drafted_ids, ids) and torch.isinf(part).sum() == 3 * (m.cfg.vocab_size - len(ids))


@pytest.mark.parametrize("which", ["stack", "oracle_stack"])
def test_hierspec_intermediate_cache_is_the_accepted_text(which, request):
    """After every HierSpec round, M's KV cache and features hold exactly what one causal forward
    over the accepted tokens gives: the tree compaction (queued behind T's verification in the
    last step of a round) keeps the accepted path and nothing else. A wrong compaction would not
    change the output (T verifies everything) but would silently lower M's acceptance."""
    from hierviz.engine import prepare
    st_ = request.getfixturevalue(which)
    s = DecodeSettings(max_new_tokens=40, m_depth=3, m_topk=3, m_tree_size=8, min_draft_len=4)
    ids, max_len = prepare(st_, "hierspec", "cache invariant", s)
    gen = methods.get("hierspec").decode(st_.models, ids, s, Sampler(), st_.tokenizer.token_text, max_len)
    m_model = st_.models.intermediate
    rounds = 0
    with torch.no_grad():
        for step in gen:
            m = gen.gi_frame.f_locals["m"]          # the generator's intermediate state
            n = m.processed
            ref_cache = m_model.new_cache(max_len)
            ref_hidden = m_model(torch.tensor(m.tokens[:n]), torch.arange(n), ref_cache)
            torch.testing.assert_close(m.cache.k[:, :, :n], ref_cache.k[:, :, :n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.cache.v[:, :, :n], ref_cache.v[:, :, :n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m.features[:n], ref_hidden, rtol=1e-4, atol=1e-4)
            rounds += 1
            if rounds >= 8:
                break
    gen.close()
    assert rounds >= 8


def test_the_eagle3_tree_preset_decodes_losslessly(stack):
    """SafeAILab's EAGLE-3 tree settings (8 levels of 10, 59 nodes) on the tiny stack's EAGLE-3
    head: the deepest trees any preset drafts still fit the caches and reproduce AR."""
    from hierviz.settings import TREE_PRESETS
    s = DecodeSettings(max_new_tokens=24, **TREE_PRESETS["eagle3"])
    want = output_tokens(generate(stack, "ar", "deep trees", s))
    tr = generate(stack, "eagle3", "deep trees", s)
    assert output_tokens(tr) == want
    assert max(len(t.nodes) for step in tr.steps for t in step.trees) == 59


@pytest.mark.parametrize("method", ["ar", "spec", "eagle2", "eagle3", "hierspec"])
def test_forwards_run_the_rows_the_registry_says(method: str, monkeypatch) -> None:
    """The row counts a W4 kernel choice weighs (methods.forward_rows) are the rows each model's
    decode forwards really run: every forward after the prompt's prefill is recorded."""
    from hierviz.decoding.state import BaseState
    stack = tiny_random_stack(eagle3=True)
    s = DecodeSettings(max_new_tokens=40, m_depth=2, m_topk=3, m_tree_size=5, min_draft_len=3,
                       t_depth=3, t_topk=3, t_tree_size=7, spec_k=3)
    seen: dict[str, list[int]] = {}
    run = BaseState.run_pending

    def recording(state, extra=None, *args, **kwargs):
        role = "target" if state.model is stack.models.target else "intermediate"
        seen.setdefault(role, []).append(len(state.pending) + (0 if extra is None else len(extra)))
        return run(state, extra, *args, **kwargs)
    monkeypatch.setattr(BaseState, "run_pending", recording)
    generate(stack, method, "rows of every forward", s)
    want = methods.forward_rows([method], s)
    assert set(seen) == set(want)
    for role, rows in seen.items():
        decode = rows[1:]          # the first forward is the prompt's prefill
        assert decode and set(decode) <= want[role], (role, sorted(set(decode)), want[role])
