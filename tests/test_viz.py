"""Figure and HTML builders on hand-made traces: colours, layout, bar sums, escaping."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hierviz.trace import DraftTree, SeqToken, Step, Trace, TreeNode, comparison_from_json, save_comparison, trace_from_json
from hierviz.viz import sample
from hierviz.viz.latency import latency_figure, latency_rows, step_reaching
from hierviz.viz.panels import legend_html, output_html, run_setup_line, sequence_html, stats_html, verdict_html
from hierviz.viz.style import COLORS, visible_token
from hierviz.viz.tree import BONUS, COL_PX, ROOT, _chip_px, layout_tree, node_status, tree_figure

EVIL = '<script>alert("x")</script>&amp;'


@pytest.fixture(scope="module")
def runs() -> list[Trace]:
    return sample.comparison(0, 48)


def small_tree(verifier: str = "intermediate") -> DraftTree:
    # root -> 1 (acc) -> 3 (acc) -> 5 ; root -> 2 -> 4 ; 1 -> 6
    nodes = [TreeNode(1, 11, " a", 0, 1, -0.1, -0.1), TreeNode(2, 12, " b", 0, 1, -1.0, -1.0),
             TreeNode(3, 13, " c", 1, 2, -0.3, -0.2), TreeNode(4, 14, " d", 2, 2, -1.5, -0.5),
             TreeNode(5, 15, " e", 3, 3, -0.9, -0.6), TreeNode(6, 16, " f", 1, 2, -2.0, -1.9)]
    return DraftTree(10, " r", nodes, [1, 3], 17, " g", verifier)


# ---- tree ------------------------------------------------------------------------------------

def test_node_status_accepted_rejected_discarded():
    status = node_status(small_tree())
    assert status == {1: "tree", 2: "rejected", 3: "tree", 4: "discarded", 5: "rejected", 6: "rejected"}


def test_tree_colours_and_bonus():
    fig = tree_figure([small_tree()])
    by_text = {token_part(a.text): a.bgcolor for a in fig.layout.annotations}
    assert by_text["·a"] == COLORS["tree"] and by_text["·c"] == COLORS["tree"]
    assert by_text["·b"] == COLORS["rejected"] and by_text["·e"] == COLORS["rejected"]
    assert by_text["·d"] == COLORS["discarded"]
    assert by_text["·r"] == COLORS["root"]
    assert by_text["·g"] == COLORS["intermediate_bonus"]
    fig_t = tree_figure([small_tree("target")])
    assert {token_part(a.text): a.bgcolor for a in fig_t.layout.annotations}["·g"] == COLORS["target_bonus"]


def token_part(chip_text: str) -> str:
    """A node chip's token label without the role mark drawn after it."""
    return chip_text.split(" ")[0]


def test_accepted_path_and_bonus_form_the_top_row():
    placed = {p.id: p for p in layout_tree(small_tree())}
    top = sorted((p.x, p.id) for p in placed.values() if p.y == 0)
    assert [i for _, i in top] == [ROOT, 1, 3, BONUS]


def _assert_no_overlap(placed) -> None:
    cells = [(p.x, p.y) for p in placed]
    assert len(cells) == len(set(cells)), "two nodes share a position"
    for p in placed:
        # a chip must end before the next column starts, or labels would collide
        assert _chip_px(p.text) < COL_PX - 8
    for p in placed:
        if p.parent is not None:
            parent = next(q for q in placed if q.id == p.parent)
            assert p.x == parent.x + 1 and p.y >= parent.y


def test_sixty_node_tree_layout_has_no_overlaps(runs):
    tree = runs[1].steps[0].trees[0]
    assert len(tree.nodes) == 60
    placed = layout_tree(tree)
    assert len(placed) == 62            # 60 nodes + root + bonus
    _assert_no_overlap(placed)
    fig = tree_figure([tree])
    assert fig.layout.height >= (max(p.y for p in placed) + 1) * 20


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=120), st.integers(0, 6))
def test_random_tree_layouts_never_overlap(parent_picks, n_acc):
    nodes: list[TreeNode] = []
    for i, pick in enumerate(parent_picks, start=1):
        parent = 0 if i == 1 else pick % i     # any earlier node or the root
        depth = 1 if parent == 0 else nodes[parent - 1].depth + 1
        nodes.append(TreeNode(i, i, f" w{pick % 97}", parent, depth, -float(i), -0.5))
    acc, cur = [], 0
    for _ in range(n_acc):
        kid = next((n for n in nodes if n.parent == cur), None)
        if kid is None:
            break
        acc.append(kid.id)
        cur = kid.id
    tree = DraftTree(0, "r", nodes, acc, 1, "b", "intermediate")
    placed = layout_tree(tree)
    assert len(placed) == len(nodes) + 2
    _assert_no_overlap(placed)


def test_several_trees_are_laid_out_left_to_right(runs):
    step = next(s for s in runs[0].steps if len(s.trees) >= 2)
    fig = tree_figure(step.trees, "t")
    roots = [a for a in fig.layout.annotations if a.bgcolor == COLORS["root"]]
    assert len(roots) == len(step.trees)
    xs = [a.x for a in roots]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    assert fig.layout.width > COL_PX * 4 * len(step.trees)


def test_tree_figure_escapes_token_text():
    t = small_tree()
    t.nodes[1].text = EVIL
    fig = tree_figure([t])
    texts = [a.text for a in fig.layout.annotations]
    assert not any("<script" in x for x in texts)
    hovers = [h for tr in fig.data if tr.hovertext for h in tr.hovertext]
    assert any("&lt;script&gt;" in h for h in hovers) and not any("<script" in h for h in hovers)


def test_empty_tree_figure():
    fig = tree_figure([])
    assert "No draft tree" in fig.layout.annotations[0].text


# ---- HTML panels -----------------------------------------------------------------------------

def test_sequence_chips_by_provenance(runs):
    step = runs[0].steps[0]
    html = sequence_html(step)
    assert html.count('class="hv-chip"') == len(step.sequence)
    assert COLORS["tree"] in html and COLORS["intermediate_bonus"] in html
    assert html.count('class="hv-group"') == len(step.trees)


def test_verdict_marks_accepted_rejected_and_bonus():
    seq = [SeqToken(1, " a", "tree", 0), SeqToken(2, " b", "intermediate_bonus", 0), SeqToken(3, " c", "tree", 1),
           SeqToken(4, " d", "tree", 1)]
    step = Step(0, "hierspec", [1, 2, 9], [" a", " b", " z"], ["tree", "intermediate_bonus", "target_bonus"],
                {"draft": 1.0}, [], seq, 2, 9, " z")
    html = verdict_html(step)
    assert html.count("✓") == 2
    assert html.count("hv-rejected") == 1 and html.count("hv-dropped") == 1
    assert COLORS["target_bonus"] in html and "·z" in html
    assert "accepted <b>2</b> of 4" in html


def test_verdict_all_accepted_and_eagle2_and_ar(runs):
    seq = [SeqToken(1, " a", "tree", 0)]
    step = Step(0, "hierspec", [1, 9], [" a", " z"], ["tree", "target_bonus"], {}, [], seq, 1, 9, " z")
    assert "all 1" in verdict_html(step) and "hv-rejected" not in verdict_html(step)
    e2 = runs[1].steps[0]
    assert "checked all <b>60</b> tree tokens" in verdict_html(e2)
    assert "EAGLE-2 has no sequence draft" in sequence_html(e2)
    assert "one token" in verdict_html(runs[2].steps[0])


def test_html_builders_escape_token_text():
    seq = [SeqToken(1, EVIL, "tree", 0)]
    step = Step(0, "hierspec", [1, 2], [EVIL, "x\n<b>"], ["tree", "target_bonus"], {"draft": 1.0},
                [small_tree()], seq, 0, 2, "<img src=x onerror=alert(1)>")
    trace = Trace({"method": "hierspec", "prompt": "<i>prompt</i>"}, [step])
    for html in (sequence_html(step), verdict_html(step), output_html(trace)):
        assert "<script" not in html and "<img" not in html and "<i>prompt" not in html
        assert "<b>x" not in html
    assert "&lt;script&gt;" in output_html(trace)
    assert "<br>" in output_html(trace)          # a newline in a token is a line break


def test_output_html_colours_by_producer_and_highlights_step(runs):
    tr = runs[0]
    html = output_html(tr, upto=2, highlight=2)
    n_tok = sum(len(s.new_tokens) for s in tr.steps[:3])
    assert f"Output: {n_tok} tokens" in html
    assert "hv-cur" in html and html.count('title="step 3') >= 1 and 'title="step 4' not in html
    # consecutive tokens of one producer in one step share a span: far fewer spans than tokens
    assert html.count('class="hv-tok') < n_tok


def test_long_output_stays_small():
    tr = sample.hierspec_trace(3, 512)
    assert len(output_html(tr)) < 60_000


def test_stats_table_speedup_and_synthetic_note(runs):
    html = stats_html(runs)
    s_h, s_e = runs[0].stats(), runs[1].stats()
    assert f'{s_h["tokens_per_s"] / s_e["tokens_per_s"]:.2f}×' in html
    assert "accepted at depth 1" in html and "Hand-made trace" in html
    assert "–" in stats_html([runs[2]])     # AR has no intermediate tau


def test_legend_lists_every_colour():
    html = legend_html()
    for k in ("tree", "intermediate_bonus", "target_bonus", "rejected", "discarded"):
        assert COLORS[k] in html


def test_visible_token():
    assert visible_token(" the") == "·the"
    assert visible_token("\n") == "⏎"
    assert visible_token("") == "∅"
    assert visible_token("abcdefghijklmnop", 8) == "abcdefg…"


# ---- latency ---------------------------------------------------------------------------------

def test_bars_sum_to_step_time(runs):
    main, others = runs[0], runs[1:]
    for i in (0, 3, len(main.steps) - 1):
        fig = latency_figure(main, i, others)
        step_rows, cum_rows = latency_rows(main, i, others)
        bars = [t for t in fig.data if t.type == "bar"]
        for row_label, stages, _ in step_rows:
            total = sum(t.x[list(t.y).index(row_label)] for t in bars if row_label in t.y)
            assert math.isclose(total, sum(stages.values()), rel_tol=1e-9)
        assert math.isclose(sum(step_rows[0][1].values()), main.steps[i].step_ms)
        # cumulative rows compare the same output position
        n = sum(len(s.new_tokens) for s in main.steps[: i + 1])
        j = step_reaching(others[0], n)
        assert math.isclose(sum(cum_rows[1][1].values()), sum(s.step_ms for s in others[0].steps[: j + 1]))
        assert math.isclose(sum(cum_rows[0][1].values()), sum(s.step_ms for s in main.steps[: i + 1]))


def test_latency_figure_without_runs():
    assert latency_figure(None).layout.annotations[-1].text.startswith("Latency bars")


# ---- hand-made traces ------------------------------------------------------------------------

def test_sample_traces_are_valid_and_consistent(runs, tmp_path):
    path = tmp_path / "c.json"
    save_comparison(runs, path)
    back = comparison_from_json(path.read_text())
    assert [t.meta["method"] for t in back] == ["hierspec", "eagle2", "ar"]
    assert all(t.meta["synthetic"] for t in back)
    for s in back[0].steps:
        n = s.target_accepted
        assert s.new_text[:n] == [t.text for t in s.sequence[:n]]
        assert s.new_sources[-1] == "target_bonus" or len(s.new_text) < n + 1
    assert back[0].output_text == back[1].output_text == back[2].output_text   # lossless: same text


def test_shipped_traces_load():
    from pathlib import Path
    files = sorted((Path(__file__).resolve().parent.parent / "assets" / "traces").glob("*.json"))
    assert files
    for f in files:
        runs = comparison_from_json(f.read_bytes())
        assert runs and all(t.steps for t in runs)


def test_random_seeds_build_valid_trees():
    for seed in range(5):
        t = sample.build_tree(random.Random(seed), sample._Vocab(), "r", [" a", " b", " c"], 4, 5, 20, 0.7, "target")
        assert len(t.nodes) == 20
        made = Trace({"method": "eagle2"}, [Step(0, "eagle2", [1], ["x"], ["target_bonus"], {}, [t])])
        back = trace_from_json(made.to_json())          # the loader's checks accept every generated tree
        assert back.steps[0].trees[0] == t and back == made


def test_plotly_labels_keep_quotes_but_escape_markup():
    from hierviz.viz.style import plotly_label
    assert plotly_label('"') == '"'
    assert plotly_label("<b>") == "&lt;b&gt;"


def test_stats_say_which_kernels_and_vocabulary_ran() -> None:
    meta = {"device": "cpu", "dtype": "float32", "w4_kernel": "dequant_cached", "intermediate_w4_kernel": "int4pack_cpu",
            "draft_vocab": "../models/smollm2-draft-vocab-8192.json", "intermediate_vocab": "draft"}
    line = run_setup_line(meta)
    assert line == ("cpu float32 · T kernel dequant_cached · M kernel int4pack_cpu · "
                    "drafter vocabulary smollm2-draft-vocab-8192 (M too)")
    assert run_setup_line({"w4_kernel": "triton", "intermediate_w4_kernel": "triton", "draft_vocab": "full"}) == "T kernel triton"
    assert run_setup_line({"w4_kernel": "int4pack_cpu", "target_batch_invariant": True}) == \
        "T kernel int4pack_cpu (batch-invariant)"
    assert run_setup_line({}) == ""
    assert run_setup_line({"w4_kernel": "triton", "intermediate_lm_head": "rtn-g64"}) == "T kernel triton · M&#x27;s LM head rtn-g64"
    # the GPU's W4 start-up proof and an EAGLE-3 head are named where the stack has them
    proof = "W4 fast path: proven here (NVIDIA H200, Triton 3.9, 4 shapes x 128 row counts, 16 s)"
    assert run_setup_line({"w4_kernel": "triton", "w4_fast_path": proof,
                           "head_types": {"e_m": "eagle3", "e_t": "eagle2", "e_t3": "eagle3"}}) == \
        f"T kernel triton · {proof} · EAGLE-3 head on M and T"
    t = Trace(meta={"method": "ar", **meta})
    assert "Ran on cpu float32" in stats_html([t])


def test_stats_check_each_run_against_autoregressive(runs):
    """The lossless check in the stats table: same tokens as AR over the part both show, the first
    differing token otherwise, nothing to check when sampling or without an AR run."""
    import copy
    from hierviz.trace import first_difference, output_tokens
    assert "same text as Autoregressive" not in stats_html(runs)         # hand-made: invented texts
    hs, e2, ar = (copy.deepcopy(r) for r in runs)
    for t in (hs, e2, ar):
        t.meta.pop("synthetic", None)
    want = output_tokens(ar)
    for t in (hs, e2):                       # the hand-made runs become lossless copies of AR's text
        k = 0
        for s in t.steps:
            s.new_tokens = want[k:k + len(s.new_tokens)]
            k += len(s.new_tokens)
    html = stats_html([hs, e2, ar])
    assert "same text as Autoregressive" in html and html.count("✓ yes") == 2 and "reference" in html
    step = next(s for s in e2.steps[3:] if s.new_tokens)
    pos = sum(len(s.new_tokens) for s in e2.steps[:e2.steps.index(step)])
    step.new_tokens = [step.new_tokens[0] + 1] + step.new_tokens[1:]
    assert first_difference(output_tokens(e2), want) == pos
    html = stats_html([hs, e2, ar])
    assert html.count("✓ yes") == 1 and f"✗ from token {pos + 1}" in html
    # scrubbed to a step before the difference: the part shown is identical
    assert stats_html([hs, e2, ar], upto={"eagle2": 1}).count("✓ yes") == 2
    sampled = copy.deepcopy(hs)
    sampled.meta["settings"] = {**(sampled.meta.get("settings") or {}), "temperature": 0.7}
    assert "✓ yes" not in stats_html([sampled, ar]) and "same text as Autoregressive" in stats_html([sampled, ar])
    assert "same text as Autoregressive" not in stats_html([hs, e2])      # no AR run: nothing to check against


def _as_plotly_checks_it(fig) -> dict:
    """The figure rebuilt through plotly's validation (which raises on any unknown or malformed
    property), as JSON."""
    import json

    import plotly.graph_objects as go
    return json.loads(go.Figure(json.loads(fig.to_json())).to_json())


@pytest.mark.parametrize("title", ["", "HierSpec · step 3"])
def test_per_step_figures_pass_plotly_validation(runs, title):
    """The tree, latency and crossover figures are built unchecked (hierviz.viz.unchecked) because they are
    rebuilt on every streamed step: each must be exactly what plotly's checks accept and keep."""
    import json

    from hierviz.viz.crossover import crossover_figure
    main, others = runs[0], runs[1:]
    several = next(s for s in main.steps if len(s.trees) > 1)
    figures = [tree_figure([small_tree()], title),
               tree_figure(several.trees, title), tree_figure([], title),
               latency_figure(main, 2, others), latency_figure(main, -1, others, projected=True),
               latency_figure(None), latency_figure(main, 0, []), crossover_figure(runs), crossover_figure([])]
    for fig in figures:
        assert json.loads(fig.to_json()) == _as_plotly_checks_it(fig)
    assert run_setup_line({"w4_kernel": "triton", "heads_quantize": {"e_m": "rtn-g64", "e_t3": "rtn-g64"}}) == \
        "T kernel triton · E_M rtn-g64 · E_T3 rtn-g64"
