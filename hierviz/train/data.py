"""Training data: our own prompts (prompts.py) answered by the target model itself.

    python -m hierviz train data --target T.gguf --tokenizer TOKDIR --out data.pt \
        --num-prompts 8000 --max-new-tokens 256 --batch-size 1024 \
        --questions spec_bench_question.jsonl mt_bench_question.jsonl --draft-vocab 8192

Each prompt is wrapped in the tokenizer's chat template exactly as the engine does (`encode_chat`)
and answered by T (transformers LlamaForCausalLM built from T's dequantized weights, batched
static-cache generation in fastgen.py), greedily or sampled according to --modes. The output holds
prompt + response tokens per sample, a held-out split, the prompt/benchmark overlap check and,
with --draft-vocab V, the V most frequent tokens of the training responses (an FR-Spec draft
vocabulary). With --derived N, a second stage reuses up to N of the target's training answers as
passages for long prompts (summarize / answer from / extract / translate / rewrite / check this
text; prompts.derived_prompts), which the benchmark categories have and the templates lack; the
same overlap rule applies (hits are dropped) and the target answers them greedily.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from hierviz.config import recorded_command
from hierviz.train.common import (base_dtype, TokenData, build_hf, env_info, load_base, load_tokenizer, log,
                                  pick_device, seed_all, write_json)
from hierviz.train import fastgen
from hierviz.train.prompts import (build_prompts, derived_prompts, instruct_prompts, overlap_report,
                                     overlapping_prompts, parse_instruction)

DEFAULT_MODES = "greedy:0.5,t0.7:0.25,t1.0:0.25"


def parse_modes(spec: str) -> list[tuple[str, float]]:
    out = []
    for part in spec.split(","):
        name, _, w = part.partition(":")
        if name != "greedy" and not (name.startswith("t") and _isfloat(name[1:])):
            raise ValueError(f"bad mode {name!r}: use greedy or tX.Y (sampling temperature)")
        out.append((name, float(w or 1)))
    return out


def _isfloat(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def assign_modes(n: int, modes: list[tuple[str, float]], seed: int) -> list[str]:
    rng = random.Random(seed)
    total = sum(w for _, w in modes)
    counts = [int(round(n * w / total)) for _, w in modes]
    counts[0] += n - sum(counts)
    out = [m for (m, _), c in zip(modes, counts) for _ in range(c)]
    rng.shuffle(out)
    return out


def generate_batch(model, prompts: list[list[int]], mode: str, max_new: int, eos_ids: list[int], pad_id: int,
                   top_p: float, seed: int) -> list[list[int]]:
    """T's responses (cut after the first EOS) to a batch of prompts: greedy or sampled at tX.Y."""
    temperature = 0.0 if mode == "greedy" else float(mode[1:])
    return fastgen.generate(model, prompts, max_new, eos_ids, pad_id, temperature=temperature,
                            top_p=top_p if temperature > 0 else 1.0, seed=seed)


def sample_items(n: int, modes: list[tuple[str, float]], samples_per_prompt: int, seed: int) -> list[tuple[int, str]]:
    """(prompt index, mode) for every sample: the mode mix per round of samples; a prompt answered
    greedily once gets its next samples sampled instead (a second greedy answer would be a copy)."""
    sampled = [m for m, _ in modes if m != "greedy"] or ["t1.0"]
    items, greedy_done = [], set()
    for s in range(samples_per_prompt):
        for i, m in enumerate(assign_modes(n, modes, seed + s)):
            if m == "greedy" and i in greedy_done:
                m = sampled[(i + s) % len(sampled)]
            elif m == "greedy":
                greedy_done.add(i)
            items.append((i, m))
    return items


def draft_vocab(data: TokenData, size: int, always: list[int]) -> tuple[list[int], dict]:
    """Top-`size` tokens by frequency in the training responses (+ `always`), and coverage figures."""
    cnt: collections.Counter = collections.Counter()
    for i in data.indices("train"):
        s = data.sample(i)[int(data.prompt_lens[i]):]
        cnt.update(s.tolist())
    ids = [t for t in always if t is not None]
    for t, _ in cnt.most_common():
        if len(ids) >= size:
            break
        if t not in ids:
            ids.append(t)
    keep = set(ids)

    def coverage(idx):
        tot = hit = 0
        for i in idx:
            s = data.sample(i)[int(data.prompt_lens[i]):].tolist()
            tot += len(s)
            hit += sum(t in keep for t in s)
        return hit / max(tot, 1)
    return ids, {"size": len(ids), "distinct_response_tokens": len(cnt),
                 "coverage_train_responses": round(coverage(data.indices("train")), 4),
                 "coverage_heldout_responses": round(coverage(data.indices("heldout")), 4)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hierviz train data", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target model: .gguf file or HF/GPTQ folder")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder, or 'byte' for tiny test models")
    ap.add_argument("--out", required=True, help="output .pt file")
    ap.add_argument("--num-prompts", type=int, default=8000)
    ap.add_argument("--samples-per-prompt", type=int, default=1)
    ap.add_argument("--modes", default=DEFAULT_MODES, help="comma list of greedy|tTEMP:weight")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--heldout-every", type=int, default=50, help="every Nth prompt goes to the held-out split")
    ap.add_argument("--questions", nargs="*", default=[], help="benchmark JSONL files the prompts must not overlap")
    ap.add_argument("--draft-vocab", type=int, default=0, help="also write the top-V frequent tokens (FR-Spec)")
    ap.add_argument("--draft-vocab-out", default=None)
    ap.add_argument("--time-budget", type=float, default=0, help="stop starting new batches after this many seconds")
    ap.add_argument("--derived", type=int, default=0,
                    help="also build up to N long prompts on the target's own training answers (summarize / answer "
                         "from / extract / translate / rewrite / check this text) and answer them greedily")
    ap.add_argument("--derived-min-tokens", type=int, default=60, help="shortest answer used as a passage")
    ap.add_argument("--derived-budget", type=float, default=0, help="seconds for the derived stage (0: no limit)")
    ap.add_argument("--instruct", type=int, default=0,
                    help="also ask the target to write N questions / tasks (sampled) and answer the usable ones")
    ap.add_argument("--instruct-temperature", type=float, default=1.0)
    ap.add_argument("--instruct-max-tokens", type=int, default=96, help="longest written question / task")
    ap.add_argument("--instruct-budget", type=float, default=0, help="seconds for the self-instruct stage (0: no limit)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None, help="JSON report path (default: OUT with .json)")
    return ap


def _overlap_check(prompts: list[tuple[str, str]], questions: list[str]) -> Optional[dict]:
    """The prompt/benchmark overlap report (None without question files); any overlap is fatal."""
    check = overlap_report([p for _, p in prompts], questions) if questions else None
    if check:
        log(f"overlap check vs {check['question_files']}: exact {check['exact_matches']}, "
            f"shared {check['ngram']}-grams {check['prompts_sharing_an_ngram']}")
        if check["exact_matches"] or check["prompts_sharing_an_ngram"]:
            raise SystemExit(f"training prompts overlap the benchmark questions: {check['examples']}")
    return check


@dataclass
class _Target:
    """The target as the generator needs it: the model, its tokenizer, EOS ids and padding id."""
    model: Any
    tok: Any
    eos_ids: list[int]
    pad_id: int


def _load_target(path: str, tokenizer: str, device: torch.device, t0: float) -> _Target:
    cfg, weights = load_base(path)
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
    tok = load_tokenizer(tokenizer, eos_ids)
    eos_ids = sorted(set(eos_ids) | set(tok.eos_ids))
    pad_id = cfg.get("pad_token_id")
    pad_id = int(pad_id) if pad_id is not None else eos_ids[0]
    dtype = base_dtype(device)
    model = build_hf(cfg, weights, device, dtype).eval()
    log(f"target loaded: {cfg.get('num_hidden_layers')} layers on {device} ({time.time() - t0:.1f}s)")
    return _Target(model, tok, eos_ids, pad_id)


class _Answers:
    """The samples generated so far (prompt + response tokens, mode, split, category per sample)
    and the generator that appends to them."""

    def __init__(self, target: _Target, a: argparse.Namespace) -> None:
        self.target, self.a = target, a
        self.tokens: list[int] = []
        self.offsets = [0]
        self.plens: list[int] = []
        self.mlist: list[str] = []
        self.split: list[str] = []
        self.cats: list[str] = []
        self.responses: list[tuple[int, list[int]]] = []   # (prompt index, response) of training samples
        self.n_resp = 0
        self.t0 = time.time()

    def _batches(self, items: list[tuple[int, str]], enc: list[list[int]], seed_base: int) -> list[list[int]]:
        """Item indices per batch: one mode and similar prompt lengths per batch, batches in a random order."""
        by_mode: dict[str, list[int]] = collections.defaultdict(list)
        for k, (i, m) in enumerate(items):
            by_mode[m].append(k)
        batches = []
        shuffle = random.Random(self.a.seed + seed_base)
        for m, ks in by_mode.items():
            ks.sort(key=lambda k: len(enc[items[k][0]]))
            chunks = [ks[j:j + self.a.batch_size] for j in range(0, len(ks), self.a.batch_size)]
            # similar lengths share a batch (little padding), but the batches run in random order: a
            # budget that stops early must not keep only the shortest prompts (some categories)
            shuffle.shuffle(chunks)
            batches.append(chunks)
        return _round_robin(batches)

    def _append(self, i: int, prompt: list[int], response: list[int], mode: str, category: str, keep: bool) -> None:
        seq = prompt + response
        self.tokens.extend(seq)
        self.offsets.append(self.offsets[-1] + len(seq))
        self.plens.append(len(prompt))
        self.mlist.append(mode)
        held = i % self.a.heldout_every == 0
        self.split.append("heldout" if held else "train")
        self.cats.append(category)
        self.n_resp += len(response)
        if keep and not held:
            self.responses.append((i, response))

    def run(self, items: list[tuple[int, str]], enc: list[list[int]], prompts: list[tuple[str, str]],
            budget: float, seed_base: int, keep: bool, max_new: int = 0, collect: Optional[list] = None) -> None:
        """Generate the target's answers for `items`, batched by mode and prompt length (batches in
        a random order), appending every sample; stops starting batches once `budget` seconds have
        passed. `collect` receives (prompt index, response) of every sample."""
        a, t = self.a, self.target
        order = self._batches(items, enc, seed_base)
        t_start = time.time()
        for bi, ks in enumerate(order):
            if budget and time.time() - t_start > budget:
                log(f"time budget reached after {bi} of {len(order)} batches")
                break
            m = items[ks[0]][1]
            resps = generate_batch(t.model, [enc[items[k][0]] for k in ks], m, max_new or a.max_new_tokens, t.eos_ids,
                                   t.pad_id, a.top_p, a.seed * 1000 + seed_base + bi)
            for k, r in zip(ks, resps):
                i = items[k][0]
                self._append(i, enc[i], r, m, prompts[i][0], keep)
                if collect is not None:
                    collect.append((i, r))
            el = time.time() - self.t0
            log(f"batch {bi + 1}/{len(order)} ({m}, {len(ks)} prompts): {self.n_resp} response tokens, "
                f"{self.n_resp / max(el, 1e-9):.0f} tok/s")

    def token_data(self, meta: dict) -> TokenData:
        return TokenData(torch.tensor(self.tokens, dtype=torch.int32), torch.tensor(self.offsets, dtype=torch.long),
                         torch.tensor(self.plens, dtype=torch.int32), self.mlist, self.split, meta)


def _written_prompts(written: list[tuple[int, list[int]]], asks: list[tuple[str, str]], gen: _Answers,
                     questions: list[str]) -> tuple[list[tuple[str, str]], set]:
    """The distinct usable questions / tasks the target wrote, and those dropped for overlapping the benchmarks."""
    eos_set = set(gen.target.eos_ids)
    seen, new_prompts = set(), []
    for i, r in written:
        text = parse_instruction(gen.target.tok.decode([t for t in r if t not in eos_set]))
        if text and text.lower() not in seen:
            seen.add(text.lower())
            new_prompts.append((f"instruct-{asks[i][0]}", text))
    hits = overlapping_prompts([p for _, p in new_prompts], questions) if questions and new_prompts else set()
    return [np_ for np_ in new_prompts if np_[1] not in hits], hits


def _instruct_stage(gen: _Answers, a: argparse.Namespace, modes: list[tuple[str, float]]) -> dict:
    """The target writes questions / tasks (sampled), then answers the usable ones (prompts.instruct_prompts)."""
    tok = gen.target.tok
    asks = instruct_prompts(a.instruct, a.seed + 7)
    ask_check = overlap_report([p for _, p in asks], a.questions) if a.questions else None
    if ask_check and (ask_check["exact_matches"] or ask_check["prompts_sharing_an_ngram"]):
        raise SystemExit(f"instruction-writing prompts overlap the benchmark questions: {ask_check['examples']}")
    written: list[tuple[int, list[int]]] = []
    t_ask = time.time()
    ask_mode = f"t{float(a.instruct_temperature)}"
    gen.run([(i, ask_mode) for i in range(len(asks))], [tok.encode_chat(p) for _, p in asks],
            [(f"instruct-ask-{c}", p) for c, p in asks], a.instruct_budget / 3 if a.instruct_budget else 0,
            300, keep=False, max_new=a.instruct_max_tokens, collect=written)
    new_prompts, hits = _written_prompts(written, asks, gen, a.questions)
    ienc = [tok.encode_chat(p) for _, p in new_prompts]
    left = max(a.instruct_budget - (time.time() - t_ask), 1.0) if a.instruct_budget else 0
    gen.run(sample_items(len(new_prompts), modes, a.samples_per_prompt, a.seed + 11), ienc, new_prompts, left,
            400, keep=a.derived > 0)
    info = {"asked": len(asks), "temperature": a.instruct_temperature, "written": len(written),
            "usable_distinct": len(new_prompts) + len(hits), "dropped_for_overlap": len(hits),
            "answered_prompts": len(new_prompts), "overlap_check_of_asks": ask_check,
            "examples": [p for _, p in new_prompts[:8]]}
    log(f"self-instruct: {info['written']} written, {len(new_prompts)} usable distinct prompts answered")
    return info


def _derived_stage(gen: _Answers, a: argparse.Namespace) -> dict:
    """Long prompts built on the target's own training answers (prompts.derived_prompts), answered greedily."""
    tok = gen.target.tok
    eos_set = set(gen.target.eos_ids)
    texts = [tok.decode([t for t in r if t not in eos_set]) for _, r in gen.responses
             if len(r) >= a.derived_min_tokens][:a.derived]
    dprompts = derived_prompts(texts, a.seed)
    dropped = 0
    if a.questions and dprompts:   # the same non-overlap rule; a hit is dropped, not fatal
        hits = overlapping_prompts([p for _, p in dprompts], a.questions)
        dropped = len(hits)
        dprompts = [dp for dp in dprompts if dp[1] not in hits]
    denc = [tok.encode_chat(p) for _, p in dprompts]
    ditems = [(i, "greedy") for i in range(len(dprompts))]
    gen.run(ditems, denc, dprompts, a.derived_budget, 500, keep=False)
    return {"asked": a.derived, "built": len(dprompts) + dropped, "dropped_for_overlap": dropped,
            "min_passage_tokens": a.derived_min_tokens, "mode": "greedy",
            "kinds": dict(collections.Counter(c for c, _ in dprompts))}


def _meta(a: argparse.Namespace, argv: Optional[list[str]], check: Optional[dict], gen: _Answers, gen_s: float,
          derived_info: Optional[dict], instruct_info: Optional[dict], device: torch.device) -> dict:
    return {"command": recorded_command("train data", argv), "target": str(a.target), "seed": a.seed,
            "prompt_source": "hierviz/train/prompts.py templates x topic lists (written for this project)",
            "overlap_check": check, "modes": a.modes, "top_p": a.top_p, "max_new_tokens": a.max_new_tokens,
            "samples": len(gen.mlist), "prompt_tokens": int(sum(gen.plens)), "response_tokens": gen.n_resp,
            "heldout_samples": gen.split.count("heldout"), "categories": dict(collections.Counter(gen.cats)),
            "mode_counts": dict(collections.Counter(gen.mlist)), "generation_seconds": round(gen_s, 1),
            "derived": derived_info, "instruct": instruct_info,
            "env": env_info(device)}


def _write_draft_vocab(data: TokenData, a: argparse.Namespace, eos_ids: list[int]) -> None:
    ids, stats = draft_vocab(data, a.draft_vocab, eos_ids)
    data.meta["draft_vocab"] = stats
    out = a.draft_vocab_out or str(Path(a.out).with_name("draft_vocab.json"))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(ids))
    log(f"draft vocabulary: {stats}")


def main(argv: Optional[list[str]] = None) -> int:
    a = _parser().parse_args(argv)
    t0 = time.time()
    seed_all(a.seed)
    device = pick_device(a.device)
    prompts = build_prompts(a.num_prompts, a.seed)
    check = _overlap_check(prompts, a.questions)
    target = _load_target(a.target, a.tokenizer, device, t0)
    modes = parse_modes(a.modes)
    items = sample_items(len(prompts), modes, a.samples_per_prompt, a.seed)
    enc = [target.tok.encode_chat(p) for _, p in prompts]
    gen = _Answers(target, a)
    gen.run(items, enc, prompts, a.time_budget, 0, keep=a.derived > 0)
    instruct_info = _instruct_stage(gen, a, modes) if a.instruct else None
    derived_info = _derived_stage(gen, a) if a.derived else None
    gen_s = time.time() - gen.t0
    meta = _meta(a, argv, check, gen, gen_s, derived_info, instruct_info, device)
    data = gen.token_data(meta)
    if a.draft_vocab:
        _write_draft_vocab(data, a, target.eos_ids)
    data.save(a.out)
    write_json(a.report or str(Path(a.out).with_suffix(".json")), meta)
    log(f"wrote {a.out}: {len(gen.mlist)} samples, {gen.n_resp} response + {sum(gen.plens)} prompt tokens in {gen_s:.0f}s")
    return 0


def _round_robin(lists: list[list]) -> list:
    out = []
    for j in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if j < len(x):
                out.append(x[j])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
