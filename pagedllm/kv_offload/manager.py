"""The offload connector's scheduler side: blocks evicted from the device cache go down the
tiers (host memory, then disk), each tier an LRU of content keys; a key found in a tier is
loaded from there. No torch here.

Write-through: a block entering the device prefix cache (computed, or loaded from the disk
tier) is saved into the host tier at once (``on_computed``; the copy rides on the next step and
overlaps it), as vLLM's offloading connector stores computed blocks: evicting it later costs
nothing, and a host-tier hit never waits for the device-to-host copy of the blocks evicted to
make room for it. The disk tier is written on demotion from the host tier (or, without a host
tier, on eviction), so it costs no disk writes for blocks that are never evicted.

What a device eviction of a block with key K does:
  - K already in the host tier (or, without one, in the disk tier): only LRU order changes;
  - else K gets a host slot (the least recently used unpinned key there is demoted to the
    disk tier, unless the disk already holds it, or dropped without a disk tier) and the block
    is saved into it; without a host tier it is saved to the disk tier directly.
The moves are recorded in order (a demotion before the save that reuses its slot); the worker
runs them before the step overwrites the block.
"""
from __future__ import annotations

from typing import Any, ClassVar

from pagedllm.kv_offload.tiers import TierIndex
from pagedllm.kv_transfer.base import Key, KVConnector, KVStepOps, Slot

HOST, DISK = "host", "disk"


class OffloadingConnector(KVConnector):
    name: ClassVar[str] = "OffloadingConnector"
    worker_class: ClassVar[str] = "pagedllm.kv_offload.stores:OffloadingWorker"
    step_stores: ClassVar[frozenset[str]] = frozenset({HOST})  # the worker's own memory
    computed_saves_at_once: ClassVar[bool] = False  # write-through rides on the next step

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        super().__init__(config, slots)
        self.host = TierIndex(HOST, slots.get(HOST, 0)) if slots.get(HOST) else None
        self.disk = TierIndex(DISK, slots.get(DISK, 0)) if slots.get(DISK) else None
        self.tiers = [t for t in (self.host, self.disk) if t is not None]

    @classmethod
    def worker_spec(cls, config: Any) -> dict[str, Any]:
        """The tier sizes in bytes and the disk folder (config.kv_offload_config)."""
        off = config.kv_offload_config
        gib = 1 << 30
        return {HOST: int(off.size_gib * gib), DISK: int((off.disk_size_gib or 0) * gib),
                "disk_path": off.disk_path}

    # --- lookups ------------------------------------------------------------------------
    def locate(self, key: Key) -> tuple[str, Slot] | None:
        for tier in self.tiers:
            slot = tier.lookup(key)
            if slot is not None:
                return tier.name, slot
        return None

    def _tier(self, name: str) -> TierIndex:
        return self.host if name == HOST else self.disk  # type: ignore[return-value]

    def pin(self, key: Key) -> None:
        found = self.locate(key)
        if found is not None:
            self._tier(found[0]).pin(key)

    def unpin(self, key: Key, store: str) -> None:
        self._tier(store).unpin(key)

    def loaded(self, key: Key, store: str) -> None:
        tier = self._tier(store)
        tier.num_hits += 1
        if key in tier:
            tier.touch(key)

    def load_failed(self, key: Key, store: str, slot: Slot) -> None:
        tier = self._tier(store)
        if tier.lookup(key) == slot:
            tier.remove(key)

    # --- saves --------------------------------------------------------------------------
    def on_computed(self, block: int, key: Key, ops: KVStepOps) -> None:
        if self.host is not None and key not in self.host:
            self._save_to_host(block, key, ops)

    def on_evict(self, block: int, key: Key, ops: KVStepOps) -> None:
        top = self.tiers[0] if self.tiers else None
        if top is None:
            return
        if key in top:
            top.touch(key)
            return
        if top is self.disk:
            self._store(self.disk, ("device", block), key, ops)
            return
        self._save_to_host(block, key, ops)

    def _save_to_host(self, block: int, key: Key, ops: KVStepOps) -> None:
        """Save device ``block`` (not in the host tier) into a host slot, demoting that
        slot's least recently used key to the disk tier first."""
        top = self.host
        assert top is not None
        got = top.insert(key)
        if got is None:  # every host slot is pinned by a load: the block is not kept
            return
        slot, victim = got
        if victim is not None and self.disk is not None:
            old_key, old_slot = victim
            if old_key in self.disk:
                self.disk.touch(old_key)
            else:
                self._store(self.disk, (HOST, old_slot), old_key, ops)
        ops.stores.append(("save", HOST, block, slot))

    @staticmethod
    def _store(tier: TierIndex, source: tuple[str, int], key: Key, ops: KVStepOps) -> None:
        if key in tier:
            tier.touch(key)
            return
        got = tier.insert(key)
        if got is None:
            return
        slot, _ = got  # a disk victim is dropped: nothing is below the disk
        if source[0] == "device":
            ops.stores.append(("save", tier.name, source[1], slot))
        else:
            ops.stores.append(("move", source[0], source[1], tier.name, slot))

    # --- bookkeeping --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {t.name: {"slots": t.num_slots, "resident": len(t), "stored": t.num_stored,
                         "hits": t.num_hits, "evicted": t.num_evicted} for t in self.tiers}

    def check_idle(self) -> list[str]:
        return [p for t in self.tiers for p in t.check_idle()]
