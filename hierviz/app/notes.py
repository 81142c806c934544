"""Messages beside what caused them: a setting's message under its group of settings, an upload's
under the upload, in the words of the page's labels.

The status box sits next to Run, and on a phone the settings and the uploads are screens below it;
so a setting is checked as the visitor changes it, and its message shows right under the settings
it is about (three groups, one message area each). A slider's number box takes any number, and the
page clamps it to the slider's range when the box loses focus: that is said aloud ("256 is the
most; using 256"), not done in silence.
"""
from __future__ import annotations

from typing import Any, Optional

from hierviz.app.guard import caps, check_caps
from hierviz.app.stacks import device_kind
from hierviz.settings import DecodeSettings, SettingsError, default_settings
from hierviz.viz.style import esc

# what the page calls each setting (hierviz.app.visualizer's labels: the tree fields sit under their
# tree's heading there, "depth", "top-k", "size")
SETTING_LABELS = {
    "max_new_tokens": "Max new tokens", "temperature": "Temperature",
    "m_depth": "E_M tree depth", "m_topk": "E_M tree top-k", "m_tree_size": "E_M tree size",
    "min_draft_len": "Min sequence-draft length for T",
    "t_depth": "E_T tree depth", "t_topk": "E_T tree top-k", "t_tree_size": "E_T tree size",
}
# the settings in the order the run and the check take them (hierviz.app.handlers.RUN_INPUTS)
SETTING_FIELDS = ("max_new_tokens", "temperature", "m_depth", "m_topk", "m_tree_size", "min_draft_len",
                  "t_depth", "t_topk", "t_tree_size")
# the message areas, by component name, each under its group of settings
NOTES = ("run_note", "m_note", "t_note")
NOTE_OF = {"max_new_tokens": "run_note", "temperature": "run_note", "m_depth": "m_note", "m_topk": "m_note",
           "m_tree_size": "m_note", "min_draft_len": "m_note", "t_depth": "t_note", "t_topk": "t_note",
           "t_tree_size": "t_note"}


def note_html(text: str, kind: str = "info") -> str:
    """A message beside a control: the status box's look (kind info, ok, warn or error); empty
    text, no message. An error is announced at once to a screen reader, the others politely."""
    if not text:
        return ""
    role = "alert" if kind == "error" else "status"
    # the margin: scrolled into view (hierviz.app.visualizer.SHOW_NOTE_JS), it does not touch the screen's edge
    return f'<div class="hv-status hv-status-{kind} hv-note" role="{role}" style="scroll-margin: 16px">{esc(text)}</div>'


def slider_ranges() -> dict[str, tuple[float, float]]:
    """The settings the page offers as sliders and their ranges (hierviz.app.visualizer.settings_panel)."""
    return {"max_new_tokens": (1, caps(device_kind())["max_new_tokens"]), "temperature": (0.0, 2.0),
            "min_draft_len": (1, 32)}


def number(v: float) -> str:
    return f"{v:g}"


def clamped(field: str, value: Any, lo: float, hi: float) -> tuple[Any, Optional[str]]:
    """The value a slider's number box ends on, and what to say when the page changes it: a number
    out of range becomes the nearest end, an empty box the low end."""
    label = SETTING_LABELS[field]
    if value is None or value == "":
        return lo, f"{label}: the box is empty; using {number(lo)}."
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return value, None                 # not a number: validation names it
    if value > hi:
        return hi, f"{label}: {number(hi)} is the most; using {number(hi)}."
    if value < lo:
        return lo, f"{label}: {number(lo)} is the least; using {number(lo)}."
    return value, None


def checked(values: dict[str, Any]) -> Optional[SettingsError]:
    """The first refusal of these settings, named by the page's labels (None: a run takes them)."""
    try:
        check_caps(DecodeSettings(**values).validate(SETTING_LABELS), device_kind(), SETTING_LABELS)
    except SettingsError as e:
        return e
    return None


def setting_notes(*values: Any) -> tuple[str, str, str]:
    """The three message areas for the settings `values` (SETTING_FIELDS' order) as the page holds
    them, before any clamping: each clamped slider said aloud, then each group's first refusal (the
    group's settings judged with the others at this machine's defaults: a refusal in one group
    must not hide another's)."""
    raw = dict(zip(SETTING_FIELDS, values))
    defaults = {f: getattr(default_settings(), f) for f in SETTING_FIELDS}
    said: dict[str, list[tuple[str, str]]] = {n: [] for n in NOTES}
    sliders = slider_ranges()
    for field in SETTING_FIELDS:
        if field in sliders:
            raw[field], text = clamped(field, raw.get(field), *sliders[field])
            if text:
                said[NOTE_OF[field]].append((text, "warn"))
        elif raw.get(field) is None or raw.get(field) == "":
            raw[field] = defaults[field]            # said here; the check below takes the default
            said[NOTE_OF[field]].insert(0, (f"{SETTING_LABELS[field]}: the box is empty; type a whole number.", "error"))
    for note in NOTES:
        refused = checked({**defaults, **{f: v for f, v in raw.items() if NOTE_OF[f] == note}})
        if refused is not None:
            said[note].insert(0, (f"{refused}.", "error"))
    return tuple(notes_html(said[n]) for n in NOTES)  # type: ignore[return-value]


def notes_html(lines: list[tuple[str, str]]) -> str:
    """One message area: its lines, the worst kind colouring them all."""
    if not lines:
        return ""
    kind = "error" if any(k == "error" for _, k in lines) else lines[0][1]
    return note_html(" ".join(t for t, _ in lines), kind)
