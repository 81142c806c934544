"""The W8A8 FP8 weight format: e4m3 weights with one scale per output channel, activations cast
to e4m3 per token at run time (dynamic, symmetric), the product accumulated in fp32.

    W[n, k] ~= scales[n] * codes[n, k]          codes float8_e4m3fn [N, K], scales float32 [N]
    x[t, k] ~= s_x[t] * q[t, k]                  s_x = max_k |x[t, k]| / 448, q = e4m3(x / s_x)
    y[t, n]  = s_x[t] * scales[n] * sum_k q[t, k] codes[n, k]

Every e4m3 value is exact in fp32, so the product is the fp32 product of the dequantized
operands; it runs in chunks of a fixed number of rows (each chunk zero-padded to that size), so a
row's bits do not depend on how many rows share the forward: a batch-invariant target on the
CPU. On CUDA (compute capability 8.9 and newer) torch._scaled_mm does the product in hardware, in
fixed 128-row GEMMs for the same reason; Hopper's FP8 tensor cores accumulate with fewer bits than
fp32, so CUDA's values differ from the CPU's in the last places (each device is exact against its
own AR).
"""
from __future__ import annotations


import torch

from hierviz.quant import act_quant
from hierviz.quant.formats import PerChannelLinear, PerChannelWeight, WeightFormat, fixed_row_chunks, register

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
CHUNK = 8      # rows per product on the CPU: one shape for every call, so rows never round differently
# rows per torch._scaled_mm on CUDA: one GEMM shape for every call (the library picks its kernel by
# shape, and kernels accumulate differently), large enough that a 128-token verification is one GEMM
CUDA_CHUNK = 128


class FP8Weight(PerChannelWeight):
    """float8_e4m3fn codes [N, K], float32 scales [N]."""
    CODE_DTYPE = E4M3
    NAME = "FP8"


def quantize_fp8(weight: torch.Tensor) -> FP8Weight:
    """Per-output-channel e4m3 of a dense [N, K] weight (the channel's largest value maps to 448)."""
    w = weight.float()
    scales = (w.abs().amax(1) / E4M3_MAX).clamp_min(1e-12)
    return FP8Weight((w / scales[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scales)


def dequantize_fp8(w: FP8Weight) -> torch.Tensor:
    return w.codes.float() * w.scales[:, None]


def quantize_tokens_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic e4m3 of activations [M, K]: (codes, scales float32 [M])."""
    xf = x2.float()
    s = (xf.abs().amax(-1) / E4M3_MAX).clamp_min(1e-12)
    return (xf / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def fp8_linear(x: torch.Tensor, w: FP8Weight) -> torch.Tensor:
    """y = x @ W.T in x's dtype, W8A8 FP8 (see the module docstring)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q, s = act_quant.quantize_rows(x2, E4M3_MAX, E4M3) if act_quant.enabled(x2) else quantize_tokens_fp8(x2)
    if q.is_cuda:
        ones = torch.ones(CUDA_CHUNK, 1, dtype=torch.float32, device=q.device)
        # the GEMM's per-row scale is 1: s is applied afterwards, so padded rows need none
        acc = fixed_row_chunks(q, CUDA_CHUNK, lambda part: torch._scaled_mm(
            part, w.codes.t(), scale_a=ones, scale_b=w.scales[None, :], out_dtype=torch.float32))
        acc = acc * s[:, None]
    else:
        wf = w.codes.float()
        acc = fixed_row_chunks(q, CHUNK, lambda part: (wf @ part.float().t()).t()) * s[:, None] * w.scales[None, :]
    return acc.to(x.dtype).reshape(*shape[:-1], w.out_features)


class FP8Linear(PerChannelLinear):
    """The W8A8 FP8 product of one fused linear; fixed row chunks keep rows invariant on the CPU."""
    format = "w8a8-fp8"
    product = staticmethod(fp8_linear)


FORMAT = register(WeightFormat(
    "w8a8-fp8", "W8A8-FP8", FP8Weight, FP8Linear, quantize=quantize_fp8, dequantize=dequantize_fp8,
    description="e4m3 weights per output channel, e4m3 activations per token (dynamic), fp32 sums",
    gpu_proven=True, min_capability=(8, 9), hardware="FP8 tensor cores", aliases=("fp8",), code_bytes=1.0,
    channel_bytes=4.0, gpu_product="scaled_mm", quantizes_activations=True))
