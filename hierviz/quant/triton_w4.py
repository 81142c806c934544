"""W4A16 Triton kernel "triton": y = x @ W.T for the W4 format of hierviz.quant.w4.

Two kernels, picked by M (the number of tokens; see pick_config):
  * M = 1, fp16, groups >= 128: `_w4_gemv_kernel` on CUDA cores (no MMA): one 16-byte code load
    per row and quad of 32 channels, unpacked and multiplied in one inline-PTX block with packed
    fp16 FMAs (see _GEMV_F16); a few percent faster than the MMA kernel at M = 1 on the H200.
  * `_w4_kernel`, the MMA kernel, otherwise, in two ways:
  * small M (<= 16): "GEMV-like". The product is computed transposed, acc[n, m] = W @ x.T, so
    the big weight tile is the MMA's M side (64 rows) and the few tokens are its N side (16,
    the smallest tile). Split-K (4 programs per output tile, whose fp32 partials the last of them
    sums in a fixed order: _store_product) makes 224 x 4 programs for a 28672-row layer.
  * larger M: the same transposed tile with 32..128 tokens per tile, split-K 2 or none.
On Hopper the entries up to M = 64 fetch the code tiles through a TMA descriptor
(`_w4_kernel` with TMA=True): asynchronous copies that Triton's pipeliner multi-buffers, where pointer
loads feeding the unpack were not pipelined (58 vs 66 us at M = 1 on the H200).
The unpack on a GPU is inline PTX, 14 instructions per 8 values: prmt/lop3 put a nibble into
the mantissa of 1024.0 (fp16) or 128.0 (bf16), one packed subtract or FMA removes the bias,
one packed FMA applies scale and offset; no int->float conversions. The Triton interpreter
(TRITON_INTERPRET=1) cannot run inline assembly, so under it the same trick written in plain
Triton ops runs instead; the tests run that one, the GPU benchmark checks both.

Kernel-specific layout, built once per W4Weight and activation dtype, cached on it
(`W4Weight.kernel_state["triton"]`; the W4Weight fields keep their meaning):
  codes  uint8 [N, K/2]: within each block of SUB input channels (SUB = group size, or 128
         for groups larger than 256), byte j holds channel j (low nibble) and channel
         j + SUB/2 (high nibble). Then the low nibbles of a tile multiply one contiguous half
         of x and the high nibbles the other half: no interleaving in registers.
  scales, offsets  [K/G, N] in the activation dtype (transposed: one contiguous row of N per
         group, so a program's per-group loads are coalesced).
Measured figures, what limits them, and the variants that measured slower: docs/kernels.md.
With HIERVIZ_W4_CUDA=on (or target, for a verifier's weights), chosen_config hands fp16 products of
the shapes it takes to the CUDA MMA variant (hierviz.quant.cuda_w4, Config.cuda) where it is proven.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from hierviz.config import options, overrides
from hierviz.quant import kernel_guard
from hierviz.quant.tickets import ticket_buffer
from hierviz.quant.w4 import (INVARIANT_MAX_ROWS, W4Weight, codes_of, codes_released, dequantize, pack_codes,
                              register_kernel, release_codes, unpack_codes)

try:  # import must work on machines without a GPU (and without triton at all)
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False

_CACHE_KEY = "triton"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ---- launch configurations ------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    block_n: int      # weight rows (output features) per program
    block_m: int      # tokens per program (>= 16: tl.dot's smallest tile)
    split_k: int      # programs sharing one output tile along K (atomic adds when > 1)
    num_warps: int
    num_stages: int
    use_asm: bool = True   # inline-PTX unpack; ignored (False) under the interpreter
    tma: bool = False      # codes through a TMA tensor descriptor (async copies the pipeliner
                           # multi-buffers) instead of pointer loads; needs K % 32 == 0
    tma_sox: bool = False  # with tma: scales, offsets and x through descriptors too, so no
                           # load in the K loop waits synchronously (needs N % 8 == 0)
    factored: bool = False # scale and offset applied to each group's dot product instead of to
                           # every weight: the unpack shrinks from 14 to 6 (fp16) / 8 (bf16)
                           # instructions per 8 codes (see _BIASED_F16)
    tiled: bool = False    # with tma: codes stored tile-major, each [block_n x SUB/2] tile of a
                           # program one contiguous run of bytes (a K range is one long stream)
    gemv: bool = False     # the CUDA-core path (_w4_gemv_kernel, fp16 only): no MMA, one token
                           # per program (block_m unused), block_q 32-channel quads of K per row
                           # per iteration; num_stages >= 2: the next iteration's loads first
    block_q: int = 8
    cuda: bool = False     # the CUDA MMA kernel (hierviz.quant.cuda_w4, fp16): block_m = tokens per
                           # block (8 x its token tiles), split_k = its K slices; other fields unused


# Picked by `python -m hierviz kernel-bench --tune` on an H200 (K=8192, N=28672, G=128);
# see docs/kernels.md. Keyed by the largest M each entry serves: the first two are the small-M
# (GEMV-like, split-K) path, the others the tiled path. The M <= 16 entry is tuned for the
# fixed-order split-K (4 ways, 3 stages: 63.8-64.1 us at M = 2..8, 59.1 at 16, vs 67.6-68.5 /
# 62.4 with 8 ways, 4 stages).
# M = 2, 4, 8 tuned separately (`--tune --tune-ms 2,8,16`, fixed-order split-K): the plain-
# unpack 64-row entry (TUNED_PLAIN_SMALL_M below) measured 60.3-60.9 us at M = 2..8 against 64.0-64.7 for
# the factored 128-row one, which stays for M = 9..16 (58.1 vs 62.1 at M = 16). (A tile-major code copy,
# `tiled`, was 1-2 us faster still, but doubles the codes' memory: not a default.)
TUNED_SMS = 132          # multiprocessors of the GPU TUNED was measured on (H200)
TUNED: dict[int, Config] = {
    8: Config(block_n=64, block_m=16, split_k=4, num_warps=4, num_stages=4, tma=True),
    16: Config(block_n=128, block_m=16, split_k=4, num_warps=4, num_stages=3, tma=True, factored=True),
    32: Config(block_n=128, block_m=32, split_k=1, num_warps=8, num_stages=3, tma=True),
    64: Config(block_n=128, block_m=64, split_k=1, num_warps=8, num_stages=4, tma=True),
    # 64 rows, not 128: with 128-row tiles and one K split (pointer loads, 8 warps, 3 stages) the H200
    # returned garbage or NaN for whole row blocks, run to run, on the shipped M's GPTQ weights (g64)
    # in long prefills (800+ rows: M's fp16 drafts for Spec-Bench's summarization prompt
    # were never accepted); 64-row tiles were right in every repeat (tests/test_gpu.py). The likely
    # cause is the in-flight wgmma hazard fixed in _w4_kernel; 64 rows stay, the tiles the sweep proved.
    1 << 30: Config(block_n=128, block_m=64, split_k=1, num_warps=8, num_stages=3),
}


# The plain-unpack small-M entry for where the factored one was not
# shown to win: bf16 activations (factored measured slower: 83.6 vs 64.0 us at M = 1 on the
# up-projection) and groups under 64 (its per-group reduction and correction then happen 2-4x as
# often per weight; the SmolLM2 stack's GGUF groups are 32, measured fast with this entry).
TUNED_PLAIN_SMALL_M = Config(block_n=64, block_m=16, split_k=4, num_warps=4, num_stages=4, tma=True)


# The CUDA-core path's entries (fp16 only), keyed like TUNED by the largest M they serve.
TUNED_GEMV: dict[int, Config] = {
    1: Config(block_n=64, block_m=1, split_k=8, num_warps=4, num_stages=2, gemv=True, block_q=4),
}
GEMV_PROGRAMS_PER_SM = 4   # split K until about this many programs per SM (K is split 8 ways anyway)


def pick_config(m: int, n: int, k: int, group_size: int, sms: int = TUNED_SMS,
                bf16: bool = False, gemv: bool = True) -> Config:
    """The configuration used for an [m, k] x [n, k]^T product (small-M vs tiled path).

    TUNED was measured on a wide layer (N = 28672). A narrow one (o_proj / down_proj, N = 8192,
    or an 8B model's 4096) leaves most of the `sms` multiprocessors idle with the same tiles
    (64 programs at M = 64 on 132 SMs: a 70B tree verification ran its W4 GEMMs at ~3x the
    one-token time), so K is split further until about two programs per SM exist."""
    # The CUDA-core kernel where it measured faster: one token, fp16, groups of 128, N >= 8192
    # (on the 8B's 4096-wide down projection the MMA kernel won: 19.3 vs 22.5 us).
    if gemv and not bf16 and group_size >= 128 and n >= 8192 and k % 32 == 0:
        for bound in sorted(TUNED_GEMV):
            if m <= bound:
                cfg = TUNED_GEMV[bound]
                tiles = -(-n // cfg.block_n) * -(-m // max(cfg.block_m, 1))
                split = max(cfg.split_k, -(-GEMV_PROGRAMS_PER_SM * sms // tiles))
                split = max(1, min(split, k // 32 // cfg.block_q))
                return cfg if split == cfg.split_k else dataclasses.replace(cfg, split_k=split)
    for bound in sorted(TUNED):
        if m <= bound:
            cfg = TUNED[bound]
            break
    if cfg.factored and (bf16 or group_size < 64):
        cfg = TUNED_PLAIN_SMALL_M
    n_kblocks = k // _sub_block(group_size)
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    split = cfg.split_k
    if tiles * split < sms:
        split = -(-2 * sms // tiles)
    split = max(1, min(split, n_kblocks))      # never finer than the number of K blocks
    return cfg if split == cfg.split_k else dataclasses.replace(cfg, split_k=split)


def invariant_config(m: int, n: int, k: int, group_size: int, sms: int = TUNED_SMS,
                     bf16: bool = False) -> Config:
    """pick_config for a product whose rows must round as they do at M = 1: M's own tile shape,
    with the K split and the unpack (plain or factored) of M = 1, which decide the rounding
    (the split sets each partial's K range and the fixed-order sum adds them; tile rows do not
    interact). The CUDA-core path (M = 1 only) is left out: its sums run in another order."""
    one = pick_config(1, n, k, group_size, sms, bf16, gemv=False)
    cfg = pick_config(m, n, k, group_size, sms, bf16, gemv=False)
    return dataclasses.replace(cfg, split_k=one.split_k, factored=one.factored)


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (off CUDA: those of the GPU TUNED was measured on)."""
    if device.type != "cuda":
        return TUNED_SMS
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNTS:
        _SM_COUNTS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNTS[i]


# ---- weight layout --------------------------------------------------------------------------

def _sub_block(group_size: int) -> int:
    """Input channels handled per inner step: one group, or 128 of a larger group."""
    if group_size <= 256:
        return group_size
    if group_size % 128 == 0:
        return 128
    raise ValueError(f"triton W4 kernel: group size {group_size} > 256 must be a multiple of 128")


def supports(w: W4Weight) -> bool:
    g = w.group_size
    return g >= 32 and g % 32 == 0 and (g <= 256 or g % 128 == 0)


def repack_codes(codes: torch.Tensor, sub: int) -> torch.Tensor:
    """[N, K/2] (even/odd nibbles) -> [N, K/2] with channel j and j+sub/2 of each block in one byte."""
    q = unpack_codes(codes)
    n, k = q.shape
    q = q.view(n, k // sub, 2, sub // 2)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


@dataclass
class Packed:
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    sub: int
    scales_nk: Optional[torch.Tensor] = None    # [N, K/G] copies for the CUDA-core path
    offsets_nk: Optional[torch.Tensor] = None


def packed(w: W4Weight, dtype: torch.dtype) -> Packed:
    """The kernel's layout of w for activations of `dtype` (built once, cached on w)."""
    cache = w.kernel_state.setdefault(_CACHE_KEY, {})
    key = (dtype, w.codes.device)
    hit = cache.get(key)
    if hit is None:
        sub = _sub_block(w.group_size)
        codes = cache.get("codes")
        if codes is None or codes.device != w.codes.device:
            codes = cache["codes"] = repack_codes(codes_of(w), sub)
            if w.codes.is_cuda and not codes_released(w):
                # Hold a GPU model's codes once: a 70B target is then 35 GB of codes, not 70
                # (hierviz.memory); source_codes rebuilds the checkpoint's order where needed.
                release_codes(w, source_codes)
        hit = cache[key] = Packed(codes, w.scales.t().to(dtype).contiguous(),
                                  w.offsets.t().to(dtype).contiguous(), sub)
    return hit


def unrepack_codes(codes: torch.Tensor, sub: int) -> torch.Tensor:
    """repack_codes undone: the W4Weight order (even/odd nibbles) of kernel-layout codes."""
    n, half_k = codes.shape
    q = torch.stack([(codes & 0xF).view(n, -1, sub // 2), (codes >> 4).view(n, -1, sub // 2)], dim=2)
    return pack_codes(q.reshape(n, half_k * 2))


def source_codes(w: W4Weight, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w's codes in the W4Weight order (rows of them), rebuilt from the kernel's layout when the
    originals were released."""
    if not codes_released(w):
        return codes_of(w, rows)
    rep = w.kernel_state[_CACHE_KEY]["codes"]
    if rows is not None:
        rep = rep.index_select(0, rows.to(rep.device))
    return unrepack_codes(rep, _sub_block(w.group_size))


def tiled_codes(w: W4Weight, block_n: int) -> torch.Tensor:
    """The repacked codes as [N/block_n * K/SUB * block_n, SUB/2]: tile (i, b) (rows i*block_n..,
    K block b) is rows (i * K/SUB + b) * block_n onwards, so consecutive K blocks of one row
    block are adjacent in memory. N is padded with zero codes to a multiple of block_n."""
    cache = w.kernel_state.setdefault(_CACHE_KEY, {})
    key = ("tiled", block_n, w.codes.device)
    hit = cache.get(key)
    if hit is None:
        sub = _sub_block(w.group_size)
        codes = packed(w, torch.float16).codes
        n, half_k = codes.shape
        n_pad = -(-n // block_n) * block_n
        if n_pad != n:
            codes = torch.cat([codes, codes.new_zeros(n_pad - n, half_k)])
        hit = cache[key] = (codes.view(n_pad // block_n, block_n, half_k // (sub // 2), sub // 2)
                            .permute(0, 2, 1, 3).reshape(-1, sub // 2).contiguous())
    return hit


# ---- the kernel -----------------------------------------------------------------------------

# 4 code bytes (8 values) -> 4 registers of two halves each, dequantized: w = q * s + o.
# prmt places bytes 0/1 (then 2/3) in the two 16-bit halves of a register; lop3 keeps one
# nibble per half and ORs it into the mantissa of 1024.0 (low nibble) or of 1024.0 at 16x
# (high nibble), so the value is 1024 + q or 1024 + 16q with no int->float conversion.
_ASM_F16 = """
{
.reg .b32 t0, t1, v0, v1, v2, v3, kmag, k16, km64;
mov.b32 kmag, 0x64006400;
mov.b32 k16, 0x2c002c00;
mov.b32 km64, 0xd400d400;
prmt.b32 t0, $4, $4, 0x0100;
prmt.b32 t1, $4, $4, 0x0302;
lop3.b32 v0, t0, 0x000f000f, 0x64006400, 0xea;
lop3.b32 v1, t1, 0x000f000f, 0x64006400, 0xea;
lop3.b32 v2, t0, 0x00f000f0, 0x64006400, 0xea;
lop3.b32 v3, t1, 0x00f000f0, 0x64006400, 0xea;
sub.f16x2 v0, v0, kmag;
sub.f16x2 v1, v1, kmag;
fma.rn.f16x2 v2, v2, k16, km64;
fma.rn.f16x2 v3, v3, k16, km64;
fma.rn.f16x2 $0, v0, $5, $7;
fma.rn.f16x2 $1, v1, $6, $8;
fma.rn.f16x2 $2, v2, $5, $7;
fma.rn.f16x2 $3, v3, $6, $8;
}
"""

# bf16 has 7 mantissa bits: 128.0 (0x4300) takes a nibble in bits 0..3 only, so the high
# nibble is shifted down first.
_ASM_BF16 = """
{
.reg .b32 t0, t1, u0, u1, v0, v1, v2, v3, kone, km128;
mov.b32 kone, 0x3f803f80;
mov.b32 km128, 0xc300c300;
prmt.b32 t0, $4, $4, 0x0100;
prmt.b32 t1, $4, $4, 0x0302;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 v0, t0, 0x000f000f, 0x43004300, 0xea;
lop3.b32 v1, t1, 0x000f000f, 0x43004300, 0xea;
lop3.b32 v2, u0, 0x000f000f, 0x43004300, 0xea;
lop3.b32 v3, u1, 0x000f000f, 0x43004300, 0xea;
fma.rn.bf16x2 v0, v0, kone, km128;
fma.rn.bf16x2 v1, v1, kone, km128;
fma.rn.bf16x2 v2, v2, kone, km128;
fma.rn.bf16x2 v3, v3, kone, km128;
fma.rn.bf16x2 $0, v0, $5, $7;
fma.rn.bf16x2 $1, v1, $6, $8;
fma.rn.bf16x2 $2, v2, $5, $7;
fma.rn.bf16x2 $3, v3, $6, $8;
}
"""

# The factored variant leaves the codes biased: lo = 1024 + q, hi = 1024 + 16 q (fp16), or
# 128 + q for both (bf16). The group's dot products of these with x are corrected after the
# MMA: sum_k (s q_k + o) x_k = s (P_lo - B Sx_lo + (P_hi - B Sx_hi) / HS) + o (Sx_lo + Sx_hi),
# with B the bias and HS the high nibble's factor (16 or 1). fp32 accumulation keeps the
# cancellation harmless (the biased products are exact in fp16/bf16 x fp32-accumulated MMA).
_BIASED_F16 = """
{
.reg .b32 t0, t1;
prmt.b32 t0, $4, $4, 0x0100;
prmt.b32 t1, $4, $4, 0x0302;
lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea;
lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea;
lop3.b32 $2, t0, 0x00f000f0, 0x64006400, 0xea;
lop3.b32 $3, t1, 0x00f000f0, 0x64006400, 0xea;
}
"""

_BIASED_BF16 = """
{
.reg .b32 t0, t1, u0, u1;
prmt.b32 t0, $4, $4, 0x0100;
prmt.b32 t1, $4, $4, 0x0302;
shr.b32 u0, t0, 4;
shr.b32 u1, t1, 4;
lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $1, t1, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $2, u0, 0x000f000f, 0x43004300, 0xea;
lop3.b32 $3, u1, 0x000f000f, 0x43004300, 0xea;
}
"""


# ---- the CUDA-core path for one token (Config.gemv) ----------------------------------------
# One row's 16 consecutive code bytes ("quad": 4 int32 words, 32 channels of one SUB block:
# word i holds channels 4w..4w+3 (low nibbles) and SUB/2 + 4w.. (high), w = 4u + i) meet x as
# fp16 pairs: prmt puts bytes (0, 1) and (2, 3) in the two halves of a register, lop3 ORs one
# nibble per half into 1024.0's mantissa, and one packed subtract (low) or FMA (high, 16x)
# leaves q - 8 exactly. Packed FMAs multiply by the matching x pairs; the sums are widened to
# fp32 once per quad (16 products per half in fp16: |q - 8| <= 8) and scaled:
# acc += s * sum((q - 8) x) + ox, with W = s (q - 8) + o' (o' = o + 8 s) and ox this quad's
# share of o' * sum(x) over the iteration (computed once per iteration, not per row).
# Everything per quad is one elementwise op, so Triton keeps one layout for all of it (with
# the arithmetic split into several ops, Triton 3.6 gave the accumulators another layout and
# re-loaded x for every row a thread holds).
_GEMV_F16 = "\n".join(
    ["{", ".reg .b32 t0, t1, v0, v1, v2, v3, kb, k16, km72, a;", ".reg .f16 h0, h1;",
     ".reg .f32 f0, f1, p;", "mov.b32 kb, 0x64086408;", "mov.b32 k16, 0x2c002c00;",
     "mov.b32 km72, 0xd480d480;", "mov.b32 a, 0;"]
    # operands: $0 new acc; $1 acc, $2 s, $3 ox (fp32); $4..$7 code words; $8..$15 the x
    # pairs of the low nibbles, $16..$23 of the high ones
    + [line for i in range(4) for line in (
        f"prmt.b32 t0, ${4 + i}, ${4 + i}, 0x0100;", f"prmt.b32 t1, ${4 + i}, ${4 + i}, 0x0302;",
        "lop3.b32 v0, t0, 0x000f000f, 0x64006400, 0xea;",
        "lop3.b32 v1, t1, 0x000f000f, 0x64006400, 0xea;",
        "lop3.b32 v2, t0, 0x00f000f0, 0x64006400, 0xea;",
        "lop3.b32 v3, t1, 0x00f000f0, 0x64006400, 0xea;",
        "sub.f16x2 v0, v0, kb;", "sub.f16x2 v1, v1, kb;",
        "fma.rn.f16x2 v2, v2, k16, km72;", "fma.rn.f16x2 v3, v3, k16, km72;",
        f"fma.rn.f16x2 a, v0, ${8 + 2 * i}, a;", f"fma.rn.f16x2 a, v1, ${9 + 2 * i}, a;",
        f"fma.rn.f16x2 a, v2, ${16 + 2 * i}, a;", f"fma.rn.f16x2 a, v3, ${17 + 2 * i}, a;")]
    + ["mov.b32 {h0, h1}, a;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;", "add.f32 p, f0, f1;",
       "fma.rn.f32 p, $2, p, $1;", "add.f32 $0, p, $3;", "}"])
_GEMV_F16_CONSTRAINTS = ",".join(["=f", "f", "f", "f"] + ["r"] * 20)


if HAVE_TRITON:

    @triton.jit
    def _biased(codes, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
        """uint8 [BN, H] codes -> (B + q_lo, B + HS q_hi) exactly, in the activation dtype."""
        dt = tl.bfloat16 if IS_BF16 else tl.float16
        if USE_ASM:
            if IS_BF16:
                lo, hi = tl.inline_asm_elementwise(_BIASED_BF16_C, "=r,=r,=r,=r,r", [codes],
                                                   dtype=(dt, dt), is_pure=True, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(_BIASED_F16_C, "=r,=r,=r,=r,r", [codes],
                                                   dtype=(dt, dt), is_pure=True, pack=4)
        elif IS_BF16:
            lo = ((codes & 0xF).to(tl.float32) + 128.0).to(dt)
            hi = ((codes >> 4).to(tl.float32) + 128.0).to(dt)
        else:
            lo = ((codes & 0xF).to(tl.int16) | 0x6400).to(dt, bitcast=True)
            hi = ((codes & 0xF0).to(tl.int16) | 0x6400).to(dt, bitcast=True)
        return lo, hi

    @triton.jit
    def _dequant(codes, s, o, IS_BF16: tl.constexpr, USE_ASM: tl.constexpr):
        """uint8 [BN, H] codes, s/o [BN] -> (W of the low nibbles, W of the high nibbles)."""
        dt = tl.bfloat16 if IS_BF16 else tl.float16
        if USE_ASM:
            sb = tl.broadcast_to(s[:, None], codes.shape)
            ob = tl.broadcast_to(o[:, None], codes.shape)
            if IS_BF16:
                lo, hi = tl.inline_asm_elementwise(_ASM_BF16_C, "=r,=r,=r,=r,r,r,r,r,r",
                                                   [codes, sb, ob], dtype=(dt, dt),
                                                   is_pure=True, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(_ASM_F16_C, "=r,=r,=r,=r,r,r,r,r,r",
                                                   [codes, sb, ob], dtype=(dt, dt),
                                                   is_pure=True, pack=4)
        else:
            if IS_BF16:
                # Plain conversions: the interpreter cannot bitcast to bf16 (numpy has none).
                ql = (codes & 0xF).to(tl.float32).to(dt)
                qh = (codes >> 4).to(tl.float32).to(dt)
            else:
                # The magic-number trick in plain ops: 0x6400 | q is the fp16 of 1024 + q.
                ql = ((codes & 0xF).to(tl.int16) | 0x6400).to(dt, bitcast=True) - 1024.0
                qh = ((codes >> 4).to(tl.int16) | 0x6400).to(dt, bitcast=True) - 1024.0
            lo = ql * s[:, None] + o[:, None]
            hi = qh * s[:, None] + o[:, None]
        return lo.to(dt), hi.to(dt)

    @triton.jit
    def _store_product(acc, y_ptrs, part_ptrs, part_stride, cnt_ptr, mask,
                       ATOMIC: tl.constexpr, ACCUM: tl.constexpr, ORDERED: tl.constexpr, CHUNK: tl.constexpr):
        """Writes a program's fp32 product tile (any shape; y_ptrs / part_ptrs / mask alike) to y.
        ATOMIC: split-K by atomic adds into y (zeroed, or the caller's residual): the order of the
        adds varies from run to run, so fp16 results are not bitwise repeatable.
        ORDERED: split-K in a fixed order: each K range (program_id 1) stores its tile into its
        slice of the fp32 partials ([split, ...], part_stride apart) and takes a ticket from the
        tile's counter; the last to arrive sums the slices in split order, adds y's old value
        under ACCUM, stores y and resets the counter (so the buffer needs no zeroing between calls
        or graph replays). The sum reads CHUNK slices per step, unrolled, so that their loads are in
        flight together (one at a time cost ~1 us per split on an H200; all at once raised the
        kernel's register count and slowed its main loop). Otherwise (one K range): y = acc, or y += acc under ACCUM."""
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask, sem="relaxed")
        elif ORDERED:
            split = tl.num_programs(1)
            tl.store(part_ptrs + tl.program_id(1).to(tl.int64) * part_stride, acc, mask=mask)
            # Every thread's partial store happens before the ticket (a CTA barrier, then the
            # ticket's release at GPU scope); the last program's reads come after its acquire.
            tl.debug_barrier()
            tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if ticket == split - 1:
                total = tl.zeros_like(acc)
                for c in range(0, split, CHUNK):       # CHUNK loads in flight at a time
                    for j in tl.static_range(CHUNK):    # past the last slice: read it again, add 0
                        part = tl.load(part_ptrs + tl.minimum(c + j, split - 1) * part_stride, mask=mask,
                                       other=0.0, cache_modifier=".cg")
                        total += tl.where(c + j < split, part, 0.0)
                if ACCUM:
                    total += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)
        else:
            if ACCUM:
                acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, acc.to(y_ptrs.dtype.element_ty), mask=mask)

    @triton.jit
    def _w4_kernel(x_ptr, c_ptr, s_ptr, o_ptr, y_ptr, part_ptr, cnt_ptr,
                   M, N, K, stride_xm, stride_ym, blocks_per_split, n_blocks, blocks_per_group,
                   SUB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                   ATOMIC: tl.constexpr, USE_ASM: tl.constexpr, IS_BF16: tl.constexpr,
                   TMA: tl.constexpr = False, TMA_SOX: tl.constexpr = False,
                   FACTORED: tl.constexpr = False, TILED: tl.constexpr = False, ACCUM: tl.constexpr = False,
                   ORDERED: tl.constexpr = False, CHUNK: tl.constexpr = 4):
        # acc[n, m] = sum_k W[n, k] x[m, k] for a BN x BM tile, over this program's K range.
        # ACCUM: y += acc, y holding the caller's residual (atomic adds always add). How split-K
        # ranges meet (ATOMIC / ORDERED, part_ptr [split, M, N] fp32, cnt_ptr): _store_product.
        # TMA: c_ptr is a tensor descriptor of the codes; each tile arrives by an asynchronous
        # copy (rows past N as zeros) that Triton's pipeliner can keep num_stages deep, where
        # pointer loads feeding the unpack are not pipelined (docs/kernels.md).
        # TMA_SOX: s_ptr, o_ptr ([K/G, N]) and x_ptr ([M, K]) are descriptors as well; then
        # every load of an iteration is an asynchronous copy and none stalls the loop.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        HALF: tl.constexpr = SUB // 2
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        rh = tl.arange(0, HALF)
        n_mask = rn < N
        m_mask = rm < M
        rn_safe = tl.where(n_mask, rn, 0)  # keeps loads unmasked along n (ragged last block)
        if not TMA:
            c_ptrs = c_ptr + rn_safe[:, None].to(tl.int64) * (K // 2) + rh[None, :]
        if not TMA_SOX:
            x_ptrs = x_ptr + rm[None, :] * stride_xm + rh[:, None]
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, n_blocks)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for b in range(b_start, b_end):
            if TILED:
                codes = c_ptr.load([(pid_n * n_blocks + b) * BN, 0])
            elif TMA:
                codes = c_ptr.load([pid_n * BN, b * HALF])
            else:
                codes = tl.load(c_ptrs + b * HALF)
            g = b // blocks_per_group     # 1 (specialized away) for groups up to 256
            if TMA_SOX:
                s = s_ptr.load([g, pid_n * BN]).reshape(BN)
                o = o_ptr.load([g, pid_n * BN]).reshape(BN)
                xl = tl.trans(x_ptr.load([pid_m * BM, b * SUB]))
                xh = tl.trans(x_ptr.load([pid_m * BM, b * SUB + HALF]))
            else:
                s = tl.load(s_ptr + g * N + rn_safe)
                o = tl.load(o_ptr + g * N + rn_safe)
                xl = tl.load(x_ptrs + b * SUB, mask=m_mask[None, :], other=0.0)
                xh = tl.load(x_ptrs + b * SUB + HALF, mask=m_mask[None, :], other=0.0)
            if FACTORED:
                BIAS: tl.constexpr = 128.0 if IS_BF16 else 1024.0
                INV_HS: tl.constexpr = 1.0 if IS_BF16 else 0.0625
                ql, qh = _biased(codes, IS_BF16, USE_ASM)
                sxl = tl.sum(xl.to(tl.float32), axis=0)
                sxh = tl.sum(xh.to(tl.float32), axis=0)
                part = tl.dot(ql, xl) - BIAS * sxl[None, :]
                part += (tl.dot(qh, xh) - BIAS * sxh[None, :]) * INV_HS
                acc += s.to(tl.float32)[:, None] * part + o.to(tl.float32)[:, None] * (sxl + sxh)[None, :]
            else:
                # The block's two products are summed into `part` and only then into acc: the
                # add is a use of the MMA result inside the iteration, so the last wgmma of an
                # iteration completes before the next iteration's unpack rewrites the registers it
                # reads its weight operand from. Chained as acc = dot(w, x, acc), Triton 3.6 left
                # that wgmma in flight across the loop's back edge (the PTX ISA makes rewriting its
                # register operand before wgmma.wait_group undefined) and on the H200 rows of
                # 8-row groups came out wrong run to run (docs/kernels.md, "Correctness").
                wl, wh = _dequant(codes, s, o, IS_BF16, USE_ASM)
                part = tl.dot(wl, xl)
                part = tl.dot(wh, xh, part)
                acc += part
        _store_product(acc, y_ptr + rm[None, :] * stride_ym + rn[:, None], part_ptr + rm[None, :] * N + rn[:, None],
                       M * N, cnt_ptr, n_mask[:, None] & m_mask[None, :], ATOMIC, ACCUM, ORDERED, CHUNK)

    @triton.jit
    def _lo16(p):
        return (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _hi16(p):
        return (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _word_ref(c, xl0, xl1, xh0, xh1):
        """One code word against its 4 x pairs in fp32 (the interpreter's path; the GPU's is
        _GEMV_F16): bytes 0/1 meet pairs xl0 (low nibbles) and xh0 (high), bytes 2/3 xl1/xh1."""
        b0 = c & 0xFF
        b1 = (c >> 8) & 0xFF
        b2 = (c >> 16) & 0xFF
        b3 = (c >> 24) & 0xFF
        lo = (((b0 & 0xF) - 8).to(tl.float32) * _lo16(xl0) + ((b1 & 0xF) - 8).to(tl.float32) * _hi16(xl0)
              + ((b2 & 0xF) - 8).to(tl.float32) * _lo16(xl1) + ((b3 & 0xF) - 8).to(tl.float32) * _hi16(xl1))
        hi = (((b0 >> 4) - 8).to(tl.float32) * _lo16(xh0) + ((b1 >> 4) - 8).to(tl.float32) * _hi16(xh0)
              + ((b2 >> 4) - 8).to(tl.float32) * _lo16(xh1) + ((b3 >> 4) - 8).to(tl.float32) * _hi16(xh1))
        return lo + hi

    @triton.jit
    def _x_pair(p, i, mask):
        # Loaded as a 1-D [BQ] vector and only then given the row axis: loading a [1, BQ]
        # tensor let Triton 3.6 repeat the load for every row a thread holds.
        return tl.load(p + i, mask=mask, other=0)[None, :]

    @triton.jit
    def _x_pairs(p, lo, hi, mask):
        """A quad's 16 x pairs ([1, BQ] each): 8 consecutive from lo (low nibbles), 8 from hi."""
        return (_x_pair(p, lo, mask), _x_pair(p, lo + 1, mask), _x_pair(p, lo + 2, mask),
                _x_pair(p, lo + 3, mask), _x_pair(p, lo + 4, mask), _x_pair(p, lo + 5, mask),
                _x_pair(p, lo + 6, mask), _x_pair(p, lo + 7, mask),
                _x_pair(p, hi, mask), _x_pair(p, hi + 1, mask), _x_pair(p, hi + 2, mask),
                _x_pair(p, hi + 3, mask), _x_pair(p, hi + 4, mask), _x_pair(p, hi + 5, mask),
                _x_pair(p, hi + 6, mask), _x_pair(p, hi + 7, mask))

    @triton.jit
    def _gemv_stage(rows, words_q, s_ptr, o_ptr, rn_safe, n_groups, q0, q_end, quads_per_group):
        """The weight loads of one iteration (quads q0.. of every row): code words [BN, 4 BQ],
        and the rows' scale and offset of that group ([BN] each; past q_end: zeros / a valid
        group). One 2-D load with the words contiguous along the last axis, so that Triton lays
        it out as vector loads along K (a 3-D [BN, BQ, 4] load let Triton 3.6 put the threads
        of a warp on 32 different rows). An iteration stays inside one group (BQ divides SUB/32
        and q0 is a multiple of BQ), so scale and offset are one value per row, loaded as 1-D
        vectors: a [BN, BQ] load of them let Triton 3.6 lay the whole quad computation out with
        the threads of a warp on 32 rows."""
        words = tl.load(rows + q0 * 4 + words_q[None, :],
                        mask=(q0 * 4 + words_q < q_end * 4)[None, :], other=0,
                        eviction_policy="evict_first")   # read once: keep L2 for x and the scales
        g = tl.minimum(q0, q_end - 1) // quads_per_group
        return (words, tl.load(s_ptr + rn_safe * n_groups + g), tl.load(o_ptr + rn_safe * n_groups + g))

    @triton.jit
    def _w4_gemv_kernel(x_ptr, c_ptr, s_ptr, o_ptr, y_ptr, part_ptr, cnt_ptr, N, stride_c, stride_xm, stride_ym,
                        quads_per_split, n_quads, n_groups, quads_per_group,
                        SUB: tl.constexpr, BN: tl.constexpr, BQ: tl.constexpr,
                        ATOMIC: tl.constexpr, USE_ASM: tl.constexpr, PREFETCH: tl.constexpr = False,
                        ACCUM: tl.constexpr = False, ORDERED: tl.constexpr = False, CHUNK: tl.constexpr = 4):
        # y[m, n] = sum_k W[n, k] x[m, k] on CUDA cores for token m = program_id(2) and BN
        # rows, over this program's range of quads (32 channels of K each). x_ptr is x as
        # int32 fp16 pairs [M, K/2] (stride_xm in pairs), c_ptr the codes as int32 words
        # [N, K/8] (stride_c = K/8: a multiple of 16 for K % 128 == 0, which lets Triton prove
        # 16-byte alignment and load each row's quad with one vector load), s_ptr / o_ptr
        # [N, K/G].
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        m = tl.program_id(2)
        QPS: tl.constexpr = SUB // 32
        rn = pid_n * BN + tl.arange(0, BN)
        n_mask = rn < N
        rn_safe = tl.where(n_mask, rn, 0)
        rows = c_ptr + rn_safe.to(tl.int64)[:, None] * stride_c
        words_q = tl.arange(0, 4 * BQ)     # the BQ quads' words, consecutive in a row
        xp = x_ptr + m * stride_xm
        pairs = tl.arange(0, 8 * BQ)       # the iteration's x pairs, per nibble half
        q_start = pid_k * quads_per_split
        q_end = tl.minimum(q_start + quads_per_split, n_quads)
        acc = tl.zeros((BN, BQ), dtype=tl.float32)
        if PREFETCH:
            w_next, s_next, o_next = _gemv_stage(rows, words_q, s_ptr, o_ptr, rn_safe, n_groups,
                                                 q_start, q_end, quads_per_group)
        for q0 in range(q_start, q_end, BQ):
            rq = q0 + tl.arange(0, BQ)
            q_ok = rq < q_end
            if PREFETCH:
                # The next iteration's codes, scales and offsets are requested before this
                # one computes, so a warp's DRAM round trip overlaps its own arithmetic.
                words, s_raw, o_raw = w_next, s_next, o_next
                w_next, s_next, o_next = _gemv_stage(rows, words_q, s_ptr, o_ptr, rn_safe, n_groups,
                                                     q0 + BQ, q_end, quads_per_group)
            else:
                words, s_raw, o_raw = _gemv_stage(rows, words_q, s_ptr, o_ptr, rn_safe, n_groups,
                                                  q0, q_end, quads_per_group)
            ca, cb = tl.split(words.reshape(BN, BQ, 2, 2))
            c0, c2 = tl.split(ca)
            c1, c3 = tl.split(cb)
            lo = (rq // QPS) * (SUB // 2) + (rq % QPS) * 8
            # sum(x) over the iteration's channels, once (a 1-D load and reduction); each of
            # a row's BQ quads adds its 1/BQ share of o' * sum(x). Masked quads read zeros.
            lo0 = (q0 // QPS) * (SUB // 2) + (q0 % QPS) * 8
            x_ok = pairs < (q_end - q0) * 8
            xl = tl.load(xp + lo0 + pairs, mask=x_ok, other=0)
            xh = tl.load(xp + lo0 + SUB // 4 + pairs, mask=x_ok, other=0)
            x_sum = tl.sum(_lo16(xl) + _hi16(xl) + _lo16(xh) + _hi16(xh), axis=0)
            s1 = s_raw.to(tl.float32)
            s = s1[:, None]
            ox = ((o_raw.to(tl.float32) + 8.0 * s1) * (x_sum / BQ))[:, None]
            x = _x_pairs(xp, lo, lo + SUB // 4, q_ok)
            if USE_ASM:
                acc = tl.inline_asm_elementwise(_GEMV_F16_C, _GEMV_F16_CONSTRAINTS_C, [
                    acc, s, ox, c0, c1, c2, c3, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7],
                    x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]],
                    dtype=tl.float32, is_pure=True, pack=1)
            else:
                part = (_word_ref(c0, x[0], x[1], x[8], x[9]) + _word_ref(c1, x[2], x[3], x[10], x[11])
                        + _word_ref(c2, x[4], x[5], x[12], x[13]) + _word_ref(c3, x[6], x[7], x[14], x[15]))
                acc += s * part + ox
        _store_product(tl.sum(acc, axis=1), y_ptr + m * stride_ym + rn, part_ptr + m * N + rn,
                       tl.num_programs(2) * N, cnt_ptr, n_mask, ATOMIC, ACCUM, ORDERED, CHUNK)

    # triton.jit kernels read module-level globals as constexprs only when they are marked so.
    _ASM_F16_C = tl.constexpr(_ASM_F16)
    _ASM_BF16_C = tl.constexpr(_ASM_BF16)
    _BIASED_F16_C = tl.constexpr(_BIASED_F16)
    _BIASED_BF16_C = tl.constexpr(_BIASED_BF16)
    _GEMV_F16_C = tl.constexpr(_GEMV_F16)
    _GEMV_F16_CONSTRAINTS_C = tl.constexpr(_GEMV_F16_CONSTRAINTS)


def _has_tma(device: torch.device) -> bool:
    """TMA (tensor-memory-accelerator) copies exist from Hopper (sm_90) on; the interpreter
    emulates them. Older GPUs (the A100 of the public Space) take the pointer-load kernel (and
    the MMA kernel at M = 1: the CUDA-core one was measured on Hopper only)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor(t: torch.Tensor, block: list[int]):
    """A host-side TMA descriptor of a 2-D tensor; tiles past its edges read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


# Split-K products meet in a fixed order by default (ORDERED, _store_product): bitwise repeatable
# results, as lossless decoding needs (fp16 atomic adds made one prompt's AR output differ between
# runs). HIERVIZ_W4_DETERMINISTIC=0 goes back to atomic adds (docs/kernels.md has both
# measured side by side).

# Partial tiles read per step of the ORDERED sum (H200: 1 and 4 tie at the 70B
# up-projection, 4 is 0.8 us faster at K=1536, N=576; 8 slowed the 70B shape by 26-37 us).
REDUCE_CHUNK = 4

_COUNTERS: dict[torch.device, torch.Tensor] = {}


@contextlib.contextmanager
def split_k_mode(ordered: bool):
    """Products launched (or CUDA-graph captured) inside use ORDERED (True) or ATOMIC split-K."""
    with overrides(w4_deterministic=ordered):
        yield


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One int32 ticket counter per output tile (the last program of a tile resets its own). Kernels
    on one stream run one after another; two streams running ORDERED products at once would share it."""
    return ticket_buffer(_COUNTERS, device, tiles, "the W4 split-K counters")


def _split_k_buffers(m: int, n: int, x: torch.Tensor, split: int, add_to: Optional[torch.Tensor],
                     tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool, bool]:
    """(y, partials, counters, ATOMIC, ACCUM, ORDERED) for a product split `split` ways along K
    over `tiles` output tiles. y is the caller's `add_to` (the residual: the kernel adds into
    it, no separate add) where it can be. ORDERED keeps fp32 partials [split, M, N]. ATOMIC adds
    into a zeroed buffer or add_to; bf16 atomics are not available everywhere (nor in the
    interpreter), so atomic bf16 accumulates in a zeroed fp32 buffer, added afterwards (_result)."""
    deterministic = options().w4_deterministic
    ordered = split > 1 and deterministic
    atomic = split > 1 and not deterministic
    acc_dtype = torch.float32 if atomic and x.dtype == torch.bfloat16 else x.dtype
    if add_to is not None and acc_dtype == x.dtype:
        y, accum = add_to, not atomic
    else:
        y, accum = (torch.zeros if atomic else torch.empty)((m, n), device=x.device, dtype=acc_dtype), False
    if ordered:
        return (y, torch.empty((split, m, n), device=x.device, dtype=torch.float32),
                _tile_counters(x.device, tiles), False, accum, True)
    return y, y, y, atomic, accum, False      # partials / counters unused: any pointer will do


def _result(y: torch.Tensor, x: torch.Tensor, add_to: Optional[torch.Tensor]) -> torch.Tensor:
    """The product from the kernel's buffer, in x's dtype, added into add_to unless the kernel did."""
    if add_to is None:
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if y is not add_to:
        add_to.add_(y.to(x.dtype))
    return add_to


def triton_w4_matmul(x: torch.Tensor, w: W4Weight, config: Optional[Config] = None,
                     add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ W.T for x [M, K] fp16/bf16 on CUDA (or on the CPU under TRITON_INTERPRET=1).
    add_to: a contiguous [M, N] tensor of x's dtype to add the product into, in place (a layer's
    residual); it is returned."""
    if not HAVE_TRITON:
        raise RuntimeError("kernel 'triton' needs the triton package")
    interp = interpreting()
    if x.device.type != "cuda" and not interp:
        raise RuntimeError("kernel 'triton' needs a CUDA device (or TRITON_INTERPRET=1)")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kernel 'triton' takes fp16/bf16 activations, got {x.dtype}")
    if not supports(w):
        raise ValueError(f"kernel 'triton' does not support group size {w.group_size}")
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} input features, weight has {w.in_features}")
    if add_to is not None and (add_to.shape != (m, n) or add_to.dtype != x.dtype or not add_to.is_contiguous()):
        raise ValueError(f"add_to must be a contiguous {(m, n)} {x.dtype} tensor, got {tuple(add_to.shape)} "
                         f"{add_to.dtype}")
    x = x.contiguous()
    if config is not None:            # an explicit configuration runs as given (benchmarks, sweeps)
        return _launch(x, w, config, interp, add_to)[0]
    cfg = chosen_config(x, w)
    if interp or x.device.type != "cuda":
        return _launch(x, w, cfg, interp, add_to)[0]
    safe = _verified(x, w, cfg)
    if safe is None:
        return _reference_product(x, w, add_to)
    return _launch(x, w, safe, interp, add_to)[0]


def chosen_config(x: torch.Tensor, w: W4Weight, hopper_paths: Optional[bool] = None,
                  variants: Optional[frozenset[str]] = None) -> Config:
    """The configuration a product gets on x's device: the tuned one (batch-invariant where the
    weight asks for it), using only the fast variants (kernel_guard.FAST_VARIANTS: TMA loads, the
    CUDA-core one-token kernel) the platform may use (kernel_guard.fast_variants: the static
    list or a start-up proof); without them the same tiles with pointer loads.
    hopper_paths=True / False allows all / none of them anywhere (the sweep's tma and pointer
    paths); variants names the allowed ones exactly (the start-up proof, one at a time)."""
    m, k = x.shape
    n = w.out_features
    if variants is None:
        variants = (kernel_guard.fast_variants(x.device, x.dtype) if hopper_paths is None
                    else frozenset(kernel_guard.FAST_VARIANTS) if hopper_paths else frozenset())
    if kernel_guard.CUDA_VARIANT in variants and x.is_cuda and x.dtype == torch.float16:
        from hierviz.quant import cuda_w4
        if cuda_w4.serves(w) and cuda_w4.supports_shape(n, k, w.group_size):
            tiles = cuda_w4.token_tiles(m)
            return Config(block_n=cuda_w4.ROWS_PER_BLOCK, block_m=8 * tiles,
                          split_k=cuda_w4.split_for(n, k, sm_count(x.device)), num_warps=cuda_w4.WARPS,
                          num_stages=cuda_w4.ahead_chunks(tiles), cuda=True)
    # The one-token CUDA-core kernel was measured on Hopper only; older GPUs (the A100 of the
    # public Space) keep the MMA kernel there. The interpreter (CPU) runs both.
    if w.batch_invariant and m <= INVARIANT_MAX_ROWS:
        cfg = invariant_config(m, n, k, w.group_size, sm_count(x.device), x.dtype == torch.bfloat16)
    else:
        cfg = pick_config(m, n, k, w.group_size, sm_count(x.device), x.dtype == torch.bfloat16,
                          gemv=_has_tma(x.device) and "gemv" in variants)
    if "tma" not in variants:
        cfg = dataclasses.replace(cfg, tma=False, tma_sox=False, tiled=False)
    return cfg


# (device, dtype, N, K, group, config) -> the configuration that passed the first-use checks
# (the chosen one or its pointer-load variant), or None: use the reference product.
_VERIFIED: dict[tuple, Optional[Config]] = {}
_HAZARDS: dict[int, list[str]] = {}     # compiled kernel -> its TTGIR hazards
# a new verdict changes which configurations are chosen: their first-use results start over
kernel_guard.when_verdicts_change(_VERIFIED.clear)


def _verified(x: torch.Tensor, w: W4Weight, cfg: Config) -> Optional[Config]:
    """cfg if its compiled kernel is free of scheduling hazards and its first product agrees with
    the dequantized reference, else the first variant that does (None: none does). Checked once
    per key, eagerly: a product first met inside a CUDA-graph capture runs unchecked (the engine
    warms every shape up eagerly before it captures)."""
    key = (x.device, x.dtype, w.out_features, w.in_features, w.group_size, cfg)
    if key in _VERIFIED:
        return _VERIFIED[key]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return cfg
    candidates = [cfg]
    if cfg.cuda:      # its fallback: the Triton pointer-load kernel of the same product
        plain = chosen_config(x, w, variants=frozenset())
    else:
        plain = dataclasses.replace(cfg, tma=False, tma_sox=False, tiled=False, gemv=False)
    if plain != cfg:
        candidates.append(plain)
    chosen = None
    for cand in candidates:
        y, kernel = _launch(x, w, cand, False, None)
        hazards = _hazards_of(kernel)
        if not hazards and kernel_guard.product_agrees(y, x, w):
            chosen = cand
            break
        warnings.warn(f"W4 kernel config {cand} for a [{w.out_features} x {w.in_features}] g{w.group_size} "
                      f"weight failed its first-use check ({'; '.join(hazards) or 'wrong product'}); trying a "
                      f"safer variant", RuntimeWarning, stacklevel=3)
    if chosen is None:
        warnings.warn(f"no W4 Triton kernel passed its check for a [{w.out_features} x {w.in_features}] "
                      f"g{w.group_size} weight: using the dequantize-and-matmul reference", RuntimeWarning,
                      stacklevel=3)
    _VERIFIED[key] = chosen
    return chosen


def _hazards_of(kernel) -> list[str]:
    """Scheduling hazards in a compiled kernel's TTGIR (cached per compiled kernel)."""
    ident = id(kernel)
    if ident not in _HAZARDS:
        asm = getattr(kernel, "asm", None) or {}
        _HAZARDS[ident] = kernel_guard.async_register_hazards(asm.get("ttgir", ""))
    return _HAZARDS[ident]


def _reference_product(x: torch.Tensor, w: W4Weight, add_to: Optional[torch.Tensor]) -> torch.Tensor:
    y = x @ dequantize(w, x.dtype).t()      # dequantize rebuilds released codes (w4.codes_of)
    return y if add_to is None else add_to.add_(y)


def _launch(x: torch.Tensor, w: W4Weight, cfg: Config, interp: bool,
            add_to: Optional[torch.Tensor]) -> tuple[torch.Tensor, object]:
    """One product with cfg: (y, the compiled kernel Triton launched; None for the CUDA kernel)."""
    m, k = x.shape
    n = w.out_features
    if cfg.cuda:
        from hierviz.quant import cuda_w4
        return cuda_w4.matmul(x, w, add_to, split=cfg.split_k, tiles=cfg.block_m // 8), None
    p = packed(w, x.dtype)
    if cfg.gemv and x.dtype == torch.float16:
        return _gemv(x, p, w.group_size, cfg, interp, add_to)
    n_blocks = k // p.sub
    per = triton.cdiv(n_blocks, cfg.split_k)
    split = triton.cdiv(n_blocks, per)
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, cfg.block_m))
    y, parts, counters, atomic, accum, ordered = _split_k_buffers(m, n, x, split, add_to, grid[0] * grid[2])
    codes, scales, offsets, xa = p.codes, p.scales, p.offsets, x
    tma = cfg.tma and k % 32 == 0 and _has_tma(x.device)
    # Descriptors need 16-byte aligned bases and row strides.
    tma_sox = (tma and cfg.tma_sox and n % 8 == 0 and k % 8 == 0
               and all(t.data_ptr() % 16 == 0 for t in (x, p.scales, p.offsets)))
    tiled = tma and cfg.tiled
    if tiled:
        codes = _descriptor(tiled_codes(w, cfg.block_n), [cfg.block_n, p.sub // 2])
    elif tma:
        codes = _descriptor(p.codes, [cfg.block_n, p.sub // 2])
    if tma_sox:
        scales = _descriptor(p.scales, [1, cfg.block_n])
        offsets = _descriptor(p.offsets, [1, cfg.block_n])
        xa = _descriptor(x, [cfg.block_m, p.sub // 2])
    kernel = _w4_kernel[grid](xa, codes, scales, offsets, y, parts, counters, m, n, k, x.stride(0), y.stride(-2),
                              per, n_blocks, w.group_size // p.sub, SUB=p.sub, BN=cfg.block_n, BM=cfg.block_m,
                              ATOMIC=atomic, USE_ASM=cfg.use_asm and not interp,
                              IS_BF16=x.dtype == torch.bfloat16, TMA=tma, TMA_SOX=tma_sox,
                              FACTORED=cfg.factored, TILED=tiled, ACCUM=accum, ORDERED=ordered,
                              CHUNK=REDUCE_CHUNK, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _result(y, x, add_to), kernel


def _row_major_groups(p: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and offsets as [N, K/G] for the CUDA-core path (built once, kept on p)."""
    if p.scales_nk is None:
        p.scales_nk = p.scales.t().contiguous()
        p.offsets_nk = p.offsets.t().contiguous()
    return p.scales_nk, p.offsets_nk


def _gemv(x: torch.Tensor, p: Packed, group_size: int, cfg: Config, interp: bool,
          add_to: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, object]:
    """The CUDA-core path: one token per program (used at M = 1; any M works)."""
    m, k = x.shape
    n = p.codes.shape[0]
    n_quads = k // 32
    bq = math.gcd(cfg.block_q, p.sub // 32)      # an iteration must not cross a group
    per = triton.cdiv(triton.cdiv(n_quads, cfg.split_k), bq) * bq
    split = triton.cdiv(n_quads, per)
    grid = (triton.cdiv(n, cfg.block_n), split, m)
    y, parts, counters, atomic, accum, ordered = _split_k_buffers(m, n, x, split, add_to, grid[0] * grid[2])
    s_rows, o_rows = _row_major_groups(p)
    kernel = _w4_gemv_kernel[grid](
        x.view(torch.int32), p.codes.view(torch.int32), s_rows, o_rows, y, parts, counters,
        n, k // 8, k // 2, y.stride(-2), per, n_quads, k // group_size, group_size // 32,
        SUB=p.sub, BN=cfg.block_n, BQ=bq, ATOMIC=atomic,
        USE_ASM=cfg.use_asm and not interp, PREFETCH=cfg.num_stages >= 2, ACCUM=accum,
        ORDERED=ordered, CHUNK=REDUCE_CHUNK, num_warps=cfg.num_warps, num_stages=1)
    return _result(y, x, add_to), kernel


triton_w4_matmul.accumulates = True       # takes add_to (w4.w4_linear)

if HAVE_TRITON:
    register_kernel("triton", triton_w4_matmul)
