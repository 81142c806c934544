"""Marlin (IST-DASLab's FP16 x INT4 kernel) as a kernel-bench peer, built from the user's source.

hierviz ships none of Marlin: `--marlin-src DIR` names a checkout of github.com/IST-DASLab/marlin
(the folder holding `marlin/__init__.py`, `marlin/marlin_cuda.cpp`, `marlin/marlin_cuda_kernel.cu`).
Its extension is compiled with torch's extension builder on first use (nvcc needed), its Python
package packs the weights. Marlin computes symmetric GPTQ products (W = (q - 8) * s, fp16, groups of
128 or one per channel), so the peer times a symmetric weight of the same shape and bytes as the
engine's. Where no source, compiler or GPU is found, `build_marlin` says why and the bench skips it.

Two builds are tried in order: the source as published, then the same with its async copies
issued without the L2 evict-first hint (each `cp_async4_stream(&...)` call becomes
`cp_async4_pred(&...)`): nvcc 13 has been seen to miscompile a hinted copy for sm_90. Each build is
first run in a child process on a small product, so that a kernel that faults takes down the
child, not the bench; the first build whose product is right there is loaded. The JSON says which
build ran.
"""
from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from hierviz.measure.common import ChildError, run_json

SOURCES = ("marlin/__init__.py", "marlin/marlin_cuda.cpp", "marlin/marlin_cuda_kernel.cu")
BUILDS = ("published", "without-l2-hints")
GROUP_SIZES = (128,)          # Marlin also runs one group per channel; the engine's weights use 128


def missing_sources(src: Optional[str | Path]) -> Optional[str]:
    """Why `src` cannot build Marlin (None when it can)."""
    if not src:
        return "no Marlin source given (--marlin-src DIR: a checkout of github.com/IST-DASLab/marlin)"
    root = Path(src)
    absent = [s for s in SOURCES if not (root / s).is_file()]
    if absent:
        return f"{root} is not a Marlin checkout: {', '.join(absent)} missing"
    return None


def cannot_build(src: Optional[str | Path]) -> Optional[str]:
    """Why Marlin cannot be built here from `src` (None when it can): source, GPU, compiler."""
    why = missing_sources(src)
    if why:
        return why
    if not torch.cuda.is_available():
        return "Marlin needs a CUDA GPU"
    cap = torch.cuda.get_device_capability()
    if cap < (8, 0):
        return f"Marlin needs compute capability 8.0 or newer (this GPU: {cap[0]}.{cap[1]})"
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME is None or shutil.which("nvcc") is None and not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "no CUDA compiler (nvcc) found: Marlin builds from source"
    return None


def _patched_kernel(text: str, build: str) -> str:
    if build == "published":
        return text
    out = text.replace("cp_async4_stream(&", "cp_async4_pred(&")
    if out == text:
        raise RuntimeError("Marlin source has no hinted copies to patch (another version?)")
    return out


def build_marlin(src: Optional[str | Path], build: str, build_dir: Path) -> tuple[Optional[ModuleType], str]:
    """(Marlin's Python package with its extension loaded, "") or (None, why not)."""
    why = cannot_build(src)
    if why:
        return None, why
    from torch.utils.cpp_extension import load
    cap = torch.cuda.get_device_capability()
    root = Path(src)
    work = build_dir / build
    work.mkdir(parents=True, exist_ok=True)
    (work / "marlin_cuda.cpp").write_text((root / "marlin/marlin_cuda.cpp").read_text())
    (work / "marlin_cuda_kernel.cu").write_text(_patched_kernel((root / "marlin/marlin_cuda_kernel.cu").read_text(), build))
    try:
        ext = load(name=f"marlin_cuda_{build.replace('-', '_')}", sources=[str(work / "marlin_cuda.cpp"),
                   str(work / "marlin_cuda_kernel.cu")], build_directory=str(work),
                   extra_cuda_cflags=["-O3", f"-arch=sm_{cap[0]}{cap[1]}"], verbose=False)
    except Exception as e:      # a compiler error is a skip with its reason, not a failed bench
        return None, f"building Marlin failed: {str(e)[-400:]}"
    sys.modules["marlin_cuda"] = ext          # what Marlin's package imports
    sys.modules.pop("marlin", None)
    sys.path.insert(0, str(root))
    try:
        package = importlib.import_module("marlin")
    finally:
        sys.path.remove(str(root))
    return package, ""


def symmetric_w4(k: int, n: int, g: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A random symmetric 4-bit weight: (dense fp16 [N, K] equal to (q - 8) * s exactly, scales
    fp16 [K / g, N])."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int16)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).half()
    dense = (q - 8).half() * s.t().repeat_interleave(g, dim=1)
    return dense.to(device), s.to(device)


def marlin_layer(marlin: ModuleType, dense: torch.Tensor, scales: torch.Tensor, g: int):
    """Marlin's packed layer for a symmetric weight (its own packing code)."""
    n, k = dense.shape
    layer = marlin.Layer(k, n, groupsize=g)
    linear = torch.nn.Linear(k, n, bias=False, device=dense.device, dtype=torch.float16)
    linear.weight.data = dense
    layer.pack(linear, scales.t())       # Marlin takes scales as (in_features / g, out)^T
    return layer.to(dense.device)


def relative_error(layer, ref: torch.Tensor, m: int = 16) -> float:
    x = torch.randn(m, ref.shape[1], device="cuda", dtype=torch.float16)
    want = x.float() @ ref.t()
    return float((layer(x).float() - want).norm() / want.norm())


def probe(src: str, build: str, build_dir: str) -> dict:
    """Build `build` and run one small product (what the child process does)."""
    marlin, why = build_marlin(src, build, Path(build_dir))
    if marlin is None:
        return {"error": why}
    dense, scales = symmetric_w4(1024, 2048, 128, 7, "cuda")
    err = relative_error(marlin_layer(marlin, dense, scales, 128), dense.float())
    torch.cuda.synchronize()
    return {"relative_error": err}


def _probe_in_child(src: str, build: str, build_dir: Path) -> dict:
    code = ("import json, sys; from hierviz.measure.marlin_peer import probe; "
            "print(json.dumps(probe(*sys.argv[1:4])))")
    try:
        return run_json(code, str(src), build, str(build_dir))
    except ChildError as e:
        return {"error": str(e)}


def marlin_operands(src: Optional[str], k: int, n: int, g: int, copies: int, build_dir: Path,
                    info: dict) -> Optional[tuple[list, torch.Tensor]]:
    """([Marlin layers], the first one's fp32 dense weight) from the first build whose product is
    right, or None with info["marlin_error"] saying why."""
    if g not in GROUP_SIZES:
        info["marlin_error"] = f"Marlin runs groups of 128 (or one per channel); this weight has {g}"
        return None
    if k % 128 or n % 256:
        info["marlin_error"] = f"Marlin needs K % 128 == 0 and N % 256 == 0 (K={k}, N={n})"
        return None
    why = cannot_build(src)      # before a child process is started for it
    if why:
        info["marlin_error"] = why
        return None
    reasons = []
    for build in BUILDS:
        checked = _probe_in_child(str(src), build, build_dir)
        if checked.get("relative_error", 1.0) < 1e-3:
            marlin, why = build_marlin(src, build, build_dir)     # the child's build, from its cache
            if marlin is None:
                info["marlin_error"] = why
                return None
            weights = [symmetric_w4(k, n, g, 100 + i, "cuda") for i in range(copies)]
            info["marlin_build"] = build
            info["marlin_probe"] = reasons + [f"{build}: relative error {checked['relative_error']:.2g}"]
            return [marlin_layer(marlin, d, s, g) for d, s in weights], weights[0][0].float()
        reasons.append(f"{build}: " + (checked.get("error") or f"relative error {checked['relative_error']:.3g}"))
    info["marlin_error"] = "no Marlin build multiplies right on this GPU and compiler (" + "; ".join(reasons) + ")"
    return None
