"""Decoding parameters shared by every method, with validation that gives clear messages."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Optional


class SettingsError(ValueError):
    """Parameters that make no sense; the message is fit to show a user."""


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

    def validate(self) -> "DecodeSettings":
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise SettingsError(msg)
        for f in fields(self):
            v = getattr(self, f.name)
            want = float if f.type in ("float", float) else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not float(v).is_integer()):
                raise SettingsError(f"{f.name} must be a number{' (whole)' if want is int else ''}, got {v!r}")
            setattr(self, f.name, want(v))
        check(1 <= self.max_new_tokens <= 8192, "max_new_tokens must be between 1 and 8192")
        check(0.0 <= self.temperature <= 10.0, "temperature must be between 0 and 10 (0 = greedy)")
        check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        for prefix, name in (("m", "E_M"), ("t", "E_T")):
            depth, topk, size = (getattr(self, f"{prefix}_{k}") for k in ("depth", "topk", "tree_size"))
            check(1 <= depth <= 32, f"{name} tree depth must be between 1 and 32, got {depth}")
            check(1 <= topk <= 64, f"{name} tree top-k must be between 1 and 64, got {topk}")
            check(1 <= size <= 512, f"{name} tree size must be between 1 and 512, got {size}")
            most = topk + (depth - 1) * topk * topk
            check(size <= most, f"{name} tree size {size} exceeds the {most} candidates that depth {depth} and top-k {topk} draft")
        check(1 <= self.min_draft_len <= 64, "min_draft_len must be between 1 and 64")
        check(1 <= self.spec_k <= 64, "spec_k must be between 1 and 64")
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

