"""The start-up proof of the W4 kernel's fast variants on the platform it runs on.

The Hopper-only variants of the Triton W4 product (TMA code loads; the CUDA-core one-token
kernel) are used where `kernel_guard.PROVEN_PLATFORMS` lists the (GPU, Triton) pair, or where a
proof on this very platform passed: `prove` runs each variant the GPU supports on the given weight
shapes at every row count of PROOF_ROWS, in both modes (normal; batch-invariant, where each row
must also equal the row computed alone, bit for bit), against a dequantized fp32 reference, and
records per variant whether it passed, which (shape, rows, mode) failed, and the time taken.
Verdicts are kept per platform (GPU, capability, driver, CUDA, Triton, torch: `platform_key`) in
memory and under `options().cache_dir / "w4-proof"`, one JSON file per platform, so that a
restart on the same platform proves only shapes it has not met. `prove_models` is what a stack
load calls; `kernel_guard.fast_variants` reads the verdicts. docs/kernels.md describes it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

from hierviz.config import options
from hierviz.quant import kernel_guard, triton_w4
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight, codes_of, dequantize_unpermuted

# Every row count a W4 product can have where a fast variant changes the kernel configuration.
# Decode, draft and verify forwards run padded to a CUDA-graph bucket (hierviz.models.cuda_graphs
# BUCKETS, up to 128) or, on the dynamic path, at their exact size, which a stack's tree and draft
# settings keep within decoders.cache_margin; the tuned configurations use TMA up to 64 rows and
# keep the one-row K split (a TMA product) up to INVARIANT_MAX_ROWS = 128 for a verifier's weight.
# Longer forwards (prefills, wider verifications) take the 128 x 64 pointer-load tiles whatever
# the verdict, so they have nothing to prove (`prove` skips any product a variant does not change).
PROOF_ROWS: list[int] = list(range(1, INVARIANT_MAX_ROWS + 1))
MODES = ("normal", "invariant")
VARIANT_LABELS = {"tma": "TMA variant", "gemv": "CUDA-core one-token variant", "cuda_mma": "CUDA MMA variant"}
CACHE_FORMAT = 1

Shape = tuple[int, int, int]          # (K in_features, N out_features, group size)
Product = Callable[[torch.Tensor, W4Weight, "triton_w4.Config"], torch.Tensor]


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
    return triton_w4.triton.__version__ if triton_w4.HAVE_TRITON else "none"


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---- one weight: products against the reference ------------------------------------------------

def synthetic_weight(n: int, k: int, g: int, device: Union[str, torch.device], seed: int, act_order: bool,
                     dtype: torch.dtype) -> W4Weight:
    """Random codes with GPTQ-like scales and zero points; act_order adds a random permutation."""
    gen = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scales = torch.rand(n, k // g, device=device, generator=gen) * 0.02 + 0.002
    zeros = torch.randint(6, 10, (n, k // g), device=device, generator=gen).to(scales.dtype)
    perm = torch.randperm(k, device=device, generator=gen) if act_order else None
    return W4Weight(codes, scales.to(dtype), (-scales * zeros).to(dtype), g, perm)


REFERENCE_CHUNK_ELEMENTS = 1 << 26     # fp32 elements of dequantized weight held at once (256 MB)


def reference(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """fp32 x @ W.T in the checkpoint's input order, dequantizing a slice of output features at a
    time (a loaded stack shares the GPU: a 28672-wide layer would take 1 GB dense)."""
    codes = codes_of(w)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // w.in_features)
    parts = []
    for a in range(0, w.out_features, step):
        part = W4Weight(codes[a:a + step], w.scales[a:a + step], w.offsets[a:a + step], w.group_size, w.perm)
        parts.append(x.float() @ dequantize_unpermuted(part, torch.float32).t())
    return torch.cat(parts, -1)


@dataclass
class RowCheck:
    """One (weight, configuration choice, mode) over a list of row counts."""
    rows_checked: int
    wrong_rows_at: list[int]            # row counts whose product had a row beyond the tolerance
    not_bit_invariant_at: list[int]     # row counts whose rows differ from the same rows alone
    worst_rel_err: float


def check_products(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, ref: torch.Tensor,
                   rows: list[int], invariant: bool, check_bits: bool, tol: float) -> RowCheck:
    """product(x[:m]) for each m of rows, each row against ref (relative error above tol, or a
    non-finite value, is wrong); with invariant and check_bits, each row also against the same
    row computed alone (rows must then be <= INVARIANT_MAX_ROWS). One device sync in all."""
    alone = None
    if invariant and check_bits:
        alone = torch.cat([product(x[r:r + 1]) for r in range(min(max(rows), INVARIANT_MAX_ROWS))])
    errs, bits = [], []
    for m in rows:
        y = product(x[:m])
        errs.append(kernel_guard.row_errors(y, ref[:m]).max())
        if alone is not None:
            bits.append(torch.ne(y, alone[:m]).any(dim=-1).sum())
    errs_t = torch.stack(errs).cpu()
    bits_t = torch.stack(bits).cpu().tolist() if bits else []
    return RowCheck(len(rows), [m for m, e in zip(rows, errs_t.tolist()) if not e <= tol],
                    [m for m, b in zip(rows, bits_t) if b], float(errs_t.max()))


def _kernel_product(x: torch.Tensor, w: W4Weight, cfg: "triton_w4.Config") -> torch.Tensor:
    """The raw kernel with an explicit configuration: no first-use check, no fallback."""
    return triton_w4.triton_w4_matmul(x, w, config=cfg)


def _config(x: torch.Tensor, w: W4Weight, variants: frozenset[str]) -> "triton_w4.Config":
    return triton_w4.chosen_config(x, w, variants=variants)


def _exercises(x: torch.Tensor, w: W4Weight, m: int, variant: str) -> bool:
    """Whether enabling `variant` changes the configuration of an m-row product of w (in invariant
    mode also: of the one-row product its rows must equal)."""
    on, off = frozenset({variant}), frozenset()
    if _config(x[:m], w, on) != _config(x[:m], w, off):
        return True
    return w.batch_invariant and m <= INVARIANT_MAX_ROWS and _config(x[:1], w, on) != _config(x[:1], w, off)


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
        cuda_variant = kernel_guard.CUDA_VARIANT
        whose = "the target's fp16 products" if kernel_guard.cuda_mode() == "target" else "fp16 products"
        cuda = f" — {whose} in the {VARIANT_LABELS[cuda_variant]}" if cuda_variant in self.enabled() else ""
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
        return dict(_KNOWN[text].get(_dtype_name(dtype), {}))


def remember(key: dict[str, str], dtype: torch.dtype, records: dict[str, dict[str, Any]]) -> None:
    """Merge new records into the platform's verdicts (a shape proven again replaces its record),
    write them to disk, and make the kernels choose again."""
    with _LOCK:
        text = _key_text(key)
        merged = _read_disk(key)
        for dt, recs in _KNOWN.get(text, {}).items():
            merged.setdefault(dt, {}).update(recs)
        merged.setdefault(_dtype_name(dtype), {}).update(records)
        _KNOWN[text] = merged
        _write_disk(key, merged)
    kernel_guard.verdicts_changed()


def forget_in_memory() -> None:
    """Drop the verdicts held in memory (the next ask reads the disk again)."""
    with _LOCK:
        _KNOWN.clear()
    kernel_guard.verdicts_changed()


def enabled_variants(device: torch.device, dtype: torch.dtype) -> frozenset[str]:
    """The fast variants this platform may use for dtype: those that failed no recorded product
    here and either passed one or are on the static list (a failure recorded here outranks it)."""
    supported = kernel_guard.supported_variants(device)
    key = platform_key(device)
    verdict = Verdict(key, _dtype_name(dtype), supported, known_records(key, dtype))
    static = kernel_guard.statically_proven(device)
    return frozenset(v for v in supported if not verdict.failures(v) and (v in static or verdict.products(v)))


def _covered(record: Optional[dict[str, Any]], rows: Iterable[int], variants: Iterable[str] = ()) -> bool:
    """Whether a shape's record covers these rows and holds a result for each of these variants
    (a variant turned on later, as HIERVIZ_W4_CUDA does, is proven then)."""
    return (record is not None and set(rows) <= set(record["rows"])
            and all(v in record["variants"] for v in variants))


def shapes_verdict(device: torch.device, dtype: torch.dtype, shapes: list[Shape], source: str = "remembered",
                   seconds: float = 0.0) -> Verdict:
    """The recorded verdict over these shapes, plus any shape on which a variant failed on this
    platform (such a failure turns the variant off everywhere here)."""
    key = platform_key(device)
    ids = {shape_id(s) for s in shapes}
    records = {sid: r for sid, r in known_records(key, dtype).items()
               if sid in ids or any(v["failures"] for v in r["variants"].values())}
    return Verdict(key, _dtype_name(dtype), kernel_guard.supported_variants(device), records, source, seconds)


def proven_for(device: Union[str, torch.device], shapes: list[Shape], dtype: torch.dtype = torch.float16,
               rows: Optional[list[int]] = None) -> bool:
    """Whether the fast variants may run on these shapes here: the CPU interpreter, the static
    list, or a recorded verdict of each shape covering rows (default PROOF_ROWS) that passed."""
    dev = torch.device(device)
    if dev.type != "cuda" or kernel_guard.on_static_list(dev):
        return True
    records = known_records(platform_key(dev), dtype)
    supported = kernel_guard.supported_variants(dev)
    return (all(_covered(records.get(shape_id(s)), rows or PROOF_ROWS, supported) for s in shapes)
            and shapes_verdict(dev, dtype, shapes).passed())


# ---- proving -----------------------------------------------------------------------------------

def _prove_shape(shape: Shape, rows: list[int], dtype: torch.dtype, dev: torch.device, supported: tuple[str, ...],
                 product: Product, check_bits: bool) -> dict[str, dict[str, Any]]:
    """variant -> {"products": checked, "failures": [...]} for one synthetic weight of shape."""
    k, n, g = shape
    w = synthetic_weight(n, k, g, dev, seed=k * 7 + n + g, act_order=False, dtype=dtype)
    gen = torch.Generator(device=dev).manual_seed(k + n)
    x = torch.randn(max(rows), k, device=dev, generator=gen).to(dtype)
    ref = reference(x, w)
    results: dict[str, dict[str, Any]] = {}
    for variant in supported:
        done = results[variant] = {"products": 0, "failures": []}
        allowed = frozenset({variant})
        for mode in MODES:
            w.batch_invariant = mode == "invariant"
            ms = [m for m in rows if (mode == "normal" or m <= INVARIANT_MAX_ROWS) and _exercises(x, w, m, variant)]
            if not ms:
                continue
            try:
                check = check_products(lambda xs: product(xs, w, _config(xs, w, allowed)), x, ref, ms,
                                       mode == "invariant", check_bits, kernel_guard.TOLERANCE[dtype])
            except torch.cuda.OutOfMemoryError:
                raise          # the GPU's state, not the variant's fault: nothing to record
            except Exception as e:      # a compile or launch error on a new platform fails the variant
                done["failures"].append({"K": k, "N": n, "group": g, "rows": ms[0], "mode": mode, "why": "error",
                                         "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            done["products"] += check.rows_checked
            for why, at in (("wrong rows", check.wrong_rows_at), ("not bit-invariant", check.not_bit_invariant_at)):
                done["failures"] += [{"K": k, "N": n, "group": g, "rows": m, "mode": mode, "why": why} for m in at]
    return results


def prove(shapes: list[Shape], rows: Optional[list[int]] = None, dtype: torch.dtype = torch.float16,
          device: Union[str, torch.device] = "cuda", product: Optional[Product] = None,
          check_bits: Optional[bool] = None, remember_verdict: bool = True,
          log: Optional[Callable[[str], None]] = None) -> Verdict:
    """Each fast variant this device supports on each (K, N, group) shape of synthetic weights, at
    every row count of rows (default PROOF_ROWS) and both modes, where the variant changes the
    configuration: every row within kernel_guard.TOLERANCE of the fp32 reference, and in
    batch-invariant mode (rows <= INVARIANT_MAX_ROWS) bit-identical to the row computed alone.
    check_bits: that bit check (default: on CUDA with ordered split-K, where products are bitwise
    repeatable; the interpreter rounds by its own blocking). product(x, w, config) replaces the
    kernel (tests). remember_verdict: merge the records into the platform's cache and re-choose."""
    dev = torch.device(device)
    rows = sorted(set(rows or PROOF_ROWS))
    product = product or _kernel_product
    supported = kernel_guard.supported_variants(dev)
    key = platform_key(dev)
    t0 = time.perf_counter()
    records: dict[str, dict[str, Any]] = {}
    bits = check_bits if check_bits is not None else dev.type == "cuda" and options().w4_deterministic
    for shape in shapes:
        t_shape = time.perf_counter()
        results = _prove_shape(shape, rows, dtype, dev, supported, product, bits)
        if dev.type == "cuda":
            torch.cuda.empty_cache()     # the loaded stack shares the GPU: hand each weight back
        sid = shape_id(shape)
        records[sid] = {"K": shape[0], "N": shape[1], "group": shape[2], "rows": rows, "variants": results,
                        "seconds": round(time.perf_counter() - t_shape, 2)}
        if log is not None:
            bad = [v for v, r in results.items() if r["failures"]]
            log(f"{'WRONG' if bad else 'ok   '} {sid} "
                + " ".join(f"{v}: {r['products']} products, {len(r['failures'])} failing" for v, r in results.items())
                + f" ({records[sid]['seconds']:.1f} s)")
    if remember_verdict:
        remember(key, dtype, records)
    return Verdict(key, _dtype_name(dtype), supported, records, "proved", time.perf_counter() - t0)


def model_shapes(models: Iterable[Any]) -> list[Shape]:
    """The unique (K, N, group) of the W4 weights the Triton kernel multiplies in these models
    (hierviz.models.llama.Linear keeps them in `.w4`; None entries and other kernels are skipped)."""
    shapes = set()
    for model in models:
        if model is None:
            continue
        for mod in model.modules():
            if getattr(mod, "w4_kernel", None) != "triton":
                continue
            for w in getattr(mod, "w4", None) or []:
                if isinstance(w, W4Weight) and triton_w4.supports(w):
                    shapes.add((w.in_features, w.out_features, w.group_size))
    return sorted(shapes)


def prove_models(models: Iterable[Any], dtype: torch.dtype, device: Union[str, torch.device],
                 rows: Optional[list[int]] = None, log: Optional[Callable[[str], None]] = None) -> Verdict:
    """Prove the fast variants on the W4 shapes of a loaded stack's models, before its first product
    (call it before warm-up and CUDA-graph capture: configurations are chosen at capture). Shapes
    the platform's cache already covers, and platforms on the static list, cost nothing. The
    verdict covers the models' shapes and any shape on which a variant failed here."""
    dev = torch.device(device)
    want = sorted(set(rows or PROOF_ROWS))
    shapes = model_shapes(models)
    supported = kernel_guard.supported_variants(dev) if dev.type == "cuda" else ()
    key = platform_key(dev)
    name = _dtype_name(dtype)
    if dev.type != "cuda":
        return Verdict(key, name, supported, source="cpu")
    if kernel_guard.on_static_list(dev):
        return Verdict(key, name, supported, source="static")
    if not supported or not shapes:
        return Verdict(key, name, supported, source="none")
    t0 = time.perf_counter()
    known = known_records(key, dtype)
    missing = [s for s in shapes if not _covered(known.get(shape_id(s)), want, supported)]
    if missing:
        try:
            prove(missing, want, dtype, dev, log=log)
        except torch.cuda.OutOfMemoryError:
            # the stack left too little room: the shapes stay unproven (tried again at the next load)
            warnings.warn("the W4 start-up proof ran out of GPU memory; the unproven shapes keep the "
                          "pointer-load kernels", RuntimeWarning, stacklevel=2)
            torch.cuda.empty_cache()
    return shapes_verdict(dev, dtype, shapes, "proved" if missing else "remembered", time.perf_counter() - t0)
