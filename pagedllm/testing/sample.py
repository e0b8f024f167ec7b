"""Sampling a check's parametrized cases (``--conformance-sample N``) for slow backends.

An emulated backend (the cuda kernels under the SIMT emulator: seconds per attention call) cannot
run every dtype x block size x head size x GQA group combination within the suite's 5-minute
budget. With ``N`` set, each check (one test function) keeps at most ``N`` of its declared cases,
raised where needed so that every value of every parameter the check varies (each declared head
size, GQA group, block size, dtype ...) still runs at least once; the cases left out are
reported SKIPPED ("sampled out"), never NOT DECLARED and never PASS. Undeclared cases are not
sampled: they are skipped and reported NOT DECLARED as in a full run.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedllm import envs

SAMPLE_ENV = "PAGEDLLM_CONFORMANCE_SAMPLE"
SAMPLED_OUT = "sampled out"


def sample_limit(option: str | int | None) -> int | None:
    """The per-check case limit: the option, else $PAGEDLLM_CONFORMANCE_SAMPLE; None: run all."""
    raw = option if option not in (None, "") else envs.get(SAMPLE_ENV)
    if raw in (None, "", "0", "all"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--conformance-sample / {SAMPLE_ENV}={raw!r}: expected a positive "
                         "number of cases per check, or 'all'")
    return value


def _pairs(params: dict[str, Any]) -> set[tuple[str, str]]:
    return {(k, repr(v)) for k, v in params.items()}


def choose(cases: Sequence[dict[str, Any]], limit: int) -> list[int]:
    """Indices of the cases to run: a greedy cover of every (parameter, value) pair (the case
    adding most uncovered pairs first; among equals the one whose values ran least so far, so
    e.g. head sizes spread over the dtypes; then the earliest), then cases spread evenly over
    the rest until ``limit`` (more than ``limit`` only when the cover needs it)."""
    pairs = [_pairs(c) for c in cases]
    uncovered = set().union(*pairs) if cases else set()
    used: dict[tuple[str, str], int] = {}
    chosen: list[int] = []
    while uncovered:
        best = max(range(len(cases)), key=lambda i: (len(pairs[i] & uncovered),
                                                     -sum(used.get(p, 0) for p in pairs[i]), -i))
        chosen.append(best)
        uncovered -= pairs[best]
        for p in pairs[best]:
            used[p] = used.get(p, 0) + 1
    rest = [i for i in range(len(cases)) if i not in chosen]
    room = limit - len(chosen)
    if room > 0 and rest:
        step = len(rest) / min(room, len(rest))
        chosen += [rest[int(k * step)] for k in range(min(room, len(rest)))]
    return sorted(chosen)


def sampled_out(items: Sequence[Any], limit: int, declared: Callable[[Any], bool]) -> set[str]:
    """Node ids of the suite ``items`` (pytest items) a run limited to ``limit`` cases per check
    leaves out; ``declared(item)`` says whether the backend declares all the item needs."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for item in items:
        if declared(item):
            key = (item.module.__name__, getattr(item, "originalname", item.name))
            groups.setdefault(key, []).append(item)
    out: set[str] = set()
    for group in groups.values():
        if len(group) <= limit:
            continue
        params = [dict(getattr(getattr(i, "callspec", None), "params", {})) for i in group]
        keep = set(choose(params, limit))
        out |= {i.nodeid for n, i in enumerate(group) if n not in keep}
    return out


def engine_skip(cls: type, module: Any) -> str | None:
    """Why a check of ``module`` is not run on backend ``cls``: the module needs the whole
    engine on the device (``NEEDS_ENGINE``) and the backend is a kernel-level stand-in (its
    ``conformance_kernels_only`` attribute gives the reason, e.g. kernels run by an emulator on
    the CPU). None: run it. Such checks are reported SKIPPED with that reason."""
    reason = getattr(cls, "conformance_kernels_only", None)
    if reason and getattr(module, "NEEDS_ENGINE", False):
        return f"engine-level check not run for this kernel-level backend: {reason}"
    # a stand-in may also name suite modules whose device code it does not route anywhere
    # ({"test_quant_linear": reason}): reported SKIPPED rather than passed on the reference
    not_covered = getattr(cls, "conformance_not_covered", {}) or {}
    name = getattr(module, "__name__", "").rsplit(".", 1)[-1]
    if reason and name in not_covered:
        return f"not run for this kernel-level backend: {not_covered[name]}"
    return None
