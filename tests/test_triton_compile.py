"""The Triton W4A16 kernel compiles to PTX for the GPUs it serves, without a GPU: Hopper (sm_90,
pointer and TMA variants; the TMA one must issue bulk tensor copies), the A100 of the public
Space (sm_80, pointer variant) and Blackwell (sm_100, sm_120: what an unproven platform runs).
The interpreter tests check the arithmetic; this checks that the GPU compiler accepts the kernel
(inline PTX, constexpr branches, descriptor loads)."""
from __future__ import annotations

import os

import pytest

# Triton 3.9 warns when this is unset; "1" is its current default (the GPU runs compile the same).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

triton = pytest.importorskip("triton")

from hierviz.quant import triton_w4  # noqa: E402

ARGS = ["x_ptr", "c_ptr", "s_ptr", "o_ptr", "y_ptr", "part_ptr", "cnt_ptr", "M", "N", "K", "stride_xm", "stride_ym",
        "blocks_per_split", "n_blocks", "blocks_per_group"]
CONSTS = {"SUB": 128, "BN": 64, "BM": 16, "ATOMIC": True, "USE_ASM": True, "IS_BF16": False, "ACCUM": False,
          "ORDERED": False, "CHUNK": 4}


def _ptx_of(fn, args: dict[str, str], consts: dict, arch: int, num_warps: int = 4, num_stages: int = 3) -> str:
    """PTX of a @triton.jit kernel for sm_<arch> (see _compiled)."""
    return _compiled(fn, args, consts, arch, num_warps, num_stages)["ptx"]


def _compiled(fn, args: dict[str, str], consts: dict, arch: int, num_warps: int = 4, num_stages: int = 3) -> dict:
    """The compiled forms (ttgir, ptx, ...) of a @triton.jit kernel for sm_<arch>: args (name -> type)
    and constexprs (name -> value), put in the kernel's parameter order. Skips the test when this
    Triton install has no CUDA toolchain."""
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
    assert f".target sm_{arch}" in compiled.asm["ptx"]
    return compiled.asm


def _ptx(arch: int, tma: bool, sox: bool = False, factored: bool = False, **consts) -> str:
    return _w4_asm(arch, tma, sox, factored, **consts)["ptx"]


def _w4_asm(arch: int, tma: bool, sox: bool = False, factored: bool = False, num_warps: int = 4, num_stages: int = 4,
            **consts) -> dict:
    args = {a: "i32" for a in ARGS[7:]}
    act = "*bf16" if consts.get("IS_BF16") else "*fp16"
    args.update({"x_ptr": act, "s_ptr": act, "o_ptr": act, "y_ptr": act, "part_ptr": "*fp32", "cnt_ptr": "*i32",
                 "c_ptr": "*u8"})
    c = {**CONSTS, "TMA": tma, "TMA_SOX": sox, "FACTORED": factored, "TILED": tma and factored, **consts}
    bn, half = c["BN"], c["SUB"] // 2
    if tma:
        args["c_ptr"] = f"tensordesc<u8[{bn}, {half}]>"
    if sox:
        e = act[1:]
        args.update({"x_ptr": f"tensordesc<{e}[{c['BM']}, {half}]>",
                     "s_ptr": f"tensordesc<{e}[1, {bn}]>", "o_ptr": f"tensordesc<{e}[1, {bn}]>"})
    return _compiled(triton_w4._w4_kernel, {a: args[a] for a in ARGS}, c, arch, num_warps, num_stages)


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
            "quads_per_split": "i32", "n_quads": "i32", "n_groups": "i32", "quads_per_group": "i32"}
    consts = {"SUB": 128, "BN": 64, "BQ": 4, "ATOMIC": True, "USE_ASM": True, "ACCUM": False, "ORDERED": False,
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
                               "o_ptr": h, "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                               "ticket_ptr": "*i32", "L": "i32",
                               "HQ": "i32", "stride_cols": "i32", "scale": "fp32", "blocks_per_split": "i32"},
         {"G": 8, "HD": 128, "BD": 128, "BR": 16, "BL": 64, "SPLIT": True, "IEEE": False}),
        (f._silu_mul_kernel, {"gu_ptr": h, "out_ptr": h, "I": "i32"}, {"BLOCK": 1024}),
    ]


@pytest.mark.parametrize("arch", [90, 80, 100, 120])
def test_fused_layer_kernels_compile_for_gpu(arch: int) -> None:
    for fn, args, consts in _fused_kernels():
        _ptx_of(fn, args, consts, arch)


def _tuned_configs():
    """Every MMA launch configuration the product can pick (tuned, invariant and pointer-load forms)."""
    from hierviz.quant.triton_w4 import TUNED, TUNED_PLAIN_SMALL_M
    return sorted({c for c in [*TUNED.values(), TUNED_PLAIN_SMALL_M]}, key=str)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("cfg", _tuned_configs(), ids=lambda c: f"bn{c.block_n}bm{c.block_m}w{c.num_warps}s{c.num_stages}"
                         + ("f" if c.factored else "") + ("t" if c.tma else ""))
def test_w4_kernel_leaves_no_register_wgmma_in_flight(arch: int, cfg) -> None:
    """The installed Triton schedules every tuned W4 configuration without an asynchronous wgmma
    whose register weight operand the next iteration rewrites (kernel_guard.async_register_hazards:
    the cause of wrong 8-row groups under Triton 3.6). Both split-K modes, fp16 and bf16."""
    from hierviz.quant.kernel_guard import async_register_hazards
    tma = cfg.tma and arch >= 90
    for bf16 in (False, True):
        for ordered in (False, True):
            asm = _w4_asm(arch, tma, False, cfg.factored, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                          BN=cfg.block_n, BM=cfg.block_m, IS_BF16=bf16, ORDERED=ordered, ATOMIC=False)
            assert async_register_hazards(asm["ttgir"]) == [], (bf16, ordered)


@pytest.mark.parametrize("arch", [100, 120])
def test_blackwell_compiles_every_kernel_it_runs(arch: int) -> None:
    """On Blackwell (B200: sm_100; RTX PRO 6000: sm_120), unproven, the W4 product runs the
    pointer-load kernel in every tuned configuration (both split-K modes, fp16: W4 models run in
    fp16; the residual-adding form): all compile for it (the fused layer kernels: above)."""
    for cfg in _tuned_configs():
        for ordered in (False, True):
            ptx = _ptx(arch, False, False, cfg.factored, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                       BN=cfg.block_n, BM=cfg.block_m, ORDERED=ordered, ATOMIC=not ordered)
            assert "prmt.b32" in ptx and "cp.async.bulk.tensor" not in ptx
    _ptx(arch, False, False, True, ORDERED=True, ATOMIC=False, ACCUM=True)


def test_hazard_check_flags_the_triton36_chained_dot_loop() -> None:
    """The check against the recorded TTGIR loops of Triton 3.6 on the H200 (tests/data): the
    chained `acc = tl.dot(w, x, acc)` loop (wrong rows on the GPU) is flagged, the factored loop
    (every dot result consumed in the iteration) is not."""
    from pathlib import Path
    from hierviz.quant.kernel_guard import async_register_hazards
    data = Path(__file__).parent / "data"
    flagged = async_register_hazards((data / "ttgir_w4_loop_triton36_chained.txt").read_text())
    assert len(flagged) == 1 and "%acc_144" in flagged[0]
    assert async_register_hazards((data / "ttgir_w4_loop_triton36_factored.txt").read_text()) == []


@pytest.mark.parametrize("arch", [90, 80])
def test_fused_attention_leaves_no_register_wgmma_in_flight(arch: int) -> None:
    from hierviz.quant.kernel_guard import async_register_hazards
    fn, args, consts = next(k for k in _fused_kernels() if k[0].__name__ == "_attention_kernel")
    assert async_register_hazards(_compiled(fn, args, consts, arch)["ttgir"]) == []


@pytest.mark.parametrize("arch", [90, 80])
def test_fused_attention_publishes_its_slices_before_the_ticket(arch: int) -> None:
    """The program that combines a token's slices reads what the others wrote: each writes its
    partial results to L2, waits at a block barrier, then takes its ticket with release / acquire
    order at GPU scope, and the combiner reads the partials from L2."""
    fn, args, consts = next(k for k in _fused_kernels() if k[0].__name__ == "_attention_kernel")
    ptx = _ptx_of(fn, args, consts, arch)
    ticket = ptx.index("atom.global.gpu.acq_rel.add")
    assert "st.global.cg" in ptx[:ticket] and "bar.sync" in ptx[ptx.rindex("st.global.cg", 0, ticket):ticket]
    assert "ld.global.cg" in ptx[ticket:]
