"""`python -m hierviz synthetic-stack`: a GPU preset's checkpoints, random but in exactly the
layouts the preset downloads, written locally so the preset's loading path can run (and be
measured) at true size on a machine without hub access.

    python -m hierviz synthetic-stack --preset paper-llama3-70b --out DIR --tokenizer-from FOLDER
    python -m hierviz synthetic-stack --preset paper-llama3-70b --out DIR --scale tiny   # CPU, seconds

Writes DIR/target (GPTQ: sharded safetensors + model.safetensors.index.json + config.json with
quantization_config + quantize_config.json, group 128, qweight/qzeros/scales/g_idx as AutoGPTQ
stores them), DIR/intermediate (an fp16 HF folder, sharded), DIR/e_m and DIR/e_t (SafeAILab EAGLE
heads: config.json + model.safetensors), tokenizer files in each model folder, and DIR/stack.json:
the preset with its hub ids replaced by these folders. `load_stack(DIR)` then takes the same code
path the hub preset takes. Shapes: the bundled config.json of each model (assets/configs), or
tiny ones (`--scale tiny`). The tokenizer is copied from --tokenizer-from (any HF tokenizer folder
whose ids fit the vocabulary; default: a tiny word-level one written here).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from hierviz.measure.common import refuse
from hierviz.memory import CONFIGS, PRESET_SHAPES
from hierviz.models.synthetic import CheckpointWeights
from hierviz.quant.formats import get_format
from hierviz.quant.w4 import FORMAT as W4A16
from hierviz.stack import PRESET_DIR

PRESET_MODELS = PRESET_SHAPES      # the presets with bundled shapes: the ones this can write
SHARD_BYTES = 5 * 1024 ** 3      # what the hub's big checkpoints use (~5 GB shards)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


def tiny_config(cfg: dict[str, Any], vocab: int) -> dict[str, Any]:
    """The same architecture at CPU size (GQA kept when the original has it)."""
    gqa = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) < cfg["num_attention_heads"]
    return {**cfg, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2 if gqa else 4, "vocab_size": vocab, "max_position_embeddings": 512,
            "bos_token_id": 1, "eos_token_id": 2}


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    return h, cfg["intermediate_size"], heads * hd, cfg.get("num_key_value_heads", heads) * hd


def _linears(cfg: dict[str, Any], prefix: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's projections."""
    h, inter, q, kv = _dims(cfg)
    return [(f"{prefix}.self_attn.q_proj", q, h), (f"{prefix}.self_attn.k_proj", kv, h),
            (f"{prefix}.self_attn.v_proj", kv, h), (f"{prefix}.self_attn.o_proj", h, q),
            (f"{prefix}.mlp.gate_proj", inter, h), (f"{prefix}.mlp.up_proj", inter, h),
            (f"{prefix}.mlp.down_proj", h, inter)]


def _model_tensors(cfg: dict[str, Any], gen: CheckpointWeights, gptq_group: Optional[int]) -> Iterator[tuple[str, torch.Tensor]]:
    h, inter, _, _ = _dims(cfg)
    v = cfg["vocab_size"]
    yield "model.embed_tokens.weight", gen.dense(v, h, std=0.02)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", torch.ones(h, dtype=torch.float16)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h, dtype=torch.float16)
        for name, n, k in _linears(cfg, p):
            if gptq_group:
                for part, t in gen.gptq(n, k, gptq_group).items():
                    yield f"{name}.{part}", t
            else:
                yield f"{name}.weight", gen.dense(n, k, std=k ** -0.5)
    yield "model.norm.weight", torch.ones(h, dtype=torch.float16)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", gen.dense(v, h, std=h ** -0.5)


def write_sharded(folder: Path, tensors: Iterator[tuple[str, torch.Tensor]], shard_bytes: int = SHARD_BYTES) -> int:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, as the hub's checkpoints;
    returns the bytes written."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    names: list[list[str]] = [[]]
    files: list[str] = []

    def flush() -> None:
        if shards[-1]:
            name = f"part-{len(files):05d}.safetensors"
            save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
            files.append(name)
            shards[-1] = {}

    total = 0
    for key, t in tensors:
        nb = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nb > shard_bytes:
            flush()
            sizes.append(0)
            names.append([])
            shards.append({})
        shards[-1][key] = t.contiguous()
        sizes[-1] += nb
        names[-1].append(key)
        total += nb
    flush()
    n = len(files)
    weight_map = {}
    for i, (old, keys) in enumerate(zip(files, names)):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / old).rename(folder / new)
        weight_map.update({k: new for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return total


def write_head(folder: Path, base: dict[str, Any], gen: CheckpointWeights) -> None:
    """A SafeAILab EAGLE-1/2 head for `base` (config.json + model.safetensors)."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    h = base["hidden_size"]
    sd = {"fc.weight": gen.dense(h, 2 * h, std=(2 * h) ** -0.5),
          "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16),
          "embed_tokens.weight": gen.dense(base["vocab_size"], h, std=0.02)}
    for name, n, k in _linears(base, "layers.0"):
        sd[f"{name}.weight"] = gen.dense(n, k, std=k ** -0.5)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**base, "num_hidden_layers": 1, "bias": False, "architectures": ["LlamaForCausalLM"]}
    cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _tokenizer(folder: Path, source: Optional[Path], vocab: int) -> None:
    if source is None:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, min(vocab, 500))}}
        tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>").save_pretrained(str(folder))
        return
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)


def write_stack(preset: str, out: Path, scale: str = "full", tokenizer_from: Optional[Path] = None,
                device: str = "cpu", seed: int = 0, log=print) -> dict[str, Any]:
    """Every checkpoint of `preset` under out/, and out/stack.json; returns sizes and times."""
    if preset not in PRESET_MODELS:
        raise ValueError(f"no synthetic layout for preset {preset!r}; choose from {', '.join(PRESET_MODELS)}")
    spec = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    vocab_tiny = 500
    cfgs = {}
    for role, (name, _, _) in PRESET_MODELS[preset].items():
        cfg = {k: v for k, v in json.loads((CONFIGS / name).read_text()).items() if not k.startswith("_")}
        cfgs[role] = tiny_config(cfg, vocab_tiny) if scale == "tiny" else cfg
    gen = CheckpointWeights(seed, device)
    info: dict[str, Any] = {"preset": preset, "scale": scale, "bytes": {}, "seconds": {}}
    group = PRESET_MODELS[preset]["target"][2] if scale == "full" else 32
    qc = {"bits": 4, "group_size": group, "desc_act": False, "sym": True,
          "checkpoint_format": "gptq", "quant_method": "gptq", "damp_percent": 0.01}
    for role, cfg in cfgs.items():
        t0 = time.perf_counter()
        folder = out / role
        gptq = get_format(PRESET_MODELS[preset][role][1]) is W4A16     # written as a GPTQ checkpoint
        info["bytes"][role] = write_sharded(folder, _model_tensors(cfg, gen, qc["group_size"] if gptq else None),
                                            SHARD_BYTES if scale == "full" else 40_000)
        written = {**cfg, "torch_dtype": "float16", **({"quantization_config": qc} if gptq else {})}
        (folder / "config.json").write_text(json.dumps(written, indent=2))
        if gptq:
            (folder / "quantize_config.json").write_text(json.dumps(qc, indent=2))
        _tokenizer(folder, tokenizer_from, cfg["vocab_size"])
        info["seconds"][role] = round(time.perf_counter() - t0, 1)
        log(f"{role}: {info['bytes'][role] / 1e9:.2f} GB in {info['seconds'][role]} s")
    for head, base in (("e_m", "intermediate"), ("e_t", "target")):
        write_head(out / head, cfgs[base], gen)
    local = {**spec, "name": f"{preset}-synthetic", "target": {"path": "target"},
             "intermediate": {**spec["intermediate"], "path": "intermediate"},
             "e_m": {"path": "e_m"}, "e_t": {"path": "e_t"}, "tokenizer": "target",
             "description": f"random weights in the layouts of {preset} (python -m hierviz synthetic-stack)"}
    (out / "stack.json").write_text(json.dumps(local, indent=2))
    return info


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz synthetic-stack", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESET_MODELS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--scale", default="full", choices=["full", "tiny"])
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="an HF tokenizer folder to copy")
    ap.add_argument("--device", default="cpu", help="where the random tensors are drawn (cuda is faster)")
    a = ap.parse_args(argv)
    if a.tokenizer_from is not None and not (a.tokenizer_from / "tokenizer.json").exists() \
            and not (a.tokenizer_from / "tokenizer.model").exists():
        return refuse(f"{a.tokenizer_from} holds no tokenizer.json or tokenizer.model")
    info = write_stack(a.preset, a.out, a.scale, a.tokenizer_from, a.device)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
