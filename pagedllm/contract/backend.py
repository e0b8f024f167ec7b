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
        """Adjust the configuration for this hardware (a backend adds its own adjustments, and
        refusals only it can know, then calls this). The base resolves dtype "auto" and switches
        off what the capabilities rule out. What the capabilities do not declare is refused by
        the engine right after this hook, in one place (engine/config_validation.py)."""
        caps = self.capabilities
        model = config.model
        if model.dtype == "auto":
            model.dtype = self.auto_dtype(model.hf_config)
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


