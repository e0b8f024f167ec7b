"""EngineArgs: the user-facing knobs (same names as vLLM), turned into an EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any

from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)
from pagedllm.config import DTYPES, LOAD_FORMATS, SCHEDULING_POLICIES
from pagedllm.engine.arg_cli import add_dataclass_args, dataclass_kwargs
from pagedllm.kv_offload.config import KVOffloadConfig
from pagedllm.kv_transfer.config import KVTransferConfig
from pagedllm.lora.config import LoRAConfig
from pagedllm.spec_decode.config import SpeculativeConfig

DEMO_MODEL = "pagedllm-demo"


@dataclass
class EngineArgs:
    model: str = field(default=DEMO_MODEL, metadata={
        "help": "Local Hugging Face checkpoint folder (config.json + safetensors or .bin), or "
                "'pagedllm-demo', the built-in model. No hub downloads."})
    tokenizer: str | None = field(default=None, metadata={
        "help": "Tokenizer folder (default: the model's folder)."})
    device: str = field(default="auto", metadata={
        "help": "Hardware backend: auto (the first available of cuda, rocm, tpu, xpu, hpu, "
                "cpu), one of those, or an installed plugin's name; 'pagedllm backends' lists "
                "what is available here."})
    dtype: str = field(default="auto", metadata={
        "help": "Weight and activation dtype; auto takes the checkpoint's torch_dtype where the "
                "backend supports it.",
        "choices": DTYPES})
    block_size: int = field(default=16, metadata={
        "help": "Tokens per KV-cache block.",
        "choices": (1, 2, 4, 8, 16, 32, 64, 128)})
    max_model_len: int | None = field(default=None, metadata={
        "help": "Longest prompt plus output, in tokens (default: the model's "
                "max_position_embeddings)."})
    max_num_seqs: int = field(default=256, metadata={
        "help": "Most sequences scheduled in one step."})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "Most tokens scheduled in one step (default: max(max_model_len, 2048), or 2048 "
                "with chunked prefill; on cpu 4096, with chunked prefill on)."})
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "Use this many KV-cache blocks instead of sizing the cache from free memory."})
    kv_cache_space_gib: float | None = field(default=None, metadata={
        "help": "KV-cache size in GiB (the cpu backend's sizing; default there: 4)."})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "Fraction of device memory for weights, activations and the KV cache, in (0, "
                "1]."})
    enable_prefix_caching: bool = field(default=False, metadata={
        "help": "Reuse the KV-cache blocks of prompt prefixes shared between requests."})
    enable_chunked_prefill: bool = field(default=False, metadata={
        "help": "Split long prompts over steps, batched with running decodes (on cpu it is on "
                "whenever --max-num-batched-tokens is not given, as in vLLM's V1 engine)."})
    swap_space: float = field(default=4.0, metadata={
        "help": "Host memory in GiB per device for KV blocks swapped out by preemption."})
    preemption_mode: str | None = field(default=None, metadata={
        "help": "What a sequence group preempted for lack of KV-cache space does: recompute "
                "(drop its blocks, prefill again) or swap (to host memory; default recompute).",
        "choices": ("recompute", "swap")})
    seed: int = field(default=0, metadata={
        "help": "Random seed for sampling and dummy weights."})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "Number of devices the model is sharded over."})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "Number of pipeline stages: the model's layers split into this many contiguous "
                "stages, one worker (or one tensor-parallel group) each; --pp-layer-partition "
                "sets an uneven split."})
    pp_layer_partition: list[int] | None = field(default=None, metadata={
        "help": "Layer counts of the pipeline stages, one per stage, summing to the model's "
                "layers, e.g. 3,5 (vLLM's VLLM_PP_LAYER_PARTITION); default: an even split."})
    enforce_eager: bool = field(default=False, metadata={
        "help": "Run every step eagerly; capture no graphs (CUDA graphs, HPU graphs)."})
    load_format: str = field(default="auto", metadata={
        "help": "Weight format: auto (safetensors, else .bin), safetensors, pt, or dummy "
                "(random weights).",
        "choices": LOAD_FORMATS})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs: first come, first served; priority: lower request priority values first.",
        "choices": SCHEDULING_POLICIES})
    distributed_executor_backend: str | None = field(default=None, metadata={
        "help": "How workers run with tensor_parallel_size > 1: uni (this process), mp (worker "
                "processes; the default) or ray (Ray actors).",
        "choices": ("uni", "mp", "ray")})
    attention_backend: str | None = field(default=None, metadata={
        "help": "A backend's attention implementation (cpu: native, torch, ipex; cuda/rocm: "
                "kernels, torch; tpu: xla; xpu: ipex; default: the backend's own)."})
    disable_async_output_proc: bool = field(default=False, metadata={
        "help": "Wait for each step's tokens before scheduling the next (cuda/rocm launch step "
                "N+1 while step N runs by default)."})
    guided_decoding_backend: str = field(default="xgrammar", metadata={
        "help": "Grammar engine for structured output (response_format, guided_*, required and "
                "named tool calls); auto picks xgrammar.",
        "choices": ("xgrammar", "auto")})
    quantization: str | None = field(default=None, metadata={
        "help": "Weight quantization method; default: the checkpoint's quantization_config. "
                "A method given must match the checkpoint's; fp8 quantizes a float checkpoint's "
                "linears to FP8 at load time.",
        "choices": ("awq", "gptq", "compressed-tensors", "fp8")})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV cache dtype: auto (the model dtype) or fp8 (= fp8_e4m3; e4m3 values with "
                "per-tensor k/v scales from the checkpoint, else 1.0).",
        "choices": ("auto", "fp8", "fp8_e4m3")})
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "Speculative decoding as JSON (vLLM's keys), e.g. '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4}', '{\"model\": DRAFT_DIR, "
                "\"num_speculative_tokens\": 4}' or '{\"method\": \"eagle\", \"model\": "
                "HEAD_DIR, \"num_speculative_tokens\": 4}'; default: off."})
    enable_lora: bool = field(default=False, metadata={
        "help": "Serve LoRA adapters (PEFT folders) on top of the base model: requests name "
                "one (lora_request, or the OpenAI model field with --lora-modules)."})
    max_loras: int = field(default=1, metadata={
        "help": "Most distinct LoRA adapters in one step (device slots allocated at start)."})
    max_lora_rank: int = field(default=16, metadata={
        "help": "Largest LoRA rank the slots hold; adapters of a higher rank are refused."})
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "LoRA adapters kept loaded in host memory (an LRU; default: max_loras)."})
    lora_dtype: str = field(default="auto", metadata={
        "help": "dtype of the LoRA slots; auto: the model dtype (the cpu backend computes a "
                "half-precision model's LoRA in float32).",
        "choices": ("auto", "float32", "float16", "bfloat16")})
    kv_offload_size: float = field(default=0.0, metadata={
        "help": "GiB of host memory for KV blocks evicted from the device prefix cache (an LRU "
                "tier below it: a prefix found there is loaded back instead of recomputed; "
                "turns prefix caching on); 0: none."})
    kv_offload_disk: str | None = field(default=None, metadata={
        "help": "Folder for a disk tier below the host tier (or below the device cache without "
                "one): evicted KV blocks go there in one file, removed at exit; default: none."})
    kv_offload_disk_size: float | None = field(default=None, metadata={
        "help": "GiB the disk tier may take (default 4 with --kv-offload-disk)."})
    kv_transfer_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "A KV connector as JSON (vLLM's keys), e.g. '{\"kv_connector\": "
                "\"SharedStorageConnector\", \"kv_role\": \"kv_producer\", "
                "\"kv_connector_extra_config\": {\"shared_storage_path\": DIR}}'; kv_role: "
                "kv_producer, kv_consumer or kv_both; default: none."})

    # --- CLI -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Every field as a kebab-case flag (``--max-model-len``) with the help text, default and
        choices of its metadata (pagedllm/engine/arg_cli.py); bools are switches."""
        add_dataclass_args(parser, cls, skip)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**dataclass_kwargs(cls, args))

    # --- config --------------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        tokenizer = (resolve_model_path(self.tokenizer, "tokenizer") if self.tokenizer
                     else model_path)
        model = ModelConfig(model=model_path, tokenizer=tokenizer,
                            dtype=self.dtype, seed=self.seed, load_format=self.load_format,
                            hf_config=hf_config, quantization=self.quantization)
        model.max_model_len = derive_max_model_len(hf_config, self.max_model_len)
        kv_offload, kv_transfer = self._kv_configs()
        cache = CacheConfig(block_size=self.block_size,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            swap_space_gib=self.swap_space,
                            kv_cache_space_gib=self.kv_cache_space_gib,
                            num_gpu_blocks_override=self.num_gpu_blocks_override,
                            enable_prefix_caching=(self.enable_prefix_caching
                                                   or kv_offload is not None
                                                   or kv_transfer is not None),
                            cache_dtype=self.kv_cache_dtype)
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens or 0,
                                enable_chunked_prefill=self.enable_chunked_prefill,
                                preemption_mode=self.preemption_mode,
                                policy=self.scheduling_policy)
        sched.resolve(model.max_model_len)
        parallel = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                  pipeline_parallel_size=self.pipeline_parallel_size,
                                  pp_layer_partition=self.pp_layer_partition,
                                  distributed_executor_backend=self.distributed_executor_backend)
        return EngineConfig(model=model, cache=cache, scheduler=sched, parallel=parallel,
                            device=self.device, enforce_eager=self.enforce_eager,
                            attention_backend=self.attention_backend,
                            disable_async_output_proc=self.disable_async_output_proc,
                            guided_decoding_backend=self.guided_decoding_backend,
                            speculative_config=SpeculativeConfig.from_value(
                                self.speculative_config),
                            lora_config=(LoRAConfig(max_loras=self.max_loras,
                                                    max_lora_rank=self.max_lora_rank,
                                                    max_cpu_loras=self.max_cpu_loras,
                                                    lora_dtype=self.lora_dtype)
                                         if self.enable_lora else None),
                            kv_offload_config=kv_offload, kv_transfer_config=kv_transfer)

    def _kv_configs(self) -> tuple[KVOffloadConfig | None, KVTransferConfig | None]:
        """The offload tiers and the KV connector; kv_transfer_config naming the offload
        connector gives its tier sizes in kv_connector_extra_config (kv_offload_size, ...)."""
        offload = KVOffloadConfig.from_args(self.kv_offload_size, self.kv_offload_disk,
                                            self.kv_offload_disk_size)
        transfer = KVTransferConfig.from_value(self.kv_transfer_config)
        if transfer is not None and transfer.kv_connector == "OffloadingConnector":
            extra = transfer.kv_connector_extra_config
            unknown = set(extra) - {"kv_offload_size", "kv_offload_disk", "kv_offload_disk_size"}
            if unknown:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown "
                                 f"key(s) {', '.join(sorted(unknown))} for OffloadingConnector; "
                                 "known: kv_offload_size, kv_offload_disk, kv_offload_disk_size")
            offload = offload or KVOffloadConfig.from_args(
                extra.get("kv_offload_size"), extra.get("kv_offload_disk"),
                extra.get("kv_offload_disk_size"))
            transfer = None
        return offload, transfer

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


@dataclass
class AsyncEngineArgs(EngineArgs):
    disable_log_requests: bool = field(default=False, metadata={
        "help": "Do not log each request's arrival and end."})


def resolve_model_path(model: str, name: str = "model") -> str:
    """A local folder; the name ``pagedllm-demo`` is the built-in model. No hub downloads.
    ``name`` is the argument the path came from, for the error."""
    if model == DEMO_MODEL:
        from pagedllm.models.demo import demo_model_path

        return demo_model_path()
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise ValueError(f"{name}={model!r} is not a local folder; pagedllm loads Hugging Face "
                         f"checkpoints from disk only (or use {name}={DEMO_MODEL!r})")
    return path


def load_hf_config(path: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def derive_max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    if limit is None:
        limit = 2048
    from pagedllm.models.layers.rotary import rope_scaled_max_len

    limit = rope_scaled_max_len(hf_config, limit)  # linear / dynamic / yarn scaling
    window = getattr(hf_config, "sliding_window", None)
    if (isinstance(window, int) and window > 0 and getattr(hf_config, "use_sliding_window", True)
            and not _runs_sliding_window(hf_config)):
        limit = min(limit, window)  # attention equals full attention within the window
    if requested is None:
        return limit
    if not isinstance(requested, int) or requested < 1 or requested > limit:
        raise ValueError(f"max_model_len={requested!r} is invalid: must be an integer in "
                         f"[1, {limit}] for this model")
    return requested


def _runs_sliding_window(hf_config: Any) -> bool:
    """Whether the registered model class of this config applies its sliding window (else the
    model length is capped to the window, where full attention equals windowed attention)."""
    from pagedllm.models.registry import MODEL_REGISTRY

    archs = getattr(hf_config, "architectures", None) or []
    return any("sliding_window" in MODEL_REGISTRY[a].features for a in archs if a in MODEL_REGISTRY)
