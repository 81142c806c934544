"""The drafter interface: what the decoders need from a draft head, and the head types behind it.

A draft head (EAGLE-1/2 in `eagle.py`, EAGLE-3 in `eagle3.py`) sits on a base model (the target
for E_T, the intermediate for E_M) and drafts from the base's features. The decoders, the tree
drafter (`hierviz.decoding.tree`), the static runners (`hierviz.models.cuda_graphs`) and the
stack loader use only what `Drafter` names, so a further head type is one module with a class
that has these members and a loader, one `register_head_type(HeadType(...))` and its tests
(docs/heads.md). Stacks, detection (`head_type_of`), traces' head_types, labels (`head_label`)
and the training command's --head-type read HEAD_TYPES; none of them names a head type.

Features. A base model hands its heads one row per token (`Transformer.forward`): its final
hidden state (after the last norm) and, when a head asks for them, the residual stream entering
each of `feature_layers` (EAGLE-3 fuses a low, a middle and a high layer). `project_features`
turns those rows into the head's input width; the head's own outputs (what it predicts for a tree
node) are already that width and feed the next depth as they are.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

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
HeadDetector = Callable[[Union[str, Path]], bool]


def _resolved(ref: Union[str, Callable[..., Any]]) -> Callable[..., Any]:
    """A callable, or a "module:attribute" reference imported on first use (the registry stays
    free of the model code: hierviz.memory reads HEAD_SLOTS without it)."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class HeadType:
    """One head type: what every layer asks about it instead of testing its name."""

    name: str                               # stack files (`type`), traces' head_types and --head-type use it
    label: str                              # for people: "EAGLE-2", "EAGLE-3"
    loader: Union[str, HeadLoader]          # (folder, base) -> Drafter, or "module:function"
    # (folder) -> bool: does a checkpoint folder hold this type? None: the fallback layout, taken
    # when no other type claims a folder
    detect: Union[str, HeadDetector, None] = None
    # drafts through its base model's LM head (no vocabulary of its own): a stack's FR-Spec
    # draft_vocab restricts it (set_draft_vocab), and its hidden size must be its base's
    base_lm_head: bool = False
    # the draft vocabulary its published checkpoints keep for a large-vocabulary base (tokens); the
    # what-if's synthetic heads of this type draft over it unless told otherwise. None: the full one
    published_draft_vocab: Optional[int] = None
    # the trainer class for hierviz.train.eagle_train's loop ("module:Class"); None: not trainable there
    trainer: Union[str, Callable[..., Any], None] = None
    description: str = ""                   # one line: what it reads from its base and how it drafts

    def load(self, folder: Union[str, Path], base: Transformer) -> Drafter:
        return _resolved(self.loader)(folder, base)

    def detects(self, folder: Union[str, Path]) -> bool:
        return self.detect is not None and bool(_resolved(self.detect)(folder))

    def trainer_class(self) -> Optional[Callable[..., Any]]:
        return None if self.trainer is None else _resolved(self.trainer)


HEAD_TYPES: dict[str, HeadType] = {}


def register_head_type(head_type: HeadType) -> HeadType:
    """Add (or replace) a head type: stacks, detection, traces and training see it from then on."""
    HEAD_TYPES[head_type.name] = head_type
    return head_type


def unregister_head_type(name: str) -> None:
    """Remove a head type added at run time (tests of the extension points)."""
    HEAD_TYPES.pop(name, None)


def get_head_type(name: str) -> HeadType:
    if name not in HEAD_TYPES:
        raise ValueError(f"unknown head type {name!r}; choose one of {', '.join(HEAD_TYPES)}")
    return HEAD_TYPES[name]


def head_label(name: str) -> str:
    """A head type's name for people ("EAGLE-3"); an unknown name as it is."""
    t = HEAD_TYPES.get(name)
    return t.label if t else name


def trainable_head_types() -> list[str]:
    """The head types the head training loop can train (--head-type's choices)."""
    return [t.name for t in HEAD_TYPES.values() if t.trainer is not None]


register_head_type(HeadType("eagle2", "EAGLE-2", "hierviz.models.eagle:load_eagle_head", None, base_lm_head=True,
                            trainer="hierviz.train.eagle_train:Eagle2Trainer",
                            description="EAGLE-1/2 heads: the base's final hidden state, drafting through its LM "
                                        "head (feature regression)"))
register_head_type(HeadType("eagle3", "EAGLE-3", "hierviz.models.eagle3:load_eagle3_head",
                            "hierviz.models.eagle3:is_eagle3_folder",
                            trainer="hierviz.train.eagle3_train:Eagle3Trainer",
                            # SafeAILab's EAGLE-3 heads for LLaMA-3.x: draft_vocab_size 32000 of 128256
                            published_draft_vocab=32000,
                            description="EAGLE-3 heads: low/middle/high base layers, own draft vocabulary "
                                        "(training-time test)"))


# a stack's head entries: the model each one drafts for, and the head type it must hold (None: any)
HEAD_SLOTS: dict[str, tuple[str, Optional[str]]] = {"e_m": ("intermediate", None), "e_t": ("target", "eagle2"),
                                                    "e_t3": ("target", "eagle3")}


def slot_for(head_type: str, role: str) -> Optional[str]:
    """The head slot on the `role` base model that takes `head_type` heads, if any."""
    return next((slot for slot, (r, want) in HEAD_SLOTS.items() if r == role and want in (None, head_type)), None)


def head_type_of(folder: Union[str, Path]) -> str:
    """The head type a checkpoint folder holds: the first type whose detector claims it, the type
    registered last asked first (an added type is more specific than those it builds on), else
    the fallback layout (a type without a detector: EAGLE-1/2)."""
    types = list(HEAD_TYPES.values())
    for t in reversed(types):
        if t.detects(folder):
            return t.name
    fallback = next((t.name for t in types if t.detect is None), None)
    if fallback is None:
        raise ValueError(f"no head type recognises {folder} ({', '.join(HEAD_TYPES)})")
    return fallback


def load_head(folder: Union[str, Path], base: Transformer, head_type: Optional[str] = None) -> Drafter:
    """A draft head on `base` from a checkpoint folder; head_type None: detected (head_type_of)."""
    return get_head_type(head_type or head_type_of(folder)).load(folder, base)


def uses_base_lm_head(head: object) -> bool:
    """Does this head draft through its base model's LM head (HeadType.base_lm_head)?"""
    t = HEAD_TYPES.get(getattr(head, "head_type", None) or "")
    return t is not None and t.base_lm_head


def is_drafter(model: object) -> bool:
    """A draft head (takes features) rather than a base model: it names its head type. (Not a
    Protocol isinstance: from Python 3.12 that looks attributes up statically and misses an
    nn.Module's submodules.)"""
    return getattr(model, "head_type", None) in HEAD_TYPES
