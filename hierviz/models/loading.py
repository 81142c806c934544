"""Checkpoints in, one format inside: HF safetensors folders (sharded or not), hub ids,
GPTQ (AutoGPTQ / GPTQModel) folders and GGUF files all become (ModelConfig, weights dict)
with float tensors and `W4Weight`s under HF parameter names."""
from __future__ import annotations

from pathlib import Path
from typing import Any


from hierviz.models.config import ModelConfig, read_config_json
from hierviz.models.llama import Weight, WeightsError
from hierviz.quant.gptq import load_state_dict_folder


def resolve_source(name_or_path: str) -> Path:
    """A local folder/file as is; anything else is a hub id, downloaded (never with remote code)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    parts = name_or_path.split("/")
    if name_or_path.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts):
        # not of the hub's owner/name form: a local path that does not exist
        raise WeightsError(f"no such model file or folder: {name_or_path}")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                                    "tokenizer*", "*.bin"]))
    except Exception as e:  # offline, unknown repo, gated repo ...
        raise WeightsError(f"cannot get {name_or_path!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                           "with HF_HUB_OFFLINE=1 only local folders work") from None


def _is_native_w4(folder: Path) -> bool:
    """hierviz's own W4 safetensors layout (the GGUF conversion cache) carries a metadata tag."""
    f = folder / "model.safetensors"
    if not f.exists():
        return False
    from safetensors import safe_open
    try:
        with safe_open(str(f), framework="pt") as h:
            return "hierviz" in (h.metadata() or {})
    except Exception:
        return False   # unreadable: let the regular reader report it


def is_gptq(config: dict[str, Any], folder: Path) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "gptq" or (folder / "quantize_config.json").exists()


def load_weights(name_or_path: str | Path) -> tuple[ModelConfig, dict[str, Weight], Path]:
    """(config, weights, folder) for an HF folder, hub id, GPTQ folder, GGUF file or hierviz W4 folder."""
    src = resolve_source(str(name_or_path))
    if src.is_file() and src.suffix == ".gguf":
        from hierviz.quant.gguf import read_gguf
        raw, weights, _ = read_gguf(src)
        return ModelConfig.from_dict(raw), weights, src.parent
    if not src.is_dir():
        raise WeightsError(f"{src} is neither a model folder nor a .gguf file")
    raw = read_config_json(src)
    cfg = ModelConfig.from_dict(raw)
    if _is_native_w4(src):
        from hierviz.quant.gguf import load_w4_safetensors
        _, weights = load_w4_safetensors(src)
    elif is_gptq(raw, src):
        from hierviz.quant.gptq import load_gptq_weights
        _, weights = load_gptq_weights(src)
    else:
        weights = dict(load_state_dict_folder(src))
    return cfg, weights, src
