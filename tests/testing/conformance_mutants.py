"""Realistic single bugs in the reference plugin; the conformance suite must catch every one.

Each mutant replaces one small method of conformance_refplugin (or one declaration) with a bug
a port has actually shipped or plausibly would: the ones issue 29 lists first (power-of-two
GQA groups, head sizes in tiles of 64, a bug only at block size 64, graphs / async_output
declared but not implemented, a bf16 cache written through fp16, scale ignored), then the
classes the suite already caught, then others. ``first`` names the checks most likely to catch
it, which the harness runs before the rest (fail fast).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from conformance_refops import RefOps
from conformance_refplugin import RefAttention, RefBackend, RefCacheOps
from pagedllm.backends.attention import AttentionMetadata


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what is wrong, in words
    attention: dict[str, Callable] = field(default_factory=dict)  # RefAttention overrides
    cache_ops: dict[str, Callable] = field(default_factory=dict)  # RefCacheOps overrides
    caps: dict[str, object] = field(default_factory=dict)  # Capabilities overrides
    first: tuple[str, ...] = ()  # check-name prefixes to run first
    ops: dict[str, object] = field(default_factory=dict)  # RefOps overrides (static/classmethods)
    backend_methods: dict[str, Callable] = field(default_factory=dict)  # RefBackend overrides
    engine: bool = False  # an engine-level bug: the engine checks run too (they are slow)
    blind_spot: str = ""  # the issue-41 class it belongs to (conformance_mutants_v3.py)

    def backend(self) -> RefBackend:
        attn = type(f"Attn_{self.name}", (RefAttention,),
                    {"supported_features": RefAttention.supported_features, **self.attention})
        ops = type(f"Ops_{self.name}", (RefCacheOps,), dict(self.cache_ops))
        ref_ops = type(f"RefOps_{self.name}", (RefOps,), dict(self.ops))
        caps = dataclasses.replace(RefBackend.capabilities, **self.caps)
        cls = type(f"Backend_{self.name}", (RefBackend,),
                   {"attention": attn, "ops": ops, "ref_ops": ref_ops, "capabilities": caps,
                    **self.backend_methods})
        return cls()


# --- the bug bodies ------------------------------------------------------------------------------
def _gqa_pow2(self: RefAttention) -> torch.Tensor:
    group = self.num_heads // self.num_kv_heads
    shift = int(math.log2(group))  # assumes the group is a power of two
    # (clamped: a kernel reads some KV head's memory instead of faulting)
    return (torch.arange(self.num_heads) >> shift).clamp(max=self.num_kv_heads - 1)


def _score_tiles_64(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    d = (q.shape[-1] // 64) * 64  # only whole tiles of 64 dims are reduced
    return RefAttention.score(self, q[..., :d], k[..., :d])


def _score_tiles_128(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    d = min(q.shape[-1], 128)  # a second 128-wide tile is never loaded
    return RefAttention.score(self, q[..., :d], k[..., :d])


def _gather_bs64_bug(self: RefAttention, kv_cache: torch.Tensor, table: torch.Tensor,
                     length: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = RefAttention.gather(self, kv_cache, table, length)
    if kv_cache.shape[2] == 64 and length > 64:  # a tile-shape special case at block size 64
        k, v = k.clone(), v.clone()
        k[64:] = k[63:-1].clone()
    return k, v


def _store_through_fp16(self: RefAttention, values: torch.Tensor, cache: torch.Tensor,
                        scale: float = 1.0) -> torch.Tensor:
    return RefAttention.store(self, values.to(torch.float16), cache, scale)


def _scale_ignored(self: RefAttention) -> float:
    return self.head_size ** -0.5


def _decode_reads_one_past(self: RefAttention, metadata: AttentionMetadata) -> list[int]:
    return [n + 1 for n in metadata.decode_seq_lens_list]  # reads a stale slot past the end


def _write_pad_rows(self: RefAttention, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    slots = metadata.slot_mapping.long() % (kv_cache.shape[1] * kv_cache.shape[2])  # -1 wraps
    bs = kv_cache.shape[2]
    kv_cache[0][slots // bs, slots % bs] = key.to(kv_cache.dtype)
    kv_cache[1][slots // bs, slots % bs] = value.to(kv_cache.dtype)


def _ignore_context(self: RefAttention, metadata: AttentionMetadata, i: int) -> int:
    return 0  # prefill treated as a fresh prompt: cached prefix never read


def _non_causal(self: RefAttention, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
    if self.sliding_window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - self.sliding_window
    return seen & (k_pos[None, :] <= q_pos.max())


def _contiguous_blocks(self: RefAttention, table: torch.Tensor, nb: int) -> torch.Tensor:
    # assumes a sequence's blocks are consecutive (clamped into the table's block range)
    return (table[0].long() + torch.arange(nb)).clamp(max=int(table.max()))


def _naive_softmax(self: RefAttention, s: torch.Tensor) -> torch.Tensor:
    e = torch.exp(s)  # no max subtraction: overflows for large scores
    return e / e.sum(-1, keepdim=True)


def _half_accumulate(self: RefAttention, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hqk,khd->qhd", p.half(), v.half()).float()  # fp16 accumulator


def _window_off_by_one(self: RefAttention, q_pos: torch.Tensor,
                       k_pos: torch.Tensor) -> torch.Tensor:
    seen = k_pos[None, :] <= q_pos[:, None]
    if self.sliding_window is not None:
        seen &= k_pos[None, :] >= q_pos[:, None] - self.sliding_window  # one key too many
    return seen


def _window_ignored(self: RefAttention, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return k_pos[None, :] <= q_pos[:, None]


def _cap_before_scale(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    s = torch.einsum("qhd,khd->hqk", q, k)
    if self.logits_soft_cap is not None:
        s = self.logits_soft_cap * torch.tanh(s / self.logits_soft_cap)
    return s * self.scale


def _cap_ignored(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.einsum("qhd,khd->hqk", q, k) * self.scale


def _context_limit_4096(self: RefAttention, kv_cache: torch.Tensor, table: torch.Tensor,
                        length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return RefAttention.gather(self, kv_cache, table, min(length, 4096))  # one 4k partition


def _copy_only_keys(self: RefCacheOps, kv_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
    for src, dst in pairs.tolist():
        for cache in kv_caches:
            cache[0, dst] = cache[0, src]


def _swap_ignores_dst(self: RefCacheOps, src_caches: list[torch.Tensor],
                      dst_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    for s, _ in pairs.tolist():
        for src, dst in zip(src_caches, dst_caches):
            if s < dst.shape[1]:
                dst[:, s] = src[:, s].to(dst.device)


def _lens_sorted(self: RefAttention, metadata: AttentionMetadata) -> list[int]:
    return sorted(metadata.decode_seq_lens_list, reverse=True)  # assumes a length-sorted batch


def _first_token_zero(self: RefAttention, query: torch.Tensor, kv_cache: torch.Tensor,
                      metadata: AttentionMetadata) -> torch.Tensor:
    out = RefAttention.decode(self, query, kv_cache, metadata)
    first = torch.tensor(metadata.decode_seq_lens_list, device=out.device) == 1
    return out.masked_fill(first[:, None, None], 0.0)  # a loop starting at the second key


def _full_blocks_only(self: RefAttention, metadata: AttentionMetadata) -> list[int]:
    bs = metadata.block_size  # the last, partial block is skipped
    return [max(1, (n // bs) * bs) if n > bs else n for n in metadata.decode_seq_lens_list]


def _kv_heads_reversed(self: RefAttention) -> torch.Tensor:
    group = self.num_heads // self.num_kv_heads
    return self.num_kv_heads - 1 - torch.arange(self.num_heads) // group


def _same_context_for_all(self: RefAttention, metadata: AttentionMetadata, i: int) -> int:
    return metadata.prefill_context_lens_list[0]


def _slot_offset_lost(self: RefAttention, slots: torch.Tensor,
                      bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    return slots // bs, (slots % bs) % 8  # offsets kept modulo an 8-token tile


def _decode_rows_shifted(self: RefAttention, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: AttentionMetadata) -> torch.Tensor:
    t = query.shape[0]
    q = query.view(t, self.num_heads, self.head_size)
    p, d = metadata.num_prefill_tokens, metadata.num_decode_tokens
    k = key.view(t, self.num_kv_heads, self.head_size)
    v = value.view(t, self.num_kv_heads, self.head_size)
    parts = []
    if p:
        parts.append(self.prefill(q[:p], kv_cache, metadata, k[:p], v[:p]))
    if d:
        parts.append(self.decode(q[:d], kv_cache, metadata))  # decode rows taken from the top
    out = torch.cat(parts)
    if out.shape[0] < t:
        out = torch.cat([out, out.new_zeros((t - out.shape[0],) + out.shape[1:])])
    return out.reshape(t, -1)


def _bf16_accumulate(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    s = torch.einsum("qhd,khd->hqk", q.bfloat16(), k.bfloat16()).float()  # bf16 dot products
    return s * self.scale


MUTANTS: list[Mutant] = [
    # the bugs issue 29 lists
    Mutant("gqa_power_of_two", "query head -> KV head by a shift (power-of-two groups only)",
           attention={"kv_head_of": _gqa_pow2}, first=("gqa[float32-g3]",)),
    Mutant("head_size_tiles_of_64", "scores reduce only whole 64-dim tiles (head size 80 ...)",
           attention={"score": _score_tiles_64}, first=("head_size[float32-hs80]",)),
    Mutant("bug_only_at_block_size_64", "a stale key at block size 64",
           attention={"gather": _gather_bs64_bug}, first=("block_size[float32-bs64]",)),
    Mutant("graphs_declared_not_implemented", "graphs=True with no capture",
           caps={"graphs": True}, first=("claims:graphs",)),
    Mutant("async_output_declared_not_implemented", "async_output=True, launch_model blocks",
           caps={"async_output": True}, first=("claims:async_output",)),
    Mutant("bf16_cache_through_fp16", "K/V stored through float16 (inf past 65504)",
           attention={"store": _store_through_fp16}, first=("dtype_edges[bfloat16]",)),
    Mutant("scale_ignored", "head_size ** -0.5 instead of the scale argument",
           attention={"effective_scale": _scale_ignored}, first=("scale[float32",)),
    # classes the suite caught before v2
    Mutant("decode_reads_past_the_end", "decode attends one stale slot past the sequence",
           attention={"decode_lens": _decode_reads_one_past}, first=("block_size[float32",)),
    Mutant("pad_rows_written", "slot -1 rows written (wrapping to the last slot)",
           attention={"write_kv": _write_pad_rows}, first=("write_kv[float32",)),
    Mutant("prefill_ignores_cached_context", "prefix-cache hits / earlier chunks never read",
           attention={"context_len": _ignore_context}, first=("block_size[float32",)),
    Mutant("prefill_not_causal", "prefill queries see later tokens",
           attention={"visible": _non_causal}, first=("block_size[float32",)),
    Mutant("blocks_assumed_contiguous", "block table read as a first block plus an offset",
           attention={"table_blocks": _contiguous_blocks}, first=("block_size[float32",)),
    Mutant("copy_blocks_keys_only", "copy-on-write copies K but not V",
           cache_ops={"copy_blocks": _copy_only_keys}, first=("copy_blocks[float32",)),
    Mutant("swap_ignores_destination", "swap writes block i to block i",
           cache_ops={"swap_blocks": _swap_ignores_dst}, first=("swap[float32",)),
    Mutant("kv_heads_reversed", "query heads read KV heads in reverse order",
           attention={"kv_head_of": _kv_heads_reversed}, first=("gqa[float32-g2]",)),
    Mutant("slot_offset_modulo_8", "cache write keeps the in-block offset modulo 8",
           attention={"slot_position": _slot_offset_lost}, first=("write_kv[float32",)),
    Mutant("decode_rows_from_the_top", "mixed steps: decode reads the prefill rows' queries",
           attention={"forward": lambda self, q, k, v, c, m: (
               self.write_kv(k.view(q.shape[0], self.num_kv_heads, self.head_size),
                             v.view(q.shape[0], self.num_kv_heads, self.head_size), c, m),
               _decode_rows_shifted(self, q, k, v, c, m))[1]},
           first=("block_size[float32",)),
    # found while writing the v2 sweep
    Mutant("softmax_without_max_subtraction", "exp overflows for scores in the hundreds",
           attention={"softmax": _naive_softmax}, first=("dtype_edges[float32]",)),
    Mutant("fp16_accumulator", "P @ V accumulated in float16 (overflows on large values)",
           attention={"combine": _half_accumulate}, first=("dtype_edges[float32]",)),
    Mutant("bf16_dot_products", "Q.K in bfloat16 (loses float32 accuracy)",
           attention={"score": _bf16_accumulate}, first=("block_size[float32",)),
    Mutant("head_size_256_in_one_tile", "a second 128-wide tile never loaded",
           attention={"score": _score_tiles_128}, first=("head_size[float32-hs256]",)),
    Mutant("sliding_window_off_by_one", "a query also sees the key at p - window",
           attention={"visible": _window_off_by_one}, first=("sliding_window[float32",)),
    Mutant("sliding_window_ignored", "the window argument is stored but not applied",
           attention={"visible": _window_ignored}, first=("sliding_window[float32",)),
    Mutant("soft_cap_before_scale", "tanh capping applied to unscaled scores",
           attention={"score": _cap_before_scale}, first=("soft_cap[float32",)),
    Mutant("soft_cap_ignored", "logits_soft_cap stored but not applied",
           attention={"score": _cap_ignored}, first=("soft_cap[float32",)),
    Mutant("context_capped_at_4096", "decode reads at most one 4,096-token partition",
           attention={"gather": _context_limit_4096}, first=("long_context[float32]",)),
    Mutant("decode_lens_sorted", "decode assumes the batch is sorted by length",
           attention={"decode_lens": _lens_sorted}, first=("reordered[float32]",)),
    Mutant("first_token_zero", "decode of a one-token sequence returns zeros",
           attention={"decode": _first_token_zero}, first=("block_size[float32",)),
    Mutant("partial_block_skipped", "decode skips the last, partly filled block",
           attention={"decode_lens": _full_blocks_only}, first=("block_size[float32",)),
    Mutant("one_context_for_all_prefills", "every prefill uses the first one's context length",
           attention={"context_len": _same_context_for_all}, first=("long_context[float32]",)),
]
