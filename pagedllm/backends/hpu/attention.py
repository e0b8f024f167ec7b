"""Paged attention for Gaudi (HPU) in plain torch: flat-block-list decode, padded prefill.

Cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V).

Steps come from the hpu model runner in one of two padded layouts (``metadata.extras["hpu"]``):

* ``"prefill"``: [batch, length] rows, prompt i in rows i*length .. i*length+q_lens[i]-1;
  attention is causal self-attention over the new tokens (the hpu backend declares neither
  prefix caching nor chunked prefill, so a prefill never has cached context);
* ``"decode"``: one row per sequence, attention over a flat block list (flat_attention.py).

Cache writes must not change shape with the number of pad rows, so pad rows (slot -1) do not
get filtered out: they repeat row 0's slot and K/V, an identical duplicate write. (A step with
no real row at all only happens in warm-up, before any sequence owns a block.) Metadata built
by the engine's ``build_metadata`` (packed rows, no extras) is handled too, as the conformance
suite sends it.
"""
from __future__ import annotations

import torch

from pagedllm.backends.hpu.flat_attention import (flat_blocks, flat_decode_attention,
                                                  padded_prefill_attention)
from pagedllm.contract.attention import AttentionImpl, AttentionMetadata
from pagedllm.reference.attention import kv_cache_shape, scatter_kv


class HpuPagedAttention(AttentionImpl):
    name = "hpu-flat"

    kv_cache_shape = staticmethod(kv_cache_shape)  # the standard layout (reference room)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping
        if slots.shape[0] != key.shape[0]:
            raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {key.shape[0]} tokens")
        pad = (slots < 0)[:, None, None]
        slots = torch.where(slots < 0, slots[:1].clamp_min(0), slots)  # pads duplicate row 0
        key = torch.where(pad, key[:1], key)
        value = torch.where(pad, value[:1], value)
        scatter_kv(kv_cache, slots, key, value)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        kind = metadata.extras.get("hpu")
        if kind is None:  # packed metadata from build_metadata: the template's split
            return super().forward(query, key, value, kv_cache, metadata)
        t = query.shape[0]
        q = query.view(t, self.num_heads, self.head_size)
        k = key.view(t, self.num_kv_heads, self.head_size)
        v = value.view(t, self.num_kv_heads, self.head_size)
        self.write_kv(k, v, kv_cache, metadata)
        if kind == "prefill":
            q_lens = metadata.extras["q_lens"]  # [B]
            b = q_lens.shape[0]
            out = padded_prefill_attention(q.view(b, t // b, self.num_heads, self.head_size),
                                           k.view(b, t // b, self.num_kv_heads, self.head_size),
                                           v.view(b, t // b, self.num_kv_heads, self.head_size),
                                           q_lens, self.scale)
        elif kind == "decode":
            out = flat_decode_attention(q, kv_cache[0], kv_cache[1], metadata.extras["flat"],
                                        self.scale)
        else:
            raise ValueError(f"unknown hpu step layout {kind!r}")
        return out.reshape(t, self.num_heads * self.head_size)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if any(metadata.prefill_context_lens_list):
            raise NotImplementedError("the hpu backend has no prefill over cached context (it "
                                      "declares neither prefix caching nor chunked prefill)")
        q_lens = metadata.prefill_query_lens_list
        p, s = len(q_lens), metadata.max_prefill_query_len
        dev = query.device
        # packed row -> row of the padded [P, S] layout
        flat = torch.cat([torch.arange(n, device=dev) + i * s for i, n in enumerate(q_lens)])

        def padded(x: torch.Tensor) -> torch.Tensor:
            out = x.new_zeros((p * s,) + x.shape[1:])
            out[flat] = x
            return out.view((p, s) + x.shape[1:])

        out = padded_prefill_attention(padded(query), padded(key), padded(value),
                                       torch.tensor(q_lens, device=dev), self.scale)
        return out.reshape(p * s, self.num_heads, self.head_size)[flat]

    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        tables = metadata.decode_block_tables.tolist()
        flat = flat_blocks(metadata.decode_seq_lens_list, tables, metadata.block_size)
        return flat_decode_attention(query, kv_cache[0], kv_cache[1], flat.to(query.device),
                                     self.scale)
