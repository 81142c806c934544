"""W4A16 kernel "int4pack_cpu": torch's CPU int4 matmul (`torch._weight_int4pack_mm_for_cpu`).

torch's kernel computes W[n, k] = (q - 8) * scale + zero with scales_and_zeros packed as
[K/G, N, 2]. Our format is W = scale * q + offset, so the exact mapping is
zero = offset + 8 * scale. The packed weight (torch's own tiled layout) and the scale/zero
tensor are built on first use and cached on the W4Weight object per activation dtype, so a
model pays the repack once. Importing this module registers the kernel.
"""
from __future__ import annotations

import torch

from hierviz.quant.w4 import KERNELS, W4Weight, register_kernel, unpack_codes

_CACHE_ATTR = "_int4pack_cpu_cache"


def available() -> bool:
    """True when this torch build has the CPU int4 ops."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu")


def _packed(w: W4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cache = w.__dict__.setdefault(_CACHE_ATTR, {})
    hit = cache.get(dtype)
    if hit is None:
        # The CPU converter takes int32 codes [N, K] (one value per element), not our nibbles.
        q = unpack_codes(w.codes).to(torch.int32).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        scale = w.scales.float()
        zero = w.offsets.float() + 8.0 * scale  # (q - 8) * s + zero == s * q + offset
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(dtype)
        hit = cache[dtype] = (packed, sz)
    return hit


def int4pack_cpu_matmul(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """y = x @ W.T for x [M, K] on the CPU (fp32, fp16 or bf16; fp32 is the accurate one)."""
    if x.device.type != "cpu":
        raise ValueError("kernel 'int4pack_cpu' runs on the CPU only")
    packed, sz = _packed(w, x.dtype)
    return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, w.group_size, sz)


if available() and "int4pack_cpu" not in KERNELS:
    register_kernel("int4pack_cpu", int4pack_cpu_matmul)
