"""The one place that checks an engine configuration against the model, the backend's declared
capabilities and the parallel layout, before any weight is loaded or any worker starts.

``LLMEngine`` calls ``validate_config(config, backend)`` once at start, right after the backend's
``check_and_update_config`` hook (which only adjusts: dtype "auto", the cpu token budget, the hpu
block size, ...). Every refusal is a ValueError naming the field (an engine argument, or the
model's config key), its value, and what is allowed or what to do instead. Field syntax (ranges,
choices) is checked earlier, by the config dataclasses' ``__post_init__`` (pagedllm/config.py);
here are the checks that need the model or the backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.backend import Backend


def validate_config(config: EngineConfig, backend: Backend) -> str:
    """Run every check; returns the model's architecture name."""
    arch = check_model(config, backend)
    check_backend(config, backend)
    check_tensor_parallel(config, backend)
    check_pipeline_parallel(config, backend, arch)
    check_speculative(config, backend)
    check_lora(config, backend)
    check_kv_transfer(config, backend)
    return arch


def check_backend(config: EngineConfig, backend: Backend) -> None:
    """The checks against the backend's declarations alone (no model registry, no layout): what
    the conformance suite asks of a plugin's declared capabilities."""
    check_capabilities(config, backend)
    check_attention_limits(config, backend)


def check_speculative(config: EngineConfig, backend: Backend) -> None:
    """speculative_config against the backend (multi-token decode), the layout and the target
    (a draft sharing its vocabulary); resolves the method and the demo model's shipped
    proposer (engine/speculative.py)."""
    if config.speculative_config is not None:
        from pagedllm.engine.speculative import check_speculative as check

        check(config, backend)


def check_lora(config: EngineConfig, backend: Backend) -> None:
    """enable_lora=True only on a backend that declares ``Capabilities.lora`` (its op table
    runs lora_shrink / lora_expand), and not with speculative decoding (not yet combined)."""
    if getattr(config, "lora_config", None) is None:
        return
    if not backend.capabilities.lora:
        from pagedllm.contract.registry import discover

        able = [i.name for i in discover().values()
                if getattr(i, "cls", None) is not None and i.cls.capabilities.lora]
        raise ValueError(f"enable_lora=True: the {backend.name} backend does not run LoRA "
                         f"adapters (Capabilities.lora); backends that do: "
                         f"{', '.join(able) or 'none installed'}")
    if config.speculative_config is not None:
        raise ValueError("enable_lora=True with speculative_config is not supported yet; turn "
                         "one of them off")


def check_kv_transfer(config: EngineConfig, backend: Backend) -> None:
    """KV offload tiers and KV connectors move blocks through the backend's block export /
    import (``Capabilities.kv_export``) and key them by the prefix cache's content keys: refused
    on a backend without either, and (not yet combined) with pipeline or tensor parallelism
    or speculative decoding."""
    offload = getattr(config, "kv_offload_config", None)
    transfer = getattr(config, "kv_transfer_config", None)
    if offload is None and transfer is None:
        return
    field = ("kv_offload_size/kv_offload_disk" if offload is not None
             else "kv_transfer_config")
    caps = backend.capabilities
    if not getattr(caps, "kv_export", False):
        from pagedllm.contract.registry import discover

        able = [i.name for i in discover().values() if getattr(i, "cls", None) is not None
                and getattr(i.cls.capabilities, "kv_export", False)]
        raise ValueError(f"{field}: the {backend.name} backend does not export or import KV "
                         f"blocks (Capabilities.kv_export), which KV offload and KV transfer "
                         f"need; backends that do: {', '.join(able) or 'none installed'}")
    if not caps.prefix_caching:
        raise ValueError(f"{field}: the {backend.name} backend does not declare prefix_caching, "
                         "which KV offload and KV transfer build on")
    parallel = config.parallel
    for name, value in (("pipeline_parallel_size", parallel.pipeline_parallel_size),
                        ("tensor_parallel_size", parallel.tensor_parallel_size)):
        if value != 1:
            raise ValueError(f"{field} with {name}={value} is not supported yet; use {name}=1")
    if config.speculative_config is not None:
        raise ValueError(f"{field} with speculative_config is not supported yet; turn one of "
                         "them off")


# --- the model ---------------------------------------------------------------------------
def check_model(config: EngineConfig, backend: Backend) -> str:
    """A registered architecture whose attention features (sliding window, soft cap) this
    config turns on are all declared by the backend. Returns the architecture name."""
    from pagedllm.models.registry import missing_features, resolve_architecture

    hf_config = config.model.hf_config
    arch = resolve_architecture(hf_config)
    declared = tuple(backend.capabilities.attention_features)
    missing = missing_features(arch, hf_config, declared)
    if missing:
        raise ValueError(
            f"{arch} with this config needs the attention feature(s) {', '.join(missing)}, which "
            f"the {backend.name} backend does not support (it declares attention_features="
            f"{declared}); run it on a backend that has them (see `pagedllm models`)")
    return arch


# --- the backend's declared capabilities -------------------------------------------------
def check_capabilities(config: EngineConfig, backend: Backend) -> None:
    """dtype, quantization, KV-cache dtype, block size, prefix caching, chunked prefill, tensor
    parallel size and swapping against what the backend declares."""
    from pagedllm.models.layers.quantization import check_backend_support, resolve_method

    caps, name, model = backend.capabilities, backend.name, config.model
    if model.dtype == "auto":
        raise ValueError(f"dtype='auto' was not resolved: the {name} backend's "
                         f"check_and_update_config must call the base class's, which resolves it")
    if model.dtype not in caps.dtypes:
        raise ValueError(f"dtype={model.dtype!r} is not supported by the {name} backend; "
                         f"supported: {', '.join(caps.dtypes)}")
    model.quantization = resolve_method(model.hf_config, model.quantization)
    check_backend_support(model.quantization, name, caps.quantizations)
    cache_dtype = config.cache.cache_dtype
    if cache_dtype != "auto" and cache_dtype not in caps.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported by the {name} "
                         f"backend; supported: {', '.join(caps.kv_cache_dtypes)}")
    if config.cache.block_size not in caps.block_sizes:
        raise ValueError(f"block_size={config.cache.block_size} is not supported by the {name} "
                         f"backend; supported: {caps.block_sizes}")
    if config.cache.enable_prefix_caching and not caps.prefix_caching:
        raise ValueError(f"enable_prefix_caching is not supported by the {name} backend")
    if config.scheduler.enable_chunked_prefill and not caps.chunked_prefill:
        raise ValueError(f"enable_chunked_prefill is not supported by the {name} backend")
    tp = config.parallel.tensor_parallel_size
    if caps.max_tensor_parallel_size is not None and tp > caps.max_tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tp} is not supported by the {name} backend "
                         f"yet; use at most {caps.max_tensor_parallel_size}")
    if config.scheduler.preemption_mode == "swap" and not caps.swap:
        raise ValueError(f"preemption_mode='swap' is not supported by the {name} backend "
                         "(it cannot swap KV blocks to host memory); use 'recompute'")


def check_attention_limits(config: EngineConfig, backend: Backend) -> None:
    """The model's head size, GQA group and max_model_len within the attention limits the
    backend declares."""
    caps, name, model = backend.capabilities, backend.name, config.model
    if model.hf_config is not None:
        head_size = model.get_head_size()
        if head_size not in caps.head_sizes:
            raise ValueError(f"head_size={head_size} (the model's) is not supported by the "
                             f"{name} backend; it declares head_sizes="
                             f"{', '.join(map(str, caps.head_sizes))}")
        heads, kv_heads = model.get_num_heads(), model.get_num_kv_heads()
        group = heads // max(kv_heads, 1)
        if caps.max_gqa_group is not None and group > caps.max_gqa_group:
            raise ValueError(f"GQA group {group} (num_attention_heads={heads} / "
                             f"num_key_value_heads={kv_heads}) exceeds the {name} backend's "
                             f"max_gqa_group={caps.max_gqa_group}")
    if caps.max_context_len is not None and model.max_model_len > caps.max_context_len:
        raise ValueError(f"max_model_len={model.max_model_len} exceeds the {name} backend's "
                         f"max_context_len={caps.max_context_len}; pass max_model_len <= "
                         f"{caps.max_context_len}")


# --- the parallel layout ------------------------------------------------------------------
def check_tensor_parallel(config: EngineConfig, backend: Backend,
                          one_host: bool | None = None) -> None:
    """A tensor_parallel_size the model's heads split over, and (on one host, the mp executor;
    ``one_host`` defaults from distributed_executor_backend) enough devices for every rank."""
    parallel = config.parallel
    n = parallel.tensor_parallel_size
    model = config.model
    heads, kv_heads = model.get_num_heads(), model.get_num_kv_heads()
    if heads % n != 0:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                         f"num_attention_heads={heads}; choose a divisor of {heads}")
    if kv_heads >= n and kv_heads % n != 0:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                         f"num_key_value_heads={kv_heads}; choose a divisor of {kv_heads} "
                         f"(or a multiple of it, up to {heads}, to replicate the KV heads)")
    if kv_heads < n and n % kv_heads != 0:
        raise ValueError(f"tensor_parallel_size={n} is larger than the model's "
                         f"num_key_value_heads={kv_heads} but not a multiple of it; KV heads "
                         f"can only be replicated evenly")
    pp = getattr(parallel, "pipeline_parallel_size", 1)
    if one_host is None:
        one_host = getattr(parallel, "distributed_executor_backend", None) != "ray"
    # several ranks may share one device only with gloo (the CPU); NCCL-like libraries refuse
    if n * pp > 1 and one_host and backend.dist_backend != "gloo":
        count = backend.device_count()
        if count < n * pp:
            what = (f"tensor_parallel_size={n}" if pp == 1 else
                    f"tensor_parallel_size={n} x pipeline_parallel_size={pp}")
            raise ValueError(f"{what} needs {n * pp} {backend.name} devices on this "
                             f"host but {count} are visible; lower tensor_parallel_size or use "
                             f"distributed_executor_backend='ray' across several hosts")


def check_pipeline_parallel(config: EngineConfig, backend: Backend,
                            arch: str | None = None) -> None:
    """pipeline_parallel_size > 1 only on a backend that declares it, for a model built of
    stages, with a layer split (pp_layer_partition or the even one) the model's layers take."""
    from pagedllm.models.layers.pipeline import partition_layers

    pp = config.parallel.pipeline_parallel_size
    if pp == 1:
        return
    if not backend.capabilities.pipeline_parallel:
        from pagedllm.contract.registry import discover

        able = [i.name for i in discover().values()
                if getattr(i, "cls", None) is not None and i.cls.capabilities.pipeline_parallel]
        raise ValueError(f"pipeline_parallel_size={pp}: the {backend.name} backend does not "
                         f"support pipeline parallelism (Capabilities.pipeline_parallel); "
                         f"backends that do: {', '.join(able) or 'none installed'}; or use "
                         f"pipeline_parallel_size=1")
    from pagedllm.models.registry import model_class, resolve_architecture

    arch = arch or resolve_architecture(config.model.hf_config)
    if not hasattr(model_class(arch), "make_empty_intermediate_tensors"):
        raise ValueError(f"pipeline_parallel_size={pp}: {arch} does not run as pipeline stages "
                         f"yet (its model builds its layers without models/layers/pipeline.py's "
                         f"make_layers); use pipeline_parallel_size=1")
    partition_layers(config.model.get_num_layers(), pp,
                     config.parallel.pp_layer_partition)  # raises naming pp_layer_partition
