"""The W8A8 int8 weight format: int8 weights with one scale per output channel, activations
quantized to int8 per token at run time (dynamic, symmetric), the product in int32.

    W[n, k] ~= scales[n] * codes[n, k]          codes int8 [N, K], scales float32 [N]
    x[t, k] ~= s_x[t] * q[t, k]                  s_x = max_k |x[t, k]| / 127, q = round(x / s_x)
    y[t, n]  = s_x[t] * scales[n] * sum_k q[t, k] codes[n, k]

The integer sum is exact, so each row's result is independent of the other rows by construction:
a W8A8 target is batch-invariant at every row count with no special kernel. torch._int_mm does
the product on the CPU and on CUDA (where it wants more than 16 rows: fewer are padded with zeros,
which changes no row's bits). Outlier-heavy activations lose precision per token, as in SmoothQuant's
dynamic per-token mode; this format does not migrate scales into the weights.
"""
from __future__ import annotations


import torch

from hierviz.quant import act_quant
from hierviz.quant.formats import PerChannelLinear, PerChannelWeight, WeightFormat, register

QMAX = 127
CUDA_MIN_ROWS = 17     # torch._int_mm on CUDA wants m > 16


class W8Weight(PerChannelWeight):
    """int8 codes [N, K], float32 scales [N]."""
    CODE_DTYPE = torch.int8
    NAME = "W8"


def quantize_w8(weight: torch.Tensor) -> W8Weight:
    """Symmetric per-output-channel int8 of a dense [N, K] weight (round to nearest)."""
    w = weight.float()
    scales = (w.abs().amax(1) / QMAX).clamp_min(1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return W8Weight(codes, scales)


def dequantize_w8(w: W8Weight) -> torch.Tensor:
    return w.codes.float() * w.scales[:, None]


def quantize_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic symmetric int8 of activations [M, K]: (codes int8, scales float32 [M])."""
    xf = x2.float()
    s = (xf.abs().amax(-1) / QMAX).clamp_min(1e-12)
    return torch.round(xf / s[:, None]).clamp(-QMAX, QMAX).to(torch.int8), s


def w8a8_linear(x: torch.Tensor, w: W8Weight) -> torch.Tensor:
    """y = x @ W.T in x's dtype, through int8 x int8 -> int32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    q, s = act_quant.quantize_rows(x2, QMAX, torch.int8) if act_quant.enabled(x2) else quantize_tokens(x2)
    m = q.shape[0]
    if q.is_cuda and m < CUDA_MIN_ROWS:     # zero rows add nothing to any sum: no row's bits change
        q = torch.cat([q, q.new_zeros(CUDA_MIN_ROWS - m, q.shape[1])])
    acc = torch._int_mm(q, w.codes.t())[:m]
    y = acc.float() * s[:, None] * w.scales[None, :]
    return y.to(x.dtype).reshape(*shape[:-1], w.out_features)


class W8A8Linear(PerChannelLinear):
    """The W8A8 int8 product of one fused linear; integer sums are exact, so rows are invariant."""
    format = "w8a8-int8"
    product = staticmethod(w8a8_linear)


FORMAT = register(WeightFormat(
    "w8a8-int8", "W8A8-int8", W8Weight, W8A8Linear, quantize=quantize_w8, dequantize=dequantize_w8,
    description="int8 weights per output channel, int8 activations per token (dynamic), int32 products",
    gpu_proven=True, aliases=("int8",), code_bytes=1.0, channel_bytes=4.0, gpu_product="int_mm",
    quantizes_activations=True))
