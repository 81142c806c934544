"""The Marlin peer of kernel-bench (hierviz.measure.marlin_peer): what it needs is checked before
anything builds, each missing piece is a skip with its reason, the symmetric weight it times is
exactly (q - 8) * s, and the one source patch it may apply touches only the scales' copies. The
build and the timing run on a GPU (tests/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from hierviz.measure import marlin_peer
from hierviz.measure.marlin_peer import SOURCES, build_marlin, marlin_operands, missing_sources, symmetric_w4


def _checkout(root) -> None:
    for s in SOURCES:
        (root / s).parent.mkdir(parents=True, exist_ok=True)
        (root / s).write_text("// stand-in\n")


def test_missing_source_is_named(tmp_path) -> None:
    assert "--marlin-src" in missing_sources(None)
    assert "marlin_cuda_kernel.cu missing" in missing_sources(tmp_path)
    _checkout(tmp_path)
    assert missing_sources(tmp_path) is None
    module, why = build_marlin(None, "published", tmp_path / "build")
    assert module is None and "IST-DASLab/marlin" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_the_peer_is_skipped_with_the_reason(tmp_path) -> None:
    _checkout(tmp_path)
    info: dict = {}
    assert marlin_operands(str(tmp_path), 256, 512, 128, 2, tmp_path / "b", info) is None
    assert info["marlin_error"] == "Marlin needs a CUDA GPU"


def test_shapes_marlin_cannot_run_are_refused_before_building(tmp_path) -> None:
    for k, n, g, match in ((256, 512, 64, "groups of 128"), (200, 512, 128, "K % 128"), (256, 300, 128, "N % 256")):
        info: dict = {}
        assert marlin_operands(str(tmp_path), k, n, g, 1, tmp_path, info) is None
        assert match in info["marlin_error"]


def test_symmetric_weight_is_codes_times_scales() -> None:
    """Within fp16's rounding of the product, so Marlin's packer (round(w / s) + 8) gets q back."""
    dense, scales = symmetric_w4(256, 64, 128, 0, "cpu")
    assert dense.shape == (64, 256) and scales.shape == (2, 64)
    per_column = scales.t().repeat_interleave(128, dim=1)
    q = dense.float() / per_column.float() + 8
    assert (q - q.round()).abs().max() < 0.01 and q.round().min() == 0 and q.round().max() == 15
    assert torch.equal(((q.round() - 8).half() * per_column), dense)


def test_the_patch_drops_the_hint_at_every_call_and_keeps_the_definition() -> None:
    text = ("cp_async4_stream(&sh_b_stage[i], B_ptr[i]);\n"
            "  cp_async4_stream(&sh_s_stage[s_sh_wr], &s[s_gl_rd]);\n"
            "  cp_async4_stream(&sh_s[s_sh_wr], &s[s_gl_rd]);\n")
    assert marlin_peer._patched_kernel(text, "published") == text
    patched = marlin_peer._patched_kernel(text, "without-l2-hints")
    assert "cp_async4_stream(&" not in patched and patched.count("cp_async4_pred(&sh_") == 3
    with pytest.raises(RuntimeError, match="no hinted copies"):
        marlin_peer._patched_kernel("void cp_async4_stream(void* p) {}", "without-l2-hints")
