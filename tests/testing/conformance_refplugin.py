"""A small, deliberately plain reference plugin for the mutation harness.

Written from the contract alone (as a vendor would): its own cache write (fp8 with per-tensor
K/V scales too), a per-sequence gather of K/V through the block table, attention with GQA, scale,
sliding window and soft cap in float32, and its own model ops (conformance_refops.py). Every step
is a small method so that a mutant (conformance_mutants.py) can replace exactly one of them with
a realistic bug.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conformance_refops import REF_OPS, RefOps
from pagedllm.backends.attention import AttentionImpl, AttentionMetadata
from pagedllm.backends.interface import Backend, CacheOps, Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.models.layers.ops import Ops

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def raw(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (CPU indexing has no float8 kernels); others as they are."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


class RefAttention(AttentionImpl):
    """Cache layout [2, num_blocks, block_size, kv_heads, head_size] (K then V)."""

    name = "ref"
    supported_features = ("sliding_window", "logits_soft_cap")
    # kv_cache_dtype="fp8": per-tensor scales (a checkpoint's k_scale / v_scale, set after
    # construction); the cache holds saturate(x / scale) in e4m3 and reads back stored * scale
    k_scale: float = 1.0
    v_scale: float = 1.0

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    # --- cache write -------------------------------------------------------------------------
    def kv_scales(self) -> tuple[float, float]:
        return self.k_scale, self.v_scale

    def store(self, values: torch.Tensor, cache: torch.Tensor, scale: float = 1.0
              ) -> torch.Tensor:
        """``values`` [n, kvH, D] as the cache stores them."""
        if cache.dtype == FP8:
            return self.to_fp8(values.float() / scale)
        return values.to(cache.dtype)

    def to_fp8(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def load(self, stored: torch.Tensor, scale: float) -> torch.Tensor:
        """Cache values [n, kvH, D] as float32 (an fp8 cache's times its scale)."""
        return stored.float() * scale if stored.dtype == FP8 else stored.float()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 metadata: AttentionMetadata) -> None:
        slots = metadata.slot_mapping.long()
        real = slots >= 0  # pad rows (slot -1) write nothing
        slots, key, value = slots[real], key[real], value[real]
        bs = kv_cache.shape[2]
        blocks, offsets = self.slot_position(slots, bs)
        k_scale, v_scale = self.kv_scales()
        cache = raw(kv_cache)
        cache[0][blocks, offsets] = raw(self.store(key, kv_cache, k_scale))
        cache[1][blocks, offsets] = raw(self.store(value, kv_cache, v_scale))

    def slot_position(self, slots: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // bs, slots % bs

    # --- reading a sequence back -----------------------------------------------------------
    def gather(self, kv_cache: torch.Tensor, table: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens' K and V of one sequence: [length, kvH, D] each."""
        bs = kv_cache.shape[2]
        nb = -(-length // bs)
        blocks = self.table_blocks(table, nb)
        cache = raw(kv_cache)
        k = cache[0][blocks].reshape(nb * bs, *kv_cache.shape[3:])[:length].view(kv_cache.dtype)
        v = cache[1][blocks].reshape(nb * bs, *kv_cache.shape[3:])[:length].view(kv_cache.dtype)
        k_scale, v_scale = self.kv_scales()
        return self.load(k, k_scale), self.load(v, v_scale)

    def table_blocks(self, table: torch.Tensor, nb: int) -> torch.Tensor:
        return table[:nb].long()

    # --- attention of one sequence -----------------------------------------------------------
    def kv_head_of(self) -> torch.Tensor:
        """[num_heads] the KV head each query head reads."""
        group = self.num_heads // self.num_kv_heads
        return torch.arange(self.num_heads) // group

    def effective_scale(self) -> float:
        return self.scale

    def score(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [n, H, D], k [L, H, D] (already per query head) -> scores [H, n, L]."""
        s = torch.einsum("qhd,khd->hqk", q, k) * self.effective_scale()
        if self.logits_soft_cap is not None:
            s = self.logits_soft_cap * torch.tanh(s / self.logits_soft_cap)
        return s

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[n, L] which keys each query sees (causal, sliding window)."""
        seen = k_pos[None, :] <= q_pos[:, None]
        if self.sliding_window is not None:
            seen &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
        return seen

    def softmax(self, s: torch.Tensor) -> torch.Tensor:
        return s.softmax(-1)

    def combine(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """p [H, n, L], v [L, H, D] -> [n, H, D]."""
        return torch.einsum("hqk,khd->qhd", p, v)

    def attend_seq(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_pos: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] at positions q_pos; k/v [L, kvH, D]. Returns [n, H, D] in q's dtype."""
        heads = self.kv_head_of().to(k.device)
        mask = self.visible(q_pos, torch.arange(k.shape[0], device=q.device))
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for j in heads.unique().tolist():  # the query heads reading KV head j, together
            idx = (heads == j).nonzero().flatten()
            kj = k[:, j:j + 1].float().expand(-1, len(idx), -1)  # [L, g, D]
            s = self.score(q[:, idx].float(), kj)
            p = self.softmax(s.masked_fill(~mask[None], float("-inf")))
            out[:, idx] = self.combine(p, v[:, j:j + 1].float().expand(-1, len(idx), -1))
        return out.to(q.dtype)

    # --- the contract's two entry points -------------------------------------------------------
    def decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        outs = []
        lens = self.decode_lens(metadata)
        for i, n in enumerate(lens):
            k, v = self.gather(kv_cache, metadata.decode_block_tables[i], n)
            pos = torch.tensor([n - 1], device=query.device)
            outs.append(self.attend_seq(query[i:i + 1], k, v, pos))
        return torch.cat(outs)

    def decode_lens(self, metadata: AttentionMetadata) -> list[int]:
        return list(metadata.decode_seq_lens_list)

    def prefill(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        outs = []
        starts = metadata.query_start_loc.tolist()
        for i in range(metadata.num_prefills):
            ctx = self.context_len(metadata, i)
            n = starts[i + 1] - starts[i]
            k, v = self.gather(kv_cache, metadata.prefill_block_tables[i], ctx + n)
            pos = ctx + torch.arange(n, device=query.device)
            outs.append(self.attend_seq(query[starts[i]:starts[i + 1]], k, v, pos))
        return torch.cat(outs)

    def context_len(self, metadata: AttentionMetadata, i: int) -> int:
        return metadata.prefill_context_lens_list[i]


class RefCacheOps(CacheOps):
    """Block copy and swap written out per block (what a port without gather kernels does), as
    bytes (an fp8 cache has no copy kernels of its own on the CPU)."""

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        for src, dst in pairs.tolist():
            for cache in map(raw, kv_caches):
                self.move(cache, dst, cache, src)

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        for s, d in pairs.tolist():
            for src, dst in zip(map(raw, src_caches), map(raw, dst_caches)):
                self.move(dst, d, src, s)

    def move(self, dst: torch.Tensor, d: int, src: torch.Tensor, s: int) -> None:
        """Block ``s`` of ``src`` to block ``d`` of ``dst`` (dim 1; any devices)."""
        dst[:, d] = src[:, s].to(dst.device)


class RefBackend(Backend):
    name = "refplug"
    torch_device = "cpu"
    plugin_api_version = "2.0"
    capabilities = Capabilities(swap=True, prefix_caching=True, chunked_prefill=True,
                                dtypes=("float32", "bfloat16"),
                                preferred_block_size=16, block_sizes=(8, 16, 32, 64, 128),
                                head_sizes=(64, 80, 96, 112, 128, 256), max_gqa_group=8,
                                attention_features=("sliding_window", "logits_soft_cap"),
                                kv_cache_dtypes=("auto", "fp8"))
    attention: type[AttentionImpl] = RefAttention
    ops: type[CacheOps] = RefCacheOps
    ref_ops: type = RefOps

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, "reference plugin on the host CPU"

    def register_ops(self, ops: Ops) -> None:
        """Its own model ops (conformance_refops.py), registered like a vendor's."""
        for name in REF_OPS:
            ops.register(name, getattr(self.ref_ops, name))

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        return self.attention

    def cache_ops(self) -> CacheOps:
        return self.ops()
