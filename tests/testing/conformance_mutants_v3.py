"""Realistic single bugs in the blind spots issue 41 names, at least two per class; the v3 suite
must catch every one (the v2 suite missed such bugs: it never left a small default shape).

Classes (``BLIND_SPOTS``): shapes inside the declared space, values off the default (fp8 scales
and range, copy/swap of fp8 caches), repetition and resources, capability claims, registered
model ops.
"""
from __future__ import annotations

import random
import time
from typing import Any

import torch

from conformance_mutants import Mutant
from conformance_refops import VOCAB_TILE, RefOps
from conformance_refplugin import FP8, RefAttention, RefBackend, raw
from pagedllm.backends.attention import AttentionMetadata
from pagedllm.worker.worker import Worker

SHAPES, VALUES, REPETITION, CLAIMS, OPS = ("shapes", "values", "repetition", "claims", "ops")
BLIND_SPOTS = (SHAPES, VALUES, REPETITION, CLAIMS, OPS)


# --- shapes inside the declared space -----------------------------------------------------------
def _kv_head_mod_4(self: RefAttention) -> torch.Tensor:
    group = self.num_heads // self.num_kv_heads
    return (torch.arange(self.num_heads) // group) % 4  # a 4-KV-head tile, no wrap guard


def _decode_grid_64(self: RefAttention, query: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: AttentionMetadata) -> torch.Tensor:
    out = RefAttention.decode(self, query, kv_cache, metadata)
    if out.shape[0] > 64:  # a grid of 64 sequence slots: the rest reuse slot i - 64's result
        out = out.clone()
        out[64:] = out[:out.shape[0] - 64]
    return out


def _prefill_causal_tile_4(self: RefAttention, q_pos: torch.Tensor,
                           k_pos: torch.Tensor) -> torch.Tensor:
    """A prefill kernel computing query tiles of 64 rows that takes the causal bound of tiles
    past the fourth from the fourth (rows past 256 of one prefill miss their later keys)."""
    seen = RefAttention.visible(self, q_pos, k_pos)
    if len(q_pos) > 256:
        capped = torch.minimum(q_pos, q_pos[255])
        seen = RefAttention.visible(self, capped, k_pos)
    return seen


def _chunk_at_last_slot(self: RefAttention, metadata: AttentionMetadata, i: int) -> int:
    """A chunk starting in the last slot of a block reads one context token less (the
    block-boundary case of the chunk-start path off by one)."""
    ctx = metadata.prefill_context_lens_list[i]
    bs = metadata.block_size
    return ctx - 1 if bs > 2 and ctx % bs == bs - 1 else ctx


def _context_16k(self: RefAttention, kv_cache: torch.Tensor, table: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return RefAttention.gather(self, kv_cache, table, min(length, 16384))  # 16k partition table


def _block_ids_int16(self: RefAttention, table: torch.Tensor, nb: int) -> torch.Tensor:
    return table[:nb].to(torch.int16).long()  # ids kept in 16 bits: past 32767 they wrap


def _long_context_head_64(self: RefAttention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    if k.shape[0] > 8192 and q.shape[-1] > 64:  # the long-context kernel built for head size 64
        return RefAttention.score(self, q[..., :64], k[..., :64])
    return RefAttention.score(self, q, k)


# --- values off the default ---------------------------------------------------------------------
def _k_scale_ignored(self: RefAttention) -> tuple[float, float]:
    return 1.0, self.v_scale


def _v_scale_for_both(self: RefAttention) -> tuple[float, float]:
    return self.v_scale, self.v_scale


def _fp8_no_saturation(self: RefAttention, x: torch.Tensor) -> torch.Tensor:
    """A device conversion without saturation (cvt without .satfinite): past e4m3's range
    (what rounds above 448) is NaN, not +-448."""
    return torch.where(x.abs() >= 464, torch.full_like(x, float("nan")), x).to(FP8)


def _fp8_copy_half_block(self: Any, dst: torch.Tensor, d: int, src: torch.Tensor, s: int) -> None:
    if dst.dtype == torch.uint8:  # an fp8 cache: the block's size computed in 2-byte elements
        half = dst.shape[2] // 2  # moves the first half of its tokens
        dst[:, d, :half] = src[:, s, :half].to(dst.device)
        return
    dst[:, d] = src[:, s].to(dst.device)


# --- repetition and resources -------------------------------------------------------------------
def _split_order_by_call(self: RefAttention, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P @ V over three key partitions, added in the order they finish (as atomics add): here
    a coin flip per call."""
    n = p.shape[-1]
    cuts = [0, n // 3, 2 * n // 3, n]
    parts = [torch.einsum("hqk,khd->qhd", p[..., a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    if _ARRIVAL.random() < 0.5:
        return (parts[0] + parts[1]) + parts[2]
    return parts[0] + (parts[1] + parts[2])


_ARRIVAL = random.Random()  # unseeded: the order partitions finish in varies run to run


def _split_k_by_clock(self: RefAttention, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Split-K partitions (2 or 3) chosen per call from a clock-based occupancy estimate, as a
    launch heuristic reading the device's load would: the same inputs reduce in another order
    from one call to the next."""
    n = p.shape[-1]
    parts = 2 + (time.perf_counter_ns() >> 10) % 2
    cuts = [n * j // parts for j in range(parts + 1)]
    out = torch.einsum("hqk,khd->qhd", p[..., :cuts[1]], v[:cuts[1]])
    for a, b in zip(cuts[1:], cuts[2:]):
        out = out + torch.einsum("hqk,khd->qhd", p[..., a:b], v[a:b])
    return out


_KEPT: list[torch.Tensor] = []


def _write_keeps_staging(self: RefAttention, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    _KEPT.append(torch.cat([key, value]).float())  # a staging copy nobody frees
    RefAttention.write_kv(self, key, value, kv_cache, metadata)


def _swap_keeps_buffers(self: Any, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                        pairs: torch.Tensor) -> None:
    staged = [raw(c)[:, pairs[:, 0].to(c.device)].clone() for c in src_caches]
    self.__dict__.setdefault("_staging", []).append(staged)  # pinned buffers, one set per call
    for stage, dst in zip(staged, dst_caches):
        for j, d in enumerate(pairs[:, 1].tolist()):
            raw(dst)[:, d] = stage[:, j].to(dst.device)


class _LeakyWorker(Worker):
    """Keeps a per-step record (a tensor of the step's sequence ids) for a profiler that never
    drains it."""

    def run_model(self, batch: Any) -> Any:
        self.__dict__.setdefault("_profile", []).append(
            torch.tensor([s.seq_id for s in batch.seqs]))
        return super().run_model(batch)


# --- capability claims --------------------------------------------------------------------------
def _silently(section: str, name: str, value: Any) -> Any:
    def check_and_update_config(self: RefBackend, config: Any) -> None:
        RefBackend.check_and_update_config(self, config)
        setattr(getattr(config, section), name, value)  # "not supported here; disabling it"
    return check_and_update_config


def _fused_rotary(drop: str) -> Any:
    """A fused rotary + attention path that forgets one attention setting."""
    def forward_rotary(self: RefAttention, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       rotary: Any, kv_cache: torch.Tensor, metadata: AttentionMetadata
                       ) -> torch.Tensor:
        kept = getattr(self, drop)
        setattr(self, drop, None)
        try:
            return RefAttention.forward_rotary(self, qkv, cos, sin, rotary, kv_cache, metadata)
        finally:
            setattr(self, drop, kept)
    return forward_rotary


# --- registered model ops -----------------------------------------------------------------------
def _residual_first_tile_only(x: torch.Tensor, residual: torch.Tensor | None,
                              start: int) -> torch.Tensor:
    return x if residual is None or start > 0 else x + residual


def _whole_vocab_tiles(vocab: int) -> range:
    return range(0, vocab - vocab % VOCAB_TILE or vocab, VOCAB_TILE)  # the tail tile dropped


def _experts_mod_8(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    return experts % 8  # expert ids in 3 bits


def _bitmask_whole_words(vocab: int) -> int:
    return vocab // 32  # the last, partial word never read: its tokens stay allowed


def _heads_assumed_contiguous(x: torch.Tensor) -> torch.Tensor:
    # reads the storage as if rows were packed (a kernel ignoring the input's strides)
    return torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())


NEW_MUTANTS: list[Mutant] = [
    Mutant("kv_heads_mod_4", "query heads map onto KV heads modulo a 4-head tile",
           attention={"kv_head_of": _kv_head_mod_4}, first=("sweep[float32-auto",),
           blind_spot=SHAPES),
    Mutant("decode_grid_of_64", "decodes past the 64th reuse an earlier slot's result",
           attention={"decode": _decode_grid_64}, first=("sweep[float32",), blind_spot=SHAPES),
    Mutant("prefill_causal_bound_tile_4", "prefill rows past 256 take the 4th tile's causal bound",
           attention={"visible": _prefill_causal_tile_4}, first=("sweep[float32",),
           blind_spot=SHAPES),
    Mutant("chunk_at_last_slot", "a chunk starting in a block's last slot misses a context token",
           attention={"context_len": _chunk_at_last_slot}, first=("sweep[float32",),
           blind_spot=SHAPES),
    Mutant("context_capped_at_16k", "decode reads at most 16,384 tokens",
           attention={"gather": _context_16k}, first=("sweep[float32",), blind_spot=SHAPES),
    Mutant("block_ids_int16", "block table entries truncated to 16 bits",
           attention={"table_blocks": _block_ids_int16}, first=("sweep[float32",),
           blind_spot=SHAPES),
    Mutant("long_context_head_64", "contexts past 8k use a kernel built for head size 64",
           attention={"score": _long_context_head_64}, first=("sweep[float32",),
           blind_spot=SHAPES),
    Mutant("fp8_k_scale_ignored", "K stored and read without its per-tensor scale",
           attention={"kv_scales": _k_scale_ignored}, first=("sweep[float32-fp8",),
           blind_spot=VALUES),
    Mutant("fp8_v_scale_for_k", "K scaled by the V scale",
           attention={"kv_scales": _v_scale_for_both}, first=("sweep[float32-fp8",),
           blind_spot=VALUES),
    Mutant("fp8_no_saturation", "values past e4m3's range stored as NaN, not +-448",
           attention={"to_fp8": _fp8_no_saturation}, first=("sweep[float32-fp8",),
           blind_spot=VALUES),
    Mutant("fp8_copy_half_block", "copy/swap of an fp8 cache moves half of each block",
           cache_ops={"move": _fp8_copy_half_block}, first=("cache_sweep[float32-fp8",),
           blind_spot=VALUES),
    Mutant("reduction_order_varies", "P @ V partitions added in the order they finish",
           attention={"combine": _split_order_by_call}, first=("deterministic[",),
           blind_spot=REPETITION),
    Mutant("split_k_by_clock", "split-K partitions (2 or 3) chosen by a clock every call",
           attention={"combine": _split_k_by_clock}, first=("deterministic[",),
           blind_spot=REPETITION),
    Mutant("write_kv_keeps_staging", "write_kv keeps a staging copy of every step's K/V",
           attention={"write_kv": _write_keeps_staging}, first=("memory[",),
           blind_spot=REPETITION),
    Mutant("swap_keeps_buffers", "swap_blocks keeps each call's staging buffers",
           cache_ops={"swap_blocks": _swap_keeps_buffers}, first=("memory[",),
           blind_spot=REPETITION),
    Mutant("worker_keeps_step_records", "the worker keeps a tensor per step forever",
           backend_methods={"worker_cls": lambda self: _LeakyWorker}, engine=True,
           first=("engine:memory",), blind_spot=REPETITION),
    Mutant("chunked_prefill_silently_off", "check_and_update_config turns chunked prefill off",
           backend_methods={"check_and_update_config": _silently(
               "scheduler", "enable_chunked_prefill", False)}, engine=True,
           first=("engine:chunked_prefill",), blind_spot=CLAIMS),
    Mutant("prefix_caching_silently_off", "check_and_update_config turns prefix caching off",
           backend_methods={"check_and_update_config": _silently(
               "cache", "enable_prefix_caching", False)}, engine=True,
           first=("engine:prefix_caching",), blind_spot=CLAIMS),
    Mutant("swap_silently_recomputes", "check_and_update_config turns swap into recompute",
           backend_methods={"check_and_update_config": _silently(
               "scheduler", "preemption_mode", "recompute")}, engine=True,
           first=("engine:swap",), blind_spot=CLAIMS),
    Mutant("fp8_cache_silently_auto", "check_and_update_config stores the KV cache in the model "
           "dtype", backend_methods={"check_and_update_config": _silently(
               "cache", "cache_dtype", "auto")}, engine=True, first=("engine:kv_cache",),
           blind_spot=CLAIMS),
    Mutant("fused_path_drops_window", "the fused rotary+attention path ignores the window",
           attention={"forward_rotary": _fused_rotary("sliding_window")}, engine=True,
           first=("engine:feature[sliding_window",), blind_spot=CLAIMS),
    Mutant("fused_path_drops_soft_cap", "the fused rotary+attention path ignores the soft cap",
           attention={"forward_rotary": _fused_rotary("logits_soft_cap")}, engine=True,
           first=("engine:feature[logits_soft_cap",), blind_spot=CLAIMS),
    Mutant("rms_norm_residual_first_tile", "rows past the first 32 get no residual added",
           ops={"add_residual": staticmethod(_residual_first_tile_only)},
           first=("ops[test_rms_norm",), blind_spot=OPS),
    Mutant("argmax_whole_tiles", "greedy argmax skips the vocabulary's partial last tile",
           ops={"vocab_tiles": staticmethod(_whole_vocab_tiles)},
           first=("ops[test_greedy_logprobs",), blind_spot=OPS),
    Mutant("moe_experts_mod_8", "expert ids kept in 3 bits (more than 8 experts alias)",
           ops={"expert_ids": staticmethod(_experts_mod_8)}, first=("ops[test_fused_moe",),
           blind_spot=OPS),
    Mutant("bitmask_partial_word_skipped", "the bitmask's last, partial word is never applied",
           ops={"words": staticmethod(_bitmask_whole_words)},
           first=("ops[test_apply_token_bitmask",), blind_spot=OPS),
    Mutant("rotary_strides_ignored", "rotary reads a partial-rotary slice as packed rows",
           ops={"load_heads": staticmethod(_heads_assumed_contiguous)},
           first=("ops[test_rotary",), blind_spot=OPS),
]

__all__ = ["BLIND_SPOTS", "NEW_MUTANTS", "RefOps"]
