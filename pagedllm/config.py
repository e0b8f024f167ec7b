"""Engine configuration: plain dataclasses validated in __post_init__. No torch import here.

Values that depend on the hardware (the dtype for "auto", the number of KV blocks) are filled in
by the backend (``Backend.check_and_update_config``) and the worker's memory profiling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm import envs

DTYPES = ("auto", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                  "bf16": "bfloat16"}
PREEMPTION_MODES = (None, "recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")
# weight quantization methods (models/layers/quantization; vLLM's names) and KV-cache dtypes
QUANTIZATION_METHODS = (None, "awq", "gptq", "compressed-tensors", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# the attention implementation when none is given (like vLLM's VLLM_ATTENTION_BACKEND)
ATTENTION_BACKEND_ENV = "PAGEDLLM_ATTENTION_BACKEND"


def _check(cond: bool, name: str, value: object, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def normalize_dtype(dtype: str) -> str:
    dtype = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    dtype = dtype.removeprefix("torch.")
    _check(dtype in DTYPES, "dtype", dtype, f"allowed values are {', '.join(DTYPES)}")
    return dtype


@dataclass
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str = "auto"  # resolved to a concrete name by the backend
    max_model_len: int = 0  # resolved from the checkpoint when 0
    seed: int = 0
    load_format: str = "auto"
    hf_config: Any = field(default=None, repr=False)
    # None: the checkpoint's quantization_config decides; a name forces (or checks) the method
    quantization: str | None = None

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        _check(self.quantization in QUANTIZATION_METHODS, "quantization", self.quantization,
               "allowed values are " + ", ".join(map(repr, QUANTIZATION_METHODS)))
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format,
               f"allowed values are {', '.join(LOAD_FORMATS)}")
        _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")

    def get_num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def get_num_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    def get_num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.get_num_heads())

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim or self.hf_config.hidden_size // self.get_num_heads())

    def get_vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space_gib: float = 4.0
    kv_cache_space_gib: float | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = False
    # "auto": the model dtype; "fp8" (= "fp8_e4m3"): e4m3 values with per-tensor k/v scales
    cache_dtype: str = "auto"
    # set once the worker has sized the cache
    num_device_blocks: int = 0
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        _check(isinstance(self.block_size, int) and self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
               "block_size", self.block_size, "allowed values are 1, 2, 4, 8, 16, 32, 64, 128")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        _check(self.swap_space_gib >= 0, "swap_space", self.swap_space_gib, "must be >= 0 (GiB)")
        _check(self.kv_cache_space_gib is None or self.kv_cache_space_gib > 0,
               "kv_cache_space_gib", self.kv_cache_space_gib, "must be > 0 (GiB) or None")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override > 0,
               "num_gpu_blocks_override", self.num_gpu_blocks_override, "must be > 0 or None")
        _check(self.cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.cache_dtype,
               f"allowed values are {', '.join(KV_CACHE_DTYPES)}")
        if self.cache_dtype == "fp8_e4m3":
            self.cache_dtype = "fp8"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 0  # resolved when 0
    max_model_len: int = 0
    enable_chunked_prefill: bool = False
    preemption_mode: str | None = None
    policy: str = "fcfs"
    # most distinct LoRA adapters running at once (LoRAConfig.max_loras, the workers' device
    # slots); 0: LoRA is off
    max_loras: int = 0
    # True when resolve() chose max_num_batched_tokens (none was given): a backend may then set
    # its own default in check_and_update_config (cpu: chunked prefill, 4096 tokens per step)
    budget_defaulted: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        _check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs",
               self.max_num_seqs, "must be an integer >= 1")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
               "allowed values are 'recompute', 'swap' or None")
        _check(self.policy in SCHEDULING_POLICIES, "scheduling_policy", self.policy,
               f"allowed values are {', '.join(SCHEDULING_POLICIES)}")

    def resolve(self, max_model_len: int) -> None:
        """Fill the token budget once the model length is known, and check it against it."""
        self.max_model_len = max_model_len
        if not self.max_num_batched_tokens:
            self.budget_defaulted = True
            self.max_num_batched_tokens = (max(2048, self.max_num_seqs) if self.enable_chunked_prefill
                                           else max(max_model_len, 2048, self.max_num_seqs))
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               self.max_num_batched_tokens, f"must be >= max_num_seqs ({self.max_num_seqs})")
        if not self.enable_chunked_prefill:
            _check(self.max_num_batched_tokens >= max_model_len, "max_num_batched_tokens",
                   self.max_num_batched_tokens,
                   f"must be >= max_model_len ({max_model_len}) unless enable_chunked_prefill=True")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # contiguous layer stages, each a worker (or a TP group of workers); ranks are
    # pp_rank * tensor_parallel_size + tp_rank
    pipeline_parallel_size: int = 1
    # layer counts per stage (vLLM's VLLM_PP_LAYER_PARTITION), summing to the model's layers
    # (checked against the model in engine/config_validation.py); None: an even split
    pp_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
               "tensor_parallel_size", self.tensor_parallel_size, "must be an integer >= 1")
        _check(isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
               "pipeline_parallel_size", self.pipeline_parallel_size, "must be an integer >= 1")
        _check(self.distributed_executor_backend in EXECUTOR_BACKENDS,
               "distributed_executor_backend", self.distributed_executor_backend,
               "allowed values are 'uni', 'mp', 'ray' or None")
        if self.pp_layer_partition is not None:
            counts = self.pp_layer_partition
            if isinstance(counts, str):  # "3,5" as the CLI and the old variable spell it
                counts = [c.strip() for c in counts.split(",") if c.strip()]
            try:
                counts = tuple(int(c) for c in counts)
            except (TypeError, ValueError):
                counts = ()
            _check(bool(counts) and all(c >= 1 for c in counts), "pp_layer_partition",
                   self.pp_layer_partition, "must be layer counts, each an integer >= 1, one per "
                   "pipeline stage (e.g. 3,5)")
            _check(len(counts) == self.pipeline_parallel_size, "pp_layer_partition",
                   self.pp_layer_partition, f"it names {len(counts)} stages but "
                   f"pipeline_parallel_size={self.pipeline_parallel_size}; give one layer "
                   "count per stage")
            self.pp_layer_partition = counts
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        _check(self.world_size == 1 or self.distributed_executor_backend != "uni",
               "distributed_executor_backend", self.distributed_executor_backend,
               "'uni' runs one worker; with tensor_parallel_size * pipeline_parallel_size = "
               f"{self.world_size} use 'mp' or 'ray'")

    @property
    def world_size(self) -> int:
        """Workers in all: tensor_parallel_size * pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "auto"  # resolved to a backend name
    enforce_eager: bool = False
    attention_backend: str | None = None  # a backend-specific attention implementation name
    # schedule step N+1 while step N runs (backends with capabilities.async_output); True = never
    disable_async_output_proc: bool = False
    # the grammar engine for guided decoding (engine/guided); vLLM's name
    guided_decoding_backend: str = "xgrammar"
    # speculative decoding (pagedllm.spec_decode.SpeculativeConfig), None: off
    speculative_config: Any = None
    # LoRA adapters (pagedllm.lora.config.LoRAConfig), None: off (enable_lora=False)
    lora_config: Any = None
    # KV offload tiers (pagedllm.kv_offload.config.KVOffloadConfig) and a KV connector
    # (pagedllm.kv_transfer.config.KVTransferConfig); None: off
    kv_offload_config: Any = None
    kv_transfer_config: Any = None

    def __post_init__(self) -> None:
        if self.guided_decoding_backend not in ("xgrammar", "auto"):
            raise ValueError(f"guided_decoding_backend={self.guided_decoding_backend!r} is "
                             f"invalid: allowed: xgrammar, auto")
        if self.attention_backend is None:  # unset: $PAGEDLLM_ATTENTION_BACKEND, else the default
            self.attention_backend = envs.PAGEDLLM_ATTENTION_BACKEND
        if self.lora_config is not None:  # the scheduler keeps to the workers' adapter slots
            self.scheduler.max_loras = self.lora_config.max_loras
