"""Helpers shared by the distributed executors: ports, thread counts, config checks."""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from pagedllm import envs

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.contract.backend import Backend

# environment variables a worker inherits from the driver even where its own environment is
# set up elsewhere (Ray actors): collective-library tuning and pagedllm's own switches
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_", "RCCL_",
                          "HIP_", "CUDA_LAUNCH_BLOCKING", "PAGEDLLM_", "HF_", "TOKENIZERS_")


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), if there is one."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (AttributeError, OSError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_num_threads(ranks_on_host: int, host_cpus: int | None = None) -> int:
    """Intra-op threads for one worker: ``PAGEDLLM_WORKER_THREADS``, else an even share of the
    host's CPUs (this host's unless given), so that N workers on one host do not oversubscribe
    it."""
    forced = envs.PAGEDLLM_WORKER_THREADS
    if forced is not None:
        return forced
    cpus = host_cpus if host_cpus is not None else available_cpus()
    return max(1, cpus // max(1, ranks_on_host))


def forwarded_env() -> dict[str, str]:
    """The driver's variables that workers should see (see FORWARDED_ENV_PREFIXES)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def verify_tensor_parallel(config: EngineConfig, backend: Backend, one_host: bool) -> None:
    """Reject a tensor_parallel_size the model or the host cannot be split over, before any
    worker starts (the layers would raise too, but from inside every worker process)."""
    n = config.parallel.tensor_parallel_size
    model = config.model
    heads, kv_heads = model.get_num_heads(), model.get_num_kv_heads()
    if heads % n != 0:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                         f"num_attention_heads={heads}; choose a divisor of {heads}")
    if kv_heads >= n and kv_heads % n != 0:
        raise ValueError(f"tensor_parallel_size={n} does not divide the model's "
                         f"num_key_value_heads={kv_heads}; choose a divisor of {kv_heads} "
                         f"(or a multiple of it, up to {heads}, to replicate the KV heads)")
    if kv_heads < n and n % kv_heads != 0:
        raise ValueError(f"tensor_parallel_size={n} is larger than the model's "
                         f"num_key_value_heads={kv_heads} but not a multiple of it; KV heads "
                         f"can only be replicated evenly")
    # several ranks may share one device only with gloo (the CPU); NCCL-like libraries refuse
    if one_host and backend.dist_backend != "gloo":
        pp = getattr(config.parallel, "pipeline_parallel_size", 1)
        count = backend.device_count()
        if count < n * pp:
            what = (f"tensor_parallel_size={n}" if pp == 1 else
                    f"tensor_parallel_size={n} x pipeline_parallel_size={pp}")
            raise ValueError(f"{what} needs {n * pp} {backend.name} devices on this "
                             f"host but {count} are visible; lower tensor_parallel_size or use "
                             f"distributed_executor_backend='ray' across several hosts")


def verify_pipeline_parallel(config: EngineConfig, backend: Backend) -> None:
    """Reject pipeline_parallel_size > 1 on a backend that does not declare it, or a split the
    model cannot take, before any worker starts."""
    from pagedllm.models.layers.pipeline import partition_layers

    pp = config.parallel.pipeline_parallel_size
    if pp == 1:
        return
    if not backend.capabilities.pipeline_parallel:
        from pagedllm.contract.registry import discover

        able = [i.name for i in discover().values()
                if getattr(i, "cls", None) is not None and i.cls.capabilities.pipeline_parallel]
        raise ValueError(f"pipeline_parallel_size={pp}: the {backend.name} backend does not "
                         f"support pipeline parallelism (Capabilities.pipeline_parallel); "
                         f"backends that do: {', '.join(able) or 'none installed'}; or use "
                         f"pipeline_parallel_size=1")
    from pagedllm.models.registry import model_class, resolve_architecture

    arch = resolve_architecture(config.model.hf_config)
    if not hasattr(model_class(arch), "make_empty_intermediate_tensors"):
        raise ValueError(f"pipeline_parallel_size={pp}: {arch} does not run as pipeline stages "
                         f"yet (its model builds its layers without models/layers/pipeline.py's "
                         f"make_layers); use pipeline_parallel_size=1")
    partition_layers(config.model.get_num_layers(), pp,
                     config.parallel.pp_layer_partition)  # raises naming the problem
