"""The one form every acceptance import takes (`ImportedAcceptance`), its error, the levels a
hierarchical run has, and the small checked readers the importers (acceptance_import) and the
published records (acceptance_record) share."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

RECORD_SCHEMA = "hierviz.acceptance-record/1"


class AcceptanceImportError(ValueError):
    """Acceptance data that cannot be imported; the message says why in words a user understands."""


@dataclass(frozen=True)
class ImportedAcceptance:
    """Acceptance statistics of one verification level, as one engine recorded them.

    rates[k-1]: conditional acceptance at draft position k, P(position k accepted | positions
        1..k-1 accepted and position k drafted), k = 1..K. This is what hierviz's what-if replays
        (RatesOracle: depth d accepted given d-1 was, with probability rates[d-1]). Empty when the
        format has no per-position data (then see warnings).
    accepted_per_position[k-1]: unconditional P(at least k draft tokens accepted in a step).
    mean_accepted_length: mean accepted DRAFT tokens per verification step (bonus excluded).
    tokens_per_step: mean_accepted_length + 1: every engine here emits one bonus / correction token
        per verification step, so this is the tokens a step adds to the output.
    reported_mean_length: the engine's own headline acceptance length, exactly as that engine
        defines it (see `definition`); None when the format reports none.
    steps: verification steps the statistics rest on.
    draft_length: K, the configured draft length when the format records it, else the longest
        accepted length seen (inferred; a warning says so).
    accept_lengths: per-step accepted draft tokens (bonus excluded), when the format has them.
    levels: for hierarchical / cascade data, the statistics of each level by name: "target" (trees
        verified by the target), "intermediate" (trees verified by the intermediate model),
        "sequence" (the intermediate's sequence drafts verified by the target).
    citation: for an acceptance record, the publication its figures come from.
    """

    source_format: str
    definition: str
    rates: list[float]
    accepted_per_position: list[float]
    mean_accepted_length: float
    steps: int
    draft_length: Optional[int] = None
    reported_mean_length: Optional[float] = None
    accept_lengths: Optional[list[int]] = None
    levels: dict[str, "ImportedAcceptance"] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    citation: Optional[str] = None     # where a published record's figures come from

    @property
    def tokens_per_step(self) -> float:
        return self.mean_accepted_length + 1.0


def _count(v: Any, where: str) -> int:
    """A non-negative count: an int, or an integral finite float (Prometheus writes 12.0)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise AcceptanceImportError(f"{where}: expected a count, got {type(v).__name__}")
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise AcceptanceImportError(f"{where}: expected a whole count, got {v!r}")
        v = int(v)
    if v < 0:
        raise AcceptanceImportError(f"{where}: counts cannot be negative, got {v}")
    return v


def _counts(v: Any, where: str) -> list[int]:
    if not isinstance(v, list):
        raise AcceptanceImportError(f"{where}: expected a list of counts, got {type(v).__name__}")
    return [_count(x, f"{where}[{i}]") for i, x in enumerate(v)]


def _dict(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise AcceptanceImportError(f"{where}: expected an object, got {type(v).__name__}")
    return v


_HIERVIZ_DEFS = {
    "target": "hierviz: per round, the length of the target-verified tree's accepted path (draft tokens, bonus "
              "excluded), and the tree's depth as the positions drafted.",
    "intermediate": "hierviz: per E_M tree verified by the intermediate model, the accepted path length (bonus "
                    "excluded), and the tree's depth as the positions drafted.",
    "sequence": "hierviz: per round, the draft tokens the target accepted of the intermediate's sequence draft "
                "(target_accepted, bonus excluded), and the sequence length as the positions drafted.",
}
