"""Draft heads stored int8 per channel (`python -m hierviz train pack-head`): the file is about half,
the loaders read it back as exactly scale x codes, its drafts stay close to the fp16 head's, both
head types load through the drafter registry, a packed head drafts losslessly in every method,
and broken or foreign schemes are refused with a message."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hierviz.models.drafter import load_head
from hierviz.models.eagle3 import default_feature_layers, save_eagle3_head
from hierviz.models.llama import Transformer
from hierviz.models.synthetic import synthetic_eagle3_head
from hierviz.quant.compressed_tensors import load_dense_tensors
from hierviz.quant.errors import CheckpointError
from hierviz.train.pack_head import main as pack_main, pack_head
from tests.test_eagle3 import LAYERS, make_base
from tests.tiny import make_tiny_head


@pytest.fixture(scope="module")
def base() -> Transformer:
    return make_base()


def _drafts(head, base: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        rows = base(tokens, torch.arange(len(tokens)))
        hidden = head(tokens[1:], head.project_features(rows[:-1]), torch.arange(len(tokens) - 1),
                      head.new_cache(32))
        return head.draft_logprobs(hidden)[0], hidden


def test_packed_weights_are_scale_times_codes_within_half_a_step(tmp_path, base) -> None:
    src = tmp_path / "e2"
    make_tiny_head(src, base.cfg, seed=3)
    report = pack_head(src, tmp_path / "e2-int8")
    stored = load_file(str(tmp_path / "e2-int8" / "model.safetensors"))
    dense = load_file(str(src / "model.safetensors"))
    config = json.loads((tmp_path / "e2-int8" / "config.json").read_text())
    loaded = load_dense_tensors(tmp_path / "e2-int8", config)
    linears = [k for k, v in dense.items() if v.dim() == 2]
    assert linears and all(stored[k].dtype == torch.int8 for k in linears)
    assert stored["fc.bias"].dtype == dense["fc.bias"].dtype            # vectors stay as stored
    for k in linears:
        scale = stored[k[:-len(".weight")] + ".weight_scale"]
        assert scale.shape == (dense[k].shape[0], 1)
        assert torch.equal(loaded[k], (stored[k].float() * scale.float()).to(scale.dtype))
        step = scale.float()
        assert ((loaded[k].float() - dense[k].float()).abs() <= 0.5 * step + 1e-6).all()
    assert set(loaded) == set(dense)
    assert report["packed_MB"] < 0.6 * report["source_MB"] + 0.01
    assert 0 < report["max_row_relative_error"] < 0.005


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_a_packed_head_loads_through_the_registry_and_drafts_like_the_original(tmp_path, base, kind) -> None:
    if kind == "eagle2":
        src = tmp_path / "src"
        make_tiny_head(src, base.cfg, seed=4)
    else:
        src = save_eagle3_head(tmp_path / "src", synthetic_eagle3_head(base, 5, draft_vocab_size=60,
                                                                       feature_layers=default_feature_layers(LAYERS)))
    pack_head(src, tmp_path / "int8")
    original, packed = load_head(src, base), load_head(tmp_path / "int8", base)
    assert packed.head_type == original.head_type == kind
    base.add_feature_layers(original.feature_layers)
    tokens = torch.randint(3, base.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    (lp_a, h_a), (lp_b, h_b) = _drafts(original, base, tokens), _drafts(packed, base, tokens)
    assert not torch.equal(h_a, h_b)                      # the weights did change ...
    assert torch.allclose(h_a, h_b, rtol=0.05, atol=0.05 * h_a.abs().max().item())   # ... by little
    assert (lp_a.argmax(-1) == lp_b.argmax(-1)).float().mean() >= 0.9


def test_pack_head_command_and_refusals(tmp_path, base, capsys) -> None:
    src = tmp_path / "src"
    make_tiny_head(src, base.cfg, seed=5, bias=False)
    assert pack_main(["--head", str(src), "--out", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["packed_MB"] > 0
    with pytest.raises(SystemExit, match="already a compressed-tensors"):
        pack_head(tmp_path / "out", tmp_path / "again")
    with pytest.raises(SystemExit, match="another folder"):
        pack_main(["--head", str(src), "--out", str(src)])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # a 4-bit weight-only scheme is not what the head loaders read
    four = json.loads(json.dumps(config))
    four["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(CheckpointError, match="weight-only 4-bit"):
        load_dense_tensors(tmp_path / "out", four)
    # codes without their scale, and a scale without codes
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    for drop, match in (("fc.weight_scale", "int8 without"), ("fc.weight", "no fc.weight")):
        bad = tmp_path / f"bad-{drop}"
        bad.mkdir()
        save_file({k: v for k, v in sd.items() if k != drop}, str(bad / "model.safetensors"))
        with pytest.raises(CheckpointError, match=match):
            load_dense_tensors(bad, config)
