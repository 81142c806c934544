"""`python -m hierviz cost-model`: a cost model of one decoder layer per weight format, built from
the kernels the layer launches, calibrated on profiles measured on one GPU, checked against them,
and applied to other GPUs from their spec sheets. Every figure it gives for a GPU it did not run
on is labelled projected. docs/formats.md describes it in full.

A layer verifying T tokens (a profile curve, hierviz.measure.profile: the fused static path of
hierviz.models.llama replayed from a CUDA graph) is the list of kernels it launches
(`layer_kernels`): the ones every format shares and what each of the four products launches in
its format: FP16 a cuBLAS GEMM (and a residual add); W4A16 one Triton kernel in the regime
pick_config gives it (`w4_regime`), or where a profile records the CUDA MMA variant
(`w4_fp16_kernel`) its one launch (`cuda_mma_kernels`); the 8-bit formats their activation
quantization (torch's kernels, or the fused quantizer where a measurement recorded it), padding,
torch._int_mm / torch._scaled_mm, rescaling and the residual add. Each kernel costs a launch plus
its traffic or its arithmetic:

    stream      launch + bytes / (e_bw BW)                                  elementwise, norms, attention
    gemm        launch + max(bytes (1 + fill stages / steps) / (e_bw BW),   cuBLAS / cuBLASLt products
                             flops / (e_c P))
    w4          launch + bytes (1 + fill stages / steps) / (e_bw BW)        the W4A16 Triton product
                       + flops / (e_c P)
    mma_sync    launch + max(bytes / (e_bw BW), flops / (e_mma I),          the CUDA MMA variant
                             flops / P)

BW: the GPU's memory bandwidth; P: its dense tensor rate for the product's arithmetic; I: one
m16n8k16 MMA issued per multiprocessor and clock (`issue_tflops`). Fitted, shared by every
format: launch (us per kernel), e_bw and e_c (the fraction of bandwidth and tensor rate a kernel
reaches), fill (the K steps of latency a program waits per pipeline stage before its K loop
streams) and, where a curve measured the CUDA MMA variant, e_mma. The model is checked by leaving
one model shape out, one format (a W4 format per kernel) out, and by predicting whole-model
curves from the layer fit.

A method's step on another GPU: the measured stages of `python -m hierviz compat`, each target /
intermediate verification scaled by the model's ratio of that GPU to the measured one at the
rows it verifies (the engine's whole forward; W4 forwards at the faster fp16 W4 kernel); drafting
and bookkeeping are kept as measured.

    python -m hierviz cost-model --profiles P1.json,P2.json --compat C1.json,C2.json --out DIR
"""
from __future__ import annotations

import argparse
import functools
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import numpy as np

from hierviz import methods as registry
from hierviz.measure.common import refuse, stamp, write_report
from hierviz.methods import BASELINE, SUBJECT
from hierviz.quant.formats import DENSE, WeightFormat, format_of_description, format_of_series, get_format
from hierviz.quant.w4_verdicts import CUDA_VARIANT, kernel_that_ran

SCHEMA = "hierviz.cost_model/1"
LABEL = "projected by the roofline cost model"


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_GBps: float           # memory bandwidth, spec sheet
    memory_GB: float
    tflops: dict[str, float]        # dense tensor-core rates by operand type: "f16" (fp32 accumulate), "i8", "f8"
    capability: tuple[int, int]
    sms: int                        # multiprocessors: the W4 kernel picks its tiles by them
    note: str = ""
    # the 8-bit products quantize activations in hierviz's one fused kernel (hierviz.quant.act_quant,
    # on its proven platforms) rather than torch's nine: set from what a measurement recorded
    fused_act_quant: bool = False
    fp32_tflops: float = 0.0        # CUDA-core (non-tensor) FP32 rate, spec sheet: one FMA a lane a clock
    aliases: tuple[str, ...] = ()   # the names torch gives the part (a measurement's "device")
    fp32_lanes: int = 128           # FP32 lanes per multiprocessor (64 on sm_80): with fp32_tflops, the clock

    @property
    def clock_ghz(self) -> float:
        return self.fp32_tflops * 1e3 / (2 * self.sms * self.fp32_lanes)


# Spec-sheet figures, dense (no sparsity), FP16 with FP32 accumulation.
GPUS = {g.name: g for g in (
    GPU("NVIDIA H200", 4800, 141, {"f16": 989.5, "i8": 1979, "f8": 1979}, (9, 0), 132, fp32_tflops=66.9),
    GPU("NVIDIA H100 SXM", 3350, 80, {"f16": 989.5, "i8": 1979, "f8": 1979}, (9, 0), 132, fp32_tflops=66.9,
        aliases=("NVIDIA H100 80GB HBM3",)),
    GPU("NVIDIA A100 80GB SXM", 2039, 80, {"f16": 312, "i8": 624}, (8, 0), 108, "no FP8 tensor cores", fp32_tflops=19.5,
        fp32_lanes=64),
    GPU("NVIDIA GeForce RTX 4090", 1008, 24, {"f16": 165.2, "i8": 660.6, "f8": 330.3}, (8, 9), 128, fp32_tflops=82.6),
    GPU("NVIDIA L4", 300, 24, {"f16": 121, "i8": 242.5, "f8": 242.5}, (8, 9), 58, fp32_tflops=30.3),
    GPU("NVIDIA RTX PRO 6000 Blackwell", 1792, 96, {"f16": 500, "i8": 1000, "f8": 1000}, (12, 0), 188,
        "tensor rates derived from the 4,000 sparse FP4 TOPS of the spec sheet (/8, /4)", fp32_tflops=125.0),
)}


def gpu_named(name: str) -> Optional[GPU]:
    """The model's GPU of a name, its own or the one torch reports; None if it knows none."""
    return GPUS.get(name) or next((g for g in GPUS.values() if name in g.aliases), None)


# An assumption for every cuBLAS / cuBLASLt product: 128 bytes of K a step (64 fp16, 128 int8 / fp8
# channels), 6 stages, K not split, as in the kernel the H200's op profile recorded for the fp16
# LM head (nvjet_sm90_hsh_256x8_64x6: 64-deep K tiles, 6 stages; docs/bench/op-profile-h200-70b.json).
CUBLAS_K_BYTES = 128
CUBLAS_STAGES = 6.0
INT_MM_MIN_ROWS = 17        # hierviz.quant.w8a8.CUDA_MIN_ROWS: torch._int_mm wants more than 16 rows
FP8_ROWS = 128              # hierviz.quant.fp8.CUDA_CHUNK: every FP8 GEMM has this many rows
ATTN_COLUMNS_PER_PROGRAM = 128   # hierviz.models.fused: ATTN_BLOCK_L * ATTN_SPLIT_BLOCKS
VISIBLE_COLUMNS_KERNELS = 7      # hierviz.models.fused.visible_columns: sum, cumsum, sub, where, long, arange, scatter


@dataclass(frozen=True)
class Fit:
    launch_us: float     # per kernel launched (CUDA-graph replay)
    e_bw: float          # fraction of the spec bandwidth a streaming kernel reaches
    e_c: float           # fraction of the spec tensor rate a product reaches
    fill: float = 0.0    # K steps of latency per pipeline stage a program waits before its loop streams
    # the fraction of the issue rate (issue_tflops) the CUDA MMA variant's mma.sync loops reach,
    # dequantizing in the same warps; None where no curve measured that kernel (e_c stands in)
    e_mma: Optional[float] = None


@dataclass(frozen=True)
class Kernel:
    kind: str            # "stream", "gemm", "dequant_mm" (a product that dequantizes in the warps that
                         # multiply) or "mma_sync" (the CUDA MMA variant: its weight reads or its MMA loop, the slower)
    bytes: float
    flops: float = 0.0
    math: str = ""       # the tensor rate of its arithmetic (a GPU.tflops key: f16, f8), or int_mm
    stages: float = 0.0  # gemm, dequant_mm: pipeline stages per K step of a program (the fill it waits for)
    ordered: bool = False  # dequant_mm: split tiles of more than 16 rows meeting in the fixed-order sum


@dataclass(frozen=True)
class Shape:
    """What a forward's kernels depend on besides the format and the row count."""
    cfg: dict[str, Any]
    context: int = 512   # tokens already in the cache
    cache: int = 640     # the cache's slots (the static path attends over all of them)
    group: int = 128     # W4 group size
    w4_kernel: str = "triton"   # the kernel of fp16 W4 products the measurement ran (hierviz.machine.w4_fp16_kernel)
    # the CUDA kernel's entry (token tiles per block, row tiles per warp, K slices, warps per row tile)
    # where a timing chose one (a what-if's w4_kernel_choices: cuda_tiles), else its one-pass entry
    w4_entry: Optional[tuple[int, int, int, int]] = None


@dataclass(frozen=True)
class Curve:
    """One measured curve: a format at a shape on the calibration GPU (one layer or the whole model)."""
    fmt: str
    shape: str
    tokens: list[int]
    us: list[float]
    where: Shape
    weight_bytes: float
    scope: str = "layer"
    layers: int = 1
    terms: list["Terms"] = field(default_factory=list, compare=False)


# ---- the kernels of a forward ------------------------------------------------------------------

def products(cfg: dict[str, Any]) -> list[tuple[str, int, int, bool]]:
    """A layer's fused linears: (name, K, N, whether the residual is added into its output)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_heads"] * cfg["head_dim"]
    kv = cfg["num_kv_heads"] * cfg["head_dim"]
    return [("qkv", h, q + 2 * kv, False), ("o", q, h, True), ("gate_up", h, 2 * i, False), ("down", i, h, True)]


@functools.lru_cache(maxsize=None)
def w4_config(t: int, n: int, k: int, group: int, sms: int, gemv: bool) -> Any:
    """The configuration hierviz.quant.triton_w4.pick_config gives a W4 product of t rows on a GPU
    of `sms` (w4_tiling and w4_regime read it; the fit asks for the same products many times)."""
    from hierviz.quant.triton_w4 import pick_config
    return pick_config(t, n, k, group, sms, gemv=gemv)


def w4_tiling(t: int, n: int, k: int, group: int, sms: int, gemv: bool) -> tuple[int, int, float, int]:
    """(row tiles, rows per tile (0: the one-token CUDA-core kernel), pipeline stages per K step of
    a program, K split) of the W4 Triton product of t rows (w4_config)."""
    c = w4_config(t, n, k, group, sms, gemv)
    if c.gemv:      # a program's K loop: its share of the 32-channel quads, block_q of them a step
        return 1, 0, c.num_stages / (-(-(k // 32) // c.split_k) / c.block_q), c.split_k
    sub = group if group <= 256 else 128        # triton_w4._sub_block: channels a step
    return -(-t // c.block_m), c.block_m, c.num_stages / -(-(k // sub) // c.split_k), c.split_k


W4_REGIMES = ("gemv", "small", "tiled", "tiled_ordered")


def w4_regime(t: int, n: int, k: int, group: int, sms: int, gemv: bool) -> str:
    """Which of the W4 Triton kernel's regimes a product of t rows runs, from the configuration
    hierviz.quant.triton_w4.pick_config gives it: "gemv" (the one-token CUDA-core kernel),
    "small" (the small-M path: 16-token MMA tiles), "tiled" (32-64-token tiles, K not split) or
    "tiled_ordered" (such tiles with K split, meeting in the fixed-order sum)."""
    c = w4_config(t, n, k, group, sms, gemv)
    if c.gemv:
        return "gemv"
    if c.block_m <= SMALL_M_TILE:
        return "small"
    return "tiled_ordered" if c.split_k > 1 else "tiled"


SMALL_M_TILE = 16       # tl.dot's smallest tile: the small-M path's token tile


@functools.lru_cache(maxsize=None)
def gemv_instructions() -> float:
    """Instructions a lane issues per weight in the one-token CUDA-core kernel: its inline-PTX
    block (triton_w4_kernels._GEMV_F16: unpack, packed FMAs, the quad's fp32 scaling) handles one
    row's 32-channel quad; its constants are set once per block and left out."""
    from hierviz.quant.triton_w4_kernels import _GEMV_F16
    body = [ln for ln in _GEMV_F16.splitlines() if ln.endswith(";") and not ln.startswith((".reg", "mov.b32 k"))]
    return len(body) / 32.0


def w4_kernels(fmt: WeightFormat, t: int, k: int, n: int, add: bool, where: Shape, gpu: GPU) -> list[Kernel]:
    if where.w4_kernel == CUDA_VARIANT:
        return cuda_mma_kernels(fmt, t, k, n, add, where, gpu)
    # the one-token CUDA-core kernel and TMA loads run from Hopper on (triton_w4._has_tma)
    hopper = gpu.capability >= (9, 0)
    tiles, rows, stages, split = w4_tiling(t, n, k, where.group, gpu.sms, hopper)
    regime = w4_regime(t, n, k, where.group, gpu.sms, hopper)
    weights = fmt.linear_bytes(n, k, where.group)          # codes, fp16 scales and offsets
    acts = 2.0 * t * k + 2.0 * t * n * (2 if add else 1)
    # split-K meets in a fixed order (triton_w4._store_product): fp32 partials written, then read back
    partials = 8.0 * split * t * n if split > 1 else 0.0
    if regime == "gemv":        # no MMA: its unpack and packed FMAs issue on the CUDA cores, 2 flops a lane-instruction
        return [Kernel("dequant_mm", weights + acts + partials, 2.0 * gemv_instructions() * n * k, "simt", stages)]
    return [Kernel("dequant_mm", tiles * weights + acts + partials, 2.0 * tiles * rows * n * k, "f16", stages,
                   ordered=regime == "tiled_ordered")]


def cuda_mma_kernels(fmt: WeightFormat, t: int, k: int, n: int, add: bool, where: Shape, gpu: GPU) -> list[Kernel]:
    """The CUDA MMA variant (hierviz.quant.cuda_w4), one launch: K in `split_for` slices, each a
    chain of mma.sync over 64-channel chunks, met in a fixed-order fp32 sum by each output tile's
    last block. Up to 40 tokens the direct loop (codes `ahead_chunks` ahead in registers, each lane
    loading its token rows' activations); above, the staged loop, whose blocks copy their tokens'
    activations into shared memory once a stage, in grid chunks of 64 tokens that each read the
    weights again. Its time is the slower of its memory reads (the weights once per grid chunk, the
    activations in and out, the split's fp32 partials; the activations each block reads again come
    from the L2 and L1) and its MMA loop: the padded token tiles' arithmetic at a fitted fraction
    `e_mma` of the issue rate (issue_tflops: the loop issues its dequantization beside its mma.sync,
    so it scales with multiprocessors x clock), never faster than the spec tensor rate. One token's
    8-row tile hides under the weight read, more tiles lengthen the loop. Costed at `where.w4_entry`
    where a timing chose one (fewer token tiles a block: more passes of the grid over the tokens,
    each reading the weights again, fewer padded tokens), else at the one-pass entry at split_for's
    K slices (cuda_w4.plan_for's default)."""
    from hierviz.quant import cuda_w4
    tiles, _, split, _ = where.w4_entry or cuda_w4.one_pass_entry(t, cuda_w4.split_for(n, k, gpu.sms))
    tiles = min(tiles, cuda_w4.token_tiles(t))
    passes = -(-t // (8 * tiles))               # grid passes over the tokens
    weights = fmt.linear_bytes(n, k, where.group)
    acts = 2.0 * t * k + 2.0 * t * n * (2 if add else 1)
    partials = 8.0 * split * t * n if split > 1 else 0.0
    return [Kernel("mma_sync", passes * weights + acts + partials, 2.0 * passes * 8 * tiles * n * k, "f16")]


def gemm_stages(k: int, elem: int) -> float:
    """Pipeline stages per K step of a library GEMM's program (assumed: see CUBLAS_STAGES)."""
    return CUBLAS_STAGES / max(1.0, k * elem / CUBLAS_K_BYTES)


def dense_kernels(t: int, k: int, n: int, add: bool, weight_bytes: Optional[float] = None) -> list[Kernel]:
    """One library GEMM over dense [n, k] weights (fp16 unless `weight_bytes` says)."""
    w = 2.0 * n * k if weight_bytes is None else weight_bytes
    out = [Kernel("gemm", w + 2.0 * t * k + 2.0 * t * n, 2.0 * t * n * k, "f16", gemm_stages(k, 2))]
    return out + ([Kernel("stream", 6.0 * t * n)] if add else [])


def gemm_kernels(fmt: WeightFormat, t: int, k: int, n: int, add: bool, where: Shape, gpu: GPU) -> list[Kernel]:
    return dense_kernels(t, k, n, add, fmt.linear_bytes(n, k, where.group))


def quantize_kernels(t: int, k: int, rounds: bool, fused: bool = False) -> list[Kernel]:
    """Per-token dynamic quantization of [t, k] fp16 activations (w8a8.quantize_tokens,
    fp8.quantize_tokens_fp8): float, abs, amax, / qmax, clamp_min, divide, (round: integer codes),
    clamp, cast; fused (act_quant): one kernel that reads each row twice and writes its codes and scale."""
    tk = t * k
    if fused:
        return [Kernel("stream", 5.0 * tk + 4 * t)]
    ops = [6 * tk, 8 * tk, 4 * tk + 4 * t, 8 * t, 8 * t, 8 * tk + 4 * t] + ([8 * tk] if rounds else [])
    return [Kernel("stream", float(b)) for b in ops + [8 * tk, 5 * tk]]


def int8_kernels(t: int, k: int, n: int, add: bool, fused: bool = False) -> list[Kernel]:
    m = max(t, INT_MM_MIN_ROWS)
    pad = [Kernel("stream", float((m - t) * k)), Kernel("stream", 2.0 * m * k)] if t < m else []
    mm = Kernel("gemm", float(n * k + m * k + 4 * m * n), 2.0 * m * n * k, "int_mm", gemm_stages(k, 1))
    tn = t * n      # int32 -> float, * token scales, * channel scales, -> fp16
    rescale = [Kernel("stream", float(b)) for b in (8 * tn, 8 * tn + 4 * t, 8 * tn + 4 * n, 6 * tn)]
    return quantize_kernels(t, k, True, fused) + pad + [mm] + rescale + ([Kernel("stream", 6.0 * tn)] if add else [])


def fp8_kernels(t: int, k: int, n: int, add: bool, fused: bool = False) -> list[Kernel]:
    m = FP8_ROWS * -(-t // FP8_ROWS)
    pad = [Kernel("stream", float((m - t) * k)), Kernel("stream", 2.0 * m * k)] if t < m else []
    ones = Kernel("stream", 4.0 * FP8_ROWS)
    mm = Kernel("gemm", float(n * k + 4 * n + m * k + 4 * m * n), 2.0 * m * n * k, "f8", gemm_stages(k, 1))
    tn = t * n      # * token scales, -> fp16
    rescale = [Kernel("stream", 8.0 * tn + 4 * t), Kernel("stream", 6.0 * tn)]
    return quantize_kernels(t, k, False, fused) + [ones] + pad + [mm] + rescale + ([Kernel("stream", 6.0 * tn)] if add else [])


# what a format's product launches on a GPU (its entry's `gpu_product`, hierviz.quant.formats):
# (its kernels, the tensor rate of its arithmetic for `tensor_tflops`)
PRODUCTS = {
    "gemm": (gemm_kernels, "f16"),
    "triton_w4": (w4_kernels, "f16"),
    "int_mm": (lambda fmt, t, k, n, add, where, gpu: int8_kernels(t, k, n, add, gpu.fused_act_quant), "int_mm"),
    "scaled_mm": (lambda fmt, t, k, n, add, where, gpu: fp8_kernels(t, k, n, add, gpu.fused_act_quant), "f8"),
}


def product_math(fmt: str) -> str:
    return PRODUCTS[get_format(fmt).gpu_product][1]


def product_kernels(fmt: str, t: int, k: int, n: int, add: bool, where: Shape, gpu: GPU) -> list[Kernel]:
    f = get_format(fmt)
    return PRODUCTS[f.gpu_product][0](f, t, k, n, add, where, gpu)


def attention_kernels(t: int, where: Shape) -> list[Kernel]:
    """The fused attention (hierviz.models.fused.masked_attention), one launch: each token's
    programs read the keys and values it sees (the context and the new tokens up to itself); when
    its columns span more than one program, their partial results are written and read back by
    the last one."""
    cfg = where.cfg
    q, kv = cfg["num_heads"] * cfg["head_dim"], cfg["num_kv_heads"] * cfg["head_dim"]
    seen = t * where.context + t * (t + 1) / 2
    used = -(-(where.context + t) // ATTN_COLUMNS_PER_PROGRAM)
    partials = 2 * 4.0 * used * t * (q + 2 * cfg["num_heads"]) if used > 1 else 0.0
    return [Kernel("stream", 4.0 * seen * kv + 4.0 * t * q + partials)]


def visible_columns_kernels(t: int, where: Shape) -> list[Kernel]:
    # the mask [t, cache] turned into each token's columns: small integer tensors
    return [Kernel("stream", 12.0 * t * where.cache)] * VISIBLE_COLUMNS_KERNELS


def layer_kernels(fmt: str, t: int, where: Shape, gpu: GPU, mask_per_layer: bool = True) -> list[Kernel]:
    """The kernels of one decoder layer on the fused static path (DecoderLayer._forward_fused)."""
    cfg = where.cfg
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    qkv = cfg["num_heads"] * cfg["head_dim"] + 2 * cfg["num_kv_heads"] * cfg["head_dim"]
    norm = Kernel("stream", 4.0 * t * h + 2.0 * h)
    out = [norm]
    (_, k0, n0, a0), (_, k1, n1, a1), (_, k2, n2, a2), (_, k3, n3, a3) = products(cfg)
    out += product_kernels(fmt, t, k0, n0, a0, where, gpu)
    out.append(Kernel("stream", 4.0 * t * qkv))                      # RoPE, k and v into the cache
    out += (visible_columns_kernels(t, where) if mask_per_layer else []) + attention_kernels(t, where)
    out += product_kernels(fmt, t, k1, n1, a1, where, gpu) + [norm]
    out += product_kernels(fmt, t, k2, n2, a2, where, gpu)
    out.append(Kernel("stream", 6.0 * t * i))                        # SiLU(gate) * up
    return out + product_kernels(fmt, t, k3, n3, a3, where, gpu)


def forward_kernels(fmt: str, t: int, where: Shape, gpu: GPU, layers: int = 1, head: bool = False,
                    engine: bool = False) -> list[Kernel]:
    """A forward of `layers` layers (+ the final norm and the dense FP16 LM head). The profile's
    stack (engine=False) copies its input once and turns the mask into columns in every layer; the
    engine (hierviz.models.llama.Transformer.run_layers) does the columns once per forward."""
    h = where.cfg["hidden_size"]
    out = visible_columns_kernels(t, where) if engine else [Kernel("stream", 4.0 * t * h)]
    out += layer_kernels(fmt, t, where, gpu, mask_per_layer=not engine) * layers
    if head:
        v = where.cfg["vocab_size"]
        out += [Kernel("stream", 4.0 * t * h)]      # the final norm: fused.rms_norm on the fused path
        out += dense_kernels(t, h, v, False)
    return out


# ---- their time ------------------------------------------------------------------------------

def issue_tflops(gpu: GPU) -> float:
    """The rate of arithmetic at one m16n8k16 MMA (4,096 flops) issued per multiprocessor and clock:
    the CUDA MMA variant's loop is bound by issuing its instructions (its dequantization beside its
    mma.sync), not by the tensor pipe, so across GPUs it scales with multiprocessors x clock. A GPU
    without an FP32 rate on file gets its tensor rate."""
    return gpu.sms * gpu.clock_ghz * 4096 / 1e3 or gpu.tflops["f16"]


def tensor_tflops(gpu: GPU, math_: str) -> float:
    """The spec tensor rate a product's arithmetic can use. torch._int_mm calls cuBLASLt without
    a workspace, which on Hopper leaves it the sm80-class int8 kernels (pytorch/pytorch#187094
    reports the same on sm_103): an assumption, modelled as the FP16 rate on compute capability 9.0."""
    if math_ == "simt":          # CUDA-core instructions (2 flops a lane-instruction), not tensor cores
        return gpu.fp32_tflops
    if math_ == "int_mm":
        return gpu.tflops["f16"] if gpu.capability == (9, 0) else gpu.tflops["i8"]
    return gpu.tflops[math_]


@dataclass(frozen=True)
class Terms:
    """A kernel list on one GPU reduced to what the fitted numbers act on (times in us at e = 1)."""
    kernels: int
    stream_us: float
    gemm_mem_us: tuple[float, ...]
    gemm_comp_us: tuple[float, ...]
    gemm_fill_us: tuple[float, ...]
    w4_mem_us: float
    w4_fill_us: float
    w4_comp_us: float
    simt_us: float = 0.0            # the one-token CUDA-core kernel's arithmetic at the spec CUDA-core rate
    ordered_comp_us: float = 0.0    # the part of w4_comp_us in split tiles of more than 16 rows (Kernel.ordered)
    mma_mem_us: tuple[float, ...] = ()     # each CUDA MMA product's memory reads
    mma_comp_us: tuple[float, ...] = ()    # its arithmetic at the issue rate (issue_tflops)
    mma_peak_us: tuple[float, ...] = ()    # and at the spec tensor rate, which no loop beats


def terms_of(kernels: list[Kernel], gpu: GPU) -> Terms:
    per_us = gpu.bandwidth_GBps * 1e3          # bytes per us
    gemms = [k for k in kernels if k.kind == "gemm"]
    w4 = [k for k in kernels if k.kind == "dequant_mm"]
    mma, simt, ordered = ([k for k in w4 if k.math != "simt"], [k for k in w4 if k.math == "simt"],
                          [k for k in w4 if k.ordered])

    def comp(ks: list[Kernel]) -> float:
        return sum(k.flops / (tensor_tflops(gpu, k.math) * 1e6) for k in ks)
    sync = [k for k in kernels if k.kind == "mma_sync"]
    return Terms(len(kernels), sum(k.bytes for k in kernels if k.kind == "stream") / per_us,
                 tuple(k.bytes / per_us for k in gemms), tuple(comp([k]) for k in gemms),
                 tuple(k.bytes * k.stages / per_us for k in gemms),
                 sum(k.bytes for k in w4) / per_us, sum(k.bytes * k.stages for k in w4) / per_us, comp(mma),
                 comp(simt), comp(ordered), tuple(k.bytes / per_us for k in sync),
                 tuple(k.flops / (issue_tflops(gpu) * 1e6) for k in sync), tuple(comp([k]) for k in sync))


def body_us(tm: Terms, e_bw: float | np.ndarray, e_c: float | np.ndarray, fill: float | np.ndarray,
            e_mma: float | np.ndarray | None = None) -> float | np.ndarray:
    """Everything but the launches; numpy arrays of parameters give an array (the fit's grid).
    The CUDA-core kernel issues its arithmetic beside its loads at the spec rate (its loads, not
    the tensor cores, set its pace); the Triton MMA kernel dequantizes in the warps that multiply,
    and its split tiles of more than 16 rows spend their arithmetic's time again in the fixed-order
    mode; the CUDA MMA variant takes the slower of its reads and its MMA loop (e_mma of the issue
    rate, e_c if None, never faster than the spec tensor rate)."""
    total = ((tm.stream_us + tm.w4_mem_us + fill * tm.w4_fill_us) / e_bw
             + (tm.w4_comp_us + tm.ordered_comp_us) / e_c + tm.simt_us)
    rate = e_c if e_mma is None else e_mma
    for mem, comp, peak in zip(tm.mma_mem_us, tm.mma_comp_us, tm.mma_peak_us):
        total = total + np.maximum(np.maximum(mem / e_bw, comp / rate), peak)
    for mem, comp, fl in zip(tm.gemm_mem_us, tm.gemm_comp_us, tm.gemm_fill_us):
        total = total + np.maximum((mem + fill * fl) / e_bw, comp / e_c)
    return total


def predict_us(f: Fit, tm: Terms) -> float:
    return float(tm.kernels * f.launch_us + body_us(tm, f.e_bw, f.e_c, f.fill, f.e_mma))


def layer_us(f: Fit, gpu: GPU, fmt: str, where: Shape, t: int) -> float:
    """One layer of the profile's stack (its input copy included): what a profile curve measures."""
    return predict_us(f, terms_of(forward_kernels(fmt, t, where, gpu), gpu))


def model_us(f: Fit, gpu: GPU, fmt: str, where: Shape, t: int) -> float:
    """The engine's whole forward: every layer, the final norm and the LM head."""
    return predict_us(f, terms_of(forward_kernels(fmt, t, where, gpu, where.cfg["num_layers"], True, True), gpu))


# ---- the fit ---------------------------------------------------------------------------------

E_BW = (0.4, 1.0)
E_C = (0.05, 1.0)
FILL = (0.0, 8.0)
E_MMA = (0.05, 1.0)


def _points(curves: list[Curve]) -> list[tuple[Terms, float]]:
    return [(tm, u) for c in curves for tm, u in zip(c.terms, c.us)]


def _grid_best(pts: list[tuple[Terms, float]], axes: list[np.ndarray]) -> tuple[float, Fit]:
    """The grid point of least squared relative error, the launch cost solved in closed form there
    (axes: e_bw, e_c, fill and, where a curve measured the CUDA MMA variant, e_mma)."""
    grid = [x.ravel() for x in np.meshgrid(*axes, indexing="ij")]
    a, b, c = grid[:3]
    d = grid[3] if len(grid) > 3 else None
    u = np.array([p[1] for p in pts])[:, None]
    n = np.array([float(p[0].kernels) for p in pts])[:, None]
    body = np.stack([body_us(tm, a, b, c, d) for tm, _ in pts])
    launch = np.maximum(0.0, (n * (u - body) / u ** 2).sum(0) / (n ** 2 / u ** 2).sum(0))
    err = (((n * launch + body - u) / u) ** 2).sum(0)
    j = int(err.argmin())
    return float(err[j]), Fit(float(launch[j]), float(a[j]), float(b[j]), float(c[j]),
                              None if d is None else float(d[j]))


def _zoom(axis: np.ndarray, best: float, points: int = 9) -> np.ndarray:
    """A finer axis between the best value's neighbours."""
    if len(axis) == 1:
        return axis
    i = int(np.abs(axis - best).argmin())
    return np.linspace(axis[max(i - 1, 0)], axis[min(i + 1, len(axis) - 1)], points)


def fit(curves: list[Curve]) -> Fit:
    """(launch, e_bw, e_c, fill, and e_mma where a curve measured the CUDA MMA variant) minimising
    the squared relative error over the curves: a grid, zoomed in three times (with e_mma, a
    coarser grid zoomed in six times, which keeps the five-axis grids as small as the four-axis
    ones). Every product with a K loop waits the fill, so any format tells it."""
    pts = _points(curves)
    if not any(tm.mma_comp_us for tm, _ in pts):
        axes = [np.linspace(*E_BW, 25), np.geomspace(*E_C, 31), np.linspace(*FILL, 17)]
        zooms, points = 3, 9
    else:
        axes = [np.linspace(*E_BW, 13), np.geomspace(*E_C, 16), np.linspace(*FILL, 9), np.geomspace(*E_MMA, 11)]
        zooms, points = 6, 5
    best = _grid_best(pts, axes)[1]
    for _ in range(zooms):
        axes = [_zoom(axis, at, points) for axis, at in zip(axes, (best.e_bw, best.e_c, best.fill, best.e_mma))]
        best = _grid_best(pts, axes)[1]
    return best


def errors(f: Fit, curves: list[Curve]) -> list[float]:
    return [predict_us(f, tm) / u - 1 for tm, u in _points(curves)]


def summary(errs: list[float]) -> dict[str, float]:
    return {"mean_abs": sum(map(abs, errs)) / len(errs), "max_abs": max(map(abs, errs))}


# ---- the profiles ----------------------------------------------------------------------------

def with_terms(c: Curve, gpu: GPU) -> Curve:
    head = c.scope == "model"
    ks = [forward_kernels(c.fmt, t, c.where, gpu, c.layers, head) for t in c.tokens]
    return Curve(c.fmt, c.shape, c.tokens, c.us, c.where, c.weight_bytes, c.scope, c.layers,
                 [terms_of(k, gpu) for k in ks])


def as_measured(gpu: GPU, quantizer: Optional[str]) -> GPU:
    """gpu with the activation quantizer a measurement recorded ("fused" / "torch"; files that
    record none predate the fused one and ran torch's)."""
    if quantizer not in (None, "fused", "torch"):
        raise ValueError(f"unknown activation_quantizer {quantizer!r} (fused or torch)")
    return replace(gpu, fused_act_quant=quantizer == "fused")


def curve_format(series: dict[str, Any]) -> Optional[str]:
    """The format a profile series measures, where it is the product the model prices (a
    registered format through its GPU kernel: not a comparison kernel such as tinygemm); else None."""
    fmt = format_of_series(series.get("format", ""))
    if fmt is None or (fmt.gpu_kernel and series.get("kernel") != fmt.gpu_kernel):
        return None
    return fmt.name


def curves_of(profile: dict[str, Any], gpu: GPU, scope: str = "layer") -> list[Curve]:
    """The curves of a profile (hierviz.measure.profile's JSON) that the model knows, measured
    (not estimated), of one scope: "layer" (the fit) or "model" (a check)."""
    gpu = as_measured(gpu, profile.get("activation_quantizer"))
    kernel = kernel_that_ran(profile.get("machine"))
    where = Shape(profile["config"], profile["context"], profile["context"] + max(profile["tokens"]),
                  profile.get("group_size", 128), kernel)
    out = []
    for s in profile["series"]:
        if s["scope"] == scope and curve_format(s) and not s.get("estimated"):
            c = Curve(curve_format(s), profile["shape"], list(profile["tokens"]), list(s["us"]), where,
                      s["weight_bytes"] / s["layers"], scope, s["layers"])
            out.append(with_terms(c, gpu))
    return out


def weight_bytes(fmt: str, where: Shape) -> float:
    """One layer's linear weights in the format, as the model reads them at one token."""
    f = get_format(fmt)
    return sum(f.linear_bytes(n, k, where.group) for _, k, n, _ in products(where.cfg))


def kernel_counts(fmt: str, where: Shape, gpu: GPU, tokens: tuple[int, ...] = (1, 16, 17, 128)) -> dict[str, int]:
    return {str(t): len(forward_kernels(fmt, t, where, gpu)) for t in tokens}


def curve_label(c: Curve) -> str:
    """A curve's name in the checks: its format, and for a format with a GPU kernel of its own
    measured through the CUDA MMA variant, that kernel too ("w4a16 (cuda_mma)")."""
    return f"{c.fmt} ({CUDA_VARIANT})" if c.where.w4_kernel == CUDA_VARIANT and get_format(c.fmt).gpu_kernel else c.fmt


def calibrate(profiles: list[dict[str, Any]], gpu: GPU) -> dict[str, Any]:
    """The fit on every layer curve and its checks: each shape left out, each format (a W4 format
    through each of its kernels: curve_label) left out, the whole-model curves predicted from the
    layer fit."""
    quantizers = {p.get("activation_quantizer", "torch") for p in profiles}
    if len(quantizers) != 1:
        raise ValueError(f"the profiles ran different activation quantizers ({', '.join(sorted(quantizers))})")
    gpu = as_measured(gpu, quantizers.pop())
    curves = [c for p in profiles for c in curves_of(p, gpu)]
    models = [c for p in profiles for c in curves_of(p, gpu, "model")]
    copy = sum(p["copy_bandwidth_GBps"] for p in profiles) / len(profiles)
    labels = sorted({curve_label(c) for c in curves})
    shapes = sorted({c.shape for c in curves})
    f = fit(curves)
    shape_out = {}
    for sh in shapes:
        train = [c for c in curves if c.shape != sh]
        g = fit(train) if train else None
        for label in labels:
            test = [c for c in curves if curve_label(c) == label and c.shape == sh]
            if g and test:
                shape_out[f"{label} @ {sh}"] = summary(errors(g, test))
    format_out = {}
    for label in labels:
        train = [c for c in curves if curve_label(c) != label]
        if train:
            format_out[label] = summary(errors(fit(train), [c for c in curves if curve_label(c) == label]))
    per_fmt = {}
    for label in labels:
        mine = {c.shape: c for c in curves if curve_label(c) == label}
        fm = next(iter(mine.values())).fmt
        per_fmt[label] = {"tensor_tflops": tensor_tflops(gpu, product_math(fm)),
                          "kernels": {sh: kernel_counts(fm, c.where, gpu) for sh, c in mine.items()},
                          "fixed_us": {sh: kernel_counts(fm, c.where, gpu, (1,))["1"] * f.launch_us
                                       for sh, c in mine.items()}}
    return {"gpu": gpu.name, "activation_quantizer": "fused" if gpu.fused_act_quant else "torch",
            "copy_bandwidth_GBps": copy, "copy_e_bw": copy / gpu.bandwidth_GBps, "e_bw": f.e_bw,
            "fit": {k: v for k, v in asdict(f).items() if v is not None}, "formats": per_fmt,
            "in_sample": {label: summary(errors(f, [c for c in curves if curve_label(c) == label])) for label in labels},
            "leave_one_shape_out": shape_out, "leave_one_format_out": format_out,
            "whole_model": {f"{curve_label(c)} @ {c.shape}": summary(errors(f, [c])) for c in models},
            "curves": [{"format": curve_label(c), "shape": c.shape} for c in curves]}


# ---- projections -----------------------------------------------------------------------------

def fits_memory(gpu: GPU, weight_bytes: float) -> bool:
    return weight_bytes <= 0.9 * gpu.memory_GB * 1e9


def _skip_reason(gpu: GPU, fm: str, need: float, measured_here: bool) -> Optional[str]:
    f = get_format(fm)
    if f.min_capability and gpu.capability < f.min_capability:
        return f"no {f.hardware}" if f.hardware else f"needs compute capability {'.'.join(map(str, f.min_capability))}"
    if not measured_here and not fits_memory(gpu, need):
        return f"needs ~{need / 1e9:.0f} GB of weights; has {gpu.memory_GB:.0f} GB"
    return None


def projected_w4_kernels(f: Fit, gpu: GPU) -> tuple[str, ...]:
    """The fp16 W4 kernels a projection prices on a GPU: the Triton kernel, and the CUDA MMA variant
    (mma.sync, from sm_80) where the calibration measured it (its e_mma); HIERVIZ_W4_CUDA=auto runs
    whichever is faster, so a forward is priced at the faster of them."""
    cuda = f.e_mma is not None and gpu.capability >= (8, 0)
    return ("triton", CUDA_VARIANT) if cuda else ("triton",)


def project(calibration: dict[str, Any], compat: dict[str, Any], configs: dict[str, dict[str, Any]],
            gpus: list[GPU]) -> dict[str, Any]:
    """Each compat row's methods on each GPU: measured stages on the GPU the rows were measured on
    (the compat file's machine; else the calibration's), verification scaled by the model on the
    others, W4 forwards there at the faster fp16 W4 kernel (projected_w4_kernels)."""
    from hierviz.measure.whatif import model_bytes
    from hierviz.models.config import ModelConfig
    machine = compat.get("machine", {})
    # the compat rows ran with the quantizer they recorded; the other GPUs get torch's (the fused
    # one is on only on its proven platforms, which a spec sheet does not tell)
    base = as_measured(gpu_named(machine.get("gpu", "")) or GPUS[calibration["gpu"]], machine.get("activation_quantizer"))
    f = Fit(**calibration["fit"])
    s = compat["settings"]
    measured_kernel = kernel_that_ran(machine)
    t_shape, m_shape = Shape(configs["target"], w4_kernel=measured_kernel), Shape(configs["intermediate"], w4_kernel=measured_kernel)
    m_fmt = (format_of_description(compat["intermediate"]) or DENSE).name
    rows_of = {BASELINE: 1, compat["head"]: s["t_tree_size"] + 1, SUBJECT: s["min_draft_len"] + 2}
    shapes = {"target": t_shape, "intermediate": m_shape}
    cache: dict[tuple[str, str, str, int], float] = {}

    def ratio(gpu: GPU, fm: str, which: str, t: int) -> float:
        key = (gpu.name, fm, which, t)
        if key not in cache:
            here = min(model_us(f, gpu, fm, replace(shapes[which], w4_kernel=k), t) for k in projected_w4_kernels(f, gpu))
            cache[key] = here / model_us(f, base, fm, shapes[which], t)
        return cache[key]

    out = []
    for r in compat["rows"]:
        if "error" in r:
            continue
        fm = get_format(r["format"]).name        # files may name a format by an alias
        need = (model_bytes(ModelConfig(**_cfg_fields(t_shape.cfg)), fm)
                + model_bytes(ModelConfig(**_cfg_fields(m_shape.cfg)), m_fmt))
        for gpu in gpus:
            entry: dict[str, Any] = {"gpu": gpu.name, "format": fm, "name": r["name"], "projected": gpu.name != base.name}
            if get_format(fm).quantizes_activations:
                entry["activation_quantizer"] = "fused" if gpu.name == base.name and base.fused_act_quant else "torch"
            if r.get("layers_measured", 0) < r.get("layers", 0):
                entry["layers_note"] = f"{r['layers_measured']} of {r['layers']} layers measured, scaled"
            skip = _skip_reason(gpu, fm, need, gpu.name == base.name)   # the compat GPU's rows were measured
            if skip:
                entry["skipped"] = skip
                out.append(entry)
                continue
            tps = {}
            subset = r.get("layers", 1) / r.get("layers_measured", 1)    # a layer subset's target stage, scaled
            for m, st in r["stages_ms_per_token"].items():
                if gpu.name == base.name:      # measured here
                    tps[m] = r["tokens_per_s"][m]
                    continue
                t_rows = r.get("target_rows_per_round", {}).get(m, rows_of.get(m, 1))
                ms = (st.get("target_verify", 0.0) * subset * ratio(gpu, fm, "target", t_rows)
                      + st.get("intermediate_verify", 0.0) * ratio(gpu, m_fmt, "intermediate", s["m_tree_size"] + 1)
                      + st.get("draft", 0.0) + st.get("overhead", 0.0))
                tps[m] = 1000.0 / ms
            entry["tokens_per_s"] = tps
            if BASELINE in tps:
                entry["speedup_vs_ar"] = {m: v / tps[BASELINE] for m, v in tps.items()}
            entry["winner"] = max(tps, key=tps.get)
            out.append(entry)
    return {"shapes": compat["shapes"], "head": compat["head"], "settings": s, "measured_on": base.name, "measured_w4_kernel": measured_kernel,
            "projected_w4_kernels": list(projected_w4_kernels(f, base)), "rows": out}


def _cfg_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    from hierviz.models.config import ModelConfig
    names = set(ModelConfig.__dataclass_fields__)
    return {k: v for k, v in cfg.items() if k in names}


# ---- report ----------------------------------------------------------------------------------

def _pct(s: Optional[dict[str, float]]) -> str:
    return f"{s['mean_abs']:.1%} / {s['max_abs']:.1%}" if s else "–"


def markdown(info: dict[str, Any]) -> str:
    cal = info["calibration"]
    f = cal["fit"]
    shapes = ", ".join(sorted({c["shape"] for c in cal["curves"]}))
    lines = [f"# Cost model, calibrated on {cal['gpu']}", "",
             f"Per kernel launch {f['launch_us']:.2f} us; e_bw {f['e_bw']:.3f} (copy measured: {cal['copy_e_bw']:.3f}); "
             f"e_c {f['e_c']:.3f}; fill {f['fill']:.2f} K steps per pipeline stage"
             + (f"; e_mma {f['e_mma']:.3f} (the CUDA MMA variant's loop, of the issue rate)." if "e_mma" in f else "."), "",
             f"| format | kernels per layer (T = 1 / 128: {shapes}) | each shape left out: mean / max ({shapes}) | "
             "in-sample mean / max | format left out: mean / max |", "|---|---|---|---|---|"]
    for fm, d in cal["formats"].items():
        counts = ", ".join(f"{d['kernels'][sh]['1']} / {d['kernels'][sh]['128']}" for sh in sorted(d["kernels"]))
        so = [_pct(v) for k, v in cal["leave_one_shape_out"].items() if k.startswith(fm + " @")]
        lines.append(f"| {fm} | {counts} | {', '.join(so) or '–'} | {_pct(cal['in_sample'][fm])} | "
                     f"{_pct(cal['leave_one_format_out'].get(fm))} |")
    for k, v in cal.get("whole_model", {}).items():
        lines.append(f"\nWhole model {k}, predicted from the layer fit: {_pct(v)}")
    for proj in info.get("projections", []):
        tree = proj["head"]
        ar, subject = registry.short(BASELINE), registry.label(SUBJECT)
        measured_on = proj.get("measured_on", cal["gpu"])
        kernels = " or ".join(proj.get("projected_w4_kernels", ["triton"]))
        lines += ["", f"## {proj['shapes']['target']} target, {proj['shapes']['intermediate']} intermediate ({LABEL}"
                      f" except the rows measured on the {measured_on}; projected W4 forwards at the faster of {kernels})", "",
                  f"| GPU | format | {ar} tok/s | {tree} / {ar} | {subject} / {ar} | {subject} / {tree} | winner |",
                  "|---|---|---|---|---|---|---|"]
        for e in proj["rows"]:
            if "skipped" in e:
                lines.append(f"| {e['gpu']} | {e['name']} | {e['skipped']} | | | | |")
                continue
            sp, tps = e["speedup_vs_ar"], e["tokens_per_s"]
            lines.append(f"| {e['gpu']}{' (projected)' if e['projected'] else ''} | {e['name']} | {tps[BASELINE]:.1f} | "
                         f"{sp.get(tree, 0):.2f}x | {sp.get(SUBJECT, 0):.2f}x | "
                         f"{tps[SUBJECT] / tps[tree]:.2f}x | {e['winner']} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz cost-model", description=(
        "Fit a per-kernel cost model of a decoder layer in every weight format to measured profiles, check it "
        "(shape and format left out) and project compat tables to other GPUs from their spec sheets."))
    ap.add_argument("--profiles", required=True, help="comma-separated profile.json files of one GPU")
    ap.add_argument("--compat", default="", help="comma-separated compat.json files to project (measured on a GPU "
                                                 "the model knows, the calibration's or another)")
    ap.add_argument("--gpus", default=",".join(GPUS), help="GPUs to project onto (names as in the model's table)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        profiles = [json.loads(Path(p).read_text()) for p in a.profiles.split(",") if p]
        compats = [json.loads(Path(p).read_text()) for p in a.compat.split(",") if p]
        names = {p.get("device") for p in profiles}
        gpu = gpu_named(next(iter(names))) if len(names) == 1 else None
        if gpu is None:
            raise ValueError(f"the profiles must come from one GPU the model knows ({', '.join(GPUS)}); got {names}")
        gpus = [GPUS[g.strip()] for g in a.gpus.split(",") if g.strip()]
    except KeyError as e:
        return refuse(f"unknown GPU {e}; known: {', '.join(GPUS)}")
    except (OSError, ValueError) as e:
        return refuse(str(e))
    cal = calibrate(profiles, gpu)
    info: dict[str, Any] = {"schema": SCHEMA, "label": LABEL, "calibration": cal,
                            "gpus": [asdict(g) for g in gpus], "projections": []}
    for c in compats:
        configs = {"target": c["configs"]["target"], "intermediate": c["configs"]["intermediate"]}
        info["projections"].append(project(cal, c, configs, gpus))
    write_report(Path(a.out), "cost_model", stamp(info, "cost-model", argv), markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
