"""GGUF import: exact Q4_1/Q4_0 repack, Q8_0/F16/BF16/F32 dequant, q/k un-permutation, the
native W4 cache, and (slow part, once) SmolLM2 logits against transformers' GGUF loader.

References come from the `gguf` package's own dequantizer (gguf.quants.dequantize) and from
transformers, never from hierviz code.
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hierviz.quant.errors import CheckpointError
from hierviz.quant.gguf import (convert_gguf_cached, file_sha256, load_w4_safetensors, read_gguf,
                                save_w4_safetensors, smollm2_gguf_path)
from hierviz.quant.w4 import W4Weight, dequantize, dequantize_unpermuted, quantize_rtn

Q = gguf.GGMLQuantizationType


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows (written from its docs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of hf_to_gguf_permute."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def as_float(w) -> torch.Tensor:
    return dequantize(w) if isinstance(w, W4Weight) else w


# ---- a tiny synthetic llama GGUF, written with gguf.GGUFWriter -------------------------------

TINY = dict(vocab=64, hidden=64, inter=128, layers=2, heads=4, kv=2)


def write_tiny_gguf(path, types: dict[str, Q], arch: str = "llama", tied: bool = False, seed: int = 0):
    """A 2-layer llama GGUF; returns the HF-orientation float weights that went in (pre-quant)."""
    rng = np.random.default_rng(seed)
    t = TINY
    hd = t["hidden"] // t["heads"]
    hf: dict[str, np.ndarray] = {"token_embd.weight": rng.standard_normal((t["vocab"], t["hidden"]))}
    for i in range(t["layers"]):
        hf[f"blk.{i}.attn_q.weight"] = rng.standard_normal((t["hidden"], t["hidden"]))
        hf[f"blk.{i}.attn_k.weight"] = rng.standard_normal((t["kv"] * hd, t["hidden"]))
        hf[f"blk.{i}.attn_v.weight"] = rng.standard_normal((t["kv"] * hd, t["hidden"]))
        hf[f"blk.{i}.attn_output.weight"] = rng.standard_normal((t["hidden"], t["hidden"]))
        hf[f"blk.{i}.ffn_gate.weight"] = rng.standard_normal((t["inter"], t["hidden"]))
        hf[f"blk.{i}.ffn_up.weight"] = rng.standard_normal((t["inter"], t["hidden"]))
        hf[f"blk.{i}.ffn_down.weight"] = rng.standard_normal((t["hidden"], t["inter"]))
        hf[f"blk.{i}.attn_norm.weight"] = rng.random(t["hidden"]) + 0.5
        hf[f"blk.{i}.ffn_norm.weight"] = rng.random(t["hidden"]) + 0.5
    hf["output_norm.weight"] = rng.random(t["hidden"]) + 0.5
    if not tied:
        hf["output.weight"] = rng.standard_normal((t["vocab"], t["hidden"]))
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(t["layers"])
    w.add_context_length(256)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["inter"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(t["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    stored = {}
    for name, arr in hf.items():
        data = arr.astype(np.float32)
        if name.endswith("attn_q.weight"):
            data = hf_to_gguf_permute(data, t["heads"])
        elif name.endswith("attn_k.weight"):
            data = hf_to_gguf_permute(data, t["kv"])
        kind = next((v for k, v in types.items() if k in name), Q.F32)
        if data.ndim == 1:
            kind = Q.F32
        if kind == Q.F32:
            w.add_tensor(name, data)
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        stored[name] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def reference_weights(path) -> dict[str, np.ndarray]:
    """gguf's own dequantization of every tensor, q/k rows un-permuted, HF orientation."""
    r = gguf.GGUFReader(str(path))
    heads = int(r.get_field("llama.attention.head_count").contents())
    kv = int(r.get_field("llama.attention.head_count_kv").contents())
    out = {}
    for t in r.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape(tuple(reversed([int(x) for x in t.shape])))
        if t.name.endswith("attn_q.weight"):
            arr = gguf_to_hf_rows(arr, heads)
        elif t.name.endswith("attn_k.weight"):
            arr = gguf_to_hf_rows(arr, kv)
        out[t.name] = arr
    return out


HF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
            "output_norm.weight": "model.norm.weight", "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
            "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
            "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
            "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
            "blk.1.ffn_gate.weight": "model.layers.1.mlp.gate_proj.weight",
            "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
            "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
            "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
            "blk.1.ffn_norm.weight": "model.layers.1.post_attention_layernorm.weight"}


def test_tiny_gguf_all_types_exact(tmp_path):
    path = tmp_path / "tiny.gguf"
    types = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0,
             "attn_output": Q.F16, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1,
             "output.weight": Q.BF16}
    stored = write_tiny_gguf(path, types)
    cfg, weights, _ = read_gguf(path)
    assert cfg["num_hidden_layers"] == 2 and cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is False and cfg["rms_norm_eps"] == 1e-6 and cfg["head_dim"] == 16
    ref = reference_weights(path)
    for gname, hname in HF_NAMES.items():
        ours = weights[hname]
        if "norm" not in gname and any(k in gname for k in ("attn_q", "attn_k", "attn_v", "ffn_")):
            assert isinstance(ours, W4Weight) and ours.group_size == 32 and ours.perm is None, gname
        assert torch.equal(as_float(ours), torch.from_numpy(ref[gname])), gname
    # the un-permutation is right: q/k come back close to the HF-orientation originals
    hf_q = gguf_to_hf_rows(stored["blk.1.attn_q.weight"], 4)
    err = (as_float(weights["model.layers.1.self_attn.q_proj.weight"]).numpy() - hf_q)
    assert np.abs(err).max() < 0.5 and np.abs(err).mean() < 0.1
    assert set(weights) == {*HF_NAMES.values(), *(f"model.layers.{i}.{m}.weight" for i in range(2) for m in
                            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                             "post_attention_layernorm"))}


def test_tiny_gguf_tied_and_errors(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, {"attn": Q.Q4_1, "ffn": Q.Q4_1}, tied=True)
    cfg, weights, _ = read_gguf(path)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in weights

    bad = tmp_path / "q5.gguf"
    write_tiny_gguf(bad, {"ffn_up": Q.Q5_0})
    with pytest.raises(CheckpointError, match="Q5_0"):
        read_gguf(bad)

    other = tmp_path / "gpt2.gguf"
    write_tiny_gguf(other, {}, arch="gpt2")
    with pytest.raises(CheckpointError, match="gpt2"):
        read_gguf(other)

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_gguf(truncated)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        read_gguf(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")


def test_native_w4_safetensors_round_trip(tmp_path):
    torch.manual_seed(0)
    w4 = quantize_rtn(torch.randn(16, 64), 32)
    w4p = W4Weight(w4.codes, w4.scales, w4.offsets, 32, torch.randperm(64))
    weights = {"a.weight": w4, "b.weight": w4p, "model.norm.weight": torch.randn(16),
               "c.bias": torch.randn(16, dtype=torch.float16)}
    save_w4_safetensors(tmp_path / "n", {"model_type": "llama"}, weights)
    cfg, back = load_w4_safetensors(tmp_path / "n")
    assert cfg == {"model_type": "llama"} and set(back) == set(weights)
    for k in ("a.weight", "b.weight"):
        assert torch.equal(dequantize_unpermuted(back[k]), dequantize_unpermuted(weights[k]))
    assert back["a.weight"].perm is None and torch.equal(back["b.weight"].perm, w4p.perm)
    assert torch.equal(back["c.bias"], weights["c.bias"])
    (tmp_path / "n" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError):
        load_w4_safetensors(tmp_path / "n")


def test_cache_is_reused_and_rebuilt(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, {"attn": Q.Q4_1, "ffn": Q.Q4_1})
    cache = tmp_path / "cache"
    folder = convert_gguf_cached(path, cache, tokenizer=False)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf_cached(path, cache, tokenizer=False) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp      # not rebuilt
    cfg, weights = load_w4_safetensors(folder)
    cfg0, weights0, _ = read_gguf(path)
    assert cfg == cfg0
    for k, v in weights0.items():
        assert torch.equal(as_float(weights[k]), as_float(v)), k
    (folder / "hierviz_source.json").write_text("{broken")                  # rebuilt, not trusted
    assert convert_gguf_cached(path, cache, tokenizer=False) == folder
    assert load_w4_safetensors(folder)[0] == cfg0


# ---- the real SmolLM2 file ------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    """Convert SmolLM2's GGUF once (weights + tokenizer) into a temporary cache."""
    import tempfile
    import hierviz.quant.gguf as gguf_mod
    path = smollm2_gguf_path()
    cache = tempfile.mkdtemp(prefix="hierviz-gguf-test-")
    folder = convert_gguf_cached(path, cache)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    conversions = []
    with pytest.MonkeyPatch.context() as mp:        # a second call must not convert again
        mp.setattr(gguf_mod, "read_gguf", lambda *a, **k: conversions.append(a) or read_gguf(*a, **k))
        again = convert_gguf_cached(path, cache)
    reuse = {"same_folder": again == folder, "conversions": len(conversions),
             "rewritten": (folder / "model.safetensors").stat().st_mtime_ns != stamp,
             "folders": sorted(p.name for p in Path(cache).iterdir())}
    cfg, weights = load_w4_safetensors(folder)
    return path, folder, cfg, weights, reuse


def test_smollm2_config_and_cached_reload(smol):
    path, folder, cfg, weights, reuse = smol
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152 and cfg["intermediate_size"] == 1536
    assert cfg["tie_word_embeddings"] is True and cfg["model_type"] == "llama"
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    # the second call returned the cached folder: no GGUF read, nothing rewritten, no second copy
    assert reuse == {"same_folder": True, "conversions": 0, "rewritten": False, "folders": [folder.name]}
    assert folder.name == file_sha256(path)[:16]
    w4 = [k for k, v in weights.items() if isinstance(v, W4Weight)]
    assert len(w4) == 30 * 7 and all(weights[k].group_size == 32 for k in w4)
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) == 49152 and tok.eos_token_id == 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


@pytest.fixture(scope="module")
def hf_reference(smol):
    """transformers' own GGUF import of SmolLM2 (its dequantizer and q/k reverse permutation)
    loaded into its LlamaForCausalLM. Built without `accelerate` (which from_pretrained(gguf_file=)
    needs): weights via transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path, _, cfg, _, _ = smol
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
            "tie_word_embeddings", "bos_token_id", "eos_token_id")
    with torch.device("meta"):                       # skip random init; weights come from the file
        model = LlamaForCausalLM(LlamaConfig(**{k: cfg[k] for k in keys}))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    model = model.to_empty(device="cpu")
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    # non-persistent buffers (rotary inv_freq) were never materialized on meta: rebuild them
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    model.model.rotary_emb = LlamaRotaryEmbedding(config=model.config)
    model.eval()
    return parsed["config"], tensors, model


def test_smollm2_matches_transformers_config_and_tensors(smol, hf_reference):
    _, _, cfg, weights, _ = smol
    hf_cfg, tensors, _ = hf_reference
    for key, value in hf_cfg.items():
        if key in cfg and key != "rms_norm_eps":
            assert cfg[key] == value, key
    assert cfg["rms_norm_eps"] == pytest.approx(hf_cfg["rms_norm_eps"], rel=1e-6)
    assert set(tensors) == set(weights)
    for name, ref in tensors.items():   # every tensor: Q4_1 repack, Q8_0 embedding, norms, q/k order
        assert torch.equal(as_float(weights[name]), ref.float()), name


@pytest.mark.skipif(os.environ.get("HIERVIZ_SKIP_SLOW") == "1", reason="HIERVIZ_SKIP_SLOW=1")
def test_smollm2_logits_match_transformers(smol, hf_reference):
    """Our model on our converted weights vs transformers' LlamaForCausalLM on its own GGUF import."""
    llama = pytest.importorskip("hierviz.models.llama")
    from hierviz.models.config import ModelConfig
    from transformers import AutoTokenizer
    _, folder, cfg, weights, _ = smol
    ref_model = hf_reference[2]
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids[0]
    model = llama.Transformer(ModelConfig.from_dict(cfg), weights)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0].float()
        ours = model.logits(model(ids, torch.arange(ids.numel())))
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-3, float(rel)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
