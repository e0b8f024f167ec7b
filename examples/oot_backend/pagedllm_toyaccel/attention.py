"""toyaccel paged attention: a heads-major cache and one blockwise online-softmax kernel.

Cache layout, per layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (K then V).
Heads-major keeps each (block, head) tile of ``block_size x head_size`` contiguous, which is what
a tile-based matrix engine loads in one go. Dim 1 still indexes blocks, as the contract requires,
so block copy and swap work unchanged.

Instead of gathering a sequence's whole context and masking (the cpu reference), the kernel
walks the block table one column at a time and keeps a running max, denominator and weighted sum
per query (flash-decoding style), so memory use does not grow with the context length. The same
kernel serves decode (one query per sequence) and prefill (queries padded per sequence), because
the new tokens' K/V are written to the cache before attention runs: prefill reads everything,
cached context and new tokens alike, from the paged cache.
"""
from __future__ import annotations

import torch

from pagedllm.contract.attention import AttentionImpl, AttentionMetadata


def blockwise_attention(query: torch.Tensor, q_pos: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                        max_seq_len: int) -> torch.Tensor:
    """Causal attention of padded queries over their sequences' paged K/V.

    query [B, Q, H, D]; q_pos [B, Q] absolute position of each query (a query at p sees keys
    0..p); seq_lens [B] (keys at or past it are never read); block_tables [B, max_blocks].
    Returns [B, Q, H, D] in query's dtype. Accumulates in float32.
    """
    b, q_len, num_heads, head_size = query.shape
    kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // kv_heads  # query head h reads kv head h // group
    # [B, kvH, G*Q, D]: every query row of a kv head's group, one matrix per (sequence, kv head)
    q = (query.float().view(b, q_len, kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
         .reshape(b, kv_heads, group * q_len, head_size)) * scale
    pos = q_pos.long().repeat(1, group).view(b, 1, group * q_len, 1)  # same order as q's rows
    lens = seq_lens.long().view(b, 1, 1, 1)
    running_max = torch.full((b, kv_heads, group * q_len), float("-inf"), device=query.device)
    denom = torch.zeros((b, kv_heads, group * q_len), device=query.device)
    acc = torch.zeros((b, kv_heads, group * q_len, head_size), device=query.device)
    offsets = torch.arange(block_size, device=query.device)
    for col in range(-(-max_seq_len // block_size)):
        blocks = block_tables[:, col].long()
        k = kv_cache[0, blocks].float()  # [B, kvH, bs, D]
        v = kv_cache[1, blocks].float()
        scores = q @ k.transpose(-1, -2)  # [B, kvH, G*Q, bs]
        k_pos = (col * block_size + offsets).view(1, 1, 1, block_size)
        scores = scores.masked_fill((k_pos > pos) | (k_pos >= lens), float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
        weights = torch.exp(scores - shift[..., None])  # masked keys -> 0
        rescale = torch.exp(running_max - shift)  # 0 while nothing was seen yet
        denom = denom * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + weights @ v
        running_max = new_max
    out = acc / denom.clamp_min(1e-30)[..., None]  # pad queries (nothing seen) give 0, not NaN
    out = out.view(b, kv_heads, group, q_len, head_size).permute(0, 3, 1, 2, 4)
    return out.reshape(b, q_len, num_heads, head_size).to(query.dtype)


class BlockwiseAttention(AttentionImpl):
    name = "blockwise"

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        if slots.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {key.shape[0]} tokens")
        real = slots >= 0  # pad rows (slot -1) of a bucketed step write nothing
        slots, key, value = slots[real], key[real], value[real]
        block_size = kv_cache.shape[3]
        blocks = (slots // block_size)[:, None]  # [n, 1]
        offsets = (slots % block_size)[:, None]
        heads = torch.arange(self.num_kv_heads, device=slots.device)[None, :]  # [1, kvH]
        kv_cache[0].index_put_((blocks, heads, offsets), key.to(kv_cache.dtype))
        kv_cache[1].index_put_((blocks, heads, offsets), value.to(kv_cache.dtype))

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        seq_lens = metadata.decode_seq_lens
        out = blockwise_attention(query[:, None], (seq_lens - 1)[:, None], seq_lens,
                                  metadata.decode_block_tables, kv_cache, self.scale,
                                  metadata.max_decode_seq_len)
        return out[:, 0]

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        p, q_max = metadata.num_prefills, metadata.max_prefill_query_len
        dev = query.device
        q_lens = torch.tensor(metadata.prefill_query_lens_list, device=dev)
        # packed row -> slot in the padded [P, Qmax] layout
        seq_of_row = torch.repeat_interleave(torch.arange(p, device=dev), q_lens)
        row_in_seq = (torch.arange(query.shape[0], device=dev)
                      - metadata.query_start_loc[:-1].long()[seq_of_row])
        flat = seq_of_row * q_max + row_in_seq
        padded = query.new_zeros(p * q_max, self.num_heads, self.head_size)
        padded[flat] = query
        q_pos = (metadata.prefill_context_lens.long()[:, None]
                 + torch.arange(q_max, device=dev)[None, :])  # [P, Qmax]
        out = blockwise_attention(padded.view(p, q_max, self.num_heads, self.head_size), q_pos,
                                  metadata.prefill_seq_lens, metadata.prefill_block_tables,
                                  kv_cache, self.scale, metadata.max_prefill_seq_len)
        return out.reshape(p * q_max, self.num_heads, self.head_size)[flat]
