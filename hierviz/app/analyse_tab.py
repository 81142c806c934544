"""The Analyse tab: whole-run views of a recorded or uploaded trace, or of two side by side.

Trace A is an uploaded file or, without one, the chosen recorded trace; trace B, optional, is chosen
the same way (an upload, else a recorded trace) and overlaid on A, with a column per run in the
table. Uploads are read by the visualizer's loader (handlers.read_upload: the same checks and size
limits), recorded traces only from the shipped list, so the page never makes the server read a path
a visitor chose. The CSV and HTML downloads are written to this visitor's own
folder under the app's download folder (hierviz/app/downloads.py).
"""
from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

import gradio as gr

from hierviz.app import downloads
from hierviz.app.common import status_html
from hierviz.app.fields import NumberField, TraceUpload
from hierviz.app.guard import log_refusal, redact_paths
from hierviz.app.handlers import read_upload, sorted_runs
from hierviz.app.session import session_key
from hierviz.app.shipped import shipped_runs, shipped_traces
from hierviz.trace import MAX_TRACE_BYTES, Trace, TraceError
from hierviz.viz.export import replay_html, step_svg
from hierviz.viz.run_figs import (Series, comparison_html, depth_figure, position_figure, series_of, steps_csv,
                                  summary_csv, tau_figure, worst_rejections)

EXPLAIN = """**Analyse a whole run.** τ per step is how many tokens each target pass produced; the depth chart
shows how often the drafts were accepted at each depth, counted over the run so far. *Worst rejections* lists
the steps that threw the most drafted tokens away: open them in the Visualizer with the step slider. Upload a
second trace (B), recorded or uploaded, to overlay it on the first (A), e.g. two drafter heads on the same
prompt, or the H200 run against the CPU one. Upload your own deployment's acceptance (a vLLM `/metrics` scrape or
per-request metrics, SGLang `meta_info`, Spec-Bench, EAGLE or SpecMQuant answers) to set it beside the run's, position
by position."""

UPLOADS_AT_ONCE = 4
NO_TRACE_B = "none (A only)"
# the files the tab offers, in the order of its download buttons
DOWNLOADS = ("hierviz-steps.csv", "hierviz-summary.csv", "hierviz-replay.html", "hierviz-step.svg")
WORST_HEADERS = ["run", "step", "thrown away", "what happened"]
# the downloads of this tab live beside the visualizer's, one folder per visitor, at most this many
FOLDER_PREFIX = "analyse-"
MAX_KEPT = downloads.MAX_KEPT
_lock = threading.Lock()


# ---- reading the traces ------------------------------------------------------------------------

def read_as(which: str, upload: str) -> list[Trace]:
    """An uploaded trace file's runs; its errors say which of the two files failed."""
    try:
        return read_upload(upload)
    except (TraceError, OSError) as e:
        raise TraceError(f"trace {which} ({Path(upload).name}): {e}") from None


def chosen_runs(which: str, shipped_path: Optional[str], upload: Optional[str]) -> tuple[str, list[Trace]]:
    """(name, runs) of trace `which` (A or B): the upload if there is one, else the chosen recorded
    trace (only those listed are read: the browser sends a path)."""
    if upload:
        return Path(upload).name, read_as(which, upload)
    if not shipped_path or shipped_path not in {p for _, p in shipped_traces()}:
        raise TraceError(f"trace {which}: pick one of the recorded traces or upload a trace file")
    return Path(shipped_path).name, shipped_runs(shipped_path)


def load_series(shipped_path: Optional[str], upload_a: Optional[str], upload_b: Optional[str],
                shipped_b: Optional[str] = None) -> tuple[str, list[Series]]:
    """(what was loaded, the series to show); TraceError or OSError with a message for the visitor.
    B is optional: an upload, else a recorded trace, else none."""
    name_a, runs_a = chosen_runs("A", shipped_path, upload_a)
    if not upload_b and not shipped_b:
        return name_a, series_of(sorted_runs(runs_a))
    name_b, runs_b = chosen_runs("B", shipped_b, upload_b)
    return (f"A = {name_a}, B = {name_b}",
            series_of(sorted_runs(runs_a), "A: ") + series_of(sorted_runs(runs_b), "B: "))


# ---- downloads ---------------------------------------------------------------------------------

def visitor_folder(key: str) -> Path:
    return downloads.DOWNLOAD_ROOT / (FOLDER_PREFIX + (re.sub(r"[^A-Za-z0-9_-]", "_", key)[:64] or "anonymous"))


def save_files(key: str, files: dict[str, str]) -> dict[str, str]:
    """Write `files` (name -> text) as the visitor `key`'s downloads, replacing their previous ones; the
    paths by name. Only the newest MAX_KEPT visitors' folders are kept, so disk use stays bounded."""
    folder = visitor_folder(key)
    with _lock:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        out = {}
        for name, text in files.items():
            # a token may be a lone surrogate (JSON allows one); it becomes "?" rather than a failed write
            (folder / name).write_text(text, encoding="utf-8", errors="replace")
            out[name] = str(folder / name)
        mine = sorted((p for p in downloads.DOWNLOAD_ROOT.glob(FOLDER_PREFIX + "*") if p.is_dir()),
                      key=lambda p: p.stat().st_mtime)
        for old in mine[:-MAX_KEPT]:
            shutil.rmtree(old, ignore_errors=True)
    return out


def export_step(series: list[Series], step: Any) -> int:
    """The 0-based step of the first run to export as SVG: the visitor's step number (from 1), kept
    within the run; the first step for anything that is not a number."""
    try:
        number = int(float(step))
    except (TypeError, ValueError, OverflowError):
        number = 1
    return max(0, min(number, len(series[0].trace.steps)) - 1)


def download_files(series: list[Series], step: int) -> dict[str, str]:
    """The files a visitor can take away; the replay and the step picture are of the first run shown
    (A's, HierSpec first)."""
    first = series[0]
    return {"hierviz-steps.csv": steps_csv(series), "hierviz-summary.csv": summary_csv(series),
            "hierviz-replay.html": replay_html(first.trace, f"hierviz replay: {first.label}"),
            "hierviz-step.svg": step_svg(first.trace, step)}


# ---- the handler -------------------------------------------------------------------------------

def worst_rows(series: list[Series]) -> list[list[Any]]:
    return [[r.method, r.step + 1, r.rejected, r.description] for r in worst_rejections(series)]


def failed(message: str) -> tuple:
    """The outputs of a failed load: the message, and no chart, table or download of the trace
    shown before, which the message is not about."""
    log_refusal("analyse", message)
    return (status_html(message, "error"), None, None, "", None,
            *(gr.update(value=None, interactive=False) for _ in DOWNLOADS), None)


def read_acceptance(upload: str):
    """A visitor's acceptance file (any format hierviz.measure.acceptance_import reads), no larger
    than a trace upload; AcceptanceFileError with a message for the visitor."""
    from hierviz.measure.api import AcceptanceFileError, read_acceptance_file
    path = Path(upload)
    if path.stat().st_size > MAX_TRACE_BYTES:
        raise AcceptanceFileError(f"acceptance file is over {MAX_TRACE_BYTES // 2**20} MB")
    try:
        return read_acceptance_file(path)
    except AcceptanceFileError as e:
        raise AcceptanceFileError(f"acceptance file {path.name}: {e}") from None


def acceptance_note(imp) -> str:
    """One line on an imported acceptance, with its engine's own definition."""
    return (f" Your acceptance ({imp.source_format}): {imp.steps} verification steps, "
            f"{imp.mean_accepted_length:.2f} draft tokens accepted per step. {imp.definition}")


def analyse(shipped_path: Optional[str], upload_a: Optional[str], upload_b: Optional[str], step: Any = 1,
            shipped_b: Optional[str] = None, acceptance_upload: Optional[str] = None,
            request: Optional[gr.Request] = None) -> tuple:
    """(status, tau figure, depth figure, comparison table, worst rejections, the DOWNLOADS, then the
    per-position figure) for trace A, and B (uploaded or recorded) overlaid when given; `step` is the
    step of A's first run to export as SVG; `acceptance_upload`, a deployment's acceptance file, goes
    beside the runs' own per-position acceptance."""
    from hierviz.measure.api import AcceptanceFileError
    try:
        name, series = load_series(shipped_path, upload_a, upload_b, shipped_b)
        imported = read_acceptance(acceptance_upload) if acceptance_upload else None
    except (TraceError, OSError, AcceptanceFileError) as e:
        return failed(redact_paths(f"Could not analyse: {e}"))
    # the replay and the step picture show the first run: it needs a step (a trace may have none)
    if not series or not series[0].trace.steps:
        return failed(f"{name} has no steps to analyse.")
    paths = save_files(session_key(request), download_files(series, export_step(series, step)))
    note = acceptance_note(imported) if imported else ""
    yours = (f"yours ({imported.source_format})", list(imported.rates)) if imported and imported.rates else None
    view = charts(series, yours)
    return (status_html(f"Analysed {name}: " + ", ".join(s.label for s in series) + "." + note, "ok"),
            view["tau"], view["depth"], view["table"], view["worst"],
            # an update, not a new component: Gradio resolves the path when it sends the event's outputs,
            # and serves it from the download folder (a static path) without copying it
            *(gr.update(value=paths[n], interactive=True)
              for n in DOWNLOADS),
            view["position"])


def charts(series: list[Series], yours: Optional[tuple[str, list[float]]] = None) -> dict[str, Any]:
    """The tab's figures and tables for `series` (yours: a deployment's per-position acceptance)."""
    return {"tau": tau_figure(series), "depth": depth_figure(series), "table": comparison_html(series),
            "worst": worst_rows(series), "position": position_figure(series, yours)}


# ---- the tab -----------------------------------------------------------------------------------

def opening_view(shipped_path: Optional[str]) -> dict[str, Any]:
    """The charts, table and status the tab opens with: the preselected recorded trace, drawn once
    when the app is built (no visitor's files; its downloads come with Analyse)."""
    empty = {"status": status_html("Pick a recorded trace or upload one, then press Analyse."),
             "tau": None, "depth": None, "position": None, "table": "", "worst": None}
    if not shipped_path:
        return empty
    try:
        name, series = load_series(shipped_path, None, None)
    except (TraceError, OSError):
        return empty
    if not series or not series[0].trace.steps:
        return empty
    return {"status": status_html(f"Showing {name}: " + ", ".join(s.label for s in series)
                                  + ". Press Analyse for its downloads, or pick or upload another.", "ok"),
            **charts(series)}


def analyse_tab() -> None:
    shipped = shipped_traces()
    first = shipped[0][1] if shipped else None
    opening = opening_view(first)
    with gr.Row():
        with gr.Column(scale=2):
            gr.Markdown(EXPLAIN, elem_classes=["hv-teach"])
            choice = gr.Dropdown(shipped, value=first, label="recorded trace (A)")
            # any file is taken and answered in the status box under Analyse: a type Gradio
            # refused would be a toast beside it
            upload_a = TraceUpload(label=f"…or upload a trace JSON as A (max {MAX_TRACE_BYTES // 2**20} MB)",
                                   type="filepath")
            # B: none, a recorded trace, or an upload (which wins, as for A)
            choice_b = gr.Dropdown([(NO_TRACE_B, ""), *shipped], value="",
                                   label="optional: a second trace (B) to compare")
            upload_b = TraceUpload(label="…or upload a trace JSON as B", type="filepath")
            acceptance_up = TraceUpload(label="optional: your deployment's acceptance (vLLM /metrics, SGLang, "
                                              "Spec-Bench, EAGLE or SpecMQuant file)",
                                        type="filepath")
            go_btn = gr.Button("Analyse", variant="primary")
            status = gr.HTML(opening["status"])
            steps_btn = gr.DownloadButton("Per-step CSV", value=None, interactive=False)
            summary_btn = gr.DownloadButton("Summary CSV", value=None, interactive=False)
            replay_btn = gr.DownloadButton("HTML replay (first run, works offline)", value=None, interactive=False)
            step_no = NumberField(1, label="step of the first run to export as a picture", precision=0, minimum=1)
            svg_btn = gr.DownloadButton("Step as SVG", value=None, interactive=False)
        with gr.Column(scale=3):
            tau_plot = gr.Plot(opening["tau"], label="τ per step")
            depth_plot = gr.Plot(opening["depth"], label="acceptance by depth")
            position_plot = gr.Plot(opening["position"], label="acceptance per draft position, this run beside yours")
            table = gr.HTML(opening["table"])
            worst = gr.Dataframe(opening["worst"], headers=WORST_HEADERS, label="worst rejections", interactive=False, wrap=True,
                                 column_widths=["14%", "8%", "10%", "68%"])
    outputs = [status, tau_plot, depth_plot, table, worst, steps_btn, summary_btn, replay_btn, svg_btn, position_plot]
    # reading an upload takes a few times its size in memory for a moment: a few at a time
    go_btn.click(analyse, [choice, upload_a, upload_b, step_no, choice_b, acceptance_up], outputs, api_visibility="private",
                 concurrency_id="analyse", concurrency_limit=UPLOADS_AT_ONCE)
