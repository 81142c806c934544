"""The FBGEMM peer of kernel-bench (hierviz.measure.fbgemm_peer) on the CPU: the operands it hands
FBGEMM's bf16i4bf16_rowwise describe the engine's own weight, and without a GPU (or the package) it
says why it is skipped (its products run in tests/test_gpu.py where the package loads)."""
from __future__ import annotations

import pytest
import torch

from hierviz.measure import fbgemm_peer
from hierviz.models.synthetic import random_w4
from hierviz.quant.w4 import dequantize


def _weight():
    return random_w4(96, 256, 64, torch.float16, "cpu", torch.Generator().manual_seed(5))


def _signed_nibbles(wq: torch.Tensor) -> torch.Tensor:
    """int8 [N, K / 2] two signed 4-bit values a byte (even channel low) -> int [N, K]."""
    b = wq.to(torch.int16) & 0xFF
    lo, hi = b & 0xF, b >> 4
    out = torch.stack([lo, hi], -1).flatten(-2)
    return torch.where(out >= 8, out - 16, out)


def test_operands_are_the_engines_matrix_in_fbgemms_form() -> None:
    """FBGEMM computes (signed code) * scale + zero per group, scales and zeros stored [K / G, N]."""
    w = _weight()
    wq, s, z = fbgemm_peer.fbgemm_operands(w)
    assert wq.dtype == torch.int8 and wq.shape == (96, 128)
    assert s.shape == z.shape == (4, 96) and s.dtype == z.dtype == torch.bfloat16
    q = _signed_nibbles(wq)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    g = w.group_size
    got = q.float() * s.float().t().repeat_interleave(g, 1) + z.float().t().repeat_interleave(g, 1)
    want = dequantize(w, torch.float32)
    assert float((got - want).norm() / want.norm()) < 1e-2          # bf16 scales and zeros
    # negative control: the unsigned codes with the offsets as zeros are another matrix
    wrong = (q.float() + 8) * s.float().t().repeat_interleave(g, 1) + z.float().t().repeat_interleave(g, 1)
    assert float((wrong - want).norm() / want.norm()) > 0.5


def test_act_order_weights_are_refused() -> None:
    w = _weight()
    w.perm = torch.randperm(256)
    with pytest.raises(ValueError, match="act-order"):
        fbgemm_peer.fbgemm_operands(w)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's answer")
def test_without_a_gpu_the_peer_says_why() -> None:
    info: dict = {}
    assert fbgemm_peer.fbgemm_layers([_weight()], info) is None
    assert "CUDA" in info["fbgemm_error"]


def test_a_missing_package_is_named(monkeypatch) -> None:
    """Where no package registers the operator, the reason names what was tried."""
    monkeypatch.setattr(fbgemm_peer, "IMPORTS", ("hierviz_no_such_package",))
    monkeypatch.setattr(fbgemm_peer, "NAMESPACES", ("hierviz_no_such_namespace",))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    info: dict = {}
    assert fbgemm_peer.fbgemm_layers([_weight()], info) is None
    assert "hierviz_no_such_package" in info["fbgemm_error"] and "fbgemm-gpu-genai" in info["fbgemm_error"]
