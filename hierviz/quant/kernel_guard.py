"""What makes a GPU W4 kernel launch trustworthy on a machine nobody here ran it on.

Three checks, used by hierviz.quant.triton_w4 for every launch it chooses itself:

* `fast_variants` / `platform_proven`: the Hopper-only variants (TMA descriptor loads, the
  CUDA-core one-token kernel) run where the full correctness sweep (`python -m hierviz w4-sweep`,
  docs/kernels.md) passed on the (GPU architecture, Triton version) pair, or where the start-up
  proof on this very platform passed (hierviz.quant.w4_proof proves, hierviz.quant.w4_verdicts
  keeps the verdicts, `enabled_variants` reads them). Elsewhere the pointer-load MMA kernel runs,
  which the sweep proved with TMA forced off (the path an A100 takes).
* `async_register_hazards`: a structural check of the compiled TTGIR. A wgmma whose weight
  operand comes from registers computed inside the loop must complete before the loop's next
  iteration; the PTX ISA leaves rewriting those registers before `wgmma.wait_group` undefined,
  and Triton 3.6 produced exactly that for a chained `acc = tl.dot(w, x, acc)` (wrong 8-row groups
  on the H200, run to run). A compiler that schedules our kernels that way again is caught here.
* `product_agrees`: the first product of each (shape, dtype, configuration) is compared with a
  dequantized fp32 reference on a slice of output features before its result is used.

A launch that fails a check falls back to a variant that passes, and at worst to the
dequantize-and-matmul reference (slow, always right), with a warning.
"""
from __future__ import annotations

import re
import warnings
from typing import Optional

import torch

from hierviz.config import options
from hierviz.quant import w4_verdicts
from hierviz.quant.w4 import W4Weight, codes_of, dequantize

# (compute capability major, Triton "major.minor") on which `hierviz w4-sweep` found 0 wrong rows
# on every path, TMA included. Add a pair only with the sweep's result recorded in docs/kernels.md.
PROVEN_PLATFORMS: frozenset[tuple[int, str]] = frozenset({(9, "3.6")})
# (compute capability major, NVRTC "major.minor") on which the sweep's `cuda` path found 0 wrong and
# 0 batch-dependent rows: the CUDA MMA variant (hierviz.quant.cuda_w4) is compiled by NVRTC.
PROVEN_CUDA_PLATFORMS: frozenset[tuple[int, str]] = frozenset({(9, "13.0")})

# Per-row relative error (over the checked output features) above which a product is wrong. The
# kernels' rounding against the fp32 reference is ~3e-4 (fp16) and ~2.3e-3 (bf16) on synthetic
# GPTQ-like weights; the faults met so far were 1e-2 and up.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}

CHECK_HEAD_ROWS = 1024   # output features checked from the start of the weight ...
CHECK_TAIL_ROWS = 256    # ... and from its end (the ragged last tile)


def triton_version() -> Optional[str]:
    try:
        import triton
    except Exception:  # pragma: no cover - depends on the install
        return None
    return ".".join(triton.__version__.split(".")[:2])


def cuda_mode() -> str:
    """HIERVIZ_W4_CUDA: which fp16 W4 weights run the CUDA MMA variant where it is proven (hierviz.
    quant.cuda_w4.serves): "auto" the kinds timed at least as fast in it (hierviz.quant.w4_choice),
    "on" every one (with a warning where it cannot load), "target" a verifier's, "off" none."""
    return options().w4_cuda


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supported_variants(device: torch.device) -> tuple[str, ...]:
    """The fast variants this device can run: the Triton ones from Hopper (sm_90) on; the CUDA MMA
    one, unless HIERVIZ_W4_CUDA is off, from sm_80 on where NVRTC compiles it and the
    driver loads it; under the interpreter the Triton ones (it emulates TMA; the CUDA kernel needs
    a GPU)."""
    if device.type != "cuda":
        return w4_verdicts.TRITON_VARIANTS
    major = torch.cuda.get_device_capability(_index(device))[0]
    found = w4_verdicts.TRITON_VARIANTS if major >= 9 else ()
    if cuda_mode() != "off":
        from hierviz.quant import cuda_w4      # imported here: it compiles only when asked
        if cuda_w4.available(device):
            found = (*found, w4_verdicts.CUDA_VARIANT)
        elif cuda_mode() != "auto":         # asked for by name: say why it does not run
            _warn_once(f"HIERVIZ_W4_CUDA={cuda_mode()}, but {cuda_w4.unavailable_reason(device)}: the Triton W4 kernel runs")
    return found


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def gpu_platform(device: torch.device) -> tuple[int, Optional[str]]:
    """(compute capability major, Triton "major.minor") of a CUDA device: the pair the static lists
    of proven platforms name (this module's PROVEN_PLATFORMS, act_quant's)."""
    return torch.cuda.get_device_capability(_index(device))[0], triton_version()


def statically_proven(device: torch.device) -> frozenset[str]:
    """The variants the full correctness sweep passed for on this kind of platform: the Triton ones
    by (GPU major, Triton), the CUDA one by (GPU major, NVRTC)."""
    if device.type != "cuda":
        return frozenset()
    major, triton = gpu_platform(device)
    found = set(w4_verdicts.TRITON_VARIANTS) if (major, triton) in PROVEN_PLATFORMS else set()
    if PROVEN_CUDA_PLATFORMS and cuda_mode() != "off":
        from hierviz.quant import cuda_w4
        if (major, cuda_w4.nvrtc_version()) in PROVEN_CUDA_PLATFORMS:
            found.add(w4_verdicts.CUDA_VARIANT)
    return frozenset(found)


def on_static_list(device: torch.device) -> bool:
    """Whether the full correctness sweep passed for every fast variant this GPU supports on this
    kind of platform (nothing is left to prove here)."""
    if device.type != "cuda":
        return False
    proven = statically_proven(device)
    return bool(proven) and set(supported_variants(device)) <= proven


def enabled_variants(device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """The fast variants this platform may use for dtype: those that failed no recorded product
    here and either passed one or are on the static list (a failure recorded here outranks it)."""
    supported = supported_variants(device)
    key = w4_verdicts.platform_key(device)
    verdict = w4_verdicts.Verdict(key, w4_verdicts.dtype_name(dtype), supported, w4_verdicts.known_records(key, dtype))
    static = statically_proven(device)
    return frozenset(v for v in supported if not verdict.failures(v) and (v in static or verdict.products(v)))


# (device index, activation dtype, HIERVIZ_W4_CUDA) -> the fast variants in use: asked on every
# product, so the answer (device queries, the verdict cache) is kept until a verdict changes
_PROVEN: dict[tuple[int, torch.dtype, str], frozenset[str]] = {}
w4_verdicts.when_verdicts_change(_PROVEN.clear)


def fast_variants(device: torch.device, dtype: torch.dtype = torch.float16) -> frozenset[str]:
    """The fast variants products of dtype may use on device: on the static list all it supports,
    else those a start-up proof on this platform passed (`enabled_variants`: the verdicts in
    memory after a proof, or from the disk cache); under the interpreter the Triton ones."""
    if device.type != "cuda":
        return frozenset(w4_verdicts.TRITON_VARIANTS)   # the interpreter: the CPU tests check it
    key = (_index(device), dtype, cuda_mode())
    if key not in _PROVEN:
        _PROVEN[key] = enabled_variants(torch.device("cuda", key[0]), dtype)
    return _PROVEN[key]


def platform_proven(device: torch.device, dtype: torch.dtype = torch.float16) -> bool:
    """Whether every fast variant this device supports may run here (the static list, or a passing
    verdict; an older GPU with none: False); under the interpreter, always."""
    supported = frozenset(supported_variants(device))
    return bool(supported) and fast_variants(device, dtype) >= supported


_DOT = re.compile(r"^\s*(%[\w#:]+)\s*=\s*ttng\.warp_group_dot\s+(%[\w]+)(?:#\d+)?\s*,.*?\}\s*:\s*(\S+)")
_WAIT = re.compile(r"ttng\.warp_group_dot_wait\b.*pendings\s*=\s*(\d+)")
_DEF = re.compile(r"^\s*(%[\w]+)(?::\d+)?\s*=")


def async_register_hazards(ttgir: str) -> list[str]:
    """Loops of a TTGIR module that carry an asynchronous wgmma across their back edge while its
    A operand lives in registers defined inside the loop (see the module docstring). Returns one
    line per such loop (empty: none)."""
    lines = ttgir.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "scf.for" not in line or not line.rstrip().endswith("{"):
            continue
        depth, body = 0, []
        for j in range(i, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            body.append(lines[j])
            if depth <= 0 and j > i:
                break
        defined = {m.group(1) for b in body[1:] if (m := _DEF.match(b))}
        in_flight: list[str] = []
        for b in body[1:]:
            if "scf.for" in b and b is not body[0]:
                continue
            m = _DOT.match(b)
            if m and "isAsync = true" in b:
                result, a_operand, a_type = m.groups()
                if a_type.startswith("tensor<") and a_operand in defined:
                    in_flight.append(result)
                else:
                    in_flight.append("")          # shared-memory or loop-invariant operand
                continue
            w = _WAIT.search(b)
            if w:
                keep = int(w.group(1))
                in_flight = in_flight[len(in_flight) - keep:] if keep else []
            if "scf.yield" in b:
                hazards = [r for r in in_flight if r]
                if hazards:
                    found.append(f"loop at TTGIR line {i + 1}: wgmma {', '.join(hazards)} with a register "
                                 f"operand still in flight at the back edge")
                break
    return found


def check_rows(n: int) -> torch.Tensor:
    """The output features a product is checked on: the first and the last few."""
    head = torch.arange(min(n, CHECK_HEAD_ROWS))
    tail = torch.arange(max(n - CHECK_TAIL_ROWS, len(head)), n)
    return torch.cat([head, tail])


def reference_rows(x: torch.Tensor, w: W4Weight, rows: torch.Tensor) -> torch.Tensor:
    """fp32 x @ W[rows].T (W in the kernel's input order: x is already permuted)."""
    idx = rows.to(w.scales.device)
    part = W4Weight(codes_of(w, idx), w.scales.index_select(0, idx), w.offsets.index_select(0, idx), w.group_size)
    return x.float() @ dequantize(part, torch.float32).t()


def row_errors(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of each row of y against ref (inf where y is not finite)."""
    d = (y.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    bad = ~torch.isfinite(y.float()).all(dim=-1)
    return torch.where(bad, torch.full_like(d, float("inf")), d)


def product_agrees(y: torch.Tensor, x: torch.Tensor, w: W4Weight) -> bool:
    """Whether the product y = x @ W.T agrees with the fp32 reference on the checked features."""
    rows = check_rows(w.out_features)
    ref = reference_rows(x, w, rows)
    got = y.index_select(-1, rows.to(y.device))
    return bool((row_errors(got, ref) <= TOLERANCE.get(x.dtype, 1e-2)).all())
