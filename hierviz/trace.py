"""The trace: the only thing the UI knows about decoding.

One JSON document per run: metadata plus a list of steps. Each decoder yields one `Step` per
round. Stats (tokens/s, tau per level, per-depth acceptance) are derived from the steps, never
stored twice. The schema is versioned; loading rejects unknown versions, oversized files and
malformed documents with a `TraceError` whose message is fit to show a user.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from hierviz.methods import METHODS
from hierviz.settings import DecodeSettings, SettingsError

SCHEMA_VERSION = 1
MAX_TRACE_BYTES = 20 * 1024 * 1024
# Stage names used in Step.timings_ms. "draft" is E_M (hierspec), E_T (eagle2) or M's
# autoregressive drafting (spec); "intermediate_verify" is M verifying E_M's trees;
# "target_verify" is every forward of the target T; "overhead" is everything else in the round.
STAGES = ("draft", "intermediate_verify", "target_verify", "overhead")
SOURCES = ("tree", "intermediate_bonus", "draft", "target_bonus")


class TraceError(ValueError):
    """A trace that cannot be used; the message says why in words a user understands."""


@dataclass
class TreeNode:
    id: int          # 1..S; 0 is the root (the last accepted token), which is not listed
    token: int
    text: str
    parent: int      # 0 for children of the root
    depth: int       # 1..D
    score: float     # cumulative log-prob under the drafter (EAGLE-2's ranking key)
    logprob: float   # this node's own log-prob under the drafter given its parent


@dataclass
class DraftTree:
    root_token: int
    root_text: str
    nodes: list[TreeNode]
    accepted: list[int]          # node ids of the verifier's accepted path, root excluded
    bonus_token: int             # the verifier's own token after the accepted path
    bonus_text: str
    verifier: str                # "intermediate" (hierspec) or "target" (eagle2, eagle3)
    # the verifier rejected the accepted path's children and its own token lies outside the
    # head's draft vocabulary (FR-Spec list, EAGLE-3 d2t): a rejection no draft could avoid
    undraftable: bool = False

    @property
    def depth(self) -> int:
        """How many levels the tree drafted (0 for an empty tree)."""
        return max((n.depth for n in self.nodes), default=0)


@dataclass
class SeqToken:
    token: int
    text: str
    source: str                  # one of SOURCES
    tree: Optional[int] = None   # index into Step.trees for source "tree"/"intermediate_bonus"


@dataclass
class Step:
    index: int
    method: str
    new_tokens: list[int]                  # tokens appended to the output this step, in order
    new_text: list[str]
    new_sources: list[str]                 # who produced each new token (SOURCES)
    timings_ms: dict[str, float]           # keys from STAGES
    trees: list[DraftTree] = field(default_factory=list)
    sequence: list[SeqToken] = field(default_factory=list)   # sequence draft the target verified
    target_accepted: int = 0               # draft tokens the target accepted this step
    target_bonus: Optional[int] = None     # the target's correction / bonus token
    target_bonus_text: str = ""
    forwards: dict[str, int] = field(default_factory=dict)  # "target", "intermediate", "e_m", "e_t"

    @property
    def step_ms(self) -> float:
        return float(sum(self.timings_ms.values()))


@dataclass
class Trace:
    meta: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    output_text: str = ""
    finish_reason: str = ""
    version: int = SCHEMA_VERSION

    # ---- derived statistics ------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return trace_stats(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")


def output_tokens(trace: Trace, steps: Optional[list[Step]] = None) -> list[int]:
    """The token ids a run produced (of `steps`, a prefix of its steps, when given)."""
    return [t for s in (trace.steps if steps is None else steps) for t in s.new_tokens]


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first position where two outputs differ, over their common length (one may have stopped
    earlier, or be shown up to an earlier step); None when that common part is identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def count_depth_acceptance(trees: list[DraftTree], reached: dict[int, int], accepted: dict[int, int]) -> None:
    """Add trees to per-depth counters: depth d was tried when the accepted path reached depth d-1
    and the tree has nodes at depth d; it was accepted when the path reached d."""
    for t in trees:
        n_acc = len(t.accepted)
        for d in range(1, min(t.depth, n_acc + 1) + 1):
            reached[d] = reached.get(d, 0) + 1
            if n_acc >= d:
                accepted[d] = accepted.get(d, 0) + 1


def target_draft_len(sequence: list, trees: list[DraftTree]) -> int:
    """The draft the target verified in a step: the sequence draft, else the deepest path of a
    target-verified tree (EAGLE-2); 0 for AR and prefill rounds."""
    if sequence:
        return len(sequence)
    return max((t.depth for t in trees if t.verifier == "target"), default=0)


def tree_rejected(tree: DraftTree) -> bool:
    """Whether the verifier turned down every child of its accepted path's last node (the root
    when it accepted none); False when that node has no children (the path used the whole tree)."""
    last = tree.accepted[-1] if tree.accepted else 0
    return any(n.parent == last for n in tree.nodes)


def trace_stats(steps: list[Step]) -> dict[str, Any]:
    """tokens/s, tau per level and per-depth acceptance, derived from steps."""
    n_tokens = sum(len(s.new_tokens) for s in steps)
    total_ms = sum(s.step_ms for s in steps)
    target_fw = sum(s.forwards.get("target", 0) for s in steps)
    stage_ms = {k: sum(s.timings_ms.get(k, 0.0) for s in steps) for k in STAGES}
    m_trees = [t for s in steps for t in s.trees if t.verifier == "intermediate"]
    all_trees = [t for s in steps for t in s.trees]
    reached: dict[int, int] = {}
    accepted: dict[int, int] = {}
    count_depth_acceptance(all_trees, reached, accepted)
    per_depth = {d: accepted.get(d, 0) / reached[d] for d in sorted(reached)}
    drafts = [s.sequence for s in steps if s.sequence]
    rejections = sum(1 for t in all_trees if tree_rejected(t))
    return {
        "new_tokens": n_tokens,
        "steps": len(steps),
        "total_ms": total_ms,
        "tokens_per_s": (1000.0 * n_tokens / total_ms) if total_ms > 0 else 0.0,
        "tau_target": (n_tokens / target_fw) if target_fw else 0.0,
        "tau_intermediate": (sum(len(t.accepted) + 1 for t in m_trees) / len(m_trees)) if m_trees else None,
        # over the rounds that drafted a sequence (not the prefill, and nothing for EAGLE-2 / AR)
        "mean_sequence_len": (sum(len(s) for s in drafts) / len(drafts)) if drafts else 0.0,
        "per_depth_acceptance": per_depth,
        "stage_ms": stage_ms,
        # trees whose verifier turned down every child of its accepted path's last node, and of
        # those the ones where its own token was outside the head's draft vocabulary
        "tree_rejections": rejections,
        "undraftable_rejections": sum(1 for t in all_trees if t.undraftable),
    }


# ---- loading and validation --------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)      # JSON true/false are no counts or ids


def _req(d: Any, key: str, typ, where: str):
    if not isinstance(d, dict):
        raise TraceError(f"{where}: expected an object")
    if key not in d:
        raise TraceError(f"{where}: missing field '{key}'")
    v = d[key]
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise TraceError(f"{where}.{key}: expected {getattr(typ, '__name__', typ)}, got {type(v).__name__}")
    return v


def _opt(d: dict, key: str, typ, where: str, default=None):
    if d.get(key) is None:
        return default
    return _req(d, key, typ, where)


def _in_range(v: Any, name: str, lo: float, hi: Optional[float] = None) -> Any:
    """v (an int, or a float, which must also be finite) within [lo, hi]; hi None: no upper bound."""
    finite = not isinstance(v, float) or math.isfinite(v)
    if not finite or v < lo or (hi is not None and v > hi):
        want = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise TraceError(f"{name} must be {want}{' (a finite number)' if isinstance(v, float) else ''}, got {v!r}")
    return v


MAX_TREE_DEPTH = 64      # deeper than any tree a decoder drafts (settings allow 32); bounds the per-depth loops


def _node(d: Any, where: str) -> TreeNode:
    depth = _in_range(_req(d, "depth", int, where), f"{where}.depth", 1, MAX_TREE_DEPTH)
    return TreeNode(_req(d, "id", int, where), _req(d, "token", int, where), _req(d, "text", str, where),
                    _req(d, "parent", int, where), depth,
                    _req(d, "score", float, where), _req(d, "logprob", float, where))


def _tree(d: Any, where: str) -> DraftTree:
    nodes = [_node(n, f"{where}.nodes[{i}]") for i, n in enumerate(_req(d, "nodes", list, where))]
    # as the decoders write them: ids 1..S in order, parents before children, depth = parent's + 1
    # (the per-depth statistics and the tree layout rely on all three)
    depth_of = {0: 0}
    for i, n in enumerate(nodes):
        w = f"{where}.nodes[{i}]"
        if n.id != i + 1:
            raise TraceError(f"{w}.id must be {i + 1} (nodes are numbered 1, 2, ... in order), got {n.id}")
        if not 0 <= n.parent < n.id:
            raise TraceError(f"{w}.parent: node {n.id} has unknown parent {n.parent} "
                             "(a parent is 0, the root, or an earlier node)")
        if n.depth != depth_of[n.parent] + 1:
            raise TraceError(f"{w}.depth must be {depth_of[n.parent] + 1}, one more than its parent's, got {n.depth}")
        depth_of[n.id] = n.depth
    accepted = _req(d, "accepted", list, where)
    if not all(_is_int(a) and 1 <= a <= len(nodes) for a in accepted):
        raise TraceError(f"{where}.accepted: must list node ids of the tree")
    # the verifier's path: each accepted node a child of the previous one (the first, of the root),
    # so len(accepted) is the depth the verifier reached
    parent = 0
    for a in accepted:
        if nodes[a - 1].parent != parent:
            raise TraceError(f"{where}.accepted: must be a path from the root (node {a} is not a child of "
                             f"{'the root' if parent == 0 else f'node {parent}'})")
        parent = a
    verifier = _req(d, "verifier", str, where)
    if verifier not in ("intermediate", "target"):
        raise TraceError(f"{where}.verifier: must be 'intermediate' or 'target'")
    tree = DraftTree(_req(d, "root_token", int, where), _req(d, "root_text", str, where), nodes,
                     accepted, _req(d, "bonus_token", int, where), _req(d, "bonus_text", str, where), verifier,
                     _opt(d, "undraftable", bool, where, False))
    if tree.undraftable and not tree_rejected(tree):
        raise TraceError(f"{where}.undraftable: only a tree whose accepted path's last node has children "
                         "can end in a rejection")
    return tree


def _step(d: Any, where: str) -> Step:
    method = _req(d, "method", str, where)
    if method not in METHODS:
        raise TraceError(f"{where}.method: unknown method {method!r}")
    timings = _req(d, "timings_ms", dict, where)
    for k, v in timings.items():
        if k not in STAGES or isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
            raise TraceError(f"{where}.timings_ms: bad entry {k!r}: {v!r}")
    new_tokens = _req(d, "new_tokens", list, where)
    new_text = _req(d, "new_text", list, where)
    new_sources = _req(d, "new_sources", list, where)
    if not (len(new_tokens) == len(new_text) == len(new_sources)):
        raise TraceError(f"{where}: new_tokens, new_text and new_sources differ in length")
    if not all(_is_int(t) for t in new_tokens) or not all(isinstance(t, str) for t in new_text):
        raise TraceError(f"{where}: new_tokens must be integers and new_text strings")
    if not all(s in SOURCES for s in new_sources):
        raise TraceError(f"{where}.new_sources: entries must be one of {SOURCES}")
    trees = [_tree(t, f"{where}.trees[{i}]") for i, t in enumerate(_opt(d, "trees", list, where, []))]
    seq = []
    for i, s in enumerate(_opt(d, "sequence", list, where, [])):
        w = f"{where}.sequence[{i}]"
        src = _req(s, "source", str, w)
        if src not in SOURCES:
            raise TraceError(f"{w}.source: must be one of {SOURCES}")
        tree_idx = _opt(s, "tree", int, w)
        if tree_idx is not None and not 0 <= tree_idx < len(trees):
            raise TraceError(f"{w}.tree: no tree {tree_idx} in this step")
        seq.append(SeqToken(_req(s, "token", int, w), _req(s, "text", str, w), src, tree_idx))
    forwards = _opt(d, "forwards", dict, where, {})
    for k, v in forwards.items():
        if not _is_int(v) or v < 0:
            raise TraceError(f"{where}.forwards: counts must be non-negative integers, got {k!r}: {v!r}")
    # the target accepts at most the draft it verified
    target_accepted = _in_range(_opt(d, "target_accepted", int, where, 0), f"{where}.target_accepted", 0,
                                target_draft_len(seq, trees))
    return Step(_req(d, "index", int, where), method, new_tokens, new_text, new_sources,
                {k: float(v) for k, v in timings.items()}, trees, seq,
                target_accepted, _opt(d, "target_bonus", int, where),
                _opt(d, "target_bonus_text", str, where, ""), forwards)


# One recorded setting is judged at a time, the others taken from this baseline: trees as deep and
# wide as allowed and of one node, so that no in-range value of one field makes the set inconsistent.
_SETTINGS_PROBE = DecodeSettings(m_depth=32, m_topk=64, m_tree_size=1, t_depth=32, t_topk=64, t_tree_size=1)
_SETTINGS_FIELDS = {f.name for f in fields(DecodeSettings)}


def _check_settings(settings: dict) -> None:
    """Each DecodeSettings value in meta.settings must be one a run accepts (DecodeSettings.validate's
    ranges); other keys are free-form."""
    for key, v in settings.items():
        if key not in _SETTINGS_FIELDS or v is None:
            continue
        try:
            replace(_SETTINGS_PROBE, **{key: v}).validate()
        # OverflowError: an integer too large for a float (JSON has no limit on digits)
        except (SettingsError, OverflowError) as e:
            raise TraceError(f"trace.meta.settings.{key}: {e}") from None


def _is_version(v: Any) -> bool:
    return _is_int(v) and v == SCHEMA_VERSION        # JSON true and 1.0 equal 1 in Python, but are no version


def trace_from_dict(d: Any) -> Trace:
    if not isinstance(d, dict):
        raise TraceError("a trace must be a JSON object")
    version = d.get("version")
    if not _is_version(version):
        raise TraceError(f"unsupported trace schema version {version!r} (this hierviz reads version {SCHEMA_VERSION})")
    meta = _req(d, "meta", dict, "trace")
    settings = meta.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise TraceError("trace.meta.settings must be an object")
    _check_settings(settings or {})
    method = meta.get("method")
    if method not in METHODS:
        raise TraceError(f"trace.meta.method: unknown method {method!r}")
    steps = [_step(s, f"steps[{i}]") for i, s in enumerate(_req(d, "steps", list, "trace"))]
    # the app addresses steps by position (step 0 is the prefill), so the numbering must agree
    for i, s in enumerate(steps):
        if s.index != i:
            raise TraceError(f"steps[{i}].index must be {i} (steps are numbered 0, 1, ... in order), got {s.index}")
    return Trace(meta, steps, _in_range(_opt(d, "prompt_tokens", int, "trace", 0), "trace.prompt_tokens", 0),
                 _in_range(_opt(d, "prefill_ms", float, "trace", 0.0), "trace.prefill_ms", 0),
                 _opt(d, "output_text", str, "trace", ""), _opt(d, "finish_reason", str, "trace", ""), SCHEMA_VERSION)


def _parse(text: str | bytes) -> Any:
    # a str is measured in UTF-8 bytes, as a file would be (characters undercount non-ASCII text)
    size = len(text) if isinstance(text, bytes) or len(text) > MAX_TRACE_BYTES else len(text.encode("utf-8", "replace"))
    if size > MAX_TRACE_BYTES:
        raise TraceError(f"trace is {size / 2**20:.1f} MB; the limit is {MAX_TRACE_BYTES / 2**20:.0f} MB")
    try:
        return json.loads(text)
    # RecursionError: JSON nested deeper than the parser's stack (an upload built to crash it)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TraceError(f"not valid JSON: {e}") from None


def trace_from_json(text: str | bytes) -> Trace:
    return trace_from_dict(_parse(text))


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceError(f"trace is {size / 2**20:.1f} MB; the limit is {MAX_TRACE_BYTES / 2**20:.0f} MB")
        data = p.read_bytes()   # a folder, or a file without read permission, fails here, not at stat
    except OSError as e:
        raise TraceError(f"cannot read trace file: {e.strerror}") from None
    return trace_from_json(data)


# A run that compares two methods on one prompt (HierSpec vs EAGLE-2, optionally AR) is a
# list of traces; the app shows them side by side. Saved as {"version":..., "runs":[...]}.
def save_comparison(traces: list[Trace], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"version": SCHEMA_VERSION, "runs": [t.to_dict() for t in traces]},
                                     ensure_ascii=False), encoding="utf-8")


def comparison_from_json(text: str | bytes) -> list[Trace]:
    """Reads either a single trace or a {"runs": [...]} comparison file."""
    d = _parse(text)
    if isinstance(d, dict) and "runs" in d:
        if not _is_version(d.get("version")):
            raise TraceError(f"unsupported trace schema version {d.get('version')!r}")
        runs = d["runs"]
        if not isinstance(runs, list) or not runs:
            raise TraceError("'runs' must be a non-empty list of traces")
        return [trace_from_dict(r) for r in runs]
    return [trace_from_dict(d)]
