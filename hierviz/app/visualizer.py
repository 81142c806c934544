"""The Visualizer tab: its components (run panel on the left, live view on the right) and their events.

The components are collected in a dict by name; hierviz.app.handlers names each event's inputs and
outputs the same way, so the wiring here is only "this event, these names, that handler". The
inputs a visitor can send anything to through the API are hierviz.app.fields' components.
"""
from __future__ import annotations

from typing import Any, Iterable

import gradio as gr

from hierviz.app import handlers as h
from hierviz.app.common import status_html
from hierviz.app.fields import NumberField, SliderField, TraceUpload
from hierviz.app.live import run_live
from hierviz.app.notes import NOTES, setting_notes
from hierviz.app.pacing import RENDERED_JS, TREE_PAINTED_JS
from hierviz.app.session import SESSION_TTL_S, Session
from hierviz.app.shipped import example_prompts, shipped_traces
from hierviz.app.guard import caps
from hierviz.app.stacks import default_stack, device_kind, stack_choices
from hierviz.config import options
from hierviz.settings import default_settings
from hierviz.trace import MAX_TRACE_BYTES
from hierviz.retime import MEASURED, TIME_SCALES
from hierviz.viz.crossover import crossover_figure
from hierviz.viz.panels import (legend_html, output_html, sequence_html, stats_html, tree_key_html, tree_key_line,
                                verdict_html)

Components = dict[str, Any]

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
UPLOADS_AT_ONCE = 4      # uploads parsed at once (a large one takes a few times its size for a moment)

TEACH = {
    "tree": """**1 · Draft tree.** A tiny EAGLE head (E_M) guesses many continuations at once: each column
is one token further ahead. The intermediate model **M** checks the whole tree in one pass and keeps
the longest branch that matches its own choices.

{tree_key}

The top row is the text M proposes. Hover a token for its probability. In the EAGLE-2 run the
picture is the same, but E_T drafts and the big target T checks the tree itself.""",
    "seq": """**2 · Sequence draft → 3 · Target verdict.** M joins its accepted branches and bonus tokens
into one line of at least *min draft length* tokens. The big 4-bit target **T** checks only this short
line, not a 30-60-token tree: 4-bit weights are cheap to read, but checking many tokens at once is not.

T keeps the line up to its first disagreement (✗) and drops the rest. It always adds one token of its
own (orange): a correction, or a bonus if all passed. The result is exactly what T alone would write.""",
    "output": """**4 · Output.** Each token is tinted by who proposed it; the outlined part is the step you
inspect. Hover for the step number.""",
    "latency": """**5 · Where the time goes.** Top: the inspected step, split by stage. Bottom: the race - how long
each method needed for the same number of tokens. EAGLE-2 makes T verify a big tree; HierSpec hands that
job to the smaller M and gives T a short line.""",
    "stats": """**6 · τ (tau)** = tokens gained per verification. *τ target*: output tokens per forward pass of T
(plain decoding: 1). *τ intermediate*: tokens per tree M checks (accepted branch + bonus). Higher τ,
fewer expensive passes. *Accepted at depth d*: how often a tree's accepted branch reached depth d,
given it reached d-1.""",
}


TEACH["tree"] = TEACH["tree"].replace("{tree_key}", tree_key_html())


def teach(key: str) -> None:
    gr.Markdown(TEACH[key], elem_classes=["hv-teach"])


def pick(ui: Components, names: Iterable[str]) -> list:
    """The components of these names, in this order (an event's inputs or outputs)."""
    return [ui[n] for n in names]


def visualizer_tab(stack_default: str | None = None) -> Components:
    """Build the tab inside the current gr.Tab and wire its events; its components by name."""
    # an idle visitor's state (their runs) is dropped after SESSION_TTL_S; API clients never close
    # a page, so without it every one of them would stay in memory
    ui: Components = {"session": gr.State(Session(), time_to_live=SESSION_TTL_S)}
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=320, elem_classes=["hv-side"]):
            run_panel(ui, stack_default)
        with gr.Column(scale=4, min_width=300, elem_classes=["hv-live"]):
            live_view(ui)
    play = wire_replay(ui)
    wire_run(ui, play)
    wire_inspect(ui, play)
    wire_loads(ui, play)
    wire_notes(ui)
    return ui


def run_panel(ui: Components, stack_default: str | None) -> None:
    ui["prompt"] = gr.Textbox(label="Prompt", lines=3, elem_id="hv-prompt", value=DEFAULT_PROMPT,
                              placeholder="Ask the model something…")
    prompts = example_prompts()
    if prompts:
        with gr.Column(elem_id="hv-examples"):
            gr.Examples(prompts, inputs=[ui["prompt"]], label="Example prompts")
    with gr.Row(elem_id="hv-run-row"):
        ui["run_btn"] = gr.Button("Run", variant="primary", elem_id="hv-run")
        ui["stop_btn"] = gr.Button("Stop", variant="stop", elem_id="hv-stop")
    ui["status"] = gr.HTML(status_html("Ready. Press Run, or load a recorded trace below."), elem_id="hv-status")
    # on by default from layout.PRESENT_FROM_PX wide (the page's load event sets it); its change sets the class
    ui["present"] = gr.Checkbox(False, label="Presentation layout", container=False, elem_id="hv-present")
    with gr.Accordion("Settings", open=False, elem_id="hv-settings"):
        settings_panel(ui, stack_default)
    with gr.Accordion("Recorded traces", open=True, elem_id="hv-traces"):
        replay_panel(ui)
    ui["download"] = gr.DownloadButton("Download trace JSON", value=None, interactive=False, elem_id="hv-download")
    ui["export_step"] = gr.Button("Download the inspected step (SVG, for slides)", elem_id="hv-export-step")
    # the file's button stays out of sight: the export writes the file, then the page clicks it
    ui["step_svg"] = gr.DownloadButton("Step picture", value=None, visible="hidden", elem_id="hv-step-svg")


def settings_panel(ui: Components, stack_default: str | None) -> None:
    """The stack and every DecodeSettings field the page offers, starting from this machine's defaults."""
    ui["stack"] = gr.Dropdown(stack_choices(), value=stack_default or default_stack(), label="Model stack",
                              allow_custom_value=options().allow_custom_stacks, elem_id="hv-stack",
                              info="Target T (4-bit), intermediate M and EAGLE heads")
    d = default_settings()   # this machine's: small trees on a CPU (settings.CPU_TREES)
    most = caps(device_kind())["max_new_tokens"]
    ui["max_new"] = SliderField(1, most, value=min(d.max_new_tokens, most), step=1, label="Max new tokens",
                                elem_id="hv-max-new")
    ui["temperature"] = SliderField(0.0, 2.0, value=d.temperature, step=0.05, label="Temperature (0 = greedy)")
    ui["run_note"] = gr.HTML("", elem_id="hv-run-note", padding=False)   # under the settings it is about (notes)
    gr.Markdown("**HierSpec: E_M tree, checked by M**")
    tree_controls(ui, "m", (d.m_depth, d.m_topk, d.m_tree_size))
    ui["m_note"] = gr.HTML("", elem_id="hv-m-note", padding=False)
    ui["min_draft"] = SliderField(1, 32, value=d.min_draft_len, step=1, label="Min sequence-draft length for T")
    gr.Markdown("**EAGLE-2 baseline: E_T tree, checked by T**")
    tree_controls(ui, "t", (d.t_depth, d.t_topk, d.t_tree_size))
    ui["t_note"] = gr.HTML("", elem_id="hv-t-note", padding=False)
    ui["with_ar"] = gr.Checkbox(True, label="Also run plain autoregressive decoding (for the speedup)",
                                elem_id="hv-with-ar")


def tree_controls(ui: Components, prefix: str, values: tuple[int, int, int]) -> None:
    """Depth, top-k and size of one tree (prefix "m": E_M's, "t": E_T's). No rounding here
    (precision None): a fraction is refused by DecodeSettings.validate like any other setting's."""
    with gr.Row():
        for key, label, value in zip(("depth", "topk", "size"), ("depth", "top-k", "size"), values):
            ui[f"{prefix}_{key}"] = NumberField(value, label=label, precision=None, step=1,
                                                elem_id=f"hv-{prefix}-{key}")


def replay_panel(ui: Components) -> None:
    """Which recorded trace is on screen: choosing one loads it, an upload loads at once too."""
    shipped = shipped_traces()
    ui["trace_pick"] = gr.Dropdown(shipped, value=shipped[0][1] if shipped else None, label="Recorded traces",
                                   elem_id="hv-trace-pick")
    # any file is taken and the app answers it under the upload: a type Gradio refused would be a toast
    ui["upload"] = TraceUpload(label=f"…or upload a trace JSON (max {MAX_TRACE_BYTES // 2**20} MB)",
                               type="filepath", elem_id="hv-upload")
    ui["trace_note"] = gr.HTML("", elem_id="hv-trace-note", padding=False)


def replay_controls(ui: Components) -> None:
    """Step back, play, pause, step on, the speed and the side-by-side view, right above the tree
    they move."""
    with gr.Row(elem_classes=["hv-replay"], equal_height=True):
        ui["prev_btn"] = gr.Button("◀ Step", size="sm", min_width=70, elem_id="hv-prev")
        ui["play_btn"] = gr.Button("▶ Play", size="sm", min_width=70, elem_id="hv-play")
        ui["pause_btn"] = gr.Button("❚❚ Pause", size="sm", min_width=70, elem_id="hv-pause")
        ui["next_btn"] = gr.Button("Step ▶", size="sm", min_width=70, elem_id="hv-next")
        # a compact slider (no box, so no label of its own): the words before it say what it sets
        gr.HTML('<span class="hv-speed-label">Replay speed<br> (steps / s)</span>', min_width=90, scale=0,
                elem_classes=["hv-speed-cap"])
        ui["speed"] = gr.Slider(h.MIN_SPEED, h.MAX_SPEED, value=3, step=0.1, label="Replay speed (steps per second)",
                                min_width=200, container=False, elem_id="hv-speed")
        ui["side_by_side"] = gr.Checkbox(False, label="Side by side with EAGLE-2", min_width=150, container=False,
                                         elem_id="hv-side-by-side-on")


# filled in by the page (layout.PAGE_JS) when trees lie past the edge of the tree's box
TREE_CUE = '<p id="hv-tree-cue" class="hv-scroll-cue" hidden></p>'

KEYS_HELP = ('<p class="hv-keys-text">Keys (outside text fields): <kbd>[</kbd> or <kbd>←</kbd> previous step, '
             '<kbd>]</kbd> or <kbd>→</kbd> next step, <kbd>k</kbd> play / pause.</p>')


def live_view(ui: Components) -> None:
    """The run chooser, the step slider, the replay controls and the six panels, each with its
    teaching note (hidden in the presentation layout)."""
    ui["headline"] = gr.HTML("", elem_id="hv-headline")       # the whole comparison, on the first screen
    gr.HTML(legend_html(), elem_classes=["hv-legend-block"])
    with gr.Row(elem_classes=["hv-scrub"]):
        ui["view"] = gr.Radio([], label="Inspect run", scale=2, elem_id="hv-view")
        ui["step"] = SliderField(1, 2, value=1, step=1, label="Step", scale=5, interactive=False, elem_id="hv-step")
    replay_controls(ui)
    # the inspected step beside the other method's at the same token count; shown when asked for, in
    # the place of the tree and sequence panels (assets/app.css hides those while it is shown)
    ui["side"] = gr.HTML("", visible=False, elem_id="hv-side-by-side", elem_classes=["hv-scroll"])
    with gr.Row(equal_height=False, elem_classes=["hv-tree-row"]):
        with gr.Column(scale=3, min_width=300, elem_classes=["hv-tree-col"]):
            # the key above the tree's box and the scroll cue over its corner stay in view however the tree scrolls
            gr.HTML(tree_key_line(), elem_id="hv-tree-head")
            ui["tree"] = gr.Plot(label="Draft tree(s)", show_label=False, elem_id="hv-tree", elem_classes=["hv-tree"])
            gr.HTML(TREE_CUE, elem_classes=["hv-cue-block"])
        with gr.Column(scale=1, min_width=260, elem_classes=["hv-teach-col"]):
            gr.HTML(KEYS_HELP, elem_classes=["hv-keys"])      # beside the tree the keys move
            teach("tree")
    with gr.Row(equal_height=False, elem_classes=["hv-seq-row"]):
        with gr.Column(scale=3, min_width=300):
            ui["seq"] = gr.HTML(sequence_html(None), elem_id="hv-seq", elem_classes=["hv-scroll"])
            ui["verdict"] = gr.HTML(verdict_html(None), elem_id="hv-verdict", elem_classes=["hv-scroll"])
            ui["output"] = gr.HTML(output_html(None), elem_id="hv-output")
        with gr.Column(scale=1, min_width=260, elem_classes=["hv-teach-col"]):
            teach("seq")
            teach("output")
    with gr.Row(equal_height=False, elem_classes=["hv-lat-row"]):
        with gr.Column(scale=1, min_width=300):
            ui["latency"] = gr.Plot(label="Latency per stage", elem_id="hv-latency", elem_classes=["hv-scroll"])
            teach("latency")
        with gr.Column(scale=1, min_width=300):
            ui["time_scale"] = gr.Radio(list(TIME_SCALES), value=MEASURED, label="Time scale", elem_id="hv-time-scale",
                                        info="re-timed: the same tokens and decisions, each stage priced at "
                                             "Llama-3-70B / 8B W4A16 costs measured on an H200 (projected)")
            ui["stats"] = gr.HTML(stats_html([]), elem_id="hv-stats")
            teach("stats")
    ui["crossover"] = gr.Plot(crossover_figure([]), label="Where this run sits (projected)", elem_id="hv-crossover")


def wire_run(ui: Components, play: Any) -> None:
    """Run (button or Enter in the prompt), Stop, and the page's drawn-update reports. Run is
    disabled while the run is in flight, so a second click cannot vanish silently; it comes back
    however the run ends (`then` follows errors too). A run stops a running replay (`play`)."""
    inputs, outputs = pick(ui, h.RUN_INPUTS), pick(ui, h.RUN_OUTPUTS)
    # a run's event starts at once and waits in the app's device line (hierviz.app.line), not in
    # Gradio's queue, whose size limit is every event's; its place and expected start are in the
    # status box, so Gradio's own progress (its estimate counts the wait as run time) is hidden
    started = dict(concurrency_limit=None, show_progress="hidden")
    hidden = dict(queue=False, show_progress="hidden", api_visibility="private")
    triggers = ((ui["run_btn"].click, dict(api_name="run")), (ui["prompt"].submit, dict(api_visibility="private")))
    for trigger, api in triggers:
        trigger(h.run_button_busy, None, [ui["run_btn"]], cancels=[play], **hidden).then(
            run_live, inputs, outputs, **api, **started).then(h.run_button_ready, None, [ui["run_btn"]], **hidden)
    ui["stop_btn"].click(h.request_stop, None, [ui["status"]], queue=False, api_name="stop")
    # the page reports each drawn status update (render pacing, hierviz.app.pacing)
    ui["status"].change(h.report_rendered, None, None, queue=False, show_progress="hidden",
                        api_visibility="private", js=RENDERED_JS)


def wire_inspect(ui: Components, play: Any) -> None:
    """The step slider, previous / next step and the run chooser; each stops a running replay
    (`play`): its updates would otherwise keep overwriting the step the visitor chose."""
    ui["step"].input(h.scrub, [ui["session"], ui["step"]], pick(ui, h.SCRUB_OUTPUTS), trigger_mode="always_last",
                     show_progress="hidden", api_name="scrub", cancels=[play])
    for button, handler in ((ui["prev_btn"], h.previous_step), (ui["next_btn"], h.next_step)):
        button.click(handler, [ui["session"], ui["step"]], pick(ui, h.STEP_OUTPUTS), show_progress="hidden",
                     trigger_mode="always_last", api_visibility="private", cancels=[play])
    ui["view"].input(h.switch_view, [ui["session"], ui["view"]], pick(ui, h.VIEW_OUTPUTS), show_progress="hidden",
                     api_visibility="private", cancels=[play])
    ui["present"].change(None, [ui["present"]], None, js=PRESENT_JS, api_visibility="private")
    ui["side_by_side"].input(h.set_side_by_side, [ui["session"], ui["side_by_side"]], [ui["side"]],
                             show_progress="hidden", api_visibility="private")
    ui["export_step"].click(h.export_step, [ui["session"]], [ui["status"], ui["step_svg"]], show_progress="hidden",
                            api_visibility="private").then(None, None, None, js=CLICK_STEP_PICTURE_JS)
    ui["time_scale"].input(h.set_time_scale, [ui["session"], ui["time_scale"]], pick(ui, h.TIME_SCALE_OUTPUTS),
                           show_progress="hidden", api_visibility="private")


def wire_replay(ui: Components) -> Any:
    """Play from the step on screen and Pause; returns Play's event for the other controls that
    stop it."""
    play = ui["play_btn"].click(h.replay, [ui["session"], ui["speed"], ui["step"]], pick(ui, h.PLAY_OUTPUTS),
                                show_progress="hidden", api_visibility="private")
    # the page reports the draft tree it has drawn (its title, in a hidden box): a replay sends the
    # next one when it is ready (handlers.TreePace)
    drawn = gr.Textbox(visible=False)
    ui["tree"].change(h.report_tree_drawn, [drawn], None, queue=False, show_progress="hidden", api_visibility="private",
                      js=TREE_PAINTED_JS)
    # the message is sent only after the cancellation went through, so a late step update from
    # the cancelled replay cannot overwrite it; the step on screen stays, and Play resumes from it
    ui["pause_btn"].click(None, None, None, cancels=[play], queue=False, api_visibility="private").then(
        h.replay_stopped, [ui["session"]], [ui["status"]], queue=False, api_visibility="private")
    return play


def wire_loads(ui: Components, play: Any) -> None:
    """An upload or a recorded trace (loaded when chosen) replaces what the page shows: a replay
    stops (its event is cancelled), and a live run of the visitor stops and sends nothing more
    (handlers.shown_instead), so none of their updates lands over the trace."""
    outputs = pick(ui, h.LOAD_OUTPUTS)
    # parsing a large upload takes a few times its size in memory for a moment: a few at a time
    ui["upload"].upload(h.load_file, [ui["upload"], ui["session"]], outputs, show_progress="hidden",
                        api_name="load_trace", concurrency_id="trace-upload", concurrency_limit=UPLOADS_AT_ONCE,
                        cancels=[play])
    ui["trace_pick"].input(h.load_shipped, [ui["trace_pick"], ui["session"]], outputs, show_progress="hidden",
                           api_visibility="private", cancels=[play])


def wire_notes(ui: Components) -> None:
    """Each setting is checked as the visitor changes it, its message under its group (hierviz.app.notes).
    The values go unprocessed: a slider's number box holds what was typed until the page clamps it,
    and what was typed is what the message answers. A new message beside a control is scrolled into view."""
    inputs, outputs = pick(ui, h.SETTING_INPUTS), pick(ui, NOTES)
    for i, name in enumerate(h.SETTING_INPUTS):
        ui[name].input(setting_notes, inputs, outputs, preprocess=False, queue=False, show_progress="hidden",
                       trigger_mode="always_last", **(dict(api_name="check_settings") if i == 0 else
                                                      dict(api_visibility="private")))
    for name in (*NOTES, "trace_note"):
        ui[name].change(None, None, None, js=SHOW_NOTE_JS.replace("ID", ui[name].elem_id), api_visibility="private")


# A new message beside a control is scrolled into view, as little as it takes (the control stays in view).
SHOW_NOTE_JS = "() => { document.querySelector('#ID .hv-note')?.scrollIntoView({block: 'nearest'}); return []; }"

# After an export, the hidden download button holds the new picture: clicking it downloads that file.
CLICK_STEP_PICTURE_JS = "() => { document.querySelector('#hv-step-svg')?.click(); return []; }"

# The presentation layout is a class on <body> that assets/app.css keys on; the checkbox sets it.
PRESENT_JS = "(on) => { document.body.classList.toggle('hv-present', !!on); return []; }"
