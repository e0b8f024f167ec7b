"""The device-side half of the engine: owns the model shard and the KV cache on one device.

Backends subclass ``Worker`` to change what differs on their hardware (device selection, how much
memory the cache may take, graph capture, input padding); the defaults here are plain torch.
"""
from __future__ import annotations

import logging
import math
from collections import Counter

import torch
from torch import nn

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput, StepDelta
from pagedllm.distributed.parallel_state import PPGroup, TPGroup
from pagedllm.models.layers.linear import LayerContext
from pagedllm.models.layers.pipeline import get_pp_indices
from pagedllm.models.loader import load_model
from pagedllm.reference.ops import Ops
from pagedllm.worker.host_memory import lazy_zeros
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.pending import PendingOutputs
from pagedllm.worker.seq_states import SeqStates

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_KV_CACHE_GIB = 4.0


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class Worker:
    # a static-shape backend's worker sets this where its runner's forward_rows pads
    # speculative decoding's verification steps to its buckets (engine/speculative.py asks)
    pads_verification_steps = False

    def __init__(self, config: EngineConfig, backend: Backend, rank: int = 0,
                 tp: TPGroup | None = None, pp: PPGroup | None = None) -> None:
        self.config = config
        self.backend = backend
        self.rank = rank
        self.tp = tp or TPGroup()
        self.pp = pp or PPGroup()
        # this stage's decoder layers [start, end): it holds their weights and KV cache only
        self.layer_range = get_pp_indices(config.model.get_num_layers(), self.pp.rank,
                                          self.pp.size, config.parallel.pp_layer_partition)
        self.num_layers = self.layer_range[1] - self.layer_range[0]
        # one KV cache (and host swap space) per virtual engine: the batches of different
        # engines are in flight in different stages at once (vLLM 0.7's virtual engines)
        self.num_virtual_engines = config.parallel.pipeline_parallel_size
        self.ve_kv_caches: list[list[torch.Tensor]] = []
        self.ve_host_caches: list[list[torch.Tensor]] = []
        self.dtype = torch_dtype(config.model.dtype)
        # kv_cache_dtype="fp8": e4m3 values (the attention scales them); else the model dtype
        self.cache_dtype = (torch.float8_e4m3fn if config.cache.cache_dtype == "fp8"
                            else self.dtype)
        self.device = self.select_device()
        self.model: nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.host_caches: list[torch.Tensor] = []
        self.num_host_blocks = 0
        self.cache_ops = backend.cache_ops()
        self.attn_cls = backend.attention_cls(config)
        # what the worker did, for the conformance suite's claim checks (docs/porting.md):
        # launches / returned_before_done (async_output), graph_captures / graph_replays (graphs)
        self.counters: Counter[str] = Counter()
        # every live sequence's parameters, block table and (where sampling reads it) tokens:
        # the executor sends each step as the change to this (execute_step)
        self.seq_states = SeqStates()
        # LoRA adapters' host cache and device slots (pagedllm/lora), with enable_lora=True
        self.lora_manager = None
        # KV connectors' / offload tiers' worker side (kv_transfer/worker_side.KVWorkerRunner),
        # opened by the engine (kv_connector_call("init", ...)) once the cache exists
        self.kv_connector = None

    # --- hooks a backend may override ----------------------------------------------------
    def select_device(self) -> torch.device:
        return torch.device(self.backend.torch_device)

    def available_kv_bytes(self) -> int:
        """Bytes the device KV cache may take (after the model is loaded)."""
        gib = self.config.cache.kv_cache_space_gib
        return int((gib if gib is not None else DEFAULT_KV_CACHE_GIB) * GiB)

    def allocate_device_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's zeroed KV cache on the device."""
        if self.device.type == "cpu":
            return lazy_zeros(shape, self.cache_dtype)
        return torch.zeros(shape, dtype=self.cache_dtype, device=self.device)

    def allocate_host_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's host swap space (pinned where the backend asks for it)."""
        if self.backend.host_pin_memory():
            return torch.zeros(shape, dtype=self.cache_dtype, pin_memory=True)
        return lazy_zeros(shape, self.cache_dtype)

    def after_cache_init(self) -> None:
        """Called once the caches exist (e.g. to warm up or capture graphs)."""

    def run_model(self, batch: ScheduledBatch) -> list[SeqOutput]:
        assert self.runner is not None
        return self.runner.execute(batch, self.kv_caches)

    def run_stage(self, batch: ScheduledBatch) -> list[SeqOutput] | None:
        """This pipeline stage's share of the step (pipeline_parallel_size > 1): samples on the
        last stage, None on the others."""
        assert self.runner is not None
        return self.runner.execute_stage(batch, self.ve_kv_caches[batch.virtual_engine], self.pp)

    def release_device_memory(self) -> None:
        """Called by ``release`` once the model and caches are dropped (e.g. return the
        caching allocator's blocks to the device)."""

    def release(self) -> None:
        """Drop the model, the runner and every KV cache (engine shutdown); idempotent. The
        counters stay readable."""
        self.model = self.runner = None
        if self.kv_connector is not None:
            self.kv_connector_call("close")
        self.kv_caches, self.host_caches = [], []
        self.ve_kv_caches, self.ve_host_caches = [], []
        self.release_device_memory()

    def launch_model(self, batch: ScheduledBatch) -> PendingOutputs:
        """Queue the step on the device and return without waiting for it (backends with
        ``capabilities.async_output``); this default runs it to completion."""
        return PendingOutputs(self.run_model(batch))

    # --- lifecycle -----------------------------------------------------------------------
    def load_model(self) -> None:
        ops = Ops()
        self.backend.register_ops(ops)
        ctx = LayerContext(ops=ops, tp=self.tp, dtype=self.dtype, device=self.device,
                           attn_cls=self.attn_cls, pp=self.pp,
                           layer_partition=self.config.parallel.pp_layer_partition)
        with torch.inference_mode():
            self.model = load_model(self.config.model, ctx)
        self.runner = ModelRunner(self.model, self.config.cache.block_size, self.device,
                                  self.config.model.seed, ops.greedy_logprobs,
                                  ops.apply_token_bitmask)
        if getattr(self.config, "lora_config", None) is not None:
            from pagedllm.lora.worker_manager import LoRAWorkerManager

            self.lora_manager = LoRAWorkerManager(
                self.model, self.config, self.tp, self.pp, self.device, self.dtype,
                graph_safe=self.backend.capabilities.graphs and not self.config.enforce_eager)

    # --- LoRA adapters (the executor's add_lora / remove_lora / list_loras) -------------------
    def add_lora(self, request: object) -> bool:
        """Load an adapter into the host cache ahead of its requests."""
        assert self.lora_manager is not None, "enable_lora=False"
        return self.lora_manager.add_lora(request)  # type: ignore[arg-type]

    def remove_lora(self, lora_int_id: int) -> bool:
        assert self.lora_manager is not None, "enable_lora=False"
        return self.lora_manager.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.lora_manager.list_loras() if self.lora_manager is not None else []

    # --- KV connectors / offload tiers (the engine's kv_transfer/engine.py) -------------------
    def kv_connector_call(self, method: str, *args: object) -> object:
        """"init" opens the connectors' stores on this worker (returns slots per store);
        "apply" runs block moves now; other names are KVWorkerRunner methods."""
        from pagedllm.kv_transfer.worker_side import worker_call

        return worker_call(self, method, *args)

    def profile_run(self, max_tokens: int | None = None) -> None:
        """One forward + sample at the largest batch the scheduler may send (for memory sizing),
        or at ``max_tokens`` tokens where that is smaller.

        Uses a throwaway cache just big enough for the dummy batch.
        """
        from pagedllm.core.batch import ScheduledBatch, ScheduledSeq
        from pagedllm.sampling_params import SamplingParams

        sched = self.config.scheduler
        bs = self.config.cache.block_size
        tokens = sched.max_num_batched_tokens
        if max_tokens is not None:
            tokens = min(tokens, max_tokens)
        num_seqs = max(1, min(sched.max_num_seqs, tokens))
        # no sequence is longer than the model (its positions index the rotary tables)
        tokens = min(tokens, num_seqs * self.config.model.max_model_len)
        per_seq = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        seqs, next_block = [], 0
        for n in sorted(per_seq, reverse=True):
            blocks = -(-n // bs)
            seqs.append(ScheduledSeq(seq_id=len(seqs), token_ids=[0] * n, start_pos=0,
                                     block_table=list(range(next_block, next_block + blocks)),
                                     sampling_params=params, num_samples=1, prompt_len=n))
            next_block += blocks
        caches = [torch.zeros(self.kv_layer_shape(next_block), dtype=self.cache_dtype,
                              device=self.device)
                  for _ in range(self.num_layers)]
        assert self.runner is not None
        if self.pp.size > 1:  # every stage profiles at once: activations pass along the pipeline
            self.runner.execute_stage(ScheduledBatch(seqs=seqs), caches, self.pp)
        else:
            self.runner.execute(ScheduledBatch(seqs=seqs), caches)
        del caches

    def kv_layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.config.model
        kv_heads = max(1, m.get_num_kv_heads() // self.tp.size)
        return self.attn_cls.kv_cache_shape(num_blocks, self.config.cache.block_size, kv_heads,
                                            m.get_head_size())

    def block_bytes(self) -> int:
        per_layer = math.prod(self.kv_layer_shape(1)) * self.cache_dtype.itemsize
        return per_layer * self.num_layers * self.num_virtual_engines

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks) per virtual engine, from the memory budget."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            num_device = cache.num_gpu_blocks_override // self.num_virtual_engines
        else:
            num_device = self.available_kv_bytes() // self.block_bytes()
        num_host = int(cache.swap_space_gib * GiB) // self.block_bytes() if self.backend.capabilities.swap else 0
        return int(num_device), int(num_host)

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        """``num_device_blocks`` / ``num_host_blocks`` per virtual engine."""
        shape = self.kv_layer_shape(num_device_blocks)
        self.ve_kv_caches = [[self.allocate_device_cache(shape) for _ in range(self.num_layers)]
                             for _ in range(self.num_virtual_engines)]
        self.kv_caches = self.ve_kv_caches[0]
        self.num_host_blocks = num_host_blocks  # host caches are allocated on first swap-out
        self.ve_host_caches = [[] for _ in range(self.num_virtual_engines)]
        self.after_cache_init()

    def _host(self, virtual_engine: int = 0) -> list[torch.Tensor]:
        if not self.ve_host_caches[virtual_engine] and self.num_host_blocks > 0:
            shape = self.kv_layer_shape(self.num_host_blocks)
            self.ve_host_caches[virtual_engine] = [self.allocate_host_cache(shape)
                                                   for _ in range(self.num_layers)]
        self.host_caches = self.ve_host_caches[0]
        return self.ve_host_caches[virtual_engine]

    def execute_step(self, step: StepDelta) -> list[SeqOutput] | None:
        """``execute`` of the batch that ``step`` makes with the kept per-sequence state."""
        return self.execute(self.seq_states.apply(step))

    def execute_step_async(self, step: StepDelta) -> PendingOutputs:
        """``execute_async`` of the batch that ``step`` makes with the kept state."""
        return self.execute_async(self.seq_states.apply(step))

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[SeqOutput] | None:
        """Apply the batch's block moves, then run the model; only rank 0 returns samples."""
        self._move_blocks(batch)
        if not batch.seqs:
            return []
        if self.lora_manager is not None:
            self.lora_manager.prepare(batch)
        if self.pp.size > 1:
            outputs = self.run_stage(batch)
        else:
            outputs = self.run_model(batch)
        return outputs if self.is_output_rank else None

    @property
    def is_output_rank(self) -> bool:
        """The rank whose samples the executor returns: TP rank 0 of the last stage."""
        return self.tp.rank == 0 and self.pp.is_last

    @torch.inference_mode()
    def execute_async(self, batch: ScheduledBatch) -> PendingOutputs:
        """``execute`` whose outputs resolve later: the device may still be running the step."""
        self._move_blocks(batch)
        if not batch.seqs:
            return PendingOutputs([])
        if self.lora_manager is not None:
            self.lora_manager.prepare(batch)
        pending = self.launch_model(batch)
        self.counters["launches"] += 1
        if not pending.done():  # the device was still running the step when launch returned
            self.counters["returned_before_done"] += 1
        return pending

    def _move_blocks(self, batch: ScheduledBatch) -> None:
        ops = self.cache_ops
        ve = batch.virtual_engine
        caches = self.ve_kv_caches[ve] if self.ve_kv_caches else self.kv_caches
        kv = self.kv_connector
        if kv is not None:  # saves of evicted blocks before anything overwrites them
            kv.before_moves(batch.kv_ops, caches)
        if batch.blocks_to_swap_out:
            ops.swap_blocks(caches, self._host(ve),
                            torch.tensor(batch.blocks_to_swap_out, dtype=torch.int64))
        if batch.blocks_to_swap_in:
            ops.swap_blocks(self._host(ve), caches,
                            torch.tensor(batch.blocks_to_swap_in, dtype=torch.int64))
        if batch.blocks_to_copy:
            ops.copy_blocks(caches, torch.tensor(batch.blocks_to_copy, dtype=torch.int64,
                                                 device=self.device))
        if kv is not None:  # loads into freshly allocated blocks, overlapping the forward
            kv.after_moves(batch.kv_ops, caches)
