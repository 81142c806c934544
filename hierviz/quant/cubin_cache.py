"""Compiled CUDA code kept on disk, so that a process loads the W4 kernel's CUBIN instead of
compiling it again with NVRTC (10-20 s a build, single-threaded: docs/kernels.md).

A file is keyed by everything the bytes depend on: the source text, the target arch, the
compiler's options and NVRTC's version. It lives under `options().cache_dir / "cuda-w4"` and holds
a magic tag, the SHA-256 of the CUBIN and the CUBIN, so a torn or damaged file is seen and
compiled again (with a warning) rather than handed to the driver. Writes are atomic; a cache that
cannot be written only warns, the compiled bytes still serve the process. The newest KEEP files
stay, older ones (other sources, other versions) are removed after each write."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

from hierviz.config import options

MAGIC = b"HVCUBIN1"
KEEP = 8            # builds kept: the shipped one per arch, and a few a benchmark script builds


def cache_dir() -> Path:
    return options().cache_dir / "cuda-w4"


def cache_file(arch: str, source: str, compiler: str) -> Path:
    """The file of one build: `compiler` names the compiler and its options (version included)."""
    key = json.dumps({"arch": arch, "compiler": compiler, "source": source}, sort_keys=True)
    return cache_dir() / f"{arch}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.cubin"


def read(path: Path) -> bytes | None:
    """The CUBIN a file holds, or None where there is none or it fails its checksum (warned)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):      # none yet, or a cache folder that cannot be (write warns)
        return None
    except OSError as e:
        warnings.warn(f"CUDA kernel cache {path} not read: {e}", RuntimeWarning, stacklevel=3)
        return None
    head, digest, cubin = data[:len(MAGIC)], data[len(MAGIC):len(MAGIC) + 32], data[len(MAGIC) + 32:]
    if head != MAGIC or hashlib.sha256(cubin).digest() != digest or not cubin:
        warnings.warn(f"CUDA kernel cache {path} is damaged: compiling again", RuntimeWarning, stacklevel=3)
        return None
    return cubin


def write(path: Path, cubin: bytes) -> None:
    """Atomically (a reader never sees half a file); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(cubin).digest() + cubin)
        os.replace(tmp, path)
        prune(path.parent)
    except OSError as e:
        warnings.warn(f"CUDA kernel cache {path} not written: {e}", RuntimeWarning, stacklevel=3)


def prune(folder: Path, keep: int = KEEP) -> None:
    """Remove all but the `keep` most recently written builds."""
    files = sorted(folder.glob("*.cubin"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in files[keep:]:
        stale.unlink(missing_ok=True)


def cubin(arch: str, source: str, compiler: str, compile_fn: Callable[[str, str], bytes]) -> tuple[bytes, bool]:
    """(CUBIN, whether it came from disk): the cached build of `source` for arch, else
    compile_fn(arch, source), written to the cache."""
    path = cache_file(arch, source, compiler)
    found = read(path)
    if found is not None:
        return found, True
    built = compile_fn(arch, source)
    write(path, built)
    return built, False


def forget(arch: str, source: str, compiler: str) -> None:
    """Drop a build the driver refused, so that the next load compiles it."""
    cache_file(arch, source, compiler).unlink(missing_ok=True)
