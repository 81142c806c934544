"""The CUDA W4 kernel's steady loops as the GPU runs them (SASS), read on a CPU.

Per entry: its registers (which set how many warps a multiprocessor holds), the bytes it spills to
its stack at its launch bounds, and for its main loop (the backward branch whose body holds the
most MMAs) the instructions per 64-channel chunk by class and the stall cycles the compiler encoded after them: the cycles a warp waits after an instruction
before its next one may issue, whatever else its scheduler has to do (ncu counts them as `wait`).
With few warps per scheduler those cycles are what the loop cannot hide (docs/kernels.md, "What the
warps wait on"). NVRTC compiles the source (the shipped entries, or --source FILE: another
cuda_w4.cu with the same entry macros) and the cuobjdump that Triton's wheel ships disassembles it,
so a change to the loop can be read before any GPU time is spent on it.
  python scripts/sass_report.py [--arch sm_90a] [--entries w4_direct_t4_r2_g128,...] [--source FILE] [--out DIR]"""
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
CLASSES = {"HMMA": "mma", "HGMMA": "mma", "LOP3": "dequant", "HADD2": "dequant", "HFMA2": "dequant",
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
        chunks = mmas / per
        by_class = Counter(CLASSES.get(x.op, "move" if x.text.startswith("IMAD.MOV") else "other") for x in loop)
        rows.append({"entry": name, "registers": res[name][0], "stack_bytes": res[name][1], "loop_instructions": len(loop),
                     "chunks_per_iteration": chunks,
                     "per_chunk": {"instructions": round(len(loop) / chunks, 1),
                                   "stall_cycles": round(sum(x.stall for x in loop) / chunks, 1),
                                   **{k: round(v / chunks, 1) for k, v in sorted(by_class.items())}}})
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
    ap.add_argument("--out", help="write DIR/sass-report.json")
    a = ap.parse_args(argv)
    rows = report(cuda_w4.compile_cubin(a.arch, build_source(a.arch, a.source)), a.entries.split(",") if a.entries else None)
    for r in rows:
        pc = r.get("per_chunk")
        print(f"{r['entry']:28s} regs {r['registers']:>4} stack {r['stack_bytes']:>3}  " + (
            " ".join(f"{k} {v}" for k, v in pc.items()) if pc else r["loop"]))
    if a.out:
        write_json(Path(a.out) / "sass-report.json", {"arch": a.arch, "nvrtc": cuda_w4.nvrtc_version(),
                                                       "source": a.source or "shipped", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
