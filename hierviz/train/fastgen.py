"""Batched generation for the training data: a static KV cache over a transformers Llama.

transformers' `generate` grows its cache by concatenation (every step copies the whole cache)
and runs its logits processors over the full batch until the last row ends; for a 135M target at
batch 2,048 that measured ~13k response tokens/s on the H200. This decoder keeps the same modules
(the model's own projections, norms, MLPs and rotary embedding, so the arithmetic is the model's),
writes K/V in place into preallocated tensors, computes logits for the last position only, and
drops finished rows from the batch once half of them have ended.

Rows are left-padded: column c of row i holds position c - pad_i, and keys left of pad_i are
masked. Greedy rows take the argmax; sampled rows use temperature + nucleus (top-p) sampling.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _attend_mask(pad: torch.Tensor, q_cols: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[B, 1, Tq, n_keys] bool: key column k is visible from query column q iff pad <= k <= q.
    A padding column sees itself too: a query with no visible key would give NaN, and NaN values
    poison later layers even where their attention weight is zero."""
    k = torch.arange(n_keys, device=pad.device)[None, None, :]
    q = q_cols[None, :, None]
    return (((k >= pad[:, None, None]) & (k <= q)) | (k == q))[:, None]


class StaticCacheLlama:
    """One batch of left-padded prompts decoded together by a transformers LlamaForCausalLM."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        self.model = model
        self.core = model.model
        cfg = model.config
        p = next(model.parameters())
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_len = max_len
        shape = (batch, self.n_kv, max_len, self.head_dim)
        n_layers = len(self.core.layers)
        # zeros, not empty: a graphed step attends over every column (masked ones included), and a
        # NaN bit pattern there would poison the output even with zero attention weight
        self.k = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(n_layers)]
        self.graph: Optional[_DecodeGraph] = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]
        self.graph = None          # captured for the old batch size and tensors

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cols: torch.Tensor, pad: torch.Tensor, n_keys: int) -> torch.Tensor:
        """Logits [B, V] (float32) of the last column, after writing K/V at columns `cols` (a [T]
        device tensor) and attending over the first n_keys columns."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        B, T = ids.shape
        pos = (cols[None, :] - pad[:, None]).clamp_min(0)
        h = self.core.embed_tokens(ids)
        cos, sin = self.core.rotary_emb(h, pos)
        mask = _attend_mask(pad, cols, n_keys)
        for i, layer in enumerate(self.core.layers):
            at = layer.self_attn
            x = layer.input_layernorm(h)
            q = at.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = at.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = at.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.k[i].index_copy_(2, cols, k)
            self.v[i].index_copy_(2, cols, v)
            o = F.scaled_dot_product_attention(q, self.k[i][:, :, :n_keys], self.v[i][:, :, :n_keys],
                                               attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
            h = h + at.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.core.norm(h[:, -1])
        return self.model.lm_head(h).float()

    def decode(self, ids: torch.Tensor, col: int, pad: torch.Tensor, graphed: bool) -> torch.Tensor:
        """One decode step ([B, 1] ids written at column col). Graphed: a CUDA graph of the step
        over the whole cache (the mask hides unwritten columns), captured once per batch size;
        a launch-bound model then pays one launch instead of ~12 per layer."""
        if not graphed:
            return self.forward(ids, torch.tensor([col], device=ids.device), pad, col + 1)
        if self.graph is None or self.graph.batch != ids.shape[0]:
            self.graph = _DecodeGraph(self, ids, col, pad)
        return self.graph.run(ids, col, pad)


class _DecodeGraph:
    def __init__(self, cache: StaticCacheLlama, ids: torch.Tensor, col: int, pad: torch.Tensor) -> None:
        self.batch = ids.shape[0]
        self.ids, self.pad = ids.clone(), pad.clone()
        self.col = torch.tensor([col], device=ids.device)
        step = lambda: cache.forward(self.ids, self.col, self.pad, cache.max_len)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):      # warm-up writes this step's K/V: the replay rewrites the same values
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()

    def run(self, ids: torch.Tensor, col: int, pad: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pad.copy_(pad)
        self.col.fill_(col)
        self.graph.replay()
        return self.logits


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: Optional[torch.Generator]) -> torch.Tensor:
    """Greedy when temperature == 0, else temperature + nucleus sampling; [B] token ids."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p   # tokens wholly beyond the nucleus (the first always stays)
        sp = sp.masked_fill(drop, 0.0)
        pick = torch.multinomial(sp, 1, generator=gen).squeeze(-1)
        return si.gather(-1, pick[:, None]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new: int, eos_ids: list[int], pad_id: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
             compact_below: float = 0.5, cuda_graph: bool = True) -> list[list[int]]:
    """Responses of `model` to each prompt (token lists), each cut after its first EOS.

    temperature 0 is greedy. Rows leave the batch (cache rows dropped) once fewer than
    `compact_below` of the rows still running are unfinished. On a GPU the decode step runs as
    a CUDA graph unless cuda_graph is False."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    device = next(model.parameters()).device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pad = torch.empty(B, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        pad[i] = L - len(p)
    ids, pad = ids.to(device), pad.to(device)
    gen = None
    if seed is not None and temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    cache = StaticCacheLlama(model, B, L + max_new)
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=device)
    rows = torch.arange(B, device=device)          # original row of each running row
    out = torch.full((B, max_new), -1, dtype=torch.long, device=device)
    graphed = cuda_graph and device.type == "cuda"
    logits = cache.forward(ids, torch.arange(L, device=device), pad, L)
    if eos_ids:
        logits[:, eos] = float("-inf")             # at least one token per response (generate's min_new_tokens=1)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new):
        nxt = sample_next(logits, temperature, top_p, gen)
        out[rows, step] = nxt
        done = done | torch.isin(nxt, eos)
        if step == max_new - 1:
            break
        n_done = int(done.sum())                   # one read-back per step: when to stop / compact
        if n_done == len(rows):
            break
        if n_done and (len(rows) - n_done) < compact_below * len(rows):
            keep = (~done).nonzero().squeeze(-1)
            rows, pad, nxt, done = rows[keep], pad[keep], nxt[keep], done[keep]
            cache.keep_rows(keep)
        # a finished row that stays (not compacted yet) decodes pad tokens; its output is cut at
        # its first EOS below, so they never count
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        logits = cache.decode(nxt[:, None], L + step, pad, graphed)
    result = []
    eos_set = set(eos_ids)
    for r in out.cpu().tolist():
        resp = []
        for t in r:
            if t < 0:
                break
            resp.append(t)
            if t in eos_set:
                break
        result.append(resp)
    return result
