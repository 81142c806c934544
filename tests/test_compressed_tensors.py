"""compressed-tensors checkpoints (llm-compressor's layout, as vLLM loads it) for W8A8 int8 and
FP8-dynamic: local stand-ins written in the exact layout (config_groups, `.weight` codes and
`.weight_scale` beside them, the LM head ignored) load into hierviz's 8-bit formats bit for bit,
and schemes whose product differs are refused with a message."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hierviz.models.loading import open_weights
from hierviz.quant.errors import CheckpointError
from hierviz.quant.fp8 import E4M3, E4M3_MAX, FP8Weight
from hierviz.quant.w8a8 import W8Weight, quantize_w8
from tests.tiny import make_tiny_hf, make_tiny_tokenizer


def scheme(kind: str, w_strategy: str = "channel", **act) -> dict:
    """A quantization_config as llm-compressor writes it: one group over the Linear modules."""
    acts = {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True, "symmetric": True, **act}
    return {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": acts,
                "weights": {"num_bits": 8, "type": kind, "strategy": w_strategy, "symmetric": True, "dynamic": False}}}}


def write_checkpoint(dense: Path, out: Path, kind: str, strategy: str = "channel", qc: dict | None = None) -> dict:
    """The dense folder's decoder linears in the compressed-tensors layout; returns what was written."""
    sd = load_file(str(dense / "model.safetensors"))
    written = {}
    for k, w in list(sd.items()):
        if k.startswith("model.layers.") and k.endswith("_proj.weight"):
            base = k[:-len(".weight")]
            if kind == "int":
                q = quantize_w8(w)
                codes, scale = q.codes, q.scales[:, None]
            else:
                s = w.float().abs().amax(1 if strategy == "channel" else None, keepdim=strategy == "channel") / E4M3_MAX
                codes = (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
                scale = s.reshape(-1, 1) if strategy == "channel" else s.reshape(1)
            sd[k], sd[f"{base}.weight_scale"] = codes.contiguous(), scale.to(torch.bfloat16)
            written[k] = (codes, scale.to(torch.bfloat16).float().reshape(-1))
    out.mkdir(parents=True)
    save_file(sd, str(out / "model.safetensors"))
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = qc or scheme(kind, strategy)
    (out / "config.json").write_text(json.dumps(cfg))
    return written


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ct") / "dense"
    make_tiny_hf(folder, layers=2, tie=False)
    make_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("kind,strategy,weight_type", [("int", "channel", W8Weight), ("float", "channel", FP8Weight),
                                                        ("float", "tensor", FP8Weight)])
def test_8bit_checkpoints_load_bit_for_bit(dense, tmp_path, kind, strategy, weight_type):
    written = write_checkpoint(dense, tmp_path / "ct", kind, strategy)
    _, weights, _ = open_weights(tmp_path / "ct")
    got = weights.read_all()
    assert not any(k.endswith("weight_scale") for k in got)
    assert isinstance(got["lm_head.weight"], torch.Tensor)              # "ignore": stays dense
    for k, (codes, scales) in written.items():
        w = got[k]
        assert type(w) is weight_type and torch.equal(w.codes.view(torch.uint8), codes.view(torch.uint8))
        n = codes.shape[0]
        assert torch.equal(w.scales, scales if scales.numel() == n else scales.expand(n))


def test_a_w8a8_checkpoint_runs_as_the_stack_the_same_weights_make(dense, tmp_path):
    """The stack loads the checkpoint as W8A8 int8 (batch-invariant on the CPU) and its decoders equal
    its AR; its codes are those the same quantizer makes from the dense folder, its scales those
    scales as the checkpoint stores them (bf16)."""
    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.stack import load_stack
    write_checkpoint(dense, tmp_path / "ct", "int")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (dense / name).exists():
            (tmp_path / "ct" / name).write_bytes((dense / name).read_bytes())
    (tmp_path / "a.json").write_text(json.dumps({"name": "ct", "target": {"path": "ct"}, "intermediate": {"path": "ct"}}))
    (tmp_path / "dense").symlink_to(dense, target_is_directory=True)
    (tmp_path / "b.json").write_text(json.dumps({"name": "q", "target": {"path": "dense", "quantize": "w8a8-int8"},
                                                 "intermediate": {"path": "dense"}}))
    a, b = load_stack(str(tmp_path / "a.json"), device="cpu"), load_stack(str(tmp_path / "b.json"), device="cpu")
    assert a.models.target.layers[0].qkv.q.format == "w8a8-int8" and a.models.target.batch_invariant
    for la, lb in zip(a.models.target.layers, b.models.target.layers):
        for x, y in ((la.qkv, lb.qkv), (la.o, lb.o), (la.gate_up, lb.gate_up), (la.down, lb.down)):
            assert all(torch.equal(u.codes, v.codes) and torch.equal(u.scales, v.scales.bfloat16().float())
                       for u, v in zip(x.q.weights, y.q.weights))
    s = DecodeSettings(max_new_tokens=10)
    ar = output_tokens(generate(a, "ar", "w5 w9 w11", s))
    assert output_tokens(generate(a, "spec", "w5 w9 w11", s)) == ar


@pytest.mark.parametrize("qc,match", [
    (scheme("float", "tensor", dynamic=False, strategy="tensor"), "dynamic=False"),           # FP8 static
    ({**scheme("int"), "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}, "strategy 'group'"),
    ({**scheme("int"), "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}}, "weight-only"),
    ({**scheme("int"), "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}}}}, "4-bit int weights"),
    ({**scheme("int"), "config_groups": {}}, "without config_groups"),
])
def test_other_schemes_are_refused_with_what_was_found(dense, tmp_path, qc, match):
    write_checkpoint(dense, tmp_path / "ct", "int", qc=qc)
    with pytest.raises(CheckpointError, match=match):
        open_weights(tmp_path / "ct")


def test_static_scales_and_a_scale_without_its_weight_are_refused(dense, tmp_path):
    write_checkpoint(dense, tmp_path / "ct", "int")
    sd = load_file(str(tmp_path / "ct" / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.input_scale"] = torch.ones(1)
    save_file(sd, str(tmp_path / "ct" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="static quantization parameters"):
        open_weights(tmp_path / "ct")
    del sd["model.layers.0.mlp.down_proj.input_scale"]
    sd["model.layers.0.mlp.extra_proj.weight_scale"] = torch.ones(3, 1)
    save_file(sd, str(tmp_path / "ct" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="extra_proj.weight_scale has no"):
        open_weights(tmp_path / "ct")


def test_memory_estimate_counts_8bit_weights(dense, tmp_path):
    from hierviz.memory import _config_of, model_bytes
    write_checkpoint(dense, tmp_path / "ct", "int")
    cfg, fmt, _ = _config_of(str(tmp_path / "ct"))
    assert fmt == "w8a8-int8" and model_bytes(cfg, fmt) < model_bytes(cfg, "dense")
    write_checkpoint(dense, tmp_path / "fp8", "float")
    assert _config_of(str(tmp_path / "fp8"))[1] == "w8a8-fp8"
