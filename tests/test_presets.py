"""Hub presets (assets/stacks/paper-llama3-70b.json, vicuna-13b-w4-single-gpu.json): their files
name exactly the intended hub repos, and they load when every hub id is replaced by a tiny local
stand-in in the same format (GPTQ folder, sharded safetensors with an index, SafeAILab heads).
Nothing here touches the network."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hierviz.stack import (
    DEFAULT_STACK,
    PRESET_DIR,
    StackError,
    load_stack,
    preset_names,
)
from tests.tiny import make_tiny_head, make_tiny_hf, make_tiny_tokenizer

PRESETS = {
    "paper-llama3-70b": {"target": "OxxoCodes/Meta-Llama-3-70B-Instruct-GPTQ",
                         "intermediate": "meta-llama/Meta-Llama-3-8B-Instruct",
                         "e_m": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "e_t": "yuhuili/EAGLE-LLaMA3-Instruct-70B",
                         "tokenizer": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "vicuna-13b-w4-single-gpu": {"target": "TheBloke/vicuna-13b-v1.3.0-GPTQ", "intermediate": "lmsys/vicuna-7b-v1.3",
                                 "e_m": "yuhuili/EAGLE-Vicuna-7B-v1.3", "e_t": "yuhuili/EAGLE-Vicuna-13B-v1.3"},
}
VOCAB = 97


def _spec(name: str) -> dict:
    return json.loads((PRESET_DIR / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_files_name_exactly_these_hub_ids(name: str) -> None:
    spec = _spec(name)
    got = {k: spec[k]["path"] for k in ("target", "intermediate", "e_m", "e_t")}
    if "tokenizer" in spec:
        got["tokenizer"] = spec["tokenizer"]
    assert got == PRESETS[name]
    assert spec["name"] == name and spec["w4_kernel_cuda"] == "triton" and spec["dtype_cuda"] == "float16"
    assert name in preset_names()


def test_presets_are_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DEFAULT_STACK == "smollm2-offline"
    from hierviz.app.stacks import default_stack
    monkeypatch.delenv("HIERVIZ_STACK", raising=False)
    assert default_stack() == "smollm2-offline"
    monkeypatch.setenv("HIERVIZ_STACK", "tiny-random")        # the app's override still wins
    assert default_stack() == "tiny-random"


def _gptq_standin(folder: Path, seed: int) -> Path:
    """A tiny Llama quantized (RTN, group 32) and written by save_gptq_checkpoint."""
    from hierviz.quant.gptq import pack_gptq_linear, save_gptq_checkpoint
    model = make_tiny_hf(folder / "float", seed=seed, vocab=VOCAB, hidden=64, layers=2, inter=128)
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    floats, quantized, gs = {}, {}, 32
    for k, w in sd.items():
        if k.endswith("_proj.weight"):
            n, kk = w.shape
            g = w.reshape(n, kk // gs, gs)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-6)
            zero = (-lo / scale).round().clamp(0, 15)
            codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).reshape(n, kk).to(torch.int32)
            quantized[k[:-len(".weight")]] = pack_gptq_linear(codes, zero.to(torch.int32), scale, group_size=gs)
        else:
            floats[k] = w.half()
    cfg = json.loads((folder / "float" / "config.json").read_text())
    out = save_gptq_checkpoint(folder / "gptq", cfg, floats, quantized,
                               {"bits": 4, "group_size": gs, "desc_act": False, "sym": False})
    make_tiny_tokenizer(out, VOCAB)
    return out


def _sharded_standin(folder: Path, seed: int) -> Path:
    """A tiny dense Llama saved in shards with model.safetensors.index.json, as meta-llama ships."""
    model = make_tiny_hf(folder / "tmp", seed=seed, vocab=VOCAB, hidden=64, layers=2, inter=128)
    model.save_pretrained(folder / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (folder / "sharded" / "model.safetensors.index.json").exists()
    make_tiny_tokenizer(folder / "sharded", VOCAB)
    return folder / "sharded"


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_loads_with_local_standins(name: str, tmp_path: Path) -> None:
    from hierviz.settings import DecodeSettings
    from hierviz.engine import generate, output_tokens
    from hierviz.models.config import ModelConfig
    target = _gptq_standin(tmp_path / "t", seed=1)
    inter = _sharded_standin(tmp_path / "m", seed=2)
    cfg = ModelConfig.from_file(target / "config.json")
    make_tiny_head(tmp_path / "e_m", cfg, seed=3)
    make_tiny_head(tmp_path / "e_t", cfg, seed=4, bias=False)
    local = {PRESETS[name]["target"]: str(target), PRESETS[name]["intermediate"]: str(inter),
             PRESETS[name]["e_m"]: str(tmp_path / "e_m"), PRESETS[name]["e_t"]: str(tmp_path / "e_t")}
    spec = _spec(name)
    for k in ("target", "intermediate", "e_m", "e_t"):
        spec[k]["path"] = local[spec[k]["path"]]
    if "tokenizer" in spec:
        spec["tokenizer"] = local[spec["tokenizer"]] if spec["tokenizer"] in local else str(inter)
    path = tmp_path / "stack.json"
    path.write_text(json.dumps(spec))
    stack = load_stack(str(path), device="cpu")
    assert stack.name == name
    assert stack.models.target.layers[0].qkv.w4   # the GPTQ target stays 4-bit
    s = DecodeSettings(max_new_tokens=8)
    ar = output_tokens(generate(stack, "ar", "w5 w6 w7", s))
    for m in ("hierspec", "eagle2"):
        assert output_tokens(generate(stack, m, "w5 w6 w7", s)) == ar   # greedy: identical to the target's


@pytest.mark.parametrize("name", list(PRESETS))
def test_hub_only_preset_offline_is_a_clear_error(name: str, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(StackError) as e:
        load_stack(name, device="cpu")
    assert name in str(e.value) and "Hugging Face hub" in str(e.value)


def test_every_shipped_model_file_has_its_sha256_in_provenance():
    """PROVENANCE.md records the sha256 of every shipped model file (the issue asks for it): a
    retrained file copied into assets/ without its record fails here."""
    import hashlib
    models = Path(__file__).resolve().parents[1] / "assets" / "models"
    record = (models / "PROVENANCE.md").read_text()
    files = [f for f in models.rglob("*") if f.is_file() and "reports" not in f.parts[-2] and f.name != "PROVENANCE.md"]
    assert len(files) >= 8
    missing = [str(f.relative_to(models)) for f in files if hashlib.sha256(f.read_bytes()).hexdigest() not in record]
    assert not missing, f"sha256 not in PROVENANCE.md: {missing}"
