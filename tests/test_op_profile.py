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


def test_op_profile_draft_trees(tmp_path, capsys) -> None:
    """--draft DEPTH,TOPK,SIZE: each step drafts one EAGLE-2 tree of that shape from a synthetic
    head on the model (HierSpec's E_M on M) and reads it back; --draft-vocab narrows the head's
    rows, --head-format its linears' format. The head's forwards and its LM head's product are what
    the table shows."""
    n = torch.get_num_threads()
    try:
        assert main(["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--steps", "2", "--draft", "3,4,10",
                     "--draft-vocab", "4096", "--prompt-len", "8", "--top", "60", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(n)
    info = json.loads((tmp_path / "op_profile.json").read_text())
    assert info["draft_tree"] == {"depth": 3, "topk": 4, "size": 10, "draft_vocab": 4096, "head_format": "dense"}
    assert info["step_ms_eager"] > 0 and all(r["us_per_layer"] is None for r in info["ops"])
    ops = {r["op"]: r for r in info["ops"]}
    mm = [r for op, r in ops.items() if op in ("aten::mm", "aten::matmul", "aten::addmm", "aten::linear")]
    assert mm and sum(r["calls_per_step"] for r in mm) >= 3       # a head forward and LM head product per depth
    assert any(op in ops for op in ("aten::topk", "aten::sort", "aten::argsort"))   # the frontier's choice
    out = capsys.readouterr().out
    assert "one EAGLE-2 draft tree per step (depth 3, top-4, 10 nodes, 4096 draft ids)" in out and "| - |" in out
    try:
        assert main(["--shape", "smollm2", "--layers", "1", "--device", "cpu", "--steps", "1", "--draft", "2,4,6",
                     "--head-format", "w4", "--prompt-len", "8", "--out", str(tmp_path / "w4")]) == 0
    finally:
        torch.set_num_threads(n)
    assert json.loads((tmp_path / "w4" / "op_profile.json").read_text())["draft_tree"]["head_format"] == "w4a16"
    assert "(depth 2, top-4, 6 nodes, head linears w4a16)" in capsys.readouterr().out


def test_op_profile_refuses_bad_draft_shapes(tmp_path, capsys) -> None:
    for bad in ("3,10", "a,b,c", "0,10,10", "2,2,9"):
        assert main(["--shape", "smollm2", "--device", "cpu", "--draft", bad, "--out", str(tmp_path)]) == 2, bad
        assert "--draft" in capsys.readouterr().err, bad
    assert main(["--shape", "smollm2", "--device", "cpu", "--draft-vocab", "100", "--out", str(tmp_path)]) == 2
    assert "--draft-vocab and --head-format need --draft" in capsys.readouterr().err
    assert main(["--shape", "smollm2", "--device", "cpu", "--head-format", "w4", "--out", str(tmp_path)]) == 2
    assert "need --draft" in capsys.readouterr().err
    assert main(["--shape", "smollm2", "--device", "cpu", "--draft", "3,4,10", "--draft-vocab", "0",
                 "--out", str(tmp_path)]) == 2
    assert "--draft-vocab must be" in capsys.readouterr().err
