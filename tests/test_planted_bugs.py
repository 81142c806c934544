"""The planted-bug list (tests/planted_bugs.py) stays applicable to the source as it is."""
from __future__ import annotations

from tests.planted_bugs import BUGS, ROOT, applies


def test_every_planted_bug_still_applies() -> None:
    stale = [b.id for b in BUGS if not applies(b)]
    assert not stale, f"planted bugs whose text no longer occurs exactly once: {stale} (update tests/planted_bugs.py)"
    assert len({b.id for b in BUGS}) == len(BUGS)
    for b in BUGS:
        assert b.old != b.new and b.tests and all((ROOT / t).is_file() for t in b.tests), b.id
