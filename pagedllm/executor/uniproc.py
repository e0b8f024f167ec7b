"""One worker in the engine's own process (tensor_parallel_size == 1)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput
from pagedllm.executor.base import Executor

if TYPE_CHECKING:
    from pagedllm.worker.pending import PendingOutputs


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        super().__init__(config, backend)
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the 'uni' executor runs tensor_parallel_size=1 only; use 'mp' or 'ray'")
        self.worker = backend.worker_cls()(config, backend)
        self.worker.load_model()

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_host_blocks)

    supports_async = True

    def execute(self, batch: ScheduledBatch) -> list[SeqOutput]:
        return self.worker.execute_step(self.encoder.encode(batch)) or []

    def execute_async(self, batch: ScheduledBatch) -> PendingOutputs:
        return self.worker.execute_step_async(self.encoder.encode(batch))

    def add_lora(self, request: object) -> bool:
        return self.worker.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.worker.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.worker.list_loras())

    def kv_connector_call(self, method: str, *args: object) -> list:
        return [self.worker.kv_connector_call(method, *args)]

    def shutdown(self) -> None:
        self.worker.release()
