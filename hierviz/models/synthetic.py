"""Random weights at any model shape: the one place that makes them.

Used by the tiny-random stack (tests, UI work), the what-if and profile tools (full-size shapes
with no checkpoint), the kernel and engine benchmarks, and `synthetic-stack` (checkpoint files in
GPTQ/HF layouts). Values are chosen so that deep stacks stay finite in fp16 (weights of std
~1/sqrt(fan-in), like a trained layer's); timings never depend on them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hierviz.models.config import ModelConfig
from hierviz.models.eagle import EagleHead
from hierviz.models.eagle3 import LAYER_PREFIX, Eagle3Head, default_feature_layers
from hierviz.models.llama import Transformer, Weight
from hierviz.quant.formats import (DEFAULT_FORMAT, DENSE, QuantizeChoice, dense_of, get_format, quantize_option,
                                   resolve_quantize)
from hierviz.quant.formats import quantize_linears as to_format
from hierviz.quant.w4 import W4Weight

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each decoder-layer linear."""
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    q = cfg.num_heads * cfg.head_dim
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def random_dense(n: int, k: int, dtype: torch.dtype, device: str | torch.device, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, device=device, generator=gen, dtype=torch.float32) * k ** -0.5).to(dtype)


def random_w4(n: int, k: int, g: int, dtype: torch.dtype, device: str | torch.device, gen: torch.Generator) -> W4Weight:
    """Random codes with GPTQ-like scales/offsets, made on the device directly."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    # Uniform codes have mean 7.5 and std 4.6: these scales give zero-mean weights of std
    # ~1/sqrt(k), so 80 synthetic layers stay finite in fp16 (larger weights overflow to inf
    # within two layers of a 70B shape, and NaN features flatten the draft trees).
    scales = (torch.rand(n, k // g, device=device, generator=gen) * 0.5 + 0.75) / (4.6 * k ** 0.5)
    return W4Weight(codes, scales.to(dtype), (-7.5 * scales).to(dtype), g)


def layer_weights(cfg: ModelConfig, fmt: str, g: int, dtype: torch.dtype, device: str | torch.device,
                  gen: torch.Generator) -> dict[str, Weight]:
    """One decoder layer's weights, keys without the "model.layers.N." prefix; fmt a weight format's
    name or alias (hierviz.quant.formats): W4A16 codes made on the device directly (group g), dense,
    or random dense weights through the format's quantizer."""
    h = cfg.hidden_size
    w: dict[str, Weight] = {"input_layernorm.weight": torch.ones(h, dtype=dtype, device=device),
                            "post_attention_layernorm.weight": torch.ones(h, dtype=dtype, device=device)}
    for name, (n, k) in linear_shapes(cfg).items():
        w[f"{name}.weight"] = random_weight(fmt, n, k, g, dtype, device, gen)
    return w


def random_weight(fmt: str, n: int, k: int, g: int, dtype: torch.dtype, device: str | torch.device,
                  gen: torch.Generator) -> Weight:
    """A random [n, k] linear weight in format `fmt`: W4A16 codes made on the device directly (group
    g; a 70B target's codes in seconds, no dense copy), else random dense weights, through the
    format's quantizer unless it is dense."""
    if random_codes(fmt):
        return random_w4(n, k, g, dtype, device, gen)
    dense, f = random_dense(n, k, dtype, device, gen), get_format(fmt)
    return dense if f.dense else f.quantize(dense)


def random_codes(fmt: str) -> bool:
    """Whether synthetic weights of this format are codes made on the device directly (W4A16),
    rather than random dense weights through its quantizer."""
    return get_format(fmt).weight_type is W4Weight


def w4_group(cfg: ModelConfig, g: int) -> int:
    """W4 group size: the requested one where it divides every input dimension, else 32."""
    ok = all(k % g == 0 for k in (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim))
    return g if ok else 32


def synthetic_model(cfg: ModelConfig, fmt: str, dtype: torch.dtype, device: str, kernel: str, seed: int,
                    group: int = 128, lm_head_format: str = DENSE.name) -> Transformer:
    """A Transformer of this shape with random weights in weight format `fmt` (layer_weights; W4A16:
    codes + scales as GPTQ would store them, fp16 embedding as GPTQ keeps it) and its LM head in
    `lm_head_format` (dense, as GPTQ keeps it, by default; a model whose outputs only draft may take
    a quantized one: it needs an LM head of its own, not tied to the embedding)."""
    if lm_head_format != DENSE.name and cfg.tie_embeddings:
        raise ValueError("a quantized LM head needs a model whose LM head is not tied to its embedding")
    gen = torch.Generator(device=device).manual_seed(seed)
    g = w4_group(cfg, group)
    w: dict[str, Any] = {"model.embed_tokens.weight": random_dense(cfg.vocab_size, cfg.hidden_size, dtype, device, gen),
                         "model.norm.weight": torch.ones(cfg.hidden_size, dtype=dtype, device=device)}
    if not cfg.tie_embeddings:
        w["lm_head.weight"] = random_weight(lm_head_format, cfg.vocab_size, cfg.hidden_size, g, dtype, device, gen)
    for i in range(cfg.num_layers):
        for k, v in layer_weights(cfg, fmt, g, dtype, device, gen).items():
            w[f"model.layers.{i}.{k}"] = v
    # release: the dict is ours, so each entry goes once used (a dense 70B is held once, not twice)
    gpu_kernel = get_format(fmt).gpu_kernel or get_format(lm_head_format).gpu_kernel
    return Transformer(cfg, w, w4_kernel=kernel if gpu_kernel else "reference", dtype=dtype, device=device, release=True)


def head_kernel(fmt: str, kernel: str) -> str:
    """The W4 kernel of a synthetic head's linears in weight format `fmt` ("reference" where the
    format has no GPU kernel of its own: dense heads, as published)."""
    return kernel if get_format(fmt).gpu_kernel else "reference"


def synthetic_head(base: Transformer, seed: int, head_class: type[EagleHead] = EagleHead, fmt: str = DENSE.name,
                   kernel: str = "reference") -> EagleHead:
    """A random EAGLE-1/2 head over `base` (one decoder layer without its input norm, and fc), its
    linears in weight format `fmt` (a head only drafts), run by `kernel` where they are W4."""
    cfg = dataclasses.replace(base.cfg, num_layers=1)
    gen = torch.Generator(device=base.device).manual_seed(seed)
    g = w4_group(cfg, 128)
    w: dict[str, Any] = {f"layers.0.{k}": v for k, v in layer_weights(cfg, fmt, g, base.dtype, base.device, gen).items()
                         if not k.startswith("input_layernorm")}
    w["fc.weight"] = random_weight(fmt, cfg.hidden_size, 2 * cfg.hidden_size, g, base.dtype, base.device, gen)
    return head_class(cfg, w, base, w4_kernel=head_kernel(fmt, kernel))


def hf_weights(cfg: ModelConfig, device: str, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random fp32 weights with HF names at the config's shapes (norms 1), for comparisons with
    transformers' reference implementation."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = cfg.hidden_size

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * std

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, h) * 10, "model.norm.weight": torch.ones(h, device=device)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        w[f"{p}.input_layernorm.weight"] = torch.ones(h, device=device)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h, device=device)
        for name, (n, k) in linear_shapes(cfg).items():
            w[f"{p}.{name}.weight"] = r(n, k)
    return w


TINY_GROUP = 32      # divides the tiny shapes' widths (64, 128)


def tiny_quantize(target_format: str) -> QuantizeChoice:
    """The tiny target's quantizer: `target_format` through hierviz.quant.formats.resolve_quantize,
    a grouped format's group TINY_GROUP unless the value names one."""
    choice = resolve_quantize(target_format, group=TINY_GROUP)
    if choice is None:
        quantize_option(target_format)        # its error names the known options
    return choice


def tiny_models(vocab: int = 259, device: torch.device | str = "cpu", seed: int = 0,
                target_format: str = DEFAULT_FORMAT) -> tuple[Transformer, Transformer, EagleHead, EagleHead]:
    """Random tiny T (4 layers in `target_format`: a weight format's name or alias, or a stack
    file's "quantize" value; a format with groups in groups of TINY_GROUP unless the value says),
    M (two of T's layers, dense) and random EAGLE heads (E_M, E_T): the tiny-random stack."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    h, heads, kvh, inter = 64, 4, 2, 128
    kv = kvh * h // heads
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}

    def model_weights(layers: int, prefix: str = "model.layers") -> dict[str, torch.Tensor]:
        w = {"model.embed_tokens.weight": rnd(vocab, h, std=0.5), "model.norm.weight": torch.ones(h)}
        for i in range(layers):
            p = f"{prefix}.{i}"
            w[f"{p}.input_layernorm.weight"] = torch.ones(h)
            w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
            for name, shape in shapes.items():
                w[f"{p}.{name}.weight"] = rnd(*shape)
        return w

    cfg = dict(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_attention_heads=heads,
               num_key_value_heads=kvh, max_position_embeddings=1024, tie_word_embeddings=True,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, model_type="llama")
    t_w = to_format(model_weights(4), tiny_quantize(target_format).quantize)
    target = Transformer(ModelConfig.from_dict(dict(cfg, num_hidden_layers=4)), t_w, device=device)
    # batch-invariant although load_stack's rule would not ask for it here (its `reference`
    # kernel is not row-invariant on the CPU): every test decoding on this stack then runs the
    # per-token attention and its cache restore against AR
    target.set_batch_invariant(True)
    # the intermediate reuses two of the target's layers (dequantized), so it agrees with it often
    m_w = {"model.embed_tokens.weight": t_w["model.embed_tokens.weight"], "model.norm.weight": torch.ones(h)}
    for new, old in ((0, 0), (1, 3)):
        for k, v in t_w.items():
            if k.startswith(f"model.layers.{old}."):
                m_w[k.replace(f"layers.{old}.", f"layers.{new}.")] = dense_of(v)
    inter_m = Transformer(ModelConfig.from_dict(dict(cfg, num_hidden_layers=2)), m_w, device=device)
    head_cfg = ModelConfig.from_dict(dict(cfg, num_hidden_layers=1))

    def head(base: Transformer) -> EagleHead:
        w = {k: v for k, v in model_weights(1, prefix="layers").items() if k.startswith("layers.0.")}
        w["fc.weight"] = rnd(h, 2 * h)
        return EagleHead(head_cfg, w, base)

    return target, inter_m, head(inter_m), head(target)


class CheckpointWeights:
    """Random tensors as checkpoints store them (fp16 on the host; AutoGPTQ's int32 layout),
    made on `device` for speed: `synthetic-stack` writes them to disk."""

    def __init__(self, seed: int, device: str) -> None:
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def dense(self, *shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g, device=self.device) * std).half().cpu()

    def gptq(self, n: int, k: int, group: int) -> dict[str, torch.Tensor]:
        """AutoGPTQ's tensors for an [n, k] linear, symmetric as the presets' checkpoints: random
        4-bit codes (any int32 word is 8 valid codes), zero point 8 stored minus one (v1: 0x77777777),
        scales giving weights of std ~ 1/sqrt(k)."""
        groups = k // group
        qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, generator=self.g,
                                device=self.device)
        qzeros = torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device=self.device)
        scales = (torch.rand(groups, n, generator=self.g, device=self.device) * 0.5 + 0.75) / (4.6 * k ** 0.5)
        g_idx = torch.arange(k, dtype=torch.int32, device=self.device) // group
        return {"qweight": qweight.cpu(), "qzeros": qzeros.cpu(), "scales": scales.half().cpu(), "g_idx": g_idx.cpu()}


def synthetic_eagle3_head(base: Transformer, seed: int, draft_vocab_size: int | None = None,
                          feature_layers: tuple[int, ...] | None = None,
                          head_class: type[Eagle3Head] = Eagle3Head, fmt: str = DENSE.name,
                          kernel: str = "reference") -> Eagle3Head:
    """A random EAGLE-3 head over `base` at its shapes (tests; what-if at real shapes): fc over the
    base's `feature_layers` (default: the EAGLE-3 default layers), the midlayer (attention input
    2H), norms of 1, its own LM head; with draft_vocab_size, a reduced draft vocabulary: a random
    subset of the base vocabulary that keeps the lowest ids (special tokens), d2t/t2d to match.
    The head does not attach itself: call base.add_feature_layers(head.feature_layers) before
    running the base. fmt, kernel: its linears' weight format and W4 kernel, as synthetic_head's."""
    cfg = dataclasses.replace(base.cfg, num_layers=1, qkv_bias=False)
    layers = feature_layers if feature_layers is not None else default_feature_layers(base.cfg.num_layers)
    dev, dt = base.device, base.dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    h, vocab = cfg.hidden_size, cfg.vocab_size
    w: dict[str, Any] = {}
    g = w4_group(cfg, 128)
    for name, (n, k) in linear_shapes(cfg).items():
        # q/k/v read [normed embedding ; normed feature]: twice the hidden size
        fan_in = 2 * h if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") else k
        w[f"{LAYER_PREFIX}.{name}.weight"] = random_weight(fmt, n, fan_in, g, dt, dev, gen)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"{LAYER_PREFIX}.{norm}.weight"] = torch.ones(h, dtype=dt, device=dev)
    w["norm.weight"] = torch.ones(h, dtype=dt, device=dev)
    w["fc.weight"] = random_weight(fmt, h, len(layers) * base.cfg.hidden_size, g, dt, dev, gen)
    vd = vocab if draft_vocab_size is None else draft_vocab_size
    if not 0 < vd <= vocab:
        raise ValueError(f"draft vocabulary size {vd} must be in 1..{vocab} (the base vocabulary)")
    w["lm_head.weight"] = random_weight(fmt, vd, h, g, dt, dev, gen)
    if vd < vocab:
        low = min(8, vd)       # the lowest ids (pad/bos/eos and such) are always draftable
        rest = torch.randperm(vocab - low, generator=torch.Generator().manual_seed(seed))[:vd - low] + low
        ids = torch.cat([torch.arange(low), rest.sort().values])
        w["d2t"] = ids - torch.arange(vd)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    return head_class(cfg, w, base, tuple(layers), draft_vocab_size=vd, w4_kernel=head_kernel(fmt, kernel))
