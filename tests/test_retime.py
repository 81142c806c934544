"""Re-timing at real scale (hierviz.retime), the like-for-like speed line and the crossover figure."""
from __future__ import annotations

import html
import json
import re
from dataclasses import replace

import pytest

from hierviz.methods import in_comparison_order
from hierviz.retime import (DRAFT_HEAD_MS, MEASURED, RETIMED, TIME_SCALES, CostModel, ForwardCost, acceptance_scale,
                            at_time_scale, default_time_scale, equal_token_ratios, real_scale_costs, retime_trace,
                            sequence_acceptance, step_cost_ms, time_to_tokens_ms, whatif_headline)
from hierviz.trace import DraftTree, SeqToken, Step, Trace, TreeNode, comparison_from_json
from hierviz.app.common import ROOT
from hierviz.viz.crossover import crossover_figure, crossover_scale, opening_trace_position, shipped_sweep, sweep_ratios
from hierviz.viz.panels import stats_html

OPENING = ROOT / "assets" / "traces" / "h200-smollm2-python-tips.json"

# Hand-made costs: T 10 ms at 1 token, 12 at 8, 20 at 16 (then 1 ms a token); M 2 ms at 1, 4 at 32.
COSTS = CostModel(ForwardCost("T", (1, 8, 16), (10.0, 12.0, 20.0)), ForwardCost("M", (1, 32), (2.0, 4.0)), 0.5, "test")


def tree(n_nodes: int, depth: int, verifier: str, accepted: int = 0) -> DraftTree:
    """A chain `depth` deep from the root, the remaining nodes children of the root."""
    nodes = [TreeNode(i, i, f"t{i}", i - 1 if i <= depth else 0, i if i <= depth else 1, 0.0, 0.0)
             for i in range(1, n_nodes + 1)]
    return DraftTree(0, "r", nodes, list(range(1, accepted + 1)), 99, "b", verifier)


def step(index: int, method: str, n_new: int, **kw) -> Step:
    return Step(index, method, list(range(n_new)), ["x"] * n_new, ["target_bonus"] * n_new,
                {"target_verify": 1.0}, **kw)


def hand_runs() -> list[Trace]:
    seq = [SeqToken(i, "s", "tree", 0) for i in range(4)]
    hierspec = Trace({"method": "hierspec"}, [
        step(0, "hierspec", 1, forwards={"target": 1, "intermediate": 1}),
        step(1, "hierspec", 5, trees=[tree(5, 3, "intermediate", 3), tree(10, 3, "intermediate", 1)], sequence=seq,
             target_accepted=4, forwards={"target": 1, "intermediate": 2, "e_m": 6})])
    eagle2 = Trace({"method": "eagle2"}, [
        step(0, "eagle2", 1, forwards={"target": 1}),
        step(1, "eagle2", 3, trees=[tree(7, 3, "target", 2)], target_accepted=2, forwards={"target": 1, "e_t": 3})])
    ar = Trace({"method": "ar"}, [step(i, "ar", 1, forwards={"target": 1}) for i in range(3)])
    return [hierspec, eagle2, ar]


def test_forward_cost_interpolates_between_measured_counts() -> None:
    t = COSTS.target
    assert t.at(1) == 10.0 and t.at(8) == 12.0
    assert t.at(5) == pytest.approx(10 + 2 * 4 / 7)
    assert t.at(12) == pytest.approx(16.0)
    assert t.at(24) == pytest.approx(28.0)                   # past the last count: its segment's slope
    real = real_scale_costs()
    assert real.target.at(1) == pytest.approx(18.70, abs=0.01)
    assert real.target.at(24) == pytest.approx((19.604 + 24.775) / 2, abs=0.01)
    assert real.intermediate.at(64) == pytest.approx(4.91, abs=0.01)


def test_retime_sums_match_hand_computed_values() -> None:
    hierspec, eagle2, ar = (retime_trace(t, COSTS) for t in hand_runs())
    # prefill: T at 1 token, and M once for HierSpec
    assert hierspec.steps[0].timings_ms == {"draft": 0.0, "intermediate_verify": 2.0, "target_verify": 10.0, "overhead": 0.0}
    # trees of 5 and 10 nodes (+ the root) through M, 4-token sequence (+ the root) through T, 6 head forwards
    m_ms = (2 + 2 * 5 / 31) + (2 + 2 * 10 / 31)
    assert hierspec.steps[1].timings_ms == pytest.approx(
        {"draft": 3.0, "intermediate_verify": m_ms, "target_verify": 10 + 2 * 4 / 7, "overhead": 0.0})
    # a 7-node tree (+ the root) through T, 3 head forwards
    assert eagle2.steps[1].timings_ms == pytest.approx({"draft": 1.5, "intermediate_verify": 0.0, "target_verify": 12.0,
                                                        "overhead": 0.0})
    assert ar.stats()["total_ms"] == 30.0
    assert eagle2.stats()["total_ms"] == pytest.approx(23.5)
    assert hierspec.stats()["total_ms"] == pytest.approx(12 + 3 + m_ms + 10 + 8 / 7)
    # tokens and decisions are untouched; the copy says it is projected
    assert [s.new_tokens for s in hierspec.steps] == [s.new_tokens for s in hand_runs()[0].steps]
    assert hierspec.meta["time_scale"] == RETIMED and "time_scale" not in hand_runs()[0].meta


def test_sequence_speculation_prices_m_drafting_one_token_a_forward() -> None:
    seq = [SeqToken(i, "s", "draft") for i in range(3)]
    spec = step(1, "spec", 2, sequence=seq, target_accepted=1, forwards={"target": 1, "intermediate": 3})
    assert step_cost_ms(spec, COSTS) == pytest.approx({"draft": 6.0, "intermediate_verify": 0.0,
                                                       "target_verify": 10 + 2 * 3 / 7, "overhead": 0.0})


def test_draft_head_cost_without_recorded_forwards_is_one_per_tree_depth() -> None:
    bare = step(1, "eagle2", 2, trees=[tree(7, 3, "target", 1)])
    assert step_cost_ms(bare, COSTS)["draft"] == pytest.approx(1.5)


def test_draft_head_cost_follows_the_recorded_forwards() -> None:
    """A recorded count prices the drafting even where it is not one per depth (HierSpec's head runs
    one more forward when M is a token short: the provisional root pair)."""
    recorded = step(1, "eagle2", 2, trees=[tree(7, 3, "target", 1)], forwards={"target": 1, "e_t": 4})
    assert step_cost_ms(recorded, COSTS)["draft"] == pytest.approx(2.0)


def test_draft_head_cost_is_the_what_if_measurement() -> None:
    d = json.loads((ROOT / "assets" / "whatif" / "h200-llama3-70b-paper-trees-triton.json").read_text())
    for method, head in (("hierspec", "e_m"), ("eagle2", "e_t")):
        r = d["methods"][method]
        assert r["stages_ms"]["draft"] / r["forwards"][head] == pytest.approx(DRAFT_HEAD_MS, rel=0.05)


def test_equal_token_ratios_compare_the_same_first_tokens() -> None:
    runs = {t.meta["method"]: t.steps for t in (retime_trace(t, COSTS) for t in hand_runs())}
    ratios = equal_token_ratios(runs)
    # N = 3 (AR's): HierSpec has them after its second step, EAGLE-2 after its second, AR after its third
    hs_ms = runs["hierspec"][0].step_ms + runs["hierspec"][1].step_ms
    assert [(r.other, r.n_tokens) for r in ratios] == [("eagle2", 3), ("ar", 3)]
    assert ratios[0].speedup == pytest.approx(23.5 / hs_ms)
    assert ratios[1].speedup == pytest.approx(30.0 / hs_ms)
    assert time_to_tokens_ms(runs["ar"], 4) is None
    # a run with no tokens yet is left out, not compared at 0 tokens
    assert [r.other for r in equal_token_ratios({**runs, "ar": []})] == ["eagle2"]


def opening_runs() -> list[Trace]:
    return comparison_from_json(OPENING.read_bytes())


def test_opening_trace_projected_figures() -> None:
    """The opening trace priced at Llama-3-70B / 8B W4 on the H200 (docs/app.md quotes these)."""
    runs = {t.meta["method"]: t for t in at_time_scale(opening_runs(), RETIMED)}
    tps = {m: t.stats()["tokens_per_s"] for m, t in runs.items()}
    assert 85 <= tps["hierspec"] <= 96
    assert 70 <= tps["eagle2"] <= 78
    assert 52 <= tps["ar"] <= 55
    ratios = {r.other: r.speedup for r in equal_token_ratios({m: t.steps for m, t in runs.items()})}
    assert 1.15 <= ratios["eagle2"] <= 1.30 and 1.55 <= ratios["ar"] <= 1.80
    assert default_time_scale(opening_runs()) == RETIMED
    assert default_time_scale(hand_runs()) == MEASURED


SPEED_LINE = re.compile(r'<div class="hv-speedup">(.*?)</div>.*?Over the first (\d+) token', re.S)


def speed_line(page: str) -> tuple[list[float], int]:
    m = SPEED_LINE.search(page)
    assert m, "no speed line"
    return [float(x) for x in re.findall(r"<b>([\d.]+)×</b>", m.group(1))], int(m.group(2))


def expected_line(steps: dict[str, list[Step]]) -> tuple[list[float], int]:
    """Worked out here from the steps alone: N = the fewest tokens, each run's time at its N-th token."""
    counts = {m: sum(len(s.new_tokens) for s in st) for m, st in steps.items() if st}
    n = min(counts.values())

    def ms_to_n(st: list[Step]) -> float:
        total, got = 0.0, 0
        for s in st:
            total, got = total + s.step_ms, got + len(s.new_tokens)
            if got >= n:
                return total
        raise AssertionError("run never reached N")
    hs = ms_to_n(steps["hierspec"])
    # every other run that has tokens: HierSpec's speedup where it is ahead (in the comparison order),
    # then each faster run's speedup over HierSpec, the fastest first
    speedups = {m: ms_to_n(steps[m]) / hs for m in in_comparison_order(list(counts)) if m != "hierspec"}
    ahead = [round(x, 2) for x in speedups.values() if x >= 1]
    behind = [round(1 / x, 2) for x in sorted(x for x in speedups.values() if x < 1)]
    return ahead + behind, n


@pytest.mark.parametrize("time_scale", TIME_SCALES)
def test_scrubbing_never_compares_unequal_token_counts(time_scale: str) -> None:
    runs = opening_runs()
    timed = {t.meta["method"]: t.steps for t in at_time_scale(runs, time_scale)}
    for main in ("hierspec", "eagle2", "ar"):
        for i in range(len(timed[main])):
            shown = {**timed, main: timed[main][: i + 1]}
            ratios, n = speed_line(stats_html(runs, {main: i}, time_scale))
            assert (ratios, n) == expected_line(shown)
            assert n == min(sum(len(s.new_tokens) for s in st) for st in shown.values())


def test_streaming_never_compares_unequal_token_counts() -> None:
    """Runs growing side by side, and one after another (the later ones not started yet)."""
    runs = opening_runs()
    longest = max(len(t.steps) for t in runs)
    for k in range(1, longest + 1, 3):
        for grown in ([replace(t, steps=t.steps[:k]) for t in runs],
                      [runs[0], replace(runs[1], steps=runs[1].steps[:k]), replace(runs[2], steps=[])]):
            page = stats_html(grown, None, MEASURED)
            assert speed_line(page) == expected_line({t.meta["method"]: t.steps for t in grown})


def test_where_a_run_was_measured_is_named() -> None:
    from hierviz.viz.panels import where_measured
    assert where_measured({"device": "cuda", "gpu": "NVIDIA A100-SXM4-80GB"}) == "NVIDIA A100-SXM4-80GB"
    assert where_measured({"device": "cuda"}) == "a CUDA GPU" and where_measured({"device": "cpu"}) == "a CPU"


def test_speed_line_says_where_and_labels_projections() -> None:
    runs = opening_runs()
    measured, projected = (html.unescape(re.sub(r"<(?!table)[^>]+>", "", stats_html(runs, None, ts)))
                           for ts in (MEASURED, RETIMED))
    assert "as measured on NVIDIA H200" in measured and "projected" not in measured.split("<table")[0].split("What-if")[0]
    assert "re-timed at real scale, projected" in projected and "tokens / s (projected)" in projected
    assert "accept decisions as measured on NVIDIA H200" in projected      # where the tokens come from
    for page in (measured, projected):
        assert "launch-bound" in page and "55 %" in page and "What-if" in page
    headline = whatif_headline()
    assert headline is not None and f'{headline["ar"]:.2f}× Autoregressive' in projected
    assert round(headline["ar"], 2) == 2.50 and round(headline["eagle2"], 2) == 1.64 and round(headline["eagle3"], 2) == 1.61
    assert f'{headline["eagle2"]:.2f}× EAGLE-2, {headline["eagle3"]:.2f}× EAGLE-3' in projected   # every method the file ran


def test_acceptance_scale_of_the_opening_trace() -> None:
    runs = opening_runs()
    assert 0.55 <= sequence_acceptance(runs[0].steps) <= 0.7
    scale = acceptance_scale(runs, [0.9, 0.8, 0.75, 0.7, 0.65, 0.6], 0.85)
    assert 0.8 <= scale <= 1.0


def test_crossover_figure_marks_crossover_paper_and_run() -> None:
    points = sweep_ratios(shipped_sweep())
    cross = crossover_scale(points)
    assert 0.6 < cross < 0.8                        # EAGLE-2 wins at scale 0.6, HierSpec at 0.8
    fig = crossover_figure(opening_runs())
    by_name = {t.name.split(" (")[0]: t for t in fig.data}
    assert set(by_name) == {"what-if sweep", "crossover", "paper's operating point", "this run"}
    assert by_name["crossover"].y == (1.0,) and by_name["crossover"].x[0] == pytest.approx(cross)
    assert by_name["paper's operating point"].x == (1.0,)
    run_x, run_y = by_name["this run"].x[0], by_name["this run"].y[0]
    assert 0.8 <= run_x <= 1.0 and 1.15 <= run_y <= 1.30
    assert "projected" in fig.layout.title.text
    # without EAGLE-2 there is no point for this run
    assert "this run" not in {t.name.split(" (")[0] for t in crossover_figure(opening_runs()[::2]).data}


def test_how_it_works_quotes_the_computed_figures() -> None:
    """assets/about.md's numbers are the ones the code computes from the shipped files."""
    about = (ROOT / "assets" / "about.md").read_text()
    runs = opening_runs()
    for time_scale in TIME_SCALES:
        timed = {t.meta["method"]: t.steps for t in at_time_scale(runs, time_scale)}
        for r in equal_token_ratios(timed):
            assert f"{r.speedup:.2f}x" in about
    projected = {t.meta["method"]: t.stats()["tokens_per_s"] for t in at_time_scale(runs, RETIMED)}
    assert (f"about **{projected['hierspec']:.0f} tokens/s for HierSpec, {projected['eagle2']:.0f} for EAGLE-2, "
            f"{projected['eagle3']:.0f} for EAGLE-3 and {projected['ar']:.0f} for AR") in about
    headline = whatif_headline()
    assert f"{headline['ar']:.2f}x AR, {headline['eagle2']:.2f}x EAGLE-2 and {headline['eagle3']:.2f}x EAGLE-3" in about
    pos = opening_trace_position()
    assert f"**{pos.crossover_scale:.2f}x** those rates" in about and f"**{pos.run_scale:.2f}x** of them" in about
    assert f"{DRAFT_HEAD_MS} ms" in about


def test_first_screen_headline_shows_both_scales_for_the_opening_trace() -> None:
    """The top-of-page line: re-timed (projected) ratios over all 126 tokens, and the measured ones
    beside them with the reason a 135M target loses; measured alone when asked."""
    from hierviz.viz.panels import headline_html
    runs = opening_runs()
    retimed = headline_html(runs, RETIMED)
    assert "projected" in retimed and "Over the first 126 tokens" in retimed
    assert "<b>1.20×</b> faster than EAGLE-2" in retimed and "0.69× EAGLE-2" in retimed and "cannot show the method" in retimed
    # every method that ran is named, and a faster one says so plainly
    assert "<b>EAGLE-3</b> is <b>1.06×</b> faster than HierSpec on this run" in retimed
    assert "0.63× EAGLE-3" in retimed
    measured = headline_html(runs, MEASURED)
    assert "projected" not in measured and "<b>EAGLE-2</b> is <b>1.44×</b>" in measured and "cannot show" not in measured
    assert "<b>EAGLE-3</b> is <b>1.60×</b>" in measured and "faster than HierSpec on this run" in measured
    assert headline_html([], RETIMED) == ""
