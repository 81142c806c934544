"""Decoding parameters shared by every method, with validation that gives clear messages, and
their command-line flags: every tool that decodes declares them through this module."""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace
from typing import Callable, Optional

from hierviz import methods


class SettingsError(ValueError):
    """Parameters that make no sense; the message is fit to show a user. `setting`: the field refused."""

    def __init__(self, message: str, setting: Optional[str] = None) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass
class DecodeSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    # Tree sizes count drafted nodes, not the root; depth counts drafted levels (TREE_PRESETS
    # gives the mapping to SafeAILab's and SpecMQuant's numbers).
    # E_M tree inside HierSpec: the paper's (SpecMQuant's --eagle-num-iter 3 --eagle-topk-per-iter 10
    # --eagle-tree-size 30, root counted)
    m_depth: int = 3
    m_topk: int = 10
    m_tree_size: int = 29
    min_draft_len: int = 6         # HierSpec: the sequence draft for T has at least this many tokens
    # E_T tree for the EAGLE-2 baseline: EAGLE-2's published defaults (depth 5, total_token 60,
    # top_k 10 in SafeAILab's counting)
    t_depth: int = 6
    t_topk: int = 10
    t_tree_size: int = 59
    spec_k: int = 5                # sequence speculative decoding: tokens M drafts per round

    def validate(self, names: Optional[dict[str, str]] = None) -> "DecodeSettings":
        """Self with each field of its type, or a SettingsError naming the first field it refuses
        (`setting`). `names`: what the messages call each field (an app's labels for them); the
        field names by default, and the tree fields' ranges in words (E_M tree depth)."""
        names = names or {}

        def check(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise SettingsError(msg, setting=field)
        for f in fields(self):
            v = getattr(self, f.name)
            want = float if f.type in ("float", float) else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not float(v).is_integer()):
                raise SettingsError(f"{names.get(f.name, f.name)} must be a {'whole ' if want is int else ''}number, "
                                    f"got {v!r}", setting=f.name)
            setattr(self, f.name, want(v))
        for field, lo, hi, said in (("max_new_tokens", 1, 8192, ""), ("temperature", 0.0, 10.0, " (0 = greedy)")):
            check(lo <= getattr(self, field) <= hi, field,
                  f"{names.get(field, field)} must be between {lo:g} and {hi:g}{said}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"{names.get('top_p', 'top_p')} must be in (0, 1]")
        for prefix, name in (("m", "E_M"), ("t", "E_T")):
            depth, topk, size = (getattr(self, f"{prefix}_{k}") for k in ("depth", "topk", "tree_size"))
            for key, value, most, words in (("depth", depth, 32, "depth"), ("topk", topk, 64, "top-k"),
                                            ("tree_size", size, 512, "size")):
                field = f"{prefix}_{key}"
                check(1 <= value <= most, field,
                      f"{names.get(field, f'{name} tree {words}')} must be between 1 and {most}, got {value}")
            most = topk + (depth - 1) * topk * topk
            check(size <= most, f"{prefix}_tree_size", f"{names.get(f'{prefix}_tree_size', f'{name} tree size')} "
                  f"{size} exceeds the {most} candidates that depth {depth} and top-k {topk} draft")
        for field in ("min_draft_len", "spec_k"):
            check(1 <= getattr(self, field) <= 64, field, f"{names.get(field, field)} must be between 1 and 64")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


# Small trees for a compute-bound CPU, where every verified token costs (docs/configuration.md gives
# the sweep that chose them); GPUs keep the defaults above.
CPU_TREES = {"m_depth": 2, "m_tree_size": 10, "min_draft_len": 2, "t_depth": 5, "t_tree_size": 6}

# Reference tree settings in hierviz's counting. SafeAILab's EAGLE counts the root in
# `total_token` (S = total_token - 1) and drafts `depth + 1` levels (D = depth + 1); SpecMQuant's
# scripts count the root in their tree sizes and draft `num_iter` levels.
#   eagle2:        SafeAILab EAGLE-2 defaults, depth 5 / total_token 60 / top_k 10 -> D 6, S 59, K 10
#   eagle3:        SafeAILab EAGLE-3 defaults (EaModel.from_pretrained with use_eagle3), depth 7 /
#                  total_token 60 / top_k 10 -> D 8, S 59, K 10 (E_M as in eagle2)
#   paper:         SpecMQuant's HierSpec run (E_M: num_iter 3, topk 10, tree size 30 -> D 3, S 29;
#                  min draft length 6) and its EAGLE-2 baseline on the 70B (3 / 10 / 24 -> D 3, S 23)
TREE_PRESETS: dict[str, dict[str, int]] = {
    "eagle2": {"t_depth": 6, "t_topk": 10, "t_tree_size": 59, "m_depth": 3, "m_topk": 10, "m_tree_size": 29,
               "min_draft_len": 6},
    "eagle3": {"t_depth": 8, "t_topk": 10, "t_tree_size": 59, "m_depth": 3, "m_topk": 10, "m_tree_size": 29,
               "min_draft_len": 6},
    "paper": {"t_depth": 3, "t_topk": 10, "t_tree_size": 23, "m_depth": 3, "m_topk": 10, "m_tree_size": 29,
              "min_draft_len": 6},
}


def default_settings(device: Optional[str] = None) -> DecodeSettings:
    """The defaults for decoding on `device` ("cpu", "cuda", "cuda:1", ...; None: this machine's,
    cuda when torch sees one; without torch installed, the GPU defaults)."""
    if device is None:
        try:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:      # a trace-only install: nothing runs here
            device = "cuda"
    if str(device).split(":")[0] == "cpu":
        return replace(DecodeSettings(), **CPU_TREES)
    return DecodeSettings()



# ---- command-line flags ------------------------------------------------------------------------

@dataclass(frozen=True)
class DraftFlag:
    """A drafting setting as a flag, named after its DecodeSettings field."""
    field: str
    what: str
    tree: str = ""        # the Method.tree_settings of the methods that read it ("t", "m"; "" none)

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")


# The drafting settings every tool takes under the same flags; TREE_FIELDS are the ones a tree
# preset (--trees) sets
DRAFT_FLAGS = (DraftFlag("m_depth", "E_M tree depth", "m"), DraftFlag("m_topk", "E_M tree top-k", "m"),
               DraftFlag("m_tree_size", "E_M tree size", "m"),
               DraftFlag("min_draft_len", "minimum sequence draft for T", "m"),
               DraftFlag("t_depth", "E_T tree depth", "t"), DraftFlag("t_topk", "E_T tree top-k", "t"),
               DraftFlag("t_tree_size", "E_T tree size", "t"),
               DraftFlag("spec_k", "tokens the intermediate drafts per round (sequence speculation)"))
TREE_FIELDS = tuple(f.field for f in DRAFT_FLAGS if f.tree)
TREES_HELP = ("reference tree settings: eagle2 = SafeAILab EAGLE-2 defaults (E_T depth 6, 59 nodes), eagle3 = "
              "SafeAILab EAGLE-3 defaults (E_T depth 8), paper = SpecMQuant's HierSpec and EAGLE-2 runs (E_T depth 3, "
              "23 nodes); single tree flags override them")


def _readers(tree: str) -> str:
    """The labels of the methods that read a tree's settings, for a flag's help."""
    return ", ".join(m.label for m in methods.METHODS.values() if tree and m.tree_settings == tree)


def add_draft_args(p: argparse.ArgumentParser, default_help: Callable[[str], str]) -> None:
    """DRAFT_FLAGS and --trees, each defaulting to None (a flag left out keeps the value the caller
    starts from; default_help(field) says what that is)."""
    for f in DRAFT_FLAGS:
        readers = _readers(f.tree)
        p.add_argument(f.flag, type=int, default=None,
                       help=f"{f.what} ({readers + '; ' if readers else ''}{default_help(f.field)})")
    p.add_argument("--trees", default=None, choices=sorted(TREE_PRESETS), help=TREES_HELP)


def apply_draft_args(s: DecodeSettings, a: argparse.Namespace) -> DecodeSettings:
    """`s` with the --trees preset, then every drafting flag given, set on it (in place)."""
    for k, v in TREE_PRESETS.get(getattr(a, "trees", None) or "", {}).items():
        setattr(s, k, v)
    for f in DRAFT_FLAGS:
        if getattr(a, f.field, None) is not None:
            setattr(s, f.field, getattr(a, f.field))
    return s


def add_settings_args(p: argparse.ArgumentParser) -> None:
    """Every decode setting as a flag; drafting flags left out take the run device's defaults."""
    d, cpu = DecodeSettings(), default_settings("cpu")

    def dflt(name: str) -> str:
        g, c = getattr(d, name), getattr(cpu, name)
        return f"default {g}" + (f"; {c} on the CPU" if c != g else "")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--seed", type=int, default=d.seed)
    add_draft_args(p, dflt)


def settings_from_args(a: argparse.Namespace, device: Optional[str] = None) -> DecodeSettings:
    """Settings from the parsed flags; drafting flags left out take the defaults of `device` (the
    device the stack runs on; default: --device, else this machine's)."""
    s = apply_draft_args(default_settings(device if device is not None else getattr(a, "device", None)), a)
    for k in ("max_new_tokens", "temperature", "top_p", "seed"):
        if getattr(a, k) is not None:
            setattr(s, k, getattr(a, k))
    return s
