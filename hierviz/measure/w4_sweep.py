"""Correctness sweep of the GPU W4A16 product over the shapes users run.

    python -m hierviz w4-sweep --out DIR                  # every preset model shape (GPU)
    python -m hierviz w4-sweep --shapes 256x192 --rows 1-24,40 --out DIR   # any shapes (CPU:
                                                          # TRITON_INTERPRET=1)

For every weight shape of the models the presets name (fused q/k/v and gate/up as the engine
loads them, the unfused ones, and the LM head), every group size (32, 64, 128, per-channel), without and with
act-order (a random input permutation, checked against the unpermuted matrix), every path
(`tma`: what Hopper runs in Triton; `cuda`: the CUDA MMA variant, hierviz.quant.cuda_w4;
`pointer`: every fast variant off, what an unproven GPU runs) and both modes (`normal`; `invariant`: a verifier's batch-invariant
weight), every row count of --rows (default 1..128 and prefill chunks up to 2048) is computed
with the configuration the product picks itself and compared with a dequantized fp32 reference
row by row (relative error above kernel_guard.TOLERANCE, or a non-finite value, is a wrong row).
In invariant mode every row of an M-row product must also equal, bit for bit, the same row
computed alone. Prints one line per (shape, group, act-order, path, mode) and writes
DIR/w4_sweep.json; exits 1 when any row is wrong.

    python -m hierviz w4-sweep --quick [--preset NAME | --shapes KxN[gG],...] [--rows ...]

runs the start-up proof (hierviz.quant.w4_proof.prove) instead: the fast variants this GPU
supports, on a preset's W4 shapes from its bundled config (no checkpoint is loaded; default
the paper preset) or on --shapes (group 128 unless gG is given), at the proof's row counts.
Prints the verdict line a stack load would show and the time, records the verdict in the
platform's cache (a later start then skips these shapes) and DIR/w4_proof.json with --out;
exits 1 when a variant fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from hierviz.config import overrides
from hierviz.machine import gpu_name, machine_info
from hierviz.measure.common import refuse, stamp, write_json
from hierviz.memory import CONFIGS, PRESET_SHAPES
from hierviz.models.config import ModelConfig
from hierviz.quant import kernel_guard
from hierviz.quant.formats import get_format
from hierviz.quant.w4 import FORMAT as W4A16
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight
from hierviz.quant.w4_proof import PROOF_ROWS, check_products, prove, reference, synthetic_weight
from hierviz.quant.w4_verdicts import CUDA_VARIANT, TRITON_VARIANTS, Shape

# hidden, intermediate, key/value width (kv heads x head dim) and vocabulary of the models the
# presets name, and of the offline default (SmolLM2-135M), whose W4 shapes also run on a GPU
MODELS: dict[str, tuple[int, int, int, int]] = {
    "smollm2-135m": (576, 1536, 192, 49152),
    "llama-2-7b": (4096, 11008, 4096, 32000), "llama-2-13b": (5120, 13824, 5120, 32000),
    "llama-2-70b": (8192, 28672, 1024, 32000), "llama-3-8b": (4096, 14336, 1024, 128256),
    "llama-3-70b": (8192, 28672, 1024, 128256), "vicuna-13b": (5120, 13824, 5120, 32000),
    "mistral-7b": (4096, 14336, 1024, 32000), "qwen2.5-7b": (3584, 18944, 512, 152064),
    "qwen2.5-14b": (5120, 13824, 1024, 152064), "qwen2.5-32b": (5120, 27648, 1024, 152064),
    "qwen2.5-72b": (8192, 29568, 1024, 152064),
}
PREFILL_ROWS = [129, 160, 192, 255, 256, 320, 384, 511, 512, 640, 768, 1000, 1024, 1536, 2047, 2048]


def model_shapes(names: list[str]) -> dict[tuple[int, int], list[str]]:
    """(K, N) -> the layers that have it: fused qkv and gate_up (what the engine multiplies), the
    separate q/o, k/v, gate/up and down projections, and the LM head (an intermediate's may be W4:
    a stack's `intermediate.quantize_lm_head`, the what-if's `--intermediate-lm-head`)."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name in names:
        h, inter, kv, vocab = MODELS[name]
        for layer, kn in (("qkv", (h, h + 2 * kv)), ("q/o", (h, h)), ("k/v", (h, kv)),
                          ("gate_up", (h, 2 * inter)), ("gate/up", (h, inter)), ("down", (inter, h)),
                          ("lm_head", (h, vocab))):
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


QUICK_PRESET = "paper-llama3-70b"
QUICK_GROUP = 128            # the GPU presets' W4 group


def parse_kn(part: str, groups: bool = True) -> tuple[int, int, str]:
    """"KxN" (or "KxNgG" where `groups`) -> (K, N, the G text or ""); ValueError naming the bad entry."""
    kn, _, g = part.strip().lower().partition("g") if groups else (part.strip().lower(), "", "")
    dims = kn.split("x")
    if len(dims) != 2 or not all(d.isdigit() for d in dims) or (g and not g.isdigit()):
        raise ValueError(f"bad shape {part!r}: expected KxN{' or KxNgG' if groups else ''} with whole numbers, "
                         f"e.g. 4096x14336{'g128' if groups else ''}")
    return int(dims[0]), int(dims[1]), g


def parse_shapes(text: str, default_group: int = QUICK_GROUP) -> list[Shape]:
    """"KxN[gG],..." -> [(K, N, G)]; ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        k, n, g = parse_kn(part)
        group = int(g) if g else default_group
        if n < 1 or k < 1 or group < 1 or k % group or not triton_supports(group):
            raise ValueError(f"bad shape {part!r}: the group ({group}) must divide K ({k}) and be 32-256 in "
                             f"multiples of 32 or a larger multiple of 128; N must be at least 1")
        out.append((k, n, group))
    return out


def triton_supports(group: int) -> bool:
    """Whether the Triton kernel takes this group size (a one-row weight of two groups asks it)."""
    from hierviz.quant import triton_w4
    return triton_w4.supports(W4Weight(torch.zeros(1, group, dtype=torch.uint8), torch.zeros(1, 2),
                                       torch.zeros(1, 2), group))


def config_shapes(cfg: ModelConfig, group: int) -> list[Shape]:
    """The W4 products of one model as the engine loads it: fused q/k/v and gate/up, o and down."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    return sorted({(h, q + 2 * kv, group), (q, h, group), (h, 2 * cfg.intermediate_size, group),
                   (cfg.intermediate_size, h, group)})


def preset_shapes(name: str) -> list[Shape]:
    """The W4 shapes of a preset's models, from the bundled configs (hierviz.memory.PRESET_SHAPES)."""
    shapes: set[Shape] = set()
    for file, fmt, group in PRESET_SHAPES[name].values():
        if get_format(fmt) is W4A16:
            cfg = ModelConfig.from_dict(json.loads((CONFIGS / file).read_text(encoding="utf-8")))
            shapes.update(config_shapes(cfg, group))
    return sorted(shapes)


def sweep_device() -> Optional[str]:
    """"cuda", or "cpu" under the Triton interpreter; None (and the reason printed) otherwise."""
    from hierviz.quant import triton_w4
    if not triton_w4.HAVE_TRITON:
        refuse("w4-sweep needs the triton package")
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_w4.interpreting():
        refuse("w4-sweep needs a CUDA GPU, or TRITON_INTERPRET=1 on the CPU")
        return None
    return device


def quick(a: argparse.Namespace) -> int:
    """--quick: the start-up proof on a preset's or the given shapes (see the module docstring)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if a.shapes:
            shapes = parse_shapes(a.shapes)
        else:
            preset = a.preset or QUICK_PRESET
            if preset not in PRESET_SHAPES:
                raise ValueError(f"unknown preset {preset!r}; presets with bundled shapes: {', '.join(PRESET_SHAPES)}")
            if device == "cpu":
                raise ValueError("on the CPU (the Triton interpreter) --quick needs small --shapes, e.g. 256x192g64")
            shapes = preset_shapes(preset)
        try:
            rows = parse_rows(a.rows) if a.rows else PROOF_ROWS
        except ValueError:
            rows = []
        if not rows or min(rows) < 1:
            raise ValueError(f"bad --rows {a.rows!r}: expected row counts from 1 up, e.g. 1-128,256")
        if not set(a.dtypes.split(",")) <= {"float16", "bfloat16"}:
            raise ValueError(f"bad --dtypes {a.dtypes!r}: expected float16 and/or bfloat16")
        dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    except ValueError as e:
        return refuse(str(e))
    if sweep_device() is None:
        return 2
    t0 = time.perf_counter()
    verdicts = []
    for dtype in dtypes:
        verdict = prove(shapes, rows, dtype, device, log=lambda s: print(s, flush=True))
        verdicts.append(verdict)
        print(f"{str(dtype).replace('torch.', '')}: {verdict.summary()}")
    print(f"w4-sweep --quick: {len(shapes)} shape{'s' if len(shapes) != 1 else ''} x {len(rows)} row "
          f"count{'s' if len(rows) != 1 else ''} in {time.perf_counter() - t0:.1f} s")
    if a.out:
        write_json(a.out / "w4_proof.json", [v.to_dict() for v in verdicts])
    failed = any(v.failures(name) for v in verdicts for name in v.supported)
    return 1 if failed else 0


# the fast variants each path may use: `tma` what Hopper runs in Triton, `cuda` the CUDA MMA kernel
# (hierviz.quant.cuda_w4), `pointer` none (what an A100 runs without the CUDA kernel)
PATH_VARIANTS = {"tma": frozenset(TRITON_VARIANTS), "cuda": frozenset({CUDA_VARIANT}),
                 "pointer": frozenset()}


def _product(x: torch.Tensor, w: W4Weight, path: str) -> torch.Tensor:
    """x @ W.T through the product's own configuration choice with only the path's variants
    allowed (no check, no fallback: the raw kernel is what is measured)."""
    from hierviz.quant import triton_w4
    xp = x.index_select(-1, w.perm) if w.perm is not None else x
    with overrides(w4_cuda="on" if path == "cuda" else "off"):     # the cuda path asks for the variant
        cfg = triton_w4.chosen_config(xp, w, variants=PATH_VARIANTS[path])
        return triton_w4.triton_w4_matmul(xp, w, config=cfg)


def sweep_weight(k: int, n: int, g: int, act_order: bool, dtype: torch.dtype, rows: list[int], paths: list[str],
                 modes: list[str], device: str, seed: int) -> list[dict]:
    """Every (path, mode) of one weight: the rows counts whose product had a wrong row."""
    w = synthetic_weight(n, k, g, device, seed, act_order, dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(max(rows), k, device=device, generator=gen).to(dtype)
    ref = reference(x, w)
    tol = kernel_guard.TOLERANCE[dtype]
    results = []
    for path in paths:
        for mode in modes:
            w.batch_invariant = mode == "invariant"
            ms = [m for m in rows if mode == "normal" or m <= INVARIANT_MAX_ROWS]
            if not ms:
                continue
            # Bit-invariance is a property of the GPU's MMA (each output's K order fixed whatever
            # the tile): the interpreter's numpy matmul rounds by its own blocking, so it is
            # checked on CUDA only.
            check = check_products(lambda xs: _product(xs, w, path), x, ref, ms, mode == "invariant", x.is_cuda, tol)
            results.append({"K": k, "N": n, "group": g, "act_order": act_order, "dtype": str(dtype).split(".")[-1],
                            "path": path, "mode": mode, "rows_checked": check.rows_checked,
                            "wrong_rows_at": check.wrong_rows_at, "not_bit_invariant_at": check.not_bit_invariant_at,
                            "worst_rel_err": check.worst_rel_err, "tolerance": tol})
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


# a worker's GPU memory per weight element at its peak: codes, the dequantized reference's
# temporaries and the kernels' layouts (about 13.7 GB measured at 8192 x 152064 on an H100)
PEAK_BYTES_PER_WEIGHT = 10


def worker_peak_bytes(jobs: list[tuple], rows: list[int]) -> int:
    """About the most GPU memory one worker holds: its largest weight's (PEAK_BYTES_PER_WEIGHT an
    element) and, at the most rows, the fp32 reference, the outputs and the input."""
    r = max(rows)
    return max(k * n * PEAK_BYTES_PER_WEIGHT + r * (k + 3 * n) * 4 for (k, n), *_ in jobs)


def workers_that_fit(asked: int, free_bytes: int, peak_bytes: int) -> int:
    """The workers (at most `asked`, at least one) whose peaks fit the GPU's free memory together."""
    return max(1, min(asked, free_bytes // max(1, peak_bytes)))


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
    ap.add_argument("--paths", default=None, help="tma,cuda,pointer (default: each this GPU supports)")
    ap.add_argument("--modes", default="normal,invariant")
    ap.add_argument("--dtypes", default="float16", help="float16,bfloat16")
    ap.add_argument("--workers", type=int, default=1, help="processes sharing the GPU (compiles run in parallel); "
                                                           "fewer run where its free memory holds fewer")
    ap.add_argument("--quick", action="store_true", help="the start-up proof of the fast variants instead")
    ap.add_argument("--preset", default=None, help=f"with --quick: the preset whose shapes to prove "
                                                   f"(default {QUICK_PRESET}; one of {', '.join(PRESET_SHAPES)})")
    a = ap.parse_args(argv)
    if a.workers < 1:
        return refuse(f"bad --workers {a.workers}: at least 1")
    if a.quick:
        return quick(a)
    if a.shapes:
        try:
            dims = [parse_kn(part, groups=False)[:2] for part in a.shapes.split(",")]
            if not all(k > 0 and n > 0 for k, n in dims):
                raise ValueError("K and N must be at least 1")
        except ValueError as e:
            return refuse(f"bad --shapes {a.shapes!r}: {e} (the groups come from --groups)")
        shapes = {(k, n): [f"{k}x{n}"] for k, n in dims}
    else:
        names = list(MODELS) if a.models == "all" else a.models.split(",")
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            return refuse(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
        shapes = model_shapes(names)
    device = sweep_device()
    if device is None:
        return 2
    rows = parse_rows(a.rows) if a.rows else list(range(1, 129)) + PREFILL_ROWS
    with overrides(w4_cuda="on"):        # what this GPU could run, the CUDA variant included
        supported = kernel_guard.supported_variants(torch.device(device))
    paths = a.paths.split(",") if a.paths else [p for p, vs in PATH_VARIANTS.items() if vs <= set(supported)]
    unknown = [p for p in paths if p not in PATH_VARIANTS]
    if unknown:
        return refuse(f"unknown path(s) {unknown}; choose from {', '.join(PATH_VARIANTS)}")
    jobs = sweep_jobs(shapes, a.groups.split(","), {"both": [False, True], "off": [False], "on": [True]}[a.act_order])
    t0 = time.perf_counter()
    dtypes = a.dtypes.split(",")
    workers = a.workers
    if device == "cuda" and workers > 1:     # workers share one GPU: as many as its memory holds
        free, peak = torch.cuda.mem_get_info()[0], worker_peak_bytes(jobs, rows)
        workers = workers_that_fit(a.workers, free, peak)
        if workers < a.workers:
            print(f"w4-sweep: {a.workers} workers would need up to {peak / 1e9:.1f} GB each at the largest weight; "
                  f"this GPU has {free / 1e9:.1f} GB free, so {workers} run", flush=True)
    try:
        if workers > 1:
            import multiprocessing as mp
            chunks = [jobs[i::workers] for i in range(workers)]
            with mp.get_context("spawn").Pool(workers) as pool:
                results = [r for part in pool.map(_worker, [(c, rows, paths, a.modes.split(","), device, dtypes)
                                                            for c in chunks]) for r in part]
        else:
            results = _worker((jobs, rows, paths, a.modes.split(","), device, dtypes))
    except torch.OutOfMemoryError as e:    # another process took the memory, or rows far past the default
        return refuse(f"the GPU ran out of memory with {workers} worker{'s' if workers > 1 else ''} "
                      f"({str(e).splitlines()[0]}): free the GPU or run fewer --workers or --rows")
    wrong = [r for r in results if r["wrong_rows_at"]]
    variant = [r for r in results if r["not_bit_invariant_at"]]
    products = sum(r["rows_checked"] for r in results)
    summary = {"products": products, "weights": len(jobs) * len(dtypes), "cases": len(results),
               "cases_with_wrong_rows": len(wrong), "cases_not_bit_invariant": len(variant),
               "seconds": round(time.perf_counter() - t0, 1)}
    print(f"w4-sweep: {products} products over {len(results)} (shape, group, act-order, dtype, path, mode) cases: "
          f"{len(wrong)} with wrong rows, {len(variant)} not bit-invariant ({summary['seconds']} s)")
    if a.out:
        env = stamp({**machine_info(device), "triton": kernel_guard.triton_version(),
                     "device": gpu_name(device) or "cpu (TRITON_INTERPRET=1)"}, "w4-sweep", argv)
        write_json(a.out / "w4_sweep.json", {"env": env, "summary": summary, "results": results})
    return 1 if wrong or variant else 0


def sweep_jobs(shapes: dict[tuple[int, int], list[str]], groups: list[str], acts: list[bool]) -> list[tuple]:
    """((K, N), layer names, group size, act order) per case the Triton kernel supports; group
    "channel" is per-channel (G = K)."""
    jobs = []
    for (k, n), layers in sorted(shapes.items()):
        for gs in groups:
            g = k if gs == "channel" else int(gs)
            if k % g or not triton_supports(g):
                continue
            for act in acts:
                jobs.append(((k, n), layers, g, act))
    return jobs


if __name__ == "__main__":
    sys.exit(main())
