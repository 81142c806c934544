"""A run as one self-contained HTML file that replays it step by step, for a class or a bug report.

Every step's panels (trees, sequence draft, the target's verdict, the output so far) are rendered
here, once, with the same builders as the app, and sit in the file one after another; a few lines
of inline JavaScript show one at a time (prev / next / play). Nothing is fetched: no script, font or
style from the network, so the file opens offline and leaks nothing. All token text goes through
style.esc, as in the app.

The trees are drawn as HTML (one row of chips per depth), not as the app's plotly figure: plotly.js
is several MB. A step's panels also export as one SVG (`step_svg`, no dependency); a plotly figure as
PNG/SVG needs plotly's exporter, kaleido, and a browser for it to drive (`figure_image`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import plotly.graph_objects as go

from hierviz.trace import Step, Trace
from hierviz.viz.compare import counterpart, matching_step, side_by_side_html
from hierviz.viz.panels import legend_html, output_html, sequence_html, tree_html, verdict_html
from hierviz.viz.style import esc, method_label

APP_CSS = Path(__file__).resolve().parents[2] / "assets" / "app.css"

PLAYER_JS = """
(function () {
  var steps = document.querySelectorAll('.hv-replay-step');
  var label = document.getElementById('hv-replay-pos');
  var playBtn = document.getElementById('hv-replay-play');
  var i = 0, timer = null;
  if (!steps.length) { return; }
  function show(k) {
    i = Math.max(0, Math.min(steps.length - 1, k));
    for (var j = 0; j < steps.length; j++) { steps[j].hidden = j !== i; }
    label.textContent = 'step ' + (i + 1) + ' of ' + steps.length;
  }
  function stop() { if (timer) { clearInterval(timer); timer = null; playBtn.textContent = 'Play'; } }
  document.getElementById('hv-replay-prev').onclick = function () { stop(); show(i - 1); };
  document.getElementById('hv-replay-next').onclick = function () { stop(); show(i + 1); };
  playBtn.onclick = function () {
    if (timer) { stop(); return; }
    if (i >= steps.length - 1) { show(0); }
    playBtn.textContent = 'Pause';
    timer = setInterval(function () { if (i >= steps.length - 1) { stop(); } else { show(i + 1); } }, 1000);
  };
  // arrow keys step, space plays or pauses
  document.addEventListener('keydown', function (e) {
    if (e.key === 'ArrowLeft') { document.getElementById('hv-replay-prev').click(); }
    else if (e.key === 'ArrowRight') { document.getElementById('hv-replay-next').click(); }
    else if (e.key === ' ') { e.preventDefault(); playBtn.click(); }
  });
  show(0);
})();
"""

# layout for the file's own elements; the panels' hv-* classes come from the app's stylesheet
REPLAY_CSS = """
body { font-family: ui-sans-serif, system-ui, "DejaVu Sans", sans-serif; margin: 1.5em; color: #222; }
.hv-replay-nav { position: sticky; top: 0; background: white; padding: .5em 0; border-bottom: 1px solid #ddd; }
.hv-replay-nav button { margin-right: .5em; padding: .3em 1em; }
"""


def app_stylesheet() -> str:
    """The app's CSS, inlined; empty when it is missing or refers to anything outside the file."""
    try:
        css = APP_CSS.read_text(encoding="utf-8")
    except OSError:
        return ""
    return "" if "url(" in css or "@import" in css else css


def step_section(trace: Trace, i: int) -> str:
    """Step i's panels as one section; the player hides all but one (without JavaScript the page
    shows every step, one after the other)."""
    st: Step = trace.steps[i]
    trees = "".join(tree_html(t, k + 1) for k, t in enumerate(st.trees))
    return (f'<section class="hv-replay-step"><h2>Step {i + 1} of {len(trace.steps)}</h2>{trees}'
            f'{sequence_html(st)}{verdict_html(st)}{output_html(trace, i, i)}</section>')


def replay_html(trace: Trace, title: str = "") -> str:
    """The whole replay file: a standalone HTML document, every step pre-rendered."""
    name = title or f"hierviz replay: {method_label(str(trace.meta.get('method', '?')))}"
    prompt = trace.meta.get("prompt")
    prompt_html = f'<p><b>Prompt:</b> {esc(prompt)}</p>' if isinstance(prompt, str) and prompt else ""
    note = ('<p class="hv-warn">Hand-made trace: no model ran and the timings are invented.</p>'
            if trace.meta.get("synthetic") else "")
    sections = "".join(step_section(trace, i) for i in range(len(trace.steps)))
    nav = ('<div class="hv-replay-nav"><button id="hv-replay-prev" type="button">◀ Prev</button>'
           '<button id="hv-replay-play" type="button">Play</button>'
           '<button id="hv-replay-next" type="button">Next ▶</button><span id="hv-replay-pos"></span></div>')
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<title>{esc(name)}</title><style>{app_stylesheet()}{REPLAY_CSS}</style></head>'
            f'<body><h1>{esc(name)}</h1>{prompt_html}{note}{legend_html()}{nav}{sections}'
            f'<script>{PLAYER_JS}</script></body></html>')


def static_export_available() -> bool:
    """Whether plotly can write a figure as PNG/SVG here (kaleido, which also needs a browser)."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return True


# ---- one step as an image ----------------------------------------------------------------------

SVG_WIDTH = 960
SVG_PAIR_WIDTH = 1280      # two columns side by side
SVG_BODY_STYLE = 'font-family: ui-sans-serif, system-ui, &quot;DejaVu Sans&quot;, sans-serif; color: #222; padding: 12px'
# characters XML 1.0 forbids (control codes, lone surrogates); random-weight models emit them as tokens
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def paired_step(trace: Trace, i: int, beside: Optional[list[Trace]]) -> Optional[tuple[Trace, int]]:
    """The other method's run and its step at step i's token count (hierviz.viz.compare), if `beside`
    holds one with such a step."""
    other = next((t for t in beside or [] if t.meta.get("method") == counterpart(str(trace.meta.get("method")))),
                 None)
    j = matching_step(other.steps, sum(len(s.new_tokens) for s in trace.steps[: i + 1])) if other else None
    return None if other is None or j is None else (other, j)


def step_panels_xhtml(trace: Trace, i: int, beside: Optional[list[Trace]] = None) -> str:
    """Step i's panels as well-formed XHTML (an SVG holds HTML only as XML): the builders' markup is
    XML but for <br>, and their escaping (&amp; &lt; &gt; &quot; &#x27;) is valid XML already. With
    `beside` (the comparison's runs), the other method's step at the same token count beside it."""
    st = trace.steps[i]
    if paired_step(trace, i, beside):
        html = side_by_side_html(trace, i, beside or []) + output_html(trace, i, i)
    else:
        trees = "".join(tree_html(t, k + 1) for k, t in enumerate(st.trees))
        html = f"{trees}{sequence_html(st)}{verdict_html(st)}{output_html(trace, i, i)}"
    return NOT_XML.sub("\ufffd", html.replace("<br>", "<br/>"))


def tree_rows(st: Step, chips_per_line: int) -> int:
    """Lines of chips a step's trees take: a heading, then each depth's chips wrapped."""
    return sum(2 + len(t.nodes) // chips_per_line + t.depth for t in st.trees)


def svg_size(trace: Trace, i: int, beside: Optional[list[Trace]] = None) -> tuple[int, int]:
    """(width, height) in px that hold step i's panels: rows of chips per tree depth and lines of
    output text, with room to spare (a foreignObject clips, it does not grow); two columns, each as
    tall as the longer one, when the other method's step stands beside it."""
    out_chars = sum(len(x) for s in trace.steps[: i + 1] for x in s.new_text)
    pair = paired_step(trace, i, beside)
    if pair is None:
        return SVG_WIDTH, 420 + 40 * tree_rows(trace.steps[i], 12) + 28 * (out_chars // 90)
    other, j = pair
    rows = max(tree_rows(trace.steps[i], 8), tree_rows(other.steps[j], 8))
    return SVG_PAIR_WIDTH, 620 + 40 * rows + 28 * (out_chars // 120)


def step_svg(trace: Trace, i: int, beside: Optional[list[Trace]] = None) -> str:
    """Step i's panels as one standalone SVG (HTML inside a foreignObject, styles inline), which any
    browser opens offline; a picture for slides that needs neither plotly's exporter nor a network.
    `beside`: the comparison's runs, to put the other method's step at the same token count beside it."""
    title = f"Step {i + 1} of {len(trace.steps)} · {method_label(str(trace.meta.get('method', '?')))}"
    width, height = svg_size(trace, i, beside)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}"><title>{esc(title)}</title><rect width="100%" height="100%" fill="white"/>'
            f'<foreignObject x="0" y="0" width="{width}" height="{height}">'
            f'<div xmlns="http://www.w3.org/1999/xhtml" style="{SVG_BODY_STYLE}"><style><![CDATA[{app_stylesheet()}{REPLAY_CSS}]]></style>'
            f'<h2>{esc(title)}</h2>{step_panels_xhtml(trace, i, beside)}</div></foreignObject></svg>')


def figure_image(fig: go.Figure, fmt: str = "png") -> Optional[bytes]:
    """A plotly figure (e.g. hierviz.viz.tree.tree_figure of a step) as PNG or SVG bytes through
    kaleido; None where kaleido or the browser it drives is missing."""
    if not static_export_available():
        return None
    try:
        return fig.to_image(format=fmt)
    except (RuntimeError, ValueError, OSError):     # kaleido installed, but no browser it can start
        return None
