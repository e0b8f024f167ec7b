"""Paged attention on CUDA/ROCm: csrc/ kernels for cache writes and decode, a Triton kernel for
prefill over cached context (prefix caching, chunked prefill)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.backends.cuda import ops
from pagedllm.backends.cuda.layer_ops import KERNEL_DTYPES
from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.reference.attention import kv_cache_shape


class CudaPagedAttention(AttentionImpl):
    name = "kernels"
    # both in the decode kernel (csrc/paged_attention.cuh) and the Triton prefill
    supported_features = ("sliding_window", "logits_soft_cap")

    kv_cache_shape = staticmethod(kv_cache_shape)  # the standard layout (reference room)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        ops.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def forward_rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # float16/bfloat16: one kernel rotates q and k in place in qkv (the rotary layer kernel's
        # bits) and writes k and v into the cache; float32 keeps the reference ops (HF equality)
        if qkv.dtype not in KERNEL_DTYPES:
            return super().forward_rotary(qkv, cos, sin, rotary, kv_cache, metadata)
        ops.load_kernels().rotary_and_cache(qkv, cos, sin, kv_cache[0], kv_cache[1],
                                            metadata.slot_mapping, self.num_heads)
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.attend(q, k, v, kv_cache, metadata)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        # query may be a strided view into the qkv projection: the kernel takes its strides
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        # a captured graph fixes max_seq_len to the model length (set in extras)
        max_len = metadata.extras.get("graph_max_seq_len", metadata.max_decode_seq_len)
        return ops.paged_attention(out, query, kv_cache[0], kv_cache[1],
                                   self.num_kv_heads, self.scale, metadata.decode_block_tables,
                                   metadata.decode_seq_lens, kv_cache.shape[2], max_len,
                                   sliding_window=self.sliding_window,
                                   soft_cap=self.logits_soft_cap)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        from pagedllm.backends.cuda.triton_prefill import context_attention_fwd

        out = torch.empty_like(query)
        return context_attention_fwd(
            query, key, value, out, kv_cache[0], kv_cache[1], metadata.prefill_block_tables,
            metadata.query_start_loc, metadata.prefill_seq_lens, metadata.prefill_context_lens,
            self.scale, max_query_len=metadata.max_prefill_query_len,
            max_context_len=max(metadata.prefill_context_lens_list, default=0),
            sliding_window=self.sliding_window, soft_cap=self.logits_soft_cap)
