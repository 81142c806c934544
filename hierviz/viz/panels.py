"""HTML builders for the sequence draft, the target's verdict, the output text, stats and legend.

All token text goes through style.esc: model output is untrusted text and must never become
markup in the page. Colours are inline so that each fragment is self-contained; layout classes
(hv-*) live in assets/app.css.
"""
from __future__ import annotations

import statistics
from typing import Optional

from hierviz.models.drafter import HEAD_SLOTS, HEAD_TYPES, head_label
from hierviz.retime import (MEASURED, RETIMED, Ratio, at_time_scale, equal_token_ratios, is_small_stack, real_scale_available,
                            whatif_headline)
from hierviz.methods import BASELINE, METHODS, SUBJECT, TOKEN, short, tree_on_target, verifies
from hierviz.trace import DraftTree, Step, Trace, first_difference, output_tokens, trace_stats
from hierviz.viz.style import (COLORS, DARK_TEXT, ROLE_MARKS, SOURCE_LABELS, TEXT_ON, TINTS, esc, method_label,
                               token_label)
from hierviz.viz.tree import KEY_NAMES, STATUS_ORDER, bonus_status, node_status

UNKNOWN_ROLE_COLOR = "#E5E7EB"


def chip(text: str, kind: str, title: str = "", mark: str | None = None, extra_class: str = "") -> str:
    """A token chip: solid colour for `kind` with its readable text colour; `mark` is a small
    symbol after the token (✓ ✗ ★), by default the role's own mark, so colour is never the only cue."""
    color = COLORS.get(kind, UNKNOWN_ROLE_COLOR)
    fg = TEXT_ON.get(kind, DARK_TEXT)
    shown_mark = ROLE_MARKS.get(kind, "") if mark is None else mark
    mark_html = f'<span class="hv-mark" aria-hidden="true">{esc(shown_mark)}</span>' if shown_mark else ""
    cls = f"hv-chip {extra_class}".strip()
    return (f'<span class="{cls}" style="background:{color};color:{fg}" title="{esc(title)}">'
            f'{token_label(text, 16)}{mark_html}</span>')


def _box(inner: str, cls: str = "") -> str:
    return f'<div class="hv-panel {cls}">{inner}</div>'


def is_prefill(step: Step) -> bool:
    """The engine's step 0 is the prefill round: every model reads the prompt, T picks token 1."""
    return step.index == 0 and not step.trees and not step.sequence


PREFILL_TEXT = ("Step 1 is the prefill: every model reads the prompt once and the target picks the first "
                "token. Drafting starts at step 2.")


# The legend's words; docs/app.md and assets/about.md use the same words and colour names.
LEGEND_ITEMS = (
    ("tree", "drafted by an EAGLE head and accepted"),
    ("intermediate_bonus", "intermediate M's own token"),
    ("target_bonus", "target T's own token"),
    ("rejected", "rejected"),
    ("discarded", "never checked / discarded"),
    ("draft", "drafted by M alone (sequence spec.)"),
)
# The tree view's key: the verifier of the trees shown (M in HierSpec) names the bonus.
TREE_KEY_ITEMS = (
    ("tree", "accepted by M"),
    ("rejected", "compared with M's choice, rejected"),
    ("discarded", "grows from a rejected token"),
    ("intermediate_bonus", "M's own next token (bonus): the root of the next tree"),
)


def swatch(kind: str) -> str:
    """A small sample of a role: its colour with its mark, as on the chips."""
    mark = esc(ROLE_MARKS.get(kind, ""))
    return (f'<span class="hv-swatch" aria-hidden="true" style="background:{COLORS[kind]};'
            f'color:{TEXT_ON[kind]}">{mark}</span>')


def legend_html(method: Optional[str] = None) -> str:
    """The colour-and-mark key; with `method`, only the roles that method's panels show."""
    all_roles = {k for k, _ in LEGEND_ITEMS}
    shown = METHODS[method].roles if method in METHODS else all_roles     # a method's panels show only its roles
    parts = [f'<span class="hv-key">{swatch(k)}{esc(v)}</span>' for k, v in LEGEND_ITEMS if k in shown]
    return f'<div class="hv-legend">{"".join(parts)}</div>'


def tree_key_html() -> str:
    """The tree view's key as lines, for the teaching text beside the tree."""
    return "<br>\n".join(f"{swatch(k)} {esc(v)}" for k, v in TREE_KEY_ITEMS)


def tree_key_line() -> str:
    """The tree figure's key in one wrapping line above it, outside the figure's scroll box."""
    parts = "".join(f'<span class="hv-key">{swatch(k)}{esc(KEY_NAMES[k])}</span>' for k in STATUS_ORDER)
    return f'<div class="hv-legend hv-tree-key"><b>Draft tree</b>{parts}</div>'


def sequence_html(step: Optional[Step]) -> str:
    """The sequence draft d the target verified, chips coloured by provenance, grouped by tree."""
    if step is None:
        return _box('<p class="hv-muted">Run a prompt or load a trace to see the sequence draft.</p>')
    if is_prefill(step):
        return _box(f'<p class="hv-muted">{esc(PREFILL_TEXT)}</p>')
    if tree_on_target(step.method):
        n = sum(len(t.nodes) for t in step.trees)
        return _box(f'<p class="hv-muted">{esc(method_label(step.method))} has no sequence draft: the target '
                    f'verifies the whole {n}-token tree itself in one forward pass.</p>')
    if verifies(step.method) == TOKEN:
        return _box(f'<p class="hv-muted">{esc(method_label(step.method))} has no draft: one target forward, one token.</p>')
    if not step.sequence:
        return _box('<p class="hv-muted">This step has no sequence draft.</p>')
    groups: list[tuple[Optional[int], list[str]]] = []
    for i, s in enumerate(step.sequence):
        title = f"position {i + 1} · token id {s.token} · {SOURCE_LABELS.get(s.source, s.source)}"
        if s.tree is not None:
            title += f" · tree {s.tree + 1}"
        c = chip(s.text, s.source, title)
        if groups and groups[-1][0] == s.tree:
            groups[-1][1].append(c)
        else:
            groups.append((s.tree, [c]))
    parts = []
    for tree_idx, chips in groups:
        cap = f"tree {tree_idx + 1}" if tree_idx is not None else "M"
        parts.append(f'<span class="hv-group"><span class="hv-cap">{cap}</span>{"".join(chips)}</span>')
    n_trees = len(step.trees)
    head = (f'<div class="hv-head">Sequence draft: <b>{len(step.sequence)}</b> tokens'
            + (f' from <b>{n_trees}</b> tree{"s" if n_trees != 1 else ""}' if n_trees else "") + '</div>')
    return _box(head + f'<div class="hv-chips">{"".join(parts)}</div>')


def tree_html(tree: DraftTree, number: int) -> str:
    """One draft tree as rows of chips by depth (the HTML export and the side-by-side view; the app's
    own tree is a plotly figure), coloured by what its verifier did with each node."""
    status = node_status(tree)
    who = "M" if tree.verifier == "intermediate" else "T"
    rows = []
    for d in range(1, tree.depth + 1):
        chips = "".join(chip(n.text, status[n.id], f"node {n.id} · parent {n.parent} · score {n.score:.2f}",
                             "✓" if status[n.id] == "tree" else "")
                        for n in tree.nodes if n.depth == d)
        rows.append(f'<div class="hv-depth-row"><span class="hv-depth-cap">depth {d}</span>{chips}</div>')
    bonus = chip(tree.bonus_text, bonus_status(tree), f"{who}'s own token after the accepted path", "+")
    head = (f'<div class="hv-head">Tree {number}: {len(tree.nodes)} nodes, {who} accepted a path of '
            f'{len(tree.accepted)} then added {bonus}</div>')
    return f'<div class="hv-panel">{head}{"".join(rows)}</div>'


VERDICT_HEAD = '<div class="hv-head">Target T\'s verdict</div>'


def verdict_html(step: Optional[Step]) -> str:
    """What the target did with the draft: accepted prefix, first rejected token, its own token."""
    if step is None:
        return _box('<p class="hv-muted">The target\'s verdict appears here.</p>')
    bonus = step.target_bonus_text
    if is_prefill(step) and verifies(step.method) != TOKEN:
        text = step.new_text[0] if step.new_text else bonus
        return _box(VERDICT_HEAD + f'<div class="hv-chips">{chip(text, "target_bonus", "the target picked the first token")}</div>'
                    '<div class="hv-sum">Prefill: the target read the prompt and wrote the first token itself.</div>')
    if verifies(step.method) == TOKEN:
        text = step.new_text[0] if step.new_text else bonus
        return _box(VERDICT_HEAD + f'<div class="hv-chips">{chip(text, "target_bonus", "target T generated this token")}</div>'
                    '<div class="hv-sum">No draft: the target ran one forward pass for one token.</div>')
    if tree_on_target(step.method):
        tree = step.trees[0] if step.trees else None
        by_id = {n.id: n for n in tree.nodes} if tree else {}
        acc = [by_id[a] for a in tree.accepted] if tree else []
        chips = [chip(n.text, "tree", f"accepted · depth {n.depth}", "✓") for n in acc]
        on_path = ({0} | set(tree.accepted)) if tree else set()
        losers = [n for n in tree.nodes if n.parent in on_path and n.id not in on_path] if tree else []
        chips.append(chip(bonus, "target_bonus", "the target's own token after the accepted path"))
        size = len(tree.nodes) if tree else 0
        summary = (f'The target checked all <b>{size}</b> tree tokens in one forward pass, accepted a path of '
                   f'<b>{len(acc)}</b> (rejecting {len(losers)} alternative{"s" if len(losers) != 1 else ""} along the way) '
                   f'and added its own token → <b>{len(step.new_tokens)}</b> new token{"s" if len(step.new_tokens) != 1 else ""}.')
        return _box(VERDICT_HEAD + f'<div class="hv-chips">{"".join(chips)}</div><div class="hv-sum">{summary}</div>')
    seq = step.sequence
    n = max(0, min(step.target_accepted, len(seq)))
    chips = []
    for i, s in enumerate(seq):
        if i < n:
            chips.append(chip(s.text, s.source, "accepted by the target", "✓"))
        elif i == n:
            chips.append(chip(s.text, "rejected", "first token the target disagreed with", "✗", "hv-rejected"))
        else:
            chips.append(chip(s.text, "discarded", "dropped: it came after a rejected token", extra_class="hv-dropped"))
    chips.append('<span class="hv-arrow">→</span>')
    chips.append(chip(bonus, "target_bonus",
                      "the target's own token " + ("(bonus: every draft token was accepted)" if n == len(seq)
                                                   else "(correction of the rejected token)")))
    if n == len(seq):
        summary = (f'The target accepted <b>all {len(seq)}</b> draft tokens and added a bonus token → '
                   f'<b>{len(step.new_tokens)}</b> new tokens from one target forward pass.')
    else:
        summary = (f'The target accepted <b>{n}</b> of {len(seq)} draft tokens, rejected '
                   f'<b>{token_label(seq[n].text, 16)}</b> and wrote <b>{token_label(bonus, 16)}</b> instead → '
                   f'<b>{len(step.new_tokens)}</b> new token{"s" if len(step.new_tokens) != 1 else ""} '
                   f'from one target forward pass.')
    return _box(VERDICT_HEAD + f'<div class="hv-chips">{"".join(chips)}</div><div class="hv-sum">{summary}</div>')


def output_html(trace: Optional[Trace], upto: Optional[int] = None, highlight: Optional[int] = None) -> str:
    """The output so far, coloured by producer. Consecutive tokens of one step and one producer
    share a span, which keeps the fragment small for long runs (a 512-token run is ~10 KB)."""
    if trace is None:
        return _box('<p class="hv-muted">The generated text appears here.</p>', "hv-output")
    steps = trace.steps if upto is None else trace.steps[: upto + 1]
    parts = []
    prompt = trace.meta.get("prompt")
    if isinstance(prompt, str) and prompt:
        parts.append(f'<span class="hv-prompt" title="prompt">{esc(prompt)}</span> ')
    for st in steps:
        run: list[str] = []
        src = None

        def flush() -> None:
            if run:
                cls = "hv-tok hv-cur" if st.index == highlight else "hv-tok"
                title = f"step {st.index + 1}: {SOURCE_LABELS.get(src, src)}"
                text = esc("".join(run)).replace("\n", "<br>")
                parts.append(f'<span class="{cls}" style="background:{TINTS.get(src, "#eee")};'
                             f'border-bottom-color:{COLORS.get(src, "#888")}" title="{esc(title)}">{text}</span>')

        for text, source in zip(st.new_text, st.new_sources):
            if source != src:
                flush()
                run, src = [], source
            run.append(text)
        flush()
    if not steps:
        parts.append('<span class="hv-muted">(no tokens yet)</span>')
    n_tok = sum(len(s.new_tokens) for s in steps)
    head = f'<div class="hv-head">Output: {n_tok} token{"s" if n_tok != 1 else ""} after step {len(steps)}</div>'
    return _box(head + f'<div class="hv-text" tabindex="0" role="region" aria-label="Output text">{"".join(parts)}</div>', "hv-output")


def _fmt(v: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "–" if v is None else f"{v:.{digits}f}{suffix}"


def run_setup_line(meta: dict) -> str:
    """Where a run ran and with which kernels and drafter vocabulary (from its trace's meta)."""
    parts = []
    if meta.get("device"):
        parts.append(f'{meta["device"]} {meta.get("dtype", "")}'.strip())
    if meta.get("w4_kernel"):
        parts.append(f'T kernel {meta["w4_kernel"]}' + (" (batch-invariant)" if meta.get("target_batch_invariant") else ""))
    if meta.get("intermediate_w4_kernel") and meta.get("intermediate_w4_kernel") != meta.get("w4_kernel"):
        parts.append(f'M kernel {meta["intermediate_w4_kernel"]}')
    if meta.get("intermediate_lm_head"):    # stack.py quantize_lm_head: M's LM head quantized
        parts.append(f'M\'s LM head {meta["intermediate_lm_head"]}')
    for slot, q in (meta.get("heads_quantize") or {}).items():     # stack.py: a head's own linears quantized
        parts.append(f"{slot.upper()} {q}")
    if meta.get("w4_fast_path"):          # the start-up proof of the W4 kernel's fast variants (GPU)
        parts.append(str(meta["w4_fast_path"]))
    parts += head_type_notes(meta.get("head_types") or {})
    vocab = str(meta.get("draft_vocab") or "")
    if vocab and vocab != "full":
        name = vocab.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".json")
        parts.append(f"drafter vocabulary {name}" + (" (M too)" if meta.get("intermediate_vocab") == "draft" else ""))
    return " · ".join(esc(p) for p in parts)


def head_type_notes(head_types: dict[str, str]) -> list[str]:
    """"EAGLE-3 head on M and T" for each head type but the default one (the EAGLE-1/2 layout)."""
    default = next(iter(HEAD_TYPES))
    on = {"intermediate": "M", "target": "T"}
    notes = []
    for kind in dict.fromkeys(v for v in head_types.values() if v != default):
        bases = dict.fromkeys(on.get(HEAD_SLOTS[k][0], k) if k in HEAD_SLOTS else k
                              for k, v in head_types.items() if v == kind)
        notes.append(f"{head_label(kind)} head on " + " and ".join(bases))
    return notes


def _same_as_ar(method: str, tokens: list[int], ar: list[int], sampled: bool) -> str:
    """Lossless check of one run against AR's output, over the tokens both show."""
    if method == BASELINE:
        return '<span class="hv-muted">reference</span>'
    if sampled:   # sampling is lossless in distribution, not token for token
        return '<span class="hv-muted" title="sampled: same distribution, not the same text">–</span>'
    i = first_difference(tokens, ar)
    if i is None:
        return "✓ yes"
    return (f'<span class="hv-warn-text" title="the target&#x27;s logits for 1 and for several verified tokens can '
            f'round differently in fp16/bf16, so near-ties flip">✗ from token {i + 1}</span>')


def shown_steps(runs: list[Trace], upto: Optional[dict[str, int]] = None) -> dict[str, list[Step]]:
    """Each run's steps up to the step shown (`upto`: method -> last step index; others: all)."""
    out = {}
    for t in runs:
        method = run_method(t)
        out[method] = t.steps if not upto or method not in upto else t.steps[: upto[method] + 1]
    return out


def run_method(t: Trace) -> str:
    return str(t.meta.get("method", t.steps[0].method if t.steps else "?"))


def where_measured(meta: dict) -> str:
    """The machine a run's times come from, in words (trace meta)."""
    device = str(meta.get("gpu") or meta.get("device") or "")
    return {"cuda": "a CUDA GPU", "cpu": "a CPU", "": "an unnamed device"}.get(device, device)


# HierSpec's speedup over each other method in each of a visitor's repeated runs of one prompt and
# one set of settings: time scale -> other method -> one speedup per run, oldest first
Repeats = dict[str, dict[str, list[float]]]


def ratio_text(speedup: float, runs: Optional[list[float]] = None, bold: bool = True) -> str:
    """A speedup; over repeated runs (two or more), their median and range instead."""
    b, unb = ("<b>", "</b>") if bold else ("", "")
    if not runs or len(runs) < 2:
        return f"{b}{speedup:.2f}×{unb}"
    return (f"{b}median {statistics.median(runs):.2f}×{unb} (range {min(runs):.2f}–{max(runs):.2f} "
            f"over {len(runs)} runs)")


def typical_speedup(speedup: float, runs: Optional[list[float]] = None) -> float:
    """The speedup that decides the wording: over repeated runs (two or more) their median."""
    return statistics.median(runs) if runs and len(runs) >= 2 else speedup


def speed_phrase(speedup: float, other: str, runs: Optional[list[float]] = None) -> str:
    """"1.22× faster than EAGLE-2"; over repeated runs (`runs`) the median decides the wording."""
    faster = "faster than" if typical_speedup(speedup, runs) >= 1 else "the speed of"
    return f"{ratio_text(speedup, runs)} {faster} {esc(method_label(other))}"


def speed_sentences(ratios: list[Ratio], repeats: dict[str, list[float]]) -> str:
    """Every run against HierSpec: "HierSpec is 1.20× faster than EAGLE-2 · 1.70× faster than
    Autoregressive", then one sentence for each method that was faster ("EAGLE-3 is 1.06× faster
    than HierSpec on this run")."""
    subject = esc(method_label(SUBJECT))
    ahead = [r for r in ratios if typical_speedup(r.speedup, repeats.get(r.other)) >= 1]
    behind = [r for r in ratios if r not in ahead]
    parts = [f"{subject} is " + " · ".join(speed_phrase(r.speedup, r.other, repeats.get(r.other)) for r in ahead)
             ] if ahead else []
    if behind:
        faster = [f"<b>{esc(method_label(r.other))}</b> is "
                  + ratio_text(1 / r.speedup, [1 / x for x in repeats.get(r.other) or [] if x > 0])
                  for r in sorted(behind, key=lambda r: r.speedup)]
        parts.append(" · ".join(faster) + f" faster than {subject} on this run")
    return ". ".join(parts)


def speed_line_html(steps: dict[str, list[Step]], meta: dict, time_scale: str = MEASURED,
                    repeats: Optional[dict[str, list[float]]] = None, lead: str = "") -> str:
    """HierSpec against each other run over the same first N tokens, and where the times come from.
    `repeats`: other method -> HierSpec's speedup in each of the visitor's runs of this prompt and
    settings; with two or more, the line gives their median and range. `lead`: words before it."""
    ratios = equal_token_ratios(steps)
    if not ratios:
        return ""
    n = ratios[0].n_tokens
    repeats = repeats or {}
    line = speed_sentences(ratios, repeats)
    if time_scale == RETIMED:
        where = (f're-timed at real scale, <b>projected</b>: {esc(str(meta.get("retimed_on", "")))}, the same '
                 f'tokens and accept decisions as measured on {esc(where_measured({"device": meta.get("measured_device"), "gpu": meta.get("measured_gpu")}))}')
    else:
        where = f"as measured on {esc(where_measured(meta))}"
    k = max((len(v) for v in repeats.values()), default=0)
    again = (f" Median and range over your {k} runs of this prompt and these settings (the first N tokens of "
             "each).") if k >= 2 else ""
    return (f'<div class="hv-speedup">{esc(lead)}{line}</div>'
            f'<div class="hv-muted">Over the first {n} token{"s" if n != 1 else ""} of every run, {where}.{again}</div>')


def whole_run_ratios(runs: list[Trace], time_scale: str = MEASURED) -> dict[str, float]:
    """HierSpec's speedup over each other run, over the first N tokens of the whole runs (N: the
    fewest any produced), at `time_scale`: the headline's numbers."""
    timed = at_time_scale(runs, time_scale)
    return {r.other: r.speedup for r in equal_token_ratios({run_method(t): t.steps for t in timed})}


# The app's What-if tab (hierviz.app.layout gives the tab this id); a link to it carries the id in
# data-hv-tab, and the page's click listener (layout.KEYS_JS) opens the tab
WHATIF_TAB = "whatif"


def tab_link(tab: str, text: str) -> str:
    """A link that opens the app's tab `tab`; outside the app it points at the page's own #tab."""
    return f'<a href="#{esc(tab)}" class="hv-tab-link" data-hv-tab="{esc(tab)}">{esc(text)}</a>'


def headline_html(runs: list[Trace], time_scale: str = MEASURED, repeats: Optional[Repeats] = None,
                  lead: str = "") -> str:
    """The whole comparison in one line for the top of the page, at the chosen time scale; for a
    small stack re-timed, the measured ratios beside it, so the first screen never hides either.
    `repeats`: the visitor's repeated runs of this prompt and settings (median and range shown);
    `lead`: words before the line ("Your live run: ")."""
    if not runs:
        return ""
    if time_scale == RETIMED and not real_scale_available():
        time_scale = MEASURED
    timed = at_time_scale(runs, time_scale)
    repeats = repeats or {}
    line = speed_line_html({run_method(t): t.steps for t in timed}, timed[0].meta, time_scale, repeats.get(time_scale),
                           lead)
    if not line:
        return ""
    measured = ""
    if time_scale == RETIMED:
        ratios = equal_token_ratios({run_method(t): t.steps for t in runs})
        # one short line under the headline: short method names, the why by the statistics
        measured = ('<div class="hv-muted">As measured on ' + esc(where_measured(runs[0].meta)) + ": "
                    + " · ".join(f"{ratio_text(r.speedup, repeats.get(MEASURED, {}).get(r.other), False)} "
                                 f"{esc(short(r.other))}" for r in ratios)
                    + " — a 135M target cannot show the method: " + tab_link(WHATIF_TAB, "What-if tab") + ".</div>"
                    if is_small_stack(runs[0].meta) and ratios else "")
    return f'<div class="hv-headline">{line}{measured}</div>'


def and_list(words: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]


def live_headline_html(runs: list[Trace], methods: list[str], running: Optional[str], where: str,
                       time_scale: str = MEASURED) -> str:
    """A live run's headline while it runs: what is running, and what the runs so far measured
    against each other over the same first N tokens (speed_sentences: every method with tokens,
    in comparison order, a faster one named as faster); before two runs have tokens, what runs.
    `where`: the machine in words ("CPU"); `time_scale`: measured, or re-timed (labelled projected)."""
    if time_scale == RETIMED and not real_scale_available():
        time_scale = MEASURED
    # a run counts once it decoded past its prefill: prefills alone say nothing of decoding speed
    timed = at_time_scale([t for t in runs if len(t.steps) > 1], time_scale)
    ratios = equal_token_ratios({run_method(t): t.steps for t in timed})
    now = (f"Now running {esc(method_label(running))} (method {methods.index(running) + 1} of {len(methods)})"
           if running in methods else "Loading and warming up the models")
    live = f"<b>Live</b> on this {esc(where)}"
    if not ratios:
        names = and_list([esc(method_label(m)) for m in methods])
        return (f'<div class="hv-headline hv-live"><div class="hv-speedup">{live}: {now[0].lower() + now[1:]}</div>'
                f'<div class="hv-muted">{names} run in turn on your prompt; their speeds are compared here over '
                'equal tokens as soon as two of them are decoding.</div></div>')
    n = ratios[0].n_tokens
    how = "re-timed at real scale (<b>projected</b>)" if time_scale == RETIMED else "measured"
    line = (f"{live}, {how} so far (first {n} token{'s' if n != 1 else ''} of each run): "
            + speed_sentences(ratios, {}))
    return (f'<div class="hv-headline hv-live"><div class="hv-speedup">{line}</div>'
            f'<div class="hv-muted">{now}; the whole comparison when the run ends.</div></div>')


def small_stack_html(meta: dict, time_scale: str = MEASURED) -> str:
    """Why a small stack's measured numbers cannot show the method, and where the real-scale result is."""
    if not is_small_stack(meta):
        return ""
    device = str(meta.get("measured_device") or meta.get("device") or "")
    why = ("on a GPU a 135M target is launch-bound: one forward costs about the same for 1 token or 64, "
           "so checking many drafted tokens at once saves nothing and every extra model call is overhead"
           if device == "cuda" else
           "on a CPU a 135M target is compute-bound: every verified token costs nearly a full step")
    headline = whatif_headline()
    real = (f' At Llama-3-70B / 8B shapes on an H200 the <b>{tab_link(WHATIF_TAB, "What-if")}</b> tab projects {esc(method_label(SUBJECT))} at '
            + and_list([f'<b>{x:.2f}×</b> {esc(method_label(m))}' for m, x in headline.items()])
            + ' (the paper\'s trees; assumed acceptance rates, EAGLE-3\'s published ones for its heads).') if headline else ""
    shown = ("These numbers are the small stack's tokens priced at real scale; choose "
             f"“{MEASURED}” for the times it took." if time_scale == RETIMED else
             f"Choose “{RETIMED}” to price these same tokens at Llama-3-70B / 8B.")
    return (f'<div class="hv-teach">Measured, this 135M stack cannot show the method: {why}; and this M agrees '
            f'with T on only 55 % of Spec-Bench tokens, so T rejects its sequence early.{real} {esc(shown)}</div>')


def stats_html(runs: list[Trace], upto: Optional[dict[str, int]] = None, time_scale: str = MEASURED) -> str:
    """A table with one column per run: speed, tau of each level, per-depth acceptance; above it the
    speed line, comparing runs only over the same number of tokens. `time_scale`: MEASURED, or
    RETIMED (every time priced at real scale, hierviz.retime; labelled projected)."""
    if not runs:
        return _box('<p class="hv-muted">Statistics appear once a run has steps.</p>')
    if time_scale == RETIMED and not real_scale_available():
        time_scale = MEASURED          # no profiles to price with: say what the numbers are
    runs = at_time_scale(runs, time_scale)
    steps_by_method = shown_steps(runs, upto)
    cols = [(m, trace_stats(steps)) for m, steps in steps_by_method.items()]
    shown = {run_method(t): output_tokens(t, steps_by_method[run_method(t)]) for t in runs}   # output up to the step shown
    projected = " (projected)" if time_scale == RETIMED else ""
    rows = [
        ("tokens", lambda s: str(s["new_tokens"])),
        (f"decode time (ms){projected}", lambda s: f'{s["total_ms"]:.0f}'),
        (f"<b>tokens / s</b>{projected}", lambda s: f'<b>{s["tokens_per_s"]:.1f}</b>'),
        ("τ target (tokens / T pass)", lambda s: _fmt(s["tau_target"])),
        ("τ intermediate (tokens / M tree)", lambda s: _fmt(s["tau_intermediate"])),
        ("mean sequence draft", lambda s: _fmt(s["mean_sequence_len"] or None, 1)),
    ]
    if any(s["undraftable_rejections"] for _, s in cols):
        # the verifier's token lay outside the head's draft vocabulary: no tree could have held it
        rows.append(("rejections no draft could avoid",
                     lambda s: f'{s["undraftable_rejections"]} of {s["tree_rejections"]}' if s["tree_rejections"] else "–"))
    head = "".join(f"<th>{esc(method_label(m))}</th>" for m, _ in cols)
    body = "".join(f"<tr><td>{name}</td>" + "".join(f"<td>{f(s)}</td>" for _, s in cols) + "</tr>"
                   for name, f in rows)
    # (a hand-made trace's texts are invented: nothing to check)
    if BASELINE in shown and len(cols) > 1 and not any(t.meta.get("synthetic") for t in runs):
        sampled = float((runs[0].meta.get("settings") or {}).get("temperature") or 0) > 0
        body += (f"<tr><td>same text as {esc(method_label(BASELINE))}</td>"
                 + "".join(f"<td>{_same_as_ar(m, shown[m], shown[BASELINE], sampled)}</td>" for m, _ in cols) + "</tr>")
    # per-depth acceptance as small bars
    depth_rows = []
    max_d = max((max(s["per_depth_acceptance"], default=0) for _, s in cols), default=0)
    for d in range(1, max_d + 1):
        cells = []
        for _, s in cols:
            r = s["per_depth_acceptance"].get(d)
            cells.append("<td>–</td>" if r is None else
                         f'<td><span class="hv-bar"><span style="width:{100 * r:.0f}%"></span></span> {100 * r:.0f}%</td>')
        depth_rows.append(f"<tr><td>accepted at depth {d}</td>{''.join(cells)}</tr>")
    speed_html = speed_line_html(steps_by_method, runs[0].meta, time_scale) + small_stack_html(runs[0].meta, time_scale)
    note = ""
    if any(t.meta.get("synthetic") for t in runs):
        note = '<div class="hv-warn">Hand-made trace: no model ran and the timings are invented.</div>'
    elif any(str(t.meta.get("stack", "")).startswith("tiny") for t in runs):
        note = '<div class="hv-warn">Tiny random-weight stack: the text is gibberish and the numbers only test the plumbing.</div>'
    setup = run_setup_line(runs[0].meta)
    if setup:
        note += f'<div class="hv-muted">Ran on {setup}.</div>'
    # the table scrolls sideways on a narrow screen; focusable, so a keyboard can scroll it too
    return _box(speed_html + '<div class="hv-table-scroll" tabindex="0" role="region" aria-label="Statistics table">'
                f'<table class="hv-stats"><thead><tr><th><span class="hv-sr-only">measure</span></th>{head}</tr></thead>'
                f'<tbody>{body}{"".join(depth_rows)}</tbody></table></div>' + note)
