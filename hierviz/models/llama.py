"""A compact Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Mistral, SmolLM2) for batch-1 decoding.

Weights are float tensors or weights of a registered format (hierviz.quant.formats: W4A16,
W8A8 int8), each linear's product done by its format. Every forward
appends its tokens' keys/values to a preallocated `KVCache`; the caller passes the positions
(tree nodes share a depth-based position) and an attention mask over [cache | new tokens], so
the same code serves causal decoding, sequence verification and tree verification. `forward`
returns the last hidden states after the final norm (EAGLE heads need them); `logits` maps
them through the LM head.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from hierviz.models import fused
from hierviz.models.config import ModelConfig, rope_frequencies
from hierviz.quant.formats import DENSE, QuantLinear, fixed_row_chunks, format_of, out_features, weight_to
from hierviz.quant.w4 import FORMAT as W4_FORMAT
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight, codes_of, matmul_nt

Weight = Union[torch.Tensor, Any]      # a dense tensor or a weight-format weight (hierviz.quant.formats)


class WeightsError(ValueError):
    """Missing or mis-shaped weights; the message names the tensor."""


class KVCache:
    """Keys/values for one sequence: [layers, kv_heads, max_len, head_dim], `length` slots used.
    k and v are the two halves of one tensor `kv`, so that compacting both is one gather."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.kv = torch.zeros(2, num_layers, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.k, self.v = self.kv[0], self.kv[1]
        self.length = 0
        self.max_len = max_len

    def truncate(self, n: int) -> None:
        """Roll back to the first n slots."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {n}")
        self.length = n

    def keep(self, start: int, slots: list[int]) -> None:
        """Keep slots start+slots[i] (ascending) moved to start+i; drop everything after start.

        Used after tree verification: the accepted path's entries become contiguous."""
        if slots == list(range(len(slots))):
            self.length = start + len(slots)      # already in place: no gather, no copy
            return
        self.move_to(start, torch.tensor([start + i for i in slots], dtype=torch.long).to(self.kv.device))

    def move_to(self, start: int, src: torch.Tensor) -> None:
        """keep() with the absolute source slots as a tensor on the cache's device (ascending, all
        >= start): a caller that uploads one index tensor for several gathers (BaseState.commit_path)."""
        n = src.numel()
        if n:
            # the gather makes a new tensor first: source and destination ranges may overlap
            self.kv[:, :, :, start:start + n] = self.kv[:, :, :, src]
        self.length = start + n


class TokenKeys:
    """For each new token of a forward, the cache columns it sees, as (n, m, tail): n columns, the
    first m of them 0..m-1, then `tail` (ascending, None when m == n): a tree node's ancestors
    scattered among siblings. Built once per forward from the mask (Transformer.run_layers) for the
    batch-invariant CPU attention."""

    def __init__(self, spans: list[tuple[int, int, Optional[torch.Tensor]]]) -> None:
        self.spans = spans

    @classmethod
    def from_mask(cls, attn_mask: Optional[torch.Tensor], prefix: int, t: int) -> "TokenKeys":
        if attn_mask is None:       # causal over [cache | new]
            return cls([(prefix + i + 1, prefix + i + 1, None) for i in range(t)])
        spans: list[tuple[int, int, Optional[torch.Tensor]]] = []
        for row in attn_mask:
            cols = row.nonzero().flatten()
            n = cols.numel()
            off = (cols != torch.arange(n, device=cols.device)).nonzero()
            m = int(off[0]) if off.numel() else n
            spans.append((n, m, cols[m:] if m < n else None))
        return cls(spans)


def attention_per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: TokenKeys) -> torch.Tensor:
    """Attention for q [Hq, T, hd] over k/v [Hkv, L, hd] (views of the KV cache), each token alone
    over the keys it sees: the same call, on a view of the same shape and the same values, as that
    token's one-token step, so verifying a sequence or a tree gives each token the bits of decoding it
    alone (torch's CPU SDPA rounds one query differently from several: 0 of 25 rows equal in fp32;
    every token here takes `_one_query_attention`, the one-token step included). A tree
    node's scattered keys (its ancestors among siblings) are moved, for its call, right after its
    contiguous prefix; the cache rows are put back afterwards."""
    lo = min((m for _, m, tail in keys.spans if tail is not None), default=None)
    saved = (k[..., lo:, :].clone(), v[..., lo:, :].clone()) if lo is not None else None
    out = []
    for i, (n, m, tail) in enumerate(keys.spans):
        if saved is not None and n > lo:
            # this token's columns from lo on, from the saved rows (an earlier token's call moved others there)
            idx = torch.arange(m - lo, device=k.device)
            if tail is not None:
                idx = torch.cat([idx, tail - lo])
            k[..., lo:n, :] = saved[0].index_select(-2, idx)
            v[..., lo:n, :] = saved[1].index_select(-2, idx)
        out.append(_one_query_attention(q[..., i:i + 1, :], k[..., :n, :], v[..., :n, :]))
    if saved is not None:
        k[..., lo:, :] = saved[0]
        v[..., lo:, :] = saved[1]
    return torch.cat(out, -2)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v for one token's q [Hq, 1, hd] over k/v [Hkv, n, hd] (GQA: query
    head h reads KV head h // (Hq / Hkv)). Three plain ops: ~65 us at n = 300 on the 2-core CPU where
    torch's SDPA takes ~250 us for one query, a cost the per-token path pays once per token and layer."""
    hkv, hd = k.shape[-3], k.shape[-1]
    qg = q.reshape(hkv, q.shape[-3] // hkv, hd)
    p = torch.softmax((qg @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(hd)), -1).to(v.dtype)
    return (p @ v).reshape(q.shape)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) with W dense or in a weight format (hierviz.quant.formats: the format's
    product does the work). Several linears reading the same input are fused into one
    (concatenated along the output dim). A dense weight is copied (fused or not) unless
    copy=False: then a single one is kept as given (a loader's own tensor, released to the model:
    no second copy while the model is built). `kernel` names the format's kernel (W4's KERNELS)."""

    def __init__(self, weights: list[Weight], biases: list[Optional[torch.Tensor]], w4_kernel: str = "reference",
                 copy: bool = True) -> None:
        super().__init__()
        self.splits = [out_features(w) for w in weights]
        self._kernel = w4_kernel
        fmts = {(f or DENSE).name for f in map(format_of, weights)}
        if len(fmts) > 1:
            raise WeightsError(f"a fused linear mixes weight formats: {', '.join(sorted(fmts))}")
        fmt = format_of(weights[0])
        self.q: Optional[QuantLinear] = None
        if fmt is None:
            dense = weights[0].contiguous() if len(weights) == 1 and not copy else torch.cat(weights, 0)
            self.weight = nn.Parameter(dense, requires_grad=False)
        else:
            self.weight = None
            self.q = fmt.make_linear(weights, w4_kernel)
        if any(b is not None for b in biases):
            ref = next(b for b in biases if b is not None)
            full = [b if b is not None else torch.zeros(n, dtype=ref.dtype, device=ref.device)
                    for b, n in zip(biases, self.splits)]
            self.bias = nn.Parameter(torch.cat(full), requires_grad=False)
        else:
            self.bias = None

    @property
    def w4_kernel(self) -> str:
        """The kernel of a format that has several (W4's KERNELS); settable, to switch a built model."""
        return getattr(self.q, "kernel", self._kernel)

    @w4_kernel.setter
    def w4_kernel(self, name: str) -> None:
        self._kernel = name
        if self.q is not None and hasattr(self.q, "kernel"):
            self.q.kernel = name

    @property
    def w4(self) -> list[W4Weight]:
        """The W4 weights of a W4A16 linear (W4-only tools: the kernel proof, the op profile)."""
        return self.q.weights if self.q is not None and self.q.format == W4_FORMAT.name else []

    def forward(self, x: torch.Tensor, add_to: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x W^T (+ b); with add_to (the residual), added into add_to in place, which is returned."""
        if self.weight is None and self.bias is None:   # the format's product adds into add_to itself
            return self.q(x, add_to)
        y = matmul_nt(x, self.weight) if self.weight is not None else self.q(x)
        if self.bias is not None:
            y = y + self.bias
        return y if add_to is None else add_to.add_(y)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.splits, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, hd]; rotate-half convention (HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, get, prefix: str, w4_kernel: str, input_norm: bool = True,
                 copy: bool = True) -> None:
        """get(name) -> weight; copy=False: `get` hands over tensors nobody else holds (see Linear)."""
        super().__init__()
        self.cfg = cfg
        att = f"{prefix}.self_attn"
        mlp = f"{prefix}.mlp"
        self.input_norm = RMSNorm(get(f"{prefix}.input_layernorm.weight"), cfg.rms_eps) if input_norm else None
        self.post_norm = RMSNorm(get(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_eps)
        bias = (lambda n: get(f"{att}.{n}_proj.bias")) if cfg.qkv_bias else (lambda n: None)
        self.qkv = Linear([get(f"{att}.{n}_proj.weight") for n in "qkv"], [bias(n) for n in "qkv"], w4_kernel)
        self.o = Linear([get(f"{att}.o_proj.weight")], [None], w4_kernel, copy)
        self.gate_up = Linear([get(f"{mlp}.gate_proj.weight"), get(f"{mlp}.up_proj.weight")], [None, None], w4_kernel)
        self.down = Linear([get(f"{mlp}.down_proj.weight")], [None], w4_kernel, copy)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                cache: Optional[KVCache], attn_mask: Optional[Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]],
                slots: Optional[torch.Tensor] = None, attn_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The layer's output. On the fused static path (CUDA, fp16/bf16) x is consumed: the
        residual adds write into it in place (callers pass a tensor of their own); there attn_mask
        may come as `fused.visible_columns` (Transformer.run_layers computes them once).
        attn_in: the attention's input when it is not input_norm(x) (an EAGLE-3 layer attends over
        [normed embedding ; normed feature] while x, the feature, stays the residual)."""
        cfg = self.cfg
        if attn_in is None and (isinstance(attn_mask, tuple) or (cache is not None and slots is not None
                                                                 and attn_mask is not None and fused.usable(x))):
            return self._forward_fused(x, cos, sin, cache.k[layer], cache.v[layer], attn_mask, slots)
        lead, t = x.shape[:-2], x.shape[-2]      # lead = () when decoding, (B,) for batched training
        h = attn_in if attn_in is not None else x if self.input_norm is None else self.input_norm(x)
        q, k, v = self.qkv.split(self.qkv(h))
        q = apply_rope(q.view(*lead, t, cfg.num_heads, cfg.head_dim).transpose(-3, -2), cos, sin)
        k = apply_rope(k.view(*lead, t, cfg.num_kv_heads, cfg.head_dim).transpose(-3, -2), cos, sin)
        v = v.view(*lead, t, cfg.num_kv_heads, cfg.head_dim).transpose(-3, -2)
        if cache is not None and slots is not None:
            # Static-shape path (hierviz.models.cuda_graphs): scatter the new keys/values at
            # cache slots given as a tensor and attend over the whole preallocated cache; the
            # caller's attn_mask [T, max_len] hides unused slots. No Python ints depend on the
            # cache length, so the forward can be captured once in a CUDA graph and replayed.
            cache.k[layer].index_copy_(1, slots, k)
            cache.v[layer].index_copy_(1, slots, v)
            k, v = cache.k[layer], cache.v[layer]
        elif cache is not None:
            start = cache.length
            cache.k[layer, :, start:start + t] = k
            cache.v[layer, :, start:start + t] = v
            k = cache.k[layer, :, :start + t]
            v = cache.v[layer, :, :start + t]
        if isinstance(attn_mask, TokenKeys):
            a = attention_per_token(q, k, v, attn_mask)
        elif attn_mask is None:
            # plain causal attention over [cache | new]
            prefix = k.shape[-2] - t
            a = F.scaled_dot_product_attention(q, k, v, is_causal=prefix == 0,
                                               attn_mask=causal_mask(prefix, t, q.device) if prefix else None,
                                               enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        x = x + self.o(a.transpose(-3, -2).reshape(*lead, t, cfg.num_heads * cfg.head_dim))
        g, u = self.gate_up.split(self.gate_up(self.post_norm(x)))
        return x + self.down(F.silu(g) * u)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, attn_mask, slots: torch.Tensor) -> torch.Tensor:
        """The static path's forward with the non-GEMM work in fused kernels (hierviz.models.fused):
        ~10 launches per layer instead of ~50; same arithmetic as `forward` up to rounding order.
        attn_mask: the bool mask or its `fused.visible_columns` (computed once for all layers)."""
        cfg = self.cfg
        h = x if self.input_norm is None else fused.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        q = fused.rope_to_cache(self.qkv(h), cos, sin, slots, k_cache, v_cache,
                                cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        a = fused.masked_attention(q, k_cache, v_cache, attn_mask, cfg.num_heads, cfg.head_dim)
        # the residual adds happen inside the o / down products (in place on x, this layer's own
        # input or the previous layer's output): no zero fill for their split-K, no add kernel
        x = self.o(a, add_to=x)
        h = fused.rms_norm(x, self.post_norm.weight, self.post_norm.eps)
        return self.down(fused.silu_mul(self.gate_up(h)), add_to=x)


def causal_mask(prefix: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[t, prefix + t] bool: new token i sees the whole prefix and new tokens 0..i."""
    m = torch.ones(t, prefix + t, dtype=torch.bool, device=device)
    m[:, prefix:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return m


def block_mask(prefix: int, block: torch.Tensor) -> torch.Tensor:
    """[t, prefix + t] bool: every new token sees the prefix; among new tokens `block` [t, t] decides."""
    t = block.shape[0]
    m = torch.ones(t, prefix + t, dtype=torch.bool, device=block.device)
    m[:, prefix:] = block
    return m


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], w4_kernel: str = "reference",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 release: bool = False) -> None:
        """weights: HF names -> float tensors / weight-format weights, anywhere, any float dtype (each is moved
        to `device` and cast to `dtype` as it is used). release: remove each entry from `weights`
        once used and keep unfused dense weights without a copy, so a loader's own weights
        (already on the device, hierviz.models.loading.open_weights) are held about once while
        the model is built, each layer fused as its tensors arrive (hierviz.stack)."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.static_runners: list = []    # hierviz.models.cuda_graphs pools its runners here
        own_head = not cfg.tie_embeddings and "lm_head.weight" in weights
        get = weight_getter(weights, dtype, self.device, release)
        self.embed = nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise WeightsError(f"embed_tokens has shape {tuple(self.embed.shape)}, config says "
                               f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.layers = nn.ModuleList(DecoderLayer(cfg, get, f"model.layers.{i}", w4_kernel, copy=not release)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(get("model.norm.weight"), cfg.rms_eps)
        if not own_head:
            self.lm_head = Linear([self.embed.data], [None])
        else:
            self.lm_head = Linear([get("lm_head.weight")], [None], w4_kernel, copy=not release)
        self.register_buffer("inv_freq", rope_frequencies(cfg).to(self.device), persistent=False)

    def new_cache(self, max_len: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Optional[KVCache] = None,
                attn_mask: Optional[torch.Tensor] = None, slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens, positions [T]; attn_mask [T, cache.length + T] bool or None (causal).
        Appends T entries to the cache. Returns hidden states [T, H] after the final norm.
        Without a cache, tokens may be batched [B, T] (training).
        With `slots` [T] (static-shape mode, see hierviz.models.cuda_graphs) the entries go to
        those cache slots instead, attn_mask is [T, cache.max_len] and cache.length is left
        for the caller to set."""
        return self.run_layers(self.embed[tokens], positions, cache, attn_mask, slots)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: Optional[KVCache],
                   attn_mask: Optional[torch.Tensor], slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = x.shape[-2]
        if cache is not None and slots is None and cache.length + t > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {t} tokens > {cache.max_len}")
        cos, sin = self.rope(positions)
        if cache is not None and slots is not None and attn_mask is not None and fused.usable(x):
            attn_mask = fused.visible_columns(attn_mask)      # once per forward, not per layer
        elif self._invariant_cpu(x) and cache is not None and slots is None:
            attn_mask = TokenKeys.from_mask(attn_mask, cache.length, t)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                captured.append(x.clone())      # the fused path adds the residual into x in place
            x = layer(x, cos, sin, i, cache, attn_mask, slots)
        if cache is not None and slots is None:
            cache.length += t
        # On the fused path the final norm is the fused kernel too: it reduces each row alone, where
        # torch's CUDA mean sizes its thread block by the row count, so a row's bits would change
        # with how many tokens share the forward.
        out = (fused.rms_norm(x, self.norm.weight, self.norm.eps) if isinstance(attn_mask, tuple)
               else self.norm(x))
        return torch.cat([out, *captured], -1) if captured else out

    # Residual-stream rows a draft head reads (hierviz.models.drafter): the input of each of these
    # layers, appended to forward's output after the final hidden state. Empty: nothing extra.
    feature_layers: tuple[int, ...] = ()

    def add_feature_layers(self, layers: tuple[int, ...]) -> None:
        """Also hand out the rows entering `layers` (a draft head's request; kept sorted, shared by
        every head on this model). Static runners built before must be dropped (their outputs are
        narrower)."""
        bad = [i for i in layers if not 0 <= i < self.cfg.num_layers]
        if bad:
            raise WeightsError(f"feature layers {bad} do not exist in a {self.cfg.num_layers}-layer model")
        self.feature_layers = tuple(sorted(set(self.feature_layers) | set(layers)))

    @property
    def feature_width(self) -> int:
        """Width of forward's output rows: the final hidden state, then each feature layer's input."""
        return self.cfg.hidden_size * (1 + len(self.feature_layers))

    def layer_features(self, rows: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """The columns of forward's output rows that hold `layers`' inputs, concatenated in that order."""
        h = self.cfg.hidden_size
        idx = [self.feature_layers.index(i) for i in layers]
        return torch.cat([rows[..., h * (1 + j):h * (2 + j)] for j in idx], -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[.., V] float32. With an output vocabulary set, only those rows of the LM head are
        computed and every other token gets -inf (argmax / softmax stay in global token ids)."""
        if hidden.shape[-1] != self.cfg.hidden_size:    # rows carrying a head's feature columns too
            hidden = hidden[..., :self.cfg.hidden_size].contiguous()
        if self.output_vocab is None:
            if self._invariant_cpu(hidden) and self.lm_head.weight is not None:
                return _rows_invariant_product(hidden, self.lm_head.weight).float()
            return self.lm_head(hidden).float()
        out = torch.full((*hidden.shape[:-1], self.cfg.vocab_size), float("-inf"), device=hidden.device)
        out[..., self.output_vocab] = rows_product(hidden, self._vocab_rows).float()
        return out

    output_vocab: Optional[torch.Tensor] = None

    def restrict_output_vocab(self, token_ids: Optional[torch.Tensor]) -> None:
        """Let this model predict only `token_ids` (FR-Spec style). Only for models whose outputs
        are drafts (the intermediate): a verifier of record (the target) keeps the full vocabulary."""
        if token_ids is None:
            self.output_vocab = None
            return
        self.output_vocab, self._vocab_rows = self.lm_head_rows(token_ids)

    batch_invariant = False

    def set_batch_invariant(self, on: bool = True) -> None:
        """Make a token's logits independent of how many tokens one forward holds (up to a
        verification's size): for the verifier of record, so that verifying K tokens in one forward
        gives the logits of K one-token forwards, bit for bit. On a GPU: the W4 kernels keep one K
        split (the fused attention is batch-invariant always). On the CPU: each token attends on its
        own (`attention_per_token`) and the dense LM head runs in fixed-size chunks; the W4 products
        must come from a row-invariant kernel (`int4pack_cpu` is, `dequant_cached`'s BLAS product is
        not). Drafters need none of it."""
        self.batch_invariant = on
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.q is not None:
                mod.q.set_batch_invariant(on)

    def products_rows_invariant_cpu(self) -> bool:
        """Whether every decoder-layer product gives a row the same bits at any row count on the
        CPU (a format's kernel says so; dense BLAS products do not): what a batch-invariant CPU
        verifier needs besides its own attention and LM head."""
        lins = [m for layer in self.layers for m in layer.modules() if isinstance(m, Linear)]
        return bool(lins) and all(m.q is not None and m.q.rows_invariant_cpu for m in lins)

    def _invariant_cpu(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.batch_invariant and x.device.type == "cpu" and 0 < rows <= INVARIANT_MAX_ROWS

    def lm_head_rows(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, Union[torch.Tensor, "Linear"]]:
        """(ids on this device, the LM head's rows for them): the pieces of a reduced-vocabulary head,
        which rows_product multiplies. A W4 head's rows are a Linear of those rows' codes and scales
        in the head's kernel (a drafter's head: an intermediate's, stack.py quantize_lm_head)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        if self.lm_head.weight is not None:
            return ids, self.lm_head.weight.data[ids]
        if len(self.lm_head.w4) != 1:
            raise WeightsError("a reduced vocabulary needs a dense or W4 LM head")
        w = self.lm_head.w4[0]
        rows = W4Weight(codes_of(w, ids), w.scales[ids], w.offsets[ids], w.group_size, w.perm)
        return ids, Linear([rows], [None], self.lm_head.w4_kernel)


def rows_product(x: torch.Tensor, rows: Union[torch.Tensor, Linear]) -> torch.Tensor:
    """x @ rows^T for the rows lm_head_rows gives: dense rows, or a Linear of a W4 head's rows."""
    return matmul_nt(x, rows) if isinstance(rows, torch.Tensor) else rows(x)


LM_HEAD_CHUNK = 8


def _rows_invariant_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T on the CPU with each row's bits independent of the other rows: always
    (w @ chunk^T)^T over chunks of LM_HEAD_CHUNK rows, zero-padded, so every BLAS call has one shape
    (measured: rows equal alone and in any chunk position; the plain x @ w^T rounds a row differently
    at every M > 1). A one-row product reads the weight once either way: the padding costs ~nothing."""
    y = fixed_row_chunks(x.reshape(-1, x.shape[-1]), LM_HEAD_CHUNK, lambda chunk: (w @ chunk.t()).t())
    return y.reshape(*x.shape[:-1], w.shape[0])


def weight_getter(weights: dict[str, Weight], dtype: torch.dtype, device: torch.device, release: bool = False):
    """get(name): the weight on device as dtype; with release, its entry leaves `weights`."""
    def get(name: str) -> Weight:
        if name not in weights:
            raise WeightsError(f"checkpoint has no tensor {name!r}")
        w = weights.pop(name) if release else weights[name]
        return weight_to(w, device, dtype)
    return get


def quantize_own_linears(module: nn.Module, quantize: Callable[[torch.Tensor], Weight], w4_kernel: str,
                         skip: tuple[nn.Module, ...] = ()) -> None:
    """Every dense Linear under `module`, except under `skip` (a draft head's base model), replaced
    by one of its weights through `quantize`, each fused part on its own so that the outputs split
    as before (a stack's quantized draft heads: heads only draft)."""
    for name, child in list(module.named_children()):
        if any(child is s for s in skip):
            continue
        if isinstance(child, Linear) and child.q is None:
            parts = torch.split(child.weight.data, child.splits, 0)
            biases = torch.split(child.bias.data, child.splits, 0) if child.bias is not None else [None] * len(parts)
            setattr(module, name, Linear([quantize(p) for p in parts], list(biases), w4_kernel))
        else:
            quantize_own_linears(child, quantize, w4_kernel, skip)
