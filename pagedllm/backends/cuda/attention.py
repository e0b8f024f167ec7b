"""Paged attention on CUDA/ROCm: csrc/ kernels for cache writes and decode, a Triton kernel for
prefill over cached context (prefix caching, chunked prefill)."""
from __future__ import annotations

import torch

from pagedllm.backends.attention import AttentionImpl, AttentionMetadata
from pagedllm.backends.cuda import ops


class CudaPagedAttention(AttentionImpl):
    name = "kernels"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        ops.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        # query may be a strided view into the qkv projection: the kernel takes its strides
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        # a captured graph fixes max_seq_len to the model length (set in extras)
        max_len = metadata.extras.get("graph_max_seq_len", metadata.max_decode_seq_len)
        return ops.paged_attention(out, query, kv_cache[0], kv_cache[1],
                                   self.num_kv_heads, self.scale, metadata.decode_block_tables,
                                   metadata.decode_seq_lens, kv_cache.shape[2], max_len)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        from pagedllm.backends.cuda.triton_prefill import context_attention_fwd

        out = torch.empty_like(query)
        return context_attention_fwd(
            query, key, value, out, kv_cache[0], kv_cache[1], metadata.prefill_block_tables,
            metadata.query_start_loc, metadata.prefill_seq_lens, metadata.prefill_context_lens,
            self.scale, max_query_len=metadata.max_prefill_query_len)
