"""Acceptance statistics from serving engines and benchmarks, in one precisely defined form.

Users have acceptance data from their own deployments (a vLLM /metrics scrape, SGLang responses,
Spec-Bench or EAGLE answer files, SpecMQuant cascade runs, hierviz traces). Each importer here reads
one such format and returns an `ImportedAcceptance`: per-position conditional acceptance rates (what
`python -m hierviz whatif --acceptance-rates` replays), the unconditional per-position rates, the
mean accepted length, and the engine's own definition of what it counted. See docs/acceptance.md.

Conventions, the same for every format:
- a verification step is one forward of the verifier over one draft (a sequence or a tree);
- an accepted length is the number of DRAFT tokens the verifier accepted in that step, never
  counting the verifier's own bonus / correction token (engines that count it are converted);
- positions are 1-based: position k is the k-th drafted token of the accepted path.

No pickle, no eval: input is parsed as JSON or as Prometheus text. Every failure on bad input is an
`AcceptanceImportError` whose message is fit to show a user.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

from hierviz.measure.acceptance_form import (_HIERVIZ_DEFS, RECORD_SCHEMA, AcceptanceImportError,  # noqa: F401
                                             ImportedAcceptance, _count, _counts, _dict)
from hierviz.measure.acceptance_record import read_record

MAX_IMPORT_BYTES = 64 * 1024 * 1024     # checked before anything is parsed

# format id -> one line on what it is; the single list of what load_acceptance reads
FORMAT_HELP = {
    "vllm-prometheus": "vLLM /metrics scrape (Prometheus text) with the vllm:spec_decode_* counters",
    "vllm-metrics-json": "vLLM LLM.get_metrics() snapshot as JSON: a list of {name, labels, value|values}",
    "vllm-request": "vLLM responses carrying metrics.speculative_decoding (--per-request-spec-decode-metrics)",
    "sglang-meta-info": "SGLang /generate responses with spec_* fields in meta_info (one object, a list or JSONL)",
    "specbench-jsonl": "Spec-Bench answer JSONL: per-step accept_lengths (bonus token included) in each choice",
    "eagle-jsonl": "EAGLE gen_ea_answer JSONL: per-turn idxs and new_tokens (mean length only)",
    "specmquant-jsonl": "SpecMQuant answer JSONL with accept_lengths and cascade_accept_lengths (two levels)",
    "hierviz-trace": "hierviz trace or comparison JSON (per-round accepted tree paths and sequence drafts)",
    "acceptance-record": "a published figure as per-depth conditional rates per level, with its source "
                         "(schema hierviz.acceptance-record/1; assets/whatif/acceptance/)",
}
FORMATS = tuple(FORMAT_HELP)

_SPEC_PREFIX = "vllm:spec_decode_"
_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ---- small checked readers ----------------------------------------------------------------------

# ---- the statistics, from per-step lengths or from counters -------------------------------------

def rates_from_lengths(accepted: list[int], drafted: Optional[list[int]] = None,
                       draft_length: Optional[int] = None) -> tuple[list[float], list[float]]:
    """(conditional rates, unconditional per-position rates) from per-step accepted draft lengths.

    Position k was tried in a step when the step accepted at least k-1 tokens and drafted at least
    k (drafted[i]; without it every step is taken to have drafted `draft_length`, default the
    longest accepted length); it was accepted when the step accepted at least k.
    rates[k-1] = accepted(k) / tried(k); the list stops before the first position never tried.
    """
    n = len(accepted)
    if n == 0:
        return [], []
    most = max(drafted) if drafted else (draft_length if draft_length is not None else max(accepted))
    rates, uncond = [], []
    for k in range(1, most + 1):
        tried = sum(1 for i, a in enumerate(accepted)
                    if a >= k - 1 and (drafted[i] if drafted else most) >= k)
        if tried == 0:
            break
        got = sum(1 for a in accepted if a >= k)
        rates.append(got / tried)
        uncond.append(got / n)
    return rates, uncond


def _from_lengths(fmt: str, definition: str, accepted: list[int], drafted: Optional[list[int]] = None,
                  draft_length: Optional[int] = None, reported: Optional[float] = None,
                  warnings: Optional[list[str]] = None) -> ImportedAcceptance:
    if not accepted:
        raise AcceptanceImportError(f"{fmt}: no verification steps in the data")
    warnings = list(warnings or [])
    if drafted is not None and any(a > d for a, d in zip(accepted, drafted)):
        raise AcceptanceImportError(f"{fmt}: a step accepted more draft tokens than it drafted")
    if draft_length is not None and max(accepted) > draft_length:
        raise AcceptanceImportError(f"{fmt}: a step accepted {max(accepted)} draft tokens, more than the "
                                    f"draft length {draft_length}")
    k = draft_length if draft_length is not None else (max(drafted) if drafted else max(accepted))
    if draft_length is None and not drafted:
        warnings.append(f"draft length not recorded; taken as the longest accepted length, {k}")
    rates, uncond = rates_from_lengths(accepted, drafted, k)
    if len(rates) < k:
        warnings.append(f"positions {len(rates) + 1}..{k} were never tried; rates stop at position {len(rates)}")
    return ImportedAcceptance(fmt, definition, rates, uncond, sum(accepted) / len(accepted), len(accepted),
                              k, reported, list(accepted), {}, warnings)


def _from_histogram(fmt: str, definition: str, hist: list[int], draft_length: Optional[int] = None,
                    reported: Optional[float] = None, warnings: Optional[list[str]] = None) -> ImportedAcceptance:
    """hist[j]: steps that accepted exactly j draft tokens (vLLM acceptance_histogram, SGLang
    spec_accept_histogram); every step is taken to have drafted draft_length (or len(hist)-1)."""
    while len(hist) > 1 and hist[-1] == 0 and draft_length is None:
        hist = hist[:-1]
    lengths = [j for j, c in enumerate(hist) for _ in range(c)]
    out = _from_lengths(fmt, definition, lengths, None, draft_length if draft_length is not None else len(hist) - 1,
                        reported, warnings)
    if draft_length is None:
        out.warnings.append(f"draft length not recorded; taken from the histogram as {len(hist) - 1}")
    return replace(out, accept_lengths=None)     # a histogram has no step order


def _from_position_counts(fmt: str, definition: str, drafts: int, draft_tokens: Optional[int], accepted: int,
                          per_pos: list[int], warnings: list[str]) -> ImportedAcceptance:
    """vLLM's counters: drafts (verification steps), draft tokens, accepted tokens, and per_pos[i]:
    steps whose accepted length reached position i+1 (vLLM increments positions 0..n-1 for a step
    that accepted n)."""
    if drafts == 0:
        raise AcceptanceImportError(f"{fmt}: the spec-decode counters are all zero (no drafts were verified yet)")
    if draft_tokens is not None and accepted > draft_tokens:
        raise AcceptanceImportError(f"{fmt}: inconsistent counts: {accepted} accepted tokens but only "
                                    f"{draft_tokens} draft tokens")
    prev = drafts
    for i, c in enumerate(per_pos):
        if c > prev:
            what = "drafts" if i == 0 else f"position {i - 1}"
            raise AcceptanceImportError(f"{fmt}: inconsistent counts: position {i} accepted {c} times, more than "
                                        f"{what} ({prev}); a position is reached only after the one before it")
        prev = c
    if per_pos and sum(per_pos) != accepted:
        warnings.append(f"per-position counts sum to {sum(per_pos)}, accepted tokens are {accepted} "
                        "(counters read at slightly different moments?)")
    k = len(per_pos)
    if k and draft_tokens is not None and draft_tokens < drafts * k:
        warnings.append(f"{drafts * k - draft_tokens} draft positions were never proposed (shorter drafts); "
                        "the rates count an unproposed position as not accepted")
    if not per_pos:
        warnings.append("no per-position counters: only the mean accepted length is known")
    rates, uncond, tried = [], [], drafts
    for c in per_pos:
        if tried == 0:
            warnings.append(f"positions {len(rates) + 1}..{k} were never tried; rates stop at position {len(rates)}")
            break
        rates.append(c / tried)
        uncond.append(c / drafts)
        tried = c
    mean = accepted / drafts
    return ImportedAcceptance(fmt, definition, rates, uncond, mean, drafts, k or None, 1.0 + mean, None, {}, warnings)


# ---- vLLM ---------------------------------------------------------------------------------------

_VLLM_DEF = ("vLLM counts, per draft verified (num_drafts), the draft tokens proposed and the draft tokens "
             "accepted before the first rejection, bonus token excluded; accepted_tokens_per_pos[i] counts "
             "drafts whose accepted prefix reached position i (0-based), and vLLM's mean acceptance length "
             "is 1 + accepted / drafts, bonus token included.")

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)


def _labels(text: str, where: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise AcceptanceImportError(f"{where}: malformed labels {{{text}}}")
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in a Prometheus text exposition; comments skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            raise AcceptanceImportError(f"line {n}: not a Prometheus sample: {line[:80]!r}")
        try:
            value = float(m.group(4))
        except ValueError:
            raise AcceptanceImportError(f"line {n}: bad sample value {m.group(4)!r}") from None
        out.append((m.group(1), _labels(m.group(3) or "", f"line {n}"), value))
    return out


def _vllm_totals(fmt: str, rows: list[tuple[str, dict[str, str], Any]], model: Optional[str]) -> ImportedAcceptance:
    """Sum vLLM's spec-decode counters over every label but position (engines of one model);
    several models in one scrape must be told apart with `model`."""
    rows = [r for r in rows if r[0].startswith(_SPEC_PREFIX)]
    if not rows:
        raise AcceptanceImportError(f"{fmt}: no vllm:spec_decode_* counters found (was the server started with "
                                    "a speculative config?)")
    models = sorted({r[1].get("model_name", "") for r in rows})
    if model is not None:
        rows = [r for r in rows if r[1].get("model_name") == model]
        if not rows:
            raise AcceptanceImportError(f"{fmt}: no spec-decode counters for model {model!r}; present: {models}")
    elif len(models) > 1:
        raise AcceptanceImportError(f"{fmt}: the data holds spec-decode counters of several models {models}; "
                                    "pass model=... to pick one (engines of one model are summed)")
    totals: dict[str, int] = {}
    per_pos: dict[int, int] = {}
    for name, labels, value in rows:
        if name == _PER_POS:
            if isinstance(value, list):     # get_metrics() Vector: values by position
                for i, c in enumerate(_counts(value, name)):
                    per_pos[i] = per_pos.get(i, 0) + c
                continue
            try:
                pos = int(labels.get("position", ""))
            except ValueError:
                raise AcceptanceImportError(f"{fmt}: {name} sample without a numeric position label") from None
            if not 0 <= pos < 4096:
                raise AcceptanceImportError(f"{fmt}: {name} position {pos} out of range")
            per_pos[pos] = per_pos.get(pos, 0) + _count(value, name)
        elif name in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED):
            totals[name] = totals.get(name, 0) + _count(value, name)
    if _DRAFTS not in totals or _ACCEPTED not in totals:
        raise AcceptanceImportError(f"{fmt}: {_DRAFTS} and {_ACCEPTED} are both needed; found only "
                                    f"{sorted(totals) or 'per-position counters'}")
    if per_pos and sorted(per_pos) != list(range(len(per_pos))):
        raise AcceptanceImportError(f"{fmt}: per-position counters skip positions: {sorted(per_pos)}")
    engines = {r[1].get("engine") for r in rows if r[0] == _DRAFTS}
    warnings = [f"summed over {len(engines)} engines"] if len(engines) > 1 else []
    warnings.append("aggregate counters: no per-step accepted lengths")
    return _from_position_counts(fmt, _VLLM_DEF, totals[_DRAFTS], totals.get(_DRAFT_TOKENS), totals[_ACCEPTED],
                                 [per_pos[i] for i in range(len(per_pos))], warnings)


def _vllm_prometheus(data: bytes, model: Optional[str]) -> ImportedAcceptance:
    rows = []
    for name, labels, value in parse_prometheus(_text(data)):
        # counters are exposed as <name>_total (and <name>_created, which is no count)
        if name.endswith("_total"):
            rows.append((name[: -len("_total")], labels, value))
    return _vllm_totals("vllm-prometheus", rows, model)


def _vllm_metrics_json(doc: Any, model: Optional[str]) -> ImportedAcceptance:
    # LLM.get_metrics() returns Python objects (vllm/v1/metrics/reader.py: Counter, Gauge, Vector,
    # Histogram dataclasses); vLLM defines no JSON form. Read here: dataclasses.asdict of each, in a list.
    if not isinstance(doc, list):
        raise AcceptanceImportError("vllm-metrics-json: expected a JSON list of metrics")
    rows = []
    for i, m in enumerate(doc):
        m = _dict(m, f"metric [{i}]")
        name, labels = m.get("name"), m.get("labels") or {}
        if not isinstance(name, str) or not isinstance(labels, dict):
            raise AcceptanceImportError(f"metric [{i}]: needs a string 'name' and an object 'labels'")
        if name.startswith(_SPEC_PREFIX):
            rows.append((name, {str(k): str(v) for k, v in labels.items()}, m.get("values", m.get("value"))))
    return _vllm_totals("vllm-metrics-json", rows, model)


_VLLM_REQ_DEF = ("vLLM records, per request, each verification step's proposed and accepted draft tokens "
                 "(acceptance_histogram[j]: steps that accepted exactly j, bonus token excluded); its "
                 "mean_acceptance_length is 1 + num_accepted_draft_tokens / num_spec_steps, bonus included.")


def _vllm_request(records: list[dict]) -> ImportedAcceptance:
    fmt = "vllm-request"
    specs, skipped = [], 0
    for i, r in enumerate(records):
        sd = (r.get("metrics") or {}).get("speculative_decoding") if isinstance(r.get("metrics"), dict) else None
        if sd is None:
            skipped += 1
            continue
        specs.append((i, _dict(sd, f"response [{i}].metrics.speculative_decoding")))
    if not specs:
        raise AcceptanceImportError(f"{fmt}: no response carries metrics.speculative_decoding (start vLLM with "
                                    "--per-request-spec-decode-metrics summary or detailed; n must be 1)")
    warnings = [f"{skipped} responses without speculative_decoding metrics skipped"] if skipped else []
    steps = accepted_total = drafted_total = 0
    hist: list[int] = []
    k: Optional[int] = None
    per_acc: list[int] = []
    per_draft: list[int] = []
    detailed = True
    for i, sd in specs:
        w = f"response [{i}]"
        h = _counts(sd.get("acceptance_histogram"), f"{w}.acceptance_histogram")
        n = _count(sd.get("num_spec_steps"), f"{w}.num_spec_steps")
        acc = _count(sd.get("num_accepted_draft_tokens"), f"{w}.num_accepted_draft_tokens")
        drafted = _count(sd.get("num_draft_tokens"), f"{w}.num_draft_tokens")
        if sum(h) != n or sum(j * c for j, c in enumerate(h)) != acc:
            raise AcceptanceImportError(f"{fmt}: {w}: inconsistent counts: the histogram gives {sum(h)} steps and "
                                        f"{sum(j * c for j, c in enumerate(h))} accepted tokens, the totals {n} and {acc}")
        if acc > drafted:
            raise AcceptanceImportError(f"{fmt}: {w}: inconsistent counts: {acc} accepted draft tokens but only "
                                        f"{drafted} drafted")
        if sd.get("num_spec_tokens") is not None:
            ks = _count(sd["num_spec_tokens"], f"{w}.num_spec_tokens")
            if k is not None and ks != k:
                warnings.append(f"responses differ in num_spec_tokens ({k} and {ks}); the larger is used")
            k = max(k or 0, ks)
        steps, accepted_total, drafted_total = steps + n, accepted_total + acc, drafted_total + drafted
        hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
        pa, pd = sd.get("per_step_accepted"), sd.get("per_step_drafted")
        if pa is None or pd is None:
            detailed = False
            continue
        pa, pd = _counts(pa, f"{w}.per_step_accepted"), _counts(pd, f"{w}.per_step_drafted")
        if len(pa) != n or len(pd) != n or sum(pa) != acc or sum(pd) != drafted:
            raise AcceptanceImportError(f"{fmt}: {w}: inconsistent counts: per-step arrays disagree with "
                                        "num_spec_steps / num_accepted_draft_tokens / num_draft_tokens")
        per_acc += pa
        per_draft += pd
    if steps == 0:
        raise AcceptanceImportError(f"{fmt}: the responses record no verification steps")
    reported = 1.0 + accepted_total / steps
    if detailed:
        return _from_lengths(fmt, _VLLM_REQ_DEF, per_acc, per_draft, k, reported, warnings)
    if drafted_total < steps * (k or len(hist) - 1):
        warnings.append("some steps proposed fewer than num_spec_tokens drafts; without per-step arrays "
                        "(detailed level) the rates count an unproposed position as not accepted")
    return _from_histogram(fmt, _VLLM_REQ_DEF, hist, k, reported, warnings)


# ---- SGLang -------------------------------------------------------------------------------------

_SGLANG_DEF = ("SGLang counts, per request, verification steps (spec_verify_ct) and accepted draft tokens "
               "(spec_accept_token_num / spec_num_correct_drafts, bonus excluded); spec_accept_histogram[j] is "
               "the steps that accepted exactly j draft tokens, and its spec_accept_length is "
               "completion_tokens / spec_verify_ct, which includes the bonus token and the first token from prefill.")

# field spellings across SGLang versions, first found wins. spec_verify_ct, spec_accept_token_num,
# spec_draft_token_num and spec_accept_histogram were read in SGLang's tokenizer manager; the newer
# spec_num_correct_drafts / spec_num_proposed_drafts / spec_correct_drafts_histogram (with the old names
# kept as aliases) were seen in SGLang-derived source whose file in sgl-project/sglang was not confirmed.
_SG_ACCEPTED = ("spec_accept_token_num", "spec_num_correct_drafts", "spec_accepted_drafts")
_SG_DRAFTED = ("spec_draft_token_num", "spec_num_proposed_drafts", "spec_proposed_drafts")
_SG_HIST = ("spec_accept_histogram", "spec_correct_drafts_histogram")


def _first(meta: dict, keys: tuple[str, ...], where: str, read=_count):
    for key in keys:
        if meta.get(key) is not None:
            return read(meta[key], f"{where}.{key}")
    return None


def _sglang(records: list[dict]) -> ImportedAcceptance:
    fmt = "sglang-meta-info"
    metas: dict[Any, tuple[int, dict]] = {}
    for i, r in enumerate(records):
        meta = r.get("meta_info")
        if not isinstance(meta, dict):
            continue
        # streamed chunks repeat a request's cumulative meta_info: keep its last one
        metas[meta["id"] if isinstance(meta.get("id"), str) else ("#", i)] = (i, meta)
    metas_l = [(i, m) for i, m in metas.values() if m.get("spec_verify_ct") is not None]
    if not metas_l:
        raise AcceptanceImportError(f"{fmt}: no meta_info with spec_verify_ct (was SGLang started with "
                                    "--speculative-algorithm?)")
    warnings = []
    if len(metas) < len(records):
        warnings.append(f"{len(records) - len(metas)} repeated responses of one request (streamed chunks) skipped")
    steps = 0
    accepted: Optional[int] = 0
    completion: Optional[int] = 0
    hist: Optional[list[int]] = []
    for i, meta in metas_l:
        w = f"response [{i}].meta_info"
        n = _count(meta["spec_verify_ct"], f"{w}.spec_verify_ct")
        acc = _first(meta, _SG_ACCEPTED, w)
        drafted = _first(meta, _SG_DRAFTED, w)
        h = _first(meta, _SG_HIST, w, _counts)
        if acc is not None and drafted is not None and acc > drafted:
            raise AcceptanceImportError(f"{fmt}: {w}: inconsistent counts: {acc} accepted draft tokens but only "
                                        f"{drafted} drafted")
        if h is not None and (sum(h) != n or (acc is not None and sum(j * c for j, c in enumerate(h)) != acc)):
            raise AcceptanceImportError(f"{fmt}: {w}: inconsistent counts: the histogram disagrees with "
                                        "spec_verify_ct or the accepted draft tokens")
        if h is None and n > 0:
            hist = None
        elif hist is not None and h is not None:
            hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
        if acc is None and h is not None:
            acc = sum(j * c for j, c in enumerate(h))
        accepted = None if acc is None or accepted is None else accepted + acc
        ct = meta.get("completion_tokens")
        completion = None if ct is None or completion is None else completion + _count(ct, f"{w}.completion_tokens")
        steps += n
    if steps == 0:
        raise AcceptanceImportError(f"{fmt}: spec_verify_ct is 0 in every response (nothing was verified)")
    reported = completion / steps if completion is not None else None
    if hist:
        return _from_histogram(fmt, _SGLANG_DEF, hist, None, reported, warnings)
    warnings.append("no spec_accept_histogram: only the mean accepted length is known, no per-position rates")
    if accepted is not None:
        mean = accepted / steps
    elif completion is not None:
        warnings.append("no accepted-token count: mean taken as completion_tokens / spec_verify_ct - 1, which "
                        "overstates it by the prefill token of each request")
        mean = max(0.0, completion / steps - 1.0)
    else:
        raise AcceptanceImportError(f"{fmt}: meta_info has spec_verify_ct but neither accepted-token counts, "
                                    "a histogram nor completion_tokens")
    return ImportedAcceptance(fmt, _SGLANG_DEF, [], [], mean, steps, None, reported, None, {}, warnings)


# ---- answer JSONL: Spec-Bench, EAGLE, SpecMQuant ------------------------------------------------

_SPECBENCH_DEF = ("Spec-Bench appends, per decoding step, the tokens the step added to the output "
                  "(accept_lengths: accepted draft tokens + the bonus token, so at least 1; the last step of a "
                  "turn may be cut at EOS); 'Mean accepted tokens' is their mean, bonus included.")
_EAGLE_DEF = ("EAGLE records, per turn, the index of the last decoding round (idxs: rounds - 1) and the tokens "
              "generated (new_tokens, each round adding its accepted draft tokens + 1 bonus token); only the mean "
              "new_tokens / rounds, bonus included, can be derived.")
_SPECMQ_TARGET_DEF = ("SpecMQuant accept_lengths: per target verification, the tokens the step added (the draft "
                      "model's accepted sequence tokens + the target's bonus token, so at least 1).")
_SPECMQ_CASCADE_DEF = ("SpecMQuant cascade_accept_lengths: per verification of an EAGLE tree by the draft model, the "
                       "tokens it accepted + its own bonus token (at least 1); recorded by the CUDA drafter and "
                       "read here as including the bonus, as its accept_lengths do.")


def _choices(records: list[dict], fmt: str) -> list[tuple[str, dict]]:
    out = []
    for i, r in enumerate(records):
        ch = r.get("choices")
        if not isinstance(ch, list):
            raise AcceptanceImportError(f"{fmt}: answer [{i}] has no 'choices' list")
        out += [(f"answer [{i}].choices[{j}]", _dict(c, f"answer [{i}].choices[{j}]")) for j, c in enumerate(ch)]
    if not out:
        raise AcceptanceImportError(f"{fmt}: no answer choices in the data")
    return out


def _bonus_lengths(fmt: str, choices: list[tuple[str, dict]], key: str) -> list[int]:
    """Per-step lengths that count the bonus token, made accepted-draft lengths (minus 1)."""
    out = []
    for w, c in choices:
        if key not in c:
            raise AcceptanceImportError(f"{fmt}: {w} has no '{key}'")
        lengths = _counts(c[key], f"{w}.{key}")
        if any(v < 1 for v in lengths):
            raise AcceptanceImportError(f"{fmt}: {w}.{key}: inconsistent counts: a step adds at least its bonus "
                                        "token, so every length must be at least 1")
        out += [v - 1 for v in lengths]
    return out


def _specbench(records: list[dict]) -> ImportedAcceptance:
    fmt = "specbench-jsonl"
    lengths = _bonus_lengths(fmt, _choices(records, fmt), "accept_lengths")
    reported = 1.0 + sum(lengths) / len(lengths) if lengths else None
    return _from_lengths(fmt, _SPECBENCH_DEF, lengths, reported=reported)


def _eagle(records: list[dict]) -> ImportedAcceptance:
    fmt = "eagle-jsonl"
    rounds = tokens = 0
    for w, c in _choices(records, fmt):
        idxs, new = _counts(c.get("idxs"), f"{w}.idxs"), _counts(c.get("new_tokens"), f"{w}.new_tokens")
        if len(idxs) != len(new):
            raise AcceptanceImportError(f"{fmt}: {w}: idxs and new_tokens differ in length")
        rounds += sum(i + 1 for i in idxs)
        tokens += sum(new)
    if tokens < rounds:
        raise AcceptanceImportError(f"{fmt}: inconsistent counts: {tokens} new tokens over {rounds} rounds, but "
                                    "every round adds at least one token")
    mean = tokens / rounds - 1.0
    return ImportedAcceptance(fmt, _EAGLE_DEF, [], [], mean, rounds, None, tokens / rounds, None, {},
                              ["EAGLE answer files hold no per-step accepted lengths: only the mean accepted length "
                               "is known, no per-position rates"])


def _specmquant(records: list[dict]) -> ImportedAcceptance:
    # Both lists are written by SpecMQuant's evaluation/spec_bench/eval.py. That accept_lengths counts the
    # target's bonus token is plain in its Python generate loop; that cascade_accept_lengths counts the
    # draft model's is inferred from its CUDA drafter (it advances the EAGLE root by the value minus one).
    fmt = "specmquant-jsonl"
    choices = _choices(records, fmt)
    seq = _bonus_lengths(fmt, choices, "accept_lengths")
    casc = _bonus_lengths(fmt, choices, "cascade_accept_lengths")
    sequence = _from_lengths(fmt, _SPECMQ_TARGET_DEF, seq, reported=1.0 + sum(seq) / len(seq) if seq else None,
                             warnings=["sequence drafts vary in length (min_draft_length up to min_draft_length + "
                                       "ea_num_iter); the rates count an unproposed position as not accepted"])
    inter = _from_lengths(fmt, _SPECMQ_CASCADE_DEF, casc, reported=1.0 + sum(casc) / len(casc) if casc else None)
    return replace(sequence, levels={"intermediate": inter, "sequence": sequence},
                   warnings=sequence.warnings + ["top level is the target's verification of the sequence drafts; "
                                                 "levels['intermediate'] holds the draft model's tree verification"])


# ---- hierviz traces -----------------------------------------------------------------------------



def _hierviz(data: bytes) -> ImportedAcceptance:
    from hierviz.trace import TraceError, comparison_from_json
    fmt = "hierviz-trace"
    try:
        runs = comparison_from_json(data)
    except TraceError as e:
        raise AcceptanceImportError(f"{fmt}: {e}") from None
    per: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in _HIERVIZ_DEFS}
    for run in runs:
        for s in run.steps:
            if s.index == 0:          # the prefill round drafts nothing the what-if replays
                continue
            for t in s.trees:
                acc, dr = per[t.verifier]
                acc.append(len(t.accepted))
                dr.append(t.depth)
            if s.sequence:
                per["sequence"][0].append(s.target_accepted)
                per["sequence"][1].append(len(s.sequence))
    levels = {k: _from_lengths(fmt, _HIERVIZ_DEFS[k], acc, dr, reported=1.0 + sum(acc) / len(acc))
              for k, (acc, dr) in per.items() if acc}
    if not levels:
        raise AcceptanceImportError(f"{fmt}: the trace has no draft rounds (autoregressive run?)")
    top = next(k for k in ("target", "sequence", "intermediate") if k in levels)
    warnings = list(levels[top].warnings)
    if len(runs) > 1:
        warnings.append(f"{len(runs)} runs pooled per level")
    if len(levels) > 1:
        warnings.append(f"top level is '{top}'; all levels are in levels")
    return replace(levels[top], levels=levels, warnings=warnings)


# ---- reading, detection, dispatch ---------------------------------------------------------------

def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise AcceptanceImportError(f"not UTF-8 text: {e}") from None


def _check_size(size: int) -> None:
    if size > MAX_IMPORT_BYTES:
        raise AcceptanceImportError(f"the data is {size / 2**20:.1f} MB; the limit is {MAX_IMPORT_BYTES / 2**20:.0f} MB")


def _json_doc(data: bytes) -> Any:
    """One JSON document, or JSONL (one per line, SSE 'data: ' prefixes and '[DONE]' allowed) as a list."""
    text = _text(data).strip()
    try:
        return json.loads(text)
    except RecursionError:
        raise AcceptanceImportError("not valid JSON: nested too deeply") from None
    except json.JSONDecodeError as e:
        whole = e
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln[5:].strip() if ln.startswith("data:") else ln for ln in lines]
    lines = [ln for ln in lines if ln and ln != "[DONE]"]
    docs = []
    for n, line in enumerate(lines, 1):
        try:
            docs.append(json.loads(line))
        except (json.JSONDecodeError, RecursionError) as e:
            if n == 1:    # not JSONL either: report the document's own error
                raise AcceptanceImportError(f"not valid JSON (truncated?): {whole}") from None
            raise AcceptanceImportError(f"JSON line {n}: not valid JSON (truncated?): {e}") from None
    return docs


def _records(doc: Any) -> list[dict]:
    items = doc if isinstance(doc, list) else [doc]
    return [x for x in items if isinstance(x, dict)]


def _looks_prometheus(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("# TYPE ") or line.startswith("# HELP "):
            return True
        return bool(_SAMPLE.match(line)) and not line.startswith(("{", "["))
    return False


def _detect_json(doc: Any) -> Optional[str]:
    if isinstance(doc, dict) and doc.get("schema") == RECORD_SCHEMA:
        return "acceptance-record"
    if isinstance(doc, dict) and "version" in doc and ("runs" in doc or ("steps" in doc and "meta" in doc)):
        return "hierviz-trace"
    recs = _records(doc)
    # get_metrics(): Counter/Gauge {name, labels, value}, Vector {.., values}, Histogram {.., count, sum, buckets}
    if isinstance(doc, list) and recs and all(isinstance(r.get("name"), str) and isinstance(r.get("labels"), dict)
                                              for r in recs) and any(r["name"].startswith("vllm:") for r in recs):
        return "vllm-metrics-json"
    if any(isinstance(r.get("metrics"), dict) and "speculative_decoding" in r["metrics"] for r in recs):
        return "vllm-request"
    if any(isinstance(r.get("meta_info"), dict) for r in recs):
        return "sglang-meta-info"
    choices = [c for r in recs if isinstance(r.get("choices"), list) for c in r["choices"] if isinstance(c, dict)]
    if any("cascade_accept_lengths" in c for c in choices):
        return "specmquant-jsonl"
    if any("accept_lengths" in c for c in choices):
        return "specbench-jsonl"
    if any("idxs" in c and "new_tokens" in c for c in choices):
        return "eagle-jsonl"
    return None


def detect_format(data: bytes, name: str = "") -> str:
    """The format id (one of FORMATS) of `data`; `name` (a file name) is used in messages only."""
    _check_size(len(data))
    what = f"{name}: " if name else ""
    text = _text(data).strip()
    if not text:
        raise AcceptanceImportError(f"{what}the data is empty")
    if text[0] not in "{[" and not text.startswith("data:") and _looks_prometheus(text):
        return "vllm-prometheus"
    try:
        fmt = _detect_json(_json_doc(data))
    except AcceptanceImportError as e:
        raise AcceptanceImportError(f"{what}{e}") from None
    if fmt is None:
        raise AcceptanceImportError(f"{what}no speculative-decoding fields recognised; known formats: "
                                    + "; ".join(f"{k} ({v})" for k, v in FORMAT_HELP.items()))
    return fmt


def _parse(data: bytes, fmt: str, model: Optional[str]) -> ImportedAcceptance:
    if fmt == "vllm-prometheus":
        text = _text(data).strip()
        if text[:1] in ("{", "["):
            raise AcceptanceImportError("vllm-prometheus: the data is JSON, not a Prometheus text scrape")
        return _vllm_prometheus(data, model)
    if fmt == "hierviz-trace":
        return _hierviz(data)
    doc = _json_doc(data)
    if fmt == "vllm-metrics-json":
        return _vllm_metrics_json(doc, model)
    if fmt == "acceptance-record":
        return read_record(doc)
    readers = {"vllm-request": _vllm_request, "sglang-meta-info": _sglang, "specbench-jsonl": _specbench,
               "eagle-jsonl": _eagle, "specmquant-jsonl": _specmquant}
    recs = _records(doc)
    if not recs:
        raise AcceptanceImportError(f"{fmt}: expected JSON objects (one, a list, or one per line)")
    return readers[fmt](recs)


def load_acceptance(path_or_bytes: Union[str, Path, bytes], fmt: Optional[str] = None, *,
                    model: Optional[str] = None) -> ImportedAcceptance:
    """Import acceptance data from a file path or its bytes. `fmt`: one of FORMATS, None to detect it.
    `model`: for vLLM counters of several served models, the model_name to read."""
    if fmt is not None and fmt not in FORMAT_HELP:
        raise AcceptanceImportError(f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}")
    name = ""
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data = bytes(path_or_bytes)
    else:
        p = Path(path_or_bytes)
        name = p.name
        try:
            _check_size(p.stat().st_size)
            data = p.read_bytes()
        except OSError as e:
            raise AcceptanceImportError(f"cannot read {name or p}: {e.strerror}") from None
    _check_size(len(data))
    if not data.strip():
        raise AcceptanceImportError(f"{name + ': ' if name else ''}the data is empty")
    use = fmt or detect_format(data, name)
    try:
        return _parse(data, use, model)
    except AcceptanceImportError as e:
        hint = "" if fmt is None else f" (read as {fmt}; is that its format?)"
        raise AcceptanceImportError(f"{name + ': ' if name else ''}{e}{hint}") from None
    # malformed values a checked reader did not anticipate: still the importer's error, never a crash
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, RecursionError, OverflowError,
            ZeroDivisionError) as e:
        raise AcceptanceImportError(f"{name + ': ' if name else ''}malformed {use} data: {e}") from None
