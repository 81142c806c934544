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


def make_tiny_tokenizer(folder: Path, vocab: int = 97) -> None:
    """A word-level HF tokenizer with `vocab` entries (ids 0..2 = pad/bos/eos) and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        words[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(folder))


def make_tiny_head(folder: Path, base_cfg, seed: int = 0, bias: bool = True) -> None:
    """A random EAGLE head for `base_cfg` (a hierviz ModelConfig) in SafeAILab's layout."""
    import json
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    h, inter = base_cfg.hidden_size, base_cfg.intermediate_size
    kv = base_cfg.num_kv_heads * base_cfg.head_dim

    def r(*s):
        return (torch.randn(*s, generator=g) * 0.2).contiguous()
    sd = {"fc.weight": r(h, 2 * h), "layers.0.self_attn.q_proj.weight": r(h, h), "layers.0.self_attn.k_proj.weight": r(kv, h),
          "layers.0.self_attn.v_proj.weight": r(kv, h), "layers.0.self_attn.o_proj.weight": r(h, h),
          "layers.0.mlp.gate_proj.weight": r(inter, h), "layers.0.mlp.up_proj.weight": r(inter, h),
          "layers.0.mlp.down_proj.weight": r(h, inter), "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    if bias:
        sd["fc.bias"] = r(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": base_cfg.vocab_size, "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": base_cfg.num_heads, "num_key_value_heads": base_cfg.num_kv_heads,
        "rms_norm_eps": base_cfg.rms_eps, "num_hidden_layers": 1, "bias": bias}))


# a 5-node draft tree below the last pending token: node i's ancestors (itself included) and depths
TREE_ANCESTORS = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 1, 0, 1]],
                              dtype=torch.bool)
TREE_DEPTHS = torch.tensor([1, 1, 2, 2, 3])


def prefill_sequence_tree(state) -> list[torch.Tensor]:
    """Three forwards through a BaseState, as the decoders make them: the pending prompt, a
    3-token causal sequence, the 5-node tree; each keeps a prefix and appends one token.
    Returns the three forwards' hidden states."""
    out = []
    with torch.no_grad():
        for step in range(3):
            start = state.processed
            if step == 0:
                h = state.run_pending()
            elif step == 1:
                h = state.run_pending([5, 6, 7])
            else:
                h = state.run_pending([11, 12, 13, 14, 15], TREE_DEPTHS, TREE_ANCESTORS)
            out.append(h)
            state.commit_prefix(start, h, h.shape[0] - (0 if step == 0 else 2), [41 + step])
    return out


def run_interpreted(script: str, *args: str, extra_env: dict | None = None, timeout: int = 600) -> list[str]:
    """`script` in a child Python under TRITON_INTERPRET=1 (set before triton is imported), from
    the repository root; its stdout lines. The test fails with the child's stderr if it fails."""
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), **(extra_env or {})}
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()
