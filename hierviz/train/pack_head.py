"""`python -m hierviz train pack-head --head DIR --out DIR`: a draft head's linears stored as int8
with one scale per output channel (compressed-tensors' weight-only layout), about half the file.

The loaders read such a head back dense (hierviz.quant.compressed_tensors.load_dense_tensors), so
the head drafts with weights within half a quantization step of the trained ones; the target
still verifies every token, so decoding stays lossless. Norms, biases and the d2t / t2d maps are
kept as stored.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from hierviz.models.config import read_config_json
from hierviz.quant.compressed_tensors import is_compressed_tensors, load_dense_tensors, store_weight_only_int8
from hierviz.quant.gptq import load_state_dict_folder


def pack_head(src: str | Path, out: str | Path) -> dict[str, float]:
    """Write `src`'s head to `out` int8-stored; returns the file sizes (MB) and the largest
    relative error of a dequantized linear (max |W' - W| / max |W| over its rows)."""
    src, out = Path(src), Path(out)
    config = read_config_json(src)
    if is_compressed_tensors(config):
        raise SystemExit(f"{src} is already a compressed-tensors checkpoint")
    tensors = {k: v.contiguous() for k, v in load_state_dict_folder(src).items()}
    packed, quantization_config = store_weight_only_int8(tensors)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    save_file(packed, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    dense = load_dense_tensors(out, config)
    worst = max(float(((dense[k].float() - t.float()).abs().amax(1) / t.float().abs().amax(1).clamp_min(1e-12)).max())
                for k, t in tensors.items() if packed[k].dtype == torch.int8)
    size = sum(f.stat().st_size for f in src.iterdir() if f.suffix in (".safetensors", ".bin"))
    return {"source_MB": size / 1e6, "packed_MB": (out / "model.safetensors").stat().st_size / 1e6,
            "max_row_relative_error": worst}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hierviz train pack-head", description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="a head folder (EAGLE-1/2 or EAGLE-3, any layout hierviz reads)")
    p.add_argument("--out", required=True, help="folder to write (config.json + model.safetensors)")
    a = p.parse_args(argv)
    if Path(a.out).resolve() == Path(a.head).resolve():
        raise SystemExit("--out must be another folder than --head")
    print(json.dumps(pack_head(a.head, a.out), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
