"""What the conformance run proved: PASS / FAIL / NOT DECLARED per capability x dtype x block size
x head size, the terminal summary, and the machine-readable report (``--conformance-report``).

A check needs capabilities (its ``capability`` markers, ``dtype:NAME`` for a dtype parameter,
``head_size:N`` / ``gqa_group:N`` for swept limits). When the backend does not declare one, the
check is skipped with ``backend 'X' does not declare capability Y`` and is NOT DECLARED here. A
capability with any failed check is FAIL, never counted as covered.
"""
from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.testing.coverage import merge, summarize

NOT_DECLARED = "does not declare capability "
PASS, FAIL, UNDECLARED, SKIP = "PASS", "FAIL", "NOT DECLARED", "SKIPPED"
REPORT_SCHEMA = 2  # 2: "sweep", "coverage" and each check's "shape"


def capability_label(name: str) -> str:
    from pagedllm.testing.sweep import limit_label

    return f"dtype {name[6:]}" if name.startswith("dtype:") else limit_label(name)


@dataclass
class CheckDims:
    """Where a check sits in the matrix (None: the check does not vary that dimension)."""

    capability: str  # its non-dtype, non-head-size need, else its area
    dtype: str | None = None
    block_size: int | None = None
    head_size: int | None = None
    gqa_group: int | None = None


@dataclass
class Coverage:
    backend: str = ""
    source: str = ""
    header: str = ""  # torch device, dtypes, block sizes, declared capabilities
    area_of: dict[str, str] = field(default_factory=dict)  # nodeid -> area
    needs_of: dict[str, list[str]] = field(default_factory=dict)  # nodeid -> capabilities
    dims_of: dict[str, CheckDims] = field(default_factory=dict)  # nodeid -> matrix position
    outcome: dict[str, str] = field(default_factory=dict)  # nodeid -> passed/failed/skipped
    missing: dict[str, str] = field(default_factory=dict)  # nodeid -> undeclared capability
    figures: dict[str, list[dict]] = field(default_factory=dict)  # nodeid -> metrics.Figure dicts
    messages: dict[str, str] = field(default_factory=dict)  # nodeid -> failure/skip reason
    info: dict[str, Any] = field(default_factory=dict)  # backend facts for the JSON report
    label_of: dict[str, str] = field(default_factory=dict)  # nodeid -> "module::test[params]"
    shapes: dict[str, dict[str, list]] = field(default_factory=dict)  # nodeid -> coverage facts

    def record(self, nodeid: str, when: str, outcome: str, message: str = "") -> None:
        if nodeid not in self.area_of:
            return
        if outcome == "failed":
            self.outcome[nodeid] = "failed"  # an error in setup or teardown counts as a failure
            self.messages.setdefault(nodeid, message)
        elif when == "call" or (when == "setup" and outcome == "skipped"):
            self.outcome.setdefault(nodeid, outcome)
            if outcome == "skipped":
                self.messages.setdefault(nodeid, message)

    def status(self, nodeid: str) -> str:
        outcome = self.outcome.get(nodeid, "skipped")
        if outcome == "passed":
            return PASS
        if outcome == "failed":
            return FAIL
        return UNDECLARED if nodeid in self.missing else SKIP

    # --- the matrix ----------------------------------------------------------------------
    def matrix(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(capability, dtype) -> {status, passed, failed, block_sizes, head_sizes, failures}:
        FAIL if any check failed, PASS if some passed and none failed, else NOT DECLARED (or
        SKIPPED when skipped for another reason)."""
        cells: dict[tuple[str, str], dict[str, Any]] = defaultdict(
            lambda: {"passed": 0, "failed": 0, "undeclared": 0, "skipped": 0,
                     "block_sizes": set(), "head_sizes": set(), "gqa_groups": set(),
                     "failures": []})
        for nodeid in self.outcome:
            d = self.dims_of.get(nodeid) or CheckDims(self.area_of[nodeid])
            st = self.status(nodeid)
            cap = capability_label(self.missing[nodeid]) if st == UNDECLARED else d.capability
            cell = cells[cap, d.dtype or "-"]
            cell[{PASS: "passed", FAIL: "failed", UNDECLARED: "undeclared", SKIP: "skipped"}[st]] += 1
            if st in (PASS, FAIL):
                if d.block_size is not None:
                    cell["block_sizes"].add(d.block_size)
                if d.head_size is not None:
                    cell["head_sizes"].add(d.head_size)
                if d.gqa_group is not None:
                    cell["gqa_groups"].add(d.gqa_group)
            if st == FAIL:
                cell["failures"].append(nodeid)
        out = {}
        for key, c in cells.items():
            status = (FAIL if c["failed"] else PASS if c["passed"] else
                      UNDECLARED if c["undeclared"] else SKIP)
            out[key] = dict(c, status=status, block_sizes=sorted(c["block_sizes"]),
                            head_sizes=sorted(c["head_sizes"]), gqa_groups=sorted(c["gqa_groups"]))
        return out

    def lines(self) -> list[str]:
        if not self.outcome:
            return []
        counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for nodeid, outcome in self.outcome.items():
            counts[self.area_of[nodeid]][outcome] += 1
        out = [self.header, "", f"{'area':<28} {'passed':>7} {'failed':>7} {'skipped':>8}"]
        for area in sorted(counts):
            c = counts[area]
            out.append(f"{area:<28} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
        out += ["", f"{'capability':<26} {'dtype':<9} {'result':<13} {'checks':>6}  "
                    "proven for (bs: block sizes, hs: head sizes, g: GQA groups)"]
        for (cap, dtype), cell in sorted(self.matrix().items()):
            n = cell["passed"] + cell["failed"]
            result = cell["status"] + (f" {cell['failed']}/{n}" if cell["failed"] else "")
            sizes = " ".join(f"{tag} {','.join(map(str, cell[key]))}" for tag, key in
                             (("bs", "block_sizes"), ("hs", "head_sizes"), ("g", "gqa_groups"))
                             if cell[key]) or "-"
            out.append(f"{cap:<26} {dtype:<9} {result:<13} {n or cell['undeclared']:>6}  {sizes}")
        coverage = self.coverage()
        if coverage:
            out += ["", "shape coverage (what the passed cases reached, per check):"]
            for check, facts in sorted(coverage.items()):
                out.append(f"  {check} [{facts['passed']} passed]: {summarize(facts['shape'])}")
        failed = sorted({cap for (cap, _), c in self.matrix().items() if c["status"] == FAIL})
        out.append("")
        out.append("FAILED capabilities: " + (", ".join(failed) if failed else "none"))
        return out

    def coverage(self) -> dict[str, dict[str, Any]]:
        """check function ("module::test") -> {passed: n, shape: the union of what its passed
        cases noted (coverage.py)}; checks that noted nothing are left out."""
        by_check: dict[str, list[str]] = defaultdict(list)
        for nodeid in self.outcome:
            if self.status(nodeid) == PASS and self.shapes.get(nodeid):
                by_check[self.label_of.get(nodeid, nodeid).split("[")[0]].append(nodeid)
        return {check: {"passed": len(ids), "shape": merge(self.shapes[i] for i in ids)}
                for check, ids in by_check.items()}

    # --- the machine-readable report ----------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        checks = []
        for nodeid in sorted(self.outcome):
            d = self.dims_of.get(nodeid) or CheckDims(self.area_of[nodeid])
            figures = self.figures.get(nodeid, [])
            finite = [f["max_error"] for f in figures if f["max_error"] != float("inf")]
            checks.append({
                "id": self.label_of.get(nodeid, nodeid), "area": self.area_of[nodeid], "capability": d.capability,
                "dtype": d.dtype, "block_size": d.block_size, "head_size": d.head_size,
                "gqa_group": d.gqa_group,
                "needs": self.needs_of.get(nodeid, []), "status": self.status(nodeid),
                "max_error": (max(finite) if len(finite) == len(figures) else "inf")
                if figures else None,
                "nmse": max((f["nmse"] for f in figures), default=None) if figures else None,
                "figures": [{k: (v if v != float("inf") else "inf") for k, v in f.items()}
                            for f in figures],
                "shape": self.shapes.get(nodeid, {}),
                "message": self.messages.get(nodeid, "")[:2000]})
        matrix = [{"capability": cap, "dtype": dtype, **{k: v for k, v in cell.items()
                                                        if k != "failures"}}
                  for (cap, dtype), cell in sorted(self.matrix().items())]
        summary = {s: sum(1 for c in checks if c["status"] == s)
                   for s in (PASS, FAIL, UNDECLARED, SKIP)}
        return {"schema": REPORT_SCHEMA, **self.info, "backend": self.backend,
                "source": self.source, "summary": summary, "matrix": matrix,
                "coverage": self.coverage(), "checks": checks}

    def write_json(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")


def git_commit(cwd: str | None = None) -> str:
    """The checkout's commit (with '-dirty' when it has local changes), or 'unknown'."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=cwd, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=cwd, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
