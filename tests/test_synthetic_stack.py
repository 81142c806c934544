"""`python -m hierviz synthetic-stack` at CPU size: the presets' checkpoint layouts written with
random weights load through the preset code path, and every method reproduces AR on them. The
same command at full size is the GPU's load test (docs/gpu.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hierviz.measure.synthetic_stack import PRESET_MODELS, main


@pytest.mark.parametrize("preset", sorted(PRESET_MODELS))
def test_synthetic_preset_loads_and_decodes_losslessly(preset: str, tmp_path: Path) -> None:
    from hierviz import memory
    from hierviz.settings import DecodeSettings
    from hierviz.engine import generate, output_tokens
    from hierviz.quant.w4 import W4Weight, dequantize
    from hierviz.stack import resolve_path, load_stack
    assert main(["--preset", preset, "--scale", "tiny", "--out", str(tmp_path)]) == 0
    index = json.loads((tmp_path / "target" / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 1 and all((tmp_path / "target" / f).exists() for f in shards)
    assert {"model.layers.0.mlp.down_proj.qweight", "model.layers.0.mlp.down_proj.qzeros",
            "model.layers.0.mlp.down_proj.scales", "model.layers.0.mlp.down_proj.g_idx"} <= set(index["weight_map"])
    qc = json.loads((tmp_path / "target" / "quantize_config.json").read_text())
    assert qc["bits"] == 4 and qc["sym"] and not qc["desc_act"]
    spec = json.loads((tmp_path / "stack.json").read_text())
    original = json.loads((Path(__file__).resolve().parents[1] / "assets" / "stacks" / f"{preset}.json").read_text())
    assert {k: v for k, v in spec.items() if k.startswith(("w4_kernel", "dtype"))} == \
        {k: v for k, v in original.items() if k.startswith(("w4_kernel", "dtype"))}
    parts = memory.stack_estimate(spec, lambda s: resolve_path(s, tmp_path))
    assert parts is not None and parts["target"] < parts["intermediate"]          # W4 vs fp16
    stack = load_stack(str(tmp_path), "cpu")
    down = stack.models.target.layers[0].down.w4[0]
    assert isinstance(down, W4Weight) and down.group_size == 32
    std = float(dequantize(down).std())
    assert 0.5 < std * down.in_features ** 0.5 < 2.0        # weights scaled like a trained layer's
    s = DecodeSettings(max_new_tokens=12, m_depth=2, m_tree_size=6, t_depth=3, t_tree_size=6, min_draft_len=2)
    want = output_tokens(generate(stack, "ar", "w5 w6 w7", s))
    assert len(want) == 12
    for method in ("spec", "eagle2", "hierspec"):
        assert output_tokens(generate(stack, method, "w5 w6 w7", s)) == want, method


def test_unknown_preset_and_bad_tokenizer_folder_are_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--preset", "nope", "--out", str(tmp_path)])
    assert main(["--preset", "paper-llama3-70b", "--scale", "tiny", "--out", str(tmp_path),
                 "--tokenizer-from", str(tmp_path)]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_memory_load_measures_a_stack_and_records_a_comparison(tmp_path: Path, capsys) -> None:
    from hierviz.measure import memory_report
    from hierviz.trace import comparison_from_json
    assert main(["--preset", "vicuna-13b-w4-single-gpu", "--scale", "tiny", "--out", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    trace = tmp_path / "cmp.json"
    assert memory_report.main(["--load", str(tmp_path / "s"), "--compare", "w5 w6 w7", "--max-new-tokens", "6",
                        "--trace", str(trace)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["stack"] == "vicuna-13b-w4-single-gpu-synthetic" and got["load_s"] >= 0 and got["peak_host_rss_gb"] > 0
    assert got["identical_to_ar"] == {"hierspec": True, "eagle2": True}
    assert got["estimate_gb"]["total"] == pytest.approx(sum(v for k, v in got["estimate_gb"].items() if k != "total"),
                                                        abs=0.05)
    assert [t.meta["method"] for t in comparison_from_json(trace.read_text())] == ["hierspec", "eagle2", "ar"]
    assert memory_report.main(["--load", str(tmp_path / "missing")]) == 2
