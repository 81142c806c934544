"""Which kernel each W4 weight runs under HIERVIZ_W4_CUDA=auto (the default): for a verifier's
weight, the CUDA MMA kernel where it is proven and timed at least as fast as the Triton kernel at
every row count its model's forwards multiply (every count the engine pads to, unless the caller
names its workload), the Triton kernel elsewhere; for a weight that is not batch-invariant (an
intermediate's, whose products decide only what is drafted), at each row count the kernel timed
faster there.

A verifier's products must all run one kernel (its rows keep their bits only within one), so the
choice is made per kind of weight (shape, group, act order, batch-invariant or not: w4_verdicts.
kernel_kind; an intermediate's kind by row count), once per process, before the weight's first
product: a stack load calls
`choose_for_models` after the start-up proof (hierviz.stack), as the measurement tools do after
building their models. Each kind is timed on synthetic weights of its shape, both kernels in the
mode the weight runs in (a verifier's batch-invariant products, another weight's normal ones), at
CHOICE_ROWS; the CUDA kernel at each of its tile choices per row count (tile_candidates: any gives a
row the same bits) and, for a kind that is not batch-invariant, at fewer K slices and with two warps
per row tile too (split_candidates, k_warp_candidates: sums in another order, which only what is
drafted sees), so a kind the CUDA kernel runs also gets the fastest entry at each row count
(w4_verdicts.planned_entry). Every method of a comparison runs the same weights, so the comparison stays fair:
a kernel that is faster at one token but slower on the tree verifications EAGLE-2's target runs
is not chosen for that weight, as those rows are in the workload. docs/kernels.md gives the choices measured on the H100 and H200."""
from __future__ import annotations

import itertools
import math
import statistics
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch

from hierviz.config import options, overrides
from hierviz.quant import cuda_w4, kernel_guard, triton_w4, w4_verdicts
from hierviz.quant.tickets import multiprocessor_count
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight
from hierviz.quant.w4_proof import synthetic_weight, triton_weights

# the row counts the engine multiplies: every bucket the static runners pad a forward to
# (hierviz.models.cuda_graphs.BUCKETS: a 30-node tree runs 32 rows there), and for the dynamic
# path the edges of the direct loop's 8-token tiles and of the staged loop's passes
CHOICE_ROWS: tuple[int, ...] = (1, 2, 4, 8, 9, 16, 17, 24, 25, 32, 40, 48, 64, 96, 128)
# the CUDA kernel is chosen when no row count is slower than Triton by more than this (the timings'
# repeat-to-repeat noise is about 1-2 %)
NOISE = 1.03
COPIES_BYTES = 128 << 20       # weight copies cycled per timing: more than the L2 of any GPU here
MAX_COPIES = 16
MAX_PASSES = 4                 # passes of the grid over the tokens a timed tile choice may take
TILES_NOISE = 1.01
# a kind that is not batch-invariant (an intermediate's) also times its K split divided by these:
# cuda_w4.split_for's slices fill one wave of blocks at one token, and at 32-64 rows, where a block
# has more work per chunk, fewer and longer slices were faster on the narrow kinds (more were slower
# everywhere: docs/kernels.md)
SPLIT_DIVISORS = (1, 2, 4)
Timer = Callable[[Callable[[], Any]], float]


def cuda_graph_timer(product: Callable[[], Any], reps: int = 20) -> float:
    """Microseconds per call of `product` as the engine runs it: `reps` calls captured in one CUDA
    graph (after two eager calls: compilation and first-use checks), the median of three replays
    timed by CUDA events. Eager launches would time the host: the Triton wrapper's Python
    costs more per call than a small product takes on the GPU."""
    for _ in range(2):
        product()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            product()
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / reps)
    del graph
    return statistics.median(times)


def _copies(kind: w4_verdicts.KernelKind, device: torch.device) -> list[W4Weight]:
    _, k, n, group, act_order, invariant = kind
    count = max(1, min(MAX_COPIES, math.ceil(COPIES_BYTES / max(1, n * k // 2))))
    out = []
    for i in range(count):
        w = synthetic_weight(n, k, group, device, 1000 + i, act_order, torch.float16)
        w.batch_invariant = invariant
        out.append(w)
    return out


def _rows(kind: w4_verdicts.KernelKind, rows: Iterable[int]) -> list[int]:
    return [m for m in rows if not kind[5] or m <= INVARIANT_MAX_ROWS]


def _time_rows(kind: w4_verdicts.KernelKind, device: torch.device, rows: Iterable[int], timer: Timer,
               product: Callable[[torch.Tensor, W4Weight, Any], Any], choices: Callable[[int], list],
               agrees: Optional[Callable[[torch.Tensor, W4Weight, Any], bool]] = None
               ) -> dict[int, dict[Any, float]]:
    """Microseconds of product(x, w, choice) at each row count of this kind, for each of
    choices(row count), cycling weight copies so that reads come from DRAM; a choice for which
    agrees(x, w, choice) is False is left out, with a warning."""
    ws = _copies(kind, device)
    x1 = torch.randn(1, kind[1], device=device).to(torch.float16)
    for w in ws:        # each copy's kernel layout is built here, eagerly, never inside a capture
        product(x1, w, None)
    out: dict[int, dict[Any, float]] = {}
    for m in _rows(kind, rows):
        x = torch.randn(m, kind[1], device=device).to(torch.float16)
        out[m] = {}
        for choice in choices(m):
            if agrees is not None and not agrees(x, ws[0], choice):
                warnings.warn(f"W4 CUDA entry {choice} disagreed with the default entry for "
                              f"{w4_verdicts.kind_label(kind)} at {m} rows on this GPU: not used", RuntimeWarning,
                              stacklevel=3)
                continue
            copies = itertools.cycle(ws)
            out[m][choice] = timer(lambda: product(x, next(copies), choice))
    return out


def time_triton(kind: w4_verdicts.KernelKind, device: torch.device, rows: Iterable[int] = CHOICE_ROWS,
                timer: Timer = cuda_graph_timer) -> dict[int, float]:
    """Microseconds per product of this kind in the Triton kernel at each row count, in the mode
    its weights run (batch-invariant or not)."""
    with overrides(w4_cuda="off"):
        times = _time_rows(kind, device, rows, timer, lambda x, w, _: triton_w4.triton_w4_matmul(x, w), lambda m: [None])
    return {m: by_choice[None] for m, by_choice in times.items()}


def tile_candidates(m: int) -> list[tuple[int, int]]:
    """The entries worth timing for an m-row product, as (8-token tiles per block, 16-row tiles per
    warp): from the entry that takes all m tokens in one pass of the grid (cuda_w4.token_tiles) down
    to fewer tiles in up to MAX_PASSES passes, each block re-reading its weight tile (from the L2
    when the passes run side by side), then the built entries of several row tiles per warp
    (cuda_w4.DIRECT_ROWS_BUILD) within as many passes."""
    full = cuda_w4.token_tiles(m)
    fits = [t for t in range(full, 0, -1) if -(-m // (8 * t)) <= MAX_PASSES]
    rows_entries = sorted((e for e in cuda_w4.DIRECT_ROWS_BUILD if e[0] in fits), key=lambda e: (-e[0], e[1]))
    return [(t, 1) for t in fits] + rows_entries


def k_warp_candidates(m: int) -> list[tuple[int, int, int]]:
    """The built entries of several warps per row tile (cuda_w4.K_WARP_BUILD) worth timing for an
    m-row product of a kind that is not batch-invariant, as (token tiles, row tiles per warp, warps
    per row tile): those within tile_candidates' passes."""
    fits = {t for t, r in tile_candidates(m) if r == 1}
    return sorted((e for e in cuda_w4.K_WARP_BUILD if e[0] in fits), key=lambda e: (-e[0], e[1], e[2]))


def split_candidates(kind: w4_verdicts.KernelKind, sms: int) -> list[int]:
    """The K slice counts timed for a kind on a GPU of `sms` multiprocessors, its default first:
    cuda_w4.split_for's (a verifier's only one: its rows keep their bits only at it), and for a
    kind that is not batch-invariant the slices of it divided by SPLIT_DIVISORS (deduplicated)."""
    _, k, n, _, _, invariant = kind
    split = cuda_w4.split_for(n, k, sms)
    divisors = (1,) if invariant else SPLIT_DIVISORS
    return list(dict.fromkeys(cuda_w4.slice_plan(k, max(1, split // d))[0] for d in divisors))


def time_cuda(kind: w4_verdicts.KernelKind, device: torch.device, rows: Iterable[int] = CHOICE_ROWS,
              timer: Timer = cuda_graph_timer) -> dict[int, dict[w4_verdicts.Entry, float]]:
    """Microseconds per product of this kind in the CUDA MMA kernel at each row count, for each of
    its tile_candidates at each of its split_candidates, and for a kind that is not batch-invariant
    its k_warp_candidates too (row count -> Entry -> us). Every tile choice is built to give a row
    the same bits at one split, and one that does not here is left out; another split or two warps
    per row tile (a kind that is not batch-invariant) sum in another order, so their products must
    agree with the default entry's within fp16 rounding."""
    splits = split_candidates(kind, multiprocessor_count(device))

    def product(x: torch.Tensor, w: W4Weight, entry: Optional[w4_verdicts.Entry]) -> torch.Tensor:
        tiles, row_tiles, split, k_warps = entry or (None, 1, None, None)
        return cuda_w4.matmul(x, w, tiles=tiles, row_tiles=row_tiles, split=split, k_warps=k_warps)

    def agrees(x: torch.Tensor, w: W4Weight, entry: w4_verdicts.Entry) -> bool:
        # an entry that gives other bits at the default split (an arch or compiler nobody here
        # ran), or other values at another split or warps per row tile, is never planned
        one_pass = cuda_w4.one_pass_entry(x.shape[0], splits[0])
        if entry == one_pass:
            return True
        y, ref = product(x, w, entry), product(x, w, one_pass)
        if entry[2] == splits[0] and entry[3] == 1:
            return torch.equal(y, ref)
        return torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())

    def choices(m: int) -> list[w4_verdicts.Entry]:
        one_warp = [(t, r, s, 1) for s in splits for t, r in tile_candidates(m)]
        return one_warp + ([] if kind[5] else [(t, r, s, kw) for s in splits for t, r, kw in k_warp_candidates(m)])
    return _time_rows(kind, device, rows, timer, product, choices, agrees)


def fastest_entry(m: int, by_entry: dict[w4_verdicts.Entry, float]) -> w4_verdicts.Entry:
    """The entry an m-row product runs: the fastest timed, or the one-pass entry of one row tile
    per warp at the kind's own split (split_for's, the most slices timed: split_candidates) unless
    another is faster by more than TILES_NOISE (so that noise does not move a product off its default)."""
    best = min(by_entry, key=by_entry.get)
    full = cuda_w4.one_pass_entry(m, max(entry[2] for entry in by_entry))
    return full if full in by_entry and by_entry[full] <= TILES_NOISE * by_entry[best] else best


def faster_everywhere(cuda_us: dict[int, float], triton_us: dict[int, float], noise: float = NOISE,
                      rows: Optional[Iterable[int]] = None) -> bool:
    """Whether the CUDA kernel is at least as fast at every timed row count of `rows` (default: every
    one timed), within the noise."""
    rows = list(cuda_us) if rows is None else [m for m in rows if m in cuda_us]
    return bool(rows) and all(cuda_us[m] <= noise * triton_us[m] for m in rows)


def deciding_rows(rows: Iterable[int]) -> list[int]:
    """The timed row counts that stand for a workload's: for each, the smallest CHOICE_ROWS count at
    or above it (whose timed tiles it runs: w4_verdicts.planned_entry), the largest for more rows.
    A caller names the rows both as run and as the static runners pad them (their bucket)."""
    return sorted({next((c for c in CHOICE_ROWS if c >= m), CHOICE_ROWS[-1]) for m in rows if m >= 1})


def choice_weights(models: Iterable[Any]) -> Iterator[W4Weight]:
    """The models' fp16 W4 weights on a GPU that the Triton kernel multiplies and the CUDA kernel
    could take over (w4_proof.triton_weights: weights of other kernels never ask)."""
    return (w for w in triton_weights(models) if w.scales.is_cuda and w.scales.dtype == torch.float16
            and cuda_w4.supports_shape(w.out_features, w.in_features, w.group_size))


def weights_by_kind(models: Iterable[Any]) -> dict[w4_verdicts.KernelKind, set[int]]:
    """Each kind of the models' choice_weights with the ids of its weights: a weight two models
    hold (a head holds its base model as a part) is one."""
    out: dict[w4_verdicts.KernelKind, set[int]] = {}
    for w in choice_weights(models):
        out.setdefault(w4_verdicts.kernel_kind(w), set()).add(id(w))
    return out


def kinds_of(models: Iterable[Any]) -> list[w4_verdicts.KernelKind]:
    """The kinds of the models' weights that the kernel choice covers (weights_by_kind)."""
    return sorted(weights_by_kind(models))


def _kind_rows(models: list[Any], workload: Optional[Mapping[Any, Iterable[int]]]
               ) -> dict[w4_verdicts.KernelKind, Optional[list[int]]]:
    """Each kind's deciding row counts: those of the workloads of the models whose forwards run its
    weights. A weight runs in the forwards of the models with a workload that hold it, whatever
    other models hold it too (a head holds its base model, whose workload counts the base's
    forwards); a kind with a weight that no model with a (non-empty) workload holds: None, every
    timed count."""
    if workload is None:
        return {kind: None for kind in kinds_of(models)}
    held = [(set(deciding_rows(workload[model])) if model in workload else set(), weights_by_kind([model]))
            for model in models]
    out: dict[w4_verdicts.KernelKind, set[int]] = {}
    covered: set[int] = set()
    for rows, by_kind in held:
        for kind, ids in (by_kind if rows else {}).items():
            out.setdefault(kind, set()).update(rows)
            covered |= ids
    every = {kind for _, by_kind in held for kind, ids in by_kind.items() if ids - covered}
    return {kind: None if kind in every else sorted(out[kind]) for kind in every | set(out)}


def choose_for_models(models: Iterable[Any], device: Union[str, torch.device], timer: Timer = cuda_graph_timer,
                      log: Optional[Callable[[str], None]] = None,
                      workload: Optional[Mapping[Any, Iterable[int]]] = None) -> dict[w4_verdicts.KernelKind, bool]:
    """Under HIERVIZ_W4_CUDA=auto, on a platform where the CUDA MMA variant is enabled, time both
    kernels on each kind of the models' fp16 W4 weights that has no choice yet and record it
    (w4_verdicts.choose_kernel). `workload`: model -> the row counts its forwards run (a model
    not in it: every CHOICE_ROWS count decides). Call it before the models' first product. Returns
    the choices in force for the models' kinds (none elsewhere)."""
    dev = torch.device(device)
    models = [m for m in models if m is not None]
    if (options().w4_cuda != "auto" or dev.type != "cuda"
            or w4_verdicts.CUDA_VARIANT not in kernel_guard.fast_variants(dev, torch.float16)):
        return {}
    chosen = {}
    known = w4_verdicts.kernel_choices()
    kind_rows = _kind_rows(models, workload)
    for kind in kinds_of(models):
        if kind in known:
            chosen[kind] = known[kind]
            continue
        try:
            by_tiles, triton_us = time_cuda(kind, dev, timer=timer), time_triton(kind, dev, timer=timer)
        except (RuntimeError, ValueError) as e:     # a timing that fails (OOM, capture) keeps the proven default
            warnings.warn(f"W4 kernel timing failed for {w4_verdicts.kind_label(kind)} ({type(e).__name__}: {e}); "
                          "the Triton kernel runs it", RuntimeWarning, stacklevel=2)
            chosen[kind] = w4_verdicts.choose_kernel(kind, False)
            continue
        tiles = {m: fastest_entry(m, us) for m, us in by_tiles.items()}
        cuda_us = {m: by_tiles[m][t] for m, t in tiles.items()}
        by_rows = None
        if kind[5]:     # a verifier: one kernel for every row count its forwards run
            rows = kind_rows.get(kind)
            cuda = faster_everywhere(cuda_us, triton_us, rows=rows)
        else:           # its products decide only what is drafted: each row count the faster kernel
            rows = sorted(cuda_us)
            by_rows = {m: cuda_us[m] <= triton_us[m] for m in rows}
            cuda = any(by_rows.values())
        chosen[kind] = w4_verdicts.choose_kernel(kind, cuda, {"cuda_us": cuda_us, "triton_us": triton_us,
                                                              "cuda_tiles": tiles, "deciding_rows": rows or sorted(cuda_us)},
                                                 tiles if cuda else None, by_rows)
        if log:
            at = w4_verdicts.cuda_rows(kind)
            which = ("Triton kernel" if not chosen[kind] else f"CUDA MMA kernel at {at} rows, Triton elsewhere" if at
                     else "CUDA MMA kernel")
            log(f"W4 {w4_verdicts.kind_label(kind)} g{kind[3]}: {which}")
    return chosen

