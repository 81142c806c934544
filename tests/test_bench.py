"""`python -m hierviz bench` writes a well-formed summary on a tiny stack."""
from __future__ import annotations

import json
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from hierviz.measure.bench import BenchError, main, read_questions

QUESTIONS = os.path.join(os.path.dirname(__file__), "..", "assets", "data", "spec_bench_question.jsonl")


@pytest.fixture()
def questions(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "again"]},
        {"question_id": 2, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"question_id": 3, "category": "qa", "turns": ["What is 2+2?"]}]) + "\n")
    return p


def test_bench_summary_is_well_formed(questions, tmp_path, monkeypatch):
    import hierviz.engine as engine
    timed: dict[str, list[Any]] = {}
    real = engine.generate

    def keep(stack: Any, m: str, prompt: str, s: Any) -> Any:
        tr = real(stack, m, prompt, s)
        if prompt != engine.WARMUP_PROMPT:
            timed.setdefault(m, []).append(tr)
        return tr
    monkeypatch.setattr(engine, "generate", keep)
    out = tmp_path / "out"
    rc = main(["--questions", str(questions), "--stack", "tiny-random", "--max-new-tokens", "8",
               "--methods", "ar,eagle2,hierspec", "--out", str(out), "--m-topk", "4", "--t-topk", "4",
               "--m-tree-size", "8", "--t-tree-size", "12"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["methods"]) == {"ar", "eagle2", "hierspec"}
    for name, m in s["methods"].items():
        for key in ("tokens_per_s", "speedup_vs_ar", "tau_target", "tau_intermediate", "per_depth_acceptance",
                    "outputs_identical_to_ar", "per_category"):
            assert key in m, (name, key)
        assert m["outputs_identical_to_ar"] is True and m["identical_questions"] == m["questions"] == 3
        assert set(m["per_category"]) == {"writing", "qa"}
    assert s["methods"]["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert s["machine"]["cpu_matmul"]["forms"]          # which product forms the CPU run chose
    # tau recomputed from what each run did: T runs once per step (the Spec-Bench answers count the
    # steps), and every tree M verified put its accepted path plus M's bonus into the sequence
    for name, m in s["methods"].items():
        answers = [json.loads(line)["choices"][0] for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert m["tau_target"] == pytest.approx(sum(a["new_tokens"][0] for a in answers) /
                                                sum(a["decoding_steps"][0] for a in answers), rel=1e-12)
    assert s["methods"]["ar"]["tau_target"] == 1.0
    runs = timed["hierspec"]
    assert len(runs) == 3
    trees = sum(len(st.trees) for t in runs for st in t.steps)
    assert trees > 0 and s["methods"]["hierspec"]["tau_intermediate"] == pytest.approx(
        sum(len(st.sequence) for t in runs for st in t.steps) / trees, rel=1e-12)
    assert s["methods"]["ar"]["tau_intermediate"] is None and s["methods"]["eagle2"]["tau_intermediate"] is None
    lines = (out / "hierspec.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["choices"][0]["new_tokens"][0] <= 8
    assert (out / "summary.md").read_text().startswith("| method") and "| yes |" in (out / "summary.md").read_text()
    assert "plotly" in (out / "chart.html").read_text()


@pytest.mark.parametrize("mode,untimed", [("short", 0), ("all", 3 * 2)])
def test_warmup_all_runs_every_question_untimed_first(questions, tmp_path, monkeypatch, mode, untimed):
    import hierviz.engine as engine
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda stack, m, prompt, s: calls.append((m, prompt)) or real(stack, m, prompt, s))
    monkeypatch.setattr(engine, "warm_up", lambda *a, **k: None)
    out = tmp_path / "out"
    assert main(["--questions", str(questions), "--stack", "tiny-random", "--max-new-tokens", "4",
                 "--methods", "ar,spec", "--out", str(out), "--warmup", mode]) == 0
    assert len(calls) == untimed + 3 * 2
    assert calls[:untimed] == calls[untimed:][:untimed]          # the same question / method pairs
    assert json.loads((out / "summary.json").read_text())["warmup"] == mode


def test_limit_is_per_category():
    qs = read_questions(QUESTIONS, limit=2)
    cats = {q["category"] for q in qs}
    assert len(cats) == 13 and len(qs) == 26


def test_bad_questions_file(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question_id": 1}\n')
    with pytest.raises(BenchError, match="not a Spec-Bench question line"):
        read_questions(p)
    assert main(["--questions", str(p), "--stack", "tiny-random", "--out", str(tmp_path / "o")]) == 2
    assert "error:" in capsys.readouterr().err


def test_warm_up_runs_each_method_once_per_tree_settings(monkeypatch):
    """bench and the app's live runs warm every method up before timing it, once per stack and
    tree settings (a longer run with the same trees has nothing left to warm)."""
    import dataclasses

    from hierviz import engine
    from hierviz.settings import DecodeSettings
    from hierviz.stack import tiny_random_stack
    stack = tiny_random_stack("cpu")
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda st, m, p, s: calls.append((m, s.max_new_tokens)) or real(st, m, p, s))
    s = DecodeSettings(max_new_tokens=20, m_tree_size=8, t_tree_size=8)
    methods = ["hierspec", "eagle2"]
    assert not engine.is_warm(stack, methods, s)
    engine.warm_up(stack, methods, s)
    assert calls == [("hierspec", 8), ("eagle2", 8)] and engine.is_warm(stack, methods, s)
    engine.warm_up(stack, methods, dataclasses.replace(s, max_new_tokens=40))
    assert len(calls) == 2
    engine.warm_up(stack, methods, dataclasses.replace(s, t_tree_size=12))
    assert calls[2:] == [("hierspec", 8), ("eagle2", 8)]


def test_agreement_report(questions, tmp_path):
    """`python -m hierviz.train.agreement`: M's top-1 agreement with T on T's own greedy answers,
    per category; T read back through one causal forward reproduces its decoded answer."""
    from hierviz.train import agreement
    out = tmp_path / "agr.json"
    assert agreement.main(["--questions", str(questions), "--stack", "tiny-random", "--max-new-tokens", "10",
                           "--draft-len", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["per_category"]) == {"writing", "qa"} and r["draft_len"] == 4
    assert r["overall"]["positions"] == sum(q["positions"] for q in r["questions"]) > 0
    assert all(q["target_consistent"] for q in r["questions"])
    assert 0 <= r["overall"]["top1_agreement"] <= 1 and 1 <= r["overall"]["tau_bound"] <= 5
    # the run-length bookkeeping behind tau_bound
    assert agreement.agreement_runs([True, True, False, True, True, True], 2) == [2, 1, 0, 2, 2, 1]
    with pytest.raises(SystemExit):
        agreement.main(["--questions", str(questions), "--draft-len", "0", "--out", str(out)])


def test_agreement_with_the_target_as_intermediate_is_total(questions):
    """With M = T every position agrees, and tau_bound is 1 + the capped run to the answer's end."""
    import dataclasses

    from hierviz.decoding.decoders import Models
    from hierviz.measure.bench import read_questions
    from hierviz.stack import tiny_random_stack
    from hierviz.train.agreement import measure
    stack = tiny_random_stack("cpu")
    stack = dataclasses.replace(stack, models=Models(stack.models.target, stack.models.target, **stack.models.heads))
    r = measure(stack, read_questions(questions), max_new_tokens=9, draft_len=3)
    for q in r["questions"]:
        n = q["positions"]
        assert q["top1_agreement"] == 1.0
        assert q["tau_bound"] == pytest.approx(1 + sum(min(n - i, 3) for i in range(n)) / n, abs=1e-3)


def test_identical_cell_counts_the_questions_that_differ():
    from hierviz.measure.bench import _identical_cell
    assert _identical_cell({"outputs_identical_to_ar": False, "identical_questions": 12, "questions": 13}) == "no (12/13)"
    assert _identical_cell({"outputs_identical_to_ar": True, "identical_questions": 13, "questions": 13}) == "yes"
    assert _identical_cell({}) == ""


def test_draft_sweep_command_runs(questions, capsys):
    """`python -m hierviz draft-sweep` (the CPU draft-length sweep in docs/benchmarks.md) stays runnable
    (through the command line's main, in this process)."""
    from hierviz.cli import main
    assert main(["draft-sweep", "--questions", str(questions), "--stack", "tiny-random", "--max-new-tokens", "4",
                 "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "tok/s" in line]
    assert len(lines) == 5 and lines[1].startswith("hierspec (defaults)")


def test_batch_invariance_command_runs(tmp_path, capsys):
    """`python -m hierviz batch-invariance` (the fp16 batch-invariance check in docs/gpu.md) runs on its CPU path:
    one token against itself is identical, and every layer-0 product and the LM head are reported
    (through the command line's main, in this process)."""
    import json

    from hierviz.cli import main
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["batch-invariance", "--shape", str(tmp_path / "config.json"), "--device", "cpu", "--dtype",
                 "float32", "--kernel", "reference", "--tokens", "1,3", "--prompt", "5", "--static"]) == 0
    out = capsys.readouterr().out
    assert "K=  1: first differing layer output None, max |logit diff| 0," in out
    assert "K=  3:" in out
    assert sum(line.startswith("layer 0 ") for line in out.splitlines()) == 4    # qkv, o, gate_up, down
    assert out.count("LM head M=") == 5
    assert out.count("static path, tree of 24") == 2 and out.count("static path, sequence of 6") == 2
