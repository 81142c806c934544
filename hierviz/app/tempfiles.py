"""The app's folders under the system temp folder: one per process and kind, removed at exit, and
those of processes that died without removing theirs (killed, crashed) removed at the next start.

    hierviz-downloads-<pid>   the comparison files the page offers (hierviz/app/downloads.py)
    hierviz-gradio-<pid>      Gradio's cache (uploads), unless the operator set GRADIO_TEMP_DIR

A folder is only ever removed when its name is exactly one of these and its process is gone.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

KINDS = ("downloads", "gradio")
_NAME = re.compile(rf"hierviz-({'|'.join(KINDS)})-(\d+)")
_registered: set[Path] = set()


def process_folder(kind: str, pid: int | None = None) -> Path:
    """This process's folder of `kind` (not created here)."""
    assert kind in KINDS, kind
    return Path(tempfile.gettempdir()) / f"hierviz-{kind}-{os.getpid() if pid is None else pid}"


def remove_at_exit(folder: Path) -> None:
    if folder not in _registered:
        _registered.add(folder)
        atexit.register(shutil.rmtree, folder, True)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # another user's process
        return True
    return True


def sweep_dead() -> list[Path]:
    """Remove the folders of processes that are gone; the folders removed."""
    removed = []
    for p in Path(tempfile.gettempdir()).glob("hierviz-*-*"):
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink() and not is_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def use_own_gradio_cache() -> None:
    """Point Gradio's cache at this process's folder (before Gradio makes its first component), so
    that it goes with the process; an operator's GRADIO_TEMP_DIR is left as it is."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return
    folder = process_folder("gradio")
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    remove_at_exit(folder)
