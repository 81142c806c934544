"""`python -m hierviz kernel-bench` as a user runs it: the CPU benchmark through the CLI exits 0,
prints its table and writes its JSON (the GPU run, Marlin included, is in tests/test_gpu.py)."""
from __future__ import annotations

import json

from hierviz.cli import main


def test_cpu_kernel_bench_through_the_cli(tmp_path, capsys) -> None:
    assert main(["kernel-bench", "--cpu", "--out", str(tmp_path), "--ms", "1", "--shape", "128,256,32"]) == 0
    assert "int4pack_cpu" in capsys.readouterr().out
    res = json.loads((tmp_path / "kernel_bench_cpu.json").read_text())
    assert [r["M"] for r in res["rows"]] == [1] and res["rows"][0]["int4pack_cpu_us"] > 0
