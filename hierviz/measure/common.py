"""What every measurement tool shares: model shapes by name, the device a run measures on, timing,
outputs (JSON, markdown, optional charts, the recorded command), refusals as `error:` lines,
comma-separated number lists, and runs in a child Python process.

Each tool in hierviz/measure/ is its measurement on top of these; the machine block of every
output is hierviz.machine.machine_info's. torch is imported where a helper needs it, so that the
app's pages can read this module's constants without it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, TypeVar

from hierviz.config import recorded_command

if TYPE_CHECKING:
    import torch

    from hierviz.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "assets" / "configs"
# model shapes by name: their config.json under assets/configs/
SHAPES = {"llama3-8b": "llama3-8b.json", "llama3-70b": "llama3-70b.json", "smollm2": "smollm2-135m.json",
          "vicuna-7b": "vicuna-7b.json", "vicuna-13b": "vicuna-13b.json"}
DTYPE_NAMES = ("float32", "float16", "bfloat16")


class MeasureError(ValueError):
    """A request a tool refuses; the message is fit to show a user."""


# ---- shapes and the device ----------------------------------------------------------------------

def config_path(shape: str) -> Path:
    """The config.json of a shape name (SHAPES), or `shape` itself as a path."""
    return CONFIG_DIR / SHAPES[shape] if shape in SHAPES else Path(shape).expanduser()


def load_shape(shape: str) -> tuple[str, "ModelConfig"]:
    """A preset name (SHAPES) or a path to a config.json: (its name, its config)."""
    from hierviz.models.config import ModelConfig
    p = config_path(shape)
    if shape not in SHAPES and not p.exists():
        raise ValueError(f"unknown shape {shape!r}: not one of {', '.join(SHAPES)} and not a config.json file")
    return (shape if shape in SHAPES else p.stem), ModelConfig.from_file(p)


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device_args(ap: argparse.ArgumentParser, device_default: Optional[str] = None) -> None:
    """--device (cuda or cpu; default `device_default`, None: cuda if available), --dtype and
    --w4-kernel, read back by `environment`."""
    ap.add_argument("--device", default=device_default,
                    help=f"cuda or cpu (default: {device_default or 'cuda if available'})")
    ap.add_argument("--dtype", default=None, choices=list(DTYPE_NAMES), help="default: float16 on CUDA, float32 on CPU")
    ap.add_argument("--w4-kernel", default=None, help="default: triton on CUDA, reference on CPU")


def environment(device: Optional[str], dtype: Optional[str] = None, w4_kernel: Optional[str] = None,
                no_gpu: str = "no CUDA GPU found: use --device cpu") -> tuple[str, "torch.dtype", str]:
    """(device, dtype, W4 kernel) of a run: float16 and the Triton kernel on CUDA, float32 and the
    reference kernel on the CPU, unless given. MeasureError for a device this machine lacks."""
    import torch
    dev = device or default_device()
    if dev not in ("cpu", "cuda"):
        raise MeasureError(f"unknown device {dev!r}; use cuda or cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise MeasureError(no_gpu)
    dtype_name = dtype or ("float16" if dev == "cuda" else "float32")
    return dev, getattr(torch, dtype_name), w4_kernel or ("triton" if dev == "cuda" else "reference")


# ---- timing -------------------------------------------------------------------------------------

def sync(device: Any) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def stopwatch(device: Any, pause_gc: bool = True) -> Iterator[Callable[[], float]]:
    """Times the block, the device synced at both ends; yields a function giving the seconds it
    took. pause_gc: no garbage collection inside (as timeit: a collection pass is host jitter)."""
    sync(device)
    if pause_gc:
        gc.collect()
        gc.disable()
    took: list[float] = []
    t0 = time.perf_counter()
    try:
        yield lambda: took[0]
        sync(device)
        took.append(time.perf_counter() - t0)
    finally:
        if pause_gc:
            gc.enable()


def median_seconds(fn: Callable[[], object], min_s: float, min_reps: int = 3, max_reps: Optional[int] = None) -> float:
    """The median wall time of fn() (after one untimed call): at least min_reps calls, more until
    min_s has passed (at most max_reps)."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_s
    while len(times) < min_reps or (time.perf_counter() < t_end and (max_reps is None or len(times) < max_reps)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- outputs ------------------------------------------------------------------------------------

def stamp(info: dict[str, Any], command: str, argv: Optional[Sequence[str]]) -> dict[str, Any]:
    """`info` with the command line that made it (hierviz.config.recorded_command)."""
    info["command"] = recorded_command(command, argv)
    return info


def write_json(path: Path, data: Any, indent: int = 1) -> Path:
    """`data` as JSON at `path`, its folder made; values JSON lacks (paths, dtypes) as text."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str))
    return path


def write_report(out: Path, stem: str, info: dict[str, Any], md: str) -> None:
    """DIR/<stem>.json and DIR/<stem>.md, the markdown printed."""
    write_json(out / f"{stem}.json", info)
    (out / f"{stem}.md").write_text(md)
    print(md)


def write_chart(path: Path, html: Callable[[], str]) -> bool:
    """html() at `path`; without plotly (optional on a headless machine) a note instead. Written?"""
    try:
        path.write_text(html())
        return True
    except ImportError:
        print(f"note: plotly is not installed; {path.name} skipped", file=sys.stderr)
        return False


def refuse(message: str) -> int:
    """Print `error: message` for the user; the exit code of a refused request (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


T = TypeVar("T")


def run_reporting_errors(work: Callable[[], T], errors: tuple[type[Exception], ...] = (MeasureError,)) -> Optional[T]:
    """work()'s result; None after printing `error: ...` for a refused request or a full GPU."""
    import torch
    try:
        return work()
    except errors as e:
        refuse(str(e))
    except torch.cuda.OutOfMemoryError:
        refuse("the GPU ran out of memory for these shapes")
    return None


# ---- number lists -------------------------------------------------------------------------------

def int_list(text: str, what: str, least: int = 1) -> list[int]:
    """Comma-separated whole numbers, each at least `least`; MeasureError naming `what` otherwise."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MeasureError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not vals or any(v < least for v in vals):
        raise MeasureError(f"{what} must be {'positive' if least == 1 else f'at least {least}'}, got {text!r}")
    return vals


def probabilities(text: str, what: str) -> list[float]:
    """Comma-separated probabilities; MeasureError naming `what` otherwise."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MeasureError(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
        raise MeasureError(f"{what} must be probabilities between 0 and 1, got {text!r}")
    return vals


# ---- child processes ----------------------------------------------------------------------------

class ChildError(RuntimeError):
    """The child printed no JSON result (it failed, or ran out of time)."""


def run_python(args: Sequence[str], timeout: Optional[float] = None, cwd: Optional[Path] = None
               ) -> subprocess.CompletedProcess:
    """`python args...` in a fresh process (in `cwd`, default this one's), with this repository
    importable and its output captured as text. For work that can take its process down (a kernel
    that faults) or must give all its memory back when it ends. subprocess.TimeoutExpired past `timeout`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def error_message(stderr: str) -> Optional[str]:
    """The message of a child's last `error: ...` line (a refused request), else None."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return lines[-1][len("error:"):].strip() if lines else None


def run_json(code: str, *args: str, timeout: float = 900) -> Any:
    """`python -c code args...`: the last stdout line that parses as JSON, whatever the exit code
    after it was printed."""
    try:
        p = run_python(["-c", code, *args], timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise ChildError(f"timed out after {timeout:.0f} s") from None
    for line in reversed(p.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise ChildError(f"the child process failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
