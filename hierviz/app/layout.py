"""The whole page: the header, the tabs in order, the page-open and page-close events, launch options."""
from __future__ import annotations

from typing import Callable, Optional

import gradio as gr

from hierviz.app import downloads, tempfiles
from hierviz.app.common import ASSETS, TRACE_DIR
from hierviz.app.analyse_tab import analyse_tab
from hierviz.app.fields import PublicBlocks
from hierviz.app.handlers import LOAD_OUTPUTS, forget_session, on_open
from hierviz.app.profile_tab import profile_tab
from hierviz.app.session import STATE_CAPACITY
from hierviz.app.stacks import set_operator_stack
from hierviz.app.visualizer import pick, visualizer_tab
from hierviz.app.whatif_tab import whatif_tab
from hierviz.trace import MAX_TRACE_BYTES
from hierviz.viz.panels import WHATIF_TAB

# The one line says the method where the presentation layout and a phone show it; the paragraph
# says it at length beside the teaching notes (assets/app.css picks one).
HEADER = """<div class="hv-header"><h1>HierSpec, step by step</h1>
<p class="hv-oneline">A tiny head drafts a <b>tree</b> → mid-size <b>M</b> turns it into a short <b>sequence</b> →
big <b>4-bit T</b> checks only that sequence.</p>
<p class="hv-intro">A tiny draft head guesses a <b>tree</b> of tokens → a mid-size model <b>M</b> checks the tree and turns it into a
short <b>sequence</b> → the big <b>4-bit target T</b> checks only that sequence. Same text as T alone, fewer expensive
passes. Compare it live with EAGLE-2, where T checks the whole tree itself.</p></div>"""

# Events that may wait in Gradio's queue for a worker of their own group at once (scrubs, loads,
# Stop through the API, the other tabs): a flood guard. Live runs never wait there: they wait in
# the app's device line, bounded by HIERVIZ_QUEUE_SIZE (hierviz/app/line.py).
EVENT_BACKLOG = 500

# (tab title, builder). A builder is called inside `with gr.Tab(title):` and builds that tab.
TAB_BUILDERS: list[tuple[str, Callable[[], None]]] = []


def register_tab(title: str, builder: Callable[[], None]) -> None:
    """Add a tab after the Profile and What-if tabs; call before build_app()."""
    TAB_BUILDERS.append((title, builder))


def about_tab() -> None:
    about = ASSETS / "about.md"
    gr.Markdown(about.read_text(encoding="utf-8") if about.exists() else "HierSpec visualizer.")


def build_app(stack_default: Optional[str] = None) -> gr.Blocks:
    """The app; stack_default preselects a stack (default: HIERVIZ_STACK, else the offline stack)."""
    set_operator_stack(stack_default)
    # this process's temp folders go at exit; those left by processes that died go now
    tempfiles.sweep_dead()
    tempfiles.use_own_gradio_cache()
    # downloads are served from their own bounded folder (hierviz/app/downloads.py) and recorded
    # traces from theirs, instead of a copy in Gradio's cache per visitor
    gr.set_static_paths([downloads.prepare(), TRACE_DIR])
    # Gradio's own cache (uploads) is swept every 10 minutes of files older than 15
    with PublicBlocks(title="hierviz: hierarchical speculative decoding", fill_width=True,
                      delete_cache=(600, 900)) as demo:
        gr.HTML(HEADER)
        with gr.Tabs() as tabs:
            with gr.Tab("Visualizer", id="viz"):
                viz = visualizer_tab(stack_default)
            for title, builder, tab_id in [("Profile", profile_tab, None), ("What-if", whatif_tab, WHATIF_TAB),
                                           ("Analyse", analyse_tab, None), *((t, b, None) for t, b in TAB_BUILDERS)]:
                with gr.Tab(title, id=tab_id):
                    builder()
            with gr.Tab("How it works", id="about"):
                about_tab()
        wire_tab_links(tabs)
        demo.load(on_open, None, pick(viz, LOAD_OUTPUTS), show_progress="hidden", api_visibility="private")
        # a desktop screen opens in the presentation layout; the checkbox's change sets the class
        demo.load(None, None, [viz["present"]], js=PRESENT_ON_WIDE_SCREENS_JS, api_visibility="private")
        demo.unload(forget_session)
    demo.queue(max_size=EVENT_BACKLOG, default_concurrency_limit=8)
    return demo


def wire_tab_links(tabs: gr.Tabs) -> None:
    """A link to the What-if tab in a panel (viz.panels.tab_link) clicks this hidden button, which
    selects the tab on the server's side: on a narrow screen the tab's own button is folded away in
    a menu, so the page cannot click it."""
    goto = gr.Button("Open the What-if tab", visible="hidden", elem_id=f"hv-goto-{WHATIF_TAB}")
    goto.click(lambda: gr.Tabs(selected=WHATIF_TAB), None, tabs, queue=False, show_progress="hidden",
               api_visibility="private")


# From this width the tree, the sequence and the verdict stand side by side (the presentation layout)
PRESENT_FROM_PX = 1200
PRESENT_ON_WIDE_SCREENS_JS = f"() => window.innerWidth >= {PRESENT_FROM_PX}"

# Keyboard shortcuts of the Visualizer (the keys are listed on the page, visualizer.KEYS_HELP):
# they click the step and replay buttons, and never act while focus is in a text field. Links to a
# tab open it.
KEYS_JS = """<script>
document.addEventListener("keydown", (e) => {
  const t = e.target;
  if (e.ctrlKey || e.metaKey || e.altKey || !document.getElementById("hv-play")) return;
  if (t && (t.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(t.tagName))) return;
  const press = (id) => { const b = document.getElementById(id); if (b) { e.preventDefault(); b.click(); } };
  if (e.key === "[" || e.key === "ArrowLeft") press("hv-prev");
  else if (e.key === "]" || e.key === "ArrowRight") press("hv-next");
  else if (e.key === "k") {
    const playing = (document.getElementById("hv-status")?.innerText || "").startsWith("Replaying");
    press(playing ? "hv-pause" : "hv-play");
  }
});
// a link to a tab (hierviz.viz.panels.tab_link) opens it through its hidden button (layout.wire_tab_links)
document.addEventListener("click", (e) => {
  const link = e.target.closest && e.target.closest("a[data-hv-tab]");
  const goto = link && document.getElementById("hv-goto-" + link.dataset.hvTab);
  if (!goto) return;
  e.preventDefault();
  goto.click();
  window.scrollTo({top: 0});
});
</script>"""


# The page's own care for what Gradio draws, redone whenever the page changes (once a frame at most):
# - Gradio's upload areas are named "Click to upload or drop files" over the visible "Drop File Here
#   - or - Click to Upload"; a name must hold the visible words (WCAG 2.5.3), so it becomes them;
#   the footer's settings icon beside the word "Settings" is decoration (alt="");
# - the tree's box and the side-by-side panel end on the first screen (their tops, for assets/app.css);
# - a table, chart or panel that may scroll (on a phone, or capped to the screen) takes keyboard
#   focus, so a keyboard can scroll it, and a name;
# - the tree's box says when trees, or part of one, lie past its edge (#hv-tree-cue);
# - the presentation layout follows the window's width (a laptop plugged into a projector) until
#   the visitor sets the checkbox.
PAGE_JS = """<script>
(() => {
  const UPLOAD_NAME = "Click to upload or drop files";
  const REGIONS = {"hv-whatif-table": "What-if results table", "hv-whatif-live-table": "Live what-if results table",
                   "hv-side-by-side": "Side by side with EAGLE-2", "hv-tree": "Draft tree(s)",
                   "hv-latency": "Latency per stage", "hv-seq": "Sequence draft", "hv-verdict": "Target T's verdict"};
  const WHEN_SCROLLING = new Set(["hv-seq", "hv-verdict"]);     // rarely wider than their box
  const nameUploads = () => {
    for (const el of document.querySelectorAll(`[aria-label="${UPLOAD_NAME}"]`)) {
      const shown = el.innerText.replace(/\\s+/g, " ").trim();
      if (shown) el.setAttribute("aria-label", shown);
    }
    for (const img of document.querySelectorAll('footer img[alt="Settings"]')) img.alt = "";
  };
  const focusableRegions = () => {
    for (const [id, name] of Object.entries(REGIONS)) {
      const el = document.getElementById(id);
      if (!el || !el.textContent.trim() || el.hasAttribute("tabindex")) continue;
      if (!WHEN_SCROLLING.has(id) || el.scrollWidth > el.clientWidth + 1) {
        el.tabIndex = 0;
        el.setAttribute("role", "region");
        el.setAttribute("aria-label", name);
      }
    }
  };
  // the tree's box and the side-by-side panel end on the first screen: their tops, for app.css
  const fitToScreen = () => {
    for (const [id, name] of [["hv-tree", "--hv-tree-top"], ["hv-side-by-side", "--hv-side-top"]]) {
      const el = document.getElementById(id);
      const top = el && el.offsetParent ? Math.round(el.getBoundingClientRect().top + scrollY) + "px" : "";
      if (top && document.body.style.getPropertyValue(name) !== top) document.body.style.setProperty(name, top);
    }
  };
  const treeCue = () => {
    const box = document.getElementById("hv-tree"), cue = document.getElementById("hv-tree-cue");
    if (!box || !cue) return;
    const right = box.scrollWidth - box.clientWidth - box.scrollLeft > 2;
    const down = box.scrollHeight - box.clientHeight - box.scrollTop > 2;
    const edge = box.getBoundingClientRect().right - 24;
    const past = [...box.querySelectorAll(".annotation-text")]
      .filter((t) => /^tree \\d+$/.test(t.textContent) && t.getBoundingClientRect().left > edge)
      .map((t) => t.textContent.slice(5));
    const way = right && down ? "→ ↓" : right ? "→" : "↓";
    const what = past.length ? `tree${past.length > 1 ? "s" : ""} ${past.join(", ")}` : "the rest of the tree";
    const text = right || down ? `Scroll ${way} for ${what}` : "";
    if (cue.textContent !== text) cue.textContent = text;
    cue.hidden = !text;
    box.classList.toggle("hv-more-right", right);
  };
  let queued = false;
  const tidy = () => { queued = false; nameUploads(); fitToScreen(); focusableRegions(); treeCue(); };
  const soon = () => { if (!queued) { queued = true; requestAnimationFrame(tidy); } };
  new MutationObserver(soon).observe(document.documentElement,
                                     {childList: true, subtree: true, attributes: true, attributeFilter: ["aria-label"]});
  // a panel shown or moved by layout alone (no mutation after it): the page's height changes
  const watchBody = () => new ResizeObserver(soon).observe(document.body);
  if (document.body) watchBody(); else addEventListener("DOMContentLoaded", watchBody);
  document.addEventListener("scroll", soon, true);
  let chosen = false, syncing = false;
  document.addEventListener("click", (e) => {
    if (!syncing && e.target.closest && e.target.closest("#hv-present")) chosen = true;
  }, true);
  addEventListener("resize", () => {
    soon();
    const box = document.querySelector("#hv-present input");
    if (chosen || !box || box.checked === (innerWidth >= PRESENT_FROM_PX)) return;
    syncing = true;
    box.click();
    syncing = false;
  });
})();
</script>""".replace("PRESENT_FROM_PX", str(PRESENT_FROM_PX))


def launch_kwargs() -> dict:
    """Theme, CSS and limits; Gradio 6 takes these in launch()."""
    css_file = ASSETS / "app.css"
    css = css_file.read_text(encoding="utf-8") if css_file.exists() else ""
    theme = gr.themes.Soft(font=("ui-sans-serif", "system-ui", "DejaVu Sans", "sans-serif"),
                           font_mono=("DejaVu Sans Mono", "ui-monospace", "monospace"))
    return dict(css=css, theme=theme, head=KEYS_JS + PAGE_JS, max_file_size=f"{MAX_TRACE_BYTES // 2**20 + 1}mb", show_error=False,
                state_session_capacity=STATE_CAPACITY)
