"""SharedStorageConnector: KV blocks between engine processes on one host, through a folder
(``/dev/shm`` by default: shared memory), one file per block named by its content key. No torch
here (the worker side is shared_storage_worker.py).

A producer (``kv_role`` "kv_producer" or "kv_both") saves every block its prefix cache gains
(a computed prompt's full blocks) as soon as the step that computed it has run, before the
request's output is returned; a consumer ("kv_consumer" or "kv_both") loads the blocks of a
prompt it finds there instead of computing them. Files appear atomically (written aside, then
renamed), so a consumer never reads a half-written block; a block missing or unreadable (the
producer died, the file went away) is computed instead, the failure logged and counted.

    --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}'
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any, ClassVar

from pagedllm.kv_transfer.base import Key, KVStepOps, RemoteStoreConnector, Slot

logger = logging.getLogger(__name__)

STORE = "shared"
DEFAULT_PATH = "/dev/shm/pagedllm-kv"
_RECENT = 1 << 16  # keys saved lately (not stat'ed again)


def block_path(folder: str, key: bytes, rank: int = 0) -> str:
    """Where the block with ``key`` of tensor-parallel rank ``rank`` is kept."""
    return os.path.join(folder, f"{key.hex()}.r{rank}.kv")


class SharedStorageConnector(RemoteStoreConnector):
    name: ClassVar[str] = "SharedStorageConnector"
    worker_class: ClassVar[str] = "pagedllm.kv_transfer.shared_storage_worker:SharedStorageWorker"

    def __init__(self, config: Any, slots: dict[str, int]) -> None:
        super().__init__(config, slots)
        transfer = config.kv_transfer_config
        self.path = self.storage_path(config)
        self.producer, self.consumer = transfer.is_producer, transfer.is_consumer
        self._saved: OrderedDict[Key, None] = OrderedDict()

    @staticmethod
    def storage_path(config: Any) -> str:
        extra = config.kv_transfer_config.kv_connector_extra_config
        return os.path.expanduser(str(extra.get("shared_storage_path", DEFAULT_PATH)))

    @classmethod
    def worker_spec(cls, config: Any) -> dict[str, Any]:
        return {"path": cls.storage_path(config)}

    def locate(self, key: Key) -> tuple[str, Slot] | None:
        if (self.consumer and not self.is_broken(key)
                and os.path.exists(block_path(self.path, key))):  # type: ignore[arg-type]
            return STORE, key
        return None

    def on_computed(self, block: int, key: Key, ops: KVStepOps) -> None:
        if not self.producer or key in self._saved:
            return
        self._saved[key] = None
        if len(self._saved) > _RECENT:
            self._saved.popitem(last=False)
        if os.path.exists(block_path(self.path, key)):  # type: ignore[arg-type]
            return
        ops.stores.append(("save", STORE, block, key))
        self.counters["saved"] += 1

    def stats(self) -> dict[str, Any]:
        return {STORE: {"path": self.path, **self.counters}}
