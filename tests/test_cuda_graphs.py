"""The static-shape path (hierviz.models.cuda_graphs) computes what the dynamic path computes.

On a GPU that path is replayed from CUDA graphs; here it runs eagerly on the CPU (forced), so
CI checks its padding, slot writes, in-graph masks and head windows."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.decoding.decoders import comparison_methods
from hierviz.settings import DecodeSettings
from hierviz.decoding.state import BaseState
from hierviz.engine import generate, output_tokens
from hierviz.models import cuda_graphs
from hierviz.stack import tiny_random_stack
from hierviz.methods import METHODS
from tests.tiny import prefill_sequence_tree


@pytest.fixture(scope="module")
def stack():
    torch.set_num_threads(1)
    return tiny_random_stack(eagle3=True)


@pytest.fixture
def static():
    cuda_graphs.force_static(True)
    yield
    cuda_graphs.force_static(False)


def _states(model, static_on: bool) -> BaseState:
    cuda_graphs.force_static(static_on)
    try:
        return BaseState(model, 200)
    finally:
        cuda_graphs.force_static(False)


def test_bucket_for() -> None:
    assert cuda_graphs.bucket_for(1) == 1
    assert cuda_graphs.bucket_for(3) == 4
    assert cuda_graphs.bucket_for(97) == 128
    assert cuda_graphs.bucket_for(129) is None


def test_static_forward_matches_dynamic(stack) -> None:
    """Prefill, a causal sequence and a tree: same hidden states, same cache contents."""
    t = stack.models.target
    dyn, sta = _states(t, False), _states(t, True)
    assert dyn.runner is None and sta.runner is not None
    for st in (dyn, sta):
        st.tokens = list(range(10, 40))
    for ha, hb in zip(prefill_sequence_tree(dyn), prefill_sequence_tree(sta)):
        torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)
        # The LM head multiplies hidden-state rounding differences (the two paths sum in different
        # orders) by ~10 on this tiny random model: 1.4e-5 measured on one CPU, under 1e-5 on another.
        torch.testing.assert_close(t.logits(hb), t.logits(ha), rtol=1e-4, atol=5e-5)
    with torch.no_grad():
        n = dyn.cache.length
        assert sta.cache.length == n
        torch.testing.assert_close(sta.cache.k[:, :, :n], dyn.cache.k[:, :, :n])


def test_runner_falls_back_for_long_forwards(stack) -> None:
    """A forward longer than the largest bucket runs the dynamic path on the runner's cache: the
    eager path's hidden states and cache, and the runner decodes on from there."""
    t = stack.models.target
    sta, dyn = _states(t, True), _states(t, False)
    assert sta.runner is not None and dyn.runner is None
    assert cuda_graphs.bucket_for(150) is None
    outs = []
    for st in (dyn, sta):
        st.tokens = list(range(3, 3 + 150))
        with torch.no_grad():
            long = st.run_pending()
            st.tokens += [7, 9]                  # two more tokens: a bucketed forward after the fallback
            short = st.run_pending()
        outs.append((long, short))
    (dl, ds), (sl, ss) = outs
    assert sl.shape == dl.shape == (150, t.feature_width) and sta.cache.length == dyn.cache.length == 152
    torch.testing.assert_close(sl, dl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ss, ds, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(sta.cache.k[:, :, :152], dyn.cache.k[:, :, :152])
        torch.testing.assert_close(sta.cache.v[:, :, :152], dyn.cache.v[:, :, :152])


@pytest.mark.parametrize("method", METHODS)
def test_decoders_static_equal_dynamic_ar(stack, method) -> None:
    s = DecodeSettings(max_new_tokens=24, m_depth=3, m_topk=4, m_tree_size=10, t_depth=3, t_topk=4,
                       t_tree_size=12, min_draft_len=4, spec_k=3)
    want = output_tokens(generate(stack, "ar", "Static shapes", s))
    cuda_graphs.force_static(True)
    try:
        got = output_tokens(generate(stack, method, "Static shapes", s))
    finally:
        cuda_graphs.force_static(False)
    assert got == want


def test_runners_are_pooled(stack, static) -> None:
    t = stack.models.target
    a = BaseState(t, 100)
    r = a.runner
    del a
    b = BaseState(t, 120)            # same length class: the released runner comes back
    assert b.runner is r
    c = BaseState(t, 100)            # b still holds it: a second runner
    assert c.runner is not r


def test_path_switches_override_the_options_and_restore_them(monkeypatch) -> None:
    """path_switches changes the options for its block only, and never writes os.environ."""
    import os

    from hierviz.config import options
    from hierviz.models import cuda_graphs
    monkeypatch.delenv("HIERVIZ_STATIC", raising=False)
    monkeypatch.setenv("HIERVIZ_CUDA_GRAPHS", "0")
    before = dict(os.environ)
    assert options().static and not options().cuda_graphs
    with cuda_graphs.path_switches(static=False, graphs=True, fused=False):
        o = options()
        assert not o.static and o.cuda_graphs and not o.fused
        with cuda_graphs.path_switches(static=True):
            assert options().static and options().cuda_graphs
        assert not options().static
        assert dict(os.environ) == before
    assert options().static and not options().cuda_graphs and options().fused


def test_prepare_all_runs_every_bucket(stack, static) -> None:
    """A benchmark's warm-up compiles every bucket up front (here: eager static forwards on the CPU)."""
    t = stack.models.target
    cuda_graphs.drop_runners(t)
    st = BaseState(t, 100)
    assert cuda_graphs.prepare_all(t) == 1
    assert sorted(st.runner._buckets) == list(cuda_graphs.BUCKETS)
    st.tokens = list(range(3, 13))       # the runner still decodes after the scratch-slot forwards
    with torch.no_grad():
        h = st.run_pending()
    assert st.cache.length == 10
    cuda_graphs.drop_runners(t)
    dyn = _states(t, False)
    dyn.tokens = list(range(3, 13))
    with torch.no_grad():
        torch.testing.assert_close(h, dyn.run_pending(), rtol=1e-5, atol=1e-5)


def test_warm_up_prepares_every_bucket_of_every_model(static) -> None:
    """engine.warm_up's short runs reach few buckets; it then prepares the rest for each model, so a
    longer prompt's prefill does not compile inside the first timed or recorded run."""
    from hierviz.engine import warm_up
    st = tiny_random_stack()               # its own models: pools untouched by other tests
    warm_up(st, comparison_methods(st.models), DecodeSettings(max_new_tokens=4, m_depth=2, m_tree_size=6,
                                                               t_depth=2, t_tree_size=6, min_draft_len=2))
    for model in st.models.present():
        runners = model.static_runners
        assert runners and all(sorted(r._buckets) == list(cuda_graphs.BUCKETS) for r in runners), model


def test_a_runner_knows_a_draft_head_from_a_base_model(stack) -> None:
    """A head's runner passes features, a base model's does not: told apart by the head type, on
    every Python (a Protocol isinstance misses nn.Module submodules from Python 3.12 on)."""
    from hierviz.models.drafter import is_drafter
    m = stack.models
    assert [is_drafter(x) for x in m.present()] == [False, False, True, True, True]
    assert [x.head_type for x in (m.e_m, m.e_t, m.e_t3)] == ["eagle2", "eagle2", "eagle3"]
