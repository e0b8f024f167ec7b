"""The declared space, swept (issue 41): paged attention at the combinations ``space.py`` takes
from every declared dtype x KV-cache dtype x block size x head size x attention feature, with
KV heads 1/3/8, GQA groups 1/odd/max and four whole-step shape classes (``shapes.py``: 67
decodes over blocks at the top of a large pool; a 421-token prompt and a long chunk; chunks
starting at every offset inside a block; contexts past 16k tokens), against the float64
reference.

With ``kv_cache="fp8"`` the K and V scales are not 1 (the attention's ``k_scale`` / ``v_scale``,
set after construction as the model loader sets a checkpoint's) and some K/V values lie at and
beyond e4m3's range once scaled: the reference reads back ``saturate(x / scale)`` in e4m3 times
the scale (docs/porting.md, the KV scale contract).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities
from pagedllm.testing.harness import (FP8_MAX, KV_CACHE_TORCH_DTYPES, make_attention,
                                      round_to_cache, stale_pool, torch_dtype)
from pagedllm.testing.metrics import assert_close
from pagedllm.testing.paged_batch import PagedBatch
from pagedllm.testing.shapes import (FP8_K_SCALE, FP8_V_SCALE, SOFT_CAP, attention_space,
                                     pool_blocks, step, window)

AREA = "declared space (sweep)"
CAPABILITY_OF = {"test_attention_sweep": "attention sweep"}
SPACES = {"test_attention_sweep": attention_space}
EDGE_FACTORS = (1.0, 1.25, 4.0)  # K/V values at, just past and far past the scaled fp8 range


def _edges(x: torch.Tensor, scale: float, rng: torch.Generator) -> torch.Tensor:
    """``x`` with ~3% of its elements moved to +-448 * scale * (1, 1.25, 4)."""
    flat = x.flatten().clone()
    n = max(3, flat.numel() // 32)
    idx = torch.randint(0, flat.numel(), (n,), generator=rng)
    sign = torch.randint(0, 2, (n,), generator=rng) * 2 - 1
    factor = torch.tensor(EDGE_FACTORS)[torch.arange(n) % len(EDGE_FACTORS)]
    flat[idx.to(flat.device)] = (sign * factor * FP8_MAX * scale).to(flat.dtype).to(flat.device)
    return flat.view_as(x)


def _with_fp8_edges(batch: PagedBatch, rng: torch.Generator) -> PagedBatch:
    return dataclasses.replace(
        batch, key=_edges(batch.key, FP8_K_SCALE, rng), value=_edges(batch.value, FP8_V_SCALE, rng),
        context_keys=[_edges(k, FP8_K_SCALE, rng) if k.numel() else k for k in batch.context_keys],
        context_values=[_edges(v, FP8_V_SCALE, rng) if v.numel() else v
                        for v in batch.context_values])


def _as_cached(batch: PagedBatch, kv: str) -> PagedBatch:
    """The batch with K/V as an fp8 cache with the sweep's scales holds them."""
    k = lambda x: round_to_cache(x, kv, FP8_K_SCALE)  # noqa: E731
    v = lambda x: round_to_cache(x, kv, FP8_V_SCALE)  # noqa: E731
    return dataclasses.replace(batch, key=k(batch.key), value=v(batch.value),
                               context_keys=[k(x) for x in batch.context_keys],
                               context_values=[v(x) for x in batch.context_values])


def run_sweep_case(backend: Backend, caps: Capabilities, case: dict[str, Any],
                   device: torch.device, rng: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, str]:
    """One step of ``case``: (backend rows, float64 reference, magnitude bound or None, what)."""
    bs, hs, kvh, dtype = case["block_size"], case["head_size"], case["kv_heads"], case["dtype"]
    heads = kvh * case["group"]
    feature, kv = case["feature"], case["kv_cache"]
    features = {"sliding_window": window(bs)} if feature == "sliding_window" else \
        {"logits_soft_cap": SOFT_CAP} if feature == "logits_soft_cap" else {}
    fp8 = kv in KV_CACHE_TORCH_DTYPES
    impl = make_attention(backend, dtype=dtype, block_size=bs, num_heads=heads, num_kv_heads=kvh,
                          head_size=hs, kv_cache_dtype=kv if kv != "auto" else None, **features)
    if fp8:  # what the model loader does with a checkpoint's k_scale / v_scale
        impl.k_scale, impl.v_scale = FP8_K_SCALE, FP8_V_SCALE
    cache_dtype = KV_CACHE_TORCH_DTYPES.get(kv, torch_dtype(dtype))
    specs = step(case["shape"], caps, bs)
    block_bytes = (torch.Size(impl.kv_cache_shape(1, bs, kvh, hs)).numel()
                   * torch.tensor([], dtype=cache_dtype).element_size())
    needed = sum(-(-s.seq_len // bs) for s in specs) + 3
    batch = PagedBatch.random(specs, num_heads=heads, num_kv_heads=kvh, head_size=hs,
                              block_size=bs, dtype=torch_dtype(dtype), device=device,
                              generator=rng, magnitudes=(3., 3., 1.) if "logits_soft_cap" in
                              features else (1., 1., 1.),
                              pool_blocks=pool_blocks(case["shape"], needed, block_bytes,
                                                      lazy=device.type == "cpu"))
    if fp8:
        batch = _with_fp8_edges(batch, rng)
    cache = stale_pool(impl, batch.num_blocks, bs, cache_dtype, device, rng, batch.touched_blocks())
    batch.write_context(impl, cache, device)
    t = batch.query.shape[0]
    got = batch.run(impl, cache, device, pad_tokens_to=t + 3)[:t].cpu()
    ref_batch = _as_cached(batch, kv) if fp8 else batch
    kw = dict(sliding_window=features.get("sliding_window"), soft_cap=features.get("logits_soft_cap"))
    ref = ref_batch.reference(impl.scale, **kw)
    bound = None
    if fp8:  # a weighted average of V's: its rounding error scales with sum p |v|
        bound = ref.abs() + dataclasses.replace(
            ref_batch, value=ref_batch.value.abs(),
            context_values=[v.abs() for v in ref_batch.context_values]).reference(impl.scale, **kw)
    lens = sorted({s.seq_len for s in specs})
    what = (f"{case['shape']} step: {len(specs)} sequences (lengths {lens[0]}..{lens[-1]}), "
            f"max block id {max(b for tb in batch.block_tables for b in tb)} of "
            f"{batch.num_blocks}; heads {heads}/{kvh} x {hs}, block size {bs}, {dtype}, "
            f"kv cache {kv}{' (k_scale %g, v_scale %g)' % (FP8_K_SCALE, FP8_V_SCALE) if fp8 else ''}"
            f", {feature}{'=' + str(next(iter(features.values()))) if features else ''}")
    return got, ref, bound, what


def test_attention_sweep(conformance_backend: Backend, conformance_caps: Capabilities,
                         sweep_case: dict[str, Any], conformance_device: torch.device,
                         conformance_rng: torch.Generator) -> None:
    if sweep_case["feature"] != "none":
        from pagedllm.models.registry import MODEL_REGISTRY

        if not any(sweep_case["feature"] in e.features for e in MODEL_REGISTRY.values()):
            pytest.skip(f"no architecture in pagedllm.models.registry uses "
                        f"{sweep_case['feature']} yet")
    got, ref, bound, what = run_sweep_case(conformance_backend, conformance_caps, sweep_case,
                                           conformance_device, conformance_rng)
    assert_close(got, ref, sweep_case["dtype"], what, magnitude=bound)
