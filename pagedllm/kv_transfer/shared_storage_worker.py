"""The shared-storage connector's worker side: a folder of one file per block (a staging row of
[num_layers, block_nbytes] bytes), written aside and renamed into place."""
from __future__ import annotations

import os
from typing import Any

import torch

from pagedllm.kv_transfer.shared_storage import block_path
from pagedllm.kv_transfer.worker_side import BlockStore, CacheLayout, KVConnectorWorker


class SharedStorageStore(BlockStore):
    def __init__(self, name: str, folder: str, layout: CacheLayout) -> None:
        self.name = name
        self.num_slots = 0  # keyed by content, not by slot: no fixed size
        self.folder = folder
        self.rank = layout.rank
        self.row_bytes = layout.row_bytes
        os.makedirs(folder, exist_ok=True)

    def write(self, slots: list[Any], rows: torch.Tensor) -> None:
        data = rows.contiguous().numpy().reshape(len(slots), self.row_bytes)
        for key, row in zip(slots, data):
            final = block_path(self.folder, key, self.rank)
            if os.path.exists(final):
                continue
            aside = f"{final}.{os.getpid()}.tmp"
            with open(aside, "wb") as f:
                f.write(memoryview(row))
            os.replace(aside, final)

    def read(self, slots: list[Any], out: torch.Tensor) -> None:
        data = out.numpy().reshape(len(slots), self.row_bytes)
        for key, row in zip(slots, data):
            path = block_path(self.folder, key, self.rank)
            with open(path, "rb") as f:
                got = f.readinto(memoryview(row))
                extra = f.read(1)
            if got != self.row_bytes or extra:
                raise ValueError(f"{path} holds {got}{'+' if extra else ''} bytes, not a "
                                 f"block of this engine's layout ({self.row_bytes} bytes)")


class SharedStorageWorker(KVConnectorWorker):
    def __init__(self, config: Any, spec: dict[str, Any], layout: CacheLayout) -> None:
        super().__init__(config, spec, layout)
        self.stores["shared"] = SharedStorageStore("shared", spec["path"], layout)
