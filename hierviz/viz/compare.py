"""HierSpec and EAGLE-2 side by side at the same point in the text, for teaching.

For the inspected step of one run, the other method's step at which it had produced the same
number of output tokens (or the nearest count not beyond it) is shown beside it: each column holds
that step's draft tree(s) as rows of chips by depth (the same drawing as the HTML export, so both
trees are drawn at one scale), the sequence draft and the target's verdict. The point it makes:
EAGLE-2's target checks a whole tree, HierSpec's a short sequence.
"""
from __future__ import annotations

from typing import Optional

from hierviz.methods import METHODS
from hierviz.retime import tokens_of
from hierviz.trace import Step, Trace
from hierviz.viz.panels import is_prefill, sequence_html, tree_html, verdict_html
from hierviz.viz.style import esc, method_label



def counterpart(method: str) -> Optional[str]:
    """The run shown beside a run of `method` (its registry entry's counterpart: the teaching
    comparison is HierSpec's sequence against EAGLE-2's tree)."""
    m = METHODS.get(method)
    return m.counterpart if m else None


def tokens_after(steps: list[Step], i: int) -> int:
    """Output tokens a run had produced once its step i (0-based) was done."""
    return tokens_of(steps[: i + 1])


def matching_step(steps: list[Step], n_tokens: int) -> Optional[int]:
    """The last step (0-based) after which the run had produced at most `n_tokens` tokens: the step
    at the same count when there is one, else the nearest count not beyond it; None when even its
    first step produced more, or it has no steps."""
    produced, match = 0, None
    for i, s in enumerate(steps):
        produced += len(s.new_tokens)
        if produced > n_tokens:
            break
        match = i
    return match


def target_checks(step: Step) -> str:
    """What the target verified in one forward this step, in words."""
    if is_prefill(step):
        return "prefill: every model reads the prompt, T writes the first token"
    if step.sequence:
        m_nodes = sum(len(t.nodes) for t in step.trees if t.verifier == "intermediate")
        via = f" (M checked {m_nodes} tree nodes to build it)" if m_nodes else ""
        return f"T checks a <b>{len(step.sequence)}-token sequence</b>{via}"
    t_nodes = sum(len(t.nodes) for t in step.trees if t.verifier == "target")
    if t_nodes:
        return f"T checks a <b>{t_nodes}-node tree</b>"
    return "T decodes one token"


def step_column(trace: Trace, i: int, where: str) -> str:
    """One run's step i: a heading (`where`: its place in the text), the trees, sequence and verdict."""
    st = trace.steps[i]
    name = esc(method_label(str(trace.meta.get("method", st.method))))
    trees = "".join(tree_html(t, k + 1) for k, t in enumerate(st.trees))
    seq = sequence_html(st) if st.sequence or is_prefill(st) else ""
    return (f'<div class="hv-pair-col"><div class="hv-head"><b>{name}</b>, step {i + 1} of {len(trace.steps)} · '
            f'{where}</div><div class="hv-sum">{target_checks(st)}</div>{trees}{seq}{verdict_html(st)}</div>')


def _note(text: str) -> str:
    return f'<div class="hv-panel"><p class="hv-muted">{esc(text)}</p></div>'


def side_by_side_html(main: Optional[Trace], i: int, runs: list[Trace], live: bool = False) -> str:
    """The inspected step i (0-based) of `main` beside its counterpart's step at the same token count
    (`counterpart`); a short note when there is nothing to pair. `live`: the runs come from a live run,
    where a method missing may simply not have started yet."""
    if main is None or not main.steps:
        return _note("Run a prompt or load a trace to compare HierSpec and EAGLE-2 step by step.")
    method = str(main.meta.get("method", main.steps[0].method))
    other_method = counterpart(method)
    if other_method is None:
        return _note("Side by side pairs HierSpec with EAGLE-2: inspect one of those two runs.")
    other = next((t for t in runs if t.meta.get("method") == other_method), None)
    other_name = method_label(other_method)
    if (other is None and live) or (other is not None and not other.steps):
        return _note(f"{other_name} has not run yet: a live run runs HierSpec, then EAGLE-2. "
                     f"It appears here once it has steps.")
    if other is None:
        return _note(f"This comparison has no {other_name} run to show beside it.")
    i = max(0, min(i, len(main.steps) - 1))
    n = tokens_after(main.steps, i)
    j = matching_step(other.steps, n)
    if j is None:
        return _note(f"{other_name}'s first step already produced more than {n} tokens.")
    m = tokens_after(other.steps, j)
    same = ("the same count" if m == n else "its last step" if j == len(other.steps) - 1
            else f"the nearest count not beyond {n}")
    left = step_column(main, i, f"{n} token{'s' if n != 1 else ''} of output so far")
    right = step_column(other, j, f"after {m} token{'s' if m != 1 else ''} ({same})")
    head = (f'<div class="hv-head">At the same point in the text: {esc(method_label(method))} after {n} tokens, '
            f'{esc(other_name)} after {m}</div>')
    return f'<div class="hv-panel hv-pair">{head}<div class="hv-pair-grid">{left}{right}</div></div>'
