"""One colour language for every panel, and safe display of token text.

Colours are from the Okabe-Ito palette so that they stay distinguishable for colour-blind
viewers and on washed-out projectors. Every panel uses the same meaning for the same colour.
"""
from __future__ import annotations

import html

# Who produced a token (trace SOURCES) and the tree-node states drawn in the tree view.
COLORS = {
    "tree": "#009E73",                # drafted by the EAGLE head and accepted by its verifier
    "intermediate_bonus": "#0072B2",  # the intermediate model M's own token after its accepted path
    "draft": "#CC79A7",               # drafted autoregressively by M (sequence speculative decoding)
    "target_bonus": "#E69F00",        # the target T's own token (correction or bonus)
    "rejected": "#D55E00",            # checked by the verifier and rejected
    "discarded": "#C9CED6",           # on a branch the verifier never reached
    "root": "#3B4252",                # the last accepted token the tree grows from
}
# Light backgrounds for text spans, same hues as COLORS.
TINTS = {
    "tree": "#CDEFE3",
    "intermediate_bonus": "#CFE3F3",
    "draft": "#F4DCEA",
    "target_bonus": "#FBE8C2",
    "rejected": "#F8D5C2",
    "discarded": "#EEF0F3",
}
SOURCE_LABELS = {
    "tree": "drafted by the EAGLE head, accepted",
    "intermediate_bonus": "intermediate model M's own token",
    "draft": "drafted by M token by token",
    "target_bonus": "target T's own token",
}
STAGE_COLORS = {
    "draft": "#56B4E9",
    "intermediate_verify": "#009E73",
    "target_verify": "#E69F00",
    "overhead": "#999999",
}
STAGE_LABELS = {
    "draft": "draft (E_M / E_T / M)",
    "intermediate_verify": "intermediate M verifies trees",
    "target_verify": "target T verifies",
    "overhead": "overhead",
}
METHOD_LABELS = {
    "hierspec": "HierSpec",
    "eagle2": "EAGLE-2",
    "spec": "Sequence spec.",
    "ar": "Autoregressive",
}


def method_label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


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
