"""Helpers shared by the distributed executors: ports, thread counts, forwarded environment.

(The checks of a parallel layout are engine/config_validation.py's.)
"""
from __future__ import annotations

import os
import socket

from pagedllm import envs

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
