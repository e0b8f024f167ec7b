"""Building blocks the conformance tests share: configs, attention layers, caches, tolerances.

Everything here reaches the backend through the plugin contract only (``attention_cls(config)``,
``kv_cache_shape``, ``cache_ops()``, ``capabilities``, ``torch_device``); nothing assumes a cache
layout beyond "dim 1 indexes blocks".
"""
from __future__ import annotations

from typing import Any

import torch

from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)
from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.backend import Backend

# every dtype the engine knows; a backend declares a subset in capabilities.dtypes
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (atol, rtol) of a backend result against the float64 reference computed from the same
# dtype-rounded inputs: output rounding plus reduced-precision accumulation
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 3e-2), "float16": (4e-3, 4e-3)}
# stale finite values standing in for whatever an earlier request left in a block; attention
# that reads past a sequence's length (or a pad slot) picks them up and misses the reference
GARBAGE_MEAN = 40.0


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


def tolerance(dtype: str) -> dict[str, float]:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def tiny_hf_config(num_heads: int, num_kv_heads: int, head_size: int,
                   sliding_window: int | None = None, logits_soft_cap: float | None = None
                   ) -> Any:
    """A one-layer Llama-shaped config with the given attention shape (what attention_cls may
    inspect). With an attention feature, it names an architecture the model registry lists as
    using that feature and sets the HF attribute that turns it on, so a backend's
    ``attention_cls`` sees the model needing it, as in a real run."""
    from transformers import LlamaConfig

    features = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    needed = {f for f, v in features.items() if v is not None}
    arch = "LlamaForCausalLM"
    if needed:
        from pagedllm.models.registry import MODEL_REGISTRY

        arch = next((a for a, e in MODEL_REGISTRY.items() if needed <= set(e.features)), arch)
    config = LlamaConfig(vocab_size=259, hidden_size=num_heads * head_size, head_dim=head_size,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=1, intermediate_size=64,
                         max_position_embeddings=8192, architectures=[arch])
    if sliding_window is not None:
        config.sliding_window, config.use_sliding_window = sliding_window, True
    if logits_soft_cap is not None:
        config.attn_logit_softcapping = logits_soft_cap
    return config


def raw_config(backend: Backend, *, dtype: str, block_size: int, num_heads: int = 4,
               num_kv_heads: int = 2, head_size: int = 64, sliding_window: int | None = None,
               logits_soft_cap: float | None = None, **features: Any) -> EngineConfig:
    """An EngineConfig for one attention shape, not yet seen by the backend. ``features``:
    enable_prefix_caching, enable_chunked_prefill, preemption_mode."""
    hf_config = tiny_hf_config(num_heads, num_kv_heads, head_size, sliding_window,
                               logits_soft_cap)
    model = ModelConfig(model="pagedllm-conformance", tokenizer="pagedllm-conformance",
                        dtype=dtype, max_model_len=8192, hf_config=hf_config)
    cache = CacheConfig(block_size=block_size,
                        enable_prefix_caching=features.pop("enable_prefix_caching", False),
                        cache_dtype=features.pop("kv_cache_dtype", None) or "auto")
    sched = SchedulerConfig(max_num_seqs=16, **features)
    sched.resolve(model.max_model_len)
    return EngineConfig(model=model, cache=cache, scheduler=sched, parallel=ParallelConfig(),
                        device=backend.name)


def make_config(backend: Backend, **kwargs: Any) -> EngineConfig:
    """``raw_config`` adjusted by the backend, as the engine does before building a worker."""
    config = raw_config(backend, **kwargs)
    backend.check_and_update_config(config)
    return config


def make_attention(backend: Backend, *, dtype: str, block_size: int, num_heads: int,
                   num_kv_heads: int, head_size: int, scale: float | None = None,
                   **attn_kwargs: Any) -> AttentionImpl:
    """The backend's attention implementation for this shape, built as a model layer builds it.

    ``scale`` defaults to head_size ** -0.5; ``attn_kwargs`` (sliding_window, logits_soft_cap,
    kv_cache_dtype) are passed only when given, as models pass them."""
    config = make_config(backend, dtype=dtype, block_size=block_size, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_size=head_size,
                         sliding_window=attn_kwargs.get("sliding_window"),
                         logits_soft_cap=attn_kwargs.get("logits_soft_cap"),
                         kv_cache_dtype=attn_kwargs.get("kv_cache_dtype"))
    cls = backend.attention_cls(config)
    if not (isinstance(cls, type) and issubclass(cls, AttentionImpl)):
        raise TypeError(f"{type(backend).__name__}.attention_cls() returned {cls!r}, which is not "
                        "an AttentionImpl subclass")
    kwargs = {k: v for k, v in attn_kwargs.items() if v is not None}
    return cls(num_heads, head_size, num_kv_heads,
               head_size ** -0.5 if scale is None else scale, **kwargs)


# kv_cache_dtype -> the element type of the cache tensor (the Worker allocates it so)
KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn}


FP8_MAX = 448.0  # e4m3fn's largest finite value


def round_to_cache(x: torch.Tensor, kv_cache_dtype: str, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache stores it and reads it back, in ``x``'s dtype: what the float64
    reference must see. fp8 (docs/porting.md, the KV scale contract): ``x / scale`` rounded to
    e4m3, saturating at +-448, read back times ``scale``."""
    if kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
        return x
    stored = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(KV_CACHE_TORCH_DTYPES[kv_cache_dtype])
    return (stored.float() * scale).to(x.dtype)


def zeros_on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the host mapped lazily (a large pool costs only the pages touched)."""
    if device.type == "cpu":
        from pagedllm.worker.host_memory import lazy_zeros

        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def stale_pool(impl: AttentionImpl, num_blocks: int, block_size: int, dtype: torch.dtype,
               device: torch.device, generator: torch.Generator, blocks: list[int]) -> torch.Tensor:
    """A cache of ``num_blocks`` whose ``blocks`` hold finite stale values (``garbage_cache``'s,
    or ~N(0, 4) for an fp8 cache) and the rest zeros (lazily mapped on the host): a large pool
    where only the blocks a step may read cost memory."""
    shape = cache_shape(impl, num_blocks, block_size)
    cache = zeros_on(shape, dtype, device)
    idx = torch.tensor(blocks, dtype=torch.int64)
    part = list(shape)
    part[1] = len(blocks)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        values = (torch.randn(part, generator=generator) * 4).to(dtype)
        cache.view(torch.uint8).index_copy_(1, idx.to(device), values.view(torch.uint8).to(device))
    else:
        values = (torch.randn(part, generator=generator) + GARBAGE_MEAN).to(dtype)
        cache.index_copy_(1, idx.to(device), values.to(device))
    return cache


def cache_shape(impl: AttentionImpl, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return tuple(impl.kv_cache_shape(num_blocks, block_size, impl.num_kv_heads, impl.head_size))


def garbage_cache(impl: AttentionImpl, num_blocks: int, block_size: int, dtype: str,
                  device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """A cache full of finite stale values (not zeros: zeros hide reads of unwritten slots)."""
    shape = cache_shape(impl, num_blocks, block_size)
    values = torch.randn(shape, generator=generator) + GARBAGE_MEAN
    return values.to(torch_dtype(dtype)).to(device)


def nan_cache(shape: tuple[int, ...], dtype: str, device: torch.device) -> torch.Tensor:
    """A cache poisoned with NaN, so every element a call fails to write stays visible."""
    return torch.full(shape, float("nan"), dtype=torch_dtype(dtype), device=device)


def block_sizes_to_test(block_sizes: tuple[int, ...], preferred: int) -> list[int]:
    """The smallest, the preferred and the largest declared block size (at most three)."""
    sizes = sorted(block_sizes)
    return sorted({sizes[0], preferred if preferred in sizes else sizes[0], sizes[-1]})
