"""The staged loop (41-64 tokens a pass) with its codes and group pairs in a deep shared-memory
ring of asynchronous copies (ring_bench.cu: product_staged_ring, Marlin's way of hiding the weight
loads) against the shipped staged entries, which hold them in registers a stage ahead. Measured
and not kept in the kernel (docs/kernels.md, "Codes through a shared-memory ring").

The module is cuda_w4.kernel_source(arch) with only the shipped staged entries (STAGED_BUILD),
then ring_bench.cu, then cuda_w4.cu's w4_mma as w4_mma_ring (ring_mma_text), then one RING_ENTRY(T, S, CS, BLOCKS) per token tiles T in 6, 7, 8 and ring
(S chunks a stage, CS stages). Every ring product is checked bitwise against
cuda_w4.matmul(x, w, tiles=T) (the shipped module's staged entry, default split) and timed with
w4_choice's timer (20 products in a CUDA graph, weight copies cycled past the L2, median of 3).
  GPU: python scripts/ring_bench.py --out DIR [--ms 41,48,56,64,96,128] [--rings 2:3,2:4,1:4,1:6] [--kind K,N,G,INV ...]
  CPU: python scripts/ring_bench.py --compile-only sm_90a [--rings ...]   (registers, spills, steady-loop SASS per chunk)
--rings: S:CS or S:CS:BLOCKS (blocks per multiprocessor in the launch bounds; default 2 where two
blocks' shared memory fits the multiprocessor, else 1)."""
import argparse
import ctypes
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.getcwd())
from hierviz.quant import cuda_w4  # noqa: E402
from hierviz.quant.tickets import multiprocessor_count  # noqa: E402

HERE = Path(__file__).resolve().parent
RING_CU = HERE / "ring_bench.cu"
TOKEN_TILES = (6, 7, 8)
# shared memory per multiprocessor by arch (H100/H200: 228 KB; A100: 164 KB) and the driver's
# reservation per block
SMEM_PER_SM = {"sm_90a": 228 << 10, "sm_90": 228 << 10, "sm_80": 164 << 10, "sm_86": 100 << 10, "sm_89": 100 << 10}
RESERVED_PER_BLOCK = 1 << 10
STATIC_SLACK = 64          # the epilogue's static `last` (and alignment)
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


def _script(name: str):
    """scripts/NAME.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ring_shared_bytes(t: int, s: int, cs: int) -> int:
    """Dynamic shared memory of w4_ring_t{t}_s{s}_c{cs}: cs stages of (8t token rows of s*64+8
    halves, 8 warps x s chunks x 32 lanes x 16 code bytes, the same x 8 pair bytes)."""
    return cs * (8 * t * (s * 64 + 8) * 2 + 8 * s * 32 * 16 + 8 * s * 32 * 8)


def default_blocks(t: int, s: int, cs: int, arch: str) -> int:
    per_sm = SMEM_PER_SM.get(arch, 228 << 10)
    return 2 if 2 * (ring_shared_bytes(t, s, cs) + RESERVED_PER_BLOCK + STATIC_SLACK) <= per_sm else 1


def parse_rings(text: str) -> list[tuple[int, int, Optional[int]]]:
    out = []
    for item in filter(None, text.split(",")):
        parts = [int(v) for v in item.split(":")]
        if len(parts) not in (2, 3) or parts[1] < 3:
            raise SystemExit(f"--rings item {item!r}: S:CS or S:CS:BLOCKS with CS >= 3")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else None))
    return out


def ring_name(t: int, s: int, cs: int) -> str:
    return f"w4_ring_t{t}_s{s}_c{cs}"


def ring_builds(rings: list, arch: str) -> dict[str, tuple[int, int, int, int]]:
    """entry name -> (T, S, CS, BLOCKS) for every token tile count and ring."""
    return {ring_name(t, s, cs): (t, s, cs, b or default_blocks(t, s, cs, arch))
            for s, cs, b in rings for t in TOKEN_TILES}


# w4_mma's text and the one call w4_mma_ring changes in it: the ring's stages ride in XRING, which
# only the wgmma loop reads (WGMMA is false in the ring entries)
MMA_HEAD = "__device__ __forceinline__ void w4_mma(PARAMS) {"
STAGED_CALL = "product_staged<T, S>(acc, ARGS,"


def ring_mma_text() -> str:
    """cuda_w4.cu's w4_mma as w4_mma_ring, product_staged_ring<T, S, XRING> in place of
    product_staged: the same tile, K slice and epilogue as the shipped entries, one copy of them."""
    text = cuda_w4.KERNEL_FILE.read_text()
    head = text.find(MMA_HEAD)
    start = text.rfind("template <", 0, head)
    end = text.find("\n}\n", head) + 3
    body = text[start:end]
    if head < 0 or body.count(STAGED_CALL) != 1:
        raise SystemExit(f"cuda_w4.cu no longer has {MMA_HEAD!r} calling {STAGED_CALL!r} once: update ring_bench.py")
    return (body.replace("void w4_mma(", "void w4_mma_ring(")
            .replace(STAGED_CALL, "product_staged_ring<T, S, XRING>(acc, ARGS,"))


def build_source(arch: str, builds: dict) -> str:
    """The shipped staged entries, ring_bench.cu, w4_mma_ring, one RING_ENTRY per build."""
    shipped = cuda_w4.kernel_source({}, cuda_w4.STAGED_BUILD, arch=arch, wgmma_build={}, rows_build={}, kw_build={})
    return (shipped + f"#line 1 \"{RING_CU.name}\"\n" + RING_CU.read_text() + ring_mma_text()
            + "".join(f"RING_ENTRY({t}, {s}, {cs}, {b})\n" for t, s, cs, b in builds.values()))


def staged_names() -> list[str]:
    return [f"w4_staged_t{t}" for t in TOKEN_TILES]


def sass_rows(cubin: bytes, names: list[str], builds: dict) -> list[dict]:
    """sass_report's rows (registers, stack bytes, the steady loop per chunk) with each ring's
    blocks per multiprocessor and shared memory."""
    rows = _script("sass_report").report(cubin, names)
    for row in rows:
        if row["entry"] in builds:
            b = builds[row["entry"]]
            row.update(blocks=b[3], shared_bytes=ring_shared_bytes(*b[:3]))
    return rows


def compile_only(arch: str, rings: list, out: Optional[str]) -> int:
    builds = ring_builds(rings, arch)
    t0 = time.time()
    cubin = cuda_w4.compile_cubin(arch, build_source(arch, builds))
    print(f"compiled {arch} (NVRTC {cuda_w4.nvrtc_version()}) in {time.time() - t0:.1f} s")
    rows = sass_rows(cubin, staged_names() + list(builds), builds)
    for r in rows:
        pc = r.get("per_chunk")
        extra = f" blocks {r['blocks']} smem {r['shared_bytes']}" if "blocks" in r else ""
        print(f"{r['entry']:22s} regs {r['registers']:>4} stack {r['stack_bytes']:>4}{extra}  "
              + (" ".join(f"{k} {v}" for k, v in pc.items()) if pc else "no mma loop found"))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"ring-sass-{arch}.json").write_text(json.dumps({"arch": arch, "rows": rows}, indent=1))
    return 0


# ---- GPU ---------------------------------------------------------------------------------------

def load(arch: str, builds: dict, carveout: Optional[int]) -> tuple[dict, bytes]:
    """The module's staged and ring entries (name -> CUfunction), the rings allowed their shared memory,
    and its CUBIN (for --sass: one build)."""
    drv = cuda_w4._DRIVER
    t0 = time.time()
    cubin = cuda_w4.compile_cubin(arch, build_source(arch, builds))
    print(f"compiled {arch} in {time.time() - t0:.1f} s", flush=True)
    module = ctypes.c_void_p()
    drv.check(drv.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
    fns = {}
    for name in staged_names() + list(builds):
        fn = ctypes.c_void_p()
        drv.check(drv.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
        fns[name] = fn
    for name, (t, s, cs, _) in builds.items():
        drv.check(drv.lib.cuFuncSetAttribute(fns[name], cuda_w4.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             ring_shared_bytes(t, s, cs)), "cuFuncSetAttribute")
        if carveout is not None:
            drv.check(drv.lib.cuFuncSetAttribute(fns[name], CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                                 carveout), "cuFuncSetAttribute carveout")
    return fns, cubin


def occupancy(fn, shared: int) -> int:
    drv = cuda_w4._DRIVER
    n = ctypes.c_int()
    drv.check(drv.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, 256, ctypes.c_size_t(shared)),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return n.value


def launch(fn, shared: int, x, w, tiles: int):
    """cuda_w4.matmul's launch (default split, no add_to) of entry fn at `tiles` token tiles."""
    import torch
    m, k = x.shape
    split, per = cuda_w4.slice_plan(k, cuda_w4.split_for(w.out_features, k, multiprocessor_count(x.device)))
    y = torch.empty((m, w.out_features), device=x.device, dtype=torch.float16)
    return cuda_w4.launch(fn, x.contiguous(), w, y, False, tiles, split, per, shared=shared)


def bench(a) -> int:
    import torch
    from hierviz.quant import w4_choice
    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    arch = cuda_w4._arch(idx)
    cuda_w4.functions(idx)                   # the shipped module (and the driver)
    builds = ring_builds(parse_rings(a.rings), arch)
    fns, cubin = load(arch, builds, a.carveout)
    occ = {name: occupancy(fns[name], ring_shared_bytes(*b[:3])) for name, b in builds.items()}
    occ.update({name: occupancy(fns[name], 0) for name in staged_names()})
    sr = _script("sass_report")
    res_usage = sr.resources(cubin) if a.sass else {}
    for name in staged_names() + list(builds):
        print(f"{name:22s} blocks/SM {occ[name]}" + (f" (bound {builds[name][3]}, smem {ring_shared_bytes(*builds[name][:3])})"
                                                    if name in builds else "")
              + (f" regs {res_usage[name][0]} stack {res_usage[name][1]}" if name in res_usage else ""), flush=True)
    ms = [int(v) for v in a.ms.split(",")]
    kinds = a.kind or _script("tiles_bench").KINDS
    sms = multiprocessor_count(dev)
    res = {"device": torch.cuda.get_device_name(), "arch": arch, "nvrtc": cuda_w4.nvrtc_version(), "sms": sms,
           "builds": {n: dict(zip(("T", "S", "CS", "blocks"), b), shared_bytes=ring_shared_bytes(*b[:3]),
                              occupancy=occ[n]) for n, b in builds.items()},
           "staged_occupancy": {n: occ[n] for n in staged_names()}, "rows": []}
    for spec in kinds:
        k, n, g, inv = (int(v) for v in spec.split(","))
        kind = (idx, k, n, g, False, bool(inv))
        ws = w4_choice._copies(kind, dev)
        x = torch.randn(max(ms), k, device=dev).half()
        for w in ws:
            cuda_w4.matmul(x[:1], w)             # each copy's layout, eagerly
        split = cuda_w4.slice_plan(k, cuda_w4.split_for(n, k, sms))[0]
        for m in ms:
            tiles = max(6, min(8, -(-m // 8)))
            xm = x[:m]
            row = {"K": k, "N": n, "G": g, "invariant": bool(inv), "M": m, "tiles": tiles, "split": split}
            ref = cuda_w4.matmul(xm, ws[0], tiles=tiles)
            torch.cuda.synchronize()
            copies = itertools.cycle(ws)
            row["shipped_us"] = round(w4_choice.cuda_graph_timer(lambda: cuda_w4.matmul(xm, next(copies), tiles=tiles)), 2)
            # this module's staged entry through this script's launch: checks the launch itself
            variants = [("staged_own", fns[f"w4_staged_t{tiles}"], 0)] + [
                (f"s{s}c{cs}b{b}", fns[ring_name(tiles, s, cs)], ring_shared_bytes(tiles, s, cs))
                for name, (t, s, cs, b) in builds.items() if t == tiles]
            for label, fn, shared in variants:
                try:
                    got = launch(fn, shared, xm, ws[0], tiles)
                    torch.cuda.synchronize()
                    row[f"{label}_equal"] = bool(torch.equal(got, ref))
                    if not row[f"{label}_equal"]:
                        row[f"{label}_err"] = float((got.float() - ref.float()).abs().max())
                    copies = itertools.cycle(ws)
                    row[f"{label}_us"] = round(w4_choice.cuda_graph_timer(
                        lambda: launch(fn, shared, xm, next(copies), tiles)), 2)
                except Exception as e:            # a sticky fault ends every later launch too
                    row[f"{label}_error"] = repr(e)[:300]
            res["rows"].append(row)
            line = f"{k},{n},{g},{inv} M={m:<4} T={tiles} shipped {row['shipped_us']:8.2f} us"
            for label, _, _ in variants:
                if f"{label}_us" in row:
                    line += f" | {label} {row[f'{label}_us']:8.2f} {'equal' if row[f'{label}_equal'] else 'NOT EQUAL'}"
                elif f"{label}_equal" in row:
                    line += f" | {label} {'equal' if row[f'{label}_equal'] else 'NOT EQUAL'} error"
                else:
                    line += f" | {label} ERROR"
            print(line, flush=True)
        del ws
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ring-bench.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {Path(a.out) / 'ring-bench.json'}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="DIR for ring-bench.json (GPU) or ring-sass-ARCH.json (--compile-only)")
    ap.add_argument("--ms", default="41,48,56,64,96,128")
    ap.add_argument("--rings", default="2:3,2:4,1:4,1:6", help="S:CS[:BLOCKS],...")
    ap.add_argument("--kind", action="append", help="K,N,G,batch_invariant (default: tiles_bench.KINDS)")
    ap.add_argument("--compile-only", metavar="ARCH", help="compile for ARCH on any machine and print registers/spills")
    ap.add_argument("--carveout", type=int, help="the ring entries' preferred shared-memory carveout (percent)")
    ap.add_argument("--sass", action="store_true", help="GPU run: also print registers and stack of each entry")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only(a.compile_only, parse_rings(a.rings), a.out)
    if not a.out:
        ap.error("--out is required for the GPU run")
    return bench(a)


if __name__ == "__main__":
    sys.exit(main())
