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

ARGS = ["x_ptr", "c_ptr", "s_ptr", "o_ptr", "y_ptr", "part_ptr", "cnt_ptr", "M", "N", "K", "stride_xm", "stride_ym",
        "blocks_per_split", "n_blocks"]
CONSTS = {"SUB": 128, "G": 128, "BN": 64, "BM": 16, "ATOMIC": True, "USE_ASM": True, "IS_BF16": False, "ACCUM": False,
          "ORDERED": False, "CHUNK": 4}


def _ptx_of(fn, args: dict[str, str], consts: dict, arch: int, num_warps: int = 4, num_stages: int = 3) -> str:
    """PTX of a @triton.jit kernel for sm_<arch>: args (name -> type) and constexprs (name ->
    value), put in the kernel's parameter order. Skips the test when this Triton install has no CUDA toolchain."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**args, **{k: "constexpr" for k in consts}}
    order = [a for a in fn.arg_names if a in sig]          # the kernel's own parameter order
    # constexpr keys are positions: a parameter left out (even one with a default) would shift them
    assert order == list(fn.arg_names), f"give every parameter: {set(fn.arg_names) - set(order)}"
    src = ASTSource(fn=fn, signature={k: sig[k] for k in order},
                    constexprs={(order.index(k),): v for k, v in consts.items()})
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    except (ImportError, RuntimeError, FileNotFoundError) as e:   # no ptxas / backend in this install
        if "ptxas" in str(e).lower() or isinstance(e, (ImportError, FileNotFoundError)):
            pytest.skip(f"Triton's CUDA toolchain is not available here: {e}")
        raise
    ptx = compiled.asm["ptx"]
    assert f".target sm_{arch}" in ptx
    return ptx


def _ptx(arch: int, tma: bool, sox: bool = False, factored: bool = False, **consts) -> str:
    args = {a: "i32" for a in ARGS[7:]}
    bn, half = CONSTS["BN"], CONSTS["SUB"] // 2
    args.update({"x_ptr": "*fp16", "s_ptr": "*fp16", "o_ptr": "*fp16", "y_ptr": "*fp16", "part_ptr": "*fp32", "cnt_ptr": "*i32",
                 "c_ptr": f"tensordesc<u8[{bn}, {half}]>" if tma else "*u8"})
    if sox:
        args.update({"x_ptr": f"tensordesc<fp16[{CONSTS['BM']}, {half}]>",
                     "s_ptr": f"tensordesc<fp16[1, {bn}]>", "o_ptr": f"tensordesc<fp16[1, {bn}]>"})
    return _ptx_of(triton_w4._w4_kernel, {a: args[a] for a in ARGS},
                   {**CONSTS, "TMA": tma, "TMA_SOX": sox, "FACTORED": factored, "TILED": tma and factored, **consts},
                   arch, num_stages=4)


@pytest.mark.parametrize("arch,tma,sox,factored", [
    (90, False, False, False), (90, True, False, False), (90, True, True, False), (90, True, False, True),
    (80, False, False, False), (80, False, False, True)])
def test_kernel_compiles_for_gpu(arch: int, tma: bool, sox: bool, factored: bool) -> None:
    ptx = _ptx(arch, tma, sox, factored)
    assert ("cp.async.bulk.tensor" in ptx) == tma
    assert "prmt.b32" in ptx          # the inline-PTX unpack made it in


def _gemv_ptx(arch: int, **consts) -> str:
    args = {"x_ptr": "*i32", "c_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16", "y_ptr": "*fp16",
            "part_ptr": "*fp32", "cnt_ptr": "*i32", "N": "i32", "stride_c": "i32", "stride_xm": "i32", "stride_ym": "i32",
            "quads_per_split": "i32", "n_quads": "i32", "n_groups": "i32"}
    consts = {"SUB": 128, "G": 128, "BN": 64, "BQ": 4, "ATOMIC": True, "USE_ASM": True, "ACCUM": False, "ORDERED": False,
              "PREFETCH": False, "CHUNK": 4, **consts}
    return _ptx_of(triton_w4._w4_gemv_kernel, args, consts, arch, num_stages=1)


@pytest.mark.parametrize("arch", [90, 80])
def test_ordered_split_k_compiles_for_gpu(arch: int) -> None:
    """ORDERED split-K (the default) in both kernels: no atomic adds of product values remain,
    only the tile counter's ticket (acquire-release at GPU scope) and its reset; the last
    program reads the partials through L2 (ld.global.cg), not a possibly stale L1."""
    import re
    value_atomic = re.compile(r"\b(?:atom|red)\.global[.\w]*\.(?:f16|f32|bf16|v2\.f16|noftz)")
    assert value_atomic.search(_ptx(arch, False)) and value_atomic.search(_gemv_ptx(arch))   # ATOMIC
    for ptx in (_ptx(arch, False, ORDERED=True, ATOMIC=False), _gemv_ptx(arch, ORDERED=True, ATOMIC=False),
                _ptx(arch, False, ORDERED=True, ATOMIC=False, ACCUM=True)):
        atomics = re.findall(r"\b(?:atom|red)\.[\w.]+", ptx)
        assert not value_atomic.search(ptx), atomics
        assert any("acq_rel" in a and "add" in a for a in atomics), atomics
        assert any("exch" in a for a in atomics), atomics
        assert "bar.sync" in ptx
        # the sum is unrolled: all 4 partial tiles are read (as L2 loads) in straight-line code
        assert len(re.findall(r"ld\.global\.cg", ptx)) >= 4


@pytest.mark.parametrize("arch,prefetch", [(90, False), (90, True), (80, True)])
def test_gemv_kernel_compiles_for_gpu(arch: int, prefetch: bool) -> None:
    """The one-token CUDA-core kernel: its inline PTX (unpack + packed fp16 FMAs) compiles."""
    ptx = _gemv_ptx(arch, PREFETCH=prefetch)
    assert "fma.rn.f16x2" in ptx and "prmt.b32" in ptx
    assert "mma" not in ptx            # CUDA cores only


@pytest.mark.parametrize("arch", [90, 80])
def test_residual_adding_kernels_compile_for_gpu(arch: int) -> None:
    """Both W4 kernels without split-K but with ACCUM (y += the product: a layer's residual add
    inside its o / down product) compile, and the epilogue reads y before storing it."""
    for ptx in (_ptx(arch, tma=arch == 90, factored=True, ATOMIC=False, ACCUM=True),
                _gemv_ptx(arch, PREFETCH=True, ATOMIC=False, ACCUM=True)):
        assert "atom" not in ptx and "st.global" in ptx and "ld.global" in ptx


def _fused_kernels():
    """(kernel, args, constexprs) of every hierviz.models.fused kernel at Llama-3-70B's sizes."""
    from hierviz.models import fused as f
    h = "*fp16"
    return [
        (f._rms_norm_kernel, {"x_ptr": h, "w_ptr": h, "y_ptr": h, "H": "i32", "eps": "fp32"}, {"BLOCK": 8192}),
        (f._rope_cache_kernel, {"qkv_ptr": h, "cos_ptr": h, "sin_ptr": h, "slots_ptr": "*i64", "q_ptr": h, "k_ptr": h,
                                "v_ptr": h, "stride_qkv": "i32", "HQ": "i32", "HKV": "i32", "L": "i32"},
         {"HD": 128, "HALF": 64, "BH": 64, "BHEADS": 16}),
        (f._attention_kernel, {"q_ptr": h, "k_ptr": h, "v_ptr": h, "cols_ptr": "*i32", "count_ptr": "*i32",
                               "o_ptr": h, "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "L": "i32",
                               "HQ": "i32", "stride_cols": "i32", "scale": "fp32", "blocks_per_split": "i32"},
         {"G": 8, "HD": 128, "BD": 128, "BR": 16, "BL": 64, "SPLIT": True, "IEEE": False}),
        (f._attention_combine_kernel, {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "o_ptr": h,
                                       "rows": "i32", "S": "i32"}, {"HD": 128, "BD": 128, "BROWS": 16}),
        (f._silu_mul_kernel, {"gu_ptr": h, "out_ptr": h, "I": "i32"}, {"BLOCK": 1024}),
    ]


@pytest.mark.parametrize("arch", [90, 80])
def test_fused_layer_kernels_compile_for_gpu(arch: int) -> None:
    for fn, args, consts in _fused_kernels():
        _ptx_of(fn, args, consts, arch)
