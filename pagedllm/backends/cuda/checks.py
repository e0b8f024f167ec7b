"""Argument checks for the csrc/ kernels, done in Python before the call.

The C++ binding repeats these checks (TORCH_CHECK), but on the first H200 run a failing C++ check
crashed the process instead of raising, so bad input is rejected here with a clear error first.
"""
from __future__ import annotations

import torch


HEAD_SIZES = (64, 80, 96, 112, 128, 256)
BLOCK_SIZES = (16, 32)


class KernelArgumentError(ValueError, RuntimeError):
    """A kernel argument has the wrong device, dtype or shape."""


def _fail(name: str, what: str) -> None:
    raise KernelArgumentError(f"{name} {what}")


def check_float(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        _fail(name, f"must be float32, float16 or bfloat16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        _fail(name, f"must have dtype {dtype} like the other operands, got {t.dtype}")


def check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        _fail(name, f"is on {t.device} but the operands are on {device} (must be a CUDA tensor)")


def check_int(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.dtype != dtype:
        _fail(name, f"must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        _fail(name, f"must have shape {list(shape)}, got {list(t.shape)}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, kv_heads: int,
                     head_size: int, dtype: torch.dtype, device: torch.device) -> None:
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_device(c, name, device)
        check_float(c, name, dtype)
        if c.dim() != 4 or c.shape[2] != kv_heads or c.shape[3] != head_size:
            _fail(name, f"must be [num_blocks, block_size, {kv_heads}, {head_size}], got "
                        f"{list(c.shape)}")
        if c.stride(-1) != 1:
            _fail(name, "must be contiguous in its last dimension")
    if key_cache.shape != value_cache.shape:
        _fail("value_cache", f"shape {list(value_cache.shape)} differs from key_cache "
                             f"{list(key_cache.shape)}")


def check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    device = key.device
    if device.type != "cuda":
        _fail("key", f"must be a CUDA tensor, got device {device}")
    check_float(key, "key")
    check_device(value, "value", device)
    check_float(value, "value", key.dtype)
    if key.dim() != 3 or value.shape != key.shape:
        _fail("value", f"and key must both be [num_tokens, num_kv_heads, head_size]; got "
                       f"{list(key.shape)} and {list(value.shape)}")
    check_cache_pair(key_cache, value_cache, key.shape[1], key.shape[2], key.dtype, device)
    check_device(slot_mapping, "slot_mapping", device)
    check_int(slot_mapping, "slot_mapping", torch.int64, (key.shape[0],))


def check_paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, num_kv_heads: int, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, block_size: int) -> None:
    device = query.device
    if device.type != "cuda":
        _fail("query", f"must be a CUDA tensor, got device {device}")
    check_float(query, "query")
    if query.dim() != 3:
        _fail("query", f"must be [num_seqs, num_heads, head_size], got {list(query.shape)}")
    num_seqs, num_heads, head_size = query.shape
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        _fail("num_heads", f"={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if head_size not in HEAD_SIZES:
        _fail("head_size", f"{head_size} is not supported; supported: {HEAD_SIZES}")
    if query.stride(-1) != 1:
        _fail("query", "must be contiguous in its last dimension")
    check_device(out, "out", device)
    check_float(out, "out", query.dtype)
    if out.shape != query.shape:
        _fail("out", f"must have the query's shape {list(query.shape)}, got {list(out.shape)}")
    check_cache_pair(key_cache, value_cache, num_kv_heads, head_size, query.dtype, device)
    if block_size not in BLOCK_SIZES or key_cache.shape[1] != block_size:
        _fail("block_size", f"={block_size} must be one of {BLOCK_SIZES} and match key_cache's "
                            f"dim 1 ({key_cache.shape[1]})")
    check_device(block_tables, "block_tables", device)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"must be int32 [{num_seqs}, max_blocks], got {block_tables.dtype} "
                              f"{list(block_tables.shape)}")
    check_device(seq_lens, "seq_lens", device)
    check_int(seq_lens, "seq_lens", torch.int32, (num_seqs,))


def check_block_mapping(mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    if mapping.dtype != torch.int64 or mapping.dim() != 2 or mapping.shape[1] != 2:
        _fail("block_mapping", f"must be int64 [num_pairs, 2], got {mapping.dtype} "
                               f"{list(mapping.shape)}")
    if mapping.numel() and mapping.device.type == "cpu":
        if int(mapping[:, 0].min()) < 0 or int(mapping[:, 0].max()) >= num_src:
            _fail("block_mapping", f"source block id out of range [0, {num_src})")
        if int(mapping[:, 1].min()) < 0 or int(mapping[:, 1].max()) >= num_dst:
            _fail("block_mapping", f"destination block id out of range [0, {num_dst})")


def check_layer_caches(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor]) -> None:
    """copy_blocks: one key and one value cache per layer, all alike."""
    if len(key_caches) != len(value_caches):
        _fail("value_caches", f"has {len(value_caches)} value caches for {len(key_caches)} key caches")
    if not key_caches:
        return
    ref = key_caches[0]
    for i, c in enumerate([*key_caches, *value_caches]):
        if c.device != ref.device or c.dtype != ref.dtype:
            _fail(f"caches[{i}]", f"must be on {ref.device} with dtype {ref.dtype}")
        if c.shape != ref.shape or c.stride() != ref.stride():
            _fail(f"caches[{i}]", "must have the same shape and strides as the first key cache "
                                  f"({list(ref.shape)}), got {list(c.shape)}")
