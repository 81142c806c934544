"""Train EAGLE-3 draft heads with training-time test (Li et al. 2025), for `train eagle --head-type eagle3`.

The head (hierviz.models.eagle3's layout) drafts from g_t = fc(concat of the base's residual rows
entering its feature layers) and the embedding of token_{t+1}; its midlayer output predicts
token_{t+2} through its own norm and lm_head over a draft vocabulary. Training-time test unrolls
`ttt_steps` drafting steps in training as the tree drafts at run time: step s feeds the head's
own step s-1 output back as the feature, with the true token_{t+s+1}, at position t+s, and its
attention sees the real pairs up to t (causal) plus its own earlier steps at the same t (the
diagonal), exactly the keys a depth-(s+1) node sees in a tree. Loss: the sum over steps of
0.8**s x the cross-entropy against the base's next-token distribution restricted to the draft
vocabulary, where the base's argmax lies inside it (EAGLE-3's recipe; no feature regression).
The head is saved in SafeAILab's EAGLE-3 layout (model.safetensors) and loads with
hierviz.models.eagle3.load_eagle3_head.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hierviz.models.config import ModelConfig
from hierviz.models.eagle3 import default_feature_layers, write_eagle3_checkpoint
from hierviz.models.llama import RMSNorm
from hierviz.train.common import copy_into

STEP_WEIGHT = 0.8     # EAGLE-3's per-step loss decay: later steps matter less and are noisier


def _norm(h: int, eps: float) -> RMSNorm:
    n = RMSNorm(torch.ones(h), eps)       # the engine's norm, made trainable
    n.weight.requires_grad_(True)
    return n


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class _Attn(nn.Module):
    """Attention over [normed embedding ; normed feature] (width 2H), with training-time test's keys."""

    def __init__(self, h: int, heads: int, kv: int, hd: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, hd
        self.q_proj = nn.Linear(2 * h, heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, tuple]:
        """x [B, n, 2H]. earlier: (k, v) of the previous unrolled steps, step 0 first; step 0's keys
        are seen causally, later steps' only at the query's own index. Returns the output and (k, v)."""
        b, n, _ = x.shape
        q = _rope(self.q_proj(x).view(b, n, self.heads, self.hd).transpose(1, 2), cos, sin)
        k = _rope(self.k_proj(x).view(b, n, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        if not earlier:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.heads // self.kv
            keys = [kk for kk, _ in earlier] + [k.repeat_interleave(rep, 1)]
            vals = [vv for _, vv in earlier] + [v.repeat_interleave(rep, 1)]
            scale = self.hd ** -0.5
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            s0 = (q @ keys[0].transpose(-1, -2)).float().masked_fill(~causal, float("-inf")) * scale
            diag = [(q * kk).sum(-1, keepdim=True).float() * scale for kk in keys[1:]]
            p = torch.softmax(torch.cat([s0, *diag], -1), -1).to(q.dtype)
            a = p[..., :n] @ vals[0]
            for j, vv in enumerate(vals[1:]):
                a = a + p[..., n + j:n + j + 1] * vv
        # later steps read this step's keys with one copy per query head
        rep = self.heads // self.kv
        return self.o_proj(a.transpose(1, 2).reshape(b, n, self.heads * self.hd)), (k.repeat_interleave(rep, 1),
                                                                                   v.repeat_interleave(rep, 1))


class _MidLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5)
        heads = cfg["num_attention_heads"]
        self.input_layernorm = _norm(h, eps)
        self.hidden_norm = _norm(h, eps)
        self.self_attn = _Attn(h, heads, cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads)
        self.post_attention_layernorm = _norm(h, eps)
        inter = cfg["intermediate_size"]
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(h, inter, bias=False), "up_proj": nn.Linear(h, inter, bias=False),
                                  "down_proj": nn.Linear(inter, h, bias=False)})

    def forward(self, emb: torch.Tensor, g: torch.Tensor, cos, sin, earlier) -> tuple[torch.Tensor, tuple]:
        attn_in = torch.cat((self.input_layernorm(emb), self.hidden_norm(g)), -1)
        a, kv = self.self_attn(attn_in, cos, sin, earlier)
        x = g + a                               # the feature stays the residual
        y = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y)), kv


class Eagle3TrainHead(nn.Module):
    """Trainable EAGLE-3 head; state_dict() keys are SafeAILab's canonical names (fc.weight,
    midlayer.*, norm.weight, lm_head.weight, d2t, t2d). cfg: the head layer's Llama config dict;
    draft_ids [Vd]: the target token of each draft entry."""

    def __init__(self, cfg: dict, draft_ids: torch.Tensor, feature_layers: tuple[int, ...], base_hidden: int) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = dict(cfg)
        self.feature_layers = tuple(feature_layers)
        self.fc = nn.Linear(len(feature_layers) * base_hidden, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = _norm(h, cfg.get("rms_norm_eps", 1e-5))
        ids = torch.as_tensor(draft_ids, dtype=torch.int64)
        self.lm_head = nn.Linear(h, ids.numel(), bias=False)
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("d2t", ids - torch.arange(ids.numel()))
        self.register_buffer("t2d", t2d)
        hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        theta = float(cfg.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)),
                             persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def unroll(self, embed: nn.Module, x: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: the midlayer's output [B, L-1, H] at each of `steps` unrolled steps.
        x [B, L] tokens, feats [B, L, F] the base's feature-layer rows. Row t of step s stands for
        the draft of token t+s+2 (read through norm and lm_head)."""
        n = x.shape[1] - 1
        g = self.fc(feats[:, :n].to(self.fc.weight.dtype))
        earlier: list = []
        outs = []
        pad = x.new_zeros(x.shape[0], steps)
        xs = torch.cat((x, pad), 1)
        for s in range(steps):
            pos = torch.arange(s, n + s, device=x.device, dtype=torch.float32)
            e = pos[:, None] * self.inv_freq[None, :]
            e = torch.cat((e, e), -1)
            cos, sin = e.cos().to(g.dtype), e.sin().to(g.dtype)
            with torch.no_grad():
                emb = embed(xs[:, s + 1:s + 1 + n])
            g, kv = self.midlayer(emb.to(g.dtype), g, cos, sin, earlier)
            earlier.append(kv)
            outs.append(g)
        return outs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def feature_layers_for(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high layers; on a base too shallow for three distinct ones (tiny test
    models), the distinct layers among them, clamped into the base."""
    want = default_feature_layers(num_layers)
    if len(set(want)) == 3 and all(0 <= i < num_layers for i in want):
        return want
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in want}))


def head_config(base_cfg: dict, vocab_size: int, intermediate_size: Optional[int]) -> dict:
    """The head layer's config: the base's attention shape, optionally a narrower MLP."""
    from hierviz.train.common import hf_config_dict
    return hf_config_dict(base_cfg, num_hidden_layers=1, vocab_size=vocab_size,
                          intermediate_size=intermediate_size or base_cfg["intermediate_size"])


def read_draft_vocab(path: Optional[str], size: Optional[int], vocab: int, eos: list[int]) -> torch.Tensor:
    """Draft vocabulary as target ids, ascending: the first `size` entries of a most-frequent-first
    JSON list (the FR-Spec file `train data` writes), end-of-sequence ids always kept; no file =
    the whole vocabulary."""
    if not path:
        return torch.arange(vocab)
    ids = [int(i) for i in json.loads(Path(path).read_text())]
    ids = ids[:size] if size else ids
    for e in eos:
        if 0 <= e < vocab and e not in ids:
            if size and len(ids) >= size:      # keep the size: an end-of-sequence id replaces the rarest entry
                ids = ids[:-1]
            ids.append(e)
    keep = set(ids)
    bad = [i for i in keep if not 0 <= i < vocab]
    if bad:
        raise SystemExit(f"draft vocabulary {path} names tokens outside the {vocab}-token vocabulary: {bad[:5]}")
    return torch.tensor(sorted(keep), dtype=torch.int64)


class Eagle3Trainer:
    """The EAGLE-3 head type for hierviz.train.eagle_train's loop."""

    head_type = "eagle3"

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a

    def make(self, base, cfg: dict, device: torch.device) -> Eagle3TrainHead:
        a = self.a
        eos = cfg.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        size = a.draft_vocab_size_m if base.name == "intermediate" and a.draft_vocab_size_m else a.draft_vocab_size
        ids = read_draft_vocab(a.draft_vocab, size, cfg["vocab_size"], eos)
        layers = feature_layers_for(cfg["num_hidden_layers"])
        head = Eagle3TrainHead(head_config(cfg, cfg["vocab_size"], a.head_intermediate_size), ids, layers,
                               cfg["hidden_size"])
        with torch.no_grad():      # start drafting from the base's own output layer over the draft vocabulary
            head.lm_head.weight.copy_(base.lm_weight()[ids].float())
            head.norm.weight.copy_(base.final_norm_weight().float())
        return head.to(device)

    def init(self, head: Eagle3TrainHead, folder: str | Path) -> None:
        from hierviz.models.config import read_config_json
        from hierviz.models.eagle3 import canonical_names
        from hierviz.quant.compressed_tensors import load_dense_tensors
        try:
            weights = canonical_names(load_dense_tensors(folder, read_config_json(folder)))
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"cannot start a head from {folder}: {e}")
        copy_into(head, weights, f"EAGLE-3 head {folder} does not fit this base and draft vocabulary")

    def _targets(self, head: Eagle3TrainHead, base, x: torch.Tensor, m: torch.Tensor, steps: int):
        """Base features and, per position j, the base's distribution of token j+1 over the draft
        vocabulary, its full-vocabulary argmax, whether that argmax is draftable and whether token j
        exists; all but the features padded by steps + 1 columns, so that every unrolled step reads
        a view."""
        with torch.no_grad():
            feats, last = base.hidden_at(x, head.feature_layers)
            full = base.lm(last)
            want = full.argmax(-1)
            p = torch.softmax(full[..., head.draft_ids].float(), -1)
            del full
            ok = head.t2d[want] & m
        return feats, *(_padded(t, steps + 1) for t in (p, want, ok, m))

    def loss(self, head: Eagle3TrainHead, base, x: torch.Tensor, m: torch.Tensor, device) -> tuple[torch.Tensor, dict]:
        from hierviz.train.common import autocast
        steps = self.a.ttt_steps
        with autocast(device):
            feats, p, want, ok, mp = self._targets(head, base, x, m, steps)
            outs = head.unroll(base.embed, x, feats, steps)
            total = 0.0
            stats = {}
            ids = head.draft_ids
            for s, out in enumerate(outs):
                n = out.shape[1]
                # row t of step s drafts token t+s+2: the base's distribution at position t+s+1
                valid = ok[:, s + 1:s + 1 + n] & mp[:, s + 2:s + 2 + n]
                logp = F.log_softmax(head.logits(out).float(), -1)
                ce = -(p[:, s + 1:s + 1 + n] * logp).sum(-1)
                n_valid = valid.sum().clamp_min(1)
                total = total + STEP_WEIGHT ** s * (ce * valid).sum() / n_valid
                if s in (0, len(outs) - 1):
                    hit = (ids[logp.argmax(-1)] == want[:, s + 1:s + 1 + n]) & valid
                    stats[f"acc{s + 1}"] = (hit.sum() / n_valid).item()
            stats["loss"] = total.item()
        return total, stats

    @torch.no_grad()
    def depth_hits(self, head: Eagle3TrainHead, base, x: torch.Tensor, m: torch.Tensor,
                   depths: int) -> tuple[list[int], list[int]]:
        """Hits of the head's argmax on the base's argmax at depths 1..depths, every position whose
        token exists (an argmax outside the draft vocabulary counts as a miss)."""
        feats, _, want, _, mp = self._targets(head, base, x, m, depths)
        outs = head.unroll(base.embed, x, feats, depths)
        hits, tots = [], []
        for s, out in enumerate(outs):
            n = out.shape[1]
            valid = mp[:, s + 2:s + 2 + n]
            got = head.draft_ids[head.logits(out).argmax(-1)]
            hits.append(int(((got == want[:, s + 1:s + 1 + n]) & valid).sum()))
            tots.append(int(valid.sum()))
        return hits, tots

    def save(self, head: Eagle3TrainHead, folder: str | Path, base_cfg: dict, extra: dict) -> Path:
        tensors = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).cpu().contiguous()
                   for k, v in head.state_dict().items()}
        cfg = ModelConfig.from_dict(dict(head.cfg, model_type="llama"))
        # SafeAILab's layout where it can say which layers the head reads, speculators' otherwise
        n_layers = base_cfg["num_hidden_layers"]
        layout = "safeailab" if head.feature_layers == default_feature_layers(n_layers) else "speculators"
        folder = write_eagle3_checkpoint(folder, tensors, cfg, torch.float16, head.feature_layers, n_layers,
                                         base_cfg["hidden_size"], layout=layout, fmt="safetensors")
        raw = json.loads((folder / "config.json").read_text())
        raw["hierviz"] = {"eagle3_head": True, "embed_tokens": "not stored: the base model's embedding is used",
                          "feature_layers": list(head.feature_layers), **extra}
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
        return folder

    def report_fields(self) -> dict:
        """The EAGLE-3 options, for the training report."""
        a = self.a
        return {"ttt_steps": a.ttt_steps, "draft_vocab": a.draft_vocab, "draft_vocab_size": a.draft_vocab_size,
                "draft_vocab_size_m": a.draft_vocab_size_m, "head_intermediate_size": a.head_intermediate_size}

    @staticmethod
    def stats_line(st: dict) -> str:
        return " ".join(f"{k} {v:.3f}" for k, v in st.items())


def _padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """t [B, L, ...] with `cols` zero (False) columns appended."""
    return torch.cat((t, t.new_zeros((t.shape[0], cols, *t.shape[2:]))), 1)
