"""Block copy (copy-on-write) and swap between device and host caches: the contract's
``CacheOps``, whose methods are a reference implementation for any cache layout with blocks on
dim 1. A backend with kernels overrides them.

Plugin API 2.2 adds block export/import between the device cache and host staging buffers (KV
offload tiers, KV transfer between engines): ``export_blocks`` / ``import_blocks``, declared by
``Capabilities.kv_export``; the torch reference is ``pagedllm.reference.kv_transfer``. 2.3 adds
layer-major staging views (``Capabilities.kv_export_layer_major``) and the layer-wise fence of an
import (``CacheTransfer.fence_layers``)."""
from __future__ import annotations

import torch


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache (kv_cache_dtype="fp8") as its bytes: block copies move bits, and
    index_copy_ has no float8 kernel on CPU."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)
    return cache


class CacheTransfer:
    """A block export or import in flight (plugin API 2.2). This one is already complete: what
    a synchronous implementation returns; an asynchronous one returns a subclass."""

    def done(self) -> bool:
        """Whether the transfer has finished (never blocks)."""
        return True

    def wait(self) -> None:
        """Block the host until the transfer has finished: an export's staging bytes are then
        readable, an import's staging buffer reusable and its blocks written."""

    def fence(self) -> None:
        """Make device work queued after this call wait for the transfer (an import's blocks
        are then visible to the next step) without blocking the host; the default waits."""
        self.wait()

    def fence_layers(self) -> None:
        """(plugin API 2.3) An import's weaker fence: the backend's attention for layer l (the
        step's forward queued after this call) waits for layer l's blocks only, so early layers
        compute while later ones still copy. The blocks' other readers (the next step's moves)
        still call ``fence``. The default is ``fence``."""
        self.fence()


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

    # --- block export / import (plugin API 2.2; Capabilities.kv_export) ---------------------
    def block_nbytes(self, kv_cache: torch.Tensor) -> int:
        """Bytes of one block of one layer's cache: ``kv_cache.select(1, b)`` as bytes (what
        one block of one layer takes in a staging buffer)."""
        return kv_cache.select(1, 0).numel() * kv_cache.element_size()

    def export_blocks(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                      staging: torch.Tensor) -> CacheTransfer:
        """Copy blocks ``block_ids`` ([n] int64, on the CPU) of every layer into ``staging``, a
        host uint8 tensor [n, len(kv_caches), block_nbytes]: row i, layer l holds the bytes of
        ``kv_caches[l].select(1, block_ids[i])`` (contiguous, in the cache's dtype: fp8 caches
        move bits). The blocks are captured as of the call (device work queued afterwards may
        overwrite them); the staging bytes are readable once the returned transfer is done.
        With ``Capabilities.kv_export_layer_major`` (2.3), ``staging`` may also be a view whose
        layer planes ``staging[:, l]`` are contiguous and whose rows are not.
        Declared by ``Capabilities.kv_export``; reference: pagedllm.reference.kv_transfer."""
        raise NotImplementedError(f"{type(self).__name__} does not export KV blocks "
                                  "(Capabilities.kv_export is not declared)")

    def import_blocks(self, staging: torch.Tensor, kv_caches: list[torch.Tensor],
                      block_ids: torch.Tensor) -> CacheTransfer:
        """The inverse of ``export_blocks``: write row i of ``staging`` into block
        ``block_ids[i]`` of every layer, bit for bit. The blocks hold the data once the
        returned transfer is done (``fence()`` orders later device work after it); ``staging``
        must stay untouched until then."""
        raise NotImplementedError(f"{type(self).__name__} does not import KV blocks "
                                  "(Capabilities.kv_export is not declared)")
