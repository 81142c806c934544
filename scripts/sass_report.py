"""The CUDA W4 kernel's steady loops as the GPU runs them (SASS), read on a CPU.

Per entry: its registers (which set how many warps a multiprocessor holds), the bytes it spills to
its stack at its launch bounds, and for its main loop (the backward branch whose body holds the
most MMAs) the instructions per 64-channel chunk by class and the stall cycles the compiler encoded after them: the cycles a warp waits after an instruction
before its next one may issue, whatever else its scheduler has to do (ncu counts them as `wait`).
With few warps per scheduler those cycles are what the loop cannot hide (docs/kernels.md, "What the
warps wait on"). NVRTC compiles the source (the shipped entries, or --source FILE: another
cuda_w4.cu with the same entry macros) and the cuobjdump that Triton's wheel ships disassembles it,
so a change to the loop can be read before any GPU time is spent on it. Each row also gives the
same figures per MMA. --marlin-src DIR (a checkout of github.com/IST-DASLab/marlin; hierviz ships
none of it) adds Marlin's kernel, built the same way at each configuration its launcher calls for
groups of 128, read from its main loop's first MMA to its last (that loop also holds the reduction
and write-out a block runs once per slice), per MMA.
  python scripts/sass_report.py [--arch sm_90a] [--entries w4_direct_t4_r2_g128,...] [--source FILE]
      [--marlin-src DIR] [--out DIR]"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple, Optional

sys.path.insert(0, os.getcwd())
from hierviz.measure.common import write_json  # noqa: E402
from hierviz.quant import cuda_w4  # noqa: E402

# instruction classes of the report (SASS opcode, before its first dot)
CLASSES = {"HMMA": "mma", "HGMMA": "mma", "LOP3": "dequant", "HADD2": "dequant", "HFMA2": "dequant", "HMUL2": "dequant",
           "PRMT": "dequant", "LDG": "load", "LDS": "load", "LDGSTS": "load", "MOV": "move"}
LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/")
HIGH = re.compile(r"/\* (0x[0-9a-f]+) \*/")


class Instr(NamedTuple):
    addr: int
    op: str        # the opcode without its modifiers (HMMA, LDG, ...)
    stall: int     # the stall cycles encoded in the instruction's control bits
    text: str


def cuobjdump() -> str:
    """Triton's own cuobjdump (backends/nvidia/bin): triton is a dependency, the CUDA toolkit is not."""
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise SystemExit(f"no cuobjdump at {path}")
    return str(path)


def _dump(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), *flags, f.name], check=True, capture_output=True, text=True).stdout


def resources(cubin: bytes) -> dict[str, tuple[int, int]]:
    """Registers per thread and stack bytes per thread (registers spilled at the entry's launch
    bounds) of each function of the CUBIN."""
    out, name = {}, None
    for line in _dump(cubin, "-res-usage").splitlines():
        if m := re.match(r"\s*Function (\S+):", line):
            name = m.group(1)
        elif name and (m := re.search(r"REG:(\d+) STACK:(\d+)", line)):
            out[name] = (int(m.group(1)), int(m.group(2)))
    return out


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Each function's instructions in `cuobjdump -sass` text. Volta to Hopper encode an instruction
    in 128 bits, the second 64-bit word on the next line; its bits 41-44 are the stall count."""
    out: dict[str, list[Instr]] = {}
    lines = text.splitlines()
    name = None
    for i, line in enumerate(lines):
        if m := re.match(r"\s+Function : (\S+)", line):
            name = m.group(1)
            out[name] = []
        elif name and (m := LINE.match(line)) and i + 1 < len(lines) and (h := HIGH.search(lines[i + 1])):
            words = m.group(2).split()
            op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
            out[name].append(Instr(int(m.group(1), 16), op, (int(h.group(1), 16) >> 41) & 0xF, m.group(2)))
    return out


def steady_loop(instrs: list[Instr]) -> list[Instr]:
    """The body of the backward branch that holds the most MMAs, the shortest of those on a tie:
    the loop a product spends its time in (the direct loop's steady loop, whose loads carry no
    predicate, rather than its predicated tail loop of as many MMAs)."""
    loops = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?(0x[0-9a-f]+)", ins.text) if ins.op == "BRA" else None
        if m and int(m.group(1), 16) < ins.addr:
            loops.append([x for x in instrs[:i + 1] if x.addr >= int(m.group(1), 16)])
    return max(loops, key=lambda body: (sum(x.op in ("HMMA", "HGMMA") for x in body), -len(body)), default=[])


def mmas_per_chunk(entry: str) -> Optional[int]:
    """A warp's MMAs per 64-channel chunk in an mma.sync entry: 4 k16 steps x token tiles x row
    tiles (None for the wgmma entries, whose MMAs are per warpgroup)."""
    m = re.match(r"w4_(direct|staged|ring)_t(\d+)(?:_r(\d+))?", entry)
    return None if m is None else 4 * int(m.group(2)) * int(m.group(3) or 1)


def report(cubin: bytes, entries: Optional[list[str]] = None) -> list[dict]:
    """One row per entry (all mma.sync entries of the CUBIN by default): registers, and per chunk
    of its steady loop the instructions by class and the encoded stall cycles."""
    sass = parse_sass(_dump(cubin, "-sass"))
    res = resources(cubin)
    names = entries or sorted(n for n in sass if mmas_per_chunk(n))
    missing = [n for n in names if n not in sass]
    if missing:
        raise SystemExit(f"no such entry in the build: {', '.join(missing)} (it has {', '.join(sorted(sass))})")
    rows = []
    for name in names:
        loop = steady_loop(sass[name])
        per = mmas_per_chunk(name)
        mmas = sum(x.op == "HMMA" for x in loop)
        if not per or not mmas:
            rows.append({"entry": name, "registers": res[name][0], "stack_bytes": res[name][1], "loop": "no mma.sync loop"})
            continue
        rows.append({"entry": name, "registers": res[name][0], "stack_bytes": res[name][1], "loop_instructions": len(loop),
                     "chunks_per_iteration": mmas / per, "per_chunk": per_unit(loop, mmas / per, 1), "per_mma": per_unit(loop, mmas)})
    return rows


def per_unit(instrs: list[Instr], units: float, digits: int = 2) -> dict[str, float]:
    """Instructions, encoded stall cycles and instructions by class, per chunk or per MMA."""
    by_class = Counter(CLASSES.get(x.op, "move" if x.text.startswith("IMAD.MOV") else "other") for x in instrs)
    return {"instructions": round(len(instrs) / units, digits), "stall_cycles": round(sum(x.stall for x in instrs) / units, digits),
            **{k: round(v / units, digits) for k, v in sorted(by_class.items())}}


# ---- Marlin's main loop beside the kernel's (hierviz ships none of Marlin: --marlin-src DIR) ----

MARLIN_KERNEL = "marlin/marlin_cuda_kernel.cu"
MARLIN_CALL = re.compile(r"CALL_IF\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(-?\d+)\s*\)")


def cuda_headers() -> str:
    """The CUDA headers Triton's wheel ships (Marlin's half2 code includes cuda_fp16.h)."""
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "include")


def marlin_source(root: str, group: int = 128) -> tuple[str, dict[str, tuple[int, int, int]]]:
    """Marlin's device code from a checkout, cut before its host launcher, with an explicit
    instantiation of each configuration the launcher calls (CALL_IF) for groups of `group`
    channels: (the source for NVRTC, {the configuration's part of the mangled kernel name:
    (16-row blocks of tokens, 16-column blocks of outputs, 16-channel blocks of K) per block})."""
    path = Path(root) / MARLIN_KERNEL
    if not path.is_file():
        raise SystemExit(f"{root} is not a Marlin checkout: no {MARLIN_KERNEL}")
    text = path.read_text()
    threads, stages = re.search(r"const int THREADS = (\d+);", text), re.search(r"const int STAGES = (\d+);", text)
    signature = re.search(r"__global__ void Marlin\((.*?)\)\s*\{", text, re.S)
    if not (threads and stages and signature):
        raise SystemExit(f"{path} is not the Marlin kernel this reads (no THREADS, STAGES or Marlin(...))")
    blocks = group // 16
    configs = [tuple(map(int, c[:3])) for c in MARLIN_CALL.findall(text) if int(c[3]) == blocks]
    if not configs:
        raise SystemExit(f"{path} launches no configuration for groups of {group}")
    device = [ln for ln in text[:threads.start()].splitlines() if not ln.lstrip().startswith("#include")]
    opened = sum(ln.lstrip().startswith("#if") for ln in device) - sum(ln.lstrip().startswith("#endif") for ln in device)
    params = re.sub(r"//[^\n]*", "", signature.group(1))
    t, st = threads.group(1), stages.group(1)
    source = "\n".join(["#include <cuda_fp16.h>", "typedef unsigned int uint32_t;", *device, *["#endif"] * opened,
                        *(f"template __global__ void Marlin<{t}, {m}, {n}, {k}, {st}, {blocks}>({params});" for m, n, k in configs)])
    return source + "\n", {f"ILi{t}ELi{m}ELi{n}ELi{k}ELi{st}ELi{blocks}E": (m, n, k) for m, n, k in configs}


def marlin_report(root: str, arch: str, group: int = 128) -> list[dict]:
    """One row per Marlin configuration: registers and, from its main loop's first MMA to its last,
    the instructions by class and the encoded stall cycles per MMA."""
    source, configs = marlin_source(root, group)
    cubin = cuda_w4.compile_cubin(arch, source, (cuda_headers(),))
    sass, res = parse_sass(_dump(cubin, "-sass")), resources(cubin)
    rows = []
    for part, (m, n, k) in configs.items():
        name = next(f for f in sass if part in f)       # each instantiation is a function of the build
        loop = steady_loop(sass[name])
        at = [i for i, x in enumerate(loop) if x.op == "HMMA"]
        row = {"entry": f"marlin m{16 * m} n{16 * n} k{16 * k}", "registers": res[name][0], "stack_bytes": res[name][1]}
        if not at:
            rows.append({**row, "loop": "no mma.sync loop"})
            continue
        span = loop[at[0]:at[-1] + 1]
        rows.append({**row, "span_instructions": len(span), "per_mma": per_unit(span, len(at))})
    return rows


def build_source(arch: str, path: Optional[str] = None) -> str:
    """What cuda_w4 compiles for `arch` (kernel_source: the constants it defines, the .cu text, the
    shipped entries), with the .cu text read from `path` instead of the shipped file if given."""
    shipped = cuda_w4.kernel_source(arch=arch)
    if path is None:
        return shipped
    return cuda_w4.kernel_text(Path(path).read_text()) + shipped[len(cuda_w4.kernel_text()):]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--entries", help="comma-separated entry names (default: every mma.sync entry)")
    ap.add_argument("--source", help="a cuda_w4.cu to build instead of the shipped one (its entry macros as shipped)")
    ap.add_argument("--marlin-src", help="also read Marlin's main loop from this checkout of github.com/IST-DASLab/marlin")
    ap.add_argument("--out", help="write DIR/sass-report.json")
    a = ap.parse_args(argv)
    rows = report(cuda_w4.compile_cubin(a.arch, build_source(a.arch, a.source)), a.entries.split(",") if a.entries else None)
    marlin = marlin_report(a.marlin_src, a.arch) if a.marlin_src else []
    for r in rows + marlin:
        head = f"{r['entry']:28s} regs {r['registers']:>4} stack {r['stack_bytes']:>3}  "
        if "per_chunk" in r:
            print(head + " ".join(f"{k} {v}" for k, v in r["per_chunk"].items()))
        print((head if "per_chunk" not in r else " " * len(head)) + (
            "per MMA: " + " ".join(f"{k} {v}" for k, v in r["per_mma"].items()) if "per_mma" in r else r["loop"]))
    if a.out:
        write_json(Path(a.out) / "sass-report.json", {"arch": a.arch, "nvrtc": cuda_w4.nvrtc_version(),
                                                       "source": a.source or "shipped", "rows": rows, "marlin": marlin})
    return 0


if __name__ == "__main__":
    sys.exit(main())
