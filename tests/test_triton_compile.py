"""The Triton W4A16 kernel compiles to PTX for the GPUs it serves, without a GPU: Hopper (sm_90,
pointer and TMA variants; the TMA one must issue bulk tensor copies) and the A100 of the public
Space (sm_80, pointer variant). The interpreter tests check the arithmetic; this checks that the
GPU compiler accepts the kernel (inline PTX, constexpr branches, descriptor loads)."""
from __future__ import annotations

import os

import pytest

# Triton 3.9 warns when this is unset; "1" is its current default (the GPU runs compile the same).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

triton = pytest.importorskip("triton")

from hierviz.quant import triton_w4  # noqa: E402

ARGS = ["x_ptr", "c_ptr", "s_ptr", "o_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym",
        "blocks_per_split", "n_blocks"]
CONSTS = {"SUB": 128, "G": 128, "BN": 64, "BM": 16, "ATOMIC": True, "USE_ASM": True, "IS_BF16": False}


def _ptx(arch: int, tma: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {a: "i32" for a in ARGS[5:]}
    sig.update({"x_ptr": "*fp16", "s_ptr": "*fp16", "o_ptr": "*fp16", "y_ptr": "*fp16",
                "c_ptr": f"tensordesc<u8[{CONSTS['BN']}, {CONSTS['SUB'] // 2}]>" if tma else "*u8"})
    order = ARGS + list(CONSTS) + ["TMA"]
    sig.update({k: "constexpr" for k in order[len(ARGS):]})
    consts = {(order.index(k),): v for k, v in {**CONSTS, "TMA": tma}.items()}
    src = ASTSource(fn=triton_w4._w4_kernel, signature={k: sig[k] for k in order}, constexprs=consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 4})
    return compiled.asm["ptx"]


@pytest.mark.parametrize("arch,tma", [(90, False), (90, True), (80, False)])
def test_kernel_compiles_for_gpu(arch: int, tma: bool) -> None:
    try:
        ptx = _ptx(arch, tma)
    except (ImportError, RuntimeError, FileNotFoundError) as e:   # no ptxas / backend in this install
        if "ptxas" in str(e).lower() or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"Triton's CUDA toolchain is not available here: {e}")
        raise
    assert f".target sm_{arch}" in ptx
    assert ("cp.async.bulk.tensor" in ptx) == tma
    assert "prmt.b32" in ptx          # the inline-PTX unpack made it in
