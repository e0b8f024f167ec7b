"""Gaudi's attention math in plain torch: decode over a flattened block list, and prefill over
prompts padded to one length. Device-independent, so it runs (and is tested) on the CPU.

Decode, the "flat" layout of vLLM's HPU port: instead of a [batch, max_blocks] block table
(whose width varies with the longest sequence), the blocks of every sequence in the batch are
concatenated into one list padded to a bucketed length. Each listed block carries the batch row
it belongs to (``block_groups``) and how many of its slots hold tokens (``block_usage``).
Attention then runs per block, [num_blocks, heads, block_size], and a grouped softmax over each
sequence's blocks (max, then sums, reduced by group) gives the exact result. Shapes depend only
on (batch bucket, block-count bucket), never on the sequences' lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class FlatBlocks:
    """A decode batch's flattened block list, padded to ``num_blocks`` entries.

    ``block_list`` [NB] physical block ids (pad: 0); ``block_groups`` [NB] the batch row of each
    block (pad: ``batch``, a dummy row that is dropped); ``block_usage`` [NB] the block's filled
    slots, 1..block_size (pad: 1, so no row of scores is empty).
    """

    block_list: torch.Tensor
    block_groups: torch.Tensor
    block_usage: torch.Tensor
    batch: int  # padded batch size; group ``batch`` collects the pad blocks

    def to(self, device: torch.device) -> FlatBlocks:
        return FlatBlocks(self.block_list.to(device), self.block_groups.to(device),
                          self.block_usage.to(device), self.batch)


def flat_blocks(seq_lens: list[int], tables: list[list[int]], block_size: int,
                num_blocks: int | None = None, batch: int | None = None) -> FlatBlocks:
    """The flat block list of sequences with these lengths (including the token being decoded)
    and block tables, padded to ``num_blocks`` entries and ``batch`` rows (default: unpadded)."""
    blocks: list[int] = []
    groups: list[int] = []
    usage: list[int] = []
    for row, (n, table) in enumerate(zip(seq_lens, tables)):
        used = -(-n // block_size)
        if len(table) < used:
            raise ValueError(f"sequence {row} has {n} tokens but only {len(table)} blocks of "
                             f"{block_size}")
        blocks.extend(table[:used])
        groups.extend([row] * used)
        usage.extend([block_size] * (used - 1) + [n - (used - 1) * block_size])
    batch = len(seq_lens) if batch is None else batch
    num_blocks = len(blocks) if num_blocks is None else num_blocks
    if len(blocks) > num_blocks or len(seq_lens) > batch:
        raise ValueError(f"{len(blocks)} blocks of {len(seq_lens)} sequences do not fit a "
                         f"flat list of {num_blocks} blocks for {batch} rows")
    pad = num_blocks - len(blocks)

    def t(values: list[int], fill: int) -> torch.Tensor:
        return torch.tensor(values + [fill] * pad, dtype=torch.int64)

    return FlatBlocks(t(blocks, 0), t(groups, batch), t(usage, 1), batch)


def flat_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, flat: FlatBlocks, scale: float
                          ) -> torch.Tensor:
    """One query per batch row over its blocks. query [B, H, D]; caches [num_blocks,
    block_size, kvH, D]; returns [B, H, D] in query's dtype (float32 accumulation). Rows
    without blocks (batch padding) come out as zeros."""
    b, num_heads, head_size = query.shape
    kv_heads = key_cache.shape[2]
    group = num_heads // kv_heads  # query head h reads kv head h // group
    block_size = key_cache.shape[1]
    rows = flat.block_groups.clamp(max=b - 1)  # pad blocks borrow row b-1's query; dropped below
    q = query.float()[rows].view(-1, kv_heads, group, head_size) * scale  # [NB, kvH, G, D]
    k = key_cache[flat.block_list].float()  # [NB, bs, kvH, D]
    v = value_cache[flat.block_list].float()
    scores = torch.einsum("nkgd,nskd->nkgs", q, k)  # [NB, kvH, G, bs]
    filled = torch.arange(block_size, device=query.device)[None, :] < flat.block_usage[:, None]
    scores = scores.masked_fill(~filled[:, None, None, :], float("-inf"))
    # grouped softmax: each block's scores shifted by the max over all blocks of its sequence
    groups = flat.block_groups
    block_max = scores.amax(dim=-1)  # [NB, kvH, G]; finite: usage >= 1
    seq_max = torch.full((flat.batch + 1,) + block_max.shape[1:], float("-inf"),
                         device=query.device)
    seq_max = seq_max.scatter_reduce(0, groups[:, None, None].expand_as(block_max), block_max,
                                     reduce="amax")
    weights = torch.exp(scores - seq_max[groups][..., None])  # masked slots -> 0
    denom = torch.zeros_like(seq_max).index_add_(0, groups, weights.sum(dim=-1))
    acc = torch.zeros(seq_max.shape + (head_size,), device=query.device)
    acc = acc.index_add_(0, groups, torch.einsum("nkgs,nskd->nkgd", weights, v))
    out = acc[:b] / denom[:b].clamp_min(1e-30)[..., None]  # [B, kvH, G, D]
    return out.reshape(b, num_heads, head_size).to(query.dtype)


def padded_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             q_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of prompts padded to one length, no cached context.

    query [B, S, H, D], key/value [B, S, kvH, D]; q_lens [B] real tokens per row (pad rows
    may have 0). Keys at or past a row's length are masked; a row with no real token still
    sees key 0, so no softmax is empty. Returns [B, S, H, D].
    """
    s = query.shape[1]
    pos = torch.arange(s, device=query.device)
    lens = q_lens.long().clamp_min(1)[:, None, None]  # [B, 1, 1]
    mask = (pos[None, None, :] <= pos[None, :, None]) & (pos[None, None, :] < lens)  # [B, S, S]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale,
        enable_gqa=query.shape[2] != key.shape[2])  # [B, H, S, D]
    return out.transpose(1, 2)
