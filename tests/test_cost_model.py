"""The cost model (hierviz.measure.cost_model) and the What-if tab's formats panel that shows its
projections: the kernels it counts are the ones the format modules launch, the fit recovers known
parameters, the checks it reports are what a refit gives, the shipped file is what the command
writes, a projection keeps measured rows as measured and names what a GPU cannot run or hold."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hierviz.app import formats_panel
from hierviz.measure import cost_model as cm
from hierviz.quant.formats import get_format

ROOT = Path(__file__).resolve().parents[1]
PROFILES = [ROOT / "assets/profile/h200-llama3-70b-formats.json", ROOT / "assets/profile/h200-llama3-8b-formats.json"]
COMPAT = ROOT / "assets/whatif/compat-h200-llama3-70b.json"
H200 = cm.GPUS["NVIDIA H200"]
# every format, and W4A16 through the CUDA MMA variant, on an H100: the shipped calibration
H100_PROFILES = [ROOT / f"docs/bench/profile-h100-llama3-{n}.json" for n in ("70b-formats", "70b-cuda", "8b-formats", "8b-cuda")]
CHECKS = ("in_sample", "leave_one_shape_out", "leave_one_format_out", "whole_model")
FORMATS = ("dense", "w4a16", "w8a8-int8", "w8a8-fp8")


@pytest.fixture(scope="module")
def profiles() -> list[dict]:
    return [json.loads(p.read_text()) for p in PROFILES]


@pytest.fixture(scope="module")
def curves(profiles) -> list[cm.Curve]:
    return [c for p in profiles for c in cm.curves_of(p, H200)]


@pytest.fixture(scope="module")
def cal(profiles) -> dict:
    return cm.calibrate(profiles, H200)


@pytest.fixture(scope="module")
def cal_h100() -> dict:
    return cm.calibrate([json.loads(p.read_text()) for p in H100_PROFILES], cm.gpu_named("NVIDIA H100 80GB HBM3"))


def assert_same_checks(recorded: dict, cal: dict) -> None:
    """A recorded calibration's fit and every check are what the model computes now."""
    assert recorded["fit"] == pytest.approx(cal["fit"])
    for key in CHECKS:
        assert recorded[key].keys() == cal[key].keys(), key
        for name, s in cal[key].items():
            assert recorded[key][name] == pytest.approx(s), (key, name)


# ---- the kernels counted are the code's ----------------------------------------------------------

class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the format modules take their CUDA branch (rows padded
    to 17, fixed 128-row GEMMs) while the ops run here."""

    @property
    def is_cuda(self) -> bool:
        return True


class _Launches(TorchDispatchMode):
    """Each op that launches a kernel on a GPU (not views, allocations or wrapped scalars), with the
    bytes of the tensors it reads and writes."""
    NO_KERNEL = ("empty", "scalar_tensor")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.__name__.split(".")[0] not in self.NO_KERNEL:
            tensors = [t for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.ops.append((func.__name__, sum(t.numel() * t.element_size() for t in tensors)))
        return out


def _launches(fn, *args) -> list[tuple[str, int]]:
    with _Launches() as mode:
        fn(*args)
    return mode.ops


@pytest.mark.parametrize("fmt", ["w8a8-int8", "w8a8-fp8"])
@pytest.mark.parametrize("t", [1, 4, 16, 17, 32, 128])
def test_the_8bit_products_launch_the_kernels_the_model_counts(fmt, t):
    """Count and bytes of every kernel of a W8A8 product (with and without the residual add), as
    hierviz.quant.w8a8 / fp8 run it on CUDA, against the model's list."""
    k, n = 256, 512
    lin = get_format(fmt).make_linear([get_format(fmt).quantize(torch.randn(n, k))], "")
    x = torch.randn(t, k, dtype=torch.float16).as_subclass(_CudaLike)
    residual = torch.zeros(t, n, dtype=torch.float16).as_subclass(_CudaLike)
    for add in (False, True):
        ops = _launches(lin, x, residual) if add else _launches(lin, x)
        want = cm.product_kernels(fmt, t, k, n, add, cm.Shape({}), H200)
        assert len(ops) == len(want), [o for o, _ in ops]
        assert sum(b for _, b in ops) == pytest.approx(sum(w.bytes for w in want), rel=0.01)
        assert [w.kind for w in want].count("gemm") == 1


def test_the_shared_kernels_and_constants_are_the_codes():
    from hierviz.models import fused
    from hierviz.quant import fp8, w8a8
    ops = _launches(fused.visible_columns, torch.ones(4, 640, dtype=torch.bool))
    assert len(ops) == cm.VISIBLE_COLUMNS_KERNELS
    assert cm.ATTN_COLUMNS_PER_PROGRAM == fused.ATTN_BLOCK_L * fused.ATTN_SPLIT_BLOCKS
    where = cm.Shape({"num_heads": 64, "num_kv_heads": 8, "head_dim": 128}, 512, 640)
    assert len(cm.attention_kernels(4, where)) == 1 and fused.attention_splits(640) > 1   # one launch, slices combined in it
    assert cm.INT_MM_MIN_ROWS == w8a8.CUDA_MIN_ROWS and cm.FP8_ROWS == fp8.CUDA_CHUNK


def test_w4_tiles_follow_the_kernels_configuration():
    from hierviz.quant.triton_w4 import pick_config
    for t in (1, 2, 16, 32, 64, 100, 128):
        for n, k in ((10240, 8192), (8192, 28672), (4096, 4096)):
            c = pick_config(t, n, k, 128, 132, gemv=True)
            tiles, rows, stages, split = cm.w4_tiling(t, n, k, 128, 132, True)
            assert rows == (0 if c.gemv else c.block_m) and tiles == (1 if c.gemv else -(-t // c.block_m))
            assert stages > 0 and split == c.split_k
    # no one-token CUDA-core kernel before Hopper: 16 padded rows
    assert cm.w4_tiling(1, 10240, 8192, 128, 108, False)[1] == 16


def test_w4_regimes_follow_the_kernels_configuration():
    """The regime a W4 product is costed in is the one pick_config launches: the CUDA-core kernel,
    the small-M path's 16-token tiles, or larger tiles with or without a K split."""
    from hierviz.quant.triton_w4 import pick_config
    seen = set()
    for t in (1, 2, 16, 17, 32, 64, 100, 128):
        for n, k in ((10240, 8192), (8192, 28672), (57344, 8192), (4096, 4096)):
            c = pick_config(t, n, k, 128, 132, gemv=True)
            regime = cm.w4_regime(t, n, k, 128, 132, True)
            seen.add(regime)
            want = ("gemv" if c.gemv else "small" if c.block_m <= 16 else "tiled_ordered" if c.split_k > 1 else "tiled")
            assert regime == want, (t, n, k)
            (kernel,) = cm.w4_kernels(get_format("w4a16"), t, k, n, False, cm.Shape({}, group=128), H200)
            assert (kernel.math == "simt") == c.gemv and kernel.ordered == (regime == "tiled_ordered")
    assert seen == set(cm.W4_REGIMES)
    assert cm.w4_regime(1, 10240, 8192, 128, 108, False) == "small"      # no CUDA-core kernel before Hopper
    # the CUDA-core kernel's instructions are its PTX block's, per weight
    assert 1.5 < cm.gemv_instructions() < 2.5


def test_a_planted_wrong_w4_regime_is_caught(monkeypatch, curves):
    """W4A16 predicted from the other formats' fit: within 15 % with the regimes the kernel runs,
    past it when the one-token CUDA-core kernel is costed as its loads alone, or the split tiles of
    32-64 rows without their fixed-order sum's cost."""
    g = cm.fit([c for c in curves if c.fmt != "w4a16"])
    w4 = [c for c in curves if c.fmt == "w4a16"]
    assert max(map(abs, cm.errors(g, w4))) < 0.15
    real_regime = cm.w4_regime

    def no_ordered_sum(t, n, k, group, sms, gemv):
        got = real_regime(t, n, k, group, sms, gemv)
        return "tiled" if got == "tiled_ordered" else got
    for name, planted in (("gemv_instructions", lambda: 0.0), ("w4_regime", no_ordered_sum)):
        monkeypatch.setattr(cm, name, planted)
        assert max(map(abs, cm.errors(g, [cm.with_terms(c, H200) for c in w4]))) > 0.15, name
        monkeypatch.undo()


def test_the_cuda_mma_regimes_follow_its_configuration():
    """A profile that records the CUDA MMA kernel is costed as its loops: K in split_for's slices
    whatever M (their fp32 partials), the weights read once per 64-token grid chunk, the padded
    token tiles' arithmetic; the time the slower of the reads and the MMA loop at e_mma."""
    from hierviz.quant import cuda_w4
    where = cm.Shape({}, group=128, w4_kernel=cm.CUDA_VARIANT)
    fmt = get_format("w4a16")
    k, n = 8192, 28672
    weights = fmt.linear_bytes(n, k, 128)
    split = cuda_w4.split_for(n, k, H200.sms)
    for t, chunks, tiles in ((1, 1, 1), (9, 1, 2), (40, 1, 5), (64, 1, 8), (65, 2, 8), (128, 2, 8)):
        kern, = cm.w4_kernels(fmt, t, k, n, True, where, H200)
        assert kern.kind == "mma_sync" and kern.flops == 2.0 * chunks * 8 * tiles * n * k
        partials = 8.0 * split * t * n if split > 1 else 0.0
        assert kern.bytes == pytest.approx(chunks * weights + 2.0 * t * k + 4.0 * t * n + partials)
    f = cm.Fit(2.3, 0.93, 0.5, 3.7, e_mma=0.2)
    one = cm.terms_of(cm.w4_kernels(fmt, 1, k, n, False, where, H200), H200)
    assert cm.predict_us(f, one) == pytest.approx(2.3 + one.mma_mem_us[0] / 0.93)     # the read hides the loop
    five = cm.terms_of(cm.w4_kernels(fmt, 40, k, n, False, where, H200), H200)
    assert cm.predict_us(f, five) == pytest.approx(2.3 + five.mma_comp_us[0] / 0.2)    # the loop is the longer
    assert cm.predict_us(dataclasses.replace(f, e_mma=None), five) < cm.predict_us(f, five)   # e_c stands in
    times = [cm.predict_us(f, cm.terms_of(cm.w4_kernels(fmt, t, k, n, False, where, H200), H200))
             for t in (1, 8, 16, 64, 128)]
    assert times == sorted(times)


def test_weight_bytes_and_kernel_counts_match_the_profiles(profiles, cal):
    for p in profiles:
        where = cm.Shape(p["config"], group=p["group_size"])
        norms = 2 * 2 * p["config"]["hidden_size"]
        for s in p["series"]:
            if s["scope"] == "layer" and cm.curve_format(s):
                assert cm.weight_bytes(cm.curve_format(s), where) + norms == pytest.approx(s["weight_bytes"], rel=1e-6)
    counts = cal["formats"]
    # one layer: 13 shared kernels; 4 GEMMs + 2 adds; 4 W4 kernels; 16 (int8) / 14 (FP8) per 8-bit product + 2 adds
    assert counts["dense"]["kernels"]["llama3-70b"] == {"1": 19, "16": 19, "17": 19, "128": 19}
    assert counts["w4a16"]["kernels"]["llama3-8b"]["1"] == 17
    assert counts["w8a8-int8"]["kernels"]["llama3-70b"] == {"1": 79, "16": 79, "17": 71, "128": 71}
    assert counts["w8a8-fp8"]["kernels"]["llama3-70b"] == {"1": 71, "16": 71, "17": 71, "128": 63}


# ---- the fit ---------------------------------------------------------------------------------------

def _synthetic(curves: list[cm.Curve], truth: cm.Fit) -> list[cm.Curve]:
    return [dataclasses.replace(c, us=[cm.predict_us(truth, tm) for tm in c.terms]) for c in curves]


def test_the_fit_recovers_the_parameters_of_curves_it_generated(curves):
    truth = cm.Fit(launch_us=3.1, e_bw=0.74, e_c=0.36, fill=2.2)
    got = cm.fit(_synthetic(curves, truth))
    assert got.launch_us == pytest.approx(3.1, rel=0.02) and got.e_bw == pytest.approx(0.74, rel=0.01)
    assert got.e_c == pytest.approx(0.36, rel=0.02) and got.fill == pytest.approx(2.2, rel=0.03)
    assert max(map(abs, cm.errors(got, _synthetic(curves, truth)))) < 0.005
    # the library GEMMs wait the same fill: curves without W4A16 still tell it, less sharply (their
    # long K loops trade a little fill for a little e_bw: 2.0 and 0.734 are 0.4 % off at most)
    no_w4 = cm.fit(_synthetic([c for c in curves if c.fmt != "w4a16"], truth))
    assert no_w4.fill == pytest.approx(2.2, rel=0.15) and no_w4.e_c == pytest.approx(0.36, rel=0.02)


def test_every_product_with_a_k_loop_waits_the_fill():
    """A library GEMM's stages per K step follow the assumed cuBLAS tiles (128 bytes of K a step),
    whatever its element size; the W4 kernel's fixed-order split-K reads its fp32 partials back."""
    for k in (4096, 8192, 28672):
        steps = k * 2 / cm.CUBLAS_K_BYTES
        assert cm.dense_kernels(1, k, 8192, False)[0].stages == pytest.approx(cm.CUBLAS_STAGES / steps)
        for fmt in ("w8a8-int8", "w8a8-fp8"):       # one byte a channel: half the steps
            mm = [x for x in cm.product_kernels(fmt, 1, k, 8192, False, cm.Shape({}), H200) if x.kind == "gemm"]
            assert mm[0].stages == pytest.approx(cm.CUBLAS_STAGES / steps * 2)
    where = cm.Shape({}, group=128)
    k, n = 28672, 8192
    for t in (1, 16, 64, 128):
        tiles, _, _, split = cm.w4_tiling(t, n, k, 128, H200.sms, True)
        weights = n * k / 2 + 4.0 * n * k / 128
        got = cm.w4_kernels(get_format("w4a16"), t, k, n, False, where, H200)[0].bytes - tiles * weights - 2.0 * t * (k + n)
        assert got == pytest.approx(8.0 * split * t * n if split > 1 else 0.0)


def test_calibration_on_the_shipped_h200_profiles_reports_every_check(cal):
    assert set(cal["formats"]) == set(FORMATS) and set(cal["in_sample"]) == set(FORMATS)
    assert 0.8 < cal["copy_e_bw"] <= 1.0 and 0.5 < cal["fit"]["e_bw"] <= 1.0
    assert 1.0 < cal["fit"]["launch_us"] < 5.0
    assert all(v["mean_abs"] < 0.1 for v in cal["in_sample"].values())
    assert len(cal["leave_one_shape_out"]) == 8 and set(cal["leave_one_format_out"]) == set(FORMATS)
    assert set(cal["whole_model"]) == {f"{f} @ llama3-8b" for f in FORMATS}


def test_the_checks_reported_are_what_a_refit_gives(cal, curves):
    for fm in FORMATS:
        g = cm.fit([c for c in curves if c.fmt != fm])
        assert cm.summary(cm.errors(g, [c for c in curves if c.fmt == fm])) == pytest.approx(cal["leave_one_format_out"][fm])
        assert 0.5 < g.fill < 8.0      # told by every format's products
    g = cm.fit([c for c in curves if c.shape != "llama3-8b"])
    for fm in FORMATS:
        test = [c for c in curves if c.fmt == fm and c.shape == "llama3-8b"]
        assert cm.summary(cm.errors(g, test)) == pytest.approx(cal["leave_one_shape_out"][f"{fm} @ llama3-8b"])


def test_formats_left_out_are_predicted_from_the_others(cal, curves):
    """Each format predicted by a fit that never saw its curves, W4A16 included: within 15 % at
    every point; with a model shape left out and in-sample W4A16 too (its regimes: the one-token
    CUDA-core kernel, the split tiles' fixed-order sum); the W4A16 fill learnt from the library
    GEMMs alone."""
    out = cal["leave_one_format_out"]
    for fm in FORMATS:
        assert out[fm]["max_abs"] < 0.15, fm
    assert all(v["max_abs"] < 0.15 for k, v in cal["leave_one_shape_out"].items()), cal["leave_one_shape_out"]
    assert all(v["max_abs"] < 0.15 for v in cal["in_sample"].values())
    g = cm.fit([c for c in curves if c.fmt != "w4a16"])
    assert g.fill == pytest.approx(cal["fit"]["fill"], rel=0.5)


def test_the_shipped_file_is_what_the_command_writes(cal_h100):
    """assets/whatif/cost-model.json: the calibration on the H100's profiles (every format and both
    fp16 W4 kernels), projecting the H200's compat tables."""
    shipped = json.loads(formats_panel.COST_MODEL_FILE.read_text())
    cal = cal_h100
    assert_same_checks(shipped["calibration"], cal)
    assert "--profiles " + ",".join(str(p.relative_to(ROOT)) for p in H100_PROFILES) in shipped["command"]
    assert "--compat assets/whatif/compat-h200-llama3-70b.json,assets/whatif/compat-h200-llama3-8b.json" in shipped["command"]
    compats = [json.loads((ROOT / f"assets/whatif/compat-h200-llama3-{n}.json").read_text()) for n in ("70b", "8b")]
    for proj, compat in zip(shipped["projections"], compats):
        assert proj == json.loads(json.dumps(cm.project(cal, compat, compat["configs"], [cm.GPUS[g["name"]] for g in shipped["gpus"]])))
        assert proj["measured_on"] == "NVIDIA H200" and proj["projected_w4_kernels"] == ["triton", "cuda_mma"]


# ---- projections -----------------------------------------------------------------------------------

def test_projection_keeps_measured_rows_and_names_what_a_gpu_cannot_run(cal):
    compat = json.loads(COMPAT.read_text())
    twice = dataclasses.replace(H200, name="twice", bandwidth_GBps=9600, memory_GB=400,
                                tflops={k: 2 * v for k, v in H200.tflops.items()})
    cm.GPUS["twice"] = twice
    try:
        proj = cm.project(cal, compat, compat["configs"], [H200, cm.GPUS["NVIDIA A100 80GB SXM"], twice])
    finally:
        del cm.GPUS["twice"]
    rows = {(e["gpu"], e["format"]): e for e in proj["rows"]}
    for r in compat["rows"]:      # the shipped file names W4A16 by its alias "w4"; projections by its name
        fm = get_format(r["format"]).name
        assert rows[("NVIDIA H200", fm)]["tokens_per_s"] == r["tokens_per_s"]
        assert not rows[("NVIDIA H200", fm)]["projected"]
    assert rows[("NVIDIA A100 80GB SXM", "w8a8-fp8")]["skipped"] == "no FP8 tensor cores"
    assert "needs ~" in rows[("NVIDIA A100 80GB SXM", "dense")]["skipped"]
    fast = rows[("twice", "w4a16")]
    assert fast["projected"] and fast["tokens_per_s"]["ar"] > rows[("NVIDIA H200", "w4a16")]["tokens_per_s"]["ar"] * 1.3


def test_a_gpu_twice_as_fast_in_everything_halves_every_kernel_but_the_launches(cal, curves):
    f = cm.Fit(**cal["fit"])
    twice = dataclasses.replace(H200, bandwidth_GBps=9600, tflops={k: 2 * v for k, v in H200.tflops.items()})
    for c in curves:
        where, t = c.where, c.tokens[-1]
        n = len(cm.forward_kernels(c.fmt, t, where, H200))
        fast, base = cm.layer_us(f, twice, c.fmt, where, t), cm.layer_us(f, H200, c.fmt, where, t)
        assert fast - n * f.launch_us == pytest.approx((base - n * f.launch_us) / 2, rel=1e-9)


def test_cli_writes_the_tables_and_refuses_unknown_gpus(tmp_path, capsys):
    args = ["--profiles", ",".join(map(str, PROFILES)), "--compat", str(COMPAT), "--out", str(tmp_path)]
    assert cm.main(args + ["--gpus", "NVIDIA L4,NVIDIA H200"]) == 0
    md = (tmp_path / "cost_model.md").read_text()
    assert "| w8a8-int8 |" in md and "NVIDIA L4" in md and "Per kernel launch" in md
    assert cm.main(args + ["--gpus", "NVIDIA B300"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


# ---- the What-if tab -------------------------------------------------------------------------------

def test_formats_panel_tags_measured_and_projected_rows(tmp_path):
    d = formats_panel.load_cost_model()
    labels = formats_panel.pair_labels(d)
    assert labels and "llama3-70b target" in labels[0]
    md = formats_panel.table_markdown(d, labels[0])
    assert "| H200<br>measured |" in md and "*projected*" in md and "no FP8 tensor cores" in md and "does not fit" in md
    assert "46 of 80 layers measured, scaled" in md and md.count("**HierSpec") >= 8
    assert "The 8-bit rows of the H200 ran hierviz's fused activation quantizer" in md
    for e in d["projections"][0]["rows"]:
        e.pop("activation_quantizer", None)
    assert "fused activation quantizer" not in formats_panel.table_markdown(d, labels[0])
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
    assert set(curves) == {"dense", "w8a8-int8", "w8a8-fp8", "w4a16"}
    w4 = curves["w4a16"]
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


# ---- the fused activation quantizer ------------------------------------------------------------

@pytest.mark.parametrize("fmt, rounds, torch_kernels", [("w8a8-int8", True, 9), ("w8a8-fp8", False, 8)])
def test_the_fused_quantizer_is_one_kernel_in_place_of_torchs(fmt, rounds, torch_kernels):
    """hierviz.quant.act_quant: one kernel that reads each row twice and writes codes and scales."""
    fused = dataclasses.replace(H200, fused_act_quant=True)
    t, k, n = 16, 256, 512
    assert len(cm.quantize_kernels(t, k, rounds)) == torch_kernels
    assert [q.bytes for q in cm.quantize_kernels(t, k, rounds, fused=True)] == [5.0 * t * k + 4 * t]
    plain = cm.product_kernels(fmt, t, k, n, True, cm.Shape({}), H200)
    one = cm.product_kernels(fmt, t, k, n, True, cm.Shape({}), fused)
    assert len(plain) - len(one) == torch_kernels - 1
    assert cm.product_kernels("w4", 1, 8192, 8192, False, cm.Shape({}, group=128), fused) == \
        cm.product_kernels("w4", 1, 8192, 8192, False, cm.Shape({}, group=128), H200)


def test_projection_prices_the_quantizer_each_side_ran(cal):
    """The same compat projected onto an identical GPU (which gets torch's quantizer), once recorded
    as measured with torch's quantizer and once with the fused one: in the second the measured
    8-bit rows were cheaper than the model's torch-quantizer layer, so their projection is slower;
    the other formats do not move."""
    compat = json.loads(COMPAT.read_text())
    same = dataclasses.replace(H200, name="same", memory_GB=400)   # holds every format
    cm.GPUS["same"] = same
    try:
        runs = {}
        for q in ("torch", "fused"):
            c = {**compat, "machine": {**compat["machine"], "activation_quantizer": q}}
            runs[q] = {e["format"]: e for e in cm.project(cal, c, c["configs"], [H200, same])["rows"] if e["gpu"] == "same"}
    finally:
        del cm.GPUS["same"]
    for r in compat["rows"]:
        fmt = get_format(r["format"])
        plain, fused = runs["torch"][fmt.name], runs["fused"][fmt.name]
        if fmt.quantizes_activations:
            assert plain["activation_quantizer"] == fused["activation_quantizer"] == "torch"
            assert fused["tokens_per_s"]["ar"] < 0.97 * plain["tokens_per_s"]["ar"]
        else:
            assert "activation_quantizer" not in fused
            assert fused["tokens_per_s"] == plain["tokens_per_s"]


def test_quantizer_records_are_checked(profiles):
    with pytest.raises(ValueError, match="unknown activation_quantizer"):
        cm.as_measured(H200, "fast")
    mixed = [profiles[0], {**profiles[1], "activation_quantizer": "fused"}]
    with pytest.raises(ValueError, match="different activation quantizers"):
        cm.calibrate(mixed, H200)


# ---- the CUDA MMA variant's curves -----------------------------------------------------------------

def _as_cuda(profile: dict) -> dict:
    """The profile as if its W4 products had run the CUDA MMA variant (HIERVIZ_W4_CUDA=on)."""
    return {**profile, "machine": {**profile.get("machine", {}), "w4_fp16_kernel": cm.CUDA_VARIANT},
            "series": [s for s in profile["series"] if cm.curve_format(s) == "w4a16"]}


def test_a_profile_of_the_cuda_kernel_is_a_curve_of_its_own_in_every_check(profiles):
    both = profiles + [_as_cuda(p) for p in profiles]
    curves = [c for p in both for c in cm.curves_of(p, H200)]
    labels = {cm.curve_label(c) for c in curves}
    assert labels == {*FORMATS, "w4a16 (cuda_mma)"}
    cuda = [c for c in curves if cm.curve_label(c) == "w4a16 (cuda_mma)"]
    assert all(tm.mma_comp_us and not tm.w4_comp_us for c in cuda for tm in c.terms)
    truth = cm.Fit(launch_us=2.4, e_bw=0.9, e_c=0.45, fill=3.0, e_mma=0.2)
    got = cm.fit(_synthetic(curves, truth))
    assert got.e_mma == pytest.approx(0.2, rel=0.03) and got.e_c == pytest.approx(0.45, rel=0.03)
    assert cm.fit(_synthetic([c for c in curves if c not in cuda], truth)).e_mma is None
    cal = cm.calibrate(both, H200)
    assert set(cal["in_sample"]) == set(cal["leave_one_format_out"]) == set(cal["formats"]) == labels
    assert {"w4a16 (cuda_mma) @ llama3-8b", "w4a16 (cuda_mma) @ llama3-70b"} <= set(cal["leave_one_shape_out"])
    assert "e_mma" in cal["fit"] and "e_mma" not in cm.calibrate(profiles, H200)["fit"]
    assert "| w4a16 (cuda_mma) |" in cm.markdown({"calibration": cal})


def test_a_gpu_is_known_by_the_name_torch_gives_it(tmp_path, profiles, capsys):
    assert cm.gpu_named("NVIDIA H100 80GB HBM3") is cm.GPUS["NVIDIA H100 SXM"]
    assert cm.gpu_named("NVIDIA H200") is H200 and cm.gpu_named("a GPU nobody sells") is None
    h100 = tmp_path / "h100.json"
    h100.write_text(json.dumps({**profiles[1], "device": "NVIDIA H100 80GB HBM3"}))
    assert cm.main(["--profiles", str(h100), "--gpus", "NVIDIA A100 80GB SXM", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out/cost_model.json").read_text())["calibration"]["gpu"] == "NVIDIA H100 SXM"
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({**profiles[1], "device": "a GPU nobody sells"}))
    assert cm.main(["--profiles", str(odd), "--out", str(tmp_path / "out2")]) != 0
    assert "one GPU the model knows" in capsys.readouterr().err


def test_the_h100_calibration_with_both_w4_kernels_is_what_a_refit_gives(cal_h100):
    """docs/bench/cost-model-h100.json (profiles of every format and of the CUDA MMA variant on an
    H100) is what the model computes from those profiles now; its CUDA curves are priced through
    e_mma, the Triton W4 curves stay within 15 % in-sample and with a shape left out, and the CUDA
    kernel's in-sample error stays where docs/formats.md records it."""
    recorded = json.loads((ROOT / "docs/bench/cost-model-h100.json").read_text())["calibration"]
    cal = cal_h100
    assert cal["gpu"] == recorded["gpu"] == "NVIDIA H100 SXM"
    assert_same_checks(recorded, cal)
    assert 0.1 < cal["fit"]["e_mma"] < cal["fit"]["e_c"]
    assert cal["in_sample"]["w4a16"]["max_abs"] < 0.15
    assert all(cal["leave_one_shape_out"][f"w4a16 @ {sh}"]["max_abs"] < 0.15 for sh in ("llama3-70b", "llama3-8b"))
    assert cal["in_sample"]["w4a16 (cuda_mma)"]["max_abs"] < 0.25


def test_a_projection_prices_w4_forwards_at_the_faster_kernel_where_the_calibration_measured_both(cal):
    """With e_mma (a calibration that measured the CUDA MMA variant) a projected GPU's W4 forwards
    take the faster of the two kernels, as HIERVIZ_W4_CUDA=auto runs them; without it, or on a GPU
    before sm_80, the Triton kernel alone. Measured rows stay as measured either way."""
    compat = json.loads(COMPAT.read_text())
    a100 = cm.GPUS["NVIDIA A100 80GB SXM"]
    with_mma = {**cal, "fit": {**cal["fit"], "e_mma": 0.18}}
    assert cm.projected_w4_kernels(cm.Fit(**with_mma["fit"]), a100) == ("triton", cm.CUDA_VARIANT)
    assert cm.projected_w4_kernels(cm.Fit(**cal["fit"]), a100) == ("triton",)
    turing = dataclasses.replace(a100, name="turing", capability=(7, 5))
    assert cm.projected_w4_kernels(cm.Fit(**with_mma["fit"]), turing) == ("triton",)
    both, triton = (cm.project(c, compat, compat["configs"], [H200, a100]) for c in (with_mma, cal))
    rows = {(e["gpu"], e["format"]): e for e in both["rows"]}
    rows_triton = {(e["gpu"], e["format"]): e for e in triton["rows"]}
    assert rows[("NVIDIA H200", "w4a16")]["tokens_per_s"] == rows_triton[("NVIDIA H200", "w4a16")]["tokens_per_s"]
    for m, tps in rows[(a100.name, "w4a16")]["tokens_per_s"].items():
        assert tps >= rows_triton[(a100.name, "w4a16")]["tokens_per_s"][m] * (1 - 1e-9), m
    assert rows[(a100.name, "w4a16")]["tokens_per_s"]["ar"] > rows_triton[(a100.name, "w4a16")]["tokens_per_s"]["ar"]
    assert both["measured_on"] == "NVIDIA H200" and both["measured_w4_kernel"] == "triton"


def test_the_cuda_kernels_loop_scales_with_multiprocessors_and_clock():
    """The clock follows from the spec sheet's FP32 rate and lanes; the loop's rate from SMs x clock,
    capped by the tensor rate (a GPU whose tensor pipe is the slower is priced at it)."""
    assert cm.GPUS["NVIDIA H100 SXM"].clock_ghz == pytest.approx(1.98, abs=0.01)
    assert cm.GPUS["NVIDIA A100 80GB SXM"].clock_ghz == pytest.approx(1.41, abs=0.01)
    assert cm.issue_tflops(cm.GPUS["NVIDIA A100 80GB SXM"]) / cm.issue_tflops(cm.GPUS["NVIDIA H100 SXM"]) == pytest.approx(
        108 * 1.41 / (132 * 1.98), rel=0.01)
    assert cm.issue_tflops(dataclasses.replace(H200, fp32_tflops=0.0)) == H200.tflops["f16"]   # no FP32 rate on file
    where = cm.Shape({}, group=128, w4_kernel=cm.CUDA_VARIANT)
    f = cm.Fit(3.0, 0.93, 0.6, 1.0, e_mma=0.9)
    ada = cm.GPUS["NVIDIA GeForce RTX 4090"]
    tm = cm.terms_of(cm.w4_kernels(get_format("w4a16"), 40, 4096, 14336, False, where, ada), ada)
    assert tm.mma_comp_us[0] / 0.9 < tm.mma_peak_us[0]
    assert cm.predict_us(f, tm) == pytest.approx(3.0 + max(tm.mma_mem_us[0] / 0.93, tm.mma_peak_us[0]))


def test_the_cuda_kernel_is_costed_at_the_entry_that_ran() -> None:
    """Without an entry, the one-pass entry (cuda_w4.plan_for's default: one grid pass per 64
    tokens, ceil(t / 8) token tiles up to 8). A timed entry of fewer token tiles runs more passes,
    each reading the weights again, over fewer padded tokens; its K slices set the fp32 partials."""
    from hierviz.quant import cuda_w4
    h100, fmt, k, n = cm.GPUS["NVIDIA H100 SXM"], get_format("w4a16"), 4096, 28672
    weights = fmt.linear_bytes(n, k, 128)

    def kernel(t: int, entry=None) -> cm.Kernel:
        where = cm.Shape({}, group=128, w4_kernel=cm.CUDA_VARIANT, w4_entry=entry)
        (one,) = cm.cuda_mma_kernels(fmt, t, k, n, False, where, h100)
        return one
    split = cuda_w4.split_for(n, k, h100.sms)
    acts = lambda t: 2.0 * t * k + 2.0 * t * n + (8.0 * split * t * n if split > 1 else 0.0)     # noqa: E731
    for t, passes, padded in [(1, 1, 8), (17, 1, 24), (64, 1, 64), (96, 2, 128), (128, 2, 128)]:
        assert kernel(t) == kernel(t, cuda_w4.one_pass_entry(t, split))
        assert kernel(t).bytes == pytest.approx(passes * weights + acts(t)) and kernel(t).flops == 2.0 * padded * n * k
    # the 8B gate-up's timed plan at 96 rows: three tiles a block, four passes, 96 padded tokens
    planned = kernel(96, (3, 2, 1, 1))
    assert planned.bytes == pytest.approx(4 * weights + 2.0 * 96 * (k + n)) and planned.flops == 2.0 * 96 * n * k
    assert kernel(9, (8, 1, 1, 1)) == kernel(9, (2, 1, 1, 1))      # more tiles than the rows fill: as many as they do


def test_cost_check_prices_each_product_a_whatif_timed(tmp_path, capsys) -> None:
    """`cost-check`: every product of a what-if's w4_kernel_choices, both kernels, priced with the
    shipped H100 calibration on the what-if's GPU; the summary covers only what the model models (a
    verifier's Triton products run the batch-invariant mode its profiles never ran)."""
    from hierviz.measure import cost_check
    whatif = ROOT / "assets/whatif/h100-llama3-70b-paper-trees.json"
    calibration = ROOT / "docs/bench/cost-model-h100.json"
    assert cost_check.main(["--calibration", str(calibration), "--whatif", str(whatif), "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "cost_check.json").read_text())
    choices = json.loads(whatif.read_text())["w4_kernel_choices"]
    assert len(info["products"]) == sum(len(c["cuda_us"]) + len(c["triton_us"]) for c in choices)
    fit = cm.Fit(**json.loads(calibration.read_text())["calibration"]["fit"])
    gpu = cm.gpu_named(info["measured_on"])
    for r in info["products"][:: 17]:      # the price is the model's for that product, the error against the record
        c = next(c for c in choices if (c["K"], c["N"], c["batch_invariant"]) == (r["K"], r["N"], r["batch_invariant"]))
        measured = c["cuda_us" if r["kernel"] == "cuda_mma" else "triton_us"][str(r["rows"])]
        entry = tuple(c["cuda_tiles"][str(r["rows"])]) if r["kernel"] == "cuda_mma" else None
        assert r["entry"] == (list(entry) if entry else None)
        kernels = cm.product_kernels("w4a16", r["rows"], r["K"], r["N"], False,
                                     cm.Shape(cfg={}, group=r["group"], w4_kernel=r["kernel"], w4_entry=entry), gpu)
        assert r["measured_us"] == measured and r["predicted_us"] == pytest.approx(cm.predict_us(fit, cm.terms_of(kernels, gpu)))
        assert r["error"] == pytest.approx(r["predicted_us"] / measured - 1)
    modeled = [r for r in info["products"] if r["modeled"]]
    assert {r["kernel"] for r in info["products"] if not r["modeled"]} == {"triton"}
    assert all(not r["batch_invariant"] for r in modeled if r["kernel"] == "triton")
    assert info["summary"]["cuda_mma"]["max_abs"] == max(abs(r["error"]) for r in modeled if r["kernel"] == "cuda_mma")
    assert "| cuda_mma |" in (tmp_path / "cost_check.md").read_text() and "not modeled" in capsys.readouterr().out
    with pytest.raises(ValueError, match="knows no GPU named 'Voodoo5 5500'"):
        cost_check.product_errors(fit, "Voodoo5 5500", choices)


@pytest.mark.parametrize("calibration, whatif, said", [
    ("docs/bench/cost-model-h100.json", "assets/whatif/acceptance", "IsADirectoryError|Is a directory"),
    ("docs/bench/cost-model-h100.json", "docs/bench/cost-model-h100.json", "holds no timed W4 products"),
    ("assets/whatif/h100-llama3-70b-paper-trees.json", "assets/whatif/h100-llama3-70b-paper-trees.json",
     "holds no fit"),
    ("docs/bench/cost-model-h100.json", "no-such-file.json", "No such file"),
])
def test_cost_check_refuses_files_it_cannot_use_with_one_line(calibration, whatif, said, capsys) -> None:
    from hierviz.measure import cost_check
    assert cost_check.main(["--calibration", str(ROOT / calibration), "--whatif", str(ROOT / whatif)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and any(s in err for s in said.split("|"))


@pytest.mark.parametrize("tiles, said", [
    ({"1": [1, 1]}, "cuda_tiles of 4096 x 4096 at 1 row is [1, 1], not four whole numbers"),
    ({"2": [0, 1, 1, 1]}, "at 2 rows is [0, 1, 1, 1], not four whole numbers of at least 1"),
    ({"1": "x"}, "at 1 row is 'x'"),
    ([[1, 1, 4, 2]], "cuda_tiles of 4096 x 4096 is not a table of row counts"),
])
def test_cost_check_refuses_a_timed_entry_it_cannot_price(tiles, said, tmp_path, capsys) -> None:
    from hierviz.measure import cost_check
    whatif = json.loads((ROOT / "assets/whatif/h100-llama3-70b-paper-trees.json").read_text())
    first = whatif["w4_kernel_choices"][0]
    assert (first["K"], first["N"]) == (4096, 4096)
    first["cuda_tiles"] = tiles if isinstance(tiles, list) else {**first["cuda_tiles"], **tiles}
    (tmp_path / "whatif.json").write_text(json.dumps(whatif))
    assert cost_check.main(["--calibration", str(ROOT / "docs/bench/cost-model-h100.json"),
                            "--whatif", str(tmp_path / "whatif.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and said in err, err
