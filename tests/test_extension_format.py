"""A weight format added at run time shows up wherever formats do, with no edit outside its own
module (tests/toy_format.py: W4 stored as dense fp32) and its registration: stack files, the
decoders, memory estimates, the what-if, the compatibility table, the cost model, the profile,
the What-if tab and the CLI flags. Registered for this module only, removed at its end."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.quant import formats  # noqa: E402
from tests import toy_format as toy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def registered():
    fmt = formats.register(toy.toy_entry())
    yield fmt
    formats.unregister(toy.NAME)
    assert formats.lookup(toy.NAME) is None and formats.lookup(toy.ALIAS) is None


def test_the_registry_finds_it_by_name_alias_weight_series_and_description(registered):
    w = toy.toy_weight(16, 64)
    assert formats.get_format(toy.ALIAS) is registered and formats.format_of(w) is registered
    assert formats.canonical_name(toy.ALIAS.upper()) == toy.NAME
    assert formats.format_of_series(toy.NAME) is registered
    assert formats.format_of_description(f"{toy.LABEL} synthetic (random weights)") is registered
    assert toy.NAME in [f.name for f in formats.by_width()]
    torch.testing.assert_close(formats.dense_of(w), w.weight)
    with pytest.raises(ValueError, match="taken"):
        formats.register(dataclasses.replace(toy.toy_entry(), name="other"))     # its alias is the toy's


def test_a_stack_file_quantizes_a_model_to_it_and_decoding_stays_exact(tmp_path):
    """"quantize": the toy's alias on the target of a tiny HF stack: its linears become the toy's,
    the target is batch-invariant on the CPU, and sequence speculation reproduces the target's
    greedy output; the intermediate quantized to it too still only drafts."""
    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.models.llama import Linear
    from hierviz.stack import load_stack
    from tests.tiny import make_tiny_hf, make_tiny_tokenizer
    make_tiny_hf(tmp_path / "t", layers=3, tie=True)
    make_tiny_tokenizer(tmp_path / "t")
    (tmp_path / "s.json").write_text(json.dumps({"name": "toy", "target": {"path": "t", "quantize": toy.ALIAS},
                                                 "intermediate": {"path": "t", "quantize": toy.NAME}}))
    st = load_stack(str(tmp_path / "s.json"), device="cpu")
    t = st.models.target
    lins = [m for m in t.layers[0].modules() if isinstance(m, Linear)]
    assert lins and all(lin.q is not None and lin.q.format == toy.NAME for lin in lins)
    assert t.batch_invariant and t.products_rows_invariant_cpu()
    s = DecodeSettings(max_new_tokens=12)
    ar = output_tokens(generate(st, "ar", "w5 w9 w11", s))
    assert len(ar) == 12 and output_tokens(generate(st, "spec", "w5 w9 w11", s)) == ar


def test_tree_methods_on_a_tiny_target_in_it_match_its_greedy_output():
    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.stack import tiny_random_stack
    st = tiny_random_stack("cpu", target_format=toy.NAME)
    assert toy.LABEL in st.meta["target"] and st.models.target.products_rows_invariant_cpu()
    s = DecodeSettings(max_new_tokens=16)
    ar = output_tokens(generate(st, "ar", "the quick brown fox", s))
    for method in ("eagle2", "hierspec"):
        assert output_tokens(generate(st, method, "the quick brown fox", s)) == ar, method


def test_memory_estimates_count_its_bytes(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from hierviz import memory
    from hierviz import stack as stack_mod
    cfg = json.loads((ROOT / "assets" / "configs" / "llama3-8b.json").read_text())
    lin = 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert memory.model_bytes(cfg, toy.NAME) == pytest.approx(lin * 4.0 + 2 * 128256 * 4096 * 2)
    parts = memory.estimate({"target": (cfg, toy.ALIAS, 0)}, [], 2048)
    assert parts["target"] == memory.model_bytes(cfg, toy.NAME) > memory.model_bytes(cfg, "dense")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    spec = {"name": "toy", "target": {"path": "t", "quantize": toy.NAME}}
    est = memory.stack_estimate(spec, lambda s: str(tmp_path / s))
    assert est["target"] == pytest.approx(memory.model_bytes(cfg, toy.NAME))
    # a 32 GB GPU holds the dense fp16 model, not ~30 GB of fp32 weights and the caches
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(total_memory=32e9, name="g"))
    stack_mod._check_gpu_memory("dense", {"target": {"path": "t"}}, tmp_path, torch.device("cuda"), torch.float16)
    with pytest.raises(stack_mod.StackError, match="needs about"):
        stack_mod._check_gpu_memory("toy", spec, tmp_path, torch.device("cuda"), torch.float16)


def test_cuda_refuses_it_until_its_product_has_run_on_a_gpu():
    with pytest.raises(ValueError, match=f"the {toy.LABEL} format has not been run on a GPU.*W4A16"):
        formats.quantize_option(toy.NAME, torch.device("cuda"))


def test_the_whatif_builds_a_target_in_it_and_names_it(tmp_path):
    from hierviz.measure.whatif import main, parser
    from hierviz.viz.whatif_fig import shapes_label
    a = parser().parse_args(["--target-format", toy.ALIAS, "--intermediate-format", toy.NAME, "--out", "-"])
    assert a.target_format == a.intermediate_format == toy.NAME
    assert toy.NAME in parser().format_help()
    assert main(["--tiny", "--device", "cpu", "--threads", "1", "--target-format", toy.ALIAS, "--max-new-tokens", "8",
                 "--methods", "ar,hierspec", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    assert info["formats"]["target"].startswith(toy.LABEL) and f"({toy.LABEL})" in shapes_label(info)


def test_the_compat_table_and_the_cost_model_take_it(capsys):
    from hierviz.measure import compat
    from hierviz.measure import cost_model as cm
    assert compat.main(["--tiny", "--formats", "nope", "--out", "-"]) == 2
    assert toy.NAME in capsys.readouterr().err          # listed among the choices
    info = {"dtype": "float32", "formats": {"target": toy.LABEL}, "settings": {"t_tree_size": 3},
            "methods": {"ar": {"tokens_per_s": 10.0, "tokens_per_round": 1.0, "stages_ms_per_token": {}}}}
    assert compat.row(toy.ALIAS, info, 4, 4, "eagle2")["name"] == toy.LABEL
    shape = cm.Shape(json.loads((ROOT / "assets" / "whatif" / "compat-h200-llama3-70b.json").read_text())
                     ["configs"]["target"])
    assert cm.weight_bytes(toy.NAME, shape) == pytest.approx(2 * cm.weight_bytes("dense", shape))
    h200 = cm.GPUS["NVIDIA H200"]
    assert len(cm.product_kernels(toy.NAME, 1, 8192, 8192, True, shape, h200)) == 2      # one GEMM + the add
    fit = cm.Fit(**json.loads((ROOT / "assets/whatif/cost-model.json").read_text())["calibration"]["fit"])
    assert cm.model_us(fit, h200, toy.NAME, shape, 1) > 1.8 * cm.model_us(fit, h200, "dense", shape, 1)
    assert cm._skip_reason(h200, toy.NAME, 300e9, False).startswith("needs ~")


def test_the_profile_and_the_whatif_tab_offer_it():
    from hierviz.app import whatif_tab as uw
    from hierviz.measure import profile
    from hierviz.measure.whatif import parser
    from hierviz.viz.format_curves import _dash
    curves = profile._formats("cpu", None)
    assert any(c["name"] == toy.NAME and c["fmt"] == toy.NAME for c in curves)
    choices = uw.live_formats()
    assert choices.get(toy.LABEL) == toy.NAME
    argv = uw.live_argv(uw.TINY, uw.RATES_SOURCE, "0.9", 1.0, 0.85, 8, False, "/tmp/x", toy.LABEL)
    assert parser().parse_args(argv).target_format == toy.NAME
    assert _dash(toy.NAME) not in (_dash("dense"), _dash("w4a16"))
