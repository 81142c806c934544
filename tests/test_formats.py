"""Weight formats behind one linear interface (hierviz.quant.formats): the model code takes any
registered format, W8A8 int8 computes what its definition says, gives each row the same bits at
every row count, and a W8A8 target keeps every decoder identical to its own greedy output."""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.models.llama import Linear, WeightsError  # noqa: E402
from hierviz.quant.formats import FORMATS, dense_of, format_of, get_format, quantize_option  # noqa: E402
from hierviz.quant.w4 import W4Weight, quantize_rtn  # noqa: E402
from hierviz.quant.fp8 import FP8Weight, fp8_linear, quantize_fp8, quantize_tokens_fp8  # noqa: E402
from hierviz.quant.w8a8 import W8Weight, quantize_tokens, quantize_w8, w8a8_linear  # noqa: E402


def test_registry_names_each_format_once():
    assert {"w4a16", "w8a8-int8", "w8a8-fp8"} <= set(FORMATS)
    w = torch.randn(32, 64)
    assert format_of(w) is None
    assert format_of(quantize_rtn(w, 32)).name == "w4a16" and format_of(quantize_w8(w)).name == "w8a8-int8"
    with pytest.raises(ValueError, match="unknown weight format 'fp4'.*w8a8-int8"):
        get_format("fp4")
    with pytest.raises(ValueError, match="unknown quantize option 'int3'.*rtn-g"):
        quantize_option("int3")
    assert isinstance(quantize_option("rtn-g32")(w), W4Weight) and isinstance(quantize_option("w8a8-int8")(w), W8Weight)
    assert isinstance(quantize_option("w8a8-fp8")(w), FP8Weight)
    assert quantize_option("rtn-g32", torch.device("cuda"))


def test_cuda_refuses_an_unproven_format_and_fp8_before_ada(monkeypatch):
    """A format whose product has not run on a GPU here is refused on CUDA; FP8 needs compute
    capability 8.9 (an A100 is 8.0) and says which formats to use instead."""
    import dataclasses
    with monkeypatch.context() as m:
        m.setitem(FORMATS, "w8a8-int8", dataclasses.replace(FORMATS["w8a8-int8"], gpu_proven=False))
        with pytest.raises(ValueError, match="has not been run on a GPU"):
            quantize_option("w8a8-int8", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*8.0.*W4A16 or W8A8-int8"):
        quantize_option("w8a8-fp8", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert quantize_option("w8a8-fp8", torch.device("cuda")) is FORMATS["w8a8-fp8"].quantize


def test_w8a8_product_is_its_definition():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 96, generator=g), torch.randn(5, 96, generator=g)
    q = quantize_w8(w)
    assert q.codes.dtype == torch.int8 and int(q.codes.abs().max()) == 127
    torch.testing.assert_close(dense_of(q), w, atol=float(q.scales.max()) / 2 + 1e-6, rtol=0)
    xq, s = quantize_tokens(x)
    want = (xq.double() @ q.codes.double().t()) * s.double()[:, None] * q.scales.double()[None, :]
    torch.testing.assert_close(w8a8_linear(x, q).double(), want, rtol=1e-6, atol=1e-6)
    # close to the dense product: int8 on both sides keeps ~2 significant digits
    err = (w8a8_linear(x, q) - x @ w.t()).abs().max() / (x @ w.t()).abs().max()
    assert err < 0.03


def test_fp8_product_is_its_definition():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 96, generator=g), torch.randn(11, 96, generator=g)
    q = quantize_fp8(w)
    assert q.codes.dtype == torch.float8_e4m3fn and float(q.codes.float().abs().max()) == 448.0
    xq, s = quantize_tokens_fp8(x)
    want = (xq.double() @ q.codes.double().t()) * s.double()[:, None] * q.scales.double()[None, :]
    torch.testing.assert_close(fp8_linear(x, q).double(), want, rtol=1e-5, atol=1e-5)
    # torch's own FP8 product (row-wise scales) agrees
    ref = torch._scaled_mm(xq, q.codes.t(), scale_a=s[:, None], scale_b=q.scales[None, :], out_dtype=torch.float32)
    torch.testing.assert_close(fp8_linear(x, q), ref, rtol=1e-5, atol=1e-5)
    err = (fp8_linear(x, q) - x @ w.t()).abs().max() / (x @ w.t()).abs().max()
    assert err < 0.06


@pytest.mark.parametrize("quantize, product", [(quantize_w8, w8a8_linear), (quantize_fp8, fp8_linear)])
def test_8bit_rows_have_the_same_bits_at_every_row_count(quantize, product):
    g = torch.Generator().manual_seed(1)
    q = quantize(torch.randn(64, 128, generator=g))
    x = torch.randn(40, 128, generator=g)
    whole = product(x, q)
    for rows in (1, 3, 9, 17, 40):
        assert torch.equal(product(x[:rows], q), whole[:rows])
    assert torch.equal(product(x[7:8], q), whole[7:8])
    assert torch.equal(product(x[33:35], q), whole[33:35])


def test_linear_fuses_within_a_format_and_refuses_mixtures():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 32, generator=g), torch.randn(8, 32, generator=g)
    lin = Linear([quantize_w8(a), quantize_w8(b)], [None, None])
    assert lin.weight is None and lin.q.format == "w8a8-int8" and lin.splits == [16, 8] and lin.w4 == []
    x = torch.randn(3, 32, generator=g)
    ya, yb = lin.split(lin(x))
    assert torch.equal(ya, w8a8_linear(x, quantize_w8(a))) and torch.equal(yb, w8a8_linear(x, quantize_w8(b)))
    res = torch.ones(3, 24)
    assert lin(x, add_to=res) is res
    with pytest.raises(WeightsError, match="mixes weight formats"):
        Linear([quantize_w8(a), quantize_rtn(b, 32)], [None, None])
    with pytest.raises(WeightsError, match="mixes weight formats"):
        Linear([a, quantize_w8(b)], [None, None])


_AR_OF_8BIT: dict[tuple[str, str], list[int]] = {}     # (format, prompt) -> AR's tokens, made once per module


@pytest.mark.parametrize("fmt", ["w8a8-int8", "w8a8-fp8"])
@pytest.mark.parametrize("method", ["spec", "eagle2", "hierspec"])
def test_every_method_reproduces_ar_of_an_8bit_target(method, fmt):
    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.stack import tiny_random_stack
    st = tiny_random_stack("cpu", target_format=fmt)
    t = st.models.target
    assert t.products_rows_invariant_cpu() and get_format(fmt).label in st.meta["target"]
    s = DecodeSettings(max_new_tokens=24)
    for prompt in ("the quick brown fox", "1 2 3 4"):
        if (fmt, prompt) not in _AR_OF_8BIT:
            _AR_OF_8BIT[fmt, prompt] = output_tokens(generate(st, "ar", prompt, s))
        ar = _AR_OF_8BIT[fmt, prompt]
        assert len(ar) == 24
        trace = generate(st, method, prompt, s)
        assert output_tokens(trace) == ar


def test_a_stack_file_quantizes_its_target_to_w8a8(tmp_path):
    """`"quantize": "w8a8-int8"` in a stack file: T's linears become W8A8, T is batch-invariant on
    the CPU with no W4 kernel (integer products), and the decoders match AR."""
    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.stack import StackError, load_stack
    from tests.tiny import make_tiny_hf, make_tiny_tokenizer
    make_tiny_hf(tmp_path / "t", layers=3, tie=True)
    make_tiny_tokenizer(tmp_path / "t")
    (tmp_path / "s.json").write_text(json.dumps({"name": "w8", "target": {"path": "t", "quantize": "w8a8-int8"},
                                                 "intermediate": {"path": "t"}}))
    st = load_stack(str(tmp_path / "s.json"), device="cpu")
    t = st.models.target
    assert all(lin.q is not None and lin.q.format == "w8a8-int8" for lin in t.layers[0].children() if isinstance(lin, Linear))
    assert t.batch_invariant
    s = DecodeSettings(max_new_tokens=12)
    ar = output_tokens(generate(st, "ar", "w5 w9 w11", s))
    assert output_tokens(generate(st, "spec", "w5 w9 w11", s)) == ar
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad", "target": {"path": "t", "quantize": "int3"}}))
    with pytest.raises(StackError, match="unknown quantize option"):
        load_stack(str(tmp_path / "bad.json"), device="cpu")


def test_whatif_projects_a_w8a8_target(tmp_path):
    """`whatif --target-format w8a8-int8`: T built in that format, every method run, the outputs
    and the app's labels name the format."""
    from hierviz.measure.whatif import main
    from hierviz.viz.whatif_fig import shapes_label
    assert main(["--tiny", "--device", "cpu", "--target-format", "w8a8-int8", "--max-new-tokens", "8",
                 "--methods", "ar,eagle2,hierspec", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    assert info["formats"]["target"].startswith("W8A8-int8")
    assert set(info["methods"]) == {"ar", "eagle2", "hierspec"}
    assert "(W8A8-int8)" in shapes_label(info) and "(W8A8-int8)" in (tmp_path / "whatif.md").read_text()
