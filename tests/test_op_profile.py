"""`python -m hierviz.measure.op_profile` at a small shape on the CPU: it profiles real decode steps
through the engine's decoding state and writes an operator table whose shares add up."""
from __future__ import annotations

import json

import torch

from hierviz.measure.op_profile import main, table


def test_op_profile_on_cpu(tmp_path, capsys) -> None:
    n = torch.get_num_threads()
    try:
        assert main(["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--steps", "2",
                     "--prompt-len", "8", "--top", "50", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(n)
    info = json.loads((tmp_path / "op_profile.json").read_text())
    assert info["layers"] == 1 and info["step_ms_eager"] > 0 and "step_ms_graphs" not in info
    assert info["command"].startswith("python -m hierviz op-profile --shape smollm2 --layers 1")
    ops = {r["op"] for r in info["ops"]}
    assert "aten::mm" in ops or "aten::matmul" in ops or "aten::addmm" in ops
    assert abs(sum(r["share"] for r in info["ops"]) - 1.0) < 0.05
    assert "| op | calls / step |" in capsys.readouterr().out
    assert "w4_fp16_kernel" not in info      # a CUDA record's: the fp16 kernel that ran
    assert "W4A16 (cuda_mma)" in table(dict(info, w4_fp16_kernel="cuda_mma"))


def test_op_profile_sequence_forwards(tmp_path) -> None:
    """--tokens N: each step verifies N tokens (logits of all read back) and keeps one."""
    n = torch.get_num_threads()
    try:
        assert main(["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--steps", "2", "--tokens", "5",
                     "--prompt-len", "8", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(n)
    info = json.loads((tmp_path / "op_profile.json").read_text())
    assert info["tokens_per_forward"] == 5 and info["step_ms_eager"] > 0


def test_op_profile_bad_arguments(tmp_path, capsys) -> None:
    assert main(["--shape", "nope", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["--layers", "0", "--shape", "smollm2", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert main(["--tokens", "0", "--shape", "smollm2", "--device", "cpu", "--out", str(tmp_path)]) == 2
