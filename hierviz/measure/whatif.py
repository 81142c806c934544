"""`python -m hierviz whatif`: real-scale projection with replayed acceptance.

Latency does not depend on weight values, acceptance does not depend on the GPU. So this
builds synthetic-weight models of real shapes (target W4A16, intermediate dense or W4A16, EAGLE-2
or EAGLE-3 draft heads of matching shape: --head), runs the REAL decoders of
hierviz.decoding.decoders — the same forwards, kernels, CUDA graphs, cache compaction and
rollback — and forces only the accept/reject decisions through an AcceptOracle
(hierviz.decoding.verify): replayed from a recorded trace or drawn from per-depth acceptance
rates (seeded). Every figure it writes is labelled "projected with replayed acceptance".

    python -m hierviz whatif --target llama3-70b --intermediate llama3-8b \
        --acceptance assets/traces/h200-smollm2-python-tips.json --out runs/whatif
    python -m hierviz whatif --tiny --acceptance-rates 0.9,0.8,0.7 --out /tmp/w   # CPU, seconds
    python -m hierviz whatif --tiny --sweep --out /tmp/w                          # sensitivity
    python -m hierviz whatif --tiny --head eagle3 --draft-vocab 300 --out /tmp/w  # EAGLE-3 heads only

Without --head the run builds both head types: AR, EAGLE-2, EAGLE-3 (its trees accepted by the
EAGLE-3 paper's record, --eagle3-acceptance), HierSpec and HierSpec with an EAGLE-3 E_M (a variant
row, hierviz.methods.VARIANTS). Each row times only its own heads' feature rows (rows_features).
"""
from __future__ import annotations

import argparse
import dataclasses
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from hierviz import methods as registry
from hierviz.methods import BASELINE, PEER, SUBJECT
from hierviz.decoding.decoders import Models, StageTimer, cache_margin
from hierviz.decoding.verify import AcceptOracle, Sampler
from hierviz.machine import formats_in_words, machine_info
from hierviz.measure.common import (MeasureError, add_device_args, environment, int_list, load_shape, run_reporting_errors,
                                    stamp, stopwatch)
from hierviz.measure import whatif_report
from hierviz.measure.whatif_report import LABEL
from hierviz.measure.whatif_acceptance import (DEFAULT_RATES, DEFAULT_SEQ_RATE, EAGLE3_RECORD, OracleMaker,
                                               accepted_lengths, apply_imported_acceptance, eagle3_record,
                                               load_acceptance_trace, oracle_factory, row_acceptance, tree_heads)
from hierviz.models import cuda_graphs
from hierviz.models.config import ModelConfig, ModelConfigError
from hierviz.models.drafter import HEAD_SLOTS, get_head_type, head_label
from hierviz.models.eagle import EagleHead
from hierviz.models.eagle3 import Eagle3Head, default_feature_layers
from hierviz.models.llama import Transformer
from hierviz.models.synthetic import random_codes, synthetic_eagle3_head, synthetic_head, synthetic_model, w4_group
from hierviz.quant import w4_choice, w4_verdicts
from hierviz.quant.formats import (DEFAULT_FORMAT, DENSE, by_width, canonical_name, check_runs_on, get_format)
from hierviz.settings import TREE_PRESETS, DecodeSettings, SettingsError, add_draft_args, apply_draft_args
from hierviz.trace import Step

SCHEMA = "hierviz.whatif/1"
SHARPEN = 12.0            # see SharpDraft
CPU_LIMIT_BYTES = 4e9


# ---- synthetic models -------------------------------------------------------------------------

def tiny_config(big: bool) -> ModelConfig:
    """CPU-sized stand-ins keeping the structure (GQA, untied head, shared vocabulary)."""
    h, layers = (128, 4) if big else (64, 2)
    return ModelConfig(vocab_size=512, hidden_size=h, intermediate_size=2 * h, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=h // 4, rope_theta=500000.0, max_position=4096)


class SharpDraft:
    """Mixin for a draft head class. A head with random weights drafts from near-uniform
    distributions, so EAGLE-2's rerank keeps only shallow trees and a replayed path of depth 4
    would not exist. Trained heads are confident; this scales the draft logits by SHARPEN /
    (their standard deviation, measured once on the first call) so the best branch dominates and
    trees reach their full depth. Same matmuls, one extra elementwise op. (Standardising every row
    instead cost four more kernels over the vocabulary per depth, a what-if-only cost that fell on
    HierSpec's ~2.3 trees per round more than on EAGLE-2's one; log_softmax ignores the mean anyway.)"""

    _scale: Optional[float] = None
    draft_logits: Callable[[torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]   # the head class's

    def draft_logprobs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        logits, ids = self.draft_logits(hidden)   # full or reduced draft vocabulary (--draft-vocab)
        if self._scale is None:   # one host read, at the warm-up's first draft
            self._scale = SHARPEN / max(float(logits.std(-1).mean()), 1e-6)
        return torch.log_softmax(logits * self._scale, -1), ids


class SharpHead(SharpDraft, EagleHead):
    """A sharpened EAGLE-1/2 head (SharpDraft)."""


class SharpEagle3Head(SharpDraft, Eagle3Head):
    """A sharpened EAGLE-3 head (SharpDraft)."""


def target_formats() -> list[str]:
    """The weight formats a synthetic target can be built in (hierviz.quant.formats), widest first."""
    return [f.name for f in by_width()]


def model_bytes(cfg: ModelConfig, fmt: str) -> float:
    """Weights in a format (codes plus scales, per linear weight, at group 128) and an fp16
    embedding and LM head."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * h * cfg.num_heads * cfg.head_dim + 2 * h * kv + 3 * h * i
    return per_layer * cfg.num_layers * get_format(fmt).bytes_per_weight(128) + 2 * 2.0 * cfg.vocab_size * h


def eagle3_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default low, middle and high layers; on a base too shallow for them to be distinct
    layers (under 7: the tiny shapes), its first, middle and last layer, each once."""
    layers = default_feature_layers(num_layers)
    if len(set(layers)) == len(layers) and all(0 <= i < num_layers for i in layers):
        return layers
    return tuple(sorted({0, num_layers // 2, num_layers - 1}))


def head_draft_vocab(head_type: str, vocab_size: int, asked: Optional[int] = None) -> Optional[int]:
    """The draft vocabulary a what-if head of this type drafts over: --draft-vocab if given, else
    the one its published checkpoints keep (HeadType.published_draft_vocab) where the base's
    vocabulary is larger, else the full vocabulary (None)."""
    if asked is not None:
        return asked
    published = get_head_type(head_type).published_draft_vocab
    return published if published is not None and published < vocab_size else None


def check_draft_vocab(draft_vocab: Optional[int], vocab_size: int) -> None:
    """MeasureError unless --draft-vocab (if given) is 1..vocab_size ids."""
    if draft_vocab is not None and not 1 <= draft_vocab <= vocab_size:
        raise MeasureError(f"--draft-vocab must be between 1 and the vocabulary size {vocab_size}")


def draft_vocabs(head_types: list[str], vocab_size: int, asked: Optional[int] = None) -> dict[str, int]:
    """Each head type's draft vocabulary size in a what-if (for its record)."""
    return {t: head_draft_vocab(t, vocab_size, asked) or vocab_size for t in head_types}


def sharp_eagle3_head(base: Transformer, seed: int, draft_vocab: Optional[int] = None, fmt: str = DENSE.name,
                      kernel: str = "reference") -> SharpEagle3Head:
    """A synthetic EAGLE-3 head on `base`, sharpened, with `base` handing out its feature rows;
    drafting over `draft_vocab` tokens, by default its published heads' count (head_draft_vocab);
    its linears in weight format `fmt` (--head-format), W4 ones run by `kernel`."""
    head = synthetic_eagle3_head(base, seed, head_draft_vocab("eagle3", base.cfg.vocab_size, draft_vocab),
                                 eagle3_feature_layers(base.cfg.num_layers), SharpEagle3Head, fmt, kernel)
    base.add_feature_layers(head.feature_layers)
    return head


def build_models(t_cfg: ModelConfig, m_cfg: ModelConfig, device: str, dtype: torch.dtype, kernel: str,
                 seed: int = 0, m_format: str = DENSE.name, head: Optional[str] = None,
                 draft_vocab: Optional[int] = None, t_format: str = DEFAULT_FORMAT,
                 rows: Optional[dict[str, Iterable[int]]] = None, m_lm_head: str = DENSE.name,
                 intermediate_draft_vocab: bool = False, head_format: str = DENSE.name) -> Models:
    """Synthetic T (`t_format`: a weight format, W4A16 as in the paper by default), M (`m_format`:
    dense as in the paper's stack by default) and heads of
    type `head` (E_M on M and E_T on T: e_t for eagle2, e_t3 for eagle3; None: both E_T types and
    an EAGLE-2 E_M, see variant_models for the EAGLE-3 E_M) drafting over `draft_vocab` token ids
    (None: the full vocabulary). `rows` ("target" / "intermediate" -> row counts: workload_rows)
    decides each W4 weight's kernel under HIERVIZ_W4_CUDA=auto; None: every row count. `m_lm_head`: M's
    LM head's format (T keeps a dense one: it verifies); `intermediate_draft_vocab`: M predicts over
    the `draft_vocab` ids too (a stack's key of that name); `head_format`: every head's linears (its
    fc and decoder layer, an EAGLE-3 head's own LM head too) in that format: heads only draft."""
    if t_cfg.vocab_size != m_cfg.vocab_size:
        raise MeasureError(f"target and intermediate vocabularies differ ({t_cfg.vocab_size} vs {m_cfg.vocab_size}): "
                          "HierSpec needs a shared tokenizer")
    if head is not None and head not in registry.tree_methods():
        raise MeasureError(f"unknown head type {head!r}; choose one of {', '.join(registry.tree_methods())}")
    check_draft_vocab(draft_vocab, t_cfg.vocab_size)
    if intermediate_draft_vocab and draft_vocab is None:
        raise MeasureError("--intermediate-draft-vocab restricts M to the --draft-vocab ids: give --draft-vocab too")
    if m_lm_head != DENSE.name and (m_cfg.tie_embeddings or draft_vocab and head != "eagle3" and not random_codes(m_lm_head)):
        raise MeasureError(f"M's LM head in {m_lm_head} needs an untied LM head, and E_M's --draft-vocab rows "
                           "of it a dense or W4 one")
    target = synthetic_model(t_cfg, t_format, dtype, device, kernel, seed)
    target.set_batch_invariant(True)    # as a loaded stack's target: what the product runs
    inter = synthetic_model(m_cfg, m_format, dtype, device, kernel, seed + 1, lm_head_format=m_lm_head)
    if intermediate_draft_vocab:    # M only drafts: T's verification keeps the output exact (stack.py)
        inter.restrict_output_vocab(torch.arange(draft_vocab, device=inter.device))
    # each row count as the dynamic path runs it and as the static runners pad it (cuda_graphs' bucket)
    workload = None if rows is None else {model: set(rows[role]) | {b for r in rows[role] if (b := cuda_graphs.bucket_for(r))}
                                          for role, model in (("target", target), ("intermediate", inter)) if role in rows}
    hw = (head_format, kernel)
    if head == "eagle3":   # d2t/t2d: a random subset of the vocabulary, as trained heads keep their frequent tokens
        models = Models(target, inter, e_m=sharp_eagle3_head(inter, seed + 2, draft_vocab, *hw),
                        e_t3=sharp_eagle3_head(target, seed + 3, draft_vocab, *hw))
    else:                  # without a head type, both head types on T: EAGLE-2 and EAGLE-3 side by side
        e_m, e_t = sharp_eagle2_head(inter, seed + 2, draft_vocab, *hw), sharp_eagle2_head(target, seed + 3, draft_vocab, *hw)
        models = Models(target, inter, e_m, e_t,
                        e_t3=sharp_eagle3_head(target, seed + 4, draft_vocab, *hw) if head is None else None)
    # each W4 weight's kernel, before any product: the heads' too (FR-Spec rows of M's W4 head)
    w4_choice.choose_for_models(models.present(), device, workload=workload)
    return models


def sharp_eagle2_head(base: Transformer, seed: int, draft_vocab: Optional[int] = None, fmt: str = DENSE.name,
                      kernel: str = "reference") -> SharpHead:
    """A synthetic EAGLE-1/2 head on `base`, sharpened; drafting over ids 0..draft_vocab-1 if given;
    its linears in weight format `fmt` (--head-format), W4 ones run by `kernel`."""
    head = synthetic_head(base, seed, SharpHead, fmt, kernel)
    draft_vocab = head_draft_vocab(PEER, base.cfg.vocab_size, draft_vocab)
    if draft_vocab is not None:
        # FR-Spec rows of the base's LM head; which ids does not change the timing (acceptance is
        # forced); real stacks use the most frequent tokens (stack.py "draft_vocab")
        head.set_draft_vocab(torch.arange(draft_vocab, device=base.device))
    return head


def variant_models(models: Models, row: str, seed: int, draft_vocab: Optional[int] = None, head_format: str = DENSE.name,
                   kernel: str = "reference") -> Models:
    """The stack a variant row runs on: `models`' T, M and heads, with the variant's head types in
    the slots it names (hierviz.methods.Variant.heads), built on the same base models (their
    linears in `head_format`, as build_models' heads)."""
    named = dict(models.heads)
    for n, (slot, kind) in enumerate(registry.VARIANTS[row].heads):
        base = models.target if HEAD_SLOTS[slot][0] == "target" else models.intermediate
        make = sharp_eagle3_head if kind == "eagle3" else sharp_eagle2_head
        named[slot] = make(base, seed + 10 + n, draft_vocab, head_format, kernel)
    return Models(models.target, models.intermediate, **named)


@contextmanager
def rows_features(models: Models, row: str) -> Iterator[None]:
    """Run a row with each base handing out only the feature rows that the row's own heads read
    (none for AR and EAGLE-2), so that no row pays for another head type's features. The bases'
    static runners are pooled per feature set, since a captured forward's output width is fixed."""
    heads = [models.part(p) for p in registry.get(registry.row_method(row)).needs if p in HEAD_SLOTS]
    saved = []
    for base in (models.target, models.intermediate):
        want = tuple(sorted({i for h in heads if h is not None and h.base is base
                             for i in getattr(h, "feature_layers", ())}))
        pools = base.__dict__.setdefault("runner_pools", {})
        pools.setdefault(base.feature_layers, base.static_runners)
        saved.append((base, base.feature_layers, base.static_runners))
        base.feature_layers, base.static_runners = want, pools.setdefault(want, [])
    try:
        yield
    finally:
        for base, layers, runners in saved:
            base.feature_layers, base.static_runners = layers, runners


def row_parts(models: Models, row: str) -> list:
    """The models a row runs: T, M and the heads its method drafts with."""
    heads = [models.part(p) for p in registry.get(registry.row_method(row)).needs if p in HEAD_SLOTS]
    return [m for m in (models.target, models.intermediate, *heads) if m is not None]

# ---- running one method -----------------------------------------------------------------------

def run_one(models: Models, method: str, s: DecodeSettings, oracle: Optional[AcceptOracle],
            prompt: list[int], max_len: Optional[int] = None) -> dict[str, Any]:
    """Decode until max_new_tokens tokens exist; time the decode rounds (prefill excluded).
    `method`: a registered method or a variant row (run with its method's decoder on `models`).
    max_len: the KV cache length (default: what these settings need); a warm-up passes the
    timed run's, so both lease the same pooled runners and graphs."""
    max_len = max_len or len(prompt) + s.max_new_tokens + cache_margin(s)
    gen = registry.get(registry.row_method(method)).decode(models, prompt, s, Sampler(0.0), str, max_len, oracle=oracle)
    steps: list[Step] = []
    made = 0
    with torch.no_grad():
        steps.append(next(gen))        # prefill round
        made += len(steps[0].new_tokens)
        with stopwatch(models.target.device) as took:
            while made < s.max_new_tokens:
                st = next(gen)
                made += len(st.new_tokens)
                steps.append(st)
    wall = took()
    gen.close()
    decode = steps[1:]
    tokens = sum(len(x.new_tokens) for x in decode)
    stages: dict[str, float] = {}
    forwards: dict[str, int] = {}
    for x in decode:
        for k, v in x.timings_ms.items():
            stages[k] = stages.get(k, 0.0) + v
        for k, v in x.forwards.items():
            forwards[k] = forwards.get(k, 0) + v
    return {"tokens": tokens, "rounds": len(decode), "decode_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "ms_per_token": 1000.0 * wall / max(1, tokens), "tokens_per_round": tokens / max(1, len(decode)),
            "prefill_ms": steps[0].step_ms, "stages_ms": stages,
            "stages_ms_per_token": {k: v / max(1, tokens) for k, v in stages.items()},
            "forwards": forwards, "accepted": accepted_lengths(steps)}


def run_repeated(models: Models, method: str, s: DecodeSettings, make: OracleMaker, prompt: list[int],
                 max_len: Optional[int], repeat: int) -> dict[str, Any]:
    """run_one `repeat` times, each with a fresh oracle from `make` (the same forced decisions),
    with only the row's own feature rows (rows_features);
    returns the run with the median decode time, all runs' times in decode_s_runs. One run is
    at the mercy of host jitter (HierSpec's host work varied ~8% between identical runs before its
    trees became CUDA graphs); the median of a few is not."""
    with rows_features(models, method):
        runs = [run_one(models, method, s, make(method), prompt, max_len) for _ in range(repeat)]
    ordered = sorted(runs, key=lambda r: r["decode_s"])
    best = dict(ordered[(len(ordered) - 1) // 2])
    best["decode_s_runs"] = [r["decode_s"] for r in runs]
    return best


# ---- the command ------------------------------------------------------------------------------

def _formats_help() -> str:
    return "; ".join(f"{f.name} ({f.description or f.label}" + (", the paper's)" if f.name == DEFAULT_FORMAT else ")")
                     for f in by_width())


def parser() -> argparse.ArgumentParser:
    d = DecodeSettings()
    ap = argparse.ArgumentParser(prog="python -m hierviz whatif", description=(
        "Real-scale projection: synthetic-weight models of real shapes, the real decoding loops and "
        f"kernels, forced acceptance. Every figure is {LABEL}."))
    ap.add_argument("--target", default="llama3-70b", help="shape: llama3-8b, llama3-70b, smollm2 or a config.json")
    ap.add_argument("--intermediate", default="llama3-8b", help="shape of the intermediate model M")
    ap.add_argument("--target-format", default=DEFAULT_FORMAT, type=canonical_name, choices=target_formats(),
                    help="T's weight format (an alias works too): " + _formats_help())
    ap.add_argument("--intermediate-format", default=DENSE.name, type=canonical_name, choices=target_formats(),
                    help=f"M's weights, the same choices ({DENSE.name}: the paper's stack)")
    ap.add_argument("--intermediate-lm-head", default=DENSE.name, type=canonical_name, choices=target_formats(),
                    help=f"M's LM head, which E_M drafts through ({DENSE.name}: as GPTQ keeps it); M only drafts")
    ap.add_argument("--head-format", default=DENSE.name, type=canonical_name, choices=target_formats(),
                    help=f"every draft head's linears: fc, its decoder layer, an EAGLE-3 head's LM head ({DENSE.name}: "
                         "as published); heads only draft")
    ap.add_argument("--intermediate-draft-vocab", action="store_true",
                    help="M predicts over the --draft-vocab ids too (FR-Spec rows of its LM head): M only drafts")
    ap.add_argument("--acceptance", default=None, help="trace / comparison JSON whose accepted lengths are replayed")
    ap.add_argument("--acceptance-rates", default=None,
                    help=f"per-depth tree acceptance rates, e.g. 0.9,0.8,0.7 (default {','.join(map(str, DEFAULT_RATES))})")
    ap.add_argument("--m-acceptance-rates", default=None, help="rates for E_M trees verified by M (default: same)")
    ap.add_argument("--acceptance-import", default=None, metavar="FILE",
                    help="your deployment's acceptance: a vLLM /metrics scrape, get_metrics() JSON or per-request "
                         "metrics, SGLang meta_info, Spec-Bench / EAGLE / SpecMQuant answer JSONL or a hierviz trace; "
                         "its per-position rates are replayed as --acceptance-rates (docs/acceptance.md)")
    ap.add_argument("--acceptance-format", default=None, help="the --acceptance-import file's format (default: detected)")
    ap.add_argument("--acceptance-model", default=None, help="the model to take from a scrape that holds several")
    ap.add_argument("--seq-rate", type=float, default=DEFAULT_SEQ_RATE,
                    help="rates mode: probability T accepts each token of M's sequence draft")
    ap.add_argument("--head", default=None, choices=registry.tree_methods(),
                    help="one head type for E_M and E_T: eagle2 (EAGLE-1/2) or eagle3 (EAGLE-3: fc over three layer "
                         "features, its own LM head over its draft vocabulary); the method of T's tree is named alike. "
                         "Default: both, EAGLE-2 and EAGLE-3 on T, and HierSpec with either E_M")
    ap.add_argument("--methods", default=None,
                    help="comma-separated rows: methods (ar, spec, hierspec, the heads' tree methods) and, without "
                         "--head, the variant " + ", ".join(registry.VARIANTS) + " (default without --head: "
                         + ",".join(_default_rows(None, False)) + "; replaying a trace: ar,eagle2,hierspec; "
                         "with --head H: ar,H,hierspec)")
    ap.add_argument("--eagle3-acceptance", default=None, metavar="FILE|none",
                    help="the acceptance record that trees drafted by an EAGLE-3 head draw from (any --acceptance-import "
                         f"format; default {EAGLE3_RECORD.name}, the EAGLE-3 paper's, unless another acceptance source is "
                         "given); none: they draw from the EAGLE-2 rates")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: the trace's length when replaying, else 128")
    ap.add_argument("--prompt-len", type=int, default=128, help="synthetic prompt length (tokens)")
    add_device_args(ap)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes instead of --target/--intermediate (CPU tests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="the heads draft over this many token ids (verifiers keep the full vocabulary; default: "
                         "full): FR-Spec rows of the LM head for eagle2, a d2t/t2d draft vocabulary for eagle3")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs per method (same forced decisions each time); the run with the median "
                         "time is reported, every run's time is kept (decode_s_runs)")
    ap.add_argument("--no-stage-sync", action="store_true",
                    help="no CUDA sync around stages: end-to-end times without sync overhead, stage times = dispatch")
    add_draft_args(ap, lambda field: f"default: the trace's settings when replaying, else {getattr(d, field)}")
    ap.add_argument("--exact", action="store_true",
                    help="no forced acceptance: check every method's output equals AR's, with the drafts as drawn "
                         "and seeded from AR's continuation (hierviz/measure/whatif_exact.py); exit code 1 on a difference")
    ap.add_argument("--exact-trees", default="eagle2,paper", help=f"--exact: tree presets ({', '.join(TREE_PRESETS)})")
    ap.add_argument("--exact-variants", default="drawn,partly-seeded,seeded",
                    help="--exact: which drafts to run: drawn (as the synthetic heads draw them), partly-seeded, seeded")
    ap.add_argument("--exact-miss-every", type=int, default=7,
                    help="--exact: the partly seeded drafts get every N-th position wrong (default 7)")
    ap.add_argument("--sweep", action="store_true",
                    help="sensitivity study: speedup vs acceptance scale, E_T tree size and min draft length")
    ap.add_argument("--sweep-scales", default="0.6,0.8,0.9,1.0,1.1")
    ap.add_argument("--sweep-tree-sizes", default="23,59")
    ap.add_argument("--sweep-min-draft", default="4,6,8")
    ap.add_argument("--out", required=True)
    return ap


def _settings(a: argparse.Namespace, base: dict[str, Any], max_new: int) -> DecodeSettings:
    s = DecodeSettings(**{k: v for k, v in base.items() if k in DecodeSettings.__dataclass_fields__})
    apply_draft_args(s, a)
    s.max_new_tokens, s.temperature, s.seed = max_new, 0.0, a.seed
    try:
        return s.validate()
    except SettingsError as e:
        raise MeasureError(str(e)) from None


def _shapes(a: argparse.Namespace, dev: str) -> tuple[dict[str, str], ModelConfig, ModelConfig]:
    if a.tiny:
        return {"target": "tiny-target", "intermediate": "tiny-intermediate"}, tiny_config(True), tiny_config(False)
    try:
        (t_name, t_cfg), (m_name, m_cfg) = load_shape(a.target), load_shape(a.intermediate)
    except (ModelConfigError, OSError) as e:
        raise MeasureError(f"cannot read a shape config: {e}") from None
    except ValueError as e:
        raise MeasureError(str(e)) from None
    try:
        check_runs_on(get_format(a.target_format), dev)      # refuses a format unproven on this GPU
    except ValueError as e:
        raise MeasureError(str(e)) from None
    need = model_bytes(t_cfg, a.target_format) + model_bytes(m_cfg, a.intermediate_format)
    if dev == "cpu" and need > CPU_LIMIT_BYTES:
        raise MeasureError(f"{t_name} + {m_name} need ~{need / 1e9:.0f} GB of weights: too big for a CPU run "
                          "(use --tiny, small config.json shapes, or --device cuda)")
    return {"target": t_name, "intermediate": m_name}, t_cfg, m_cfg


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _format_text(fmt: str, cfg: ModelConfig, kernel: str, dtype: torch.dtype) -> str:
    """A model's format as the outputs name it; its first word is the label the figures show
    (hierviz.quant.formats.format_of_description reads it back)."""
    f = get_format(fmt)
    if f.dense:
        return f"{f.name} {str(dtype).replace('torch.', '')}"
    if random_codes(f.name):
        return f"{f.label} synthetic codes, group {w4_group(cfg, 128)}, kernel {kernel}"
    return f"{f.label} synthetic (random weights through its quantizer)"


def _default_rows(head: Optional[str], replay: bool) -> list[str]:
    """The rows a run makes without --methods: AR, T's tree method(s) and HierSpec; without --head
    (and not replaying a trace, which holds EAGLE-2's and HierSpec's runs) every tree method and
    every variant row too."""
    if head is not None or replay:
        return [BASELINE, head or PEER, SUBJECT]
    return [m for m in registry.row_names() if registry.row_method(m) in (BASELINE, SUBJECT) or registry.tree_on_target(m)]


def _methods(a: argparse.Namespace) -> list[str]:
    """--methods as a list of rows (methods and variants); its default: _default_rows."""
    if a.methods is None:   # --exact and --sweep run registered methods only
        return [m for m in _default_rows(a.head, bool(a.acceptance))
                if not (m in registry.VARIANTS and (a.exact or a.sweep))]
    return [m.strip() for m in a.methods.split(",") if m.strip()]


def _head_types(a: argparse.Namespace, rows: list[str]) -> list[str]:
    """The head types this run builds: the --head, else those the rows draft with."""
    if a.head is not None:
        return [a.head]
    kinds = {k for r in rows for k in tree_heads(r, None) if k}
    return [k for k in registry.tree_methods() if k in kinds] or [PEER]


def _check_args(a: argparse.Namespace, methods: list[str]) -> None:
    """Flag values that cannot run, refused before any model is built."""
    heads = registry.tree_methods()     # each head type is also the method of T's own tree
    bad = [m for m in methods if m not in registry.METHODS and m not in registry.VARIANTS]
    if bad or not methods:
        choices = [m for m in registry.row_names() if a.head is None or (m not in heads and m not in registry.VARIANTS)
                   or m == a.head]
        raise MeasureError(f"unknown method(s) {bad}; choose from {', '.join(choices)}")
    other_head = [m for m in methods if m in heads and a.head is not None and m != a.head]
    if other_head:   # the run builds one head type: T's tree method is the one of --head
        raise MeasureError(f"method {other_head[0]} drafts with {head_label(other_head[0])} heads: it needs "
                           f"--head {other_head[0]} or no --head (this run's heads are {a.head})")
    variants = [m for m in methods if m in registry.VARIANTS]
    if variants and (a.head is not None or a.exact or a.acceptance or a.sweep):
        raise MeasureError(f"{variants[0]} ({registry.label(variants[0])}) is a row of the run without --head, "
                           "--exact, --sweep or a replayed --acceptance trace")
    if a.acceptance and (a.acceptance_rates or a.m_acceptance_rates):
        raise MeasureError("give either --acceptance (a trace) or --acceptance-rates, not both")
    if a.acceptance and a.sweep:
        raise MeasureError("--sweep varies acceptance rates: use --acceptance-rates (or the defaults), not a trace")
    if not 0.0 <= a.seq_rate <= 1.0:
        raise MeasureError(f"--seq-rate must be between 0 and 1, got {a.seq_rate}")
    if a.prompt_len < 1:
        raise MeasureError("--prompt-len must be at least 1")
    if not 1 <= a.repeat <= 20:
        raise MeasureError(f"--repeat must be between 1 and 20, got {a.repeat}")
    if a.max_new_tokens is not None and a.max_new_tokens < 2:
        raise MeasureError("--max-new-tokens must be at least 2")
    if a.threads is not None and a.threads < 1:
        raise MeasureError("--threads must be at least 1")


def _trace_and_settings(a: argparse.Namespace, methods: list[str]) -> tuple[Optional[dict], DecodeSettings, int]:
    """The acceptance trace (if any), the decode settings (the trace's, then the flags') and the
    number of new tokens."""
    trace = None
    base_settings: dict[str, Any] = {}
    if a.acceptance:
        trace = load_acceptance_trace(a.acceptance)
        missing = [m for m in methods if m != BASELINE and m not in trace]
        if missing:
            raise MeasureError(f"the trace has no run of {', '.join(missing)} (it has {', '.join(trace) or 'none'}): "
                              "drop those from --methods or use --acceptance-rates")
        spec = next((trace[m] for m in methods if m in trace), None)
        base_settings = spec["settings"] if spec else {}
    max_new = a.max_new_tokens or (max(trace[m]["tokens"] for m in methods if m in trace)
                                   if trace and any(m in trace for m in methods) else 128)
    return trace, _settings(a, base_settings, max_new), max_new


def _report(a: argparse.Namespace, names: dict, t_cfg: ModelConfig, m_cfg: ModelConfig, dev: str, dtype: torch.dtype,
            kernel: str, trace: Optional[dict], rates_info: dict, s: DecodeSettings, results: dict) -> dict[str, Any]:
    info: dict[str, Any] = {
        "schema": SCHEMA, "label": LABEL, "shapes": names,
        "configs": {"target": dataclasses.asdict(t_cfg), "intermediate": dataclasses.asdict(m_cfg)},
        "formats": {"target": _format_text(a.target_format, t_cfg, kernel, dtype),
                    "intermediate": _format_text(a.intermediate_format, m_cfg, kernel, dtype) + (
                        f", LM head {get_format(a.intermediate_lm_head).label}" if a.intermediate_lm_head != DENSE.name else "")
                    + (f", {a.draft_vocab} output ids" if a.intermediate_draft_vocab else ""),
                    "heads": "; ".join(_heads_text(k) for k in _head_types(a, list(results))) + (
                        f", linears {get_format(a.head_format).label}" if a.head_format != DENSE.name else "")},
        "head": a.head or PEER, "heads": _head_types(a, list(results)),
        "device": dev, "dtype": str(dtype).replace("torch.", ""), "w4_kernel": kernel, "tiny": a.tiny,
        "acceptance": ({"mode": "trace", "source": a.acceptance,
                        "source_stack": {m: trace[m]["stack"] for m in trace}} if trace else
                       {"mode": "rates", **rates_info, "seed": a.seed,
                        **({"imported": a.imported} if getattr(a, "imported", None) else {})}),
        "settings": s.to_dict(), "prompt_tokens": a.prompt_len, "stage_sync": StageTimer.sync, "repeat": a.repeat,
        "draft_vocab": a.draft_vocab or t_cfg.vocab_size, "intermediate_lm_head": a.intermediate_lm_head,
        "head_format": a.head_format,
        "intermediate_vocab": "draft" if a.intermediate_draft_vocab else "full",
        "draft_vocabs": draft_vocabs(_head_types(a, list(results)), t_cfg.vocab_size, a.draft_vocab),
        "methods": results, "machine": machine_info(dev)}
    info["formats"] = {role: formats_in_words(text, info["machine"]) for role, text in info["formats"].items()}
    if w4_verdicts.kernel_choices():      # HIERVIZ_W4_CUDA=auto: each W4 kind's kernel and its timings
        info["w4_kernel_choices"] = w4_verdicts.kernel_choice_records()
    if "eagle3" in info["heads"]:
        info["feature_layers"] = _feature_layers_info(t_cfg, m_cfg)
    for m, r in results.items():    # each row names where its accept/reject decisions came from
        r["acceptance_source"] = row_acceptance(m, info["acceptance"], a.head)
    if trace:
        info["replay"] = {m: _replay_check(trace[m]["rows"], results[m]["accepted"]) for m in results if m in trace}
    info["speedup_vs_ar"] = ({m: r["tokens_per_s"] / results[BASELINE]["tokens_per_s"] for m, r in results.items()}
                             if BASELINE in results else {})
    for row in (m for m in results if registry.row_method(m) == SUBJECT):   # HierSpec rows over T's tree rows
        for tree in (m for m in results if registry.tree_on_target(m)):
            info[f"{row}_vs_{tree}"] = results[row]["tokens_per_s"] / results[tree]["tokens_per_s"]
    return info


def _heads_text(kind: str) -> str:
    """A head type as formats.heads names it (EAGLE-2 heads have EAGLE-1's layout)."""
    return "EAGLE-1/2 layout, synthetic" if kind == PEER else f"{head_label(kind)}, synthetic"


def _feature_layers_info(t_cfg: ModelConfig, m_cfg: ModelConfig) -> dict[str, list[int]]:
    """The base layers whose inputs the EAGLE-3 heads fuse, per base model."""
    return {"target": list(eagle3_feature_layers(t_cfg.num_layers)),
            "intermediate": list(eagle3_feature_layers(m_cfg.num_layers))}


def check_request(a: argparse.Namespace) -> tuple[list[str], Optional[dict], DecodeSettings, int]:
    """What run_whatif refuses before it builds a model (methods, settings, acceptance sources),
    also for a caller that runs the what-if elsewhere (hierviz.measure.compat): the methods, the
    acceptance trace (if any), the settings and the number of new tokens."""
    # an imported file's rates spread over the run's E_T depth (flags and --trees) where it gives no draft length
    def tree_depths() -> tuple[int, int]:
        s = _settings(a, {}, 16)
        return s.t_depth, s.m_depth
    a.imported = apply_imported_acceptance(a, lambda: tree_depths()[0])
    methods = _methods(a)
    _check_args(a, methods)
    a.eagle3_record = eagle3_record(a, tree_depths) if "eagle3" in _head_types(a, methods) else None
    return (methods, *_trace_and_settings(a, methods))


def run_whatif(a: argparse.Namespace) -> dict[str, Any]:
    methods, trace, s, max_new = check_request(a)
    sweep_settings: list[DecodeSettings] = []
    if a.sweep:   # check the sweep's lists before building (possibly 70B-sized) models
        _scales(a.sweep_scales)
        sweep_settings = ([_settings_copy(s, t_tree_size=z) for z in int_list(a.sweep_tree_sizes, "--sweep-tree-sizes")]
                          + [_settings_copy(s, min_draft_len=d) for d in int_list(a.sweep_min_draft, "--sweep-min-draft")])
    dev, dtype, kernel = environment(a.device, a.dtype, a.w4_kernel, "no CUDA GPU found: use --device cpu --tiny for "
                                                                     "the CPU version")
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    names, t_cfg, m_cfg = _shapes(a, dev)
    if a.prompt_len + max_new + cache_margin(s) > t_cfg.max_position:
        raise MeasureError(f"prompt ({a.prompt_len}) + new tokens ({max_new}) + draft room exceed the "
                          f"{t_cfg.max_position}-token context of the target shape")
    StageTimer.sync = not a.no_stage_sync
    torch.manual_seed(a.seed)
    kinds = _head_types(a, methods)
    rows = None if a.exact else registry.workload_rows(methods, [s] + sweep_settings, a.prompt_len)
    models = build_models(t_cfg, m_cfg, dev, dtype, kernel, a.seed, a.intermediate_format,
                          a.head or (PEER if kinds == [PEER] else None), a.draft_vocab,
                          a.target_format, rows, a.intermediate_lm_head, a.intermediate_draft_vocab, a.head_format)
    if a.exact:
        return _run_exact(a, models, s, methods, names, dev)
    stacks = {m: variant_models(models, m, a.seed, a.draft_vocab, a.head_format, kernel) if m in registry.VARIANTS else models
              for m in methods}
    prompt = _prompt(t_cfg.vocab_size, a.prompt_len, a.seed)
    _check_finite(models, prompt)
    make, rates_info = oracle_factory(a, trace)
    warm = dataclasses.replace(s, max_new_tokens=min(16, max_new))
    # one cache length for every run: all lease the same pooled runners, captured in the warm-up
    cache_len = len(prompt) + max_new + max(cache_margin(x) for x in [s] + sweep_settings)
    for m in methods:   # warm-up: kernel packing, CUDA-graph capture, allocator growth stay out of the figures
        with rows_features(stacks[m], m):
            run_one(stacks[m], m, warm, make(m), prompt, cache_len)
            cuda_graphs.prepare_models(row_parts(stacks[m], m))    # buckets the short warm-up did not reach
    results = {m: run_repeated(stacks[m], m, s, make, prompt, cache_len, a.repeat) for m in methods}
    info = _report(a, names, t_cfg, m_cfg, dev, dtype, kernel, trace, rates_info, s, results)
    if a.sweep:
        info["sweep"] = run_sweep(a, models, s, prompt, results, cache_len)
    return info


def _run_exact(a: argparse.Namespace, models: Models, s: DecodeSettings, methods: list[str],
               names: dict[str, str], dev: str) -> dict[str, Any]:
    from hierviz.measure import whatif_exact
    presets = [p.strip() for p in a.exact_trees.split(",") if p.strip()]
    bad = [p for p in presets if p not in TREE_PRESETS]
    if bad or not presets:
        raise MeasureError(f"unknown tree preset(s) {bad}; choose from {', '.join(TREE_PRESETS)}")
    if a.acceptance or a.sweep:
        raise MeasureError("--exact takes no --acceptance or --sweep")
    prompt = _prompt(models.target.cfg.vocab_size, a.prompt_len, a.seed)
    _check_finite(models, prompt)
    if a.exact_miss_every < 2:
        raise MeasureError("--exact-miss-every must be at least 2")
    variants = tuple(v.strip() for v in a.exact_variants.split(",") if v.strip())
    if not variants or any(v not in whatif_exact.VARIANTS for v in variants):
        raise MeasureError(f"--exact-variants takes {', '.join(whatif_exact.VARIANTS)} (comma-separated)")
    res = whatif_exact.run_exact(models, prompt, s, presets, [m for m in methods if m != BASELINE], a.exact_miss_every,
                                 log=lambda line: print(line, flush=True), variants=variants)
    return {"exact": True, "shapes": names, "head": a.head or PEER, "heads": _head_types(a, methods),
            "draft_vocab": a.draft_vocab or models.target.cfg.vocab_size,
            "draft_vocabs": draft_vocabs(_head_types(a, methods), models.target.cfg.vocab_size, a.draft_vocab),
            "device": dev,
            "dtype": str(models.target.dtype).replace("torch.", ""), "settings": s.to_dict(),
            "tree_presets": {p: TREE_PRESETS[p] for p in presets}, "machine": machine_info(dev), **res}


def _check_finite(models: Models, prompt: list[int]) -> None:
    """Synthetic weights must keep activations finite: NaN features give the heads flat
    distributions, EAGLE-2's rerank then keeps shallow trees, and the projection is wrong
    without any error (seen with over-scaled weights at 70B shape in fp16)."""
    toks = torch.tensor(prompt[:8], device=models.target.device)
    for name, model in (("target", models.target), ("intermediate", models.intermediate)):
        with torch.no_grad():
            logits = model.logits(model(toks, torch.arange(len(toks), device=toks.device)))
        if model.output_vocab is not None:      # the ids it does not predict are -inf by design
            logits = logits[..., model.output_vocab]
        if not bool(torch.isfinite(logits).all()):
            raise MeasureError(f"the synthetic {name} produced non-finite logits in {model.dtype}: "
                              "its weights are scaled wrongly for this shape")


def _replay_check(want: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    n = min(len(want), len(got))
    same = sum(1 for i in range(n) if want[i] == got[i])
    return {"rounds_in_trace": len(want), "rounds_run": len(got), "rounds_identical": same,
            "exact": len(want) == len(got) and same == n}


def _scales(text: str) -> list[float]:
    try:
        scales = [float(x) for x in text.split(",") if x.strip()] or [1.0]
    except ValueError:
        raise MeasureError(f"--sweep-scales must be comma-separated numbers, got {text!r}") from None
    if any(not x > 0 for x in scales):
        raise MeasureError("--sweep-scales must be positive")
    return scales


def run_sweep(a: argparse.Namespace, models: Models, s: DecodeSettings, prompt: list[int],
              base: dict[str, Any], cache_len: Optional[int] = None) -> dict[str, Any]:
    """AR once; T's own tree method (EAGLE-2, or EAGLE-3 with --head eagle3) per (scale, E_T tree
    size); HierSpec per (scale, min draft length); each the median of --repeat runs."""
    scales = _scales(a.sweep_scales)
    sizes = int_list(a.sweep_tree_sizes, "--sweep-tree-sizes")
    drafts = int_list(a.sweep_min_draft, "--sweep-min-draft")
    tree_method = a.head or PEER  # the head type is also the method of T's own tree
    ar = base[BASELINE] if BASELINE in base else run_repeated(models, BASELINE, s, lambda m: None, prompt, cache_len,
                                                              a.repeat)
    rows = []
    for sc in scales:
        make, rinfo = oracle_factory(a, None, sc)
        for size in sizes:
            st = _settings_copy(s, t_tree_size=size)
            r = run_repeated(models, tree_method, st, make, prompt, cache_len, a.repeat)
            rows.append({"method": tree_method, "scale": sc, "t_tree_size": size, "rates": rinfo["rates"],
                         "tokens_per_s": r["tokens_per_s"], "tokens_per_round": r["tokens_per_round"],
                         "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"]})
        for md in drafts:
            st = _settings_copy(s, min_draft_len=md)
            r = run_repeated(models, SUBJECT, st, make, prompt, cache_len, a.repeat)
            rows.append({"method": SUBJECT, "scale": sc, "min_draft_len": md, "rates": rinfo["rates"],
                         "seq_rate": rinfo["seq_rate"], "tokens_per_s": r["tokens_per_s"],
                         "tokens_per_round": r["tokens_per_round"],
                         "speedup_vs_ar": r["tokens_per_s"] / ar["tokens_per_s"]})
    verdicts = []
    for sc in scales:
        e = [r for r in rows if r["scale"] == sc and r["method"] == tree_method]
        h = [r for r in rows if r["scale"] == sc and r["method"] == SUBJECT]
        be, bh = max(e, key=lambda r: r["tokens_per_s"]), max(h, key=lambda r: r["tokens_per_s"])
        verdicts.append({"scale": sc, "best_tree": be["speedup_vs_ar"], "best_tree_size": be["t_tree_size"],
                         "best_hierspec": bh["speedup_vs_ar"], "best_min_draft_len": bh["min_draft_len"],
                         "winner": SUBJECT if bh["tokens_per_s"] > be["tokens_per_s"] else tree_method})
    return {"label": LABEL, "tree_method": tree_method, "ar_tokens_per_s": ar["tokens_per_s"], "rows": rows,
            "verdicts": verdicts}


def _settings_copy(s: DecodeSettings, **kw: Any) -> DecodeSettings:
    try:
        return dataclasses.replace(s, **kw).validate()
    except SettingsError as e:
        raise MeasureError(str(e)) from None


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    info = run_reporting_errors(lambda: run_whatif(a), (MeasureError, SettingsError))
    if info is None:
        return 2
    stamp(info, "whatif", argv)
    if info.get("exact"):
        from hierviz.measure import whatif_exact
        whatif_exact.write(info, Path(a.out))
        print(whatif_exact.markdown(info))
        return 0 if info["passed"] else 1
    whatif_report.write_outputs(info, Path(a.out))
    print(whatif_report.markdown(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
