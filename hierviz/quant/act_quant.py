"""Per-token dynamic activation quantization in one Triton kernel, for the 8-bit formats.

torch's definition (w8a8.quantize_tokens, fp8.quantize_tokens_fp8) runs as about nine small
kernels per product on CUDA (cast, abs, amax, divide, clamp, divide, round, clamp, cast), which is
most of what makes a one-token W8A8 layer slower than FP16 on the H200 (docs/formats.md). This
kernel reads each row twice (its absmax, then its codes) and writes the codes and the row's scale:

    s[t] = max(max_k |x[t, k]| / QMAX, 1e-12)        (fp32; on CUDA as absmax x fp32(1 / QMAX))
    q[t, k] = round_half_even(clamp(x[t, k] / s[t], -QMAX, QMAX))   int8, QMAX = 127
            = e4m3(clamp(x[t, k] / s[t], -448, 448))                FP8, round to nearest even

the same arithmetic as torch's in the same order, so the codes and scales are the same bits (torch
divides a tensor by a Python number as a multiplication by its fp32 reciprocal on CUDA, and
exactly on the CPU: the kernel does what torch does on the device it runs on). One
program per row: a row's result never depends on the others (batch invariance by construction).

Used on CUDA only on a (GPU generation, Triton) pair where tests/test_gpu.py compared it with
torch's path bit for bit (`PROVEN_PLATFORMS`); elsewhere torch's path runs. The CPU tests run it
under TRITON_INTERPRET=1.
"""
from __future__ import annotations

from typing import Optional

import torch

# (compute capability major, Triton "major.minor") where
# tests/test_gpu.py::test_fused_activation_quantizer_matches_torch passed (docs/formats.md records it)
PROVEN_PLATFORMS: frozenset[tuple[int, str]] = frozenset({(9, "3.6")})
_proven_on: dict[torch.device, bool] = {}      # device -> on PROVEN_PLATFORMS (asked on every product)
_forced: list[Optional[bool]] = [None]
ROUND_MAGIC = 12582912.0        # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to nearest even in fp32
BLOCK = 1024

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - triton is a requirement; the torch path needs none of it
    triton = None


def force(on: Optional[bool]) -> None:
    """Tests: use the kernel (True) or torch's path (False) whatever the platform; None = default."""
    _forced[0] = on


def platform_proven(device: torch.device) -> bool:
    """Whether device is a GPU whose (generation, Triton) pair is in PROVEN_PLATFORMS."""
    if device.type != "cuda":
        return False
    if device not in _proven_on:
        from hierviz.quant.kernel_guard import gpu_platform
        _proven_on[device] = gpu_platform(device) in PROVEN_PLATFORMS
    return _proven_on[device]


def active(device: torch.device) -> bool:
    """Whether the 8-bit products on device quantize their activations with the kernel: on a proven
    GPU platform (or forced, also on the CPU under the interpreter)."""
    if triton is None:
        return False
    if _forced[0] is not None:
        return _forced[0]
    return platform_proven(device)


def enabled(x: torch.Tensor) -> bool:
    """Whether x's rows are quantized by the kernel (`active` on x's device)."""
    return active(x.device)


def name_on(device: torch.device) -> str:
    """"fused" or "torch": which quantizer the 8-bit products on device run, as measurements record it."""
    return "fused" if active(device) else "torch"


if triton is not None:
    @triton.jit
    def _quantize_rows(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, QMAX: tl.constexpr, INV_QMAX: tl.constexpr, RECIP: tl.constexpr, FP8: tl.constexpr,
                       MAGIC: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        # torch's arithmetic on this device (module docstring); divisions are div_rn because
        # Triton's own fp32 `/` is the approximate div.full on NVIDIA GPUs
        if RECIP:
            s = tl.maximum(tl.max(amax, axis=0) * INV_QMAX, 1e-12)
        else:
            s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), 1e-12)
        tl.store(s_ptr + row, s)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -QMAX), QMAX)
            if FP8:
                # round to e4m3's grid in fp32 first (3 mantissa bits, subnormal step 2**-9), so the
                # cast is exact: the interpreter's own fp8 cast drops the carry into the exponent
                # the magnitude is cast and the sign set on the code's bit, so a value that rounds
                # to zero keeps its sign as torch's cast does (-0, 0x80): a negated float zero does
                # not survive the GPU compiler's no-signed-zeros folding
                vb = v.to(tl.int32, bitcast=True)
                e = ((vb >> 23) & 0xFF) - 127
                step = (tl.maximum(e - 3, -9) + 127).to(tl.int32)
                ulp = (step << 23).to(tl.float32, bitcast=True)
                r = ((tl.math.div_rn(tl.abs(v), ulp) + MAGIC) - MAGIC) * ulp
                q = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True) | tl.where(vb < 0, 0x80, 0).to(tl.uint8)
            else:
                q = ((v + MAGIC) - MAGIC).to(tl.int8)
            tl.store(q_ptr + row * stride_q + offs, q, mask=offs < K)


def quantize_rows(x2: torch.Tensor, qmax: float, code_dtype: torch.dtype,
                  cuda_arithmetic: Optional[bool] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] of code_dtype, float32 scales [M]) of a contiguous-row [M, K] activation.
    cuda_arithmetic: match torch on CUDA (scale = absmax x fp32(1 / qmax)) or on the CPU (an IEEE
    division); default: x2's device. Tests set it to check CUDA's branch under the interpreter."""
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    q = torch.empty(m, k, dtype=code_dtype, device=x2.device)
    s = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        # FP8 codes are written as their bytes (the kernel sets the sign bit itself)
        _quantize_rows[(m,)](x2, q if code_dtype == torch.int8 else q.view(torch.uint8), s, k, x2.stride(0), q.stride(0), QMAX=qmax, INV_QMAX=1.0 / qmax,
                             RECIP=x2.is_cuda if cuda_arithmetic is None else cuda_arithmetic,
                             FP8=code_dtype != torch.int8, MAGIC=ROUND_MAGIC, BLOCK=BLOCK)
    return q, s
