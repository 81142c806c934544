"""The Visualizer's export of the inspected step for slides: one standalone SVG, named after the run
and step, that needs nothing from the network, with EAGLE-2's step beside it when the side-by-side
view is on (driven through the handlers on the shipped tiny-random trace)."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from hierviz.app import downloads
from hierviz.app import handlers as h
from hierviz.app.session import Session
from hierviz.app.shipped import shipped_runs, shipped_traces

VISITOR = SimpleNamespace(session_hash="export-visitor")
# a namespace name is an identifier, not a fetch; anything else that names a place outside the file is
EXTERNAL = re.compile(r"https?://(?!www\.w3\.org/)|url\(|@import|src=|href=")


@pytest.fixture
def download_root(tmp_path, monkeypatch):
    monkeypatch.setattr(downloads, "DOWNLOAD_ROOT", tmp_path)
    return tmp_path


def tiny_session() -> Session:
    path = next(p for _, p in shipped_traces() if "tiny-random" in p)
    return Session(runs=h.sorted_runs(shipped_runs(path)))


def exported(sess: Session) -> tuple[str, Path]:
    status, button = h.export_step(sess, VISITOR)
    return status, Path(button["value"])


def test_the_inspected_step_exports_as_one_self_contained_svg(download_root) -> None:
    sess = tiny_session()
    h.scrub(sess, 5)
    status, path = exported(sess)
    assert "hv-status-ok" in status and "Exported step 5 of HierSpec" in status
    assert path.name == "hierviz-hierspec-step-5.svg" and path.is_relative_to(download_root)
    svg = path.read_text(encoding="utf-8")
    root = ET.fromstring(svg)                       # well-formed: a browser shows nothing of a broken one
    assert root.tag.endswith("svg") and root.get("width") == "960"
    assert "Step 5 of 11 · HierSpec" in svg and not EXTERNAL.search(svg)
    assert "M accepted a path of" in svg and "Target T's verdict" in svg and "Output:" in svg
    assert "T accepted a path of" not in svg         # EAGLE-2's tree only when asked for


def test_side_by_side_puts_eagle2s_step_in_the_picture_and_a_new_export_replaces_the_old(download_root) -> None:
    sess = tiny_session()
    first = exported(sess)[1]                       # the latest step, on its own
    h.set_side_by_side(sess, True)
    h.next_step(sess, 2)
    status, path = exported(sess)
    assert path.name == "hierviz-hierspec-step-3.svg" and not first.exists()
    svg = path.read_text(encoding="utf-8")
    root = ET.fromstring(svg)
    assert root.get("width") == "1280" and not EXTERNAL.search(svg)
    assert "M accepted a path of" in svg and "T accepted a path of" in svg and "EAGLE-2</b>, step" in svg
    h.switch_view(sess, "ar")                       # AR has no pair: its step on its own
    assert exported(sess)[1].name.startswith("hierviz-ar-step-")


def test_nothing_to_export_is_a_message(download_root) -> None:
    status, button = h.export_step(Session(), VISITOR)
    assert "hv-status-error" in status and "Nothing to export" in status and button["value"] is None
    assert list(download_root.iterdir()) == []
