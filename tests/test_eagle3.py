"""EAGLE-3 heads (hierviz.models.eagle3): what the published semantics compute, the base's layer
features they read, the three checkpoint layouts, the errors, and the static-shape path."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import pytest
import torch

from hierviz.decoding.state import BaseState, HeadState
from hierviz.decoding.tree import draft_tree_on_device
from hierviz.models import cuda_graphs
from hierviz.models.config import ModelConfig, ModelConfigError
from hierviz.models.drafter import head_type_of, is_drafter, load_head
from hierviz.models.eagle3 import (Eagle3Head, default_feature_layers, is_eagle3_folder, load_eagle3_head,
                                   save_eagle3_head)
from hierviz.models.llama import Transformer, WeightsError
from hierviz.models.synthetic import synthetic_eagle3_head, synthetic_model
from tests.tiny import make_tiny_head

H, HEADS, KV_HEADS, INTER, VOCAB, LAYERS = 64, 4, 2, 128, 300, 8
HD = H // HEADS


def make_base(layers: int = LAYERS, seed: int = 0) -> Transformer:
    cfg = ModelConfig.from_dict(dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers,
                                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
                                     bos_token_id=1, eos_token_id=2))
    return synthetic_model(cfg, "dense", torch.float32, "cpu", "reference", seed)


@pytest.fixture(scope="module")
def base() -> Transformer:
    return make_base()


# ---- an independent statement of EAGLE-3 in plain torch ------------------------------------

def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [heads, T, hd] rotated by the rotate-half rope at positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.cat([pos.float()[:, None] * inv] * 2, -1)
    half = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1)
    return x * ang.cos() + half * ang.sin()


def reference_head(sd: dict[str, torch.Tensor], embed: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor,
                   pos: torch.Tensor, eps: float, theta: float, norm_before_residual: bool = False) -> torch.Tensor:
    """The midlayer's output for fused features g [T, H] over a causal sequence: attention over
    [input_layernorm(embed) ; hidden_norm(g)], g (or its norm) the residual, SiLU MLP."""
    p = "midlayer."
    t = tokens.shape[0]
    normed = rms(g, sd[p + "hidden_norm.weight"], eps)
    a_in = torch.cat([rms(embed[tokens], sd[p + "input_layernorm.weight"], eps), normed], -1)
    q = (a_in @ sd[p + "self_attn.q_proj.weight"].T).view(t, HEADS, HD).transpose(0, 1)
    k = (a_in @ sd[p + "self_attn.k_proj.weight"].T).view(t, KV_HEADS, HD).transpose(0, 1)
    v = (a_in @ sd[p + "self_attn.v_proj.weight"].T).view(t, KV_HEADS, HD).transpose(0, 1)
    q, k = rotate(q, pos, theta), rotate(k, pos, theta)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(HD)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, H)
    x = (normed if norm_before_residual else g) + att @ sd[p + "self_attn.o_proj.weight"].T
    m = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ sd[p + "mlp.gate_proj.weight"].T, m @ sd[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T


def layer_inputs_by_hand(base: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The residual rows entering each of the base's layers, then the final (normed) hidden state."""
    pos = torch.arange(tokens.shape[0])
    cos, sin = base.rope(pos)
    x = base.embed[tokens]
    rows = []
    for i, layer in enumerate(base.layers):
        rows.append(x)
        x = layer(x, cos, sin, i, None, None)
    return rows + [base.norm(x)]


def random_state_dict(seed: int, vd: int, fc_in: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random tensors with SafeAILab's EAGLE-3 names and shapes (norms not 1, so that a swapped
    norm shows), rounded to fp16 as published checkpoints store them."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale / math.sqrt(shape[-1])).half().float()

    def norm() -> torch.Tensor:
        return (1 + 0.2 * torch.randn(H, generator=g)).half().float()

    p = "midlayer."
    sd = {p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
          p + "post_attention_layernorm.weight": norm(), p + "self_attn.q_proj.weight": r(H, 2 * H),
          p + "self_attn.k_proj.weight": r(KV_HEADS * HD, 2 * H), p + "self_attn.v_proj.weight": r(KV_HEADS * HD, 2 * H),
          p + "self_attn.o_proj.weight": r(H, H), p + "mlp.gate_proj.weight": r(INTER, H),
          p + "mlp.up_proj.weight": r(INTER, H), p + "mlp.down_proj.weight": r(H, INTER),
          "fc.weight": r(H, fc_in), "norm.weight": norm(), "lm_head.weight": r(vd, H, )}
    ids = torch.cat([torch.arange(5), torch.randperm(VOCAB - 5, generator=g)[:vd - 5].sort().values + 5])
    sd["d2t"] = ids - torch.arange(vd)
    sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    sd["t2d"][ids] = True
    return sd


# SafeAILab's published EAGLE-3 config.json (eagle/traineagle3/config.json, the LLaMA-3.1-8B head's),
# scaled down to the test base
SAFEAILAB_CONFIG = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                    "hidden_size": H, "initializer_range": 0.02, "intermediate_size": INTER,
                    "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": HEADS,
                    "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
                    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
                    "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": 100}


def speculators_config(layer_ids: list[int], theta: float) -> dict:
    """vLLM speculators' Eagle3 config.json (as RedHatAI's published heads have it), scaled down."""
    return {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": 100, "dtype": "float16",
            "eagle_aux_hidden_state_layer_ids": layer_ids, "embed_requires_grad": False, "norm_before_fc": False,
            "norm_before_residual": True,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                         "speculative_tokens": 3, "verifier_accept_k": 1}],
                                   "verifier": {"architectures": [], "name_or_path": "tiny/base"}},
            "speculators_model_type": "eagle3", "speculators_version": "0.4.0", "target_hidden_size": None,
            "tie_word_embeddings": False,
            "transformer_layer_config": {"attention_bias": False, "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
                                         "intermediate_size": INTER, "max_position_embeddings": 4096,
                                         "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": 1,
                                         "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-06,
                                         "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
                                         "tie_word_embeddings": False, "vocab_size": VOCAB}}


def write_folder(folder: Path, config: dict, sd: dict[str, torch.Tensor], fmt: str = "bin") -> Path:
    """A head folder by hand: config.json and the tensors (floats as fp16, as published)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    sd = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file
        save_file(sd, str(folder / "model.safetensors"))
    return folder


def speculators_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()}


# ---- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["safeailab", "speculators"])
def test_published_layouts_load_and_match_the_reference(tmp_path, base, layout) -> None:
    """A stand-in of each published layout, written by hand, loads; the head's outputs over a
    causal sequence (in two forwards through its cache) and its draft log-probs are the reference's."""
    if layout == "safeailab":
        layers, theta, eps, before = default_feature_layers(LAYERS), 10000.0, 1e-5, False
        sd = random_state_dict(0, 100, 3 * H)
        folder = write_folder(tmp_path / "head", SAFEAILAB_CONFIG, sd, "bin")
    else:
        layers, theta, eps, before = (1, 3, 6), 5000.0, 1e-6, True    # another rope than the base's
        sd = random_state_dict(1, 100, 3 * H)
        folder = write_folder(tmp_path / "head", speculators_config(list(layers), theta), speculators_names(sd),
                              "safetensors")
    assert is_eagle3_folder(folder) and head_type_of(folder) == "eagle3"
    head = load_eagle3_head(folder, base)
    assert head.layout == layout and head.feature_layers == layers and is_drafter(head)
    base.add_feature_layers(head.feature_layers)

    tokens = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rows = base(tokens, torch.arange(12))
        g = head.project_features(rows[:-1])
        by_hand = layer_inputs_by_hand(base, tokens)
        want_g = torch.cat([by_hand[i] for i in layers], -1)[:-1] @ sd["fc.weight"].T
        torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-5)

        pos = torch.arange(11)
        cache = head.new_cache(32)
        got = torch.cat([head(tokens[1:7], g[:6], pos[:6], cache), head(tokens[7:], g[6:], pos[6:], cache)])
        assert cache.length == 11
        want = reference_head(sd, base.embed, tokens[1:], g, pos, eps, theta, before)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

        logp, ids = head.draft_logprobs(got)
        want_logp = torch.log_softmax(rms(want, sd["norm.weight"], eps) @ sd["lm_head.weight"].T, -1)
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-4)
        assert logp.dtype == torch.float32 and logp.shape == (11, 100)
        assert torch.equal(ids, torch.arange(100) + sd["d2t"])


def test_base_hands_out_the_rows_entering_its_feature_layers() -> None:
    """forward's output = [final normed hidden | inputs of the feature layers, ascending]; the final
    hidden state and the logits are bit for bit those of a base without feature layers."""
    plain, feat = make_base(), make_base()
    feat.add_feature_layers((5, 2))
    feat.add_feature_layers((4, 2))
    assert feat.feature_layers == (2, 4, 5) and feat.feature_width == 4 * H
    tokens = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9)
    with torch.no_grad():
        want = plain(tokens, pos, plain.new_cache(16))
        rows = feat(tokens, pos, feat.new_cache(16))
        by_hand = layer_inputs_by_hand(plain, tokens)
    assert rows.shape == (9, 4 * H)
    assert torch.equal(rows[:, :H], want)
    assert torch.equal(feat.logits(rows), plain.logits(want))
    torch.testing.assert_close(rows[:, :H], by_hand[-1], rtol=0, atol=1e-6)
    for j, layer in enumerate((2, 4, 5)):
        torch.testing.assert_close(rows[:, H * (1 + j):H * (2 + j)], by_hand[layer], rtol=0, atol=1e-6)
    torch.testing.assert_close(feat.layer_features(rows, (5, 2)), torch.cat([by_hand[5], by_hand[2]], -1),
                               rtol=0, atol=1e-6)


def _head_with_options(base: Transformer, layers: tuple[int, ...], options: bool) -> Eagle3Head:
    """A random head; with options, speculators' extras too (fc bias, norm before fc, normed residual)."""
    head = synthetic_eagle3_head(base, 5, draft_vocab_size=100, feature_layers=layers)
    if not options:
        return head
    w = head.state_dict_canonical()
    g = torch.Generator().manual_seed(6)
    w["fc.bias"] = torch.randn(H, generator=g) * 0.1
    w["input_norm.weight"] = 1 + 0.2 * torch.randn(len(layers) * H, generator=g)
    return Eagle3Head(head.cfg, w, base, layers, draft_vocab_size=100, norm_before_residual=True, norm_before_fc=True)


@pytest.mark.parametrize("layout, options", [("safeailab", False), ("specforge", False), ("speculators", False),
                                             ("speculators", True)])
def test_each_layout_round_trips(tmp_path, base, layout, options) -> None:
    layers = default_feature_layers(LAYERS) if layout == "safeailab" else (1, 3, 6)
    head = _head_with_options(base, layers, options)
    base.add_feature_layers(layers)
    folder = save_eagle3_head(tmp_path / layout, head, layout)
    config = json.loads((folder / "config.json").read_text())
    if layout == "specforge":      # SGLang numbers the layer whose output is read
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    if layout == "speculators":
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
        assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert is_eagle3_folder(folder)
    again = load_head(folder, base)          # the drafter registry detects and loads it
    assert again.layout == layout and again.feature_layers == layers and again.draft_vocab_size == 100
    tokens = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        rows = base(tokens, torch.arange(8))
        outs = []
        for h in (head, again):
            hidden = h(tokens[1:], h.project_features(rows[:-1]), torch.arange(7), h.new_cache(16))
            outs.append(h.draft_logprobs(hidden))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(head.draft_vocab_mask(), again.draft_vocab_mask())


def _wider_head(base: Transformer, width: int, seed: int = 11) -> Eagle3Head:
    """A random head `width` wide on `base` (hidden size H): fc reads 3 x H, everything else is
    `width` wide, with its own embedding (a head of another width cannot use its base's)."""
    g = torch.Generator().manual_seed(seed)
    hd = width // HEADS
    cfg = ModelConfig.from_dict(dict(vocab_size=VOCAB, hidden_size=width, intermediate_size=INTER, num_hidden_layers=1,
                                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
                                     bos_token_id=1, eos_token_id=2))

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    p = "midlayer."
    w = {p + "input_layernorm.weight": torch.ones(width), p + "hidden_norm.weight": torch.ones(width),
         p + "post_attention_layernorm.weight": torch.ones(width), p + "self_attn.q_proj.weight": r(HEADS * hd, 2 * width),
         p + "self_attn.k_proj.weight": r(KV_HEADS * hd, 2 * width), p + "self_attn.v_proj.weight": r(KV_HEADS * hd, 2 * width),
         p + "self_attn.o_proj.weight": r(width, HEADS * hd), p + "mlp.gate_proj.weight": r(INTER, width),
         p + "mlp.up_proj.weight": r(INTER, width), p + "mlp.down_proj.weight": r(width, INTER),
         "fc.weight": r(width, 3 * H), "norm.weight": torch.ones(width), "lm_head.weight": r(VOCAB, width),
         "embed_tokens.weight": r(VOCAB, width)}
    return Eagle3Head(cfg, w, base, default_feature_layers(LAYERS))


def test_a_head_of_another_width_round_trips_through_the_safeailab_layout(tmp_path, base) -> None:
    """config.json records target_hidden_size, so that a reader that sizes fc from the config
    alone (SafeAILab's cnets.Model: 3 x target_hidden_size, else 3 x hidden_size) fits fc.weight."""
    from hierviz.quant.gptq import load_state_dict_folder
    head = _wider_head(base, 96)
    base.add_feature_layers(head.feature_layers)
    folder = save_eagle3_head(tmp_path / "wide", head, "safeailab")
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == 96 and config["target_hidden_size"] == H
    fc_in_by_config = 3 * config.get("target_hidden_size", config["hidden_size"])
    assert tuple(load_state_dict_folder(folder)["fc.weight"].shape) == (96, fc_in_by_config)
    again = load_head(folder, base)
    assert again.layout == "safeailab" and again.cfg.hidden_size == 96
    tokens = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        rows = base(tokens, torch.arange(8))
        outs = [h.draft_logprobs(h(tokens[1:], h.project_features(rows[:-1]), torch.arange(7), h.new_cache(16)))[0]
                for h in (head, again)]
    assert torch.equal(outs[0], outs[1])
    same_width = json.loads((save_eagle3_head(tmp_path / "same", synthetic_eagle3_head(base, 7), "safeailab")
                             / "config.json").read_text())
    assert "target_hidden_size" not in same_width      # as SafeAILab's own heads: fc reads 3 x hidden_size


def test_written_tensors_have_the_layout_names_and_dtypes(tmp_path, base) -> None:
    from hierviz.quant.gptq import load_state_dict_folder
    head = synthetic_eagle3_head(base, 7, draft_vocab_size=100, feature_layers=(1, 3, 6))
    sf = load_state_dict_folder(save_eagle3_head(tmp_path / "sf", head, "specforge"))
    sp = load_state_dict_folder(save_eagle3_head(tmp_path / "sp", head, "speculators"))
    assert "midlayer.hidden_norm.weight" in sf and not any(k.startswith("layers.") for k in sf)
    assert "layers.0.hidden_norm.weight" in sp and not any(k.startswith("midlayer.") for k in sp)
    for sd in (sf, sp):
        assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (100,)
        assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (VOCAB,)
        assert sd["fc.weight"].shape == (H, 3 * H) and sd["lm_head.weight"].shape == (100, H)
        assert "embed_tokens.weight" not in sd
    safe = save_eagle3_head(tmp_path / "safe", synthetic_eagle3_head(base, 7), "safeailab")
    assert (safe / "pytorch_model.bin").exists() and json.loads((safe / "config.json").read_text())["draft_vocab_size"] == VOCAB


def test_an_eagle2_head_is_not_an_eagle3_folder(tmp_path, base) -> None:
    make_tiny_head(tmp_path / "e2", base.cfg)
    assert not is_eagle3_folder(tmp_path / "e2") and head_type_of(tmp_path / "e2") == "eagle2"
    assert not is_eagle3_folder(tmp_path / "nothing")
    # a SafeAILab head whose config lost its draft_vocab_size is still known by its tensor names
    sd = random_state_dict(0, VOCAB, 3 * H)
    sd["d2t"] = torch.zeros(VOCAB, dtype=torch.int64)
    sd["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    cfg = {k: v for k, v in SAFEAILAB_CONFIG.items() if k != "draft_vocab_size"}
    assert is_eagle3_folder(write_folder(tmp_path / "e3", cfg, sd, "safetensors"))


def test_draft_vocabulary_maps_through_d2t_and_t2d(base) -> None:
    head = synthetic_eagle3_head(base, 8, draft_vocab_size=60)
    sd = head.state_dict_canonical()
    ids = torch.arange(60) + sd["d2t"]
    assert torch.equal(head.draft_ids, ids) and torch.equal(head.draft_vocab_mask(), sd["t2d"])
    assert int(sd["t2d"].sum()) == 60 and bool(sd["t2d"][:8].all())     # low ids kept
    assert torch.equal(sd["t2d"].nonzero().flatten(), ids)
    with torch.no_grad():
        logp, got_ids = head.draft_logprobs(torch.randn(3, H))
    assert logp.shape == (3, 60) and torch.equal(got_ids[logp.argmax(-1)], ids[logp.argmax(-1)])
    full = synthetic_eagle3_head(base, 8)
    assert full.draft_ids is None and full.draft_vocab_mask() is None
    assert torch.equal(full.state_dict_canonical()["d2t"], torch.zeros(VOCAB, dtype=torch.int64))


# ---- errors ----------------------------------------------------------------------------------

def _bad_safeailab(tmp_path: Path, config: Optional[dict] = None, drop: str = "", **tensors) -> Path:
    sd = random_state_dict(9, 100, 3 * H)
    sd.update(tensors)
    sd.pop(drop, None)
    return write_folder(tmp_path / "bad", {**SAFEAILAB_CONFIG, **(config or {})}, sd, "safetensors")


def _specforge(ids: list[int]) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}


@pytest.mark.parametrize("config, drop, tensors, error, match", [
    ({"hidden_size": 2 * H, "head_dim": HD}, "", {}, WeightsError, "cannot use its base model's embedding"),
    ({}, "", {"fc.weight": torch.zeros(H, 2 * H)}, WeightsError, r"fc.weight has shape \(64, 128\), expected \(64, 192\)"),
    ({"target_hidden_size": 2 * H}, "", {}, ModelConfigError, "target_hidden_size"),
    (_specforge([1, 3, 8]), "", {}, ModelConfigError, r"feature layers \[9\] are outside the base model's layers 0..7"),
    ({}, "", {"t2d": torch.ones(VOCAB - 1, dtype=torch.bool)}, WeightsError, r"t2d has shape \(299,\), expected \(300,\)"),
    ({}, "", {"d2t": torch.full((100,), 250)}, WeightsError, "outside the base vocabulary of 300"),
    ({}, "", {"d2t": -torch.arange(100)}, WeightsError, "two draft tokens to the same target token"),
    ({"draft_vocab_size": 99}, "", {}, WeightsError, r"lm_head.weight has shape \(100, 64\), expected \(99, 64\)"),
    ({"vocab_size": 301}, "", {}, ModelConfigError, "301-token target vocabulary .* base model has 300"),
    ({}, "midlayer.hidden_norm.weight", {}, WeightsError, "'midlayer.hidden_norm.weight' is missing"),
    ({}, "d2t", {}, WeightsError, "no tensor 'd2t'"),
    ({}, "", {"t2d": torch.ones(VOCAB, dtype=torch.bool)}, WeightsError, "t2d marks 300 target tokens, not the 100"),
    ({}, "", {"midlayer.self_attn.q_proj.weight": torch.zeros(H, H)}, WeightsError, "q_proj.weight has shape"),
    ({"num_hidden_layers": 2}, "", {}, ModelConfigError, "one-layer heads only"),
])
def test_clear_errors(tmp_path, base, config, drop, tensors, error, match) -> None:
    with pytest.raises(error, match=match):
        load_eagle3_head(_bad_safeailab(tmp_path, config, drop, **tensors), base)


def test_default_layers_that_collide_and_an_unattached_base_are_clear_errors(tmp_path) -> None:
    small = make_base(layers=6)              # defaults (2, 3, 3)
    with pytest.raises(ModelConfigError, match=r"repeat a layer"):
        load_eagle3_head(_bad_safeailab(tmp_path), small)
    fresh = make_base()
    head = synthetic_eagle3_head(fresh, 0)
    with pytest.raises(ValueError, match="add_feature_layers"):
        head.project_features(torch.zeros(2, H))
    with pytest.raises(ModelConfigError, match="cannot record feature layers"):
        save_eagle3_head(tmp_path / "x", synthetic_eagle3_head(fresh, 0, feature_layers=(1, 2, 3)), "safeailab")


# ---- the static-shape path -----------------------------------------------------------------

def _drafting(model: Transformer, head: Eagle3Head, static: bool) -> tuple[BaseState, HeadState]:
    cuda_graphs.force_static(static)
    try:
        state = BaseState(model, 300)
        drafter = HeadState(head, state, 300)
    finally:
        cuda_graphs.force_static(False)
    assert (drafter.runner is not None) == static
    with torch.no_grad():
        state.tokens = list(range(40, 61))
        root = state.tokens.pop()
        state.consume_pending()
        state.tokens.append(root)
    return state, drafter


@pytest.mark.parametrize("draft_vocab", [None, 100])
def test_static_path_drafts_what_the_eager_path_drafts(draft_vocab) -> None:
    """A HeadState drive (real pairs, then a draft tree of own outputs) through the static runner
    equals the dynamic path: same tree, close scores, same root feature."""
    model = make_base(seed=3)
    head = synthetic_eagle3_head(model, 4, draft_vocab_size=draft_vocab)
    model.add_feature_layers(head.feature_layers)
    trees, roots = [], []
    for static in (False, True):
        state, drafter = _drafting(model, head, static)
        with torch.no_grad():
            roots.append(drafter.root_hidden().clone())
            drafter.end_tree()
            tree, _ = draft_tree_on_device(drafter, 4, 5, 16).read()
        assert drafter.cache.length == 20
        trees.append(tree)
    torch.testing.assert_close(roots[1], roots[0], rtol=1e-5, atol=1e-5)
    dyn, sta = trees
    assert (sta.tokens, sta.parents, sta.depths) == (dyn.tokens, dyn.parents, dyn.depths)
    assert sta.scores == pytest.approx(dyn.scores, abs=1e-4)
    if draft_vocab is not None:
        assert all(head.draft_vocab_mask()[t] for t in dyn.tokens)
