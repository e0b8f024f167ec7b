"""Block export / import between the device KV cache and host staging buffers (plugin API 2.2,
``Capabilities.kv_export``): what KV offload tiers and KV connectors move blocks with.

For every declared dtype, block size and KV-cache dtype, with the backend's own cache layout
(its attention's ``kv_cache_shape``): blocks exported from a pool of stale values land in the
staging buffer exactly as the reference lays them out (row i, layer l = the bytes of
``cache.select(1, block_ids[i])``), and imported into other blocks of a poisoned pool they are
bit-exact copies with every other block untouched; the transfer is complete once ``wait()``
returns, and an import followed by ``fence()`` is visible to the next device work. With
``Capabilities.kv_export_layer_major`` (2.3): the same through layer-major staging views, and an
import fenced with ``fence_layers()`` is what the backend's attention reads, layer by layer, with
every layer's wait consumed by it.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract import layer_fences
from pagedllm.contract.backend import Backend
from pagedllm.reference import kv_transfer as reference
from pagedllm.testing.coverage import note
from pagedllm.testing.harness import KV_CACHE_TORCH_DTYPES, cache_shape, make_attention, torch_dtype
from pagedllm.testing.harness import stale_pool, tolerance
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

AREA = "KV block export/import"
CAPABILITY_OF = {"test_export_import_round_trip": "kv export/import",
                 "test_export_captures_blocks_before_later_writes": "kv export/import",
                 "test_layer_major_import_is_read_layer_by_layer": "kv export/import"}
NUM_LAYERS = 3
NUM_BLOCKS = 24


def _kv_dtypes(backend: Backend) -> list[str]:
    """The declared KV-cache dtypes the run's attention takes (an explicit --attention-backend
    may refuse one the backend declares, e.g. the cpu backend's ipex attention and fp8)."""
    from pagedllm.testing.plugin import chosen_attention_supports
    from pagedllm.testing.sweep import KV_CACHE_DTYPE

    declared = getattr(backend.capabilities, "kv_cache_dtypes", None) or ("auto",)
    return [kv for kv in dict.fromkeys(declared)
            if kv == "auto" or chosen_attention_supports(type(backend), KV_CACHE_DTYPE + kv)]


def _pool(backend: Backend, dtype: str, kv: str, bs: int, device: torch.device,
          rng: torch.Generator) -> tuple[list[torch.Tensor], torch.dtype]:
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=4, num_kv_heads=2,
                          head_size=64, kv_cache_dtype=None if kv == "auto" else kv)
    cdt = KV_CACHE_TORCH_DTYPES.get(kv, torch_dtype(dtype))
    blocks = list(range(NUM_BLOCKS))
    caches = [stale_pool(impl, NUM_BLOCKS, bs, cdt, device, rng, blocks)
              for _ in range(NUM_LAYERS)]
    assert tuple(caches[0].shape) == cache_shape(impl, NUM_BLOCKS, bs)
    return caches, cdt


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.cpu().contiguous()
    return x if x.dtype == torch.uint8 else x.view(torch.uint8)


def _staging(backend: Backend, n: int, caches: list[torch.Tensor]) -> torch.Tensor:
    nbytes = backend.cache_ops().block_nbytes(caches[0])
    staging = torch.full((n, len(caches), nbytes), 0xA5, dtype=torch.uint8)
    return staging.pin_memory() if backend.host_pin_memory() else staging


@pytest.mark.capability("kv_export")
def test_export_import_round_trip(conformance_backend: Backend, conformance_dtype: str,
                                  conformance_sweep_block_size: int,
                                  conformance_device: torch.device) -> None:
    b, bs, dev = conformance_backend, conformance_sweep_block_size, conformance_device
    ops = b.cache_ops()
    for kv in _kv_dtypes(b):
        rng = torch.Generator().manual_seed(bs * 7 + len(kv))
        caches, cdt = _pool(b, conformance_dtype, kv, bs, dev, rng)
        assert ops.block_nbytes(caches[0]) == reference.block_nbytes(caches[0])
        # scattered ids, out of order, the pool's last block included
        src = torch.tensor([NUM_BLOCKS - 1, 3, 0, 11, 7], dtype=torch.int64)
        staging = _staging(b, len(src), caches)
        ops.export_blocks(caches, src, staging).wait()
        want = torch.empty_like(staging)
        reference.export_blocks([c.cpu() for c in caches], src, want)
        assert torch.equal(staging, want), (
            f"{kv} cache, block size {bs}: the staging buffer differs from the reference layout "
            "(row i, layer l = the bytes of cache.select(1, block_ids[i]))")
        before = [_bits(c) for c in caches]
        dst = torch.tensor([2, 20, 5, 13, 9], dtype=torch.int64)
        for c in caches:  # poison the destinations: a byte the import forgets shows
            c.view(torch.uint8).index_fill_(1, dst.to(dev), 0x7F)
        transfer = ops.import_blocks(staging, caches, dst)
        transfer.fence()
        transfer.wait()
        b.synchronize()
        assert transfer.done()
        for layer, (c, old) in enumerate(zip(caches, before)):
            got, expect = _bits(c), old.clone()
            expect[:, dst] = old[:, src]
            assert torch.equal(got, expect), (
                f"layer {layer}, {kv} cache, block size {bs}: after export + import the "
                "destination blocks are not bit-exact copies, or another block changed")
        empty = torch.empty((0,), dtype=torch.int64)
        ops.export_blocks(caches, empty, _staging(b, 0, caches)).wait()
        ops.import_blocks(_staging(b, 0, caches), caches, empty).wait()
        note(kv_cache=kv, block_size=bs, blocks=len(src), layers=NUM_LAYERS,
             dtype=str(cdt).removeprefix("torch."))


@pytest.mark.capability("kv_export")
def test_export_captures_blocks_before_later_writes(conformance_backend: Backend,
                                                    conformance_dtype: str,
                                                    conformance_device: torch.device) -> None:
    """An exported block may be overwritten by the next step right after the call (an evicted
    block is reused at once): the staging buffer still holds the content as of the call."""
    b, dev = conformance_backend, conformance_device
    bs = b.capabilities.preferred_block_size
    caches, _ = _pool(b, conformance_dtype, "auto", bs, dev, torch.Generator().manual_seed(5))
    ids = torch.tensor([4, 9], dtype=torch.int64)
    expect = torch.empty((2, NUM_LAYERS, reference.block_nbytes(caches[0])), dtype=torch.uint8)
    reference.export_blocks([c.cpu() for c in caches], ids, expect)
    staging = _staging(b, 2, caches)
    transfer = b.cache_ops().export_blocks(caches, ids, staging)
    for c in caches:  # device work queued after the call
        c.index_fill_(1, ids.to(dev), 0)
    transfer.wait()
    b.synchronize()
    assert torch.equal(staging, expect), (
        "export_blocks: blocks overwritten after the call reached the staging buffer; the "
        "export must capture them as of the call")


def _layer_major(backend: Backend, n: int, caches: list[torch.Tensor]) -> torch.Tensor:
    """A staging view [n, layers, bytes] of a [layers, n, bytes] tensor (the host tier's
    layer-major pool hands out such views): each layer's plane contiguous, rows not."""
    nbytes = backend.cache_ops().block_nbytes(caches[0])
    planes = torch.full((len(caches), n, nbytes), 0xA5, dtype=torch.uint8)
    return (planes.pin_memory() if backend.host_pin_memory() else planes).transpose(0, 1)


@pytest.mark.capability("kv_export_layer_major")
def test_layer_major_import_is_read_layer_by_layer(conformance_backend: Backend,
                                                   conformance_dtype: str,
                                                   conformance_device: torch.device) -> None:
    """Blocks of cached context exported into a layer-major view are the reference's bytes;
    poisoned, imported back and fenced with ``fence_layers()`` (no host wait), each layer's
    attention over them gives the float64 reference, and every layer's wait was run by it (a
    wait left pending means the attention read the layer without waiting for its copy)."""
    b, dev, dtype = conformance_backend, conformance_device, conformance_dtype
    bs = b.capabilities.preferred_block_size
    impl = make_attention(b, dtype=dtype, block_size=bs, num_heads=4, num_kv_heads=2,
                          head_size=64)
    rng = torch.Generator().manual_seed(23)
    batch = PagedBatch.random([SeqSpec(6 * bs, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                              block_size=bs, dtype=torch_dtype(dtype), device=dev, generator=rng)
    caches = [stale_pool(impl, batch.num_blocks, bs, torch_dtype(dtype), dev, rng,
                         list(range(batch.num_blocks))) for _ in range(NUM_LAYERS)]
    for cache in caches:
        batch.write_context(impl, cache, dev)
    ids = torch.tensor(batch.block_tables[0][:6], dtype=torch.int64)
    ops = b.cache_ops()
    staging = _layer_major(b, len(ids), caches)
    ops.export_blocks(caches, ids, staging).wait()
    want = torch.empty(staging.shape, dtype=torch.uint8)
    reference.export_blocks([c.cpu() for c in caches], ids, want)
    assert torch.equal(staging, want), (
        "export_blocks into a layer-major staging view: the bytes differ from the reference "
        "layout (row i, layer l = the bytes of cache.select(1, block_ids[i]))")
    b.synchronize()
    for c in caches:  # poison the context: a layer read before its copy lands shows
        c.view(torch.uint8).index_fill_(1, ids.to(dev), 0x7F)
    layer_fences.consume_all()  # nothing left over from an earlier test
    transfer = ops.import_blocks(staging, caches, ids)
    transfer.fence_layers()
    ref = batch.reference(impl.scale)
    for layer, cache in enumerate(caches):
        out = batch.run(impl, cache, dev)
        torch.testing.assert_close(out.cpu().double(), ref, **tolerance(dtype), msg=lambda m: (
            f"layer {layer}: attention over blocks imported from a layer-major view and fenced "
            f"with fence_layers() differs from the reference: {m}"))
    assert layer_fences.pending() == 0, (
        f"{layer_fences.pending()} layers' waits were never run: the backend's attention must "
        "call layer_fences.consume(kv_cache) (AttentionImpl.attend does) before reading a layer "
        "whose import was fenced with fence_layers()")
    transfer.wait()
    note(block_size=bs, blocks=len(ids), layers=NUM_LAYERS, dtype=dtype)
