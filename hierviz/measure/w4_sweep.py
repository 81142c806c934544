"""Correctness sweep of the Triton W4A16 product over the shapes users run.

    python -m hierviz w4-sweep --out DIR                  # every preset model shape (GPU)
    python -m hierviz w4-sweep --shapes 256x192 --rows 1-24,40 --out DIR   # any shapes (CPU:
                                                          # TRITON_INTERPRET=1)

For every weight shape of the models the presets name (fused q/k/v and gate/up as the engine
loads them, and the unfused ones), every group size (32, 64, 128, per-channel), without and with
act-order (a random input permutation, checked against the unpermuted matrix), every path
(`tma`: what Hopper runs; `pointer`: TMA and the CUDA-core kernel forced off, what an A100 and
an unproven GPU run) and both modes (`normal`; `invariant`: a verifier's batch-invariant
weight), every row count of --rows (default 1..128 and prefill chunks up to 2048) is computed
with the configuration the product picks itself and compared with a dequantized fp32 reference
row by row (relative error above kernel_guard.TOLERANCE, or a non-finite value, is a wrong row).
In invariant mode every row of an M-row product must also equal, bit for bit, the same row
computed alone. Prints one line per (shape, group, act-order, path, mode) and writes
DIR/w4_sweep.json; exits 1 when any row is wrong.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from hierviz.machine import gpu_name
from hierviz.quant import kernel_guard
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight, dequantize_unpermuted

# hidden, intermediate, key/value width (kv heads x head dim) of the models the presets name
MODELS: dict[str, tuple[int, int, int]] = {
    "llama-2-7b": (4096, 11008, 4096), "llama-2-13b": (5120, 13824, 5120), "llama-2-70b": (8192, 28672, 1024),
    "llama-3-8b": (4096, 14336, 1024), "llama-3-70b": (8192, 28672, 1024), "vicuna-13b": (5120, 13824, 5120),
    "mistral-7b": (4096, 14336, 1024), "qwen2.5-7b": (3584, 18944, 512), "qwen2.5-14b": (5120, 13824, 1024),
    "qwen2.5-32b": (5120, 27648, 1024), "qwen2.5-72b": (8192, 29568, 1024),
}
PREFILL_ROWS = [129, 160, 192, 255, 256, 320, 384, 511, 512, 640, 768, 1000, 1024, 1536, 2047, 2048]


def model_shapes(names: list[str]) -> dict[tuple[int, int], list[str]]:
    """(K, N) -> the layers that have it: fused qkv and gate_up (what the engine multiplies) and
    the separate q/o, k/v, gate/up and down projections."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name in names:
        h, inter, kv = MODELS[name]
        for layer, kn in (("qkv", (h, h + 2 * kv)), ("q/o", (h, h)), ("k/v", (h, kv)),
                          ("gate_up", (h, 2 * inter)), ("gate/up", (h, inter)), ("down", (inter, h))):
            shapes.setdefault(kn, []).append(f"{name}:{layer}")
    return shapes


def parse_rows(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            out.extend(range(int(lo), int(hi) + 1))
        elif part:
            out.append(int(part))
    return sorted(set(out))


def synthetic_weight(n: int, k: int, g: int, device: str, seed: int, act_order: bool,
                     dtype: torch.dtype) -> W4Weight:
    """Random codes with GPTQ-like scales and zero points; act_order adds a random permutation."""
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.rand(n, k // g, device=device, generator=gen) * 0.02 + 0.002
    zeros = torch.randint(6, 10, (n, k // g), device=device, generator=gen).to(scales.dtype)
    perm = torch.randperm(k, device=device, generator=gen) if act_order else None
    return W4Weight(codes, scales.to(dtype), (-scales * zeros).to(dtype), g, perm)


def _product(x: torch.Tensor, w: W4Weight, path: str) -> torch.Tensor:
    """x @ W.T through the product's own configuration choice, with the older-GPU path forced
    when path == 'pointer' (no check, no fallback: the raw kernel is what is measured)."""
    from hierviz.quant import triton_w4
    xp = x.index_select(-1, w.perm) if w.perm is not None else x
    cfg = triton_w4.chosen_config(xp, w, hopper_paths=path == "tma")
    return triton_w4.triton_w4_matmul(xp, w, config=cfg)


def sweep_weight(k: int, n: int, g: int, act_order: bool, dtype: torch.dtype, rows: list[int], paths: list[str],
                 modes: list[str], device: str, seed: int) -> list[dict]:
    """Every (path, mode) of one weight: the rows counts whose product had a wrong row."""
    w = synthetic_weight(n, k, g, device, seed, act_order, dtype)
    m_max = max(rows)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(m_max, k, device=device, generator=gen).to(dtype)
    ref = x.float() @ dequantize_unpermuted(w, torch.float32).t()
    tol = kernel_guard.TOLERANCE[dtype]
    results = []
    for path in paths:
        for mode in modes:
            w.batch_invariant = mode == "invariant"
            ms = [m for m in rows if mode == "normal" or m <= INVARIANT_MAX_ROWS]
            if not ms:
                continue
            bits = []
            alone = None
            # Bit-invariance is a property of the GPU's MMA (each output's K order fixed whatever
            # the tile): the interpreter's numpy matmul rounds by its own blocking, so it is
            # checked on CUDA only.
            if mode == "invariant" and x.is_cuda:
                n_alone = min(max(ms), INVARIANT_MAX_ROWS)
                alone = torch.cat([_product(x[r:r + 1], w, path) for r in range(n_alone)])
            errs = []
            for m in ms:
                y = _product(x[:m], w, path)
                e = kernel_guard.row_errors(y, ref[:m])
                errs.append(e.max())
                if alone is not None:
                    bits.append(torch.ne(y, alone[:m]).any(dim=-1).sum())
            errs_t = torch.stack(errs).cpu()
            worst = float(errs_t.max())
            wrong = [m for m, e in zip(ms, errs_t.tolist()) if not e <= tol]
            bits_t = torch.stack(bits).cpu().tolist() if bits else []
            not_invariant = [m for m, b in zip(ms, bits_t) if b]
            results.append({"K": k, "N": n, "group": g, "act_order": act_order, "dtype": str(dtype).split(".")[-1],
                            "path": path, "mode": mode, "rows_checked": len(ms), "wrong_rows_at": wrong,
                            "not_bit_invariant_at": not_invariant, "worst_rel_err": worst, "tolerance": tol})
    return results


def _run(jobs: list[tuple], rows: list[int], paths: list[str], modes: list[str], device: str,
         dtypes: list[torch.dtype], log) -> list[dict]:
    out = []
    for (k, n), layers, g, act in jobs:
        for dt in dtypes:
            t0 = time.perf_counter()
            res = sweep_weight(k, n, g, act, dt, rows, paths, modes, device, seed=k * 7 + n + g)
            if device == "cuda":
                torch.cuda.empty_cache()    # workers share one GPU: hand each weight's memory back
            for r in res:
                r["layers"] = layers
                bad = r["wrong_rows_at"] or r["not_bit_invariant_at"]
                log(f"{'WRONG' if bad else 'ok   '} K={k:5d} N={n:5d} g={g:5d} act={int(act)} {r['dtype']} "
                    f"{r['path']:7s} {r['mode']:9s} rows={r['rows_checked']:3d} worst={r['worst_rel_err']:.1e}"
                    + (f" wrong at {r['wrong_rows_at'][:12]}" if r["wrong_rows_at"] else "")
                    + (f" not invariant at {r['not_bit_invariant_at'][:12]}" if r["not_bit_invariant_at"] else "")
                    + f" ({time.perf_counter() - t0:.1f}s) [{', '.join(layers[:3])}{'...' if len(layers) > 3 else ''}]")
            out.extend(res)
    return out


def _worker(args: tuple) -> list[dict]:
    jobs, rows, paths, modes, device, dtypes = args
    return _run(jobs, rows, paths, modes, device, [getattr(torch, d) for d in dtypes],
                lambda s: print(s, flush=True))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hierviz w4-sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write DIR/w4_sweep.json")
    ap.add_argument("--models", default="all", help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--shapes", default=None, help="KxN[,KxN...] instead of --models")
    ap.add_argument("--groups", default="32,64,128,channel", help="group sizes; 'channel' = per-channel (G = K)")
    ap.add_argument("--act-order", default="both", choices=["both", "off", "on"])
    ap.add_argument("--rows", default=None, help="row counts, e.g. 1-128,256 (default 1-128 and prefill chunks to 2048)")
    ap.add_argument("--paths", default=None, help="tma,pointer (default both on a TMA GPU, else pointer)")
    ap.add_argument("--modes", default="normal,invariant")
    ap.add_argument("--dtypes", default="float16", help="float16,bfloat16")
    ap.add_argument("--workers", type=int, default=1, help="processes sharing the GPU (compiles run in parallel)")
    a = ap.parse_args(argv)
    from hierviz.quant import triton_w4
    if not triton_w4.HAVE_TRITON:
        print("error: w4-sweep needs the triton package", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_w4.interpreting():
        print("error: w4-sweep needs a CUDA GPU, or TRITON_INTERPRET=1 on the CPU", file=sys.stderr)
        return 2
    if a.shapes:
        shapes = {tuple(int(v) for v in s.lower().split("x")): [f"{s}"] for s in a.shapes.split(",")}
    else:
        names = list(MODELS) if a.models == "all" else a.models.split(",")
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            print(f"error: unknown model(s) {unknown}; choose from {', '.join(MODELS)}", file=sys.stderr)
            return 2
        shapes = model_shapes(names)
    rows = parse_rows(a.rows) if a.rows else list(range(1, 129)) + PREFILL_ROWS
    has_tma = device == "cpu" or torch.cuda.get_device_capability()[0] >= 9
    paths = a.paths.split(",") if a.paths else (["tma", "pointer"] if has_tma else ["pointer"])
    acts = {"both": [False, True], "off": [False], "on": [True]}[a.act_order]
    jobs = []
    for (k, n), layers in sorted(shapes.items()):
        for gs in a.groups.split(","):
            g = k if gs == "channel" else int(gs)
            if k % g or not triton_w4.supports(W4Weight(torch.zeros(1, k // 2, dtype=torch.uint8),
                                                        torch.zeros(1, k // g), torch.zeros(1, k // g), g)):
                continue
            for act in acts:
                jobs.append(((k, n), layers, g, act))
    t0 = time.perf_counter()
    dtypes = a.dtypes.split(",")
    if a.workers > 1:
        import multiprocessing as mp
        chunks = [jobs[i::a.workers] for i in range(a.workers)]
        with mp.get_context("spawn").Pool(a.workers) as pool:
            results = [r for part in pool.map(_worker, [(c, rows, paths, a.modes.split(","), device, dtypes)
                                                        for c in chunks]) for r in part]
    else:
        results = _worker((jobs, rows, paths, a.modes.split(","), device, dtypes))
    wrong = [r for r in results if r["wrong_rows_at"]]
    variant = [r for r in results if r["not_bit_invariant_at"]]
    products = sum(r["rows_checked"] for r in results)
    summary = {"products": products, "weights": len(jobs) * len(dtypes), "cases": len(results),
               "cases_with_wrong_rows": len(wrong), "cases_not_bit_invariant": len(variant),
               "seconds": round(time.perf_counter() - t0, 1)}
    print(f"w4-sweep: {products} products over {len(results)} (shape, group, act-order, dtype, path, mode) cases: "
          f"{len(wrong)} with wrong rows, {len(variant)} not bit-invariant ({summary['seconds']} s)")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        env = {"torch": torch.__version__, "python": platform.python_version(),
               "triton": kernel_guard.triton_version(), "device": gpu_name(device) or "cpu (TRITON_INTERPRET=1)", "command": "python -m hierviz w4-sweep " + " ".join(
                   argv if argv is not None else sys.argv[1:])}
        (a.out / "w4_sweep.json").write_text(json.dumps({"env": env, "summary": summary, "results": results}, indent=1))
    return 1 if wrong or variant else 0


if __name__ == "__main__":
    sys.exit(main())
