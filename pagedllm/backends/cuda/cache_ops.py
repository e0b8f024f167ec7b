"""Block copy and swap through the csrc/ kernels (one launch for all layers); caches of other
element types (an fp8 KV cache) take the reference byte copies of CacheOps."""
from __future__ import annotations

import torch

from pagedllm.backends.cuda import ops
from pagedllm.contract.cache_ops import CacheOps


KERNEL_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelCacheOps(CacheOps):
    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        if kv_caches and kv_caches[0].dtype not in KERNEL_CACHE_DTYPES:
            return CacheOps.copy_blocks(self, kv_caches, pairs)
        ops.copy_blocks([c[0] for c in kv_caches], [c[1] for c in kv_caches], pairs)

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        if pairs.numel() == 0:
            return
        if src_caches and src_caches[0].dtype not in KERNEL_CACHE_DTYPES:
            return CacheOps.swap_blocks(self, src_caches, dst_caches, pairs)
        pairs = pairs.cpu()
        for src, dst in zip(src_caches, dst_caches):
            ops.swap_blocks(src[0], dst[0], pairs)
            ops.swap_blocks(src[1], dst[1], pairs)
