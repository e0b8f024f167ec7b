"""Block copy and swap through the csrc/ kernels (one launch for all layers)."""
from __future__ import annotations

import torch

from pagedllm.backends.cuda import ops
from pagedllm.backends.interface import CacheOps


class KernelCacheOps(CacheOps):
    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        ops.copy_blocks([c[0] for c in kv_caches], [c[1] for c in kv_caches], pairs)

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        pairs = pairs.cpu()
        for src, dst in zip(src_caches, dst_caches):
            ops.swap_blocks(src[0], dst[0], pairs)
            ops.swap_blocks(src[1], dst[1], pairs)
