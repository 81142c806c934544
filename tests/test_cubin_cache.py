"""The CUDA W4 kernel's builds kept on disk (hierviz.quant.cubin_cache): a build is compiled once
and read back after, keyed by source, arch and compiler; a damaged file is compiled again; a cache
that cannot be written only warns; a kept build the driver refuses is compiled again once
(cuda_w4.load_entries, with a stand-in driver). Runs on a CPU."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hierviz.quant import cubin_cache, cuda_w4

TINY = 'extern "C" __global__ void hv_tiny(float* y) { y[threadIdx.x] = 1.0f; }\n'


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HIERVIZ_CACHE", str(tmp_path))
    return tmp_path / "cuda-w4"


class Counting:
    """A stand-in compiler that records what it was asked to build."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, arch: str, source: str) -> bytes:
        self.calls.append((arch, source))
        return f"cubin of {arch}:{source}".encode()


def test_a_build_is_compiled_once_and_read_back(cache) -> None:
    compile_fn = Counting()
    first, from_disk = cubin_cache.cubin("sm_90a", "src", "nvrtc 13.0", compile_fn)
    assert not from_disk and compile_fn.calls == [("sm_90a", "src")]
    again, from_disk = cubin_cache.cubin("sm_90a", "src", "nvrtc 13.0", compile_fn)
    assert from_disk and again == first and len(compile_fn.calls) == 1
    assert [p.name.split("-")[0] for p in cache.glob("*.cubin")] == ["sm_90a"]


@pytest.mark.parametrize("other", [("sm_80", "src", "nvrtc 13.0"), ("sm_90a", "src2", "nvrtc 13.0"),
                                   ("sm_90a", "src", "nvrtc 12.9")])
def test_another_source_arch_or_compiler_is_another_build(cache, other) -> None:
    compile_fn = Counting()
    cubin_cache.cubin("sm_90a", "src", "nvrtc 13.0", compile_fn)
    built, from_disk = cubin_cache.cubin(*other, compile_fn)
    assert not from_disk and built == f"cubin of {other[0]}:{other[1]}".encode()
    assert len(list(cache.glob("*.cubin"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_file_is_compiled_again(cache, damage) -> None:
    compile_fn = Counting()
    built, _ = cubin_cache.cubin("sm_90a", "src", "nvrtc 13.0", compile_fn)
    path = cubin_cache.cache_file("sm_90a", "src", "nvrtc 13.0")
    data = path.read_bytes()
    path.write_bytes({"flip": data[:-1] + bytes([data[-1] ^ 1]), "truncate": data[:-3], "empty": b"",
                      "foreign": b"\x7fELF" + data[4:]}[damage])
    with pytest.warns(RuntimeWarning, match="damaged"):
        again, from_disk = cubin_cache.cubin("sm_90a", "src", "nvrtc 13.0", compile_fn)
    assert not from_disk and again == built and len(compile_fn.calls) == 2
    assert cubin_cache.read(path) == built          # written whole again


def test_a_cache_that_cannot_be_written_only_warns(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("HIERVIZ_CACHE", str(blocker))
    compile_fn = Counting()
    with pytest.warns(RuntimeWarning, match="not written"):
        built, from_disk = cubin_cache.cubin("sm_80", "src", "nvrtc 13.0", compile_fn)
    assert built == b"cubin of sm_80:src" and not from_disk


def test_only_the_newest_builds_are_kept(cache) -> None:
    compile_fn = Counting()
    for i in range(cubin_cache.KEEP + 3):
        cubin_cache.cubin("sm_90a", f"src{i}", "nvrtc 13.0", compile_fn)
        path = cubin_cache.cache_file("sm_90a", f"src{i}", "nvrtc 13.0")
        os.utime(path, (time.time() - 100 + i, time.time() - 100 + i))   # distinct write times
    kept = {p.name for p in cache.glob("*.cubin")}
    cubin_cache.prune(cache)
    assert len(kept) == cubin_cache.KEEP
    newest = {cubin_cache.cache_file("sm_90a", f"src{i}", "nvrtc 13.0").name
              for i in range(3, cubin_cache.KEEP + 3)}
    assert {p.name for p in cache.glob("*.cubin")} == newest
    assert not list(cache.glob("*.tmp"))


def test_nvrtc_builds_round_trip_through_the_cache(cache) -> None:
    if cuda_w4.nvrtc_version() is None:
        pytest.skip("NVRTC is not installed (nvidia-cuda-nvrtc-cu12; scripts/setup.sh --test installs it)")
    built, from_disk = cubin_cache.cubin("sm_80", TINY, cuda_w4.compiler_id(), cuda_w4.compile_cubin)
    assert not from_disk and built[:4] == b"\x7fELF"
    again, from_disk = cubin_cache.cubin("sm_80", TINY, cuda_w4.compiler_id(), cuda_w4.compile_cubin)
    assert from_disk and again == built
    assert cuda_w4.compiler_id().startswith(f"nvrtc {cuda_w4.nvrtc_version()} ")


class RefusingDriver:
    """cuModuleLoadData refuses every image but `good`; the other calls succeed."""

    def __init__(self, good: bytes) -> None:
        self.good, self.loaded = good, []
        driver = self

        class Lib:
            @staticmethod
            def cuModuleLoadData(module, image) -> int:
                driver.loaded.append(bytes(image))
                return 0 if bytes(image) == driver.good else 200       # CUDA_ERROR_INVALID_IMAGE

            @staticmethod
            def cuModuleGetFunction(fn, module, name) -> int:
                return 0

            @staticmethod
            def cuFuncSetAttribute(fn, attr, value) -> int:
                return 0
        self.lib = Lib()

    def check(self, res: int, what: str) -> None:
        if res != 0:
            raise RuntimeError(f"{what} failed: {res}")


def test_a_kept_build_the_driver_refuses_is_compiled_again(cache, monkeypatch) -> None:
    source = "the kernel's source"
    cubin_cache.write(cubin_cache.cache_file("sm_80", source, cuda_w4.compiler_id()), b"a stale image")
    driver = RefusingDriver(b"a fresh image")
    monkeypatch.setattr(cuda_w4, "_DRIVER", driver)
    monkeypatch.setattr(cuda_w4, "compile_cubin", lambda arch, src: b"a fresh image")
    found = cuda_w4.load_entries("sm_80", source)
    assert driver.loaded == [b"a stale image", b"a fresh image"]
    assert set(found) == set(cuda_w4.entry_names("sm_80"))
    assert cubin_cache.read(cubin_cache.cache_file("sm_80", source, cuda_w4.compiler_id())) == b"a fresh image"
    # a build compiled in this process that the driver refuses is an error, not a loop
    monkeypatch.setattr(cuda_w4, "compile_cubin", lambda arch, src: b"still refused")
    with pytest.raises(RuntimeError, match="cuModuleLoadData"):
        cuda_w4.load_entries("sm_80", "another source")
