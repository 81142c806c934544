"""GPU memory a stack needs, worked out from config.json facts before any weight is loaded
(the `python -m hierviz memory` command: hierviz/measure/memory_report.py).

`load_stack` calls `check_fits` on a CUDA device, so a stack that cannot fit is refused up
front with a message that says by how much, instead of failing deep inside a load or a decode.

What is counted (bytes), per model, from its weight format's entry (hierviz.quant.formats:
bytes per weight as a loaded GPU model holds them, embedding bytes):
  W4A16 (GPTQ, or a stack file's "quantize"): 4-bit codes held once (the Triton kernel's layout;
    the checkpoint's order is released after packing), fp16 scales and offsets twice (checkpoint
    + kernel layout), fp16 embedding and LM head;
  8-bit formats: one byte per weight, embedding and LM head in the activations' dtype;
  dense models: parameters x 2 (fp16/bf16) or x 4 (fp32);
  EAGLE heads: one decoder layer, fc, and an embedding copy (SafeAILab heads usually carry one);
  KV caches of target and intermediate at the longest context a run uses, twice (the static
    runners' caches and a dynamic path's), plus a workspace for a 2048-token prefill chunk's fp32
    logits and activations, and ~1 GB for the CUDA context and kernels.
These are estimates within a few percent of the weights (the largest part); the margin is
MARGIN.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from hierviz.models.drafter import HEAD_SLOTS
from hierviz.quant.compressed_tensors import QUANT_METHOD, WEIGHT_TYPES, scheme_type
from hierviz.quant.errors import CheckpointError
from hierviz.quant.formats import DENSE, WeightFormat, get_format, quantized_formats, resolve_quantize
from hierviz.quant.w4 import FORMAT as W4A16

GB = 1e9
MARGIN = 0.05                  # of the GPU's memory kept free for fragmentation and the allocator
CONTEXT_BYTES = 1.0 * GB       # CUDA context, cuBLAS/Triton workspaces, compiled kernels
PREFILL_CHUNK = 2048
DEFAULT_CONTEXT = 4096

# Cards a deployment picks (memory as the vendor states it, in GB of 1e9 bytes)
GPUS = {"24 GB card (RTX 4090 / A10G)": 24.0, "A100-40GB": 40.0, "48 GB card (L40S / A6000)": 48.0,
        "A100-80GB": 80.0, "H100-80GB": 80.0, "H200": 141.0}


class StackTooLarge(ValueError):
    """A stack that does not fit this GPU; the message is fit to show a user."""


def _linear_params(c: dict[str, Any]) -> int:
    h, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    return h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter


def _vocab_bytes(c: dict[str, Any], bytes_per: float) -> float:
    n = int(c["vocab_size"]) * int(c["hidden_size"])
    return n * bytes_per * (1 if c.get("tie_word_embeddings") else 2)


def model_bytes(c: dict[str, Any], fmt: str | WeightFormat, group: int = 128, act_bytes: float = 2.0,
                lm_head: Optional[tuple[str, int]] = None) -> float:
    """Weights of one model in a weight format (a name or alias of hierviz.quant.formats: its bytes
    per weight as a loaded GPU model holds them; `group` for a format with groups, -1 = one per
    channel); a dense model's norms counted too. `lm_head`: (format, group) of a quantized LM head
    (a stack's `quantize_lm_head`), held beside the embedding, which stays as it was."""
    f = get_format(fmt)
    layers = int(c["num_hidden_layers"])
    lin = _linear_params(c) * layers
    emb = act_bytes if f.embedding_bytes is None else f.embedding_bytes
    norms = (2 * layers + 1) * int(c["hidden_size"]) * act_bytes if f.dense else 0.0
    if lm_head is None:
        vocab = _vocab_bytes(c, emb)
    else:     # the embedding as it is, and the head in its own format
        vocab = int(c["vocab_size"]) * int(c["hidden_size"]) * (emb + _resident(get_format(lm_head[0]), lm_head[1], c, act_bytes))
    return lin * _resident(f, group, c, act_bytes) + norms + vocab


def _resident(f: WeightFormat, group: int, c: dict[str, Any], act_bytes: float) -> float:
    """Bytes per weight as a loaded GPU model holds it (group <= 0: one per channel)."""
    return f.resident_bytes_per_weight(int(c["hidden_size"]) if group <= 0 else group, act_bytes)


def head_bytes(base: dict[str, Any], act_bytes: float = 2.0, quantized: Optional[tuple[str, int]] = None) -> float:
    """An EAGLE head on a model of config `base`: its decoder layer and fc, dense or, where the
    stack quantizes them, (format, group); an embedding-sized table (its own embedding or LM head)."""
    h = int(base["hidden_size"])
    per = act_bytes if quantized is None else _resident(get_format(quantized[0]), quantized[1], base, act_bytes)
    return (_linear_params(base) + 2 * h * h) * per + int(base["vocab_size"]) * h * act_bytes


def kv_bytes(c: dict[str, Any], context: int, act_bytes: float = 2.0) -> float:
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    return int(c["num_hidden_layers"]) * 2 * kv_heads * hd * context * act_bytes


def workspace_bytes(c: dict[str, Any], act_bytes: float = 2.0) -> float:
    v, inter = int(c["vocab_size"]), int(c["intermediate_size"])
    return PREFILL_CHUNK * (v * 4 + 4 * inter * act_bytes)


def estimate(models: dict[str, tuple[dict[str, Any], str, int]], heads: list[tuple[str, Optional[tuple[str, int]]]],
             context: int = DEFAULT_CONTEXT, act_bytes: float = 2.0,
             lm_heads: Optional[dict[str, tuple[str, int]]] = None) -> dict[str, float]:
    """models: role -> (config dict, weight format name, group); heads: one (the role of the model it
    is on, (format, group) of its quantized linears or None) per EAGLE head; lm_heads: role ->
    (format, group) of a quantized LM head. Returns bytes per part and the total."""
    parts: dict[str, float] = {}
    for role, (c, fmt, g) in models.items():
        parts[role] = model_bytes(c, fmt, g, act_bytes, (lm_heads or {}).get(role))
    parts["heads"] = sum(head_bytes(models[r][0], act_bytes, q) for r, q in heads if r in models)
    ctx = min(context, min(int(c.get("max_position_embeddings") or context) for c, _, _ in models.values()))
    parts["kv caches"] = 2 * sum(kv_bytes(c, ctx, act_bytes) for c, _, _ in models.values())
    parts["workspace"] = max(workspace_bytes(c, act_bytes) for c, _, _ in models.values()) + CONTEXT_BYTES
    parts["total"] = sum(parts.values())
    return parts


# ---- stack files ------------------------------------------------------------------------------

def _config_of(source: str) -> Optional[tuple[dict[str, Any], str, int]]:
    """(config.json, format, group) of a model source: a local folder, or a hub id whose
    config.json (a few kB) is fetched alone; None when it cannot be read (then no check)."""
    folder = Path(source).expanduser()
    files: dict[str, Optional[Path]] = {}
    if folder.is_dir():
        files = {n: folder / n for n in ("config.json", "quantize_config.json")}
    elif folder.suffix == ".gguf" or source.startswith("pypi:"):
        return None          # the offline CPU stack: small, never checked
    else:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            return None
        for n in ("config.json", "quantize_config.json"):
            try:
                files[n] = Path(hf_hub_download(source, n))
            except Exception:
                files[n] = None
    try:
        cfg = json.loads(files["config.json"].read_text()) if files.get("config.json") else None
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(cfg, dict) or "hidden_size" not in cfg:
        return None
    qc = dict(cfg.get("quantization_config") or {})
    qf = files.get("quantize_config.json")
    if qf is not None and qf.exists():
        try:
            qc.update(json.loads(qf.read_text()))
        except (OSError, json.JSONDecodeError):
            pass
    if qc.get("quant_method") == "gptq" or qc.get("bits") == 4:
        return cfg, W4A16.name, int(qc.get("group_size", 128))
    if qc.get("quant_method") == QUANT_METHOD:
        return _compressed_tensors_format(cfg, qc)
    return cfg, DENSE.name, 0


def _compressed_tensors_format(cfg: dict[str, Any], qc: dict[str, Any]) -> Optional[tuple[dict[str, Any], str, int]]:
    """The 8-bit format a compressed-tensors checkpoint loads as; None for a scheme the load refuses
    (it names what the checkpoint has)."""
    try:
        weight_type = WEIGHT_TYPES[scheme_type({"quantization_config": qc})]
    except CheckpointError:
        return None
    return cfg, next(f.name for f in quantized_formats() if f.weight_type is weight_type), 0


def stack_estimate(spec: dict[str, Any], resolve, context: int = DEFAULT_CONTEXT,
                   act_bytes: float = 2.0) -> Optional[dict[str, float]]:
    """The estimate for a stack file's models (resolve: the stack's path resolver); None when a
    model's config cannot be read."""
    models, lm_heads = {}, {}
    for role in ("target", "intermediate"):
        if spec.get(role):
            got = _config_of(resolve(spec[role]["path"]))
            if got is None:
                return None
            cfg, fmt, g = got
            for key in ("quantize", "quantize_lm_head"):
                if spec[role].get(key):
                    choice = resolve_quantize(spec[role][key])
                    if choice is None:
                        return None      # an unknown option: the load names the known ones
                    if key == "quantize":
                        fmt, g = choice.format.name, choice.group
                    else:
                        lm_heads[role] = (choice.format.name, choice.group)
            models[role] = (cfg, fmt, g)
    heads = _heads_of(spec)
    return None if heads is None else estimate(models, heads, context, act_bytes, lm_heads)


def _heads_of(spec: dict[str, Any]) -> Optional[list[tuple[str, Optional[tuple[str, int]]]]]:
    """A stack file's heads as estimate takes them: (the role of the model each is on, the
    (format, group) of its "quantize" or None); None for an unknown quantize option."""
    heads = []
    for slot, (role, _) in HEAD_SLOTS.items():
        if spec.get(slot):
            q = spec[slot].get("quantize")
            choice = resolve_quantize(q) if q else None
            if q and choice is None:
                return None      # an unknown option: the load names the known ones
            heads.append((role, (choice.format.name, choice.group) if choice else None))
    return heads


def describe(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GB:.1f} GB" for k, v in parts.items() if k != "total")


def check_fits(name: str, parts: dict[str, float], capacity_bytes: float, gpu: str) -> None:
    """Raise StackTooLarge when the stack needs more than the GPU's usable memory."""
    usable = capacity_bytes * (1 - MARGIN)
    if parts["total"] > usable:
        raise StackTooLarge(
            f"stack {name!r} needs about {parts['total'] / GB:.0f} GB of GPU memory ({describe(parts)}); "
            f"{gpu} has {capacity_bytes / GB:.0f} GB, of which {usable / GB:.0f} GB are usable. Choose a smaller "
            f"stack (python -m hierviz memory lists what fits where) or a larger GPU.")


def table(rows: list[tuple[str, dict[str, float]]]) -> str:
    head = "| stack | weights (GB) | total (GB) | " + " | ".join(GPUS) + " |"
    lines = [head, "|" + "---|" * (3 + len(GPUS))]
    for name, parts in rows:
        w = sum(v for k, v in parts.items() if k in ("target", "intermediate", "heads"))
        fits = ["fits" if parts["total"] <= gb * GB * (1 - MARGIN) else "no" for gb in GPUS.values()]
        lines.append(f"| {name} | {w / GB:.1f} | {parts['total'] / GB:.1f} | " + " | ".join(fits) + " |")
    return "\n".join(lines)


# The bundled shape configs of the GPU presets' models (assets/configs), so the table needs no hub.
PRESET_SHAPES = {
    "paper-llama3-70b": {"target": ("llama3-70b.json", W4A16.name, 128),
                         "intermediate": ("llama3-8b.json", DENSE.name, 0)},
    "vicuna-13b-w4-single-gpu": {"target": ("vicuna-13b.json", W4A16.name, 128),
                                 "intermediate": ("vicuna-7b.json", DENSE.name, 0)},
}


CONFIGS = Path(__file__).resolve().parents[1] / "assets" / "configs"


def shape_estimate(spec: dict[str, Any], context: int = DEFAULT_CONTEXT) -> Optional[dict[str, float]]:
    shapes = PRESET_SHAPES.get(spec.get("name", ""))
    if shapes is None:
        return None
    models = {r: (json.loads((CONFIGS / f).read_text()), fmt, g) for r, (f, fmt, g) in shapes.items()}
    heads = _heads_of(spec)
    return None if heads is None else estimate(models, heads, context)

