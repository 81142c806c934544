"""The method registry: one entry per decoding method, read by every layer.

Trace validation, the decoders' driver, comparisons and the headline, viz styles, latency bars,
the What-if figures, bench columns, CLI choices and the app's run picker all ask this module, so a
new method is one decoder module and one `register(Method(...))`. It sits at the bottom of the
layers (it imports nothing of hierviz): a built-in entry names its decoder as "module:function",
resolved on first use, so that this module does not import the decoders above it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

# What T checks in one round: one token (AR), a sequence draft, or a whole draft tree
TOKEN, SEQUENCE, TREE = "token", "sequence", "tree"


@dataclass(frozen=True)
class Method:
    name: str                         # traces, stack files, the CLI and the API use it
    label: str                        # for people: "Autoregressive", "EAGLE-2"
    short: str                        # in narrow places: "AR"
    color: str                        # its colour in per-method charts (What-if, crossover)
    dash: str                         # its line style there ("solid", "dot", "dash", "dashdot")
    needs: tuple[str, ...]            # the stack parts it runs on besides T (Models fields)
    target_verifies: str              # TOKEN, SEQUENCE or TREE
    decoder: Union[str, Callable[..., Any]]   # "module:function" or the generator function itself
    # its place in a side-by-side comparison, lowest first; None: never part of one
    compare_rank: Optional[int] = None
    stage_names: dict[str, str] = field(default_factory=dict)   # trace stage -> latency bar label
    roles: frozenset[str] = frozenset()   # the token/node roles its panels can show (viz.style.COLORS keys)
    # the method shown beside it in the side-by-side teaching view
    counterpart: Optional[str] = None
    # the drafted-tree depth settings it reads ("t": E_T's tree on T, "m": E_M's trees on M)
    tree_settings: Optional[str] = None
    # the method whose acceptance record a what-if replays for it (a tree on T with another head
    # type is priced with the same decisions), default itself
    acceptance_as: Optional[str] = None
    # the rows of the forwards each base model runs in a round, {"target" | "intermediate": (fewest,
    # most)}, from the decode settings: the row counts a W4 kernel choice weighs (hierviz.quant.w4_choice)
    forward_rows: Optional[Callable[[Any], dict[str, tuple[int, int]]]] = None
    description: str = ""

    @property
    def decode(self) -> Callable[..., Any]:
        """The decoder: a generator function (models, prompt, settings, sampler, text, max_len, oracle)."""
        if callable(self.decoder):
            return self.decoder
        module, _, name = self.decoder.partition(":")
        return getattr(importlib.import_module(module), name)


METHODS: dict[str, Method] = {}
SUBJECT = "hierspec"      # the method the app is about: headlines compare it with every other run
BASELINE = "ar"           # the reference every output is checked against and every speedup is over
PEER = "eagle2"           # the method the paper measures HierSpec against (T verifies E_T's tree)


def register(method: Method) -> Method:
    """Add (or replace) a method; every layer sees it from then on."""
    if method.target_verifies not in (TOKEN, SEQUENCE, TREE):
        raise ValueError(f"{method.name}: target_verifies must be one of token, sequence, tree")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method added at run time (tests of the extension points)."""
    METHODS.pop(name, None)


def get(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def names() -> list[str]:
    """Every method, in display order (registration order)."""
    return list(METHODS)


def label(name: str) -> str:
    """A method's or a variant row's label; the name itself for an unknown one."""
    m = METHODS.get(name) or VARIANTS.get(name)
    return m.label if m else name


def short(name: str) -> str:
    m = METHODS.get(name) or VARIANTS.get(name)
    return m.short if m else name


def color(name: str) -> Optional[str]:
    """A method's or a variant row's colour in per-method charts; None for an unknown name."""
    m = METHODS.get(name) or VARIANTS.get(name)
    return m.color if m else None


def comparison_order() -> list[str]:
    """The methods a side-by-side comparison may run, in their comparison order (SUBJECT first)."""
    ranked = [m for m in METHODS.values() if m.compare_rank is not None]
    return [m.name for m in sorted(ranked, key=lambda m: m.compare_rank)]


def in_comparison_order(names: list[str]) -> list[str]:
    """`names` sorted as a comparison lists them: ranked methods first, then the rest in registry order."""
    ranked, order = comparison_order(), list(METHODS)
    return sorted(names, key=lambda m: (ranked.index(m) if m in ranked else len(ranked),
                                        order.index(m) if m in order else len(order)))


def comparison_having(has: Callable[[str], bool]) -> list[str]:
    """The comparison's methods whose every needed part `has` says is there."""
    return [m for m in comparison_order() if all(has(part) for part in METHODS[m].needs)]


def verifies(name: str) -> Optional[str]:
    """What T checks in a round of this method (TOKEN, SEQUENCE, TREE); None for an unknown name."""
    m = METHODS.get(name)
    return m.target_verifies if m else None


def forward_rows(names: list[str], settings: Any) -> Optional[dict[str, set[int]]]:
    """Every row count the rounds of these methods or variant rows run on each base model under
    `settings` ("target" / "intermediate" -> row counts); None when a method does not say."""
    out: dict[str, set[int]] = {}
    for name in names:
        method = get(row_method(name))
        if method.forward_rows is None:
            return None
        for role, (fewest, most) in method.forward_rows(settings).items():
            out.setdefault(role, set()).update(range(fewest, most + 1))
    return out


def workload_rows(methods: list[str], settings: list[Any], prompt_len: int
                  ) -> Optional[dict[str, set[int]]]:
    """The row counts the run's forwards multiply on T and M: every method's rounds under each of
    the settings (forward_rows) and the prompt's prefill on a model that runs at
    all; None when a method does not say (then every row count decides)."""
    out: dict[str, set[int]] = {}
    for s in settings:
        rows = forward_rows(methods, s)
        if rows is None:
            return None
        for role, counts in rows.items():
            out.setdefault(role, set()).update(counts)
    for counts in out.values():
        counts.add(prompt_len)
    return out


def tree_on_target(name: str) -> bool:
    """Does T verify a whole draft tree itself in this method (EAGLE-2, EAGLE-3)?"""
    return verifies(name) == TREE


def tree_methods() -> list[str]:
    return [m.name for m in METHODS.values() if m.target_verifies == TREE]


@dataclass(frozen=True)
class Variant:
    """A row of a per-method table that runs a registered method with another head type in one of
    its head slots (the what-if's HierSpec whose E_M is an EAGLE-3 head). Not a method: traces,
    stacks and side-by-side comparisons never hold one; only the what-if runs and shows it."""
    name: str                         # its key in the what-if's outputs and in --methods
    method: str                       # the registered method it runs
    label: str
    short: str
    color: str
    dash: str
    heads: tuple[tuple[str, str], ...]   # (head slot, head type) it puts in place of the method's own
    description: str = ""


VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant) -> Variant:
    if variant.method not in METHODS:
        raise ValueError(f"{variant.name}: {variant.method} is not a registered method")
    VARIANTS[variant.name] = variant
    return variant


def row_method(name: str) -> str:
    """The registered method a row runs: the variant's method, or the name itself."""
    return VARIANTS[name].method if name in VARIANTS else name


def row_names() -> list[str]:
    """Every method and variant row in display order: registration order, each variant right
    after its method."""
    return [n for m in METHODS for n in [m] + [v.name for v in VARIANTS.values() if v.method == m]]


_TREE_ROLES = frozenset({"tree", "target_bonus", "rejected", "discarded"})


# Rows per forward: the verifier's pending tokens (the last bonus; two on M after a round whose
# draft it fully accepted) plus the draft it checks.
def _rows_one_token(s: Any) -> dict[str, tuple[int, int]]:
    return {"target": (1, 1)}


def _rows_sequence(s: Any) -> dict[str, tuple[int, int]]:
    return {"target": (s.spec_k + 1, s.spec_k + 1), "intermediate": (1, 2)}


def _rows_target_tree(s: Any) -> dict[str, tuple[int, int]]:
    # a drafted tree keeps its tree_size best candidates (settings refuse a size above their count)
    return {"target": (s.t_tree_size + 1, s.t_tree_size + 1)}


def _rows_hierspec(s: Any) -> dict[str, tuple[int, int]]:
    # M: E_M's tree; T: M's draft, at least min_draft_len, at most one tree's path and bonus more
    return {"intermediate": (s.m_tree_size + 1, s.m_tree_size + 2),
            "target": (s.min_draft_len + 1, s.min_draft_len + s.m_depth + 1)}


register(Method("ar", "Autoregressive", "AR", "#333333", "dash", (), TOKEN,
                "hierviz.decoding.decoders:decode_ar", compare_rank=3,
                stage_names={"target_verify": "T forward"}, roles=frozenset({"target_bonus"}),
                forward_rows=_rows_one_token,
                description="one target forward per token"))
register(Method("spec", "Sequence spec.", "Spec", "#B286E9", "dashdot", ("intermediate",), SEQUENCE,
                "hierviz.decoding.decoders:decode_spec",
                stage_names={"draft": "M drafts", "target_verify": "T verifies sequence"},
                roles=frozenset({"draft", "target_bonus", "rejected", "discarded"}), forward_rows=_rows_sequence,
                description="M drafts a sequence token by token, T verifies it"))
register(Method("eagle2", "EAGLE-2", "EAGLE-2", "#C96A00", "dot", ("e_t",), TREE,
                "hierviz.decoding.decoders:decode_eagle2", compare_rank=1,
                stage_names={"draft": "E_T draft", "target_verify": "T verifies tree"}, roles=_TREE_ROLES,
                counterpart="hierspec", tree_settings="t", forward_rows=_rows_target_tree,
                description="an EAGLE-1/2 head on T drafts a tree, T verifies the tree"))
register(Method("eagle3", "EAGLE-3", "EAGLE-3", "#7A3E00", "longdash", ("e_t3",), TREE,
                "hierviz.decoding.decoders:decode_eagle3", compare_rank=2,
                stage_names={"draft": "E_T draft (EAGLE-3)", "target_verify": "T verifies tree"}, roles=_TREE_ROLES,
                counterpart="hierspec", tree_settings="t", acceptance_as="eagle2", forward_rows=_rows_target_tree,
                description="an EAGLE-3 head on T drafts a tree, T verifies the tree"))
register(Method("hierspec", "HierSpec", "HierSpec", "#297B7A", "solid", ("intermediate", "e_m"), SEQUENCE,
                "hierviz.decoding.decoders:decode_hierspec", compare_rank=0,
                stage_names={"draft": "E_M draft", "intermediate_verify": "M verifies trees",
                             "target_verify": "T verifies sequence"},
                roles=frozenset({"tree", "intermediate_bonus", "target_bonus", "rejected", "discarded"}),
                counterpart="eagle2", tree_settings="m", forward_rows=_rows_hierspec,
                description="E_M drafts trees, M verifies them into a sequence, T verifies the sequence"))
register_variant(Variant("hierspec_eagle3", "hierspec", "HierSpec (EAGLE-3 E_M)", "HierSpec (E3 E_M)", "#5BB5B3",
                         "longdashdot", (("e_m", "eagle3"),),
                         description="HierSpec whose E_M is an EAGLE-3 head on M"))
