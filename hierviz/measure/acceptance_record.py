"""Published acceptance figures as records the what-if replays (assets/whatif/acceptance/).

A record (schema hierviz.acceptance-record/1) names its source and holds, per verification level
("target", "intermediate", "sequence"), the per-depth conditional rates derived from a published
mean acceptance length by the rule it states ("derivation"), the published figure and the tree
depth it was measured at. `python -m hierviz whatif` reads one through acceptance_import
(--acceptance-import, --eagle3-acceptance); docs/whatif.md gives the shipped records' sources.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from hierviz.measure.acceptance_form import (_HIERVIZ_DEFS, RECORD_SCHEMA, AcceptanceImportError,
                                             ImportedAcceptance, _count, _dict)


def expected_accepted(rates: list[float], depth: int) -> float:
    """Mean accepted draft tokens of a chain of `depth` positions accepted at these conditional
    rates (the last rate repeats): the sum over k of the products of the first k rates."""
    total, p = 0.0, 1.0
    for k in range(depth):
        p *= rates[min(k, len(rates) - 1)]
        total += p
    return total


def _record_level(fmt: str, definition: str, raw: Any, name: str) -> ImportedAcceptance:
    level = _dict(raw, f"level {name}")
    rates = level.get("rates")
    if not isinstance(rates, list) or not rates or not all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates):
        raise AcceptanceImportError(f"{fmt}: level {name}: rates must be a non-empty list of numbers in [0, 1]")
    depth = _count(level.get("tree_depth", len(rates)), f"level {name}: tree_depth") or len(rates)
    rates = [float(r) for r in rates]
    reached, p = [], 1.0
    for k in range(depth):
        p *= rates[min(k, len(rates) - 1)]
        reached.append(p)
    tau = level.get("published_tau")
    return ImportedAcceptance(fmt, definition, rates, reached, expected_accepted(rates, depth), 0, depth,
                              float(tau) if isinstance(tau, (int, float)) else None)


def read_record(doc: Any) -> ImportedAcceptance:
    """A published acceptance figure (assets/whatif/acceptance/): per level, the per-depth
    conditional rates derived from the published mean by the rule the record states."""
    fmt = "acceptance-record"
    d = _dict(doc, "the record")
    if d.get("schema") != RECORD_SCHEMA:
        raise AcceptanceImportError(f"{fmt}: schema must be {RECORD_SCHEMA}")
    source = d.get("source")
    if not isinstance(source, str) or not source.strip():
        raise AcceptanceImportError(f"{fmt}: the record names no source")
    definition = str(d.get("definition") or "published acceptance, as per-depth conditional rates")
    raw = _dict(d.get("levels"), "levels")
    unknown = sorted(set(raw) - set(_HIERVIZ_DEFS))
    if unknown or not raw:
        raise AcceptanceImportError(f"{fmt}: levels must be among {', '.join(_HIERVIZ_DEFS)}; got "
                                    f"{', '.join(unknown) or 'none'}")
    levels = {k: _record_level(fmt, definition, v, k) for k, v in raw.items()}
    top = next(k for k in ("target", "sequence", "intermediate") if k in levels)
    warnings = [f"a published figure, not a measurement: {d.get('derivation') or 'rates as the record gives them'}"]
    return replace(levels[top], levels=levels, warnings=warnings, citation=source.strip())
