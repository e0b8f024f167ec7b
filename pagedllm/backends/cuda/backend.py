"""The cuda backend: csrc/ paged-attention, cache and layer kernels, CUDA graphs for decode."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.backend import Backend
from pagedllm.contract.cache_ops import CacheOps
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.reference.ops import Ops

logger = logging.getLogger(__name__)


class CudaBackend(Backend):
    name = "cuda"
    torch_device = "cuda"
    dist_backend = "nccl"
    default_dtype = "bfloat16"
    capabilities = Capabilities(graphs=True, swap=True, static_shapes=False, prefix_caching=True,
                                # csrc/paged_attention.cu's head-size switch (64-256; its GQA
                                # tiles 1/4/8); 16-72 and 192 run the torch attention, eager
                                # (check_and_update_config): the engine refuses other sizes
                                head_sizes=(16, 32, 40, 64, 72, 80, 96, 112, 128, 192, 256),
                                max_gqa_group=8,
                                chunked_prefill=True, dtypes=("bfloat16", "float16", "float32"),
                                preferred_block_size=16, block_sizes=(16, 32), async_output=True,
                                pipeline_parallel=True,
                                # the decode kernel and the Triton prefill (and the torch path)
                                attention_features=("sliding_window", "logits_soft_cap"),
                                # FP8 on torch._scaled_mm, the rest the reference (quant_ops.py)
                                quantizations=("awq", "gptq", "compressed-tensors", "fp8"),
                                # fp8 (e4m3) K/V: the torch attention reads them (eager)
                                kv_cache_dtypes=("auto", "fp8"),
                                # LoRA's shrink/expand on Triton (triton_lora.py; graph-safe)
                                lora=True,
                                # block export/import on side streams (cache_ops.py);
                                # layer-major host pools: imports fenced layer by layer
                                kv_export=True, kv_export_layer_major=True)
    worker_class = "pagedllm.backends.cuda.worker:CudaWorker"
    # what differs between the CUDA and ROCm builds of the same sources (declared, not scattered)
    platform: ClassVar[str] = "cuda"
    warp_size: ClassVar[int] = 32
    # False once check_and_update_config sees attention_backend="torch": the run asked for no
    # csrc/ kernels, so the model ops stay torch too
    layer_kernels: bool = True

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        version = torch.version.hip if cls.platform == "rocm" else torch.version.cuda
        if not version:
            return False, (f"torch {torch.__version__} was built without "
                           f"{'ROCm (HIP)' if cls.platform == 'rocm' else 'CUDA'} support")
        try:
            count = torch.cuda.device_count()
        except Exception as exc:  # a broken driver must not break the backend table
            return False, f"cannot query devices: {exc}"
        if count == 0:
            return False, f"no {cls.platform.upper()} device is visible (device_count() == 0)"
        return True, f"{count} device(s), {cls.platform} {version}"

    def check_and_update_config(self, config: EngineConfig) -> None:
        """The decode kernel is compiled for a fixed set of head sizes; other models run on the
        torch attention (eager) unless the kernels were asked for by name."""
        super().check_and_update_config(config)
        from pagedllm.backends.cuda.checks import HEAD_SIZES

        # decided before the head-size fallback below: the layer kernels take any head size
        self.layer_kernels = config.attention_backend != "torch"
        _route_fp8_cache(config)

        head_size = config.model.get_head_size()
        if head_size in HEAD_SIZES or config.attention_backend == "torch":
            return
        if config.attention_backend == "kernels":
            raise ValueError(f"head_size={head_size} is not supported by the {self.name} attention "
                             f"kernels; supported: {HEAD_SIZES} (attention_backend='torch' runs "
                             "any head size)")
        logger.warning("head size %d has no %s attention kernel (compiled: %s); using the torch "
                       "attention, without CUDA graphs", head_size, self.name, HEAD_SIZES)
        config.attention_backend = "torch"
        config.enforce_eager = True

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        choice = config.attention_backend or "kernels"
        if choice == "kernels":
            from pagedllm.backends.cuda.attention import CudaPagedAttention

            return CudaPagedAttention
        if choice == "torch":
            from pagedllm.reference.attention import TorchPagedAttention

            return TorchPagedAttention
        raise ValueError(f"attention_backend={choice!r} is not available on {self.name}; "
                         "allowed: kernels, torch")

    def register_ops(self, ops: Ops) -> None:
        """Greedy sampling on a Triton kernel (triton_sampling.py); rms_norm, rotary and
        silu_and_mul on the csrc/ layer kernels for float16/bfloat16
        (float32 keeps the torch reference, which matches transformers exactly). Without the
        kernels (attention_backend="torch", or they cannot be loaded) the torch references stay."""
        from pagedllm.backends.cuda import quant_ops

        quant_ops.register(ops)  # quantized linears: FP8 on torch._scaled_mm
        try:  # Triton ships with CUDA and ROCm torch builds; without it the sampler stays torch
            from pagedllm.backends.cuda.triton_bitmask import apply_token_bitmask
            from pagedllm.backends.cuda.triton_sampling import greedy_logprobs
        except ImportError as exc:
            logger.warning("triton is unavailable (%s); greedy sampling runs torch ops", exc)
        else:
            ops.register("greedy_logprobs", greedy_logprobs)
            ops.register("apply_token_bitmask", apply_token_bitmask)  # guided decoding
            from pagedllm.backends.cuda.triton_rejection import rejection_sample

            ops.register("rejection_sample", rejection_sample)  # speculative decoding
            from pagedllm.backends.cuda.triton_moe import fused_moe

            ops.register("fused_moe", fused_moe)  # grouped by expert
            from pagedllm.backends.cuda import triton_lora

            ops.register("lora_shrink", triton_lora.lora_shrink)  # one launch for every adapter
            ops.register("lora_expand", triton_lora.lora_expand)
        if not self.layer_kernels:
            return
        from pagedllm.backends.cuda import ops as kernel_ops
        from pagedllm.backends.cuda.layer_ops import layer_ops

        ok, reason = kernel_ops.kernels_available(build=True)
        if not ok:
            logger.warning("the csrc/ layer kernels are unavailable (%s); rms_norm, rotary and "
                           "silu_and_mul run the torch reference ops", reason)
            return
        for name, fn in layer_ops(kernel_ops.load_kernels()).items():
            ops.register(name, fn)

    def cache_ops(self) -> CacheOps:
        from pagedllm.backends.cuda.cache_ops import KernelCacheOps

        return KernelCacheOps()

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def host_pin_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()


def _route_fp8_cache(config: EngineConfig) -> None:
    """kv_cache_dtype="fp8": the csrc/ decode kernel and the Triton prefill read caches in the
    model dtype, so e4m3 caches run the torch attention (any device), eager (its host-side
    checks cannot be captured); asking for the kernels by name is refused, naming both."""
    if getattr(getattr(config, "cache", None), "cache_dtype", "auto") != "fp8":
        return
    if config.attention_backend == "kernels":
        raise ValueError("attention_backend='kernels' does not support kv_cache_dtype='fp8'; use "
                         "attention_backend='torch' (or unset)")
    if config.attention_backend != "torch":
        logger.info("kv_cache_dtype='fp8': the torch attention reads the e4m3 cache (eager)")
    config.attention_backend = "torch"
    config.enforce_eager = True
