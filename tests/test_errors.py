"""Bad input gets a clear error message, never a crash or a hang."""
from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hierviz.settings import DecodeSettings
from hierviz.engine import EngineError, generate, output_tokens
from hierviz.models.config import ModelConfig
from hierviz.stack import StackError, load_stack, tiny_random_stack
from tests.tiny import make_tiny_head, make_tiny_hf, make_tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    make_tiny_hf(root / "target", "llama", seed=0, layers=3)
    make_tiny_tokenizer(root / "target")
    make_tiny_hf(root / "inter", "llama", seed=1, layers=1)
    make_tiny_hf(root / "inter101", "llama", seed=1, layers=1, vocab=101)
    t_cfg = ModelConfig.from_file(root / "target")
    make_tiny_head(root / "e_t", t_cfg, seed=2)
    make_tiny_head(root / "e_m", ModelConfig.from_file(root / "inter"), seed=3, bias=False)
    return root


def write_stack(root, **parts) -> str:
    spec = {"name": "test", "target": {"path": "target", "quantize": "rtn-g16"}}
    spec.update(parts)
    p = root / f"stack-{abs(hash(json.dumps(spec, sort_keys=True)))}.json"
    p.write_text(json.dumps(spec))
    return str(p)


def test_local_folder_stack_runs_all_methods_losslessly(folders):
    stack = load_stack(write_stack(folders, intermediate={"path": "inter"}, e_m={"path": "e_m"}, e_t={"path": "e_t"}),
                       "cpu")
    s = DecodeSettings(max_new_tokens=16, m_depth=2, m_topk=3, m_tree_size=6, t_depth=3, t_topk=3, t_tree_size=9)
    outs = {m: output_tokens(generate(stack, m, "w5 w7 w9", s)) for m in ("ar", "spec", "eagle2", "hierspec")}
    assert all(o == outs["ar"] for o in outs.values())


def test_mismatched_vocab_between_tiers(folders):
    with pytest.raises(StackError, match=r"vocabulary \(101\) differs from the target's \(97\)"):
        load_stack(write_stack(folders, intermediate={"path": "inter101"}), "cpu")


def test_missing_model_folder(folders):
    with pytest.raises(StackError, match="no such model file or folder"):
        load_stack(write_stack(folders, intermediate={"path": "./does-not-exist"}), "cpu")


def test_hub_id_offline_is_explained(folders):
    with pytest.raises(StackError, match="HF_HUB_OFFLINE"):
        load_stack(write_stack(folders, intermediate={"path": "nobody-here/no-such-model-xyz"}), "cpu")


def test_corrupt_weights_file(folders, tmp_path):
    import shutil
    bad = folders / "corrupt"
    shutil.copytree(folders / "inter", bad, dirs_exist_ok=True)
    (bad / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(StackError, match="corrupt or truncated safetensors file"):
        load_stack(write_stack(folders, intermediate={"path": "corrupt"}), "cpu")


def test_unsupported_architecture(folders):
    import shutil
    gpt = folders / "gpt2"
    shutil.copytree(folders / "inter", gpt, dirs_exist_ok=True)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (gpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StackError, match="unsupported architecture 'gpt2'"):
        load_stack(write_stack(folders, intermediate={"path": "gpt2"}), "cpu")


def test_bad_stack_files(tmp_path):
    with pytest.raises(StackError, match="unknown stack"):
        load_stack(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(StackError, match="not valid JSON"):
        load_stack(str(bad))
    bad.write_text("{}")
    with pytest.raises(StackError, match="no 'target'"):
        load_stack(str(bad))


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_stack()


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_prompt(tiny, prompt):
    with pytest.raises(EngineError, match="prompt is empty"):
        generate(tiny, "hierspec", prompt, DecodeSettings(max_new_tokens=4))


def test_prompt_longer_than_context(tiny):
    with pytest.raises(EngineError, match="context"):
        generate(tiny, "ar", "x" * 1100, DecodeSettings(max_new_tokens=4))


@pytest.mark.parametrize("kw,msg", [({"m_topk": 0}, "top-k must be between 1"), ({"t_depth": 0}, "depth must be"),
                                    ({"m_tree_size": 200, "m_topk": 2, "m_depth": 2}, "exceeds the 6 candidates"),
                                    ({"temperature": -1}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
                                    ({"top_p": 0}, "top_p"), ({"min_draft_len": 0}, "min_draft_len"),
                                    ({"m_topk": 2.5}, "must be a whole number")])
def test_nonsense_tree_parameters(tiny, kw, msg):
    with pytest.raises(EngineError, match=msg):
        generate(tiny, "hierspec", "hi", DecodeSettings(**kw))


def test_tree_larger_than_cache_allows(tiny):
    s = DecodeSettings(max_new_tokens=600, t_depth=10, t_topk=10, t_tree_size=512)
    with pytest.raises(EngineError, match="exceeds the 1024-token context"):
        generate(tiny, "eagle2", "hi", s)


def test_unknown_method(tiny):
    with pytest.raises(EngineError, match="unknown method"):
        generate(tiny, "medusa", "hi", DecodeSettings())


def test_cli_reports_errors_without_traceback(capsys):
    from hierviz.cli import main
    assert main(["generate", "--stack", "tiny-random", "--prompt", " "]) == 2
    err = capsys.readouterr().err
    assert "error: the prompt is empty" in err and "Traceback" not in err
    assert main(["nonsense"]) == 2


def test_cli_generate_writes_trace(tmp_path, capsys):
    from hierviz.cli import main
    from hierviz.trace import load_trace
    out = tmp_path / "t.json"
    assert main(["generate", "--stack", "tiny-random", "--prompt", "hi", "--max-new-tokens", "6",
                 "--method", "eagle2", "--trace", str(out)]) == 0
    tr = load_trace(out)
    assert tr.meta["method"] == "eagle2" and sum(len(s.new_tokens) for s in tr.steps) == 6


def test_deep_wide_head_tree_fits_or_is_refused_up_front(tiny):
    """The EAGLE head's cache holds (depth-1) x top-k frontier nodes: such a tree runs, and one
    that cannot fit the context is refused before the run with a clear message."""
    tr = generate(tiny, "eagle2", "hi", DecodeSettings(max_new_tokens=4, t_depth=20, t_topk=40, t_tree_size=100))
    assert sum(len(s.new_tokens) for s in tr.steps) == 4
    with pytest.raises(EngineError, match="draft/tree room .* does not fit"):
        generate(tiny, "eagle2", "hi", DecodeSettings(max_new_tokens=4, t_depth=32, t_topk=64, t_tree_size=100))


def test_tree_defaults_follow_the_device() -> None:
    """Small trees on a CPU (the CPU sweep), the paper's on a GPU; an explicit flag always wins."""
    import argparse

    from hierviz.settings import CPU_TREES, DecodeSettings, add_settings_args, default_settings, settings_from_args
    gpu, cpu = default_settings("cuda"), default_settings("cpu")
    assert gpu == DecodeSettings() and (gpu.t_depth, gpu.t_tree_size) == (6, 59)
    assert all(getattr(cpu, k) == v for k, v in CPU_TREES.items()) and cpu.validate()
    import torch
    assert default_settings() == (gpu if torch.cuda.is_available() else cpu)   # None: this machine
    p = argparse.ArgumentParser()
    add_settings_args(p)
    assert settings_from_args(p.parse_args([]), "cpu") == cpu
    assert settings_from_args(p.parse_args([]), "cuda:0") == gpu
    s = settings_from_args(p.parse_args(["--t-tree-size", "60", "--m-depth", "3"]), "cpu")
    assert s.t_tree_size == 60 and s.m_depth == 3 and s.min_draft_len == CPU_TREES["min_draft_len"]
