"""The start-up proof of the W4 kernel's fast variants on the platform it runs on.

The Hopper-only variants of the Triton W4 product (TMA code loads; the CUDA-core one-token
kernel) and the CUDA MMA one are used where `kernel_guard.PROVEN_PLATFORMS` (or its CUDA list)
names the platform, or where a proof on this very platform passed: `prove` runs each variant the
GPU supports on the given weight shapes at every row count of PROOF_ROWS, in both modes (normal;
batch-invariant, where each row must also equal the row computed alone, bit for bit), against a
dequantized fp32 reference, and records per variant whether it passed, which (shape, rows, mode)
failed, and the time taken. The verdicts are kept per platform by hierviz.quant.w4_verdicts (in
memory and on disk), so that a restart on the same platform proves only shapes it has not met.
`prove_models` is what a stack load calls; `kernel_guard.fast_variants` reads the verdicts.
docs/kernels.md describes it.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from hierviz.config import options
from hierviz.quant import kernel_guard, triton_w4
from hierviz.quant.w4_verdicts import Shape, Verdict, dtype_name, known_records, platform_key, remember, shape_id
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

Product = Callable[[torch.Tensor, W4Weight, "triton_w4.Config"], torch.Tensor]


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


# ---- what the recorded verdicts cover -----------------------------------------------------------

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
    return Verdict(key, dtype_name(dtype), kernel_guard.supported_variants(device), records, source, seconds)


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
    return Verdict(key, dtype_name(dtype), supported, records, "proved", time.perf_counter() - t0)


def triton_weights(models: Iterable[Any]) -> Iterator[W4Weight]:
    """The W4 weights the Triton kernel (and so its CUDA MMA variant) multiplies in these models
    (hierviz.models.llama.Linear keeps them in `.w4`; None entries and other kernels are skipped)."""
    for model in models:
        if model is None:
            continue
        for mod in model.modules():
            if getattr(mod, "w4_kernel", None) != "triton":
                continue
            for w in getattr(mod, "w4", None) or []:
                if isinstance(w, W4Weight) and triton_w4.supports(w):
                    yield w


def model_shapes(models: Iterable[Any]) -> list[Shape]:
    """The unique (K, N, group) of the W4 weights the Triton kernel multiplies in these models."""
    return sorted({(w.in_features, w.out_features, w.group_size) for w in triton_weights(models)})


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
    name = dtype_name(dtype)
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
