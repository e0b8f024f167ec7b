"""The OpenMP spin policy of a pagedllm process, set before torch loads libgomp.

Every op of a cpu step ends its OpenMP parallel region at a barrier; libgomp's threads then spin
(GOMP_SPINCOUNT iterations, 300,000 by default) before they sleep. On a machine whose cores are
shared with other processes (a server next to other jobs), the spinning threads take the time
slices the working ones need: benchmarks/thread_placement.py measured decode at 43 ms per token
with GOMP_SPINCOUNT=10000 against 82 ms with the default under two busy loops on the 2-core
machine of benchmarks/RESULTS.md, and the same 20.2 ms on the idle machine. vLLM's CPU docs tune
the same knob. libgomp reads the variable once, when it is loaded (``import torch``), so
``import pagedllm`` (pagedllm/__init__.py) and the ``pagedllm`` command (serve, generate,
bench) set it first, and the processes they start inherit it; a value the user set wins. Where
torch was imported before pagedllm, the engine runs its cpu worker in a process of its own with
the variable set (executor/worker_process.py), as the Python API's users cannot be asked to
mind their import order.
"""
from __future__ import annotations

import os
import sys

from pagedllm.executor.worker_process import (DEFAULT_SPINCOUNT, SPINCOUNT_ENV,
                                              WAIT_POLICY_ENV)

__all__ = ["DEFAULT_SPINCOUNT", "SPINCOUNT_ENV", "WAIT_POLICY_ENV", "set_spin_default"]


def set_spin_default() -> bool:
    """Set GOMP_SPINCOUNT to DEFAULT_SPINCOUNT where neither the user nor OMP_WAIT_POLICY chose
    a policy and torch (hence libgomp) is not loaded yet; True when it was set here."""
    if "torch" in sys.modules or SPINCOUNT_ENV in os.environ or WAIT_POLICY_ENV in os.environ:
        return False
    os.environ[SPINCOUNT_ENV] = DEFAULT_SPINCOUNT
    return True
