"""The xpu backend: Intel GPUs through torch.xpu and intel_extension_for_pytorch (IPEX).

Attention is IPEX's paged attention (``PagedAttention.reshape_and_cache`` for KV writes,
``single_query_cached_kv_attention`` for decode, ``flash_attn_varlen_func`` for prefill over
cached context; the decode of a layer with a window and a soft cap, which IPEX's kernel refuses,
is torch over the same cache): the same class as the cpu backend's ``attention_backend="ipex"``
(cpu/ipex_attention.py), which is how this path is tested without the card: IPEX's CPU build
runs those ops on the host. Block copy and swap are the contract's torch ops (blocks on dim 1).
Neither torch.xpu's devices nor IPEX are touched until the backend is probed or used.
"""
from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from pagedllm.contract.backend import Backend
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.attention import AttentionImpl

IPEX_HINT = "pip install intel-extension-for-pytorch, the XPU build matching your torch"


class XpuBackend(Backend):
    name = "xpu"
    torch_device = "xpu"
    dist_backend = "ccl"  # oneCCL (oneccl_bindings_for_pytorch)
    default_dtype = "bfloat16"
    capabilities = Capabilities(graphs=False, swap=True, static_shapes=False,
                                head_sizes=(64, 80, 96, 112, 128, 256), max_gqa_group=8,
                                prefix_caching=True, chunked_prefill=True,
                                dtypes=("bfloat16", "float16", "float32"),
                                preferred_block_size=16, block_sizes=(16, 32, 64),
                                # IPEX's kernels run windows and soft caps; a layer with both
                                # (Gemma 2's sliding ones) decodes in torch over the same cache
                                # (cpu/ipex_attention.py: torch_decode)
                                attention_features=("sliding_window", "logits_soft_cap"))
    worker_class = "pagedllm.backends.xpu.worker:XpuWorker"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if importlib.util.find_spec("intel_extension_for_pytorch") is None:
            return False, f"intel_extension_for_pytorch is not installed; {IPEX_HINT}"
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        xpu = getattr(torch, "xpu", None)
        try:
            count = xpu.device_count() if xpu is not None and xpu.is_available() else 0
        except Exception as exc:  # a broken driver must not break the backend table
            return False, f"cannot query Intel GPUs: {type(exc).__name__}: {exc}"
        if count == 0:
            return False, (f"no Intel GPU is visible (torch {torch.__version__}: "
                           "torch.xpu.is_available() is False); IPEX's CPU build runs this "
                           "backend's attention on the cpu backend: attention_backend='ipex'")
        return True, f"{count} Intel GPU(s): {xpu.get_device_name(0)}"

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "ipex"
        if choice == "ipex":
            from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

            return IpexPagedAttention
        if choice == "torch":
            from pagedllm.reference.attention import TorchPagedAttention

            return TorchPagedAttention
        raise ValueError(f"attention_backend={choice!r} is not available on xpu; "
                         "allowed: ipex, torch")

    def device_count(self) -> int:
        import torch

        return torch.xpu.device_count()

    def host_pin_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        import torch

        torch.xpu.synchronize()
