"""A toy weight format for the extension test (tests/test_extension_format.py): W4 stored as dense
fp32. Its weight is the fp32 matrix a W4 RTN weight stands for, its product a plain matmul (in
fixed row chunks, so a row's bits do not depend on the row count, as a CPU verifier needs), its
quantizer the W4 RTN quantizer followed by dequantization. Everything a format needs is here and
in `toy_entry`; nothing in hierviz names it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hierviz.quant.formats import WeightFormat, fixed_row_chunks
from hierviz.quant.w4 import dequantize_unpermuted, quantize_rtn

NAME = "w4-as-fp32"
ALIAS = "toy-w4f32"
LABEL = "W4-as-FP32"
CHUNK = 8        # rows per product: one shape for every call


@dataclass
class DenseW4Weight:
    """The fp32 [N, K] matrix of a W4 weight."""
    weight: torch.Tensor
    batch_invariant: bool = False

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "DenseW4Weight":
        """Move to a device; the values stay fp32 (the format's point)."""
        return DenseW4Weight(self.weight.to(device), self.batch_invariant)


def quantize_toy(weight: torch.Tensor) -> DenseW4Weight:
    k = weight.shape[1]
    group = 32 if k % 32 == 0 else k
    return DenseW4Weight(dequantize_unpermuted(quantize_rtn(weight, group)).float())


class DenseW4Linear:
    format = NAME
    rows_invariant_cpu = True

    def __init__(self, weights: list[DenseW4Weight], kernel: str = "") -> None:
        self.weights = [DenseW4Weight(torch.cat([w.weight for w in weights]))] if len(weights) > 1 else weights

    def set_batch_invariant(self, on: bool) -> None:
        for w in self.weights:
            w.batch_invariant = on

    def __call__(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = self.weights[0].weight
        x2 = x.reshape(-1, x.shape[-1]).float()
        y = fixed_row_chunks(x2, CHUNK, lambda c: (w @ c.t()).t()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
        return y if add_to is None else add_to.add_(y)


def toy_entry() -> WeightFormat:
    """The registry entry (hierviz.quant.formats.register takes it)."""
    return WeightFormat(NAME, LABEL, DenseW4Weight, DenseW4Linear, quantize=quantize_toy,
                        dequantize=lambda w: w.weight, aliases=(ALIAS,), code_bytes=4.0, gpu_product="gemm",
                        description="W4 RTN values stored as dense fp32, a plain matmul (a test's toy)")


def toy_weight(n: int, k: int, seed: int = 0) -> Any:
    return quantize_toy(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
