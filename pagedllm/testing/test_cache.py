"""KV-cache writes, block copy (copy-on-write) and swap, checked element by element.

Layout-agnostic: the contract fixes only that dim 1 of a layer's cache indexes blocks, so writes
are checked per block (the multiset of values in a block must be exactly the K and V of the
tokens mapped to it; every other element must stay untouched) and copies/swaps per dim-1 slice.
Destinations are poisoned with NaN first, so an element a call forgets shows up.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.testing.harness import cache_shape, make_attention, nan_cache, torch_dtype
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

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
