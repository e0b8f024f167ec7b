"""Paged attention in vectorized torch: the reference every other backend is compared to, and
the standard cache layout (``kv_cache_shape``, ``scatter_kv``) the cpu, cuda and hpu backends
share.

No Python loop per token or per sequence: decode gathers each sequence's blocks through its block
table in one indexing op; prefill pads the packed queries to [num_prefills, max_query_len].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.contract.attention import AttentionImpl, AttentionMetadata


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_size: int) -> tuple[int, ...]:
    """The standard layout of one layer's cache: K then V, [2, num_blocks, block_size,
    num_kv_heads, head_size]; slot s = block * block_size + offset is row s of K (or V) viewed
    as [num_blocks * block_size, num_kv_heads, head_size]."""
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def scatter_kv(kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> None:
    """Store ``key``/``value`` [n, kvH, D] at ``slots`` [n] int64 (every one a real slot, >= 0)
    of a standard-layout cache, converted to the cache's dtype."""
    kv_heads, head_size = kv_cache.shape[-2:]
    k_flat = kv_cache[0].view(-1, kv_heads, head_size)
    v_flat = kv_cache[1].view(-1, kv_heads, head_size)
    k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, value.to(v_flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [2, num_blocks, bs, kvH, D], tables [B, nb] -> K and V, each [B, kvH, nb*bs, D].

    One index_select over the flattened [2 * num_blocks] dim (a row copy per block; advanced
    indexing on dim 1 is ~4x slower).
    """
    b, nb = block_tables.shape
    _, num_blocks, bs, kv_heads, d = kv_cache.shape
    idx = block_tables.reshape(-1).long()
    g = kv_cache.view(2 * num_blocks, bs, kv_heads, d).index_select(0, torch.cat([idx, idx + num_blocks]))
    g = g.view(2, b, nb * bs, kv_heads, d).transpose(2, 3)
    return g[0], g[1]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, soft_cap: float | None) -> torch.Tensor:
    """q [B, H, Q, D], k/v [B, kvH, L, D], mask [B, 1, Q, L] (True: visible) -> [B, H, Q, D].

    Without a soft cap this is SDPA. With one, transformers' eager arithmetic: scores = q k^T *
    scale, then cap * tanh(scores / cap), then the mask, a float32 softmax and the product with v
    (query head h reads kv head h // (H / kvH)). Every row sees at least one key (itself).
    """
    group = q.shape[1] // k.shape[1]
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=group != 1)
    if group != 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to e4m3 (saturating at +-448)."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


class TorchPagedAttention(AttentionImpl):
    name = "torch"
    # kv_cache_dtype="fp8": per-tensor scales of the cached K and V (1.0 unless a checkpoint
    # sets them)
    k_scale: float = 1.0
    v_scale: float = 1.0
    supported_features = ("sliding_window", "logits_soft_cap")

    kv_cache_shape = staticmethod(kv_cache_shape)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        n = key.shape[0]
        if slots.shape[0] != n:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {n} tokens")
        valid = slots >= 0
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        if kv_cache.dtype == torch.float8_e4m3fn:  # K / k_scale, V / v_scale as e4m3 bytes
            kv_cache = kv_cache.view(torch.uint8)
            key = to_fp8(key, self.k_scale).view(torch.uint8)
            value = to_fp8(value, self.v_scale).view(torch.uint8)
        scatter_kv(kv_cache, slots, key, value)

    def gather(self, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather_kv`` in ``dtype``; an fp8 cache's values times the k / v scales."""
        if kv_cache.dtype != torch.float8_e4m3fn:
            return gather_kv(kv_cache, block_tables)
        k, v = gather_kv(kv_cache.view(torch.uint8), block_tables)
        return (k.view(torch.float8_e4m3fn).to(dtype) * self.k_scale,
                v.view(torch.float8_e4m3fn).to(dtype) * self.v_scale)

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        k, v = self.gather(kv_cache, metadata.decode_block_tables, query.dtype)  # [B, kvH, L, D]
        b, length = k.shape[0], k.shape[2]
        k_pos = torch.arange(length, device=query.device)[None, :]
        seq_lens = metadata.decode_seq_lens[:, None]
        mask = k_pos < seq_lens  # [B, L]; the query sits at position seq_len - 1
        if self.sliding_window is not None:
            mask &= k_pos > seq_lens - 1 - self.sliding_window
        # The query heads of a kv group as the group's query rows: [B, kvH, H / kvH, D]. Same
        # attention as GQA over repeated K/V, without materializing the repeats.
        q = query.reshape(b, self.num_kv_heads, self.num_heads // self.num_kv_heads, -1)
        out = masked_attention(q, k, v, mask[:, None, None, :], self.scale, self.logits_soft_cap)
        return out.reshape(b, self.num_heads, -1)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        p, qmax = metadata.num_prefills, metadata.max_prefill_query_len
        dev = query.device
        q_lens = metadata.prefill_query_lens_list
        starts = metadata.query_start_loc[:-1].long()
        # packed row -> (sequence, offset) in the padded [P, Qmax] layout
        seq_of_row = torch.repeat_interleave(torch.arange(p, device=dev),
                                             torch.tensor(q_lens, device=dev))
        offset = torch.arange(query.shape[0], device=dev) - starts[seq_of_row]
        flat_idx = seq_of_row * qmax + offset
        q = query.new_zeros(p * qmax, self.num_heads, self.head_size)
        q.index_copy_(0, flat_idx, query)
        q = q.view(p, qmax, self.num_heads, self.head_size).transpose(1, 2)  # [P, H, Qmax, D]
        k, v = self.gather(kv_cache, metadata.prefill_block_tables, query.dtype)  # [P, kvH, L, D]
        length = k.shape[2]
        ctx = metadata.prefill_context_lens.long()[:, None, None]  # [P, 1, 1]
        q_pos = ctx + torch.arange(qmax, device=dev)[None, :, None]  # absolute query positions
        k_pos = torch.arange(length, device=dev)[None, None, :]
        seq_lens = metadata.prefill_seq_lens.long()[:, None, None]
        mask = (k_pos <= q_pos) & (k_pos < seq_lens)  # [P, Qmax, L]
        if self.sliding_window is not None:
            # a padded query row (q_pos >= seq_len) may see no key: its NaN row is dropped below
            mask &= k_pos > q_pos - self.sliding_window
        out = masked_attention(q, k, v, mask[:, None], self.scale,
                               self.logits_soft_cap)  # [P, H, Qmax, D]
        out = out.transpose(1, 2).reshape(p * qmax, self.num_heads, self.head_size)
        return out[flat_idx]
