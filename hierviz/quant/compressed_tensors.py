"""The compressed-tensors checkpoint layout (what llm-compressor writes and vLLM loads) for the
8-bit schemes hierviz runs: W8A8 int8 (`"format": "int-quantized"`) and FP8-dynamic
(`"format": "float-quantized"`).

config.json carries `quantization_config` with `"quant_method": "compressed-tensors"` and
`config_groups`, each a scheme for the modules it targets: `weights` (8 bits, `"type"` int or
float, `"strategy"` channel or tensor, symmetric) and `input_activations` (8 bits, same type,
`"strategy": "token"`, `"dynamic": true`). A quantized linear is stored as `<name>.weight` (int8 or
float8_e4m3fn codes, [N, K]) and `<name>.weight_scale` ([N, 1] per channel, or one value per
tensor), W = weight_scale * weight: exactly hierviz's W8A8 int8 and W8A8 FP8 weights (a per-tensor
scale is repeated per channel). Modules listed in `"ignore"` (the LM head) stay dense. Schemes
whose product differs from these formats' (static activation scales, weight-only, groups or
blocks, 4-bit packing) are refused with a message that names what was found.

Draft heads may be stored weight-only: int8 codes with per-channel scales and no
`input_activations` (`store_weight_only_int8`). A head is small and runs dense, so its loader
reads such a folder back as plain float tensors (`load_dense_tensors`), W = weight_scale * weight.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz.quant.errors import CheckpointError
from hierviz.quant.fp8 import FP8Weight
from hierviz.quant.gptq import cast_float, checkpoint_tensors, iter_tensors, load_state_dict_folder
from hierviz.quant.w8a8 import QMAX, W8Weight

QUANT_METHOD = "compressed-tensors"
WEIGHT_TYPES = {"int": W8Weight, "float": FP8Weight}
SCALE_SUFFIX = ".weight_scale"
STATIC_SUFFIXES = (".input_scale", ".weight_zero_point", ".input_zero_point")


def is_compressed_tensors(config: dict[str, Any]) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def config_groups(config: dict[str, Any]) -> dict[str, Any]:
    """The quantization schemes by group name; CheckpointError where there are none."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("compressed-tensors checkpoint without config_groups")
    return groups


def scheme_type(config: dict[str, Any]) -> str:
    """"int" or "float": the one 8-bit scheme of the checkpoint; CheckpointError for anything else."""
    types = set()
    for name, g in config_groups(config).items():
        w, a = (g or {}).get("weights") or {}, (g or {}).get("input_activations")
        kind = w.get("type")
        if w.get("num_bits") != 8 or kind not in WEIGHT_TYPES:
            raise CheckpointError(f"compressed-tensors group {name!r}: {w.get('num_bits')}-bit {kind} weights; hierviz "
                                  "reads 8-bit int (W8A8-int8) and 8-bit float (FP8-dynamic) schemes")
        if w.get("strategy") not in ("channel", "tensor") or w.get("symmetric") is False:
            raise CheckpointError(f"compressed-tensors group {name!r}: weight strategy {w.get('strategy')!r} "
                                  f"(symmetric={w.get('symmetric')}); hierviz reads symmetric channel or tensor scales")
        if not a or a.get("num_bits") != 8 or a.get("type") != kind or a.get("strategy") != "token" \
                or a.get("dynamic") is not True:
            got = "no input_activations (weight-only)" if not a else \
                f"{a.get('num_bits')}-bit {a.get('type')} activations, strategy {a.get('strategy')!r}, dynamic={a.get('dynamic')}"
            raise CheckpointError(f"compressed-tensors group {name!r}: {got}; hierviz's 8-bit formats quantize "
                                  "activations per token at run time (dynamic), like the W8A8 and FP8_DYNAMIC schemes")
        types.add(kind)
    if len(types) != 1:
        raise CheckpointError("compressed-tensors checkpoint mixes int and float schemes")
    return types.pop()


def _scales(scale: torch.Tensor, n: int, name: str) -> torch.Tensor:
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(n).contiguous()
    if s.numel() != n:
        raise CheckpointError(f"{name}{SCALE_SUFFIX} has {s.numel()} values for {n} output channels")
    return s


def ct_weights(folder: Path, config: dict[str, Any], device: torch.device | str = "cpu",
               dtype: Optional[torch.dtype] = None) -> tuple[list[str], Iterator[tuple[str, Any]]]:
    """(names, stream of (name, weight)): quantized linears as W8Weight / FP8Weight (codes and
    float32 scales on `device`), everything else as stored (floats cast to `dtype`)."""
    kind = scheme_type(config)
    weight_type = WEIGHT_TYPES[kind]
    located = checkpoint_tensors(folder)
    static = sorted(k for k in located if k.endswith(STATIC_SUFFIXES))
    if static:
        raise CheckpointError(f"compressed-tensors checkpoint has static quantization parameters ({static[0]}, ...); "
                              "hierviz's 8-bit formats quantize activations dynamically and symmetrically")
    quantized = {k[:-len(SCALE_SUFFIX)] for k in located if k.endswith(SCALE_SUFFIX)}
    missing = sorted(q for q in quantized if f"{q}.weight" not in located)
    if missing:
        raise CheckpointError(f"{missing[0]}{SCALE_SUFFIX} has no {missing[0]}.weight beside it")
    names = [k for k in located if not k.endswith(SCALE_SUFFIX)]

    def stream() -> Iterator[tuple[str, Any]]:
        codes: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for k, t in iter_tensors(located, device):
            base = k[:-len(SCALE_SUFFIX)] if k.endswith(SCALE_SUFFIX) else k[:-len(".weight")] \
                if k.endswith(".weight") else None
            if base not in quantized:
                yield k, cast_float(t, dtype)
                continue
            (scales if k.endswith(SCALE_SUFFIX) else codes)[base] = t
            if base in codes and base in scales:
                c = codes.pop(base)
                if c.dtype != weight_type.CODE_DTYPE:
                    raise CheckpointError(f"{base}.weight is {c.dtype}, not the {weight_type.CODE_DTYPE} of a "
                                          f"{kind}-quantized scheme")
                yield f"{base}.weight", weight_type(c, _scales(scales.pop(base), c.shape[0], base))
    return names, stream()


# ---- weight-only int8 storage of draft heads ---------------------------------------------------

WEIGHT_ONLY_INT8 = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "dynamic": False}}


def is_weight_only_int8(config: dict[str, Any]) -> bool:
    """Whether config.json declares the weight-only int8 per-channel scheme store_weight_only_int8
    writes; CheckpointError for any other weight-only compressed-tensors scheme."""
    if not is_compressed_tensors(config):
        return False
    for name, g in config_groups(config).items():
        w, a = (g or {}).get("weights") or {}, (g or {}).get("input_activations")
        if a:
            return False     # a W8A8 scheme: the target importer's (ct_weights)
        if (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("symmetric", True)) != (8, "int", "channel", True):
            raise CheckpointError(f"compressed-tensors group {name!r}: weight-only {w.get('num_bits')}-bit "
                                  f"{w.get('type')} weights, strategy {w.get('strategy')!r}; hierviz reads weight-only "
                                  "checkpoints as symmetric 8-bit int with per-channel scales")
    return True


def load_dense_tensors(folder: str | Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """All tensors of a folder (load_state_dict_folder), a weight-only int8 checkpoint's linears
    dequantized to their scales' dtype; anything else as stored."""
    weights = load_state_dict_folder(folder)
    if not is_weight_only_int8(config):
        return weights
    out = {k: v for k, v in weights.items() if not k.endswith(SCALE_SUFFIX)}
    for k in weights:
        if not k.endswith(SCALE_SUFFIX):
            continue
        base = k[:-len(SCALE_SUFFIX)]
        codes = weights.get(f"{base}.weight")
        if codes is None:
            raise CheckpointError(f"{k} has no {base}.weight beside it")
        if codes.dtype != torch.int8 or codes.dim() != 2:
            raise CheckpointError(f"{base}.weight is {codes.dtype} {tuple(codes.shape)}, not the int8 [N, K] codes "
                                  "of a weight-only int8 scheme")
        scale = weights[k]
        out[f"{base}.weight"] = (codes.float() * _scales(scale, codes.shape[0], base)[:, None]).to(scale.dtype)
    stray = sorted(k for k, v in out.items() if v.dtype == torch.int8)
    if stray:
        raise CheckpointError(f"{stray[0]} is int8 without a {SCALE_SUFFIX} beside it")
    return out


def store_weight_only_int8(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, quantization_config): every 2-D floating `*.weight` as int8 codes with a per-row
    scale (max |w| / QMAX, in the tensor's dtype), the rest unchanged; round to nearest."""
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        if not (k.endswith(".weight") and t.dim() == 2 and t.is_floating_point()):
            out[k] = t
            continue
        w = t.float()
        scale = (w.abs().amax(dim=1) / QMAX).clamp_min(torch.finfo(torch.float16).tiny).to(t.dtype)
        out[k] = torch.round(w / scale.float()[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
        out[f"{k[:-len('.weight')]}{SCALE_SUFFIX}"] = scale[:, None].contiguous()
    config = {"quant_method": QUANT_METHOD, "format": "int-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": WEIGHT_ONLY_INT8}, "ignore": []}
    return out, config
