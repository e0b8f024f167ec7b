"""The remote half of a distributed executor: one rank's Worker (a tensor-parallel rank of a
pipeline stage).

The same object runs in a spawned process (``mp``) and as a Ray actor (``ray``); the executor
calls its methods by name. Order of start-up matters: the Worker picks its device first, then
the process group is created (so NCCL binds to that device), then one all-reduce checks the
group and creates the communicators before anything (e.g. CUDA-graph capture) relies on them.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.core.batch import ScheduledBatch, SeqOutput, StepDelta
from pagedllm.distributed.parallel_state import PPGroup, TPGroup

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """Everything one rank needs to start (pickled to the process or actor)."""

    config: EngineConfig
    backend: Backend
    rank: int
    world_size: int
    init_method: str  # tcp://HOST:PORT of rank 0's rendezvous store
    num_threads: int
    env: dict[str, str] = field(default_factory=dict)


def stage_groups(config: EngineConfig, rank: int) -> tuple[TPGroup, PPGroup]:
    """Global rank -> (its tensor-parallel group, its pipeline stage): ranks are
    pp_rank * tp_size + tp_rank, and TP rank t of a stage talks to TP rank t of its neighbours."""
    tp_size = config.parallel.tensor_parallel_size
    pp_size = config.parallel.pipeline_parallel_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    pp = PPGroup(rank=pp_rank, size=pp_size,
                 prev_rank=rank - tp_size if pp_rank > 0 else -1,
                 next_rank=rank + tp_size if pp_rank < pp_size - 1 else -1)
    # the TP group's process group: None (the world) without pipeline stages, else set once
    # the process group exists
    return TPGroup(rank=tp_rank, size=tp_size), pp


def init_process_group(dist_backend: str, init_method: str, rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; a "
                           "pagedllm worker needs a process of its own")
    dist.init_process_group(dist_backend, init_method=init_method, rank=rank,
                            world_size=world_size)


class WorkerWrapper:
    def __init__(self) -> None:
        self.worker: Any = None
        self.rank = -1

    def init_worker(self, spec: WorkerSpec) -> None:
        os.environ.update(spec.env)
        torch.set_num_threads(spec.num_threads)
        self.rank = spec.rank
        tp, pp = stage_groups(spec.config, spec.rank)
        stage = {"pp": pp} if pp.size > 1 else {}  # a plugin's Worker may predate the pp keyword
        worker = spec.backend.worker_cls()(spec.config, spec.backend, rank=spec.rank, tp=tp,
                                           **stage)
        init_process_group(spec.backend.dist_backend, spec.init_method, spec.rank, spec.world_size)
        if pp.size > 1 and tp.size > 1:  # every rank creates every stage's group, in one order
            import torch.distributed as dist

            for stage in range(pp.size):
                group = dist.new_group(ranks=list(range(stage * tp.size, (stage + 1) * tp.size)))
                if stage == pp.rank:
                    tp.group = group
        check = TPGroup(rank=spec.rank, size=spec.world_size).all_reduce(
            torch.ones(1, device=worker.device))
        if int(check.item()) != spec.world_size:
            raise RuntimeError(f"the {spec.backend.dist_backend} all-reduce check returned "
                               f"{check.item()} instead of {spec.world_size}")
        if pp.size > 1 and tp.size > 1:
            check = tp.all_reduce(torch.ones(1, device=worker.device))
            if int(check.item()) != tp.size:
                raise RuntimeError(f"the stage's tensor-parallel all-reduce returned "
                                   f"{check.item()} instead of {tp.size}")
        worker.load_model()
        self.worker = worker
        logger.debug("rank %d of %d (stage %d of %d, layers %s) ready on %s (%s, %d threads)",
                     spec.rank, spec.world_size, pp.rank, pp.size, worker.layer_range,
                     worker.device, spec.backend.dist_backend, spec.num_threads)

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_host_blocks)

    def execute(self, batch: ScheduledBatch) -> list[SeqOutput] | None:
        """The last stage's TP rank 0 returns the samples; the other ranks return None."""
        return self.worker.execute(batch)

    def execute_step(self, step: StepDelta) -> list[SeqOutput] | None:
        """A step as the change to the state this rank keeps (worker/seq_states.py)."""
        return self.worker.execute_step(step)

    def add_lora(self, request: Any) -> bool:
        return self.worker.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.worker.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.worker.list_loras()

    def kv_connector_call(self, method: str, *args: Any) -> Any:
        """KV connectors' / offload tiers' worker side (Worker.kv_connector_call)."""
        return self.worker.kv_connector_call(method, *args)

    def pid(self) -> int:
        return os.getpid()

    def stage_timeline(self, clear: bool = True) -> list[tuple[float, float]]:
        """This pipeline stage's recent steps, (start, end) on the host's monotonic clock."""
        runner = self.worker.runner
        spans = list(runner.busy)
        if clear:
            runner.busy.clear()
        return spans

    def close(self) -> None:
        import torch.distributed as dist

        self.worker = None
        if dist.is_initialized():
            dist.destroy_process_group()
