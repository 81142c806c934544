"""GemLite (github.com/dropbox/gemlite, Triton W4A16 kernels; `pip install gemlite`) as a
kernel-bench peer, where it is installed.

GemLite is a PyPI package of Triton kernels (a GEMV with "reversed" split-K for one token, split-K
and plain GEMMs above), so it runs where Triton runs; it needs CUDA at import. hierviz does not
depend on it: where it is absent or fails, the bench says why and goes on.

The peer multiplies the engine's own asymmetric weight, not a stand-in: GemLite's grouped integer
mode (`fma_mode`) computes W = q * s + z' per group, with z' = -zeros * s, and hierviz's W4 weight
is W = q * s + offset, so zeros = -offset / s (fp16: z' differs from the offset by its rounding,
far below the bench's error bound).
"""
from __future__ import annotations

from typing import Optional

import torch

from hierviz.quant.w4 import W4Weight, codes_of, unpack_codes


def gemlite_operands(w: W4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K] in 0..15, scales fp16 [N, K / G], zeros fp16 [N, K / G]) for GemLite's
    `A16Wn.from_weights`: q * scales - zeros * scales is w's matrix."""
    if w.perm is not None:
        raise ValueError("GemLite's peer takes weights without an act-order permutation")
    q = unpack_codes(codes_of(w)).to(torch.uint8)
    s = w.scales.float()
    zeros = torch.where(s != 0, -w.offsets.float() / torch.where(s != 0, s, 1.0), 0.0)
    return q, w.scales.to(torch.float16), zeros.to(torch.float16)


def gemlite_layers(ws: list[W4Weight], info: dict) -> Optional[list]:
    """GemLite's fp16 layers for each weight copy, or None with the reason in info["gemlite_error"]."""
    if not torch.cuda.is_available():
        info["gemlite_error"] = "GemLite needs a CUDA GPU"
        return None
    try:
        import gemlite
        from gemlite.helper import A16Wn
    except Exception as e:  # absent, or an import that fails on this torch / Triton
        info["gemlite_error"] = f"gemlite not importable ({type(e).__name__}: {str(e)[:200]}); pip install gemlite"
        return None
    info["gemlite_version"] = getattr(gemlite, "__version__", "unknown")
    try:
        layers = []
        for w in ws:
            q, s, z = gemlite_operands(w)
            layers.append(A16Wn(device=str(q.device), dtype=torch.float16).from_weights(
                q, s, z, W_nbits=4, group_size=w.group_size))
        return layers
    except Exception as e:  # keep the rest of the bench alive
        info["gemlite_error"] = repr(e)[:300]
        return None
