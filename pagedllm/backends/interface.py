"""The plugin contract: what a hardware backend supplies to the device-free engine.

A backend is a small ``Backend`` subclass naming its device and capabilities plus three
implementation classes: an ``AttentionImpl`` (paged attention), a ``CacheOps`` (block copy and
swap) and a ``Worker`` (cache sizing, batch preparation, model execution). Everything marked
optional has a safe default here; the required surface is ``name``, ``torch_device``,
``availability`` and ``attention_cls``. Importing this module never imports a vendor SDK.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedllm.backends.attention import AttentionImpl, AttentionMetadata  # noqa: F401  (re-export)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.models.layers.ops import Ops
    from pagedllm.worker.worker import Worker


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the engine and the conformance suite consult these, never names."""

    graphs: bool = False  # captures decode graphs (disabled by enforce_eager)
    swap: bool = True  # can swap KV blocks to host memory (else preemption recomputes)
    static_shapes: bool = False  # inputs must be padded to buckets
    prefix_caching: bool = True
    chunked_prefill: bool = True
    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    preferred_block_size: int = 16
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    max_tensor_parallel_size: int | None = None  # None: as many devices as the backend counts
    # the worker's launch_model returns before the device finishes, so the engine schedules and
    # launches step N+1 (inputs taken from step N's device-side draws) while step N runs
    async_output: bool = False
    # --- attention limits (plugin API 2.0); the conformance suite sweeps what is declared ---------
    # Safe defaults: what a port is expected to handle anyway; the suite sweeps 32..256 and GQA
    # groups 1-8 and reports each undeclared value NOT DECLARED, so declare only what passes.
    head_sizes: tuple[int, ...] = (64, 128)  # head sizes the attention handles
    max_gqa_group: int | None = 8  # largest num_heads // num_kv_heads (None: any)
    max_context_len: int | None = None  # longest sequence the attention was built for (None: any)
    # optional attention arguments models need (AttentionImpl kwargs): "sliding_window",
    # "logits_soft_cap"; a model needing one the backend lacks is refused, the feature named
    attention_features: tuple[str, ...] = ()
    # quantization methods whose linear the backend runs ("awq", "gptq", "compressed-tensors",
    # "fp8"); the engine refuses others, naming the backends that support them
    quantizations: tuple[str, ...] = ()
    pipeline_parallel: bool = False  # runs stages of a pipeline (activations sent between ranks)

    def summary(self) -> str:
        flags = [name for name in ("graphs", "swap", "static_shapes", "prefix_caching",
                                   "chunked_prefill", "async_output") if getattr(self, name)]
        return f"{','.join(flags) or '-'}; dtypes={'/'.join(self.dtypes)}"


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache (kv_cache_dtype="fp8") as its bytes: block copies move bits, and
    index_copy_ has no float8 kernel on CPU."""
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cache.view(torch.uint8)
    return cache


class CacheOps:
    """Block copy (copy-on-write) and swap between device and host caches.

    The reference implementation works for any cache whose dim 1 indexes blocks; a backend with
    kernels overrides ``copy_blocks``/``swap_blocks``.
    """

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """``pairs`` [n, 2] int64 (src, dst) on the cache's device; applied to every layer."""
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in map(as_bytes, kv_caches):
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def swap_blocks(self, src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor],
                    pairs: torch.Tensor) -> None:
        """Copy blocks ``pairs[:, 0]`` of each src layer to ``pairs[:, 1]`` of the dst layer.

        ``pairs`` [n, 2] int64 on the CPU; src and dst caches live on different devices.
        """
        if pairs.numel() == 0:
            return
        for src, dst in zip(map(as_bytes, src_caches), map(as_bytes, dst_caches)):
            src_idx = pairs[:, 0].to(src.device)
            dst_idx = pairs[:, 1].to(dst.device)
            dst.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(dst.device))


class Backend(ABC):
    """One hardware family. Subclasses set the class attributes and implement the abstract methods."""

    name: ClassVar[str]
    torch_device: ClassVar[str]
    dist_backend: ClassVar[str] = "gloo"
    default_dtype: ClassVar[str] = "float32"
    capabilities: ClassVar[Capabilities] = Capabilities()
    # the Ray resource one worker reserves (None: "GPU" when torch_device is cuda, else "CPU")
    ray_resource: ClassVar[str | None] = None
    # where the plugin came from: "built-in" or the installing package (set by the registry)
    source: str = "built-in"
    # the plugin API ("major.minor", pagedllm.backends.PLUGIN_API_VERSION) this plugin was
    # written for; the registry refuses another major or a newer minor. None: not stated
    # (accepted, and shown as such by `pagedllm backends`). Built-ins track the current one.
    plugin_api_version: ClassVar[str | None] = None

    @classmethod
    @abstractmethod
    def availability(cls) -> tuple[bool, str]:
        """(usable here?, reason). Must never raise; the reason is shown to users as is."""

    @abstractmethod
    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        """The attention implementation to build every attention layer with."""

    # --- optional, with safe defaults ----------------------------------------------------
    def check_and_update_config(self, config: EngineConfig) -> None:
        """Adjust or reject the configuration for this hardware. The base resolves the dtype and
        switches off features the capabilities rule out."""
        caps = self.capabilities
        model = config.model
        if model.dtype == "auto":
            model.dtype = self.auto_dtype(model.hf_config)
        if model.dtype not in caps.dtypes:
            raise ValueError(f"dtype={model.dtype!r} is not supported by the {self.name} backend; "
                             f"supported: {', '.join(caps.dtypes)}")
        _check_quantization(self.name, caps, config)
        _check_attention_limits(self.name, caps, config)
        if config.cache.block_size not in caps.block_sizes:
            raise ValueError(f"block_size={config.cache.block_size} is not supported by the "
                             f"{self.name} backend; supported: {caps.block_sizes}")
        if config.cache.enable_prefix_caching and not caps.prefix_caching:
            raise ValueError(f"enable_prefix_caching is not supported by the {self.name} backend")
        if config.scheduler.enable_chunked_prefill and not caps.chunked_prefill:
            raise ValueError(f"enable_chunked_prefill is not supported by the {self.name} backend")
        tp = config.parallel.tensor_parallel_size
        if caps.max_tensor_parallel_size is not None and tp > caps.max_tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tp} is not supported by the {self.name} backend "
                             f"yet; use at most {caps.max_tensor_parallel_size}")
        if config.scheduler.preemption_mode == "swap" and not caps.swap:
            raise ValueError(f"preemption_mode='swap' is not supported by the {self.name} backend "
                             "(it cannot swap KV blocks to host memory); use 'recompute'")
        if not caps.swap:
            config.cache.swap_space_gib = 0.0
        if not caps.graphs:
            config.enforce_eager = True

    def auto_dtype(self, hf_config: object) -> str:
        """dtype="auto": the checkpoint's half type if supported, otherwise the default dtype."""
        # transformers 5 names it dtype (torch_dtype is deprecated); 4.x names it torch_dtype
        torch_dtype = str(getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", "")
                          or "").removeprefix("torch.")
        if torch_dtype in ("float16", "bfloat16") and torch_dtype in self.capabilities.dtypes:
            return torch_dtype
        return self.default_dtype

    def cache_ops(self) -> CacheOps:
        return CacheOps()

    def register_ops(self, ops: Ops) -> None:
        """Replace reference ops (rms_norm, rotary, silu_and_mul, linear, ...) with faster ones."""

    def worker_cls(self) -> type[Worker]:
        from pagedllm.worker.worker import Worker

        return Worker

    def device_count(self) -> int:
        return 1

    def host_pin_memory(self) -> bool:
        """Whether host swap blocks should be pinned."""
        return False

    def synchronize(self) -> None:
        """Wait for queued device work (timing, and step boundaries on lazy devices)."""


@dataclass
class BackendInfo:
    """A registry row: the class, where it came from, and whether it loaded."""

    name: str
    source: str
    cls: type[Backend] | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def availability(self) -> tuple[bool, str]:
        if self.cls is None:
            if self.error and self.error.startswith("refused"):
                return False, self.error
            return False, f"failed to load: {self.error}"
        try:
            return self.cls.availability()
        except Exception as exc:  # a plugin bug must not break the table
            return False, f"availability() raised {type(exc).__name__}: {exc}"


def _check_quantization(backend: str, caps: Capabilities, config: EngineConfig) -> None:
    """Resolve the model's quantization method (the checkpoint's, or the forced one) and refuse
    one the backend does not run, or a KV-cache dtype it lacks."""
    from pagedllm.models.layers.quantization import check_backend_support, resolve_method

    model = config.model
    model.quantization = resolve_method(model.hf_config, model.quantization)
    check_backend_support(model.quantization, backend, caps.quantizations)
    cache_dtype = config.cache.cache_dtype
    if cache_dtype != "auto" and cache_dtype not in caps.kv_cache_dtypes:
        raise ValueError(f"kv_cache_dtype={cache_dtype!r} is not supported by the {backend} "
                         f"backend; supported: {', '.join(caps.kv_cache_dtypes)}")


def _check_attention_limits(backend: str, caps: Capabilities, config: EngineConfig) -> None:
    """Refuse a model outside the attention limits the backend declares (head sizes, GQA group,
    context length), naming the field, the model's value and what the backend declares."""
    model = config.model
    if model.hf_config is not None:
        head_size = model.get_head_size()
        if head_size not in caps.head_sizes:
            raise ValueError(f"head_size={head_size} (the model's) is not supported by the "
                             f"{backend} backend; it declares head_sizes="
                             f"{', '.join(map(str, caps.head_sizes))}")
        heads, kv_heads = model.get_num_heads(), model.get_num_kv_heads()
        group = heads // max(kv_heads, 1)
        if caps.max_gqa_group is not None and group > caps.max_gqa_group:
            raise ValueError(f"GQA group {group} (num_attention_heads={heads} / "
                             f"num_key_value_heads={kv_heads}) exceeds the {backend} backend's "
                             f"max_gqa_group={caps.max_gqa_group}")
    if caps.max_context_len is not None and model.max_model_len > caps.max_context_len:
        raise ValueError(f"max_model_len={model.max_model_len} exceeds the {backend} backend's "
                         f"max_context_len={caps.max_context_len}; pass max_model_len <= "
                         f"{caps.max_context_len}")
