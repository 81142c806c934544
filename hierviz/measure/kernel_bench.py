"""W4A16 matmul benchmark: fp16 cuBLAS vs torch's tinygemm vs Marlin vs GemLite vs FBGEMM vs hierviz's kernels.

    python -m hierviz kernel-bench --out DIR [--tune] [--shape K,N,G ...] [--ms 1,2,4,...] [--marlin-src DIR]
    python -m hierviz kernel-bench --cpu --out DIR      # int4pack_cpu vs fp32 dense (SmolLM2 shape)
    (KERNEL_BENCH_THREADS=N sets torch's CPU threads for the --cpu run)

On a CUDA device: one weight matrix (default Llama-3-70B up-projection K=8192, N=28672,
group 128, synthetic codes), every M in --ms, the kernels side by side in one process (Marlin
where --marlin-src names its source and a compiler is found: hierviz.measure.marlin_peer;
GemLite where the package is installed: hierviz.measure.gemlite_peer; FBGEMM's mixed-input GEMM
where its wheel matches the torch: hierviz.measure.fbgemm_peer),
timed as CUDA-graph replays (launch overhead out, as in the engine) with 3 rotating copies of
every weight so that the 60 MB L2 cannot serve repeated reads. Prints a table and writes
DIR/kernel_bench.json (+ a chart). Correctness of each kernel against the dequantized
reference is checked at every M. --tune first sweeps Triton launch configurations per M and
uses the best; the winners are what hierviz.quant.triton_w4.TUNED holds.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from hierviz.config import options
from hierviz.machine import machine_info
from hierviz.measure.common import median_seconds, stamp, write_json
from hierviz.measure.fbgemm_peer import fbgemm_layers
from hierviz.measure.gemlite_peer import gemlite_layers
from hierviz.measure.marlin_peer import marlin_operands
from hierviz.models.synthetic import random_w4
from hierviz.quant.w4 import W4Weight, codes_of, dequantize, quantize_rtn, unpack_codes

ROTATE = 3  # weight copies cycled through while timing (> L2 in total)


# ---- timing ---------------------------------------------------------------------------------

def _graph_time_us(fns: list[Callable[[], object]], rep_ms: float) -> float:
    """Median time of one call, from CUDA-graph replays; calls cycle through `fns`."""
    import triton.testing

    state = {"i": 0}

    def fn() -> None:
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    for f in fns:  # compile / build caches outside the capture
        f()
    torch.cuda.synchronize()
    return 1000.0 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def _copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200, return_mode="median")
    return 2 * n / (ms * 1e-3)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.float()
    if not torch.isfinite(y).all():
        return float("inf")
    return float((y - ref).norm() / ref.norm())


# ---- weights --------------------------------------------------------------------------------

def tinygemm_pack(w: W4Weight, swap_nibbles: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch._weight_int4pack_mm operands: packed int4 weight and bf16 [K/G, N, 2] scale/zero.

    tinygemm computes (q - 8) * scale + zero, so zero = offset + 8 * scale. Its converter
    takes uint8 [N, K/2]; which nibble holds the even element is checked against the
    reference by the caller (swap_nibbles)."""
    q = unpack_codes(codes_of(w))
    even, odd = q[:, 0::2], q[:, 1::2]
    u8 = ((even << 4) | odd) if swap_nibbles else ((odd << 4) | even)
    packed = torch.ops.aten._convert_weight_to_int4pack(u8.to(torch.uint8).contiguous(), 8)
    s = w.scales.float()
    z = w.offsets.float() + 8.0 * s
    sz = torch.stack([s.t(), z.t()], dim=-1).contiguous().to(torch.bfloat16)
    return packed, sz


# ---- Triton tuning candidates ---------------------------------------------------------------

def tune_candidates(m: int, family: str = "all"):
    """The launch configurations --tune times at M (see docs/kernels.md). family "gemv": only
    the CUDA-core path's, plus the production MMA entry for that M (pick_config) to beat."""
    from hierviz.quant.triton_w4 import Config

    out = []
    if m == 1:
        # the CUDA-core path (fp16, one token per program)
        for bn, bq, warps in [(64, 4, 4), (128, 4, 4), (256, 4, 8), (64, 4, 2), (128, 2, 4)]:
            for split in (4, 8):
                for stages in (1, 2):   # 2: the next iteration's loads issued first
                    out.append(Config(bn, 1, split, warps, stages, gemv=True, block_q=bq))
    if family == "gemv":
        return out
    if m <= 16:
        # earlier winners for reference: pointer loads; TMA codes; TMA for every load
        out.append(Config(128, 16, 4, 8, 4))
        out.append(Config(128, 16, 2, 4, 4, use_asm=False))
        out.append(Config(128, 16, 4, 4, 4, tma=True, tma_sox=True))
        for split in (4, 8):
            out.append(Config(64, 16, split, 4, 4, tma=True))
            out.append(Config(64, 16, split, 4, 3, tma=True, tiled=True))
        # scale and offset per group (short unpack), +- tile-major codes
        for bn, warps, stages in [(64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 4, 4), (128, 8, 4)]:
            for split in (2, 4, 8):
                for tiled in (False, True):
                    out.append(Config(bn, 16, split, warps, stages, tma=True, factored=True,
                                      tiled=tiled))
    else:
        bm = 32 if m <= 32 else 64 if m <= 64 else 128
        if m <= 64:   # the factored small-M kernel with a wider token tile
            for bn, warps in [(64, 4), (128, 4), (128, 8)]:
                for split in (1, 2, 4):
                    out.append(Config(bn, bm, split, warps, 4, tma=True, factored=True))
        for bn, warps, stages in [(64, 4, 4), (128, 8, 3)]:
            for split in ((1, 2) if m <= 64 else (1,)):
                out.append(Config(bn, bm, split, warps, stages))
        out.append(Config(128, bm, 1, 4, 3, use_asm=False))
        for bn, warps, stages in [(128, 4, 3), (128, 8, 3), (128, 8, 4)]:
            for split in ((1, 2) if m <= 64 else (1,)):
                out.append(Config(bn, bm, split, warps, stages, tma=True))
                out.append(Config(bn, bm, split, warps, stages, tma=True, tma_sox=True))
                out.append(Config(bn, bm, split, warps, stages, tma=True, tiled=True))
                out.append(Config(bn, bm, split, warps, stages, tma=True, tma_sox=True, tiled=True))
    return out


# ---- the GPU benchmark ----------------------------------------------------------------------

def _bench_device(dry: bool) -> tuple[str, dict, Callable]:
    """The device, the run's facts and the timer: CUDA-graph replays, or (dry) one CPU call."""
    import triton
    if dry:
        dev, name, sms, bw = "cpu", "cpu (dry run)", 0, 1e11
        timer = lambda fns, rep_ms: _cpu_time_us(fns[0], 0.01)  # noqa: E731
    else:
        dev, timer = "cuda", _graph_time_us
        props = torch.cuda.get_device_properties(0)
        name, sms, bw = props.name, props.multi_processor_count, _copy_bandwidth()
    info = {"device": name, "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
            "machine": machine_info(dev),
            "timing": f"CUDA-graph replay median, {ROTATE} rotating weight copies", "copy_bandwidth_TBps": bw / 1e12}
    print(f"{name}, {sms} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return dev, info, timer


def _tinygemm_operands(ws: list[W4Weight], ref_w: torch.Tensor, g: int, dev: str, info: dict) -> Optional[list]:
    """tinygemm's packed operands per weight copy, in whichever nibble order matches the reference."""
    try:
        xt = torch.randn(4, ws[0].in_features, device=dev, dtype=torch.bfloat16)
        want = xt.float() @ ref_w.t()
        for swap in (True, False):
            p0 = tinygemm_pack(ws[0], swap)
            if _rel_err(torch.ops.aten._weight_int4pack_mm(xt, p0[0], g, p0[1]), want) < 2e-2:
                info["tinygemm_even_nibble_high"] = swap
                return [p0] + [tinygemm_pack(w, swap) for w in ws[1:]]
        info["tinygemm_error"] = "no nibble order matched the reference"
    except Exception as e:  # keep the rest of the run alive
        info["tinygemm_error"] = repr(e)[:300]
    return None


def _tune(ws: list[W4Weight], ref_w: torch.Tensor, dev: str, ms: list[int], family: str,
          timer: Callable) -> tuple[list[dict], dict[int, object]]:
    """Every candidate config per M, timed where its result is right; the fastest per M."""
    from hierviz.quant.triton_w4 import pick_config, sm_count, triton_w4_matmul
    n, k, g = ws[0].out_features, ws[0].in_features, ws[0].group_size
    rows, best_cfg = [], {}
    t0 = time.time()
    for m in ms:
        xs = [torch.randn(m, k, device=dev, dtype=torch.float16) for _ in ws]
        want = xs[0].float() @ ref_w.t()
        best = None
        cands = tune_candidates(m, family)
        if family != "all":
            cands.append(pick_config(m, n, k, g, sm_count(torch.device(dev)), gemv=False))
        for cfg in cands:
            row = {"M": m, **asdict(cfg)}
            try:
                row["rel_err"] = err = _rel_err(triton_w4_matmul(xs[0], ws[0], cfg), want)
                if err > 1e-2:
                    row["error"] = "wrong result"
                else:
                    row["us"] = timer([lambda x=x, w=w: triton_w4_matmul(x, w, cfg) for x, w in zip(xs, ws)], rep_ms=10)
                    if best is None or row["us"] < best[0]:
                        best = (row["us"], cfg)
            except Exception as e:
                row["error"] = repr(e)[:300]
            rows.append(row)
            print("tune", row, flush=True)
        if best is not None:
            best_cfg[m] = best[1]
    print(f"tuning took {time.time() - t0:.0f} s", flush=True)
    return rows, best_cfg


def _triton_timings(row: dict, x16: list, xbf: list, ws: list[W4Weight], cfg, cfg_bf16, want: torch.Tensor,
                    ref_w: torch.Tensor, timer: Callable, rep_ms: float) -> None:
    from hierviz.quant import triton_w4
    from hierviz.quant.triton_w4 import triton_w4_matmul
    row["triton_err"] = _rel_err(triton_w4_matmul(x16[0], ws[0], cfg), want)
    # the default split-K (HIERVIZ_W4_DETERMINISTIC) next to atomic adds, and whether 20
    # repeats of one product give the same bits in each mode
    for mode, ordered in (("", options().w4_deterministic), ("_atomic", False)):
        with triton_w4.split_k_mode(ordered):
            row[f"triton{mode}_us"] = timer([lambda x=x, w=w: triton_w4_matmul(x, w, cfg) for x, w in zip(x16, ws)], rep_ms)
            first = triton_w4_matmul(x16[0], ws[0], cfg)
            row[f"triton{mode}_repeatable"] = all(torch.equal(first, triton_w4_matmul(x16[0], ws[0], cfg))
                                                  for _ in range(20))
    wantb = xbf[0].float() @ ref_w.t()
    row["triton_bf16_err"] = _rel_err(triton_w4_matmul(xbf[0], ws[0], cfg_bf16), wantb)
    row["triton_bf16_us"] = timer([lambda x=x, w=w: triton_w4_matmul(x, w, cfg_bf16) for x, w in zip(xbf, ws)], rep_ms)


def _time_peer(row: dict, name: str, layers: list, x16: list[torch.Tensor], want: torch.Tensor,
               timer: Callable, rep_ms: float) -> None:
    """A peer kernel's error against its own weight's product and its time, into row; a peer that
    fails at this M records why (`<name>_error`) and the other columns still run."""
    try:
        row[f"{name}_err"] = _rel_err(layers[0](x16[0]), want)
        row[f"{name}_us"] = timer([lambda x=x, lay=lay: lay(x) for x, lay in zip(x16, layers)], rep_ms)
    except Exception as e:
        row[f"{name}_error"] = repr(e)[:300]


def cuda_mma_layers(ws: list[W4Weight], info: dict) -> Optional[list]:
    """The CUDA MMA variant (hierviz.quant.cuda_w4) as one product per weight copy, or None with
    the reason in info["cuda_mma_error"] (no NVRTC, a GPU before sm_80, a shape it does not take)."""
    from hierviz.quant import cuda_w4
    w = ws[0]
    if not cuda_w4.supports_shape(w.out_features, w.in_features, w.group_size):
        info["cuda_mma_error"] = f"the CUDA MMA kernel does not take {w.out_features}x{w.in_features} g{w.group_size}"
        return None
    if not cuda_w4.available(torch.device("cuda")):
        info["cuda_mma_error"] = cuda_w4.unavailable_reason(torch.device("cuda"))
        return None
    info["cuda_mma_nvrtc"] = cuda_w4.nvrtc_version()
    return [lambda x, w=w: cuda_w4.matmul(x, w) for w in ws]


def _bench_row(m: int, ws: list[W4Weight], dense: list, ref_w: torch.Tensor, tiny: Optional[list],
               best_cfg: dict, dev: str, timer: Callable, rep_ms: float, dry: bool,
               marlin: Optional[tuple[list, torch.Tensor]] = None, gemlite: Optional[list] = None,
               cuda_mma: Optional[list] = None, fbgemm: Optional[list] = None) -> dict:
    """cuBLAS fp16, tinygemm, Marlin, GemLite, FBGEMM, the CUDA MMA variant and the Triton kernel
    (both split-K modes, fp16 and bf16) at M rows."""
    from hierviz.quant.triton_w4 import invariant_config, pick_config, sm_count, triton_w4_matmul
    n, k, g = ws[0].out_features, ws[0].in_features, ws[0].group_size
    x16 = [torch.randn(m, k, device=dev, dtype=torch.float16) for _ in ws]
    xbf = [x.to(torch.bfloat16) for x in x16]
    want = x16[0].float() @ ref_w.t()
    up = [t for t in sorted(best_cfg) if t >= m]      # untuned M: the next tuned M up's winner (same path)
    sms = sm_count(torch.device(dev))
    cfg = best_cfg[up[0]] if up else pick_config(m, n, k, g, sms)
    cfg_bf16 = cfg if up else pick_config(m, n, k, g, sms, bf16=True)
    row: dict = {"M": m, "triton_config": asdict(cfg)}
    if cfg_bf16 != cfg:
        row["triton_bf16_config"] = asdict(cfg_bf16)
    row["cublas_fp16_us"] = timer([lambda x=x, d=d: x @ d.t() for x, d in zip(x16, dense)], rep_ms)
    row["cublas_fp16_err"] = _rel_err(x16[0] @ dense[0].t(), want)
    if tiny is not None:
        row["tinygemm_err"] = _rel_err(torch.ops.aten._weight_int4pack_mm(xbf[0], tiny[0][0], g, tiny[0][1]),
                                       xbf[0].float() @ ref_w.t())
        row["tinygemm_us"] = timer([lambda x=x, t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], g, t[1])
                                    for x, t in zip(xbf, tiny)], rep_ms)
    if marlin is not None:        # its own symmetric weights: same shape and bytes
        _time_peer(row, "marlin", marlin[0], x16, x16[0].float() @ marlin[1].t(), timer, rep_ms)
    if gemlite is not None:       # the engine's own weights
        _time_peer(row, "gemlite", gemlite, x16, want, timer, rep_ms)
    if fbgemm is not None:        # the engine's own weights, bf16 activations (its only form)
        _time_peer(row, "fbgemm", fbgemm, xbf, xbf[0].float() @ ref_w.t(), timer, rep_ms)
    if cuda_mma is not None:      # the engine's CUDA MMA variant on its own weights
        _time_peer(row, "cuda_mma", cuda_mma, x16, want, timer, rep_ms)
    try:
        _triton_timings(row, x16, xbf, ws, cfg, cfg_bf16, want, ref_w, timer, rep_ms)
        # the batch-invariant mode: what a target's weights run (hierviz.quant.triton_w4.invariant_config)
        inv = invariant_config(m, n, k, g, sms)
        row["triton_invariant_config"] = asdict(inv)
        row["triton_invariant_us"] = timer([lambda x=x, w=w: triton_w4_matmul(x, w, inv) for x, w in zip(x16, ws)],
                                           rep_ms)
    except Exception as e:
        row["triton_error"] = repr(e)[:300]
    if m == 1 and not dry:  # launch overhead, for the record: plain launches, no graph
        import triton.testing
        row["triton_eager_us"] = 1000 * triton.testing.do_bench(lambda: triton_w4_matmul(x16[0], ws[0], cfg),
                                                                return_mode="median")
        row["cublas_fp16_eager_us"] = 1000 * triton.testing.do_bench(lambda: x16[0] @ dense[0].t(), return_mode="median")
    return row


def gpu_bench(k: int, n: int, g: int, ms: list[int], tune: bool, rep_ms: float,
              dry: bool = False, tune_ms: Optional[list[int]] = None, family: str = "all",
              marlin_src: Optional[str] = None, build_dir: Optional[Path] = None) -> dict:
    """dry: run the same code on the CPU under TRITON_INTERPRET=1 (tiny shapes; no timing value)."""
    from hierviz.quant import triton_w4
    dev, info, timer = _bench_device(dry)
    info["shape"] = {"K": k, "N": n, "G": g}
    ws = [random_w4(n, k, g, torch.float16, dev, torch.Generator(device=dev).manual_seed(seed)) for seed in range(ROTATE)]
    info["w4_bytes"] = w_bytes = ws[0].codes.numel() + 2 * ws[0].scales.numel() * 2  # fp16 scales + offsets
    info["floor_us"] = floor_us = w_bytes / (info["copy_bandwidth_TBps"] * 1e12) * 1e6
    dense = [dequantize(w, torch.float16) for w in ws]
    ref_w = dequantize(ws[0], torch.float32)
    tiny = _tinygemm_operands(ws, ref_w, g, dev, info)
    print("tinygemm:", info.get("tinygemm_error", "ok"), flush=True)
    if dry:      # a CPU rehearsal of this code: the peers need a GPU
        for peer in ("marlin", "gemlite", "fbgemm", "cuda_mma"):
            info[f"{peer}_error"] = "not run in a dry run"
    marlin = None if dry else marlin_operands(marlin_src, k, n, g, ROTATE, build_dir or options().cache_dir / "marlin",
                                              info)
    print("marlin:", info.get("marlin_error", f"ok ({info.get('marlin_build')} build)"), flush=True)
    gemlite = None if dry else gemlite_layers(ws, info)
    cuda_mma = None if dry else cuda_mma_layers(ws, info)
    fbgemm = None if dry else fbgemm_layers(ws, info)
    print("gemlite:", info.get("gemlite_error", f"ok ({info.get('gemlite_version')})"), flush=True)
    print("fbgemm:", info.get("fbgemm_error", f"ok ({info.get('fbgemm_version')})"), flush=True)
    tune_rows, best_cfg = _tune(ws, ref_w, dev, tune_ms or ms, family, timer) if tune else ([], {})
    rows = []
    for m in ms:
        row = _bench_row(m, ws, dense, ref_w, tiny, best_cfg, dev, timer, rep_ms, dry, marlin, gemlite, cuda_mma,
                         fbgemm)
        row["floor_us"] = floor_us
        rows.append(row)
        print("bench", row, flush=True)
    return {"info": info, "rows": rows, "tune": tune_rows,
            "tuned": {m: asdict(c) for m, c in best_cfg.items()},
            "package_tuned": {b: asdict(c) for b, c in triton_w4.TUNED.items()}}


# ---- the CPU benchmark (int4pack_cpu) -------------------------------------------------------

def _cpu_time_us(fn: Callable[[], object], min_s: float = 0.5) -> float:
    return 1e6 * median_seconds(fn, min_s, min_reps=5)


def cpu_bench(k: int, n: int, g: int, ms: list[int]) -> dict:
    from hierviz.quant.int4pack_cpu import int4pack_cpu_matmul

    torch.manual_seed(0)
    if os.environ.get("KERNEL_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["KERNEL_BENCH_THREADS"]))
    w = quantize_rtn(torch.randn(n, k), g)
    dense = dequantize(w, torch.float32)
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        want = x.double() @ dense.double().t()
        row = {"M": m,
               "int4pack_cpu_err": _rel_err(int4pack_cpu_matmul(x, w).double(), want.float()),
               "int4pack_cpu_us": _cpu_time_us(lambda: int4pack_cpu_matmul(x, w)),
               "fp32_dense_us": _cpu_time_us(lambda: x @ dense.t()),
               "reference_us": _cpu_time_us(lambda: x @ dequantize(w, torch.float32).t())}
        rows.append(row)
        print("cpu", row, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "load_average_1min": load,
            "torch": torch.__version__, "machine": machine_info("cpu"), "shape": {"K": k, "N": n, "G": g},
            "timing": "wall-clock median"}
    return {"info": info, "rows": rows}


# ---- output ---------------------------------------------------------------------------------

# every timed column, in the table's order; the chart leaves out the variants of one kernel
COLUMNS = ("cublas_fp16_us", "tinygemm_us", "marlin_us", "gemlite_us", "fbgemm_us", "cuda_mma_us", "triton_us",
           "triton_invariant_us", "triton_atomic_us", "triton_bf16_us", "floor_us", "int4pack_cpu_us",
           "fp32_dense_us", "reference_us")
NOT_CHARTED = ("cuda_mma_us", "triton_invariant_us", "triton_atomic_us", "triton_bf16_us", "reference_us")


def table(res: dict) -> str:
    rows = res["rows"]
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    lines = ["| M | " + " | ".join(c.replace("_us", " (us)") for c in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        cells = [f"{r[c]:.1f}" if isinstance(r.get(c), float) else "-" for c in cols]
        lines.append(f"| {r['M']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_chart(res: dict, out: Path, stem: str = "kernel_bench") -> Optional[Path]:
    rows = res["rows"]
    series = [c for c in COLUMNS if c not in NOT_CHARTED and any(c in r for r in rows)]
    xs = [r["M"] for r in rows]
    try:
        import plotly.graph_objects as go

        fig = go.Figure()
        for c in series:
            fig.add_trace(go.Scatter(x=xs, y=[r.get(c) for r in rows], mode="lines+markers",
                                     name=c.replace("_us", ""),
                                     line={"dash": "dot"} if c == "floor_us" else None))
        fig.update_layout(title=f"W4A16 matmul, {res['info']['device']}, {res['info']['shape']}",
                          xaxis={"title": "M (tokens)", "type": "log"},
                          yaxis={"title": "microseconds", "type": "log"})
        path = out / f"{stem}.html"
        fig.write_html(path, include_plotlyjs="cdn")
        return path
    except ImportError:
        pass
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in series:
            ax.plot(xs, [r.get(c, math.nan) for r in rows], marker="o", label=c.replace("_us", ""),
                    linestyle=":" if c == "floor_us" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("microseconds")
        ax.set_title(f"W4A16 matmul, {res['info']['device']}")
        ax.legend()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        return path
    except ImportError:
        return None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz kernel-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", action="append", default=None,
                    help="K,N,G (default 8192,28672,128 GPU; 576,1536,32 CPU); repeat it for several shapes "
                         "in one process (one JSON each, named by the shape)")
    ap.add_argument("--ms", default=None, help="comma-separated token counts")
    ap.add_argument("--tune", action="store_true", help="sweep Triton configs per M first")
    ap.add_argument("--tune-ms", default=None, help="token counts to tune at (default: all of --ms)")
    ap.add_argument("--cpu", action="store_true", help="int4pack_cpu benchmark even with a GPU")
    ap.add_argument("--rep-ms", type=float, default=40.0, help="timing budget per measurement")
    ap.add_argument("--family", choices=["all", "gemv"], default="all",
                    help="tuning candidates: all, or only the CUDA-core path's (plus the production entry)")
    ap.add_argument("--marlin-src", default=None,
                    help="a checkout of github.com/IST-DASLab/marlin: built with torch's extension builder and "
                         "timed beside the others (skipped, with the reason, without it or without nvcc)")
    ap.add_argument("--dry", action="store_true", help=argparse.SUPPRESS)  # CPU rehearsal
    a = ap.parse_args(argv)
    use_gpu = (torch.cuda.is_available() or a.dry) and not a.cpu
    try:
        shapes = [tuple(int(v) for v in shape.split(","))
                  for shape in (a.shape or ["8192,28672,128" if use_gpu else "576,1536,32"])]
        if any(len(shape) != 3 or min(shape) <= 0 for shape in shapes):
            raise ValueError("three positive numbers")
    except ValueError:
        ap.error(f"--shape takes K,N,G (three positive integers), got {a.shape}")
    ms = [int(v) for v in (a.ms or ("1,2,4,8,16,32,64,128" if use_gpu else "1,8,64")).split(",")]
    tune_ms = [int(v) for v in a.tune_ms.split(",")] if a.tune_ms else None
    a.out.mkdir(parents=True, exist_ok=True)
    for k, n, g in shapes:
        res = (gpu_bench(k, n, g, ms, a.tune, a.rep_ms, a.dry, tune_ms, a.family, a.marlin_src)
               if use_gpu
               else cpu_bench(k, n, g, ms))
        stem = ("kernel_bench" if use_gpu else "kernel_bench_cpu") + (f"_{k}x{n}g{g}" if len(shapes) > 1 else "")
        write_json(a.out / f"{stem}.json", stamp(res, "kernel-bench", argv))
        print(f"K={k} N={n} group {g}")
        print(table(res))
        chart = write_chart(res, a.out, stem if len(shapes) > 1 else "kernel_bench")
        print(f"wrote {a.out / f'{stem}.json'}" + (f" and {chart}" if chart else ""))
    return 0


if __name__ == "__main__":
    main()
