"""The W8A8 int8 weight format: int8 weights with one scale per output channel, activations
quantized to int8 per token at run time (dynamic, symmetric), the product in int32.

    W[n, k] ~= scales[n] * codes[n, k]          codes int8 [N, K], scales float32 [N]
    x[t, k] ~= s_x[t] * q[t, k]                  s_x = max_k |x[t, k]| / 127, q = round(x / s_x)
    y[t, n]  = s_x[t] * scales[n] * sum_k q[t, k] codes[n, k]

The integer sum is exact, so each row's result is independent of the other rows by construction:
a W8A8 target is batch-invariant at every row count with no special kernel. torch._int_mm does
the product on the CPU and on CUDA (where it wants more than 16 rows: fewer are padded, which
changes no row's bits). Outlier-heavy activations lose precision per token, as in SmoothQuant's
dynamic per-token mode; this format does not migrate scales into the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hierviz.quant.formats import WeightFormat, register

QMAX = 127
CUDA_MIN_ROWS = 17     # torch._int_mm on CUDA wants m > 16


@dataclass
class W8Weight:
    codes: torch.Tensor      # int8 [N, K]
    scales: torch.Tensor     # float32 [N]
    batch_invariant: bool = False   # always true of the product; kept for the format interface

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.codes.dim() != 2:
            raise ValueError(f"W8 codes must be a 2-D int8 tensor, got {self.codes.dtype} {tuple(self.codes.shape)}")
        if tuple(self.scales.shape) != (self.codes.shape[0],):
            raise ValueError(f"W8 scales must have shape ({self.codes.shape[0]},), got {tuple(self.scales.shape)}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "W8Weight":
        """Move to a device (codes stay int8, scales float32: dtype is the activations' business)."""
        return W8Weight(self.codes.to(device), self.scales.to(device), self.batch_invariant)


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
    q, s = quantize_tokens(x2)
    m = q.shape[0]
    if q.is_cuda and m < CUDA_MIN_ROWS:
        q = torch.cat([q, q.new_zeros(CUDA_MIN_ROWS - m, q.shape[1])])
    acc = torch._int_mm(q, w.codes.t())[:m]
    y = acc.float() * s[:, None] * w.scales[None, :]
    return y.to(x.dtype).reshape(*shape[:-1], w.out_features)


class W8A8Linear:
    """The W8A8 int8 product of one fused linear (parts concatenated into one weight)."""

    format = "w8a8-int8"
    rows_invariant_cpu = True     # integer sums are exact

    def __init__(self, weights: list[W8Weight], kernel: str = "int_mm") -> None:
        self.weights = weights if len(weights) == 1 else [
            W8Weight(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]))]

    def set_batch_invariant(self, on: bool) -> None:
        for w in self.weights:     # nothing to switch: integer sums are exact
            w.batch_invariant = on

    def __call__(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = w8a8_linear(x, self.weights[0])
        return y if add_to is None else add_to.add_(y)


FORMAT = register(WeightFormat(
    "w8a8-int8", "W8A8-int8", W8Weight, W8A8Linear, quantize=quantize_w8, dequantize=dequantize_w8,
    description="int8 weights per output channel, int8 activations per token (dynamic), int32 products"))
