"""The GPTQ and RTN quantizers: correctness of the integers, exact packing, and that GPTQ's
error feedback actually pays off on correlated calibration data."""
from __future__ import annotations

import pytest
import torch

from hierviz.quant.gptq import gptq_linear_to_w4, load_gptq_weights, save_gptq_checkpoint
from hierviz.quant.quantize import GPTQResult, HessianAccumulator, gptq_quantize, quantize_weights, rtn_quantize
from hierviz.quant.w4 import dequantize_unpermuted, w4_linear


def correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with strongly correlated channels and uneven scales (like real LLM inputs)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 2.0 * torch.randn(k, k, generator=g) / k ** 0.5
    scale = torch.rand(k, generator=g) * 3 + 0.1
    return (torch.randn(n, k, generator=g) @ mix) * scale


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    k, n = 256, 64
    w = torch.randn(n, k)
    x = correlated_inputs(1024, k)
    acc = HessianAccumulator(k)
    for chunk in x.split(300):                 # several batches, like real calibration
        acc.add_batch(chunk)
    return w, x, acc.hessian


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float((x @ w.T - x @ wq.T).norm())


def test_hessian_accumulator_matches_formula(problem):
    _, x, h = problem
    assert torch.allclose(h.double(), 2 * x.double().T @ x.double() / x.shape[0], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        HessianAccumulator(4).hessian


@pytest.mark.parametrize("group_size,sym,act_order", [(32, False, False), (32, True, True),
                                                      (128, False, True), (-1, True, False),
                                                      (64, False, True)])
def test_gptq_beats_rtn(problem, group_size, sym, act_order):
    w, x, h = problem
    gq = gptq_quantize(w, h, group_size=group_size, sym=sym, act_order=act_order)
    rq = rtn_quantize(w, group_size=group_size, sym=sym)
    e_gptq = output_error(x, w, gq.dequantize())
    e_rtn = output_error(x, w, rq.dequantize())
    assert e_gptq < 0.85 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("quantizer", ["gptq", "rtn"])
@pytest.mark.parametrize("sym", [False, True])
def test_result_is_valid_gptq(problem, quantizer, sym):
    w, _, h = problem
    r = gptq_quantize(w, h, 32, sym, act_order=True) if quantizer == "gptq" else rtn_quantize(w, 32, sym)
    assert isinstance(r, GPTQResult)
    assert r.intcodes.min() >= 0 and r.intcodes.max() <= 15
    assert r.zeros.min() >= 0 and r.zeros.max() <= 15
    if sym:
        assert bool((r.zeros == 8).all())
    assert torch.equal(r.scales, r.scales.half().float())      # fp16-representable
    counts = torch.bincount(r.g_idx, minlength=w.shape[1] // 32)
    assert bool((counts == 32).all())


def test_rtn_error_is_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(16, 128)
    r = rtn_quantize(w, 32, sym=False)
    step = r.scales[:, r.g_idx]
    # fp16 rounding of the scale can push the extreme values a hair past half a step
    assert bool(((w - r.dequantize()).abs() <= 0.5 * step * 1.01 + 1e-6).all())


def test_to_w4_is_exact_and_runs(problem):
    w, x, h = problem
    r = gptq_quantize(w, h, group_size=32, act_order=True)
    w4 = r.to_w4()
    assert w4.perm is not None                            # act-order -> input permutation
    assert torch.equal(dequantize_unpermuted(w4), r.dequantize())
    assert torch.allclose(w4_linear(x[:5], w4), x[:5] @ r.dequantize().T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_quantizer_output_round_trips_through_checkpoint(tmp_path, problem, fmt):
    w, _, h = problem
    # v1 cannot hold a zero point of 0; min_zero=1 keeps every group representable
    r = gptq_quantize(w, h, group_size=64, sym=False, act_order=True, min_zero=1 if fmt == "gptq" else 0)
    bias = torch.randn(w.shape[0])
    packed = r.pack(fmt, bias=bias)
    folder = save_gptq_checkpoint(tmp_path / fmt, {"model_type": "llama"}, {"model.norm.weight": torch.ones(4)},
                                  {"model.layers.0.mlp.up_proj": packed},
                                  {"bits": 4, "group_size": 64, "desc_act": True, "sym": False,
                                   "checkpoint_format": fmt})
    _, weights = load_gptq_weights(folder)
    w4 = weights["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(dequantize_unpermuted(w4), r.dequantize())
    assert torch.equal(weights["model.layers.0.mlp.up_proj.bias"], bias.half())


def test_dead_inputs_and_all_positive_groups():
    """Channels with zero activation get weight 0 and no NaNs; min_zero=1 handles w >= 0."""
    torch.manual_seed(2)
    k = 64
    x = torch.randn(256, k)
    x[:, :5] = 0
    acc = HessianAccumulator(k)
    acc.add_batch(x)
    w = torch.rand(8, k)                               # all nonnegative -> natural zero is 0
    r = gptq_quantize(w, acc.hessian, group_size=32, min_zero=1)
    assert torch.isfinite(r.dequantize()).all()
    assert bool((r.zeros >= 1).all())
    r.pack("gptq")                                      # representable in v1
    assert torch.equal(gptq_linear_to_w4(**{k_: v for k_, v in r.pack("gptq").items() if k_ != "bias"},
                                         group_size=32, checkpoint_format="gptq").codes, r.to_w4().codes)


def test_bad_arguments():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="group_size"):
        rtn_quantize(w, 48)
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_quantize(w, torch.eye(32), 32)


def test_quantize_weights_with_hooks_to_checkpoint(tmp_path):
    """The model-level path: hooks collect Hessians, GPTQ for hooked layers, RTN for the rest,
    and the packed result loads through the ordinary GPTQ loader."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    sd = {"model.up.weight": net[0].weight.detach(), "model.up.bias": net[0].bias.detach(),
          "model.down.weight": net[2].weight.detach(), "model.norm.weight": torch.ones(32)}
    acc = HessianAccumulator(64)
    handle = net[0].register_forward_pre_hook(acc.pre_hook)
    with torch.no_grad():
        net(correlated_inputs(512, 64))
    handle.remove()
    floats, packed = quantize_weights(sd, ["model.up", "model.down"], {"model.up": acc.hessian},
                                      group_size=32, checkpoint_format="gptq")
    assert set(floats) == {"model.norm.weight"} and set(packed) == {"model.up", "model.down"}
    folder = save_gptq_checkpoint(tmp_path / "q", {"model_type": "llama"}, floats, packed,
                                  {"bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                                   "checkpoint_format": "gptq"})
    _, weights = load_gptq_weights(folder)
    assert weights["model.up.weight"].perm is not None          # act-order on the GPTQ layer
    assert weights["model.down.weight"].perm is None            # RTN layer
    err = (dequantize_unpermuted(weights["model.down.weight"]) - sd["model.down.weight"]).abs().max()
    assert err < 0.1 * sd["model.down.weight"].abs().max()
    assert torch.equal(weights["model.up.bias"], sd["model.up.bias"].half())
