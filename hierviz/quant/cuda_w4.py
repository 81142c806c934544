"""The CUDA MMA variant of the GPU W4 product: y = x @ W.T for fp16 activations, every M.

One small CUDA C kernel (cuda_w4.cu, beside this module), compiled at first use with NVRTC (the
runtime compiler that ships with torch's CUDA wheels: no nvcc, no build step; the build is kept on
disk by cubin_cache, so later processes load it) and launched through
the CUDA driver API on torch's current stream, so CUDA graphs capture it like any other kernel.
The Triton kernel hands a product here (triton_w4.chosen_config) where the variant `cuda_mma` is
proven (kernel_guard) and `serves` says the weight runs here: with HIERVIZ_W4_CUDA=auto (the
default) the weight kinds hierviz.quant.w4_choice timed at least as fast here at every row count
their models' forwards run, with `on` every W4 weight, with `target` a verifier's. It is faster
than both Triton modes up to 8 rows, than the batch-invariant one up to 24 rows and at most
others on the 70B shapes, and slower than Triton's normal mode from 25-32 rows on the 8B's
(docs/kernels.md).

Why it exists: Triton does not let a kernel choose its register layout, and the W4 product at a
few tokens is bound by how many instructions move codes into the tensor-core operand layout
(docs/kernels.md). Here the codes are stored in the order one thread's `mma.sync.m16n8k16`
fragment needs, as Marlin does: one 16-byte load gives a thread the A fragments of four MMAs, and
dequantizing 8 codes is 13 register operations (lop3 puts nibbles in the mantissa of 1024.0, a
packed subtract or FMA removes the bias exactly, a packed FMA applies scale and offset).

The arithmetic is batch-invariant by construction: a warp multiplies 16 weight rows by 8..64
tokens; each output element is one chain of MMAs over its K slice in a fixed order, and the
K slices (split_for: from N, K and the GPU, never from M) meet in a fixed-order fp32 sum done by
the last block of each output tile. So a row gets the same bits at every M, and the same kernel
serves decode, verification and prefill (tokens beyond 64 run as further token chunks of the
grid). Up to 40 tokens a pass the activations come straight from L1 and the codes and group pairs
are held in registers several chunks ahead (`product_direct`, one or two 16-row tiles per warp:
DIRECT_ROWS_BUILD); from 41 the block's warps share the activations through shared memory
(`product_staged`, the codes read once for up to 64 tokens); all run the same MMAs. Where w4_choice
timed a weight's kind, each row count runs the entry timed fastest (plan_for): a narrow weight may
take 32 tokens as two passes of 16, a wide one 24 tokens with two row tiles per warp. On Hopper the
kernel is built for sm_90a, which adds wgmma entries for the staged tile counts (`product_wgmma`:
each warpgroup's 64 rows times the pass's tokens per MMA step, A from the same dequantized
registers, the same bits); they are slower there than `product_staged`, so they run only when
asked for (WGMMA_BY_DEFAULT, matmul(wgmma=True)).

Layout, built once per weight (kernel_state["cuda_w4"]), replacing the checkpoint-order codes on
the GPU (codes_of rebuilds them):
  codes  int32 [N/16, K/64, 32 lanes, 4 steps]: row tile r (16 rows), K chunk c (64 channels),
         lane (g, t) = (lane >> 2, lane & 3), MMA step j. Within chunk c, lane t owns channels
         c*64 + 16t .. +15 (so its activations are two 16-byte loads) and step j uses four of
         them, 16t + 4j + e (e = 0..3): the MMA's k slots 2t, 2t+1 take e = 0, 1 and slots
         2t+8, 2t+9 take e = 2, 3. The word's nibbles (bit 4p, p = 0..7) hold rows g / g+8 as
         NIBBLE_OF[h][e] (h = 0: row g, 1: row g+8). Stored tile by tile: a tile's chunks
         are 512 bytes apart, so the one-token loop's code addresses are constant offsets from one
         pointer (a plain read in the kernel's grid and order runs at the copy bandwidth).
  so     int32 [N/16, K/G, 8, 2]: half2 (scale, offset) of rows r*16 + g and r*16 + g + 8.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz.config import options
from hierviz.quant.tickets import multiprocessor_count, ticket_buffer
from hierviz.quant.w4 import W4Weight, codes_of, codes_released, pack_codes, release_codes, unpack_codes
from hierviz.quant import cubin_cache, w4_verdicts

_CACHE_KEY = "cuda_w4"
WARPS = 8                  # row tiles per block (a warp each, or two a warp): 128 weight rows share its K slice
ROWS_PER_BLOCK = 16 * WARPS
NBUF = 2                   # x stages the staged loop keeps in shared memory (NBUF - 1 in flight)
# The entries, by token tiles per block, measured best per entry on the H200 and H100 (docs/kernels.md;
# every choice gives a row the same bits). Direct (up to 40 tokens): (K chunks of codes and group
# pairs held in registers ahead; blocks per multiprocessor it is built for). Staged: (K chunks per
# x stage, which is also the code ring's depth; blocks per multiprocessor).
DIRECT_BUILD = {1: (4, 2), 2: (4, 2), 3: (4, 2), 4: (4, 2), 5: (2, 2)}
# Direct entries whose warps each multiply several 16-row tiles, so that each activation load
# serves that many MMAs (8 / row tiles warps a block: the same 128 rows, grid and K split, so the
# same bits): (token tiles, row tiles per warp) -> (chunks ahead, blocks per multiprocessor). They
# are candidates that w4_choice times per kind and row count (docs/kernels.md, "Row tiles per warp").
DIRECT_ROWS_BUILD: dict[tuple[int, int], tuple[int, int]] = {(2, 2): (2, 4), (3, 2): (2, 4), (4, 2): (4, 2),
                                                              (5, 2): (4, 2)}
# (token tiles, row tiles per warp) of the direct entries that load each chunk's activations one
# chunk ahead: those measured no slower so on any kind of the what-if (docs/kernels.md,
# "Activations a chunk ahead"); the same MMAs in the same order, so the same bits.
X_AHEAD_ENTRIES = frozenset({(3, 1), (4, 2), (5, 1)})
PAIR_GROUPS = (64, 128)    # group sizes with direct entries that address group pairs by offset
# Direct entries of two warps per row tile, each multiplying half of the K slice's chunks, their sums
# met in shared memory: twice the warps in flight with the same K slices, for the narrow products
# that cannot fill a multiprocessor (docs/kernels.md, "Warps per row tile"). They sum in another
# order than one warp per row tile, so only kinds that are not batch-invariant (an intermediate's)
# time them: (token tiles, row tiles per warp, warps per row tile) -> (chunks ahead, blocks per
# multiprocessor).
K_WARP_BUILD: dict[tuple[int, int, int], tuple[int, int]] = {(1, 1, 2): (4, 1), (2, 1, 2): (4, 1), (3, 1, 2): (4, 1),
                                                              (2, 2, 2): (2, 2), (4, 2, 2): (4, 1)}
STAGED_BUILD = {6: (2, 2), 7: (2, 2), 8: (2, 2)}
# The wgmma staged entries (sm_90a), by token tiles: (K chunks per x stage, asynchronous-copy slots
# of the activations ahead of the two stages in the wgmma layout (0: one stage through registers),
# blocks per multiprocessor). The same bits as the staged loop, slower than it on the H100
# (docs/kernels.md, "The wgmma staged loop"): they take its products only with WGMMA_BY_DEFAULT or
# matmul(wgmma=True).
WGMMA_BUILD = {6: (2, 0, 2), 7: (2, 0, 2), 8: (2, 0, 2)}
WGMMA_BY_DEFAULT = False
WGMMA_ARCHS = ("sm_90a",)  # wgmma needs the arch-specific Hopper target
MAX_TOKEN_TILES = 8        # 8-token MMA tiles per warp: 64 tokens per block, more as grid chunks
WAVE_BLOCKS_PER_SM = 2     # the direct entries' occupancy: K is split to fill one wave of them ...
MIN_CHUNKS_PER_SLICE = 12  # ... but keeps at least this many 64-channel chunks per slice (docs/kernels.md),
SLICE_ROUND = 4            # in whole rounds of the direct entries' look-ahead (and whole 128-groups)

# the nibble (bit 4p) that holds row g + 8h, channel 16t + 4j + e of a lane's word
NIBBLE_OF = ((0, 4, 2, 6), (1, 5, 3, 7))

KERNEL_FILE = Path(__file__).with_name("cuda_w4.cu")   # the CUDA C, read when the kernel is built


def kernel_text(cu: Optional[str] = None) -> str:
    """cuda_w4.cu (or `cu`, another text of it) with the constants it takes from here defined
    before it; `#line` keeps NVRTC's messages on the file's own line numbers."""
    return (f"#define NBUF {NBUF}\n#define ROWS_PER_BLOCK {ROWS_PER_BLOCK}\n"
            f"#line 1 \"{KERNEL_FILE.name}\"\n" + (KERNEL_FILE.read_text() if cu is None else cu))


def has_group_entry(ahead: int, group: int) -> bool:
    """Whether a direct build `ahead` chunks deep has an entry for `group`-channel groups: one of
    PAIR_GROUPS, its look-ahead whole groups."""
    return group in PAIR_GROUPS and ahead % (group // 64) == 0


def has_wgmma(arch: Optional[str]) -> bool:
    """Whether builds for `arch` carry the wgmma staged entries (WGMMA_BUILD)."""
    return arch in WGMMA_ARCHS


def direct_entries(direct_build: Optional[dict] = None, rows_build: Optional[dict] = None) -> dict[tuple[int, int], tuple[int, int]]:
    """Every direct entry of a build (defaults: the shipped ones), by (token tiles, row tiles per
    warp): (chunks ahead, blocks per multiprocessor)."""
    direct_build = DIRECT_BUILD if direct_build is None else direct_build
    rows_build = DIRECT_ROWS_BUILD if rows_build is None else rows_build
    return {**{(t, 1): v for t, v in direct_build.items()}, **rows_build}


def kernel_source(direct_build: dict = DIRECT_BUILD, staged_build: dict = STAGED_BUILD,
                  arch: Optional[str] = None, wgmma_build: Optional[dict] = None,
                  rows_build: Optional[dict] = None, x_ahead: frozenset = X_AHEAD_ENTRIES,
                  kw_build: Optional[dict] = None) -> str:
    """The CUDA source with one entry per build (the defaults: the shipped entries), the wgmma
    entries only for an arch that has them; x_ahead: the direct entries, by (token tiles, row tiles
    per warp), that load activations a chunk ahead; kw_build: the entries of several warps per row tile
    (default K_WARP_BUILD)."""
    wgmma_build = WGMMA_BUILD if wgmma_build is None else wgmma_build
    kw_build = K_WARP_BUILD if kw_build is None else kw_build
    # (token tiles, row tiles per warp, warps per row tile, chunks ahead, blocks per multiprocessor)
    direct = [(t, r, 1, a, b) for (t, r), (a, b) in direct_entries(direct_build, rows_build).items()]
    kw = [(t, r, k_warps, a, b) for (t, r, k_warps), (a, b) in kw_build.items()]

    def entry(t: int, r: int, kw: int, a: int, b: int, g: int = 0) -> str:
        xa = int((t, r) in x_ahead)
        kind = "DIRECT" + ("_KW" if kw > 1 else "_ROWS" if r > 1 else "") + ("_GROUP" if g else "")
        shape = f", {r}, {kw}" if kw > 1 else f", {r}" if r > 1 else ""
        return f"{kind}_ENTRY({t}, {a}, {b}{shape}{f', {g}' if g else ''}, {xa})\n"
    return (kernel_text() + "".join(entry(*e) for e in direct)
            + "".join(entry(*e, g) for e in direct for g in PAIR_GROUPS if has_group_entry(e[3], g))
            + "".join(entry(*e, g) for e in kw for g in (0, *PAIR_GROUPS) if g == 0 or has_group_entry(e[3], g))
            + "".join(f"STAGED_ENTRY({t}, {s}, {b})\n" for t, (s, b) in staged_build.items())
            + ("".join(f"WGMMA_ENTRY({t}, {s}, {r}, {b})\n" for t, (s, r, b) in wgmma_build.items())
               if has_wgmma(arch) else ""))


def wgmma_shared_bytes(tiles: int, wgmma_build: Optional[dict] = None) -> int:
    """Dynamic shared memory of the wgmma entry of `tiles` token tiles: its two x stages, each S
    chunks x 4 steps x `tiles` 8-token blocks x two 128-byte core matrices, then its copy slots,
    each 64 bytes for every thread and every 256 of a stage's (token, chunk, half-chunk) pieces."""
    s, ring, _ = (WGMMA_BUILD if wgmma_build is None else wgmma_build)[tiles]
    return 2 * s * 4 * tiles * 256 + ring * -(-16 * tiles * s // 256) * 256 * 64


# ---- which products it serves ----------------------------------------------------------------

def group_shift(k: int, group_size: int) -> Optional[int]:
    """log2 of the group size (31 for one group over all of K: per-channel), or None when the
    kernel cannot index the groups (not a power of two >= 32, and not per-channel)."""
    if group_size == k:
        return 31
    if group_size >= 32 and group_size & (group_size - 1) == 0:
        return group_size.bit_length() - 1
    return None


def supports_shape(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel multiplies: N in 16-row tiles, K in 64-channel chunks, power-of-two
    groups of at least 32 channels or one group per row."""
    return n % 16 == 0 and k % 64 == 0 and k > 0 and group_shift(k, group_size) is not None


def split_for(n: int, k: int, sms: int) -> int:
    """K slices of an N x K product: as many as fill one wave of blocks at the direct entries'
    occupancy (WAVE_BLOCKS_PER_SM), at least one, keeping MIN_CHUNKS_PER_SLICE chunks a slice, as
    slice_plan lays them out. A wave and a fraction more costs a whole second pass over the
    bandwidth-starved tail. Never depends on M, so a row rounds alike at every M."""
    blocks = -(-n // ROWS_PER_BLOCK)
    wanted = max(1, min(WAVE_BLOCKS_PER_SM * sms // blocks, (k // 64) // MIN_CHUNKS_PER_SLICE))
    return slice_plan(k, wanted)[0]


def slice_plan(k: int, split: int) -> tuple[int, int]:
    """(slices, 64-channel chunks per slice) for `split` wanted slices of K: equal slices rounded
    up to SLICE_ROUND chunks, so the look-ahead runs whole rounds and every slice starts on a
    group (the pair-group entries); the last slice takes the rest."""
    chunks = k // 64
    per = min(chunks, -(-(-(-chunks // max(1, split))) // SLICE_ROUND) * SLICE_ROUND)
    return -(-chunks // per), per


def token_tiles(m: int) -> int:
    """8-token MMA tiles per warp for an m-row product (beyond 64 tokens: grid chunks of 64)."""
    return min(MAX_TOKEN_TILES, max(1, -(-m // 8)))


def one_pass_entry(m: int, split: int) -> w4_verdicts.Entry:
    """The entry that takes an m-row product's tokens in one pass of the grid (grid chunks of 64
    past 64 tokens), one row tile per warp and one warp per row tile, at `split` K slices."""
    return token_tiles(m), 1, split, 1


def plan_for(w: W4Weight, m: int, sms: int) -> w4_verdicts.Entry:
    """(8-token tiles per block, 16-row tiles per warp, K slices, warps per row tile) of an m-row
    product of w on a GPU of `sms` multiprocessors: where hierviz.quant.w4_choice timed w's kind,
    its fastest entry (fewer token tiles run more passes of the grid over the tokens, each block
    re-reading its weight tile; more row tiles per warp let each activation load serve more MMAs;
    any of them gives a row the same bits; a kind that is not batch-invariant may also have timed
    another K split or two warps per row tile faster), else one_pass_entry at split_for."""
    default = one_pass_entry(m, split_for(w.out_features, w.in_features, sms))
    planned = w4_verdicts.planned_entry(w4_verdicts.kernel_kind(w), m)
    if planned is None:
        return default
    tiles, row_tiles, split, k_warps = min(planned[0], token_tiles(m)), planned[1], planned[2], planned[3]
    if w.batch_invariant:       # a verifier's rows keep their bits only at the split of its kind, one warp a tile
        split, k_warps = default[2], 1
    if k_warps > 1 and (tiles, row_tiles, k_warps) not in K_WARP_BUILD:     # clamped to fewer tiles than built
        k_warps = 1
    if row_tiles > 1 and k_warps == 1 and (tiles, row_tiles) not in DIRECT_ROWS_BUILD:
        row_tiles = 1
    return tiles, row_tiles, split, k_warps


def serves(w: W4Weight, m: Optional[int] = None) -> bool:
    """Whether w's fp16 products (its m-row ones; None: any), on a platform where the variant is
    proven, run here rather than in the Triton kernel: with HIERVIZ_W4_CUDA=auto (the default) the
    weights whose kind hierviz.quant.w4_choice timed as fast here at every row count its model's
    forwards run, with `on` every W4 weight, with `target` only a verifier's (batch-invariant: the
    target's). A verifier's products must all run one kernel (its rows keep their bits only within
    one), so its choice is per weight, never per M; a weight that is not batch-invariant (an
    intermediate's) runs each row count in the kernel timed faster there."""
    mode = options().w4_cuda
    if mode == "auto":
        return w4_verdicts.cuda_chosen(w, m)
    return mode == "on" or (mode == "target" and w.batch_invariant)


# ---- layout ----------------------------------------------------------------------------------

LAYOUT_TILES_AT_ONCE = 256    # row tiles converted per step: bounds the temporaries on a 70B layer


def _pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """codes [16 * tiles, K] (uint8 values 0..15) -> int32 [tiles, K/64, 32, 4]."""
    n, k = q.shape
    # [tile, h, g, chunk, t, j, e] -> [tile, chunk, g, t, j, h, e]
    q = q.view(n // 16, 2, 8, k // 64, 4, 4, 4).permute(0, 3, 2, 4, 5, 1, 6).to(torch.int32)
    words = torch.zeros(q.shape[:-2], dtype=torch.int32, device=q.device)
    for h, row in enumerate(NIBBLE_OF):
        for e, p in enumerate(row):
            words |= q[..., h, e] << (4 * p)        # bit 31 may be set: int32 keeps the bits
    return words.reshape(n // 16, k // 64, 32, 4)


def pack_layout(codes: torch.Tensor) -> torch.Tensor:
    """W4Weight codes uint8 [N, K/2] -> the kernel's int32 [N/16, K/64, 32, 4] (module docstring)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    words = torch.empty((n // 16, k // 64, 32, 4), dtype=torch.int32, device=codes.device)
    step = 16 * LAYOUT_TILES_AT_ONCE
    for a in range(0, n, step):
        words[a // 16:(a + step) // 16] = _pack_tiles(unpack_codes(codes[a:a + step]))
    return words


def _unpack_tiles(words: torch.Tensor) -> torch.Tensor:
    """_pack_tiles undone: int32 [tiles, K/64, 32, 4] -> uint8 codes [16 * tiles, K] (0..15)."""
    tiles, chunks = words.shape[0], words.shape[1]
    w = words.reshape(tiles, chunks, 8, 4, 4)
    q = torch.empty(tiles, chunks, 8, 4, 4, 2, 4, dtype=torch.uint8, device=words.device)
    for h, row in enumerate(NIBBLE_OF):
        for e, p in enumerate(row):
            q[..., h, e] = ((w >> (4 * p)) & 0xF).to(torch.uint8)
    return q.permute(0, 5, 2, 1, 3, 4, 6).reshape(tiles * 16, chunks * 64)


def unpack_layout(words: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pack_layout undone: the W4Weight codes uint8 [N, K/2] (or `rows` of them)."""
    if rows is not None:
        tiles = torch.unique(rows.to(words.device) // 16)
        q = _unpack_tiles(words.index_select(0, tiles))
        where = torch.searchsorted(tiles, rows.to(words.device) // 16) * 16 + rows.to(words.device) % 16
        return pack_codes(q.index_select(0, where))
    return torch.cat([pack_codes(_unpack_tiles(words[a:a + LAYOUT_TILES_AT_ONCE]))
                      for a in range(0, words.shape[0], LAYOUT_TILES_AT_ONCE)])


def pack_groups(scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """scales, offsets [N, K/G] -> int32 [N/16, K/G, 8, 2] of fp16 pairs (scale low, offset high):
    rows g and g + 8 of a tile side by side, one 8-byte load for lane group g."""
    n, groups = scales.shape
    s = scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    o = offsets.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    pair = (s | (o << 16)).view(n // 16, 2, 8, groups).permute(0, 3, 2, 1)
    return pair.contiguous()


def layout(w: W4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, so) of w in the kernel's layout, built once; on a GPU the checkpoint-order codes
    are then released (w4.codes_of rebuilds them from here)."""
    state = w.kernel_state.setdefault(_CACHE_KEY, {})
    if "codes" not in state:
        state["codes"] = pack_layout(codes_of(w))
        state["so"] = pack_groups(w.scales, w.offsets)
        if w.codes.is_cuda and not codes_released(w):
            release_codes(w, source_codes)
    return state["codes"], state["so"]


def source_codes(w: W4Weight, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w's codes in the W4Weight order, rebuilt from this kernel's layout."""
    return unpack_layout(w.kernel_state[_CACHE_KEY]["codes"], rows)


# ---- NVRTC and the driver ----------------------------------------------------------------------

class CompileError(RuntimeError):
    pass


def _nvrtc_library() -> ctypes.CDLL:
    """libnvrtc from torch's CUDA wheels (or the system), whichever loads first."""
    names = []
    try:
        from torch.cuda import _utils
        return _utils._get_nvrtc_library()
    except Exception:
        pass
    import site
    for base in site.getsitepackages() + [site.getusersitepackages()]:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "**", "libnvrtc.so*"), recursive=True), reverse=True)
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in names:
        if "builtins" in name or ".alt." in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CompileError("NVRTC (libnvrtc) was not found: install torch's CUDA wheels")


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> Optional[str]:
    """NVRTC's "major.minor", or None where it does not load."""
    try:
        lib = _nvrtc_library()
    except CompileError:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    return f"{major.value}.{minor.value}"


NVRTC_OPTIONS = ("--std=c++17", "-default-device")


def compiler_id() -> str:
    """What a build's bytes depend on besides its source and arch (the disk cache's key)."""
    return f"nvrtc {nvrtc_version()} {' '.join(NVRTC_OPTIONS)}"


def compile_cubin(arch: str, source: Optional[str] = None, include_dirs: tuple[str, ...] = ()) -> bytes:
    """`source` (default: kernel_source(arch=arch), the shipped entries) compiled by NVRTC for arch
    ("sm_90"): the CUBIN bytes (CompileError with the compiler's log otherwise). Needs no GPU:
    the tests compile it on a CPU machine. include_dirs: where the source's #include headers are
    (the shipped kernel includes none)."""
    lib = _nvrtc_library()
    prog = ctypes.c_void_p()
    src = (kernel_source(arch=arch) if source is None else source).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"hierviz_w4.cu", 0, None, None) != 0:
        raise CompileError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in NVRTC_OPTIONS] + [
        f"-I{d}".encode() for d in include_dirs]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    try:
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if res != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CompileError(f"NVRTC failed for {arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0:
            raise CompileError("nvrtcGetCUBINSize failed")
        out = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, out) != 0:
            raise CompileError("nvrtcGetCUBIN failed")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class _Driver:
    """The few CUDA driver calls the kernel needs, on torch's primary context."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]

    def check(self, res: int, what: str) -> None:
        if res != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(res, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else res}")

    def ensure_context(self) -> None:
        """torch's threads have its primary context current; a new thread (a web worker) may not."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


_LOCK = threading.Lock()
_DRIVER: Optional[_Driver] = None
_FUNCTIONS: dict[int, dict[str, ctypes.c_void_p]] = {}     # device index -> entry name -> CUfunction
_UNAVAILABLE: dict[int, str] = {}                          # device index -> why not


def _arch(index: int) -> str:
    """The NVRTC target of device `index`: Hopper's arch-specific sm_90a (wgmma), else sm_XY."""
    major, minor = torch.cuda.get_device_capability(index)
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def _direct_build(tiles: int, row_tiles: int = 1, k_warps: int = 1) -> Optional[tuple[int, int]]:
    """(chunks ahead, blocks per multiprocessor) of the direct entry for `tiles` token tiles,
    `row_tiles` row tiles per warp and `k_warps` warps per row tile; None where no direct entry is
    built (staged tile counts)."""
    if k_warps > 1:
        return K_WARP_BUILD.get((tiles, row_tiles, k_warps))
    return DIRECT_BUILD.get(tiles) if row_tiles == 1 else DIRECT_ROWS_BUILD.get((tiles, row_tiles))


def ahead_chunks(tiles: int, row_tiles: int = 1, k_warps: int = 1) -> int:
    """K chunks of codes the entry of `tiles` token tiles fetches ahead of the one it multiplies."""
    build = _direct_build(tiles, row_tiles, k_warps)
    if build:
        return build[0]
    return STAGED_BUILD[tiles][0]


def pair_group(tiles: int, group_size: int, chunks_per_slice: int, row_tiles: int = 1, k_warps: int = 1) -> int:
    """The group size whose direct entry addresses the group pairs by constant offsets (every
    slice starting on a group, the look-ahead whole groups), else 0: the generic entry."""
    build = _direct_build(tiles, row_tiles, k_warps)
    if build is None or not has_group_entry(build[0], group_size):
        return 0
    return group_size if chunks_per_slice % (group_size // 64) == 0 else 0


def entry_for(tiles: int, group: int = 0, wgmma: bool = False, row_tiles: int = 1, k_warps: int = 1) -> str:
    """The entry that multiplies `tiles` token tiles per block: the direct loop for few (group:
    its pair_group entry; row_tiles: 16-row tiles per warp; k_warps: warps per row tile), else
    staged (wgmma: its wgmma entry)."""
    if k_warps > 1:
        return f"w4_direct_t{tiles}_r{row_tiles}_k{k_warps}" + (f"_g{group}" if group else "")
    if row_tiles > 1:       # a direct entry at any token tiles, the staged ones' counts too (DIRECT_ROWS_BUILD)
        return f"w4_direct_t{tiles}_r{row_tiles}" + (f"_g{group}" if group else "")
    if tiles not in DIRECT_BUILD:
        return f"w4_wgmma_t{tiles}" if wgmma and tiles in WGMMA_BUILD else f"w4_staged_t{tiles}"
    return f"w4_direct_t{tiles}_g{group}" if group else f"w4_direct_t{tiles}"


def entry_names(arch: Optional[str] = None, wgmma_build: Optional[dict] = None,
                rows_build: Optional[dict] = None, kw_build: Optional[dict] = None) -> list[str]:
    """The entries a build for `arch` holds (None: an arch without the wgmma entries; wgmma_build:
    its wgmma entries, default WGMMA_BUILD; rows_build: its direct entries of several row tiles per
    warp, default DIRECT_ROWS_BUILD; kw_build: of several warps per row tile, default K_WARP_BUILD)."""
    rows_build = DIRECT_ROWS_BUILD if rows_build is None else rows_build
    kw_build = K_WARP_BUILD if kw_build is None else kw_build
    return [entry_for(t) for t in range(1, MAX_TOKEN_TILES + 1)] + [
        entry_for(t, g) for t, (a, _) in DIRECT_BUILD.items() for g in PAIR_GROUPS if has_group_entry(a, g)] + [
        entry_for(t, g, row_tiles=r) for (t, r), (a, _) in rows_build.items()
        for g in (0, *PAIR_GROUPS) if g == 0 or has_group_entry(a, g)] + [
        entry_for(t, g, row_tiles=r, k_warps=kw) for (t, r, kw), (a, _) in kw_build.items()
        for g in (0, *PAIR_GROUPS) if g == 0 or has_group_entry(a, g)] + (
        [entry_for(t, wgmma=True) for t in (WGMMA_BUILD if wgmma_build is None else wgmma_build)]
        if has_wgmma(arch) else [])


def functions(index: int) -> dict[str, ctypes.c_void_p]:
    """The compiled entries (name -> CUfunction) on CUDA device `index`, built on first use."""
    global _DRIVER
    if index in _FUNCTIONS:
        return _FUNCTIONS[index]
    with _LOCK:
        if index in _FUNCTIONS:
            return _FUNCTIONS[index]
        if index in _UNAVAILABLE:
            raise RuntimeError(_UNAVAILABLE[index])
        try:
            torch.cuda.init()
            with torch.cuda.device(index):
                torch.zeros(1, device=f"cuda:{index}")      # torch's primary context exists
                if _DRIVER is None:
                    _DRIVER = _Driver()
                _DRIVER.ensure_context()
                found = load_entries(_arch(index))
        except Exception as e:
            _UNAVAILABLE[index] = f"the CUDA W4 kernel is not available on cuda:{index}: {type(e).__name__}: {e}"
            raise RuntimeError(_UNAVAILABLE[index]) from e
        _FUNCTIONS[index] = found
        return found


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def load_entries(arch: str, source: Optional[str] = None, wgmma_build: Optional[dict] = None,
                 rows_build: Optional[dict] = None, kw_build: Optional[dict] = None) -> dict[str, ctypes.c_void_p]:
    """`source` (default: the shipped entries) compiled for arch (or its build kept on disk:
    cubin_cache) and loaded into the current context: entry name -> CUfunction, the wgmma entries
    allowed their dynamic shared memory."""
    source, compiler = kernel_source(arch=arch) if source is None else source, compiler_id()
    cubin, from_disk = cubin_cache.cubin(arch, source, compiler, compile_cubin)
    module = ctypes.c_void_p()
    res = _DRIVER.lib.cuModuleLoadData(ctypes.byref(module), cubin)
    if res != 0 and from_disk:      # a kept build the driver refuses: compiled again, once
        cubin_cache.forget(arch, source, compiler)
        cubin, _ = cubin_cache.cubin(arch, source, compiler, compile_cubin)
        res = _DRIVER.lib.cuModuleLoadData(ctypes.byref(module), cubin)
    _DRIVER.check(res, "cuModuleLoadData")
    found = {}
    for name in entry_names(arch, wgmma_build, rows_build, kw_build):
        fn = ctypes.c_void_p()
        _DRIVER.check(_DRIVER.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
        found[name] = fn
    for t in (WGMMA_BUILD if wgmma_build is None else wgmma_build) if has_wgmma(arch) else ():
        _DRIVER.check(_DRIVER.lib.cuFuncSetAttribute(found[entry_for(t, wgmma=True)],
                                                     CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                     wgmma_shared_bytes(t, wgmma_build)),
                      "cuFuncSetAttribute")
    return found


def available(device: torch.device) -> bool:
    """Whether the kernel compiles and loads on this CUDA device (tensor-core MMA: sm_80 on)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(_index(device))[0] < 8:
        return False
    try:
        functions(_index(device))
        return True
    except RuntimeError:
        return False


def unavailable_reason(device: torch.device) -> str:
    """Why `available` said no on this device."""
    if device.type != "cuda":
        return "the CUDA W4 kernel needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(_index(device))
    if major < 8:
        return f"the CUDA W4 kernel needs tensor-core MMA (sm_80 on), this GPU is sm_{major}{minor}"
    return _UNAVAILABLE.get(_index(device), "the CUDA W4 kernel has not been loaded")


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One int32 ticket per output tile (the last block resets its own)."""
    return ticket_buffer(_COUNTERS, device, tiles, "the CUDA W4 kernel's counters")


def matmul(x: torch.Tensor, w: W4Weight, add_to: Optional[torch.Tensor] = None,
           split: Optional[int] = None, tiles: Optional[int] = None, wgmma: Optional[bool] = None,
           row_tiles: int = 1, k_warps: Optional[int] = None) -> torch.Tensor:
    """y = x @ W.T (x [M, K] fp16, contiguous, on CUDA); add_to [M, N] fp16: added into in place
    and returned. split: K slices (default: plan_for's, for a batch-invariant weight split_for on
    this GPU, the same for every M; another split sums in another order, so other bits). tiles:
    8-token tiles per block (default plan_for(w, M), with its row tiles per warp and K slices);
    any choice of tiles gives a row the same bits. wgmma:
    whether the staged tile counts run the wgmma entries (default: WGMMA_BY_DEFAULT, where this
    GPU's build has them; else the mma.sync staged loop), the same bits either way. row_tiles:
    16-row tiles per warp of a direct entry (DIRECT_ROWS_BUILD), the same bits too. k_warps: warps
    per row tile of a direct entry (K_WARP_BUILD; default plan_for's where tiles is None, else 1),
    other bits than one warp's (a sum of another order)."""
    m, k = x.shape
    n = w.out_features
    if k != w.in_features:
        raise ValueError(f"x has {k} input features, the weight {w.in_features}")
    if row_tiles < 1 or WARPS % row_tiles:
        raise ValueError(f"no entry multiplies {row_tiles} row tiles per warp (a block holds {WARPS})")
    if tiles is not None and (k_warps or 1) > 1 and (tiles, row_tiles, k_warps) not in K_WARP_BUILD:
        raise ValueError(f"no entry multiplies {tiles} token tiles with {row_tiles} row tiles and {k_warps} warps per row tile")
    if tiles is not None and row_tiles > 1 and (k_warps or 1) == 1 and (tiles, row_tiles) not in DIRECT_ROWS_BUILD:
        # the staged loop and the untabled direct entries have warps of one row tile
        raise ValueError(f"no entry multiplies {tiles} token tiles with {row_tiles} row tiles per warp")
    if add_to is not None and (add_to.shape != (m, n) or add_to.dtype != torch.float16
                               or not add_to.is_contiguous()):
        raise ValueError(f"add_to must be a contiguous fp16 {(m, n)} tensor, got {tuple(add_to.shape)} {add_to.dtype}")
    if x.dtype != torch.float16 or not x.is_cuda:
        raise ValueError(f"the CUDA W4 kernel takes fp16 CUDA activations, got {x.dtype} on {x.device}")
    shift = group_shift(k, w.group_size)
    if not supports_shape(n, k, w.group_size) or shift is None:
        raise ValueError(f"the CUDA W4 kernel does not multiply a {n}x{k} g{w.group_size} weight")
    if m == 0:
        return add_to if add_to is not None else x.new_empty((0, n))
    index = _index(x.device)
    fns = functions(index)
    x = x.contiguous()
    if tiles is None:
        tiles, row_tiles, planned_split, planned_warps = plan_for(w, m, multiprocessor_count(x.device))
        split = planned_split if split is None else split
        k_warps = planned_warps if k_warps is None else k_warps
    k_warps = k_warps or 1
    if split is None:
        split = split_for(n, k, multiprocessor_count(x.device))
    split, per = slice_plan(k, split)
    if not 1 <= tiles <= MAX_TOKEN_TILES:
        raise ValueError(f"no entry multiplies {tiles} token tiles")
    y = add_to if add_to is not None else torch.empty((m, n), device=x.device, dtype=torch.float16)
    _DRIVER.ensure_context()
    use_wgmma = WGMMA_BY_DEFAULT and entry_for(tiles, wgmma=True) in fns if wgmma is None else wgmma
    entry = entry_for(tiles, pair_group(tiles, w.group_size, per, row_tiles, k_warps), use_wgmma, row_tiles, k_warps)
    if entry not in fns:
        raise ValueError(f"this GPU's build of the CUDA W4 kernel has no entry {entry}")
    shared = wgmma_shared_bytes(tiles) if entry.startswith("w4_wgmma") else 0
    return launch(fns[entry], x, w, y, add_to is not None, tiles, split, per, 32 * WARPS // row_tiles * k_warps, shared)


def launch(fn: Any, x: torch.Tensor, w: W4Weight, y: torch.Tensor, residual: bool, tiles: int, split: int, per: int,
           threads: int = 32 * WARPS, shared: int = 0) -> torch.Tensor:
    """Launch kernel entry `fn` on torch's current stream: x's rows in passes of `tiles` token
    tiles, K in `split` slices of `per` channels, into y (which already holds the residual where
    `residual`); `threads` per block, `shared` bytes of dynamic shared memory. Returns y."""
    m, k = x.shape
    n = w.out_features
    codes, so = layout(w)
    if codes.stride()[1:] != (128, 4, 1):
        raise ValueError("the CUDA W4 kernel reads its codes tile by tile (cuda_w4.pack_layout)")
    grid = (-(-m // (8 * tiles)), -(-n // ROWS_PER_BLOCK), split)
    parts = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    counters = _counters(x.device, grid[0] * grid[1]) if split > 1 else y
    args = [ctypes.c_void_p(codes.data_ptr()), ctypes.c_void_p(so.data_ptr()), ctypes.c_void_p(x.data_ptr()),
            ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(y.data_ptr() if residual else 0),
            ctypes.c_void_p(parts.data_ptr()), ctypes.c_void_p(counters.data_ptr()), ctypes.c_int(m), ctypes.c_int(n),
            ctypes.c_int(k), ctypes.c_int(x.stride(0)), ctypes.c_int(y.stride(0)), ctypes.c_int(per),
            ctypes.c_int(k // w.group_size), ctypes.c_int(group_shift(k, w.group_size)), ctypes.c_int(split),
            ctypes.c_longlong(codes.stride(0) // 4)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _DRIVER.check(_DRIVER.lib.cuLaunchKernel(fn, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, ptrs, None),
                  "cuLaunchKernel")
    return y
