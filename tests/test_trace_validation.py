"""Trace loading rejects every malformed document with a TraceError that names the problem, and a
saved trace loads back identical, field by field.

Every `raise TraceError` in hierviz/trace.py, by the name the cases below use (30 in all;
`test_every_rejection_path_has_a_case` fails when a raise is added, removed or left untested):

| # | path               | where                 | what is rejected                                        |
|---|--------------------|-----------------------|---------------------------------------------------------|
| 1 | not_an_object      | _req                  | a step, tree, node or sequence entry that is no object  |
| 2 | missing_field      | _req                  | a required field absent (trace, step, tree, node, seq)  |
| 3 | wrong_type         | _req                  | a field of the wrong JSON type (bool is not an int)     |
| 4 | out_of_range       | _in_range             | node depth outside 1..64, target_accepted outside 0..the|
|   |                    |                       | draft, negative prompt_tokens, prefill_ms < 0 or not    |
|   |                    |                       | finite                                                  |
| 5 | node_id            | _tree                 | nodes not numbered 1, 2, ... in order                   |
| 6 | unknown_parent     | _tree                 | a parent that is neither 0 nor an earlier node          |
| 7 | node_depth_parent  | _tree                 | a depth other than its parent's + 1                     |
| 8 | accepted_not_nodes | _tree                 | tree.accepted naming ids that are not the tree's nodes  |
| 9 | accepted_path      | _tree                 | tree.accepted that is no path down from the root        |
|10 | verifier           | _tree                 | tree.verifier other than "intermediate" / "target"      |
|11 | step_method        | _step                 | step.method not one of METHODS                          |
|12 | timings_entry      | _step                 | timings_ms key not a stage, value negative or no number |
|13 | new_lengths        | _step                 | new_tokens / new_text / new_sources lengths differ      |
|14 | new_types          | _step                 | new_tokens not all integers or new_text not all strings |
|15 | new_sources        | _step                 | a new_sources entry not one of SOURCES                  |
|16 | sequence_source    | _step                 | a sequence entry's source not one of SOURCES            |
|17 | sequence_tree      | _step                 | sequence[i].tree not an index into the step's trees     |
|18 | forwards           | _step                 | forward counts negative or not integers                 |
|19 | settings_value     | _check_settings       | a meta.settings value DecodeSettings would refuse       |
|20 | not_a_json_object  | trace_from_dict       | a document that is not a JSON object                    |
|21 | version            | trace_from_dict       | a schema version other than SCHEMA_VERSION (or none)    |
|22 | meta_settings      | trace_from_dict       | meta.settings that is not an object                     |
|23 | meta_method        | trace_from_dict       | meta.method absent or not one of METHODS                |
|24 | step_index         | trace_from_dict       | steps[i].index other than i                             |
|25 | text_too_large     | _parse                | JSON text over MAX_TRACE_BYTES                          |
|26 | invalid_json       | _parse                | text that is not JSON (or not UTF-8)                    |
|27 | file_unreadable    | load_trace            | a path that does not exist or cannot be read (a folder) |
|28 | file_too_large     | load_trace            | a file over MAX_TRACE_BYTES, refused before reading it  |
|29 | comparison_version | comparison_from_json  | a {"runs": [...]} file of another schema version        |
|30 | comparison_runs    | comparison_from_json  | "runs" that is not a non-empty list                     |

The valid documents mutated here are real engine traces (tiny random stack, every method) and the
hand-made sample traces (whose trees have accepted paths, which random models rarely give). The
numeric bounds (`BOUNDS`, one row per numeric field a trace holds) are probed on the small
hand-made traces of tests/test_trace_stats.py: a value on each bound loads, one just past it is
refused with a message that names the field.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from hierviz import trace as trace_mod
from hierviz.settings import DecodeSettings
from hierviz.engine import generate
from hierviz.stack import tiny_random_stack
from hierviz.methods import METHODS
from hierviz.trace import (MAX_TRACE_BYTES, SOURCES, DraftTree, SeqToken, Step, Trace, TraceError, TreeNode,
                           comparison_from_json, load_trace, save_comparison, trace_from_json)
from hierviz.viz import sample
from tests.test_trace_stats import ar_trace, eagle2_trace, hierspec_trace, spec_trace

# path name -> (function holding the raise, a literal fragment of its message)
PATHS: dict[str, tuple[str, str]] = {
    "not_an_object": ("_req", ": expected an object"),
    "missing_field": ("_req", ": missing field '"),
    "wrong_type": ("_req", ", got "),
    "out_of_range": ("_in_range", " must be "),
    "node_id": ("_tree", ".id must be "),
    "unknown_parent": ("_tree", " has unknown parent "),
    "node_depth_parent": ("_tree", ", one more than its parent's, got "),
    "accepted_not_nodes": ("_tree", ".accepted: must list node ids of the tree"),
    "accepted_path": ("_tree", ".accepted: must be a path from the root (node "),
    "verifier": ("_tree", ".verifier: must be 'intermediate' or 'target'"),
    "undraftable": ("_tree", ".undraftable: only a tree whose accepted path's last node has children "),
    "step_method": ("_step", ".method: unknown method "),
    "timings_entry": ("_step", ".timings_ms: bad entry "),
    "new_lengths": ("_step", ": new_tokens, new_text and new_sources differ in length"),
    "new_types": ("_step", ": new_tokens must be integers and new_text strings"),
    "new_sources": ("_step", ".new_sources: entries must be one of "),
    "sequence_source": ("_step", ".source: must be one of "),
    "sequence_tree": ("_step", ".tree: no tree "),
    "forwards": ("_step", ".forwards: counts must be non-negative integers, got "),
    "settings_value": ("_check_settings", "trace.meta.settings."),
    "not_a_json_object": ("trace_from_dict", "a trace must be a JSON object"),
    "version": ("trace_from_dict", "unsupported trace schema version "),
    "meta_method": ("trace_from_dict", "trace.meta.method: unknown method "),
    "meta_settings": ("trace_from_dict", "trace.meta.settings must be an object"),
    "step_index": ("trace_from_dict", ".index must be "),
    "text_too_large": ("_parse", "; the limit is "),
    "invalid_json": ("_parse", "not valid JSON: "),
    "file_unreadable": ("load_trace", "cannot read trace file: "),
    "file_too_large": ("load_trace", "; the limit is "),
    "comparison_version": ("comparison_from_json", "unsupported trace schema version "),
    "comparison_runs": ("comparison_from_json", "'runs' must be a non-empty list of traces"),
}

SETTINGS = DecodeSettings(max_new_tokens=12, m_depth=2, m_topk=3, m_tree_size=5, t_depth=3, t_topk=3,
                          t_tree_size=8, min_draft_len=3, spec_k=3)
MiB = 2 ** 20


@pytest.fixture(scope="module")
def engine_traces() -> dict[str, Trace]:
    stack = tiny_random_stack(eagle3=True)
    return {m: generate(stack, m, "w5 w7 w9", SETTINGS) for m in METHODS}


@pytest.fixture(scope="module")
def handmade_traces() -> dict[str, Trace]:
    return {t.meta["method"]: t for t in sample.comparison(0, 24)}


@pytest.fixture()
def doc(engine_traces) -> dict[str, Any]:
    """A valid HierSpec trace document: step 1 has M-verified trees and a sequence pointing into them."""
    d = engine_traces["hierspec"].to_dict()
    s1 = d["steps"][1]
    assert len(s1["trees"]) >= 2 and len(s1["trees"][0]["nodes"]) >= 2 and s1["sequence"][0]["tree"] == 0
    return d


# ---- the table is complete -----------------------------------------------------------------------

def _raises_in_trace_module() -> list[tuple[str, str]]:
    """(enclosing function, literal text of the message) of every `raise TraceError(...)`."""
    out: list[tuple[str, str]] = []

    class Raises(ast.NodeVisitor):
        def __init__(self) -> None:
            self.fn = "<module>"

        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            outer, self.fn = self.fn, node.name
            self.generic_visit(node)
            self.fn = outer

        def visit_Raise(self, node: ast.Raise) -> None:
            exc = node.exc
            if isinstance(exc, ast.Call) and getattr(exc.func, "id", None) == "TraceError":
                msg = exc.args[0]
                parts = msg.values if isinstance(msg, ast.JoinedStr) else [msg]
                out.append((self.fn, "".join(p.value for p in parts if isinstance(p, ast.Constant))))

    Raises().visit(ast.parse(inspect.getsource(trace_mod)))
    return out


def test_every_rejection_path_has_a_case() -> None:
    raises = _raises_in_trace_module()
    assert len(raises) == len(PATHS) == 31
    unmatched = list(raises)
    for name, (fn, fragment) in PATHS.items():
        hits = [r for r in unmatched if r[0] == fn and fragment in r[1]]
        assert len(hits) == 1, f"{name}: {len(hits)} `raise TraceError` in {fn} say {fragment!r}"
        unmatched.remove(hits[0])
    assert not unmatched
    tested = {p.values[0] for p in DOCUMENT_CASES + TEXT_CASES + FILE_CASES + COMPARISON_CASES}
    assert tested == set(PATHS), set(PATHS) ^ tested


# ---- a mutated document ------------------------------------------------------------------------

def _set(path: str, value: Any) -> Callable[[dict], dict]:
    """Mutation: set the field at a dotted path ("steps.1.trees.0.verifier") to value."""
    def mutate(d: dict) -> dict:
        *head, last = path.split(".")
        obj: Any = d
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[int(last) if isinstance(obj, list) else last] = value
        return d
    return mutate


def _del(path: str) -> Callable[[dict], dict]:
    def mutate(d: dict) -> dict:
        *head, last = path.split(".")
        obj: Any = d
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        del obj[last]
        return d
    return mutate


def _edit(fn: Callable[[dict], Any]) -> Callable[[dict], dict]:
    def mutate(d: dict) -> dict:
        fn(d)
        return d
    return mutate


def _last_node_parent(d: dict) -> None:
    nodes = d["steps"][1]["trees"][0]["nodes"]
    nodes[-1]["parent"] = 1000


def _undraftable_after_the_whole_tree(d: dict) -> None:
    """A tree fully accepted down to a leaf cannot end in a rejection."""
    tree = d["steps"][1]["trees"][0]
    path, node = [], tree["nodes"][-1]
    while True:
        path.insert(0, node["id"])
        if node["parent"] == 0:
            break
        node = tree["nodes"][node["parent"] - 1]
    tree["accepted"], tree["undraftable"] = path, True


def _target_accepts_more_than_the_draft(d: dict) -> None:
    s = d["steps"][1]
    s["target_accepted"] = len(s["sequence"]) + 1


def _seq_tree_past_end(d: dict) -> None:
    s = d["steps"][1]
    s["sequence"][0]["tree"] = len(s["trees"])


S1 = r"steps\[1\]"
T0 = S1 + r"\.trees\[0\]"
DOCUMENT_CASES = [
    pytest.param("out_of_range", _set("steps.1.trees.0.nodes.1.depth", 10 ** 9),
                 rf"^{T0}\.nodes\[1\]\.depth must be between 1 and 64, got 1000000000$", id="node-depth-absurd"),
    pytest.param("out_of_range", _set("steps.1.trees.0.nodes.0.depth", 0),
                 rf"^{T0}\.nodes\[0\]\.depth must be between 1 and 64, got 0$", id="node-depth-zero"),
    pytest.param("out_of_range", _set("steps.1.trees.0.nodes.0.depth", -1),
                 rf"^{T0}\.nodes\[0\]\.depth must be between 1 and 64, got -1$", id="node-depth-negative"),
    pytest.param("out_of_range", _set("steps.1.target_accepted", -1),
                 rf"^{S1}\.target_accepted must be between 0 and \d+, got -1$", id="target-accepted-negative"),
    pytest.param("out_of_range", _edit(_target_accepts_more_than_the_draft),
                 rf"^{S1}\.target_accepted must be between 0 and (\d+), got (?!\1)\d+$", id="target-accepted-past-draft"),
    pytest.param("out_of_range", _set("prompt_tokens", -1), r"^trace\.prompt_tokens must be at least 0, got -1$",
                 id="prompt-tokens-negative"),
    pytest.param("out_of_range", _set("prefill_ms", float("nan")),
                 r"^trace\.prefill_ms must be at least 0 \(a finite number\), got nan$", id="prefill-nan"),
    pytest.param("node_id", _set("steps.1.trees.0.nodes.1.id", 1),
                 rf"^{T0}\.nodes\[1\]\.id must be 2 \(nodes are numbered 1, 2, \.\.\. in order\), got 1$",
                 id="node-id-repeated"),
    pytest.param("node_depth_parent", _set("steps.1.trees.0.nodes.0.depth", 2),
                 rf"^{T0}\.nodes\[0\]\.depth must be 1, one more than its parent's, got 2$", id="root-child-at-depth-2"),
    pytest.param("accepted_path", _set("steps.1.trees.0.accepted", [1, 1]),
                 rf"^{T0}\.accepted: must be a path from the root \(node 1 is not a child of node 1\)$",
                 id="accepted-repeats-a-node"),
    pytest.param("step_index", _set("steps.1.index", 5),
                 rf"^{S1}\.index must be 1 \(steps are numbered 0, 1, \.\.\. in order\), got 5$", id="step-index-skips"),
    pytest.param("step_index", _set("steps.0.index", 1),
                 r"^steps\[0\]\.index must be 0 \(steps are numbered 0, 1, \.\.\. in order\), got 1$",
                 id="no-step-0"),
    pytest.param("meta_settings", _set("meta.settings", "greedy"), r"^trace\.meta\.settings must be an object$",
                 id="meta-settings-a-string"),
    pytest.param("settings_value", _set("meta.settings.temperature", "hot"),
                 r"^trace\.meta\.settings\.temperature: temperature must be a number, got 'hot'$",
                 id="meta-temperature-a-word"),
    pytest.param("settings_value", _set("meta.settings.m_depth", 0),
                 r"^trace\.meta\.settings\.m_depth: E_M tree depth must be between 1 and 32, got 0$",
                 id="meta-m-depth-zero"),
    pytest.param("not_an_object", _set("steps.1", 7), rf"^{S1}: expected an object$", id="step-is-a-number"),
    pytest.param("not_an_object", _set("steps.1.trees.0", [1]), rf"^{T0}: expected an object$", id="tree-is-a-list"),
    pytest.param("not_an_object", _set("steps.1.trees.0.nodes.1", "node"), rf"^{T0}\.nodes\[1\]: expected an object$",
                 id="node-is-a-string"),
    pytest.param("not_an_object", _set("steps.1.sequence.0", None), rf"^{S1}\.sequence\[0\]: expected an object$",
                 id="sequence-entry-is-null"),
    pytest.param("missing_field", _del("meta"), r"^trace: missing field 'meta'$", id="no-meta"),
    pytest.param("missing_field", _del("steps"), r"^trace: missing field 'steps'$", id="no-steps"),
    pytest.param("missing_field", _del("steps.1.index"), rf"^{S1}: missing field 'index'$", id="no-step-index"),
    pytest.param("missing_field", _del("steps.1.timings_ms"), rf"^{S1}: missing field 'timings_ms'$", id="no-timings"),
    pytest.param("missing_field", _del("steps.1.trees.0.bonus_text"), rf"^{T0}: missing field 'bonus_text'$",
                 id="no-tree-bonus-text"),
    pytest.param("missing_field", _del("steps.1.trees.0.nodes.0.score"), rf"^{T0}\.nodes\[0\]: missing field 'score'$",
                 id="no-node-score"),
    pytest.param("missing_field", _del("steps.1.sequence.0.token"), rf"^{S1}\.sequence\[0\]: missing field 'token'$",
                 id="no-sequence-token"),
    pytest.param("wrong_type", _set("steps.1.index", "1"), rf"^{S1}\.index: expected int, got str$", id="index-str"),
    pytest.param("wrong_type", _set("steps.1.trees.0.nodes.0.id", True), rf"^{T0}\.nodes\[0\]\.id: expected int, got bool$",
                 id="node-id-bool"),
    pytest.param("wrong_type", _set("steps.1.trees.0.nodes.0.score", "high"),
                 rf"^{T0}\.nodes\[0\]\.score: expected float, got str$", id="node-score-str"),
    pytest.param("wrong_type", _set("steps.1.trees", {}), rf"^{S1}\.trees: expected list, got dict$", id="trees-dict"),
    pytest.param("wrong_type", _set("steps.1.target_bonus_text", 5), rf"^{S1}\.target_bonus_text: expected str, got int$",
                 id="bonus-text-int"),
    pytest.param("wrong_type", _set("meta", []), r"^trace\.meta: expected dict, got list$", id="meta-list"),
    pytest.param("wrong_type", _set("steps", {}), r"^trace\.steps: expected list, got dict$", id="steps-dict"),
    pytest.param("wrong_type", _set("prompt_tokens", 3.0), r"^trace\.prompt_tokens: expected int, got float$",
                 id="prompt-tokens-float"),
    pytest.param("wrong_type", _set("prefill_ms", "2"), r"^trace\.prefill_ms: expected float, got str$",
                 id="prefill-str"),
    pytest.param("unknown_parent", _edit(_last_node_parent),
                 rf"^{T0}\.nodes\[\d+\]\.parent: node \d+ has unknown parent 1000 \(a parent is 0, the root, or an earlier node\)$",
                 id="parent-not-in-tree"),
    pytest.param("unknown_parent", _set("steps.1.trees.0.nodes.0.parent", 2),
                 rf"^{T0}\.nodes\[0\]\.parent: node 1 has unknown parent 2 \(", id="parent-a-later-node"),
    pytest.param("accepted_not_nodes", _set("steps.1.trees.0.accepted", [1000]),
                 rf"^{T0}\.accepted: must list node ids of the tree$", id="accepted-unknown-id"),
    pytest.param("accepted_not_nodes", _set("steps.1.trees.0.accepted", ["1"]),
                 rf"^{T0}\.accepted: must list node ids of the tree$", id="accepted-str"),
    pytest.param("undraftable", _edit(_undraftable_after_the_whole_tree),
                 rf"^{T0}\.undraftable: only a tree whose accepted path's last node has children can end in a "
                 r"rejection$", id="undraftable-without-rejection"),
    pytest.param("verifier", _set("steps.1.trees.0.verifier", "draft"),
                 rf"^{T0}\.verifier: must be 'intermediate' or 'target'$", id="verifier-draft"),
    pytest.param("verifier", _set("steps.1.trees.0.verifier", "Target"),
                 rf"^{T0}\.verifier: must be 'intermediate' or 'target'$", id="verifier-case"),
    pytest.param("step_method", _set("steps.1.method", "medusa"), rf"^{S1}\.method: unknown method 'medusa'$",
                 id="step-medusa"),
    pytest.param("timings_entry", _set("steps.1.timings_ms", {"sampling": 1.0}),
                 rf"^{S1}\.timings_ms: bad entry 'sampling': 1\.0$", id="timing-unknown-stage"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", -0.5), rf"^{S1}\.timings_ms: bad entry 'draft': -0\.5$",
                 id="timing-negative"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", "fast"),
                 rf"^{S1}\.timings_ms: bad entry 'draft': 'fast'$", id="timing-str"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", None), rf"^{S1}\.timings_ms: bad entry 'draft': None$",
                 id="timing-null"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", float("nan")),
                 rf"^{S1}\.timings_ms: bad entry 'draft': nan$", id="timing-nan"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", float("inf")),
                 rf"^{S1}\.timings_ms: bad entry 'draft': inf$", id="timing-inf"),
    pytest.param("timings_entry", _set("steps.1.timings_ms.draft", True),
                 rf"^{S1}\.timings_ms: bad entry 'draft': True$", id="timing-bool"),
    pytest.param("new_lengths", _edit(lambda d: d["steps"][1]["new_text"].append("x")),
                 rf"^{S1}: new_tokens, new_text and new_sources differ in length$", id="extra-text"),
    pytest.param("new_lengths", _edit(lambda d: d["steps"][1]["new_sources"].pop()),
                 rf"^{S1}: new_tokens, new_text and new_sources differ in length$", id="missing-source"),
    pytest.param("new_types", _set("steps.1.new_tokens.0", True), rf"^{S1}: new_tokens must be integers and new_text strings$",
                 id="token-bool"),
    pytest.param("forwards", _set("steps.1.forwards", {"target": True}),
                 rf"^{S1}\.forwards: counts must be non-negative integers, got 'target': True$", id="forwards-bool"),
    pytest.param("new_types", _set("steps.1.new_tokens.0", "5"), rf"^{S1}: new_tokens must be integers and new_text strings$",
                 id="token-str"),
    pytest.param("new_types", _set("steps.1.new_tokens.0", 1.5), rf"^{S1}: new_tokens must be integers and new_text strings$",
                 id="token-float"),
    pytest.param("new_types", _set("steps.1.new_text.0", 5), rf"^{S1}: new_tokens must be integers and new_text strings$",
                 id="text-int"),
    pytest.param("new_sources", _set("steps.1.new_sources.0", "oracle"),
                 rf"^{S1}\.new_sources: entries must be one of \('tree', ", id="source-oracle"),
    pytest.param("sequence_source", _set("steps.1.sequence.0.source", "target"),
                 rf"^{S1}\.sequence\[0\]\.source: must be one of \('tree', ", id="sequence-source-target"),
    pytest.param("sequence_tree", _edit(_seq_tree_past_end), rf"^{S1}\.sequence\[0\]\.tree: no tree \d+ in this step$",
                 id="sequence-tree-past-end"),
    pytest.param("sequence_tree", _set("steps.1.sequence.0.tree", -1), rf"^{S1}\.sequence\[0\]\.tree: no tree -1 in this step$",
                 id="sequence-tree-negative"),
    pytest.param("forwards", _set("steps.1.forwards.target", -1),
                 rf"^{S1}\.forwards: counts must be non-negative integers, got 'target': -1$", id="forwards-negative"),
    pytest.param("forwards", _set("steps.1.forwards.e_m", 1.5),
                 rf"^{S1}\.forwards: counts must be non-negative integers, got 'e_m': 1\.5$", id="forwards-float"),
    pytest.param("not_a_json_object", lambda d: [d], r"^a trace must be a JSON object$", id="list"),
    pytest.param("not_a_json_object", lambda d: "trace", r"^a trace must be a JSON object$", id="string"),
    pytest.param("version", _set("version", 2), r"^unsupported trace schema version 2 \(this hierviz reads version 1\)$",
                 id="version-2"),
    pytest.param("version", _del("version"), r"^unsupported trace schema version None \(", id="no-version"),
    pytest.param("version", _set("version", "1"), r"^unsupported trace schema version '1' \(", id="version-str"),
    pytest.param("version", _set("version", True), r"^unsupported trace schema version True \(", id="version-true"),
    pytest.param("meta_method", _set("meta.method", "medusa"), r"^trace\.meta\.method: unknown method 'medusa'$",
                 id="meta-medusa"),
    pytest.param("meta_method", _del("meta.method"), r"^trace\.meta\.method: unknown method None$", id="no-meta-method"),
]


@pytest.mark.parametrize("path,mutate,message", DOCUMENT_CASES)
def test_malformed_document_is_rejected(doc, path: str, mutate: Callable[[dict], Any], message: str) -> None:
    bad = mutate(copy.deepcopy(doc))
    text = json.dumps(bad)
    with pytest.raises(TraceError, match=message):
        trace_from_json(text)
    # the app's reader takes a single trace or a comparison: both report the same problem
    with pytest.raises(TraceError, match=message):
        comparison_from_json(text.encode())
    with pytest.raises(TraceError, match=message):
        comparison_from_json(json.dumps({"version": 1, "runs": [doc, bad]}))


def test_the_unmutated_document_loads(doc) -> None:
    """The cases above fail because of their one change, not because the base document is bad."""
    assert trace_from_json(json.dumps(doc)).to_dict() == doc
    assert [t.to_dict() for t in comparison_from_json(json.dumps({"version": 1, "runs": [doc, doc]}))] == [doc, doc]


def test_whole_number_times_load_as_floats(doc) -> None:
    """A hand-written file may say 2 for 2.0 ms: accepted, and held as floats like the engine's."""
    doc["prefill_ms"] = 3
    doc["steps"][1]["timings_ms"] = {"draft": 2, "target_verify": 0}
    back = trace_from_json(json.dumps(doc))
    assert type(back.prefill_ms) is float and back.prefill_ms == 3.0
    t = back.steps[1].timings_ms
    assert t == {"draft": 2.0, "target_verify": 0.0} and all(type(v) is float for v in t.values())


# ---- text, files, comparisons ------------------------------------------------------------------

TEXT_CASES = [
    pytest.param("text_too_large", lambda d: b" " * (MAX_TRACE_BYTES + 1), r"^trace is 20\.0 MB; the limit is 20 MB$",
                 id="bytes"),
    pytest.param("text_too_large", lambda d: json.dumps({**d, "output_text": "x" * (25 * MiB)}),
                 r"^trace is 25\.0 MB; the limit is 20 MB$", id="valid-json-str"),
    pytest.param("invalid_json", lambda d: "{", r"^not valid JSON: Expecting property name", id="truncated"),
    pytest.param("invalid_json", lambda d: "", r"^not valid JSON: Expecting value", id="empty"),
    pytest.param("invalid_json", lambda d: json.dumps(d)[:-1] + ",}", r"^not valid JSON: ", id="trailing-comma"),
    pytest.param("invalid_json", lambda d: b'{"version": 1, "meta": "\xff"}', r"^not valid JSON: .*utf-8", id="not-utf8"),
    pytest.param("invalid_json", lambda d: "[" * 100_000 + "]" * 100_000, r"^not valid JSON: .*recursion",
                 id="nested-too-deep"),
    pytest.param("text_too_large", lambda d: json.dumps({**d, "output_text": "\u00e9" * (11 * MiB)}, ensure_ascii=False),
                 r"^trace is 22\.0 MB; the limit is 20 MB$", id="non-ascii-str-counted-in-bytes"),
]


@pytest.mark.parametrize("path,make,message", TEXT_CASES)
def test_bad_text_is_rejected(doc, path: str, make: Callable[[dict], str | bytes], message: str) -> None:
    text = make(doc)
    with pytest.raises(TraceError, match=message):
        trace_from_json(text)
    with pytest.raises(TraceError, match=message):
        comparison_from_json(text)


def _sparse(p: Path, size: int) -> Path:
    with open(p, "wb") as f:
        f.truncate(size)           # no disk blocks: only the size matters
    return p


FILE_CASES = [
    pytest.param("file_unreadable", lambda tmp: tmp / "absent.json", r"^cannot read trace file: No such file or directory$",
                 id="missing"),
    pytest.param("file_unreadable", lambda tmp: tmp, r"^cannot read trace file: Is a directory$", id="folder"),
    pytest.param("file_too_large", lambda tmp: _sparse(tmp / "big.json", 25 * MiB), r"^trace is 25\.0 MB; the limit is 20 MB$",
                 id="25MiB"),
]


@pytest.mark.parametrize("path,make,message", FILE_CASES)
def test_bad_file_is_rejected(tmp_path, monkeypatch, path: str, make: Callable[[Path], Path], message: str) -> None:
    target = make(tmp_path)
    if path == "file_too_large":
        # refused from its size alone: the 25 MB are never read
        monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read"))
    with pytest.raises(TraceError, match=message):
        load_trace(target)


def test_file_at_the_size_limit_is_read(tmp_path) -> None:
    """MAX_TRACE_BYTES itself is allowed: the (zero-filled) file is read and fails as JSON, not on size."""
    with pytest.raises(TraceError, match=r"^not valid JSON: "):
        load_trace(_sparse(tmp_path / "edge.json", MAX_TRACE_BYTES))


COMPARISON_CASES = [
    pytest.param("comparison_version", lambda d: {"version": 2, "runs": [d]}, r"^unsupported trace schema version 2$",
                 id="version-2"),
    pytest.param("comparison_version", lambda d: {"runs": [d]}, r"^unsupported trace schema version None$",
                 id="no-version"),
    pytest.param("comparison_version", lambda d: {"version": True, "runs": [d]},
                 r"^unsupported trace schema version True$", id="version-true"),
    pytest.param("comparison_runs", lambda d: {"version": 1, "runs": []}, r"^'runs' must be a non-empty list of traces$",
                 id="empty"),
    pytest.param("comparison_runs", lambda d: {"version": 1, "runs": d}, r"^'runs' must be a non-empty list of traces$",
                 id="a-trace-not-a-list"),
    pytest.param("comparison_runs", lambda d: {"version": 1, "runs": None}, r"^'runs' must be a non-empty list of traces$",
                 id="null"),
]


@pytest.mark.parametrize("path,make,message", COMPARISON_CASES)
def test_bad_comparison_is_rejected(doc, tmp_path, path: str, make: Callable[[dict], dict], message: str) -> None:
    f = tmp_path / "c.json"
    f.write_text(json.dumps(make(doc)))
    with pytest.raises(TraceError, match=message):
        comparison_from_json(f.read_bytes())


# ---- save and load back ------------------------------------------------------------------------

def _assert_same(a: Any, b: Any, where: str = "trace") -> int:
    """a equals b field by field, with the same types all the way down (JSON would let 1 == 1.0 and
    True == 1 pass a plain ==); returns the number of leaf values compared. A str subclass (the
    engine's meta holds torch's TorchVersion) comes back as the str JSON has."""
    if isinstance(a, str):
        assert type(b) is str and str(a) == b, f"{where}: {a!r} became {b!r}"
        return 1
    assert type(a) is type(b), f"{where}: {type(a).__name__} became {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        return sum(_assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
                   for f in dataclasses.fields(a))
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} became {list(b)}"
        return sum(_assert_same(a[k], b[k], f"{where}[{k!r}]") for k in a)
    if isinstance(a, list):
        assert len(a) == len(b), f"{where}: {len(a)} entries became {len(b)}"
        return sum(_assert_same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), f"{where}: nan became {b!r}"
    else:
        assert a == b, f"{where}: {a!r} became {b!r}"
    return 1


def _leaves(t: Trace) -> int:
    """Leaf values of a trace counted from its dataclasses, independently of _assert_same."""
    def count(x: Any) -> int:
        if isinstance(x, dict):
            return sum(count(v) for v in x.values())
        if isinstance(x, list):
            return sum(count(v) for v in x)
        return 1
    return count(t.to_dict())


ROUND_TRIPS = [("engine", m) for m in METHODS] + [("handmade", m) for m in ("hierspec", "eagle2", "ar")]


@pytest.mark.parametrize("kind,method", ROUND_TRIPS, ids=[f"{k}-{m}" for k, m in ROUND_TRIPS])
def test_save_and_load_give_back_every_field(engine_traces, handmade_traces, tmp_path, kind: str, method: str) -> None:
    tr = (engine_traces if kind == "engine" else handmade_traces)[method]
    # the comparison is only as strong as what the trace holds: each method's structures are there
    steps = tr.steps[1:]
    trees = [t for s in steps for t in s.trees]
    assert tr.meta["method"] == method and len(tr.steps) >= 3 and tr.output_text
    if method == "ar":
        assert not trees and not any(s.sequence for s in steps)
    if method == "spec":
        assert all(s.sequence and all(q.tree is None and q.source == "draft" for q in s.sequence) for s in steps)
    if method == "eagle2":
        assert all(len(s.trees) == 1 and s.trees[0].verifier == "target" and s.trees[0].nodes for s in steps)
    if method == "hierspec":
        assert trees and all(t.verifier == "intermediate" for t in trees)
        assert any(q.tree is not None for s in steps for q in s.sequence)
        assert {"draft", "intermediate_verify", "target_verify"} <= set(steps[0].timings_ms)
    if kind == "handmade" and method != "ar":
        assert any(t.accepted for t in trees)           # accepted paths survive too

    f = tmp_path / "t.json"
    tr.save(f)
    loaded = {"file": load_trace(f), "text": trace_from_json(tr.to_json()),
              "bytes": trace_from_json(f.read_bytes()), "as-comparison": comparison_from_json(f.read_bytes())[0]}
    want = _leaves(tr)
    for how, back in loaded.items():
        assert _assert_same(tr, back, f"{how}:trace") == want, how
        assert type(back.steps[-1]) is Step
        assert all(type(n) is TreeNode for s in back.steps for t in s.trees for n in t.nodes)
        assert all(type(t) is DraftTree for s in back.steps for t in s.trees)
        assert all(type(q) is SeqToken for s in back.steps for q in s.sequence)
        assert back.stats() == tr.stats()
        assert back.to_json() == tr.to_json()        # saving again writes the same bytes


def test_comparison_file_gives_back_every_run(engine_traces, handmade_traces, tmp_path) -> None:
    runs = [*engine_traces.values(), *handmade_traces.values()]
    f = tmp_path / "c.json"
    save_comparison(runs, f)
    back = comparison_from_json(f.read_bytes())
    assert len(back) == len(runs)
    for i, (a, b) in enumerate(zip(runs, back)):
        assert _assert_same(a, b, f"runs[{i}]") == _leaves(a)
    assert {s for t in back for st in t.steps for s in st.new_sources} <= set(SOURCES)


# ---- numeric bounds ----------------------------------------------------------------------------
# One row per numeric field a trace holds (`test_every_numeric_field_has_a_bounds_row` keeps the
# table complete). Values in `ok` lie on the field's bounds and must load; each value in `bad` lies
# just past a bound, or is of the wrong type where the field has no bound, and must be refused with
# `message(value)`, a regex of the whole message, which names the field.
#
# Token ids, scores and log-probs have no bound: they are only shown, and tests/hardening_inputs.py
# holds negative or huge ids and NaN / infinite scores as documents that must load.

BASES: dict[str, Callable[[], Trace]] = {"hierspec": hierspec_trace, "eagle2": eagle2_trace, "spec": spec_trace,
                                          "ar": ar_trace}


@dataclasses.dataclass
class Bound:
    field: str                          # Class.field of hierviz.trace, or settings.<DecodeSettings field>
    case: str                           # what the row probes
    base: str                           # the hand-made trace (BASES) the value is written into
    put: Callable[[dict, Any], None]
    ok: list
    bad: list
    message: Callable[[Any], str]


def _at(path: str) -> Callable[[dict, Any], None]:
    def put(d: dict, v: Any) -> None:
        _set(path, v)(d)
    return put


def _esc(v: Any) -> str:
    return re.escape(repr(v))


def _chain(d: dict, n: int) -> None:
    """HierSpec round 1's first tree replaced by a single path of n nodes (depths 1..n)."""
    tree = d["steps"][1]["trees"][0]
    tree["nodes"] = [{"id": i, "token": i, "text": "x", "parent": i - 1, "depth": i, "score": -0.1 * i, "logprob": -0.1}
                     for i in range(1, n + 1)]
    tree["accepted"] = []


def _reparent(d: dict, parent: Any) -> None:
    """EAGLE-2 round 1's tree (ids 1, 2 at depth 1; 3 under 1; 4 under 3): node 3 moved under
    `parent`, the depths of 3 and 4 following it; nothing accepted."""
    s = d["steps"][1]
    nodes = s["trees"][0]["nodes"]
    nodes[2]["parent"] = parent
    nodes[2]["depth"] = {0: 1}.get(parent, 2)
    nodes[3]["depth"] = nodes[2]["depth"] + 1
    s["trees"][0]["accepted"] = []
    s["target_accepted"] = 0


def _settings(key: str) -> Callable[[dict, Any], None]:
    def put(d: dict, v: Any) -> None:
        d["meta"]["settings"] = {key: v}
    return put


def _settings_row(key: str, ok: list, bad: list) -> Bound:
    return Bound(f"settings.{key}", "DecodeSettings.validate's range", "hierspec", _settings(key), ok, bad,
                 lambda v: rf"^trace\.meta\.settings\.{key}: ")


_PATH_ERRORS = {(3,): "node 3 is not a child of the root", (1, 2): "node 2 is not a child of node 1",
                (1, 3, 3): "node 3 is not a child of node 3", (2, 3): "node 3 is not a child of node 2"}
STEP_INDEX = r"^steps\[{i}\]\.index must be {i} \(steps are numbered 0, 1, \.\.\. in order\), got {v}$"
NO_BOUND = "no bound: only shown"
INF, NAN = float("inf"), float("nan")

BOUNDS = [
    Bound("Trace.version", "SCHEMA_VERSION only", "hierspec", _at("version"), [1], [0, 2, True, 1.0],
          lambda v: rf"^unsupported trace schema version {_esc(v)} \(this hierviz reads version 1\)$"),
    Bound("Trace.prompt_tokens", ">= 0", "hierspec", _at("prompt_tokens"), [0, 10 ** 6], [-1],
          lambda v: rf"^trace\.prompt_tokens must be at least 0, got {v}$"),
    Bound("Trace.prefill_ms", "finite, >= 0", "hierspec", _at("prefill_ms"), [0, 0.0, 1e308], [-1e-9, -1, INF, NAN],
          lambda v: rf"^trace\.prefill_ms must be at least 0 \(a finite number\), got {_esc(float(v))}$"),
    Bound("Step.index", "the prefill is step 0", "hierspec", _at("steps.0.index"), [0], [-1, 1],
          lambda v: STEP_INDEX.format(i=0, v=v)),
    Bound("Step.index", "its position", "hierspec", _at("steps.1.index"), [1], [0, 2],
          lambda v: STEP_INDEX.format(i=1, v=v)),
    Bound("Step.timings_ms", "finite, >= 0", "hierspec", _at("steps.1.timings_ms.draft"), [0, 0.0, 1e308],
          [-1e-9, INF, NAN, True], lambda v: rf"^{S1}\.timings_ms: bad entry 'draft': {_esc(v)}$"),
    Bound("Step.forwards", "integer >= 0", "hierspec", _at("steps.1.forwards.target"), [0, 10 ** 6], [-1, 1.5, True],
          lambda v: rf"^{S1}\.forwards: counts must be non-negative integers, got 'target': {_esc(v)}$"),
    Bound("Step.target_accepted", "hierspec: 0..the sequence draft (4)", "hierspec", _at("steps.1.target_accepted"),
          [0, 4], [-1, 5], lambda v: rf"^{S1}\.target_accepted must be between 0 and 4, got {v}$"),
    Bound("Step.target_accepted", "eagle2: 0..the target tree's depth (3)", "eagle2", _at("steps.1.target_accepted"),
          [0, 3], [-1, 4], lambda v: rf"^{S1}\.target_accepted must be between 0 and 3, got {v}$"),
    Bound("Step.target_accepted", "spec: 0..the sequence draft (3)", "spec", _at("steps.1.target_accepted"),
          [0, 3], [-1, 4], lambda v: rf"^{S1}\.target_accepted must be between 0 and 3, got {v}$"),
    Bound("Step.target_accepted", "ar: no draft", "ar", _at("steps.1.target_accepted"), [0], [-1, 1],
          lambda v: rf"^{S1}\.target_accepted must be between 0 and 0, got {v}$"),
    Bound("Step.target_accepted", "prefill: no draft", "hierspec", _at("steps.0.target_accepted"), [0], [1],
          lambda v: rf"^steps\[0\]\.target_accepted must be between 0 and 0, got {v}$"),
    Bound("Step.target_bonus", NO_BOUND, "hierspec", _at("steps.1.target_bonus"), [-5, 0, 10 ** 30, None], [1.5],
          lambda v: rf"^{S1}\.target_bonus: expected int, got float$"),
    Bound("Step.new_tokens", NO_BOUND, "hierspec", _at("steps.1.new_tokens.0"), [-5, 0, 10 ** 30], [1.5, True],
          lambda v: rf"^{S1}: new_tokens must be integers and new_text strings$"),
    Bound("SeqToken.token", NO_BOUND, "hierspec", _at("steps.1.sequence.0.token"), [-5, 10 ** 30], [1.5],
          lambda v: rf"^{S1}\.sequence\[0\]\.token: expected int, got float$"),
    Bound("SeqToken.tree", "an index into the step's 2 trees", "hierspec", _at("steps.1.sequence.0.tree"),
          [0, 1, None], [-1, 2], lambda v: rf"^{S1}\.sequence\[0\]\.tree: no tree {v} in this step$"),
    Bound("DraftTree.root_token", NO_BOUND, "hierspec", _at("steps.1.trees.0.root_token"), [-5, 10 ** 30], [1.5],
          lambda v: rf"^{T0}\.root_token: expected int, got float$"),
    Bound("DraftTree.bonus_token", NO_BOUND, "hierspec", _at("steps.1.trees.0.bonus_token"), [-5, 10 ** 30], [1.5],
          lambda v: rf"^{T0}\.bonus_token: expected int, got float$"),
    Bound("DraftTree.accepted", "ids of the tree's 3 nodes", "hierspec", _at("steps.1.trees.0.accepted"),
          [[], [1], [2], [1, 3]], [[0], [4], [-1], [True]], lambda v: rf"^{T0}\.accepted: must list node ids of the tree$"),
    Bound("DraftTree.accepted", "a path down from the root", "hierspec", _at("steps.1.trees.0.accepted"),
          [[1, 3]], [[3], [1, 2], [1, 3, 3], [2, 3]],
          lambda v: rf"^{T0}\.accepted: must be a path from the root \({_PATH_ERRORS[tuple(v)]}\)$"),
    Bound("TreeNode.id", "its position + 1", "hierspec", _at("steps.1.trees.0.nodes.2.id"), [3], [2, 4],
          lambda v: rf"^{T0}\.nodes\[2\]\.id must be 3 \(nodes are numbered 1, 2, \.\.\. in order\), got {v}$"),
    Bound("TreeNode.parent", "0 or an earlier node (node 3 of 4)", "eagle2", _reparent, [0, 1, 2], [-1, 3, 4, 5],
          lambda v: rf"^{T0}\.nodes\[2\]\.parent: node 3 has unknown parent {v} "
                    r"\(a parent is 0, the root, or an earlier node\)$"),
    Bound("TreeNode.depth", "a root child: >= 1", "hierspec", _at("steps.1.trees.0.nodes.0.depth"), [1], [0, -1],
          lambda v: rf"^{T0}\.nodes\[0\]\.depth must be between 1 and 64, got {v}$"),
    Bound("TreeNode.depth", "a path as deep as allowed: <= 64", "hierspec", _chain, [64], [65],
          lambda v: rf"^{T0}\.nodes\[{v - 1}\]\.depth must be between 1 and 64, got {v}$"),
    Bound("TreeNode.depth", "its parent's + 1", "hierspec", _at("steps.1.trees.0.nodes.2.depth"), [2], [1, 3],
          lambda v: rf"^{T0}\.nodes\[2\]\.depth must be 2, one more than its parent's, got {v}$"),
    Bound("TreeNode.token", NO_BOUND, "hierspec", _at("steps.1.trees.0.nodes.0.token"), [-5, 10 ** 30], [1.5],
          lambda v: rf"^{T0}\.nodes\[0\]\.token: expected int, got float$"),
    Bound("TreeNode.score", NO_BOUND, "hierspec", _at("steps.1.trees.0.nodes.0.score"), [0, -1e308, 1.0, NAN, -INF],
          ["high"], lambda v: rf"^{T0}\.nodes\[0\]\.score: expected float, got str$"),
    Bound("TreeNode.logprob", NO_BOUND, "hierspec", _at("steps.1.trees.0.nodes.0.logprob"), [0, -1e308, 1.0, NAN, INF],
          ["high"], lambda v: rf"^{T0}\.nodes\[0\]\.logprob: expected float, got str$"),
    # meta.settings: the ranges of DecodeSettings.validate, each field on its own; None is "not recorded"
    _settings_row("max_new_tokens", [1, 8192, None], [0, 8193, 2.5, 10 ** 400]),
    _settings_row("temperature", [0, 0.0, 10.0], [-1e-9, 10.000001, NAN, INF, "hot", True]),
    _settings_row("top_p", [1e-9, 1.0], [0.0, 1.000001]),
    _settings_row("seed", [0, -1, 2 ** 40], [0.5, "0"]),
    *(_settings_row(k, [1, 32], [0, 33]) for k in ("m_depth", "t_depth")),
    *(_settings_row(k, [1, 64], [0, 65]) for k in ("m_topk", "t_topk", "min_draft_len", "spec_k")),
    *(_settings_row(k, [1, 512], [0, 513]) for k in ("m_tree_size", "t_tree_size")),
]


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 12 else r[:8] + "..."


def _case_id(b: Bound, v: Any, ok: bool) -> str:
    case = re.sub(r"[^A-Za-z0-9.+<>=]+", "-", b.case).strip("-")
    return f"{b.field}[{case}]={_short(v)}-{'loads' if ok else 'refused'}"


BOUND_CASES = [pytest.param(b, v, ok, id=_case_id(b, v, ok))
               for b in BOUNDS for ok, values in ((True, b.ok), (False, b.bad)) for v in values]


@pytest.mark.parametrize("bound,value,loads", BOUND_CASES)
def test_numeric_bound(bound: Bound, value: Any, loads: bool) -> None:
    d = BASES[bound.base]().to_dict()
    bound.put(d, value)
    text = json.dumps(d)
    if loads:
        back = trace_from_json(text)
        assert trace_from_json(back.to_json()).to_json() == back.to_json()     # and saves as a valid trace
    else:
        with pytest.raises(TraceError, match=bound.message(value)):
            trace_from_json(text)


def test_every_numeric_field_has_a_bounds_row() -> None:
    numeric = {f"{cls.__name__}.{f.name}" for cls in (Trace, Step, DraftTree, TreeNode, SeqToken)
               for f in dataclasses.fields(cls) if re.search(r"\b(int|float)\b", str(f.type))}
    numeric |= {f"settings.{f.name}" for f in dataclasses.fields(DecodeSettings)}
    assert {b.field for b in BOUNDS} == numeric
    assert all(b.ok and b.bad for b in BOUNDS)
    # the hand-made bases load as they are: every refusal above is the probed value's doing
    for make in BASES.values():
        assert trace_from_json(make().to_json()) == make()


# ---- the traces the project ships --------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _is_trace_document(d: Any) -> bool:
    """A trace ({"meta", "steps", ...}) or a comparison of traces ({"runs": [trace, ...]})."""
    def one(t: Any) -> bool:
        return isinstance(t, dict) and "meta" in t and "steps" in t
    return one(d) or (isinstance(d, dict) and isinstance(d.get("runs"), list) and bool(d["runs"])
                      and all(one(r) for r in d["runs"]))


def test_shipped_and_benchmark_traces_load() -> None:
    files = sorted(ROOT.glob("assets/traces/*.json")) + sorted((ROOT / "docs" / "bench").rglob("*.json"))
    traces = [f for f in files if _is_trace_document(json.loads(f.read_bytes()))]
    names = {f.relative_to(ROOT).as_posix() for f in traces}
    assert {"assets/traces/h200-smollm2-python-tips.json", "assets/traces/handmade-demo.json",
            "assets/traces/tiny-random-plumbing.json", "docs/bench/app-check-h200-llama3-70b.json"} <= names
    for f in traces:
        runs = comparison_from_json(f.read_bytes())
        assert runs and all(t.steps and t.stats()["new_tokens"] for t in runs), f
