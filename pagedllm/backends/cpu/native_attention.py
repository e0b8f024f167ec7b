"""The cpu backend's default attention: TorchPagedAttention with decode in C++.

Decode runs csrc/cpu/paged_attention_cpu.cpp, which reads each sequence's K/V blocks in place
through its block table instead of gathering them into a padded [B, kvH, L, D] tensor for SDPA.
The cache writes are one C++ copy per token and kv head (layer_ops_cpu.cpp); prefill stays the
torch reference's. The kernels are built (or loaded from
the kernel cache) when the first layer is constructed; see kernels.py.
"""
from __future__ import annotations

import torch

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.backends.cpu.kernels import load_cpu_kernels


class CpuNativePagedAttention(TorchPagedAttention):
    name = "native"

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale)
        self._ops = load_cpu_kernels()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        """One copy per token and kv head into the cache (slots < 0 skipped); the kernel raises on
        a slot past the cache."""
        if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
            return super().write_kv(key, value, kv_cache, metadata)
        if metadata.slot_mapping.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping has {metadata.slot_mapping.shape[0]} entries for "
                             f"{key.shape[0]} tokens")
        self._ops.write_kv(key, value, kv_cache, metadata.slot_mapping)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """query [num_decodes, num_heads, head_size] (a strided view is fine) -> a new tensor of
        that shape. The kernel checks shapes, dtypes, block ids and lengths; bad ones raise."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self._ops.paged_attention_decode(out, query, kv_cache, metadata.decode_block_tables,
                                         metadata.decode_seq_lens, self.scale)
        return out
