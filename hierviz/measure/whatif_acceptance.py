"""Where a what-if's accept/reject decisions come from (hierviz.measure.whatif): a recorded trace's
accepted lengths replayed in order, per-depth rates drawn with a seeded generator, or a
deployment's acceptance (hierviz.measure.acceptance_import) turned into such rates."""
from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any, Callable, Optional

from hierviz import methods
from hierviz.decoding.tree import Tree
from hierviz.decoding.verify import AcceptOracle
from hierviz.measure.common import MeasureError, probabilities
from hierviz.trace import Step, TraceError, comparison_from_json

# Default rates when neither a trace nor rates are given. They are an assumption, not a
# measurement: per-depth conditional acceptance giving EAGLE-2 tau 3.93 at its depth-6 tree, between
# the EAGLE-3 paper's EAGLE-2 figures for LLaMA-Instruct 3.3 70B (3.67) and 3.1 8B (4.05) on
# MT-bench (assets/whatif/acceptance/eagle2-arxiv-2503.01840.json); see docs/whatif.md.
DEFAULT_RATES = (0.9, 0.8, 0.75, 0.7, 0.65, 0.6)
DEFAULT_SEQ_RATE = 0.85   # T accepting each of M's draft tokens (Llama-3-8B drafting for 70B): assumption
ACCEPTANCE_DIR = Path(__file__).resolve().parents[2] / "assets" / "whatif" / "acceptance"
# EAGLE-3's published acceptance, per level: what the what-if's EAGLE-3-drafted trees draw from
# when no acceptance is given (--eagle3-acceptance)
EAGLE3_RECORD = ACCEPTANCE_DIR / "eagle3-arxiv-2503.01840.json"
ASSUMED = "assumed default rates"


def accepted_lengths(steps: list[Step]) -> list[dict[str, Any]]:
    """Per decode round (prefill excluded): the accepted tree path lengths (verifier M for
    HierSpec, T for EAGLE-2) and the target's accepted count for sequence drafts."""
    out = []
    for s in steps:
        if s.index == 0:
            continue
        row: dict[str, Any] = {"trees": [len(t.accepted) for t in s.trees]}
        if methods.get(s.method).target_verifies == methods.SEQUENCE:
            row["target"] = s.target_accepted
        out.append(row)
    return out


class ReplayOracle(AcceptOracle):
    """Replays a trace's accepted lengths in order, per level; wraps around when the what-if
    asks for more rounds than the trace has (the report's `replay` gives both round counts)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.trees = [n for r in rows for n in r["trees"]]
        self.seq = [r["target"] for r in rows if "target" in r]
        self.i_tree = self.i_seq = 0

    def _next(self, q: list[int], attr: str) -> int:
        i = getattr(self, attr)
        if not q:
            return 0
        setattr(self, attr, i + 1)
        return q[i % len(q)]

    def tree(self, level: str, tree: Tree) -> int:
        return self._next(self.trees, "i_tree")

    def sequence(self, level: str, draft: list[int]) -> int:
        return self._next(self.seq, "i_seq")


class RatesOracle(AcceptOracle):
    """Tree level: depth d is accepted (given d-1 was) with probability rates[d-1] (the last
    rate repeats). Sequence level: each of M's draft tokens with probability seq_rate."""

    def __init__(self, rates: list[float], seq_rate: float, seed: int, m_rates: Optional[list[float]] = None) -> None:
        self.rates, self.m_rates, self.seq_rate = list(rates), list(m_rates or rates), seq_rate
        self.rng = random.Random(seed)

    def _run(self, rates: list[float], most: int) -> int:
        n = 0
        while n < most and self.rng.random() < rates[min(n, len(rates) - 1)]:
            n += 1
        return n

    def tree(self, level: str, tree: Tree) -> int:
        return self._run(self.m_rates if level == "intermediate" else self.rates, max(tree.depths, default=0))

    def sequence(self, level: str, draft: list[int]) -> int:
        return self._run([self.seq_rate], len(draft))


def load_acceptance_trace(path: str) -> dict[str, list[dict[str, Any]]]:
    """Accepted lengths per method from a trace or comparison file, plus each run's settings."""
    try:
        runs = comparison_from_json(Path(path).read_bytes())
    except OSError as e:
        raise MeasureError(f"cannot read acceptance trace {path}: {e.strerror}") from None
    except TraceError as e:
        raise MeasureError(f"acceptance trace {path}: {e}") from None
    out: dict[str, Any] = {}
    for t in runs:
        m = t.meta.get("method") or (t.steps[0].method if t.steps else None)
        if m and m not in out:
            out[m] = {"rows": accepted_lengths(t.steps), "settings": t.meta.get("settings", {}),
                      "tokens": sum(len(s.new_tokens) for s in t.steps), "stack": t.meta.get("stack")}
    return out


OracleMaker = Callable[[str], Optional[AcceptOracle]]


def oracle_factory(a: argparse.Namespace, trace: Optional[dict[str, Any]], scale: float = 1.0
                   ) -> tuple[OracleMaker, dict[str, Any]]:
    """A fresh oracle per run of a row (a method or a variant; same seed per method: every run of
    a method draws the same luck), and the rates it draws from; a row that drafts nothing gets
    none. Trees an EAGLE-3 head drafts draw from the EAGLE-3 record's level of their verifier
    where the run has one (a.eagle3_record, see eagle3_record)."""
    rates = [min(1.0, r * scale) for r in probabilities(a.acceptance_rates, "--acceptance-rates")] \
        if a.acceptance_rates else [min(1.0, r * scale) for r in DEFAULT_RATES]
    m_rates = [min(1.0, r * scale) for r in probabilities(a.m_acceptance_rates, "--m-acceptance-rates")] \
        if a.m_acceptance_rates else None
    seq = min(1.0, a.seq_rate * scale)
    record = getattr(a, "eagle3_record", None)
    e3 = {k: [min(1.0, r * scale) for r in v] for k, v in record["rates"].items()} if record else {}

    def row_rates(row: str) -> tuple[list[float], Optional[list[float]]]:
        t_head, m_head = tree_heads(row, getattr(a, "head", None))
        return (e3["target"] if t_head == "eagle3" and e3 else rates,
                e3["intermediate"] if m_head == "eagle3" and e3 else m_rates)

    def make(row: str) -> Optional[AcceptOracle]:
        method = methods.row_method(row)
        if methods.get(method).target_verifies == methods.TOKEN:
            return None
        if trace is not None:
            return ReplayOracle(trace[method]["rows"])
        t_rates, m_row_rates = row_rates(row)
        return RatesOracle(t_rates, seq, method_seed(a.seed, method), m_row_rates)
    return make, {"rates": rates, "m_rates": m_rates or rates, "seq_rate": seq,
                  "given": bool(a.acceptance_rates or a.m_acceptance_rates),
                  **({"eagle3": {**record, "rates": e3}} if record else {})}


def tree_heads(row: str, head: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(head type drafting the trees T verifies, head type drafting the trees M verifies) in a
    row; None where it drafts no tree for that verifier. `head`: the run's --head (E_M's type; None:
    EAGLE-2's, the default run's HierSpec), which a variant row replaces in the slots it names."""
    from hierviz.models.drafter import HEAD_SLOTS
    swapped = dict(methods.VARIANTS[row].heads) if row in methods.VARIANTS else {}
    t_head = m_head = None
    for slot in methods.get(methods.row_method(row)).needs:
        if slot not in HEAD_SLOTS:
            continue
        base, kind = HEAD_SLOTS[slot]
        kind = swapped.get(slot) or kind or head or methods.PEER
        if base == "target":
            t_head = kind
        else:
            m_head = kind
    return t_head, m_head


def eagle3_record(a: argparse.Namespace, tree_depths: Callable[[], tuple[int, int]]) -> Optional[dict[str, Any]]:
    """--eagle3-acceptance: the acceptance record EAGLE-3-drafted trees draw from, as the outputs
    record it (source, citation, per-level rates), or None. Default: the shipped record (the
    EAGLE-3 paper's), unless another acceptance source is given, which then holds for every tree;
    "none": EAGLE-3 trees draw as EAGLE-2's. A level known only by its mean is spread over its draft
    length, else over the depth of the trees it stands for (tree_depths(): E_T's, E_M's; level_rates)."""
    choice = getattr(a, "eagle3_acceptance", None)
    if choice == "none" or (choice is None and (a.acceptance or a.acceptance_rates or a.m_acceptance_rates
                                                or getattr(a, "acceptance_import", None))):
        return None
    if a.acceptance:
        raise MeasureError("--eagle3-acceptance gives rates: it does not combine with a replayed --acceptance trace")
    from hierviz.measure.acceptance_import import AcceptanceImportError, load_acceptance
    path = Path(choice) if choice else EAGLE3_RECORD
    try:
        imp = load_acceptance(path)
    except AcceptanceImportError as e:
        raise MeasureError(f"--eagle3-acceptance {path}: {e}") from None
    target = imp.levels.get("target", imp)
    m = imp.levels.get("intermediate", target)
    t_depth, m_depth = tree_depths()
    return {"source": _relative(path), "citation": imp.citation or f"{imp.source_format} file {path.name}",
            "format": imp.source_format, "definition": imp.definition,
            "rates": {"target": level_rates(target, t_depth), "intermediate": level_rates(m, m_depth)},
            "published_tau": {k: lv.reported_mean_length for k, lv in (("target", target), ("intermediate", m))}}


def _relative(path: Path) -> str:
    """A path as the outputs name it: relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ACCEPTANCE_DIR.parents[2]))
    except ValueError:
        return str(path)


def row_acceptance(row: str, info: dict[str, Any], head: Optional[str]) -> str:
    """Where a row's accept/reject decisions came from, in one line for tables and charts."""
    method = methods.row_method(row)
    if methods.get(method).target_verifies == methods.TOKEN:
        return "none (one token per target forward)"
    if info.get("mode") == "trace":
        return f"replayed from trace {Path(str(info.get('source', '?'))).name} ({method}'s run)"
    record = info.get("eagle3")
    used = [(lvl, who) for lvl, who, kind in zip(("target", "intermediate"), ("T", "M"), tree_heads(row, head))
            if kind == "eagle3"]
    if record and used:
        taus = record.get("published_tau") or {}
        per = ", ".join(f"τ {taus[lvl]:g} for {who}'s trees" for lvl, who in used if taus.get(lvl))
        return f"{record['citation']}" + (f", {per}" if per else "") + f" ({record['source']})"
    imported = info.get("imported")
    if imported:
        return f"imported from {imported.get('format', '?')} file {Path(str(imported.get('source', '?'))).name}"
    return "given rates (--acceptance-rates)" if info.get("given") else ASSUMED


def method_seed(seed: int, method: str) -> int:
    """A stable per-method seed (Python's str hash is salted per process): the method's place
    among the registered methods that keep their own acceptance record. One priced with another's
    record (Method.acceptance_as: EAGLE-3's tree as EAGLE-2's) draws that method's: T's tree gets
    the same forced decisions whichever head type drafts it."""
    own = [m for m in methods.names() if methods.get(m).acceptance_as is None]
    return seed * 1000 + own.index(methods.get(method).acceptance_as or method)



def scaled_shape_rates(shape: tuple[float, ...], mean_accepted: float, depth: int) -> list[float]:
    """`shape` times the one factor s (each rate capped at 1) whose chain of `depth` positions
    accepts `mean_accepted` draft tokens on average: a published mean spread like the shape."""
    from hierviz.measure.acceptance_record import expected_accepted
    lo, hi = 0.0, 1.0 / min(shape)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted([min(1.0, mid * r) for r in shape], depth) < mean_accepted else (lo, mid)
    return [min(1.0, (lo + hi) / 2 * r) for r in shape]


def constant_rate(mean_accepted: float, draft_length: int) -> float:
    """The per-position rate r with r + r^2 + ... + r^K = the mean accepted length (K = draft_length):
    one rate standing for a level known only by its mean."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= draft_length:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** k for k in range(1, draft_length + 1)) < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def level_rates(level: Any, depth: int, notes: Optional[list[str]] = None) -> list[float]:
    """An imported level's per-depth conditional rates; a level known only by its mean gets one
    rate, the mean spread over its draft length, else over `depth` (the run's tree depth, said in
    `notes`)."""
    if level.rates:
        return list(level.rates)
    if not level.draft_length and notes is not None:
        notes.append(f"draft length unknown: the mean is spread over {depth} positions (the run's tree depth)")
    return [constant_rate(level.mean_accepted_length, level.draft_length or depth)]


def apply_imported_acceptance(a: argparse.Namespace, tree_depth: Callable[[], int]) -> Optional[dict[str, Any]]:
    """--acceptance-import: the file's rates become --acceptance-rates (the target's level),
    --m-acceptance-rates (an intermediate level) and --seq-rate (a sequence level); a level known
    only by its mean gets the one rate that gives that mean, over tree_depth() positions (the
    run's E_T depth) where the file gives no draft length. Returns what the outputs record."""
    if not a.acceptance_import:
        return None
    from hierviz.measure.acceptance_import import AcceptanceImportError, load_acceptance
    if a.acceptance or a.acceptance_rates or a.m_acceptance_rates:
        raise MeasureError("give one source of acceptance: --acceptance-import, --acceptance or --acceptance-rates")
    try:
        imp = load_acceptance(Path(a.acceptance_import), a.acceptance_format, model=a.acceptance_model)
    except AcceptanceImportError as e:
        raise MeasureError(f"--acceptance-import {a.acceptance_import}: {e}") from None
    except OSError as e:
        raise MeasureError(f"cannot read {a.acceptance_import}: {e.strerror}") from None

    warnings = list(imp.warnings)
    depth = tree_depth()

    def rates_of(level: Any) -> list[float]:
        return level_rates(level, depth, warnings)

    top = imp.levels.get("target", imp)
    if "target" not in imp.levels and "sequence" in imp.levels:
        warnings.append("no tree level verified by the target: T's tree rates are the sequence level's")
    if not rates_of(top) or (top.steps == 0 and not top.rates):    # a record has rates but no steps
        raise MeasureError(f"--acceptance-import {a.acceptance_import}: no verification steps to take rates from")
    a.acceptance_rates = ",".join(f"{r:.6f}" for r in rates_of(top))
    if "intermediate" in imp.levels:
        a.m_acceptance_rates = ",".join(f"{r:.6f}" for r in rates_of(imp.levels["intermediate"]))
    if "sequence" in imp.levels:
        seq = imp.levels["sequence"]
        a.seq_rate = constant_rate(seq.mean_accepted_length, seq.draft_length or max(1, len(seq.rates)))
    return {"source": a.acceptance_import, "format": imp.source_format, "definition": imp.definition,
            "steps": imp.steps, "mean_accepted_length": imp.mean_accepted_length, "rates": list(imp.rates),
            "levels": sorted(imp.levels), "warnings": warnings, **({"citation": imp.citation} if imp.citation else {})}

