"""Checkpoints in, one format inside: HF safetensors folders (sharded or not), hub ids,
GPTQ (AutoGPTQ / GPTQModel) folders, compressed-tensors 8-bit folders and GGUF files all become (ModelConfig, weights dict)
with float tensors and weight-format weights (W4Weight, ...) under HF parameter names.

Folders are streamed onto the device the model will run on: each tensor is read memory-mapped,
copied there and converted there (GPTQ repack, dtype casts), so host memory holds about one
tensor at a time (hierviz.quant.gptq.iter_tensors), not the checkpoint. `open_weights` reads
lazily (StreamedWeights): a model built from it with Transformer(..., release=True) fuses each
layer as soon as its tensors have been read, before the next layer's are."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz.models.config import ModelConfig, read_config_json
from hierviz.models.llama import Weight, WeightsError
from hierviz.quant.gptq import cast_float, checkpoint_tensors, iter_tensors
from hierviz.quant.formats import weight_to


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


class StreamedWeights(MutableMapping):
    """A model's weights, read on first use from a stream of (name, weight) in file order. The
    names are known up front (from the files' headers); looking one up reads the stream on to it,
    keeping what it passes for later. Setting or deleting a name not read yet overrides the file's
    copy, which is then dropped as it goes by."""

    def __init__(self, names: Iterable[str], stream: Iterator[tuple[str, Weight]]) -> None:
        self._unread = dict.fromkeys(names)          # an ordered set
        self._ready: dict[str, Weight] = {}
        self._stream = stream

    def _read_to(self, name: str) -> None:
        while name in self._unread:
            try:
                key, w = next(self._stream)
            except StopIteration:
                raise WeightsError(f"tensor {name!r} is listed in the checkpoint's headers but was not read") from None
            if key in self._unread:
                del self._unread[key]
                self._ready[key] = w

    def __getitem__(self, name: str) -> Weight:
        self._read_to(name)
        return self._ready[name]

    def __setitem__(self, name: str, w: Weight) -> None:
        self._unread.pop(name, None)
        self._ready[name] = w

    def __delitem__(self, name: str) -> None:
        if name in self._unread:
            del self._unread[name]
        else:
            del self._ready[name]

    def __contains__(self, name: object) -> bool:
        return name in self._ready or name in self._unread

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._ready) + list(self._unread))

    def __len__(self) -> int:
        return len(self._ready) + len(self._unread)

    def read_all(self) -> dict[str, Weight]:
        """Everything, as a plain dict (reads the rest of the stream)."""
        for name in list(self._unread):
            self._read_to(name)
        return dict(self._ready)


def open_weights(name_or_path: str | Path, device: torch.device | str = "cpu",
                 dtype: Optional[torch.dtype] = None) -> tuple[ModelConfig, StreamedWeights, Path]:
    """(config, weights, folder) for an HF folder, hub id, GPTQ folder, GGUF file or hierviz W4
    folder, with the weights read lazily onto `device` (StreamedWeights); with `dtype`,
    floating-point tensors and W4 scales/offsets are cast to it there (what Transformer(dtype=...)
    would do), else they keep their stored dtype (W4: float32). Missing or corrupt files and
    tensors that the headers show are raised here, before any weight is read."""
    src = resolve_source(str(name_or_path))
    if src.is_file() and src.suffix == ".gguf":
        from hierviz.quant.gguf import read_gguf
        raw, weights, _ = read_gguf(src)          # parsed on the host (the stack converts GGUFs to a W4 folder first)
        return ModelConfig.from_dict(raw), StreamedWeights(list(weights), _placed(weights, device, dtype)), src.parent
    if not src.is_dir():
        raise WeightsError(f"{src} is neither a model folder nor a .gguf file")
    raw = read_config_json(src)
    cfg = ModelConfig.from_dict(raw)
    if _is_native_w4(src):
        from hierviz.quant.gguf import w4_safetensors_weights
        _, names, stream = w4_safetensors_weights(src, device, dtype)
    elif is_gptq(raw, src):
        from hierviz.quant.gptq import gptq_weights
        _, names, stream = gptq_weights(src, device, dtype)
    elif (raw.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        from hierviz.quant.compressed_tensors import ct_weights      # W8A8 int8 / FP8-dynamic (llm-compressor)
        names, stream = ct_weights(src, raw, device, dtype)
    else:
        located = checkpoint_tensors(src)
        names, stream = list(located), ((k, cast_float(t, dtype)) for k, t in iter_tensors(located, device))
    return cfg, StreamedWeights(names, stream), src


def load_weights(name_or_path: str | Path, device: torch.device | str = "cpu",
                 dtype: Optional[torch.dtype] = None) -> tuple[ModelConfig, dict[str, Weight], Path]:
    """open_weights, read whole into a dict: (config, weights, folder). The weights still pass
    through host memory one tensor at a time on their way to `device`."""
    cfg, weights, folder = open_weights(name_or_path, device, dtype)
    return cfg, weights.read_all(), folder


def _placed(weights: dict[str, Weight], device: torch.device | str,
            dtype: Optional[torch.dtype]) -> Iterator[tuple[str, Weight]]:
    """weights moved to device (and cast), one at a time: each host tensor is dropped once moved."""
    for k in list(weights):
        w = weights.pop(k)
        yield k, cast_float(w.to(device), dtype) if isinstance(w, torch.Tensor) else weight_to(w, device, dtype)
