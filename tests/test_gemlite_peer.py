"""The GemLite peer of kernel-bench (hierviz.measure.gemlite_peer) on the CPU: the operands it
hands GemLite describe the engine's own weight, and without a GPU it says why it is skipped (its
products run in tests/test_gpu.py where gemlite is installed)."""
from __future__ import annotations

import pytest
import torch

from hierviz.measure.gemlite_peer import gemlite_layers, gemlite_operands
from hierviz.models.synthetic import random_w4
from hierviz.quant.w4 import dequantize


def _weight():
    return random_w4(96, 256, 128, torch.float16, "cpu", torch.Generator().manual_seed(3))


def test_operands_are_the_engines_matrix_in_gemlites_fma_form() -> None:
    """GemLite's grouped integer mode computes q * s - zeros * s per group."""
    w = _weight()
    q, s, z = gemlite_operands(w)
    assert q.dtype == torch.uint8 and q.shape == (96, 256) and int(q.max()) <= 15
    assert s.shape == z.shape == (96, 2) and s.dtype == z.dtype == torch.float16
    g = w.group_size
    sf = s.float().repeat_interleave(g, 1)
    zs = (-z.float() * s.float()).half().float().repeat_interleave(g, 1)   # GemLite keeps z' in fp16
    want = dequantize(w, torch.float32)
    assert float((q.float() * sf + zs - want).norm() / want.norm()) < 1e-3
    # negative control: the offsets taken as GemLite's zeros are a different matrix
    wrong = (q.float() - w.offsets.float().repeat_interleave(g, 1)) * sf
    assert float((wrong - want).norm() / want.norm()) > 0.5


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's answer")
def test_without_a_gpu_the_peer_says_why() -> None:
    info: dict = {}
    assert gemlite_layers([_weight()], info) is None
    assert "CUDA" in info["gemlite_error"]
