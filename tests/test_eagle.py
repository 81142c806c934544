"""EAGLE-1/2 heads in SafeAILab's checkpoint layout load and compute what the reference layer computes."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.models.eagle import EagleHead, load_eagle_weights
from hierviz.models.llama import Transformer, WeightsError
from hierviz.quant.errors import CheckpointError
from hierviz.models.loading import load_weights
from tests.tiny import make_tiny_hf


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    make_tiny_hf(folder, "llama")
    cfg, w, _ = load_weights(folder)
    return Transformer(cfg, w)


def _save_head(folder, base_cfg: dict, with_embed: bool, bias: bool, fmt: str, seed: int = 0):
    """A random head written with SafeAILab key names; returns (state dict, transformers layer)."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**base_cfg, "num_hidden_layers": 1})
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    for p in layer.parameters():
        nn.init.normal_(p, 0, 0.2)
    layer.input_layernorm = nn.Identity()   # EAGLE's layer 0 has no input norm
    fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
    sd = {f"layers.0.{k}": v for k, v in layer.state_dict().items()}
    sd["fc.weight"] = fc.weight.data
    if bias:
        sd["fc.bias"] = fc.bias.data
    if with_embed:
        sd["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg.to_dict(), "bias": bias}))
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    return sd, layer, fc, cfg


@pytest.mark.parametrize("with_embed,bias,fmt", [(False, True, "bin"), (True, False, "safetensors"),
                                                 (False, False, "safetensors")])
def test_safeailab_head_loads_and_matches_reference(tmp_path, base, with_embed, bias, fmt):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    c = base.cfg
    base_cfg = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_eps,
                    max_position_embeddings=256)
    sd, layer, fc, hf_cfg = _save_head(tmp_path / "head", base_cfg, with_embed, bias, fmt)
    head = EagleHead(*load_eagle_weights(tmp_path / "head"), base)
    t = 9
    toks = torch.randint(3, c.vocab_size, (t,))
    feats = torch.randn(t, c.hidden_size)
    pos = torch.arange(t)
    with torch.no_grad():
        got = head(toks, feats, pos, head.new_cache(16))
        emb = (sd["embed_tokens.weight"] if with_embed else base.embed)[toks]
        x = fc(torch.cat((emb, feats), -1))[None]
        rope = LlamaRotaryEmbedding(hf_cfg)
        cos, sin = rope(x, pos[None])
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=(cos, sin), position_ids=pos[None], attention_mask=causal)
        want = (out[0] if isinstance(out, tuple) else out)[0]
    assert torch.allclose(got, want, atol=2e-4), (got - want).abs().max()


def test_not_an_eagle_head_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
                                                      "num_attention_heads": 4}))
    from safetensors.torch import save_file
    save_file({"foo": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="not an EAGLE-1/2 head"):
        load_eagle_weights(tmp_path)


def test_corrupt_head_file_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
                                                      "num_attention_heads": 4}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="corrupt or unsafe PyTorch weights file"):
        load_eagle_weights(tmp_path)
