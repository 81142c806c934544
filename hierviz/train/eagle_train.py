"""Train draft heads: E_T on the target's features, E_M on the intermediate's.

    python -m hierviz train eagle --target T.gguf --intermediate M_DIR --data data.pt \
        --out-t E_T_DIR --out-m E_M_DIR --steps 3000 --time-budget 150 [--head-type eagle3 ...]

One loop trains every head type that names a trainer in its registry entry
(hierviz.models.drafter.HeadType.trainer); each trainer brings its head, loss, held-out check and
writer (Eagle2Trainer here; hierviz.train.eagle3_train.Eagle3Trainer for EAGLE-3 with
training-time test). EAGLE-1/2:

A head is one Llama decoder layer without input norm, fed fc(cat(embed(token_{t+1}), feature_t))
at position t, where feature_t is the base model's last hidden state after its final norm; its
output predicts feature_{t+1}, and the base's frozen LM head turns it into draft logits. Loss
(EAGLE): SmoothL1(pred, feature_{t+1}) + w * CE(softmax(LM(feature_{t+1})), LM(pred)), with
uniform noise on the input features. Data = the base model's own outputs on
T's generated text: E_M sees the *quantized* M exactly as shipped (GPTQ checkpoint, embeddings
shared with T). Heads are saved in SafeAILab's layout (config.json + model.safetensors, fp16,
no embed_tokens copy) and load with hierviz.models.eagle.load_eagle_weights. Reported: held-out
top-1 accuracy of the head's argmax against the base's argmax at depth 1 (true features) and
depths 2-3 (the head's own predicted features fed back), on greedy and on sampled text.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hierviz.config import recorded_command
from hierviz.models.drafter import HEAD_TYPES, get_head_type, trainable_head_types
from hierviz.models.llama import RMSNorm
from hierviz.train.common import (base_dtype, Progress, TokenData, autocast, batches, build_hf, copy_into,
                                  env_info, hf_config_dict, load_base, log, pick_device, seed_all, valid_mask,
                                  with_shared_embeddings, write_json)


class _Attn(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, hd: int) -> None:
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, hd
        self.q_proj = nn.Linear(h, heads * hd, bias=False)
        self.k_proj = nn.Linear(h, kv * hd, bias=False)
        self.v_proj = nn.Linear(h, kv * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.hd))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class _MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        self.self_attn = _Attn(h, heads, cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or h // heads)
        self.mlp = _MLP(h, cfg["intermediate_size"])
        # the engine's norm, made trainable (the engine freezes its parameters)
        self.post_attention_layernorm = RMSNorm(torch.ones(h), cfg.get("rms_norm_eps", 1e-5))
        self.post_attention_layernorm.weight.requires_grad_(True)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(x, cos, sin)      # layer 0 of an EAGLE head: no input_layernorm
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleTrainHead(nn.Module):
    """Trainable EAGLE head; state_dict() keys are SafeAILab's (fc.*, layers.0.*)."""

    def __init__(self, cfg: dict, bias: bool = True) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.layers = nn.ModuleList([_Layer(cfg)])
        hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        theta = float(cfg.get("rope_theta", 10000.0))
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)),
                             persistent=False)

    def forward(self, emb_next: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """emb_next [B, T, H] = embed(token_{t+1}), feats [B, T, H] = feature_t, positions 0..T-1."""
        t = feats.shape[1]
        freqs = torch.arange(t, device=feats.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        e = torch.cat((freqs, freqs), -1)
        x = self.fc(torch.cat((emb_next, feats.to(emb_next.dtype)), -1))
        cos, sin = e.cos().to(x.dtype), e.sin().to(x.dtype)
        return self.layers[0](x, cos, sin)


def save_head(head: EagleTrainHead, folder: str | Path, base_cfg: dict, extra: dict) -> Path:
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.float16).cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config_dict(base_cfg, num_hidden_layers=1, torch_dtype="float16", bias=head.fc.bias is not None)
    cfg["hierviz"] = {"eagle_head": True, "embed_tokens": "not stored: the base model's embedding is used", **extra}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def init_head(head: EagleTrainHead, folder: str | Path) -> None:
    """Load a saved head (SafeAILab layout, as save_head writes it) into `head` to train it further."""
    from hierviz.models.eagle import load_eagle_weights
    try:
        _, weights = load_eagle_weights(folder)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"cannot start a head from {folder}: {e}")
    copy_into(head, weights, f"head {folder} does not fit this base", ignore_extra=True)


class _Base:
    """A frozen base model: features (after the final norm), embedding and LM head."""

    def __init__(self, name: str, model) -> None:
        self.name = name
        self.model = model

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.model(input_ids=x).last_hidden_state

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(x)

    def lm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(h)

    def lm_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def final_norm_weight(self) -> torch.Tensor:
        return self.model.model.norm.weight

    @torch.no_grad()
    def hidden_at(self, x: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual rows entering each of `layers`, concatenated [B, L, len(layers) * H], the
        final normed hidden state [B, L, H]): what an EAGLE-3 head reads, numbered as the engine's
        Transformer.add_feature_layers numbers them."""
        rows: dict[int, torch.Tensor] = {}
        hooks = [self.model.model.layers[i].register_forward_pre_hook(
            lambda _m, args, kw, i=i: rows.__setitem__(i, (args[0] if args else kw["hidden_states"])), with_kwargs=True)
            for i in layers]
        try:
            last = self.model.model(input_ids=x).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([rows[i] for i in layers], -1), last


def head_loss(head: EagleTrainHead, base: _Base, x: torch.Tensor, m: torch.Tensor, feats: torch.Tensor,
              noise: float, p_w: float, device) -> tuple[torch.Tensor, dict]:
    """EAGLE loss on one batch. x [B, L], m [B, L] valid mask, feats [B, L, H] (base features)."""
    f_in = feats[:, :-1].float()
    if noise > 0:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * noise * f_in.std()
    target = feats[:, 1:]
    pair = m[:, 1:]                                   # pair t valid when token t+1 exists
    with autocast(device):
        with torch.no_grad():
            emb = base.embed(x[:, 1:])
        pred = head(emb, f_in)
        pred_v, tgt_v = pred[pair].float(), target[pair].float()
        vloss = F.smooth_l1_loss(pred_v, tgt_v, reduction="none").mean(-1).mean()
        with torch.no_grad():
            tlogp = F.log_softmax(base.lm(tgt_v.to(pred.dtype)).float(), -1)
        plogp = F.log_softmax(base.lm(pred[pair]).float(), -1)
        ploss = -(tlogp.exp() * plogp).sum(-1).mean()
        acc = (plogp.argmax(-1) == tlogp.argmax(-1)).float().mean()
    return vloss + p_w * ploss, {"vloss": vloss.item(), "ploss": ploss.item(), "acc": acc.item()}


@torch.no_grad()
def head_accuracy(head: EagleTrainHead, base: _Base, data: TokenData, idx: list[int], device, max_len: int,
                  batch_tokens: int, depths: int = 3, trainer: Optional["Eagle2Trainer"] = None) -> Optional[list[float]]:
    """Top-1 accuracy vs the base's argmax at depths 1..depths on held-out samples (all positions).
    Depth k feeds the head's own depth-(k-1) outputs back as features (tokens stay true)."""
    if not idx:
        return None
    trainer = trainer or Eagle2Trainer(None)
    hits, tots = [0] * depths, [0] * depths
    head.eval()
    for x, lens, _ in batches(data, idx, batch_tokens, max_len, seed=0, loop=False):
        x = x.to(device)
        m = valid_mask(lens, x.shape[1], device)
        with autocast(device):
            h, t = trainer.depth_hits(head, base, x, m, depths)
        hits = [a + b for a, b in zip(hits, h)]
        tots = [a + b for a, b in zip(tots, t)]
    head.train()
    return [round(h / max(t, 1), 4) for h, t in zip(hits, tots)]


class Eagle2Trainer:
    """The EAGLE-1/2 head type for the training loop: head, loss, held-out hits, writer."""

    head_type = "eagle2"

    def __init__(self, a: Optional[argparse.Namespace]) -> None:
        self.a = a

    def make(self, base: _Base, cfg: dict, device: torch.device) -> EagleTrainHead:
        return EagleTrainHead(cfg, bias=not self.a.no_bias).to(device)

    def init(self, head: EagleTrainHead, folder: str | Path) -> None:
        init_head(head, folder)

    def loss(self, head: EagleTrainHead, base: _Base, x: torch.Tensor, m: torch.Tensor, device) -> tuple[torch.Tensor, dict]:
        with autocast(device):
            feats = base.features(x)
        return head_loss(head, base, x, m, feats, self.a.noise, self.a.p_w, device)

    @torch.no_grad()
    def depth_hits(self, head: EagleTrainHead, base: _Base, x: torch.Tensor, m: torch.Tensor,
                   depths: int) -> tuple[list[int], list[int]]:
        feats = base.features(x)
        emb = base.embed(x[:, 1:])
        want = base.lm(feats[:, 1:]).argmax(-1)
        f_in = feats[:, :-1]
        pair = m[:, 1:]
        hits, tots = [], []
        for d in range(depths):
            pred = head(emb, f_in)
            got = base.lm(pred).argmax(-1)
            ok = pair.clone()
            ok[:, :d] = False                      # depth d needs d earlier predictions
            hits.append(int(((got == want) & ok).sum()))
            tots.append(int(ok.sum()))
            f_in = torch.cat((feats[:, :1], pred[:, :-1].to(feats.dtype)), 1)
        return hits, tots

    def save(self, head: EagleTrainHead, folder: str | Path, base_cfg: dict, extra: dict) -> Path:
        return save_head(head, folder, base_cfg, extra)

    def report_fields(self) -> dict:
        """This head type's own options, for the training report (EAGLE-1/2: none beyond the loop's)."""
        return {}

    @staticmethod
    def stats_line(st: dict) -> str:
        return f"v {st['vloss']:.4f} p {st['ploss']:.3f} acc {st['acc']:.3f}"


def trainer_for(a: argparse.Namespace):
    """The head type's trainer (--head-type), from its registry entry."""
    trainer = get_head_type(a.head_type).trainer_class()
    if trainer is None:
        raise SystemExit(f"head type {a.head_type!r} has no trainer; trainable: {', '.join(trainable_head_types())}")
    return trainer(a)


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hierviz train eagle", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--intermediate", default=None, help="M's checkpoint folder (for E_M)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out-t", default=None, help="write E_T here")
    ap.add_argument("--out-m", default=None, help="write E_M here")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--time-budget", type=float, default=0)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--p-w", type=float, default=0.1, help="weight of the token cross-entropy")
    ap.add_argument("--noise", type=float, default=0.2, help="uniform feature noise width (x feature std)")
    ap.add_argument("--no-bias", action="store_true")
    choices = trainable_head_types()
    ap.add_argument("--head-type", choices=choices, default=choices[0],
                    help="; ".join(f"{n}: {HEAD_TYPES[n].description}" for n in choices))
    ap.add_argument("--ttt-steps", type=int, default=7, help="eagle3: drafting steps unrolled in training")
    ap.add_argument("--draft-vocab", default=None,
                    help="eagle3: JSON list of token ids, most frequent first (train data's FR-Spec file); "
                         "none = the whole vocabulary")
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="eagle3: keep the first N of --draft-vocab")
    ap.add_argument("--draft-vocab-size-m", type=int, default=None, help="eagle3: E_M's own N (default: --draft-vocab-size)")
    ap.add_argument("--head-intermediate-size", type=int, default=None,
                    help="eagle3: the head's MLP width (default: the base's)")
    ap.add_argument("--init-t", default=None, help="start E_T from this head folder (SafeAILab layout) instead of random")
    ap.add_argument("--init-m", default=None, help="start E_M from this head folder (e.g. the shipped E_M, for a new M)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None)
    a = ap.parse_args(argv)
    if not (a.out_t or a.out_m):
        ap.error("give --out-t and/or --out-m")
    if a.out_m and not a.intermediate:
        ap.error("--out-m needs --intermediate")
    if a.ttt_steps < 1:
        ap.error("--ttt-steps must be at least 1")
    for n in (a.draft_vocab_size, a.draft_vocab_size_m):
        if n is not None and n < 2:
            ap.error("a draft vocabulary needs at least 2 tokens")
    return a


def _load_bases(a: argparse.Namespace, device: torch.device) -> dict[str, tuple[_Base, dict]]:
    """The frozen base of each head to train ("e_t": T, "e_m": M with T's embeddings), with its config."""
    dtype = base_dtype(device)
    t_cfg, t_w = load_base(a.target)
    bases: dict[str, tuple[_Base, dict]] = {}
    if a.out_t:
        bases["e_t"] = (_Base("target", build_hf(t_cfg, t_w, device, dtype).eval()), t_cfg)
    if a.out_m:
        m_cfg, m_w = load_base(a.intermediate)
        bases["e_m"] = (_Base("intermediate", build_hf(m_cfg, with_shared_embeddings(m_w, t_w), device, dtype).eval()),
                        m_cfg)
    for b, _ in bases.values():
        for p in b.model.parameters():
            p.requires_grad_(False)
    return bases


def _make_heads(bases: dict[str, tuple[_Base, dict]], a: argparse.Namespace, device: torch.device,
                trainer) -> tuple[dict[str, torch.nn.Module], dict[str, torch.optim.Optimizer]]:
    heads, opts = {}, {}
    for k, (base, cfg) in bases.items():
        heads[k] = trainer.make(base, cfg, device)
        init = a.init_t if k == "e_t" else a.init_m
        if init:
            trainer.init(heads[k], init)
        opts[k] = torch.optim.AdamW(heads[k].parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                    fused=device.type == "cuda")
    return heads, opts


def _train(heads: dict[str, torch.nn.Module], opts: dict, bases: dict[str, tuple[_Base, dict]], data: TokenData,
           a: argparse.Namespace, device: torch.device, trainer) -> tuple[Progress, dict[str, list], dict[str, dict]]:
    """Train every head on the same batches until the step count or time budget runs out; returns
    the progress, the logged loss figures per head and each head's last ones."""
    prog = Progress(a.steps, a.time_budget)
    it = batches(data, data.indices("train"), a.batch_tokens, a.max_len, a.seed)
    logs: dict[str, list] = {k: [] for k in heads}
    last: dict[str, dict] = {}
    while not prog.done:
        x, lens, _ = next(it)
        x = x.to(device, non_blocking=True)
        m = valid_mask(lens, x.shape[1], device)
        scale = prog.lr_scale()
        for k, head in heads.items():
            loss, st = trainer.loss(head, bases[k][0], x, m, device)
            for g in opts[k].param_groups:
                g["lr"] = a.lr * scale
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            opts[k].step()
            last[k] = st
        prog.step += 1
        if prog.step % 50 == 0 or prog.step == 1 or prog.done:
            for k in heads:
                logs[k].append({"step": prog.step, **{n: round(v, 4) for n, v in last[k].items()}})
            log(f"{trainer.head_type} step {prog.step} " + " | ".join(
                f"{k}: {trainer.stats_line(last[k])}" for k in heads) + f" ({time.time() - prog.t0:.0f}s)")
    return prog, logs, last


def _evaluate_and_save(heads: dict[str, torch.nn.Module], bases: dict[str, tuple[_Base, dict]], data: TokenData,
                       a: argparse.Namespace, device: torch.device, prog: Progress, logs: dict[str, list],
                       last: dict[str, dict], trainer) -> dict[str, dict]:
    """Held-out accuracy of each head, written into its saved folder; the report entry per head."""
    out_heads = {}
    for k, head in heads.items():
        base = bases[k][0]
        acc = {mode: head_accuracy(head, base, data, data.indices("heldout", mode), device, a.max_len, a.batch_tokens,
                                   trainer=trainer)
               for mode in ("greedy", "sampled")}
        out = a.out_t if k == "e_t" else a.out_m
        info = {"base": base.name, "steps": prog.step, "final": {n: round(v, 4) for n, v in last.get(k, {}).items()},
                "heldout_top1_by_depth": acc, "log": logs[k]}
        trainer.save(head, out, bases[k][1], {"base": base.name, "steps": prog.step,
                                              "heldout_top1_by_depth": acc})
        out_heads[k] = info
        log(f"{k} -> {out}: held-out top-1 by depth {acc}")
    return out_heads


def main(argv: Optional[list[str]] = None) -> int:
    a = _parse_args(argv)
    t0 = time.time()
    seed_all(a.seed)
    device = pick_device(a.device)
    data = TokenData.load(a.data)
    bases = _load_bases(a, device)
    trainer = trainer_for(a)
    heads, opts = _make_heads(bases, a, device, trainer)
    log(f"training {trainer.head_type} heads {list(heads)} on {device} ({time.time() - t0:.1f}s)")
    prog, logs, last = _train(heads, opts, bases, data, a, device, trainer)
    report = {"command": recorded_command("train eagle", argv), "target": str(a.target),
              "intermediate": a.intermediate, "data": str(a.data), "steps": prog.step,
              "seconds_training": round(time.time() - prog.t0, 1), "lr": a.lr, "batch_tokens": a.batch_tokens,
              "p_w": a.p_w, "noise": a.noise, "init_t": a.init_t, "init_m": a.init_m, "head_type": a.head_type,
              "heads": {}, "env": env_info(device)}
    report.update(trainer.report_fields())
    report["heads"] = _evaluate_and_save(heads, bases, data, a, device, prog, logs, last, trainer)
    report["seconds_total"] = round(time.time() - t0, 1)
    write_json(a.report, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
