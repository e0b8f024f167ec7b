"""The cpu backend's default attention: TorchPagedAttention with decode and prefill in C++.

Decode runs csrc/cpu/paged_attention_cpu.cpp, which reads each sequence's K/V blocks in place
through its block table instead of gathering them into a padded [B, kvH, L, D] tensor for SDPA.
Prefill runs csrc/cpu/prefill_attention_cpu.cpp: flash-style (online softmax over key tiles read
in place from the cache), any mix of prompt lengths and cached context (prefix caching, chunked
prefill), no padding or mask tensor. Both honour sliding_window and logits_soft_cap.
The cache writes are one C++ copy per token and kv head (layer_ops_cpu.cpp); ``forward_rotary``
rotates q and k in place in the qkv projection and writes k and v into the cache in one C++
pass (rotary_and_cache: the rotary op's bits, without its new [T, heads, D] tensor).
The kernels are built (or loaded from the kernel cache) when the first layer is constructed; see
kernels.py.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.backends.cpu.kernels import ATTENTION, load_cpu_kernels
from pagedllm.backends.cpu.layer_ops import KERNEL_DTYPES
from pagedllm.contract.attention import AttentionMetadata
from pagedllm.reference.attention import TorchPagedAttention


class CpuNativePagedAttention(TorchPagedAttention):
    name = "native"
    supported_features = ("sliding_window", "logits_soft_cap")

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 **features: Any) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale, **features)
        self._ops = load_cpu_kernels(ATTENTION)
        # the kernels' spelling of "off": 0
        self._window = self.sliding_window or 0
        self._soft_cap = float(self.logits_soft_cap or 0.0)

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
        """query [num_prefill_tokens, num_heads, head_size] (a strided view is fine) -> a new
        tensor of that shape, over each sequence's cache (this step's K/V already written); the
        kernel checks shapes, dtypes, block ids and lengths."""
        if kv_cache.dtype != query.dtype:
            return super().prefill(query, kv_cache, metadata, key, value)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_prefills == 0:
            return out
        self._ops.paged_attention_prefill(out, query, kv_cache, metadata.prefill_block_tables,
                                          metadata.query_start_loc, metadata.prefill_seq_lens,
                                          self.scale, self._window, self._soft_cap)
        return out

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """query [num_decodes, num_heads, head_size] (a strided view is fine) -> a new tensor of
        that shape. The kernel checks shapes, dtypes, block ids and lengths; bad ones raise."""
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self._ops.paged_attention_decode(out, query, kv_cache, metadata.decode_block_tables,
                                         metadata.decode_seq_lens, self.scale, self._window,
                                         self._soft_cap)
        return out
