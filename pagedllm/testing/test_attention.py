"""Paged attention against a float64 reference: prefill (with and without cached context),
decode, mixed batches and pad rows, across GQA ratios, head sizes, block sizes and dtypes.

Every case draws fresh random Q/K/V, scatters sequences over a shuffled block pool whose unused
slots hold large stale values, writes the cached context with the backend's ``write_kv`` and
runs the backend's ``forward`` on metadata built by the engine's model runner.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.harness import garbage_cache, make_attention, torch_dtype
from pagedllm.testing.metrics import assert_close
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec

AREA = "attention"
CAPABILITY_OF = {"test_decode": "decode", "test_prefill_without_context": "prefill",
                 "test_mixed_prefill_and_decode": "mixed prefill+decode",
                 "test_pad_rows_change_nothing": "pad rows"}
# (num_heads, num_kv_heads): grouped-query (4 per KV head), multi-query; multi-head and the
# other groups are swept by test_limits.test_gqa_group
HEADS = [(8, 2), (8, 1)]
HEAD_SIZES = [64, 128]


def _heads_id(h: tuple[int, int]) -> str:
    return f"h{h[0]}kv{h[1]}"


def run_case(backend: Backend, specs: list[SeqSpec], *, dtype: str, block_size: int,
             num_heads: int, num_kv_heads: int, head_size: int, device: torch.device,
             rng: torch.Generator, pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs one step on a fresh cache; returns (backend output of the real rows, reference)."""
    impl: AttentionImpl = make_attention(backend, dtype=dtype, block_size=block_size,
                                         num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_size=head_size)
    batch = PagedBatch.random(specs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, block_size=block_size,
                              dtype=torch_dtype(dtype), device=device, generator=rng)
    cache = garbage_cache(impl, batch.num_blocks, block_size, dtype, device, rng)
    batch.write_context(impl, cache, device)
    t = batch.query.shape[0]
    out = batch.run(impl, cache, device, pad_tokens_to=t + pad_rows if pad_rows else 0)
    return out[:t].cpu(), batch.reference(impl.scale)


def assert_matches(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    assert_close(got, ref, dtype, what)  # records max error / NMSE for the report


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=_heads_id)
def test_decode(conformance_backend: Backend, conformance_dtype: str,
                conformance_block_size: int, heads: tuple[int, int], head_size: int,
                conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    bs = conformance_block_size
    seq_lens = [1, bs, bs + 1, 2 * bs + 5, 3 * bs - 1]  # first token, full block, just past, ...
    specs = [SeqSpec(n - 1, 1) for n in seq_lens]
    got, ref = run_case(conformance_backend, specs, dtype=conformance_dtype, block_size=bs,
                        num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                        device=conformance_device, rng=conformance_rng)
    assert_matches(got, ref, conformance_dtype, f"decode, seq lens {seq_lens}")


def test_prefill_without_context(conformance_backend: Backend, conformance_dtype: str,
                                 conformance_block_size: int, conformance_device: torch.device,
                                 conformance_rng: torch.Generator) -> None:
    bs = conformance_block_size
    specs = [SeqSpec(0, n) for n in (17, 2, bs + 1)]
    got, ref = run_case(conformance_backend, specs, dtype=conformance_dtype, block_size=bs,
                        num_heads=8, num_kv_heads=2, head_size=64, device=conformance_device,
                        rng=conformance_rng)
    assert_matches(got, ref, conformance_dtype, "prefill of fresh prompts")


@pytest.mark.capability("cached_context")
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=_heads_id)
def test_prefill_with_cached_context(conformance_backend: Backend, conformance_dtype: str,
                                     conformance_block_size: int, heads: tuple[int, int],
                                     head_size: int, conformance_device: torch.device,
                                     conformance_rng: torch.Generator) -> None:
    """Prefix-cache hits and later chunks: queries start after tokens already in the cache."""
    bs = conformance_block_size
    specs = [SeqSpec(bs, 3), SeqSpec(2 * bs + 3, bs + 2), SeqSpec(5, 9), SeqSpec(0, 6)]
    got, ref = run_case(conformance_backend, specs, dtype=conformance_dtype, block_size=bs,
                        num_heads=heads[0], num_kv_heads=heads[1], head_size=head_size,
                        device=conformance_device, rng=conformance_rng)
    assert_matches(got, ref, conformance_dtype,
                   f"prefill over cached context, (context, query) lens "
                   f"{[(s.context_len, s.query_len) for s in specs]}")


def _mixed_specs(caps: Capabilities, bs: int) -> list[SeqSpec]:
    ctx = bs + 1 if caps.prefix_caching or caps.chunked_prefill else 0
    return [SeqSpec(0, 7), SeqSpec(ctx, 4), SeqSpec(bs, 1), SeqSpec(3, 1), SeqSpec(0, 1)]


def test_mixed_prefill_and_decode(conformance_backend: Backend, conformance_caps: Capabilities,
                                  conformance_dtype: str, conformance_block_size: int,
                                  conformance_device: torch.device,
                                  conformance_rng: torch.Generator) -> None:
    specs = _mixed_specs(conformance_caps, conformance_block_size)
    got, ref = run_case(conformance_backend, specs, dtype=conformance_dtype,
                        block_size=conformance_block_size, num_heads=8, num_kv_heads=2,
                        head_size=64, device=conformance_device, rng=conformance_rng)
    assert_matches(got, ref, conformance_dtype, "prefills and decodes in one step")


def test_pad_rows_change_nothing(conformance_backend: Backend, conformance_caps: Capabilities,
                                 conformance_dtype: str, conformance_device: torch.device
                                 ) -> None:
    """Rows past the real tokens (slot -1, as padded and graph-captured steps send them) must
    neither write the cache nor change the real rows."""
    bs = conformance_caps.preferred_block_size
    specs = _mixed_specs(conformance_caps, bs)
    kwargs = dict(dtype=conformance_dtype, block_size=bs, num_heads=8, num_kv_heads=2,
                  head_size=64, device=conformance_device)
    plain, ref = run_case(conformance_backend, specs, rng=torch.Generator().manual_seed(7),
                          **kwargs)
    padded, _ = run_case(conformance_backend, specs, rng=torch.Generator().manual_seed(7),
                         pad_rows=5, **kwargs)
    assert_matches(padded, ref, conformance_dtype, "real rows of a padded step")
    assert_matches(plain, ref, conformance_dtype, "the same step unpadded")
