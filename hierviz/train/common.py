"""Shared pieces of the training commands: loading base models as trainable transformers
modules, the token dataset, batching, the LR schedule and small reporting helpers.

Training uses transformers' LlamaForCausalLM (plain, separate q/k/v and gate/up parameters)
rather than the engine's frozen, fused Transformer; checkpoints are written under HF /
SafeAILab names and tests check that the engine's loaders reproduce the training modules.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from hierviz.config import options
from hierviz.machine import gpu_name
from hierviz.quant.w4 import W4Weight, dequantize_unpermuted

LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias",
              "hidden_act", "rope_scaling")


def log(*args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def pick_device(name: Optional[str]) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---- base models ----------------------------------------------------------------------------

def float_weights(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize W4Weights (in the checkpoint's channel order); float tensors pass through."""
    out = {}
    for k, w in weights.items():
        out[k] = dequantize_unpermuted(w) if isinstance(w, W4Weight) else w.float()
    return out


def load_base(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF-style config dict, float weights) for a .gguf file, an HF folder or a GPTQ folder.

    A GPTQ folder written with share_embeddings (no embedding inside) comes back without
    `model.embed_tokens.weight`; the caller supplies the target's (see with_shared_embeddings)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from hierviz.quant.gguf import read_gguf
        cfg, weights, _ = read_gguf(p)
        return dict(cfg), float_weights(weights)
    from hierviz.models.loading import is_gptq
    from hierviz.quant.gptq import load_state_dict_folder
    raw = json.loads((p / "config.json").read_text())
    if is_gptq(raw, p):
        from hierviz.quant.gptq import load_gptq_weights
        cfg, weights = load_gptq_weights(p)
        return cfg, float_weights(weights)
    return raw, float_weights(load_state_dict_folder(p))


def export_float(src: str | Path, folder: str | Path) -> Path:
    """Write a base model (e.g. the GGUF target, dequantized exactly) as an fp32 HF folder, so
    later training stages load it in a second instead of re-parsing the GGUF."""
    from safetensors.torch import save_file
    cfg, weights = load_base(src)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", "source": str(src)})
    (folder / "config.json").write_text(json.dumps(hf_config_dict(cfg, torch_dtype="float32"), indent=2))
    return folder


def with_shared_embeddings(weights: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w = dict(weights)
    w.setdefault("model.embed_tokens.weight", target["model.embed_tokens.weight"])
    if "lm_head.weight" in target:
        w.setdefault("lm_head.weight", target["lm_head.weight"])
    return w


def copy_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], what: str,
              skip: tuple[str, ...] = (), ignore_extra: bool = False) -> None:
    """Copy saved `weights` into `module` (to continue training it): every tensor but `skip` must be
    there with its shape, and (unless ignore_extra) nothing else, else SystemExit naming `what`."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in skip and k not in weights)
    bad = sorted(k for k in weights if k not in skip and (weights[k].shape != own[k].shape if k in own
                                                          else not ignore_extra))
    if missing or bad:
        raise SystemExit(f"{what}: missing {missing[:3]}, mismatched {bad[:3]}")
    with torch.no_grad():
        for k in own:
            if k not in skip:
                own[k].copy_(weights[k].to(own[k].dtype))


def _llama_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """The LLAMA_KEYS a config sets; rope_theta read from transformers 5's rope_parameters too."""
    kw = {k: cfg[k] for k in LLAMA_KEYS if k in cfg and cfg[k] is not None}
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in kw and "rope_theta" in rope:
        kw["rope_theta"] = rope["rope_theta"]
    return kw


def llama_config(cfg: dict[str, Any], **overrides: Any):
    from transformers import LlamaConfig
    kw = _llama_keys(cfg)
    kw.update(overrides)
    c = LlamaConfig(**kw)
    c._attn_implementation = "sdpa"
    return c


def build_hf(cfg: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device,
             dtype: torch.dtype = torch.float32, **overrides: Any):
    """LlamaForCausalLM holding exactly these weights (tied embeddings kept tied)."""
    from transformers import LlamaForCausalLM
    hf_cfg = llama_config(cfg, **overrides)
    model = LlamaForCausalLM(hf_cfg)
    state = {k: v for k, v in weights.items() if k in model.state_dict()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"weights lack {missing[:5]}")
    if hf_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=device, dtype=dtype)


def hf_config_dict(cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A clean config.json dict (Llama) derived from a base config."""
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    out.update(_llama_keys(cfg))
    out.update(overrides)
    return out


# ---- tokenizers -------------------------------------------------------------------------------

def load_tokenizer(spec: str, eos_ids: Optional[list[int]] = None):
    """'byte' = the engine's ByteTokenizer (tiny test models); otherwise a folder with tokenizer files."""
    from hierviz.tokenizer import ByteTokenizer, HFTokenizer
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_folder(spec, eos_ids)


# ---- the dataset --------------------------------------------------------------------------------

@dataclass
class TokenData:
    """Prompt + response token sequences. tokens is one flat int32 tensor; sample i is
    tokens[offsets[i]:offsets[i+1]], its first prompt_lens[i] tokens are the chat prompt."""
    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lens: torch.Tensor
    modes: list[str]          # "greedy" or "t0.7"/"t1.0" ...
    split: list[str]          # "train" or "heldout"
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.modes)

    def sample(self, i: int) -> torch.Tensor:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].long()

    def indices(self, split: str, mode: Optional[str] = None) -> list[int]:
        out = [i for i, s in enumerate(self.split) if s == split]
        if mode == "greedy":
            out = [i for i in out if self.modes[i] == "greedy"]
        elif mode == "sampled":
            out = [i for i in out if self.modes[i] != "greedy"]
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tokens": self.tokens.to(torch.int32), "offsets": self.offsets, "prompt_lens": self.prompt_lens,
                    "modes": self.modes, "split": self.split, "meta": json.dumps(self.meta, default=str)}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> "TokenData":
        d = torch.load(str(path), map_location="cpu", weights_only=True)
        return cls(d["tokens"], d["offsets"], d["prompt_lens"], list(d["modes"]), list(d["split"]), json.loads(d["meta"]))


def batches(data: TokenData, idx: list[int], batch_tokens: int, max_len: int, seed: int,
            pad_id: int = 0, loop: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded batches (tokens [B, L], lengths [B], prompt_lens [B]) of about batch_tokens
    tokens, samples of similar length together. Loops over shuffled epochs when loop."""
    rng = random.Random(seed)
    lens = {i: min(int(data.offsets[i + 1] - data.offsets[i]), max_len) for i in idx}
    while True:
        order = sorted(idx, key=lambda i: (lens[i], rng.random()))
        groups, cur, cur_max = [], [], 0
        for i in order:
            m = max(cur_max, lens[i])
            if cur and m * (len(cur) + 1) > batch_tokens:
                groups.append(cur)
                cur, m = [], lens[i]
            cur.append(i)
            cur_max = m
        if cur:
            groups.append(cur)
        if loop:
            rng.shuffle(groups)
        for g in groups:
            L = max(lens[i] for i in g)
            out = torch.full((len(g), L), pad_id, dtype=torch.long)
            for r, i in enumerate(g):
                s = data.sample(i)[:L]
                out[r, :len(s)] = s
            yield out, torch.tensor([lens[i] for i in g]), torch.tensor([int(data.prompt_lens[i]) for i in g])
        if not loop:
            return


def valid_mask(lengths: torch.Tensor, L: int, device) -> torch.Tensor:
    """[B, L] True where position < length."""
    return torch.arange(L, device=device)[None, :] < lengths.to(device)[:, None]


def response_pred_mask(lengths: torch.Tensor, prompt_lens: torch.Tensor, L: int, device) -> torch.Tensor:
    """[B, L] True at positions t whose next token t+1 is a response token (t in [p-1, n-2])."""
    pos = torch.arange(L, device=device)[None, :]
    return (pos >= prompt_lens.to(device)[:, None] - 1) & (pos < lengths.to(device)[:, None] - 1)


# ---- schedule ------------------------------------------------------------------------------------

class Progress:
    """Training progress = max(step / steps, elapsed / time_budget): the run ends at whichever
    limit comes first and the cosine LR schedule follows it."""

    def __init__(self, steps: int, time_budget: float, warmup: float = 0.03) -> None:
        self.steps = max(1, steps)
        self.budget = time_budget if time_budget and time_budget > 0 else math.inf
        self.warmup = warmup
        self.t0 = time.time()
        self.step = 0

    @property
    def frac(self) -> float:
        return min(1.0, max(self.step / self.steps, (time.time() - self.t0) / self.budget))

    @property
    def done(self) -> bool:
        return self.frac >= 1.0

    def lr_scale(self, floor: float = 0.1) -> float:
        f = self.frac
        if f < self.warmup:
            return max(f / self.warmup, 0.01)
        f = (f - self.warmup) / max(1e-9, 1 - self.warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * f))


def use_bf16(device: torch.device) -> bool:
    """bf16 frozen models + bf16 autocast on GPU; the train_bf16 option (HIERVIZ_TRAIN_BF16=1) forces
    it on the CPU too, for dry runs of the GPU's arithmetic."""
    return device.type == "cuda" or options().train_bf16


def base_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if use_bf16(device) else torch.float32


def autocast(device: torch.device, enabled: bool = True):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled and use_bf16(device))


def write_json(path: Optional[str | Path], obj: Any) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=False))


def env_info(device: torch.device) -> dict[str, Any]:
    import transformers
    info = {"torch": str(torch.__version__), "transformers": str(transformers.__version__), "device": str(device)}
    if gpu_name(device):
        info["gpu"] = gpu_name(device)
    info["host_cpus"] = os.cpu_count()
    return info
