"""Paged attention through intel_extension_for_pytorch (IPEX): the xpu backend's attention, and
the cpu backend's ``attention_backend="ipex"`` (IPEX's CPU build runs the same ops on the host).

Cache layout, per layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (K then V).
Each half is the layout IPEX's kernels really use, ``[num_blocks, num_kv_heads, block_size,
head_size]`` (checked with IPEX 2.8.0+cpu; the docstring of ``reshape_and_cache`` says
``[num_blocks, block_size, num_heads, head_size]``, and passing that layout crashes the
process), so ``_check_cache`` verifies shapes before any IPEX call.

* writes: ``PagedAttention.reshape_and_cache`` by slot. IPEX does not skip slot -1 (it writes
  before the buffer and corrupts the heap), so pad rows are removed first;
* decode: ``single_query_cached_kv_attention`` (one query per sequence, GQA by head mapping);
* prefill, with or without cached context: ``flash_attn_varlen_func`` over the paged cache
  (causal, aligned to the end of each sequence, so queries after cached context work).

Both kernels take a sliding window and a soft cap (``softcap``; -1.0: off), with limits checked
against a float64 reference (IPEX 2.8.0+cpu): decode's ``window_size`` counts the visible keys
(the window), prefill's ``window_size_left`` the keys left of the query (window - 1, where 0 means
off, so a window of 1 is refused). IPEX's decode refuses a window and a soft cap together (Gemma
2's sliding layers): such a layer decodes in torch over the same cache (``torch_decode``: the
torch reference's masked attention on the sequences' gathered blocks), while its cache writes
and prefills stay IPEX's, and every other layer runs IPEX throughout.

intel_extension_for_pytorch is imported when the first layer is built, never at import time.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.reference.attention import masked_attention

_IPEX: Any = None


def ipex_paged_attention() -> Any:
    """``ipex.llm.modules.PagedAttention``, importing IPEX on first use."""
    global _IPEX
    if _IPEX is None:
        try:
            import intel_extension_for_pytorch as ipex
        except ImportError as exc:
            raise RuntimeError("attention_backend='ipex' needs intel_extension_for_pytorch "
                               "(pip install intel-extension-for-pytorch, matching your torch "
                               f"version): {exc}") from exc
        _IPEX = ipex.llm.modules.PagedAttention
    return _IPEX


class IpexPagedAttention(AttentionImpl):
    name = "ipex"
    supported_features = ("sliding_window", "logits_soft_cap")

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 **features: Any) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale, **features)
        self._ops = ipex_paged_attention()
        window, cap = self.sliding_window, self.logits_soft_cap
        if window is not None and window < 2:
            raise ValueError(f"the ipex attention cannot run sliding_window={window} (IPEX "
                             "takes windows >= 2); use attention_backend='torch'")
        # IPEX's decode kernel refuses a window with a soft cap: torch_decode runs those layers
        self.decode_in_torch = window is not None and cap is not None
        # IPEX's arguments (-1: off): decode's visible keys, prefill's keys left of the query
        self._window = -1 if window is None else window
        self._window_left = -1 if window is None else window - 1
        self._softcap = -1.0 if cap is None else float(cap)
        # query head h reads kv head h // (num_heads / num_kv_heads)
        self._head_mapping = torch.arange(num_kv_heads, dtype=torch.int32).repeat_interleave(
            num_heads // num_kv_heads)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def _check_cache(self, kv_cache: torch.Tensor, block_size: int) -> None:
        expected = (2, kv_cache.shape[1], self.num_kv_heads, block_size, self.head_size)
        if tuple(kv_cache.shape) != expected or not kv_cache.is_contiguous():
            raise ValueError(f"IPEX paged attention needs a contiguous KV cache of shape "
                             f"[2, num_blocks, num_kv_heads, block_size, head_size] = {expected}; "
                             f"got {tuple(kv_cache.shape)} (other layouts crash IPEX's kernels)")

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        self._check_cache(kv_cache, metadata.block_size)
        slots = metadata.slot_mapping
        if slots.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {key.shape[0]} tokens")
        real = slots >= 0
        if not bool(real.all()):  # IPEX writes slot -1 out of bounds: drop pad rows first
            slots, key, value = slots[real], key[real], value[real]
        if slots.numel() == 0:
            return
        self._ops.reshape_and_cache(key.to(kv_cache.dtype).contiguous(),
                                    value.to(kv_cache.dtype).contiguous(),
                                    kv_cache[0], kv_cache[1], slots.long())

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """[num_decodes, num_heads, head_size]: one query per sequence over its whole context."""
        self._check_cache(kv_cache, metadata.block_size)
        if self.decode_in_torch:
            return self.torch_decode(query, kv_cache, metadata)
        out = torch.empty_like(query)
        self._ops.single_query_cached_kv_attention(
            out, query.contiguous(), kv_cache[0], kv_cache[1],
            self._head_mapping.to(query.device), self.scale,
            metadata.decode_block_tables.int().contiguous(),
            metadata.decode_seq_lens.int().contiguous(), metadata.block_size,
            metadata.max_decode_seq_len, None, window_size=self._window,
            softcap=self._softcap)
        return out

    def torch_decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:
        """Decode in torch over IPEX's cache layout, window and soft cap included: each
        sequence's blocks gathered to K/V [B, kvH, nb * block_size, D], the query heads of a kv
        group as that group's query rows, keys outside (seq_len - 1 - window, seq_len) masked."""
        tables = metadata.decode_block_tables.long()  # [B, nb]
        b, nb = tables.shape
        bs, kvh, d = metadata.block_size, self.num_kv_heads, self.head_size
        # [B, nb, kvH, bs, D] -> [B, kvH, nb * bs, D]
        k = kv_cache[0][tables].transpose(1, 2).reshape(b, kvh, nb * bs, d)
        v = kv_cache[1][tables].transpose(1, 2).reshape(b, kvh, nb * bs, d)
        k_pos = torch.arange(nb * bs, device=query.device)[None, :]
        seq_lens = metadata.decode_seq_lens.long()[:, None]
        mask = (k_pos < seq_lens) & (k_pos > seq_lens - 1 - self.sliding_window)  # [B, L]
        q = query.reshape(b, kvh, self.num_heads // kvh, d)
        out = masked_attention(q, k.to(query.dtype), v.to(query.dtype), mask[:, None, None, :],
                               self.scale, self.logits_soft_cap)
        return out.reshape(b, self.num_heads, d)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Causal attention of the packed prefill rows over each sequence's cached context plus
        its new tokens, all read from the paged cache (the new K/V are already written)."""
        self._check_cache(kv_cache, metadata.block_size)
        seq_lens = metadata.prefill_seq_lens.int()
        cu_kv = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=query.device)
        cu_kv[1:] = seq_lens.cumsum(0)
        out = torch.empty_like(query)
        self._ops.flash_attn_varlen_func(
            out, query.contiguous(), kv_cache[0], kv_cache[1],
            metadata.query_start_loc.int().contiguous(), cu_kv,
            metadata.max_prefill_query_len, metadata.max_prefill_seq_len, self.scale, True,
            metadata.prefill_block_tables.int().contiguous(), None,
            window_size_left=self._window_left, softcap=self._softcap)
        return out
