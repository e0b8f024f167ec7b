"""The cpu backend: pure torch (oneDNN for linears), KV cache sized in GiB."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.backends.attention import AttentionImpl
from pagedllm.backends.interface import Backend, Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.models.layers.ops import Ops


class CpuBackend(Backend):
    name = "cpu"
    torch_device = "cpu"
    dist_backend = "gloo"
    default_dtype = "float32"
    capabilities = Capabilities(graphs=False, swap=True, static_shapes=False, prefix_caching=True,
                                chunked_prefill=True,
                                dtypes=("float32", "bfloat16", "float16"))

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, "always available"

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "torch"
        if choice == "torch":
            from pagedllm.backends.cpu.attention import TorchPagedAttention

            return TorchPagedAttention
        if choice == "ipex":  # intel_extension_for_pytorch's CPU build (imported when used)
            from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

            return IpexPagedAttention
        raise ValueError(f"attention_backend={choice!r} is not available on cpu; "
                         "allowed: torch, ipex")

    def register_ops(self, ops: Ops) -> None:
        from pagedllm.backends.cpu import ops as cpu_ops

        ops.register("linear_prepare", cpu_ops.linear_prepare)
        ops.register("linear", cpu_ops.linear)
