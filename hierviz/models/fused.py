"""Fused Triton kernels for a decoder layer's non-GEMM work on the static (CUDA-graph) path.

Why: done by torch, that work is ~45 small kernels per layer (RMSNorm's fp32 chain, RoPE's
cat/neg/mul/add, the cache writes, SDPA's math path with its mask conversion and GQA copies,
SiLU * up, residual adds), whose time and launch gaps on a 70B target exceed the weight-read
floor of the whole model (docs/kernels.md, "The fused layer kernels"). These kernels do that
work in five launches per layer:

  rms_norm                  one program per token row (the residual adds happen inside the o /
                            down W4 products: hierviz.quant.w4.w4_linear's add_to)
  rope_to_cache             rotates q and k (HF rotate-half), writes k and v into their cache
                            slots, leaves q in [T, heads * head_dim], the layout o_proj reads
  masked_attention          flash-decoding over the preallocated cache with the static path's
                            boolean mask [T, L], turned once per forward into each token's list
                            of visible columns (`visible_columns`); GQA without copies (one
                            program serves a token's group of query heads); only visible columns
                            are read; split along them for parallelism, the last slice of a token
                            combining them in the same launch;
                            batch-invariant (see masked_attention)
  silu_mul                  silu(gate) * up from the fused gate_up output

Arithmetic follows the unfused torch code: the same ops in the activation dtype where torch
rounds to it (residual add, RoPE, SiLU * up), fp32 where torch upcasts (norm statistics,
softmax). Used on CUDA for fp16/bf16 (`HIERVIZ_FUSED=0` turns it off); the CPU tests force
it under TRITON_INTERPRET=1 and compare it with the unfused path.
"""
from __future__ import annotations

import math

import torch

from hierviz.config import options
from hierviz.quant.tickets import ticket_buffer

try:  # must import on machines without triton
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    HAVE_TRITON = False

_force = False
ATTN_BLOCK_L = 64          # cache columns per attention step
ATTN_SPLIT_BLOCKS = 2      # attention steps per program (longer contexts: more programs, combined)


def force(on: bool) -> None:
    """Use the fused kernels on any device (under TRITON_INTERPRET=1 off CUDA): for tests."""
    global _force
    _force = on


def usable(x: torch.Tensor) -> bool:
    """Fused path for this activation: CUDA fp16/bf16 unless HIERVIZ_FUSED=0, or forced."""
    if not HAVE_TRITON or x.dim() != 2:
        return False
    if _force:
        return True
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and options().fused)


if HAVE_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < H
        x = tl.load(x_ptr + row * H + offs, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / H
        n = (xf * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        tl.store(y_ptr + row * H + offs, w * n, mask=ok)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                           stride_qkv, HQ, HKV, L, HD: tl.constexpr, HALF: tl.constexpr,
                           BH: tl.constexpr, BHEADS: tl.constexpr):
        t = tl.program_id(0)                       # one token: its HQ query, HKV key, HKV value heads
        hh = tl.program_id(1) * BHEADS + tl.arange(0, BHEADS)
        offs = tl.arange(0, BH)
        ok = (hh < HQ + 2 * HKV)[:, None] & (offs < HALF)[None, :]
        src = qkv_ptr + t * stride_qkv + hh[:, None] * HD + offs[None, :]
        x1 = tl.load(src, mask=ok, other=0.0)
        x2 = tl.load(src + HALF, mask=ok, other=0.0)
        c1 = tl.load(cos_ptr + t * HD + offs, mask=offs < HALF, other=0.0)[None, :]
        c2 = tl.load(cos_ptr + t * HD + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
        s1 = tl.load(sin_ptr + t * HD + offs, mask=offs < HALF, other=0.0)[None, :]
        s2 = tl.load(sin_ptr + t * HD + HALF + offs, mask=offs < HALF, other=0.0)[None, :]
        # x * cos + rotate_half(x) * sin, rounded op by op as torch does in this dtype; values pass as they are
        rot = (hh < HQ + HKV)[:, None]
        y1 = tl.where(rot, x1 * c1 + (-x2) * s1, x1)
        y2 = tl.where(rot, x2 * c2 + x1 * s2, x2)
        slot = tl.load(slots_ptr + t)
        is_k = (hh >= HQ) & (hh < HQ + HKV)
        row = tl.where(hh < HQ, t * HQ + hh,
                       tl.where(is_k, (hh - HQ) * L + slot, (hh - HQ - HKV) * L + slot))
        dst_q = q_ptr + row[:, None] * HD + offs[None, :]
        dst_k = k_ptr + row[:, None] * HD + offs[None, :]
        dst_v = v_ptr + row[:, None] * HD + offs[None, :]
        is_q2, is_k2, is_v2 = (hh < HQ)[:, None], is_k[:, None], (hh >= HQ + HKV)[:, None]
        tl.store(dst_q, y1, mask=ok & is_q2)
        tl.store(dst_q + HALF, y2, mask=ok & is_q2)
        tl.store(dst_k, y1, mask=ok & is_k2)
        tl.store(dst_k + HALF, y2, mask=ok & is_k2)
        tl.store(dst_v, y1, mask=ok & is_v2)
        tl.store(dst_v + HALF, y2, mask=ok & is_v2)

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, cols_ptr, count_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, ticket_ptr,
                          L, HQ, stride_cols, scale, blocks_per_split,
                          G: tl.constexpr, HD: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                          BL: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
        h = tl.program_id(0)                       # KV head
        t = tl.program_id(1)                       # token: its G query heads are the rows
        sp = tl.program_id(2)                      # slice of the token's visible columns
        g = tl.arange(0, BR)
        row_ok = g < G
        orow = t * HQ + h * G + g                  # row of the [T * HQ, HD] output
        d = tl.arange(0, BD)
        d_ok = d < HD
        rd_ok = row_ok[:, None] & d_ok[None, :]
        n = tl.load(count_ptr + t)                 # the token's visible columns, listed first in cols
        # slices holding columns: a function of the token's own count (at least one writes its row)
        used = tl.maximum(tl.cdiv(tl.cdiv(n, BL), blocks_per_split), 1)
        if sp < used:
            q = tl.load(q_ptr + orow[:, None] * HD + d[None, :], mask=rd_ok, other=0.0)
            m_i = tl.full([BR], float("-inf"), tl.float32)
            l_i = tl.zeros([BR], tl.float32)
            acc = tl.zeros([BR, BD], tl.float32)
            kv = h * L * HD
            b0 = sp * blocks_per_split
            b1 = tl.minimum(b0 + blocks_per_split, tl.cdiv(n, BL))
            for b in range(b0, b1):
                j = b * BL + tl.arange(0, BL)          # logical key index: the j-th column this token sees
                j_ok = j < n
                col = tl.load(cols_ptr + t * stride_cols + j, mask=j_ok, other=0)
                kv_ok = j_ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + kv + col[:, None] * HD + d[None, :], mask=kv_ok, other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where(j_ok[None, :], s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)            # m_new is finite: block b holds a visible key
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_ptr + kv + col[:, None] * HD + d[None, :], mask=kv_ok, other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if used == 1:
                # what the combine gives one slice (weight exp(0) = 1) without the round trip
                out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                tl.store(o_ptr + orow[:, None] * HD + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rd_ok)
            elif SPLIT:
                rows = tl.num_programs(1) * HQ
                part = sp * rows + orow
                tl.store(m_ptr + part, m_i, mask=row_ok, cache_modifier=".cg")
                tl.store(l_ptr + part, l_i, mask=row_ok, cache_modifier=".cg")
                tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=rd_ok, cache_modifier=".cg")
                # the last of the token's used slices to finish combines them in slice order
                # (every thread's stores precede the barrier, the ticket releases them)
                tl.debug_barrier()
                ticket = ticket_ptr + h * tl.num_programs(1) + t
                if tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == used - 1:
                    tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")
                    m_max = tl.full([BR], float("-inf"), tl.float32)
                    for s2 in range(0, used):
                        m_max = tl.maximum(m_max, tl.load(m_ptr + s2 * rows + orow, mask=row_ok,
                                                          other=float("-inf"), cache_modifier=".cg"))
                    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
                    den = tl.zeros([BR], tl.float32)
                    out = tl.zeros([BR, BD], tl.float32)
                    for s2 in range(0, used):
                        w = tl.exp(tl.load(m_ptr + s2 * rows + orow, mask=row_ok, other=float("-inf"),
                                           cache_modifier=".cg") - m_safe)
                        den += w * tl.load(l_ptr + s2 * rows + orow, mask=row_ok, other=0.0, cache_modifier=".cg")
                        out += w[:, None] * tl.load(acc_ptr + (s2 * rows + orow[:, None]) * HD + d[None, :],
                                                    mask=rd_ok, other=0.0, cache_modifier=".cg")
                    out = out / tl.where(den > 0, den, 1.0)[:, None]
                    tl.store(o_ptr + orow[:, None] * HD + d[None, :], out.to(o_ptr.dtype.element_ty), mask=rd_ok)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < I
        g = tl.load(gu_ptr + t * 2 * I + offs, mask=ok, other=0.0)
        u = tl.load(gu_ptr + t * 2 * I + I + offs, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)   # F.silu rounds to the dtype, then * up
        tl.store(out_ptr + t * I + offs, silu * u, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * normalize(x) for x [T, H] (RMSNorm of hierviz.models.llama)."""
    x = x.contiguous()
    t, hdim = x.shape
    y = torch.empty_like(x)
    block = triton.next_power_of_2(hdim)
    _rms_norm_kernel[(t,)](x, weight, y, hdim, eps, BLOCK=block,
                           num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return y


def rope_to_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * hd] -> rotated q [T, Hq * hd]; rotated k and v written into
    k_cache / v_cache [Hkv, L, hd] at `slots` [T]."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    qkv = qkv.contiguous()
    t = qkv.shape[0]
    q = torch.empty(t, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    heads = num_heads + 2 * num_kv_heads
    bheads = min(16, triton.next_power_of_2(heads))
    _rope_cache_kernel[(t, triton.cdiv(heads, bheads))](
        qkv, cos.contiguous(), sin.contiguous(), slots, q, k_cache, v_cache, qkv.stride(0),
        num_heads, num_kv_heads, k_cache.shape[1], HD=head_dim, HALF=half, BH=triton.next_power_of_2(half), BHEADS=bheads,
        num_warps=4)
    return q


def visible_columns(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a visibility mask [T, L] (True = visible): (cols [T, L + 1] int32 whose row t starts with
    the columns token t sees, ascending; count [T] int32 of them). Device ops only (CUDA-graph safe);
    computed once per forward and shared by every layer's `masked_attention`."""
    t, length = mask.shape
    count = mask.sum(1, dtype=torch.int32)
    rank = torch.cumsum(mask, 1, dtype=torch.int32) - 1          # index among the row's visible columns
    dest = torch.where(mask, rank, length).long()                # hidden columns go to a spare column
    cols = torch.empty(t, length + 1, dtype=torch.int32, device=mask.device)
    src = torch.arange(length, dtype=torch.int32, device=mask.device).expand(t, length)
    cols.scatter_(1, dest, src)
    return cols, count


def attention_splits(length: int) -> int:
    """Programs per (KV head, token) along the visible columns: a function of the cache size only."""
    return triton.cdiv(triton.cdiv(length, ATTN_BLOCK_L), ATTN_SPLIT_BLOCKS)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """One int32 ticket per (KV head, token) (the combining program resets its own)."""
    return ticket_buffer(_TICKETS, device, n, "the attention's tickets")


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     mask: torch.Tensor | tuple[torch.Tensor, torch.Tensor], num_heads: int,
                     head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd), masked) v for q [T, Hq * hd] over k/v [Hkv, L, hd] with
    mask [T, L] (True = visible) or its `visible_columns`; returns [T, Hq * hd]. Every row must
    see a column.

    One launch: a program per (KV head, token, slice of ATTN_SPLIT_BLOCKS column blocks); a token
    whose columns fit one slice is finished by that program, else the last of its slices to finish
    (an atomic ticket) combines the slices' partial results in slice order.

    Batch-invariant: a token's output depends only on its own query and the keys it sees, not on
    how many tokens share the forward or where its keys sit in the cache. The program walks the
    token's visible columns in ascending order, so a tree node whose ancestors are scattered among
    siblings reduces exactly as the same token decoded alone after its path; the slices a token
    uses and the combine order follow its own column count only. This is what lets fp16
    speculative decoding reproduce AR bit for bit (docs/exactness.md)."""
    t = q.shape[0]
    hkv, length = k_cache.shape[0], k_cache.shape[1]
    group = num_heads // hkv
    cols, count = visible_columns(mask) if isinstance(mask, torch.Tensor) else mask
    splits = attention_splits(length)
    out = torch.empty(t, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        m = torch.empty(splits, t * num_heads, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(splits, t * num_heads, head_dim, dtype=torch.float32, device=q.device)
        tickets = _tickets(q.device, hkv * t)
    else:
        m = l = acc = out
        tickets = count
    bd = max(16, triton.next_power_of_2(head_dim))
    _attention_kernel[(hkv, t, splits)](
        q.contiguous(), k_cache, v_cache, cols, count, out, m, l, acc, tickets, length, num_heads, cols.stride(0),
        1.0 / math.sqrt(head_dim), ATTN_SPLIT_BLOCKS, G=group, HD=head_dim, BD=bd,
        BR=max(16, triton.next_power_of_2(group)), BL=ATTN_BLOCK_L, SPLIT=splits > 1,
        IEEE=q.dtype == torch.float32, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up]; returns [T, I]."""
    gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
