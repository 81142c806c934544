"""Distil the intermediate model M from the target T, then GPTQ-quantize it to W4.

    python -m hierviz train distill --target T.gguf --data data.pt --out M_DIR \
        --layers 8 --steps 3000 --time-budget 150 --group-size 64

M is a shallower copy of T: --layers decoder layers taken from T at evenly spaced depths
(first and last included), with T's embedding, final norm and tied LM head, which stay frozen
(so the stack can share them: `"share_embeddings": true`, and M's checkpoint omits the
embedding). Training minimises KL(T || M) over T's full next-token distributions on T's own
text (bf16 autocast on GPU, AdamW, warm-up + cosine LR). Then GPTQ (hierviz.quant.quantize,
calibration = training samples, layer by layer, asymmetric, --group-size) quantizes every
decoder linear, and the result is written as an AutoGPTQ-layout checkpoint (v1 "gptq" format)
that hierviz.quant.gptq.load_gptq_weights reads. Held-out top-1 agreement with T is reported
(separately on greedy and on sampled text) before training, after training and after quantization.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from hierviz.config import recorded_command
from hierviz.train.common import (base_dtype, Progress, TokenData, autocast, batches, build_hf, copy_into,
                                  env_info, hf_config_dict, load_base, log, pick_device, response_pred_mask, seed_all,
                                  valid_mask, with_shared_embeddings, write_json)

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def pick_layers(n_teacher: int, n_student: int) -> list[int]:
    if n_student > n_teacher or n_student < 1:
        raise ValueError(f"cannot take {n_student} layers from {n_teacher}")
    if n_student == 1:
        return [n_teacher - 1]
    return [round(i * (n_teacher - 1) / (n_student - 1)) for i in range(n_student)]


def student_weights(t_weights: dict[str, torch.Tensor], layer_ids: list[int]) -> dict[str, torch.Tensor]:
    w = {k: v for k, v in t_weights.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layer_ids):
        pre = f"model.layers.{old}."
        for k, v in t_weights.items():
            if k.startswith(pre):
                w[f"model.layers.{new}." + k[len(pre):]] = v.clone()
    return w


@torch.no_grad()
def agreement(ref, other, data: TokenData, idx: list[int], device, max_len: int, batch_tokens: int) -> Optional[float]:
    """Top-1 agreement of `other` with `ref` (both LlamaForCausalLM) at positions predicting response tokens."""
    if not idx:
        return None
    hit = tot = 0
    for x, lens, plens in batches(data, idx, batch_tokens, max_len, seed=0, loop=False):
        x = x.to(device)
        m = response_pred_mask(lens, plens, x.shape[1], device)
        with autocast(device):
            a = ref.lm_head(ref.model(input_ids=x).last_hidden_state[m]).argmax(-1)
            b = other.lm_head(other.model(input_ids=x).last_hidden_state[m]).argmax(-1)
        hit += int((a == b).sum())
        tot += int(m.sum())
    return round(hit / max(tot, 1), 4)


def agreement_report(teacher, student, data, device, max_len, batch_tokens) -> dict:
    return {k: agreement(teacher, student, data, data.indices("heldout", k), device, max_len, batch_tokens)
            for k in ("greedy", "sampled")}


def train(teacher, student, data: TokenData, device, steps: int, time_budget: float, lr: float, batch_tokens: int,
          max_len: int, seed: int, log_every: int = 50, top1_weight: float = 0.0) -> dict:
    """Minimise KL(T || M) per token, plus top1_weight x the cross-entropy of M against T's argmax
    (greedy decoding only needs M's argmax to match T's; the KL spends capacity on the tail)."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    prog = Progress(steps, time_budget)
    it = batches(data, data.indices("train"), batch_tokens, max_len, seed)
    student.train()
    losses: list[float] = []
    window: list[torch.Tensor] = []
    tokens_seen = 0
    while not prog.done:
        x, lens, _ = next(it)
        x = x.to(device, non_blocking=True)
        m = valid_mask(lens, x.shape[1], device)
        for g in opt.param_groups:
            g["lr"] = lr * prog.lr_scale()
        with torch.no_grad(), autocast(device):
            lt = teacher.lm_head(teacher.model(input_ids=x).last_hidden_state[m]).float()
        with autocast(device):
            ls = student.lm_head(student.model(input_ids=x).last_hidden_state[m]).float()
        log_ps = F.log_softmax(ls, -1)
        loss = F.kl_div(log_ps, F.log_softmax(lt, -1), log_target=True, reduction="batchmean")
        if top1_weight:
            loss = loss + top1_weight * F.nll_loss(log_ps, lt.argmax(-1))
        del lt, ls, log_ps
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        prog.step += 1
        tokens_seen += int(m.sum())
        window.append(loss.detach())
        if prog.step % log_every == 0 or prog.step == 1 or prog.done:
            losses.append(round(float(torch.stack(window).mean()), 4))   # mean loss since the last log line
            window = []
            log(f"distill step {prog.step} loss {losses[-1]:.4f} lr {lr * prog.lr_scale():.2e} "
                f"tokens {tokens_seen} ({time.time() - prog.t0:.0f}s)")
    student.eval()
    return {"steps": prog.step, "final_loss": losses[-1] if losses else None, "loss_log": losses,
            "tokens_seen": tokens_seen, "seconds": round(time.time() - prog.t0, 1)}


# ---- GPTQ -------------------------------------------------------------------------------------------

@torch.no_grad()
def gptq_student(student, data: TokenData, idx: list[int], device, group_size: int, max_len: int,
                 batch_tokens: int, damp: float = 0.01) -> dict[str, dict[str, torch.Tensor]]:
    """Quantize every decoder linear of `student` in place (weights replaced by their W4 values),
    layer after layer with inputs from the already-quantized earlier layers. Returns the packed
    AutoGPTQ tensors per module name."""
    calib = [(x, lens) for x, lens, _ in batches(data, idx, batch_tokens, max_len, seed=1, loop=False)]
    packed: dict[str, dict[str, torch.Tensor]] = {}
    dtype = next(student.parameters()).dtype
    for li, layer in enumerate(student.model.layers):
        mods = {n: layer.get_submodule(n) for n in LINEARS}
        H = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float32, device=device) for n, m in mods.items()}
        count = {n: 0 for n in mods}
        state = {}

        def hook(name):
            def f(_mod, inp, _out):
                x = inp[0][state["mask"]].float()
                H[name] += 2.0 * (x.t() @ x)
                count[name] += x.shape[0]
            return f
        handles = [m.register_forward_hook(hook(n)) for n, m in mods.items()]
        try:
            for x, lens in calib:
                x = x.to(device)
                state["mask"] = valid_mask(lens, x.shape[1], device)
                student.model(input_ids=x)
        finally:
            for h in handles:
                h.remove()
        for n, m in mods.items():
            hess = H[n] / max(count[n], 1)
            res = _gptq(m.weight.detach().float(), hess, group_size, damp, device)
            m.weight.data = res.dequantize().to(device=device, dtype=dtype)
            packed[f"model.layers.{li}.{n}"] = {k: v.cpu() for k, v in res.pack("gptq").items()}
        log(f"gptq layer {li}: {len(mods)} linears quantized ({count[LINEARS[0]]} calibration tokens)")
    return packed


def _gptq(w: torch.Tensor, hess: torch.Tensor, group_size: int, damp: float, device):
    """gptq_quantize on the training device (its column loop is launch-bound on a GPU, but far
    faster than on a few CPU cores); tensors it creates follow the default device. Falls back
    to the CPU if that fails."""
    from hierviz.quant.quantize import GPTQResult, gptq_quantize
    kw = dict(group_size=group_size, sym=False, damp_percent=damp, min_zero=1)
    if device.type != "cpu":
        try:
            with torch.device(device):
                r = gptq_quantize(w.to(device), hess.to(device), **kw)
            return GPTQResult(r.intcodes.cpu(), r.zeros.cpu(), r.scales.cpu(), r.g_idx.cpu(), r.group_size)
        except Exception as e:  # noqa: BLE001 - any failure: the CPU path is the reference
            log(f"gptq on {device} failed ({type(e).__name__}: {e}); using the CPU")
    return gptq_quantize(w.cpu(), hess.cpu(), **kw)


def save_intermediate(folder: str | Path, t_cfg: dict, student, packed: dict, group_size: int,
                      layer_ids: list[int], extra: dict) -> Path:
    from hierviz.quant.gptq import save_gptq_checkpoint
    floats = {k: v.detach().to(torch.float16).cpu() for k, v in student.state_dict().items()
              if k.endswith("norm.weight")}
    cfg = hf_config_dict(t_cfg, num_hidden_layers=len(layer_ids), torch_dtype="float16", tie_word_embeddings=True)
    cfg["hierviz"] = {"share_embeddings": True,
                      "note": "model.embed_tokens.weight / lm_head are not stored: they are the target's "
                              "(load with \"share_embeddings\": true in the stack)",
                      "init_layers_from_target": layer_ids, **extra}
    qc = {"bits": 4, "group_size": group_size, "sym": False, "desc_act": False, "checkpoint_format": "gptq",
          "true_sequential": True, "damp_percent": 0.01, "quantizer": "hierviz.quant.quantize.gptq_quantize"}
    return save_gptq_checkpoint(folder, cfg, floats, packed, qc)


def init_student(student, path: str | Path, layers: int) -> None:
    """Copy an earlier student's weights into `student`: a --save-float safetensors file, or a checkpoint
    folder (GPTQ codes dequantized). The embedding and final norm stay T's (frozen, and not stored in a
    shared-embedding M)."""
    p = Path(path)
    if p.is_dir():
        _, init = load_base(p)
    elif p.is_file():
        from safetensors.torch import load_file
        init = load_file(str(p))
    else:
        raise SystemExit(f"--init {path}: no such file or folder")
    copy_into(student, init, f"--init {path} does not fit a {layers}-layer student",
              skip=("lm_head.weight", "model.embed_tokens.weight"))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz train distill", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True, help="output folder (GPTQ checkpoint)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--time-budget", type=float, default=0, help="seconds of training at most")
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--top1-weight", type=float, default=0.0,
                    help="add this x cross-entropy against the target's argmax to the KL loss (greedy agreement)")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=256)
    ap.add_argument("--save-float", default=None, help="also save the unquantized student here (safetensors)")
    ap.add_argument("--init", default=None,
                    help="start from this student instead of T's layers: a --save-float file of an earlier run "
                         "(continues a distillation in a second device call) or an M checkpoint folder with the same "
                         "--layers (GPTQ or float; a shipped M, dequantized, goes on training on new data)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None)
    a = ap.parse_args(argv)
    if a.top1_weight < 0:
        ap.error("--top1-weight must be >= 0")
    t0 = time.time()
    seed_all(a.seed)
    device = pick_device(a.device)
    data = TokenData.load(a.data)
    t_cfg, t_w = load_base(a.target)
    n_t = int(t_cfg["num_hidden_layers"])
    layer_ids = pick_layers(n_t, a.layers)
    t_dtype = base_dtype(device)
    teacher = build_hf(t_cfg, t_w, device, t_dtype).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = build_hf(t_cfg, student_weights(t_w, layer_ids), device, torch.float32, num_hidden_layers=a.layers)
    if a.init:
        init_student(student, a.init, a.layers)
    student.model.embed_tokens.weight.requires_grad_(False)
    student.model.norm.weight.requires_grad_(False)
    log(f"teacher {n_t} layers, student layers {layer_ids} on {device} ({time.time() - t0:.1f}s)")
    ev = dict(device=device, max_len=a.max_len, batch_tokens=a.batch_tokens)
    student.eval()
    before = agreement_report(teacher, student, data, **ev)
    log(f"agreement before training: {before}")
    tr = train(teacher, student, data, device, a.steps, a.time_budget, a.lr, a.batch_tokens, a.max_len, a.seed,
               top1_weight=a.top1_weight)
    after = agreement_report(teacher, student, data, **ev)
    log(f"agreement after training: {after}")
    if a.save_float:
        from safetensors.torch import save_file
        Path(a.save_float).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in student.state_dict().items()
                   if k != "lm_head.weight"}, a.save_float)
    calib_idx = data.indices("train")[: a.calib_samples]
    tq = time.time()
    packed = gptq_student(student, data, calib_idx, device, a.group_size, a.max_len, a.batch_tokens)
    gptq_s = round(time.time() - tq, 1)
    report = {"command": recorded_command("train distill", argv), "target": str(a.target), "data": str(a.data),
              "data_meta": {k: data.meta.get(k) for k in ("samples", "response_tokens", "prompt_tokens")},
              "student_layers_from_target": layer_ids, "init": a.init, "lr": a.lr, "batch_tokens": a.batch_tokens,
              "loss": "KL(T||M)" + (f" + {a.top1_weight:g} x CE(M, argmax T)" if a.top1_weight else ""),
              "training": tr, "agreement_heldout_before": before, "agreement_heldout_after": after,
              "gptq": {"group_size": a.group_size, "sym": False, "calib_samples": len(calib_idx), "seconds": gptq_s},
              "env": env_info(device)}
    save_intermediate(a.out, t_cfg, student, packed, a.group_size, layer_ids,
                      {"distill_steps": tr["steps"], "final_loss": tr["final_loss"]})
    # reload through the project's GPTQ loader: the figures below are for the shipped checkpoint
    m_cfg, m_w = load_base(a.out)
    reloaded = build_hf(m_cfg, with_shared_embeddings(m_w, t_w), device, t_dtype).eval()
    report["agreement_heldout_quantized"] = agreement_report(teacher, reloaded, data, **ev)
    log(f"agreement after GPTQ (reloaded checkpoint): {report['agreement_heldout_quantized']}")
    report["seconds_total"] = round(time.time() - t0, 1)
    write_json(a.report or str(Path(a.out) / "train_report.json"), report)
    log(f"wrote {a.out} ({report['seconds_total']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
