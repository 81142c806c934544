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

QUESTIONS = [p for p in (Path(__file__).resolve().parent.parent.parent / "shared" / "data").glob("*_question.jsonl")]


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
    qs = ["--questions", *map(str, QUESTIONS)] if QUESTIONS else []
    assert data.main(["--target", str(target), "--tokenizer", "byte", "--out", str(d / "data.pt"), "--num-prompts", "24",
                      "--max-new-tokens", "12", "--batch-size", "12", "--heldout-every", "4", "--device", "cpu",
                      "--draft-vocab", "64", *qs]) == 0
    assert distill.main(["--target", str(target), "--data", str(d / "data.pt"), "--out", str(d / "M"), "--layers", "2",
                         "--steps", "4", "--batch-tokens", "512", "--group-size", "32", "--calib-samples", "6",
                         "--top1-weight", "0.5", "--device", "cpu"]) == 0
    assert eagle_train.main(["--target", str(target), "--intermediate", str(d / "M"), "--data", str(d / "data.pt"),
                             "--out-t", str(d / "E_T"), "--out-m", str(d / "E_M"), "--steps", "4", "--batch-tokens",
                             "512", "--device", "cpu", "--report", str(d / "eagle.json")]) == 0
    return d


def test_data_file(trained):
    from hierviz.train.common import TokenData
    data = TokenData.load(trained / "data.pt")
    assert len(data) == 24 and data.indices("heldout") and data.indices("train")
    assert data.meta["response_tokens"] > 0
    if QUESTIONS:
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


def test_derived_prompts_stage(tmp_path):
    """--derived: the target's own training answers become passages of long prompts, which the
    target then answers greedily; they land in the data with their own categories."""
    from hierviz.train import data
    from hierviz.train.common import TokenData
    from hierviz.train.prompts import DERIVED_TEMPLATES, derived_prompts
    target = _tiny_target(tmp_path / "target")
    qs = ["--questions", *map(str, QUESTIONS)] if QUESTIONS else []
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


def test_pipeline_in_two_calls(tmp_path):
    """The device pipeline split over two invocations (two device calls): the second reuses the
    exported target, the data and M that the first left in WORK_DIR, and trains only the heads."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    target = _tiny_target(tmp_path / "target")
    qfiles = " ".join(map(str, QUESTIONS))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(root), "NUM_PROMPTS": "16", "MAX_NEW": "8",
           "GEN_BATCH": "8", "DISTILL_STEPS": "2", "EAGLE_STEPS": "2", "BATCH_TOKENS": "256", "LAYERS": "2",
           "GROUP": "32", "DRAFT_VOCAB": "64", "QUESTIONS": qfiles}
    script = root / "hierviz" / "train" / "gpu_pipeline.sh"
    work, out = tmp_path / "w", tmp_path / "out"
    for stages, made in (("data distill", "M.tar"), ("heads", "heads.tar")):
        p = subprocess.run(["bash", str(script), str(target), "byte", str(work), str(out)], cwd=root,
                           env={**env, "STAGES": stages}, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert (out / made).is_file()
        if stages == "data distill":
            assert not (out / "heads.tar").exists()
    log = (out / "log.txt").read_text()
    assert "stages: heads" in log and log.count("stages:") == 2
    assert (work / "smollm2-m2-eagle" / "model.safetensors").is_file()
