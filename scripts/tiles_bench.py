"""The CUDA W4 kernel's entries at the row counts past the direct loop, against the Triton kernel.

For each kind of weight (K,N,G and whether batch-invariant, as w4_choice times them) and row count:
the Triton kernel's time in the kind's mode, the CUDA kernel's one-pass entry (token_tiles), every
smaller tile count forced (`tiles`: more passes over the tokens, each block re-reading its weight
tile), and each extra build (BUILDS: the staged loop at 4-5 tiles, another register-loop depth, a
6-tile register loop, register-loop entries with several 16-row tiles per warp; `unscaled`, a
source without the dequantization's scale FMAs, as a bound) at one pass and at its own tile counts. Every variant's rows are
checked bitwise against the rows multiplied one at a time, so a variant that keeps batch invariance
shows `equal`. Times: w4_choice's timer (20 products in a CUDA graph, weight copies cycled past the
L2, median of three replays).
  GPU: python scripts/tiles_bench.py --out DIR [--kind 8192,28672,128,1 ...] [--ms 24,25,32,48,64]
Writes DIR/tiles-bench.json and prints one line per (kind, M)."""
import argparse
import itertools
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from hierviz.measure.common import write_json  # noqa: E402

from hierviz.quant import cuda_w4, w4_choice  # noqa: E402

# the 70B target's (batch-invariant) and the 8B intermediate's kinds of the default what-if
KINDS = ["8192,57344,128,1", "28672,8192,128,1", "8192,10240,128,1", "8192,8192,128,1",
         "4096,28672,128,0", "14336,4096,128,0", "4096,6144,128,0", "4096,4096,128,0"]
# name: the tables a build replaces the shipped ones' entries with (cuda_w4's): "direct" (register-loop
# entries), "staged", "rows" (entries of several row tiles per warp, timed at their own token tiles),
# "x_ahead" (the direct entries that load activations a chunk ahead), "k_warps" (entries of several
# warps per row tile, timed at their own token tiles)
BUILDS = {
    "staged45": {"staged": {4: (4, 3), 5: (2, 2)}},      # the staged loop from 25 rows
    "d4a2": {"direct": {4: (2, 2)}},
    "d6a2": {"direct": {6: (2, 2)}},
    # the one- and two-tile register loops at more blocks per multiprocessor (fewer registers), so
    # that two passes of a 32-row product fit one wave
    "b4": {"direct": {1: (2, 4), 2: (2, 4)}},
    "b3": {"direct": {1: (4, 3), 2: (4, 3)}},
    # (token tiles, row tiles per warp): (chunks ahead, blocks per multiprocessor)
    "r2a4b2": {"rows": {(t, 2): (4, 2) for t in (1, 2, 3, 4, 5)}},
    "r2a4b3": {"rows": {(t, 2): (4, 3) for t in (1, 2, 3)}},
    "r2a2b4": {"rows": {(t, 2): (2, 4) for t in (1, 2, 3, 4, 5)}},
    "r4a2b4": {"rows": {(t, 4): (2, 4) for t in (1, 2, 3, 4)}},
    "r4a2b2": {"rows": {(t, 4): (2, 2) for t in (3, 4, 5)}},
    # the register loop at the staged loop's token tiles, two row tiles per warp: each dequantized
    # word feeds 6-8 MMAs with the register loop's few address instructions (docs/kernels.md,
    # "Marlin's main loop, read the same way"); 253-255 registers, no spill
    "r2t678": {"rows": {(t, 2): (2, 2) for t in (6, 7, 8)}},
    # the same 4 chunks ahead: fewer instructions per MMA in the group entries, which take the 70B
    # kinds (the generic t7 and t8 entries spill 8-16 bytes on sm_90a)
    "r2t678a4": {"rows": {(t, 2): (4, 2) for t in (6, 7, 8)}},
    # the register loop's activations loaded at use in every entry, or a chunk ahead in every entry
    # (the shipped build: in X_AHEAD_ENTRIES')
    "xoff": {"x_ahead": frozenset()},
    "xall": {"x_ahead": frozenset(cuda_w4.direct_entries())},
    # two warps per row tile, each multiplying half of the K slice's chunks (token tiles, row tiles,
    # warps per row tile): (chunks ahead, blocks per multiprocessor)
    "kw2": {"k_warps": {(1, 1, 2): (4, 1), (2, 1, 2): (4, 1), (3, 1, 2): (4, 1), (4, 1, 2): (4, 1),
                        (2, 2, 2): (2, 2), (4, 2, 2): (4, 1)}},
    # a bound, not a kernel: the dequantization without its scale-and-offset FMAs (wrong values, so
    # rows never `equal`), the most that applying the group scales after the MMA could save
    "unscaled": {"source": "unscaled"},
}
# the scale-and-offset FMAs of cuda_w4.cu's dequant, which the "unscaled" source drops
SCALE_FMAS = ["  a[0] = hfma2(a[0], sg, og);\n", "  a[1] = hfma2(a[1], sh, oh);\n",
              "  a[2] = hfma2(a[2], sg, og);\n", "  a[3] = hfma2(a[3], sh, oh);\n"]
TABLES = {"direct": "DIRECT_BUILD", "staged": "STAGED_BUILD", "rows": "DIRECT_ROWS_BUILD", "k_warps": "K_WARP_BUILD"}     # a build's table -> the cuda_w4 table it replaces


@contextmanager
def entries(fns: dict, tables: dict) -> Iterator[None]:
    """cuda_w4 launching a build's entries (its CUfunctions and its TABLES) inside the block."""
    idx = torch.cuda.current_device()
    saved_fns, saved = cuda_w4._FUNCTIONS.get(idx), {t: getattr(cuda_w4, name) for t, name in TABLES.items()}
    cuda_w4._FUNCTIONS[idx] = fns
    for t, name in TABLES.items():
        setattr(cuda_w4, name, tables[t])
    try:
        yield
    finally:
        cuda_w4._FUNCTIONS[idx] = saved_fns
        for t, name in TABLES.items():
            setattr(cuda_w4, name, saved[t])


def unscaled_text() -> str:
    """cuda_w4.cu without the dequantization's scale-and-offset FMAs."""
    text = cuda_w4.kernel_text()
    for line in SCALE_FMAS:
        if line not in text:
            raise SystemExit(f"cuda_w4.cu no longer has {line.strip()!r}: update SCALE_FMAS")
        text = text.replace(line, "")
    return text


@contextmanager
def source_text(spec: dict) -> Iterator[None]:
    """cuda_w4.kernel_text giving the spec's source inside the block (the shipped one without "source")."""
    shipped = cuda_w4.kernel_text
    if spec.get("source") == "unscaled":
        text = unscaled_text()
        cuda_w4.kernel_text = lambda: text
    try:
        yield
    finally:
        cuda_w4.kernel_text = shipped


def build(arch: str, spec: dict) -> tuple[dict, dict]:
    """A build's CUfunctions and tables: the shipped entries with the spec's (BUILDS) in place of
    theirs (wgmma entries only for the tile counts still staged), from its source."""
    staged = spec.get("staged", {})
    d = {t: v for t, v in {**cuda_w4.DIRECT_BUILD, **spec.get("direct", {})}.items() if t not in staged}
    s = {t: v for t, v in {**cuda_w4.STAGED_BUILD, **staged}.items() if t not in d}
    r = {**cuda_w4.DIRECT_ROWS_BUILD, **spec.get("rows", {})}
    kw = {**cuda_w4.K_WARP_BUILD, **spec.get("k_warps", {})}
    wgmma = {t: v for t, v in cuda_w4.WGMMA_BUILD.items() if t in s}
    tables = {"direct": d, "staged": s, "rows": r, "k_warps": kw}
    with entries({}, tables), source_text(spec):
        source = cuda_w4.kernel_source(d, s, arch=arch, wgmma_build=wgmma, rows_build=r,
                                       x_ahead=spec.get("x_ahead", cuda_w4.X_AHEAD_ENTRIES), kw_build=kw)
        fns = cuda_w4.load_entries(arch, source, wgmma, r, kw)
    return fns, tables


def described(spec: dict) -> dict:
    """A build's tables as JSON: tuple keys as "TxR" (or "TxRxW"), sets as sorted lists."""
    return {name: (sorted(v) if isinstance(v, frozenset) else v if isinstance(v, str) else
                   {("x".join(map(str, k)) if isinstance(k, tuple) else k): val for k, val in v.items()})
            for name, v in spec.items()}


def time_variant(row: dict, label: str, x: torch.Tensor, ws: list, alone: torch.Tensor, tiles: Optional[int] = None,
                 row_tiles: int = 1, split: Optional[int] = None, k_warps: int = 1) -> None:
    """row[label_equal]: whether the product's rows equal `alone`'s (another K split or several warps
    per row tile sum in another order: then row[label_err], the largest difference from them);
    row[label_us]: its time."""
    m = x.shape[0]
    try:
        got = cuda_w4.matmul(x, ws[0], tiles=tiles, row_tiles=row_tiles, split=split, k_warps=k_warps)
        torch.cuda.synchronize()
        row[f"{label}_equal"] = bool(torch.equal(got, alone[:m]))
        if split is not None or k_warps > 1:
            row[f"{label}_err"] = float((got.float() - alone[:m].float()).abs().max())
        copies = itertools.cycle(ws)
        row[f"{label}_us"] = round(w4_choice.cuda_graph_timer(
            lambda: cuda_w4.matmul(x, next(copies), tiles=tiles, row_tiles=row_tiles, split=split, k_warps=k_warps)), 2)
    except Exception as e:            # a sticky fault ends every later launch too
        row[f"{label}_error"] = repr(e)[:300]


def time_row(row: dict, x: torch.Tensor, ws: list, alone: torch.Tensor, invariant: bool, splits: list[int],
             builds: dict) -> None:
    """Every variant of one kind at one row count (x's rows) into row: the shipped build's entries
    (one pass, fewer token tiles, several row tiles per warp, and for a kind that is not
    batch-invariant two warps per row tile and the other K splits), then each build's."""
    m = x.shape[0]
    full = cuda_w4.token_tiles(m)

    def within_passes(t: int) -> bool:
        return t <= full and -(-m // (8 * t)) <= w4_choice.MAX_PASSES

    def row_tiles(rows: list, label: str, sp: Optional[int] = None) -> None:
        """Entries of (token tiles, row tiles per warp), each at its token tiles, within
        MAX_PASSES; sp: at that K split instead of the shipped one."""
        for (t, rt) in rows:
            if within_passes(t):
                time_variant(row, f"{label}{t}", x, ws, alone, t, rt, sp)

    def k_warp_entries(build_entries: dict, label: str) -> None:
        """Entries of several warps per row tile (another order of sums: a kind that is not
        batch-invariant only), each at its token tiles within MAX_PASSES, at every split."""
        for (t, rt, kw) in build_entries if not invariant else ():
            if within_passes(t):
                for sp in [None, *splits]:
                    time_variant(row, f"{label}_t{t}r{rt}" + (f"_split{sp}" if sp else ""), x, ws, alone, t, rt, sp, kw)

    time_variant(row, "shipped", x, ws, alone)
    for t in range(1, full):            # fewer tiles per block, more passes
        time_variant(row, f"tiles{t}", x, ws, alone, t)
    row_tiles(cuda_w4.DIRECT_ROWS_BUILD, "rows_tiles")      # the shipped ones
    k_warp_entries(cuda_w4.K_WARP_BUILD, "kwarps")
    for sp in splits:
        time_variant(row, f"split{sp}", x, ws, alone, split=sp)
        row_tiles([(t, 1) for t in range(1, full)], f"split{sp}_tiles", sp)
        row_tiles(cuda_w4.DIRECT_ROWS_BUILD, f"split{sp}_rows_tiles", sp)
    for name, (fns, tables) in builds.items():
        with entries(fns, tables):
            spec = BUILDS[name]
            if "k_warps" in spec:       # a k_warps build: its entries
                k_warp_entries(spec["k_warps"], name)
                continue
            own_rows = list(spec.get("rows", {}))
            if own_rows:                # a rows build: its own entries
                row_tiles(own_rows, f"{name}_tiles")
                continue
            time_variant(row, name, x, ws, alone)
            # a build's own tile counts; an x_ahead build's: every smaller one, as the shipped
            # build's, its row-tile entries and its entries of two warps per row tile
            x_ahead = "x_ahead" in spec
            for t in (range(1, full) if x_ahead else sorted({*spec.get("direct", {}), *spec.get("staged", {})})):
                if t < full:
                    time_variant(row, f"{name}_tiles{t}", x, ws, alone, t)
            if x_ahead:
                row_tiles(cuda_w4.DIRECT_ROWS_BUILD, f"{name}_rows_tiles")
                k_warp_entries(cuda_w4.K_WARP_BUILD, f"{name}_kwarps")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", action="append")
    ap.add_argument("--ms", default="17,24,25,32,40,48,64,96,128")
    ap.add_argument("--builds", default=",".join(BUILDS))
    # the kinds that need no batch invariance (the intermediate's) may take any K split: each one's
    # entries timed at these splits too (the shipped build)
    ap.add_argument("--splits", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    arch = cuda_w4._arch(idx)
    cuda_w4.functions(idx)
    builds = {}
    for name in [b for b in a.builds.split(",") if b]:
        t0 = time.time()
        builds[name] = build(arch, BUILDS[name])
        print(f"built {name} in {time.time() - t0:.1f} s", flush=True)
    ms = [int(v) for v in a.ms.split(",")]
    sms = torch.cuda.get_device_properties(idx).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "arch": arch, "nvrtc": cuda_w4.nvrtc_version(),
           "torch": torch.__version__, "sms": sms,
           "shipped": described({"direct": cuda_w4.DIRECT_BUILD, "staged": cuda_w4.STAGED_BUILD,
                                 "rows": cuda_w4.DIRECT_ROWS_BUILD, "k_warps": cuda_w4.K_WARP_BUILD,
                                 "x_ahead": cuda_w4.X_AHEAD_ENTRIES}),
           "builds": {n: described(BUILDS[n]) for n in builds}, "rows": []}
    for spec in a.kind or KINDS:
        k, n, g, inv = (int(v) for v in spec.split(","))
        kind = (idx, k, n, g, False, bool(inv))
        triton_us = w4_choice.time_triton(kind, dev, rows=ms)
        ws = w4_choice._copies(kind, dev)
        x = torch.randn(max(ms), k, device=dev).half()
        for w in ws:
            cuda_w4.matmul(x[:1], w)            # each copy's layout, eagerly
        alone = torch.cat([cuda_w4.matmul(x[i:i + 1], ws[0]) for i in range(max(ms))])
        split = cuda_w4.slice_plan(k, cuda_w4.split_for(n, k, sms))[0]
        # the other K splits asked for (a batch-invariant kind keeps its own), as slice_plan lays them out
        splits = sorted({cuda_w4.slice_plan(k, int(v))[0] for v in a.splits.split(",") if v} - {split}) if not inv else []
        for m in ms:
            row = {"K": k, "N": n, "G": g, "invariant": bool(inv), "M": m, "split": split,
                   "triton_us": round(triton_us[m], 2)}
            time_row(row, x[:m], ws, alone[:m], bool(inv), splits, builds)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    write_json(Path(a.out) / "tiles-bench.json", res)

if __name__ == "__main__":
    main()
