"""KV-cache writes, block copy (copy-on-write) and swap, checked element by element; copy and swap
also swept over the declared space (KV-cache dtypes, block sizes, large pools, many pairs).

Layout-agnostic: the contract fixes only that dim 1 of a layer's cache indexes blocks, so writes
are checked per block (the multiset of values in a block must be exactly the K and V of the
tokens mapped to it; every other element must stay untouched) and copies/swaps per dim-1 slice.
Destinations are poisoned with NaN first, so an element a call forgets shows up.
"""
from __future__ import annotations

import pytest
import torch

from typing import Any

from pagedllm.contract.backend import Backend
from pagedllm.testing.coverage import note
from pagedllm.testing.harness import (KV_CACHE_TORCH_DTYPES, cache_shape, make_attention,
                                      nan_cache, stale_pool, torch_dtype)
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec
from pagedllm.testing.shapes import pool_blocks
from pagedllm.testing.space import Space

AREA = "cache write/copy/swap"
CAPABILITY_OF = {"test_write_kv_fills_exactly_the_mapped_slots": "cache write",
                 "test_copy_blocks": "block copy"}
NUM_LAYERS = 3


def test_write_kv_fills_exactly_the_mapped_slots(conformance_backend: Backend,
                                                 conformance_dtype: str,
                                                 conformance_block_size: int,
                                                 conformance_device: torch.device,
                                                 conformance_rng: torch.Generator) -> None:
    bs = conformance_block_size
    impl = make_attention(conformance_backend, dtype=conformance_dtype, block_size=bs,
                          num_heads=4, num_kv_heads=2, head_size=64)
    # a fresh prompt, a chunk ending mid-block, decodes at and past a block boundary
    specs = [SeqSpec(0, bs + 5), SeqSpec(max(1, bs - 2), 4), SeqSpec(2 * bs, 1), SeqSpec(5, 1)]
    batch = PagedBatch.random(specs, num_heads=4, num_kv_heads=2, head_size=64, block_size=bs,
                              dtype=torch_dtype(conformance_dtype), device=conformance_device,
                              generator=conformance_rng)
    meta = batch.step_metadata(conformance_device, pad_tokens_to=batch.query.shape[0] + 3)
    t = meta.slot_mapping.shape[0]
    pad = t - batch.key.shape[0]  # rows with slot -1 must write nothing
    key = torch.cat([batch.key, batch.key[:pad] + 100.0])
    value = torch.cat([batch.value, batch.value[:pad] + 100.0])
    cache = nan_cache(cache_shape(impl, batch.num_blocks, bs), conformance_dtype,
                      conformance_device)

    impl.write_kv(key, value, cache, meta)

    cache = cache.cpu()
    slots = meta.slot_mapping.cpu()
    real = slots >= 0
    written = int((~cache.isnan()).sum())
    expected_count = 2 * int(real.sum()) * key[0].numel()
    assert written == expected_count, (
        f"write_kv wrote {written} elements, expected {expected_count} (K and V of "
        f"{int(real.sum())} tokens; {pad} pad rows with slot -1 must write nothing)")
    for block in range(batch.num_blocks):
        got = cache.select(1, block)
        got = got[~got.isnan()].float().sort().values
        rows = real & (slots // bs == block)
        want = torch.cat([key.cpu()[rows].flatten(), value.cpu()[rows].flatten()])
        want = want.to(cache.dtype).float().sort().values
        assert torch.equal(got, want), (
            f"block {block}: the values written are not exactly the K/V of the "
            f"{int(rows.sum())} tokens mapped to it")


def _random_caches(shape: tuple[int, ...], dtype: str, device: torch.device,
                   rng: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=rng).to(torch_dtype(dtype)).to(device)
            for _ in range(NUM_LAYERS)]


def _layer_shape(backend: Backend, dtype: str, num_blocks: int, bs: int) -> tuple[int, ...]:
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=4, num_kv_heads=2,
                          head_size=64)
    return cache_shape(impl, num_blocks, bs)


def test_copy_blocks(conformance_backend: Backend, conformance_dtype: str,
                     conformance_block_size: int, conformance_device: torch.device,
                     conformance_rng: torch.Generator) -> None:
    shape = _layer_shape(conformance_backend, conformance_dtype, 10, conformance_block_size)
    caches = _random_caches(shape, conformance_dtype, conformance_device, conformance_rng)
    # copy-on-write pairs: one source forked twice, destinations distinct and not sources
    pairs = torch.tensor([[1, 2], [4, 5], [4, 9], [7, 0]], dtype=torch.int64)
    expected = []
    for cache in caches:
        ref = cache.cpu().clone()
        ref[:, pairs[:, 1]] = cache.cpu()[:, pairs[:, 0]]
        expected.append(ref)
        cache.index_fill_(1, pairs[:, 1].to(conformance_device), float("nan"))
    ops = conformance_backend.cache_ops()

    ops.copy_blocks(caches, pairs.to(conformance_device))
    ops.copy_blocks(caches, torch.empty((0, 2), dtype=torch.int64, device=conformance_device))

    for layer, (cache, ref) in enumerate(zip(caches, expected)):
        got = cache.cpu()
        assert not got.isnan().any(), f"layer {layer}: a destination block was not fully copied"
        assert torch.equal(got, ref), f"layer {layer}: copy_blocks differs from the reference"


@pytest.mark.capability("swap")
def test_swap_out_and_in(conformance_backend: Backend, conformance_dtype: str,
                         conformance_block_size: int, conformance_device: torch.device,
                         conformance_rng: torch.Generator) -> None:
    bs = conformance_block_size
    device_caches = _random_caches(_layer_shape(conformance_backend, conformance_dtype, 10, bs),
                                   conformance_dtype, conformance_device, conformance_rng)
    original = [c.cpu().clone() for c in device_caches]
    host_shape = _layer_shape(conformance_backend, conformance_dtype, 4, bs)
    host_caches = [nan_cache(host_shape, conformance_dtype, torch.device("cpu"))
                   for _ in range(NUM_LAYERS)]
    if conformance_backend.host_pin_memory():
        host_caches = [c.pin_memory() for c in host_caches]
    ops = conformance_backend.cache_ops()

    out_pairs = torch.tensor([[3, 0], [5, 2], [0, 1]], dtype=torch.int64)
    ops.swap_blocks(device_caches, host_caches, out_pairs)
    conformance_backend.synchronize()
    for layer, (host, orig) in enumerate(zip(host_caches, original)):
        assert torch.equal(host[:, out_pairs[:, 1]], orig[:, out_pairs[:, 0]]), (
            f"layer {layer}: swap-out did not copy the device blocks to the host blocks")
        assert host[:, 3].isnan().all(), f"layer {layer}: swap-out wrote an unmapped host block"

    in_pairs = torch.tensor([[0, 7], [2, 8], [1, 9]], dtype=torch.int64)
    for cache in device_caches:
        cache.index_fill_(1, in_pairs[:, 1].to(conformance_device), float("nan"))
    ops.swap_blocks(host_caches, device_caches, in_pairs)
    conformance_backend.synchronize()
    for layer, (cache, orig) in enumerate(zip(device_caches, original)):
        expected = orig.clone()
        expected[:, [7, 8, 9]] = orig[:, [3, 5, 0]]
        assert torch.equal(cache.cpu(), expected), (
            f"layer {layer}: after swap-in the device cache differs from the reference")


# --- the declared space (issue 41): fp8 caches, large pools, many pairs -------------------------
def _cache_space(caps: Any, features: Any = None, kv_cache_dtypes: Any = None) -> Space:
    kv = caps.kv_cache_dtypes if kv_cache_dtypes is None else kv_cache_dtypes
    return Space({"dtype": list(caps.dtypes), "kv_cache": list(dict.fromkeys(kv or ("auto",))),
                  "block_size": sorted(caps.block_sizes), "pool": ["small", "large"],
                  "pairs": [1, WIDE_PAIRS]})


SPACES = {"test_copy_and_swap_sweep": _cache_space}
CAPABILITY_OF["test_copy_and_swap_sweep"] = "block copy/swap sweep"
WIDE_PAIRS = 67  # past 16, 32 and 64 pairs per call


def _poison(cache: torch.Tensor, blocks: torch.Tensor) -> None:
    """NaN into ``blocks`` (0x7F bytes for an fp8 cache: e4m3's NaN)."""
    if cache.dtype in KV_CACHE_TORCH_DTYPES.values():
        cache.view(torch.uint8).index_fill_(1, blocks.to(cache.device), 0x7F)
    else:
        cache.index_fill_(1, blocks.to(cache.device), float("nan"))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.uint8)


def test_copy_and_swap_sweep(conformance_backend: Backend, conformance_caps: Any,
                             sweep_case: dict, conformance_device: torch.device) -> None:
    """copy_blocks and (where declared) swap_blocks over 3 layers, in the KV-cache dtype (fp8
    caches move bits), between blocks at the top of a large pool (ids past 32,767 where memory
    allows) or a small one, 1 or 67 pairs a call: destinations poisoned first, every moved block
    bit-exact, their neighbours untouched."""
    case, dev, b = sweep_case, conformance_device, conformance_backend
    bs, kv = case["block_size"], case["kv_cache"]
    impl = make_attention(b, dtype=case["dtype"], block_size=bs, num_heads=4, num_kv_heads=2,
                          head_size=64, kv_cache_dtype=None if kv == "auto" else kv)
    cdt = KV_CACHE_TORCH_DTYPES.get(kv, torch_dtype(case["dtype"]))
    n = case["pairs"]
    block_bytes = (torch.Size(cache_shape(impl, 1, bs)).numel()
                   * torch.tensor([], dtype=cdt).element_size())
    num_blocks = (pool_blocks("decode", 2 * n + 8, block_bytes * NUM_LAYERS, dev.type == "cpu")
                  if case["pool"] == "large" else 2 * n + 8)
    rng = torch.Generator().manual_seed(bs * 1000 + n)
    region = num_blocks - (2 * n + 8) + torch.randperm(2 * n + 8, generator=rng)
    src, dst, spare = region[:n], region[n:2 * n], region[2 * n:]
    blocks = torch.cat([src, dst, spare])
    caches = [stale_pool(impl, num_blocks, bs, cdt, dev, rng, blocks.tolist())
              for _ in range(NUM_LAYERS)]
    before = [_bits(c[:, blocks.to(dev)]) for c in caches]
    for c in caches:
        _poison(c, dst)
    ops = b.cache_ops()
    ops.copy_blocks(caches, torch.stack([src, dst], 1).to(dev))
    b.synchronize()
    for layer, c in enumerate(caches):
        got = _bits(c[:, blocks.to(dev)])
        want = before[layer].clone()
        want[:, n:2 * n] = before[layer][:, :n]  # destinations = sources; the rest unchanged
        assert torch.equal(got, want), (
            f"layer {layer}: copy_blocks of {n} pairs (block ids up to {int(blocks.max())} of "
            f"{num_blocks}, {kv} cache) differs from the bit-exact reference")
    note(pairs=n, max_block_id=int(blocks.max()), pool_blocks=num_blocks, kv_cache=kv,
         block_size=bs)
    if not conformance_caps.swap:
        return
    host = [torch.zeros(cache_shape(impl, n + 2, bs), dtype=cdt) for _ in caches]
    if b.host_pin_memory():
        host = [h.pin_memory() for h in host]
    out_pairs = torch.stack([src, torch.arange(n) + 1], 1)  # host block 0 and n + 1 stay zero
    ops.swap_blocks(caches, host, out_pairs)
    b.synchronize()
    for c in caches:
        _poison(c, spare[:min(n, len(spare))])
    back = spare[:min(n, len(spare))]
    ops.swap_blocks(host, caches, torch.stack([torch.arange(len(back)) + 1, back], 1))
    b.synchronize()
    for layer, (c, h) in enumerate(zip(caches, host)):
        assert torch.equal(_bits(h[:, 1:n + 1]), _bits(before[layer][:, :n].view(cdt))), (
            f"layer {layer}: swap-out of {n} blocks ({kv} cache) differs bit for bit")
        assert not _bits(h[:, 0]).any() and not _bits(h[:, n + 1]).any(), (
            f"layer {layer}: swap-out wrote a host block it was not given")
        assert torch.equal(_bits(c[:, back.to(dev)]), _bits(h[:, 1:len(back) + 1])), (
            f"layer {layer}: swap-in of {len(back)} blocks ({kv} cache) differs bit for bit")
