"""EngineArgs: the user-facing knobs (same names as vLLM), turned into an EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)

DEMO_MODEL = "pagedllm-demo"


@dataclass
class EngineArgs:
    model: str = DEMO_MODEL
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_space_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    swap_space: float = 4.0
    preemption_mode: str | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    load_format: str = "auto"
    scheduling_policy: str = "fcfs"
    distributed_executor_backend: str | None = None
    attention_backend: str | None = None
    disable_async_output_proc: bool = False

    # --- CLI -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Every field as a kebab-case flag (``--max-model-len``); bools are switches."""
        hints = get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            hint = str(hints[f.name])
            if hints[f.name] is bool or hint.startswith("bool"):
                parser.add_argument(flag, action="store_true", default=f.default)
                continue
            kind = int if "int" in hint else float if "float" in hint else str
            parser.add_argument(flag, type=kind, default=f.default)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # --- config --------------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        model = ModelConfig(model=model_path, tokenizer=resolve_model_path(self.tokenizer or self.model),
                            dtype=self.dtype, seed=self.seed, load_format=self.load_format,
                            hf_config=hf_config)
        model.max_model_len = derive_max_model_len(hf_config, self.max_model_len)
        cache = CacheConfig(block_size=self.block_size,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            swap_space_gib=self.swap_space,
                            kv_cache_space_gib=self.kv_cache_space_gib,
                            num_gpu_blocks_override=self.num_gpu_blocks_override,
                            enable_prefix_caching=self.enable_prefix_caching)
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens or 0,
                                enable_chunked_prefill=self.enable_chunked_prefill,
                                preemption_mode=self.preemption_mode,
                                policy=self.scheduling_policy)
        sched.resolve(model.max_model_len)
        parallel = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                  distributed_executor_backend=self.distributed_executor_backend)
        return EngineConfig(model=model, cache=cache, scheduler=sched, parallel=parallel,
                            device=self.device, enforce_eager=self.enforce_eager,
                            attention_backend=self.attention_backend,
                            disable_async_output_proc=self.disable_async_output_proc)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


@dataclass
class AsyncEngineArgs(EngineArgs):
    disable_log_requests: bool = False


def resolve_model_path(model: str) -> str:
    """A local folder; the name ``pagedllm-demo`` is the built-in model. No hub downloads."""
    if model == DEMO_MODEL:
        from pagedllm.models.demo import demo_model_path

        return demo_model_path()
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise ValueError(f"model={model!r} is not a local folder; pagedllm loads Hugging Face "
                         f"checkpoints from disk only (or use model={DEMO_MODEL!r})")
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
    window = getattr(hf_config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # attention equals full attention within the window
    if requested is None:
        return limit
    if not isinstance(requested, int) or requested < 1 or requested > limit:
        raise ValueError(f"max_model_len={requested!r} is invalid: must be an integer in "
                         f"[1, {limit}] for this model")
    return requested
