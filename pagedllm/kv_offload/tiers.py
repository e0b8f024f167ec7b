"""One KV offload tier's slots: which content key each holds, in LRU order, and which are
pinned by a load in flight. No torch here.

Invariant: every slot is either free or holds exactly one key; ``len(free) + len(keys) ==
num_slots``; pinned keys are resident; at idle nothing is pinned (check_idle).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable


class TierIndex:
    def __init__(self, name: str, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"{name} tier: num_slots={num_slots} must be >= 0")
        self.name = name
        self.num_slots = num_slots
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # LRU first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._pins: Counter[Hashable] = Counter()
        # cumulative counters
        self.num_stored = 0  # blocks written into the tier
        self.num_hits = 0  # blocks loaded back from it
        self.num_evicted = 0  # resident blocks dropped to make room

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, key: Hashable) -> int | None:
        return self._slot_of.get(key)

    def touch(self, key: Hashable) -> None:
        """``key`` was used: most recently used."""
        self._slot_of.move_to_end(key)

    def insert(self, key: Hashable) -> tuple[int, tuple[Hashable, int] | None] | None:
        """A slot for ``key`` (not resident): a free one, else the least recently used
        unpinned one, whose (key, slot) is returned as the victim. None: no slot (the tier
        has none, or every resident key is pinned)."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            old = next((k for k in self._slot_of if not self._pins[k]), None)
            if old is None:
                return None
            slot = self._slot_of.pop(old)
            victim = (old, slot)
            self.num_evicted += 1
        self._slot_of[key] = slot
        self.num_stored += 1
        return slot, victim

    def remove(self, key: Hashable) -> None:
        """Forget ``key`` (its content turned out unreadable); its slot becomes free."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._pins.pop(key, None)
            self._free.append(slot)

    def pin(self, key: Hashable) -> None:
        self._pins[key] += 1

    def unpin(self, key: Hashable) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    @property
    def num_pinned(self) -> int:
        return sum(1 for n in self._pins.values() if n > 0)

    def check_idle(self) -> list[str]:
        problems = []
        if len(self._free) + len(self._slot_of) != self.num_slots:
            problems.append(f"{self.name} tier: {len(self._free)} free + {len(self._slot_of)} "
                            f"resident != {self.num_slots} slots")
        if len(set(self._free)) != len(self._free) or set(self._free) & set(self._slot_of.values()):
            problems.append(f"{self.name} tier: a slot is both free and resident, or free twice")
        if self.num_pinned:
            problems.append(f"{self.name} tier: {self.num_pinned} keys still pinned at idle")
        return problems
