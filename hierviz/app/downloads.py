"""The comparison file the page offers for download after a live run, and the picture of a step a
visitor exports, one of each per visitor.

Each visitor's file lives in its own folder under DOWNLOAD_ROOT; a new run replaces it, a closed
page removes it, and the process keeps at most MAX_KEPT visitors' files (the oldest go first), so
a public app's disk use stays bounded however many visitors come. The folder goes when the
process exits (hierviz/app/tempfiles.py). A recorded trace is offered as its own file, and an
uploaded one not at all (the visitor has it): loading a trace writes nothing.
"""
from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path
from typing import Optional

from hierviz.app.tempfiles import process_folder, remove_at_exit
from hierviz.trace import Trace, save_comparison

DOWNLOAD_ROOT = process_folder("downloads")
MAX_KEPT = 64
STEP_PICTURE_SUFFIX = ".svg"
_lock = threading.Lock()


def _folder(key: str) -> Path:
    return DOWNLOAD_ROOT / (re.sub(r"[^A-Za-z0-9_-]", "_", key)[:64] or "anonymous")


def prepare() -> Path:
    """The download folder, created, and removed when this process exits."""
    DOWNLOAD_ROOT.mkdir(parents=True, exist_ok=True)
    remove_at_exit(DOWNLOAD_ROOT)
    return DOWNLOAD_ROOT


def save(key: str, runs: list[Trace]) -> Optional[str]:
    """Write `runs` as the visitor `key`'s download, replacing their previous one; its path."""
    if not runs:
        return None
    folder = _folder(key)
    methods = "-".join(str(t.meta.get("method")) for t in runs)
    with _lock:
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"hierviz-trace-{methods}.json"
        save_comparison(runs, path)
        _trim()
    return str(path)


def save_step_picture(key: str, name: str, text: str) -> str:
    """Write a picture of one step (`name`, an SVG) beside the visitor `key`'s comparison file,
    replacing their previous picture; its path. A new run's download clears the folder, pictures too."""
    folder = _folder(key)
    with _lock:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"*{STEP_PICTURE_SUFFIX}"):
            old.unlink(missing_ok=True)
        path = folder / name
        # a token may be a lone surrogate (JSON allows one): export.step_svg replaced those already
        path.write_text(text, encoding="utf-8", errors="replace")
        _trim()
    return str(path)


def forget(key: str) -> None:
    """A closed page's download goes."""
    with _lock:
        shutil.rmtree(_folder(key), ignore_errors=True)


def _trim() -> None:
    folders = sorted((p for p in DOWNLOAD_ROOT.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in folders[:-MAX_KEPT]:
        shutil.rmtree(old, ignore_errors=True)

