"""The start-up proof of the W4 kernel's fast variants (hierviz.quant.w4_proof), how its verdicts are
kept (hierviz.quant.w4_verdicts) and how they reach the kernels (kernel_guard.fast_variants,
triton_w4.chosen_config), on the CPU: the verdict logic with a product function standing in for
the kernel, the per-platform cache on disk, a CUDA platform faked through torch.cuda's queries,
and the real kernels under TRITON_INTERPRET=1 (in a subprocess: the interpreter must be on before
triton is imported). tests/test_gpu.py proves real model shapes on a GPU."""
from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hierviz.measure import w4_sweep  # noqa: E402
from hierviz.models.config import ModelConfig  # noqa: E402
from hierviz.quant import kernel_guard, triton_w4, w4_proof, w4_verdicts  # noqa: E402
from hierviz.quant.w4 import INVARIANT_MAX_ROWS, W4Weight, dequantize  # noqa: E402
from tests.tiny import run_interpreted

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)
WIDE = (256, 8192, 128)        # N >= 8192, g128: the CUDA-core one-token kernel is picked at one row
ROWS = [1, 5, 17, 40, 100]


@pytest.fixture(autouse=True)
def fresh_verdicts(tmp_path, monkeypatch):
    """Each test starts with no verdict in memory and an empty cache directory."""
    monkeypatch.setenv("HIERVIZ_CACHE", str(tmp_path / "cache"))
    w4_verdicts.forget_in_memory()
    yield
    w4_verdicts.forget_in_memory()


def rowwise_product(wrong_tma_at: int = 0, batch_dependent: bool = False):
    """A stand-in for the kernel: each row computed alone in fp32 (so bit-invariant), optionally
    wrong in one 8-feature group at one row count on TMA configurations, or (batch_dependent) one
    unit in the last place off in row 0 of every batch-invariant TMA product of more than one row."""
    dense: dict[int, torch.Tensor] = {}

    def product(x: torch.Tensor, w: W4Weight, cfg: triton_w4.Config) -> torch.Tensor:
        if id(w) not in dense:
            dense[id(w)] = dequantize(w, torch.float32)
        y = torch.cat([r[None] @ dense[id(w)].t() for r in x.float()]).to(x.dtype)
        if cfg.tma and x.shape[0] == wrong_tma_at:
            y[:, :8] *= 1.5
        if batch_dependent and cfg.tma and w.batch_invariant and x.shape[0] > 1:
            y.view(torch.int16)[0, 0] += 1
        return y
    return product


def test_a_variant_wrong_at_one_row_count_is_disabled_and_the_right_one_enabled() -> None:
    v = w4_proof.prove([WIDE], ROWS, torch.float16, CPU, product=rowwise_product(wrong_tma_at=17),
                       check_bits=True, remember_verdict=False)
    assert v.enabled() == {"gemv"} and not v.passed()
    assert [(f["rows"], f["mode"], f["why"]) for f in v.failures("tma")] == [
        (17, "normal", "wrong rows"), (17, "invariant", "wrong rows"), (17, "invariant", "not bit-invariant")]
    # TMA: normal mode up to 64 rows (the 128 x 64 pointer tiles above), batch-invariant mode every
    # row count (its rows must equal the one-row TMA product); CUDA-core: one row, normal mode
    assert v.products("tma") == 4 + 5 and v.products("gemv") == 1 and not v.failures("gemv")
    assert "TMA variant wrong at 256x8192 g128, 17 rows" in v.summary()
    assert v.summary().startswith("W4 fast path: partly proven here (CUDA-core one-token variant on;")


def test_invariant_mode_catches_a_row_that_depends_on_the_batch() -> None:
    product = rowwise_product(batch_dependent=True)
    v = w4_proof.prove([WIDE], ROWS, torch.float16, CPU, product=product, check_bits=True, remember_verdict=False)
    assert {(f["mode"], f["why"]) for f in v.failures("tma")} == {("invariant", "not bit-invariant")}
    # 100 rows run the pointer tiles, which this stand-in computes right: only the TMA rows differ
    assert sorted(f["rows"] for f in v.failures("tma")) == [5, 17, 40]
    assert v.enabled() == {"gemv"}
    # one unit in the last place is within the tolerance: only the bit check sees it
    lax = w4_proof.prove([WIDE], ROWS, torch.float16, CPU, product=product, check_bits=False, remember_verdict=False)
    assert lax.passed() and lax.summary().startswith("W4 fast path: proven here (cpu (TRITON_INTERPRET=1), Triton ")
    assert "1 shape x 5 row counts" in lax.summary()


def test_verdict_lines_for_the_other_outcomes() -> None:
    key = w4_verdicts.platform_key(CPU)
    off = w4_proof.prove([WIDE], [1, 17], torch.float16, CPU, product=rowwise_product(wrong_tma_at=17),
                         check_bits=True, remember_verdict=False)
    assert off.enabled() == {"gemv"}
    narrow = w4_proof.prove([(256, 192, 64)], [17], torch.float16, CPU, product=rowwise_product(wrong_tma_at=17),
                            remember_verdict=False)
    assert narrow.summary() == ("W4 fast path: off (TMA variant wrong at 256x192 g64, 17 rows) — using the "
                                "pointer-load kernels")

    def no_gemv(x, w, cfg):
        if cfg.gemv:
            raise RuntimeError("PassManager::run failed")    # what a compiler that cannot build it raises
        return rowwise_product()(x, w, cfg)
    crashed = w4_proof.prove([WIDE], [1, 2], torch.float16, CPU, product=no_gemv, remember_verdict=False)
    assert crashed.enabled() == {"tma"} and crashed.failures("gemv")[0]["error"].startswith("RuntimeError")
    assert "CUDA-core one-token variant failed to run at 256x8192 g128, 1 row" in crashed.summary()
    ampere = w4_verdicts.Verdict({**key, "gpu": "NVIDIA A100", "capability": "8.0"}, "float16", ())
    assert ampere.summary().startswith("W4 fast path: not available on this GPU (NVIDIA A100, Triton ")
    assert w4_verdicts.Verdict(key, "float16", ("tma", "gemv"), source="static").enabled() == {"tma", "gemv"}
    static = w4_verdicts.Verdict(key, "float16", ("tma", "gemv"), source="static")
    assert "CUDA MMA" not in static.summary()
    with_cuda = w4_verdicts.Verdict(key, "float16", ("tma", "gemv", "cuda_mma"), source="static")
    assert with_cuda.summary().endswith(" — fp16 products of the weights it is timed fastest on in the CUDA MMA "
                                        "variant")      # HIERVIZ_W4_CUDA=auto, the default


def test_the_status_line_says_when_only_the_target_runs_the_cuda_variant(monkeypatch) -> None:
    key = w4_verdicts.platform_key(CPU)
    with_cuda = w4_verdicts.Verdict(key, "float16", ("tma", "gemv", "cuda_mma"), source="static")
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "target")
    assert with_cuda.summary().endswith(" — the target's fp16 products in the CUDA MMA variant")
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "on")
    assert with_cuda.summary().endswith(" — fp16 products in the CUDA MMA variant")


def test_proof_rows_cover_every_row_count_a_fast_variant_changes() -> None:
    """PROOF_ROWS holds every CUDA-graph bucket; past it no variant changes a configuration (a
    long prefill runs the same pointer-load tiles proven or not), at it both modes still do."""
    from hierviz.models.cuda_graphs import BUCKETS
    assert set(BUCKETS) <= set(w4_proof.PROOF_ROWS) and max(w4_proof.PROOF_ROWS) == INVARIANT_MAX_ROWS
    for k, n, g in [(8192, 10240, 128), (28672, 8192, 128), (4096, 28672, 128), (5120, 5120, 64)]:
        w = W4Weight(torch.zeros(1, dtype=torch.uint8).expand(n, k // 2), torch.zeros(n, k // g),
                     torch.zeros(n, k // g), g)
        x = torch.zeros(2048, k, dtype=torch.float16)
        for invariant in (False, True):
            w.batch_invariant = invariant
            for m in (129, 256, 1000, 2048):
                assert not any(w4_proof._exercises(x, w, m, v) for v in w4_verdicts.FAST_VARIANTS), (k, n, m)
            assert w4_proof._exercises(x, w, INVARIANT_MAX_ROWS if invariant else 64, "tma")


def test_verdicts_are_kept_on_disk_per_platform() -> None:
    product = rowwise_product(wrong_tma_at=17)
    w4_proof.prove([(256, 192, 64)], [1, 17], torch.float16, CPU, product=product)
    w4_proof.prove([(256, 96, 128)], [1, 2], torch.float16, CPU, product=product)     # merged, not replaced
    key = w4_verdicts.platform_key(CPU)
    path = w4_verdicts.cache_file(key)
    assert path.parent == Path(os.environ["HIERVIZ_CACHE"]) / "w4-proof"
    w4_verdicts.forget_in_memory()
    known = w4_verdicts.known_records(key, torch.float16)
    assert sorted(known) == ["256x192g64", "256x96g128"]
    assert known["256x192g64"]["variants"]["tma"]["failures"][0]["rows"] == 17
    assert w4_verdicts.known_records(key, torch.bfloat16) == {}
    for other in ({"gpu": "NVIDIA H100"}, {"triton": "3.6.0"}, {"torch": "2.11.0+cu130"}, {"driver": "550.54"}):
        assert w4_verdicts.known_records({**key, **other}, torch.float16) == {}, other
    assert json.loads(path.read_text())["platform"] == key


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1, "platform": {"gpu": "another"}, "dtypes": {}}),
                                     json.dumps([1, 2]), "PLATFORM_WITH_A_BAD_RECORD"])
def test_a_corrupt_or_foreign_cache_file_is_ignored_with_a_warning(content) -> None:
    key = w4_verdicts.platform_key(CPU)
    path = w4_verdicts.cache_file(key)
    path.parent.mkdir(parents=True)
    if content == "PLATFORM_WITH_A_BAD_RECORD":
        content = json.dumps({"format": 1, "platform": key, "dtypes": {"float16": {"256x192g64": {"K": "x"}}}})
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="W4 proof cache .* ignored"):
        assert w4_verdicts.known_records(key, torch.float16) == {}
    with pytest.warns(RuntimeWarning, match="ignored"):     # the next proof replaces the file
        w4_proof.prove([(256, 192, 64)], [1], torch.float16, CPU, product=rowwise_product())
    w4_verdicts.forget_in_memory()
    assert list(w4_verdicts.known_records(key, torch.float16)) == ["256x192g64"]


@pytest.fixture
def fake_hopper(monkeypatch):
    """torch.cuda's device queries answer for an sm_90 GPU (no GPU is used: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake H200")
    monkeypatch.setattr(w4_verdicts, "driver_version", lambda: "570.1")
    monkeypatch.setattr(kernel_guard, "PROVEN_PLATFORMS", frozenset())
    w4_verdicts.verdicts_changed()
    yield
    w4_verdicts.forget_in_memory()


def record(shape: tuple[int, int, int], tma_failures: int = 0) -> dict:
    k, n, g = shape
    fails = [{"K": k, "N": n, "group": g, "rows": 17, "mode": "normal", "why": "wrong rows"}] * tma_failures
    return {"K": k, "N": n, "group": g, "rows": w4_proof.PROOF_ROWS, "seconds": 1.5,
            "variants": {"tma": {"products": 192, "failures": fails}, "gemv": {"products": 1, "failures": []}}}


def test_platform_proven_honours_a_passing_verdict_and_the_static_list(fake_hopper, monkeypatch) -> None:
    key = w4_verdicts.platform_key(GPU)
    assert key["gpu"] == "Fake H200" and key["capability"] == "9.0" and key["driver"] == "570.1"
    assert not kernel_guard.platform_proven(GPU) and kernel_guard.fast_variants(GPU) == frozenset()
    assert not w4_proof.proven_for(GPU, [WIDE])
    triton_w4._VERIFIED[("stale",)] = None
    w4_verdicts.remember(key, torch.float16, {"256x8192g128": record(WIDE)})
    assert ("stale",) not in triton_w4._VERIFIED           # choices made under the old verdict start over
    assert kernel_guard.platform_proven(GPU) and w4_proof.proven_for(GPU, [WIDE])
    assert not w4_proof.proven_for(GPU, [(256, 192, 64)])  # a shape never proven here
    assert not kernel_guard.platform_proven(GPU, torch.bfloat16)
    # a failure recorded on another shape turns the failing variant off for the whole platform
    w4_verdicts.remember(key, torch.float16, {"256x192g64": record((256, 192, 64), tma_failures=1)})
    assert kernel_guard.fast_variants(GPU) == {"gemv"} and not kernel_guard.platform_proven(GPU)
    assert not w4_proof.proven_for(GPU, [WIDE])
    w4_verdicts.forget_in_memory()                         # a restart: the verdict comes from disk
    assert kernel_guard.fast_variants(GPU) == {"gemv"}
    # the static list holds the pair: every variant, unless a failure was recorded here
    monkeypatch.setattr(kernel_guard, "PROVEN_PLATFORMS", frozenset({(9, kernel_guard.triton_version())}))
    w4_verdicts.verdicts_changed()
    assert kernel_guard.fast_variants(GPU) == {"gemv"}
    monkeypatch.setenv("HIERVIZ_CACHE", str(Path(os.environ["HIERVIZ_CACHE"]) / "elsewhere"))
    w4_verdicts.forget_in_memory()
    assert kernel_guard.platform_proven(GPU) and w4_proof.proven_for(GPU, [(1024, 1024, 128)])


def test_an_older_gpu_has_no_fast_variant_to_prove(fake_hopper, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 0))
    assert kernel_guard.supported_variants(GPU) == () and not kernel_guard.platform_proven(GPU)
    model, _ = tiny_w4_model()
    verdict = w4_proof.prove_models([model], torch.float16, GPU)
    assert verdict.source == "none" and "not available on this GPU" in verdict.summary()


def tiny_w4_model():
    from hierviz.models.synthetic import synthetic_model
    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    return synthetic_model(cfg, "w4", torch.float16, "cpu", "triton", seed=0, group=64), cfg


def test_prove_models_collects_the_engine_shapes_and_skips_what_is_known(fake_hopper, monkeypatch) -> None:
    model, cfg = tiny_w4_model()
    shapes = w4_proof.model_shapes([model, None])
    assert shapes == w4_sweep.config_shapes(cfg, 64)        # what --quick proves for a preset is what loads
    key = w4_verdicts.platform_key(GPU)
    proved: list[list] = []

    def fake_prove(shapes, rows, dtype, device, log=None):
        proved.append(shapes)
        w4_verdicts.remember(key, dtype, {w4_verdicts.shape_id(s): record(s) for s in shapes})
    monkeypatch.setattr(w4_proof, "prove", fake_prove)
    w4_verdicts.remember(key, torch.float16, {w4_verdicts.shape_id(shapes[0]): record(shapes[0])})
    first = w4_proof.prove_models([model], torch.float16, GPU)
    assert proved == [shapes[1:]] and first.source == "proved" and first.passed()
    assert first.summary().startswith(f"W4 fast path: proven here (Fake H200, Triton {kernel_guard.triton_version()}, "
                                      f"{len(shapes)} shapes x 128 row counts, ")
    again = w4_proof.prove_models([model], torch.float16, GPU)
    assert proved == [shapes[1:]] and again.source == "remembered" and "remembered from an earlier start" in again.summary()
    assert kernel_guard.platform_proven(GPU)
    monkeypatch.setattr(kernel_guard, "PROVEN_PLATFORMS", frozenset({(9, kernel_guard.triton_version())}))
    assert w4_proof.prove_models([model], torch.float16, GPU).source == "static"
    assert w4_proof.prove_models([model], torch.float16, CPU).summary().startswith("W4 fast path: not used on the CPU")


def test_chosen_config_uses_only_the_allowed_variants() -> None:
    w = W4Weight(torch.zeros(8192, 128, dtype=torch.uint8), torch.zeros(8192, 2), torch.zeros(8192, 2), 128)
    one, few = torch.zeros(1, 256, dtype=torch.float16), torch.zeros(8, 256, dtype=torch.float16)
    pick = triton_w4.chosen_config
    assert pick(one, w, variants=frozenset({"gemv"})).gemv and not pick(few, w, variants=frozenset({"gemv"})).tma
    assert not pick(one, w, variants=frozenset({"tma"})).gemv and pick(one, w, variants=frozenset({"tma"})).tma
    assert pick(one, w, hopper_paths=True).gemv and pick(few, w, hopper_paths=True).tma
    off = pick(one, w, hopper_paths=False)
    assert not off.gemv and not off.tma and off == pick(one, w, variants=frozenset())


def test_quick_sweep_refuses_bad_input(capsys) -> None:
    for args, message in ((["--shapes", "12xab"], "bad shape '12xab'"), (["--shapes", "100x64g64"], "must divide K"),
                          (["--shapes", "264x64g33"], "multiples of 32"), (["--shapes", "256x64g0"], "must divide K"),
                          (["--preset", "nope"], "unknown preset 'nope'"),
                          (["--shapes", "256x192", "--rows", "0-3"], "bad --rows"),
                          (["--shapes", "256x192", "--dtypes", "int8"], "bad --dtypes")):
        assert w4_sweep.main(["--quick", *args]) == 2, args
        assert message in capsys.readouterr().err, args
    assert w4_sweep.parse_shapes("4096x14336g64, 256x192") == [(4096, 14336, 64), (256, 192, 128)]
    assert w4_sweep.preset_shapes("paper-llama3-70b") == [(8192, 8192, 128), (8192, 10240, 128), (8192, 57344, 128),
                                                          (28672, 8192, 128)]
    if not torch.cuda.is_available():
        assert w4_sweep.main(["--quick"]) == 2 and "needs small --shapes" in capsys.readouterr().err


_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from hierviz.measure import w4_sweep
    from hierviz.quant import w4_proof
    out = {}
    v = w4_proof.prove([(256, 192, 64), (512, 96, 128)], [1, 3, 17, 40], torch.float16, "cpu", remember_verdict=False)
    out["prove"] = {"enabled": sorted(v.enabled()), "tma": v.products("tma"), "gemv": v.products("gemv"),
                    "failures": v.failures("tma") + v.failures("gemv")}
    out["rc_clean"] = w4_sweep.main(["--quick", "--shapes", "256x192g64", "--rows", "1,17"])
    out["cache_files"] = sorted(os.listdir(os.path.join(os.environ["HIERVIZ_CACHE"], "w4-proof")))
    real = w4_proof._kernel_product
    def broken(x, w, cfg):
        y = real(x, w, cfg)
        if cfg.tma and x.shape[0] == 17:
            y = y.clone(); y[:, :8] *= 1.05
        return y
    w4_proof._kernel_product = broken
    out["rc_broken"] = w4_sweep.main(["--quick", "--shapes", "256x192g64", "--rows", "1,17"])
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("proof-cache")
    lines = run_interpreted(_SCRIPT, extra_env={"HIERVIZ_CACHE": str(cache)})
    return {**json.loads(lines[-1]), "stdout": "\n".join(lines[:-1])}


def test_the_real_kernels_pass_the_proof_under_the_interpreter(interpreted) -> None:
    p = interpreted["prove"]
    assert p["enabled"] == ["tma"] and p["failures"] == []
    assert p["tma"] == 2 * (4 + 4) and p["gemv"] == 0        # no shape here is wide enough for the CUDA-core kernel


def test_quick_sweep_exit_codes_and_verdict_line(interpreted) -> None:
    assert interpreted["rc_clean"] == 0 and interpreted["rc_broken"] == 1
    assert len(interpreted["cache_files"]) == 1 and interpreted["cache_files"][0].endswith(".json")
    out = interpreted["stdout"]
    assert "float16: W4 fast path: proven here for the TMA variant, the one these shapes use (cpu " in out
    assert "float16: W4 fast path: off (TMA variant wrong at 256x192 g64, 17 rows) — using the pointer-load kernels" in out
    assert "w4-sweep --quick: 1 shape x 2 row counts in " in out


def test_asking_for_the_cuda_variant_where_it_cannot_load_warns_and_keeps_triton(fake_hopper, monkeypatch) -> None:
    """HIERVIZ_W4_CUDA=on on a GPU where the CUDA MMA kernel does not load (here: no CUDA driver at
    all behind the faked device queries): a warning says why, and the Triton variants stay."""
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "on")
    kernel_guard._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="HIERVIZ_W4_CUDA=on, but the CUDA W4 kernel is not available"):
        assert kernel_guard.supported_variants(GPU) == w4_verdicts.TRITON_VARIANTS
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (7, 5))
    with pytest.warns(RuntimeWarning, match="needs tensor-core MMA"):
        assert kernel_guard.supported_variants(GPU) == ()


def test_a_record_at_fewer_rows_does_not_cover_a_load(fake_hopper, monkeypatch) -> None:
    """A shape proven at a few row counts (`w4-sweep --quick --rows 1,2`) is not proven for a load,
    whose decoders use every row count: the load proves it again at PROOF_ROWS."""
    model, _ = tiny_w4_model()
    shapes = w4_proof.model_shapes([model, None])
    key = w4_verdicts.platform_key(GPU)
    w4_verdicts.remember(key, torch.float16, {w4_verdicts.shape_id(s): {**record(s), "rows": [1, 2]} for s in shapes})
    assert w4_proof.proven_for(GPU, shapes, rows=[1, 2]) and not w4_proof.proven_for(GPU, shapes)
    proved: list[tuple] = []
    monkeypatch.setattr(w4_proof, "prove", lambda shapes, rows, dtype, device, log=None: proved.append((shapes, rows)))
    w4_proof.prove_models([model], torch.float16, GPU)
    assert proved == [(shapes, sorted(w4_proof.PROOF_ROWS))]


def test_the_static_list_covers_a_platform_only_for_every_variant_it_supports(fake_hopper, monkeypatch) -> None:
    """On a statically proven (GPU, Triton) pair the Triton variants need no proof, but a CUDA MMA
    variant asked for there, with an NVRTC the list does not name, still does: the platform is not
    'on the static list' and a load proves it."""
    monkeypatch.setattr(kernel_guard, "PROVEN_PLATFORMS", frozenset({(9, kernel_guard.triton_version())}))
    assert kernel_guard.on_static_list(GPU)
    monkeypatch.setattr(kernel_guard, "supported_variants", lambda device: (*w4_verdicts.TRITON_VARIANTS, w4_verdicts.CUDA_VARIANT))
    w4_verdicts.verdicts_changed()
    assert kernel_guard.statically_proven(GPU) == frozenset(w4_verdicts.TRITON_VARIANTS)
    assert not kernel_guard.on_static_list(GPU) and not w4_proof.proven_for(GPU, [WIDE])
    model, _ = tiny_w4_model()
    proved: list = []
    monkeypatch.setattr(w4_proof, "prove", lambda shapes, rows, dtype, device, log=None: proved.append(shapes))
    assert w4_proof.prove_models([model], torch.float16, GPU).source != "static" and proved


def test_auto_keeps_triton_quietly_where_the_cuda_variant_cannot_load(fake_hopper, monkeypatch) -> None:
    """HIERVIZ_W4_CUDA=auto (every weight where proven) on a GPU where the CUDA MMA kernel does not
    load: the Triton variants run, with no warning (nothing was asked for by name)."""
    import warnings
    monkeypatch.setenv("HIERVIZ_W4_CUDA", "auto")
    kernel_guard._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_guard.supported_variants(GPU) == w4_verdicts.TRITON_VARIANTS
