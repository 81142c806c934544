"""The what-if projection (hierviz.measure.whatif) at tiny shapes on the CPU: forced acceptance replays a
trace's accepted lengths exactly through the real decoders, with EAGLE-2 or EAGLE-3 heads; rates mode
is seeded; bad arguments exit with code 2 and a one-line error."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hierviz.settings import DecodeSettings
from hierviz.decoding.tree import Tree
from hierviz.decoding.verify import forced_tree_path
from hierviz.measure.common import MeasureError
from hierviz.measure.whatif import build_models, main, run_one, tiny_config
from hierviz.measure.whatif_acceptance import RatesOracle, ReplayOracle

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--tiny", "--device", "cpu", "--threads", "1"]


@pytest.fixture(autouse=True)
def _keep_threads():
    """--threads 1 sets torch's global thread count: give it back to the other test modules."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine_trace(tmp_path_factory) -> Path:
    """A HierSpec + EAGLE-2 comparison recorded by the engine on the tiny random stack."""
    from hierviz.engine import generate
    from hierviz.stack import tiny_random_stack
    from hierviz.trace import save_comparison
    stack = tiny_random_stack()
    s = DecodeSettings(max_new_tokens=24)
    path = tmp_path_factory.mktemp("trace") / "tiny.json"
    save_comparison([generate(stack, m, "replay me", s) for m in ("hierspec", "eagle2")], path)
    return path


def _replay(trace: Path, out: Path, methods: str, extra: tuple[str, ...] = ()) -> dict:
    assert main(FAST + ["--acceptance", str(trace), "--methods", methods, *extra, "--out", str(out)]) == 0
    return json.loads((out / "whatif.json").read_text())


def _lengths(trace: Path) -> dict[str, list]:
    from hierviz.trace import comparison_from_json
    from hierviz.measure.whatif_acceptance import accepted_lengths
    return {t.meta["method"]: accepted_lengths(t.steps) for t in comparison_from_json(trace.read_bytes())}


def test_replays_engine_trace_exactly(engine_trace: Path, tmp_path: Path) -> None:
    info = _replay(engine_trace, tmp_path, "ar,eagle2,hierspec")
    want = _lengths(engine_trace)
    for m in ("eagle2", "hierspec"):
        assert info["methods"][m]["accepted"] == want[m]          # per round, per level
        assert info["replay"][m]["exact"]
    assert info["label"] == "projected with replayed acceptance"
    assert set(info["speedup_vs_ar"]) == {"ar", "eagle2", "hierspec"}
    assert info["head"] == "eagle2" and "hierspec_vs_eagle2" in info and "feature_layers" not in info
    assert "projected with replayed acceptance" in (tmp_path / "whatif.md").read_text()


def test_w4_intermediate_replays_exactly(engine_trace: Path, tmp_path: Path) -> None:
    """--intermediate-format w4: M is built W4A16 like the target; the replay stays exact."""
    info = _replay(engine_trace, tmp_path, "hierspec", ("--intermediate-format", "w4"))
    assert info["methods"]["hierspec"]["accepted"] == _lengths(engine_trace)["hierspec"]
    assert info["formats"]["intermediate"].startswith("W4A16")


def test_reduced_draft_vocabulary_replays_exactly(engine_trace: Path, tmp_path: Path) -> None:
    """--draft-vocab (FR-Spec): both heads draft from a smaller LM head; timing only changes."""
    info = _replay(engine_trace, tmp_path, "eagle2,hierspec", ("--draft-vocab", "200"))
    want = _lengths(engine_trace)
    for m in ("eagle2", "hierspec"):
        assert info["methods"][m]["accepted"] == want[m]
    assert info["draft_vocab"] == 200


def test_replays_deep_trees_of_the_recorded_h200_trace(tmp_path: Path) -> None:
    """The shipped H200 trace accepts paths up to the full tree depth: the synthetic heads'
    trees must reach that depth for the replay to stay exact."""
    trace = ROOT / "assets" / "traces" / "h200-smollm2-python-tips.json"
    info = _replay(trace, tmp_path, "eagle2,hierspec")
    want = _lengths(trace)
    assert max(n for r in want["eagle2"] for n in r["trees"]) >= 3
    for m in ("eagle2", "hierspec"):
        assert info["methods"][m]["accepted"] == want[m]


def test_rates_mode_is_seeded() -> None:
    torch.manual_seed(0)
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference")
    s = DecodeSettings(max_new_tokens=20)
    prompt = list(range(3, 40))
    runs = [run_one(models, "hierspec", s, RatesOracle([0.9, 0.7], 0.8, seed), prompt)["accepted"]
            for seed in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    e = run_one(models, "eagle2", s, RatesOracle([1.0], 1.0, 0), prompt)
    assert all(r["trees"] == [s.t_depth] for r in e["accepted"])   # rate 1: every tree fully accepted


def test_rates_oracle_accepts_each_depth_at_its_rate() -> None:
    """The forced lengths follow the given rates: depth d is accepted, once d - 1 was, at rates[d-1]
    (the intermediate's trees at m_rates), never deeper than the tree; a sequence token at seq_rate."""
    oracle = RatesOracle([0.9, 0.5, 0.2], 0.7, seed=5, m_rates=[0.6, 0.3])
    deep, shallow = SimpleNamespace(depths=[1, 2, 3, 3]), SimpleNamespace(depths=[1, 2])
    n = 20000

    def conditional(lengths: list[int], depth: int) -> float:
        return sum(x >= depth for x in lengths) / sum(x >= depth - 1 for x in lengths)

    t = [oracle.tree("target", deep) for _ in range(n)]
    assert [conditional(t, d) for d in (1, 2, 3)] == pytest.approx([0.9, 0.5, 0.2], abs=0.02)
    m = [oracle.tree("intermediate", deep) for _ in range(n)]
    assert [conditional(m, d) for d in (1, 2, 3)] == pytest.approx([0.6, 0.3, 0.3], abs=0.02)   # the last rate repeats
    assert max(oracle.tree("target", shallow) for _ in range(2000)) == 2
    q = [oracle.sequence("target", [0] * 4) for _ in range(n)]
    assert [conditional(q, d) for d in (1, 2, 3, 4)] == pytest.approx([0.7] * 4, abs=0.02) and max(q) == 4


def test_forced_tree_path_takes_the_most_likely_branch_and_replay_wraps() -> None:
    """A forced length n accepts the path to the best-scoring node at depth min(n, deepest) (EAGLE-2's
    most likely branch, not the first drafted), bonus the verifier's argmax after it; a replayed
    trace shorter than the run starts over."""
    tree = Tree(0, [5, 6, 7, 8], [-1, -1, 0, 1], [1, 1, 2, 2], [-0.1, -0.2, -0.5, -0.3], [-0.1, -0.2, -0.4, -0.1])
    best = [10, 11, 12, 13, 14]
    assert forced_tree_path(tree, best, 0) == ([], 10)
    assert forced_tree_path(tree, best, 1) == ([0], 11)
    assert forced_tree_path(tree, best, 2) == ([1, 3], 14) == forced_tree_path(tree, best, 9)
    replay = ReplayOracle([{"trees": [2], "target": 3}, {"trees": [0, 1], "target": 1}])
    assert [replay.tree("target", tree) for _ in range(5)] == [2, 0, 1, 2, 0]
    assert [replay.sequence("target", [0] * 4) for _ in range(3)] == [3, 1, 3]


def test_sweep_writes_verdicts(tmp_path: Path) -> None:
    assert main(FAST + ["--sweep", "--sweep-scales", "0.5,1.0", "--sweep-tree-sizes", "24",
                        "--sweep-min-draft", "6", "--max-new-tokens", "12", "--out", str(tmp_path)]) == 0
    sw = json.loads((tmp_path / "sweep.json").read_text())
    assert [v["scale"] for v in sw["verdicts"]] == [0.5, 1.0]
    assert all(v["winner"] in ("eagle2", "hierspec") for v in sw["verdicts"])
    assert sw["label"] == "projected with replayed acceptance"
    assert sw["formats"]["intermediate"].startswith("dense") and sw["stage_sync"] is True   # labelled in the UI
    assert sw["tree_method"] == "eagle2" and {r["method"] for r in sw["rows"]} == {"eagle2", "hierspec"}


def test_sweep_with_eagle3_heads_compares_eagle3_and_hierspec(tmp_path: Path) -> None:
    """--sweep --head eagle3: T's own tree is EAGLE-3's, HierSpec drafts with an EAGLE-3 E_M; the
    verdicts, the table and the app's sweep figure name EAGLE-3."""
    from hierviz.app.whatif_tab import summary_markdown
    from hierviz.viz.whatif_fig import sweep_figure
    assert main(FAST + ["--head", "eagle3", "--draft-vocab", "200", "--sweep", "--sweep-scales", "0.5,1.0",
                        "--sweep-tree-sizes", "12", "--sweep-min-draft", "4", "--max-new-tokens", "10",
                        "--out", str(tmp_path)]) == 0
    sw = json.loads((tmp_path / "sweep.json").read_text())
    assert sw["tree_method"] == "eagle3" and {r["method"] for r in sw["rows"]} == {"eagle3", "hierspec"}
    assert all(v["winner"] in ("eagle3", "hierspec") and v["best_tree"] > 0 for v in sw["verdicts"])
    assert "| scale | best EAGLE-3 |" in (tmp_path / "whatif.md").read_text()
    assert "best EAGLE-3 (tree size)" in summary_markdown(sw)
    assert any(t.name == "best EAGLE-3" for t in sweep_figure(sw).data)


@pytest.mark.parametrize("args, msg", [
    (FAST + ["--methods", "ar,bogus"], "unknown method"),
    (FAST + ["--acceptance-rates", "0.5,1.5"], "between 0 and 1"),
    (FAST + ["--acceptance-rates", "a,b"], "comma-separated numbers"),
    (FAST + ["--acceptance", "/nonexistent/trace.json"], "cannot read acceptance trace"),
    (FAST + ["--acceptance", str(ROOT / "assets/traces/h200-smollm2-python-tips.json"), "--acceptance-rates", "0.5"],
     "not both"),
    (["--device", "cpu", "--target", "llama3-70b"], "too big for a CPU run"),
    (["--device", "cpu", "--target", "no-such-shape"], "unknown shape"),
    (FAST + ["--t-tree-size", "0"], "tree size"),
    (FAST + ["--draft-vocab", "0"], "--draft-vocab"),
    (FAST + ["--repeat", "0"], "--repeat"),
    (FAST + ["--sweep", "--sweep-scales", "x", "--max-new-tokens", "4"], "--sweep-scales"),
    (FAST + ["--sweep", "--sweep-tree-sizes", "0"], "--sweep-tree-sizes"),
    (FAST + ["--sweep", "--acceptance", str(ROOT / "assets/traces/h200-smollm2-python-tips.json")], "--sweep"),
    (FAST + ["--head", "eagle2", "--methods", "ar,eagle3"], "method eagle3 drafts with EAGLE-3 heads: it needs --head eagle3"),
    (FAST + ["--head", "eagle2", "--methods", "ar,hierspec_eagle3"], "is a row of the run without --head"),
    (FAST + ["--exact", "--methods", "ar,hierspec_eagle3"], "is a row of the run without --head"),
    (FAST + ["--eagle3-acceptance", "/nonexistent/record.json"], "--eagle3-acceptance"),
    (FAST + ["--head", "eagle3", "--methods", "eagle2,hierspec"], "method eagle2 drafts with EAGLE-2 heads: it needs --head eagle2"),
    (FAST + ["--head", "eagle3", "--draft-vocab", "513"], "--draft-vocab must be between 1 and the vocabulary size 512"),
    (FAST + ["--head", "eagle3", "--exact", "--methods", "ar,eagle2"], "it needs --head eagle2"),
    (FAST + ["--intermediate-lm-head", "w8a8-int8", "--draft-vocab", "300"], "E_M's --draft-vocab rows of it a dense or W4 one"),
])
def test_bad_arguments(args: list[str], msg: str, tmp_path: Path, capsys) -> None:
    assert main(args + ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_trace_without_the_method(engine_trace: Path, tmp_path: Path, capsys) -> None:
    assert main(FAST + ["--acceptance", str(engine_trace), "--methods", "spec", "--out", str(tmp_path)]) == 2
    assert "no run of spec" in capsys.readouterr().err


@pytest.mark.slow
def test_synthetic_weights_stay_finite_at_wide_shapes_in_fp16() -> None:
    """Synthetic W4 layers of a wide (70B-like hidden 8192 / MLP 28672) shape kept finite in
    fp16: over-scaled weights overflowed by layer 2 and silently flattened EAGLE-2's trees.
    Slow on a CPU (~40 s: fp16 dequantization of 0.7e9 weights); every what-if run also refuses
    a synthetic model whose logits are not finite (whatif._check_finite, tested below)."""
    from hierviz.models.config import ModelConfig
    from hierviz.models.synthetic import synthetic_model
    cfg = ModelConfig(vocab_size=256, hidden_size=8192, intermediate_size=28672, num_layers=2, num_heads=64,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=64)
    m = synthetic_model(cfg, "w4", torch.float16, "cpu", "reference", 0)
    toks = torch.arange(6)
    with torch.no_grad():
        logits = m.logits(m(toks, torch.arange(6)))
    assert torch.isfinite(logits).all()


def test_non_finite_synthetic_model_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    import hierviz.measure.whatif as w
    real = w.synthetic_model

    def broken(cfg, fmt, *args, **kw):
        m = real(cfg, fmt, *args, **kw)
        if fmt == "w4a16":      # the target (--target-format's default, by its name)
            m.norm.weight.data.fill_(float("nan"))
        return m
    monkeypatch.setattr(w, "synthetic_model", broken)
    assert main(FAST + ["--out", str(tmp_path)]) == 2
    assert "non-finite" in capsys.readouterr().err


def test_command_is_recorded(tmp_path: Path, monkeypatch) -> None:
    """The JSON records the command line, led by the settings in the environment that change what
    ran (here the W4 kernel choice), so running it again runs the same thing."""
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "target")
    monkeypatch.setenv("HIERVIZ_QUEUE_SIZE", "5")           # an app setting: not part of a measurement
    args = FAST + ["--max-new-tokens", "8", "--sweep", "--sweep-scales", "1.0", "--sweep-min-draft", "4",
                   "--sweep-tree-sizes", "8", "--out", str(tmp_path)]
    assert main(args) == 0
    for name in ("whatif.json", "sweep.json"):
        cmd = json.loads((tmp_path / name).read_text())["command"]
        assert cmd.startswith("HIERVIZ_W4_CUDA=target python -m hierviz whatif --tiny") and "--sweep" in cmd
        assert "QUEUE" not in cmd


def test_repeat_reports_the_median_run(tmp_path: Path) -> None:
    assert main(FAST + ["--methods", "ar,hierspec", "--max-new-tokens", "8", "--repeat", "3", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    assert info["repeat"] == 3
    for m in ("ar", "hierspec"):
        r = info["methods"][m]
        assert len(r["decode_s_runs"]) == 3
        assert r["decode_s"] == sorted(r["decode_s_runs"])[1]
    assert info["speedup_vs_ar"]["hierspec"] == pytest.approx(
        info["methods"]["hierspec"]["tokens_per_s"] / info["methods"]["ar"]["tokens_per_s"])
    sweep_out = tmp_path / "sweep"
    assert main(FAST + ["--sweep", "--sweep-scales", "1.0", "--sweep-tree-sizes", "8", "--sweep-min-draft", "4",
                        "--max-new-tokens", "6", "--repeat", "2", "--out", str(sweep_out)]) == 0
    assert json.loads((sweep_out / "sweep.json").read_text())["verdicts"][0]["winner"] in ("eagle2", "hierspec")


@pytest.mark.parametrize("static", [False, True])
def test_exact_mode_matches_ar_with_real_acceptance(tmp_path, monkeypatch, static) -> None:
    """`whatif --exact` at tiny shapes: every method equals AR with the drafts as drawn and seeded
    from AR's continuation (deep acceptance, and rejections where every 5th position is wrong);
    a decoder whose output differs makes the command fail. static: through the static-shape
    runners the GPU uses (their outputs are copies, which the steering must still find)."""
    import json as _json

    from hierviz.measure import whatif, whatif_exact
    from hierviz.models import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_force", static)     # force_static, restored after the test
    args = ["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "40",
            "--methods", "ar,spec,eagle2,hierspec", "--exact-trees", "paper", "--exact-miss-every", "5",
            "--out", str(tmp_path / "ok")]
    assert whatif.main(args) == 0
    info = _json.loads((tmp_path / "ok" / "whatif_exact.json").read_text())
    runs = {(r["method"], r["seeded"], r["miss_every"]): r for r in info["runs"]}
    assert len(runs) == 9 and all(r["identical"] and r["tokens"] == 40 for r in runs.values())
    for m in ("eagle2", "hierspec"):
        exact, partial = runs[(m, True, 0)], runs[(m, True, 5)]
        # seeded: whole trees accepted (but for the last rounds, which draft past AR's 40 tokens)
        assert exact["trees_n"] > 0 and exact["full_depth_trees"] >= 0.75 * exact["trees_n"]
        assert 0 < partial["full_depth_trees"] < partial["trees_n"]      # some rejected partway
        assert exact["tokens_per_round"] > 3 and runs[(m, False, 0)]["tokens_per_round"] < 1.2
    assert runs[("spec", True, 0)]["target_accepted"] > runs[("spec", True, 5)]["target_accepted"] > 0
    real = whatif_exact.decode

    def off_by_one(models, method, s, prompt):
        tokens, steps = real(models, method, s, prompt)
        if method == "hierspec" and tokens:
            tokens = tokens[:-1] + [(tokens[-1] + 1) % models.target.cfg.vocab_size]
        return tokens, steps
    monkeypatch.setattr(whatif_exact, "decode", off_by_one)
    # the same command with the methods the broken decoder touches (AR is the reference)
    bad_args = args[:-1] + [str(tmp_path / "bad")]
    bad_args[bad_args.index("--methods") + 1] = "ar,hierspec"
    assert whatif.main(bad_args) == 1
    bad = _json.loads((tmp_path / "bad" / "whatif_exact.json").read_text())
    assert [r["first_difference"] for r in bad["runs"] if not r["identical"]] == [39, 39, 39]
    assert {r["method"] for r in bad["runs"] if not r["identical"]} == {"hierspec"}


def test_exact_mode_fails_on_a_steering_miss(tmp_path, monkeypatch) -> None:
    """Seeded drafts that the steering does not reach accept nothing: the outputs still equal
    AR's, but the command must fail and name the miss instead of passing."""
    import json as _json

    from hierviz.measure import whatif, whatif_exact
    monkeypatch.setattr(whatif_exact, "_boost", lambda logits, succ: logits)
    args = ["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "24",
            "--methods", "ar,eagle2", "--exact-trees", "paper", "--exact-variants", "seeded", "--out", str(tmp_path)]
    assert whatif.main(args) == 1
    info = _json.loads((tmp_path / "whatif_exact.json").read_text())
    assert info["identical"] and info["steering_misses"] == 1
    assert info["runs"][0]["steering_miss"] == "no tree node accepted"
    assert "steering miss" in (tmp_path / "whatif_exact.md").read_text()


def test_exact_steering_follows_the_table_after_it_changes() -> None:
    """A CUDA graph's replays call no forward, so a copy of a replayed output can only be matched
    against an output recorded before, perhaps while the table was cleared (the run with drafts
    as drawn): the successors must come from the table as it is now, by the recorded positions."""
    from hierviz.measure.whatif_exact import SuccessorTable, _Registry
    reg = _Registry(SuccessorTable(16, torch.device("cpu")))
    out = torch.randn(4, 8)
    reg.record(torch.arange(3, 7), 2, out)                  # recorded while the table is cleared
    assert reg.successors(out[1:3].clone()).tolist() == [-1, -1]
    reg.table.fill(list(range(100, 116)), vocab=200, start=0)
    assert reg.successors(out[1:3].clone()).tolist() == [106, 107]    # rows at 4, 5 predict 6, 7
    assert reg.successors(out[2:]).tolist() == [107, 108]             # a view: found by its pointer
    assert reg.successors(torch.randn(2, 8)) is None


def test_eagle3_heads_are_timed_and_recorded(tmp_path: Path) -> None:
    """--head eagle3: E_M and E_T are EAGLE-3 heads (fc over layer features, a d2t draft vocabulary
    with --draft-vocab), the eagle3 method runs T's tree with them and HierSpec drafts with the
    EAGLE-3 E_M; the output names the head type. Sharpened like the EAGLE-2 heads: at rate 1
    every tree is accepted to its full depth."""
    assert main(FAST + ["--head", "eagle3", "--draft-vocab", "300", "--max-new-tokens", "12", "--acceptance-rates",
                        "1.0", "--seq-rate", "1.0", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    assert info["head"] == "eagle3" and info["formats"]["heads"] == "EAGLE-3, synthetic"
    assert list(info["methods"]) == ["ar", "eagle3", "hierspec"]            # the default methods for the head
    assert info["draft_vocab"] == 300 and info["hierspec_vs_eagle3"] > 0 and info["draft_vocabs"] == {"eagle3": 300}
    assert info["feature_layers"] == {"target": [0, 2, 3], "intermediate": [0, 1]}   # tiny bases: distinct layers
    e3 = info["methods"]["eagle3"]
    assert e3["forwards"]["e_t3"] > 0 and e3["stages_ms"]["draft"] > 0
    assert all(r["trees"] == [info["settings"]["t_depth"]] for r in e3["accepted"])
    assert all(n == info["settings"]["m_depth"] for r in info["methods"]["hierspec"]["accepted"] for n in r["trees"])
    assert "EAGLE-3 draft heads" in (tmp_path / "whatif.md").read_text()


@pytest.mark.parametrize("static", [False, True])
def test_exact_mode_with_eagle3_heads(tmp_path: Path, monkeypatch, static: bool) -> None:
    """--exact --head eagle3: eagle3 and HierSpec (EAGLE-3 E_M) equal AR in every variant, and the
    seeded runs are steered through the EAGLE-3 heads (trees accepted, > 2 tokens per round).
    static: through the static-shape runners the GPU uses (outputs handed out as copies)."""
    from hierviz.models import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "_force", static)     # force_static, restored after the test
    assert main(["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--head", "eagle3", "--max-new-tokens", "32",
                 "--methods", "ar,eagle3,hierspec", "--exact-trees", "paper", "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif_exact.json").read_text())
    assert info["head"] == "eagle3" and info["passed"]
    assert info["ar_tokens_outside_draft_vocab"] == {"e_m": 0, "e_t3": 0}          # the full draft vocabulary
    runs = {(r["method"], r["seeded"], r["miss_every"]): r for r in info["runs"]}
    assert len(runs) == 6 and all(r["identical"] and r["tokens"] == 32 for r in runs.values())
    for m in ("eagle3", "hierspec"):
        assert runs[(m, True, 0)]["accepted_tree_nodes"] > 0 and runs[(m, True, 0)]["tokens_per_round"] > 2
        assert runs[(m, True, 7)]["accepted_tree_nodes"] > 0
        assert runs[(m, False, 0)]["tokens_per_round"] < 1.2               # the drafts as drawn: random heads


@pytest.mark.parametrize("head, steered", [("eagle3", True), ("eagle3", False), ("eagle2", True)])
def test_exact_steering_with_a_reduced_draft_vocabulary(tmp_path, monkeypatch, head, steered) -> None:
    """Heads drafting over 256 of 512 tokens (EAGLE-3: d2t; EAGLE-2: FR-Spec rows) cannot draft half
    of AR's tokens: the boost goes to a successor's draft index, trees cut by an undraftable token
    are counted, and the steering-miss check leaves them out: T's tree method makes under 2 tokens
    per round overall yet passes. Without the boost the same run still fails as a steering miss."""
    from hierviz.measure import whatif_exact
    if not steered:
        monkeypatch.setattr(whatif_exact, "_boost", lambda logits, succ: logits)
    args = ["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--head", head, "--draft-vocab", "256",
            "--max-new-tokens", "40", "--methods", f"ar,{head},hierspec", "--exact-trees", "paper",
            "--exact-variants", "seeded", "--out", str(tmp_path)]
    assert main(args) == (0 if steered else 1)
    info = json.loads((tmp_path / "whatif_exact.json").read_text())
    assert info["identical"] and info["draft_vocab"] == 256
    assert len(info["ar_tokens_outside_draft_vocab"]) == 2 and all(n > 0 for n in info["ar_tokens_outside_draft_vocab"].values())
    runs = {r["method"]: r for r in info["runs"]}
    if steered:
        assert not info["steering_misses"]
        assert all(r["undraftable_trees"] > 0 and r["accepted_tree_nodes"] > 0 for r in runs.values())
        assert runs[head]["tokens_per_round"] <= 2 and runs["hierspec"]["tokens_per_round"] > 2
    else:
        assert all(r["steering_miss"] for r in runs.values())


DATA = ROOT / "tests" / "data" / "acceptance"


def test_constant_rate_gives_the_mean():
    from hierviz.measure.whatif_acceptance import constant_rate
    r = constant_rate(2.0, 5)
    assert sum(r ** k for k in range(1, 6)) == pytest.approx(2.0, abs=1e-9)
    assert constant_rate(0.0, 4) == 0.0 and constant_rate(9.0, 4) == 1.0


def test_whatif_replays_an_imported_vllm_scrape(tmp_path: Path) -> None:
    """--acceptance-import: a vLLM /metrics scrape's per-position rates drive the run, and the
    outputs say where they came from."""
    from hierviz.measure.acceptance_import import load_acceptance
    from hierviz.viz.whatif_fig import acceptance_label
    imp = load_acceptance(DATA / "vllm_metrics.prom")
    assert main(FAST + ["--acceptance-import", str(DATA / "vllm_metrics.prom"), "--max-new-tokens", "10",
                        "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    acc = info["acceptance"]
    assert acc["rates"] == pytest.approx(imp.rates, abs=1e-6)
    assert acc["imported"]["format"] == "vllm-prometheus" and acc["imported"]["steps"] == imp.steps
    assert acceptance_label(info).startswith("imported from vllm-prometheus file vllm_metrics.prom")


def test_whatif_takes_a_cascade_import_per_level_and_sweeps_it(tmp_path: Path) -> None:
    """SpecMQuant's two levels: the intermediate's rates for E_M trees, the sequence level's mean
    as the sequence rate; --sweep scales the imported rates."""
    from hierviz.measure.acceptance_import import load_acceptance
    from hierviz.measure.whatif_acceptance import constant_rate
    imp = load_acceptance(DATA / "specmquant_answers.jsonl")
    assert main(FAST + ["--acceptance-import", str(DATA / "specmquant_answers.jsonl"), "--sweep", "--sweep-scales",
                        "0.5,1.0", "--sweep-tree-sizes", "12", "--sweep-min-draft", "4", "--max-new-tokens", "8",
                        "--out", str(tmp_path)]) == 0
    info = json.loads((tmp_path / "whatif.json").read_text())
    acc = info["acceptance"]
    assert acc["m_rates"] == pytest.approx(imp.levels["intermediate"].rates, abs=1e-6)
    seq = imp.levels["sequence"]
    assert acc["seq_rate"] == pytest.approx(constant_rate(seq.mean_accepted_length, seq.draft_length), abs=1e-9)
    assert any("sequence level" in w for w in acc["imported"]["warnings"])
    sw = json.loads((tmp_path / "sweep.json").read_text())
    assert sw["acceptance"]["imported"]["format"] == "specmquant-jsonl" and len(sw["verdicts"]) == 2


@pytest.mark.parametrize("extra, msg", [
    (["--acceptance-rates", "0.5"], "one source of acceptance"),
    (["--acceptance-format", "sglang-meta-info"], "--acceptance-import"),
])
def test_imported_acceptance_errors_are_clear(tmp_path: Path, capsys, extra, msg) -> None:
    assert main(FAST + ["--acceptance-import", str(DATA / "vllm_metrics.prom"), *extra, "--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err


def test_a_missing_import_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(FAST + ["--acceptance-import", str(tmp_path / "none.prom"), "--out", str(tmp_path)]) == 2
    assert "none.prom" in capsys.readouterr().err


def test_the_w4_kernel_choice_weighs_the_rows_the_run_multiplies(tmp_path: Path, monkeypatch) -> None:
    """Each W4 weight's kernel is chosen over the rows its model's forwards run in this what-if: the
    methods' rounds under its settings (and any sweep's) and the prompt's prefill."""
    from hierviz import methods
    from hierviz.quant import w4_choice
    seen = {}

    def capture(models, device, timer=None, log=None, workload=None):
        target, inter = models[:2]          # then the heads, without a workload of their own
        assert not set(models[2:]) & set(workload)
        seen.clear()
        seen.update({role: set(workload[model]) for role, model in (("target", target), ("intermediate", inter))
                     if model in workload})
        return {}
    monkeypatch.setattr(w4_choice, "choose_for_models", capture)
    assert main(FAST + ["--methods", "ar,eagle2,hierspec", "--max-new-tokens", "4", "--prompt-len", "16",
                        "--trees", "paper", "--out", str(tmp_path)]) == 0
    # the rows as run, and as the static runners pad them (9-10 rows run the 16-row bucket, 30-31 the 32)
    assert seen == {"target": {1, 24, 7, 8, 9, 10, 16}, "intermediate": {30, 31, 32, 16}}
    assert main(FAST + ["--methods", "eagle2", "--max-new-tokens", "4", "--prompt-len", "5", "--t-depth", "3",
                        "--t-topk", "10", "--t-tree-size", "16", "--out", str(tmp_path / "t17")]) == 0
    assert seen["target"] == {17, 24, 5, 8}       # a 16-node tree's 17 rows run the 24-row bucket
    assert "| 1.00x |" in (tmp_path / "whatif.md").read_text()
    # without an AR row there is no speedup to show: said so, not "nanx"
    assert main(FAST + ["--methods", "eagle2,hierspec", "--max-new-tokens", "4", "--out", str(tmp_path / "no-ar")]) == 0
    md = (tmp_path / "no-ar" / "whatif.md").read_text()
    assert "| no AR row |" in md and "nan" not in md
    s = DecodeSettings(t_tree_size=11)
    assert methods.workload_rows(["eagle2"], [s, DecodeSettings(t_tree_size=30)], 5) == {"target": {12, 31, 5}}


def test_the_heads_leave_their_base_models_weights_to_the_base_models_rows(monkeypatch) -> None:
    """A draft head holds its base model as a part, so the base's W4 weights are the head's too; the
    kernel choice still decides a verifier's kind over the rows of the base's forwards (a head
    without a workload of its own must not make every row count decide it), and the head's own W4
    weights (FR-Spec rows of M's W4 head) decide at every count."""
    from hierviz.measure.whatif import build_models, tiny_config
    from hierviz.quant import w4_choice, w4_proof
    # the weights the choice covers, on this CPU: every Triton-kernel W4 weight (no CUDA filter)
    monkeypatch.setattr(w4_choice, "choice_weights", w4_proof.triton_weights)
    monkeypatch.setattr(w4_choice, "choose_for_models", lambda *a, **k: {})       # build_models' own call
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "triton", m_format="w4a16",
                          m_lm_head="w4a16", draft_vocab=320)
    head_rows = next(iter(w4_choice.weights_by_kind([models.e_m._draft_head])))
    assert set(w4_choice.kinds_of([models.target])) <= set(w4_choice.kinds_of([models.e_t]))    # the head holds T's
    workload = {models.target: {1, 24}, models.intermediate: {30, 31}}
    rows = w4_choice._kind_rows(models.present(), workload)
    assert all(rows[k] == [1, 24] for k in w4_choice.kinds_of([models.target]))
    assert all(rows[k] == [32] for k in w4_choice.kinds_of([models.intermediate]))
    assert rows[head_rows] is None


def test_the_intermediate_predicts_over_the_draft_vocabulary_when_asked(tmp_path: Path, monkeypatch, capsys) -> None:
    """--intermediate-draft-vocab (a stack's `intermediate_draft_vocab`): M's logits cover only the
    --draft-vocab ids, through W4 rows of its W4 head that the kernel choice sees; the record says
    so; every method's output still equals AR's; without --draft-vocab it is refused before any
    model is built."""
    from hierviz.measure import whatif
    from hierviz.quant import w4_choice
    chosen_over = []
    monkeypatch.setattr(w4_choice, "choose_for_models", lambda models, device, **kw: chosen_over.extend(models) or {})
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference",
                          m_lm_head="w4a16", draft_vocab=300, intermediate_draft_vocab=True)
    m = models.intermediate
    assert m.output_vocab.tolist() == list(range(300)) and m._vocab_rows.w4[0].out_features == 300
    logits = m.logits(torch.randn(3, m.cfg.hidden_size))
    assert torch.isfinite(logits[:, :300]).all() and torch.isneginf(logits[:, 300:]).all()
    assert any(mod is m._vocab_rows for ms in chosen_over for mod in ms.modules())
    assert models.target.output_vocab is None            # the verifier keeps its whole vocabulary
    monkeypatch.undo()
    args = FAST + ["--methods", "hierspec,eagle2", "--max-new-tokens", "8", "--draft-vocab", "300",
                   "--intermediate-draft-vocab", "--out", str(tmp_path / "rates")]
    assert whatif.main(args) == 0
    info = json.loads((tmp_path / "rates" / "whatif.json").read_text())
    assert info["intermediate_vocab"] == "draft" and info["formats"]["intermediate"].endswith(", 300 output ids")
    assert whatif.main(["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "24",
                        "--methods", "ar,hierspec", "--draft-vocab", "300", "--intermediate-draft-vocab",
                        "--exact-variants", "drawn", "--out", str(tmp_path / "exact")]) == 0
    runs = json.loads((tmp_path / "exact" / "whatif_exact.json").read_text())["runs"]
    assert runs and all(r["identical"] for r in runs)
    capsys.readouterr()
    assert whatif.main(FAST + ["--intermediate-draft-vocab", "--out", str(tmp_path / "refused")]) == 2
    assert "give --draft-vocab too" in capsys.readouterr().err
    with pytest.raises(MeasureError, match="give --draft-vocab too"):
        build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference", intermediate_draft_vocab=True)


def test_eagle3_heads_draft_over_their_published_vocabulary_by_default() -> None:
    """An EAGLE-3 head drafts over the vocabulary its published checkpoints keep (32,000 of
    LLaMA-3's 128,256 tokens) unless --draft-vocab says otherwise; EAGLE-2 heads over the full one;
    a vocabulary no larger than the published one stays whole."""
    from hierviz.measure.whatif import draft_vocabs, head_draft_vocab
    assert head_draft_vocab("eagle3", 128256) == 32000 and head_draft_vocab("eagle2", 128256) is None
    assert head_draft_vocab("eagle3", 128256, 8000) == 8000 and head_draft_vocab("eagle3", 259) is None
    assert draft_vocabs(["eagle2", "eagle3"], 128256) == {"eagle2": 128256, "eagle3": 32000}
    from hierviz.viz.whatif_fig import shapes_label
    d = {"shapes": {"target": "llama3-70b", "intermediate": "llama3-8b"}, "configs": {"target": {"vocab_size": 128256}},
         "draft_vocab": 128256, "draft_vocabs": {"eagle2": 128256, "eagle3": 32000}}
    assert shapes_label(d).endswith(", EAGLE-3 heads draft over 32000 tokens (as published)")
    assert "FR-Spec" in shapes_label({**d, "draft_vocab": 16000}) and "published" not in shapes_label({**d, "draft_vocab": 16000})
    import dataclasses
    from hierviz.measure.whatif import sharp_eagle2_head, sharp_eagle3_head, tiny_config
    from hierviz.models.synthetic import synthetic_model
    base = synthetic_model(dataclasses.replace(tiny_config(False), vocab_size=40000), "dense", torch.float32, "cpu",
                           "reference", 0)
    assert sharp_eagle3_head(base, 1).draft_vocab_size == 32000
    assert sharp_eagle3_head(base, 2, 1000).draft_vocab_size == 1000
    assert sharp_eagle2_head(base, 3).draft_vocab is None


def test_a_quantized_intermediate_lm_head_drafts_through_the_format_and_keeps_the_output(tmp_path: Path, monkeypatch) -> None:
    """--intermediate-lm-head w4: M's LM head (which E_M drafts through) is a W4 weight, T's stays
    dense; the record and the title say so; every method's output still equals AR's (--exact), as
    only drafts go through it, also with E_M over FR-Spec rows of it; a tied LM head is refused with
    a clear error."""
    import dataclasses

    from hierviz.measure import whatif
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference", m_lm_head="w4a16")
    assert models.intermediate.lm_head.q is not None and models.target.lm_head.q is None
    assert models.e_m.base is models.intermediate
    args = FAST + ["--intermediate-format", "w4", "--intermediate-lm-head", "w4", "--methods", "hierspec,eagle2",
                   "--max-new-tokens", "8", "--out", str(tmp_path / "rates")]
    assert whatif.main(args) == 0
    info = json.loads((tmp_path / "rates" / "whatif.json").read_text())
    assert info["formats"]["intermediate"].endswith(", LM head W4A16") and info["intermediate_lm_head"] == "w4a16"
    assert "(W4A16, LM head W4A16)" in (tmp_path / "rates" / "whatif.md").read_text().splitlines()[0]
    assert whatif.main(["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "24",
                        "--methods", "ar,hierspec", "--intermediate-lm-head", "w4", "--out", str(tmp_path / "exact")]) == 0
    runs = json.loads((tmp_path / "exact" / "whatif_exact.json").read_text())["runs"]
    assert runs and all(r["identical"] for r in runs)
    # with FR-Spec rows: E_M drafts through a Linear of the W4 head's rows
    from hierviz.quant import w4_choice
    chosen_over = []
    with monkeypatch.context() as patched:
        patched.setattr(w4_choice, "choose_for_models", lambda models, device, **kw: chosen_over.extend(models) or {})
        models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference",
                              m_lm_head="w4a16", draft_vocab=300)
    assert models.e_m._draft_head.w4 and models.e_m._draft_head.w4[0].out_features == 300
    # the kernel choice (and its timing on a GPU) sees those rows: a W4 kind of their own
    assert any(mod is models.e_m._draft_head for m in chosen_over for mod in m.modules())
    assert whatif.main(["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "24", "--methods",
                        "ar,hierspec", "--intermediate-lm-head", "w4", "--draft-vocab", "300",
                        "--out", str(tmp_path / "exact-rows")]) == 0
    runs = json.loads((tmp_path / "exact-rows" / "whatif_exact.json").read_text())["runs"]
    assert runs and all(r["identical"] for r in runs)
    tied = dataclasses.replace(tiny_config(False), tie_embeddings=True)
    with pytest.raises(MeasureError, match="needs an untied LM head"):
        build_models(tiny_config(True), tied, "cpu", torch.float32, "reference", m_lm_head="w4a16")


def test_heads_in_w4_draft_through_the_format_and_keep_the_output(tmp_path: Path) -> None:
    """--head-format w4: every head's linears (fc, its decoder layer, an EAGLE-3 head's own LM head)
    are W4 weights run by the run's W4 kernel, T's and M's weights unchanged, the default heads dense;
    the record, the heads' words and the title say so; every method's output still equals AR's
    (--exact), EAGLE-2 and EAGLE-3 heads alike, as heads only draft."""
    from hierviz.measure import whatif
    dense = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference")
    models = build_models(tiny_config(True), tiny_config(False), "cpu", torch.float32, "reference", head_format="w4a16")
    for head in (models.e_m, models.e_t, models.e_t3):
        assert head.fc.q is not None and head.layer.qkv.q is not None and head.layer.down.q is not None
    assert models.e_t3.lm_head.q is not None and models.e_t3.lm_head.w4_kernel == "reference"
    assert all(h.fc.q is None and h.layer.gate_up.q is None for h in (dense.e_m, dense.e_t, dense.e_t3))
    assert [type(m.layers[0].qkv.q) for m in (models.target, models.intermediate)] == \
        [type(m.layers[0].qkv.q) for m in (dense.target, dense.intermediate)]
    variant = whatif.variant_models(models, "hierspec_eagle3", 0, None, "w4a16", "reference")
    assert variant.e_m.head_type == "eagle3" and variant.e_m.layer.o.q is not None
    assert whatif.main(FAST + ["--head-format", "w4", "--methods", "hierspec,eagle2,hierspec_eagle3",
                               "--max-new-tokens", "8", "--out", str(tmp_path / "rates")]) == 0
    info = json.loads((tmp_path / "rates" / "whatif.json").read_text())
    assert info["head_format"] == "w4a16" and info["formats"]["heads"].endswith(", linears W4A16")
    assert ", heads W4A16 on " in (tmp_path / "rates" / "whatif.md").read_text().splitlines()[0]
    for head in ("eagle2", "eagle3"):
        out = tmp_path / f"exact-{head}"
        assert whatif.main(["--exact", "--tiny", "--device", "cpu", "--threads", "1", "--max-new-tokens", "24",
                            "--methods", f"ar,{head},hierspec", "--head", head, "--head-format", "w4",
                            "--out", str(out)]) == 0
        runs = json.loads((out / "whatif_exact.json").read_text())["runs"]
        assert runs and all(r["identical"] for r in runs), head
