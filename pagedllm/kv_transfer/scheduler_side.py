"""KVConnectorManager: what the scheduler and the block manager see of KV connectors (offload
tiers, transfer). No torch here.

- A waiting sequence whose prefix continues, past the device cache's hits, in a connector's
  store is not admitted yet (``ready`` is False): device blocks are allocated for those keys
  and the step carries their loads; the loads overlap that step's forward. After the step
  (``land``) the loaded blocks enter the prefix cache under their keys, so the next schedule
  admits the sequence with them as ordinary prefix hits. A failed load is dropped (its block
  unregistered, the connector forgets the key) and the engine computes the block instead.
  When every such block is in a store that cannot fail (``KVConnector.step_stores``: the host
  tier), the blocks enter the prefix cache at once and the sequence is admitted in this step;
  its loads run before the step's forward (``KVStepOps.ready_loads``).
- Blocks are pinned (a reference held here) from the load until the end of the schedule after
  it landed, so nothing evicts them before their sequence is admitted; then they are ordinary
  cached blocks.
- A block the device cache evicts goes to every connector's ``on_evict`` (offload tiers save
  it unless they hold it already); a block entering the prefix cache goes to ``on_computed`` (a
  producer saves it; the host tier writes it through, so that evicting it later costs nothing).
The moves collect here and ride on the next batch (``end_schedule`` / ``attach``), or are
handed to the workers at once after the step (``take_pending``: the saves of connectors with
``computed_saves_at_once``, producers).
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from pagedllm.kv_transfer.base import Key, KVConnector, KVStepOps

if TYPE_CHECKING:
    from pagedllm.core.block_manager import BlockManager
    from pagedllm.core.batch import ScheduledBatch
    from pagedllm.core.sequence import Sequence, SequenceGroup

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVConnectorManager:
    def __init__(self, block_manager: BlockManager, connectors: list[KVConnector]) -> None:
        if not block_manager.enable_caching:
            raise ValueError("KV connectors need the prefix cache (enable_prefix_caching=True)")
        self.bm = block_manager
        self.connectors = connectors
        self._ops = KVStepOps()  # moves for the next batch, not yet handed to the workers
        self._now = KVStepOps()  # producers' saves, handed to the workers after the step
        # key -> (device block, connector) of the loads not yet landed
        self._loading: dict[Key, tuple[int, KVConnector]] = {}
        self._pinned: list[int] = []  # device blocks pinned by loads not yet landed
        self._landed: list[int] = []  # pinned until the end of the next schedule
        # blocks: "queried" (full prompt blocks of sequences asked about, once each),
        # "device" (of those, in the device cache then), "loaded:S" / "failed:S" / "saved:S"
        self.counters: Counter[str] = Counter()
        self._queried: OrderedDict[int, None] = OrderedDict()  # seq ids counted
        block_manager.device.on_evict = self._on_evict
        block_manager.device.on_register = self._on_register

    # --- the block manager's callbacks --------------------------------------------------
    def _on_evict(self, block: int, key: Key) -> None:
        for connector in self.connectors:
            connector.on_evict(block, key, self._ops)

    def _on_register(self, block: int, key: Key) -> None:
        for connector in self.connectors:
            connector.on_computed(block, key, self._now if connector.computed_saves_at_once
                                  else self._ops)

    # --- admission ----------------------------------------------------------------------
    def ready(self, group: SequenceGroup) -> bool:
        """Whether the group's waiting sequences may be admitted now; False while blocks of
        their prefixes are being loaded (loads are issued here, into this step)."""
        from pagedllm.core.sequence import SequenceStatus

        ready = True
        for seq in group.get_seqs(SequenceStatus.WAITING):
            ready = self._ready(seq) and ready  # every sequence issues its loads
        return ready

    def _locate(self, key: Key) -> tuple[KVConnector, str, Any] | None:
        for connector in self.connectors:
            found = connector.locate(key)
            if found is not None:
                return connector, found[0], found[1]
        return None

    def _ready(self, seq: Sequence) -> bool:
        bm = self.bm
        max_blocks = (len(seq) - 1) // bm.block_size  # the last token is always computed
        hits = bm._prefix_hits(seq)
        if seq.seq_id not in self._queried:
            self._queried[seq.seq_id] = None
            if len(self._queried) > 1 << 16:
                self._queried.popitem(last=False)
            self.counters["queried"] += max_blocks
            self.counters["device"] += len(hits)
        if len(hits) >= max_blocks:
            return True
        keys = bm._block_keys(seq, max_blocks)
        plan: list[tuple[Key, tuple[KVConnector, str, Any] | None]] = []
        for key in keys[len(hits):]:
            if key in self._loading:
                plan.append((key, None))
                continue
            found = self._locate(key)
            if found is None:
                break
            plan.append((key, found))
        if not plan:
            return True
        new = sum(1 for _, found in plan if found is not None)
        # room for the loads, the idle hits pinned with them and the rest of the prompt;
        # short of it the sequence is admitted as usual (it computes instead of loading)
        revived = sum(1 for b in hits if bm.device.is_idle_cached(b))
        rest = _cdiv(len(seq), bm.block_size) - len(hits) - len(plan)
        if bm.device.num_available - new - revived - rest < bm.watermark_blocks:
            return True
        # every block from a store that cannot fail: loaded before this step's forward, so
        # the sequence is admitted now with them as prefix hits
        now = all(found is not None and found[1] in found[0].step_stores for _, found in plan)
        for block in hits:  # the prefix stays resident while the rest loads
            bm.device.incref(block)
            self._pinned.append(block)
        for key, found in plan:  # every source pinned before an allocation evicts anything
            if found is not None:
                found[0].pin(key)
        for key, found in plan:
            if found is None:
                block = self._loading[key][0]
                bm.device.incref(block)
            else:
                connector, store, slot = found
                block = bm.device.allocate()  # may evict: its save precedes the load
                if now:
                    self._ops.ready_loads.append((store, slot, block))
                    self._ops.ready_keys.append((key, store, connector))
                    connector.loaded(key, store)
                    self.counters[f"loaded:{store}"] += 1
                    bm.device.register(block, key)
                else:
                    self._ops.loads.append((store, slot, block))
                    self._ops.load_keys.append((key, store, slot, block))
                    self._loading[key] = (block, connector)
            self._pinned.append(block)
        return now

    # --- the step -----------------------------------------------------------------------
    def _count_saves(self, ops: KVStepOps) -> None:
        for op in ops.stores:
            self.counters[f"saved:{op[1] if op[0] == 'save' else op[3]}"] += 1

    def attach(self, batch: ScheduledBatch) -> None:
        """Hand the moves collected so far to ``batch`` (they run before its forward)."""
        if not self._ops:
            return
        self._count_saves(self._ops)
        if batch.kv_ops is None:
            batch.kv_ops = self._ops
        else:
            batch.kv_ops.extend(self._ops)
        self._ops = KVStepOps()

    def end_schedule(self, batch: ScheduledBatch) -> None:
        """The scheduler planned ``batch``: blocks that landed before it are unpinned (their
        sequences were admitted with them, or they stay as ordinary cached blocks), and the
        step carries the moves."""
        self.release_landed()
        self.attach(batch)

    def land(self, ops: KVStepOps | None, failed: list[tuple[str, Any, int]]) -> None:
        """The step that carried ``ops`` has run: its loaded blocks enter the prefix cache,
        except ``failed`` ones ((store, slot, block) the worker could not load)."""
        if ops is None or not (ops.load_keys or ops.ready_keys):
            return
        for key, store, connector in ops.ready_keys:  # registered when issued
            connector.unpin(key, store)
        bad = {block for _, _, block in failed}
        for key, store, slot, block in ops.load_keys:
            connector = self._loading.pop(key)[1]
            connector.unpin(key, store)
            if block in bad:
                connector.load_failed(key, store, slot)
                self.counters[f"failed:{store}"] += 1
                continue
            connector.loaded(key, store)
            self.counters[f"loaded:{store}"] += 1
            self.bm.device.register(block, key)
        if failed:
            logger.warning("KV load failed for %d of %d blocks (%s); those blocks are computed "
                           "instead", len(bad), len(ops.load_keys),
                           ", ".join(sorted({s for s, _, _ in failed})))
        self._landed += self._pinned
        self._pinned = []

    def release_landed(self) -> None:
        """Unpin landed blocks now (the engine is idle: no schedule will come to do it)."""
        for block in self._landed:
            self.bm.device.free(block)
        self._landed = []

    def take_deferred(self) -> KVStepOps | None:
        """The moves waiting for the next batch (the engine is idle: none will come)."""
        if not self._ops:
            return None
        ops, self._ops = self._ops, KVStepOps()
        self._count_saves(ops)
        return ops

    def take_pending(self) -> KVStepOps | None:
        """Producers' saves of blocks computed by the step that just ran: the engine hands
        them to the workers at once."""
        if not self._now:
            return None
        ops, self._now = self._now, KVStepOps()
        self._count_saves(ops)
        return ops

    # --- bookkeeping --------------------------------------------------------------------
    @property
    def num_pinned(self) -> int:
        return len(self._pinned) + len(self._landed)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"counters": dict(self.counters)}
        for connector in self.connectors:
            out[connector.name] = connector.stats()
        return out

    def check_idle(self) -> list[str]:
        """Every block accounted for once nothing runs: no load in flight, no pin, no pending
        move, every device block free or cached-idle, every connector's own invariants."""
        problems = []
        if self._loading or self._pinned:
            problems.append(f"{len(self._loading)} loads / {len(self._pinned)} pins in flight")
        if self._landed:
            problems.append(f"{len(self._landed)} landed blocks still pinned")
        if self._ops or self._now:
            problems.append("moves collected but never handed to the workers")
        dev = self.bm.device
        if dev.num_free + dev.num_cached_idle != dev.num_blocks:
            problems.append(f"device: {dev.num_free} free + {dev.num_cached_idle} cached != "
                            f"{dev.num_blocks} blocks")
        for connector in self.connectors:
            problems += connector.check_idle()
        return problems
