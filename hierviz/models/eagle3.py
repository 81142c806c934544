"""EAGLE-3 draft heads: a hierviz.models.drafter.Drafter reading a low, a middle and a high layer.

One decoder layer (the "midlayer") drafts from g_t, a fused feature: at a real pair it is
fc(concat of the base's residual rows entering its `feature_layers`), inside a draft tree it is
the head's own previous output. The layer's attention reads [input_layernorm(embed(token_{t+1})) ;
hidden_norm(g_t)] (width 2H) while g_t stays the residual; its output, before the head's own final
norm, feeds the next depth. `norm` and `lm_head` draft over a draft vocabulary whose entry i is
target token i + d2t[i] (t2d marks those target tokens).

Three checkpoint layouts are read (docs/heads.md): "safeailab" (SafeAILab's published heads),
"specforge" (SpecForge's output, what SGLang serves) and "speculators" (vLLM speculators' Eagle3
format). Feature layers are in hierviz's numbering (Transformer.add_feature_layers: the rows
entering layer i, as vLLM numbers its aux layer ids); SpecForge/SGLang number the layer whose
output is taken, one less. A loaded head does not attach itself: the caller runs
base.add_feature_layers(head.feature_layers) before the base's forwards.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from hierviz.models.config import ModelConfig, ModelConfigError, read_config_json
from hierviz.models.eagle import _rope, _same_rope
from hierviz.models.llama import DecoderLayer, KVCache, Linear, RMSNorm, Transformer, WeightsError, weight_getter
from hierviz.quant.errors import CheckpointError
from hierviz.quant.compressed_tensors import load_dense_tensors
from hierviz.quant.formats import weight_shape
from hierviz.quant.gptq import checkpoint_tensors

PathLike = Union[str, Path]

LAYOUTS = ("safeailab", "specforge", "speculators")

# the midlayer's tensors, as SafeAILab and SpecForge name them (speculators: "layers.0." instead)
LAYER_PREFIX = "midlayer"
_LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The low, middle and high layer every EAGLE-3 implementation reads when a config names none."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Head(nn.Module):
    """EAGLE-3 head over `base`. weights: the canonical names (SafeAILab's: midlayer.*, fc.weight,
    norm.weight, lm_head.weight, d2t, t2d, optional embed_tokens.weight, fc.bias, input_norm.weight).
    cfg.vocab_size is the target vocabulary the head was trained for; draft_vocab_size defaults to
    lm_head's rows. norm_before_residual / norm_before_fc: speculators' options (the residual is the
    normed feature; an RMSNorm over fc's input)."""

    head_type = "eagle3"

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], base: Transformer,
                 feature_layers: tuple[int, ...], *, draft_vocab_size: Optional[int] = None,
                 target_hidden_size: Optional[int] = None, norm_before_residual: bool = False,
                 norm_before_fc: bool = False, layout: str = "safeailab", w4_kernel: str = "reference") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown EAGLE-3 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
        self.cfg = cfg
        self.base = base
        self.dtype = base.dtype
        self.device = base.device
        self.static_runners: list = []    # hierviz.models.cuda_graphs pools its runners here
        self.layout = layout
        self.norm_before_residual = norm_before_residual
        h, hb, vocab = cfg.hidden_size, base.cfg.hidden_size, base.cfg.vocab_size
        if cfg.vocab_size != vocab:
            raise ModelConfigError(f"EAGLE-3 head was trained for a {cfg.vocab_size}-token target vocabulary "
                                   f"(config vocab_size) but its base model has {vocab} tokens")
        if target_hidden_size is not None and target_hidden_size != hb:
            raise ModelConfigError(f"EAGLE-3 head reads a target of hidden size {target_hidden_size} (config "
                                   f"target_hidden_size) but its base model's hidden size is {hb}")
        self.feature_layers = _checked_layers(feature_layers, base.cfg.num_layers)
        get = weight_getter(weights, base.dtype, base.device)

        if "embed_tokens.weight" in weights:
            emb = get("embed_tokens.weight")
            if tuple(emb.shape) != (vocab, h):
                raise WeightsError(f"EAGLE-3 embed_tokens.weight has shape {tuple(emb.shape)}, expected "
                                   f"({vocab}, {h}): base vocabulary x head hidden size")
            self.embed: Optional[nn.Parameter] = nn.Parameter(emb, requires_grad=False)
        else:
            if h != hb:
                raise WeightsError(f"EAGLE-3 head of hidden size {h} has no embed_tokens.weight and cannot use its "
                                   f"base model's embedding (hidden size {hb})")
            self.embed = None        # published heads leave the (frozen) embedding to the target

        fc_in = len(self.feature_layers) * hb
        fc_w = get("fc.weight")
        if weight_shape(fc_w) != (h, fc_in):
            raise WeightsError(f"EAGLE-3 fc.weight has shape {weight_shape(fc_w)}, expected ({h}, {fc_in}): "
                               f"{len(self.feature_layers)} feature layers x base hidden size {hb}")
        self.fc = Linear([fc_w], [get("fc.bias") if "fc.bias" in weights else None], w4_kernel)
        self.fc_norm = RMSNorm(_shaped(get, "input_norm.weight", (fc_in,)), cfg.rms_eps) if norm_before_fc else None

        p = LAYER_PREFIX
        self.input_norm = RMSNorm(_shaped(get, f"{p}.input_layernorm.weight", (h,)), cfg.rms_eps)
        self.hidden_norm = RMSNorm(_shaped(get, f"{p}.hidden_norm.weight", (h,)), cfg.rms_eps)
        q_w = get(f"{p}.self_attn.q_proj.weight")
        if weight_shape(q_w) != (cfg.num_heads * cfg.head_dim, 2 * h):
            raise WeightsError(f"EAGLE-3 {p}.self_attn.q_proj.weight has shape {weight_shape(q_w)}, expected "
                               f"({cfg.num_heads * cfg.head_dim}, {2 * h}): the attention reads [embedding ; feature]")
        self.layer = DecoderLayer(cfg, get, p, w4_kernel, input_norm=False)

        self.norm = RMSNorm(_shaped(get, "norm.weight", (h,)), cfg.rms_eps)
        head_w = get("lm_head.weight")
        vd = draft_vocab_size if draft_vocab_size is not None else weight_shape(head_w)[0]
        if weight_shape(head_w) != (vd, h):
            raise WeightsError(f"EAGLE-3 lm_head.weight has shape {weight_shape(head_w)}, expected ({vd}, {h}): "
                               f"config draft_vocab_size x hidden size")
        self.lm_head = Linear([head_w], [None], w4_kernel)
        self.draft_ids, self.vocab_mask = _vocab_maps(weights.get("d2t"), weights.get("t2d"), vd, vocab, base.device)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.splits[0]

    @property
    def draft_vocab(self) -> Optional[torch.Tensor]:
        """draft_ids under EagleHead's name: hierviz.decoding.tree.TreeGraph keys its graphs by it."""
        return self.draft_ids

    def new_cache(self, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(1, c.num_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Base output rows [.., W] -> fc(concat of the rows entering feature_layers, in that order) [.., H]."""
        missing = [i for i in self.feature_layers if i not in self.base.feature_layers]
        if missing:
            raise ValueError(f"the base model hands out no rows for layers {missing}: call "
                             f"base.add_feature_layers(head.feature_layers) before running it")
        x = self.base.layer_features(features, self.feature_layers).to(self.dtype)
        if self.fc_norm is not None:
            x = self.fc_norm(x)
        return self.fc(x)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: Optional[KVCache], attn_mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [T] (token_{t+1}), features [T, H] (projected, or the head's own outputs), positions
        [T] (= t): the midlayer's output [T, H], before the final norm. Without a cache inputs may be
        batched ([B, T], [B, T, H]) and attention is causal (training)."""
        emb = (self.embed if self.embed is not None else self.base.embed)[tokens]
        feats = features.to(emb.dtype)
        normed = self.hidden_norm(feats)
        attn_in = torch.cat((self.input_norm(emb), normed), -1)
        t = emb.shape[-2]
        if cache is not None and slots is None and cache.length + t > cache.max_len:
            raise ValueError(f"EAGLE-3 KV cache full: {cache.length} + {t} > {cache.max_len}")
        cos, sin = self.base.rope(positions) if _same_rope(self.cfg, self.base.cfg) else _rope(self.cfg, positions, self.dtype)
        residual = normed if self.norm_before_residual else feats
        # slots: static-shape mode (hierviz.models.cuda_graphs); the caller sets cache.length
        x = self.layer(residual, cos, sin, 0, cache, attn_mask, slots, attn_in=attn_in)
        if cache is not None and slots is None:
            cache.length += t
        return x

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """fp32 logits over the draft vocabulary and the target ids they index (None = full vocabulary)."""
        return self.lm_head(self.norm(hidden)).float(), self.draft_ids

    def draft_logprobs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs over the draft vocabulary and the target ids they index (None = full vocabulary)."""
        logits, ids = self.draft_logits(hidden)
        return torch.log_softmax(logits, -1), ids

    def draft_vocab_mask(self) -> Optional[torch.Tensor]:
        """bool [base vocab]: t2d, the target tokens this head can draft (None: every one)."""
        return self.vocab_mask

    def state_dict_canonical(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the canonical (SafeAILab) names, as the layouts store them."""
        p = LAYER_PREFIX
        layer = self.layer
        q, k, v = torch.split(layer.qkv.weight.data, layer.qkv.splits, 0)
        gate, up = torch.split(layer.gate_up.weight.data, layer.gate_up.splits, 0)
        out = {"fc.weight": self.fc.weight.data, f"{p}.input_layernorm.weight": self.input_norm.weight.data,
               f"{p}.hidden_norm.weight": self.hidden_norm.weight.data,
               f"{p}.post_attention_layernorm.weight": layer.post_norm.weight.data,
               f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
               f"{p}.self_attn.v_proj.weight": v, f"{p}.self_attn.o_proj.weight": layer.o.weight.data,
               f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
               f"{p}.mlp.down_proj.weight": layer.down.weight.data,
               "norm.weight": self.norm.weight.data, "lm_head.weight": self.lm_head.weight.data}
        if layer.qkv.bias is not None:
            for name, b in zip("qkv", torch.split(layer.qkv.bias.data, layer.qkv.splits, 0)):
                out[f"{p}.self_attn.{name}_proj.bias"] = b
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias.data
        if self.fc_norm is not None:
            out["input_norm.weight"] = self.fc_norm.weight.data
        if self.embed is not None:
            out["embed_tokens.weight"] = self.embed.data
        vd, vocab = self.draft_vocab_size, self.base.cfg.vocab_size
        ids = self.draft_ids if self.draft_ids is not None else torch.arange(vd, device=self.device)
        out["d2t"] = (ids - torch.arange(vd, device=ids.device)).to(torch.int64)
        mask = self.vocab_mask if self.vocab_mask is not None else torch.ones(vocab, dtype=torch.bool)
        out["t2d"] = mask.to(torch.bool)
        return {k: t.detach().cpu().contiguous() for k, t in out.items()}


def _shaped(get, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    w = get(name)
    if tuple(w.shape) != shape:
        raise WeightsError(f"EAGLE-3 {name} has shape {tuple(w.shape)}, expected {shape}")
    return w


def _checked_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    layers = tuple(int(i) for i in layers)
    if not layers:
        raise ModelConfigError("an EAGLE-3 head needs at least one feature layer")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ModelConfigError(f"EAGLE-3 feature layers {bad} are outside the base model's layers 0..{num_layers - 1} "
                               f"(hierviz numbers the rows entering a layer; {num_layers} would be the final output)")
    if len(set(layers)) != len(layers):
        raise ModelConfigError(f"EAGLE-3 feature layers {list(layers)} repeat a layer (a {num_layers}-layer base gives "
                               f"colliding defaults: name the layers in the head's config)")
    return layers


def _vocab_maps(d2t: Optional[torch.Tensor], t2d: Optional[torch.Tensor], vd: int, vocab: int,
                device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(target ids of the draft entries [vd] or None = identity, mask [vocab] or None = all) from the
    checkpoint's d2t (offsets) and t2d (mask), checked against each other and the base vocabulary."""
    if d2t is None:
        if vd != vocab:
            raise WeightsError(f"EAGLE-3 checkpoint has no tensor 'd2t': a {vd}-token draft vocabulary over "
                               f"{vocab} target tokens needs it")
        ids = torch.arange(vd)
    else:
        if tuple(d2t.shape) != (vd,) or d2t.is_floating_point():
            raise WeightsError(f"EAGLE-3 d2t is {d2t.dtype} of shape {tuple(d2t.shape)}, expected integer "
                               f"offsets of shape ({vd},): one per draft token")
        ids = torch.arange(vd) + d2t.to(torch.int64).cpu()
        bad = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise WeightsError(f"EAGLE-3 d2t maps {bad.numel()} draft tokens outside the base vocabulary of {vocab} "
                               f"(draft token {i} -> {int(ids[i])})")
        if torch.unique(ids).numel() != vd:
            raise WeightsError("EAGLE-3 d2t maps two draft tokens to the same target token")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise WeightsError(f"EAGLE-3 t2d has shape {tuple(t2d.shape)}, expected ({vocab},): one per base "
                               f"vocabulary token")
        if not torch.equal(t2d.cpu().bool(), mask):
            raise WeightsError(f"EAGLE-3 t2d marks {int(t2d.bool().sum())} target tokens, not the {vd} that d2t maps to")
    if vd == vocab and torch.equal(ids, torch.arange(vocab)):
        return None, None          # the full vocabulary in target order: no mapping to apply
    return ids.to(device), mask.to(device)


# ---- checkpoint layouts ------------------------------------------------------------------------

def _layout_of(raw: dict[str, Any]) -> str:
    if "speculators_model_type" in raw:
        if raw["speculators_model_type"] != "eagle3":
            raise ModelConfigError(f"speculators model type {raw['speculators_model_type']!r} is not an EAGLE-3 head")
        return "speculators"
    archs = raw.get("architectures") or []
    if "eagle_config" in raw or any("Eagle3" in a for a in archs):
        return "specforge"
    return "safeailab"


def _feature_layers_of(raw: dict[str, Any], layout: str, num_layers: int) -> tuple[int, ...]:
    """The config's aux layer ids in hierviz's numbering (see the module docstring), else the default."""
    flat = raw.get("eagle_aux_hidden_state_layer_ids")          # vLLM numbering: the row entering layer i
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layout != "speculators" and nested is not None:
        shifted = tuple(int(i) + 1 for i in nested)           # SGLang numbering: the output of layer i
        if flat is not None and tuple(int(i) for i in flat) != shifted:
            raise ModelConfigError(f"config eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (outputs) and "
                                   f"eagle_aux_hidden_state_layer_ids {list(flat)} (inputs) name different layers")
        return shifted
    if flat is not None:
        return tuple(int(i) for i in flat)
    return default_feature_layers(num_layers)


def canonical_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> canonical ones: no "model." prefix, the layer under "midlayer."."""
    out = {}
    for k, v in weights.items():
        k = k[6:] if k.startswith("model.") else k
        if k.startswith("layers."):
            if not k.startswith("layers.0."):
                raise ModelConfigError(f"EAGLE-3 checkpoint holds tensor {k!r}: hierviz reads one-layer heads only")
            k = LAYER_PREFIX + k[len("layers.0"):]
        out[k] = v
    return out


def _head_config(raw: dict[str, Any], layout: str) -> tuple[ModelConfig, dict[str, Any]]:
    layer_raw = raw.get("transformer_layer_config") if layout == "speculators" else raw
    if not isinstance(layer_raw, dict):
        raise ModelConfigError("speculators config has no transformer_layer_config object")
    layer_raw = dict(layer_raw)
    layer_raw.setdefault("model_type", "llama")
    n = int(layer_raw.get("num_hidden_layers", 1))
    if n != 1:
        raise ModelConfigError(f"EAGLE-3 head config has num_hidden_layers {n}: hierviz reads one-layer heads only")
    return ModelConfig.from_dict(layer_raw), layer_raw


def load_eagle3_head(folder: PathLike, base: Transformer) -> Eagle3Head:
    """An EAGLE-3 head from a local folder (config.json + model.safetensors or pytorch_model.bin) in
    any of LAYOUTS, on `base`. The caller attaches it: base.add_feature_layers(head.feature_layers)."""
    folder = Path(folder)
    raw = read_config_json(folder)
    layout = _layout_of(raw)
    cfg, layer_raw = _head_config(raw, layout)
    weights = canonical_names(load_dense_tensors(folder, raw))   # .bin: weights_only; int8-stored: dense
    for key in ("fc.weight", "lm_head.weight", *(f"{LAYER_PREFIX}.{n}" for n in _LAYER_TENSORS)):
        if key not in weights:
            raise WeightsError(f"{folder} is not a complete EAGLE-3 head ({layout} layout): tensor {key!r} is missing")
    cfg.qkv_bias = f"{LAYER_PREFIX}.self_attn.q_proj.bias" in weights
    draft_vocab = raw.get("draft_vocab_size", layer_raw.get("draft_vocab_size"))
    target_hidden = raw.get("target_hidden_size")
    return Eagle3Head(cfg, weights, base, _feature_layers_of(raw, layout, base.cfg.num_layers),
                      draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
                      target_hidden_size=None if target_hidden is None else int(target_hidden),
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      norm_before_fc=bool(raw.get("norm_before_fc", False)), layout=layout)


def is_eagle3_folder(folder: PathLike) -> bool:
    """Whether a folder holds an EAGLE-3 head, from its config keys, else its tensor names (file
    headers only)."""
    try:
        raw = read_config_json(folder)
    except ModelConfigError:
        return False
    if raw.get("speculators_model_type") == "eagle3" or "draft_vocab_size" in raw or "eagle_config" in raw:
        return True
    if any("Eagle3" in a for a in raw.get("architectures") or []):
        return True
    try:
        names = checkpoint_tensors(folder)
    except CheckpointError:
        return False
    return any(n.startswith(("midlayer.", "model.midlayer.")) or n.endswith("layers.0.hidden_norm.weight") or n == "d2t"
               for n in names)


# ---- writers -----------------------------------------------------------------------------------

def _llama_config(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The head layer's config as a transformers Llama config.json has it."""
    dtype_name = str(dtype).removeprefix("torch.")
    d: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
                         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
                         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
                         "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_position,
                         "attention_bias": cfg.qkv_bias, "tie_word_embeddings": False, "initializer_range": 0.02,
                         "pad_token_id": 0, "use_cache": True, "torch_dtype": dtype_name}
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        d["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids
    return d


def save_eagle3_head(folder: PathLike, head: Eagle3Head, layout: str = "safeailab", fmt: Optional[str] = None,
                     verifier: Optional[str] = None) -> Path:
    """Write `head` as `layout` stores it: config.json plus pytorch_model.bin (safeailab's published
    format) or model.safetensors (fmt "bin" / "safetensors" overrides). d2t is int64, t2d bool.
    verifier: the base model's name for speculators' config."""
    base = head.base
    return write_eagle3_checkpoint(folder, head.state_dict_canonical(), head.cfg, head.dtype, head.feature_layers,
                                   base.cfg.num_layers, base.cfg.hidden_size, layout, fmt, verifier,
                                   norm_before_residual=head.norm_before_residual)


def write_eagle3_checkpoint(folder: PathLike, tensors: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype,
                            feature_layers: tuple[int, ...], base_num_layers: int, base_hidden_size: int,
                            layout: str = "safeailab", fmt: Optional[str] = None, verifier: Optional[str] = None,
                            norm_before_residual: bool = False) -> Path:
    """Write an EAGLE-3 head given by its canonical tensors (Eagle3Head.state_dict_canonical's names,
    d2t and t2d included) and its layer config, as `layout` stores it (see save_eagle3_head); the
    training command writes its heads through here too."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown EAGLE-3 layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    folder = Path(folder)
    extras = [k for k in ("fc.bias", "input_norm.weight") if k in tensors]
    if norm_before_residual:
        extras.append("norm_before_residual")
    if layout != "speculators" and extras:
        raise ModelConfigError(f"the {layout} layout cannot record {', '.join(extras)}: write this head as speculators")
    ids = [int(i) for i in feature_layers]
    draft_vocab_size = int(tensors["lm_head.weight"].shape[0])
    config_llama = _llama_config(cfg, dtype)
    if layout == "safeailab":
        # SafeAILab's config has no aux layer key: its heads read the default layers
        if tuple(ids) != default_feature_layers(base_num_layers):
            raise ModelConfigError(f"the safeailab layout cannot record feature layers {ids} (it always reads "
                                   f"{list(default_feature_layers(base_num_layers))}): write specforge or speculators")
        config = dict(config_llama, draft_vocab_size=draft_vocab_size)
        if cfg.hidden_size != base_hidden_size:     # cnets.Model sizes fc from it (else 3 x the head's width)
            config["target_hidden_size"] = base_hidden_size
    elif layout == "specforge":
        if "embed_tokens.weight" in tensors:
            raise ModelConfigError("the specforge layout stores no embedding (SGLang uses the target's): this head "
                                   "has its own; write safeailab or speculators")
        config = dict(config_llama, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                                    "use_aux_hidden_state": True})
        if cfg.hidden_size != base_hidden_size:
            config["target_hidden_size"] = base_hidden_size
    else:
        layer_cfg = {k: v for k, v in config_llama.items() if k not in ("architectures", "torch_dtype", "use_cache")}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer_cfg, "draft_vocab_size": draft_vocab_size,
                  "norm_before_residual": norm_before_residual,
                  "norm_before_fc": "input_norm.weight" in tensors,
                  "target_hidden_size": base_hidden_size if cfg.hidden_size != base_hidden_size else None,
                  "eagle_aux_hidden_state_layer_ids": ids,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": verifier, "architectures": []}}}
        tensors = {(f"layers.0{k[len(LAYER_PREFIX):]}" if k.startswith(LAYER_PREFIX + ".") else k): v
                   for k, v in tensors.items()}
    fmt = fmt or ("bin" if layout == "safeailab" else "safetensors")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    elif fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        raise ValueError(f"unknown weights format {fmt!r}; choose bin or safetensors")
    return folder
