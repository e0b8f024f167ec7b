"""The workers' half of KV connectors: stores that hold blocks as bytes, and the runner that
carries out a step's block moves (``KVStepOps``) through the backend's cache ops.

Ordering (what makes the moves safe without locks): every store read and write runs on one I/O
thread, first in, first out, so a read sees every write queued before it. A save captures the
device blocks in the worker's own thread before the step writes them (``export_blocks`` returns
once they are captured) and queues the store write; a load queues the store read and the
``import_blocks`` into its device blocks, which then overlaps the step's forward (those blocks
are pinned: nothing else reads or writes them) and is joined before the next step's moves, or
when the engine asks for failures after the step (``take_load_results``).

Direct moves: a store that holds its slots in (pinned) host memory shows runs of consecutive
slots as a tensor (``BlockStore.view``); a save exports straight into it and a load imports
straight from it, with no staging buffer and no host copy (a 4k-token document of an 8B model is
512 MB: the host copies were most of a load's time on a GPU). A direct save first waits for the
queued jobs that touch its slots; its I/O job only waits for the export, keeping the order.

Ready loads (``KVStepOps.ready_loads``: a store that cannot fail, the host tier) run in the
worker's own thread after the queued jobs on their slots, queued on the device before the
step's forward, which reads them (the sequence was admitted in this step): fenced layer by layer
(``CacheTransfer.fence_layers``: with a layer-major host pool the cuda import copies and fences
each layer on its own, so layer l's attention waits for layer l alone), and in full before the
next step's moves.
"""
from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.contract.cache_ops import CacheOps, CacheTransfer
from pagedllm.kv_transfer.base import KVStepOps, Slot

logger = logging.getLogger(__name__)

MAX_PENDING_WRITE_BYTES = 512 << 20  # queued store writes beyond this wait for the I/O thread
LATENCY_SAMPLES = 4096


@dataclass(frozen=True)
class CacheLayout:
    """What a store needs of the worker's cache: one block of all layers is
    ``num_layers * block_nbytes`` bytes (a staging row)."""

    num_layers: int
    block_nbytes: int
    rank: int = 0
    pin_memory: bool = False
    # the cache ops take layer-major staging views (Capabilities.kv_export_layer_major): host
    # memory stores keep each layer's slots contiguous
    layer_major: bool = False

    @property
    def row_bytes(self) -> int:
        return self.num_layers * self.block_nbytes

    def staging(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.num_layers, self.block_nbytes), dtype=torch.uint8,
                           pin_memory=self.pin_memory and n > 0)


MIN_DIRECT_RUN = 4  # consecutive slots moved directly; shorter runs share one staging buffer


def consecutive_runs(slots: list[Slot]) -> list[tuple[int, int, int]]:
    """(first index in ``slots``, first slot, count) of the runs of consecutive int slots."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and isinstance(slot, int) and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def slot_runs(slots: list[Slot]) -> list[tuple[int, int, int, bool]]:
    """(first index in ``slots``, lowest slot, count, descending) of the runs of consecutive
    int slots either way up (a sequence's blocks may have been evicted, so saved, last first):
    ``slots[first:first + count]`` is ``lowest .. lowest + count - 1``, reversed if descending."""
    runs: list[list] = []
    for i, slot in enumerate(slots):
        if runs and isinstance(slot, int):
            first, low, count, down = runs[-1]
            if count == 1 and slot in (low + 1, low - 1):
                runs[-1] = [first, min(low, slot), 2, slot < low]
                continue
            if not down and slot == low + count:
                runs[-1][2] += 1
                continue
            if down and slot == low - 1:
                runs[-1][1:3] = [slot, count + 1]
                continue
        runs.append([i, slot, 1, False])
    return [(f, lo, n, d) for f, lo, n, d in runs]


def _run_blocks(blocks: list[int], first: int, count: int, down: bool) -> torch.Tensor:
    """The device blocks of a run's rows in slot order (lowest slot first)."""
    picked = blocks[first:first + count]
    return torch.tensor(picked[::-1] if down else picked, dtype=torch.int64)


class BlockStore(ABC):
    """A worker's store: slots of one staging row each ([num_layers, block_nbytes] bytes)."""

    name: str
    num_slots: int

    @abstractmethod
    def write(self, slots: list[Slot], rows: torch.Tensor) -> None:
        """rows[i] into slot ``slots[i]`` (uint8 [n, num_layers, block_nbytes])."""

    @abstractmethod
    def read(self, slots: list[Slot], out: torch.Tensor) -> None:
        """Slot ``slots[i]`` into out[i]; raises OSError/ValueError when a slot is unreadable."""

    def view(self, first: Slot, count: int) -> torch.Tensor | None:
        """Slots ``first .. first + count - 1`` as one host tensor this store holds
        ([count, num_layers, block_nbytes], no copy), which a save may export into and a load
        import from directly; None (the default): the store has no such memory."""
        return None

    def close(self) -> None:
        """Release what the store holds (files it created, memory)."""


class KVConnectorWorker:
    """A connector's worker side: opens its stores. Subclasses fill ``stores``."""

    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        self.config = config
        self.spec = spec
        self.layout = layout
        self.stores: dict[str, BlockStore] = {}


def _runs(items: list[tuple], key: Callable[[tuple], Any]) -> list[list[tuple]]:
    """Consecutive items with the same key, in order."""
    out: list[list[tuple]] = []
    for item in items:
        if out and key(out[-1][0]) == key(item):
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _save_runs(stores: list[tuple]) -> list[list[tuple]]:
    """``KVStepOps.stores`` in runs that run as one call each: consecutive saves into one
    store, never twice into one slot (a slot reused within the step keeps its last save);
    each move alone."""
    out: list[list[tuple]] = []
    slots: set = set()
    for op in stores:
        if (op[0] == "save" and out and out[-1][0][0] == "save" and out[-1][0][1] == op[1]
                and op[3] not in slots):
            out[-1].append(op)
        else:
            out.append([op])
            slots = set()
        if op[0] == "save":
            slots.add(op[3])
    return out


class KVWorkerRunner:
    """Runs each step's moves on one worker, over the stores of every connector."""

    def __init__(self, cache_ops: CacheOps, layout: CacheLayout,
                 parts: list[KVConnectorWorker]) -> None:
        self.cache_ops = cache_ops
        self.layout = layout
        self.parts = parts
        self.stores = {name: s for p in parts for name, s in p.stores.items()}
        self._io = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-kv-io")
        # queued writes: future, bytes, the (store, slot)s they read or write
        self._writes: list[tuple[Future, int, set]] = []
        self._loads: list[tuple[Future, str, list[tuple]]] = []
        self._failed: list[tuple[str, Slot, int]] = []
        self._ready: list[CacheTransfer] = []  # ready loads queued on the device
        self.counters: Counter[str] = Counter()  # bytes/blocks saved, loaded, failed per store
        self.load_seconds: list[float] = []  # per load group: store read + import, not taken

    def num_slots(self) -> dict[str, int]:
        return {name: s.num_slots for name, s in self.stores.items()}

    # --- the step -----------------------------------------------------------------------
    def before_moves(self, ops: KVStepOps | None, caches: list[torch.Tensor]) -> None:
        """Join the previous step's loads, then save / demote as ``ops.stores`` says, in
        order (before the step's swaps and writes)."""
        self.join_loads()
        for transfer in self._ready:  # fenced layer by layer in their step: in full from here
            transfer.fence()
        self._ready = [t for t in self._ready if not t.done()]  # each holds buffers until done
        if ops is None or not ops.stores:
            return
        for run in _save_runs(ops.stores):
            if run[0][0] == "save":
                self._save(run[0][1], [op[2] for op in run], [op[3] for op in run], caches)
            else:
                self._move(run[0][1], [op[2] for op in run], run[0][3], [op[4] for op in run])

    def after_moves(self, ops: KVStepOps | None, caches: list[torch.Tensor]) -> None:
        """Queue ``ops.ready_loads`` before the forward, and start ``ops.loads`` (after the
        step's swaps); the latter overlap the forward."""
        if ops is None:
            return
        for run in _runs(ops.ready_loads, key=lambda op: op[0]):
            self._load_ready(run[0][0], [op[1] for op in run], [op[2] for op in run], caches)
        for run in _runs(ops.loads, key=lambda op: op[0]):
            store = run[0][0]
            fut = self._io.submit(self._load, store, [op[1] for op in run],
                                  [op[2] for op in run], caches)
            self._loads.append((fut, store, run))

    def _save(self, store: str, blocks: list[int], slots: list[Slot],
              caches: list[torch.Tensor]) -> None:
        target, staged = self.stores[store], []
        for first, slot, count, down in slot_runs(slots):
            view = target.view(slot, count) if count >= MIN_DIRECT_RUN else None
            if view is None:
                staged += range(first, first + count)
                continue
            touched = {(store, s) for s in range(slot, slot + count)}
            self._wait_for(touched)  # an earlier job still reading or writing these slots
            ids = _run_blocks(blocks, first, count, down)
            transfer = self.cache_ops.export_blocks(caches, ids, view)
            self._queue_write(transfer.wait, view.numel(), touched)
        if staged:
            staging = self.layout.staging(len(staged))
            ids = torch.tensor([blocks[i] for i in staged], dtype=torch.int64)
            transfer = self.cache_ops.export_blocks(caches, ids, staging)
            staged_slots = [slots[i] for i in staged]

            def write() -> None:
                transfer.wait()
                target.write(staged_slots, staging)

            self._queue_write(write, staging.numel(), {(store, s) for s in staged_slots})
        self.counters[f"saved_blocks:{store}"] += len(blocks)
        self.counters[f"saved_bytes:{store}"] += len(blocks) * self.layout.row_bytes

    def _move(self, src: str, src_slots: list[Slot], dst: str, dst_slots: list[Slot]) -> None:
        source, target, layout = self.stores[src], self.stores[dst], self.layout

        def move() -> None:
            rows = layout.staging(len(src_slots))
            source.read(src_slots, rows)
            target.write(dst_slots, rows)

        touched = {(src, s) for s in src_slots} | {(dst, s) for s in dst_slots}
        self._queue_write(move, len(src_slots) * layout.row_bytes, touched)
        self.counters[f"saved_blocks:{dst}"] += len(dst_slots)
        self.counters[f"saved_bytes:{dst}"] += len(dst_slots) * layout.row_bytes

    def _queue_write(self, job: Callable[[], None], nbytes: int, touched: set) -> None:
        self._writes = [w for w in self._writes if not w[0].done()]
        while self._writes and sum(w[1] for w in self._writes) + nbytes > MAX_PENDING_WRITE_BYTES:
            self._writes.pop(0)[0].result()
        self._writes.append((self._io.submit(job), nbytes, touched))

    def _wait_for(self, touched: set) -> None:
        """Wait for the queued writes and moves that touch any of ``touched`` ((store, slot))."""
        for fut, _, theirs in self._writes:
            if not fut.done() and not theirs.isdisjoint(touched):
                fut.result()

    def _load(self, store: str, slots: list[Slot], blocks: list[int],
              caches: list[torch.Tensor]) -> list[int]:
        """Import ``slots`` into ``blocks`` (runs the store shows as a view directly, the rest
        read into one staging buffer); the indices that failed (a staged group that fails is
        retried block by block, so one bad block costs only itself)."""
        start = time.perf_counter()
        source = self.stores[store]
        transfers, staged = self._import_direct(source, slots, blocks, caches)
        bad: list[int] = []
        try:
            if staged:
                bad = self._load_staged(source, [slots[i] for i in staged],
                                        [blocks[i] for i in staged], caches)
                bad = [staged[i] for i in bad]
        finally:
            for transfer in transfers:  # nothing writes these blocks after the load returns
                transfer.wait()
        self.load_seconds.append(time.perf_counter() - start)
        del self.load_seconds[:-LATENCY_SAMPLES]  # nobody asks: keep the latest only
        return bad

    def _import_direct(self, source: BlockStore, slots: list[Slot], blocks: list[int],
                       caches: list[torch.Tensor]) -> tuple[list[CacheTransfer], list[int]]:
        """Start importing the runs ``source`` shows as a view straight into their blocks;
        returns (their transfers, the indices of ``slots`` left for a staging buffer)."""
        transfers: list[CacheTransfer] = []
        staged: list[int] = []
        for first, slot, count, down in slot_runs(slots):
            view = source.view(slot, count) if count >= MIN_DIRECT_RUN else None
            if view is None:
                staged += range(first, first + count)
                continue
            ids = _run_blocks(blocks, first, count, down)
            transfers.append(self.cache_ops.import_blocks(view, caches, ids))
        return transfers, staged

    def _load_ready(self, store: str, slots: list[Slot], blocks: list[int],
                    caches: list[torch.Tensor]) -> None:
        """Import ``slots`` into ``blocks`` ahead of the step's forward: queued on the device
        (``fence``), the host not blocked; after the queued writes to those slots. Its
        latency sample is the host's time to queue it (what it adds to the step's start)."""
        start = time.perf_counter()
        source = self.stores[store]
        self._wait_for({(store, s) for s in slots})
        transfers, staged = self._import_direct(source, slots, blocks, caches)
        if staged:
            rows = self.layout.staging(len(staged))
            source.read([slots[i] for i in staged], rows)
            ids = torch.tensor([blocks[i] for i in staged], dtype=torch.int64)
            transfers.append(self.cache_ops.import_blocks(rows, caches, ids))
        for transfer in transfers:  # each layer's attention waits for that layer only
            transfer.fence_layers()
        self._ready += transfers  # each holds its buffers until done
        self.counters[f"loaded_blocks:{store}"] += len(blocks)
        self.load_seconds.append(time.perf_counter() - start)
        del self.load_seconds[:-LATENCY_SAMPLES]

    def _load_staged(self, source: BlockStore, slots: list[Slot], blocks: list[int],
                     caches: list[torch.Tensor]) -> list[int]:
        rows = self.layout.staging(len(slots))
        try:
            source.read(slots, rows)
            good = list(range(len(slots)))
        except (OSError, ValueError) as exc:
            good = []
            for i, slot in enumerate(slots):
                try:
                    source.read([slot], rows[i:i + 1])
                    good.append(i)
                except (OSError, ValueError) as one:
                    logger.warning("KV load from %s failed: %s", source.name, one)
            if not good:
                raise exc
        ids = torch.tensor([blocks[i] for i in good], dtype=torch.int64)
        self.cache_ops.import_blocks(rows[good].contiguous() if len(good) < len(slots) else rows,
                                     caches, ids).wait()
        return sorted(set(range(len(slots))) - set(good))

    def join_loads(self) -> None:
        """Wait for the loads in flight; a failed group's (store, slot, block)s are kept for
        ``take_load_results`` (the engine then computes those blocks)."""
        for fut, store, run in self._loads:
            try:
                bad = fut.result()
                self.counters[f"loaded_blocks:{store}"] += len(run) - len(bad)
                self.counters[f"failed_blocks:{store}"] += len(bad)
                self._failed += [run[i] for i in bad]
            except (OSError, ValueError, RuntimeError) as exc:
                logger.warning("KV load of %d blocks from %s failed: %s", len(run), store, exc)
                self.counters[f"failed_blocks:{store}"] += len(run)
                self._failed += [(op[0], op[1], op[2]) for op in run]
        self._loads = []

    # --- called by the engine between steps (Worker.kv_connector_call) -------------------
    def take_load_results(self) -> tuple[list[tuple[str, Slot, int]], list[float]]:
        """The loads' failures ((store, slot, block)) and latencies (seconds per group) since
        the last call, once every load in flight has finished."""
        self.join_loads()
        failed, self._failed = self._failed, []
        seconds, self.load_seconds = self.load_seconds, []
        return failed, seconds

    def apply(self, ops: KVStepOps, caches: list[torch.Tensor]) -> None:
        """Run ``ops`` now, between steps (a producer's saves), and wait for the writes: a
        consumer may look for them once the request's output is out."""
        self.before_moves(ops, caches)
        self.after_moves(ops, caches)
        self.flush()

    def queue(self, ops: KVStepOps, caches: list[torch.Tensor]) -> None:
        """Run ``ops`` now, between steps, without waiting for their writes (the engine went
        idle with write-through saves meant for the next step)."""
        self.before_moves(ops, caches)
        self.after_moves(ops, caches)

    def flush(self) -> None:
        for fut, _, _ in self._writes:
            fut.result()
        self._writes = []
        self.join_loads()

    def stats(self) -> dict[str, Any]:
        return {"counters": dict(self.counters), "row_bytes": self.layout.row_bytes}

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._io.shutdown(wait=True)
            for store in self.stores.values():
                store.close()


def open_runner(worker: Any, specs: list[tuple[str, dict[str, Any]]]) -> KVWorkerRunner:
    """The runner of a worker whose KV cache exists: each connector's worker side
    (``KVConnector.worker_class``, built from its ``worker_spec``) over the worker's layout."""
    from pagedllm.contract.registry import load_class

    caches = worker.kv_caches
    layout = CacheLayout(num_layers=len(caches),
                         block_nbytes=worker.cache_ops.block_nbytes(caches[0]),
                         rank=getattr(worker, "rank", 0),
                         pin_memory=worker.backend.host_pin_memory(),
                         layer_major=worker.backend.capabilities.kv_export_layer_major)
    parts = [load_class(path)(worker.config, spec, layout) for path, spec in specs]
    return KVWorkerRunner(worker.cache_ops, layout, parts)


def worker_call(worker: Any, method: str, *args: Any) -> Any:
    """``Worker.kv_connector_call``: "init" opens the runner (returns its stores' slots);
    "apply" runs moves now and waits for them, "queue" without waiting; any other name is a
    KVWorkerRunner method."""
    if method == "init":
        if worker.kv_connector is not None:
            worker.kv_connector.close()
        worker.kv_connector = open_runner(worker, *args)
        return {"slots": worker.kv_connector.num_slots(),
                "row_bytes": worker.kv_connector.layout.row_bytes}
    runner = worker.kv_connector
    if runner is None:
        raise RuntimeError("no KV connector is open on this worker")
    if method in ("apply", "queue"):
        return getattr(runner, method)(args[0], worker.kv_caches)
    if method == "close":
        worker.kv_connector = None
        return runner.close()
    return getattr(runner, method)(*args)
