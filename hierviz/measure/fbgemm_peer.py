"""FBGEMM's mixed-input GEMM (`bf16i4bf16_rowwise`: CUTLASS, bf16 activations, int4 weights with
group-wise scales and zero points; PyPI `fbgemm-gpu-genai`) as a kernel-bench peer, where its wheel
matches the installed torch.

hierviz does not depend on it: where the package is absent or does not load against this torch
(its wheels are built per torch release), the bench says why and goes on. The operator has lived
in the `fbgemm` namespace and, in later releases, in `mslk`; whichever is registered is used.

The peer multiplies the engine's own asymmetric weight. FBGEMM computes W = q' * scale + zero per
group with signed codes q' = q - 8 (packed two per byte, even channel in the low nibble, as
hierviz packs them), so q' is q with each nibble's top bit flipped and zero = offset + 8 * scale;
scales and zero points are stored [K / G, N] (column-major per group) in bf16.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hierviz.quant.w4 import W4Weight, codes_of

IMPORTS = ("fbgemm_gpu.experimental.gen_ai", "mslk")      # packages that register the operator
NAMESPACES = ("fbgemm", "mslk")


def fbgemm_operands(w: W4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wq int8 [N, K / 2]: signed codes two per byte, scales bf16 [K / G, N], zeros bf16 [K / G, N])
    for `bf16i4bf16_rowwise`: (q - 8) * scales + zeros is w's matrix (up to bf16 rounding of the
    per-group values)."""
    if w.perm is not None:
        raise ValueError("FBGEMM's peer takes weights without an act-order permutation")
    wq = (codes_of(w) ^ 0x88).view(torch.int8)
    scales = w.scales.float()
    zeros = w.offsets.float() + 8.0 * scales
    return wq.contiguous(), scales.t().contiguous().to(torch.bfloat16), zeros.t().contiguous().to(torch.bfloat16)


def fbgemm_operator() -> Callable:
    """The registered bf16i4bf16_rowwise operator (ImportError where no package provides it)."""
    import importlib
    errors = []
    for name in IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as e:  # absent, or built against another torch
            errors.append(f"{name}: {type(e).__name__}: {str(e)[:150]}")
    for ns in NAMESPACES:
        op = getattr(getattr(torch.ops, ns, None), "bf16i4bf16_rowwise", None)
        if op is not None:
            try:
                op.default      # resolves the overload: raises where only a stub namespace exists
                return op
            except Exception as e:
                errors.append(f"torch.ops.{ns}: {type(e).__name__}: {str(e)[:150]}")
    raise ImportError("; ".join(errors) or "no bf16i4bf16_rowwise operator is registered")


def fbgemm_layers(ws: list[W4Weight], info: dict) -> Optional[list]:
    """FBGEMM's products (bf16 activations) for each weight copy, or None with the reason in
    info["fbgemm_error"]."""
    if not torch.cuda.is_available():
        info["fbgemm_error"] = "FBGEMM's mixed-input GEMM needs a CUDA GPU"
        return None
    try:
        op = fbgemm_operator()
    except ImportError as e:
        info["fbgemm_error"] = f"no FBGEMM int4 GEMM for torch {torch.__version__} ({e}); pip install fbgemm-gpu-genai"
        return None
    try:
        import importlib.metadata as md
        info["fbgemm_version"] = md.version("fbgemm-gpu-genai")
    except Exception:
        info["fbgemm_version"] = "unknown"
    try:
        layers = []
        for w in ws:
            wq, s, z = fbgemm_operands(w)
            layers.append(lambda x, wq=wq, s=s, z=z: op(x, wq, s, z))
        return layers
    except Exception as e:  # keep the rest of the bench alive
        info["fbgemm_error"] = repr(e)[:300]
        return None
