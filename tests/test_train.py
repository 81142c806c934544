"""The training commands (hierviz.train.*) run end to end on a tiny random model on CPU, and
the engine's loaders reproduce the training modules exactly (M via the GPTQ loader with shared
embeddings, heads via the SafeAILab loader)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the benchmark questions the training prompts must not overlap (shipped: assets/data/README.md)
QUESTIONS = [Path(__file__).resolve().parent.parent / "assets" / "data" / f for f in
             ("spec_bench_question.jsonl", "mt_bench_question.jsonl")]


def _tiny_target(folder: Path) -> Path:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0, rope_theta=50000.0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.3 if "embed" in n else 0.12)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from hierviz.train import data, distill, eagle_train
    d = tmp_path_factory.mktemp("train")
    target = _tiny_target(d / "target")
    qs = ["--questions", *map(str, QUESTIONS)]
    assert data.main(["--target", str(target), "--tokenizer", "byte", "--out", str(d / "data.pt"), "--num-prompts", "24",
                      "--max-new-tokens", "12", "--batch-size", "12", "--heldout-every", "4", "--device", "cpu",
                      "--draft-vocab", "64", "--draft-vocab-out", str(d / "draft_vocab.json"), *qs]) == 0
    assert distill.main(["--target", str(target), "--data", str(d / "data.pt"), "--out", str(d / "M"), "--layers", "2",
                         "--steps", "4", "--batch-tokens", "512", "--group-size", "32", "--calib-samples", "6",
                         "--top1-weight", "0.5", "--device", "cpu"]) == 0
    assert eagle_train.main(["--target", str(target), "--intermediate", str(d / "M"), "--data", str(d / "data.pt"),
                             "--out-t", str(d / "E_T"), "--out-m", str(d / "E_M"), "--steps", "4", "--batch-tokens",
                             "512", "--device", "cpu", "--report", str(d / "eagle.json")]) == 0
    assert eagle_train.main(["--head-type", "eagle3", "--target", str(target), "--intermediate", str(d / "M"),
                             "--data", str(d / "data.pt"), "--out-t", str(d / "E_T3"), "--out-m", str(d / "E_M3"),
                             "--draft-vocab", str(d / "draft_vocab.json"), "--draft-vocab-size", "48",
                             "--ttt-steps", "3", "--head-intermediate-size", "96", "--steps", "4",
                             "--batch-tokens", "512", "--device", "cpu", "--report", str(d / "eagle3.json")]) == 0
    return d


def test_data_file(trained):
    from hierviz.train.common import TokenData
    data = TokenData.load(trained / "data.pt")
    assert len(data) == 24 and data.indices("heldout") and data.indices("train")
    assert data.meta["response_tokens"] > 0
    assert data.meta["overlap_check"]["exact_matches"] == 0
    assert data.meta["overlap_check"]["prompts_sharing_an_ngram"] == 0
    vocab = json.loads((trained / "draft_vocab.json").read_text())
    assert len(vocab) == len(set(vocab)) <= 64 and 2 in vocab


def test_distill_report_names_the_loss(trained):
    """--top1-weight adds cross-entropy against T's argmax; the report says what was minimised."""
    rep = json.loads((trained / "M" / "train_report.json").read_text())
    assert rep["loss"] == "KL(T||M) + 0.5 x CE(M, argmax T)"
    assert rep["training"]["steps"] == 4 and rep["training"]["final_loss"] > 0


def test_intermediate_loads_in_engine_like_training(trained):
    from hierviz.models.llama import Transformer
    from hierviz.models.loading import load_weights
    from hierviz.quant.gptq import load_gptq_weights
    from hierviz.quant.w4 import W4Weight
    from hierviz.train.common import build_hf, load_base, with_shared_embeddings
    cfg, w, _ = load_weights(trained / "M")
    assert cfg.num_layers == 2 and "model.embed_tokens.weight" not in w
    assert isinstance(w["model.layers.0.mlp.down_proj.weight"], W4Weight)
    _, gw = load_gptq_weights(trained / "M")
    assert set(gw) == set(w)
    t_cfg, t_w = load_base(trained / "target")
    w["model.embed_tokens.weight"] = t_w["model.embed_tokens.weight"]        # what share_embeddings does
    engine = Transformer(cfg, w)
    m_cfg, m_w = load_base(trained / "M")
    hf = build_hf(m_cfg, with_shared_embeddings(m_w, t_w), torch.device("cpu")).eval()
    x = torch.randint(3, 259, (1, 20))
    with torch.no_grad():
        a = engine(x[0], torch.arange(20))
        b = hf.model(input_ids=x).last_hidden_state[0]
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
        assert torch.equal(engine.logits(a).argmax(-1), hf.lm_head(b).argmax(-1))
    rep = json.loads((trained / "M" / "train_report.json").read_text())
    assert set(rep["agreement_heldout_quantized"]) == {"greedy", "sampled"}


def test_heads_load_in_engine_like_training(trained):
    from safetensors.torch import load_file
    from hierviz.models.eagle import EagleHead, load_eagle_weights
    from hierviz.models.llama import Transformer
    from hierviz.models.loading import load_weights
    from hierviz.train.eagle_train import EagleTrainHead
    t_cfg_e, t_w_e, _ = load_weights(trained / "target")
    base = Transformer(t_cfg_e, t_w_e)
    for name in ("E_T", "E_M"):
        cfg, w = load_eagle_weights(trained / name)
        assert "embed_tokens.weight" not in w and "fc.bias" in w
        raw = json.loads((trained / name / "config.json").read_text())
        head_t = EagleTrainHead(raw)
        head_t.load_state_dict({k: v.float() for k, v in load_file(str(trained / name / "model.safetensors")).items()})
        engine_head = EagleHead(cfg, w, base)    # same base embedding for both sides of the check
        toks = torch.randint(3, 259, (12,))
        feats = torch.randn(12, 64)
        with torch.no_grad():
            a = engine_head(toks, feats, torch.arange(12), None)
            b = head_t(base.embed[toks][None], feats[None])[0]
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    rep = json.loads((trained / "eagle.json").read_text())
    assert set(rep["heads"]) == {"e_t", "e_m"}
    assert len(rep["heads"]["e_t"]["heldout_top1_by_depth"]["greedy"]) == 3


def test_training_continues_from_shipped_checkpoints(trained, tmp_path):
    """--init M_DIR starts a student from a saved M checkpoint (GPTQ codes dequantized) and --init-m
    starts E_M from a saved head: the weights copied are the checkpoint's, and both commands run."""
    from hierviz.train import distill, eagle_train
    from hierviz.train.common import build_hf, load_base
    t_cfg, t_w = load_base(trained / "target")
    student = build_hf(t_cfg, distill.student_weights(t_w, distill.pick_layers(4, 2)), torch.device("cpu"),
                       torch.float32, num_hidden_layers=2)
    key = "model.layers.1.mlp.up_proj.weight"
    assert not torch.equal(student.state_dict()[key], load_base(trained / "M")[1][key])
    distill.init_student(student, trained / "M", 2)
    assert torch.equal(student.state_dict()[key], load_base(trained / "M")[1][key].float())
    assert torch.equal(student.state_dict()["model.embed_tokens.weight"], t_w["model.embed_tokens.weight"])
    wrong = build_hf(t_cfg, distill.student_weights(t_w, distill.pick_layers(4, 3)), torch.device("cpu"),
                     torch.float32, num_hidden_layers=3)
    with pytest.raises(SystemExit, match="does not fit a 3-layer student"):
        distill.init_student(wrong, trained / "M", 3)
    with pytest.raises(SystemExit, match="no such file"):
        distill.init_student(student, tmp_path / "absent", 2)
    one = build_hf(t_cfg, distill.student_weights(t_w, [0]), torch.device("cpu"), torch.float32, num_hidden_layers=1)
    with pytest.raises(SystemExit, match="does not fit a 1-layer student"):   # M's second layer has no place
        distill.init_student(one, trained / "M", 1)

    head = eagle_train.EagleTrainHead(json.loads((trained / "E_M" / "config.json").read_text()))
    eagle_train.init_head(head, trained / "E_M")
    from safetensors.torch import load_file
    saved = load_file(str(trained / "E_M" / "model.safetensors"))
    assert all(torch.equal(v, saved[k].float()) for k, v in head.state_dict().items())
    with pytest.raises(SystemExit, match="cannot start a head"):
        eagle_train.init_head(head, trained / "M")           # not a head

    assert distill.main(["--target", str(trained / "target"), "--data", str(trained / "data.pt"), "--out",
                         str(tmp_path / "M2"), "--layers", "2", "--steps", "2", "--batch-tokens", "512",
                         "--group-size", "32", "--calib-samples", "4", "--init", str(trained / "M"),
                         "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "M2" / "train_report.json").read_text())["init"] == str(trained / "M")
    assert eagle_train.main(["--target", str(trained / "target"), "--intermediate", str(tmp_path / "M2"), "--data",
                             str(trained / "data.pt"), "--out-m", str(tmp_path / "E_M2"), "--init-m",
                             str(trained / "E_M"), "--steps", "2", "--batch-tokens", "512", "--device", "cpu",
                             "--report", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["init_m"] == str(trained / "E_M")


def test_derived_prompts_stage(tmp_path):
    """--derived: the target's own training answers become passages of long prompts, which the
    target then answers greedily; they land in the data with their own categories."""
    from hierviz.train import data
    from hierviz.train.common import TokenData
    from hierviz.train.prompts import DERIVED_TEMPLATES, derived_prompts
    target = _tiny_target(tmp_path / "target")
    qs = ["--questions", *map(str, QUESTIONS)]
    assert data.main(["--target", str(target), "--tokenizer", "byte", "--out", str(tmp_path / "d.pt"),
                      "--num-prompts", "12", "--max-new-tokens", "10", "--batch-size", "12", "--heldout-every", "4",
                      "--device", "cpu", "--derived", "6", "--derived-min-tokens", "4", *qs]) == 0
    d = TokenData.load(tmp_path / "d.pt")
    info = d.meta["derived"]
    assert info["built"] == 6 and len(d) == 12 + info["built"] - info["dropped_for_overlap"]
    assert all(k.startswith("derived-") for k in info["kinds"])
    assert sum(v for k, v in d.meta["categories"].items() if k.startswith("derived-")) == 6 - info["dropped_for_overlap"]
    # every kind of derived task embeds the passage
    ps = derived_prompts([f"passage number {i}." for i in range(len(DERIVED_TEMPLATES))], 0)
    assert len({c for c, _ in ps}) == len(DERIVED_TEMPLATES)
    assert all(f"passage number {i}." in p for i, (_, p) in enumerate(ps))


@pytest.fixture()
def warm_py(tmp_path):
    """The pipeline's PYTHON: its six commands run forked from one interpreter that imported torch
    and transformers once (tests/warm_python.py), not six fresh ones (~5 s of imports each)."""
    from tests.warm_python import warm_python
    root = Path(__file__).resolve().parents[1]
    preload = ["torch", "transformers", "transformers.models.llama.modeling_llama", "safetensors.torch"]
    with warm_python(preload, root, {**os.environ, "PYTHONPATH": str(root)}) as py:
        yield py


def test_pipeline_in_two_calls(tmp_path, warm_py):
    """The device pipeline split over two invocations (two device calls): the second reuses the
    exported target, the data and M that the first left in WORK_DIR, and trains only the heads."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    target = _tiny_target(tmp_path / "target")
    qfiles = " ".join(map(str, QUESTIONS))
    env = {**os.environ, "PYTHON": warm_py, "PYTHONPATH": str(root), "NUM_PROMPTS": "16", "MAX_NEW": "8",
           "GEN_BATCH": "8", "DISTILL_STEPS": "2", "EAGLE_STEPS": "2", "BATCH_TOKENS": "256", "LAYERS": "2",
           "GROUP": "32", "DRAFT_VOCAB": "64", "QUESTIONS": qfiles}
    script = root / "hierviz" / "train" / "gpu_pipeline.sh"
    work, out = tmp_path / "w", tmp_path / "out"
    # the second call also continues the distillation from the student the first one saved
    second = {"STAGES": "distill heads", "INIT": str(work / "M_float.safetensors"), "SEED": "3"}
    for extra, made in (({"STAGES": "data distill"}, "M.tar"), (second, "heads.tar")):
        p = subprocess.run(["bash", str(script), str(target), "byte", str(work), str(out)], cwd=root,
                           env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert (out / made).is_file()
        if extra["STAGES"] == "data distill":
            assert not (out / "heads.tar").exists()
            assert json.loads((out / "distill.json").read_text())["init"] is None
    log = (out / "log.txt").read_text()
    assert "stages: distill heads" in log and log.count("stages:") == 2
    assert json.loads((out / "distill.json").read_text())["init"] == second["INIT"]
    assert (work / "smollm2-m2-eagle" / "model.safetensors").is_file()
    # a third call trains EAGLE-3 heads on a given M (as for the shipped one)
    third = {"STAGES": "heads", "HEAD_TYPE": "eagle3", "TTT": "2", "DV_T": "24", "DV_M": "16", "HEAD_INTER": "64",
             "INTERMEDIATE": str(work / "smollm2-m2-gptq")}
    p = subprocess.run(["bash", str(script), str(target), "byte", str(work), str(out)], cwd=root,
                       env={**env, **third}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((out / "eagle.json").read_text())
    assert rep["head_type"] == "eagle3" and rep["intermediate"] == third["INTERMEDIATE"]
    for name, vocab in (("smollm2-eagle3-t", 24), ("smollm2-m2-eagle3", 16)):
        cfg = json.loads((work / name / "config.json").read_text())
        assert cfg["draft_vocab_size"] == vocab and cfg["transformer_layer_config"]["intermediate_size"] == 64


def _hf_greedy(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0, min_new_tokens=1)
    r = out[0, len(prompt):].tolist()
    cut = next((j + 1 for j, t in enumerate(r) if t in eos), len(r))
    return r[:cut]


def test_fastgen_greedy_equals_transformers_generate(tmp_path):
    """The static-cache batched generator returns exactly what transformers' generate returns for
    each prompt alone (greedy, fp32): left padding, EOS stops and dropping finished rows included."""
    import transformers
    from hierviz.train import fastgen
    model = transformers.LlamaForCausalLM.from_pretrained(_tiny_target(tmp_path / "t")).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (int(n),), generator=g).tolist() for n in torch.randint(1, 24, (10,), generator=g)]
    free = [_hf_greedy(model, p, 24, []) for p in prompts]
    assert fastgen.generate(model, prompts, 24, [], 0) == free
    # EOS = tokens that occur mid-way in some answers: rows end at different steps and leave the batch
    eos = sorted({free[0][5], free[3][2], free[6][9]})
    ref = [_hf_greedy(model, p, 24, eos) for p in prompts]
    assert len({len(r) for r in ref}) > 2 and min(len(r) for r in ref) < 12
    assert fastgen.generate(model, prompts, 24, eos, 0) == ref
    assert fastgen.generate(model, prompts, 24, eos, 0, compact_below=0.0) == ref   # never compacting: same answers


def test_fastgen_sampling_distribution():
    """Temperature + nucleus sampling draws each token with its renormalised nucleus probability."""
    from hierviz.train.fastgen import sample_next
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))
    n = 40000
    gen = torch.Generator().manual_seed(0)
    draws = sample_next(logits.expand(n, 5).clone(), 1.0, 0.85, gen)   # nucleus: the first three (0.5+0.25 < 0.85)
    freq = torch.bincount(draws, minlength=5).double() / n
    want = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0], dtype=torch.float64) / 0.9
    assert (freq - want).abs().max() < 0.01, freq
    hot = sample_next(logits.expand(n, 5).clone(), 2.0, 1.0, gen)      # temperature 2: p ~ sqrt(p)
    want = logits.double().div(2).softmax(-1)
    assert (torch.bincount(hot, minlength=5).double() / n - want).abs().max() < 0.01
    assert sample_next(logits[None], 0.0, 1.0, None).item() == 0


def test_sample_items_never_repeats_a_greedy_answer():
    from hierviz.train.data import parse_modes, sample_items
    items = sample_items(200, parse_modes("greedy:0.5,t0.7:0.5"), 3, 0)
    assert len(items) == 600
    greedy = [i for i, m in items if m == "greedy"]
    assert len(greedy) == len(set(greedy)) and len(greedy) >= 100


def test_instruct_stage(tmp_path, monkeypatch):
    """--instruct: the target writes questions / tasks (sampled); the usable distinct ones are
    answered and land in the data as instruct-* samples next to the writing samples."""
    from hierviz.train import data
    from hierviz.train.common import TokenData
    from hierviz.train.prompts import parse_instruction
    assert parse_instruction('Question: "How do bees make honey?"') == "How do bees make honey?"
    assert parse_instruction("2) Write a poem about the sea at night.") == "Write a poem about the sea at night."
    assert parse_instruction("ok then") is None
    assert parse_instruction("What is a prime number? The answer is that a prime has two divisors. Also") == \
        "What is a prime number?"
    assert parse_instruction("A soldier's motto is a Germanic word meaning live without fear.") is None   # no task
    assert parse_instruction("I'm not able to write questions, but what is your favourite animal?") is None
    # a random byte model writes no words: accept any non-empty text so the answering path runs
    monkeypatch.setattr(data, "parse_instruction", lambda t: t.strip() or None)
    target = _tiny_target(tmp_path / "target")
    qs = ["--questions", *map(str, QUESTIONS)]
    assert data.main(["--target", str(target), "--tokenizer", "byte", "--out", str(tmp_path / "d.pt"),
                      "--num-prompts", "6", "--max-new-tokens", "8", "--batch-size", "8", "--device", "cpu",
                      "--instruct", "10", "--instruct-max-tokens", "12", *qs]) == 0
    d = TokenData.load(tmp_path / "d.pt")
    info = d.meta["instruct"]
    cats = d.meta["categories"]
    assert info["asked"] == info["written"] == 10
    assert sum(v for k, v in cats.items() if k.startswith("instruct-ask-")) == 10
    answered = sum(v for k, v in cats.items() if k.startswith("instruct-") and not k.startswith("instruct-ask-"))
    assert answered == info["answered_prompts"] > 0
    assert len(d) == 6 + 10 + answered


def test_eagle3_heads_draft_in_the_engine_as_training_unrolled_them(trained):
    """An EAGLE-3 head written by `train eagle --head-type eagle3` loads through the engine's loader,
    and the engine, drafting a chain through its KV cache as a tree does (own output fed back, one
    position further each depth), gives the training head's unrolled steps: training-time test's
    mask and positions are the tree's."""
    from safetensors.torch import load_file
    from hierviz.models.eagle3 import canonical_names, load_eagle3_head
    from hierviz.models.llama import Transformer
    from hierviz.models.loading import load_weights
    from hierviz.train.common import with_shared_embeddings
    from hierviz.train.eagle3_train import Eagle3TrainHead
    from hierviz.train.eagle_train import _Base
    from hierviz.train.common import build_hf, load_base
    t_cfg, t_w = load_base(trained / "target")
    for name, base_dir in (("E_T3", trained / "target"), ("E_M3", trained / "M")):
        cfg_e, w_e, _ = load_weights(base_dir)
        if name == "E_M3":
            cfg_raw, w_raw = load_base(base_dir)
            w_raw = with_shared_embeddings(w_raw, t_w)
            _, t_w_e, _ = load_weights(trained / "target")
            w_e = dict(w_e, **{k: t_w_e[k] for k in ("model.embed_tokens.weight",) if k not in w_e})
        else:
            cfg_raw, w_raw = t_cfg, t_w
        engine_base = Transformer(cfg_e, w_e)
        head = load_eagle3_head(trained / name, engine_base)
        engine_base.add_feature_layers(head.feature_layers)
        assert head.draft_vocab_size == 48 and head.cfg.intermediate_size == 96
        assert bool(head.draft_vocab_mask()[2])                     # end-of-sequence stays draftable
        raw = load_file(str(trained / name / "model.safetensors"))
        from hierviz.train.eagle3_train import feature_layers_for, head_config
        ids = torch.arange(raw["d2t"].numel()) + raw["d2t"]
        th = Eagle3TrainHead(head_config(cfg_raw, cfg_raw["vocab_size"], 96), ids, feature_layers_for(
            cfg_raw["num_hidden_layers"]), cfg_raw["hidden_size"])
        th.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in canonical_names(raw).items()})
        assert th.feature_layers == head.feature_layers
        hf = _Base("base", build_hf(cfg_raw, w_raw, torch.device("cpu")).eval())
        x = torch.randint(3, 259, (1, 14), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            feats, _ = hf.hidden_at(x, th.feature_layers)
            steps = th.unroll(hf.embed, x, feats, 3)
            rows = engine_base(x[0], torch.arange(14))
            g = head.project_features(rows[:-1])
            torch.testing.assert_close(g, th.fc(feats[0, :-1]), rtol=1e-4, atol=1e-4)
            t = 8
            cache = head.new_cache(32)
            out = head(x[0, 1:t + 2], g[:t + 1], torch.arange(t + 1), cache)
            chain = [out[-1]]
            for s in (1, 2):
                nxt = head(x[0, t + s + 1:t + s + 2], chain[-1][None], torch.tensor([t + s]), cache)
                chain.append(nxt[0])
            for s in range(3):
                torch.testing.assert_close(chain[s], steps[s][0, t], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out, steps[0][0, :t + 1], rtol=1e-4, atol=1e-4)
    rep = json.loads((trained / "eagle3.json").read_text())
    assert rep["head_type"] == "eagle3" and rep["ttt_steps"] == 3
    assert len(rep["heads"]["e_m"]["heldout_top1_by_depth"]["greedy"]) == 3


def test_eagle3_draft_vocabulary_keeps_its_size_and_the_end_token(tmp_path):
    from hierviz.train.eagle3_train import read_draft_vocab
    f = tmp_path / "v.json"
    f.write_text(json.dumps([7, 3, 9, 4, 11]))
    assert read_draft_vocab(str(f), 3, 20, [2]).tolist() == [2, 3, 7]     # 9 gave way to the end token
    assert read_draft_vocab(str(f), None, 20, [3]).tolist() == [3, 4, 7, 9, 11]
    assert read_draft_vocab(None, None, 5, [2]).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(SystemExit, match="outside"):
        read_draft_vocab(str(f), None, 10, [])
