"""EAGLE-1/2 draft head (SafeAILab checkpoint layout).

One decoder layer whose input at position t is fc(concat(embed(token_{t+1}), feature_t)),
feature_t being the base model's last hidden state (after its final norm). Layer 0 has no
input_layernorm and there is no final norm: the output feature goes straight through the
base model's frozen LM head.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from hierviz.models.config import ModelConfig, read_config_json
from hierviz.quant.compressed_tensors import load_dense_tensors
from hierviz.quant.formats import weight_shape
from hierviz.models.llama import DecoderLayer, KVCache, Linear, Transformer, WeightsError, rows_product, weight_getter


class EagleHead(nn.Module):
    """EAGLE-1/2 head: a hierviz.models.drafter.Drafter reading its base's final hidden state."""

    head_type = "eagle2"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], base: Transformer,
                 w4_kernel: str = "reference") -> None:
        """w4_kernel: the kernel of the head's linears where they are W4 weights (a what-if's
        --head-format); published heads are dense."""
        super().__init__()
        if cfg.hidden_size != base.cfg.hidden_size:
            raise WeightsError(f"EAGLE head hidden size {cfg.hidden_size} does not match its base model's "
                               f"{base.cfg.hidden_size}")
        self.cfg = cfg
        self.base = base
        self.dtype = base.dtype
        self.static_runners: list = []    # hierviz.models.cuda_graphs pools its runners here
        self.device = base.device
        get = weight_getter(weights, base.dtype, base.device)
        fc_w = get("fc.weight")
        if weight_shape(fc_w) != (cfg.hidden_size, 2 * cfg.hidden_size):
            raise WeightsError(f"EAGLE fc.weight has shape {weight_shape(fc_w)}, expected "
                               f"({cfg.hidden_size}, {2 * cfg.hidden_size})")
        self.fc = Linear([fc_w], [get("fc.bias") if "fc.bias" in weights else None], w4_kernel)
        self.layer = DecoderLayer(cfg, get, "layers.0", w4_kernel, input_norm=False)
        if "embed_tokens.weight" in weights:
            emb = get("embed_tokens.weight")
            if emb.shape[0] != base.cfg.vocab_size:
                raise WeightsError(f"EAGLE head vocabulary {emb.shape[0]} does not match its base model's "
                                   f"{base.cfg.vocab_size}")
            self.embed = nn.Parameter(emb, requires_grad=False)
        else:
            self.embed = None  # SafeAILab heads often omit the copy: use the base's embedding
        # draft-only LM head rows (FR-Spec style reduced vocabulary: Transformer.lm_head_rows); None = full vocabulary
        self.draft_vocab: Optional[torch.Tensor] = None
        self._draft_head: Optional[Union[torch.Tensor, Linear]] = None

    def new_cache(self, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """The base's final hidden state: the first H columns of its output rows (a base may also
        carry an EAGLE-3 head's layer features after them)."""
        return features[..., :self.cfg.hidden_size]

    def draft_vocab_mask(self) -> Optional[torch.Tensor]:
        """bool [vocab]: the FR-Spec draft vocabulary, or None (the full vocabulary)."""
        if self.draft_vocab is None:
            return None
        mask = torch.zeros(self.base.cfg.vocab_size, dtype=torch.bool, device=self.draft_vocab.device)
        mask[self.draft_vocab] = True
        return mask

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: Optional[KVCache], attn_mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [T] (token_{t+1}), features [T, H] (feature_t), positions [T] (= t).
        Returns the predicted next features [T, H]. Without a cache, inputs may be batched
        ([B, T], [B, T, H]) and attention is causal (training)."""
        emb = (self.embed if self.embed is not None else self.base.embed)[tokens]
        x = self.fc(torch.cat((emb, features.to(emb.dtype)), -1))
        t = x.shape[-2]
        if cache is not None and slots is None and cache.length + t > cache.max_len:
            raise ValueError(f"EAGLE KV cache full: {cache.length} + {t} > {cache.max_len}")
        cos, sin = self.base.rope(positions) if _same_rope(self.cfg, self.base.cfg) else _rope(self.cfg, positions, self.dtype)
        # slots: static-shape mode (hierviz.models.cuda_graphs); the caller sets cache.length
        x = self.layer(x, cos, sin, 0, cache, attn_mask, slots)
        if cache is not None and slots is None:
            cache.length += t
        return x

    def set_draft_vocab(self, token_ids: Optional[torch.Tensor]) -> None:
        """Restrict the draft LM head to these token ids (verifiers keep the full vocabulary)."""
        if token_ids is None:
            self.draft_vocab = self._draft_head = None
            return
        self.draft_vocab, self._draft_head = self.base.lm_head_rows(token_ids)

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """fp32 logits over the draft vocabulary and the ids they index (None = full vocabulary)."""
        if self._draft_head is None:
            return self.base.logits(hidden), None
        return rows_product(hidden, self._draft_head).float(), self.draft_vocab

    def draft_logprobs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs over the draft vocabulary and the ids they index (None = full vocabulary)."""
        logits, ids = self.draft_logits(hidden)
        return torch.log_softmax(logits, -1), ids


def _same_rope(a: ModelConfig, b: ModelConfig) -> bool:
    return a.rope_theta == b.rope_theta and a.rope_scaling == b.rope_scaling and a.head_dim == b.head_dim


_INV_FREQ: dict = {}


def _rope(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype):
    from hierviz.models.config import rope_frequencies
    # cached per device: a host-to-device copy inside a CUDA-graph capture is not allowed
    key = (cfg.rope_theta, cfg.head_dim, repr(cfg.rope_scaling), str(positions.device))
    inv = _INV_FREQ.get(key)
    if inv is None:
        inv = _INV_FREQ[key] = rope_frequencies(cfg).to(positions.device)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def load_eagle_weights(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + model.safetensors or pytorch_model.bin in SafeAILab's key layout (weights as
    stored, or int8 per channel: hierviz.quant.compressed_tensors.store_weight_only_int8)."""
    folder = Path(folder)
    raw = read_config_json(folder)
    raw.setdefault("model_type", "llama")
    raw = dict(raw, num_hidden_layers=1)
    cfg = ModelConfig.from_dict(raw)
    # safetensors, else pytorch_model.bin with weights_only; int8-stored weights come back dense
    weights = load_dense_tensors(folder, raw)
    # some exports prefix keys with "model."
    weights = {k[6:] if k.startswith("model.") else k: v for k, v in weights.items()}
    for key in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        if key not in weights:
            raise WeightsError(f"{folder} is not an EAGLE-1/2 head: tensor {key!r} is missing")
    cfg.qkv_bias = "layers.0.self_attn.q_proj.bias" in weights  # Qwen2 heads carry qkv bias
    return cfg, weights


def load_eagle_head(folder: str | Path, base: Transformer) -> EagleHead:
    """An EAGLE-1/2 head from a local folder on `base` (the `eagle2` head type's loader)."""
    return EagleHead(*load_eagle_weights(folder), base)
