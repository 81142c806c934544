"""The kernel each W4 weight runs under HIERVIZ_W4_CUDA=auto (hierviz.quant.w4_choice): the CUDA
MMA kernel only for weight kinds it was timed at least as fast as the Triton kernel at every row
count, chosen once, before a weight's first product; a kind nobody chose for stays on Triton. The
timings themselves run on a GPU (tests/test_gpu.py)."""
import pytest
import torch

from hierviz import machine
from hierviz.config import options
from hierviz.quant import cuda_w4, kernel_guard, w4_choice, w4_verdicts
from tests.test_cuda_w4 import random_weight

SMS = 132       # an H100's multiprocessors: the K split of the small test weights is one slice at any count


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.delenv("HIERVIZ_W4_CUDA", raising=False)
    w4_verdicts.forget_kernel_choices()
    yield
    w4_verdicts.forget_kernel_choices()


def test_auto_is_the_default() -> None:
    assert options().w4_cuda == "auto"


@pytest.mark.parametrize("cuda_us, triton_us, chosen", [
    ({1: 38.0, 32: 90.0, 64: 138.0}, {1: 62.0, 32: 89.4, 64: 158.6}, True),    # 1 % slower at 32 rows: noise
    ({1: 36.8, 32: 89.0, 64: 138.5}, {1: 67.0, 32: 81.5, 64: 147.7}, False),   # 9 % slower at 32 rows
    ({1: 10.0}, {1: 10.0}, True),
    ({}, {}, False),
])
def test_the_cuda_kernel_is_chosen_only_if_no_row_count_is_slower(cuda_us, triton_us, chosen) -> None:
    assert w4_choice.faster_everywhere(cuda_us, triton_us) is chosen


def test_a_choice_holds_for_the_kind_and_serves_follows_it(monkeypatch) -> None:
    fast, slow = random_weight(64, 128, 32), random_weight(128, 128, 32)
    fast.batch_invariant = slow.batch_invariant = True
    kinds = [w4_verdicts.kernel_kind(fast), w4_verdicts.kernel_kind(slow)]
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    monkeypatch.setattr(w4_choice, "kinds_of", lambda models: kinds)
    timed = []

    def fake_cuda(kind, device, rows=w4_choice.CHOICE_ROWS, timer=None):
        timed.append((kind, "cuda"))
        faster = kind == kinds[0]
        # the faster kind's 32-row products run fastest as two passes of 16 tokens
        return {m: {(*t, 1, 1): (10.0 if faster else 30.0) - (t == (2, 1) and m == 32) for t in w4_choice.tile_candidates(m)}
                for m in rows}

    def fake_triton(kind, device, rows=w4_choice.CHOICE_ROWS, timer=None):
        timed.append((kind, "triton"))
        return {m: 20.0 for m in rows}
    monkeypatch.setattr(w4_choice, "time_cuda", fake_cuda)
    monkeypatch.setattr(w4_choice, "time_triton", fake_triton)
    chosen = w4_choice.choose_for_models([], "cuda")
    assert chosen == {kinds[0]: True, kinds[1]: False} and len(timed) == 4
    times = w4_verdicts.kernel_times(kinds[0])
    assert times["cuda_us"][1] == 10.0 and times["cuda_us"][32] == 9.0 and times["cuda_tiles"][32] == (2, 1, 1, 1)
    assert cuda_w4.serves(fast) and not cuda_w4.serves(slow)
    # the tile plan: 32 rows (and 26-31, timed at 32) in two passes; elsewhere one pass
    assert [cuda_w4.plan_for(fast, m, SMS)[0] for m in (1, 16, 24, 25, 32, 33, 40, 64, 128, 300)] == [1, 2, 3, 4, 2, 5, 5, 8, 8, 8]
    assert [cuda_w4.plan_for(slow, m, SMS) for m in (25, 32)] == [(4, 1, 1, 1), (4, 1, 1, 1)]     # no plan: Triton runs it anyway
    # a twin weight of the same kind (another layer) runs the same kernel; nothing is timed again
    twin = random_weight(64, 128, 32)
    twin.batch_invariant = True
    assert cuda_w4.serves(twin) and w4_choice.choose_for_models([], "cuda") == chosen and len(timed) == 4
    # the same shape as a plain (not batch-invariant) weight is a kind of its own
    plain = random_weight(64, 128, 32)
    assert w4_verdicts.kernel_kind(plain) not in chosen
    monkeypatch.setattr(machine, "gpu_name", lambda device: "NVIDIA H100")
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "cuda_mma for 128x64 (verifier); triton for the rest"


def test_a_kind_that_ran_a_product_before_any_choice_keeps_the_triton_kernel(monkeypatch) -> None:
    """A weight never changes kernel mid-run: the first product of a kind nobody chose for fixes
    it to Triton, and a later choice (faster CUDA timings) does not move it."""
    w = random_weight(64, 128, 32)
    assert not cuda_w4.serves(w)            # its first product's question
    kind = w4_verdicts.kernel_kind(w)
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    monkeypatch.setattr(w4_choice, "kinds_of", lambda models: [kind])
    monkeypatch.setattr(w4_choice, "time_cuda", lambda kind, device, **kw: {1: {(1, 1, 1, 1): 1.0}})
    monkeypatch.setattr(w4_choice, "time_triton", lambda kind, device, **kw: {1: 9.0})
    assert w4_choice.choose_for_models([], "cuda") == {kind: False} and not cuda_w4.serves(w)
    assert cuda_w4.plan_for(w, 32, SMS) == (4, 1, 1, 1)


def test_nothing_is_timed_off_auto_on_a_cpu_or_where_the_variant_is_not_enabled(monkeypatch) -> None:
    monkeypatch.setattr(w4_choice, "time_cuda", lambda *a, **kw: pytest.fail("timed"))
    monkeypatch.setattr(w4_choice, "time_triton", lambda *a, **kw: pytest.fail("timed"))
    monkeypatch.setattr(w4_choice, "kinds_of", lambda models: [(0, 128, 64, 32, False, True)])
    assert w4_choice.choose_for_models([], "cpu") == {}
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset())
    assert w4_choice.choose_for_models([], "cuda") == {}
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    for mode in ("off", "on", "target"):
        monkeypatch.setenv("HIERVIZ_W4_CUDA", mode)
        assert w4_choice.choose_for_models([], "cuda") == {}


def test_kinds_are_the_fp16_cuda_weights_the_kernel_takes() -> None:
    """On a CPU no weight is a kind the CUDA kernel could run."""
    from hierviz.measure.whatif import tiny_config
    from hierviz.models.synthetic import synthetic_model
    model = synthetic_model(tiny_config(False), "w4a16", torch.float32, "cpu", "reference", 0)
    assert w4_choice.kinds_of([model, None]) == []


def test_a_timing_that_fails_keeps_the_triton_kernel_with_a_warning(monkeypatch) -> None:
    kind = (0, 128, 64, 32, False, True)
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    monkeypatch.setattr(w4_choice, "kinds_of", lambda models: [kind])

    def failing(kind, device, **kw):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(w4_choice, "time_cuda", failing)
    with pytest.warns(RuntimeWarning, match="W4 kernel timing failed for 128x64 .*the Triton kernel runs it"):
        assert w4_choice.choose_for_models([], "cuda") == {kind: False}


def test_the_choice_times_every_bucket_the_static_runners_pad_to() -> None:
    """A forward on the static path runs at its bucket's row count (a 30-node tree at 32 rows), so
    every bucket is among the row counts a kernel must not be slower at."""
    from hierviz.models.cuda_graphs import BUCKETS
    assert set(BUCKETS) <= set(w4_choice.CHOICE_ROWS)


def test_tile_candidates_and_the_fastest_entry(monkeypatch) -> None:
    """Candidates run from the one-pass entry down to MAX_PASSES passes over the tokens, then the
    built entries of several row tiles per warp within as many passes; the one-pass entry keeps a
    row count unless another is faster by more than TILES_NOISE."""
    monkeypatch.setattr(cuda_w4, "DIRECT_ROWS_BUILD", {})
    assert w4_choice.tile_candidates(1) == [(1, 1)] and w4_choice.tile_candidates(16) == [(2, 1), (1, 1)]
    assert w4_choice.tile_candidates(32) == [(4, 1), (3, 1), (2, 1), (1, 1)]
    assert w4_choice.tile_candidates(33) == [(5, 1), (4, 1), (3, 1), (2, 1)]
    assert w4_choice.tile_candidates(128) == [(8, 1), (7, 1), (6, 1), (5, 1), (4, 1)]
    monkeypatch.setattr(cuda_w4, "DIRECT_ROWS_BUILD", {(2, 2): (4, 2), (4, 2): (4, 2), (4, 4): (2, 4), (1, 4): (2, 4)})
    assert w4_choice.tile_candidates(1) == [(1, 1), (1, 4)]
    assert w4_choice.tile_candidates(32) == [(4, 1), (3, 1), (2, 1), (1, 1), (4, 2), (4, 4), (2, 2), (1, 4)]
    assert w4_choice.tile_candidates(17) == [(3, 1), (2, 1), (1, 1), (2, 2), (1, 4)]
    assert all(-(-m // (8 * t)) <= w4_choice.MAX_PASSES for m in w4_choice.CHOICE_ROWS for t, _ in w4_choice.tile_candidates(m))
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.05, (2, 1, 4, 1): 10.0}) == (4, 1, 4, 1)
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.5, (2, 1, 4, 1): 10.0, (1, 1, 4, 1): 12.0}) == (2, 1, 4, 1)
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.5, (2, 1, 4, 1): 10.0, (4, 2, 4, 1): 8.0}) == (4, 2, 4, 1)
    # the kind's own split is the most slices timed; fewer slices, or two warps per row tile, win
    # only beyond the noise
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.05, (4, 1, 2, 1): 10.0, (4, 1, 1, 1): 10.02}) == (4, 1, 4, 1)
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.5, (4, 1, 1, 1): 10.0, (2, 1, 4, 1): 10.4}) == (4, 1, 1, 1)
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.05, (2, 1, 4, 2): 10.0}) == (4, 1, 4, 1)
    assert w4_choice.fastest_entry(32, {(4, 1, 4, 1): 10.5, (2, 1, 1, 2): 8.0}) == (2, 1, 1, 2)


def test_k_warp_candidates_are_the_built_entries_within_the_passes(monkeypatch) -> None:
    """An intermediate's kind also times the entries of two warps per row tile whose token tiles
    tile_candidates would time; a verifier's kind never does (time_cuda: other bits)."""
    monkeypatch.setattr(cuda_w4, "K_WARP_BUILD", {(1, 1, 2): (4, 1), (2, 2, 2): (2, 2), (4, 2, 2): (4, 1)})
    assert w4_choice.k_warp_candidates(1) == [(1, 1, 2)]
    assert w4_choice.k_warp_candidates(16) == [(2, 2, 2), (1, 1, 2)]
    assert w4_choice.k_warp_candidates(32) == [(4, 2, 2), (2, 2, 2), (1, 1, 2)]
    assert w4_choice.k_warp_candidates(64) == [(4, 2, 2), (2, 2, 2)]        # one token tile: 8 passes
    assert w4_choice.k_warp_candidates(128) == [(4, 2, 2)]


def test_a_planned_entry_of_several_row_tiles_runs_only_where_it_is_built(monkeypatch) -> None:
    """plan_for clamps a plan's token tiles to the rows at hand; an entry of several warps per row
    tile that is not built then runs one warp per row tile, and a (tiles, row tiles) pair that is
    not built one row tile per warp."""
    w = random_weight(64, 128, 32)
    kind = w4_verdicts.kernel_kind(w)
    monkeypatch.setattr(cuda_w4, "DIRECT_ROWS_BUILD", {(4, 2): (4, 2), (2, 2): (4, 2)})
    monkeypatch.setattr(cuda_w4, "K_WARP_BUILD", {(2, 1, 2): (4, 1)})
    w4_verdicts.choose_kernel(kind, True, None, {8: (2, 1, 1, 2), 16: (2, 2, 1, 1), 32: (4, 2, 1, 1), 40: (3, 1, 1, 2)})
    assert ([cuda_w4.plan_for(w, m, SMS) for m in (8, 9, 16, 17, 25, 32, 33, 40)]
            == [(1, 1, 1, 1), (2, 2, 1, 1), (2, 2, 1, 1), (3, 1, 1, 1), (4, 2, 1, 1), (4, 2, 1, 1), (3, 1, 1, 1),
                (3, 1, 1, 1)])


def test_choose_kernel_keeps_the_choice_a_kind_already_has() -> None:
    w = random_weight(64, 128, 32)
    kind = w4_verdicts.kernel_kind(w)
    assert not w4_verdicts.cuda_chosen(w)                       # a product ran: fixed to Triton
    assert w4_verdicts.choose_kernel(kind, True, {"cuda_us": {1: 1.0}}, {32: (2, 1, 1)}) is False
    assert not cuda_w4.serves(w) and w4_verdicts.kernel_times(kind) is None and w4_verdicts.planned_entry(kind, 32) is None


def test_a_workload_decides_over_its_own_row_counts(monkeypatch) -> None:
    """A caller that names each model's row counts (the what-if) has a verifier's kernel chosen over
    those only: a kind slower at 32 rows alone goes to the CUDA kernel for a target that verifies
    1-24 rows, stays on Triton where a verifier runs 30-row trees or names no workload. A kind that
    is not batch-invariant (an intermediate's) runs each row count in the faster kernel."""
    kind, wide, other = (0, 128, 64, 32, False, True), (0, 192, 64, 32, False, True), (-1, 256, 64, 32, False, False)
    # each model's weights by kind: the twin holds a weight of the target's kind, the head the
    # target's own weight (as a draft head holds its base model)
    weights = {"target": {kind: {"t"}}, "verifier": {wide: {"v"}}, "intermediate": {other: {"i"}},
               "twin": {kind: {"tw"}}, "head": {kind: {"t"}}}

    def weights_by_kind(models):
        out = {}
        for m in models:
            for k, ids in weights[m].items():
                out.setdefault(k, set()).update(ids)
        return out
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    monkeypatch.setattr(w4_choice, "weights_by_kind", weights_by_kind)
    monkeypatch.setattr(w4_choice, "time_cuda", lambda kind, device, **kw: {
        m: {(*t, 1): 40.0 if m == 32 else 10.0 for t in w4_choice.tile_candidates(m)} for m in w4_choice.CHOICE_ROWS})
    monkeypatch.setattr(w4_choice, "time_triton", lambda kind, device, **kw: {m: 20.0 for m in w4_choice.CHOICE_ROWS})
    said = []
    chosen = w4_choice.choose_for_models(["target", "verifier", "intermediate"], "cuda", log=said.append,
                                         workload={"target": {1, 7, 10, 24}, "verifier": {30, 31},
                                                   "intermediate": {30, 31}})
    assert said == ["W4 256x64 g32: CUDA MMA kernel at 1-25, 33+ rows, Triton elsewhere",
                    "W4 128x64 (verifier) g32: CUDA MMA kernel", "W4 192x64 (verifier) g32: Triton kernel"]
    assert chosen == {kind: True, wide: False, other: True}
    assert w4_verdicts.kernel_times(kind)["deciding_rows"] == [1, 8, 16, 24]
    assert w4_verdicts.kernel_times(wide)["deciding_rows"] == [32]
    # the intermediate's kind: Triton for 26-32 rows (timed at 32), the CUDA kernel elsewhere
    assert w4_verdicts.kernel_times(other)["deciding_rows"] == list(w4_choice.CHOICE_ROWS)
    w = random_weight(64, 256, 32)
    assert w4_verdicts.kernel_kind(w) == other and cuda_w4.serves(w)
    assert [cuda_w4.serves(w, m) for m in (1, 25, 26, 31, 32, 33, 128, 300)] == [True, True, False, False, False,
                                                                                  True, True, True]
    assert w4_verdicts.cuda_rows(other) == "1-25, 33+" and w4_verdicts.cuda_rows(kind) is None
    record = next(r for r in w4_verdicts.kernel_choice_records() if r["K"] == 256)
    assert record["kernel"] == "by rows" and record["cuda_rows"] == "1-25, 33+"
    assert w4_verdicts.kernel_summary() == "cuda_mma for 256x64 at 1-25, 33+ rows, 128x64 (verifier); triton for the rest"
    w4_verdicts.forget_kernel_choices()
    # the same kind in a model without a workload: every timed row count decides
    assert w4_choice.choose_for_models(["target", "twin"], "cuda", workload={"target": {1}}) == {kind: False}
    assert w4_verdicts.kernel_times(kind)["deciding_rows"] == list(w4_choice.CHOICE_ROWS)
    w4_verdicts.forget_kernel_choices()
    # the target's own weight in a head without a workload: the target's forwards run it, its rows decide
    assert w4_choice.choose_for_models(["target", "head"], "cuda", workload={"target": {1, 24}}) == {kind: True}
    assert w4_verdicts.kernel_times(kind)["deciding_rows"] == [1, 24]
    # a per-row choice is refused for a verifier
    with pytest.raises(ValueError, match="batch-invariant"):
        w4_verdicts.choose_kernel(wide, True, None, None, {1: True, 32: False})


def test_rows_the_cuda_kernel_runs_for_a_kind_chosen_by_rows() -> None:
    kind = (0, 64, 32, 32, False, False)
    w4_verdicts.choose_kernel(kind, True, None, None, {1: True, 8: True, 16: False, 32: True, 64: False, 128: True})
    assert w4_verdicts.cuda_rows(kind) == "1-8, 17-32, 65+"
    w4_verdicts.forget_kernel_choices()
    w4_verdicts.choose_kernel(kind, True, None, None, {1: False, 8: True, 16: False})
    assert w4_verdicts.cuda_rows(kind) == "2-8"
    w4_verdicts.forget_kernel_choices()
    w4_verdicts.choose_kernel(kind, True, None, None, {1: True, 8: True})      # every row: one kernel, no row plan
    assert w4_verdicts.cuda_rows(kind) is None and w4_verdicts.kernel_summary() == "cuda_mma"


def test_deciding_rows_are_the_timed_counts_that_cover_a_workload() -> None:
    assert w4_choice.deciding_rows({1, 7, 8, 9, 10, 24, 30, 31}) == [1, 8, 9, 16, 24, 32]
    assert w4_choice.deciding_rows({129, 4000}) == [128] and w4_choice.deciding_rows(set()) == []
    assert w4_choice.faster_everywhere({1: 1.0, 32: 9.0}, {1: 2.0, 32: 2.0}, rows=[1])
    assert not w4_choice.faster_everywhere({1: 1.0, 32: 9.0}, {1: 2.0, 32: 2.0})
    assert not w4_choice.faster_everywhere({1: 1.0}, {1: 2.0}, rows=[64])      # nothing timed there


def test_each_row_count_and_choice_is_timed_over_cycled_weight_copies(monkeypatch) -> None:
    """The timing loop both kernels share: every copy's layout built eagerly on one row first, then
    per row count (a verifier's only up to INVARIANT_MAX_ROWS) each choice timed on its own inputs
    of that many rows, the products cycling through the copies."""
    from hierviz.quant.w4 import INVARIANT_MAX_ROWS
    monkeypatch.setattr(w4_choice, "COPIES_BYTES", 3 * 64 * 32 // 2)      # three copies of a 32 x 64 weight
    seen = []

    def product(x, w, choice):
        seen.append((x.shape[0], id(w), choice))
        return x

    def timer(run):
        run(), run()
        return 1.0
    kind = (0, 64, 32, 32, False, True)
    times = w4_choice._time_rows(kind, torch.device("cpu"), (1, 5, INVARIANT_MAX_ROWS + 1), timer, product,
                                 lambda m: ["a", "b"] if m > 1 else ["a"])
    assert times == {1: {"a": 1.0}, 5: {"a": 1.0, "b": 1.0}}
    eager, timed = seen[:3], seen[3:]
    assert [c for _, _, c in eager] == [None] * 3 and len({w for _, w, _ in eager}) == 3
    assert [(m, c) for m, _, c in timed] == [(1, "a")] * 2 + [(5, "a")] * 2 + [(5, "b")] * 2
    assert timed[0][1] != timed[1][1]          # consecutive products read different copies
    # a choice whose rows differ from the default entry's on this machine is neither timed nor planned
    seen.clear()
    with pytest.warns(RuntimeWarning, match=r"W4 CUDA entry b disagreed with the default entry for 64x32 "
                                            r"\(verifier\) at 5 rows on this GPU: not used"):
        times = w4_choice._time_rows(kind, torch.device("cpu"), (1, 5), timer, product,
                                     lambda m: ["a", "b"] if m > 1 else ["a"], agrees=lambda x, w, choice: choice == "a")
    assert times == {1: {"a": 1.0}, 5: {"a": 1.0}}


def test_a_kind_that_is_not_batch_invariant_also_times_more_k_slices(monkeypatch) -> None:
    """An intermediate's kind times its own split and it divided by SPLIT_DIVISORS; a
    verifier's only its own (its rows keep their bits only there). The plan's split runs the
    intermediate's products; a verifier's plan never moves its split or its warps per row tile."""
    assert w4_choice.split_candidates((0, 4096, 4096, 128, False, False), 132) == [4, 2, 1]
    assert w4_choice.split_candidates((0, 4096, 28672, 128, False, False), 132) == [1]
    assert w4_choice.split_candidates((0, 14336, 4096, 128, False, False), 132) == [8, 4, 2]
    assert w4_choice.split_candidates((0, 4096, 4096, 128, False, True), 132) == [4]
    plain, verifier = random_weight(64, 1024, 32), random_weight(64, 1024, 32)
    verifier.batch_invariant = True
    for w in (plain, verifier):
        w4_verdicts.choose_kernel(w4_verdicts.kernel_kind(w), True, None, {1: (1, 1, 1, 1), 32: (2, 1, 4, 2)})
    assert cuda_w4.split_for(64, 1024, SMS) == 1
    assert [cuda_w4.plan_for(plain, m, SMS) for m in (1, 32)] == [(1, 1, 1, 1), (2, 1, 4, 2)]
    assert [cuda_w4.plan_for(verifier, m, SMS) for m in (1, 32)] == [(1, 1, 1, 1), (2, 1, 1, 1)]
