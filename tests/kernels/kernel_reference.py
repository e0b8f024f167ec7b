"""Float64 torch references for the GPU kernels (device-agnostic; computed on CPU)."""
from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows 0..length-1 of one sequence from a paged cache [num_blocks, block_size, kv_heads, d]."""
    block_size = cache.shape[1]
    pos = torch.arange(length)
    blocks = block_table.cpu().long()[pos // block_size]
    return cache.cpu()[blocks, pos % block_size]  # [length, kv_heads, d]


def attention_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal_offset: int | None = None) -> torch.Tensor:
    """q [nq, heads, d], k/v [nk, kv_heads, d] -> [nq, heads, d] float64.

    causal_offset=c lets query i see keys 0..c+i (None: every key).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal_offset is not None:
        qi = torch.arange(q.shape[0])[:, None]
        ki = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(ki > causal_offset + qi, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def paged_decode_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Single-token decode: query [num_seqs, heads, d] attends to its seq_len cached tokens."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        k = gather_context(key_cache, block_tables[i], length)
        v = gather_context(value_cache, block_tables[i], length)
        out[i] = attention_f64(query[i : i + 1].cpu(), k, v, scale)[0]
    return out


def prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Packed prefill: each sequence's new tokens see its cached context and earlier new tokens."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        keys = torch.cat([gather_context(key_cache, block_tables[i], ctx), k[s:e].cpu()])
        values = torch.cat([gather_context(value_cache, block_tables[i], ctx), v[s:e].cpu()])
        out[s:e] = attention_f64(q[s:e].cpu(), keys, values, scale, causal_offset=ctx)
    return out
