"""Re-timing a trace at real scale: the same tokens and accept decisions, priced at Llama-3 sizes.

A small stack (a 135M target) cannot show what HierSpec is for: its forward pass costs the same
for 1 token or 64. This module keeps a trace's tokens, trees, sequences and verdicts and replaces
every step's stage times with what those forwards cost on an H200 at real shapes, from the
recorded profiles in assets/profile/: T = Llama-3-70B W4A16 (Triton kernel), M = Llama-3-8B W4A16.

Pricing per step (every result is a projection, labelled "projected" wherever shown):
- EAGLE-2: the tree (its nodes + the root) through T in one forward, plus the draft head per depth;
- HierSpec: each tree (nodes + root) through M, the sequence draft (+ the root) through T, plus the
  draft head per depth;
- sequence speculation: M drafts one token per forward, T verifies the sequence (+ the root);
- AR, and every method's prefill round: one T forward of one token (and one M forward where it ran M).
The forward time between two measured token counts is interpolated linearly.

Also here: like-for-like comparison of runs (the time each took to produce its first N tokens), so
that no headline ratio ever compares runs that produced different numbers of tokens.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hierviz.methods import SUBJECT, in_comparison_order
from hierviz.trace import Step, Trace, trace_stats

ROOT = Path(__file__).resolve().parent.parent
TARGET_PROFILE = ROOT / "assets" / "profile" / "h200.json"              # Llama-3-70B shapes
INTERMEDIATE_PROFILE = ROOT / "assets" / "profile" / "h200-llama3-8b.json"
PROFILE_KERNEL = "triton"       # the 4-bit kernel the decoders use on a GPU: its whole-model series is priced

# One EAGLE draft-head forward (one tree depth) at these shapes: the shipped what-if runs on the
# H200 measured 50.3 ms of drafting over 343 E_M forwards and 36.1 ms over 249 E_T forwards
# (assets/whatif/h200-llama3-70b-paper-trees-triton.json), 0.145-0.147 ms each; rounded up.
DRAFT_HEAD_MS = 0.15

MEASURED = "as measured on this machine"
RETIMED = "re-timed at real scale (projected)"
TIME_SCALES = (MEASURED, RETIMED)


@dataclass(frozen=True)
class ForwardCost:
    """Forward latency of one model against the number of tokens it verifies in that forward."""
    name: str
    tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def at(self, n_tokens: int) -> float:
        """Latency for n_tokens, linear between measured counts; flat below the first, the last
        segment's slope beyond the last (a bigger batch only costs more)."""
        n = max(n_tokens, self.tokens[0])
        i = bisect.bisect_left(self.tokens, n)
        if i < len(self.tokens) and self.tokens[i] == n:
            return self.ms[i]
        i = min(max(i, 1), len(self.tokens) - 1)
        t0, t1, y0, y1 = self.tokens[i - 1], self.tokens[i], self.ms[i - 1], self.ms[i]
        return y0 + (y1 - y0) * (n - t0) / (t1 - t0)


@dataclass(frozen=True)
class CostModel:
    target: ForwardCost
    intermediate: ForwardCost
    draft_head_ms: float
    device: str

    def label(self) -> str:
        return f"T {self.target.name} W4A16 · M {self.intermediate.name} W4A16 on {self.device}"


def profile_cost(profile: dict, kernel: str = PROFILE_KERNEL) -> ForwardCost:
    """The whole-model series of a recorded profile (hierviz.profile/1) through `kernel`, in ms."""
    series = next(s for s in profile["series"] if s.get("kernel") == kernel and s["scope"] == "model")
    return ForwardCost(profile_shape_name(profile["shape"]), tuple(profile["tokens"]),
                       tuple(us / 1000.0 for us in series["us"]))


def profile_shape_name(shape: str) -> str:
    return {"llama3-70b": "Llama-3-70B", "llama3-8b": "Llama-3-8B"}.get(shape, shape)


@functools.cache
def real_scale_costs() -> CostModel:
    """The shipped H200 profiles, read once."""
    target = json.loads(TARGET_PROFILE.read_text(encoding="utf-8"))
    intermediate = json.loads(INTERMEDIATE_PROFILE.read_text(encoding="utf-8"))
    return CostModel(profile_cost(target), profile_cost(intermediate), DRAFT_HEAD_MS, target.get("device", "GPU"))


def real_scale_available() -> bool:
    """Whether the profiles re-timing reads are shipped and readable."""
    try:
        real_scale_costs()
        return True
    except (OSError, ValueError, KeyError, StopIteration, TypeError):
        return False


# ---- pricing one step ----------------------------------------------------------------------------

BASE_PARTS = {"target", "intermediate"}     # Step.forwards keys of base models; every other key is a draft head


def draft_depths(step: Step) -> int:
    """Draft-head forwards of a step: the recorded count, else one per depth of each tree."""
    recorded = sum(n for part, n in step.forwards.items() if part not in BASE_PARTS)
    if recorded:
        return recorded
    return sum(t.depth for t in step.trees)


def step_cost_ms(step: Step, costs: CostModel) -> dict[str, float]:
    """The step's stage times at real scale (keys from trace.STAGES; overhead is not priced)."""
    draft = costs.draft_head_ms * draft_depths(step)
    m_trees = [t for t in step.trees if t.verifier == "intermediate"]
    t_trees = [t for t in step.trees if t.verifier == "target"]
    if step.sequence and not m_trees:
        # a sequence draft without trees (sequence speculation): M drafts one token per forward, T verifies the sequence (+ the root)
        m_forwards = step.forwards.get("intermediate", len(step.sequence))
        return {"draft": costs.intermediate.at(1) * m_forwards, "intermediate_verify": 0.0,
                "target_verify": costs.target.at(len(step.sequence) + 1), "overhead": 0.0}
    if m_trees or step.sequence:
        # HierSpec: M verifies every tree, T verifies the sequence (+ the last accepted token)
        m_ms = sum(costs.intermediate.at(len(t.nodes) + 1) for t in m_trees)
        return {"draft": draft, "intermediate_verify": m_ms,
                "target_verify": costs.target.at(len(step.sequence) + 1), "overhead": 0.0}
    if t_trees:
        t_ms = sum(costs.target.at(len(t.nodes) + 1) for t in t_trees)
        return {"draft": draft, "intermediate_verify": 0.0, "target_verify": t_ms, "overhead": 0.0}
    # AR, or a prefill round: T picks one token (plus one M forward where the round ran M)
    m_ms = costs.intermediate.at(1) if step.forwards.get("intermediate") else 0.0
    return {"draft": 0.0, "intermediate_verify": m_ms, "target_verify": costs.target.at(1), "overhead": 0.0}


def retime_trace(trace: Trace, costs: Optional[CostModel] = None) -> Trace:
    """A copy of the trace whose step times are priced at real scale; tokens and decisions unchanged.
    Its meta says so ("time_scale", "retimed_on"), so every view of it can label it projected."""
    costs = costs or real_scale_costs()
    steps = [replace(s, timings_ms=step_cost_ms(s, costs)) for s in trace.steps]
    meta = {**trace.meta, "time_scale": RETIMED, "retimed_on": costs.label(), "measured_device": trace.meta.get("device"),
            "measured_gpu": trace.meta.get("gpu")}
    return replace(trace, meta=meta, steps=steps, prefill_ms=0.0)


def is_small_stack(meta: dict) -> bool:
    """The offline SmolLM2-135M stack: too small a target to show what HierSpec is for."""
    return str(meta.get("stack", "")).startswith("smollm2")


def default_time_scale(runs: list[Trace]) -> str:
    """Re-timed at real scale for a small stack recorded on a GPU (its measured times cannot show the
    method, as on the trace the app opens on); as measured for everything else."""
    return default_time_scale_of([t.meta for t in runs])


def default_time_scale_of(metas: list[dict]) -> str:
    """default_time_scale of runs with these metas ("stack" and "device" decide; a live run knows
    both before its first step)."""
    small_on_gpu = bool(metas) and all(is_small_stack(m) and m.get("device") == "cuda" for m in metas)
    return RETIMED if small_on_gpu and real_scale_available() else MEASURED


def at_time_scale(traces: list[Trace], time_scale: str = MEASURED) -> list[Trace]:
    """The runs as measured, or re-timed at real scale (the choice the app offers)."""
    if time_scale != RETIMED or not real_scale_available():
        return list(traces)
    # always re-priced: the price depends only on the tokens and trees, and a trace's meta is not trusted
    return [retime_trace(t) for t in traces]


# ---- like-for-like comparison ---------------------------------------------------------------------

def tokens_of(steps: list[Step]) -> int:
    return sum(len(s.new_tokens) for s in steps)


def time_to_tokens_ms(steps: list[Step], n_tokens: int) -> Optional[float]:
    """Time the run took until its output held n_tokens tokens (the end of the step that produced
    the n-th; a step's tokens arrive together); None when it never got there."""
    elapsed, produced = 0.0, 0
    for s in steps:
        elapsed += s.step_ms
        produced += len(s.new_tokens)
        if produced >= n_tokens:
            return elapsed
    return None


@dataclass(frozen=True)
class Ratio:
    """HierSpec's speed relative to another run over the same first n_tokens tokens."""
    other: str
    n_tokens: int
    hierspec_ms: float
    other_ms: float

    @property
    def speedup(self) -> float:
        return self.other_ms / self.hierspec_ms


def equal_token_ratios(runs: dict[str, list[Step]]) -> list[Ratio]:
    """HierSpec against every other run at N = the fewest tokens any of them produced (the steps
    given: up to the inspected step, or what has streamed so far). A run with no tokens yet (one
    still waiting for its turn) is left out rather than holding N at 0."""
    runs = {m: steps for m, steps in runs.items() if tokens_of(steps) > 0}
    hs = runs.get(SUBJECT)
    others = in_comparison_order([m for m in runs if m != SUBJECT])
    if not hs or not others:
        return []
    n = min(tokens_of(s) for s in runs.values())
    ratios = []
    for m in others:
        hs_ms, other_ms = time_to_tokens_ms(hs, n), time_to_tokens_ms(runs[m], n)
        # a ratio that over- or underflows (absurd stage times in a loaded file) says nothing
        if hs_ms and other_ms and 0.0 < other_ms / hs_ms < math.inf:
            ratios.append(Ratio(m, n, hs_ms, other_ms))
    return ratios


def tokens_per_s(steps: list[Step], n_tokens: Optional[int] = None) -> float:
    """Throughput over the first n_tokens (default: all the steps' tokens)."""
    n = tokens_of(steps) if n_tokens is None else n_tokens
    ms = time_to_tokens_ms(steps, n) if n else None
    return 1000.0 * n / ms if ms else 0.0


# ---- the real-scale what-if result the app quotes --------------------------------------------------

WHATIF_HEADLINE = ROOT / "assets" / "whatif" / "h200-llama3-70b-paper-trees.json"   # docs/whatif.md
WHATIF_SWEEP = ROOT / "assets" / "whatif" / "h200-llama3-70b-sweep.json"


@functools.cache
def whatif_headline() -> Optional[dict[str, float]]:
    """HierSpec's speedups in the shipped what-if result at the paper's settings (Llama-3-70B/8B
    shapes on an H200, the default acceptance rates, EAGLE-3's published ones for its rows): other
    method -> HierSpec's speedup over it, in comparison order, for every method the file ran; None
    if not shipped. The What-if tab opens with the same file."""
    try:
        d = json.loads(WHATIF_HEADLINE.read_text(encoding="utf-8"))
        ms = d["methods"]
        hs = float(ms[SUBJECT]["tokens_per_s"])
        return {m: hs / float(ms[m]["tokens_per_s"]) for m in in_comparison_order([m for m in ms if m != SUBJECT])}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


# ---- a run's acceptance, on the what-if sweep's scale ------------------------------------------------

def sequence_acceptance(steps: list[Step]) -> Optional[float]:
    """How often T accepted a token of M's sequence draft, over the tokens it checked (every
    accepted one, plus the one it rejected when it rejected one); None without sequence drafts."""
    accepted = checked = 0
    for s in steps:
        if s.sequence:
            accepted += s.target_accepted
            checked += s.target_accepted + (1 if s.target_accepted < len(s.sequence) else 0)
    return accepted / checked if checked else None


def acceptance_scale(traces: list[Trace], base_rates: list[float], base_seq_rate: Optional[float],
                     depths: int = 3) -> Optional[float]:
    """A run's acceptance as the what-if sweep measures it: the mean, over its trees' depths 1..depths
    (the sweep's trees are 3 deep) and its sequence draft, of the measured conditional rate divided by
    the sweep's base rate at that place. None when the runs hold no drafts."""
    ratios = []
    for t in traces:
        per_depth = trace_stats(t.steps)["per_depth_acceptance"]
        ratios += [per_depth[d] / base_rates[min(d, len(base_rates)) - 1]
                   for d in range(1, depths + 1) if d in per_depth and base_rates]
        seq = sequence_acceptance(t.steps)
        if seq is not None and base_seq_rate:
            ratios.append(seq / base_seq_rate)
    return sum(ratios) / len(ratios) if ratios else None
