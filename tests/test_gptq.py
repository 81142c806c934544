"""GPTQ checkpoints: AutoGPTQ/GPTQModel layout in, exact W4 out.

The reference here is deliberately independent of hierviz: a numpy packer that writes the
layout bit by bit and the textbook formula W[n,k] = scales[g,n] * (q[k,n] - z[g,n]), g = g_idx[k].
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from hierviz.quant.errors import CheckpointError
from hierviz.quant.gptq import (gptq_linear_to_w4, load_gptq_weights, load_state_dict_folder,
                                pack_gptq_linear, save_gptq_checkpoint)
from hierviz.quant.w4 import W4Weight, dequantize_unpermuted, w4_linear

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- an independent reference ------------------------------------------------------------

def np_pack(vals: np.ndarray, axis: int) -> np.ndarray:
    """Pack 4-bit values 8 per uint32 along axis (value i of a word at bits 4i) -> int32."""
    v = np.moveaxis(vals.astype(np.uint32), axis, 0)
    out = np.zeros((v.shape[0] // 8,) + v.shape[1:], dtype=np.uint32)
    for i in range(8):
        out |= (v[i::8] & 0xF) << np.uint32(4 * i)
    return np.moveaxis(out, 0, axis).view(np.int32)


def np_unpack(words: np.ndarray, axis: int) -> np.ndarray:
    w = np.moveaxis(words.view(np.uint32), axis, 0)
    out = np.zeros((w.shape[0] * 8,) + w.shape[1:], dtype=np.int64)
    for i in range(8):
        out[i::8] = (w >> np.uint32(4 * i)) & 0xF
    return np.moveaxis(out, 0, axis)


def reference_dequant(qweight, qzeros, scales, g_idx, fmt: str) -> np.ndarray:
    """Textbook GPTQ dequantization in float64 -> W [N, K]."""
    q = np_unpack(np.asarray(qweight), 0)                  # [K, N]
    z = np_unpack(np.asarray(qzeros), 1)                   # [G, N]
    if fmt == "gptq":
        z = z + 1
    s = np.asarray(scales, dtype=np.float64)
    g = np.asarray(g_idx, dtype=np.int64)
    return (s[g] * (q - z[g])).T                           # [N, K]


def make_checkpoint_tensors(n: int, k: int, group_size: int, fmt: str, sym: bool, desc_act: bool, seed: int):
    """Random GPTQ tensors written with the numpy packer (not hierviz's)."""
    rng = np.random.default_rng(seed)
    gs = k if group_size == -1 else group_size
    groups = k // gs
    q = rng.integers(0, 16, size=(k, n))
    if sym:
        z = np.full((groups, n), 8)
    else:
        z = rng.integers(1 if fmt == "gptq" else 0, 17 if fmt == "gptq" else 16, size=(groups, n))
    stored = z - 1 if fmt == "gptq" else z
    scales = (rng.random((groups, n)) * 0.02 + 1e-3).astype(np.float16)
    if desc_act:
        order = rng.permutation(k)               # act-order: channel order[j] is j-th quantized
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[order] = np.arange(k) // gs
    else:
        g_idx = (np.arange(k) // gs).astype(np.int32)
    tensors = {
        "qweight": torch.from_numpy(np_pack(q, 0)),
        "qzeros": torch.from_numpy(np_pack(stored, 1)),
        "scales": torch.from_numpy(scales),
        "g_idx": torch.from_numpy(g_idx),
    }
    return tensors, q, z


CASES = [(fmt, sym, gs, da) for fmt in ("gptq", "gptq_v2") for sym in (True, False)
         for gs in (32, 64, 128, -1) for da in (False, True)]


@pytest.mark.parametrize("fmt,sym,group_size,desc_act", CASES)
def test_linear_matches_reference_exactly(fmt, sym, group_size, desc_act):
    n, k = 48, 256
    t, _, _ = make_checkpoint_tensors(n, k, group_size, fmt, sym, desc_act, seed=hash((fmt, sym, group_size, desc_act)) % 1000)
    ref = reference_dequant(t["qweight"].numpy(), t["qzeros"].numpy(), t["scales"].numpy(), t["g_idx"].numpy(), fmt)
    w4 = gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"],
                           group_size=group_size, checkpoint_format=fmt)
    assert isinstance(w4, W4Weight)
    assert w4.group_size == (k if group_size == -1 else group_size)
    assert (w4.perm is not None) == (desc_act and group_size != -1)
    ours = dequantize_unpermuted(w4).double().numpy()
    assert np.array_equal(ours, ref)                        # exact, not allclose
    x = torch.randn(3, k, dtype=torch.float64)
    y = w4_linear(x, w4.to(dtype=torch.float64))
    assert torch.allclose(y, x @ torch.from_numpy(ref).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt,sym,group_size,desc_act", CASES[::3])
def test_writer_matches_independent_packer(fmt, sym, group_size, desc_act):
    n, k = 32, 128
    t, q, z = make_checkpoint_tensors(n, k, group_size, fmt, sym, desc_act, seed=7)
    packed = pack_gptq_linear(torch.from_numpy(q.T.copy()), torch.from_numpy(z.T.copy()),
                              t["scales"].float().T, t["g_idx"], checkpoint_format=fmt)
    for key in ("qweight", "qzeros", "scales", "g_idx"):
        assert packed[key].dtype == t[key].dtype, key
        assert torch.equal(packed[key], t[key]), key


def test_trivial_g_idx_absent_or_ordered_gives_no_perm():
    t, _, _ = make_checkpoint_tensors(16, 64, 32, "gptq_v2", False, False, seed=1)
    a = gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], None, group_size=32, checkpoint_format="gptq_v2")
    b = gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group_size=32, checkpoint_format="gptq_v2")
    assert a.perm is None and b.perm is None
    assert torch.equal(a.codes, b.codes)


def _tiny_model(tmp_path: Path, fmt: str, desc_act: bool, sym: bool = False, group_size: int = 32):
    """Float + quantized tensors of a 2-layer toy model, saved in AutoGPTQ's layout."""
    torch.manual_seed(0)
    hidden, inter, vocab = 64, 128, 100
    floats = {"model.embed_tokens.weight": torch.randn(vocab, hidden, dtype=torch.float16),
              "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
              "lm_head.weight": torch.randn(vocab, hidden, dtype=torch.float16)}
    quantized, refs = {}, {}
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for layer in range(2):
        floats[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        for i, (mod, (n, k)) in enumerate(shapes.items()):
            name = f"model.layers.{layer}.{mod}"
            t, _, _ = make_checkpoint_tensors(n, k, group_size, fmt, sym, desc_act, seed=10 * layer + i)
            if mod == "self_attn.q_proj":
                t["bias"] = torch.randn(n, dtype=torch.float16)
            quantized[name] = t
            refs[name] = reference_dequant(t["qweight"].numpy(), t["qzeros"].numpy(), t["scales"].numpy(),
                                           t["g_idx"].numpy(), fmt)
    config = {"model_type": "llama", "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": 2}
    qc = {"bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym, "true_sequential": True,
          "checkpoint_format": fmt}
    folder = save_gptq_checkpoint(tmp_path / f"ckpt-{fmt}", config, floats, quantized, qc)
    return folder, floats, quantized, refs


@pytest.mark.parametrize("fmt,desc_act", [("gptq", False), ("gptq", True), ("gptq_v2", True)])
def test_checkpoint_round_trip(tmp_path, fmt, desc_act):
    folder, floats, quantized, refs = _tiny_model(tmp_path, fmt, desc_act)
    qc = json.loads((folder / "quantize_config.json").read_text())
    assert qc["quant_method"] == "gptq" and qc["bits"] == 4 and qc["checkpoint_format"] == fmt
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["desc_act"] == desc_act
    config, weights = load_gptq_weights(folder)
    assert config["quantization_config"]["checkpoint_format"] == fmt
    for key, t in floats.items():
        assert torch.equal(weights[key], t)
    for name, ref in refs.items():
        w4 = weights[f"{name}.weight"]
        assert isinstance(w4, W4Weight)
        assert np.array_equal(dequantize_unpermuted(w4).double().numpy(), ref)
        if "bias" in quantized[name]:
            assert torch.equal(weights[f"{name}.bias"], quantized[name]["bias"])
    assert not any(k.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for k in weights)


def test_quantization_config_only_in_config_json(tmp_path):
    """Newer checkpoints carry only config.json["quantization_config"]; absent format => v1."""
    folder, _, _, refs = _tiny_model(tmp_path, "gptq", False)
    (folder / "quantize_config.json").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]["checkpoint_format"]
    (folder / "config.json").write_text(json.dumps(cfg))
    config, weights = load_gptq_weights(folder)
    assert config["quantization_config"]["checkpoint_format"] == "gptq"
    name = next(iter(refs))
    assert np.array_equal(dequantize_unpermuted(weights[f"{name}.weight"]).double().numpy(), refs[name])


def test_sharded_safetensors_and_bin_fallback(tmp_path):
    folder, _, _, refs = _tiny_model(tmp_path, "gptq_v2", True)
    everything = load_state_dict_folder(folder)
    # re-shard into two files with an index
    keys = sorted(everything)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    (folder / "model.safetensors").unlink()
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: everything[k] for k in ks}, str(folder / fname))
        weight_map.update({k: fname for k in ks})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, w_sharded = load_gptq_weights(folder)
    name = next(iter(refs))
    assert np.array_equal(dequantize_unpermuted(w_sharded[f"{name}.weight"]).double().numpy(), refs[name])
    # .bin fallback (loaded with weights_only=True)
    for f in list(folder.glob("*.safetensors")) + [folder / "model.safetensors.index.json"]:
        f.unlink()
    torch.save(everything, folder / "pytorch_model.bin")
    _, w_bin = load_gptq_weights(folder)
    assert set(w_bin) == set(w_sharded)


# ---- clear errors -------------------------------------------------------------------------

def test_error_bits_not_4(tmp_path):
    folder, *_ = _tiny_model(tmp_path, "gptq", False)
    qc = json.loads((folder / "quantize_config.json").read_text())
    qc["bits"] = 8
    (folder / "quantize_config.json").write_text(json.dumps(qc))
    with pytest.raises(CheckpointError, match="bits=8"):
        load_gptq_weights(folder)


def test_error_unknown_format_and_method(tmp_path):
    folder, *_ = _tiny_model(tmp_path, "gptq", False)
    qc = json.loads((folder / "quantize_config.json").read_text())
    (folder / "quantize_config.json").write_text(json.dumps({**qc, "checkpoint_format": "marlin"}))
    with pytest.raises(CheckpointError, match="marlin"):
        load_gptq_weights(folder)
    (folder / "quantize_config.json").write_text(json.dumps({**qc, "quant_method": "awq"}))
    with pytest.raises(CheckpointError, match="awq"):
        load_gptq_weights(folder)


def test_error_missing_tensor(tmp_path):
    folder, floats, quantized, _ = _tiny_model(tmp_path, "gptq_v2", False)
    sd = load_state_dict_folder(folder)
    del sd["model.layers.1.mlp.up_proj.qzeros"]
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.qzeros"):
        load_gptq_weights(folder)


def test_error_shape_mismatch(tmp_path):
    folder, *_ = _tiny_model(tmp_path, "gptq_v2", False)
    sd = load_state_dict_folder(folder)
    sd["model.layers.0.mlp.up_proj.scales"] = sd["model.layers.0.mlp.up_proj.scales"][:, :-8].contiguous()
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj: scales shape"):
        load_gptq_weights(folder)


def test_error_truncated_and_corrupt_files(tmp_path):
    folder, *_ = _tiny_model(tmp_path, "gptq_v2", False)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_gptq_weights(folder)
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_gptq_weights(folder)
    path.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_gptq_weights(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt JSON"):
        load_gptq_weights(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing file"):
        load_gptq_weights(folder)
    (folder / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        load_state_dict_folder(folder)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gptq_weights(tmp_path / "nowhere")


def test_error_not_gptq(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not a GPTQ checkpoint"):
        load_gptq_weights(folder)


def test_error_bad_linear_inputs():
    t, q, z = make_checkpoint_tensors(16, 64, 32, "gptq_v2", False, False, seed=3)
    with pytest.raises(CheckpointError, match="not a multiple of group_size"):
        gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"][:1], None, group_size=48,
                          checkpoint_format="gptq_v2")
    bad = t["g_idx"].clone()
    bad[0] = 1                                       # group 1 now has 33 channels
    with pytest.raises(CheckpointError, match="exactly 32"):
        gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], bad, group_size=32, checkpoint_format="gptq_v2")
    with pytest.raises(CheckpointError, match="g_idx has"):
        gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"][:-1], group_size=32,
                          checkpoint_format="gptq_v2")
    with pytest.raises(CheckpointError, match="int32"):
        gptq_linear_to_w4(t["qweight"].float(), t["qzeros"], t["scales"], None, group_size=32,
                          checkpoint_format="gptq_v2")
    # K not divisible by 8 cannot be packed
    with pytest.raises(CheckpointError, match="multiple of 8"):
        pack_gptq_linear(torch.zeros(8, 60, dtype=torch.long), torch.zeros(8, 2, dtype=torch.long),
                         torch.ones(8, 2), group_size=30, checkpoint_format="gptq_v2")
    # v1 cannot store a zero point of 0
    zeros = torch.from_numpy(z.T.copy())
    zeros[0, 0] = 0
    with pytest.raises(CheckpointError, match="gptq_v2"):
        pack_gptq_linear(torch.from_numpy(q.T.copy()), zeros, torch.ones(zeros.shape), group_size=32,
                         checkpoint_format="gptq")
