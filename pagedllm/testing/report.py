"""What the conformance run covered: outcomes per area and the capabilities it had to skip.

A check needs capabilities (its ``capability`` markers, plus ``dtype:NAME`` for a dtype
parameter). When the backend does not declare one, the check is skipped with the reason
``backend 'X' does not declare capability Y`` and counted here, so the summary tells a vendor
exactly what the run did and did not cover.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

NOT_DECLARED = "does not declare capability "


def capability_label(name: str) -> str:
    from pagedllm.testing.sweep import limit_label

    return f"dtype {name[6:]}" if name.startswith("dtype:") else limit_label(name)


@dataclass
class Coverage:
    backend: str = ""
    source: str = ""
    header: str = ""  # torch device, dtypes, block sizes, declared capabilities
    area_of: dict[str, str] = field(default_factory=dict)  # nodeid -> area
    needs_of: dict[str, list[str]] = field(default_factory=dict)  # nodeid -> capabilities
    outcome: dict[str, str] = field(default_factory=dict)  # nodeid -> passed/failed/skipped
    missing: dict[str, str] = field(default_factory=dict)  # nodeid -> undeclared capability
    figures: dict[str, list[dict]] = field(default_factory=dict)  # nodeid -> metrics.Figure dicts

    def record(self, nodeid: str, when: str, outcome: str) -> None:
        if nodeid not in self.area_of:
            return
        if outcome == "failed":
            self.outcome[nodeid] = "failed"  # an error in setup or teardown counts as a failure
        elif when == "call" or (when == "setup" and outcome == "skipped"):
            self.outcome.setdefault(nodeid, outcome)

    def lines(self) -> list[str]:
        if not self.outcome:
            return []
        per_area: dict[str, Counter] = defaultdict(Counter)
        for nodeid, outcome in self.outcome.items():
            per_area[self.area_of[nodeid]][outcome] += 1
        out = [self.header, "", f"{'area':<28} {'passed':>7} {'failed':>7} {'skipped':>8}"]
        for area in sorted(per_area):
            c = per_area[area]
            out.append(f"{area:<28} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
        covered: Counter = Counter()
        for nodeid, outcome in self.outcome.items():
            if outcome in ("passed", "failed"):
                covered.update(capability_label(n) for n in self.needs_of[nodeid])
        skipped: dict[str, Counter] = defaultdict(Counter)
        for nodeid, cap in self.missing.items():
            if self.outcome.get(nodeid) == "skipped":
                skipped[capability_label(cap)][self.area_of[nodeid]] += 1
        out.append("")
        out.append("capabilities exercised: " + (", ".join(
            f"{cap} ({n})" for cap, n in sorted(covered.items())) or "none"))
        if skipped:
            out.append("not declared by the backend, so not checked:")
            for cap in sorted(skipped):
                areas = ", ".join(f"{area}: {n}" for area, n in sorted(skipped[cap].items()))
                out.append(f"  {cap:<20} {sum(skipped[cap].values())} check(s) skipped ({areas})")
        else:
            out.append("every capability check ran (nothing skipped for an undeclared capability)")
        return out
