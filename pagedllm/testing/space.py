"""The declared space a check sweeps, and which of its combinations a run takes (issue 41).

A *dimension* is one axis a backend's result may depend on. Its values come from what the
backend declares (every dtype, KV-cache dtype, block size, head size, attention feature) or, for
an axis it does not declare (KV heads, the step's shape class, an op's row count or width), from
a fixed list holding the axis's extremes and values that are not multiples of any plausible tile
width (3 KV heads, 67 decodes, a 549-token prompt, a vocabulary of 50,257 ...).

A run takes one *sweep* of the product of a check's dimensions:

- ``pairs`` (the default): a covering array. Every value of every dimension appears together
  with every *representative* of every other dimension in at least one case: its extremes and
  its values that are not multiples of common tile widths (for block sizes the smallest and
  largest declared; for head sizes those and the declared size with the fewest factors of 2;
  for the other dimensions, whose lists hold only such values, all of them). So each declared
  capability value meets each other dimension's extremes and odd values. The free choices are
  drawn from a generator seeded by ``--conformance-seed`` (reported), so another seed explores
  other combinations with the same guarantee;
- ``values`` (with ``--conformance-sample``, for emulated backends): every value at least once;
- ``full`` (``--conformance-full``): every combination.

A few value pairs are *excluded* where they only multiply the float64 reference's cost
(8 KV heads with the 16k-token shapes); each excluded pair is listed by the check.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PAIRS, VALUES, FULL = "pairs", "values", "full"
SWEEPS = (PAIRS, VALUES, FULL)
DEFAULT_SEED = 41

Pair = tuple[tuple[str, Any], tuple[str, Any]]


@dataclass(frozen=True)
class Space:
    """A check's dimensions (name -> values, in order), the value pairs it never combines, and
    per dimension its *representatives* (default: every value): its extremes and its values
    that are not multiples of common tile widths, which every value of every other dimension
    must meet."""

    dims: Mapping[str, Sequence[Any]]
    excluded: frozenset[Pair] = frozenset()
    reps: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    # dimension -> value -> relative cost; among equally useful values a case takes the cheapest
    cost: Mapping[str, Mapping[Any, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        empty = [name for name, values in self.dims.items() if not values]
        if empty:
            raise ValueError(f"dimension(s) {empty} have no values")

    @property
    def size(self) -> int:
        """How many combinations ``full`` runs (before exclusions)."""
        n = 1
        for values in self.dims.values():
            n *= len(values)
        return n

    def allowed(self, case: Mapping[str, Any], name: str, value: Any) -> bool:
        return not any(_pair(name, value, other, v) in self.excluded
                       for other, v in case.items() if other != name)

    def cases(self, sweep: str, seed: int) -> list[dict[str, Any]]:
        """The combinations a ``sweep`` takes, in a stable order for a given ``seed``."""
        if sweep not in SWEEPS:
            raise ValueError(f"sweep={sweep!r}: expected one of {', '.join(SWEEPS)}")
        if sweep == FULL:
            names = list(self.dims)
            out = []
            for combo in itertools.product(*self.dims.values()):
                case = dict(zip(names, combo))
                if all(self.allowed(case, n, v) for n, v in case.items()):
                    out.append(case)
            return out
        rng = random.Random(f"{seed}:{sorted(self.dims)}")
        return self._values(rng) if sweep == VALUES else self._pairs(rng)

    # --- strength 1: every value once -------------------------------------------------------
    def _values(self, rng: random.Random) -> list[dict[str, Any]]:
        orders = {n: rng.sample(list(v), len(v)) for n, v in self.dims.items()}
        longest = max(len(v) for v in orders.values())
        cases = []
        for i in range(longest):
            case: dict[str, Any] = {}
            for name, values in orders.items():
                # the i-th value (cycling), else the first one this case allows
                candidates = values[i % len(values):] + values[:i % len(values)]
                case[name] = next((v for v in candidates if self.allowed(case, name, v)),
                                  candidates[0])
            cases.append(case)
        return cases

    # --- strength 2: every pair of values once (a greedy covering array, AETG-style) ----------
    def representatives(self, name: str) -> Sequence[Any]:
        return self.reps.get(name) or self.dims[name]

    def required_pairs(self) -> set[Pair]:
        """Every value of each dimension with every representative of each other one."""
        names = list(self.dims)
        out = set()
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                combos = [(va, vb) for va in self.dims[a] for vb in self.representatives(b)]
                combos += [(va, vb) for va in self.representatives(a) for vb in self.dims[b]]
                out |= {p for va, vb in combos if (p := _pair(a, va, b, vb)) not in self.excluded}
        return out

    def _pairs(self, rng: random.Random) -> list[dict[str, Any]]:
        uncovered = self.required_pairs()
        names = list(self.dims)
        cases: list[dict[str, Any]] = []
        while uncovered:
            (a, va), (b, vb) = rng.choice(sorted(uncovered, key=repr))
            case = {a: va, b: vb}
            rest = [n for n in names if n not in case]
            rng.shuffle(rest)
            for name in rest:
                def gain(v: Any, name: str = name) -> int:
                    return sum(_pair(name, v, o, ov) in uncovered for o, ov in case.items())
                options = [v for v in self.dims[name] if self.allowed(case, name, v)]
                options = options or list(self.dims[name])
                best = max(gain(v) for v in options)
                useful = [v for v in options if gain(v) == best]
                prices = self.cost.get(name, {})
                cheapest = min(prices.get(v, 1.0) for v in useful)
                case[name] = rng.choice([v for v in useful if prices.get(v, 1.0) == cheapest])
            uncovered -= pairs_of(case)
            cases.append({n: case[n] for n in names})
        return cases


def _pair(a: str, va: Any, b: str, vb: Any) -> Pair:
    return ((a, va), (b, vb)) if a < b else ((b, vb), (a, va))


def pairs_of(case: Mapping[str, Any]) -> set[Pair]:
    items = sorted(case.items(), key=lambda kv: kv[0])
    return {_pair(a, va, b, vb) for (a, va), (b, vb) in itertools.combinations(items, 2)}


def exclude(pairs: Sequence[tuple[str, Any, str, Any]]) -> frozenset[Pair]:
    """``[(dim, value, other dim, other value), ...]`` as a Space's ``excluded``."""
    return frozenset(_pair(a, va, b, vb) for a, va, b, vb in pairs)


@dataclass
class SweepChoice:
    """What a run sweeps: the mode, the seed, and per check how many cases of how many."""

    sweep: str = PAIRS
    seed: int = DEFAULT_SEED
    taken: dict[str, tuple[int, int]] = field(default_factory=dict)  # check -> (cases, space)

    def describe(self) -> str:
        total = sum(t for t, _ in self.taken.values())
        space = sum(s for _, s in self.taken.values())
        return (f"sweep {self.sweep} (seed {self.seed}): {total} of {space} combinations over "
                f"{len(self.taken)} swept check(s)")


def odd_one_out(values: Sequence[int]) -> int:
    """The value with the smallest power-of-two factor (the least tile-friendly; ties: the
    largest), e.g. 72 of (64, 72, 80, 128)."""
    return max(values, key=lambda v: (-(v & -v), v))


def extremes_and_odd(values: Sequence[int]) -> list[int]:
    """A numeric dimension's representatives: its smallest, largest and least tile-friendly."""
    return sorted({min(values), max(values), odd_one_out(values)})


def case_id(case: Mapping[str, Any]) -> str:
    """A readable pytest id: values joined by '-', with short dimension tags."""
    parts = []
    for name, value in case.items():
        tag = ID_TAGS.get(name, "")
        parts.append(f"{tag}{value}" if tag or not isinstance(value, bool)
                     else f"{name}{int(value)}")
    return "-".join(str(p).replace(" ", "") for p in parts)


ID_TAGS = {"block_size": "bs", "head_size": "hs", "kv_heads": "kv", "group": "g", "rows": "r",
           "width": "w", "experts": "e", "topk": "top", "vocab": "v"}
