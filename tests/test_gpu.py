"""GPU-only checks of what only a GPU runs: CUDA-graph replays of the decoders' forwards and of
whole draft trees (tree.TreeGraph). Skipped without CUDA (CI); on the device machine:
`python -m pytest -q tests/test_gpu.py` (session 13, H200: 3 passed). The same code runs eagerly
through the static path in CPU tests (test_tree.py, test_cuda_graphs.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from hierviz.decoding.settings import DecodeSettings
from hierviz.decoding.state import BaseState, HeadState
from hierviz.decoding.tree import draft_tree
from hierviz.engine import generate, output_tokens
from hierviz.stack import tiny_random_stack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def stack():
    return tiny_random_stack("cuda")


@pytest.mark.parametrize("prompt", ["Static shapes", "hello world, trees"])
def test_decoders_reproduce_ar_with_graphs(stack, prompt) -> None:
    s = DecodeSettings(max_new_tokens=48, m_depth=3, m_topk=4, m_tree_size=10, t_depth=3, t_topk=4,
                       t_tree_size=12, min_draft_len=4, spec_k=3)
    want = output_tokens(generate(stack, "ar", prompt, s))
    for method in ("spec", "eagle2", "hierspec"):
        assert output_tokens(generate(stack, method, prompt, s)) == want, method


def test_tree_graph_replays_the_eager_tree() -> None:
    stack = tiny_random_stack("cuda")      # its own models: no runner or tree graph used before
    m, e = stack.models.intermediate, stack.models.e_m
    trees, runner = [], None
    with torch.no_grad():
        for _ in range(4):            # call 1 runs eagerly, call 2 captures, calls 3-4 replay
            base = BaseState(m, 200)
            head = HeadState(e, base, 200)
            base.tokens = list(range(40, 61))
            root = base.tokens.pop()
            base.consume_pending()
            base.tokens.append(root)
            trees.append(draft_tree(head, 3, 4, 10))
            assert head.cache.length == 20
            assert runner is None or head.runner is runner, "the runner did not go back to the pool"
            runner = head.runner
            del base, head
            gc.collect()
    assert all(t == trees[0] for t in trees[1:])
    graphs = list(runner.tree_graphs.values())
    assert [(g.graph is not None, g.calls) for g in graphs] == [(True, 4)]
