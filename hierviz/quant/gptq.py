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
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from .errors import CheckpointError
from .w4 import W4Weight

__all__ = [
    "CheckpointError", "GPTQ_FORMATS", "gptq_linear_to_w4", "pack_gptq_linear",
    "normalize_quantize_config", "read_quantize_config", "checkpoint_tensors", "iter_tensors",
    "load_state_dict_folder", "gptq_weights", "load_gptq_weights", "save_gptq_checkpoint", "MAP_WINDOW",
]

GPTQ_FORMATS = ("gptq", "gptq_v2")
_PACK = 8  # 4-bit codes per int32 word

PathLike = Union[str, os.PathLike]


# ---- bit packing ------------------------------------------------------------------------------

def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> uint8 values [..., 8W], value i of a word from bits 4i. One byte per
    value (a layer's unpacked codes take twice its packed bytes), on the words' device."""
    return torch.stack([((words >> (4 * i)) & 0xF).to(torch.uint8) for i in range(_PACK)], -1).flatten(-2)


def _pack_int32(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """int nibbles (0..15) -> int32 words, 8 per word along `dim` (inverse of _unpack_nibbles)."""
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
    is already in order. Runs on the tensors' device (a streaming load's target device); the
    temporaries are one transposing copy of qweight, or with act-order two bytes per packed byte.
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
    dev = qweight.device
    in_order = torch.arange(k, device=dev) // gs
    perm_out = None
    if g_idx is not None:
        g_idx = g_idx.to(device=dev, dtype=torch.int64).reshape(-1)
        if g_idx.numel() != k:
            raise CheckpointError(f"{name}: g_idx has {g_idx.numel()} entries, expected in_features {k}")
        # Sorting channels by group makes every group a contiguous run of gs channels; this only
        # works if each group has exactly gs members (true for GPTQ act-order and static groups).
        sorted_g, perm = torch.sort(g_idx, stable=True)
        if not torch.equal(sorted_g, in_order):
            raise CheckpointError(f"{name}: g_idx does not assign exactly {gs} input channels to each "
                                  f"of the {groups} groups; cannot represent it with contiguous groups")
        if not torch.equal(perm, torch.arange(k, device=dev)):
            perm_out = perm

    qt = qweight.t()                              # [N, K/8]: word w of row n holds k = 8w .. 8w+7
    if perm_out is None:
        # W4 byte j of a row holds codes 2j (low nibble) and 2j+1 (high), which is byte j % 4 of
        # word j // 4 (bits 8b..8b+7 are codes 8w+2b, 8w+2b+1): the words' bytes, least significant
        # first, i.e. their memory on a little-endian machine (CPUs and GPUs torch runs on)
        if sys.byteorder == "little":
            codes = qt.contiguous().view(torch.uint8)
        else:
            codes = torch.stack([((qt >> (8 * b)) & 0xFF).to(torch.uint8) for b in range(4)], -1).flatten(-2)
    else:
        q = _unpack_nibbles(qt).index_select(1, perm_out)    # [N, K] uint8, groups contiguous
        codes = q[:, 0::2] | (q[:, 1::2] << 4)
        del q
    z = _unpack_nibbles(qzeros).to(torch.float32)             # [groups, N]
    if checkpoint_format == "gptq":
        z = z + 1                                             # v1 stores zero - 1
    s = scales.to(torch.float32)
    offsets = -(s * z)
    return W4Weight(codes.contiguous(), s.t().contiguous(), offsets.t().contiguous(), gs, perm_out)


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


# ---- folders of tensors, streamed ------------------------------------------------------------
#
# A load reads one tensor at a time, memory-mapped, copies it onto the target device (the GPU for a
# CUDA load) and lets go of the mapping, so the host holds about one tensor (at most MAP_WINDOW
# bytes of a shard's pages, or one tensor if larger) whatever the checkpoint's size; every
# conversion (GPTQ repack, casts, q/k/v fusing) then runs where the weights end up.

MAP_WINDOW = 1 << 30     # bytes of a safetensors file mapped at once before it is reopened

TensorSource = tuple[Path, str]            # (file, "safetensors" | "bin")


def _open_safetensors(path: Path):
    from safetensors import safe_open
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"missing weights file {path}") from None
    except Exception as e:  # safetensors raises its own error types for bad headers/sizes
        raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None


def _safetensors_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file in the order of their data (the header only)."""
    with _open_safetensors(path) as f:
        return list(f.offset_keys())


def _load_bin_file(path: Path) -> dict[str, torch.Tensor]:
    """A `.bin` state dict, memory-mapped where its format allows (torch.save's zip format) and
    never unpickling code (weights_only)."""
    try:
        # torch.save's zip format can be mapped; the legacy one (and any non-zip file) is read whole
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except FileNotFoundError:
        raise CheckpointError(f"missing weights file {path}") from None
    except Exception as e:
        raise CheckpointError(f"corrupt or unsafe PyTorch weights file {path}: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} does not hold a flat dict of tensors")
    return sd


def _place(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t copied onto `device`: a new tensor even on the host, so nothing keeps a file mapped."""
    out = t.to(device)
    return out.clone() if out is t else out


def _names_in(files: list[Path], kind: Optional[str] = None) -> dict[str, TensorSource]:
    located: dict[str, TensorSource] = {}
    for f in files:
        k = kind or ("safetensors" if f.suffix == ".safetensors" else "bin")
        names = _safetensors_names(f) if k == "safetensors" else list(_load_bin_file(f))
        for name in names:
            located.pop(name, None)     # a name in two files: the later file's copy is read, in its turn
            located[name] = (f, k)
    return located


def checkpoint_tensors(folder: PathLike) -> dict[str, TensorSource]:
    """Every tensor of an HF-style folder -> the file it is read from, in reading order:
    (sharded) safetensors first, `.bin` as a fallback. Reads file headers only (a `.bin`'s pickle)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    for index_name, kind in (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "bin")):
        index = folder / index_name
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            located = _names_in([folder / shard for shard in sorted(set(weight_map.values()))], kind)
            missing = sorted(set(weight_map) - set(located))
            if missing:
                raise CheckpointError(f"{index} lists tensors not found in its shards: {missing[:5]}")
            return located
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return _names_in(files)
    if (folder / "pytorch_model.bin").exists():
        return _names_in([folder / "pytorch_model.bin"])
    bins = sorted(folder.glob("*.bin"))
    if bins:
        return _names_in(bins)
    raise CheckpointError(f"{folder}: no *.safetensors or *.bin weights found")


_MALLOC_TRIM: Any = None     # glibc's malloc_trim, found on first use (False: none here)


def _trim_host_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). A CPU load frees a
    packed tensor for each repacked one and the pieces of each fused layer; without this those
    holes between kept weights stay resident."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):       # not glibc: nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


def _read_safetensors(path: Path, names: list[str], device) -> Iterator[tuple[str, torch.Tensor]]:
    """names of one safetensors file, each copied onto `device` as it is read. The file is mapped
    about MAP_WINDOW bytes at a time (closed and reopened before a tensor that would take a
    window past that), so the pages read stay resident for at most max(MAP_WINDOW, one tensor),
    not for the whole shard."""
    host = torch.device(device).type == "cpu"
    i = 0
    while i < len(names):
        if host and i:
            _trim_host_heap()
        mapped = 0
        with _open_safetensors(path) as f:
            while i < len(names):
                try:
                    view = f.get_tensor(names[i])        # a view of the mapping: no page read yet
                except Exception as e:
                    raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None
                if mapped and mapped + view.nbytes > MAP_WINDOW:
                    break                                # it starts the next window
                mapped += view.nbytes
                out = _place(view, device)
                del view
                yield names[i], out
                del out
                i += 1
            view = None                                  # nothing of this mapping is left


def _read_bin(path: Path, names: list[str], device) -> Iterator[tuple[str, torch.Tensor]]:
    sd = _load_bin_file(path)           # mapped: a tensor's pages are read when it is placed
    for name in names:
        out = _place(sd.pop(name), device)
        yield name, out
        del out


def _by_file(located: dict[str, TensorSource]) -> dict[TensorSource, list[str]]:
    by_file: dict[TensorSource, list[str]] = {}
    for name, src in located.items():
        by_file.setdefault(src, []).append(name)
    return by_file


def iter_tensors(located: dict[str, TensorSource], device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device`) for each tensor of checkpoint_tensors(folder), one at a time,
    file by file, each a copy of its own (nothing keeps a file mapped): the host holds one
    mapping window's pages (MAP_WINDOW, or one tensor) at a time. Tensors keep their stored dtype."""
    host = torch.device(device).type == "cpu"
    for n, ((path, kind), names) in enumerate(_by_file(located).items()):
        if host and n:
            _trim_host_heap()
        yield from (_read_safetensors if kind == "safetensors" else _read_bin)(path, names, device)


def gather_parts(tensors: Iterator[tuple[str, torch.Tensor]], part_of: dict[str, tuple[str, str]],
                 expected: dict[str, int]) -> Iterator[tuple[str, torch.Tensor | None, dict[str, torch.Tensor] | None]]:
    """Streams a checkpoint whose quantized weights are stored in parts: a tensor that is no part
    comes as (key, tensor, None); the parts of one weight (part_of[key] = (weight, part)) are held
    only until all expected[weight] of them have come, then come as (weight, None, {part: tensor})."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors:
        if key not in part_of:
            yield key, t, None
            continue
        name, part = part_of[key]
        got = pending.setdefault(name, {})
        got[part] = t
        del t
        if len(got) == expected[name]:
            del got                 # nothing here holds a part while the caller builds its weight
            yield name, None, pending.pop(name)


def load_state_dict_folder(folder: PathLike, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of an HF-style folder (stored dtypes). On the host they are views of the files'
    memory maps (no copy; a page is read when it is first used), for a caller that keeps or moves
    them all (EAGLE heads, training); on another device each is copied there as it is read
    (iter_tensors). Model loads stream instead (hierviz.models.loading)."""
    located = checkpoint_tensors(folder)
    if torch.device(device).type != "cpu":
        return dict(iter_tensors(located, device))
    out: dict[str, torch.Tensor] = {}
    for (path, kind), names in _by_file(located).items():
        if kind == "bin":
            sd = _load_bin_file(path)
            out.update((name, sd[name]) for name in names)
            continue
        with _open_safetensors(path) as f:
            for name in names:
                try:
                    out[name] = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"corrupt or truncated safetensors file {path}: {e}") from None
    return out


def cast_float(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """t as dtype where it is a floating-point tensor and dtype is given (on t's device)."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def cast_w4(w: W4Weight, dtype: Optional[torch.dtype]) -> W4Weight:
    """w with scales and offsets as dtype (codes and perm unchanged; as W4Weight.to does)."""
    if dtype is None:
        return w
    return W4Weight(w.codes, w.scales.to(dtype), w.offsets.to(dtype), w.group_size, w.perm, w.batch_invariant)


# ---- whole checkpoints ---------------------------------------------------------------------------

_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")

Stream = Iterator[tuple[str, Any]]


def gptq_weights(folder: PathLike, device: torch.device | str = "cpu",
                 dtype: Optional[torch.dtype] = None) -> tuple[dict[str, Any], list[str], Stream]:
    """A GPTQ checkpoint folder as (config, names, stream): config.json with a normalized
    "quantization_config"; the names of the weights, from the files' headers; and a generator
    that reads them onto `device`, yielding (name, weight) in file order.

    A weight is a float tensor (stored dtype, or `dtype` when given) or, for each quantized
    linear `<m>`, a W4Weight under `<m>.weight` (its bias, if any, under `<m>.bias`), with W4
    scales and offsets in float32 or `dtype`. Each linear is repacked on `device` as soon as its
    tensors have arrived (they may sit in different shards) and its packed tensors dropped then.
    Header problems (missing parts, shards, corrupt files) are raised here, before any data is read.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config = _read_json(folder / "config.json")
    qc = read_quantize_config(folder, config)
    config["quantization_config"] = qc
    located = checkpoint_tensors(folder)

    modules = sorted(k[: -len(".qweight")] for k in located if k.endswith(".qweight"))
    if not modules:
        raise CheckpointError(f"{folder}: no '*.qweight' tensors; not a GPTQ checkpoint")
    part_of: dict[str, tuple[str, str]] = {}
    expected: dict[str, int] = {}
    for m in modules:
        for part in ("qweight", "qzeros", "scales"):
            if f"{m}.{part}" not in located:
                raise CheckpointError(f"{folder}: quantized module {m!r} is missing tensor {f'{m}.{part}'!r}")
        present = [p for p in _GPTQ_PARTS if f"{m}.{p}" in located]
        part_of.update({f"{m}.{p}": (m, p) for p in present})
        expected[m] = len(present)
    names = list(dict.fromkeys(f"{part_of[k][0]}.weight" if k in part_of else k for k in located))
    return config, names, _gptq_stream(folder, located, part_of, expected, qc, device, dtype)


def _gptq_stream(folder: Path, located: dict[str, TensorSource], part_of: dict[str, tuple[str, str]],
                 expected: dict[str, int], qc: dict[str, Any], device, dtype: Optional[torch.dtype]) -> Stream:
    sizes: dict[str, list[int]] = {}            # module -> [bias entries, out_features], as they arrive

    def check_bias(m: str, i: int, n: int) -> None:
        got = sizes.setdefault(m, [-1, -1])
        got[i] = n
        if min(got) >= 0 and got[0] != got[1]:
            raise CheckpointError(f"{folder}: {m}.bias has {got[0]} entries, expected {got[1]}")

    for key, t, parts in gather_parts(iter_tensors(located, device), part_of, expected):
        if parts is None:
            if key.endswith(".bias") and key[:-len(".bias")] in expected:
                check_bias(key[:-len(".bias")], 0, t.numel())
            yield key, cast_float(t, dtype)
            continue
        w4 = gptq_linear_to_w4(parts.pop("qweight"), parts.pop("qzeros"), parts.pop("scales"), parts.pop("g_idx", None),
                               group_size=qc["group_size"], checkpoint_format=qc["checkpoint_format"], name=key)
        del parts
        check_bias(key, 1, w4.out_features)
        yield f"{key}.weight", cast_w4(w4, dtype)
        del w4


def load_gptq_weights(folder: PathLike, device: torch.device | str = "cpu",
                      dtype: Optional[torch.dtype] = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a GPTQ checkpoint folder -> (config, weights), streamed onto `device` (see gptq_weights)."""
    config, _, stream = gptq_weights(folder, device, dtype)
    return config, dict(stream)


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
