"""The W4 kernel's fast variants and what start-up proofs found about them, per platform.

The variant names and labels; the platform a verdict holds for (GPU, capability, driver, CUDA,
Triton, torch: `platform_key`); `Verdict`, which variants passed on which shapes, with its status
line; and the store of verdicts, in memory and under `options().cache_dir / "w4-proof"`, one JSON
file per platform, so that a restart on the same platform proves only shapes it has not met.
hierviz.quant.w4_proof runs the proofs and records them here; hierviz.quant.kernel_guard reads
them (`kernel_guard.enabled_variants`) to choose what a launch may use, and keeps its answers
until a verdict changes (`when_verdicts_change`). docs/kernels.md describes the proof.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from hierviz.config import options

# The variants only a proven platform uses: codes through TMA descriptors (`Config.tma`), the
# CUDA-core one-token kernel (`Config.gemv`), and the CUDA MMA kernel (`Config.cuda`,
# hierviz.quant.cuda_w4: tensor-core MMA from sm_80 on, compiled at run time by NVRTC).
TRITON_VARIANTS: tuple[str, ...] = ("tma", "gemv")
CUDA_VARIANT = "cuda_mma"
FAST_VARIANTS: tuple[str, ...] = (*TRITON_VARIANTS, CUDA_VARIANT)
VARIANT_LABELS = {"tma": "TMA variant", "gemv": "CUDA-core one-token variant", "cuda_mma": "CUDA MMA variant"}
CACHE_FORMAT = 1

Shape = tuple[int, int, int]          # (K in_features, N out_features, group size)


# ---- the platform ----------------------------------------------------------------------------

_DRIVER = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)")


def driver_version() -> str:
    """The NVIDIA driver's version, read without a subprocess (the kernel module's /proc file;
    else the CUDA driver API version torch reports)."""
    try:
        m = _DRIVER.search(Path("/proc/driver/nvidia/version").read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    api = getattr(torch._C, "_cuda_getDriverVersion", None)
    if api is not None:
        try:
            return f"cuda-api-{api()}"
        except Exception:  # pragma: no cover - depends on the install
            pass
    return "unknown"


def _triton_full_version() -> str:
    # imported here: Triton loads only when a verdict is asked for
    from hierviz.quant.triton_w4_kernels import HAVE_TRITON, triton
    return triton.__version__ if HAVE_TRITON else "none"


def platform_key(device: Union[str, torch.device]) -> dict[str, str]:
    """What a verdict holds for: the GPU, its compute capability, the driver, CUDA, Triton and torch
    versions (on the CPU: the Triton interpreter)."""
    dev = torch.device(device)
    key = {"torch": torch.__version__, "triton": _triton_full_version()}
    if dev.type == "cuda":
        i = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(i)
        key.update(gpu=torch.cuda.get_device_name(i), capability=f"{major}.{minor}", driver=driver_version(),
                   cuda=torch.version.cuda or "unknown")
    else:
        key.update(gpu="cpu (TRITON_INTERPRET=1)", capability="interpreter", driver="none", cuda="none")
    return key


def shape_id(shape: Shape) -> str:
    k, n, g = shape
    return f"{k}x{n}g{g}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- verdicts ----------------------------------------------------------------------------------

def _failure_text(variant: str, f: dict[str, Any]) -> str:
    rows = f"{f['rows']} row{'s' if f['rows'] != 1 else ''}"
    mode = ", batch-invariant mode" if f["mode"] == "invariant" and f["why"] != "not bit-invariant" else ""
    what = {"wrong rows": "wrong", "not bit-invariant": "not bit-invariant"}.get(f["why"], "failed to run")
    return f"{VARIANT_LABELS.get(variant, variant)} {what} at {f['K']}x{f['N']} g{f['group']}, {rows}{mode}"


@dataclass
class Verdict:
    """Which fast variants passed on which shapes, on one platform, for one activation dtype.
    records: shape id -> {"K", "N", "group", "rows", "seconds", "variants": {name: {"products",
    "failures": [{"K", "N", "group", "rows", "mode", "why"}]}}}."""
    platform: dict[str, str]
    dtype: str
    supported: tuple[str, ...]           # the fast variants this GPU can run
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "proved"               # proved | remembered | static | cpu | none
    seconds: float = 0.0                 # this call's own time

    def failures(self, variant: str) -> list[dict[str, Any]]:
        return [f for r in self.records.values() for f in r["variants"].get(variant, {}).get("failures", [])]

    def products(self, variant: str) -> int:
        return sum(r["variants"].get(variant, {}).get("products", 0) for r in self.records.values())

    def enabled(self) -> frozenset[str]:
        """The variants that ran at least one product here and failed none (all on the static list)."""
        if self.source == "static":
            return frozenset(self.supported)
        return frozenset(v for v in self.supported if self.products(v) and not self.failures(v))

    def used(self) -> frozenset[str]:
        """The variants some product of these shapes exercised (bf16 and narrow layers never get
        the CUDA-core kernel, for one)."""
        if self.source == "static":
            return frozenset(self.supported)
        return frozenset(v for v in self.supported if self.products(v) or self.failures(v))

    def passed(self) -> bool:
        """Every variant these shapes use is enabled, and there is one (none supported: False)."""
        return bool(self.used()) and self.enabled() == self.used()

    @property
    def shapes(self) -> list[Shape]:
        return sorted((r["K"], r["N"], r["group"]) for r in self.records.values())

    @property
    def rows(self) -> list[int]:
        """The row counts every record covers."""
        common: Optional[set[int]] = None
        for r in self.records.values():
            common = set(r["rows"]) if common is None else common & set(r["rows"])
        return sorted(common or ())

    def summary(self) -> str:
        """One line for a status display."""
        where = f"{self.platform.get('gpu', '?')}, Triton {'.'.join(self.platform.get('triton', '?').split('.')[:2])}"
        fallback = " — using the pointer-load kernels"
        if self.source == "cpu":
            return "W4 fast path: not used on the CPU (the Triton kernels run on CUDA GPUs)"
        # HIERVIZ_W4_CUDA moves fp16 products to another kernel: say so where it is enabled
        whose = {"target": "the target's fp16 products",
                 "auto": "fp16 products of the weights it is timed fastest on"}.get(options().w4_cuda, "fp16 products")
        cuda = f" — {whose} in the {VARIANT_LABELS[CUDA_VARIANT]}" if CUDA_VARIANT in self.enabled() else ""
        if self.source == "static":
            return f"W4 fast path: on ({where}: a platform the full correctness sweep passed on){cuda}"
        if not self.supported:
            return (f"W4 fast path: not available on this GPU ({where}, compute capability "
                    f"{self.platform.get('capability', '?')}: no TMA){fallback}")
        if self.source == "none":
            return "W4 fast path: no Triton W4 weights to prove in this stack"
        n = len(self.records)
        recorded = sum(r.get("seconds", 0.0) for r in self.records.values())
        took = f"{recorded:.0f} s" + (", remembered from an earlier start" if self.source == "remembered" else "")
        r = len(self.rows)
        scope = f"{where}, {n} shape{'s' if n != 1 else ''} x {r} row count{'s' if r != 1 else ''}, {took}"
        enabled = self.enabled()
        failed = [v for v in self.supported if self.failures(v)]
        first_failure = "; ".join(_failure_text(v, self.failures(v)[0]) for v in failed)
        if self.passed():
            if self.used() != frozenset(self.supported):
                used = [VARIANT_LABELS[v] for v in self.supported if v in self.used()]
                which = "the one these shapes use" if len(used) == 1 else "the ones these shapes use"
                return f"W4 fast path: proven here for the {' and '.join(used)}, {which} ({scope}){cuda}"
            return f"W4 fast path: proven here ({scope}){cuda}"
        if not enabled:
            why = first_failure or "no product of these shapes used a fast variant"
            return f"W4 fast path: off ({why}){fallback}"
        on = ", ".join(VARIANT_LABELS[v] for v in self.supported if v in enabled)
        return f"W4 fast path: partly proven here ({on} on; off: {first_failure}) ({scope})"

    def to_dict(self) -> dict[str, Any]:
        return {"platform": self.platform, "dtype": self.dtype, "supported": list(self.supported),
                "enabled": sorted(self.enabled()), "passed": self.passed(), "source": self.source,
                "seconds": round(self.seconds, 2), "summary": self.summary(), "records": self.records}


# ---- who re-chooses when a verdict changes -------------------------------------------------------

_ON_CHANGE: list[Callable[[], None]] = []


def when_verdicts_change(callback: Callable[[], None]) -> None:
    """Call back (no arguments) whenever a verdict changes: caches of choices made under it drop."""
    _ON_CHANGE.append(callback)


def verdicts_changed() -> None:
    """Tell the caches that depend on the verdicts (kernel_guard's per-device answers, triton_w4's
    first-use results) to drop what they hold."""
    for callback in _ON_CHANGE:
        callback()


# ---- what is known per platform: memory, then disk ---------------------------------------------

_KNOWN: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}    # key json -> dtype -> shape id -> record
_LOCK = threading.Lock()


def _key_text(key: dict[str, str]) -> str:
    return json.dumps(key, sort_keys=True)


def cache_file(key: dict[str, str]) -> Path:
    """The platform's verdict file: one per platform key, named by its digest."""
    digest = hashlib.sha256(_key_text(key).encode()).hexdigest()[:16]
    return options().cache_dir / "w4-proof" / f"{digest}.json"


def _valid_record(r: Any) -> bool:
    try:
        return (all(isinstance(r[f], int) for f in ("K", "N", "group")) and all(isinstance(m, int) for m in r["rows"])
                and all(isinstance(v["products"], int) and isinstance(v["failures"], list)
                        for v in r["variants"].values()))
    except (KeyError, TypeError, AttributeError):
        return False


def _read_disk(key: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """The verdicts recorded on disk for this platform; an unreadable, corrupt or foreign file is
    ignored with a warning (the proof then runs again)."""
    path = cache_file(key)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
            raise ValueError(f"not a format-{CACHE_FORMAT} verdict file")
        if data.get("platform") != key:
            raise ValueError(f"it holds verdicts of another platform ({data.get('platform')})")
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for dtype, records in data["dtypes"].items():
            good = {sid: r for sid, r in records.items() if _valid_record(r)}
            if len(good) != len(records):
                raise ValueError("it has malformed records")
            out[dtype] = good
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        warnings.warn(f"W4 proof cache {path} ignored: {e}", RuntimeWarning, stacklevel=3)
        return {}


def _write_disk(key: dict[str, str], known: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Write atomically (a file another process reads is never half written); a failure to write
    only warns: the verdict holds in memory for this process."""
    path = cache_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"format": CACHE_FORMAT, "platform": key, "dtypes": known}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"W4 proof cache {path} not written: {e}", RuntimeWarning, stacklevel=3)


def known_records(key: dict[str, str], dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """shape id -> record of every shape proven on this platform for dtype (memory, else disk)."""
    with _LOCK:
        text = _key_text(key)
        if text not in _KNOWN:
            _KNOWN[text] = _read_disk(key)
        return dict(_KNOWN[text].get(dtype_name(dtype), {}))


def remember(key: dict[str, str], dtype: torch.dtype, records: dict[str, dict[str, Any]]) -> None:
    """Merge new records into the platform's verdicts (a shape proven again replaces its record),
    write them to disk, and make the kernels choose again."""
    with _LOCK:
        text = _key_text(key)
        merged = _read_disk(key)
        for dt, recs in _KNOWN.get(text, {}).items():
            merged.setdefault(dt, {}).update(recs)
        merged.setdefault(dtype_name(dtype), {}).update(records)
        _KNOWN[text] = merged
        _write_disk(key, merged)
    verdicts_changed()


def forget_in_memory() -> None:
    """Drop the verdicts held in memory (the next ask reads the disk again)."""
    with _LOCK:
        _KNOWN.clear()
    verdicts_changed()


# ---- the kernel each weight runs under HIERVIZ_W4_CUDA=auto -------------------------------------

# (device index, K, N, group, act order, batch-invariant) -> whether the CUDA MMA kernel runs the
# weights of that kind: chosen from timings (hierviz.quant.w4_choice), or fixed to the Triton kernel
# by the first product of a kind nobody chose for, so that a weight never changes kernel mid-run
# (its rows' bits would change with it)
KernelKind = tuple[int, int, int, int, bool, bool]
# an entry of the CUDA kernel: (token tiles per block, row tiles per warp, K slices, warps per row tile)
Entry = tuple[int, int, int, int]
_KERNEL_CHOICE: dict[KernelKind, bool] = {}
_KERNEL_TIMES: dict[KernelKind, dict[str, Any]] = {}
# the CUDA kernel's entry by row count, for a kind it runs: (rows timed, Entry) sorted
_TILE_PLAN: dict[KernelKind, tuple[tuple[int, Entry], ...]] = {}
# the kernel by row count of a kind that is not batch-invariant and runs each row count in the kernel
# timed faster there (an intermediate's products decide only what is drafted): (rows timed, CUDA?) sorted
_ROW_KERNEL: dict[KernelKind, tuple[tuple[int, bool], ...]] = {}


def kernel_kind(w: Any) -> KernelKind:
    """The kind of a W4 weight that its kernel choice is made for."""
    dev = w.scales.device
    return (dev.index if dev.index is not None else -1, w.in_features, w.out_features, w.group_size,
            w.perm is not None, bool(w.batch_invariant))


def cuda_chosen(w: Any, m: Optional[int] = None) -> bool:
    """Whether the CUDA MMA kernel runs w's m-row products under auto (m None: any of them); asked
    before each of w's products, so the first ask of a kind with no choice fixes it to the Triton
    kernel. A kind chosen by rows answers for the smallest timed row count at or above m."""
    kind = kernel_kind(w)
    by_rows = _ROW_KERNEL.get(kind)
    if by_rows and m is not None:
        return _at_rows(by_rows, m, by_rows[-1][1])
    return _KERNEL_CHOICE.setdefault(kind, False)


def _at_rows(plan: tuple[tuple[int, Any], ...], m: int, past: Any = None) -> Any:
    """What a plan ((rows timed, value) sorted) gives an m-row product: the value of the smallest
    timed row count at or above m; `past` beyond the largest."""
    return next((value for rows, value in plan if rows >= m), past)


def choose_kernel(kind: KernelKind, cuda: bool, times: Optional[dict[str, Any]] = None,
                  tiles: Optional[dict[int, Entry]] = None,
                  by_rows: Optional[dict[int, bool]] = None) -> bool:
    """Record the kernel a kind runs, unless it has one already (chosen, or fixed by a product),
    and for the CUDA kernel its entry per row count (rows timed -> Entry); by_rows (rows timed -> CUDA?), for a kind that is not batch-invariant: each row count's
    own kernel (cuda: whether any runs CUDA). Returns the choice in force."""
    if by_rows and kind[5] and len(set(by_rows.values())) > 1:     # a verifier's rows keep their bits only within one kernel
        raise ValueError(f"{kind_label(kind)} is batch-invariant: its products must all run one kernel")
    if kind not in _KERNEL_CHOICE:
        if times is not None:
            _KERNEL_TIMES[kind] = times
        if cuda and tiles:
            _TILE_PLAN[kind] = tuple(sorted(tiles.items()))
        if cuda and by_rows and not all(by_rows.values()):
            _ROW_KERNEL[kind] = tuple(sorted(by_rows.items()))
    return _KERNEL_CHOICE.setdefault(kind, cuda)


def cuda_rows(kind: KernelKind) -> Optional[str]:
    """For a kind chosen by rows, the row counts the CUDA kernel runs ("1-40", "1-24, 65-96"; a
    range ending at the largest timed count runs on past it: "65+"), else None."""
    by_rows = _ROW_KERNEL.get(kind)
    if not by_rows:
        return None
    ranges: list[list[int]] = []      # [first row, last timed row] of each run of CUDA row counts
    prev = 0
    for rows, cuda in by_rows:
        if cuda and ranges and ranges[-1][1] == prev:
            ranges[-1][1] = rows
        elif cuda:
            ranges.append([prev + 1, rows])     # a row count runs the plan of the timed one at or above it
        prev = rows
    open_end = by_rows[-1][1]
    return ", ".join(f"{a}+" if open_end and b == prev else f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)


def planned_entry(kind: KernelKind, m: int) -> Optional[Entry]:
    """The CUDA kernel's Entry (token tiles per block, row tiles per warp, K slices, warps per row
    tile) that timing chose for an m-row product of this kind: that of the smallest timed row count
    at or above m; None for a kind without a plan or past it."""
    return _at_rows(_TILE_PLAN.get(kind, ()), m)


def kernel_choices() -> dict[KernelKind, bool]:
    """Every kind's kernel choice so far (True: the CUDA MMA kernel)."""
    return dict(_KERNEL_CHOICE)


def kernel_times(kind: KernelKind) -> Optional[dict[str, Any]]:
    """The timings a kind's choice was made from, if it was timed."""
    return _KERNEL_TIMES.get(kind)


def forget_kernel_choices() -> None:
    """Drop every choice (tests; a process that loads new weights keeps its choices)."""
    _KERNEL_CHOICE.clear()
    _KERNEL_TIMES.clear()
    _TILE_PLAN.clear()
    _ROW_KERNEL.clear()


def kernel_that_ran(machine: Optional[dict[str, Any]]) -> str:
    """The fp16 W4 kernel a measurement's `machine` (hierviz.machine.machine_info) says ran all its
    products: CUDA_VARIANT, or "triton" (a record without the field, or kernels by kind, counts as
    the Triton kernel's)."""
    return CUDA_VARIANT if (machine or {}).get("w4_fp16_kernel") == CUDA_VARIANT else "triton"


def kernel_summary() -> str:
    """One line naming the weights the CUDA MMA kernel runs under auto: "triton" where it runs
    none, "cuda_mma" where it runs every kind, else the shapes it runs."""
    cuda = sorted(k for k, v in _KERNEL_CHOICE.items() if v)
    if not cuda:
        return "triton"
    if len(cuda) == len(_KERNEL_CHOICE) and not _ROW_KERNEL:
        return CUDA_VARIANT
    labels = [kind_label(k) + (f" at {cuda_rows(k)} rows" if k in _ROW_KERNEL else "") for k in cuda]
    return f"{CUDA_VARIANT} for {', '.join(labels)}; triton for the rest"


def kind_label(kind: KernelKind) -> str:
    """A kind as messages name it: "KxN", with " (verifier)" for a batch-invariant weight's."""
    return f"{kind[1]}x{kind[2]}{' (verifier)' if kind[5] else ''}"


def kernel_choice_records() -> list[dict[str, Any]]:
    """Every kind's kernel choice with the timings it was made from (measurement records)."""
    return [{"K": k[1], "N": k[2], "group": k[3], "act_order": k[4], "batch_invariant": k[5],
             "kernel": "by rows" if k in _ROW_KERNEL else CUDA_VARIANT if cuda else "triton",
             **({"cuda_rows": cuda_rows(k)} if k in _ROW_KERNEL else {}), **(_KERNEL_TIMES.get(k) or {"timed": False})}
            for k, cuda in sorted(_KERNEL_CHOICE.items())]
