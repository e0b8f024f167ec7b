"""The workers' half of KV connectors: stores that hold blocks as bytes, and the runner that
carries out a step's block moves (``KVStepOps``) through the backend's cache ops.

Ordering (what makes the moves safe without locks): every store read and write runs on one I/O
thread, first in, first out, so a read sees every write queued before it. A save captures the
device blocks in the worker's own thread before the step writes them (``export_blocks`` returns
once they are captured) and queues the store write; a load queues the store read and the
``import_blocks`` into its device blocks, which then overlaps the step's forward (those blocks
are pinned: nothing else reads or writes them) and is joined before the next step's moves, or
when the engine asks for failures after the step (``take_load_results``).
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

from pagedllm.contract.cache_ops import CacheOps
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

    @property
    def row_bytes(self) -> int:
        return self.num_layers * self.block_nbytes

    def staging(self, n: int) -> torch.Tensor:
        rows = torch.empty((n, self.num_layers, self.block_nbytes), dtype=torch.uint8)
        return rows.pin_memory() if self.pin_memory and n else rows


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
        self._writes: list[tuple[Future, int]] = []  # queued writes and their bytes
        self._loads: list[tuple[Future, str, list[tuple]]] = []
        self._failed: list[tuple[str, Slot, int]] = []
        self.counters: Counter[str] = Counter()  # bytes/blocks saved, loaded, failed per store
        self.load_seconds: list[float] = []  # per load group: store read + import, not taken

    def num_slots(self) -> dict[str, int]:
        return {name: s.num_slots for name, s in self.stores.items()}

    # --- the step -----------------------------------------------------------------------
    def before_moves(self, ops: KVStepOps | None, caches: list[torch.Tensor]) -> None:
        """Join the previous step's loads, then save / demote as ``ops.stores`` says, in
        order (before the step's swaps and writes)."""
        self.join_loads()
        if ops is None or not ops.stores:
            return
        for run in _save_runs(ops.stores):
            if run[0][0] == "save":
                self._save(run[0][1], [op[2] for op in run], [op[3] for op in run], caches)
            else:
                self._move(run[0][1], [op[2] for op in run], run[0][3], [op[4] for op in run])

    def after_moves(self, ops: KVStepOps | None, caches: list[torch.Tensor]) -> None:
        """Start ``ops.loads`` (after the step's swaps); they overlap the forward."""
        if ops is None or not ops.loads:
            return
        for run in _runs(ops.loads, key=lambda op: op[0]):
            store = run[0][0]
            fut = self._io.submit(self._load, store, [op[1] for op in run],
                                  [op[2] for op in run], caches)
            self._loads.append((fut, store, run))

    def _save(self, store: str, blocks: list[int], slots: list[Slot],
              caches: list[torch.Tensor]) -> None:
        staging = self.layout.staging(len(blocks))
        transfer = self.cache_ops.export_blocks(caches, torch.tensor(blocks, dtype=torch.int64),
                                                staging)
        target = self.stores[store]

        def write() -> None:
            transfer.wait()
            target.write(slots, staging)

        self._queue_write(write, staging.numel())
        self.counters[f"saved_blocks:{store}"] += len(blocks)
        self.counters[f"saved_bytes:{store}"] += staging.numel()

    def _move(self, src: str, src_slots: list[Slot], dst: str, dst_slots: list[Slot]) -> None:
        source, target, layout = self.stores[src], self.stores[dst], self.layout

        def move() -> None:
            rows = layout.staging(len(src_slots))
            source.read(src_slots, rows)
            target.write(dst_slots, rows)

        self._queue_write(move, len(src_slots) * layout.row_bytes)
        self.counters[f"saved_blocks:{dst}"] += len(dst_slots)
        self.counters[f"saved_bytes:{dst}"] += len(dst_slots) * layout.row_bytes

    def _queue_write(self, job: Callable[[], None], nbytes: int) -> None:
        self._writes = [(f, n) for f, n in self._writes if not f.done()]
        while self._writes and sum(n for _, n in self._writes) + nbytes > MAX_PENDING_WRITE_BYTES:
            self._writes.pop(0)[0].result()
        self._writes.append((self._io.submit(job), nbytes))

    def _load(self, store: str, slots: list[Slot], blocks: list[int],
              caches: list[torch.Tensor]) -> list[int]:
        """Read ``slots`` and import them into ``blocks``; the indices that failed (a group
        that fails is retried block by block, so one bad block costs only itself)."""
        start = time.perf_counter()
        rows = self.layout.staging(len(slots))
        try:
            self.stores[store].read(slots, rows)
            good = list(range(len(slots)))
        except (OSError, ValueError) as exc:
            good = []
            for i, slot in enumerate(slots):
                try:
                    self.stores[store].read([slot], rows[i:i + 1])
                    good.append(i)
                except (OSError, ValueError) as one:
                    logger.warning("KV load from %s failed: %s", store, one)
            if not good:
                raise exc
        ids = torch.tensor([blocks[i] for i in good], dtype=torch.int64)
        self.cache_ops.import_blocks(rows[good].contiguous() if len(good) < len(slots) else rows,
                                     caches, ids).wait()
        self.load_seconds.append(time.perf_counter() - start)
        del self.load_seconds[:-LATENCY_SAMPLES]  # nobody asks: keep the latest only
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

    def flush(self) -> None:
        for fut, _ in self._writes:
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
                         pin_memory=worker.backend.host_pin_memory())
    parts = [load_class(path)(worker.config, spec, layout) for path, spec in specs]
    return KVWorkerRunner(worker.cache_ops, layout, parts)


def worker_call(worker: Any, method: str, *args: Any) -> Any:
    """``Worker.kv_connector_call``: "init" opens the runner (returns its stores' slots);
    "apply" runs moves now; any other name is a KVWorkerRunner method."""
    if method == "init":
        if worker.kv_connector is not None:
            worker.kv_connector.close()
        worker.kv_connector = open_runner(worker, *args)
        return {"slots": worker.kv_connector.num_slots(),
                "row_bytes": worker.kv_connector.layout.row_bytes}
    runner = worker.kv_connector
    if runner is None:
        raise RuntimeError("no KV connector is open on this worker")
    if method == "apply":
        return runner.apply(args[0], worker.kv_caches)
    if method == "close":
        worker.kv_connector = None
        return runner.close()
    return getattr(runner, method)(*args)
