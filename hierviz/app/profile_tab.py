"""The app's Profile tab: forward latency against the number of verified tokens, fp16 vs W4A16.

Shows the curves `python -m hierviz profile` recorded on the H200 (assets/profile/*.json) and, on
a machine with a GPU, measures one decoder layer live on this device, in the server process, in its
turn in the app's device line (hierviz.measure.api.profile_layer)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gradio as gr

from hierviz.app.common import ASSETS
from hierviz.app.guard import VisitorError
from hierviz.app.line import LINE
from hierviz.app.session import session_key
from hierviz.app.stacks import device_kind
from hierviz.viz.profile_fig import profile_figure

PROFILE_DIR = ASSETS / "profile"
LIVE_SHAPES = ("smollm2", "llama3-8b", "llama3-70b")

NO_GPU = "No GPU on this server: measuring needs one, so the chart shows the H200 recording."

EXPLAIN = """**Why HierSpec exists, in one chart.** Each curve is the time of one forward pass against how many
tokens it verifies at once. With **fp16** weights the pass is *memory-bound* — it costs the time to read the
weights — until ~150-200 tokens. **4-bit (W4A16)** weights are 4x smaller, so one token is much cheaper, but
the kernel also unpacks nibbles and the pass turns *compute-bound* far sooner: the orange curve rises after a
few dozen tokens and crosses fp16 (the dotted vertical line). An EAGLE-2 tree of 60 tokens sits right there; a HierSpec sequence of 6-8
tokens stays on the flat part. Both axes are logarithmic: equal heights are equal ratios. The dotted horizontal
lines are each format's bandwidth floor (weight bytes / measured copy bandwidth)."""


def recorded_profiles() -> dict[str, Path]:
    out = {}
    for p in sorted(PROFILE_DIR.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if d.get("schema") == "hierviz.profile/1":
            out[f"{d.get('shape', p.stem)} on {d.get('device', '?')} ({p.name})"] = p
    return out


def show_profile(label: Optional[str], show_comparison: bool = False):
    """(figure, note) of one recorded profile, chosen by its label; `show_comparison` draws the
    comparison kernels' curves too (hierviz.viz.profile_fig.COMPARISON_KERNELS)."""
    files = recorded_profiles()
    if label not in files:
        return gr.update(), "Choose a recorded profile."
    d = json.loads(files[label].read_text())
    return profile_figure(d, bool(show_comparison)), f"Recorded with `{d.get('command', '?')}` — " \
                                                     f"{d.get('device', '?')}, copy bandwidth " \
                                                     f"{d.get('copy_bandwidth_GBps', 0):.0f} GB/s."


def measure_profile(shape: str, request: Optional[gr.Request] = None, show_comparison: bool = False):
    """(figure, note) of one decoder layer of `shape` measured now on this GPU, in its turn on the
    device (hierviz.app.line); a message without one."""
    import torch
    if not torch.cuda.is_available():
        return gr.update(), NO_GPU
    from hierviz.measure.api import profile_layer
    try:
        with LINE.hold(session_key(request)), torch.no_grad():
            d = profile_layer(shape, [1, 2, 4, 8, 16, 32, 64, 128], rep_ms=20.0)
    except VisitorError as e:          # the device line is full
        return gr.update(), str(e)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return gr.update(), "The GPU ran out of memory for this shape; try a smaller one."
    except Exception as e:   # a measurement must never take the app down
        return gr.update(), f"Measurement failed: {type(e).__name__}: {e}"
    return profile_figure(d, show_comparison), f"Measured now on {d['device']} (one decoder layer of {d['shape']})."


def measure_here(shape: str, show_comparison: bool, request: gr.Request):
    """The button's event: the chart, the note under it and the answer beside the button; the
    chart and its note change only when a measurement was made."""
    fig, note = measure_profile(shape, request, bool(show_comparison))
    measured = not isinstance(fig, dict)       # gr.update() is a dict: nothing measured
    return fig, (note if measured else gr.update()), note


def profile_tab() -> None:
    files = recorded_profiles()
    labels = list(files)
    first: Optional[str] = next((l for l in labels if "70b" in l), labels[0] if labels else None)
    fig, text = show_profile(first) if first else (None, "No recorded profile is shipped.")
    gpu = device_kind() == "cuda"
    with gr.Row():
        with gr.Column(scale=3):
            plot = gr.Plot(label="forward latency vs verified tokens", value=fig, elem_id="hv-profile-plot")
            note = gr.Markdown(text)
        with gr.Column(scale=2):
            gr.Markdown(EXPLAIN, elem_classes=["hv-teach"])
            choice = gr.Dropdown(labels, value=first, label="recorded profile")
            comparison = gr.Checkbox(False, label="Also show torch's tinygemm W4 kernel (far slower: it turns "
                                                  "compute-bound after a few tokens)", elem_id="hv-profile-tinygemm")
            shape = gr.Dropdown(list(LIVE_SHAPES), value="llama3-8b", label="measure one layer on this GPU",
                                interactive=gpu)
            go_btn = gr.Button("Measure on this device", interactive=gpu, elem_id="hv-profile-measure")
            # the answer, or why there is none, right under the button
            answer = gr.Markdown("" if gpu else NO_GPU, elem_id="hv-profile-answer")
    choice.change(show_profile, [choice, comparison], [plot, note], api_visibility="private")
    # the toggle redraws the recorded profile chosen (a measurement is made again with the toggle as set)
    comparison.input(show_profile, [choice, comparison], [plot, note], api_visibility="private")
    go_btn.click(measure_here, [shape, comparison], [plot, note, answer], concurrency_id="gpu", concurrency_limit=1,
                 api_visibility="private")
