"""Streaming loads (hierviz.quant.gptq.iter_tensors, hierviz.models.loading.load_weights, the
stack's _load_model): tensor by tensor onto the target device, with the same engine weights, bit
for bit, as the all-in-host path they replace, and host memory of about the final weights plus
one shard.

The oracle (`host_*` below) is that all-in-host path as it was: every file read into one dict on
the host, then each GPTQ linear unpacked through int64 nibbles and repacked there.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from safetensors.torch import save_file

from hierviz.models.config import ModelConfig, read_config_json
from hierviz.models.llama import Linear, Transformer
from hierviz.models.loading import load_weights
from hierviz.quant import gptq
from hierviz.quant.errors import CheckpointError
from hierviz.quant.gptq import load_gptq_weights, load_state_dict_folder, read_quantize_config
from hierviz.quant.w4 import W4Weight, quantize_linears

ROOT = Path(__file__).resolve().parents[1]


# ---- the oracle: the all-in-host path -------------------------------------------------------

def host_unpack_int32(words: torch.Tensor, dim: int) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    w = w.movedim(dim, -1)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF
    return nib.reshape(*w.shape[:-1], w.shape[-1] * 8).movedim(-1, dim)


def host_gptq_linear_to_w4(qweight, qzeros, scales, g_idx, group_size: int, fmt: str) -> W4Weight:
    k = qweight.shape[0] * 8
    gs = k if group_size == -1 else group_size
    g_idx = (torch.arange(k) // gs if g_idx is None else g_idx).to(torch.int64).reshape(-1)
    q = host_unpack_int32(qweight, 0)
    z = host_unpack_int32(qzeros, 1)
    if fmt == "gptq":
        z = z + 1
    _, perm = torch.sort(g_idx, stable=True)
    perm_out = None if torch.equal(perm, torch.arange(k)) else perm
    if perm_out is not None:
        q = q.index_select(0, perm)
    codes = (q[0::2] | (q[1::2] << 4)).to(torch.uint8).t().contiguous()
    s = scales.to(torch.float32)
    return W4Weight(codes, s.t().contiguous(), (-(s * z.to(torch.float32))).t().contiguous(), gs, perm_out)


def host_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    def st(path: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def pt(path: Path) -> dict[str, torch.Tensor]:
        return torch.load(str(path), map_location="cpu", weights_only=True)

    for index_name, loader in (("model.safetensors.index.json", st), ("pytorch_model.bin.index.json", pt)):
        if (folder / index_name).exists():
            out: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads((folder / index_name).read_text())["weight_map"].values())):
                out.update(loader(folder / shard))
            return out
    out = {}
    for f in sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")):
        out.update((st if f.suffix == ".safetensors" else pt)(f))
    return out


def host_load_weights(folder: Path, convert=None) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, weights) as the all-in-host path built them (GPTQ or plain folders); convert:
    the linear repack (default: the int64 one above)."""
    convert = convert or host_gptq_linear_to_w4
    config = read_config_json(folder)
    raw = host_state_dict(folder)
    weights: dict[str, Any] = {}
    if not any(k.endswith(".qweight") for k in raw):
        return ModelConfig.from_dict(config), raw
    qc = read_quantize_config(folder, config)
    used: set[str] = set()
    for m in sorted(k[:-len(".qweight")] for k in raw if k.endswith(".qweight")):
        weights[f"{m}.weight"] = convert(raw[f"{m}.qweight"], raw[f"{m}.qzeros"], raw[f"{m}.scales"],
                                         raw.get(f"{m}.g_idx"), qc["group_size"], qc["checkpoint_format"])
        used |= {f"{m}.{p}" for p in ("qweight", "qzeros", "scales", "g_idx")}
    weights.update({k: v for k, v in raw.items() if k not in used})
    return ModelConfig.from_dict(config), weights


def host_model(folder: Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quantize: Optional[int] = None, convert=None) -> Transformer:
    cfg, w = host_load_weights(folder, convert)
    if quantize:
        w = quantize_linears(w, quantize)
    return Transformer(cfg, w, dtype=dtype, device=device)


# ---- small checkpoints in the real layouts --------------------------------------------------

def model_config(layers: int, hidden: int = 64, inter: int = 128, vocab: int = 96, model_type: str = "llama") -> dict:
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _linears(cfg: dict) -> list[tuple[str, int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    return [("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, h), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)]


def gptq_parts(n: int, k: int, group: int, fmt: str, sym: bool, desc_act: bool, g: torch.Generator) -> dict:
    """AutoGPTQ's tensors for an [n, k] linear: any int32 word holds 8 valid codes."""
    gs = k if group == -1 else group
    groups = k // gs

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, generator=g)

    if sym:       # zero point 8: v1 stores 7 in every nibble, v2 stores 8
        qzeros = torch.full((groups, n // 8), 0x77777777 if fmt == "gptq" else 0x88888888 - 2 ** 32, dtype=torch.int32)
    else:
        qzeros = words(groups, n // 8)
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 1e-3).half()
    return {"qweight": words(k // 8, n), "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def model_tensors(cfg: dict, seed: int, gptq_cfg: Optional[dict] = None, dense_dtype=torch.float16,
                  bias: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]

    def dense(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dense_dtype)

    yield "model.embed_tokens.weight", dense(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", 1 + dense(h)
        yield f"{p}.post_attention_layernorm.weight", 1 + dense(h)
        for name, n, k in _linears(cfg):
            if gptq_cfg:
                for part, t in gptq_parts(n, k, gptq_cfg["group_size"], gptq_cfg["checkpoint_format"],
                                          gptq_cfg["sym"], gptq_cfg["desc_act"], g).items():
                    yield f"{p}.{name}.{part}", t
            else:
                yield f"{p}.{name}.weight", dense(n, k)
            if bias and name.startswith("self_attn.") and name != "self_attn.o_proj":
                yield f"{p}.{name}.bias", dense(n)
    yield "model.norm.weight", 1 + dense(h)
    yield "lm_head.weight", dense(v, h)


def write_checkpoint(folder: Path, cfg: dict, tensors: Iterator[tuple[str, torch.Tensor]], shard_bytes: int,
                     gptq_cfg: Optional[dict] = None) -> list[int]:
    """Sharded safetensors + index + config.json (+ quantize_config.json), as the hub's
    checkpoints (hierviz.measure.synthetic_stack.write_sharded); returns the shards' sizes."""
    from hierviz.measure.synthetic_stack import write_sharded
    write_sharded(folder, tensors, shard_bytes)
    (folder / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": gptq_cfg} if gptq_cfg else {})}))
    if gptq_cfg:
        (folder / "quantize_config.json").write_text(json.dumps(gptq_cfg))
    return [f.stat().st_size for f in sorted(folder.glob("*.safetensors"))]


def gptq_config(fmt: str = "gptq", sym: bool = True, desc_act: bool = False, group: int = 32) -> dict:
    return {"bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym, "checkpoint_format": fmt,
            "quant_method": "gptq"}


def write_gptq_model(folder: Path, layers: int = 2, shard_bytes: int = 2500, seed: int = 0, **kw) -> list[int]:
    cfg, qc = model_config(layers), gptq_config(**kw)
    return write_checkpoint(folder, cfg, model_tensors(cfg, seed, qc), shard_bytes, qc)


# ---- comparing weights ----------------------------------------------------------------------

def assert_same_weight(a: Any, b: Any, key: str) -> None:
    assert type(a) is type(b), key
    if isinstance(a, W4Weight):
        assert a.group_size == b.group_size, key
        assert (a.perm is None) == (b.perm is None), key
        pairs = [("codes", a.codes, b.codes), ("scales", a.scales, b.scales), ("offsets", a.offsets, b.offsets)]
        if a.perm is not None:
            pairs.append(("perm", a.perm, b.perm))
    else:
        pairs = [("", a, b)]
    for part, x, y in pairs:
        assert x.dtype == y.dtype and x.device == y.device, (key, part, x.dtype, y.dtype, x.device, y.device)
        assert torch.equal(x, y), (key, part)


def assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for key in a:
        assert_same_weight(a[key], b[key], key)


def engine_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a built model holds: parameters, buffers, and each W4 linear's parts."""
    out = {k: v for k, v in model.named_parameters()}
    out.update(model.named_buffers())
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Linear):
            for i, w in enumerate(mod.w4):
                out.update({f"{mod_name}.w4.{i}.{p}": t for p, t in
                            (("codes", w.codes), ("scales", w.scales), ("offsets", w.offsets), ("perm", w.perm))
                            if t is not None})
    return out


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ta, tb = engine_tensors(a), engine_tensors(b)
    assert_same_weights(ta, tb)
    assert [len(m.w4) for m in a.modules() if isinstance(m, Linear)] == \
        [len(m.w4) for m in b.modules() if isinstance(m, Linear)]


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages a built model holds."""
    seen: dict[int, int] = {}
    for t in engine_tensors(model).values():
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


# ---- same weights as the all-in-host path ---------------------------------------------------

GPTQ_CASES = [dict(fmt="gptq", sym=True, desc_act=False, group=32), dict(fmt="gptq", sym=False, desc_act=True, group=32),
              dict(fmt="gptq_v2", sym=False, desc_act=False, group=64), dict(fmt="gptq_v2", sym=True, desc_act=True, group=-1)]


@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_sharded_gptq_streams_to_the_host_paths_weights(tmp_path: Path, case: dict) -> None:
    sizes = write_gptq_model(tmp_path, **case)
    assert len(sizes) >= 4                                       # linears' parts spread over shards
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(index[f"{m}.qweight"] != index[f"{m}.{part}"] for part in ("qzeros", "scales", "g_idx")
               for m in (k[:-len(".qweight")] for k in index if k.endswith(".qweight")))
    cfg_host, w_host = host_load_weights(tmp_path)
    _, w_stream = load_gptq_weights(tmp_path)
    assert_same_weights(w_stream, w_host)
    cfg, w, _ = load_weights(tmp_path)
    assert cfg == cfg_host
    assert_same_weights(w, w_host)
    # cast as they arrive: what Transformer(dtype=...) makes of the host path's weights
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        _, w, _ = load_weights(tmp_path, "cpu", dtype)
        assert_same_model(Transformer(cfg, w, dtype=dtype, release=True), host_model(tmp_path, dtype))
        assert not w                                            # release: the loader's dict is used up


def test_gptq_linear_repack_equals_the_int64_unpacking() -> None:
    g = torch.Generator().manual_seed(1)
    for fmt in ("gptq", "gptq_v2"):
        for desc_act in (False, True):
            for n, k, group in ((8, 64, 32), (40, 256, 64), (16, 128, -1)):
                t = gptq_parts(n, k, group, fmt, False, desc_act, g)
                ours = gptq.gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"],
                                              group_size=group, checkpoint_format=fmt)
                ref = host_gptq_linear_to_w4(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, fmt)
                assert_same_weight(ours, ref, f"{fmt} {desc_act} {n}x{k} g{group}")
                assert ours.codes.is_contiguous() and ours.scales.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_fp16_folder_streams_to_the_host_paths_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    cfg = model_config(3, model_type="qwen2")                      # q/k/v biases too
    write_checkpoint(tmp_path, cfg, model_tensors(cfg, 5, dense_dtype=dtype, bias=True), 20_000)
    c_host, w_host = host_load_weights(tmp_path)
    c, w, folder = load_weights(tmp_path)
    assert c == c_host and folder == tmp_path
    assert_same_weights(w, w_host)
    for model_dtype in (torch.float32, torch.float16):
        _, w, _ = load_weights(tmp_path, "cpu", model_dtype)
        assert all(t.dtype == model_dtype for t in w.values())
        assert_same_model(Transformer(c, w, dtype=model_dtype, release=True), host_model(tmp_path, model_dtype))


def test_a_small_mapping_window_reopens_shards_with_the_same_result(tmp_path: Path, monkeypatch) -> None:
    write_gptq_model(tmp_path, shard_bytes=60_000, fmt="gptq_v2", sym=False, desc_act=True)
    _, whole = load_gptq_weights(tmp_path)
    opened = []
    real_open = gptq._open_safetensors
    monkeypatch.setattr(gptq, "_open_safetensors", lambda p: opened.append(p) or real_open(p))
    monkeypatch.setattr(gptq, "MAP_WINDOW", 3000)              # a few tensors per mapping
    _, windowed = load_gptq_weights(tmp_path)
    assert_same_weights(windowed, whole)
    shards = len(list(tmp_path.glob("*.safetensors")))
    assert len(opened) > 3 * shards                           # headers once, then several windows each


def test_stack_model_loads_equal_the_host_path(tmp_path: Path) -> None:
    """hierviz.stack._load_model (stream, cast on the device, build with release) against the
    host path's Transformer, also with a quantize option (RTN of the stored values)."""
    from hierviz.stack import _load_model
    write_gptq_model(tmp_path / "q", layers=2, fmt="gptq", sym=False, desc_act=True)
    cfg = model_config(2)
    write_checkpoint(tmp_path / "d", cfg, model_tensors(cfg, 3), 30_000)
    for folder, dtype in ((tmp_path / "q", torch.float32), (tmp_path / "d", torch.float16)):
        model, got_folder = _load_model({"path": folder.name}, tmp_path, torch.device("cpu"), dtype, "reference")
        assert got_folder == folder
        assert_same_model(model, host_model(folder, dtype))
    model, _ = _load_model({"path": "d", "quantize": "rtn-g32"}, tmp_path, torch.device("cpu"), torch.float16, "reference")
    assert_same_model(model, host_model(tmp_path / "d", torch.float16, quantize=32))


def test_bin_checkpoints_stream_too(tmp_path: Path) -> None:
    """pytorch_model.bin (zip format: memory-mapped; legacy format: read whole), and .bin shards
    with an index; weights_only throughout."""
    write_gptq_model(tmp_path / "src", layers=1, shard_bytes=10 ** 9, fmt="gptq", sym=False, desc_act=True)
    sd = load_state_dict_folder(tmp_path / "src")
    _, want = host_load_weights(tmp_path / "src")
    keys = sorted(sd)
    for name, files in (("zip", {"pytorch_model.bin": keys}), ("legacy", {"pytorch_model.bin": keys}),
                        ("index", {"pytorch_model-00001-of-00002.bin": keys[::2],
                                   "pytorch_model-00002-of-00002.bin": keys[1::2]})):
        folder = tmp_path / name
        folder.mkdir()
        for fname, ks in files.items():
            torch.save({k: sd[k] for k in ks}, folder / fname, _use_new_zipfile_serialization=name != "legacy")
        if name == "index":
            (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
                {"weight_map": {k: f for f, ks in files.items() for k in ks}}))
        for f in ("config.json", "quantize_config.json"):
            (folder / f).write_text((tmp_path / "src" / f).read_text())
        _, got, _ = load_weights(folder)
        assert_same_weights(got, want)


def test_native_w4_cache_streams(tmp_path: Path) -> None:
    from hierviz.quant.gguf import load_w4_safetensors, save_w4_safetensors
    write_gptq_model(tmp_path / "q", layers=1, fmt="gptq_v2", sym=False, desc_act=True)
    cfg, w = host_load_weights(tmp_path / "q")
    save_w4_safetensors(tmp_path / "n", {**model_config(1)}, w)
    _, back = load_w4_safetensors(tmp_path / "n")
    assert_same_weights(back, w)
    c, back16, _ = load_weights(tmp_path / "n", "cpu", torch.float16)
    assert c == cfg
    assert_same_model(Transformer(c, back16, dtype=torch.float16, release=True), host_model(tmp_path / "q", torch.float16))


def test_a_name_in_two_files_is_read_once_from_the_later(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(3), "b": torch.ones(2)}, str(tmp_path / "1.safetensors"))
    save_file({"a": torch.full((3,), 7.0), "c": torch.ones(1)}, str(tmp_path / "2.safetensors"))
    located = gptq.checkpoint_tensors(tmp_path)
    assert [(k, p.name) for k, (p, _) in located.items()] == [("b", "1.safetensors"), ("a", "2.safetensors"),
                                                              ("c", "2.safetensors")]
    sd = load_state_dict_folder(tmp_path)
    assert torch.equal(sd["a"], torch.full((3,), 7.0)) and list(sd) == ["b", "a", "c"]


def test_streaming_errors_name_the_problem(tmp_path: Path) -> None:
    write_gptq_model(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.scales"]
    # a part missing from every shard: found from the headers, before any data is read
    sd = load_state_dict_folder(tmp_path)
    kept = {k: v for k, v in sd.items() if index["weight_map"][k] == shard and k != "model.layers.1.mlp.up_proj.scales"}
    save_file(kept, str(tmp_path / shard))
    with pytest.raises(CheckpointError, match="lists tensors not found in its shards"):
        load_gptq_weights(tmp_path)
    del index["weight_map"]["model.layers.1.mlp.up_proj.scales"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj' is missing tensor 'model.layers.1.mlp.up_proj.scales'"):
        load_gptq_weights(tmp_path)
    (tmp_path / shard).write_bytes((tmp_path / shard).read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"corrupt or truncated safetensors file .*{shard}"):
        load_gptq_weights(tmp_path)
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing weights file .*{shard}"):
        load_weights(tmp_path)


def test_release_uses_up_the_dict_and_builds_the_same_model(tmp_path: Path) -> None:
    write_gptq_model(tmp_path)
    cfg, w, _ = load_weights(tmp_path)
    kept = Transformer(cfg, w)
    assert w                                                    # without release the caller's dict is left alone
    released = Transformer(cfg, dict(w), release=True)
    assert_same_model(released, kept)


# ---- host memory: about the final weights plus one shard ------------------------------------

PEAK_SCRIPT = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from tests.test_streaming_load import held_bytes, host_model, rss_bytes
from hierviz.quant.gptq import gptq_linear_to_w4
from hierviz.stack import _load_model
folder, warm, way = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def lean(qweight, qzeros, scales, g_idx, group_size, fmt):
    return gptq_linear_to_w4(qweight, qzeros, scales, g_idx, group_size=group_size, checkpoint_format=fmt)
def load(f):
    if way == "host":           # the all-in-host path, with today's lean repack (its int64 one held more)
        return host_model(f, convert=lean)
    return _load_model({"path": str(f)}, f.parent, torch.device("cpu"), torch.float32, "reference")[0]
load(warm)                      # every code path once: lazily loaded code is in the baseline
Path("/proc/self/clear_refs").write_text("5")        # VmHWM := VmRSS
base = rss_bytes()["VmRSS"]
model = load(folder)
print(json.dumps({"base": base, "peak": rss_bytes()["VmHWM"], "final": held_bytes(model)}))
"""


def rss_bytes() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _peak(folder: Path, warm: Path, way: str) -> dict[str, int]:
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), str(warm), way], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def big_gptq(tmp_path_factory) -> tuple[Path, Path, list[int]]:
    """~190 MB GPTQ checkpoint in 5 shards (hidden 1024, 24 layers), and a tiny one for warming up."""
    root = tmp_path_factory.mktemp("big")
    cfg, qc = model_config(24, hidden=1024, inter=4096, vocab=8192), gptq_config(group=128)
    sizes = write_checkpoint(root / "big", cfg, model_tensors(cfg, 0, qc), 40 * 2 ** 20, qc)
    write_gptq_model(root / "warm", layers=1)
    return root / "big", root / "warm", sizes


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak RSS")
def test_streaming_load_peak_host_memory_is_final_weights_plus_a_shard(big_gptq) -> None:
    folder, warm, sizes = big_gptq
    assert len(sizes) >= 4 and sum(sizes) > 150e6
    bound_extra = 1.5 * max(sizes)
    got = _peak(folder, warm, "stream")
    grew = got["peak"] - got["base"]
    assert grew <= got["final"] + bound_extra, {k: v / 1e6 for k, v in {**got, "grew": grew}.items()}
    # the all-in-host path held every shard and the repacked weights at once, beside the fused layers
    old = _peak(folder, warm, "host")
    assert old["final"] == got["final"]
    assert old["peak"] - old["base"] > got["final"] + bound_extra, {k: v / 1e6 for k, v in old.items()}
