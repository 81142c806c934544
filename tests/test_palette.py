"""The role colours stay apart for colour-blind viewers and keep their text readable.

Colour-vision deficiency is simulated with the Machado, Oliveira & Fernandes (2009) matrices at
severity 1.0 (applied to linear RGB); differences are CIEDE2000 on CIELAB (D65). Both are
implemented here with numpy so that the check needs no extra dependency.

Seven roles cannot all be 30 apart in every simulation (a free search over all of sRGB tops
out near 29 with neon colours), so the palette is tested at two levels: the roles a visitor
must tell apart at a glance (accepted, rejected, T's own token, M's bonus) are >= 30 apart in
normal vision and every simulation; every pair of roles is >= ALL_PAIRS_MIN_DE apart, and each
role also carries a mark (style.ROLE_MARKS) so that colour is never the only cue.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from hierviz.viz.style import COLORS, ROLE_MARKS, STAGE_COLORS, TEXT_ON, TINTS, contrast_ratio

MACHADO_2009 = {
    "protanopia": np.array([[0.152286, 1.052583, -0.204868],
                            [0.114503, 0.786281, 0.099216],
                            [-0.003882, -0.048116, 1.051998]]),
    "deuteranopia": np.array([[0.367322, 0.860646, -0.227968],
                              [0.280085, 0.672501, 0.047413],
                              [-0.011820, 0.042940, 0.968881]]),
    "tritanopia": np.array([[1.255528, -0.076749, -0.178779],
                            [-0.078411, 0.930809, 0.147602],
                            [0.004733, 0.691367, 0.303900]]),
}
VISIONS = {"normal": np.eye(3), **MACHADO_2009}
SRGB_TO_XYZ = np.array([[0.4124564, 0.3575761, 0.1804375],
                        [0.2126729, 0.7151522, 0.0721750],
                        [0.0193339, 0.1191920, 0.9503041]])
D65_WHITE = np.array([0.95047, 1.0, 1.08883])

KEY_ROLES = ("tree", "rejected", "target_bonus", "intermediate_bonus")
KEY_MIN_DE = 30.0
ALL_PAIRS_MIN_DE = 23.0   # achieved minimum over all 7 roles and 4 visions (measured 23.0; see docs/app.md)
TEXT_MIN_CONTRAST = 4.5   # WCAG AA for normal-size text


def hex_to_srgb(color: str) -> np.ndarray:
    return np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0


def srgb_to_linear(rgb: np.ndarray) -> np.ndarray:
    return np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)


def linear_to_lab(linear: np.ndarray) -> np.ndarray:
    xyz = linear @ SRGB_TO_XYZ.T / D65_WHITE
    delta = 6 / 29
    f = np.where(xyz > delta ** 3, np.cbrt(xyz), xyz / (3 * delta ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def seen_as_lab(color: str, vision: str) -> np.ndarray:
    """CIELAB of `color` as a viewer with `vision` sees it (simulation clipped to the gamut)."""
    simulated = np.clip(VISIONS[vision] @ srgb_to_linear(hex_to_srgb(color)), 0.0, 1.0)
    return linear_to_lab(simulated)


def ciede2000(lab1: np.ndarray, lab2: np.ndarray) -> float:
    """CIEDE2000 colour difference (Sharma, Wu & Dalal 2005), kL = kC = kH = 1."""
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    c_mean = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(c_mean ** 7 / (c_mean ** 7 + 25 ** 7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = np.hypot(a1p, b1), np.hypot(a2p, b2)
    h1p = np.degrees(np.arctan2(b1, a1p)) % 360
    h2p = np.degrees(np.arctan2(b2, a2p)) % 360
    dl, dc = l2 - l1, c2p - c1p
    dh = h2p - h1p
    if c1p * c2p == 0:
        dh = 0.0
    elif dh > 180:
        dh -= 360
    elif dh < -180:
        dh += 360
    dh_big = 2 * np.sqrt(c1p * c2p) * np.sin(np.radians(dh / 2))
    l_mean, cp_mean = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        hp_mean = h1p + h2p
    elif abs(h1p - h2p) > 180:
        hp_mean = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    else:
        hp_mean = (h1p + h2p) / 2
    t = (1 - 0.17 * np.cos(np.radians(hp_mean - 30)) + 0.24 * np.cos(np.radians(2 * hp_mean))
         + 0.32 * np.cos(np.radians(3 * hp_mean + 6)) - 0.20 * np.cos(np.radians(4 * hp_mean - 63)))
    d_theta = 30 * np.exp(-(((hp_mean - 275) / 25) ** 2))
    r_c = 2 * np.sqrt(cp_mean ** 7 / (cp_mean ** 7 + 25 ** 7))
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / np.sqrt(20 + (l_mean - 50) ** 2)
    s_c = 1 + 0.045 * cp_mean
    s_h = 1 + 0.015 * cp_mean * t
    r_t = -np.sin(np.radians(2 * d_theta)) * r_c
    return float(np.sqrt((dl / s_l) ** 2 + (dc / s_c) ** 2 + (dh_big / s_h) ** 2
                         + r_t * (dc / s_c) * (dh_big / s_h)))


def min_difference(roles: tuple[str, ...], vision: str) -> tuple[float, tuple[str, str]]:
    """The closest pair of `roles` as seen with `vision`, and its CIEDE2000 difference."""
    return min((ciede2000(seen_as_lab(COLORS[a], vision), seen_as_lab(COLORS[b], vision)), (a, b))
               for a, b in itertools.combinations(roles, 2))


@pytest.mark.parametrize(("lab1", "lab2", "expected"), [
    # reference pairs from Sharma, Wu & Dalal (2005), table 1
    ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),
    ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),
    ((50.0, 2.5, 0.0), (50.0, 0.0, -2.5), 4.3065),
    ((2.0776, 0.0795, -1.1350), (0.9033, -0.0636, -0.5514), 0.9082),
])
def test_ciede2000_matches_the_published_reference(lab1, lab2, expected):
    assert ciede2000(np.array(lab1), np.array(lab2)) == pytest.approx(expected, abs=1e-4)


def test_simulation_keeps_greys_grey():
    for vision in MACHADO_2009:
        lab = seen_as_lab("#808080", vision)
        assert abs(lab[1]) < 1.0 and abs(lab[2]) < 1.0


@pytest.mark.parametrize("vision", list(VISIONS))
def test_key_roles_stay_apart(vision):
    de, pair = min_difference(KEY_ROLES, vision)
    assert de >= KEY_MIN_DE, f"{pair} only {de:.1f} apart under {vision}"


@pytest.mark.parametrize("vision", list(VISIONS))
def test_every_role_pair_stays_apart(vision):
    de, pair = min_difference(tuple(COLORS), vision)
    assert de >= ALL_PAIRS_MIN_DE, f"{pair} only {de:.1f} apart under {vision}"


@pytest.mark.parametrize("role", list(COLORS))
def test_text_on_every_role_colour_is_readable(role):
    assert contrast_ratio(TEXT_ON[role], COLORS[role]) >= TEXT_MIN_CONTRAST


@pytest.mark.parametrize("role", list(TINTS))
def test_text_on_every_tint_is_readable(role):
    assert contrast_ratio("#1F2937", TINTS[role]) >= TEXT_MIN_CONTRAST


def test_every_role_has_a_distinct_mark_where_colour_must_not_be_alone():
    marks = [ROLE_MARKS[r] for r in KEY_ROLES]
    assert all(marks) and len(set(marks)) == len(marks)


def test_contrast_ratio_matches_wcag_examples():
    assert contrast_ratio("#FFFFFF", "#000000") == pytest.approx(21.0)
    assert contrast_ratio("#FFFFFF", "#E69F00") == pytest.approx(2.25, abs=0.01)


def test_stage_colours_are_distinct_under_every_simulation():
    for vision in VISIONS:
        pairs = itertools.combinations(STAGE_COLORS.values(), 2)
        assert min(ciede2000(seen_as_lab(a, vision), seen_as_lab(b, vision)) for a, b in pairs) >= 10


def test_chips_carry_their_role_mark_and_readable_text():
    from hierviz.viz.panels import chip
    for role, mark in ROLE_MARKS.items():
        html = chip("x", role)
        assert f"color:{TEXT_ON[role]}" in html
        assert (f">{mark}</span>" in html) if mark else "hv-mark" not in html


def test_tree_nodes_carry_their_role_mark():
    from hierviz.trace import DraftTree, TreeNode
    from hierviz.viz.tree import tree_figure
    # root -> 1 (accepted) -> bonus; root -> 2 (rejected) -> 3 (discarded)
    nodes = [TreeNode(1, 11, " a", 0, 1, -0.1, -0.1), TreeNode(2, 12, " b", 0, 1, -0.2, -0.2),
             TreeNode(3, 13, " c", 2, 2, -0.3, -0.1)]
    tree = DraftTree(10, " r", nodes, [1], 14, " g", "intermediate")
    by_color = {a.bgcolor: a for a in tree_figure([tree]).layout.annotations}
    for role in ("tree", "rejected", "intermediate_bonus"):
        assert by_color[COLORS[role]].text.endswith(ROLE_MARKS[role])
        assert by_color[COLORS[role]].font.color == TEXT_ON[role]


def test_legend_shows_marks_and_follows_the_method():
    from hierviz.viz.panels import legend_html
    assert all(mark in legend_html() for mark in ROLE_MARKS.values() if mark)
    eagle = legend_html("eagle2")
    assert COLORS["intermediate_bonus"] not in eagle and COLORS["draft"] not in eagle
    assert COLORS["draft"] in legend_html("spec") and COLORS["tree"] not in legend_html("spec")


def test_a_marked_node_chip_still_fits_its_column():
    from hierviz.viz.tree import COL_PX, LABEL_CHARS, _chip_px
    longest = "x" * (LABEL_CHARS + 5)
    assert all(_chip_px(longest, mark) < COL_PX - 8 for mark in ROLE_MARKS.values())
