"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout), read and written natively.

A 4-bit GPTQ linear layer W [N, K] (out x in) is stored as
  qweight int32 [K/8, N]        8 codes per word along K; code i of a word sits at bits 4i
  qzeros  int32 [groups, N/8]   zero points, packed the same way along N
  scales  fp16  [groups, N]
  g_idx   int32 [K]             group of each input channel (not monotone for desc_act)
  bias    fp16  [N]             optional
and W[n, k] = scales[g, n] * (q[k, n] - z[g, n]) with g = g_idx[k], where
z = stored + 1 for checkpoint_format "gptq" (v1: AutoGPTQ historically stored zero - 1) and
z = stored for "gptq_v2" (GPTQModel). We convert into hierviz's one W4 format (w4.py) with a
float offset = -scale * zero per group; act-order checkpoints get an input permutation that
makes every group contiguous.

We do not import auto-gptq / gptqmodel: the layout is small and stable, and those packages do
not import cleanly with current transformers.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .errors import CheckpointError
from .w4 import W4Weight

__all__ = [
    "CheckpointError", "GPTQ_FORMATS", "gptq_linear_to_w4", "pack_gptq_linear",
    "normalize_quantize_config", "read_quantize_config", "load_state_dict_folder",
    "load_gptq_weights", "save_gptq_checkpoint",
]

GPTQ_FORMATS = ("gptq", "gptq_v2")
_PACK = 8  # 4-bit codes per int32 word

PathLike = Union[str, os.PathLike]


# ---- bit packing ------------------------------------------------------------------------------

def _unpack_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> int64 nibbles, 8 per word along `dim` (nibble i at bits 4i)."""
    w = words.to(torch.int64) & 0xFFFFFFFF  # view as unsigned so the sign bit is just bit 31
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = w.movedim(dim, -1)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF  # [..., words, 8]
    nib = nib.reshape(*w.shape[:-1], w.shape[-1] * _PACK)
    return nib.movedim(-1, dim)


def _pack_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """int nibbles (0..15) -> int32 words, 8 per word along `dim` (inverse of _unpack_int32)."""
    c = codes.to(torch.int64).movedim(dim, -1)
    if c.shape[-1] % _PACK:
        raise CheckpointError(f"cannot pack {c.shape[-1]} 4-bit values into int32 words: "
                              f"the packed dimension must be a multiple of {_PACK}")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // _PACK, _PACK)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (c << shifts).sum(-1)  # distinct bit ranges, so sum == bitwise or
    # Two's complement wrap into int32 (explicit: int64 -> int32 casts of large values are UB).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in GPTQ_FORMATS:
        raise CheckpointError(f"unsupported GPTQ checkpoint_format {checkpoint_format!r}; "
                              f"supported: {', '.join(GPTQ_FORMATS)}")


# ---- one linear layer ---------------------------------------------------------------------------

def gptq_linear_to_w4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: Optional[torch.Tensor], *, group_size: int,
                      checkpoint_format: str = "gptq", name: str = "linear") -> W4Weight:
    """Convert one packed 4-bit GPTQ linear into a W4Weight, exactly.

    offsets = -scale * zero is computed in float32, which is exact for fp16 scales and 4-bit
    integer zeros, so dequantize(result) reproduces scales * (q - z) bit for bit.
    For act-order (desc_act) checkpoints perm = stable argsort(g_idx); perm is None when g_idx
    is already in order.
    """
    _check_format(checkpoint_format)
    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise CheckpointError(f"{name}: qweight/qzeros/scales must be 2-D, got "
                              f"{tuple(qweight.shape)}, {tuple(qzeros.shape)}, {tuple(scales.shape)}")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise CheckpointError(f"{name}: qweight/qzeros must be int32 (bits=4 packing), got "
                              f"{qweight.dtype}/{qzeros.dtype}")
    k = qweight.shape[0] * _PACK
    n = qweight.shape[1]
    gs = k if group_size == -1 else group_size
    if gs <= 0:
        raise CheckpointError(f"{name}: invalid group_size {group_size}")
    if k % gs:
        raise CheckpointError(f"{name}: in_features {k} is not a multiple of group_size {gs}; "
                              "partial last groups are not supported by the W4 format")
    groups = k // gs
    if tuple(scales.shape) != (groups, n):
        raise CheckpointError(f"{name}: scales shape {tuple(scales.shape)} does not match "
                              f"[groups={groups}, out_features={n}] (in_features {k}, group_size {group_size})")
    if tuple(qzeros.shape) != (groups, n // _PACK) or n % _PACK:
        raise CheckpointError(f"{name}: qzeros shape {tuple(qzeros.shape)} does not match "
                              f"[groups={groups}, out_features/8={n / _PACK:g}]")
    if g_idx is None:
        g_idx = torch.arange(k) // gs
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != k:
        raise CheckpointError(f"{name}: g_idx has {g_idx.numel()} entries, expected in_features {k}")

    q = _unpack_int32(qweight, 0)              # [K, N]
    z = _unpack_int32(qzeros, 1)               # [groups, N]
    if checkpoint_format == "gptq":
        z = z + 1                               # v1 stores zero - 1

    # Sorting channels by group makes every group a contiguous run of gs channels; this only
    # works if each group has exactly gs members (true for GPTQ act-order and static groups).
    sorted_g, perm = torch.sort(g_idx, stable=True)
    if not torch.equal(sorted_g, torch.arange(k) // gs):
        raise CheckpointError(f"{name}: g_idx does not assign exactly {gs} input channels to each "
                              f"of the {groups} groups; cannot represent it with contiguous groups")
    if torch.equal(perm, torch.arange(k)):
        perm_out = None
    else:
        q = q.index_select(0, perm)
        perm_out = perm
    # Pack pairs along K while q is still [K, N] (row slices: much faster than w4.pack_codes on
    # the transposed view); same layout: even k in the low nibble.
    codes = (q[0::2] | (q[1::2] << 4)).to(torch.uint8).t().contiguous()   # [N, K/2]
    s = scales.to(torch.float32)
    offsets = -(s * z.to(torch.float32))
    return W4Weight(codes, s.t().contiguous(), offsets.t().contiguous(), gs, perm_out)


def pack_gptq_linear(intcodes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: Optional[torch.Tensor] = None, *, group_size: Optional[int] = None,
                     checkpoint_format: str = "gptq",
                     bias: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Pack integer GPTQ results into AutoGPTQ's tensors (qweight, qzeros, scales, g_idx[, bias]).

    intcodes: int [N, K] in 0..15, in the original input-channel order.
    zeros:    int [N, groups], the true zero points (0..15; v1 can store 1..16 only).
    scales:   float [N, groups] (stored as fp16).
    g_idx:    [K] group of each input channel; default arange(K) // group_size.
    """
    _check_format(checkpoint_format)
    n, k = intcodes.shape
    if zeros.dim() != 2 or zeros.shape[0] != n or tuple(scales.shape) != tuple(zeros.shape):
        raise CheckpointError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must both "
                              f"be [out_features={n}, groups]")
    groups = zeros.shape[1]
    if g_idx is None:
        if group_size is None:
            raise CheckpointError("pack_gptq_linear needs g_idx or group_size")
        gs = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // gs
    g_idx = g_idx.to(torch.int64).reshape(-1)
    if g_idx.numel() != k or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise CheckpointError(f"g_idx must hold {k} group indices in [0, {groups})")
    if int(intcodes.min()) < 0 or int(intcodes.max()) > 15:
        raise CheckpointError("4-bit codes must lie in 0..15")
    stored = zeros.to(torch.int64)
    if checkpoint_format == "gptq":
        stored = stored - 1
        if int(stored.min()) < 0 or int(stored.max()) > 15:
            raise CheckpointError("checkpoint_format 'gptq' (v1) stores zero - 1 and so can only "
                                  "hold zero points 1..16; use 'gptq_v2' for zero points of 0")
    elif int(stored.min()) < 0 or int(stored.max()) > 15:
        raise CheckpointError("gptq_v2 zero points must lie in 0..15")
    out = {
        "qweight": _pack_int32(intcodes.t(), 0),           # [K/8, N]
        "qzeros": _pack_int32(stored.t(), 1),              # [groups, N/8]
        "scales": scales.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


# ---- quantize_config ----------------------------------------------------------------------------

def normalize_quantize_config(qc: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults and check that hierviz can load this GPTQ config (4-bit, gptq/gptq_v2)."""
    qc = dict(qc)
    method = str(qc.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise CheckpointError(f"quant_method {method!r} is not GPTQ; only GPTQ checkpoints are supported")
    # GPTQModel renamed checkpoint_format to format; absent means v1 (AutoGPTQ).
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq")) or "gptq"
    _check_format(fmt)
    bits = int(qc.get("bits", 4))
    if bits != 4:
        raise CheckpointError(f"GPTQ bits={bits} is not supported; hierviz loads 4-bit checkpoints only")
    qc.update(quant_method="gptq", checkpoint_format=fmt, bits=4,
              group_size=int(qc.get("group_size", 128)), desc_act=bool(qc.get("desc_act", False)),
              sym=bool(qc.get("sym", True)), true_sequential=bool(qc.get("true_sequential", True)))
    return qc


def read_quantize_config(folder: PathLike, config: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """quantize_config.json, else config.json's quantization_config, normalized."""
    path = Path(folder) / "quantize_config.json"
    if path.exists():
        qc = _read_json(path)
    elif config is not None and "quantization_config" in config:
        qc = config["quantization_config"]
    else:
        raise CheckpointError(f"{folder}: no quantize_config.json and no quantization_config in "
                              "config.json; this is not a GPTQ checkpoint")
    return normalize_quantize_config(qc)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt JSON in {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


# ---- folders of tensors -----------------------------------------------------------------------

def _load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    try:
        out = {}
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
        return out
    except FileNotFoundError:
        raise CheckpointError(f"missing weights file {path}") from None
    except Exception as e:  # safetensors raises its own error types for bad headers/sizes
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None


def _load_bin_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True)  # never unpickle code
    except FileNotFoundError:
        raise CheckpointError(f"missing weights file {path}") from None
    except Exception as e:
        raise CheckpointError(f"corrupt or unsafe PyTorch weights file {path}: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a flat dict of tensors")
    return sd


def load_state_dict_folder(folder: PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF-style folder: (sharded) safetensors first, `.bin` as a fallback."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    for index_name, loader in (("model.safetensors.index.json", _load_safetensors_file),
                               ("pytorch_model.bin.index.json", _load_bin_file)):
        index = folder / index_name
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            out: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                out.update(loader(folder / shard))
            missing = sorted(set(weight_map) - set(out))
            if missing:
                raise CheckpointError(f"{index} lists tensors not found in its shards: {missing[:5]}")
            return out
    files = sorted(folder.glob("*.safetensors"))
    if files:
        out = {}
        for f in files:
            out.update(_load_safetensors_file(f))
        return out
    bins = sorted(folder.glob("*.bin"))
    if (folder / "pytorch_model.bin").exists():
        return _load_bin_file(folder / "pytorch_model.bin")
    if bins:
        out = {}
        for f in bins:
            out.update(_load_bin_file(f))
        return out
    raise CheckpointError(f"{folder}: no *.safetensors or *.bin weights found")


# ---- whole checkpoints ---------------------------------------------------------------------------

def load_gptq_weights(folder: PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a GPTQ checkpoint folder -> (config, weights).

    config is config.json with a normalized "quantization_config". weights maps HF parameter
    names to float tensors (stored dtype) or, for each quantized linear `<m>`, a W4Weight under
    `<m>.weight` (and its bias, if any, under `<m>.bias`).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config = _read_json(folder / "config.json")
    qc = read_quantize_config(folder, config)
    config["quantization_config"] = qc
    raw = load_state_dict_folder(folder)

    modules = sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight"))
    if not modules:
        raise CheckpointError(f"{folder}: no '*.qweight' tensors; not a GPTQ checkpoint")
    weights: dict[str, Any] = {}
    used: set[str] = set()
    for m in modules:
        parts = {}
        for part in ("qweight", "qzeros", "scales"):
            key = f"{m}.{part}"
            if key not in raw:
                raise CheckpointError(f"{folder}: quantized module {m!r} is missing tensor {key!r}")
            parts[part] = raw[key]
            used.add(key)
        g_idx = raw.get(f"{m}.g_idx")
        used.add(f"{m}.g_idx")
        weights[f"{m}.weight"] = gptq_linear_to_w4(
            parts["qweight"], parts["qzeros"], parts["scales"], g_idx,
            group_size=qc["group_size"], checkpoint_format=qc["checkpoint_format"], name=m)
        if f"{m}.bias" in raw:
            bias = raw[f"{m}.bias"]
            if bias.numel() != weights[f"{m}.weight"].out_features:
                raise CheckpointError(f"{folder}: {m}.bias has {bias.numel()} entries, expected "
                                      f"{weights[f'{m}.weight'].out_features}")
            weights[f"{m}.bias"] = bias
            used.add(f"{m}.bias")
    for key, value in raw.items():
        if key not in used:
            weights[key] = value
    return config, weights


def save_gptq_checkpoint(folder: PathLike, config: dict[str, Any], float_weights: dict[str, torch.Tensor],
                         quantized: dict[str, dict[str, torch.Tensor]],
                         quantize_config: dict[str, Any]) -> Path:
    """Write an AutoGPTQ-layout folder: config.json (with quantization_config),
    quantize_config.json and model.safetensors.

    quantized maps module names (e.g. "model.layers.0.mlp.up_proj") to the tensors from
    pack_gptq_linear; float_weights holds every other parameter under its HF name.
    """
    from safetensors.torch import save_file

    qc = normalize_quantize_config({"damp_percent": 0.01, "static_groups": False,
                                    "model_file_base_name": "model", **quantize_config})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in float_weights.items():
        # clone: safetensors refuses tensors that share storage (tied embeddings, views)
        tensors[key] = t.detach().contiguous().clone()
    for m, parts in quantized.items():
        for part in ("qweight", "qzeros", "scales"):
            if part not in parts:
                raise CheckpointError(f"quantized module {m!r} lacks {part!r}")
        for part, t in parts.items():
            key = f"{m}.{part}"
            if key in tensors:
                raise CheckpointError(f"tensor {key!r} given both as float and quantized")
            tensors[key] = t.detach().contiguous().clone()
    cfg = dict(config)
    cfg["quantization_config"] = qc
    with open(folder / "config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    with open(folder / "quantize_config.json", "w", encoding="utf-8") as f:
        json.dump(qc, f, indent=2)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
