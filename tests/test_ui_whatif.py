"""The What-if tab: figures and tables from what-if results made here by the real command at tiny
shapes on the CPU (rates, trace replay, sweep), the message for an empty results folder, only
listed files read, bad live-run input answered by a message, and a CPU live run at tiny shapes."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from hierviz.app import whatif_tab as uw
from hierviz.viz import whatif_fig as wf
from hierviz.measure.whatif import LABEL, main, parser

ROOT = Path(__file__).resolve().parent.parent
H200_TRACE = ROOT / "assets" / "traces" / "h200-smollm2-python-tips.json"
FAST = ["--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "12", "--prompt-len", "16"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A results folder like assets/whatif/: whatif.json of a rates run and of a trace replay, and
    a sweep.json, each written by `python -m hierviz whatif` (in-process) at tiny shapes."""
    threads = torch.get_num_threads()
    base = tmp_path_factory.mktemp("whatif")
    folder = base / "assets-whatif"
    folder.mkdir()
    runs = {"rates": ["--acceptance-rates", "0.9,0.7", "--seq-rate", "0.8"],
            "replay": ["--acceptance", str(H200_TRACE)],
            "sweep": ["--sweep", "--sweep-scales", "0.8,1.1", "--sweep-tree-sizes", "12,24", "--sweep-min-draft", "4",
                      "--t-tree-size", "12", "--m-tree-size", "12"]}
    try:
        for name, extra in runs.items():
            out = base / name
            assert main(FAST + extra + ["--out", str(out)]) == 0
            shutil.copy(out / ("sweep.json" if name == "sweep" else "whatif.json"), folder / f"cpu-tiny-{name}.json")
    finally:
        torch.set_num_threads(threads)
    return folder


def _load(results: Path, name: str) -> dict:
    return json.loads((results / f"cpu-tiny-{name}.json").read_text())


@pytest.fixture()
def shipped(results, monkeypatch) -> dict[str, Path]:
    monkeypatch.setattr(uw, "WHATIF_DIR", results)
    return uw.recorded_results()


def test_files_are_told_apart_by_their_keys(results):
    assert wf.kind(_load(results, "rates")) == "whatif"
    assert wf.kind(_load(results, "replay")) == "whatif"
    assert wf.kind(_load(results, "sweep")) == "sweep"
    assert wf.kind({"schema": "hierviz.profile/1", "series": []}) is None
    assert wf.kind([1, 2]) is None


@pytest.mark.parametrize("name, source", [("rates", "per-depth tree rates 0.9,0.7"),
                                          ("replay", "replayed from trace h200-smollm2-python-tips.json"),
                                          ("sweep", "each x the acceptance scale")])
def test_every_title_says_projected_and_names_source_and_machine(results, name, source):
    d = _load(results, name)
    figs = wf.figures(d)
    assert len(figs) == (1 if name == "sweep" else 2)
    for fig in figs:
        title = fig.layout.title.text
        assert LABEL in title and source in title
        assert f"CPU (torch {torch.__version__})" in title and "plumbing only" in title
        assert fig.data


def test_throughput_bars_carry_speedups(results):
    d = _load(results, "rates")
    bar = wf.throughput_figure(d).data[0]
    # the default rows without --head: both tree methods and HierSpec with either E_M
    assert list(bar.x) == ["Autoregressive", "EAGLE-2", "EAGLE-3", "HierSpec", "HierSpec (EAGLE-3 E_M)"]
    assert list(bar.y) == [d["methods"][m]["tokens_per_s"] for m in ("ar", "eagle2", "eagle3", "hierspec",
                                                                      "hierspec_eagle3")]
    assert bar.text[3] == f"{d['speedup_vs_ar']['hierspec']:.2f}x vs AR"
    stages = wf.stages_figure(d)
    hier = sum(t.y[3] for t in stages.data if t.type == "bar")
    assert hier == pytest.approx(sum(d["methods"]["hierspec"]["stages_ms_per_token"].values()))
    assert "Host time" not in stages.layout.title.text
    # benchmark mode (--no-stage-sync): the stages are host times, and the title says so
    assert "Host time per token by stage (no stage syncs)" in wf.stages_figure(dict(d, stage_sync=False)).layout.title.text


def test_sweep_marks_the_winner_at_every_scale(results):
    d = _load(results, "sweep")
    fig = wf.sweep_figure(d)
    star = next(t for t in fig.data if t.name == "winner at this scale")
    assert list(star.x) == [0.8, 1.1]
    winners = [a.text for a in fig.layout.annotations if a.text.startswith("<b>")]
    assert winners == [f"<b>{'HierSpec' if v['winner'] == 'hierspec' else 'EAGLE-2'}</b>" for v in d["verdicts"]]


def _table(md: str) -> dict[str, list[str]]:
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| method")
            and not ln.startswith("| scale")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)}


def test_recorded_whatif_table_matches_json(shipped, results):
    assert len(shipped) == 3
    label = next(lb for lb in shipped if "cpu-tiny-replay.json" in lb)
    a, b, table, source = uw.show_recorded(label)
    assert a["visible"] and b["visible"] and LABEL in a["value"].layout.title.text
    d = _load(results, "replay")
    rows = _table(table)
    for m, name in (("ar", "AR"), ("eagle2", "EAGLE-2"), ("hierspec", "HierSpec")):
        r = d["methods"][m]
        tps, speedup, tau, ms, rounds = rows[name]
        assert float(tps) == pytest.approx(r["tokens_per_s"], abs=0.051)
        assert float(speedup.rstrip("x")) == pytest.approx(d["speedup_vs_ar"][m], abs=0.0051)
        assert float(tau) == pytest.approx(r["tokens_per_round"], abs=0.0051)
        assert float(ms) == pytest.approx(r["ms_per_token"], abs=0.0051)
        assert int(rounds) == r["rounds"]
    ratio = re.search(r"HierSpec / EAGLE-2: ([\d.]+)x", table).group(1)
    assert float(ratio) == pytest.approx(d["hierspec_vs_eagle2"], abs=0.0051)
    assert "replayed from trace h200-smollm2-python-tips.json" in source
    assert "exact (" in source and "python -m hierviz whatif --tiny" in source


def test_the_source_names_the_kernel_of_each_w4_weight_kind():
    """The headline's W4 weights mostly run the CUDA kernel, though its models were built with the
    Triton kernel family: the formats say the kernel is chosen per weight kind (not "kernel
    triton"), and the next line says which kinds (K x N) run which."""
    from hierviz.machine import KERNEL_PER_KIND, formats_in_words
    d = json.loads((ROOT / "assets" / "whatif" / uw.HEADLINE_RESULT).read_text())
    source = uw.source_markdown(d)
    kernels = d["machine"]["w4_fp16_kernel"]
    assert kernels.startswith("cuda_mma for ") and "28672x8192 (verifier)" in kernels
    assert f"**fp16 W4 products:** {uw.esc(kernels)}" in source
    assert "kernel triton" not in source and f"target W4A16 synthetic codes, group 128, {KERNEL_PER_KIND}" in source
    no_machine = uw.source_markdown({k: v for k, v in d.items() if k != "machine"})
    assert "fp16 W4 products" not in no_machine and "kernel triton" in no_machine
    # a record whose fp16 W4 products all ran Triton keeps its words
    assert formats_in_words("W4A16 synthetic codes, kernel triton", {"w4_fp16_kernel": "triton"}).endswith("kernel triton")
    assert formats_in_words("W4A16 synthetic codes, kernel triton", {"w4_fp16_kernel": "cuda_mma"}).endswith(KERNEL_PER_KIND)


def test_table_says_how_repeated_runs_spread(results):
    d = json.loads((ROOT / "assets" / "whatif" / "h200-llama3-70b-paper-trees.json").read_text())
    assert d["repeat"] == 3
    table = uw.summary_markdown(d)
    runs = d["methods"]["hierspec"]["decode_s_runs"]
    assert "the median of 3 timed runs" in table
    assert f"HierSpec {min(runs):.3f}-{max(runs):.3f} s" in table
    assert "timed runs" not in uw.summary_markdown(_load(results, "rates"))     # one run: nothing to say


def test_recorded_sweep_table_matches_json(shipped, results):
    label = next(lb for lb in shipped if "cpu-tiny-sweep.json" in lb)
    a, b, table, source = uw.show_recorded(label)
    assert a["visible"] and not b["visible"]
    d = _load(results, "sweep")
    rows = _table(table)
    for v in d["verdicts"]:
        e2, hs, ratio, winner = rows[f"{v['scale']:g}"]
        assert e2 == f"{v['best_tree']:.2f}x ({v['best_tree_size']})"
        assert hs == f"{v['best_hierspec']:.2f}x ({v['best_min_draft_len']})"
        assert float(ratio.rstrip("x")) == pytest.approx(v["best_hierspec"] / v["best_tree"], abs=0.0051)
        assert winner == f"**{'HierSpec' if v['winner'] == 'hierspec' else 'EAGLE-2'}**"
    assert "--sweep-scales 0.8,1.1" in source and " \\\n    --" in source     # wrapped as shell lines


@pytest.mark.parametrize("name", ["rates", "replay", "sweep"])
def test_rebuilt_command_reproduces_the_recorded_arguments(results, name):
    recorded = _load(results, name)
    assert uw.command_text(recorded) == (recorded["command"], True)   # whatif records its command
    d = {k: v for k, v in recorded.items() if k != "command"}          # older files: rebuilt
    cmd, verbatim = uw.command_text(d)
    assert not verbatim and cmd.startswith("python -m hierviz whatif ")
    a = parser().parse_args(cmd.split()[4:])
    assert a.tiny and a.device == "cpu" and a.max_new_tokens == 12
    if name == "rates":
        assert a.acceptance_rates == "0.9,0.7" and a.seq_rate == 0.8 and a.prompt_len == 16
        assert a.intermediate_format == "dense"
        w4m = {**d, "formats": {**d["formats"], "intermediate": "W4A16 synthetic codes, group 32, kernel reference"}}
        assert parser().parse_args(uw.command_text(w4m)[0].split()[4:]).intermediate_format == "w4a16"
        from hierviz.viz.whatif_fig import shapes_label
        assert shapes_label(w4m).endswith("(W4A16)") and not shapes_label(d).endswith("(W4A16)")
        fr = {**d, "draft_vocab": 100}          # --draft-vocab: named in the label and the command
        assert "FR-Spec" in shapes_label(fr) and "FR-Spec" not in shapes_label(d)
        assert parser().parse_args(uw.command_text(fr)[0].split()[4:]).draft_vocab == 100
        assert parser().parse_args(uw.command_text({**d, "repeat": 3})[0].split()[4:]).repeat == 3
        assert "--repeat" not in uw.command_text(d)[0]
    if name == "replay":
        assert a.acceptance == str(H200_TRACE)
    if name == "sweep":
        assert (a.sweep, a.sweep_scales, a.sweep_tree_sizes, a.sweep_min_draft) == (True, "0.8,1.1", "12,24", "4")
        assert a.t_tree_size == 12 and a.m_tree_size == 12
    assert uw.command_text({**d, "command": "python -m hierviz whatif --x"}) == ("python -m hierviz whatif --x", True)


@pytest.mark.parametrize("folder", ["missing", "empty", "junk"])
def test_no_results_is_a_message(tmp_path, monkeypatch, folder):
    path = tmp_path / folder
    if folder != "missing":
        path.mkdir()
    if folder == "junk":
        (path / "profile.json").write_text('{"schema": "hierviz.profile/1", "series": []}')
        (path / "broken.json").write_text("{not json")
    monkeypatch.setattr(uw, "WHATIF_DIR", path)
    assert uw.recorded_results() == {}
    a, b, table, _ = uw.show_recorded(None)
    assert not a["visible"] and not b["visible"]
    assert "No recorded what-if results" in table and "assets/whatif/" in table


def test_only_listed_files_are_read(shipped, results, tmp_path, monkeypatch):
    outside = tmp_path / "outside.json"
    shutil.copy(results / "cpu-tiny-rates.json", outside)
    (results / "link.json").symlink_to(outside)       # a link out of the folder is not listed
    try:
        assert not any("link.json" in lb for lb in uw.recorded_results())
    finally:
        (results / "link.json").unlink()
    for bad in (str(outside), "../../etc/passwd", "cpu-tiny-rates.json"):
        a, _, table, source = uw.show_recorded(bad)
        assert not a["visible"] and "Choose one of the recorded results" in table and source == ""


def _last(gen):
    out = list(gen)
    assert out
    return out[-1]


RATES = uw.RATES_SOURCE


@pytest.mark.parametrize("args, message", [
    ((uw.TINY, RATES, "abc", 1.0, 0.85, 8), "comma-separated numbers"),
    ((uw.TINY, RATES, "0.9,1.5", 1.0, 0.85, 8), "between 0 and 1"),
    ((uw.TINY, RATES, "0.9,nan", 1.0, 0.85, 8), "between 0 and 1"),
    ((uw.TINY, RATES, "  ", 1.0, 0.85, 8), "empty"),
    ((uw.TINY, RATES, "0.9", 1.0, 0.85, "many"), "Max new tokens must be a number"),
    ((uw.TINY, RATES, "0.9", 1.0, 0.85, 10_000), "between 2 and 64"),
    ((uw.TINY, RATES, "0.9", 9.0, 0.85, 8), "Acceptance scale must be between"),
    ((uw.TINY, RATES, "0.9", 1.0, None, 8), "Sequence acceptance rate must be a number"),
    (("/etc/passwd", RATES, "0.9", 1.0, 0.85, 8), "Choose one of the listed model shapes"),
    ((uw.TINY, str(H200_TRACE), "0.9", 1.0, 0.85, 8), "Choose one of the listed acceptance sources"),
])
def test_bad_live_input_is_a_message(args, message):
    status, *_ = _last(uw.live_run(*args))
    assert "hv-status-error" in status and message in status and "Traceback" not in status


def test_real_shapes_need_a_gpu():
    if uw.cuda_available():
        pytest.skip("this machine has a GPU")
    assert uw.live_shape_choices(False) == [uw.TINY]
    status, *_ = _last(uw.live_run(next(iter(uw.LIVE_SHAPES)), RATES, "0.9", 1.0, 0.85, 8))
    assert "need a CUDA GPU" in status


def test_live_arguments_scale_rates_and_name_listed_traces():
    argv = uw.live_argv(uw.TINY, RATES, "0.9, 0.5", 1.2, 0.9, 16, False, "/tmp/x")
    a = parser().parse_args(argv)
    assert a.tiny and a.device == "cpu" and a.threads == 1 and a.max_new_tokens == 16
    assert a.acceptance_rates == "1,0.6" and a.seq_rate == 1.0    # scaled, capped at 1
    label = next(lb for lb in uw.replay_traces() if "h200-smollm2-python-tips.json" in lb)
    a = parser().parse_args(uw.live_argv(uw.TINY, label, "", 1.0, 0.85, 8, False, "/tmp/x"))
    assert a.acceptance == str(H200_TRACE) and a.acceptance_rates is None
    assert not any("handmade" in lb for lb in uw.replay_traces())     # hand-made traces are not measurements


def test_cpu_live_run_at_tiny_shapes_returns_figures():
    if uw.cuda_available():
        pytest.skip("this machine has a GPU: the live run uses real shapes")
    outs = list(uw.live_run(uw.TINY, RATES, "0.9,0.8,0.7", 1.0, 0.85, 8))
    assert "Running AR, EAGLE-2 and HierSpec on the CPU" in outs[0][0]
    status, a, b, table = outs[-1]
    assert "hv-status-ok" in status and "plumbing" in status
    assert a["visible"] and b["visible"]
    assert LABEL in a["value"].layout.title.text and "per-depth tree rates 0.9,0.8,0.7" in a["value"].layout.title.text
    assert "| HierSpec |" in table and "**Command:**" in table
    cmd = "python -m hierviz whatif --tiny --device cpu --threads 1 --methods ar,eagle2,hierspec --max-new-tokens 8 " \
          "--prompt-len 64 --acceptance-rates 0.9,0.8,0.7 --seq-rate 0.85 --out OUT_DIR"
    assert cmd in table.replace(" \\\n    ", " ")


def test_incomplete_result_is_a_message(tmp_path, monkeypatch):
    (tmp_path / "half.json").write_text('{"schema": "hierviz.whatif/1", "methods": {"ar": 3}}')
    monkeypatch.setattr(uw, "WHATIF_DIR", tmp_path)
    [label] = uw.recorded_results()
    a, _, table, _ = uw.show_recorded(label)
    assert not a["visible"] and "half.json: it is not a complete what-if result" in table


def test_child_errors_and_time_limit_are_messages(tmp_path):
    with pytest.raises(uw.LiveInputError, match="refused these settings: unknown method"):
        uw.run_child(["--tiny", "--device", "cpu", "--methods", "nope", "--out", str(tmp_path)], 60)
    with pytest.raises(uw.LiveInputError, match="longer than 0 s and was stopped"):
        uw.run_child(["--tiny", "--device", "cpu", "--out", str(tmp_path)], 0.3)
    with pytest.raises(uw.LiveInputError, match="not valid what-if arguments"):
        uw.run_child(["--tiny", "--no-such-flag"], 60)


def test_live_run_takes_a_target_format():
    """The live run's target-format box: each choice reaches the what-if's --target-format, an
    unknown one is a message, and a W8A8 run on the CPU names its format in the source lines."""
    for label, name in uw.live_formats().items():
        a = parser().parse_args(uw.live_argv(uw.TINY, RATES, "0.9", 1.0, 0.85, 8, False, "/tmp/x", label))
        assert a.target_format == name
    with pytest.raises(uw.LiveInputError, match="listed target formats"):
        uw.live_argv(uw.TINY, RATES, "0.9", 1.0, 0.85, 8, False, "/tmp/x", "int3")
    if uw.cuda_available():
        return
    status, _, _, table = list(uw.live_run(uw.TINY, RATES, "0.9,0.8", 1.0, 0.85, 8, "W8A8-int8"))[-1]
    assert "hv-status-ok" in status and "W8A8-int8" in table, table
