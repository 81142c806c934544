"""`python -m hierviz profile`: the CPU version writes the JSON schema the Profile tab reads, the
GPU version explains itself on a machine without a GPU, and the figure builder draws it."""
from __future__ import annotations

import json

import pytest
import torch

from hierviz.measure import profile as prof
from hierviz.viz.profile_fig import profile_figure

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "vocab_size": 300, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512}


def test_cpu_profile_schema(tmp_path) -> None:
    torch.set_num_threads(1)
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "out"
    rc = prof.main(["--device", "cpu", "--shape", str(cfg), "--tokens", "1,4", "--context", "16",
                    "--group-size", "32", "--out", str(out)])
    assert rc == 0
    info = json.loads((out / "profile.json").read_text())
    assert info["schema"] == prof.SCHEMA and info["tokens"] == [1, 4] and info["shape"] == "tiny"
    assert info["copy_bandwidth_GBps"] > 0 and info["config"]["num_layers"] == 2
    scopes = {(s["format"], s["scope"]) for s in info["series"]}
    assert ("fp32", "layer") in scopes and ("fp32", "model") in scopes
    assert any(s["format"].startswith("w4") for s in info["series"])
    for s in info["series"]:
        assert len(s["us"]) == 2 and all(u > 0 for u in s["us"])
        assert s["floor_us"] > 0 and s["weight_bytes"] > 0 and s["estimated"] is False
    w4 = next(s for s in info["series"] if s["format"].startswith("w4") and s["scope"] == "layer")
    dense = next(s for s in info["series"] if s["format"] == "fp32" and s["scope"] == "layer")
    assert w4["weight_bytes"] < dense["weight_bytes"] / 4       # 4-bit codes + fp32 scales/offsets
    assert (out / "profile.html").exists()
    assert "command" in info


def test_gpu_profile_without_gpu_says_so(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prof.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bad_arguments(tmp_path, capsys) -> None:
    assert prof.main(["--device", "cpu", "--tokens", "0,x", "--out", str(tmp_path)]) == 2
    assert prof.main(["--device", "cpu", "--shape", "no-such-model", "--out", str(tmp_path)]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_shape_presets() -> None:
    name, cfg = prof.load_shape("llama3-70b")
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == \
        (8192, 28672, 80, 64, 8)
    assert cfg.vocab_size == 128256 and cfg.rope_theta == 500000.0 and cfg.max_position == 8192
    _, cfg8 = prof.load_shape("llama3-8b")
    assert (cfg8.hidden_size, cfg8.intermediate_size, cfg8.num_layers, cfg8.num_heads) == (4096, 14336, 32, 32)


HAND = {"schema": "hierviz.profile/1", "shape": "llama3-70b", "device": "NVIDIA H200", "copy_bandwidth_GBps": 4300,
        "tokens": [1, 8, 64], "config": {"num_layers": 80},
        "series": [
            {"format": "fp16", "scope": "layer", "us": [1000, 1010, 1100], "floor_us": 400, "estimated": False},
            {"format": "w4a16-triton", "scope": "layer", "us": [150, 200, 900], "floor_us": 110, "estimated": False},
            {"format": "fp16", "scope": "model", "us": [80000, 81000, 88000], "floor_us": 33000, "estimated": True},
            {"format": "w4a16-triton", "scope": "model", "us": [12000, 16000, 72000], "floor_us": 9000,
             "estimated": False}]}


def test_profile_figure_hand_made() -> None:
    fig = profile_figure(HAND)
    # one line per series and one floor per series, in the file's order; a format's legend entry is
    # shown once (first panel), an estimated curve always (its label says so)
    assert [(t.name, t.xaxis, t.showlegend) for t in fig.data] == [
        ("fp16", "x", True), ("fp16 bandwidth floor", "x", True),
        ("w4a16-triton", "x", True), ("w4a16-triton bandwidth floor", "x", True),
        ("fp16 (estimated)", "x2", True), ("fp16 bandwidth floor", "x2", False),
        ("w4a16-triton", "x2", False), ("w4a16-triton bandwidth floor", "x2", False)]
    assert [a.text for a in fig.layout.annotations] == ["one decoder layer", "whole model (80 layers + LM head)"]
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert list(fig.layout.xaxis.tickvals) == [1, 8, 64]
    # the model panel is in ms (values > 5 ms), the layer panel in µs: every point is the profile's
    assert fig.layout.yaxis.title.text == "forward latency (µs, log scale)"
    assert fig.layout.yaxis2.title.text == "forward latency (ms, log scale)"
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    lines = [t for t in fig.data if "floor" not in t.name]
    floors = [t for t in fig.data if "floor" in t.name]
    for row, line, floor in zip(HAND["series"], lines, floors):
        div = 1000.0 if row["scope"] == "model" else 1.0
        assert list(line.x) == HAND["tokens"] and list(line.y) == pytest.approx([u / div for u in row["us"]])
        assert list(floor.x) == [1, 64] and list(floor.y) == pytest.approx([row["floor_us"] / div] * 2)
        assert line.line.dash == ("dash" if row["estimated"] else "solid") and floor.line.dash == "dot"
        assert line.line.color == floor.line.color
    assert lines[0].line.color != lines[1].line.color
    assert "llama3-70b · NVIDIA H200 · copy 4300 GB/s" in fig.layout.title.text


def test_a_curve_is_named_by_the_w4_kernel_that_ran() -> None:
    """A profile made with HIERVIZ_W4_CUDA=on (its machine says the CUDA MMA variant ran the fp16 W4
    products) names the W4 curve and the crossing by that kernel, not by the format's own."""
    cuda = {**HAND, "machine": {"w4_fp16_kernel": "cuda_mma"}}
    names = {t.name for t in profile_figure(cuda).data}
    assert "w4a16-cuda_mma" in names and not any(n.startswith("w4a16-triton") for n in names)
    assert "fp16" in names                           # other formats keep their names
    assert "w4a16-triton" in {t.name for t in profile_figure({**HAND, "machine": {"w4_fp16_kernel": "triton"}}).data}
    crossing = [a.text for a in profile_figure(cuda).layout.annotations if "slower than" in a.text]
    assert all(t.startswith("w4a16-cuda_mma") for t in crossing)


def test_profile_figure_empty() -> None:
    fig = profile_figure({"series": [], "tokens": []})
    assert fig.data == () and [a.text for a in fig.layout.annotations] == ["one decoder layer"]
    assert fig.layout.title.text.endswith("<sup>? · ?</sup>")
