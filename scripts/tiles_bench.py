"""The CUDA W4 kernel's entries at the row counts past the direct loop, against the Triton kernel.

For each kind of weight (K,N,G and whether batch-invariant, as w4_choice times them) and row count:
the Triton kernel's time in the kind's mode, the CUDA kernel's shipped choice (token_tiles), every
direct entry forced (`tiles`: more blocks along the tokens, each re-reading its weight tile), and
each extra build (BUILDS: more direct entries, other staged stage lengths). Every variant's rows are
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
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from hierviz.measure.common import write_json  # noqa: E402

from hierviz.quant import cuda_w4, w4_choice  # noqa: E402

# the 70B target's (batch-invariant) and the 8B intermediate's kinds of the default what-if
KINDS = ["8192,57344,128,1", "28672,8192,128,1", "8192,10240,128,1", "8192,8192,128,1",
         "4096,28672,128,0", "14336,4096,128,0", "4096,6144,128,0", "4096,4096,128,0"]
BUILDS = {      # name: (direct entries added or replaced, staged entries replaced)
    "d4": ({4: (4, 2)}, {}),
    "d4a2": ({4: (2, 2)}, {}),
    "d456a2": ({4: (2, 2), 5: (2, 2), 6: (2, 2)}, {}),
    "s4_22": ({}, {4: (2, 2)}),
    "s4_42": ({}, {4: (4, 2)}),
}


def build(arch: str, direct: dict, staged: dict) -> tuple[dict, dict, dict]:
    d = {**cuda_w4.DIRECT_BUILD, **direct}
    s = {t: v for t, v in {**cuda_w4.STAGED_BUILD, **staged}.items() if t not in d}
    saved = cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD
    cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD = d, s
    try:
        fns = cuda_w4.load_entries(arch, cuda_w4.kernel_source(d, s, arch=arch))
    finally:
        cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD = saved
    return fns, d, s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", action="append")
    ap.add_argument("--ms", default="17,24,25,32,40,48,64,96,128")
    ap.add_argument("--builds", default=",".join(BUILDS))
    a = ap.parse_args()
    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    arch = cuda_w4._arch(idx)
    default = cuda_w4.functions(idx)
    shipped = cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD
    builds = {}
    for name in [b for b in a.builds.split(",") if b]:
        t0 = time.time()
        builds[name] = build(arch, *BUILDS[name])
        print(f"built {name} in {time.time() - t0:.1f} s", flush=True)
    ms = [int(v) for v in a.ms.split(",")]
    res = {"device": torch.cuda.get_device_name(), "arch": arch, "nvrtc": cuda_w4.nvrtc_version(),
           "torch": torch.__version__, "sms": torch.cuda.get_device_properties(idx).multi_processor_count,
           "shipped": {"direct": shipped[0], "staged": shipped[1]},
           "builds": {n: {"direct": BUILDS[n][0], "staged": BUILDS[n][1]} for n in builds}, "rows": []}
    for spec in a.kind or KINDS:
        k, n, g, inv = (int(v) for v in spec.split(","))
        kind = (idx, k, n, g, False, bool(inv))
        triton_us = w4_choice.time_triton(kind, dev, rows=ms)
        ws = w4_choice._copies(kind, dev)
        x = torch.randn(max(ms), k, device=dev).half()
        for w in ws:
            cuda_w4.matmul(x[:1], w)            # each copy's layout, eagerly
        alone = torch.cat([cuda_w4.matmul(x[i:i + 1], ws[0]) for i in range(max(ms))])
        split = cuda_w4.slice_plan(k, cuda_w4.split_for(n, k, res["sms"]))[0]
        for m in ms:
            row = {"K": k, "N": n, "G": g, "invariant": bool(inv), "M": m, "split": split,
                   "triton_us": round(triton_us[m], 2)}

            def timed(label: str, tiles=None) -> None:
                try:
                    got = cuda_w4.matmul(x[:m], ws[0], tiles=tiles)
                    torch.cuda.synchronize()
                    row[f"{label}_equal"] = bool(torch.equal(got, alone[:m]))
                    copies = itertools.cycle(ws)
                    row[f"{label}_us"] = round(w4_choice.cuda_graph_timer(
                        lambda: cuda_w4.matmul(x[:m], next(copies), tiles=tiles)), 2)
                except Exception as e:
                    row[f"{label}_error"] = repr(e)[:300]

            timed("shipped")
            for t in (1, 2, 3):
                if t < cuda_w4.token_tiles(m):
                    timed(f"tiles{t}", t)
            for name, (fns, d, s) in builds.items():
                cuda_w4._FUNCTIONS[idx] = fns
                cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD = d, s
                try:
                    timed(name)
                    for t in d:
                        if t > 3 and t < cuda_w4.token_tiles(m):
                            timed(f"{name}_tiles{t}", t)
                finally:
                    cuda_w4._FUNCTIONS[idx] = default
                    cuda_w4.DIRECT_BUILD, cuda_w4.STAGED_BUILD = shipped
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    write_json(Path(a.out) / "tiles-bench.json", res)


if __name__ == "__main__":
    main()
