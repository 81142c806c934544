"""W4A16 Triton kernel "triton": y = x @ W.T for the W4 format of hierviz.quant.w4.

This module picks the launch configuration, lays out the weight, launches and checks first
products; the kernel bodies are in hierviz.quant.triton_w4_kernels.
Two kernels, picked by M (the number of tokens; see pick_config):
  * M = 1, fp16, groups >= 128: `_w4_gemv_kernel` on CUDA cores (no MMA): one 16-byte code load
    per row and quad of 32 channels, unpacked and multiplied in one inline-PTX block with packed
    fp16 FMAs; faster than the MMA kernel at one token on Hopper.
  * `_w4_kernel`, the MMA kernel, otherwise, in two ways:
  * small M (<= 16): "GEMV-like". The product is computed transposed, acc[n, m] = W @ x.T, so
    the big weight tile is the MMA's M side (64 rows) and the few tokens are its N side (16,
    the smallest tile). Split-K (4 programs per output tile, whose fp32 partials the last of them
    sums in a fixed order: _store_product) makes 224 x 4 programs for a 28672-row layer.
  * larger M: the same transposed tile with 32..128 tokens per tile, split-K 2 or none.
On Hopper the entries up to M = 64 fetch the code tiles through a TMA descriptor
(`_w4_kernel` with TMA=True): asynchronous copies that Triton's pipeliner multi-buffers, where it
does not pipeline pointer loads feeding the unpack.

Kernel-specific layout, built once per W4Weight and activation dtype, cached on it
(`W4Weight.kernel_state["triton"]`; the W4Weight fields keep their meaning):
  codes  uint8 [N, K/2]: within each block of SUB input channels (SUB = group size, or 128
         for groups larger than 256), byte j holds channel j (low nibble) and channel
         j + SUB/2 (high nibble). Then the low nibbles of a tile multiply one contiguous half
         of x and the high nibbles the other half: no interleaving in registers.
  scales, offsets  [K/G, N] in the activation dtype (transposed: one contiguous row of N per
         group, so a program's per-group loads are coalesced).
Measured figures, the measurements behind the tuned entries, what limits the kernels and the
variants that measured slower: docs/kernels.md.
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
from hierviz.quant import kernel_guard, w4_verdicts
from hierviz.quant.tickets import multiprocessor_count, ticket_buffer
from hierviz.quant.triton_w4_kernels import HAVE_TRITON, triton
from hierviz.quant.w4 import (INVARIANT_MAX_ROWS, W4Weight, codes_of, codes_released, dequantize, pack_codes,
                              register_kernel, release_codes, unpack_codes)

if HAVE_TRITON:
    from hierviz.quant.triton_w4_kernels import _w4_gemv_kernel, _w4_kernel

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
                           # instructions per 8 codes (triton_w4_kernels._BIASED_F16)
    tiled: bool = False    # with tma: codes stored tile-major, each [block_n x SUB/2] tile of a
                           # program one contiguous run of bytes (a K range is one long stream)
    gemv: bool = False     # the CUDA-core path (_w4_gemv_kernel, fp16 only): no MMA, one token
                           # per program (block_m unused), block_q 32-channel quads of K per row
                           # per iteration; num_stages >= 2: the next iteration's loads first
    block_q: int = 8
    cuda: bool = False     # the CUDA MMA kernel (hierviz.quant.cuda_w4, fp16): block_m = tokens per
                           # block (8 x its token tiles), split_k = its K slices, num_warps = warps per
                           # block; other fields unused
    k_warps: int = 1       # with cuda: warps per 16-row tile (cuda_w4.K_WARP_BUILD)


# Picked by `python -m hierviz kernel-bench --tune` on an H200 (K=8192, N=28672, G=128), keyed by
# the largest M each entry serves: the first two the small-M (GEMV-like, fixed-order split-K) path,
# the others the tiled path. The measurements behind each entry: docs/kernels.md, "The tuned entries".
TUNED_SMS = 132          # multiprocessors of the GPU TUNED was measured on (H200)
TUNED: dict[int, Config] = {
    8: Config(block_n=64, block_m=16, split_k=4, num_warps=4, num_stages=4, tma=True),
    16: Config(block_n=128, block_m=16, split_k=4, num_warps=4, num_stages=3, tma=True, factored=True),
    32: Config(block_n=128, block_m=32, split_k=1, num_warps=8, num_stages=3, tma=True),
    64: Config(block_n=128, block_m=64, split_k=1, num_warps=8, num_stages=4, tma=True),
    # prefills: 64-token tiles, the ones the correctness sweep proved (128-token tiles gave wrong rows)
    1 << 30: Config(block_n=128, block_m=64, split_k=1, num_warps=8, num_stages=3),
}


# The plain-unpack small-M entry where the factored one does not win: bf16 activations, and groups
# under 64 (its per-group reduction and correction then run 2-4x as often per weight).
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
    (64 programs at M = 64 on 132 SMs), so K is split further until about two programs per SM
    exist."""
    # The CUDA-core kernel where it is faster than the MMA kernel: one token, fp16, groups of 128, N >= 8192.
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


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (off CUDA: those of the GPU TUNED was measured on)."""
    return multiprocessor_count(device) if device.type == "cuda" else TUNED_SMS


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


# ---- launch ---------------------------------------------------------------------------------

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


# Split-K products meet in a fixed order by default (ORDERED, triton_w4_kernels._store_product):
# bitwise repeatable results, as lossless decoding needs (with fp16 atomic adds one prompt's AR
# output differs between runs). HIERVIZ_W4_DETERMINISTIC=0 selects atomic adds (docs/kernels.md
# has both measured side by side).

REDUCE_CHUNK = 4     # partial tiles read per step of the ORDERED sum (docs/kernels.md, "The tuned entries")

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
    weight asks for it), using only the fast variants (w4_verdicts.FAST_VARIANTS: TMA loads, the
    CUDA-core one-token kernel, the CUDA MMA one) the platform may use (kernel_guard.fast_variants:
    the static lists or a start-up proof); without them the same tiles with pointer loads.
    hopper_paths=True / False allows all / none of them anywhere (the sweep's tma and pointer
    paths); variants names the allowed ones exactly (the start-up proof, one at a time)."""
    m, k = x.shape
    n = w.out_features
    if variants is None:
        variants = (kernel_guard.fast_variants(x.device, x.dtype) if hopper_paths is None
                    else frozenset(w4_verdicts.FAST_VARIANTS) if hopper_paths else frozenset())
    if w4_verdicts.CUDA_VARIANT in variants and x.is_cuda and x.dtype == torch.float16:
        from hierviz.quant import cuda_w4
        if cuda_w4.serves(w, m) and cuda_w4.supports_shape(n, k, w.group_size):
            tiles, row_tiles, split, k_warps = cuda_w4.plan_for(w, m, sm_count(x.device))
            return Config(block_n=cuda_w4.ROWS_PER_BLOCK, block_m=8 * tiles, split_k=split,
                          num_warps=cuda_w4.WARPS // row_tiles * k_warps,
                          num_stages=cuda_w4.ahead_chunks(tiles, row_tiles, k_warps), cuda=True, k_warps=k_warps)
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
w4_verdicts.when_verdicts_change(_VERIFIED.clear)


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
        return cuda_w4.matmul(x, w, add_to, split=cfg.split_k, tiles=cfg.block_m // 8,
                              row_tiles=cuda_w4.WARPS * cfg.k_warps // cfg.num_warps, k_warps=cfg.k_warps), None
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
