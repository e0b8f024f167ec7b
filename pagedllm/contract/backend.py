"""The backend class of the plugin contract: one hardware family.

A backend is a small ``Backend`` subclass naming its device and capabilities plus the parts it is
made of: an ``AttentionImpl`` (paged attention), a ``CacheOps`` (block copy and swap) and a worker
(cache sizing, batch preparation, model execution), named by class or by "module:Class" string so
the contract imports none of them. Everything marked optional has a safe default here; the
required surface is ``name``, ``torch_device``, ``availability`` and ``attention_cls``.
Importing this module never imports a vendor SDK.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.cache_ops import CacheOps
from pagedllm.contract.capabilities import Capabilities
from pagedllm.contract.quantization import check_backend_support, resolve_method
from pagedllm.contract.registry import load_class

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.ops import OpTable

DEFAULT_WORKER = "pagedllm.worker.worker:Worker"


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
    # the worker class (a pagedllm.worker.worker.Worker subclass), or its "module:Class" import
    # string, resolved by ``worker_cls()`` when a worker starts (plugin API 2.1)
    worker_class: ClassVar[str | type] = DEFAULT_WORKER

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

    def register_ops(self, ops: OpTable) -> None:
        """Replace reference ops (rms_norm, rotary, silu_and_mul, linear, ...) with faster ones."""

    def worker_cls(self) -> type:
        """The worker class: ``worker_class`` resolved (a plugin may override this instead)."""
        return load_class(self.worker_class)

    def device_count(self) -> int:
        return 1

    def host_pin_memory(self) -> bool:
        """Whether host swap blocks should be pinned."""
        return False

    def synchronize(self) -> None:
        """Wait for queued device work (timing, and step boundaries on lazy devices)."""


def _check_quantization(backend: str, caps: Capabilities, config: EngineConfig) -> None:
    """Resolve the model's quantization method (the checkpoint's, or the forced one) and refuse
    one the backend does not run, or a KV-cache dtype it lacks."""
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
