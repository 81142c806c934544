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


def test_several_shapes_in_one_process_write_one_file_each(tmp_path, capsys) -> None:
    assert main(["kernel-bench", "--cpu", "--out", str(tmp_path), "--ms", "1",
                 "--shape", "128,256,32", "--shape", "64,128,64"]) == 0
    out = capsys.readouterr().out
    assert "K=128 N=256 group 32" in out and "K=64 N=128 group 64" in out
    for stem, k in (("kernel_bench_cpu_128x256g32", 128), ("kernel_bench_cpu_64x128g64", 64)):
        res = json.loads((tmp_path / f"{stem}.json").read_text())
        assert res["rows"][0]["int4pack_cpu_us"] > 0 and str(k) in json.dumps(res)


def test_a_bad_shape_is_a_usage_error(tmp_path, capsys) -> None:
    import pytest
    for bad in ("128,256", "a,b,c", "128,0,32"):
        with pytest.raises(SystemExit) as e:
            main(["kernel-bench", "--cpu", "--out", str(tmp_path), "--shape", bad])
        assert e.value.code == 2 and "--shape takes K,N,G" in capsys.readouterr().err


def test_a_failing_peer_records_why_and_the_row_goes_on() -> None:
    """kernel-bench's peers (Marlin, GemLite) share one timing step: a peer that raises at some M
    names the error in its column and the bench keeps the row."""
    import torch
    from hierviz.measure.kernel_bench import _time_peer
    x16 = [torch.randn(2, 8) for _ in range(2)]
    w = torch.randn(4, 8)
    row: dict = {}
    _time_peer(row, "good", [lambda x: x @ w.t()] * 2, x16, x16[0] @ w.t(), lambda fns, rep: len(fns) * 1.0, 1.0)
    assert row == {"good_err": 0.0, "good_us": 2.0}

    def broken(x):
        raise RuntimeError("illegal instruction")
    _time_peer(row, "bad", [broken] * 2, x16, x16[0] @ w.t(), lambda fns, rep: 1.0, 1.0)
    assert "illegal instruction" in row["bad_error"] and "bad_us" not in row and row["good_us"] == 2.0


def test_the_cuda_mma_column_says_why_a_shape_is_left_out() -> None:
    """kernel-bench's CUDA MMA column: a weight shape the kernel does not take is skipped with the
    reason (checked before any GPU query, so it runs here)."""
    from hierviz.measure.kernel_bench import cuda_mma_layers
    from hierviz.quant.w4 import quantize_rtn
    import torch
    info: dict = {}
    assert cuda_mma_layers([quantize_rtn(torch.randn(24, 192), 96)], info) is None
    assert info["cuda_mma_error"] == "the CUDA MMA kernel does not take 24x192 g96"
