"""Picks the executor for a configuration (above the executors it builds, which import base.py;
multiproc and Ray are imported only when chosen)."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.contract.backend import Backend
from pagedllm.executor.base import Executor


def make_executor(config: EngineConfig, backend: Backend) -> Executor:
    kind = config.parallel.distributed_executor_backend
    if kind == "uni":
        from pagedllm.executor import worker_process

        if worker_process.run_apart(backend):  # libgomp's spin default here (worker_process.py)
            from pagedllm.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor(config, backend, launcher=worker_process.launch)
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, backend)
    if kind == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, backend)
    if kind == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, backend)
    raise ValueError(f"distributed_executor_backend={kind!r}: allowed values are uni, mp, ray")
