"""Executors run the worker(s): in this process, in worker processes, or on Ray actors."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.executor.step_encoder import StepEncoder
from pagedllm.worker.pending import PendingOutputs


class Executor(ABC):
    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        # each batch goes to the workers as a StepDelta: what they do not already hold
        self.encoder = StepEncoder(config.cache.block_size)

    @abstractmethod
    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks): the minimum over all workers."""

    @abstractmethod
    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None: ...

    @abstractmethod
    def execute(self, batch: ScheduledBatch) -> list[SeqOutput]: ...

    # Whether execute_async returns before the device finishes (then the engine schedules the
    # next step while this one runs); the default below runs the step to completion.
    supports_async = False

    def execute_async(self, batch: ScheduledBatch) -> PendingOutputs:
        return PendingOutputs(self.execute(batch))

    def submit(self, batch: ScheduledBatch) -> PendingOutputs:
        """Start ``batch`` and return at once where the executor can (pipeline stages run
        batches of different virtual engines at the same time); ``result()`` calls must come in
        submission order. This default runs the step to completion."""
        return PendingOutputs(self.execute(batch))

    # --- LoRA adapters (enable_lora=True): every worker loads its shard -----------------
    def add_lora(self, request: object) -> bool:
        """Load an adapter (pagedllm.lora.request.LoRARequest) into every worker's host cache."""
        raise NotImplementedError(f"{type(self).__name__} does not run LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        raise NotImplementedError(f"{type(self).__name__} does not run LoRA adapters")

    def list_loras(self) -> set[int]:
        raise NotImplementedError(f"{type(self).__name__} does not run LoRA adapters")

    # --- KV connectors / offload tiers (kv_transfer/engine.py) ---------------------------
    def kv_connector_call(self, method: str, *args: object) -> list:
        """``Worker.kv_connector_call`` on every worker; each worker's result, in rank order."""
        raise NotImplementedError(f"{type(self).__name__} does not run KV connectors")

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        """Release workers and devices."""


class MultiWorkerExecutor(Executor):
    """Several workers that each run every call: ``tensor_parallel_size`` ranks per pipeline
    stage, global rank pp_rank * tp_size + tp_rank; the last stage's TP rank 0 returns samples.

    Subclasses supply ``_call(method, *args) -> [result of each rank]`` (processes, Ray actors).
    """

    @abstractmethod
    def _call(self, method: str, *args: object) -> list: ...

    def _pack(self, batch: ScheduledBatch) -> object:
        """How the batch travels to the workers: its StepDelta (called once per batch, in the
        order the workers run them)."""
        return self.encoder.encode(batch)

    def determine_num_blocks(self) -> tuple[int, int]:
        per_rank = self._call("determine_num_blocks")
        return min(d for d, _ in per_rank), min(h for _, h in per_rank)

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self._call("init_cache", num_device_blocks, num_host_blocks)

    @property
    def output_rank(self) -> int:
        """The rank whose reply carries the samples: TP rank 0 of the last stage."""
        p = self.config.parallel
        return (p.pipeline_parallel_size - 1) * p.tensor_parallel_size

    def execute(self, batch: ScheduledBatch) -> list[SeqOutput]:
        return self._call("execute_step", self._pack(batch))[self.output_rank] or []

    def add_lora(self, request: object) -> bool:
        return any(self._call("add_lora", request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._call("remove_lora", lora_int_id))

    def list_loras(self) -> set[int]:
        return set(self._call("list_loras")[0])

    def kv_connector_call(self, method: str, *args: object) -> list:
        return self._call("kv_connector_call", method, *args)

    def stage_timelines(self) -> list[list[tuple[float, float]]]:
        """Each rank's pipeline steps since the last call, (start, end) on the host's monotonic
        clock (benchmarks/pp_timeline.py)."""
        return self._call("stage_timeline")
