"""The torch reference of block export/import between a device KV cache and host staging
buffers (plugin API 2.2, ``CacheOps.export_blocks`` / ``import_blocks``; declared by
``Capabilities.kv_export``). Layout-agnostic: the contract fixes only that dim 1 of a layer's
cache indexes blocks, so a block of a layer is ``cache.select(1, b)`` and travels as its bytes.

Staging layout: a host uint8 tensor [n, num_layers, block_nbytes]; row i, layer l holds the
bytes of ``kv_caches[l].select(1, block_ids[i])`` in C order (for the standard layout
[2, num_blocks, block_size, kv_heads, head_size]: K's block then V's block). Bytes, not values:
every KV-cache dtype (fp8 included) round-trips bit for bit.
"""
from __future__ import annotations

import torch


def block_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of one layer."""
    return kv_cache.select(1, 0).numel() * kv_cache.element_size()


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 (its last dim times the element size); the cache's last dim must be
    contiguous, as every built-in layout's is."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def staging_rows(staging: torch.Tensor, layer: int, cache_bytes: torch.Tensor) -> torch.Tensor:
    """Staging's layer ``layer`` as [cache dim 0, n, cache dims 2...] (bytes), a view."""
    n = staging.shape[0]
    block_shape = (cache_bytes.shape[0],) + tuple(cache_bytes.shape[2:])
    return staging[:, layer].view(n, *block_shape).movedim(0, 1)


def check_staging(staging: torch.Tensor, kv_caches: list[torch.Tensor], n: int) -> None:
    """ValueError unless ``staging`` is uint8 [n, len(kv_caches), block_nbytes] on the host."""
    want = (n, len(kv_caches), block_nbytes(kv_caches[0]) if kv_caches else 0)
    if staging.dtype != torch.uint8 or tuple(staging.shape) != want:
        raise ValueError(f"staging must be a uint8 tensor of shape {want} (blocks, layers, "
                         f"bytes per block); got {staging.dtype} {tuple(staging.shape)}")
    if staging.device.type != "cpu":
        raise ValueError(f"staging must be a host (cpu) tensor; got {staging.device}")


def export_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                  staging: torch.Tensor) -> None:
    """staging[i, l] = bytes of kv_caches[l].select(1, block_ids[i]); synchronous."""
    n = int(block_ids.numel())
    check_staging(staging, kv_caches, n)
    if n == 0:
        return
    for layer, cache in enumerate(kv_caches):
        src = byte_view(cache)
        picked = src.index_select(1, block_ids.to(src.device))  # [d0, n, ...]
        staging_rows(staging, layer, src).copy_(picked)


def import_blocks(staging: torch.Tensor, kv_caches: list[torch.Tensor],
                  block_ids: torch.Tensor) -> None:
    """kv_caches[l].select(1, block_ids[i]) = staging[i, l] bit for bit; synchronous."""
    n = int(block_ids.numel())
    check_staging(staging, kv_caches, n)
    if n == 0:
        return
    for layer, cache in enumerate(kv_caches):
        dst = byte_view(cache)
        rows = staging_rows(staging, layer, dst)
        dst.index_copy_(1, block_ids.to(dst.device), rows.to(dst.device))
