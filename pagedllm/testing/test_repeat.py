"""Repetition (issue 41, item 2): the same attention step and the same op calls, run twice (and
once more on a fresh implementation and cache), give bitwise-equal results and leave the cache
bitwise equal; memory (live tensors, the device allocator, host RSS) stays flat over many
repeated cache writes, attention steps, block copies and swaps.

Bitwise determinism is the ``deterministic`` capability (``Capabilities.deterministic``,
default True): a backend whose kernels reduce in a run-dependent order (atomics, split-K chosen
at run time) declares it False and these checks are reported NOT DECLARED. Memory must stay flat
on every backend.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.coverage import note
from pagedllm.testing.harness import cache_shape, make_attention, stale_pool, torch_dtype
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec
from pagedllm.testing.resources import Snapshot, assert_flat
from pagedllm.testing.shapes import DECODE, step
from pagedllm.testing.test_ops_sweep import backend_ops

AREA = "determinism and resources"
CAPABILITY_OF = {"test_attention_step_twice_is_bitwise_equal": "deterministic",
                 "test_ops_twice_are_bitwise_equal": "deterministic",
                 "test_cache_ops_and_steps_keep_memory_flat": "memory flat (kernels)"}
ROUNDS = 30  # repetitions between two memory snapshots


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().cpu().contiguous()
    return x.view(torch.uint8) if x.is_floating_point() else x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _step(backend: Backend, caps: Capabilities, dtype: str, device: torch.device
          ) -> tuple[object, PagedBatch, torch.Tensor]:
    """The decode shape class (a prefill and 67 decodes), 2 KV heads x the largest group."""
    bs = caps.preferred_block_size
    group = min(4, caps.max_gqa_group or 4)
    hs = 128 if 128 in caps.head_sizes else sorted(caps.head_sizes)[-1]
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=2 * group,
                          num_kv_heads=2, head_size=hs)
    rng = torch.Generator().manual_seed(4141)
    batch = PagedBatch.random(step(DECODE, caps, bs), num_heads=2 * group, num_kv_heads=2,
                              head_size=hs, block_size=bs, dtype=torch_dtype(dtype),
                              device=device, generator=rng)
    cache = stale_pool(impl, batch.num_blocks, bs, torch_dtype(dtype), device,
                       torch.Generator().manual_seed(7), batch.touched_blocks())
    batch.write_context(impl, cache, device)
    return impl, batch, cache


@pytest.mark.capability("deterministic")
def test_attention_step_twice_is_bitwise_equal(conformance_backend: Backend,
                                               conformance_caps: Capabilities,
                                               conformance_dtype: str,
                                               conformance_device: torch.device) -> None:
    """One step (its cache write included) run twice on the same cache, then on a fresh
    implementation and a fresh, identically filled cache: the same bits every time."""
    dev = conformance_device
    impl, batch, cache = _step(conformance_backend, conformance_caps, conformance_dtype, dev)
    t = batch.query.shape[0]
    first = batch.run(impl, cache, dev, pad_tokens_to=t + 3)
    cache_after = cache.clone()
    second = batch.run(impl, cache, dev, pad_tokens_to=t + 3)
    impl2, batch2, cache2 = _step(conformance_backend, conformance_caps, conformance_dtype, dev)
    third = batch2.run(impl2, cache2, dev, pad_tokens_to=t + 3)
    assert _same_bits(first, second), (
        f"the same step twice gave different bits (max |diff| "
        f"{(first.double() - second.double()).abs().max().item():.3g}); declare "
        "deterministic=False if the kernels cannot promise it")
    assert _same_bits(cache_after, cache), "writing the same K/V twice changed the cache's bits"
    assert _same_bits(first, third), "a fresh implementation and cache gave different bits"


@pytest.mark.capability("deterministic")
def test_ops_twice_are_bitwise_equal(conformance_backend: Backend, conformance_dtype: str,
                                     conformance_device: torch.device) -> None:
    """Each registered op called twice on the same inputs (at 37 rows and real widths). The
    inputs are made under inference_mode too, as the engine's are (XLA refuses in-place updates
    of ordinary tensors there)."""
    with torch.inference_mode():
        _ops_twice(conformance_backend, conformance_dtype, conformance_device)


def _ops_twice(conformance_backend: Backend, conformance_dtype: str,
               conformance_device: torch.device) -> None:
    dt, dev = torch_dtype(conformance_dtype), conformance_device
    rng = torch.Generator().manual_seed(41)
    ops = backend_ops(conformance_backend)
    x = torch.randn(37, 2880, generator=rng).to(dt).to(dev)
    w = torch.randn(2880, generator=rng).to(dt).to(dev)
    qk = torch.randn(37, 10, 128, generator=rng).to(dt).to(dev)
    cos, sin = (torch.rand(37, 128, generator=rng).to(dt).to(dev) for _ in range(2))
    layer = nn.Module()
    layer.weight = nn.Parameter((torch.randn(1000, 2880, generator=rng) / 60).to(dt).to(dev),
                                requires_grad=False)
    layer.bias = nn.Parameter(torch.randn(1000, generator=rng).to(dt).to(dev), requires_grad=False)
    ops.linear_prepare(layer)
    logits = (torch.randn(37, 32000, generator=rng) * 4).to(dev)
    moe = [torch.randn(*s, generator=rng).to(dt).to(dev) for s in
           ((37, 96), (16, 112, 96), (16, 96, 56), (37, 16))]
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, w, 1e-6, x)[0],
        "gemma_rms_norm": lambda: ops.gemma_rms_norm(x, w, 1e-6, None)[0],
        "rotary": lambda: ops.rotary(qk, cos, sin),
        "silu_and_mul": lambda: ops.silu_and_mul(x),
        "gelu_tanh_and_mul": lambda: ops.gelu_tanh_and_mul(x),
        "linear": lambda: ops.linear(x, layer),
        "greedy_logprobs": lambda: torch.cat([t.double() for t in ops.greedy_logprobs(logits)]),
        "fused_moe": lambda: ops.fused_moe(*moe, 4, True),
    }
    for name, call in calls.items():
        a, b = call(), call()
        assert _same_bits(a, b), f"{name}: two calls on the same inputs gave different bits"
    note(ops=sorted(calls))


def test_cache_ops_and_steps_keep_memory_flat(conformance_backend: Backend,
                                              conformance_caps: Capabilities,
                                              conformance_device: torch.device,
                                              conformance_sweep_mode: str) -> None:
    """``ROUNDS`` rounds of (write_kv + attention step, copy_blocks, swap out and in where
    declared) after a warm-up, twice: the second batch of rounds may not hold more memory than
    the first did. A sampled run (the ``values`` sweep, for slow backends) takes a fifth of the
    rounds of a smaller step: live tensors are still counted exactly, host RSS only sees larger
    leaks. Everything is made under inference_mode, as the engine's caches are."""
    with torch.inference_mode():
        _memory_rounds(conformance_backend, conformance_caps, conformance_device,
                       conformance_sweep_mode)


def _memory_rounds(conformance_backend: Backend, conformance_caps: Capabilities,
                   conformance_device: torch.device, conformance_sweep_mode: str) -> None:
    caps, dev, b = conformance_caps, conformance_device, conformance_backend
    sampled = conformance_sweep_mode == "values"
    rounds = ROUNDS // 5 if sampled else ROUNDS
    dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    bs = caps.preferred_block_size
    impl = make_attention(b, dtype=dtype, block_size=bs, num_heads=8, num_kv_heads=4,
                          head_size=128 if 128 in caps.head_sizes else sorted(caps.head_sizes)[-1])
    # a leak of one step's K/V: ~1 MiB a round at 256 tokens (RSS sees it over 30 rounds)
    specs = [SeqSpec(0, 32 if sampled else 256), SeqSpec(bs + 1, 1), SeqSpec(3 * bs, 1)]
    batch = PagedBatch.random(specs, num_heads=8, num_kv_heads=4, head_size=impl.head_size,
                              block_size=bs, dtype=torch_dtype(dtype), device=dev,
                              generator=torch.Generator().manual_seed(3), spare_blocks=8)
    cache = stale_pool(impl, batch.num_blocks, bs, torch_dtype(dtype), dev,
                       torch.Generator().manual_seed(4), batch.touched_blocks())
    caches = [cache, cache.clone()]
    host = [torch.zeros(cache_shape(impl, 8, bs), dtype=cache.dtype) for _ in caches]
    if b.host_pin_memory():
        host = [h.pin_memory() for h in host]
    ops = b.cache_ops()
    spare = list(range(batch.num_blocks - 8, batch.num_blocks))
    copy_pairs = torch.tensor([[spare[0], spare[1]], [spare[2], spare[3]]], device=dev)
    out_pairs = torch.tensor([[spare[4], 0], [spare[5], 3]])
    in_pairs = torch.tensor([[0, spare[6]], [3, spare[7]]])

    def round_() -> None:
        batch.run(impl, cache, dev, pad_tokens_to=batch.query.shape[0] + 5)
        ops.copy_blocks(caches, copy_pairs)
        if caps.swap:
            ops.swap_blocks(caches, host, out_pairs)
            ops.swap_blocks(host, caches, in_pairs)
        b.synchronize()

    for _ in range(3):
        round_()
    first = Snapshot.take(dev)
    for _ in range(rounds):
        round_()
    middle = Snapshot.take(dev)
    for _ in range(rounds):
        round_()
    last = Snapshot.take(dev)
    assert_flat(first, middle, f"{rounds} rounds after the warm-up", rss_slack=64 << 20)
    growth = assert_flat(middle, last, f"{rounds} more rounds")
    note(rounds=2 * rounds, tokens_per_step=batch.query.shape[0], swap=caps.swap,
         rss_growth_mib=round(growth["rss_bytes"] / (1 << 20), 1))
