"""Tiny random HF models saved as folders, for tests (no hub access)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_hf(folder: Path, arch: str = "llama", seed: int = 0, vocab: int = 97, hidden: int = 32,
                 layers: int = 2, heads: int = 4, kv_heads: int = 2, inter: int = 64, tie: bool = False,
                 rope_scaling: dict | None = None):
    """Random-weight transformers model of the given architecture saved to `folder`; returns it."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # random init is small; scale up so logits are not all near-equal (ties make greedy tests flaky)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.3 if "embed" in n or "lm_head" in n else 0.15)
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model
