"""The Analyse tab and its builders, checked against numbers worked out by hand on two small traces.

HierSpec (prefill + 2 rounds), trees as (depth, accepted path), sequence as (drafted, T accepted):
    round 1: trees (2, 2) and (2, 0), sequence 4 of which T accepts 3 → 4 new tokens
    round 2: tree (3, 1), sequence 2 of which T accepts 0 → 1 new token
EAGLE-2 (prefill + 2 rounds), one target-verified tree each: (3, 1) → 2 tokens, (3, 3) → 4 tokens.
Every round costs one target forward.
"""
from __future__ import annotations

import csv
import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go
import pytest

from hierviz.app import analyse_tab, downloads
from hierviz.app.shipped import shipped_traces
from hierviz.trace import DraftTree, SeqToken, Step, Trace, TreeNode, trace_stats
from hierviz.viz.export import figure_image, replay_html, static_export_available, step_svg
from hierviz.viz.run_figs import (STEP_COLUMNS, comparison_table, depth_acceptance_over_run, depth_figure, series_of,
                                  steps_csv, summary_csv, tau_figure, worst_rejections)

EVIL = "<script>alert(1)</script>"


def chain(depth: int, n_acc: int, verifier: str) -> DraftTree:
    """A path of `depth` nodes (ids 1..depth) whose verifier accepted the first n_acc."""
    nodes = [TreeNode(d, 100 + d, f" n{d}", d - 1, d, -0.5 * d, -0.5) for d in range(1, depth + 1)]
    return DraftTree(1, " r", nodes, list(range(1, n_acc + 1)), 99, " b", verifier)


def step(index: int, method: str, n_new: int, trees: list[DraftTree], seq_len: int = 0, accepted: int = 0,
         text: str = " w") -> Step:
    sources = ["target_bonus"] * n_new
    seq = [SeqToken(200 + k, text, "tree", 0) for k in range(seq_len)]
    return Step(index, method, list(range(n_new)), [text] * n_new, sources,
                {"draft": 1.0, "target_verify": 10.0 + index}, trees, seq, accepted, 99, " b", {"target": 1})


def hierspec() -> Trace:
    steps = [step(0, "hierspec", 1, []),
             step(1, "hierspec", 4, [chain(2, 2, "intermediate"), chain(2, 0, "intermediate")], 4, 3, EVIL),
             step(2, "hierspec", 1, [chain(3, 1, "intermediate")], 2, 0)]
    return Trace({"method": "hierspec", "prompt": "say <b>hi</b>"}, steps)


def eagle2() -> Trace:
    steps = [step(0, "eagle2", 1, []),
             step(1, "eagle2", 2, [chain(3, 1, "target")], 0, 1),
             step(2, "eagle2", 4, [chain(3, 3, "target")], 0, 3)]
    return Trace({"method": "eagle2"}, steps)


def test_tau_per_step():
    fig = tau_figure(series_of([hierspec(), eagle2()]))
    assert [t.name for t in fig.data] == ["HierSpec", "EAGLE-2"]
    assert list(fig.data[0].x) == [1, 2, 3] and list(fig.data[0].y) == [1.0, 4.0, 1.0]
    assert list(fig.data[1].y) == [1.0, 2.0, 4.0]


def test_depth_acceptance_over_the_run():
    # after round 1: depth 1 tried by both trees, accepted by one; depth 2 tried and accepted by the first.
    # round 2's tree accepts depth 1 and is tried at depth 2, where it is rejected.
    curves = depth_acceptance_over_run(hierspec().steps)
    assert curves == {1: [(2, 0.5), (3, 2 / 3)], 2: [(2, 1.0), (3, 0.5)]}
    assert {d: c[-1][1] for d, c in curves.items()} == trace_stats(hierspec().steps)["per_depth_acceptance"]
    fig = depth_figure(series_of([eagle2()]))
    by_name = {t.name: (list(t.x), list(t.y)) for t in fig.data}
    assert by_name == {"EAGLE-2 · depth 1": ([2, 3], [1.0, 1.0]), "EAGLE-2 · depth 2": ([2, 3], [0.0, 0.5]),
                       "EAGLE-2 · depth 3": ([3], [1.0])}


def test_worst_rejections_are_ordered_per_run():
    # HierSpec round 2 throws away 2 (tree) + 2 (sequence) = 4, round 1 2 + 1 = 3; EAGLE-2 round 1 2,
    # round 2 none (left out)
    worst = worst_rejections(series_of([hierspec(), eagle2()]))
    assert [(r.method, r.step, r.rejected) for r in worst] == [("HierSpec", 2, 4), ("HierSpec", 1, 3), ("EAGLE-2", 1, 2)]
    assert worst[0].description.startswith("M accepted paths 1/3") and "T accepted 0 of 2" in worst[0].description
    assert len(worst_rejections(series_of([hierspec()]), per_run=1)) == 1


def test_steps_csv_columns_and_rows():
    rows = list(csv.DictReader(io.StringIO(steps_csv(series_of([hierspec(), eagle2()])))))
    assert tuple(rows[0]) == STEP_COLUMNS and len(rows) == 6
    r = rows[1]
    assert (r["method"], r["step"], r["new_tokens"], r["tau"], r["target_draft"], r["target_accepted"]) == \
        ("HierSpec", "2", "4", "4.0", "4", "3")
    assert (r["tree_sizes"], r["accepted_path_lengths"], r["rejected_tokens"]) == ("2;2", "2;0", "3")
    assert (r["draft_ms"], r["target_verify_ms"], r["intermediate_verify_ms"], r["step_ms"]) == ("1.0", "11.0", "0.0", "12.0")
    assert rows[0]["tree_sizes"] == "" and rows[5]["method"] == "EAGLE-2"


def test_summary_csv_and_comparison_table():
    series = series_of([hierspec(), eagle2()], "A: ")
    rows = list(csv.DictReader(io.StringIO(summary_csv(series))))
    assert [r["method"] for r in rows] == ["A: HierSpec", "A: EAGLE-2"]
    assert rows[0]["tau_target"] == "2.0" and rows[1]["tau_target"] == "2.3333"
    assert rows[0]["tau_intermediate"] == str(round((3 + 1 + 2) / 3, 4)) and rows[1]["tau_intermediate"] == ""
    assert (rows[0]["accept_depth_3"], rows[1]["accept_depth_3"]) == ("", "1.0")
    header, table = comparison_table(series)
    assert header == ["", "A: HierSpec", "A: EAGLE-2"]
    assert ["mean sequence draft", "3.0", "–"] in table and ["accepted at depth 2", "50%", "50%"] in table


def test_html_replay_is_self_contained_and_escaped():
    page = replay_html(hierspec())
    assert not re.search(r"https?://", page) and "src=" not in page and "url(" not in page
    assert EVIL not in page and "&lt;script&gt;" in page
    assert "<b>hi</b>" not in page
    assert page.count('class="hv-replay-step"') == 3
    for button in ("hv-replay-prev", "hv-replay-next", "hv-replay-play"):
        assert f'id="{button}"' in page


def test_step_svg_is_well_formed_and_escaped():
    trace = hierspec()
    trace.steps[1].new_text[0] = "\x07bell"        # a random-weight model's token: no XML character
    svg = step_svg(trace, 1)
    root = ET.fromstring(svg)                      # a file that does not parse shows nothing at all
    assert root.tag.endswith("svg") and EVIL not in svg and "&lt;script&gt;" in svg
    assert "Step 2 of 3" in svg and not re.search(r"https?://(?!www\.w3\.org/)", svg)


def test_export_step_stays_within_the_run():
    series = series_of([hierspec()])
    assert [analyse_tab.export_step(series, v) for v in (1, "2", 3.0, 99, -5, "x", None, "inf")] == [0, 1, 2, 2, 0, 0, 0, 0]


def test_figure_image_needs_kaleido():
    fig = tau_figure(series_of([hierspec()]))
    if not static_export_available():
        assert figure_image(fig) is None
    else:
        png = figure_image(fig)
        assert png is None or png.startswith(b"\x89PNG")   # None: kaleido without a browser


@pytest.fixture
def download_root(tmp_path, monkeypatch):
    monkeypatch.setattr(downloads, "DOWNLOAD_ROOT", tmp_path)
    return tmp_path


def test_the_tab_opens_on_the_preselected_trace_without_writing_files(download_root):
    """A visitor sees the first recorded trace charted before pressing anything: the figures are
    drawn once when the tab is built, and no download file is written for it."""
    first = shipped_traces()[0][1]
    view = analyse_tab.opening_view(first)
    assert "Showing " in view["status"] and "hv-status-ok" in view["status"]
    assert all(isinstance(view[k], go.Figure) for k in ("tau", "depth", "position"))
    assert "<table" in view["table"] and view["worst"]
    with gr.Blocks() as demo:
        analyse_tab.analyse_tab()
    plots = [c for c in demo.blocks.values() if isinstance(c, gr.Plot)]
    assert len(plots) == 3 and all(c.value for c in plots)
    assert not any(download_root.iterdir())
    for nothing in (None, "", "/etc/passwd"):         # no trace, or a path that is not a recorded one
        view = analyse_tab.opening_view(nothing)
        assert "Pick a recorded trace" in view["status"] and view["tau"] is None


def test_tab_builds_and_analyses_a_shipped_trace(download_root):
    with gr.Blocks():
        analyse_tab.analyse_tab()
    path = next(p for _, p in shipped_traces() if p.endswith("handmade-demo.json"))
    status, tau, depth, table, worst, *buttons, position = analyse_tab.analyse(path, None, None, "3")
    assert "hv-status-ok" in status and isinstance(tau, go.Figure) and isinstance(depth, go.Figure)
    assert len(tau.data) == 3 and worst and "<table" in table
    files = [btn["value"] for btn in buttons]
    assert [Path(f).name for f in files] == list(analyse_tab.DOWNLOADS)
    assert all(f.startswith(str(download_root)) for f in files)
    assert open(files[0], encoding="utf-8").readline().strip() == ",".join(STEP_COLUMNS)
    assert "Step 3 of " in Path(files[3]).read_text(encoding="utf-8")


def test_two_uploads_are_overlaid(download_root, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(hierspec().to_json(), encoding="utf-8")
    b.write_text(eagle2().to_json(), encoding="utf-8")
    status, tau, *_ = analyse_tab.analyse(None, str(a), str(b))
    assert "hv-status-ok" in status and [t.name for t in tau.data] == ["A: HierSpec", "B: EAGLE-2"]


def test_bad_input_gives_a_clear_error(download_root, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    status, *rest = analyse_tab.analyse(None, str(bad), None)
    assert "hv-status-error" in status and "trace A (bad.json): not valid JSON" in status
    assert str(tmp_path) not in status and len(rest) == 5 + len(analyse_tab.DOWNLOADS)
    good = tmp_path / "good.json"
    good.write_text(hierspec().to_json(), encoding="utf-8")
    status, *_ = analyse_tab.analyse(None, str(good), str(bad))
    assert "trace B (bad.json): not valid JSON" in status
    empty = tmp_path / "empty.json"
    empty.write_text(Trace({"method": "ar"}).to_json(), encoding="utf-8")
    status, *_ = analyse_tab.analyse(None, str(empty), None)
    assert "empty.json has no steps to analyse" in status
    text = tmp_path / "notes.txt"
    text.write_text("{}", encoding="utf-8")
    assert "a trace is a .json file" in analyse_tab.analyse(None, str(text), None)[0]
    status, *_ = analyse_tab.analyse("/etc/passwd", None, None)
    assert "pick one of the recorded traces" in status


def test_a_recorded_trace_as_b_is_overlaid_with_a_column_per_run(download_root, tmp_path):
    a, b = (next(p for _, p in shipped_traces() if p.endswith(name))
            for name in ("h200-smollm2-python-tips.json", "tiny-random-plumbing.json"))
    status, tau, depth, table, *_ = analyse_tab.analyse(a, None, None, 1, b)
    assert "A = h200-smollm2-python-tips.json, B = tiny-random-plumbing.json" in status
    labels = [f"A: {m}" for m in ("HierSpec", "EAGLE-2", "EAGLE-3", "Autoregressive")] + \
        [f"B: {m}" for m in ("HierSpec", "EAGLE-2", "Autoregressive")]
    assert [t.name for t in tau.data] == labels
    assert {t.name.split(" · ")[0] for t in depth.data} == set(labels[:3] + labels[4:6])    # AR drafts nothing
    corner, *heads = re.findall(r"<th>(.*?)</th>", table)
    assert heads == labels and "measure" in corner        # the row names' column is named for a screen reader
    # an upload as B wins over the recorded choice, as for A
    up = tmp_path / "b.json"
    up.write_text(eagle2().to_json(), encoding="utf-8")
    status, tau, *_ = analyse_tab.analyse(a, None, str(up), 1, b)
    assert "B = b.json" in status and tau.data[-1].name == "B: EAGLE-2"
    # only the listed recorded traces are read
    status, *_ = analyse_tab.analyse(a, None, None, 1, "/etc/passwd")
    assert "hv-status-error" in status and "trace B: pick one of the recorded traces" in status


def test_an_imported_acceptance_goes_beside_the_runs_own(download_root, tmp_path):
    """A deployment's acceptance file (here a vLLM /metrics scrape) is drawn position by position
    beside each run's own conditional acceptance, its engine's definition in the status; a bad or
    oversized file is a clear error."""
    from hierviz.measure.acceptance_import import load_acceptance
    from hierviz.trace import trace_stats
    data = Path(__file__).resolve().parent / "data" / "acceptance"
    path = next(p for _, p in shipped_traces() if p.endswith("handmade-demo.json"))
    status, *_, position = analyse_tab.analyse(path, None, None, 1, None, str(data / "vllm_metrics.prom"))
    assert "hv-status-ok" in status and "vllm-prometheus" in status
    imp = load_acceptance(data / "vllm_metrics.prom")
    yours = [t for t in position.data if t.name.startswith("yours")]
    assert len(yours) == 1 and list(yours[0].y) == pytest.approx(imp.rates)
    runs = [t for t in position.data if not t.name.startswith("yours")]
    series = analyse_tab.load_series(path, None, None)[1]
    assert len(runs) == len([s for s in series if trace_stats(s.trace.steps)["per_depth_acceptance"]])
    first = next(s for s in series if s.label == runs[0].name)
    want = trace_stats(first.trace.steps)["per_depth_acceptance"]
    assert list(runs[0].y) == pytest.approx([want[d] for d in sorted(want, key=int)][:len(runs[0].y)])
    bad = tmp_path / "bad.prom"
    bad.write_text("# HELP nothing here\nsome_counter 1\n")
    status, *rest = analyse_tab.analyse(path, None, None, 1, None, str(bad))
    assert "hv-status-error" in status and "bad.prom" in status and str(tmp_path) not in status
    big = tmp_path / "big.jsonl"
    big.write_bytes(b" " * (analyse_tab.MAX_TRACE_BYTES + 1))
    assert "over" in analyse_tab.analyse(path, None, None, 1, None, str(big))[0]
