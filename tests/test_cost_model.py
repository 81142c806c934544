"""The roofline cost model (hierviz.measure.cost_model) and the What-if tab's formats panel that
shows its projections: the fit recovers known parameters, the checks report leave-out errors, a
projection keeps measured rows as measured and names what a GPU cannot run or hold."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hierviz.app import formats_panel
from hierviz.measure import cost_model as cm

ROOT = Path(__file__).resolve().parents[1]
PROFILES = [ROOT / "assets/profile/h200-llama3-70b-formats.json", ROOT / "assets/profile/h200-llama3-8b-formats.json"]
COMPAT = ROOT / "assets/whatif/compat-h200-llama3-70b.json"
H200 = cm.GPUS["NVIDIA H200"]


def test_the_fit_recovers_the_parameters_of_curves_it_generated():
    truth = cm.Fit(0.88, 0.4, 75.0)
    tokens = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    curves = [cm.Curve("dense", f"s{n}", tokens,
                       [cm.layer_us(truth, H200, "fp16", 2.0 * n, n, t) for t in tokens], 2.0 * n, n)
              for n in (2e8, 8e8)]
    got = cm.fit(curves, H200, 0.88)
    assert got.e_c == pytest.approx(0.4, abs=0.006) and got.c0_us == pytest.approx(75.0, rel=0.02)
    assert max(map(abs, cm.errors(got, curves, H200))) < 0.01


def test_calibration_on_the_shipped_h200_profiles_reports_every_check():
    cal = cm.calibrate([json.loads(p.read_text()) for p in PROFILES], H200)
    assert set(cal["fits"]) == {"dense", "w4", "w8a8-int8", "w8a8-fp8"}
    assert 0.8 < cal["e_bw"] <= 1.0                         # the profiles' measured copy rate over the spec
    assert all(v["mean_abs"] < 0.15 for v in cal["in_sample"].values())
    assert len(cal["leave_one_shape_out"]) == 8 and set(cal["leave_one_format_out"]) == set(cal["fits"])


def test_projection_keeps_measured_rows_and_names_what_a_gpu_cannot_run():
    cal = cm.calibrate([json.loads(p.read_text()) for p in PROFILES], H200)
    compat = json.loads(COMPAT.read_text())
    twice = dataclasses.replace(H200, name="twice", bandwidth_GBps=9600, memory_GB=400,
                                tflops={k: 2 * v for k, v in H200.tflops.items()})
    cm.GPUS["twice"] = twice
    try:
        proj = cm.project(cal, compat, compat["configs"], [H200, cm.GPUS["NVIDIA A100 80GB SXM"], twice])
    finally:
        del cm.GPUS["twice"]
    rows = {(e["gpu"], e["format"]): e for e in proj["rows"]}
    for r in compat["rows"]:
        assert rows[("NVIDIA H200", r["format"])]["tokens_per_s"] == r["tokens_per_s"]
        assert not rows[("NVIDIA H200", r["format"])]["projected"]
    assert rows[("NVIDIA A100 80GB SXM", "w8a8-fp8")]["skipped"] == "no FP8 tensor cores"
    assert "needs ~" in rows[("NVIDIA A100 80GB SXM", "dense")]["skipped"]
    fast = rows[("twice", "w4")]
    assert fast["projected"] and fast["tokens_per_s"]["ar"] > rows[("NVIDIA H200", "w4")]["tokens_per_s"]["ar"] * 1.3


def test_cli_writes_the_tables_and_refuses_unknown_gpus(tmp_path, capsys):
    args = ["--profiles", ",".join(map(str, PROFILES)), "--compat", str(COMPAT), "--out", str(tmp_path)]
    assert cm.main(args + ["--gpus", "NVIDIA L4,NVIDIA H200"]) == 0
    md = (tmp_path / "cost_model.md").read_text()
    assert "| w8a8-int8 |" in md and "NVIDIA L4" in md
    assert cm.main(args + ["--gpus", "NVIDIA B300"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def test_formats_panel_tags_measured_and_projected_rows(tmp_path):
    d = formats_panel.load_cost_model()
    labels = formats_panel.pair_labels(d)
    assert labels and "llama3-70b target" in labels[0]
    md = formats_panel.table_markdown(d, labels[0])
    assert "| H200<br>measured |" in md and "*projected*" in md and "no FP8 cores" in md and "does not fit" in md
    assert "46 of 80 layers measured, scaled" in md and md.count("**HierSpec") >= 8
    assert "No cost-model file" in formats_panel.table_markdown(None, None)
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert formats_panel.load_cost_model(bad) is None


def test_format_curves_reprice_the_sweep_and_mark_the_crossovers():
    """At the tables' point (scale 1) the W4A16 curve is the sweep's own; the other formats move by
    the per-round difference compat measured; crossovers sit between the scales around them."""
    from hierviz.viz.format_curves import crossing, format_curves, format_curves_figure
    compat = json.loads(COMPAT.read_text())
    sweep = json.loads((ROOT / "assets/whatif/h200-llama3-70b-sweep.json").read_text())
    curves = format_curves(compat, sweep)
    assert set(curves) == {"dense", "w8a8-int8", "w8a8-fp8", "w4"}
    w4 = curves["w4"]
    i = w4["scales"].index(1.0)
    want = next(r for r in sweep["rows"] if r["method"] == "hierspec" and r["scale"] == 1.0
                and r["min_draft_len"] == compat["settings"]["min_draft_len"])
    assert w4["hierspec"][i] == pytest.approx(want["speedup_vs_ar"], rel=1e-9)
    for c in curves.values():       # acceptance helps every method in every format
        assert all(a < b for a, b in zip(c["hierspec"], c["hierspec"][1:]))
        x = c["crossovers"]["hierspec_over_eagle2"]
        assert x is not None and 0.6 < x < 1.0
    assert crossing([0, 1, 2], [0.0, 1.0, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert crossing([0, 1], [2.0, 3.0], [1.0, 1.0]) is None and crossing([0, 1], [0.0, 0.5], [1.0, 1.0]) is None
    fig = format_curves_figure(curves)
    assert len(fig.data) == 12 and "projected" in fig.layout.title.text     # 2 curves + 1 crossover each
    with pytest.raises(ValueError, match="no W4A16 row"):
        format_curves({**compat, "rows": [r for r in compat["rows"] if r["format"] != "w4"]}, sweep)


def test_formats_panel_curves_say_where_hierspec_overtakes(tmp_path):
    fig, note = formats_panel.curves_figure()
    assert fig is not None and "HierSpec overtakes EAGLE-2" in note and "W4A16 from 0." in note
    fig, note = formats_panel.curves_figure(tmp_path / "missing.json")
    assert fig is None and "not shipped" in note
