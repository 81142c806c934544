"""`python -m hierviz profile`: forward latency against the number of verified tokens.

    python -m hierviz profile --shape llama3-70b --out runs/profile
    python -m hierviz profile --shape assets/configs/llama3-8b.json --tokens 1,8,64 --out DIR
    python -m hierviz profile --device cpu --shape smollm2 --tokens 1,4 --out DIR   # tiny CPU run

What it measures: one forward of T new tokens (T = 1..128, as when verifying a
draft of T tokens) over a KV cache that already holds `--context` tokens, at a real model's
shapes with synthetic weights, for dense fp16 weights and for W4A16 weights (the engine's
Triton kernel; torch's `_weight_int4pack_mm` "tinygemm" for one layer, bf16). Two scopes:
one decoder layer, and the whole model (all layers + final norm + LM head on every row). The
forward is the engine's own static-shape decoder layer (hierviz.models.llama), replayed from a
CUDA graph so launch overhead stays out. The bandwidth floor of each series is its weight
bytes over the measured device-to-device copy rate (bytes read + written). Where a whole
model does not fit in GPU memory (fp16 Llama-3-70B: 140 GB), its curve is one layer's times
the layer count plus the LM head, marked `estimated`.

Writes DIR/profile.json (schema below, `SCHEMA`) and DIR/profile.html (plotly).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from hierviz.machine import device_name, machine_info
from hierviz.measure.common import SHAPES, load_shape, median_seconds, refuse, stamp, write_json
from hierviz.models.config import ModelConfig, rope_frequencies
from hierviz.models.llama import DecoderLayer, KVCache, Linear, RMSNorm
from hierviz.models.synthetic import layer_weights, random_dense
from hierviz.quant.formats import DEFAULT_FORMAT, DENSE, WeightFormat, check_runs_on, get_format, quantized_formats
from hierviz.quant.w4 import W4Weight, register_kernel

SCHEMA = "hierviz.profile/1"
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128)
TINYGEMM = "tinygemm"     # torch's int4 kernel, a comparison curve of this tool
NO_GPU = ("no CUDA GPU found: `python -m hierviz profile` measures GPU forward latency. "
          "The curve recorded on an H200 is assets/profile/h200.json (the app's Profile tab shows it); "
          "`--device cpu` runs a small CPU version of the same measurement.")



def _tinygemm(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """torch's `_weight_int4pack_mm` (bf16 only); operands built once, cached on w."""
    hit = w.kernel_state.get("tinygemm")
    if hit is None:
        from hierviz.measure.kernel_bench import tinygemm_pack
        hit = w.kernel_state["tinygemm"] = tinygemm_pack(w, swap_nibbles=False)
    return torch.ops.aten._weight_int4pack_mm(x, hit[0], w.group_size, hit[1])



def build_layer(cfg: ModelConfig, fmt: str, kernel: str, g: int, dtype: torch.dtype, device: str,
                seed: int) -> DecoderLayer:
    if kernel == TINYGEMM:        # a comparison kernel of this tool only, registered on use
        register_kernel(TINYGEMM, _tinygemm)
    gen = torch.Generator(device=device).manual_seed(seed)
    w = {f"p.{k}": v for k, v in layer_weights(cfg, fmt, g, dtype, device, gen).items()}
    return DecoderLayer(cfg, w.__getitem__, "p", kernel)


def layer_bytes(layer: DecoderLayer) -> int:
    """Bytes a forward must read: the linears' weights in their format (codes and scales) and norms."""
    total = 0
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        if lin.weight is not None:
            total += lin.weight.numel() * lin.weight.element_size()
        if lin.q is not None:
            total += sum(w.nbytes for w in lin.q.weights)
    for norm in (layer.input_norm, layer.post_norm):
        total += norm.weight.numel() * norm.weight.element_size()
    return total


class Stack:
    """Layers (+ final norm + LM head when `head`), run the engine's static-shape way:
    T new rows written at cache slots context..context+T-1, mask over the whole cache."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], head: Optional[Linear], dtype: torch.dtype,
                 device: str, context: int, max_t: int) -> None:
        self.cfg, self.layers, self.head = cfg, layers, head
        self.norm = RMSNorm(torch.ones(cfg.hidden_size, dtype=dtype, device=device), cfg.rms_eps)
        self.cache = KVCache(len(layers), cfg.num_kv_heads, cfg.head_dim, context + max_t, dtype, device)
        self.cache.k.normal_()
        self.cache.v.normal_()
        self.inv_freq = rope_frequencies(cfg).to(device)
        self.context, self.dtype, self.device = context, dtype, device

    def inputs(self, t: int) -> tuple:
        x = torch.randn(t, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        pos = torch.arange(self.context, self.context + t, device=self.device)
        slots = pos.clone()
        mask = torch.zeros(t, self.cache.max_len, dtype=torch.bool, device=self.device)
        mask[:, :self.context] = True
        mask[:, self.context:self.context + t] = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        return x, emb.cos().to(self.dtype), emb.sin().to(self.dtype), mask, slots

    def forward(self, x, cos, sin, mask, slots) -> torch.Tensor:
        x = x.clone()     # the fused layer path adds its residuals into its input in place
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, self.cache, mask, slots)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


# ---- timing -----------------------------------------------------------------------------------

def _time_cuda_us(fn: Callable[[], object], rep_ms: float) -> float:
    import triton.testing
    fn()                      # compile kernels and build weight layouts outside the capture
    torch.cuda.synchronize()
    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def _time_cpu_us(fn: Callable[[], object], min_s: float = 0.05, max_reps: int = 20) -> float:
    return 1e6 * median_seconds(fn, min_s, 3, max_reps)


def copy_bandwidth(device: str) -> float:
    """Device-to-device (or RAM) copy rate in bytes/s, counting bytes read plus bytes written."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    if device == "cuda":
        import triton.testing
        ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")
        s = ms * 1e-3
    else:
        s = _time_cpu_us(lambda: b.copy_(a)) * 1e-6
    return 2 * n / s


# ---- the measurement --------------------------------------------------------------------------

def _fits(nbytes: int, device: str) -> bool:
    if device != "cuda":
        return nbytes < (2 << 30)
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.85 * free


def _paper_format() -> WeightFormat:
    return get_format(DEFAULT_FORMAT)


def _kernels(fmt: WeightFormat, device: str, dtype: torch.dtype) -> list[tuple[str, torch.dtype, bool]]:
    """(kernel, dtype, whole model too) of each curve a format gets: a format with a GPU kernel of
    its own (W4A16) that one on a GPU, plus torch's tinygemm for W4 weights (one layer, bf16 only),
    and its CPU kernel on a CPU; any other format its one product."""
    if not fmt.gpu_kernel:
        return [("reference", dtype, True)]
    w4 = fmt.weight_type is W4Weight
    if device == "cuda":
        return [(fmt.gpu_kernel, dtype, True)] + ([(TINYGEMM, torch.bfloat16, False)] if w4 else [])
    from hierviz.quant.int4pack_cpu import available
    return [("int4pack_cpu" if w4 and available() else "reference", dtype, True)]


def _formats(device: str, only: Optional[list[str]]) -> list[dict]:
    """The curves a profile draws: dense in the device's dtype, then every registered format with
    a quantizer, only where hierviz runs it on this device (hierviz.quant.formats: proven on a GPU
    before CUDA gets it)."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    fmts = [dict(name=str(dtype).removeprefix("torch.").replace("float", "fp"), fmt=DENSE.name, kernel="reference",
                 dtype=dtype, model=True)]
    for f in quantized_formats():
        if f.quantize is None:
            continue
        try:
            check_runs_on(f, torch.device(device))
        except ValueError:      # unproven on this GPU, or no FP8 hardware
            continue
        kernels = _kernels(f, device, dtype)
        fmts += [dict(name=f.series(k if f.gpu_kernel else ""), fmt=f.name, kernel=k, dtype=dt, model=m)
                 for k, dt, m in kernels]
    return [f for f in fmts if not only or f["name"] in only]


@dataclass
class _Run:
    """What every curve of one profile shares."""
    cfg: ModelConfig
    tokens: list[int]
    device: str
    context: int
    rep_ms: float
    timer: Callable
    bw: float
    info: dict
    log: Callable[[str], None]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def series(self, fmt: dict, scope: str, layers: int, nbytes: int, us: list[float], estimated: bool = False,
               note: str = "") -> None:
        row = {"format": fmt["name"], "dtype": str(fmt["dtype"]).replace("torch.", ""), "kernel": fmt["kernel"],
               "scope": scope, "layers": layers, "weight_bytes": nbytes, "floor_us": 1e6 * nbytes / self.bw,
               "us": us, "estimated": estimated, "note": note}
        self.info["series"].append(row)
        self.log(f"[profile] {fmt['name']:15s} {scope:5s} floor {row['floor_us']:9.1f} us | " +
                 " ".join(f"T={t}:{u:.1f}" for t, u in zip(self.tokens, us)))

    def curve(self, layers: list, head: Optional[Linear], dtype: torch.dtype,
              rep_ms: Optional[float] = None) -> list[float]:
        """Times of the layers (+ norm and head) at each token count."""
        st = Stack(self.cfg, layers, head, dtype, self.device, self.context, max(self.tokens))
        us = []
        for t in self.tokens:
            args = st.inputs(t)
            us.append(self.timer(lambda: st.forward(*args), rep_ms or self.rep_ms))
        return us


def _header(cfg: ModelConfig, shape: str, tokens: list[int], device: str, context: int, group_size: int,
            bw: float) -> dict:
    cuda = device == "cuda"
    info = {"schema": SCHEMA, "shape": shape,
            "config": {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                   "num_kv_heads", "head_dim", "vocab_size")},
            "device": device_name(device),
            "machine": machine_info(device),
            "context": context, "group_size": group_size, "tokens": list(tokens),
            "copy_bandwidth_GBps": bw / 1e9, "series": [], "notes": []}
    if cuda:
        from hierviz.quant import act_quant
        info["activation_quantizer"] = act_quant.name_on(torch.device(device))
    return info


def _whole_model(run: _Run, fmt: dict, g: int, layer: DecoderLayer, one: int, layer_us: list[float]) -> None:
    """All layers + final norm + dense LM head (kept in the activation dtype, as GPTQ/AWQ
    checkpoints keep it) applied to every row, as tree/sequence verification does; where the
    weights do not fit, one layer's time x the layer count + the LM head measured alone."""
    cfg, dtype = run.cfg, fmt["dtype"]
    gen = torch.Generator(device=run.device).manual_seed(2)
    head = Linear([random_dense(cfg.vocab_size, cfg.hidden_size, dtype, run.device, gen)], [None])
    head_bytes = cfg.vocab_size * cfg.hidden_size * head.weight.element_size() + cfg.hidden_size * 2
    total = one * cfg.num_layers + head_bytes
    if _fits(one * (cfg.num_layers + 2) + head_bytes, run.device):   # + 2 layers of build transients
        layers = [layer]
        try:
            for i in range(1, cfg.num_layers):
                lay = build_layer(cfg, fmt["fmt"], fmt["kernel"], g or 128, dtype, run.device, seed=10 + i)
                if fmt["kernel"] == "triton":   # the kernel layout now, which releases the checkpoint-order codes
                    from hierviz.quant.triton_w4 import packed
                    for lin in (lay.qkv, lay.o, lay.gate_up, lay.down):
                        for w in lin.w4:
                            packed(w, dtype)
                layers.append(lay)
            run.series(fmt, "model", cfg.num_layers, total, run.curve(layers, head, dtype, run.rep_ms * 3))
            return
        except torch.cuda.OutOfMemoryError:
            run.info["notes"].append(f"{fmt['name']}: whole model ran out of memory; estimated from one layer")
        finally:
            layers = None
            if run.cuda:
                torch.cuda.empty_cache()
    head_us = run.curve([], head, dtype)
    est = [u * cfg.num_layers + h for u, h in zip(layer_us, head_us)]
    note = (f"estimated: {total / 1e9:.0f} GB of weights do not fit this device; "
            f"one layer's time x {cfg.num_layers} + the LM head measured alone")
    run.info["notes"].append(f"{fmt['name']} whole model: {note}")
    run.series(fmt, "model", cfg.num_layers, total, est, estimated=True, note=note)
    if run.cuda:
        torch.cuda.empty_cache()


def profile(cfg: ModelConfig, shape: str, tokens: list[int], device: str = "cuda", context: int = 512,
            group_size: int = 128, whole_model: bool = True, formats: Optional[list[str]] = None,
            rep_ms: float = 60.0, log: Callable[[str], None] = print) -> dict:
    """Measure; returns the profile dict (see SCHEMA in the module docstring)."""
    cuda = device == "cuda"
    timer = (lambda fn, rep=rep_ms: _time_cuda_us(fn, rep)) if cuda else (lambda fn, rep=0: _time_cpu_us(fn))
    bw = copy_bandwidth(device)
    info = _header(cfg, shape, tokens, device, context, group_size, bw)
    run = _Run(cfg, list(tokens), device, context, rep_ms, timer, bw, info, log)
    log(f"[profile] {shape} on {info['device']}: copy bandwidth {bw / 1e9:.0f} GB/s; tokens {tokens}")
    for fmt in _formats(device, formats):
        g = group_size if get_format(fmt["fmt"]).group_bytes else 0
        try:
            layer = build_layer(cfg, fmt["fmt"], fmt["kernel"], g or 128, fmt["dtype"], device, seed=1)
        except Exception as e:  # e.g. a kernel that does not support this shape
            info["notes"].append(f"{fmt['name']}: cannot build a layer: {e}")
            log(f"[profile] {fmt['name']}: skipped ({e})")
            continue
        one = layer_bytes(layer)
        try:
            layer_us = run.curve([layer], None, fmt["dtype"])
        except Exception as e:
            info["notes"].append(f"{fmt['name']}: one-layer forward failed: {e}")
            log(f"[profile] {fmt['name']}: one-layer forward failed ({e})")
            continue
        run.series(fmt, "layer", 1, one, layer_us)
        if whole_model and fmt["model"]:
            _whole_model(run, fmt, g, layer, one, layer_us)
    return info


def write_outputs(info: dict, out: Path) -> tuple[Path, Optional[Path]]:
    j = write_json(out / "profile.json", info)
    try:
        from hierviz.viz.profile_fig import profile_figure
        html = out / "profile.html"
        profile_figure(info).write_html(str(html), include_plotlyjs="cdn")
    except ImportError:
        html = None
    return j, html


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz profile",
                                 description="Forward latency vs number of verified tokens, fp16 vs W4A16, "
                                             "at real model shapes with synthetic weights.")
    ap.add_argument("--shape", default="llama3-8b", help=f"{' | '.join(SHAPES)} | path to a config.json")
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated token counts")
    ap.add_argument("--out", required=True, help="output folder (profile.json, profile.html)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache")
    ap.add_argument("--group-size", type=int, default=0, help="W4 group size (default: 128 where it divides "
                                                               "the layer widths, else 32)")
    ap.add_argument("--formats", default=None,
                    help="subset of the curves, comma-separated: fp16 / fp32 (dense), a format's name, or "
                         "<format>-<kernel> for a format with kernels (cuda: "
                         f"{', '.join(_paper_format().series(k) for k in (_paper_format().gpu_kernel, TINYGEMM))})")
    ap.add_argument("--layer-only", action="store_true", help="skip the whole-model curves")
    ap.add_argument("--rep-ms", type=float, default=60.0, help="timing budget per point (GPU)")
    a = ap.parse_args(argv)
    try:
        tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
        if not tokens or min(tokens) < 1 or max(tokens) > 1024:
            raise ValueError
    except ValueError:
        return refuse("--tokens takes comma-separated counts between 1 and 1024, e.g. 1,2,4,8")
    if a.device == "cuda" and not torch.cuda.is_available():
        return refuse(NO_GPU)
    try:
        shape, cfg = load_shape(a.shape)
    except Exception as e:
        return refuse(str(e))
    formats = [f.strip() for f in a.formats.split(",")] if a.formats else None
    g = a.group_size or next((g for g in (128, 64, 32) if all(
        d % g == 0 for d in (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim))), 32)
    with torch.no_grad():
        info = profile(cfg, shape, tokens, a.device, a.context, g, not a.layer_only, formats, a.rep_ms)
    j, html = write_outputs(stamp(info, "profile", argv), Path(a.out))
    print(f"wrote {j}" + (f" and {html}" if html else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
