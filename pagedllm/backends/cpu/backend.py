"""The cpu backend: torch (oneDNN for linears) plus C++ kernels (csrc/cpu: decode attention, cache
writes, fused float32/bf16/fp16 layer ops, the greedy sampler), KV cache sized in GiB."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedllm.contract.attention import AttentionImpl
from pagedllm.contract.backend import Backend
from pagedllm.contract.cache_ops import CacheOps
from pagedllm.contract.capabilities import Capabilities

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.reference.ops import Ops

logger = logging.getLogger(__name__)
ATTENTION_CHOICES = ("native", "torch", "ipex")
CPU_MAX_NUM_BATCHED_TOKENS = 4096  # the default token budget per step (no budget given)


class CpuBackend(Backend):
    name = "cpu"
    torch_device = "cpu"
    dist_backend = "gloo"
    default_dtype = "float32"
    capabilities = Capabilities(graphs=False, swap=True, static_shapes=False, prefix_caching=True,
                                chunked_prefill=True,
                                # both attentions (torch, native C++) sweep clean over these
                                head_sizes=(16, 32, 40, 64, 72, 80, 96, 112, 128, 192, 256),
                                max_gqa_group=None,
                                # the torch attention has both; attention_cls picks it when the
                                # model needs one the native kernels do not declare
                                attention_features=("sliding_window", "logits_soft_cap"),
                                dtypes=("float32", "bfloat16", "float16"), pipeline_parallel=True,
                                quantizations=("awq", "gptq", "compressed-tensors", "fp8"),
                                kv_cache_dtypes=("auto", "fp8"),
                                lora=True,  # LoRA: one GEMM per adapter in use (lora_ops.py)
                                # block export/import: cache_ops.py (the reference
                                # takes layer-major staging views too)
                                kv_export=True, kv_export_layer_major=True)
    worker_class = "pagedllm.backends.cpu.worker:CpuWorker"

    native_ops = True  # the csrc/cpu layer ops where they load; False for attention_backend="torch"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, "always available"

    def cache_ops(self) -> CacheOps:
        from pagedllm.backends.cpu.cache_ops import CpuCacheOps

        return CpuCacheOps()

    def attention_cls(self, config: EngineConfig) -> type[AttentionImpl]:
        """"native" (the default where its kernels build), "torch" (the reference) or "ipex".

        The default is "torch" for a model needing an attention feature (sliding window, soft
        cap) the native kernels do not declare; an explicit choice lacking one is refused.
        kv_cache_dtype="fp8" runs the torch attention (the only one reading e4m3 caches)."""
        # (a config without a cache part, as some callers build, means the model dtype)
        fp8_cache = getattr(getattr(config, "cache", None), "cache_dtype", "auto") == "fp8"
        if fp8_cache and config.attention_backend not in (None, "torch"):
            raise ValueError(f"attention_backend={config.attention_backend!r} does not support "
                             f"kv_cache_dtype='fp8'; use attention_backend='torch' (or unset)")
        choice = "torch" if fp8_cache else config.attention_backend or _default_attention()
        cls = self._attention_by_name(choice)
        needed = _features_needed(config)
        missing = cls.missing_features(needed)
        if missing and config.attention_backend is None and choice != "torch":
            logger.info("cpu: the %s attention lacks %s; running the torch attention",
                        choice, ", ".join(missing))
            return self._attention_by_name("torch")
        if missing:
            raise ValueError(f"attention_backend={choice!r} does not support {', '.join(missing)} "
                             f"(needed by this model); use attention_backend='torch'")
        return cls

    def _attention_by_name(self, choice: str) -> type[AttentionImpl]:
        if choice == "native":  # C++ decode (csrc/cpu); raises with the reason if it cannot build
            from pagedllm.backends.cpu.kernels import CORE, load_cpu_kernels
            from pagedllm.backends.cpu.native_attention import CpuNativePagedAttention

            load_cpu_kernels(*CORE)
            return CpuNativePagedAttention
        if choice == "torch":
            from pagedllm.reference.attention import TorchPagedAttention

            return TorchPagedAttention
        if choice == "ipex":  # intel_extension_for_pytorch's CPU build (imported when used)
            from pagedllm.backends.cpu.ipex_attention import IpexPagedAttention

            return IpexPagedAttention
        raise ValueError(f"attention_backend={choice!r} is not available on cpu; "
                         f"allowed: {', '.join(ATTENTION_CHOICES)}")

    def check_and_update_config(self, config: EngineConfig) -> None:
        super().check_and_update_config(config)
        sched = config.scheduler
        if getattr(sched, "budget_defaulted", False):
            # no max_num_batched_tokens given: vLLM's V1 engine on CPU (chunked prefill, 4096
            # tokens per step): prefills fill large GEMMs, decodes ride along in the same step
            sched.enable_chunked_prefill = True
            sched.max_num_batched_tokens = max(CPU_MAX_NUM_BATCHED_TOKENS, sched.max_num_seqs)
        # attention_backend="torch" asks for the torch reference throughout, layer ops included
        self.native_ops = config.attention_backend != "torch"
        lora = getattr(config, "lora_config", None)
        if lora is not None and lora.lora_dtype == "auto" and config.model.dtype != "float32":
            # half-precision GEMMs are slow where oneDNN has no native ones (ops.py): LoRA's
            # small products run in float32 (slots widened once, activations per op)
            lora.lora_dtype = "float32"

    def register_ops(self, ops: Ops) -> None:
        """oneDNN linears with pre-packed weights (ops.py); rms_norm, rotary and silu_and_mul on
        the csrc/cpu layer kernels (float32, bfloat16, float16) and greedy_logprobs on the csrc/cpu
        sampler (layer_ops.py) and apply_token_bitmask on the csrc/cpu mask kernel (bitmask.py)
        where the cpu kernels load, unless attention_backend="torch"."""
        from pagedllm.backends.cpu import ops as cpu_ops
        from pagedllm.backends.cpu import quant_ops
        from pagedllm.backends.cpu import fused_moe

        ops.register("linear_prepare", cpu_ops.linear_prepare)
        ops.register("linear", cpu_ops.linear)
        quant_ops.register(ops)  # weight-only INT8 / INT4 kernels for quantized checkpoints
        # one sort by expert, each expert's GEMMs on weights packed after loading
        ops.register("fused_moe_prepare", fused_moe.fused_moe_prepare)
        ops.register("fused_moe", fused_moe.fused_moe)
        from pagedllm.backends.cpu import lora_ops

        ops.register("lora_shrink", lora_ops.lora_shrink)  # one GEMM per adapter in use
        ops.register("lora_expand", lora_ops.lora_expand)
        from pagedllm.backends.cpu import bitmask

        if bitmask.available():  # guided decoding's mask on xgrammar's C++ kernel
            ops.register("apply_token_bitmask", bitmask.apply_token_bitmask)
        kernels = _cpu_kernels() if self.native_ops else None
        if kernels is None:
            return
        from pagedllm.backends.cpu.layer_ops import layer_ops

        for name, fn in layer_ops(kernels).items():
            ops.register(name, fn)
        ops.register("apply_token_bitmask", bitmask.native_apply_token_bitmask(kernels))


_fallback_logged = False


def _cpu_kernels() -> Any:
    """torch.ops.pagedllm_cpu where the cpu kernels load (or build) here, else None, saying why
    once per process: a warning, or info when PAGEDLLM_CPU_KERNELS=0 asked for it."""
    global _fallback_logged
    from pagedllm.backends.cpu.kernels import CORE, cpu_kernels_disabled, load_cpu_kernels

    try:
        return load_cpu_kernels(*CORE)
    except RuntimeError as exc:
        if not _fallback_logged:
            _fallback_logged = True
            logger.log(logging.INFO if cpu_kernels_disabled() else logging.WARNING,
                       "the cpu backend runs the torch reference attention and layer ops: %s", exc)
        return None


def _features_needed(config: EngineConfig) -> tuple[str, ...]:
    """The attention features the configured model needs (models/registry.py)."""
    from pagedllm.models.registry import MODEL_REGISTRY

    hf_config = getattr(getattr(config, "model", None), "hf_config", None)
    archs = [a for a in getattr(hf_config, "architectures", None) or [] if a in MODEL_REGISTRY]
    # an unknown architecture is refused by the engine (engine/config_validation.py)
    return MODEL_REGISTRY[archs[0]].features_needed(hf_config) if archs else ()


def _default_attention() -> str:
    """"native" where the cpu kernels load, else "torch"."""
    return "native" if _cpu_kernels() is not None else "torch"
