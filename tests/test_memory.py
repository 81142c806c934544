"""GPU memory estimates (hierviz.memory) and the up-front refusal of a stack that cannot fit;
the release of a GPU weight's checkpoint-order codes once the Triton layout exists."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hierviz import memory
from hierviz.measure import memory_report
from hierviz.memory import GB

ROOT = Path(__file__).resolve().parents[1]


def _cfg(name: str) -> dict:
    return json.loads((ROOT / "assets" / "configs" / name).read_text())


def test_weight_bytes_follow_the_parameter_counts() -> None:
    c = _cfg("llama3-8b.json")
    # Llama-3-8B: 6.98e9 linear parameters + 2 x 128256 x 4096 embedding / LM head = 8.03e9
    assert memory.model_bytes(c, "dense") == pytest.approx(8.03e9 * 2, rel=0.01)
    big = _cfg("llama3-70b.json")
    lin = 80 * (8192 * 8192 * 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672)
    assert memory.model_bytes(big, "w4", 128) == pytest.approx(lin * 0.5 + lin / 128 * 8 + 2 * 128256 * 8192 * 2)
    assert memory.kv_bytes(big, 4096) == 80 * 2 * 8 * 128 * 4096 * 2
    # tied embeddings hold the vocabulary matrix once (SmolLM2, Llama-3.2)
    tied = {**c, "tie_word_embeddings": True}
    assert memory.model_bytes(c, "dense") - memory.model_bytes(tied, "dense") == 128256 * 4096 * 2


def test_an_estimate_counts_each_kv_cache_twice_and_the_heads() -> None:
    """Every model's cache at the run's context twice (the static runners' and a dynamic path's),
    one head per role that carries one, and a part list that sums to the total."""
    t, m = _cfg("llama3-70b.json"), _cfg("llama3-8b.json")
    parts = memory.estimate({"target": (t, "w4", 128), "intermediate": (m, "w4", 128)},
                            [("target", None), ("intermediate", None)], 2048)
    assert parts["kv caches"] == 2 * (memory.kv_bytes(t, 2048) + memory.kv_bytes(m, 2048))
    assert parts["heads"] == memory.head_bytes(t) + memory.head_bytes(m)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


@pytest.mark.parametrize("preset,fits,no", [
    ("paper-llama3-70b", ["A100-80GB", "H100-80GB", "H200"], ["48 GB card (L40S / A6000)", "A100-40GB"]),
    ("vicuna-13b-w4-single-gpu", ["A100-40GB", "48 GB card (L40S / A6000)"], ["24 GB card (RTX 4090 / A10G)"]),
])
def test_preset_budgets(preset: str, fits: list[str], no: list[str]) -> None:
    spec = json.loads((ROOT / "assets" / "stacks" / f"{preset}.json").read_text())
    parts = memory.shape_estimate(spec)
    assert parts is not None and parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    for gpu in fits:
        memory.check_fits(preset, parts, memory.GPUS[gpu] * GB, gpu)
    for gpu in no:
        with pytest.raises(memory.StackTooLarge, match=rf"needs about \d+ GB.*{gpu.split()[0]}"):
            memory.check_fits(preset, parts, memory.GPUS[gpu] * GB, gpu)


def test_memory_command_prints_the_preset_table(capsys) -> None:
    assert memory_report.main([]) == 0
    out = capsys.readouterr().out
    assert "| paper-llama3-70b |" in out and "| vicuna-13b-w4-single-gpu |" in out and "A100-80GB" in out


def _stack(tmp_path: Path, hidden: int) -> Path:
    """A stack file whose models have only config.json files (the check reads nothing else)."""
    cfg = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
    for role in ("t", "m"):
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "t" / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    spec = {"name": "local", "target": {"path": "t"}, "intermediate": {"path": "m"}, "e_m": {"path": "h"}}
    (tmp_path / "stack.json").write_text(json.dumps(spec))
    return tmp_path


def test_a_stack_that_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch) -> None:
    from hierviz import stack as stack_mod
    base = _stack(tmp_path, 4096)
    spec = json.loads((base / "stack.json").read_text())
    parts = memory.stack_estimate(spec, lambda s: str(base / s))
    assert parts is not None and 20 * GB < parts["total"] < 30 * GB       # W4 ~5 GB + fp16 ~16 GB + head + caches
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=16 * GB, name="a 16 GB test GPU"))
    with pytest.raises(stack_mod.StackError, match="stack 'local' needs about .* a 16 GB test GPU has 16 GB"):
        stack_mod._check_gpu_memory("local", spec, base, torch.device("cuda"), torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=80 * GB, name="an 80 GB test GPU"))
    stack_mod._check_gpu_memory("local", spec, base, torch.device("cuda"), torch.float16)   # fits: no error
    # a model whose config cannot be read yet: no estimate (the load itself reports the problem)
    assert memory.stack_estimate({"target": {"path": "missing"}}, lambda s: str(base / s)) is None
    # M's LM head through a quantizer (quantize_lm_head): the head at W4's bytes beside the fp16
    # embedding; an unknown quantizer: no estimate (the load names the known ones)
    spec["intermediate"]["quantize_lm_head"] = "rtn-g64"
    head = 32000 * 4096
    smaller = memory.stack_estimate(spec, lambda s: str(base / s))
    assert parts["intermediate"] - smaller["intermediate"] == pytest.approx(head * 2 - head * (0.5 + 8 / 64))
    assert parts["target"] == smaller["target"]
    spec["intermediate"]["quantize_lm_head"] = "nonsense"
    assert memory.stack_estimate(spec, lambda s: str(base / s)) is None


def test_released_codes_are_rebuilt_from_the_kernel_layout() -> None:
    pytest.importorskip("triton")
    from hierviz.quant import triton_w4
    from hierviz.quant.w4 import codes_of, codes_released, dequantize, quantize_rtn, release_codes
    for g in (32, 128, 512):
        w = quantize_rtn(torch.randn(96, 1024), g)
        original, dense = w.codes.clone(), dequantize(w)
        triton_w4.packed(w, torch.float16)
        release_codes(w, triton_w4.source_codes)      # what packed() does to a CUDA weight: the order goes, the shape stays
        assert codes_released(w) and w.out_features == 96 and w.in_features == 1024
        assert torch.equal(codes_of(w), original) and torch.equal(dequantize(w), dense)
        rows = torch.tensor([0, 5, 95])
        assert torch.equal(triton_w4.source_codes(w, rows), original[rows])
        assert torch.equal(w.to("cpu").codes, original)


def _documented_quantize_values() -> list[str]:
    """Every concrete `"quantize"` value the docs show (docs/formats.md, docs/stacks.md), and every
    registered format's name and aliases with a quantizer (formats.md: a format's name works)."""
    from hierviz.quant.formats import FORMATS
    found = set()
    for doc in ("formats.md", "stacks.md"):
        found.update(re.findall(r'"quantize": "([^"<]+)"', (ROOT / "docs" / doc).read_text()))
    assert {"w8a8-int8", "w8a8-fp8", "rtn-g32"} <= found
    found.update(n for f in FORMATS.values() if f.quantize is not None for n in f.names)
    return sorted(found)


@pytest.mark.parametrize("quantize", _documented_quantize_values())
def test_every_documented_quantize_value_goes_through_the_cuda_preload_check(tmp_path, monkeypatch, quantize) -> None:
    """stack._check_gpu_memory runs memory.stack_estimate on CUDA before any weight is read: each
    documented `"quantize"` value gives a byte count between a quarter of the dense model's and the
    dense model's, and the check passes on a large GPU and refuses a small one."""
    from hierviz import stack as stack_mod
    cfg = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 4,
           "num_hidden_layers": 16, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    spec = {"name": "q", "target": {"path": "t", "quantize": quantize}}
    dense = memory.stack_estimate({"target": {"path": "t"}}, lambda s: str(tmp_path / s))
    parts = memory.stack_estimate(spec, lambda s: str(tmp_path / s))
    assert parts is not None and dense["target"] / 4 < parts["target"] < dense["target"], (quantize, parts)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=80 * GB, name="an 80 GB test GPU"))
    stack_mod._check_gpu_memory("q", spec, tmp_path, torch.device("cuda"), torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=2 * GB, name="a 2 GB test GPU"))
    with pytest.raises(stack_mod.StackError, match="needs about"):
        stack_mod._check_gpu_memory("q", spec, tmp_path, torch.device("cuda"), torch.float16)


def test_a_quantize_option_sets_the_estimates_format_and_group(tmp_path) -> None:
    """rtn-g<G>: W4A16 with group G (scales and offsets twice per G weights); an 8-bit format one
    byte per weight; an unknown option no estimate (the load names the known options)."""
    c = _cfg("llama3-8b.json")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(c))

    def target(q: object) -> float | None:
        parts = memory.stack_estimate({"target": {"path": "t", "quantize": q}}, lambda s: str(tmp_path / s))
        return None if parts is None else parts["target"]
    assert target("rtn-g32") == pytest.approx(memory.model_bytes(c, "w4a16", 32))
    assert target("rtn-g64") < target("rtn-g32")
    assert target("w4a16") == pytest.approx(memory.model_bytes(c, "w4", 128))
    assert target("w8a8-int8") == pytest.approx(memory.model_bytes(c, "w8a8-int8")) == target("w8a8-fp8")
    assert target("int3") is None and target(5) is None


def test_heads_quantized_by_the_stack_file_are_counted_at_their_format(tmp_path) -> None:
    """A head's "quantize" (stack.py): its decoder layer and fc at the format's bytes in the estimate,
    its embedding-sized table as it was; an unknown option gives no estimate (the load names it)."""
    base = _stack(tmp_path, 4096)
    spec = json.loads((base / "stack.json").read_text())
    spec["e_m"] = {"path": "m"}
    dense = memory.stack_estimate(spec, lambda s: str(base / s))
    spec["e_m"]["quantize"] = "rtn-g64"
    quantized = memory.stack_estimate(spec, lambda s: str(base / s))
    cfg = json.loads((base / "m" / "config.json").read_text())
    h = cfg["hidden_size"]
    linears = memory._linear_params(cfg) + 2 * h * h
    assert dense["heads"] - quantized["heads"] == pytest.approx(linears * (2 - (0.5 + 8 / 64)))
    assert quantized["heads"] == memory.head_bytes(cfg, 2.0, ("w4a16", 64))
    assert {k: v for k, v in quantized.items() if k not in ("heads", "total")} == \
        {k: v for k, v in dense.items() if k not in ("heads", "total")}
    spec["e_m"]["quantize"] = "nonsense"
    assert memory.stack_estimate(spec, lambda s: str(base / s)) is None
