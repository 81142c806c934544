"""The method registry is the one place a method is declared: a toy method registered at run time
(tests/toy_method.py, no other edit) shows up wherever methods show up — the CLI's choices, the
engine and its exactness, trace save/load and validation, the comparison a stack runs and the app's
run picker, viz labels, colours, legends and latency bars, the headline's ratios, bench columns and
the What-if's method list and figures."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hierviz import methods
from hierviz.settings import DecodeSettings
from tests import toy_method
from tests.toy_method import NAME

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = DecodeSettings(max_new_tokens=16)


@pytest.fixture(scope="module")
def toy():
    method = toy_method.register()
    yield method
    methods.unregister(NAME)
    assert NAME not in methods.METHODS


@pytest.fixture(scope="module")
def runs(toy):
    """The toy, HierSpec and AR on the tiny random stack, one prompt."""
    from hierviz.engine import generate
    from hierviz.stack import tiny_random_stack
    stack = tiny_random_stack()
    return {m: generate(stack, m, "w5 w7 w9 w7 w9", SETTINGS) for m in (NAME, "hierspec", "ar")}


def test_the_toy_decodes_exactly_and_its_trace_round_trips(runs, tmp_path) -> None:
    from hierviz.trace import comparison_from_json, output_tokens, save_comparison, trace_from_json
    toy = runs[NAME]
    assert output_tokens(toy) == output_tokens(runs["ar"]) and len(output_tokens(toy)) == SETTINGS.max_new_tokens
    assert any(s.target_accepted for s in toy.steps[1:]), "the repeats were never accepted: a test that cannot fail"
    back = trace_from_json(toy.to_json())
    assert back.meta["method"] == NAME and [s.new_tokens for s in back.steps] == [s.new_tokens for s in toy.steps]
    save_comparison([runs["hierspec"], toy], tmp_path / "both.json")
    both = comparison_from_json((tmp_path / "both.json").read_bytes())
    assert [t.meta["method"] for t in both] == ["hierspec", NAME]


def test_an_unregistered_method_is_refused_by_trace_validation(runs) -> None:
    from hierviz.trace import TraceError, trace_from_json
    doc = json.loads(runs[NAME].to_json())
    doc["meta"]["method"] = doc["steps"][1]["method"] = "never-registered"
    with pytest.raises(TraceError, match="unknown method"):
        trace_from_json(json.dumps(doc))


def test_cli_choices_and_generate(toy, capsys) -> None:
    from hierviz.cli import main
    assert main(["generate", "--method", NAME, "--stack", "tiny-random", "--prompt", "w5 w7", "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert NAME in capsys.readouterr().out


def test_the_comparison_and_the_run_picker_include_it(toy, runs) -> None:
    from hierviz.app.render import view_choices
    from hierviz.app.session import Session
    from hierviz.decoding.decoders import comparison_methods
    from hierviz.stack import stack_comparison, tiny_random_stack
    assert stack_comparison("tiny-random")[-1] == NAME          # compare_rank 5: after every built-in
    assert comparison_methods(tiny_random_stack().models)[-1] == NAME
    sess = Session(runs=[runs["hierspec"], runs[NAME]])
    assert ("Repeat-last", NAME) in view_choices(sess)


def test_viz_labels_colours_legend_and_latency_bars(toy, runs) -> None:
    from hierviz.viz.latency import latency_figure
    from hierviz.viz.panels import legend_html, sequence_html, stats_html, verdict_html
    from hierviz.viz.style import method_color, method_label
    assert method_label(NAME) == "Repeat-last" and method_color(NAME) == "#6B8E23"
    legend = legend_html(NAME)
    assert "drafted by M alone" in legend and "intermediate model M" not in legend    # its roles only
    step = next(s for s in runs[NAME].steps[1:] if s.target_accepted)
    assert "Sequence draft: <b>3</b> tokens" in sequence_html(step)
    assert "accepted" in verdict_html(step)
    fig = latency_figure(runs[NAME], 3, [runs["hierspec"]])
    hover_names = {name for t in fig.data for name in (t.customdata or ())}     # each bar's stage, by method
    assert set(toy_method.STAGE_NAMES.values()) <= hover_names
    assert any("Repeat-last" in str(y) for t in fig.data for y in (t.y or ()))
    assert "<th>Repeat-last</th>" in stats_html([runs["hierspec"], runs[NAME]])


def test_the_headline_names_it(toy, runs) -> None:
    from hierviz.retime import MEASURED, equal_token_ratios
    from hierviz.viz.panels import headline_html
    ratios = equal_token_ratios({m: t.steps for m, t in runs.items()})
    assert {r.other for r in ratios} == {NAME, "ar"}
    line = re.sub(r"<[^>]+>", "", headline_html(list(runs.values()), MEASURED))
    assert "Repeat-last" in line and "Autoregressive" in line


def test_bench_has_a_column_for_it(toy, tmp_path) -> None:
    from hierviz.measure.bench import main
    questions = ROOT / "assets" / "data" / "spec_bench_question.jsonl"
    assert main(["--questions", str(questions), "--limit", "1", "--categories", "writing", "--stack", "tiny-random",
                 "--max-new-tokens", "6", "--methods", f"ar,{NAME}", "--out", str(tmp_path), "--device", "cpu"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["methods"]) == {"ar", NAME}
    assert summary["methods"][NAME]["outputs_identical_to_ar"]


def test_whatif_figures_show_it(toy) -> None:
    from hierviz.viz.whatif_fig import throughput_figure
    d = {"methods": {"ar": {"tokens_per_s": 10.0}, NAME: {"tokens_per_s": 12.0}}, "speedup_vs_ar": {"ar": 1.0, NAME: 1.2}}
    fig = throughput_figure(d)
    assert list(fig.data[0].x) == ["Autoregressive", "Repeat-last"]
    assert list(fig.data[0].marker.color) == [methods.get("ar").color, "#6B8E23"]


def test_whatif_runs_it_at_real_decoders(toy, tmp_path) -> None:
    """The what-if builds synthetic models and runs the registered decoder with forced acceptance."""
    import torch

    from hierviz.measure.whatif import main
    threads = torch.get_num_threads()
    try:
        assert main(["--tiny", "--device", "cpu", "--threads", "1", "--methods", f"ar,{NAME}", "--max-new-tokens", "8",
                     "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    info = json.loads((tmp_path / "whatif.json").read_text())
    assert list(info["methods"]) == ["ar", NAME] and info["speedup_vs_ar"][NAME] > 0
    assert f"| {NAME} |" in (tmp_path / "whatif.md").read_text()
