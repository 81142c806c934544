"""One colour language for every panel, and safe display of token text.

Every role keeps one colour in every panel. The colours were chosen so that the roles a visitor
must tell apart at a glance (accepted, rejected, T's own token, M's bonus) stay at least 30
CIEDE2000 apart in normal vision and under simulated deuteranopia, protanopia and tritanopia;
every pair of roles stays at least 23 apart (seven roles cannot all be 30 apart), and each role
also has a mark (ROLE_MARKS) so that colour is never the only cue. Text on every role colour
meets WCAG AA (4.5:1). tests/test_palette.py checks all of this.
"""
from __future__ import annotations

import html

from hierviz import methods

# Who produced a token (trace SOURCES) and the tree-node states drawn in the tree view.
COLORS = {
    "tree": "#297B7A",                # teal: drafted by the EAGLE head and accepted by its verifier
    "intermediate_bonus": "#000E4C",  # navy: the intermediate model M's own token after its accepted path
    "draft": "#B286E9",               # lavender: drafted autoregressively by M (sequence speculative decoding)
    "target_bonus": "#E68101",        # orange: the target T's own token (correction or bonus)
    "rejected": "#862400",            # dark red: checked by the verifier and rejected
    "discarded": "#CFDBD5",           # grey: on a branch the verifier never reached
    "root": "#130100",                # black: the last accepted token the tree grows from
}
DARK_TEXT = "#1F2937"
LIGHT_TEXT = "#FFFFFF"
# Text colour on each role colour: whichever of the two reads at >= 4.5:1 on it.
TEXT_ON = {
    "tree": LIGHT_TEXT,
    "intermediate_bonus": LIGHT_TEXT,
    "draft": DARK_TEXT,
    "target_bonus": DARK_TEXT,
    "rejected": LIGHT_TEXT,
    "discarded": DARK_TEXT,
    "root": LIGHT_TEXT,
}
# The second cue beside colour: a mark after the token in chips, tree nodes and the legend.
ROLE_MARKS = {
    "tree": "✓",
    "intermediate_bonus": "◆",
    "draft": "",
    "target_bonus": "★",
    "rejected": "✗",
    "discarded": "",
    "root": "",
}
# Light backgrounds for text spans (dark text on them), same hues as COLORS.
TINTS = {
    "tree": "#D4ECEB",
    "intermediate_bonus": "#D7DCEF",
    "draft": "#ECDFFA",
    "target_bonus": "#FCE3C4",
    "rejected": "#F3D5CA",
    "discarded": "#EEF0F3",
}
SOURCE_LABELS = {
    "tree": "drafted by the EAGLE head, accepted",
    "intermediate_bonus": "intermediate model M's own token",
    "draft": "drafted by M token by token",
    "target_bonus": "target T's own token",
}
# Time per stage: M's work in M's navy, T's in T's orange (as their own tokens), drafting sky blue.
STAGE_COLORS = {
    "draft": "#56B4E9",
    "intermediate_verify": "#000E4C",
    "target_verify": "#E68101",
    "overhead": "#999999",
}
STAGE_LABELS = {
    "draft": "draft (E_M / E_T / M)",
    "intermediate_verify": "intermediate M verifies trees",
    "target_verify": "target T verifies",
    "overhead": "overhead",
}


def relative_luminance(color: str) -> float:
    """WCAG relative luminance of a #RRGGBB colour."""
    channels = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast_ratio(foreground: str, background: str) -> float:
    """WCAG contrast ratio of two #RRGGBB colours (1 to 21)."""
    lighter, darker = sorted((relative_luminance(foreground), relative_luminance(background)), reverse=True)
    return (lighter + 0.05) / (darker + 0.05)


def method_label(method: str) -> str:
    return methods.label(method)


def method_color(method: str) -> str:
    """A method's (or a what-if variant row's) colour in per-method charts, from the registry; grey
    for an unknown name."""
    return methods.color(method) or "#999999"


def visible_token(text: str, limit: int = 12) -> str:
    """Token text made visible (spaces, newlines, empty) and shortened; NOT yet escaped."""
    if text == "":
        return "∅"
    shown = text.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "")
    if shown.startswith(" "):
        shown = "·" + shown[1:]      # a leading space matters for tokenizers: show it
    if shown.strip() == "":
        shown = shown.replace(" ", "·")
    if len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return shown


def esc(text: str) -> str:
    """HTML-escape text for the page and for plotly labels (plotly decodes these entities)."""
    return html.escape(text, quote=True)


def token_label(text: str, limit: int = 12) -> str:
    return esc(visible_token(text, limit))


def plotly_label(text: str, limit: int = 12) -> str:
    """Token text for plotly annotations/hovers: plotly decodes &lt; &gt; &amp; but shows
    &quot; and &#x27; literally, so quotes stay as they are (no attribute context there)."""
    return html.escape(visible_token(text, limit), quote=False)
