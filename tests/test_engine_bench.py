"""engine-bench's transformers peers on the CPU (the GPU run is `python -m hierviz engine-bench`):
the static-cache `generate` gives the plain one's tokens on the same weights, and a failing
variant is reported while the others are kept; every generate call has the measured length, and an
unknown --hf variant is a clear error."""
from __future__ import annotations

import json

import pytest
import torch

from hierviz.measure import engine_bench as eb
from hierviz.models.config import ModelConfig
from hierviz.models.synthetic import hf_weights

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2}


def test_static_cache_generate_matches_the_plain_one(tmp_path):
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(TINY))
    torch.manual_seed(0)
    weights = hf_weights(ModelConfig.from_file(cfg_path), "cpu")
    prompt = [1, 5, 9, 11]
    plain, _ = eb.hf_generate(cfg_path, weights, prompt, 6, "cpu", torch.float32, "plain")
    static, dt = eb.hf_generate(cfg_path, weights, prompt, 6, "cpu", torch.float32, "static")
    assert len(plain) == 6 and static == plain and dt > 0


def test_a_failing_variant_is_reported_and_the_others_kept(tmp_path, monkeypatch):
    def fake(cfg_path, weights, prompt, n, dev, dtype, variant):
        if variant == "static-compiled":
            raise RuntimeError("no C++ compiler")
        return [3] * n, {"plain": 2.0, "static": 1.0, "static-compiled-default": 0.5}[variant]
    monkeypatch.setattr(eb, "hf_generate", fake)
    res = {"identical_prefix": {}}
    rows = {"ours fp16, CUDA graphs": 40.0, "ours W4A16 triton, CUDA graphs": 20.0}
    toks = {"ours fp16, CUDA graphs": [3, 3, 4, 3]}
    eb._against_transformers(res, rows, toks, tmp_path, {}, [1], 4, "cpu", torch.float32)
    assert rows[f"{eb.HF_VARIANTS['plain']} fp16"] == 2.0 and rows[f"{eb.HF_VARIANTS['static']} fp16"] == 4.0
    assert "no C++ compiler" in res["hf_error"]["static-compiled"]
    assert rows[f"{eb.HF_VARIANTS['static-compiled-default']} fp16"] == 8.0
    assert res["ours_fp16_graphs_over_best_transformers"] == 5.0           # against the fastest peer
    assert res["identical_prefix"][f"ours fp16 graphs vs {eb.HF_VARIANTS['static']}"] == 2


def test_a_variant_in_its_own_process_gives_the_same_tokens(tmp_path):
    """hf_generate_in_child (how the compiled variant runs, so that a crash at its exit stays in its
    process): same tokens as in this process; a child that fails is a clear error."""
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(TINY))
    torch.manual_seed(0)
    weights = hf_weights(ModelConfig.from_file(cfg_path), "cpu")
    here, _ = eb.hf_generate(cfg_path, weights, [1, 5, 9], 5, "cpu", torch.float32, "plain")
    there, dt = eb.hf_generate_in_child(cfg_path, weights, [1, 5, 9], 5, "cpu", torch.float32, "plain")
    assert there == here and dt > 0
    with pytest.raises(RuntimeError, match="failed in its process"):
        eb.hf_generate_in_child(tmp_path / "missing.json", weights, [1], 2, "cpu", torch.float32, "plain")


def test_every_generate_call_has_the_measured_length(tmp_path, monkeypatch):
    """A static cache is sized prompt + max_new_tokens: a warm-up of another length would make the
    compiled forward recompile inside the timed run."""
    from transformers import LlamaForCausalLM
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(TINY))
    weights = hf_weights(ModelConfig.from_file(cfg_path), "cpu")
    lengths = []
    original = LlamaForCausalLM.generate

    def spy(self, *args, **kw):
        lengths.append(kw["max_new_tokens"])
        return original(self, *args, **kw)
    monkeypatch.setattr(LlamaForCausalLM, "generate", spy)
    eb.hf_generate(cfg_path, weights, [1, 5, 9], 7, "cpu", torch.float32, "static")
    assert len(lengths) >= 2 and set(lengths) == {7}


def test_an_unknown_variant_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as e:
        eb.main(["--hf", "plain,compiled-fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "compiled-fast" in err and all(v in err for v in eb.HF_VARIANTS)
