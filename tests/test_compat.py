"""`python -m hierviz compat`: the what-if per target weight format in one process (CPU, tiny
shapes), the layer-subset scaling used where a format does not fit the GPU, and its errors."""
from __future__ import annotations

import json

from hierviz.measure import compat
from hierviz.measure.common import load_shape


def test_compat_runs_every_format_and_writes_the_table(tmp_path):
    rc = compat.main(["--tiny", "--device", "cpu", "--max-new-tokens", "12", "--formats", "dense,w8a8-int8",
                      "--acceptance-rates", "0.9,0.8,0.7", "--out", str(tmp_path)])
    assert rc == 0
    info = json.loads((tmp_path / "compat.json").read_text())
    assert [r["format"] for r in info["rows"]] == ["dense", "w8a8-int8"]
    for r in info["rows"]:
        assert set(r["tokens_per_s"]) == {"ar", "eagle2", "hierspec"} and r["speedup_vs_ar"]["ar"] == 1.0
        assert r["target_rows_per_round"]["eagle2"] == info["settings"]["t_tree_size"] + 1
        assert 2.0 <= r["target_rows_per_round"]["hierspec"] <= 40
        assert abs(r["hierspec_vs_eagle2"] - r["tokens_per_s"]["hierspec"] / r["tokens_per_s"]["eagle2"]) < 1e-9
    assert info["rows"][1]["target"].startswith("W8A8-int8") or "int8" in info["rows"][1]["target"]
    md = (tmp_path / "compat.md").read_text()
    assert "| W8A8-int8 |" in md and "| FP32 (dense) |" in md and "projected with replayed acceptance" in md


def test_a_target_too_big_for_the_gpu_runs_a_layer_subset_and_is_scaled():
    _, t_cfg = load_shape("llama3-70b")
    _, m_cfg = load_shape("llama3-8b")
    budget = 139e9 * compat.GPU_FILL
    assert compat.fitting_layers(t_cfg, m_cfg, "w4", "w4", budget) == 80
    dense = compat.fitting_layers(t_cfg, m_cfg, "dense", "w4", budget)
    assert 30 < dense < 80
    info = {"dtype": "float16", "formats": {"target": "dense"}, "settings": {"t_tree_size": 23},
            "methods": {"ar": {"tokens_per_s": 100.0, "stages_ms_per_token": {"target_verify": 9.0, "overhead": 1.0},
                               "tokens_per_round": 1.0}}}
    row = compat.row("dense", info, 40, 80, "eagle2")
    assert abs(row["tokens_per_s"]["ar"] - 1000 / 19.0) < 1e-9        # 10 ms + 9 ms more of target layers
    assert row["layers_measured"] == 40 and row["target_rows_per_round"] == {"ar": 1.0}
    assert "40 of 80 target layers" in compat.markdown({
        "head": "eagle2", "shapes": {"target": "llama3-70b", "intermediate": "llama3-8b"}, "intermediate": "W4A16",
        "machine": {"gpu": "NVIDIA H200"}, "device": "cuda", "rows": [row]})


def test_compat_refuses_flags_it_sets_itself_and_unknown_formats(tmp_path, capsys):
    assert compat.main(["--tiny", "--target-format", "w4", "--out", str(tmp_path)]) == 2
    assert "sets --target-format itself" in capsys.readouterr().err
    assert compat.main(["--tiny", "--formats", "fp4", "--out", str(tmp_path)]) == 2
    assert "unknown --formats fp4" in capsys.readouterr().err
    assert compat.main(["--tiny", "--t-depth", "0", "--out", str(tmp_path)]) == 2
