"""4-bit weight quantizers: GPTQ (Frantar et al. 2022) and round-to-nearest as a fallback.

Both produce a GPTQResult: integer codes in the original input-channel order plus per-group
zero points and scales and g_idx, i.e. exactly what an AutoGPTQ checkpoint stores. From there
`.pack()` gives the checkpoint tensors (gptq.pack_gptq_linear) and `.to_w4()` the in-engine
W4Weight (through the same GPTQ importer, so a saved checkpoint and the in-memory weight agree).

GPTQ, briefly: for a layer y = x W^T and calibration inputs X, minimize ||X W^T - X Q^T||^2.
With H = 2 X^T X, quantize one input column at a time and spread its rounding error over the
not-yet-quantized columns through the inverse Hessian (via its upper Cholesky factor, which
equals the sequential OBS updates). Updates are applied lazily per block of columns for
speed. Per-group scale/zero are chosen when the quantizer reaches a group's first column,
from the already error-corrected weights. Act-order quantizes columns by decreasing diag(H).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

from .gptq import gptq_linear_to_w4, pack_gptq_linear
from .w4 import W4Weight

__all__ = ["GPTQResult", "HessianAccumulator", "gptq_quantize", "rtn_quantize", "find_params",
           "quantize_weights"]

MAXQ = 15


@dataclass
class GPTQResult:
    """Integer GPTQ output for one linear layer W [N, K]."""
    intcodes: torch.Tensor   # int [N, K], 0..15, original input-channel order
    zeros: torch.Tensor      # int [N, groups]
    scales: torch.Tensor     # float32 [N, groups] (values representable in fp16)
    g_idx: torch.Tensor      # int [K]
    group_size: int          # -1 = one group over all K

    def dequantize(self) -> torch.Tensor:
        """The float matrix [N, K] these integers represent (original channel order)."""
        g = self.g_idx.long()
        return self.scales[:, g] * (self.intcodes.float() - self.zeros[:, g].float())

    def pack(self, checkpoint_format: str = "gptq_v2", bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        return pack_gptq_linear(self.intcodes, self.zeros, self.scales, self.g_idx,
                                checkpoint_format=checkpoint_format, bias=bias)

    def to_w4(self) -> W4Weight:
        p = self.pack("gptq_v2")
        return gptq_linear_to_w4(p["qweight"], p["qzeros"], p["scales"], p["g_idx"],
                                 group_size=self.group_size, checkpoint_format="gptq_v2")


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over calibration rows x of a layer's input (float64 sums)."""

    def __init__(self, in_features: int) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.H += 2.0 * (x.t() @ x)
        self.n += x.shape[0]

    def pre_hook(self, module: Any, args: tuple) -> None:
        """Use as `module.register_forward_pre_hook(acc.pre_hook)` to collect a layer's inputs."""
        self.add_batch(args[0])

    @property
    def hessian(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration data was added to the Hessian")
        return (self.H / self.n).to(torch.float32)


def find_params(w: torch.Tensor, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero per row of w [N, G] (AutoGPTQ's convention: the range includes 0).

    Scales are rounded to fp16 here, so codes are chosen against the scale the checkpoint
    will actually store. min_zero=1 keeps zeros representable in the v1 ("zero - 1") format.
    """
    xmin = torch.clamp(w.amin(1), max=0)
    xmax = torch.clamp(w.amax(1), min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both0, -torch.ones_like(xmin), xmin)
    xmax = torch.where(both0, torch.ones_like(xmax), xmax)
    scale = (xmax - xmin) / MAXQ
    if sym:
        zero = torch.full_like(scale, (MAXQ + 1) // 2)
    else:
        zero = torch.round(-xmin / scale)
        if min_zero:
            # all-nonnegative group: shift the grid up so zero >= min_zero, keep xmax in range
            low = zero < min_zero
            scale = torch.where(low, xmax / (MAXQ - min_zero), scale)
            zero = torch.where(low, torch.full_like(zero, min_zero), zero)
    scale = scale.to(torch.float16).to(torch.float32)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0 ** -24))  # fp16 underflow
    return scale, zero


def _quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale) + zero, 0, MAXQ)


def _group_size_for(k: int, group_size: int) -> int:
    gs = k if group_size == -1 else group_size
    if gs <= 0 or k % gs:
        raise ValueError(f"group_size {group_size} must be -1 or divide in_features {k}")
    return gs


def rtn_quantize(weight: torch.Tensor, group_size: int = 128, sym: bool = False,
                 min_zero: int = 0) -> GPTQResult:
    """Round-to-nearest with GPTQ's min-max scale/zero per group (no calibration)."""
    n, k = weight.shape
    gs = _group_size_for(k, group_size)
    w = weight.detach().to(torch.float32)
    scales, zeros, codes = [], [], []
    for g0 in range(0, k, gs):
        s, z = find_params(w[:, g0:g0 + gs], sym, min_zero)
        codes.append(_quant(w[:, g0:g0 + gs], s[:, None], z[:, None]))
        scales.append(s)
        zeros.append(z)
    return GPTQResult(torch.cat(codes, 1).to(torch.int64), torch.stack(zeros, 1).to(torch.int64),
                      torch.stack(scales, 1), torch.arange(k) // gs, group_size)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, sym: bool = False,
                  act_order: bool = False, damp_percent: float = 0.01, block_size: int = 128,
                  min_zero: int = 0) -> GPTQResult:
    """GPTQ-quantize W [N, K] given H [K, K] (from HessianAccumulator)."""
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not match in_features {k}")
    gs = _group_size_for(k, group_size)
    W = weight.detach().to(torch.float32).clone()
    H = hessian.detach().to(torch.float32).clone()

    dead = torch.diag(H) == 0          # inputs never active: weight irrelevant, keep H invertible
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    W = W[:, perm]
    H = H[perm][:, perm]

    damp = damp_percent * torch.mean(torch.diag(H))
    H += damp * torch.eye(k)
    L = torch.linalg.cholesky(H)
    Hinv = torch.cholesky_inverse(L)
    U = torch.linalg.cholesky(Hinv, upper=True)  # rows of U drive the sequential updates

    # Blocks hold whole groups so a group's params come from fully updated weights (W1 below).
    if gs <= block_size:
        block_size = (block_size // gs) * gs
    else:
        block_size = gs
    Q = torch.zeros_like(W)
    scales = torch.zeros(n, k // gs)
    zeros = torch.zeros(n, k // gs)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gs == 0:
                s, z = find_params(W1[:, i:i + gs], sym, min_zero)
                scales[:, col // gs] = s
                zeros[:, col // gs] = z
            g = col // gs
            w = W1[:, i]
            q = _quant(w, scales[:, g], zeros[:, g])
            Q[:, col] = q
            err = (w - scales[:, g] * (q - zeros[:, g])) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    # Columns were processed in permuted order: group of permuted column j is j // gs.
    intcodes = torch.empty(n, k, dtype=torch.int64)
    intcodes[:, perm] = Q.to(torch.int64)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // gs
    return GPTQResult(intcodes, zeros.to(torch.int64), scales, g_idx, group_size)


def quantize_weights(weights: Mapping[str, torch.Tensor], modules: Iterable[str],
                     hessians: Optional[Mapping[str, torch.Tensor]] = None, *, group_size: int = 128,
                     sym: bool = False, act_order: bool = True, checkpoint_format: str = "gptq_v2",
                     damp_percent: float = 0.01) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Quantize the linear layers `modules` (HF module names, e.g. "model.layers.0.mlp.up_proj")
    of a float state dict -> (float_weights, packed) ready for gptq.save_gptq_checkpoint.

    A module with a Hessian in `hessians` is GPTQ-quantized, one without falls back to RTN.
    Biases (`<module>.bias`) travel inside the packed dict as AutoGPTQ stores them.
    """
    modules = list(modules)
    hessians = hessians or {}
    min_zero = 1 if checkpoint_format == "gptq" else 0   # v1 cannot store a zero point of 0
    floats = {k: v for k, v in weights.items()
              if not any(k in (f"{m}.weight", f"{m}.bias") for m in modules)}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for m in modules:
        if f"{m}.weight" not in weights:
            raise KeyError(f"no weight {m}.weight to quantize")
        w = weights[f"{m}.weight"]
        if m in hessians:
            r = gptq_quantize(w, hessians[m], group_size, sym, act_order, damp_percent, min_zero=min_zero)
        else:
            r = rtn_quantize(w, group_size, sym, min_zero=min_zero)
        packed[m] = r.pack(checkpoint_format, bias=weights.get(f"{m}.bias"))
    return floats, packed
