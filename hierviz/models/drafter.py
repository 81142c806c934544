"""The drafter interface: what the decoders need from a draft head, and the head types behind it.

A draft head (EAGLE-1/2 in `eagle.py`, EAGLE-3 in `eagle3.py`) sits on a base model (the target
for E_T, the intermediate for E_M) and drafts from the base's features. The decoders, the tree
drafter (`hierviz.decoding.tree`), the static runners (`hierviz.models.cuda_graphs`) and the
stack loader use only what `Drafter` names, so a further head type is one module with a class
that has these members, one entry in HEAD_TYPES and its tests (docs/architecture.md).

Features. A base model hands its heads one row per token (`Transformer.forward`): its final
hidden state (after the last norm) and, when a head asks for them, the residual stream entering
each of `feature_layers` (EAGLE-3 fuses a low, a middle and a high layer). `project_features`
turns those rows into the head's input width; the head's own outputs (what it predicts for a tree
node) are already that width and feed the next depth as they are.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Union

import torch

if TYPE_CHECKING:     # annotations only: hierviz.memory reads HEAD_SLOTS without the model code
    from hierviz.models.config import ModelConfig
    from hierviz.models.llama import KVCache, Transformer


class Drafter(Protocol):
    head_type: str                     # a key of HEAD_TYPES, shown in traces and panels
    cfg: ModelConfig                   # the head's own layer shape
    base: Transformer                  # the model whose features it reads
    dtype: torch.dtype
    device: torch.device
    static_runners: list               # hierviz.models.cuda_graphs pools its runners here
    feature_layers: tuple[int, ...]    # base layers whose input rows it reads; () = the final hidden only
    draft_vocab: Optional[torch.Tensor]   # the target ids it drafts over (None: all); a new one = new graphs

    def new_cache(self, max_len: int) -> KVCache: ...

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Base feature rows [T, W] (Transformer.feature_width) -> the head's input rows [T, H]."""

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: Optional[KVCache], attn_mask: Optional[torch.Tensor] = None,
                slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [T] (token t+1), features [T, H] (projected, or the head's own outputs), positions [T]
        (= t): the predicted features [T, H]. `slots`: static-shape mode (cuda_graphs)."""

    def draft_logprobs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Log-probs over the draft vocabulary and the target token ids they index (None: the
        full vocabulary, ids = positions)."""

    def draft_vocab_mask(self) -> Optional[torch.Tensor]:
        """bool [base vocab]: which target tokens this head can draft at all (None: every one). A
        target token outside it is a rejection no draft could have avoided."""


HeadLoader = Callable[[Union[str, Path], "Transformer"], Drafter]


def _eagle2(folder: Union[str, Path], base: Transformer) -> Drafter:
    from hierviz.models.eagle import EagleHead, load_eagle_weights
    return EagleHead(*load_eagle_weights(folder), base)


def _eagle3(folder: Union[str, Path], base: Transformer) -> Drafter:
    from hierviz.models.eagle3 import load_eagle3_head
    return load_eagle3_head(folder, base)


# head type -> loader(folder, base model); "eagle2" reads EAGLE-1 and EAGLE-2 heads (one layout)
HEAD_TYPES: dict[str, HeadLoader] = {"eagle2": _eagle2, "eagle3": _eagle3}


# a stack's head entries: the model each one drafts for, and the head type it must hold (None: any)
HEAD_SLOTS: dict[str, tuple[str, Optional[str]]] = {"e_m": ("intermediate", None), "e_t": ("target", "eagle2"),
                                                    "e_t3": ("target", "eagle3")}


def head_type_of(folder: Union[str, Path]) -> str:
    """The head type a checkpoint folder holds, from its config and tensor names."""
    from hierviz.models.eagle3 import is_eagle3_folder
    return "eagle3" if is_eagle3_folder(folder) else "eagle2"


def load_head(folder: Union[str, Path], base: Transformer, head_type: Optional[str] = None) -> Drafter:
    """A draft head on `base` from a checkpoint folder; head_type None: detected (head_type_of)."""
    kind = head_type or head_type_of(folder)
    if kind not in HEAD_TYPES:
        raise ValueError(f"unknown head type {kind!r}; choose one of {', '.join(HEAD_TYPES)}")
    return HEAD_TYPES[kind](folder, base)


def is_drafter(model: object) -> bool:
    """A draft head (takes features) rather than a base model: it names its head type. (Not a
    Protocol isinstance: from Python 3.12 that looks attributes up statically and misses an
    nn.Module's submodules.)"""
    return getattr(model, "head_type", None) in HEAD_TYPES
