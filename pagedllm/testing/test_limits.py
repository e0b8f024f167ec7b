"""Declared limits, swept: every declared block size, head sizes (80, 96, 112, 256 ...), GQA
groups 1-8, contexts past 4,096 tokens, custom scales, dtype-edge inputs, reordered batches,
and the optional attention features (sliding window, logit soft-capping), each against the
float64 reference. A value the backend does not declare is skipped and reported NOT DECLARED.

Each check mixes prefills (with cached context where the backend declares it) and decodes in
one step with pad rows, so a single call exercises both paths; one dimension varies at a time
(see sweep.py), which keeps the whole sweep within a couple of minutes on two CPU cores.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.harness import (KV_CACHE_TORCH_DTYPES, garbage_cache, make_attention,
                                      round_to_cache, torch_dtype)
from pagedllm.testing.metrics import assert_close
from pagedllm.testing.paged_batch import PagedBatch, SeqSpec
from pagedllm.testing.sweep import (CUSTOM_SCALES, default_head_size, default_heads,
                                    long_context)

AREA = "declared limits"
# the summary's capability row of each check (report.py); undeclared values get their own row
CAPABILITY_OF = {"test_every_block_size": "block sizes", "test_head_size": "head sizes",
                 "test_gqa_group": "GQA groups", "test_long_context": "long context",
                 "test_custom_scale": "custom scale", "test_dtype_edges": "dtype range edges",
                 "test_reordered_batch": "reordered batch", "test_kv_cache_dtype": "kv cache dtype"}
# KV-cache dtypes other than "auto" that the suite knows how to store and round
KV_CACHE_DTYPES = tuple(KV_CACHE_TORCH_DTYPES)
# fp16's largest finite value; bf16 inputs beyond it catch a bf16 cache written through fp16
FP16_MAX = 65504.0


def step_specs(caps: Capabilities, bs: int) -> list[SeqSpec]:
    """One step that crosses block boundaries: a fresh prompt, a prompt over cached context
    (where declared), decodes at the first token, a full block, just past one and several."""
    cached = caps.prefix_caching or caps.chunked_prefill
    specs = [SeqSpec(0, bs + 3)]
    if cached:
        specs.append(SeqSpec(2 * bs + 1, 5))
    specs += [SeqSpec(3 * bs + 1, 1), SeqSpec(bs - 1, 1) if bs > 1 else SeqSpec(1, 1),
              SeqSpec(bs, 1), SeqSpec(0, 1)]
    return specs


def run_step(backend: Backend, caps: Capabilities, specs: list[SeqSpec], *, dtype: str, bs: int,
             device: torch.device, rng: torch.Generator, num_heads: int | None = None,
             num_kv_heads: int | None = None, head_size: int | None = None,
             scale: float | None = None, magnitudes: tuple[float, float, float] = (1., 1., 1.),
             pad_rows: int = 3, order: list[int] | None = None, **features: Any
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step on a fresh garbage-filled cache: (backend rows, float64 reference rows)."""
    h, kvh = default_heads(caps)
    num_heads, num_kv_heads = num_heads or h, num_kv_heads or kvh
    head_size = head_size or default_head_size(caps)
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
                          **features)
    batch = PagedBatch.random(specs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, block_size=bs, dtype=torch_dtype(dtype),
                              device=device, generator=rng, magnitudes=magnitudes)
    if order is not None:
        batch = batch.reordered(order)
    cache = garbage_cache(impl, batch.num_blocks, bs, dtype, device, rng)
    batch.write_context(impl, cache, device)
    t = batch.query.shape[0]
    out = batch.run(impl, cache, device, pad_tokens_to=t + pad_rows if pad_rows else 0)
    ref = batch.reference(impl.scale, sliding_window=features.get("sliding_window"),
                          soft_cap=features.get("logits_soft_cap"))
    return out[:t].cpu(), ref


def _lens(specs: list[SeqSpec]) -> str:
    return str([(s.context_len, s.query_len) for s in specs])


# --- one dimension at a time -------------------------------------------------------------------
def test_every_block_size(conformance_backend: Backend, conformance_caps: Capabilities,
                          conformance_dtype: str, conformance_sweep_block_size: int,
                          conformance_device: torch.device, conformance_rng: torch.Generator
                          ) -> None:
    bs = conformance_sweep_block_size
    specs = step_specs(conformance_caps, bs)
    got, ref = run_step(conformance_backend, conformance_caps, specs, dtype=conformance_dtype,
                        bs=bs, device=conformance_device, rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"block size {bs}, (context, query) {_lens(specs)}")


def test_head_size(conformance_backend: Backend, conformance_caps: Capabilities,
                   conformance_dtype: str, conformance_head_size: int,
                   conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    bs = conformance_caps.preferred_block_size
    specs = step_specs(conformance_caps, bs)
    got, ref = run_step(conformance_backend, conformance_caps, specs, dtype=conformance_dtype,
                        bs=bs, head_size=conformance_head_size, device=conformance_device,
                        rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"head size {conformance_head_size}")


def test_gqa_group(conformance_backend: Backend, conformance_caps: Capabilities,
                   conformance_dtype: str, conformance_gqa_group: int,
                   conformance_device: torch.device, conformance_rng: torch.Generator) -> None:
    """num_heads = group * num_kv_heads with 2 KV heads: query head h must read KV head
    h // group (groups 3, 5, 6 catch power-of-two shifts and masks)."""
    bs = conformance_caps.preferred_block_size
    group = conformance_gqa_group
    specs = step_specs(conformance_caps, bs)
    got, ref = run_step(conformance_backend, conformance_caps, specs, dtype=conformance_dtype,
                        bs=bs, num_heads=2 * group, num_kv_heads=2, device=conformance_device,
                        rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"GQA group {group} (heads {2 * group}, kv 2)")


def test_long_context(conformance_backend: Backend, conformance_caps: Capabilities,
                      conformance_dtype: str, conformance_device: torch.device,
                      conformance_rng: torch.Generator) -> None:
    """Decodes at up to the longest context (4,100 tokens unless a smaller max_context_len is
    declared), crossing hundreds of blocks; with cached context, a chunk at the far end too."""
    caps = conformance_caps
    bs = caps.preferred_block_size
    n = long_context(caps)
    specs = [SeqSpec(n - 1, 1), SeqSpec(n // 2, 1), SeqSpec(1023, 1)]
    if caps.prefix_caching or caps.chunked_prefill:
        specs.insert(0, SeqSpec(n - 40, 40))
    else:
        specs.insert(0, SeqSpec(0, min(n, 600)))
    got, ref = run_step(conformance_backend, caps, specs, dtype=conformance_dtype, bs=bs,
                        num_heads=4, num_kv_heads=2, device=conformance_device,
                        rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"long context, (context, query) {_lens(specs)}")


@pytest.mark.parametrize("scale", CUSTOM_SCALES)
def test_custom_scale(conformance_backend: Backend, conformance_caps: Capabilities,
                      conformance_dtype: str, scale: float, conformance_device: torch.device,
                      conformance_rng: torch.Generator) -> None:
    """The ``scale`` argument, not head_size ** -0.5, multiplies the scores."""
    bs = conformance_caps.preferred_block_size
    got, ref = run_step(conformance_backend, conformance_caps, step_specs(conformance_caps, bs),
                        dtype=conformance_dtype, bs=bs, scale=scale, magnitudes=(2., 2., 1.),
                        device=conformance_device, rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"scale={scale}")


def test_dtype_edges(conformance_backend: Backend, conformance_caps: Capabilities,
                     conformance_dtype: str, conformance_device: torch.device,
                     conformance_rng: torch.Generator) -> None:
    """Values near the top of the dtype's range (bf16 and float32: beyond fp16's max), and
    scores large enough that a softmax without max-subtraction overflows."""
    bs = conformance_caps.preferred_block_size
    # the standard deviation of V: 5 sigma stays finite in fp16; bf16's reach past fp16's max
    big = {"float16": 0.15 * FP16_MAX, "bfloat16": 4 * FP16_MAX, "float32": 1e30}
    for what, magnitudes in ((f"values ~{big[conformance_dtype]:.3g}",
                              (1., 1., big[conformance_dtype])),
                             ("scores up to ~±300", (6., 6., 1.))):
        specs = step_specs(conformance_caps, bs)
        got, ref = run_step(conformance_backend, conformance_caps, specs, dtype=conformance_dtype,
                            bs=bs, magnitudes=magnitudes, device=conformance_device,
                            rng=conformance_rng)
        # compared relative to V's magnitude: outputs are weighted averages of V
        assert_close(got / magnitudes[2], ref / magnitudes[2], conformance_dtype,
                     f"dtype edge: {what} (errors relative to V's scale)")


def test_reordered_batch(conformance_backend: Backend, conformance_caps: Capabilities,
                         conformance_dtype: str, conformance_device: torch.device) -> None:
    """The same sequences in another order give each sequence the same result: outputs follow
    their sequence (its block table and lengths), not their row."""
    bs = conformance_caps.preferred_block_size
    specs = step_specs(conformance_caps, bs)
    n_prefill = sum(1 for s in specs if s.query_len > 1)
    decodes = list(range(n_prefill, len(specs)))
    order = list(reversed(range(n_prefill))) + decodes[1::2] + decodes[0::2]
    for o in (None, order):
        got, ref = run_step(conformance_backend, conformance_caps, specs,
                            dtype=conformance_dtype, bs=bs, device=conformance_device,
                            rng=torch.Generator().manual_seed(11), order=o)
        assert_close(got, ref, conformance_dtype, f"batch order {o or 'as built'}")


# --- optional attention features (Capabilities.attention_features) -----------------------------
def _require_model_family(feature: str) -> None:
    """A backend learns that a model needs a feature from the model's config (its attention_cls
    may pick another implementation); without a registered family using it, no run can ask."""
    from pagedllm.models.registry import MODEL_REGISTRY

    if not any(feature in e.features for e in MODEL_REGISTRY.values()):
        pytest.skip(f"no architecture in pagedllm.models.registry uses {feature} yet")


@pytest.mark.capability("feature:sliding_window")
@pytest.mark.parametrize("window", [2, 7, 40])  # 1 (a token seeing only itself): no model
def test_sliding_window(conformance_backend: Backend, conformance_caps: Capabilities,
                        conformance_dtype: str, window: int, conformance_device: torch.device,
                        conformance_rng: torch.Generator) -> None:
    """A query at position p sees keys at positions > p - window (and <= p)."""
    _require_model_family("sliding_window")
    bs = conformance_caps.preferred_block_size
    specs = step_specs(conformance_caps, bs) + [SeqSpec(100, 1)]
    got, ref = run_step(conformance_backend, conformance_caps, specs, dtype=conformance_dtype,
                        bs=bs, sliding_window=window, device=conformance_device,
                        rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"sliding_window={window}")


@pytest.mark.capability("feature:logits_soft_cap")
@pytest.mark.parametrize("cap", [5.0, 30.0])
def test_logits_soft_cap(conformance_backend: Backend, conformance_caps: Capabilities,
                         conformance_dtype: str, cap: float, conformance_device: torch.device,
                         conformance_rng: torch.Generator) -> None:
    """Scaled scores s become cap * tanh(s / cap) before the softmax (Gemma 2)."""
    _require_model_family("logits_soft_cap")
    bs = conformance_caps.preferred_block_size
    got, ref = run_step(conformance_backend, conformance_caps, step_specs(conformance_caps, bs),
                        dtype=conformance_dtype, bs=bs, logits_soft_cap=cap,
                        magnitudes=(3., 3., 1.), device=conformance_device, rng=conformance_rng)
    assert_close(got, ref, conformance_dtype, f"logits_soft_cap={cap}")


# --- KV-cache dtypes (Capabilities.kv_cache_dtypes) ---------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", [pytest.param(
    k, marks=pytest.mark.capability(f"kv_cache:{k}")) for k in KV_CACHE_DTYPES])
def test_kv_cache_dtype(conformance_backend: Backend, conformance_caps: Capabilities,
                        conformance_dtype: str, kv_cache_dtype: str,
                        conformance_device: torch.device, conformance_rng: torch.Generator
                        ) -> None:
    """A declared KV-cache dtype: K/V stored in it (scale 1.0) and read back by attention equal
    the float64 reference over the same K/V rounded to that type."""
    caps, dev, bs = conformance_caps, conformance_device, conformance_caps.preferred_block_size
    h, kvh = default_heads(caps)
    hs = default_head_size(caps)
    impl = make_attention(conformance_backend, dtype=conformance_dtype, block_size=bs,
                          num_heads=h, num_kv_heads=kvh, head_size=hs,
                          kv_cache_dtype=kv_cache_dtype)
    specs = step_specs(caps, bs)
    batch = PagedBatch.random(specs, num_heads=h, num_kv_heads=kvh, head_size=hs, block_size=bs,
                              dtype=torch_dtype(conformance_dtype), device=dev,
                              generator=conformance_rng)
    shape = tuple(impl.kv_cache_shape(batch.num_blocks, bs, kvh, hs))
    cache = ((torch.randn(shape, generator=conformance_rng) * 4)
             .to(KV_CACHE_TORCH_DTYPES[kv_cache_dtype]).to(dev))  # stale finite values
    batch.write_context(impl, cache, dev)
    t = batch.query.shape[0]
    got = batch.run(impl, cache, dev, pad_tokens_to=t + 3)[:t].cpu()
    rounded = dataclasses.replace(
        batch, key=round_to_cache(batch.key, kv_cache_dtype),
        value=round_to_cache(batch.value, kv_cache_dtype),
        context_keys=[round_to_cache(k, kv_cache_dtype) for k in batch.context_keys],
        context_values=[round_to_cache(v, kv_cache_dtype) for v in batch.context_values])
    assert_close(got, rounded.reference(impl.scale), conformance_dtype,
                 f"kv_cache_dtype={kv_cache_dtype!r}, (context, query) {_lens(specs)}")
