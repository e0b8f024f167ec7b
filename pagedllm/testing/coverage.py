"""What shapes each check actually reached, for the report (issue 41, item 6).

A check (or the helpers it calls: ``PagedBatch.run``, the ops sweep, the cache checks) notes the
facts of what it ran: ``note(kv_heads=8, seqs=68, max_block_id=70000)``. The pytest plugin opens
and closes the sink around each check, like ``metrics.SINK``; the report lists, per check and per
check function, every value each fact took (numbers as their range and count), so a vendor sees
what was and was not exercised.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class _ShapeSink:
    def __init__(self) -> None:
        self.facts: dict[str, set] | None = None

    def open(self) -> None:
        self.facts = {}

    def close(self) -> dict[str, list]:
        facts, self.facts = self.facts or {}, None
        return {k: sorted(v, key=_order) for k, v in facts.items()}

    def note(self, **facts: Any) -> None:
        if self.facts is None:
            return
        for key, value in facts.items():
            if value is None:
                continue
            values = value if isinstance(value, (list, tuple, set)) else [value]
            self.facts.setdefault(key, set()).update(values)


def _order(v: Any) -> tuple:
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))


SHAPES = _ShapeSink()
note = SHAPES.note


def merge(facts: Iterable[dict[str, list]]) -> dict[str, list]:
    """The union of several checks' facts."""
    out: dict[str, set] = {}
    for f in facts:
        for k, values in f.items():
            out.setdefault(k, set()).update(values)
    return {k: sorted(v, key=_order) for k, v in out.items()}


def summarize(facts: dict[str, list]) -> str:
    """'kv_heads 1,3,8; seqs 4..71 (12 values)' for the terminal summary."""
    parts = []
    for key, values in sorted(facts.items()):
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(values) and len(values) > 6:
            parts.append(f"{key} {_num(min(numbers))}..{_num(max(numbers))} ({len(values)} values)")
        else:
            parts.append(f"{key} {','.join(_num(v) for v in values)}")
    return "; ".join(parts)


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
