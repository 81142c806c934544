"""Messages beside what caused them: a setting's message under its group of settings in the words of
the page's labels, a slider's clamped value said aloud, an upload's answer under the upload (a file
of any type, non-JSON text answered as such), a failed analysis that leaves no stale chart, the
Profile chart that shows its point, and the replay's tree pacing. Through functions and through
gradio_client (the outputs each message comes back in); the browser's view is tests/test_browser.py."""
from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

torch = pytest.importorskip("torch")
ON_GPU = torch.cuda.is_available()
CPU_ONLY = pytest.mark.skipif(ON_GPU, reason="the caps and defaults checked here are the CPU's")

# the settings in the check's order: Max new tokens, Temperature, E_M depth / top-k / size, min draft, E_T depth / top-k / size
GOOD = [8, 0.0, 2, 4, 8, 3, 2, 4, 8]


def text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html).replace("&#x27;", "'")


def with_(**changes) -> list:
    from hierviz.app.notes import SETTING_FIELDS
    values = dict(zip(SETTING_FIELDS, GOOD))
    values.update(changes)
    return [values[f] for f in SETTING_FIELDS]


# ---- settings: labels, groups, clamping --------------------------------------------------------

@CPU_ONLY
@pytest.mark.parametrize("changes, group, message", [
    ({"max_new_tokens": 999}, 0, "Max new tokens: 256 is the most; using 256."),
    ({"max_new_tokens": 0}, 0, "Max new tokens: 1 is the least; using 1."),
    ({"max_new_tokens": -5}, 0, "Max new tokens: 1 is the least; using 1."),
    ({"max_new_tokens": None}, 0, "Max new tokens: the box is empty; using 1."),
    ({"temperature": 5}, 0, "Temperature: 2 is the most; using 2."),
    ({"min_draft_len": 40}, 1, "Min sequence-draft length for T: 32 is the most; using 32."),
    ({"max_new_tokens": 2.5}, 0, "Max new tokens must be a whole number, got 2.5."),
    ({"temperature": "warm"}, 0, "Temperature must be a number, got 'warm'."),
    ({"m_depth": 1.5}, 1, "E_M tree depth must be a whole number, got 1.5."),
    ({"m_depth": 0}, 1, "E_M tree depth must be between 1 and 32, got 0."),
    ({"m_depth": None}, 1, "E_M tree depth: the box is empty; type a whole number."),
    ({"m_tree_size": 500}, 1, "E_M tree size 500 exceeds the 20 candidates that depth 2 and top-k 4 draft."),
    ({"m_depth": 3, "m_topk": 8, "m_tree_size": 65}, 1, "E_M tree size must be at most 64 on this server."),
    ({"t_topk": -5}, 2, "E_T tree top-k must be between 1 and 64, got -5."),
    ({"t_tree_size": 7.5}, 2, "E_T tree size must be a whole number, got 7.5."),
])
def test_a_settings_message_is_in_its_groups_area_in_the_pages_words(changes, group, message):
    from hierviz.app.notes import setting_notes
    notes = setting_notes(*with_(**changes))
    assert text(notes[group]) == message, notes
    assert all(n == "" for i, n in enumerate(notes) if i != group), notes
    kind = "warn" if "using" in message and "empty; type" not in message else "error"
    assert f"hv-status-{kind}" in notes[group]
    assert "_" not in text(notes[group]).replace("E_M", "").replace("E_T", "")     # no internal name


def test_good_settings_say_nothing_and_one_groups_refusal_hides_no_others():
    from hierviz.app.notes import setting_notes
    assert setting_notes(*GOOD) == ("", "", "")
    notes = setting_notes(*with_(max_new_tokens=2.5, m_depth=0, t_tree_size=7.5))
    assert [bool(n) for n in notes] == [True, True, True]
    assert "Max new tokens" in notes[0] and "E_M tree depth" in notes[1] and "E_T tree size" in notes[2]


def test_settings_messages_escape_what_was_typed():
    from hierviz.app.notes import setting_notes
    notes = setting_notes(*with_(temperature="<img src=x onerror=alert(1)>"))
    assert "<img" not in notes[0] and "&lt;img" in notes[0]


def test_validation_names_fields_by_the_labels_given_and_by_field_names_otherwise():
    from hierviz.app.notes import SETTING_LABELS
    from hierviz.settings import DecodeSettings, SettingsError
    with pytest.raises(SettingsError) as e:
        DecodeSettings(max_new_tokens=2.5).validate(SETTING_LABELS)
    assert str(e.value) == "Max new tokens must be a whole number, got 2.5" and e.value.setting == "max_new_tokens"
    with pytest.raises(SettingsError) as e:                  # the command line and trace files keep field names
        DecodeSettings(max_new_tokens=0).validate()
    assert str(e.value) == "max_new_tokens must be between 1 and 8192" and e.value.setting == "max_new_tokens"
    with pytest.raises(SettingsError) as e:
        DecodeSettings(m_depth=3, m_topk=2, m_tree_size=100).validate()
    assert e.value.setting == "m_tree_size" and str(e.value).startswith("E_M tree size 100 exceeds")


def test_the_labels_are_the_pages():
    """Each setting's name in a message is its label on the page (a tree's fields sit under their
    tree's heading, labelled "depth", "top-k", "size": the message's name ends with it)."""
    import gradio as gr
    from hierviz.app.handlers import SETTING_INPUTS
    from hierviz.app.notes import SETTING_FIELDS, SETTING_LABELS
    from hierviz.app.visualizer import visualizer_tab
    with gr.Blocks():
        ui = visualizer_tab("tiny-random")
    for name, field in zip(SETTING_INPUTS, SETTING_FIELDS):
        shown, said = ui[name].label, SETTING_LABELS[field]
        assert shown.startswith(said) or said.endswith(f" {shown}"), (field, shown, said)


# ---- uploads -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, content, message", [
    ("notes.txt", b"{}", "not a trace file (a trace is a .json file)"),
    ("notes.json", b"Dear visitor,\nthis is a letter.", "not a trace file (it is not JSON)"),
    ("spaces.json", b"  \n  # a comment", "not a trace file (it is not JSON)"),
    ("empty.json", b"", "not a trace file (it is empty)"),
    ("blank.json", b" \n\t ", "not a trace file (it is empty)"),
    ("image.json", b"\x89PNG\r\n\x1a\n\x00\xff", "not a trace file (it is not text; a trace is JSON text)"),
    ("broken.json", b'{"version": 1,', "not valid JSON: "),          # JSON gone wrong: where, as the parser says
    ("word.json", b'"hello"', "a trace must be a JSON object"),          # JSON, but no trace: the schema's words
])
def test_an_upload_that_is_no_trace_says_what_it_is(tmp_path, name, content, message):
    from hierviz.app.handlers import read_upload
    from hierviz.trace import TraceError
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(TraceError) as e:
        read_upload(str(f))
    assert str(e.value).startswith(message), str(e.value)
    assert "Expecting value: line 1 column 1" not in str(e.value)


# ---- the analysis: a failure leaves nothing of the trace before --------------------------------

def test_a_failed_analysis_clears_the_charts_and_downloads(tmp_path, monkeypatch):
    from hierviz.app import analyse_tab, downloads
    from hierviz.app.shipped import shipped_traces
    monkeypatch.setattr(downloads, "DOWNLOAD_ROOT", tmp_path)
    good = next(p for _, p in shipped_traces() if p.endswith("handmade-demo.json"))
    shown = analyse_tab.analyse(good, None, None)
    assert "hv-status-ok" in shown[0] and all(b["interactive"] for b in shown[5:9])
    bad = tmp_path / "letter.json"
    bad.write_text("Dear visitor", encoding="utf-8")
    status, tau, depth, table, worst, *buttons, position = analyse_tab.analyse(good, str(bad), None)
    assert "hv-status-error" in status and "not a trace file (it is not JSON)" in status
    assert (tau, depth, table, worst, position) == (None, None, "", None, None)
    assert [(b["value"], b["interactive"]) for b in buttons] == [(None, False)] * len(analyse_tab.DOWNLOADS)


# ---- the Profile tab ----------------------------------------------------------------------------

def visible_y(fig, xaxis: str = "x") -> list[float]:
    return [y for t in fig.data if t.visible is not False and t.visible != "legendonly" and t.xaxis == xaxis
            for y in t.y]


def test_the_profile_chart_shows_fp16_and_w4_and_their_crossing():
    """Log y; torch's tinygemm curve off (a legend click or the tab's toggle shows it), so the
    visible range is the fp16 and W4 curves' own, and their crossing is marked inside it."""
    from hierviz.app.profile_tab import recorded_profiles, show_profile
    label = next(l for l in recorded_profiles() if "70b" in l)
    fig, _ = show_profile(label)
    assert fig.layout.yaxis.type == "log" and "log scale" in fig.layout.yaxis.title.text
    tiny = [t for t in fig.data if t.name.startswith("w4a16-tinygemm")]
    assert tiny and all(t.visible == "legendonly" for t in tiny) and "click to show" in tiny[0].name
    fp16 = next(t for t in fig.data if t.name == "fp16")
    w4 = next(t for t in fig.data if t.name == "w4a16-triton")
    ys = visible_y(fig)
    lo, hi = min(ys), max(ys)
    assert hi / lo < 12                  # with tinygemm's 7.5 ms the axis would span 70x
    assert fig.layout.yaxis.title.text == "forward latency (µs, log scale)"
    [line] = [s for s in fig.layout.shapes if s.xref == "x"]
    at = line.x0
    assert 32 < at < 64 and any("slower" in a.text and f"≈{at:.0f} tokens" in a.text for a in fig.layout.annotations)
    # the curves at the crossing sit inside the drawn range, well away from its ends (log scale)
    import math
    span = math.log(hi) - math.log(lo)
    for curve in (fp16, w4):
        y = curve.y[5] + (curve.y[6] - curve.y[5]) * 0.5          # between 32 and 64 tokens
        assert 0.2 < (math.log(y) - math.log(lo)) / span < 0.8
    # the toggle draws tinygemm too
    shown, _ = show_profile(label, True)
    assert all(t.visible is True for t in shown.data if t.name.startswith("w4a16-tinygemm"))


def test_profile_crossing_is_interpolated_on_the_log_axis():
    from hierviz.viz.profile_fig import crossing
    assert crossing([1, 4], [10, 10], [5, 20]) == pytest.approx(4 ** (1 / 3))
    assert crossing([1, 2, 4], [10, 10, 10], [1, 2, 3]) is None          # W4 stays below
    assert crossing([1, 2], [10, 10], [11, 12]) is None                  # W4 starts above


@pytest.mark.skipif(ON_GPU, reason="this machine has a GPU")
def test_measure_is_off_without_a_gpu_and_says_why_beside_the_button():
    import gradio as gr
    from hierviz.app import profile_tab
    with gr.Blocks() as demo:
        profile_tab.profile_tab()
    blocks = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    assert blocks["hv-profile-measure"].interactive is False
    assert "No GPU" in blocks["hv-profile-answer"].value
    fig, note, answer = profile_tab.measure_here("llama3-8b", False, None)
    assert "No GPU" in answer and isinstance(fig, dict) and isinstance(note, dict)   # the chart stays


# ---- the replay's tree pacing -------------------------------------------------------------------

def test_a_replay_sends_a_tree_once_the_page_drew_the_last_and_rested():
    from hierviz.app.handlers import TREE_REST, TREE_WAIT_MAX_S, TreePace, replay_panels
    from hierviz.app.session import SessionFlags
    assert TreePace(None).ready(5.0)                 # an API client: every tree
    flags = SessionFlags(reporting=True)
    pace = TreePace(flags)
    assert pace.ready(10.0)
    pace.sent(10.0)
    assert not pace.ready(10.3)                      # being drawn
    flags.tree_drawn_at = 10.4                       # drawn in 0.4 s
    assert not pace.ready(10.4 + 0.4 * TREE_REST - 0.01) and pace.ready(10.4 + 0.4 * TREE_REST)
    pace.sent(20.0)
    assert pace.ready(20.0 + TREE_WAIT_MAX_S)        # a report that never came holds nothing up for long
    light = replay_panels(False, 0.0, 0.0, 10.0, page_ready=False)
    assert light == {"seq", "verdict", "output", "side"}
    assert replay_panels(False, 1.0, 0.0, 10.0, page_ready=True) == light | {"tree", "latency", "stats"}
    assert replay_panels(True, 0.0, 5.0, 10.0, page_ready=False) is None      # the last step: everything


# ---- through the API: the output each message comes back in --------------------------------------

@pytest.fixture(scope="module")
def client():
    gradio_client = pytest.importorskip("gradio_client")
    from hierviz.app.check import start_app
    url, demo = start_app("tiny-random")
    yield gradio_client.Client(url, verbose=False)
    demo.close()


@CPU_ONLY
def test_the_settings_check_answers_in_each_groups_area(client):
    """/check_settings takes the values as the page holds them (a slider's box not yet clamped) and
    answers in (under Max new tokens and Temperature, under the E_M tree, under the E_T tree)."""
    run, m, t = client.predict(*with_(max_new_tokens=999, m_depth=1.5), api_name="/check_settings")
    assert text(run) == "Max new tokens: 256 is the most; using 256." and "hv-status-warn" in run
    assert text(m) == "E_M tree depth must be a whole number, got 1.5." and "hv-status-error" in m and t == ""
    assert client.predict(*GOOD, api_name="/check_settings") == ("", "", "")


def test_a_bad_upload_is_answered_under_the_upload_and_in_the_status_box(client, tmp_path):
    from gradio_client import handle_file
    from hierviz.app.handlers import LOAD_OUTPUTS
    # after the outputs API clients already read by position (the session, a gr.State, is no API output)
    assert LOAD_OUTPUTS[-2:] == ("trace_note", "upload")
    note = len(LOAD_OUTPUTS) - 3
    for name, content, said in (("notes.txt", "hello", "not a trace file (a trace is a .json file)"),
                                ("letter.json", "Dear visitor", "not a trace file (it is not JSON)")):
        f = tmp_path / name
        f.write_text(content)
        out = client.predict(handle_file(str(f)), api_name="/load_trace")
        assert len(out) == note + 2
        for where in (out[0], out[note]):
            assert "hv-status-error" in where and f"Could not read {name}: {said}" in text(where), where
        assert out[-1] is None                  # the upload box is empty again, ready for the next file
    good = tmp_path / "good.json"
    from hierviz.trace import save_comparison
    from hierviz.viz import sample
    save_comparison(sample.comparison(0, 24), good)
    out = client.predict(handle_file(str(good)), api_name="/load_trace")
    assert "hv-status-ok" in out[note] and "Loaded good.json" in text(out[note])


def test_the_visualizers_upload_takes_any_file_type():
    """Gradio answers a file type it was told to refuse with a toast beside nothing; the app takes
    any file and answers it under the upload."""
    from hierviz.app import build_app
    demo = build_app("tiny-random")
    uploads = [b for b in demo.blocks.values() if type(b).__name__ == "TraceUpload"]
    assert uploads and all(not b.file_types for b in uploads)
