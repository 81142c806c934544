"""W4A16 kernel "int4pack_cpu": torch's CPU int4 matmul (`torch._weight_int4pack_mm_for_cpu`).

torch's kernel computes W[n, k] = (q - 8) * scale + zero with scales_and_zeros packed as
[K/G, N, 2]. Our format is W = scale * q + offset, so the exact mapping is
zero = offset + 8 * scale. The packed weight (torch's own tiled layout) and the scale/zero
tensor are built on first use and cached on the W4Weight object per activation dtype, so a
model pays the repack once. Importing this module registers the kernel.

fp32 activations are rounded to bf16 before the call (and the result returned as fp32):
torch's fp32 path of this op is ~16x slower than its bf16 path (docs/kernels.md), which would
make the kernel pointless.
The cost is bf16 activation rounding, ~4e-3 relative error against the fp32 reference.
Set FP32_VIA_BF16 = False for the exact (slow) fp32 path.
"""
from __future__ import annotations

import torch

from hierviz.quant.w4 import KERNELS, W4Weight, codes_of, register_kernel, unpack_codes

_CACHE_KEY = "int4pack_cpu"
FP32_VIA_BF16 = True


def available() -> bool:
    """True when this torch build has the CPU int4 ops."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu")


def _packed(w: W4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cache = w.kernel_state.setdefault(_CACHE_KEY, {})
    hit = cache.get(dtype)
    if hit is None:
        # The CPU converter takes int32 codes [N, K] (one value per element), not our nibbles.
        q = unpack_codes(codes_of(w)).to(torch.int32).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        scale = w.scales.float()
        zero = w.offsets.float() + 8.0 * scale  # (q - 8) * s + zero == s * q + offset
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(dtype)
        hit = cache[dtype] = (packed, sz)
    return hit


def int4pack_cpu_matmul(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """y = x @ W.T for x [M, K] on the CPU (fp32, fp16 or bf16; see FP32_VIA_BF16)."""
    if x.device.type != "cpu":
        raise ValueError("kernel 'int4pack_cpu' runs on the CPU only")
    xc = x.to(torch.bfloat16) if (x.dtype == torch.float32 and FP32_VIA_BF16) else x
    packed, sz = _packed(w, xc.dtype)
    y = torch._weight_int4pack_mm_for_cpu(xc.contiguous(), packed, w.group_size, sz)
    return y if y.dtype == x.dtype else y.to(x.dtype)


if available() and "int4pack_cpu" not in KERNELS:
    register_kernel("int4pack_cpu", int4pack_cpu_matmul)
