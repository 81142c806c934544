"""The CUDA W4 kernel's staged products: the wgmma entries (sm_90a) against the mma.sync staged loop.

For each shape (K,N,G) and row count: the mma.sync staged loop's time, then each wgmma build's
(WGMMA_BUILD tables: K chunks per stage, copy slots, blocks per multiprocessor), every build's rows
checked bitwise against the mma.sync loop's and against the rows multiplied one at a time (the
direct loop). Times are CUDA-graph medians over three weight copies (kernel_bench's timer).
  GPU (sm_90): python scripts/wgmma_bench.py --out DIR [--shape 8192,28672,128 ...] [--ms 48,64,128]
Writes DIR/wgmma-bench.json and prints one line per (shape, M)."""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from hierviz.measure.common import write_json  # noqa: E402

from hierviz.measure.kernel_bench import _graph_time_us  # noqa: E402
from hierviz.quant import cuda_w4  # noqa: E402
from hierviz.quant.w4_proof import synthetic_weight  # noqa: E402

BUILDS = {       # per staged tile count: (K chunks a stage, copy slots ahead of the two wgmma-layout stages
    # (0: registers), blocks per SM)
    "s2": {t: (2, 0, 2) for t in cuda_w4.STAGED_BUILD},
    "s2c3": {t: (2, 3, 2) for t in cuda_w4.STAGED_BUILD},
    "s4c2": {t: (4, 2, 1) for t in cuda_w4.STAGED_BUILD},
}
COPIES = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", action="append")
    ap.add_argument("--ms", default="41,48,64,128,200")    # row counts the staged tile counts take
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--builds", default=",".join(BUILDS))
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in (a.shape or ["8192,28672,128"])]
    ms = [int(v) for v in a.ms.split(",")]
    idx = torch.cuda.current_device()
    arch = cuda_w4._arch(idx)
    default = cuda_w4.functions(idx)
    shipped = dict(cuda_w4.WGMMA_BUILD)
    builds = {}
    for name in a.builds.split(","):
        t0 = time.time()
        builds[name] = cuda_w4.load_entries(arch, cuda_w4.kernel_source(arch=arch, wgmma_build=BUILDS[name]),
                                            BUILDS[name])
        print(f"built {name} in {time.time() - t0:.1f} s", flush=True)
    res = {"device": torch.cuda.get_device_name(), "arch": arch, "nvrtc": cuda_w4.nvrtc_version(),
           "torch": torch.__version__, "shipped_build": {str(t): v for t, v in shipped.items()},
           "builds": {n: {str(t): v for t, v in BUILDS[n].items()} for n in builds}, "rows": []}
    for k, n, g in shapes:
        ws = [synthetic_weight(n, k, g, "cuda", seed=i, act_order=False, dtype=torch.float16) for i in range(COPIES)]
        x = torch.randn(max(ms), k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k)).half()
        alone = torch.cat([cuda_w4.matmul(x[i:i + 1], ws[0]) for i in range(max(ms))])
        for m in ms:
            row = {"K": k, "N": n, "G": g, "M": m}
            cuda_w4._FUNCTIONS[idx] = default
            cuda_w4.WGMMA_BUILD = shipped
            want = cuda_w4.matmul(x[:m], ws[0], wgmma=False)
            row["mma_equal_alone"] = bool(torch.equal(want, alone[:m]))
            row["mma_us"] = _graph_time_us([lambda w=w: cuda_w4.matmul(x[:m], w, wgmma=False) for w in ws], a.rep_ms)
            for name, fns in builds.items():
                cuda_w4._FUNCTIONS[idx] = fns
                cuda_w4.WGMMA_BUILD = BUILDS[name]
                try:
                    got = cuda_w4.matmul(x[:m], ws[0], wgmma=True)
                    torch.cuda.synchronize()
                    row[f"{name}_equal"] = bool(torch.equal(got, want))
                    row[f"{name}_us"] = _graph_time_us([lambda w=w: cuda_w4.matmul(x[:m], w, wgmma=True) for w in ws],
                                                       a.rep_ms)
                except Exception as e:            # a sticky fault ends every later launch too
                    row[f"{name}_error"] = repr(e)[:300]
            cuda_w4._FUNCTIONS[idx] = default
            cuda_w4.WGMMA_BUILD = shipped
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        del ws
        torch.cuda.empty_cache()
    write_json(Path(a.out) / "wgmma-bench.json", res)


if __name__ == "__main__":
    main()
