"""Plotly figure of the draft tree(s) of one step.

Layout: depth runs left to right (the root, i.e. the last accepted token, at the left), one row
per leaf. A parent sits on the row of its first child, and the accepted child always comes
first, so the verifier's accepted path and its bonus token form one straight top row: that row
is exactly what the step adds to the output. Several trees of one HierSpec round are placed
left to right in the order they were drafted; each next tree grows from the previous bonus.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import plotly.graph_objects as go

from hierviz.trace import DraftTree
from hierviz.viz.style import COLORS, ROLE_MARKS, TEXT_ON, plotly_label, visible_token
from hierviz.viz.unchecked import unchecked_figure

CHIP_FONT_PX = 16   # node chips read on a projector at the back of a room
COL_PX = 146        # pixels per depth column; the figure width is fixed so labels never overlap
ROW_PX = 30         # pixels per leaf row
LABEL_CHARS = 9     # longest token label drawn in a node chip
CHAR_PX = 10.1      # approximate width of one label character at CHIP_FONT_PX (DejaVu Sans Mono)
TITLE_FONT_PX = 15
TITLE_CHAR_PX = 8.6  # approximate width of one title character: the figure is at least its title wide
GAP_COLS = 0.6      # empty columns between two trees of one round
BONUS = -1          # pseudo node id of the verifier's bonus token
ROOT = 0


@dataclass
class PlacedNode:
    id: int          # node id, 0 = root, -1 = bonus
    x: float         # column (depth + tree offset)
    y: float         # row (0 = top)
    status: str      # root / tree (accepted) / rejected / discarded / intermediate_bonus / target_bonus
    text: str
    token: int
    depth: int
    score: float | None = None
    logprob: float | None = None
    parent: int | None = None


def node_status(tree: DraftTree) -> dict[int, str]:
    """'tree' (on the accepted path), 'rejected' (its parent is the root or an accepted node, so
    the verifier compared it with its own token at that spot and it lost), or 'discarded' (it
    grows from a rejected token, so it could never count)."""
    accepted = set(tree.accepted)
    on_path = accepted | {ROOT}
    out = {}
    for n in tree.nodes:
        if n.id in accepted:
            out[n.id] = "tree"
        elif n.parent in on_path:
            out[n.id] = "rejected"
        else:
            out[n.id] = "discarded"
    return out


def bonus_status(tree: DraftTree) -> str:
    return "intermediate_bonus" if tree.verifier == "intermediate" else "target_bonus"


def layout_tree(tree: DraftTree, x0: float = 0.0) -> list[PlacedNode]:
    """Tidy layered layout of one tree; nodes unreachable from the root are left out."""
    status = node_status(tree)
    accepted = set(tree.accepted)
    children: dict[int, list] = defaultdict(list)
    for n in tree.nodes:
        children[n.parent].append(n)
    for kids in children.values():
        # accepted child first, then by drafter score (best on top)
        kids.sort(key=lambda n: (n.id not in accepted, -n.score, n.id))
    last = tree.accepted[-1] if tree.accepted else ROOT

    # Iterative pre-order DFS (trees from files may be deep or malformed). Leaves take rows in
    # visiting order; a parent then takes its first child's row, so rows never collide within a column.
    seen: set[int] = set()
    order: list[tuple[int, int]] = []          # (node id, column) in pre-order
    first_child: dict[int, int] = {}
    stack = [(ROOT, 0)]
    while stack:
        nid, col = stack.pop()
        if nid in seen:
            continue
        seen.add(nid)
        order.append((nid, col))
        kids = [] if nid == BONUS else [k.id for k in children.get(nid, []) if k.id not in seen]
        if nid == last:
            kids = [BONUS] + kids
        if kids:
            first_child[nid] = kids[0]
        stack.extend((k, col + 1) for k in reversed(kids))
    rows: dict[int, int] = {}
    next_row = 0
    for nid, _ in order:                    # leaves numbered in pre-order
        if nid not in first_child:
            rows[nid] = next_row
            next_row += 1
    for nid, _ in reversed(order):          # children are after their parent in pre-order
        if nid in first_child:
            rows[nid] = rows[first_child[nid]]
    cols = dict(order)
    placed: list[PlacedNode] = []
    by_id = {n.id: n for n in tree.nodes}
    for nid, c in cols.items():
        x, y = x0 + c, float(rows[nid])
        if nid == ROOT:
            placed.append(PlacedNode(ROOT, x, y, "root", tree.root_text, tree.root_token, 0))
        elif nid == BONUS:
            placed.append(PlacedNode(BONUS, x, y, bonus_status(tree), tree.bonus_text, tree.bonus_token,
                                     len(tree.accepted) + 1, parent=last))
        else:
            n = by_id[nid]
            placed.append(PlacedNode(n.id, x, y, status[n.id], n.text, n.token, n.depth, n.score, n.logprob, n.parent))
    return placed


def _chip_px(text: str, mark: str = "") -> float:
    """Drawn width of a node chip: its label, then a space and its role mark if it has one."""
    chars = len(visible_token(text, LABEL_CHARS)) + (len(mark) + 1 if mark else 0)
    return chars * CHAR_PX + 14


def _node_px(p: PlacedNode) -> float:
    return _chip_px(p.text, ROLE_MARKS[p.status])


STATUS_NAMES = {
    "root": "root (last accepted token)",
    "tree": "accepted by the verifier",
    "rejected": "checked and rejected",
    "discarded": "grows from a rejected token",
    "intermediate_bonus": "M's bonus token",
    "target_bonus": "T's bonus token",
}


# The key's words, short so that the key fits a narrow tree box in one or two lines
KEY_NAMES = {
    "root": "last accepted",
    "tree": "accepted",
    "rejected": "rejected",
    "discarded": "after a rejection",
    "intermediate_bonus": "M's bonus",
    "target_bonus": "T's bonus",
}


def _hover(p: PlacedNode, tree_idx: int) -> str:
    lines = [f"<b>{plotly_label(p.text, 40)}</b>", f"token id {p.token}", STATUS_NAMES[p.status]]
    if p.score is not None:
        lines += [f"depth {p.depth}",
                  f"p(token | parent) = {math.exp(p.logprob):.3f}" if p.logprob is not None and p.logprob <= 0 else "",
                  f"log-prob {p.logprob:.3f}", f"cumulative log-prob (rank key) {p.score:.3f}"]
    lines.append(f"tree {tree_idx + 1}")
    return "<br>".join(l for l in lines if l)


_UNIT = 1.0 / COL_PX    # data units per pixel along x
_EDGE_KIND = {"tree": "tree", "intermediate_bonus": "bonus", "target_bonus": "bonus"}
_EDGE_STYLES = {"other": dict(color="#B8BEC8", width=1.2), "tree": dict(color=COLORS["tree"], width=3.5),
                "bonus": dict(color="#555", width=2.5, dash="dot")}
STATUS_ORDER = ("root", "tree", "rejected", "discarded", "intermediate_bonus", "target_bonus")


def _title(title: str) -> dict | None:
    return dict(text=title, x=0.01, font=dict(size=TITLE_FONT_PX)) if title else None


def _empty_figure(title: str, empty: str) -> go.Figure:
    return unchecked_figure([], dict(
        height=170, xaxis=dict(visible=False), yaxis=dict(visible=False), title=_title(title),
        annotations=[dict(text=empty, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=15))],
        margin=dict(l=10, r=10, t=10, b=10), plot_bgcolor="white"))


def _place_trees(trees: list[DraftTree]) -> tuple[list[tuple[int, PlacedNode]], list[tuple[PlacedNode, PlacedNode]]]:
    """(tree index, node) of every tree laid out left to right, and the (bonus, next root)
    connectors: each next tree grows from the previous tree's bonus token."""
    all_nodes: list[tuple[int, PlacedNode]] = []
    x0 = 0.0
    prev_bonus: PlacedNode | None = None
    connectors = []
    for ti, t in enumerate(trees):
        placed = layout_tree(t, x0)
        all_nodes += [(ti, p) for p in placed]
        root = next(p for p in placed if p.id == ROOT)
        if prev_bonus is not None:
            connectors.append((prev_bonus, root))
        prev_bonus = next((p for p in placed if p.id == BONUS), None)
        x0 = max(p.x for p in placed) + 1 + GAP_COLS
    return all_nodes, connectors


def _figure_size(all_nodes: list[tuple[int, PlacedNode]], title: str = "") -> tuple[int, int, int, float]:
    """(rows, width px, height px, right end of the x range) of the laid-out nodes."""
    n_rows = int(max(p.y for _, p in all_nodes)) + 1
    # the right edge is the end of the widest chip in the last columns, not the last column itself
    x_end = max(p.x + _node_px(p) / COL_PX for _, p in all_nodes) + 0.1
    # at least the title's width; the range grows with it (COL_PX stays exact)
    width = max(int((x_end + 0.1) * COL_PX) + 20, int(len(title) * TITLE_CHAR_PX) + 30)
    x_end = (width - 20) / COL_PX - 0.1
    height = n_rows * ROW_PX + (_top_margin(title) + 20)
    return n_rows, width, height, x_end


def _top_margin(title: str) -> int:
    return 44 if title else 16


def _elbow(a: PlacedNode, b: PlacedNode) -> tuple[list, list]:
    """An edge from the right end of a's chip to the left of b: across, down, across."""
    xs = round(a.x + _node_px(a) * _UNIT, 3)     # rounded: keeps the streamed JSON small
    xm = round(b.x - 10 * _UNIT, 3)
    return [xs, xm, xm, b.x, None], [a.y, a.y, b.y, b.y, None]


def _edge_traces(all_nodes: list[tuple[int, PlacedNode]], pos: dict[tuple[int, int], PlacedNode],
                 connectors: list[tuple[PlacedNode, PlacedNode]]) -> list[dict]:
    """Parent-child edges, one trace per kind (other, accepted, bonus), then the tree-to-tree connectors."""
    edge_groups: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for ti, p in all_nodes:
        if p.id == ROOT:
            continue
        parent = pos.get((ti, p.parent if p.parent is not None else ROOT))
        if parent is None:
            continue
        kind = _EDGE_KIND.get(p.status, "other")
        ex, ey = _elbow(parent, p)
        edge_groups[kind][0].extend(ex)
        edge_groups[kind][1].extend(ey)
    traces = [dict(type="scatter", x=edge_groups[kind][0], y=edge_groups[kind][1], mode="lines", line=_EDGE_STYLES[kind],
                   hoverinfo="skip", showlegend=False) for kind in ("other", "tree", "bonus") if kind in edge_groups]
    return traces + [dict(type="scatter", x=[a.x + _node_px(a) * _UNIT, b.x], y=[a.y, b.y], mode="lines",
                          line=dict(color="#555", width=2, dash="dash"), hoverinfo="skip", showlegend=False)
                     for a, b in connectors]


def _chip(p: PlacedNode) -> dict:
    """The annotation drawing one node: its token text and role mark (✓ ✗ ◆ ★, the cue beside
    colour) on the status colour, in the text colour that reads on it; the bonus outlined."""
    mark = ROLE_MARKS[p.status]
    label = plotly_label(p.text, LABEL_CHARS)
    return dict(
        x=p.x, y=p.y, xanchor="left", yanchor="middle", showarrow=False,
        text=f"{label} {mark}" if mark else label,
        font=dict(size=CHIP_FONT_PX, color=TEXT_ON[p.status], family="DejaVu Sans Mono, monospace"),
        bgcolor=COLORS[p.status], borderpad=3,
        bordercolor="#222" if p.id == BONUS else COLORS[p.status], borderwidth=1.5 if p.id == BONUS else 0)


def _node_traces(all_nodes: list[tuple[int, PlacedNode]]) -> tuple[list[dict], list[dict]]:
    """Per status: an invisible marker trace carrying the hover texts; and the node chips. Chips are
    annotations because annotations size to their text. The key is HTML beside the figure
    (tree_key_line), so it stays in view when a wide tree scrolls."""
    traces, annotations = [], []
    for status in STATUS_ORDER:
        group = [(ti, p) for ti, p in all_nodes if p.status == status]
        if not group:
            continue
        traces.append(dict(
            type="scatter", x=[round(p.x + _node_px(p) * _UNIT / 2, 3) for _, p in group], y=[p.y for _, p in group],
            mode="markers", marker=dict(size=18, color=COLORS[status], opacity=0.0, symbol="square"),
            hovertext=[_hover(p, ti) for ti, p in group], hoverinfo="text", name=STATUS_NAMES[status],
            showlegend=False))
        annotations += [_chip(p) for _, p in group]
    return traces, annotations


def _tree_labels(trees: list[DraftTree], pos: dict[tuple[int, int], PlacedNode]) -> list[dict]:
    """'tree N' above each tree's root when a step has several trees."""
    if len(trees) <= 1:
        return []
    return [dict(x=pos[(ti, ROOT)].x, y=-0.85, xanchor="left", showarrow=False, text=f"<i>tree {ti + 1}</i>",
                 font=dict(size=14, color="#4B5563")) for ti in range(len(trees))]


def tree_figure(trees: list[DraftTree], title: str = "",
                empty: str = "No draft tree in this step (autoregressive or sequence drafting).") -> go.Figure:
    """All trees of a step, left to right, as one figure with a fixed pixel size."""
    if not trees:
        return _empty_figure(title, empty)
    all_nodes, connectors = _place_trees(trees)
    n_rows, width, height, x_end = _figure_size(all_nodes, title)
    pos = {(ti, p.id): p for ti, p in all_nodes}
    node_traces, chips = _node_traces(all_nodes)
    layout = dict(
        title=_title(title),
        width=width, height=height, autosize=False,
        margin=dict(l=10, r=10, t=_top_margin(title), b=10),
        template="none", plot_bgcolor="white", paper_bgcolor="white",
        annotations=chips + _tree_labels(trees, pos),
        xaxis=dict(visible=False, range=[-0.1, x_end], fixedrange=True),
        yaxis=dict(visible=False, range=[n_rows - 0.4, -1.3], fixedrange=True),
        showlegend=False, hoverlabel=dict(font=dict(size=14)),
    )
    return unchecked_figure(_edge_traces(all_nodes, pos, connectors) + node_traces, layout)
