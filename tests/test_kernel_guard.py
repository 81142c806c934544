"""The W4 product's safety net on GPUs nobody here ran (hierviz.quant.kernel_guard) and the
correctness sweep command, on the CPU under TRITON_INTERPRET=1 (in a subprocess: the interpreter
must be on before triton is imported). The sweep's full run is a GPU command (docs/kernels.md)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from tests.tiny import run_interpreted

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import dataclasses, json, os, sys, warnings
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from pathlib import Path
    from hierviz.measure import w4_sweep
    from hierviz.quant import triton_w4
    from hierviz.quant.triton_w4 import Config
    from hierviz.quant.w4 import quantize_rtn
    out = {}
    torch.manual_seed(0)
    w = quantize_rtn(torch.randn(192, 256), 64)
    x = torch.randn(5, 256, dtype=torch.float16)
    ref = x.float() @ triton_w4.dequantize(w, torch.float32).t()
    cfg = Config(64, 16, 2, 4, 2, tma=True)
    real_launch = triton_w4._launch
    class Kernel:
        def __init__(self, ttgir): self.asm = {"ttgir": ttgir}
    clean, chained = Kernel(""), Kernel(Path(sys.argv[1]).read_text())

    def launch(bad_tma=False, bad_all=False, hazard=False):
        def fake(x, w, c, interp, add_to):
            y, _ = real_launch(x, w, c, True, add_to)
            if bad_all or (bad_tma and c.tma):
                y = y.clone(); y[:, :8] *= 1.5          # one 8-feature group wrong, as the GPU fault
            return y, (chained if hazard and c.tma else clean)
        return fake
    for name, kw in (("good", {}), ("bad_tma", {"bad_tma": True}), ("bad_all", {"bad_all": True}),
                     ("hazard", {"hazard": True})):
        triton_w4._VERIFIED.clear()
        triton_w4._HAZARDS.clear()
        triton_w4._launch = launch(**kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = triton_w4._verified(x, w, cfg)
        out[name] = {"config": None if got is None else dataclasses.asdict(got), "warnings": len(caught)}
    triton_w4._launch = real_launch
    y = triton_w4._reference_product(x, w, None)
    out["reference_err"] = float((y.float() - ref).norm() / ref.norm())
    # the sweep: a clean run, then the same run with every product's first 8 features scaled
    rc_clean = w4_sweep.main(["--shapes", "256x192", "--groups", "64,channel", "--rows", "1,17,33,70",
                              "--modes", "normal", "--out", sys.argv[2]])
    clean_json = json.loads((Path(sys.argv[2]) / "w4_sweep.json").read_text())
    real_product = w4_sweep._product
    def broken(x, w, path):
        y = real_product(x, w, path)
        if x.shape[0] >= 33:
            y = y.clone(); y[:, :8] *= 1.05
        return y
    w4_sweep._product = broken
    rc_broken = w4_sweep.main(["--shapes", "256x192", "--groups", "64", "--rows", "1,17,33,70", "--modes", "normal",
                               "--act-order", "off", "--paths", "tma"])
    out["sweep"] = {"rc_clean": rc_clean, "rc_broken": rc_broken, "summary": clean_json["summary"],
                    "wrong": [r["wrong_rows_at"] for r in clean_json["results"]],
                    "paths": sorted({r["path"] for r in clean_json["results"]}),
                    "groups": sorted({r["group"] for r in clean_json["results"]}),
                    "acts": sorted({r["act_order"] for r in clean_json["results"]})}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sweep")
    return json.loads(run_interpreted(_SCRIPT, str(ROOT / "tests/data/ttgir_w4_loop_triton36_chained.txt"),
                                      str(out))[-1])


def test_first_use_check_keeps_a_config_that_agrees(guarded) -> None:
    assert guarded["good"] == {"config": guarded["good"]["config"], "warnings": 0}
    assert guarded["good"]["config"]["tma"] is True


@pytest.mark.parametrize("case", ["bad_tma", "hazard"])
def test_first_use_check_falls_back_to_the_pointer_path(guarded, case) -> None:
    """A wrong product, or a compiled kernel whose TTGIR keeps a register-operand wgmma in flight
    across its loop (the recorded Triton 3.6 loop), sends the product to the pointer-load variant."""
    got = guarded[case]
    assert got["config"] is not None and got["config"]["tma"] is False and got["warnings"] == 1


def test_first_use_check_ends_at_the_reference(guarded) -> None:
    assert guarded["bad_all"] == {"config": None, "warnings": 3}
    assert guarded["reference_err"] < 1e-3


def test_sweep_passes_the_kernel_and_catches_a_wrong_feature_group(guarded) -> None:
    s = guarded["sweep"]
    assert s["rc_clean"] == 0 and s["rc_broken"] == 1
    # 2 groups x 2 act-orders x 2 paths, 4 row counts each, none wrong
    assert s["summary"]["cases"] == 8 and s["summary"]["products"] == 32
    assert s["wrong"] == [[]] * 8
    assert s["paths"] == ["pointer", "tma"] and s["groups"] == [64, 256] and s["acts"] == [False, True]


def test_platform_table_and_tolerances() -> None:
    from hierviz.quant import kernel_guard
    assert kernel_guard.platform_proven(torch.device("cpu"))
    assert (9, "3.6") in kernel_guard.PROVEN_PLATFORMS
    rows = kernel_guard.check_rows(3000)
    assert rows[:3].tolist() == [0, 1, 2] and rows[-1].item() == 2999 and len(rows) == 1024 + 256
    assert kernel_guard.check_rows(100).tolist() == list(range(100))
    y = torch.ones(2, 4)
    y[1, 0] = float("nan")
    errs = kernel_guard.row_errors(y, torch.ones(2, 4))
    assert errs[0].item() == 0.0 and errs[1].item() == float("inf")


def test_w4_sweep_covers_every_preset_models_layers_and_lm_head() -> None:
    """The sweep's shapes: each model's fused and separate projections and its LM head (K = hidden,
    N = vocabulary), which an intermediate may hold in W4 (quantize_lm_head)."""
    from hierviz.measure import w4_sweep
    shapes = w4_sweep.model_shapes(list(w4_sweep.MODELS))
    assert shapes[(4096, 128256)] == ["llama-3-8b:lm_head"] and shapes[(8192, 128256)] == ["llama-3-70b:lm_head"]
    assert shapes[(576, 49152)] == ["smollm2-135m:lm_head"]
    for name in w4_sweep.MODELS:
        layers = {layer.split(":")[1] for at in shapes.values() for layer in at if layer.startswith(name + ":")}
        assert layers == {"qkv", "q/o", "k/v", "gate_up", "gate/up", "down", "lm_head"}, name


def test_w4_sweep_refuses_bad_shapes_with_one_line(capsys) -> None:
    from hierviz.measure import w4_sweep
    for bad in ("12x", "256x0", "axb", "256x192x3"):
        assert w4_sweep.main(["--shapes", bad]) == 2
        assert "bad --shapes" in capsys.readouterr().err


def test_w4_sweep_runs_the_workers_the_gpu_memory_holds_and_refuses_an_out_of_memory_run(monkeypatch, capsys) -> None:
    """--workers share one GPU: the sweep runs as many as its free memory holds (an H100's 79 GB
    holds 4 at the presets' largest weight, an H200's 8), and a run that still runs out of memory
    ends with one line saying what to do, not a traceback."""
    from hierviz.measure import w4_sweep
    jobs = w4_sweep.sweep_jobs(w4_sweep.model_shapes(list(w4_sweep.MODELS)), ["128"], [False])
    rows = list(range(1, 129)) + w4_sweep.PREFILL_ROWS
    peak = w4_sweep.worker_peak_bytes(jobs, rows)
    assert 13.7e9 < peak < 20e9, peak            # 13.7 GB measured for 8192 x 152064
    assert w4_sweep.workers_that_fit(8, int(79e9), peak) == 4
    assert w4_sweep.workers_that_fit(8, int(140e9), peak) == 8
    assert w4_sweep.workers_that_fit(8, int(1e9), peak) == 1
    assert w4_sweep.workers_that_fit(2, int(140e9), peak) == 2
    assert w4_sweep.main(["--shapes", "256x192", "--workers", "0"]) == 2
    assert "bad --workers" in capsys.readouterr().err

    def out_of_memory(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB.\nmore")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(w4_sweep, "_worker", out_of_memory)
    assert w4_sweep.main(["--shapes", "256x192", "--groups", "64", "--rows", "1", "--paths", "tma"]) == 2
    err = capsys.readouterr().err
    assert "ran out of memory with 1 worker" in err and "Tried to allocate 256.00 MiB" in err and "fewer --workers" in err
