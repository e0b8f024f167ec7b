"""The cpu backend's cache ops: copy and swap from the contract's reference; block export /
import (KV offload and transfer, ``Capabilities.kv_export``) through the torch reference. The
device is the host, so a transfer is a memory copy, complete when the call returns."""
from __future__ import annotations

import torch

from pagedllm.contract.cache_ops import CacheOps, CacheTransfer
from pagedllm.reference import kv_transfer

_DONE = CacheTransfer()


class CpuCacheOps(CacheOps):
    def export_blocks(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                      staging: torch.Tensor) -> CacheTransfer:
        kv_transfer.export_blocks(kv_caches, block_ids, staging)
        return _DONE

    def import_blocks(self, staging: torch.Tensor, kv_caches: list[torch.Tensor],
                      block_ids: torch.Tensor) -> CacheTransfer:
        kv_transfer.import_blocks(staging, kv_caches, block_ids)
        return _DONE
