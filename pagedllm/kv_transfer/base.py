"""The KV connector interface, scheduler side (no torch here), and the block moves a step
carries to the workers.

A connector holds KV blocks somewhere other than the device cache, under the prefix cache's
content keys (keys.py), in one or more named *stores* (the offload connector: "host" and
"disk"; the shared-storage connector: "shared"). Its scheduler side decides, by key alone:
where a key can be loaded from (``locate``), what to save when the device cache evicts a block
(``on_evict``: offload tiers) or when a computed block enters the prefix cache
(``on_computed``: a producer). The data moves on the worker side: each connector names the
worker class that opens its stores (``worker_class``, a "module:Class" string, as backends name
their worker), and the worker runs every step's ``KVStepOps`` through the backend's
``CacheOps.export_blocks`` / ``import_blocks``.

Connectors are found by name: the built-ins and the entry-point group "pagedllm.kv_connectors"
(registry.py), like backends.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

Key = Hashable  # a content key (bytes: kv_transfer/keys.py)
Slot = Any  # where a store keeps a block: an int for a pool, the key for a keyed store


@dataclass
class KVStepOps:
    """A step's block moves, for the workers. ``stores`` run in order before the step's swaps
    and writes (an evicted block is saved before its reuse overwrites it; a demotion runs
    before the save that reuses its slot): ``("save", store, device_block, slot)`` or
    ``("move", src_store, src_slot, dst_store, dst_slot)``. ``loads`` start after the swaps:
    ``(store, slot, device_block)``; they overlap the step's forward and are complete (or
    failed) before the worker's next step, or when ``take_load_results`` asks.
    ``ready_loads`` (same form, from a connector's ``step_stores``) run after the swaps too,
    ordered before the step's forward on the device: the step's sequences read them."""

    stores: list[tuple] = field(default_factory=list)
    loads: list[tuple[str, Slot, int]] = field(default_factory=list)
    ready_loads: list[tuple[str, Slot, int]] = field(default_factory=list)
    # (key, store, slot, device_block) of each load, kept on the engine's side (not sent)
    load_keys: list[tuple[Key, str, Slot, int]] = field(default_factory=list, repr=False)
    # (key, store, connector) of each ready load: unpinned once the step has run (not sent)
    ready_keys: list[tuple[Key, str, Any]] = field(default_factory=list, repr=False)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.ready_loads)

    def extend(self, other: KVStepOps) -> None:
        self.stores += other.stores
        self.loads += other.loads
        self.ready_loads += other.ready_loads
        self.load_keys += other.load_keys
        self.ready_keys += other.ready_keys

    def for_workers(self) -> KVStepOps:
        """The moves alone (what crosses to worker processes)."""
        return KVStepOps(list(self.stores), list(self.loads), list(self.ready_loads))

    def __getstate__(self) -> dict:
        return {"stores": self.stores, "loads": self.loads, "ready_loads": self.ready_loads,
                "load_keys": [], "ready_keys": []}


class KVConnector(ABC):
    """A connector's scheduler side: which keys it can supply and what it saves.

    Constructed with the engine's config and the number of slots each of its stores has
    (``slots``: what every worker's side reported, the minimum over workers). Everything is
    by content key and store slot; nothing here sees a tensor.
    """

    name: ClassVar[str]
    # the worker side: a "module:Class" whose constructor takes (config, spec, layout) and
    # which opens this connector's stores (kv_transfer/worker_side.py)
    worker_class: ClassVar[str]
    # stores whose loads cannot fail once issued (memory of this process): a sequence whose
    # prefix continues only in them is admitted in the step that loads it, the loads queued
    # on the device before that step's forward (``KVStepOps.ready_loads``)
    step_stores: ClassVar[frozenset[str]] = frozenset()
    # where ``on_computed``'s moves go: True (a producer), handed to the workers right after the
    # step that computed the blocks and waited for (a consumer may look for them as soon as the
    # request's output is out); False, they ride on the next step's moves like ``on_evict``'s
    # (run before its writes, the copies overlapping it: an offload tier's write-through)
    computed_saves_at_once: ClassVar[bool] = True

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        self.config = config
        self.slots = slots

    @classmethod
    def worker_spec(cls, config: Any) -> dict[str, Any]:
        """Plain data the worker side is built from (sent to every worker)."""
        return {}

    # --- lookups ------------------------------------------------------------------------
    @abstractmethod
    def locate(self, key: Key) -> tuple[str, Slot] | None:
        """(store, slot) a block with ``key`` can be loaded from, or None."""

    def pin(self, key: Key) -> None:
        """Keep ``key`` where ``locate`` found it until ``unpin`` (a load reads it)."""

    def unpin(self, key: Key, store: str) -> None:
        """The load of ``key`` from ``store`` (where ``locate`` found it) has run."""

    def loaded(self, key: Key, store: str) -> None:
        """A load of ``key`` from ``store`` succeeded (LRU, counters)."""

    def load_failed(self, key: Key, store: str, slot: Slot) -> None:
        """A load of ``key`` failed: forget it (the engine computes the block instead)."""

    # --- saves --------------------------------------------------------------------------
    def on_evict(self, block: int, key: Key, ops: KVStepOps) -> None:
        """The device cache evicts ``block`` (holding ``key``) to reuse it this step: append
        the moves that keep its content (offload tiers); default: nothing."""

    def on_computed(self, block: int, key: Key, ops: KVStepOps) -> None:
        """``block`` now holds ``key`` (computed by this engine, or loaded): a producer saves
        it, an offload tier writes it through (``computed_saves_at_once`` says when the moves
        run); default: nothing."""

    # --- bookkeeping --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters and residency per store, for metrics and logs."""
        return {}

    def check_idle(self) -> list[str]:
        """Broken invariants at idle (no request, no load in flight); [] when all hold."""
        return []

    def close(self) -> None:
        """The engine shuts down: release connections and threads (default: nothing)."""


class RemoteStoreConnector(KVConnector):
    """A connector whose blocks live outside this engine (a shared folder, a producer engine,
    LMCache): counts its loads, failed loads and saves (``counters``) and keeps a key whose
    load failed from being offered again (``is_broken``): for ``retry_s`` seconds when set, else
    until ``MAX_BROKEN`` newer failures push it out."""

    MAX_BROKEN: ClassVar[int] = 1 << 16
    retry_s: float | None = None

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        super().__init__(config, slots)
        self.counters: Counter[str] = Counter()
        self._broken: OrderedDict[Key, float] = OrderedDict()  # key -> when its load failed

    def is_broken(self, key: Key) -> bool:
        failed_at = self._broken.get(key)
        if failed_at is None:
            return False
        if self.retry_s is not None and time.monotonic() - failed_at >= self.retry_s:
            del self._broken[key]
            return False
        return True

    def forget_broken(self, key: Key) -> None:
        """``key`` is good again (computed and saved anew)."""
        self._broken.pop(key, None)

    def loaded(self, key: Key, store: str) -> None:
        self.counters["loaded"] += 1

    def load_failed(self, key: Key, store: str, slot: Slot) -> None:
        self.counters["failed"] += 1
        self._broken[key] = time.monotonic()
        self._broken.move_to_end(key)
        if len(self._broken) > self.MAX_BROKEN:
            self._broken.popitem(last=False)
