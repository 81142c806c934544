"""The CUDA MMA W4 kernel's CPU-side checks: its weight layout, an emulation of what each thread
loads and multiplies (the fragment mapping the kernel relies on), its shape rules and K split,
and NVRTC compiling the source for sm_80, sm_90 and Blackwell (sm_100, sm_120). The kernel itself
runs in tests/test_gpu.py."""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hierviz.quant import cuda_w4
from hierviz.quant.w4 import W4Weight, unpack_codes
from hierviz.quant.w4_proof import synthetic_weight


def random_weight(n: int, k: int, g: int, seed: int = 0) -> W4Weight:
    """GPTQ-like random codes, fp16 scales and offsets (the start-up proof's synthetic weight)."""
    return synthetic_weight(n, k, g, "cpu", seed, act_order=False, dtype=torch.float16)


@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (576, 576), (4112, 128)])
def test_layout_round_trip(n, k) -> None:
    w = random_weight(n, k, 32, seed=n + k)
    words = cuda_w4.pack_layout(w.codes)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32
    assert words.is_contiguous()      # tile by tile: the one-token loop's code addresses are constant offsets
    assert torch.equal(cuda_w4.unpack_layout(words), w.codes)
    rows = torch.tensor([n - 1, 0, 17 % n, 3, n // 2])
    assert torch.equal(cuda_w4.unpack_layout(words, rows), w.codes[rows])


def _half_bits(word: torch.Tensor, high: bool) -> torch.Tensor:
    bits = (word >> 16) & 0xFFFF if high else word & 0xFFFF
    return bits.to(torch.int16).view(torch.float16).double()


def emulate(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """x @ W.T computed the way the kernel's threads do, from its layout: lane (g, t) of the warp on
    row tile r decodes word j of chunk c exactly as `step` does (lop3 masks 0x000f000f / 0x00f000f0,
    the second pair after >> 8) into the m16n8k16 A fragment (reg0: row g, k slots 2t, 2t+1; reg1:
    row g+8; reg2 / reg3: slots 2t+8, 2t+9), scales it by the group pair `chunk` picks, and takes
    its B fragment from the two 16-byte activation loads (b0 = word 2(j%2), b1 = the next, of load
    j // 2); the products are summed over all 16 k slots of every step."""
    words, so = cuda_w4.pack_layout(w.codes), cuda_w4.pack_groups(w.scales, w.offsets)
    tiles, chunks = words.shape[:2]
    m, k = x.shape
    shift = cuda_w4.group_shift(k, w.group_size)
    xd = x.half().double()
    out = torch.zeros(m, tiles * 16, dtype=torch.float64)
    words = words.to(torch.int64) & 0xFFFFFFFF
    so = so.to(torch.int64) & 0xFFFFFFFF
    for r in range(tiles):
        for c in range(chunks):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                grp = (c * 64 + 16 * t) >> shift
                pair_g, pair_h = so[r, grp, g, 0], so[r, grp, g, 1]
                s = {0: _half_bits(pair_g, False), 8: _half_bits(pair_h, False)}
                o = {0: _half_bits(pair_g, True), 8: _half_bits(pair_h, True)}
                base = c * 64 + 16 * t               # the lane's two 16-byte loads: channels base..base+15
                for j in range(4):
                    word = int(words[r, c, lane, j])
                    lo, lo8 = word & 0x000F000F, (word >> 8) & 0x000F000F
                    hi, hi8 = (word & 0x00F000F0) >> 4, ((word >> 8) & 0x00F000F0) >> 4
                    # (register, row offset, slot offset): the A fragment of mma.m16n8k16
                    regs = ((lo, 0, 0), (hi, 8, 0), (lo8, 0, 8), (hi8, 8, 8))
                    load, first_word = divmod(j, 2)
                    b_channel = {0: base + 8 * load + 2 * (2 * first_word), 8: base + 8 * load + 2 * (2 * first_word + 1)}
                    for reg, row_off, slot_off in regs:
                        for half in (0, 1):
                            q = (reg >> (16 * half)) & 0xF
                            a = torch.tensor(q * float(s[row_off]) + float(o[row_off])).half().double()
                            kk = b_channel[slot_off] + half
                            out[:, r * 16 + g + row_off] += a * xd[:, kk]
    return out


@pytest.mark.parametrize("g", [32, 64, 128])
def test_the_threads_fragments_multiply_the_weight(g) -> None:
    n, k = 32, 256
    w = random_weight(n, k, g, seed=g)
    x = torch.randn(3, k).half().float()
    dense = (unpack_codes(w.codes).double().view(n, k // g, g) * w.scales.double().unsqueeze(-1)
             + w.offsets.double().unsqueeze(-1)).view(n, k).half().double()
    want = x.double() @ dense.t()
    got = emulate(x, w)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_pack_groups_puts_scale_low_and_offset_high() -> None:
    s = torch.arange(32 * 2, dtype=torch.float32).view(32, 2) / 64
    o = -s
    pairs = cuda_w4.pack_groups(s, o)
    assert pairs.shape == (2, 2, 8, 2)
    for h, row in ((0, 19), (1, 27)):                     # tile 1, group 0, lane group 3: rows 16 + 3, 16 + 11
        v = int(pairs[1, 0, 3, h]) & 0xFFFFFFFF
        assert _half_bits(torch.tensor(v), False) == s[row, 0] and _half_bits(torch.tensor(v), True) == o[row, 0]


def test_shape_rules_and_the_k_split() -> None:
    assert cuda_w4.supports_shape(28672, 8192, 128) and cuda_w4.supports_shape(576, 576, 32)
    assert cuda_w4.supports_shape(4096, 14336, 14336)                       # per-channel
    assert not cuda_w4.supports_shape(4104, 4096, 128)                      # N not in 16-row tiles
    assert not cuda_w4.supports_shape(4096, 4128, 32)                       # K not in 64-channel chunks
    assert not cuda_w4.supports_shape(4096, 4608, 96)                       # groups not a power of two
    assert cuda_w4.group_shift(8192, 128) == 7 and cuda_w4.group_shift(8192, 8192) == 31
    # the split follows the shape and the GPU, never M: one wave of 2 blocks per multiprocessor
    # (132 on an H200: 264 blocks of 128 rows), slices of at least 12 chunks
    assert cuda_w4.split_for(28672, 8192, 132) == 1 and cuda_w4.split_for(8192, 28672, 132) == 4
    assert cuda_w4.split_for(8192, 8192, 132) == 4 and cuda_w4.split_for(57344, 8192, 132) == 1
    assert cuda_w4.split_for(10240, 8192, 132) == 3 and cuda_w4.split_for(576, 576, 132) == 1
    assert cuda_w4.split_for(4096, 14336, 132) == 8 and cuda_w4.split_for(4096, 14336, 66) == 4
    assert cuda_w4.split_for(576, 1536, 132) == 2                             # SmolLM2's down: 2 x 12 chunks
    assert cuda_w4.slice_plan(4096, cuda_w4.split_for(4096, 4096, 132)) == (4, 16)
    for n, k in ((28672, 8192), (8192, 28672), (4096, 14336), (1536, 576), (6144, 4096), (1024, 1088)):
        s = cuda_w4.split_for(n, k, 132)
        assert s == 1 or (k // 64) // s >= cuda_w4.MIN_CHUNKS_PER_SLICE
        assert -(-n // cuda_w4.ROWS_PER_BLOCK) * s <= 2 * 132 or s == 1
        # slices in whole look-ahead rounds, covering K, none empty
        slices, per = cuda_w4.slice_plan(k, s)
        assert per % cuda_w4.SLICE_ROUND == 0 or per == k // 64
        assert (slices - 1) * per < k // 64 <= slices * per
    assert cuda_w4.slice_plan(8192, 3) == (3, 44) and cuda_w4.slice_plan(4096, 5) == (4, 16)
    assert cuda_w4.slice_plan(576, 4) == (3, 4) and cuda_w4.slice_plan(8192, 1) == (1, 128)
    assert [cuda_w4.token_tiles(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128)] == [1, 1, 2, 2, 3, 4, 5, 8, 8, 8]
    assert cuda_w4.entry_for(1) == "w4_direct_t1" and cuda_w4.entry_for(8) == "w4_staged_t8"
    assert cuda_w4.entry_for(5) == "w4_direct_t5" and cuda_w4.entry_for(6) == "w4_staged_t6"
    assert len({cuda_w4.entry_for(t) for t in range(1, cuda_w4.MAX_TOKEN_TILES + 1)}) == cuda_w4.MAX_TOKEN_TILES
    assert len(set(cuda_w4.entry_names())) == len(cuda_w4.entry_names())
    # one entry per tile count, direct or staged, each built into the source
    assert sorted([*cuda_w4.DIRECT_BUILD, *cuda_w4.STAGED_BUILD]) == list(range(1, cuda_w4.MAX_TOKEN_TILES + 1))
    source = cuda_w4.kernel_source()
    assert all(f"DIRECT_ENTRY({t}," in source for t in cuda_w4.DIRECT_BUILD)
    assert all(f"STAGED_ENTRY({t}," in source for t in cuda_w4.STAGED_BUILD)
    assert cuda_w4.ahead_chunks(1) == cuda_w4.DIRECT_BUILD[1][0] and cuda_w4.ahead_chunks(8) == cuda_w4.STAGED_BUILD[8][0]
    assert set(map(cuda_w4.entry_for, range(1, cuda_w4.MAX_TOKEN_TILES + 1))) <= set(cuda_w4.entry_names())


def test_the_wgmma_entries_take_the_staged_tile_counts_on_sm_90a_only() -> None:
    """One wgmma entry per staged tile count, built (and named) only for sm_90a, with its stages'
    shared memory; the direct tile counts keep their entries whatever is asked."""
    assert sorted(cuda_w4.WGMMA_BUILD) == sorted(cuda_w4.STAGED_BUILD)
    assert cuda_w4.entry_for(8, wgmma=True) == "w4_wgmma_t8" and cuda_w4.entry_for(6, 0, True) == "w4_wgmma_t6"
    assert cuda_w4.entry_for(1, 128, True) == "w4_direct_t1_g128" and cuda_w4.entry_for(3, 0, True) == "w4_direct_t3"
    wgmma = {cuda_w4.entry_for(t, wgmma=True) for t in cuda_w4.WGMMA_BUILD}
    assert wgmma <= set(cuda_w4.entry_names("sm_90a")) and not wgmma & set(cuda_w4.entry_names("sm_90"))
    assert set(cuda_w4.entry_names("sm_90a")) - wgmma == set(cuda_w4.entry_names())
    for arch in ("sm_80", "sm_90", "sm_100", "sm_120", None):
        lines = cuda_w4.kernel_source(arch=arch).splitlines()
        assert not any(line.startswith("WGMMA_ENTRY(") for line in lines) and not cuda_w4.has_wgmma(arch)
    source = cuda_w4.kernel_source(arch="sm_90a")
    assert all(f"WGMMA_ENTRY({t}, {s}, {r}, {b})" in source for t, (s, r, b) in cuda_w4.WGMMA_BUILD.items())
    for t, (s, r, b) in cuda_w4.WGMMA_BUILD.items():
        assert s % 2 == 0 and r >= 0                           # the loop's static_assert
        assert cuda_w4.wgmma_shared_bytes(t) * b <= 227 * 1024
    assert cuda_w4.wgmma_shared_bytes(8, {8: (4, 0, 1)}) == 64 * 1024
    assert cuda_w4.wgmma_shared_bytes(8, {8: (2, 3, 2)}) == 32 * 1024 + 3 * 16 * 1024
    assert cuda_w4.wgmma_shared_bytes(5, {5: (4, 2, 2)}) == 40 * 1024 + 2 * 2 * 16 * 1024   # 320 pieces: 2 a thread


def test_nvrtc_compiles_every_kind_of_wgmma_build() -> None:
    """Activations through registers or copy slots, 2 or 4 chunks a stage."""
    skip_without_nvrtc()
    build = {4: (2, 0, 2), 5: (4, 2, 1), 6: (2, 3, 2), 7: (4, 0, 1), 8: (2, 4, 2)}
    # the wgmma entries alone (the other entries compile in test_nvrtc_compiles_the_kernel)
    source = cuda_w4.kernel_source({}, {}, arch="sm_90a", wgmma_build=build, rows_build={}, kw_build={})
    cubin = cuda_w4.compile_cubin("sm_90a", source)
    assert all(f"w4_wgmma_t{t}".encode() in cubin for t in build) and b"w4_direct_t1" not in cubin


def test_group_pairs_by_offset_only_where_every_slice_starts_on_a_group() -> None:
    """The direct entries specialized to 64- and 128-channel groups take a product only when each
    K slice starts on a group and the look-ahead is whole groups; anything else runs the generic
    entry (the same arithmetic, so the same bits)."""
    assert cuda_w4.pair_group(1, 128, 32) == 128 and cuda_w4.pair_group(2, 64, 7) == 64
    assert cuda_w4.pair_group(1, 128, 19) == 0            # odd slices: a slice starts mid-group
    assert cuda_w4.pair_group(1, 32, 32) == 0             # two groups per chunk: generic
    assert cuda_w4.pair_group(1, 8192, 128) == 0          # per-channel: generic
    assert cuda_w4.pair_group(cuda_w4.MAX_TOKEN_TILES, 128, 32) == 0    # the staged loop
    names = set(cuda_w4.entry_names())
    for tiles in range(1, cuda_w4.MAX_TOKEN_TILES + 1):
        for g in (32, 64, 128, 256, 8192):
            for per in (1, 2, 7, 8, 19, 32, 56):
                assert cuda_w4.entry_for(tiles, cuda_w4.pair_group(tiles, g, per)) in names
    assert all(f"DIRECT_GROUP_ENTRY({t}, {a}, {b}, 128, {int((t, 1) in cuda_w4.X_AHEAD_ENTRIES)})" in cuda_w4.kernel_source()
               for t, (a, b) in cuda_w4.DIRECT_BUILD.items())


def test_entries_of_several_row_tiles_per_warp_are_named_and_built() -> None:
    """A (token tiles, row tiles per warp) build gets its own entry (and its pair-group entries), a
    warp count of 8 / row tiles and its own look-ahead (the shipped ones compile for every arch in
    test_nvrtc_compiles_the_kernel)."""
    build = {(2, 2): (4, 2), (4, 2): (2, 4), (3, 4): (2, 4)}
    assert cuda_w4.entry_for(4, 0, row_tiles=2) == "w4_direct_t4_r2"
    assert cuda_w4.entry_for(3, 128, row_tiles=4) == "w4_direct_t3_r4_g128"
    names = cuda_w4.entry_names(rows_build=build)
    assert {"w4_direct_t2_r2", "w4_direct_t2_r2_g64", "w4_direct_t2_r2_g128", "w4_direct_t4_r2",
            "w4_direct_t4_r2_g64", "w4_direct_t4_r2_g128", "w4_direct_t3_r4"} <= set(names)
    assert len(set(names)) == len(names)
    source = cuda_w4.kernel_source(rows_build=build, x_ahead=frozenset({(2, 2)}))
    assert all(f"DIRECT_ROWS_ENTRY({t}, {a}, {b}, {r}, {int((t, r) == (2, 2))})" in source for (t, r), (a, b) in build.items())
    shipped = cuda_w4.kernel_source(arch="sm_90a")
    assert cuda_w4.DIRECT_ROWS_BUILD and set(cuda_w4.entry_names()) >= {
        cuda_w4.entry_for(t, 0, row_tiles=r) for t, r in cuda_w4.DIRECT_ROWS_BUILD}
    assert all(f"DIRECT_ROWS_ENTRY({t}, {a}, {b}, {r}, {int((t, r) in cuda_w4.X_AHEAD_ENTRIES)})" in shipped
               for (t, r), (a, b) in cuda_w4.DIRECT_ROWS_BUILD.items())
    for (t, r), (a, b) in cuda_w4.DIRECT_ROWS_BUILD.items():
        assert 8 % r == 0 and cuda_w4.ahead_chunks(t, r) == a and t <= cuda_w4.MAX_TOKEN_TILES
        assert cuda_w4.pair_group(t, 128, 32, r) == (128 if a % 2 == 0 else 0)


def test_activations_a_chunk_ahead_only_where_the_entries_are_built() -> None:
    """X_AHEAD_ENTRIES names direct entries that exist (one row tile: DIRECT_BUILD; several:
    DIRECT_ROWS_BUILD), and each entry's flag, its pair-group entries' too, follows the set."""
    built = cuda_w4.direct_entries()
    assert set(built) == {(t, 1) for t in cuda_w4.DIRECT_BUILD} | set(cuda_w4.DIRECT_ROWS_BUILD)
    assert cuda_w4.X_AHEAD_ENTRIES and cuda_w4.X_AHEAD_ENTRIES <= set(built)
    for x_ahead in (cuda_w4.X_AHEAD_ENTRIES, frozenset(), frozenset(built)):
        lines = cuda_w4.kernel_source(x_ahead=x_ahead)[len(cuda_w4.kernel_text()):].splitlines()
        direct = [line for line in lines if line.startswith("DIRECT") and not line.startswith("DIRECT_KW")]
        assert len(direct) == len(built) * (1 + len(cuda_w4.PAIR_GROUPS)) - sum(
            not cuda_w4.has_group_entry(a, g) for a, _ in built.values() for g in cuda_w4.PAIR_GROUPS)
        # an entry of two warps per row tile loads activations ahead as its (tiles, row tiles) entry does
        for line in [line for line in lines if line.startswith("DIRECT")]:
            args = [int(v) for v in line[line.index("(") + 1:-1].split(",")]
            t, r = args[0], (args[3] if line.startswith(("DIRECT_ROWS", "DIRECT_KW")) else 1)
            assert args[-1] == int((t, r) in x_ahead), line


def test_entries_of_two_warps_per_row_tile_are_built_named_and_planned_for_intermediates_only() -> None:
    """K_WARP_BUILD: each entry and its pair-group entries in the source and the names, launched
    with 256 / row tiles x warps threads (launch bounds in the macro); a plan keeps two warps per row
    tile only where that entry is built and never for a verifier (other bits than one warp's)."""
    assert cuda_w4.K_WARP_BUILD and all(kw == 2 and 8 % r == 0 and (t, r) in cuda_w4.direct_entries()
                                        for t, r, kw in cuda_w4.K_WARP_BUILD)
    source = cuda_w4.kernel_source()
    names = set(cuda_w4.entry_names())
    for (t, r, kw), (a, b) in cuda_w4.K_WARP_BUILD.items():
        xa = int((t, r) in cuda_w4.X_AHEAD_ENTRIES)
        assert f"DIRECT_KW_ENTRY({t}, {a}, {b}, {r}, {kw}, {xa})" in source
        assert cuda_w4.entry_for(t, 0, row_tiles=r, k_warps=kw) == f"w4_direct_t{t}_r{r}_k{kw}" in names
        assert cuda_w4.entry_for(t, 128, row_tiles=r, k_warps=kw) in names or not cuda_w4.has_group_entry(a, 128)
        assert cuda_w4.ahead_chunks(t, r, kw) == a and cuda_w4.pair_group(t, 128, 32, r, kw) == (128 if a % 2 == 0 else 0)
        assert 256 // r * kw * b <= 2048          # threads a multiprocessor holds
    assert len(names) == len(cuda_w4.entry_names())
    with pytest.raises(ValueError, match="no entry multiplies 4 token tiles with 1 row tiles and 2 warps"):
        cuda_w4.matmul(torch.zeros(2, 128, dtype=torch.float16), random_weight(64, 128, 32), tiles=4, k_warps=2)


def test_bad_operands_are_refused_before_any_launch() -> None:
    w = random_weight(64, 128, 32)
    with pytest.raises(ValueError, match="input features"):
        cuda_w4.matmul(torch.zeros(2, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="add_to must be"):
        cuda_w4.matmul(torch.zeros(2, 128, dtype=torch.float16), w, add_to=torch.zeros(3, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16 CUDA activations"):
        cuda_w4.matmul(torch.zeros(2, 128, dtype=torch.float16), w)
    for row_tiles in (0, 3):
        with pytest.raises(ValueError, match=f"no entry multiplies {row_tiles} row tiles per warp"):
            cuda_w4.matmul(torch.zeros(2, 128, dtype=torch.float16), w, row_tiles=row_tiles)
    for tiles in (1, cuda_w4.MAX_TOKEN_TILES):     # no such entry: the one-tile and staged warps
        assert (tiles, 2) not in cuda_w4.DIRECT_ROWS_BUILD
        with pytest.raises(ValueError, match=f"no entry multiplies {tiles} token tiles with 2 row tiles per warp"):
            cuda_w4.matmul(torch.zeros(2, 128, dtype=torch.float16), w, tiles=tiles, row_tiles=2)


def test_the_option_and_the_cpu_never_choose_it(monkeypatch) -> None:
    pytest.importorskip("triton")
    from hierviz.quant import kernel_guard, triton_w4, w4_verdicts
    w = random_weight(64, 128, 32)
    verifier = random_weight(64, 128, 32)
    verifier.batch_invariant = True
    x = torch.zeros(4, 128, dtype=torch.float16)
    every = frozenset(w4_verdicts.FAST_VARIANTS)
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "on")
    assert cuda_w4.serves(w) and cuda_w4.serves(verifier)
    assert not triton_w4.chosen_config(x, w, variants=every).cuda   # CPU tensors
    assert w4_verdicts.CUDA_VARIANT not in kernel_guard.supported_variants(torch.device("cpu"))
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "target")        # a verifier's (the target's) weights only
    assert cuda_w4.serves(verifier) and not cuda_w4.serves(w)
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "auto")          # the weights whose kind was timed fastest there
    w4_verdicts.forget_kernel_choices()
    w4_verdicts.choose_kernel(w4_verdicts.kernel_kind(verifier), True)
    assert cuda_w4.serves(verifier) and not cuda_w4.serves(w)
    w4_verdicts.forget_kernel_choices()
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "off")
    assert not cuda_w4.serves(w) and not cuda_w4.serves(verifier)
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "sometimes")
    from hierviz.config import ConfigError
    with pytest.raises(ConfigError, match="HIERVIZ_W4_CUDA"):
        cuda_w4.serves(w)


def test_measurements_record_which_w4_kernel_ran(monkeypatch) -> None:
    """machine_info (whatif, bench) names the fp16 W4 kernel: the CUDA variant only with the option
    on and the variant allowed on the device."""
    pytest.importorskip("triton")
    from hierviz import machine
    from hierviz.quant import kernel_guard, w4_verdicts
    monkeypatch.setattr(machine, "gpu_name", lambda device: "NVIDIA H200")
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "on")
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "triton"          # not allowed on a CPU
    monkeypatch.setattr(kernel_guard, "fast_variants", lambda device, dtype: frozenset({w4_verdicts.CUDA_VARIANT}))
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "cuda_mma"
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "auto")           # no weight timed yet: all Triton
    w4_verdicts.forget_kernel_choices()
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "triton"
    w4_verdicts.choose_kernel((0, 128, 64, 32, False, True), True)
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "cuda_mma"
    w4_verdicts.forget_kernel_choices()
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "target")
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "cuda_mma for the target, triton for the rest"
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "off")
    assert machine.machine_info("cpu")["w4_fp16_kernel"] == "triton"


def skip_without_nvrtc() -> None:
    if cuda_w4.nvrtc_version() is None:
        pytest.skip("NVRTC is not installed (nvidia-cuda-nvrtc-cu12; scripts/setup.sh --test installs it)")


@functools.lru_cache(maxsize=None)
def shipped_cubin(arch: str) -> bytes:
    """The shipped entries built for `arch`, once per test process (a build takes 15-20 s)."""
    return cuda_w4.compile_cubin(arch)


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A100 and H100/H200 (sm_90a: what cuda_w4 builds there, with the wgmma entries; a plain sm_90
# build is never made, as every Hopper part is 9.0): every shipped entry
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_nvrtc_compiles_the_kernel(arch) -> None:
    skip_without_nvrtc()
    cubin = shipped_cubin(arch)
    assert cubin[:4] == b"\x7fELF"
    assert all(name.encode() in cubin for name in cuda_w4.entry_names(arch))
    assert (b"w4_wgmma_t8" in cubin) == (arch == "sm_90a") == cuda_w4.has_wgmma(arch)


# The Blackwell parts (B200, RTX PRO 6000), where the start-up proof decides and a build that fails
# leaves the Triton kernel running: one entry of each kind (the entries of a kind differ only in
# their template constants), which keeps the CPU suite's compile time to the two archs above
@pytest.mark.parametrize("arch", ["sm_100", "sm_120"])
def test_nvrtc_compiles_each_kind_of_entry_for_blackwell(arch) -> None:
    skip_without_nvrtc()
    direct = {1: cuda_w4.DIRECT_BUILD[1]}
    staged = {cuda_w4.MAX_TOKEN_TILES: cuda_w4.STAGED_BUILD[cuda_w4.MAX_TOKEN_TILES]}
    rows = dict([next(iter(cuda_w4.DIRECT_ROWS_BUILD.items()))])
    k_warps = dict([next(iter(cuda_w4.K_WARP_BUILD.items()))])
    source = cuda_w4.kernel_source(direct, staged, arch=arch, rows_build=rows, kw_build=k_warps)
    macros = {line.split("(")[0] for line in source[len(cuda_w4.kernel_text()):].splitlines()}
    assert macros == {"DIRECT_ENTRY", "DIRECT_GROUP_ENTRY", "DIRECT_ROWS_ENTRY", "DIRECT_ROWS_GROUP_ENTRY",
                      "DIRECT_KW_ENTRY", "DIRECT_KW_GROUP_ENTRY", "STAGED_ENTRY"}
    cubin = cuda_w4.compile_cubin(arch, source)
    assert cubin[:4] == b"\x7fELF" and b"w4_direct_t1" in cubin and b"w4_staged_t8" in cubin


def test_nvrtc_errors_come_back_as_a_compile_error_with_the_log() -> None:
    skip_without_nvrtc()
    with pytest.raises(cuda_w4.CompileError, match=r"(?s)NVRTC failed for sm_80:.*hierviz_w4\.cu\(1\): error"):
        cuda_w4.compile_cubin("sm_80", "this is not C++;\n")


def test_the_cuda_c_is_the_cu_file_beside_the_module() -> None:
    """The kernel's CUDA C is hierviz/quant/cuda_w4.cu, not a string in the Python module: the
    source NVRTC gets is that file, after the constants cuda_w4.py defines and before one
    entry line per build."""
    path = Path(cuda_w4.__file__).with_name("cuda_w4.cu")
    assert cuda_w4.KERNEL_FILE == path and path.is_file()
    text = path.read_text()
    head, entries = cuda_w4.kernel_source().split(text)
    assert head == (f'#define NBUF {cuda_w4.NBUF}\n#define ROWS_PER_BLOCK {cuda_w4.ROWS_PER_BLOCK}\n'
                    '#line 1 "cuda_w4.cu"\n')
    assert len(entries.splitlines()) == len(cuda_w4.entry_names())
    assert all(line.split("(")[0] in ("DIRECT_ENTRY", "DIRECT_GROUP_ENTRY", "DIRECT_ROWS_ENTRY", "DIRECT_ROWS_GROUP_ENTRY",
                                      "DIRECT_KW_ENTRY", "DIRECT_KW_GROUP_ENTRY", "STAGED_ENTRY")
               for line in entries.splitlines())
    head90a, entries90a = cuda_w4.kernel_source(arch="sm_90a").split(text)
    assert head90a == head and len(entries90a.splitlines()) == len(cuda_w4.entry_names("sm_90a"))
    assert entries90a.startswith(entries) and all(line.startswith("WGMMA_ENTRY(")
                                                   for line in entries90a[len(entries):].splitlines())
    assert "__global__" in text and "__global__" not in Path(cuda_w4.__file__).read_text()


def test_nvrtc_reads_the_cu_file_when_it_builds_and_names_its_lines(monkeypatch, tmp_path) -> None:
    """compile_cubin's default source is the file as it is when the kernel is built, and NVRTC's
    messages carry the file's own line numbers."""
    skip_without_nvrtc()
    text = cuda_w4.KERNEL_FILE.read_text()
    broken = tmp_path / "cuda_w4.cu"
    broken.write_text(text + "int broken = not_declared;\n")
    monkeypatch.setattr(cuda_w4, "KERNEL_FILE", broken)
    with pytest.raises(cuda_w4.CompileError, match=rf"cuda_w4\.cu\({text.count(chr(10)) + 1}\): error"):
        cuda_w4.compile_cubin("sm_80")


def test_nvrtc_compiles_the_wgmma_probe_for_sm_90a() -> None:
    """scripts/wgmma_probe.py, which measured that wgmma gives the kernel's mma.sync bits, still builds."""
    skip_without_nvrtc()
    assert cuda_w4.compile_cubin("sm_90a", load_script("wgmma_probe").SOURCE)[:4] == b"\x7fELF"


def test_sass_report_reads_each_entrys_steady_loop() -> None:
    """scripts/sass_report.py finds each entry's steady loop in the SASS of the shipped sm_90a
    build: a direct entry's turns AHEAD chunks of its ring, 4 MMAs a chunk per token tile and row
    tile and the dequantization's 13 operations per 8 codes (52 a chunk and row tile, group-pair
    entries), each instruction with at least one stall cycle and a register count a thread can have."""
    skip_without_nvrtc()
    sass = load_script("sass_report")
    names = ["w4_direct_t1_g128", "w4_direct_t4_r2_g128", "w4_staged_t8"]
    rows = {r["entry"]: r for r in sass.report(shipped_cubin("sm_90a"), names)}
    for name, tiles, row_tiles in (("w4_direct_t1_g128", 1, 1), ("w4_direct_t4_r2_g128", 4, 2), ("w4_staged_t8", 8, 1)):
        r, chunk = rows[name], rows[name]["per_chunk"]
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] == 0     # these three spill nothing
        assert chunk["mma"] == 4 * tiles * row_tiles
        assert chunk["stall_cycles"] >= chunk["instructions"] > chunk["mma"]
        if name.startswith("w4_direct"):
            assert r["chunks_per_iteration"] == cuda_w4.ahead_chunks(tiles, row_tiles)
            assert chunk["dequant"] == 52 * row_tiles
    # the steady loop (one compare: its own condition), not the tail loop of as many MMAs that
    # tests each chunk against the slice's end
    text = sass._dump(shipped_cubin("sm_90a"), "-sass", "-fun", "w4_direct_t1_g128")
    loop = sass.steady_loop(sass.parse_sass(text)["w4_direct_t1_g128"])
    assert sum(x.op == "ISETP" for x in loop) == 1 and loop[-1].op == "BRA"
    with pytest.raises(SystemExit, match="no such entry"):
        sass.report(shipped_cubin("sm_90a"), ["w4_direct_t9"])
    # --source FILE: FILE in place of cuda_w4.cu, the constants and entries as shipped
    assert sass.build_source("sm_90a", str(cuda_w4.KERNEL_FILE)) == sass.build_source("sm_90a") == cuda_w4.kernel_source(arch="sm_90a")


def test_ring_bench_builds_a_staged_loop_that_loads_no_codes_from_global_memory() -> None:
    """scripts/ring_bench.py (the staged loop with codes and group pairs in a shared-memory ring of
    asynchronous copies, docs/kernels.md): its entries build for sm_90a without spills at 2 blocks
    per multiprocessor, with the staged loop's 4 MMAs a chunk per token tile, and their steady loop
    reads the weights from shared memory only, where the shipped staged loop loads them itself."""
    skip_without_nvrtc()
    bench, sass = load_script("ring_bench"), load_script("sass_report")
    builds = bench.ring_builds(bench.parse_rings("1:4"), "sm_90a")
    cubin = cuda_w4.compile_cubin("sm_90a", bench.build_source("sm_90a", builds))
    rows = {r["entry"]: r for r in bench.sass_rows(cubin, bench.staged_names() + list(builds), builds)}
    parsed = sass.parse_sass(sass._dump(cubin, "-sass"))
    for name, (tiles, _, _, blocks) in builds.items():
        r = rows[name]
        assert blocks == 2 and r["stack_bytes"] == 0 and r["registers"] <= 65536 // (2 * 256)
        assert r["per_chunk"]["mma"] == 4 * tiles and r["shared_bytes"] == bench.ring_shared_bytes(tiles, 1, 4)
        assert not any(x.op == "LDG" for x in sass.steady_loop(parsed[name])), name
    assert any(x.op == "LDG" for x in sass.steady_loop(parsed["w4_staged_t8"]))
    with pytest.raises(SystemExit, match="CS >= 3"):
        bench.parse_rings("2:2")
    ring_mma = bench.ring_mma_text()       # w4_mma's own tile, K slice and epilogue, one call changed
    assert "void w4_mma_ring(PARAMS)" in ring_mma and bench.STAGED_CALL not in ring_mma
    assert ring_mma.replace("w4_mma_ring(", "w4_mma(").replace("product_staged_ring<T, S, XRING>", "product_staged<T, S>") in cuda_w4.KERNEL_FILE.read_text()


def test_tiles_bench_unscaled_source_drops_exactly_the_scale_fmas(monkeypatch) -> None:
    """scripts/tiles_bench.py's "unscaled" build (the bound on applying the group scales after the
    MMA, docs/kernels.md) removes the dequantization's four scale-and-offset FMAs and nothing else,
    only inside its block, and says so when the kernel no longer has them."""
    bench = load_script("tiles_bench")
    shipped = cuda_w4.kernel_text()
    with bench.source_text(bench.BUILDS["unscaled"]):
        unscaled = cuda_w4.kernel_text()
    assert cuda_w4.kernel_text() == shipped
    removed = [line + "\n" for line in shipped.splitlines() if line + "\n" not in unscaled.splitlines(keepends=True)]
    assert removed == bench.SCALE_FMAS
    assert len(shipped) - len(unscaled) == sum(map(len, bench.SCALE_FMAS))
    monkeypatch.setattr(cuda_w4, "kernel_text", lambda: shipped.replace(bench.SCALE_FMAS[0], ""))
    with pytest.raises(SystemExit, match="no longer has"):
        bench.unscaled_text()


# A Marlin-shaped checkout for --marlin-src: its kernel template, host constants and launcher calls
# as github.com/IST-DASLab/marlin lays them out, with a loop of mma.sync (hierviz ships none of Marlin)
FAKE_MARLIN = r'''
#ifndef FAKE_MARLIN_CUH
#define FAKE_MARLIN_CUH
#include <cuda.h>
#include <cuda_fp16.h>
#include <iostream>

template <const int threads, const int thread_m_blocks, const int thread_n_blocks, const int thread_k_blocks,
          const int stages, const int group_blocks = -1>
__global__ void Marlin(
  const int4* __restrict__ A, // activations
  int4* __restrict__ C,       // output
  int iters
) {
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t* a = reinterpret_cast<const uint32_t*>(A);
  for (int i = 0; i < iters; i++) {
    #pragma unroll
    for (int j = 0; j < thread_m_blocks; j++) {
      half2 s = __hmul2(*reinterpret_cast<const half2*>(a + i + j), *reinterpret_cast<const half2*>(a + i + j + 1));
      uint32_t b = *reinterpret_cast<uint32_t*>(&s);
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%4,%4}, {%0,%1,%2,%3};\n"
                   : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]) : "r"(b));
    }
  }
  reinterpret_cast<float*>(C)[threadIdx.x] = acc[0] + acc[1] + acc[2] + acc[3];
}

const int THREADS = 256;
const int STAGES = 4;
#define CALL_IF(M, N, K, G) if (m == M) { Marlin<THREADS, M, N, K, STAGES, G><<<1, THREADS>>>(A, C, 1); }
int marlin_cuda(const void* A, void* C, int m) {
  CALL_IF(1, 8, 8, -1)
  CALL_IF(1, 8, 8, 8)
  CALL_IF(4, 16, 4, 8)
  return 0;
}
#endif
'''


def test_sass_report_reads_marlins_main_loop_beside_the_kernels(tmp_path) -> None:
    """--marlin-src: Marlin's device code is cut before its host launcher, instantiated at each
    configuration the launcher calls for groups of 128 (not those without groups), built by NVRTC
    with the CUDA headers Triton ships, and read from its loop's first MMA to its last, per MMA;
    a folder that is not a Marlin checkout, or a kernel file of another shape, is refused."""
    skip_without_nvrtc()
    sass = load_script("sass_report")
    (tmp_path / "marlin").mkdir()
    (tmp_path / sass.MARLIN_KERNEL).write_text(FAKE_MARLIN)
    source, configs = sass.marlin_source(str(tmp_path))
    assert sorted(configs.values()) == [(1, 8, 8), (4, 16, 4)]
    assert "int marlin_cuda" not in source and "<iostream>" not in source and source.count("#endif") == 1
    rows = {r["entry"]: r for r in sass.marlin_report(str(tmp_path), "sm_90a")}
    assert set(rows) == {"marlin m16 n128 k128", "marlin m64 n256 k64"}
    for r in rows.values():
        per = r["per_mma"]
        assert 0 < r["registers"] <= 255 and per["mma"] == 1.0
        assert per["stall_cycles"] >= per["instructions"] > 1.0 and per["dequant"] > 0      # the HMUL2s
    with pytest.raises(SystemExit, match="not a Marlin checkout"):
        sass.marlin_source(str(tmp_path / "marlin"))
    (tmp_path / sass.MARLIN_KERNEL).write_text(FAKE_MARLIN.replace("const int THREADS = 256;", ""))
    with pytest.raises(SystemExit, match="not the Marlin kernel this reads"):
        sass.marlin_source(str(tmp_path))


def test_a_rows_build_at_the_staged_tile_counts_builds_direct_entries(monkeypatch) -> None:
    """scripts/tiles_bench.py's r2t678 build (the register loop at 6-8 token tiles by two row tiles
    per warp, docs/kernels.md): cuda_w4 names its entries as direct ones, not the staged entries of
    the same token tiles, every name once, and its largest, 8 token tiles (the most registers), builds
    for sm_90a and sm_80 (an A100) without spilling, 4 MMAs a chunk per token tile and row tile."""
    skip_without_nvrtc()
    bench, sass = load_script("tiles_bench"), load_script("sass_report")
    rows = bench.BUILDS["r2t678"]["rows"]
    monkeypatch.setattr(cuda_w4, "DIRECT_ROWS_BUILD", {**cuda_w4.DIRECT_ROWS_BUILD, **rows})
    assert cuda_w4.entry_for(8, 128, row_tiles=2) == "w4_direct_t8_r2_g128"
    assert cuda_w4.entry_for(8, 128) == "w4_staged_t8" and cuda_w4.entry_for(8, wgmma=True) == "w4_wgmma_t8"
    names = cuda_w4.entry_names("sm_90a")
    assert len(names) == len(set(names)) and {"w4_direct_t6_r2", "w4_direct_t8_r2_g128", "w4_staged_t8"} <= set(names)
    largest = {(8, 2): rows[(8, 2)]}
    for arch in ("sm_90a", "sm_80"):
        source = cuda_w4.kernel_source({}, {}, arch=arch, wgmma_build={}, rows_build=largest, x_ahead=frozenset(), kw_build={})
        report = {r["entry"]: r for r in sass.report(cuda_w4.compile_cubin(arch, source))}
        for group in ("", "_g64", "_g128"):
            row = report[f"w4_direct_t8_r2{group}"]
            assert row["stack_bytes"] == 0 and row["per_chunk"]["mma"] == 4 * 8 * 2, (arch, row)
