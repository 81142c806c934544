"""The Triton W4A16 kernels' bodies; hierviz.quant.triton_w4 picks their configuration, lays out
the weight for them, launches them and checks their first products.

  _w4_kernel        the MMA kernel: acc[n, m] = W @ x.T for a tile of weight rows by tokens over
                    one K range; codes by pointer loads or TMA descriptors (TMA, TMA_SOX, TILED),
                    unpacked per weight or left biased and corrected per group (FACTORED)
  _w4_gemv_kernel   the one-token CUDA-core kernel (no MMA), packed fp16 FMAs (_GEMV_F16)
  _store_product    how K ranges meet: atomic adds, or the fixed-order sum of fp32 partials

The unpack on a GPU is inline PTX, 14 instructions per 8 values: prmt/lop3 put a nibble into
the mantissa of 1024.0 (fp16) or 128.0 (bf16), one packed subtract or FMA removes the bias,
one packed FMA applies scale and offset; no int->float conversions. The Triton interpreter
(TRITON_INTERPRET=1) cannot run inline assembly, so under it the same trick written in plain
Triton ops runs instead; the tests run that one, the GPU benchmark checks both. The kernels'
names, leading underscore included, are what profiles record.
"""
from __future__ import annotations

try:  # import must work on machines without a GPU (and without triton at all)
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False


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
        flight together (one at a time is slower, all at once costs the main loop registers).
        Otherwise (one K range): y = acc, or y += acc under ACCUM."""
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
                # The block's two products are summed into `part` and only then into acc: that use
                # of the MMA result inside the iteration makes the last wgmma complete before the
                # next iteration's unpack rewrites its register operand. A chained
                # acc = dot(w, x, acc) can leave it in flight across the loop's back edge, which
                # gives wrong rows (docs/kernels.md, "One rule the MMA loop must keep").
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
