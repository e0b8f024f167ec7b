"""Block copy (copy-on-write) and swap between device and host caches: the contract's
``CacheOps``, whose methods are a reference implementation for any cache layout with blocks on
dim 1. A backend with kernels overrides them."""
from __future__ import annotations

import torch

def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache (kv_cache_dtype="fp8") as its bytes: block copies move bits, and
    index_copy_ has no float8 kernel on CPU."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)
    return cache


class CacheOps:
    """Block copy (copy-on-write) and swap between device and host caches.

    The reference implementation works for any cache whose dim 1 indexes blocks; a backend with
    kernels overrides ``copy_blocks``/``swap_blocks``.
    """

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """``pairs`` [n, 2] int64 (src, dst) on the cache's device; applied to every layer."""
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in map(as_bytes, kv_caches):
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        """Copy blocks ``pairs[:, 0]`` of each src layer to ``pairs[:, 1]`` of the dst layer.

        ``pairs`` [n, 2] int64 on the CPU; src and dst caches live on different devices.
        """
        if pairs.numel() == 0:
            return
        for src, dst in zip(map(as_bytes, src_caches), map(as_bytes, dst_caches)):
            src_idx = pairs[:, 0].to(src.device)
            dst_idx = pairs[:, 1].to(dst.device)
            dst.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(dst.device))
