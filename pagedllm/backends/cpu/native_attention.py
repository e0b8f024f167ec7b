"""The cpu backend's default attention: TorchPagedAttention with decode in C++.

Decode runs csrc/cpu/paged_attention_cpu.cpp, which reads each sequence's K/V blocks in place
through its block table instead of gathering them into a padded [B, kvH, L, D] tensor for SDPA.
The cache writes are one C++ copy per token and kv head (layer_ops_cpu.cpp); ``forward_rotary``
rotates q and k in place in the qkv projection and writes k and v into the cache in one C++
pass (rotary_and_cache: the rotary op's bits, without its new [T, heads, D] tensor). Prefill is
the torch reference's, except for a batch of prompts of one length without cached context (the
common offline case): their queries, keys and values are already [P, L] in the packed rows, so
one causal SDPA over the new keys and values replaces the reference's padding, cache gather and
mask.
The kernels are built (or loaded from the kernel cache) when the first layer is constructed; see
kernels.py.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.backends.attention import AttentionMetadata
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.backends.cpu.kernels import load_cpu_kernels
from pagedllm.backends.cpu.layer_ops import KERNEL_DTYPES


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

    def forward_rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                       kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The kernel's neox rotary (the cpu rotary op's arithmetic) in place of ``rotary`` where
        qkv, cos, sin and the cache share one dtype; the template's path otherwise."""
        dtype = qkv.dtype
        if (dtype not in KERNEL_DTYPES or cos.dtype != dtype or sin.dtype != dtype
                or kv_cache.dtype != dtype or qkv.dim() != 2 or qkv.stride(1) != 1):
            return super().forward_rotary(qkv, cos, sin, rotary, kv_cache, metadata)
        if metadata.slot_mapping.shape[0] != qkv.shape[0]:
            raise ValueError(f"slot_mapping has {metadata.slot_mapping.shape[0]} entries for "
                             f"{qkv.shape[0]} tokens")
        self._ops.rotary_and_cache(qkv, cos, sin, kv_cache, metadata.slot_mapping,
                                   self.num_heads)
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.attend(q, k, v, kv_cache, metadata)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The reference's prefill; for P prompts of one length L and no cached context, causal
        SDPA on the packed rows viewed as [P, heads, L, head_size] (the same masked softmax)."""
        lens = metadata.prefill_query_lens_list
        if any(metadata.prefill_context_lens_list) or len(set(lens)) != 1:
            return super().prefill(query, kv_cache, metadata, key, value)
        p, length = len(lens), lens[0]

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [P * L, h, D] -> [P, h, L, D]
            return x.view(p, length, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads_first(query), heads_first(key), heads_first(value), is_causal=True,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).reshape(p * length, self.num_heads, self.head_size)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """query [num_decodes, num_heads, head_size] (a strided view is fine) -> a new tensor of
        that shape. The kernel checks shapes, dtypes, block ids and lengths; bad ones raise."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self._ops.paged_attention_decode(out, query, kv_cache, metadata.decode_block_tables,
                                         metadata.decode_seq_lens, self.scale)
        return out
