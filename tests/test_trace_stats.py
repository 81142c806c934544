"""Every statistic derived from a trace, checked against numbers worked out by hand.

The traces are small and hand-built, one per method, shaped as the decoders in
hierviz/decoding/decoders.py write them: step 0 is the prefill round (one target token), and every
later round appends the accepted draft plus the target's bonus. Acceptance differs by depth
(HierSpec 5/6, 3/4, 1/2; EAGLE-2 1.0, 1.0, 0.6) and one tree is shallower than the others, so a
statistic that ignores depth, shifts it by one or takes every tree as deep as the deepest fails.
The same traces feed the stats table, the latency bars and the benchmark summary.
"""
from __future__ import annotations

import html
import re
from typing import Any

import pytest

from hierviz.measure.bench import _aggregate
from hierviz.trace import STAGES, DraftTree, SeqToken, Step, Trace, TreeNode, trace_from_json, trace_stats
from hierviz.viz.latency import latency_rows
from hierviz.viz.panels import stats_html


# ---- hand-made traces -------------------------------------------------------------------------

def _tok(t: int) -> str:
    return f" t{t}"


def chain_tree(depth: int, n_acc: int, verifier: str, root: int) -> DraftTree:
    """A path of `depth` nodes (one per depth 1..depth) plus a rejected sibling of its first node,
    numbered as the decoders number nodes (by depth): depth 1 holds ids 1 (path) and 2 (sibling),
    depth d >= 2 holds id d + 1. The verifier accepted the first `n_acc` nodes of the path."""
    path_ids = [1] + [d + 1 for d in range(2, depth + 1)]
    nodes = [TreeNode(1, root + 1, _tok(root + 1), 0, 1, -0.5, -0.5),
             TreeNode(2, root + 2, _tok(root + 2), 0, 1, -1.5, -1.5)]
    for d in range(2, depth + 1):
        nodes.append(TreeNode(d + 1, root + d + 1, _tok(root + d + 1), path_ids[d - 2], d, -0.5 * d, -0.5))
    bonus = root + 50
    return DraftTree(root, _tok(root), nodes, path_ids[:n_acc], bonus, _tok(bonus), verifier)


def _accepted_tokens(t: DraftTree) -> list[int]:
    return [t.nodes[i - 1].token for i in t.accepted]


def _prefill(method: str, token: int, timings: dict[str, float], forwards: dict[str, int]) -> Step:
    return Step(0, method, [token], [_tok(token)], ["target_bonus"], timings, forwards=forwards)


def hierspec_trace() -> Trace:
    """Prefill + 3 rounds; M-verified trees as (deepest node, accepted path length):
    round 1: A (2, 2), B (2, 0); round 2: C (3, 3); round 3: D (3, 1), E (1, 1), F (3, 2)."""
    rounds = [  # (trees, target_accepted, timings_ms)
        ([(2, 2), (2, 0)], 3, {"draft": 3.0, "intermediate_verify": 5.0, "target_verify": 12.0, "overhead": 1.0}),
        ([(3, 3)], 4, {"draft": 1.5, "intermediate_verify": 2.5, "target_verify": 12.0, "overhead": 0.5}),
        ([(3, 1), (1, 1), (3, 2)], 5, {"draft": 4.5, "intermediate_verify": 7.5, "target_verify": 13.0, "overhead": 1.25}),
    ]
    steps = [_prefill("hierspec", 10, {"target_verify": 40.0, "intermediate_verify": 8.0},
                      {"target": 1, "intermediate": 1})]
    for i, (shapes, n, timings) in enumerate(rounds, start=1):
        trees = [chain_tree(depth, acc, "intermediate", 1000 * i + 100 * k) for k, (depth, acc) in enumerate(shapes)]
        if i == 1:      # B rejected at its root: M's token lay outside E_M's draft vocabulary
            trees[1].undraftable = True
        seq = []
        for k, t in enumerate(trees):      # each tree's accepted path, then M's bonus token
            seq += [SeqToken(x, _tok(x), "tree", k) for x in _accepted_tokens(t)]
            seq.append(SeqToken(t.bonus_token, t.bonus_text, "intermediate_bonus", k))
        bonus = 1000 * i + 99
        new = [q.token for q in seq[:n]] + [bonus]
        steps.append(Step(i, "hierspec", new, [_tok(x) for x in new], [q.source for q in seq[:n]] + ["target_bonus"],
                          timings, trees, seq, n, bonus, _tok(bonus),
                          {"target": 1, "intermediate": len(trees), "e_m": sum(len(t.nodes) for t in trees)}))
    return Trace({"method": "hierspec", "synthetic": True}, steps, prompt_tokens=7, prefill_ms=48.0)


def eagle2_trace() -> Trace:
    """Prefill + 5 rounds, one target-verified tree of depth 3 each, accepted paths 3, 3, 2, 3, 2;
    the last round is cut after 2 of its 3 tokens (EOS), as the engine cuts it."""
    steps = [_prefill("eagle2", 20, {"target_verify": 30.0, "overhead": 2.0}, {"target": 1})]
    for i, n in enumerate([3, 3, 2, 3, 2], start=1):
        t = chain_tree(3, n, "target", 2000 + 100 * i)
        new = _accepted_tokens(t) + [t.bonus_token]
        src = ["tree"] * n + ["target_bonus"]
        if i == 5:
            new, src = new[:2], src[:2]
        steps.append(Step(i, "eagle2", new, [_tok(x) for x in new], src,
                          {"draft": 4.0, "target_verify": 10.0, "overhead": 1.0}, [t], [], n, t.bonus_token,
                          t.bonus_text, {"target": 1, "e_t": 3}))
    return Trace({"method": "eagle2", "synthetic": True}, steps, prompt_tokens=7, prefill_ms=32.0)


def spec_trace() -> Trace:
    """Prefill + 4 rounds of 3 drafted tokens (spec_k 3), the target accepting 3, 0, 1, 2."""
    steps = [_prefill("spec", 30, {"target_verify": 20.0, "draft": 5.25}, {"target": 1, "intermediate": 1})]
    for i, n in enumerate([3, 0, 1, 2], start=1):
        draft = [3000 + 10 * i + j for j in range(3)]
        bonus = 3000 + 10 * i + 9
        new = draft[:n] + [bonus]
        steps.append(Step(i, "spec", new, [_tok(x) for x in new], ["draft"] * n + ["target_bonus"],
                          {"draft": 6.0, "target_verify": 12.0, "overhead": 0.5}, [],
                          [SeqToken(x, _tok(x), "draft") for x in draft], n, bonus, _tok(bonus),
                          {"target": 1, "intermediate": 3}))
    return Trace({"method": "spec", "synthetic": True}, steps, prompt_tokens=7, prefill_ms=25.25)


def ar_trace() -> Trace:
    """Prefill + 4 rounds of one target token each."""
    steps = [_prefill("ar", 40, {"target_verify": 15.0}, {"target": 1})]
    for i in range(1, 5):
        steps.append(Step(i, "ar", [40 + i], [_tok(40 + i)], ["target_bonus"],
                          {"target_verify": 10.0, "overhead": 0.25}, target_bonus=40 + i,
                          target_bonus_text=_tok(40 + i), forwards={"target": 1}))
    return Trace({"method": "ar", "synthetic": True}, steps, prompt_tokens=7, prefill_ms=15.0)


TRACES = {"hierspec": hierspec_trace, "eagle2": eagle2_trace, "spec": spec_trace, "ar": ar_trace}


def _stages(**ms: float) -> dict[str, float]:
    return {k: ms.get(k, 0.0) for k in STAGES}


# Worked by hand from the builders above.
EXPECTED: dict[str, dict[str, Any]] = {
    "hierspec": {
        "new_tokens": 16,                          # 1 (prefill) + 4 + 5 + 6: accepted draft + bonus per round
        "steps": 4,
        "total_ms": 111.75,                        # 48 + 21 + 16.5 + 26.25
        "tokens_per_s": 16 / 0.11175,              # = 143.18
        "tau_target": 16 / 4,                      # one target forward per round
        "tau_intermediate": 15 / 6,                # (2+1 + 0+1 + 3+1 + 1+1 + 1+1 + 2+1) / 6 trees = 2.5
        "mean_sequence_len": 15 / 3,               # sequences of 4, 4, 7 in the 3 drafting rounds
        # depth 1: all 6 trees try it, A C D E F pass -> 5/6
        # depth 2: the trees that passed depth 1 and reach depth 2: A C D F (E has no depth 2); A C F pass -> 3/4
        # depth 3: passed depth 2 and reach 3: C F (A is 2 deep); C passes -> 1/2
        "per_depth_acceptance": {1: 5 / 6, 2: 3 / 4, 3: 1 / 2},
        "stage_ms": _stages(draft=9.0, intermediate_verify=23.0, target_verify=77.0, overhead=2.75),
        "tree_rejections": 3,                      # B, D, F stop before their last depth; A, C, E use all of it
        "undraftable_rejections": 1,               # B
    },
    "eagle2": {
        "new_tokens": 18,                          # 1 + 4 + 4 + 3 + 4 + 2 (the last round cut from 3 to 2)
        "steps": 6,
        "total_ms": 107.0,                         # 32 + 5 * 15
        "tokens_per_s": 18 / 0.107,                # = 168.22
        "tau_target": 18 / 6,
        "tau_intermediate": None,                  # the target verifies EAGLE-2's trees: no M level
        "mean_sequence_len": 0.0,
        # all 5 trees are 3 deep with paths 3, 3, 2, 3, 2: depths 1 and 2 always pass, depth 3 in 3 of 5
        "per_depth_acceptance": {1: 1.0, 2: 1.0, 3: 0.6},
        "stage_ms": _stages(draft=20.0, target_verify=80.0, overhead=7.0),
        "tree_rejections": 2,                      # the two paths of 2 in 3-deep trees
        "undraftable_rejections": 0,
    },
    "spec": {
        "new_tokens": 11,                          # 1 + 4 + 1 + 2 + 3
        "steps": 5,
        "total_ms": 99.25,                         # 25.25 + 4 * 18.5
        "tokens_per_s": 11 / 0.09925,              # = 110.83
        "tau_target": 11 / 5,
        "tau_intermediate": None,
        "mean_sequence_len": 12 / 4,               # 4 drafts of 3 (the prefill drafts nothing)
        "per_depth_acceptance": {},                # no trees
        "stage_ms": _stages(draft=29.25, target_verify=68.0, overhead=2.0),
        "tree_rejections": 0,
        "undraftable_rejections": 0,
    },
    "ar": {
        "new_tokens": 5,
        "steps": 5,
        "total_ms": 56.0,                          # 15 + 4 * 10.25
        "tokens_per_s": 5 / 0.056,                 # = 89.29
        "tau_target": 1.0,
        "tau_intermediate": None,
        "mean_sequence_len": 0.0,
        "per_depth_acceptance": {},
        "stage_ms": _stages(target_verify=55.0, overhead=1.0),
        "tree_rejections": 0,
        "undraftable_rejections": 0,
    },
}


def assert_stats(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Same keys (in order for per-depth acceptance: depths ascending) and values to 1e-12."""
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        if isinstance(w, dict):
            assert list(g) == list(w), k
            assert all(g[d] == pytest.approx(w[d], rel=1e-12) for d in w), (k, g, w)
        elif w is None:
            assert g is None, k
        else:
            assert type(g) is type(w) and g == pytest.approx(w, rel=1e-12), (k, g, w)


# ---- trace_stats / Trace.stats ----------------------------------------------------------------

@pytest.mark.parametrize("method", list(TRACES))
def test_stats_of_a_hand_made_trace(method: str) -> None:
    tr = TRACES[method]()
    assert_stats(tr.stats(), EXPECTED[method])
    assert_stats(trace_stats(tr.steps), EXPECTED[method])
    # the loader accepts the trace and a loaded copy gives the same figures
    back = trace_from_json(tr.to_json())
    assert back == tr
    assert_stats(back.stats(), EXPECTED[method])


def test_stats_of_a_prefix() -> None:
    """The app shows the stats up to the inspected step: HierSpec through round 1 (trees A, B)."""
    steps = hierspec_trace().steps[:2]
    assert_stats(trace_stats(steps), {
        "new_tokens": 5, "steps": 2, "total_ms": 69.0, "tokens_per_s": 5 / 0.069, "tau_target": 5 / 2,
        "tau_intermediate": (3 + 1) / 2, "mean_sequence_len": 4 / 1,
        # depth 1: A passes, B fails; depth 2: only A reached it, and passed
        "per_depth_acceptance": {1: 0.5, 2: 1.0},
        "stage_ms": _stages(draft=3.0, intermediate_verify=13.0, target_verify=52.0, overhead=1.0),
        "tree_rejections": 1, "undraftable_rejections": 1,     # B, outside E_M's draft vocabulary
    })


def test_stats_of_no_steps() -> None:
    assert_stats(trace_stats([]), {
        "new_tokens": 0, "steps": 0, "total_ms": 0, "tokens_per_s": 0.0, "tau_target": 0.0, "tau_intermediate": None,
        "mean_sequence_len": 0.0, "per_depth_acceptance": {}, "stage_ms": _stages(), "tree_rejections": 0,
        "undraftable_rejections": 0})


def test_the_hand_made_trees_are_what_the_stats_assume() -> None:
    """Guards the expected numbers above against a change in the builders."""
    shapes = [[(max(n.depth for n in t.nodes), len(t.accepted)) for t in s.trees] for s in hierspec_trace().steps]
    assert shapes == [[], [(2, 2), (2, 0)], [(3, 3)], [(3, 1), (1, 1), (3, 2)]]
    t = chain_tree(3, 2, "target", 0)
    assert [(n.id, n.parent, n.depth) for n in t.nodes] == [(1, 0, 1), (2, 0, 1), (3, 1, 2), (4, 3, 3)]
    assert t.accepted == [1, 3]
    e2 = eagle2_trace()
    assert [len(s.trees[0].accepted) for s in e2.steps[1:]] == [3, 3, 2, 3, 2]


# ---- figures shown from the stats ------------------------------------------------------------

def _table(page: str) -> dict[str, list[str]]:
    """The stats table as {row name: [cell text per run]}."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page):
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<t[dh]>(.*?)</t[dh]>", row)]
        rows[cells[0]] = cells[1:]
    return rows


def test_stats_table_shows_the_hand_worked_figures() -> None:
    runs = [hierspec_trace(), eagle2_trace(), ar_trace(), spec_trace()]
    page = stats_html(runs)
    rows = _table(page)
    assert rows["measure"] == ["HierSpec", "EAGLE-2", "Autoregressive", "Sequence spec."]
    assert rows["tokens"] == ["16", "18", "5", "11"]
    assert rows["decode time (ms)"] == ["112", "107", "56", "99"]           # 111.75, 107, 56, 99.25 ms
    assert rows["tokens / s"] == ["143.2", "168.2", "89.3", "110.8"]
    assert rows["τ target (tokens / T pass)"] == ["4.00", "3.00", "1.00", "2.20"]
    assert rows["τ intermediate (tokens / M tree)"] == ["2.50", "–", "–", "–"]
    assert rows["mean sequence draft"] == ["5.0", "–", "–", "3.0"]          # 5.0 and 3.0; 0 shows as –
    # per-depth acceptance, in percent: 5/6 3/4 1/2 for HierSpec, 1 1 0.6 for EAGLE-2
    assert rows["accepted at depth 1"] == ["83%", "100%", "–", "–"]
    assert rows["accepted at depth 2"] == ["75%", "100%", "–", "–"]
    assert rows["accepted at depth 3"] == ["50%", "60%", "–", "–"]
    assert "accepted at depth 4" not in rows and "accepted at depth 0" not in rows
    assert [int(w) for w in re.findall(r'class="hv-bar"><span style="width:(\d+)%', page)] == [83, 100, 75, 100, 50, 60]
    # speed-ups over the same first 5 tokens (AR's all): HierSpec has them after 48 + 21 = 69 ms, EAGLE-2
    # after 32 + 15 = 47 (0.681), AR after 56 (0.812), Sequence spec. after 25.25 + 18.5 = 43.75 (0.634):
    # every one is faster, so each is named as faster than HierSpec (69/43.75, 69/47, 69/56), fastest first
    assert ("<b>Sequence spec.</b> is <b>1.58×</b> · <b>EAGLE-2</b> is <b>1.47×</b> · <b>Autoregressive</b> is "
            "<b>1.23×</b> faster than HierSpec on this run") in page
    assert "Over the first 5 tokens of every run" in page


def test_stats_table_up_to_a_step() -> None:
    """Scrubbed to HierSpec's round 1: its column holds the prefix's figures, the others whole runs."""
    rows = _table(stats_html([hierspec_trace(), eagle2_trace()], {"hierspec": 1}))
    assert rows["tokens"] == ["5", "18"]
    assert rows["τ target (tokens / T pass)"] == ["2.50", "3.00"]
    assert rows["τ intermediate (tokens / M tree)"] == ["2.00", "–"]
    assert rows["accepted at depth 1"] == ["50%", "100%"]
    assert rows["accepted at depth 2"] == ["100%", "100%"]
    assert rows["accepted at depth 3"] == ["–", "60%"]


def test_latency_bars_sum_the_hand_made_timings() -> None:
    """HierSpec inspected at round 2 (10 tokens so far) against the other runs at 10 tokens."""
    step_rows, cum_rows = latency_rows(hierspec_trace(), 2, [eagle2_trace(), ar_trace(), spec_trace()])
    assert step_rows == [
        ("HierSpec · step 3 (5 tok)", {"draft": 1.5, "intermediate_verify": 2.5, "target_verify": 12.0, "overhead": 0.5},
         "hierspec"),
        ("EAGLE-2 · step 4 (3 tok)", {"draft": 4.0, "target_verify": 10.0, "overhead": 1.0}, "eagle2"),   # 1+4+4+3 = 12
        ("Autoregressive · step 5 (1 tok)", {"target_verify": 10.0, "overhead": 0.25}, "ar"),            # never gets to 10
        ("Sequence spec. · step 5 (3 tok)", {"draft": 6.0, "target_verify": 12.0, "overhead": 0.5}, "spec"),  # 1+4+1+2+3
    ]
    assert cum_rows == [
        ("HierSpec · 10 tok", _stages(draft=4.5, intermediate_verify=15.5, target_verify=64.0, overhead=1.5), "hierspec"),
        ("EAGLE-2 · 12 tok", _stages(draft=12.0, target_verify=60.0, overhead=5.0), "eagle2"),
        ("Autoregressive · 5 tok (so far)", _stages(target_verify=55.0, overhead=1.0), "ar"),
        ("Sequence spec. · 11 tok", _stages(draft=29.25, target_verify=68.0, overhead=2.0), "spec"),
    ]


def test_benchmark_summary_of_the_hand_made_traces() -> None:
    """bench's per-method summary: the same stats in seconds, depths as JSON keys; over two runs
    the trees of both count (HierSpec's 6 and EAGLE-2's 5 are pooled per depth)."""
    got = _aggregate([hierspec_trace()])
    assert got == {"tokens_per_s": pytest.approx(16 / 0.11175), "new_tokens": 16, "total_s": pytest.approx(0.11175),
                   "tau_target": 4.0, "tau_intermediate": 2.5,
                   "per_depth_acceptance": {"1": pytest.approx(5 / 6), "2": 0.75, "3": 0.5},
                   "stage_s": {"draft": 0.009, "intermediate_verify": 0.023, "target_verify": 0.077,
                               "overhead": pytest.approx(0.00275)}}
    both = _aggregate([hierspec_trace(), eagle2_trace()])
    # depth 1: 5 + 5 of 6 + 5; depth 2: 3 + 5 of 4 + 5; depth 3: 1 + 3 of 2 + 5
    assert both["per_depth_acceptance"] == {"1": pytest.approx(10 / 11), "2": pytest.approx(8 / 9),
                                            "3": pytest.approx(4 / 7)}
    assert both["new_tokens"] == 34 and both["tau_target"] == pytest.approx(34 / 10)
    assert both["tau_intermediate"] == 2.5           # EAGLE-2's trees are no M trees
