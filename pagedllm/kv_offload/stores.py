"""The offload tiers on a worker: a host-memory pool and a disk file, each a store of slots of
one block of every layer (a staging row: [num_layers, block_nbytes] bytes). The scheduler side
(manager.py) decides which key is in which slot; these only move bytes."""
from __future__ import annotations

import logging
import os
import uuid
import weakref
from typing import Any

import torch

from pagedllm.kv_transfer.worker_side import (BlockStore, CacheLayout, KVConnectorWorker,
                                              consecutive_runs)
from pagedllm.worker.host_memory import lazy_zeros

logger = logging.getLogger(__name__)


class HostPool(BlockStore):
    """Slots in host memory (pinned where the backend pins host memory, else mapped lazily:
    only slots written cost memory). Runs of slots are views of it, so the device copies to and
    from it directly. Layer-major where the cache ops take such views
    (``CacheLayout.layer_major``): one uint8 tensor [num_layers, num_slots, block_nbytes], a
    run's view [count, num_layers, block_nbytes] its transpose, whose layer planes are each one
    contiguous piece (a load copies and fences each layer on its own); else [num_slots,
    num_layers, block_nbytes]."""

    def __init__(self, name: str, num_slots: int, layout: CacheLayout) -> None:
        self.name = name
        self.num_slots = num_slots
        self.dim = 1 if layout.layer_major else 0  # the slots' dim
        shape = ((layout.num_layers, num_slots, layout.block_nbytes) if layout.layer_major
                 else (num_slots, layout.num_layers, layout.block_nbytes))
        self.pool = (torch.zeros(shape, dtype=torch.uint8, pin_memory=True)
                     if layout.pin_memory and num_slots else lazy_zeros(shape, torch.uint8))

    def _rows(self, pool: torch.Tensor) -> torch.Tensor:
        """``pool`` (or a part of it along the slots) as [slots, num_layers, block_nbytes]."""
        return pool.transpose(0, 1) if self.dim else pool

    def write(self, slots: list[Any], rows: torch.Tensor) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        self.pool.index_copy_(self.dim, index, rows.transpose(0, 1) if self.dim else rows)

    def read(self, slots: list[Any], out: torch.Tensor) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        if self.dim:
            out.copy_(self._rows(self.pool.index_select(1, index)))
        else:
            torch.index_select(self.pool, 0, index, out=out)

    def view(self, first: Any, count: int) -> torch.Tensor | None:
        if not (0 <= first and first + count <= self.num_slots):
            return None
        return self._rows(self.pool.narrow(self.dim, first, count))

    def close(self) -> None:
        self.pool = torch.empty(0, dtype=torch.uint8)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DiskStore(BlockStore):
    """Slots in one file of ``num_slots`` rows in ``folder`` (created sparse; removed when the
    store closes or the process exits). Consecutive slots move in one system call. A slot whose
    last write failed reads as an error, never as stale bytes."""

    def __init__(self, name: str, num_slots: int, layout: CacheLayout, folder: str) -> None:
        self.name = name
        self.num_slots = num_slots
        self.row_bytes = layout.row_bytes
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"pagedllm-kv-{os.getpid()}-r{layout.rank}-"
                                         f"{uuid.uuid4().hex[:8]}.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._cleanup = weakref.finalize(self, _close_and_remove, self._fd, self.path)
        os.ftruncate(self._fd, num_slots * self.row_bytes)
        self._bad: set[int] = set()
        logger.info("KV offload disk tier: %d blocks (%.2f GiB) in %s", num_slots,
                    num_slots * self.row_bytes / (1 << 30), self.path)

    def write(self, slots: list[Any], rows: torch.Tensor) -> None:
        data = rows.contiguous().numpy().reshape(len(slots), self.row_bytes)
        for first, slot, count in consecutive_runs(slots):
            try:
                view = memoryview(data[first:first + count]).cast("B")
                done = os.pwrite(self._fd, view, slot * self.row_bytes)
                if done != len(view):
                    raise OSError(f"short write: {done} of {len(view)} bytes")
            except OSError:
                self._bad.update(range(slot, slot + count))
                raise
            self._bad.difference_update(range(slot, slot + count))

    def read(self, slots: list[Any], out: torch.Tensor) -> None:
        bad = self._bad.intersection(int(s) for s in slots)
        if bad:
            raise ValueError(f"disk tier slots {sorted(bad)[:4]} hold no valid block (a write "
                             "failed)")
        data = out.numpy().reshape(len(slots), self.row_bytes)
        for first, slot, count in consecutive_runs(slots):
            view = memoryview(data[first:first + count]).cast("B")
            got = os.preadv(self._fd, [view], slot * self.row_bytes)
            if got != len(view):
                raise OSError(f"short read from {self.path}: {got} of {len(view)} bytes")

    def close(self) -> None:
        self._cleanup()


def _close_and_remove(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        _remove(path)


class OffloadingWorker(KVConnectorWorker):
    """The offload connector's stores on one worker: "host" (``kv_offload_size``) and "disk"
    (``kv_offload_disk_size`` in ``kv_offload_disk``), each as many slots as fit."""

    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        super().__init__(config, spec, layout)
        host_slots = spec.get("host", 0) // layout.row_bytes
        if host_slots:
            self.stores["host"] = HostPool("host", host_slots, layout)
        disk_slots = spec.get("disk", 0) // layout.row_bytes
        if spec.get("disk_path") and disk_slots:
            self.stores["disk"] = DiskStore("disk", disk_slots, layout, spec["disk_path"])
