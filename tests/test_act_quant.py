"""The fused per-token activation quantizer of the 8-bit formats (hierviz.quant.act_quant) under
TRITON_INTERPRET=1, in a subprocess: its int8 and e4m3 codes and its scales are torch's definition
bit for bit (fp32, fp16, bf16 rows; a zero row, an outlier, ties, values rounding to a signed
zero, K beyond one block), so the int8
and FP8 products come out the same with it. On CUDA it runs only on the (GPU generation, Triton)
pairs where tests/test_gpu.py compared it with torch on a GPU (`PROVEN_PLATFORMS`)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from tests.tiny import run_interpreted

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from hierviz.quant import act_quant
    from hierviz.quant.act_quant import quantize_rows
    from hierviz.quant.fp8 import E4M3, E4M3_MAX, quantize_tokens_fp8
    from hierviz.quant.w8a8 import QMAX, quantize_tokens
    out = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        k = str(dt).split(".")[-1]
        x = torch.randn(6, 1500, dtype=dt) * 3
        x[2] = 0                                      # a zero row: the 1e-12 floor
        x[3, 7] = 100                                 # an outlier
        x[3, 8:12] = torch.tensor([-1e-5, 1e-5, -0.0, -3e-4])   # round to zero: -0 keeps its sign (0x80)
        x[4] = (torch.arange(1500) % 255 - 127).to(dt) / 127 * 0.5 * x[4].abs().max()   # halves: ties
        x[5] = torch.randn(1500, dtype=dt) * 1e-3
        q, s = quantize_rows(x, QMAX, torch.int8)
        q0, s0 = quantize_tokens(x)
        out[f"int8_{k}"] = [torch.equal(q, q0), torch.equal(s, s0)]
        q, s = quantize_rows(x[:, :700].contiguous(), E4M3_MAX, E4M3)
        q0, s0 = quantize_tokens_fp8(x[:, :700])
        out[f"fp8_{k}"] = [torch.equal(q.view(torch.uint8), q0.view(torch.uint8)), torch.equal(s, s0)]
        # torch on CUDA scales by the fp32 reciprocal (a tensor / python scalar is a * (1 / b)
        # there): the kernel's CUDA branch, checked here against that arithmetic
        xf = x.float()
        s_cuda = (xf.abs().amax(-1) * torch.tensor(1 / QMAX, dtype=torch.float32)).clamp_min(1e-12)
        q, s = quantize_rows(x, QMAX, torch.int8, cuda_arithmetic=True)
        out[f"int8_cuda_{k}"] = [torch.equal(q, torch.round(xf / s_cuda[:, None]).clamp(-QMAX, QMAX).to(torch.int8)),
                                 torch.equal(s, s_cuda)]
    # rows whose absmax the two arithmetics scale differently: each branch gives its own bits
    inv = torch.tensor(1 / QMAX, dtype=torch.float32)
    c = torch.rand(100000) * 10
    c = c[c * inv != c / QMAX][:8]
    x = torch.cat([c[:, None], c[:, None] * torch.rand(8, 40)], 1)
    out["scale_arithmetic"] = [torch.equal(quantize_rows(x, QMAX, torch.int8, cuda_arithmetic=True)[1], c * inv),
                               torch.equal(quantize_rows(x, QMAX, torch.int8, cuda_arithmetic=False)[1], c / QMAX),
                               len(c) == 8]
    # a strided view is quantized as its values
    xs = torch.randn(4, 64)[:, ::2]
    out["strided"] = torch.equal(quantize_rows(xs, QMAX, torch.int8)[0], quantize_tokens(xs)[0])
    # the formats' products with the kernel forced: the same bits as with torch's quantizer, so
    # every decoder's output is unchanged (the decoders' equality to AR is tests/test_formats.py's)
    from hierviz.quant.fp8 import fp8_linear, quantize_fp8
    from hierviz.quant.w8a8 import quantize_w8, w8a8_linear
    w = torch.randn(96, 160)
    x = torch.randn(3, 5, 160, dtype=torch.bfloat16)
    for fmt, product, weight in (("w8a8-int8", w8a8_linear, quantize_w8(w)), ("w8a8-fp8", fp8_linear, quantize_fp8(w))):
        act_quant.force(False)
        want = product(x, weight)
        act_quant.force(True)
        out[fmt] = torch.equal(product(x, weight), want)
        act_quant.force(None)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(run_interpreted(_SCRIPT)[-1])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_codes_and_scales_are_torchs_bits(results, fmt, dtype) -> None:
    assert results[f"{fmt}_{dtype}"] == [True, True]
    assert results["strided"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_branch_scales_by_the_reciprocal_as_torch_does_on_cuda(results, dtype) -> None:
    """torch on CUDA computes x / 127.0 as x * fp32(1 / 127); on the CPU it divides. The kernel
    matches the torch of the device it runs on (its CUDA branch checked here, under the interpreter)."""
    assert results[f"int8_cuda_{dtype}"] == [True, True]
    assert results["scale_arithmetic"] == [True, True, True]


@pytest.mark.parametrize("fmt", ["w8a8-int8", "w8a8-fp8"])
def test_the_formats_products_are_unchanged_with_the_kernel(results, fmt) -> None:
    assert results[fmt] is True


def test_off_by_default_until_proven_on_a_gpu() -> None:
    from hierviz.quant import act_quant
    x = torch.zeros(2, 8)
    assert not act_quant.enabled(x)                       # the CPU uses torch's path
    act_quant.force(True)
    try:
        assert act_quant.enabled(x)
    finally:
        act_quant.force(None)


@pytest.mark.parametrize("capability,triton,proven", [((9, 0), "3.6", True), ((8, 0), "3.6", False),
                                                       ((9, 0), "3.9", False), ((10, 0), "3.6", False)])
def test_on_cuda_only_where_the_gpu_test_passed(monkeypatch, capability, triton, proven) -> None:
    """A GPU generation or Triton the bit-for-bit GPU test never ran on keeps torch's path."""
    from hierviz.quant import act_quant, kernel_guard
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(kernel_guard, "triton_version", lambda: triton)
    monkeypatch.setattr(act_quant, "_proven_on", {})
    assert act_quant.platform_proven(torch.device("cuda", 0)) is proven
    assert act_quant.platform_proven(torch.device("cpu")) is False


def test_measurements_record_which_quantizer_ran(monkeypatch):
    """machine_info (whatif, compat, bench) names the quantizer the 8-bit products ran, which the
    cost model prices (hierviz.measure.cost_model.as_measured)."""
    from hierviz import machine
    from hierviz.quant import act_quant
    monkeypatch.setattr(machine, "gpu_name", lambda device: "NVIDIA H200")
    assert machine.machine_info("cpu")["activation_quantizer"] == "torch"     # not a proven platform
    act_quant.force(True)
    try:
        assert machine.machine_info("cpu")["activation_quantizer"] == "fused"
    finally:
        act_quant.force(None)
    monkeypatch.undo()
    assert "activation_quantizer" not in machine.machine_info("cpu")          # no GPU, no 8-bit GPU products
